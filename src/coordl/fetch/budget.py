"""How big a cache may be: the budget from what the user asks, /dev/shm's free space and the memory limit.

:func:`resolve_budget` plans; :class:`~coordl.fetch.cache.NodeCache` carries the plan out and
checks the same two limits again as it fills, since other processes use memory meanwhile.
"""

from __future__ import annotations

import logging

from coordl.errors import SharedMemoryError, warn
from coordl.fetch.cache import table_bytes
from coordl.fetch.chunks import headroom, memory_text
from coordl.options import AUTO
from coordl.shm import limits, segment
from coordl.units import format_bytes, parse_bytes

__all__ = ["resolve_budget"]

log = logging.getLogger(__name__)


def resolve_budget(request, dataset_bytes: int, directory: str, num_items: int | None = None) -> int:
    """Turns a cache budget as the user gives it into bytes, checked against free space and memory.

    Args:
        request: ``"auto"`` (default: half of the shm space free beyond :func:`headroom`,
            at most the dataset and the room the memory limit leaves), bytes as an ``int``, a
            string like ``"40GB"`` or ``"512MiB"``, or a ``float`` in (0, 1] for a fraction of the
            dataset. ``0`` disables the cache.
        dataset_bytes: total bytes of the dataset's files.
        directory: the shm directory.
        num_items: samples in the dataset; their table's space is kept out of the budget.

    Returns:
        The budget in bytes, never more than the dataset, the free space beyond the headroom,
        or the room the tightest memory limit (:func:`~coordl.shm.limits.tightest`) leaves beyond
        its margin (:attr:`~coordl.shm.limits.Level.room`).
        A larger explicit request is shrunk with a warning; ``"auto"`` logs a warning when the
        memory limit leaves room for less than it would take otherwise.
    """
    auto = request == AUTO
    wanted = dataset_bytes if auto else parse_bytes(request, dataset_bytes)
    if wanted == 0:
        return 0
    try:
        space = segment.space(directory)
    except FileNotFoundError:
        raise SharedMemoryError(
            f"the shared-memory directory {directory} does not exist; mount a tmpfs there "
            "or point COORDL_SHM_DIR at one, or pass cache=0 to run without a cache"
        ) from None
    table = table_bytes(num_items) if num_items is not None else 0
    usable = max(0, space.free - headroom(space.total) - table)
    level = limits.tightest()  # None where no limit can be read: then only the shm space bounds it
    room = level.room if level is not None else wanted
    if auto:
        budget = min(dataset_bytes, usable // 2)
        if room < budget:
            if room == 0:
                log.warning(
                    "coordl: no room for a cache within %s; reading every sample from storage", memory_text(level)
                )
            else:
                log.warning(
                    "coordl: cache budget of %s for a dataset of %s: all that %s leaves; raise the limit to cache more",
                    format_bytes(room),
                    format_bytes(dataset_bytes),
                    memory_text(level),
                )
            return room
        if budget == 0:
            log.warning("coordl: no room for a cache in %s; reading every sample from storage", directory)
        return budget
    wanted = min(wanted, dataset_bytes)
    if room < min(wanted, usable):
        warn(
            f"coordl: cache budget of {format_bytes(wanted)} does not fit in {memory_text(level)}; "
            f"using {format_bytes(room)}. Raise the memory limit (docker run --memory, the pod's "
            "resources.limits.memory, Slurm's --mem) or ask for less.",
        )
        wanted = room
    elif wanted > usable:
        warn(
            f"coordl: cache budget of {format_bytes(wanted)} does not fit in {directory} "
            f"({format_bytes(space.free)} free of {format_bytes(space.total)}, "
            f"{format_bytes(headroom(space.total))} kept free for other shared memory); "
            f"using {format_bytes(usable)}. Enlarge {directory} "
            "(docker run --shm-size, a Kubernetes emptyDir with medium: Memory) or ask for less.",
        )
        wanted = usable
    return wanted
