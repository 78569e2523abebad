"""Records what a loader delivers, image by ``(epoch, sample)``, for the resume tests."""

from __future__ import annotations

import torch


def take(loader, out: dict, epoch: int, limit: int | None = None) -> list[int]:
    """Iterates ``loader`` (at most ``limit`` batches, then ``break``), recording every image by
    ``(epoch, sample)`` in ``out``; returns the samples in delivery order. A sample delivered
    twice in an epoch (padding) must be the same image both times."""
    got = []
    if limit == 0:
        return got
    for k, (x, _, ids) in enumerate(loader):
        for image, i in zip(x, ids.tolist(), strict=True):
            previous = out.setdefault((epoch, i), image.clone())
            assert torch.equal(previous, image), f"sample {i} of epoch {epoch} delivered twice, differently"
            got.append(i)
        if limit is not None and k + 1 == limit:
            break
    return got
