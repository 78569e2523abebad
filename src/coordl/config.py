"""A loader's configuration as frozen, validated records, and the one identity of a configuration.

:func:`identity` says what decides which samples a step sees and how they are pre-processed
(dataset, pre-processing, batch size, order). Resume (``state_dict``'s ``config``), the HP
group's admission check and the configuration fingerprint all use it, so they cannot disagree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from coordl import env

__all__ = ["LoaderConfig", "TorchOptions", "fingerprint", "identity"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class LoaderConfig:
    """The settings every pass of a loader shares (see :class:`~coordl.CoordLoader`'s arguments)."""

    batch_size: int
    shuffle: bool = False
    drop_last: bool = False
    seed: int = 0
    on_error: str = "raise"
    return_index: bool = False
    log_epochs: bool = False
    batches_ahead: int = 2  # the DALI backend's look-ahead (Fetch.batches_ahead)

    def __post_init__(self):
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if not _is_int(self.seed):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        object.__setattr__(self, "drop_last", bool(self.drop_last))
        object.__setattr__(self, "log_epochs", bool(self.log_epochs) or env.flag("COORDL_LOG_EPOCHS"))


@dataclass(frozen=True)
class TorchOptions:
    """``DataLoader``'s own arguments, for the torch backend."""

    num_workers: int = 0
    pin_memory: bool = False
    collate_fn: object = None
    worker_init_fn: object = None
    timeout: float = 0
    multiprocessing_context: object = None
    generator: object = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory_device: str = ""

    def __post_init__(self):
        if not _is_int(self.num_workers) or self.num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative int, got {self.num_workers!r}")

    def given(self) -> list[str]:
        """The arguments set to something other than their default that only the torch backend
        uses (``pin_memory`` is accepted with DALI, whose outputs are on their device already)."""
        return [k for k, v in self.__dict__.items() if k != "pin_memory" and v not in (None, 0, False, "")]


def identity(
    *,
    dataset: str,
    prep: str,
    batch_size: int,
    drop_last: bool,
    shard_drop_last: bool,
    shuffle: bool,
    seed: int,
    order: int,
) -> dict:
    """What identifies a configuration: two loaders with the same identity deliver the same samples
    in the same batches, pre-processed alike.

    Args:
        order: the version of the epoch order's algorithm (:data:`coordl.sampler.ORDER_VERSION`).
    """
    return {
        "dataset": dataset,
        "prep": prep,
        "batch_size": batch_size,
        "drop_last": drop_last,
        "shard_drop_last": shard_drop_last,
        "shuffle": shuffle,
        "seed": seed,
        "order": order,
    }


def fingerprint(ident: dict) -> str:
    """A short, stable hash of an :func:`identity`."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
