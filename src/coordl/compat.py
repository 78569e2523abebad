"""Every use coordl makes of PyTorch's and DALI's private internals, in one place.

Each is something the libraries do not offer publicly and coordl cannot do without; each is
checked against the installed libraries by ``tests/test_compat.py``, so that an upgrade that
removes or changes one fails there, loudly, rather than somewhere in a training run. When one of
them is missing, the functions here raise :class:`CompatError` naming it and the version.
"""

from __future__ import annotations

import ctypes

from coordl.errors import CoordlError

__all__ = [
    "CompatError",
    "abandon_pipeline",
    "pin_memory",
    "pipeline_schemas",
    "shutdown_dataloader_workers",
    "shutdown_iterator_workers",
]


class CompatError(CoordlError):
    """An installed PyTorch or DALI lacks an internal coordl relies on (the message names it)."""


def _missing(library: str, what: str) -> CompatError:
    if library == "torch":
        import torch

        version = torch.__version__
    else:
        import nvidia.dali

        version = nvidia.dali.__version__
    return CompatError(
        f"{library} {version} has no {what}, which coordl uses (coordl/compat.py): this version of coordl does not "
        f"support this {library}; install the versions coordl's requirements name, or a newer coordl"
    )


# -- PyTorch ------------------------------------------------------------------------------------


def shutdown_iterator_workers(iterator) -> None:
    """Stops the worker processes of a ``DataLoader`` iterator now (``_shutdown_workers``): a pass
    abandoned mid-epoch ends its workers as ``DataLoader`` would when the iterator is collected,
    without waiting for the collector. An iterator without workers has nothing to stop."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

        if isinstance(iterator, _MultiProcessingDataLoaderIter):
            raise _missing("torch", "_MultiProcessingDataLoaderIter._shutdown_workers")
        return
    shutdown()


def shutdown_dataloader_workers(dataloader) -> None:
    """Stops a ``DataLoader``'s persistent workers (the iterator it keeps, ``_iterator``)."""
    if not hasattr(dataloader, "_iterator"):
        raise _missing("torch", "DataLoader._iterator")
    if dataloader._iterator is not None:
        shutdown_iterator_workers(dataloader._iterator)


def pin_memory(batch, device=None):
    """``batch`` pinned as ``DataLoader``'s pinning thread pins a batch (its nested structures,
    namedtuples and custom types with a ``pin_memory`` method included)."""
    try:
        from torch.utils.data._utils.pin_memory import pin_memory as pin
    except ImportError:
        raise _missing("torch", "torch.utils.data._utils.pin_memory.pin_memory") from None
    return pin(batch, device)


# -- DALI ---------------------------------------------------------------------------------------


def pipeline_schemas(pipe) -> list[str]:
    """The schema names of the operators of a built DALI pipeline (``Pipeline._ops``): DALI has no
    public list of what a graph holds."""
    ops = getattr(pipe, "_ops", None)
    if ops is None:
        raise _missing("nvidia-dali", "Pipeline._ops")
    names = []
    for op in ops:
        if not hasattr(op, "_op"):
            raise _missing("nvidia-dali", "the operator instances' _op")
        name = getattr(op._op, "schema_name", None)  # None for operators run in Python (external_source)
        if name is not None:
            names.append(name)
    return names


def abandon_pipeline(pipe) -> None:
    """In a forked child, lets go of a pipeline the parent built without shutting it down.

    Its native handle (``Pipeline._pipe``) belongs to threads that do not exist in the child, and
    shutting it down (when the child exits, or at collection) raises in C++ and aborts the child.
    So the handle gets one reference more, never given back, and the Python object forgets it.
    """
    if not hasattr(pipe, "_pipe"):
        raise _missing("nvidia-dali", "Pipeline._pipe")
    handle = pipe._pipe
    if handle is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))  # never freed in the child
        pipe._pipe = None
