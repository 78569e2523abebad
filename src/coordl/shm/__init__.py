"""Shared-memory primitives: names, segments, locks and the reaper.

Every piece of state coordl shares between processes is a file in the shm
directory (``/dev/shm``, or ``COORDL_SHM_DIR``) named by :func:`names.segment_name`
as ``coordl.<fingerprint>.<kind>[.<id>]``; ``ls /dev/shm/coordl.*`` shows all of it.

- :mod:`.names` builds and parses those names and lists every kind.
- :mod:`.own` creates every file exclusively (``O_EXCL``, mode 0600) and opens one only if it is
  this user's own private file (``O_NOFOLLOW``, then ``fstat``): what another user made at one of
  the names is never read, written, followed or removed (:class:`~.own.ForeignFileError`).
- :mod:`.segment` reserves a segment's space with ``posix_fallocate`` before anything is
  written, and maps it.
- :mod:`.group` is the membership of one fingerprint's segments: every user holds a
  shared ``flock`` on the group's lock file, so the kernel knows who is alive; the
  last one out removes the group.
- :mod:`.reaper` removes groups that no live process uses.
- :mod:`.limits` reads the memory limits (cgroups, the machine) that shared memory counts
  against, and how much room each leaves.

Nothing here imports the rest of coordl but :mod:`coordl.cgroups` (which imports nothing of
coordl): where this process's cgroups are, for :mod:`.limits` (memory's) as for
:mod:`coordl.cpus` (the CPU quota).
"""
