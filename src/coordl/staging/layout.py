"""The binary layout of a staging area, declared once: its records, constants, slot states and sizes.

The ``stage`` file is a header (:data:`HEADER`), the group's configuration (JSON, at most
:data:`CONFIG_BYTES`), :data:`MAX_MEMBERS` member records (:data:`MEMBER`) and
:data:`MAX_SLOTS` slot records (:data:`SLOT`): :data:`CONTROL_BYTES` in all. The
``batches`` file is ``slots`` slots of ``stride`` bytes; a slot holds a batch's images,
then its labels and its sample ids (``int64``, ``batch_size`` of each): ``batch_size`` is the
group's staged batch (its unit), which members of any batch size cut their batches from. A
header is complete once its ``magic`` is set, which its creator does last.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os

import numpy as np

from coordl.errors import SharedMemoryError
from coordl.options import AUTO
from coordl.shm import segment

__all__ = [
    "CLAIMED",
    "CONFIG_BYTES",
    "CONTROL_BYTES",
    "DEFAULT_UNITS_PER_PASS",
    "DEFAULT_UNIT_MAX",
    "EMPTY",
    "ERROR",
    "HEADER",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_MEMBERS",
    "MAX_SLOTS",
    "MEMBER",
    "MIN_SLOTS",
    "READY",
    "SLOT",
    "TODO",
    "VERSION",
    "default_unit",
    "group_fingerprint",
    "image_bytes",
    "page_round",
    "records",
    "slot_stride",
    "slots_for",
]

log = logging.getLogger(__name__)

MAGIC = 0x31474154535A4443  # "CDZSTAG1"
VERSION = 2  # 2: staged units of the group's batch size, members of any batch size; detached members
MAX_MEMBERS = 64
MAX_SLOTS = 64
MIN_SLOTS = 4
AUTO_SLOTS, AUTO_BYTES = 16, 2 << 30  # HPGroup(staging="auto"): 16 slots, fewer if they would pass 2 GiB
# The default staged batch (HPGroup(stage_batch=None)) is at most DEFAULT_UNIT_MAX samples (unless the
# first member's batch is larger): every member's first batch waits for a whole staged batch, and a
# member of a smaller batch makes its share on a DALI pipeline of the staged batch's size. It is at
# most 1/DEFAULT_UNITS_PER_PASS of a pass: staged batches are what producers share, so a pass of a
# few would be made by a few producers while the others' cores wait, and the ring would hold
# passes, not batches.
DEFAULT_UNIT_MAX = 256
DEFAULT_UNITS_PER_PASS = 8
CONFIG_BYTES = 4096
HEADER_BYTES = 512

HEADER = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<i8"),
        ("slots", "<i8"),
        ("stride", "<i8"),  # bytes per slot, a multiple of the page size
        ("batch_size", "<i8"),  # samples per staged batch (the group's unit)
        ("nb", "<i8"),  # staged batches per pass
        ("epoch_offset", "<i8"),
        ("released", "<i8"),
        ("frontier", "<i8"),
        ("tokens", "<i8"),
        ("live_peak", "<i8"),  # most slots ever live at once
        ("make_pace", "<f8"),  # seconds the group's producers take per sample (recent average); 0: unknown
        ("config_len", "<i8"),
        ("ndim", "<i8"),
        ("shape", "<i8", (4,)),
        ("dtype", "S16"),
    ]
)
MEMBER = np.dtype(
    [
        ("state", "<i8"),  # 0 free, 1 attached
        ("pid", "<i8"),
        ("start", "<i8"),  # first batch of the passes it consumes; -1: not enrolled
        ("cursor", "<i8"),  # next batch it consumes
        ("held", "<u8"),  # bit s: a tensor of this member maps slot s
        ("iterating", "<i8"),
        ("idle_since", "<f8"),  # CLOCK_MONOTONIC, system-wide
        ("produced", "<i8"),
        ("consumed", "<i8"),
        ("detached", "<i8"),  # 1: it fell behind by the whole ring; it finishes its pass alone
        ("pace", "<f8"),  # its training's seconds per sample (median of its recent batches); 0: unknown
    ]
)
SLOT = np.dtype(
    [
        ("state", "<i8"),
        ("q", "<i8"),
        ("producer", "<i8"),
        ("token", "<i8"),
        ("n", "<i8"),  # samples in the batch
        ("claimed_at", "<f8"),
    ]
)
# A slot's states: EMPTY -> CLAIMED -> READY | ERROR -> EMPTY; TODO: its producer died or gave it back.
EMPTY, CLAIMED, READY, ERROR, TODO = 0, 1, 2, 3, 4
assert HEADER.itemsize <= HEADER_BYTES


def page_round(n: int) -> int:
    """``n`` bytes rounded up to a whole number of pages."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


CONTROL_BYTES = page_round(HEADER_BYTES + CONFIG_BYTES + MAX_MEMBERS * MEMBER.itemsize + MAX_SLOTS * SLOT.itemsize)


def group_fingerprint(name: str, rank: int) -> str:
    """The fingerprint of an HP group's files: per group name, user and rank."""
    return hashlib.sha256(f"hp-group:{name}:{os.getuid()}:{rank}".encode()).hexdigest()[:16]


def records(buf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the header, the member records and the slot records in a ``stage`` mapping."""
    header = np.ndarray((), HEADER, buf, 0)
    off = HEADER_BYTES + CONFIG_BYTES
    members = np.ndarray((MAX_MEMBERS,), MEMBER, buf, off)
    slots = np.ndarray((MAX_SLOTS,), SLOT, buf, off + MAX_MEMBERS * MEMBER.itemsize)
    return header, members, slots


def image_bytes(batch_size: int, sample_shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a batch's images: the start of its labels in a slot."""
    import torch  # for the dtype's size only

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return batch_size * int(np.prod(sample_shape, dtype=np.int64)) * itemsize


def slot_stride(batch_size: int, sample_shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one slot: the images, the labels and the ids, rounded up to whole pages."""
    return page_round(image_bytes(batch_size, sample_shape, dtype) + 16 * batch_size)


def slots_for(bound, stride: int, directory: str) -> int:
    """How many slots of ``stride`` bytes a new staging area has, for ``bound``
    (:attr:`HPGroup.staging <coordl.HPGroup.staging>`: ``"auto"`` or bytes).

    Raises:
        ValueError: ``bound`` holds fewer than :data:`MIN_SLOTS` slots.
        SharedMemoryError: ``directory`` has no room for :data:`MIN_SLOTS` slots.
    """
    free = segment.space(directory).free
    if bound == AUTO:
        slots = max(MIN_SLOTS, min(AUTO_SLOTS, AUTO_BYTES // stride))
    else:
        slots = int(bound) // stride
        if slots < MIN_SLOTS:
            raise ValueError(
                f"HPGroup(staging={bound!r}) holds {slots} batch(es) of {stride} bytes; "
                f"it must hold at least {MIN_SLOTS}"
            )
    slots = min(slots, MAX_SLOTS)
    if slots * stride > free // 2:
        fit = (free // 2) // stride
        if fit < MIN_SLOTS:
            raise SharedMemoryError(
                f"the hp_group staging area needs {MIN_SLOTS} batches of {stride} bytes but {directory} has only "
                f"{free} bytes free; enlarge it (docker run --shm-size) or use a smaller batch"
            )
        log.warning("coordl: staging %d batches instead of %d: %s has %d bytes free", fit, slots, directory, free)
        slots = fit
    return slots


def default_unit(
    batch_size: int, pass_samples: int, sample_shape: tuple[int, ...], dtype: str, bound, free: int
) -> int:
    """The staged batch of a group whose first member gives no ``HPGroup(stage_batch)``: its
    ``batch_size`` doubled while the double is at most :data:`DEFAULT_UNIT_MAX` samples and at most
    1/:data:`DEFAULT_UNITS_PER_PASS` of a pass (``pass_samples``), and the staging bound
    (``"auto"``: :data:`AUTO_BYTES`) and half of ``free`` (the shm folder's free bytes, of which
    :func:`slots_for` takes at most half) hold :data:`AUTO_SLOTS` slots of it.

    A member whose batch size divides the staged batch gets views of it, not copies: with a first
    member of a power-of-two batch size, every power-of-two batch size up to the result, whichever
    member comes first. The ring keeps the 16 slots of ``"auto"``, so producers work as far ahead,
    in staged batches, as with a staged batch of the first member's size.
    """
    budget = min(AUTO_BYTES if bound == AUTO else int(bound), free // 2)
    unit = batch_size
    while (
        2 * unit <= DEFAULT_UNIT_MAX
        and 2 * unit * DEFAULT_UNITS_PER_PASS <= pass_samples
        and AUTO_SLOTS * slot_stride(2 * unit, sample_shape, dtype) <= budget
    ):
        unit *= 2
    return unit
