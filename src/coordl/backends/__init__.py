"""The two ways a loader pre-processes: passes built on :class:`coordl.passes.Pass`.

- :mod:`.dali` decodes and augments with an NVIDIA DALI pipeline (a folder, a list of files
  or an index), fed by a driver thread from the fetcher's look-ahead.
- :mod:`.torch` runs a dataset of :mod:`coordl.datasets` on PyTorch ``DataLoader`` workers
  that read through the node's cache and apply the dataset's Python transforms.

An HP group member's pass is in :mod:`coordl.staging.member`; DS-Analyzer's phases in
:mod:`coordl.analyze.probe`.
"""
