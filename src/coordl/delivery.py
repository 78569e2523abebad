"""What the training loop receives for a batch of the DALI backend: ``(images, labels)`` of a
dataset of classes, ``(images, targets)`` of a detection dataset (:mod:`coordl.detection.targets`),
laid out by ``collate_fn`` when the loader has one, with the samples' positions in the index appended
when ``return_index``.

Every pass of the DALI backend (its own, an HP group's, remote prep's) delivers through one
:class:`Delivery`, so the shape of a batch does not depend on where it was prepared. A detection
batch's boxes are computed here from its sample ids and the epoch whose draws its pixels were made
with, by the same pure function that planned the pixels' crop windows and flips.
"""

from __future__ import annotations

import torch

__all__ = ["Delivery", "with_ids"]


class Delivery:
    """Shapes a prepared batch for the training loop.

    Args:
        recipe: the loader's DALI recipe.
        boxes: the index's boxes (a detection dataset), or None.
        seed: the loader's seed (it keys the recipes' draws, which their targets may depend on).
        return_index: append the samples' ids.
        collate_fn: called with the batch's samples as ``DataLoader`` calls it, a list of
            ``(image, label)`` or ``(image, target)`` pairs (each image a view of the batch's
            tensor); what it returns is delivered. None: the default layout.
    """

    def __init__(self, recipe, boxes, seed: int, *, return_index: bool = False, collate_fn=None):
        self.recipe = recipe
        self.boxes = boxes
        self.seed = seed
        self.return_index = return_index
        self.collate_fn = collate_fn

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, order_epoch: int):
        """The batch of ``images`` (made with the draws of ``order_epoch``), ``labels`` and ``ids``
        (int64 tensors on the CPU), as the training loop receives it."""
        targets = self.recipe.targets(
            labels, ids, boxes=self.boxes, seed=self.seed, epoch=order_epoch, device=images.device
        )
        out = (images, targets)
        if self.collate_fn is not None:
            out = self.collate_fn(list(zip(images, targets, strict=True)))
        return with_ids(out, ids) if self.return_index else out


def with_ids(batch, ids: torch.Tensor):
    """A batch with the samples' index positions appended (``return_index=True``)."""
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        return (*batch, ids)
    if isinstance(batch, list):
        return [*batch, ids]
    return batch, ids
