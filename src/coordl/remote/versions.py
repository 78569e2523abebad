"""What the trainer and its actors must agree on for the actors' batches to be the trainer's own.

The bit-for-bit promise of ``RayPrep`` rests on the same code on both sides: coordl (the
recipes, the draws of each sample), the epoch order's algorithm (:data:`coordl.sampler.ORDER_VERSION`),
NumPy, and the library that prepares the batches: DALI for the DALI backend, PyTorch for the
torch backend (its generators draw a transform's randomness). The trainer puts its
:func:`versions` in the actors' job; each actor compares them with its own before it takes a
unit, and refuses to start on a difference (:func:`check`).
"""

from __future__ import annotations

import sys

from coordl.errors import CoordlError

__all__ = ["VersionMismatch", "check", "versions"]


class VersionMismatch(CoordlError):
    """An actor's machine runs other versions than the trainer's (the message names both sides)."""


def versions(backend: str) -> dict[str, str]:
    """This process's versions of what a ``backend`` (``"dali"`` or ``"torch"``) actor's batches depend on."""
    import numpy

    from coordl.sampler import ORDER_VERSION

    # The package's __init__ holds the version and imports (through the loader) this module: read
    # from the package, which Python imported before any of its modules, not imported again.
    coordl = sys.modules["coordl"]
    out = {"coordl": coordl.__version__, "numpy": numpy.__version__, "ORDER_VERSION": str(ORDER_VERSION)}
    if backend == "dali":
        import nvidia.dali

        out["nvidia-dali"] = nvidia.dali.__version__
    else:
        import torch

        out["torch"] = torch.__version__
    return out


def check(trainer: dict[str, str], backend: str, where: str) -> None:
    """Raises :class:`VersionMismatch` when this process (an actor on ``where``) runs other
    versions than ``trainer``'s."""
    mine = versions(backend)
    differ = [name for name in trainer if mine.get(name) != trainer[name]]
    if differ:
        sides = ", ".join(f"{name} {trainer[name]} on the trainer, {mine.get(name)} on {where}" for name in differ)
        raise VersionMismatch(
            f"coordl: a RayPrep actor on {where} runs other versions than the trainer ({sides}): its batches "
            "would not be the trainer's own, so it does not start. Install the trainer's versions on every "
            "machine of the Ray cluster (pip install 'coordl[ray]==<version>' ...); see docs/remote-prep.md"
        )
