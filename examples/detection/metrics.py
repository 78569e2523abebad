"""Average precision and recall at IoU 0.5 of a detector's detections on a validation set.

COCO's way of matching at one threshold: per class, the detections of all images, best score
first, each take the not yet matched ground-truth box of their image that they overlap most, if
the IoU is at least 0.5 (a true positive), else count as false positives. The AP is the area
under the precision-recall curve made monotonic (PASCAL VOC 2010's all-point interpolation);
mAP@0.5 is its mean over the classes present in the ground truth (COCO's AP50, without COCO's
101-point sampling, crowd boxes and area ranges).
"""

from __future__ import annotations

import torch
from boxes import box_iou

__all__ = ["Detections"]


class Detections:
    """Collects detections and ground truths image by image; ``summary()`` scores them."""

    def __init__(self, num_classes: int, iou_threshold: float = 0.5):
        self.num_classes, self.iou_threshold = num_classes, iou_threshold
        self.images: list[tuple[dict, dict]] = []

    def add(self, detections: list[dict], truths: list[dict]) -> None:
        """One batch: per image ``{"boxes", "scores", "labels"}`` and ``{"boxes", "labels"}``."""
        cpu = [{k: v.detach().cpu() for k, v in d.items() if k in ("boxes", "scores", "labels")} for d in detections]
        self.images += zip(cpu, [{k: t[k].cpu() for k in ("boxes", "labels")} for t in truths])

    def summary(self) -> dict[str, float]:
        """``map50`` (mean AP over the classes with ground truth), ``recall50`` (the share of the
        ground-truth boxes that some detection found), ``boxes`` and ``images``."""
        aps, found, total = [], 0, 0
        for c in range(1, self.num_classes + 1):
            scores, hits, truths = [], [], 0
            for det, gt in self.images:
                g, d = gt["boxes"][gt["labels"] == c], det["labels"] == c
                truths += len(g)
                s, order = det["scores"][d].sort(descending=True)
                iou = box_iou(det["boxes"][d][order], g)
                taken = torch.zeros(len(g), dtype=torch.bool)
                for i in range(len(s)):
                    best_iou, j = iou[i].masked_fill(taken, -1.0).max(0) if len(g) else (torch.tensor(0.0), None)
                    hit = bool(best_iou >= self.iou_threshold)
                    if hit:
                        taken[j] = True
                    hits.append(hit)
                scores.append(s)
            total += truths
            found += sum(hits)
            if truths:
                aps.append(_average_precision(torch.cat(scores), torch.tensor(hits, dtype=torch.bool), truths))
        return {
            "map50": sum(aps) / max(len(aps), 1),
            "recall50": found / max(total, 1),
            "boxes": total,
            "images": len(self.images),
        }


def _average_precision(scores: torch.Tensor, hits: torch.Tensor, truths: int) -> float:
    """The area under the interpolated precision-recall curve of detections ``scores`` that are
    true positives where ``hits``, against ``truths`` ground-truth boxes."""
    if not len(scores):
        return 0.0
    hits = hits[scores.argsort(descending=True)].float()
    tp = hits.cumsum(0)
    precision = tp / torch.arange(1, len(hits) + 1)
    recall = tp / truths
    precision = torch.cat((precision, torch.zeros(1))).flip(0).cummax(0).values.flip(0)  # the envelope
    steps = torch.cat((recall[:1], recall[1:] - recall[:-1]))
    return float((steps * precision[:-1]).sum())
