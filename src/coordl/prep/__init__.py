"""Decoding and augmentation: from raw encoded bytes to batches of tensors.

- :mod:`.recipes` says *what* to do (the ImageNet training and validation recipes
  as plain, validated configuration, or a user's own function of DALI ops).
- :mod:`.dali` does it with an NVIDIA DALI pipeline fed by ``fn.external_source``
  (CPU with ``device_id=None``, the ``mixed`` decoder and GPU ops otherwise). It is
  the only module that imports ``nvidia.dali``.
"""
