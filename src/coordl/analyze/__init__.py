"""DS-Analyzer: measures where training time goes and predicts what more resources buy.

``coordl analyze -- python train.py ...`` runs an unchanged training script that uses
:class:`~coordl.CoordLoader` in the phases of the CoorDL paper (section 4.2 and 5): ingestion
rate G, prep rate P (and training on cached data R), storage and cache read rates S and C,
and a cold-cache fetch run. :mod:`coordl.analyze.model` turns them into a stall split and
what-if predictions; :mod:`coordl.analyze.report` prints, saves and plots them.
"""
