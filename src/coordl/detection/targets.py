"""A delivered batch's detection targets, as torchvision's detection models take them: one dict per
sample from the flat arrays of its delivered boxes (a detection recipe computes those arrays:
:meth:`coordl.prep.ssd.SSDTrain.targets`)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["targets"]


def targets(xyxy: np.ndarray, labels: np.ndarray, counts: np.ndarray, image_ids, device=None) -> list[dict]:
    """One ``{"boxes", "labels", "image_id"}`` per sample: ``boxes`` float32 ``(N, 4)`` (``x1, y1,
    x2, y2`` in pixels of the delivered image), ``labels`` int64 ``(N,)``, both on ``device`` (moved
    there in one copy), and the image's id in its annotations (an int).

    Args:
        xyxy, labels: every sample's delivered boxes and their classes, sample after sample.
        counts: each sample's number of boxes.
        image_ids: each sample's image id.
    """
    xyxy_t, labels_t = torch.from_numpy(np.ascontiguousarray(xyxy)), torch.from_numpy(np.ascontiguousarray(labels))
    if device is not None and torch.device(device).type != "cpu":
        xyxy_t, labels_t = xyxy_t.to(device, non_blocking=False), labels_t.to(device, non_blocking=False)
    split = np.asarray(counts).tolist()
    return [
        {"boxes": b, "labels": c, "image_id": i}
        for b, c, i in zip(torch.split(xyxy_t, split), torch.split(labels_t, split), list(image_ids), strict=True)
    ]
