"""Box arithmetic for the detection example: IoU, SSD's matching and offsets, decoding and NMS.

Boxes are ``(x1, y1, x2, y2)`` in pixels unless a name says ``cxcywh``. The offsets are SSD's
(Liu et al., "SSD: Single Shot MultiBox Detector", eq. 2) with the variances of the paper's
Caffe code and of NVIDIA's SSD300 v1.1: 0.1 for the centre, 0.2 for the width and height, so
that an offset of 1 moves a box by a tenth of its default box's size.
"""

from __future__ import annotations

import torch

__all__ = ["VARIANCES", "box_iou", "decode", "encode", "match", "nms", "to_cxcywh", "to_xyxy"]

VARIANCES = (0.1, 0.2)  # centre, size


def to_cxcywh(boxes: torch.Tensor) -> torch.Tensor:
    return torch.cat(((boxes[..., :2] + boxes[..., 2:]) / 2, boxes[..., 2:] - boxes[..., :2]), -1)


def to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    return torch.cat((boxes[..., :2] - boxes[..., 2:] / 2, boxes[..., :2] + boxes[..., 2:] / 2), -1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, M) intersection over union of the boxes ``a`` (N, 4) and ``b`` (M, 4)."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    top_left = torch.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter).clamp(min=1e-9)


def match(defaults: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, threshold: float = 0.5):
    """SSD's matching: the ground-truth box and class each default box is trained towards.

    A default box takes the ground-truth box it overlaps most if their IoU is at least
    ``threshold``; and every ground-truth box takes the default box that overlaps it most, so
    that none is left without a positive (NVIDIA's SSD300 ``Encoder.encode``).

    Args:
        defaults: (D, 4) default boxes, xyxy.
        boxes: (N, 4) ground-truth boxes, xyxy; N may be 0.
        labels: (N,) their class indices, 1..C.

    Returns:
        ``(matched, classes)``: (D, 4) the box each default box regresses to (its own where it
        is background) and (D,) its class, 0 for background.
    """
    classes = torch.zeros(len(defaults), dtype=torch.int64, device=defaults.device)
    if len(boxes) == 0:
        return defaults.clone(), classes
    iou = box_iou(boxes, defaults)  # (N, D)
    best_iou, best_box = iou.max(0)  # for each default box, its best ground truth
    best_default = iou.argmax(1)  # for each ground truth, its best default box
    best_iou[best_default] = 2.0  # always a positive, whatever its IoU
    best_box[best_default] = torch.arange(len(boxes), device=boxes.device)
    positive = best_iou >= threshold
    classes[positive] = labels[best_box[positive]]
    matched = torch.where(positive[:, None], boxes[best_box], defaults)
    return matched, classes


def encode(matched: torch.Tensor, defaults: torch.Tensor) -> torch.Tensor:
    """The offsets (..., D, 4) that turn the default boxes into ``matched`` (both xyxy)."""
    g, d = to_cxcywh(matched), to_cxcywh(defaults)
    centre = (g[..., :2] - d[..., :2]) / (d[..., 2:] * VARIANCES[0])
    size = torch.log(g[..., 2:].clamp(min=1e-6) / d[..., 2:]) / VARIANCES[1]
    return torch.cat((centre, size), -1)


def decode(offsets: torch.Tensor, defaults: torch.Tensor) -> torch.Tensor:
    """The boxes (..., D, 4), xyxy, that ``offsets`` make of the default boxes (the inverse of
    :func:`encode`)."""
    d = to_cxcywh(defaults)
    centre = d[..., :2] + offsets[..., :2] * VARIANCES[0] * d[..., 2:]
    size = d[..., 2:] * torch.exp((offsets[..., 2:] * VARIANCES[1]).clamp(max=8.0))
    return to_xyxy(torch.cat((centre, size), -1))


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: the indices of the boxes kept, best score first.

    Each box, best first, removes the lower-scoring boxes that overlap it by more than
    ``iou_threshold``. The IoU matrix is computed once; only a kept box does tensor work.
    """
    order = scores.argsort(descending=True)
    iou = box_iou(boxes[order], boxes[order])
    alive = torch.ones(len(order), dtype=torch.bool, device=boxes.device)
    keep = []
    for i in range(len(order)):
        if alive[i]:
            keep.append(i)
            alive &= iou[i] <= iou_threshold
    return order[torch.tensor(keep, dtype=torch.int64, device=boxes.device)]
