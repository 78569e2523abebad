"""The node's cache tiers: how its budget is split between encoded bytes and decoded images.

- :mod:`~coordl.tiers.model`: pure: the predicted samples/s of a split, from measured rates.
- :mod:`~coordl.tiers.plan`: the split a loader attaches to: what the user asked for, the tiers
  another job made on the node, or (``Cache(decoded="auto")``) rates measured on a few samples
  (:mod:`coordl.prep.calibrate`) and the model.
"""
