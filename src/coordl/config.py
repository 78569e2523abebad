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

__all__ = ["GroupOptions", "LoaderConfig", "PeerOptions", "TorchOptions", "fingerprint", "identity"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class LoaderConfig:
    """The settings every pass of a loader shares (see :class:`~coordl.CoordLoader`'s arguments)."""

    batch_size: int
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0
    on_error: str = "raise"
    return_index: bool = False
    io_threads: int = 8
    prefetch_batches: int = 2
    log_epochs: bool = False

    def __post_init__(self):
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.io_threads < 1 or self.prefetch_batches < 1:
            raise ValueError("io_threads and prefetch_batches must be at least 1")
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        object.__setattr__(self, "drop_last", bool(self.drop_last))
        log = bool(self.log_epochs) or env.flag("COORDL_LOG_EPOCHS")
        object.__setattr__(self, "log_epochs", log)


@dataclass(frozen=True)
class GroupOptions:
    """Coordinated prep: the ``hp_group`` name and its staging area's bound and idle timeout."""

    name: str
    staging: int | str = "auto"
    idle_timeout: float = 60.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"hp_group must be a non-empty string, got {self.name!r}")
        if self.idle_timeout <= 0:
            raise ValueError(f"hp_idle_timeout must be positive, got {self.idle_timeout!r}")


@dataclass(frozen=True)
class PeerOptions:
    """The partitioned cache: on (``True``), off or ``"auto"``, and its network settings."""

    mode: bool | str = "auto"
    locality_aware: bool = True
    timeout: float = 10.0
    retry_after: float = 60.0
    interface: str | None = None
    port: int | None = None
    linger: float | None = None  # None: 3 * timeout

    def __post_init__(self):
        if self.mode not in ("auto", True, False):
            raise ValueError(f"peers must be 'auto', True or False, got {self.mode!r}")
        if self.timeout <= 0 or self.retry_after < 0:
            raise ValueError("peer_timeout must be positive and peer_retry_after non-negative")
        if self.linger is not None and not self.linger >= 0:
            raise ValueError(f"peer_linger must be non-negative (or None: 3 x peer_timeout), got {self.linger!r}")


@dataclass(frozen=True)
class TorchOptions:
    """``DataLoader``'s own arguments, for the torch backend."""

    num_workers: int = 0
    pin_memory: bool = False
    collate_fn: object = None
    worker_init_fn: object = None
    timeout: float = 0
    multiprocessing_context: object = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory_device: str = ""

    def given(self) -> list[str]:
        """The torch-only arguments set to something other than their default."""
        skip = ("num_workers", "pin_memory")  # DataLoader scripts pass both; with DALI they change nothing
        return [k for k, v in self.__dict__.items() if k not in skip and v not in (None, 0, False, "")]


def identity(*, dataset: str, prep: str, batch_size: int, drop_last: bool, shuffle: bool, seed: int) -> dict:
    """What identifies a configuration: two loaders with the same identity deliver the same samples
    in the same batches, pre-processed alike."""
    return {
        "dataset": dataset,
        "prep": prep,
        "batch_size": batch_size,
        "drop_last": drop_last,
        "shuffle": shuffle,
        "seed": seed,
    }


def fingerprint(ident: dict) -> str:
    """A short, stable hash of an :func:`identity`."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
