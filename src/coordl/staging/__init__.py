"""Coordinated prep: the staging area an HP group shares, and a member's pass over it.

:mod:`~coordl.staging.member` runs a loader's part in the group (its producer threads) and
:mod:`~coordl.staging.grouppass` its passes (batches of its own size cut from the staged ones,
or made alone once the group detached it), on a :class:`~coordl.staging.area.StagingArea`,
this process's attachment to the group's shared ring of ready batches. The area is built from five parts, used only
through their public names and imported one way: ``area`` imports them; ``holds`` and
``liveness`` import ``ring``; ``ring`` and ``files`` import ``layout``:

- :mod:`~coordl.staging.layout`: the binary layout of the shared records and the
  sizing of slots, declared once;
- :mod:`~coordl.staging.files`: the ``stage`` and ``batches`` files, made by the first
  member, checked and mapped by the others;
- :mod:`~coordl.staging.ring`: the ring protocol over the records (claim, publish,
  lazy release), under the group's ``flock`` mutex;
- :mod:`~coordl.staging.holds`: the slots this member's tensors still map;
- :mod:`~coordl.staging.liveness`: who is alive (a member ``flock`` each), reaping the
  dead and dropping the idle.
"""
