"""A delivered batch's detection targets, from its sample ids: the boxes an SSD recipe's pixels
carry, as torchvision's detection models take them."""

from __future__ import annotations

import numpy as np
import torch

from coordl.detection import crops
from coordl.detection.boxes import Boxes
from coordl.prep.recipes import SSDTrain

__all__ = ["targets"]


def targets(recipe, boxes: Boxes, seed: int, epoch: int, ids: np.ndarray, device=None) -> list[dict]:
    """One ``{"boxes", "labels", "image_id"}`` per sample of ``ids`` delivered with ``recipe``'s
    pixels in ``epoch``: ``boxes`` float32 ``(N, 4)`` (``x1, y1, x2, y2`` in pixels of the delivered
    image), ``labels`` int64 ``(N,)``, both on ``device`` (moved there in one copy), and the image's
    id in its annotations (an int)."""
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(recipe, SSDTrain):
        p = crops.plan(recipe, boxes, seed, epoch, ids)
        xyxy, labels, counts = p.xyxy, p.labels, p.counts
    else:
        xyxy, labels, counts = crops.val_targets(recipe, boxes, ids)
    xyxy_t, labels_t = torch.from_numpy(np.ascontiguousarray(xyxy)), torch.from_numpy(np.ascontiguousarray(labels))
    if device is not None and torch.device(device).type != "cpu":
        xyxy_t, labels_t = xyxy_t.to(device, non_blocking=False), labels_t.to(device, non_blocking=False)
    split = counts.tolist()
    image_ids = boxes.image_ids[ids].tolist()
    return [
        {"boxes": b, "labels": c, "image_id": i}
        for b, c, i in zip(torch.split(xyxy_t, split), torch.split(labels_t, split), image_ids, strict=True)
    ]
