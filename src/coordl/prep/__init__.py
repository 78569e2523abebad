"""Decoding and augmentation: from raw encoded bytes to batches of tensors.

- :mod:`.protocol` says what a recipe answers (:class:`~.protocol.Recipe`: its decoder, its
  augmentation, its checks, its output, its targets, its key), each with a default; it is the
  one module that asks which kind of recipe it holds. :mod:`.recipes` names the built-in ones and
  resolves ``pipeline=``; each kind is a module of its own: :mod:`.imagenet`, :mod:`.ssd`,
  :mod:`.waveforms`, :mod:`.custom` (:class:`~.custom.DecodedRecipe`), with the shared field checks
  in :mod:`.fields` and the decoders' settings in :mod:`.decoders`.
- :mod:`.graph` holds DALI's operators the recipes compose, and the graph of a batch that mixes
  encoded and decoded samples, written against the protocol; :mod:`.planned` the per-sample
  random numbers (``ctx.random``); :mod:`.windows` the training crop's windows in numpy;
  :mod:`.checks` the pure checks of decoded samples.
- :mod:`.dali` runs a recipe as an NVIDIA DALI pipeline fed by ``fn.external_source`` (CPU with
  ``device_id=None``, the ``mixed`` decoder and GPU ops otherwise). With :mod:`.graph` and
  :mod:`.planned`, the only modules that import ``nvidia.dali``; the recipes import
  :mod:`.graph` when a pipeline is built.
"""
