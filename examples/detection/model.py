"""A small SSD in plain torch: the network, its default boxes, its loss and its detections.

``TinySSD`` is SSD (Liu et al., 2016) at CPU-demo scale: a VGG-like backbone of strided
3x3 conv/BN/ReLU blocks instead of VGG-16 or NVIDIA SSD300's ResNet-50, four feature maps
(strides 8, 16, 32 and 64: 16x16, 8x8, 4x4 and 2x2 cells at 128x128) instead of six, and
four default boxes per cell (aspect ratios 1, 2 and 1/2 at the map's scale, and 1 at the
geometric mean of its scale and the next map's), 1,360 at 128x128. Each map has a 3x3
convolution for class scores (background + C classes) and one for the four box offsets
of every default box. ``SSDLoss`` is SSD's: match (:func:`boxes.match`), smooth-L1 on the
offsets of the positives, cross-entropy on the positives and on the three times as many
negatives that the network gets most wrong (hard-negative mining), over the batch's number
of positives.

``torchvision_ssd`` builds torchvision's SSD300-VGG16 or SSDLite320-MobileNetV3, which
have their own default boxes, matching, loss and post-processing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from boxes import decode, encode, match, nms
from torch import nn

__all__ = ["SSDLoss", "TinySSD", "default_boxes", "detect", "torchvision_ssd"]

# Default-box sizes, as fractions of the image side, of each feature map and (last) of the
# extra box of the last map: SSD's s_k, smaller than its 0.2..0.9 since the maps start at
# stride 8 (SSD300's first is also 0.07 of the image: 21 of 300 pixels).
SCALES = (0.1, 0.22, 0.42, 0.65, 0.9)
ASPECT_RATIOS = (2.0,)


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinySSD(nn.Module):
    """SSD with a small backbone for ``size`` x ``size`` images and ``num_classes`` classes
    (without the background).

    ``forward(images)`` returns ``(scores, offsets)``: (B, D, num_classes + 1) class logits
    (class 0 is the background) and (B, D, 4) box offsets of the D default boxes, which are the
    buffer ``defaults`` (D, 4), xyxy in pixels.
    """

    def __init__(self, num_classes: int, size: int = 128, width: int = 32):
        super().__init__()
        w = width
        self.num_classes, self.size = num_classes, size
        self.stages = nn.ModuleList(
            [
                nn.Sequential(  # stride 8
                    *(_block(3, w // 2, 2), _block(w // 2, w, 2), _block(w, w, 1)),
                    *(_block(w, 2 * w, 2), _block(2 * w, 2 * w, 1)),
                ),
                nn.Sequential(_block(2 * w, 4 * w, 2), _block(4 * w, 4 * w, 1)),  # stride 16
                _block(4 * w, 4 * w, 2),  # stride 32
                _block(4 * w, 4 * w, 2),  # stride 64
            ]
        )
        channels = (2 * w, 4 * w, 4 * w, 4 * w)
        per_cell = 2 + 2 * len(ASPECT_RATIOS)
        self.class_heads = nn.ModuleList(nn.Conv2d(c, per_cell * (num_classes + 1), 3, 1, 1) for c in channels)
        self.box_heads = nn.ModuleList(nn.Conv2d(c, per_cell * 4, 3, 1, 1) for c in channels)
        cells, side = [], size
        for _ in range(3):  # the stride-8 map: three stride-2 convolutions (3x3, padding 1) of the image
            side = math.ceil(side / 2)
        for _ in channels:
            cells.append(side)
            side = math.ceil(side / 2)
        self.register_buffer("defaults", default_boxes(cells, size), persistent=False)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if images.shape[-2:] != (self.size, self.size):
            raise ValueError(f"TinySSD(size={self.size}) got images of {tuple(images.shape[-2:])} pixels")
        scores, offsets, x = [], [], images
        for stage, class_head, box_head in zip(self.stages, self.class_heads, self.box_heads):
            x = stage(x)
            # (B, A*K, H, W) -> (B, H*W*A, K): the order of default_boxes (row, column, box)
            scores.append(class_head(x).permute(0, 2, 3, 1).reshape(len(x), -1, self.num_classes + 1))
            offsets.append(box_head(x).permute(0, 2, 3, 1).reshape(len(x), -1, 4))
        return torch.cat(scores, 1), torch.cat(offsets, 1)


def default_boxes(cells: list[int], size: int) -> torch.Tensor:
    """SSD's default boxes, (D, 4) xyxy in pixels of a ``size`` x ``size`` image, for feature
    maps of ``cells`` x ``cells`` cells: row by row, cell by cell, box by box."""
    out = []
    for k, n in enumerate(cells):
        s, s_next = SCALES[k], SCALES[k + 1]
        shapes = [(s, s), (math.sqrt(s * s_next),) * 2]
        for r in ASPECT_RATIOS:
            shapes += [(s * math.sqrt(r), s / math.sqrt(r)), (s / math.sqrt(r), s * math.sqrt(r))]
        centres = (torch.arange(n, dtype=torch.float32) + 0.5) / n
        cy, cx = torch.meshgrid(centres, centres, indexing="ij")
        for y, x in zip(cy.flatten(), cx.flatten()):
            for w, h in shapes:
                out.append((x, y, w, h))
    cxcywh = torch.tensor(out).clamp(0, 1)  # NVIDIA's SSD300 clamps them the same way
    return torch.cat((cxcywh[:, :2] - cxcywh[:, 2:] / 2, cxcywh[:, :2] + cxcywh[:, 2:] / 2), 1) * size


class SSDLoss(nn.Module):
    """SSD's loss over a batch: (smooth-L1 of the positives' offsets + cross-entropy of the
    positives and of the hardest ``neg_pos`` times as many negatives) / number of positives.

    ``targets(boxes, labels)`` makes the training targets of a batch once per batch (the same for
    any model output); ``forward(scores, offsets, target_offsets, classes)`` returns the loss
    and its two parts, ``(loss, box_loss, class_loss)``.
    """

    def __init__(self, defaults: torch.Tensor, neg_pos: int = 3, threshold: float = 0.5):
        super().__init__()
        self.register_buffer("defaults", defaults, persistent=False)
        self.neg_pos, self.threshold = neg_pos, threshold

    def targets(self, boxes: list[torch.Tensor], labels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D, 4) target offsets and (B, D) classes of the images' boxes and class indices."""
        matched, classes = zip(*(match(self.defaults, b, lab, self.threshold) for b, lab in zip(boxes, labels)))
        return encode(torch.stack(matched), self.defaults), torch.stack(classes)

    def forward(self, scores, offsets, target_offsets, classes):
        positive = classes > 0
        positives = positive.sum(1)
        ce = F.cross_entropy(scores.transpose(1, 2), classes, reduction="none")  # (B, D)
        # Hard-negative mining: the negatives of highest loss, neg_pos per positive of the image.
        negative_ce = ce.detach().masked_fill(positive, -math.inf)
        rank = negative_ce.argsort(1, descending=True).argsort(1)
        negative = (rank < self.neg_pos * positives[:, None]) & ~positive
        n = positives.sum().clamp(min=1)
        class_loss = ce[positive | negative].sum() / n
        box_loss = F.smooth_l1_loss(offsets[positive], target_offsets[positive], reduction="sum") / n
        return box_loss + class_loss, box_loss, class_loss


@torch.no_grad()
def detect(
    scores: torch.Tensor,
    offsets: torch.Tensor,
    defaults: torch.Tensor,
    score_threshold: float = 0.05,
    iou_threshold: float = 0.5,
    per_class: int = 100,
    per_image: int = 100,
) -> list[dict[str, torch.Tensor]]:
    """The detections of a batch, as torchvision's detection models return them: per image a dict
    of ``boxes`` (N, 4) xyxy in pixels, ``scores`` (N,) and ``labels`` (N,) class indices 1..C.

    Per class, the ``per_class`` best boxes above ``score_threshold`` after NMS at
    ``iou_threshold``; per image, the ``per_image`` best of all classes (NVIDIA's SSD300 keeps
    200 of each at 0.05 and 0.5).
    """
    probabilities = scores.softmax(-1)
    boxes = decode(offsets, defaults)
    out = []
    for p, b in zip(probabilities, boxes):
        kept_boxes, kept_scores, kept_labels = [], [], []
        for c in range(1, p.shape[1]):
            candidates = (p[:, c] > score_threshold).nonzero().squeeze(1)
            candidates = candidates[p[candidates, c].argsort(descending=True)[:per_class]]
            keep = candidates[nms(b[candidates], p[candidates, c], iou_threshold)]
            kept_boxes.append(b[keep])
            kept_scores.append(p[keep, c])
            kept_labels.append(torch.full((len(keep),), c, dtype=torch.int64, device=p.device))
        s = torch.cat(kept_scores)
        best = s.argsort(descending=True)[:per_image]
        out.append({"boxes": torch.cat(kept_boxes)[best], "scores": s[best], "labels": torch.cat(kept_labels)[best]})
    return out


def torchvision_ssd(name: str, num_classes: int) -> nn.Module:
    """torchvision's ``ssd300_vgg16`` or ``ssdlite320_mobilenet_v3_large``, untrained, for
    ``num_classes`` classes plus the background. Needs torchvision."""
    from torchvision.models import detection  # imported only for these models

    builders = {"torchvision": detection.ssd300_vgg16, "torchvision-ssdlite": detection.ssdlite320_mobilenet_v3_large}
    return builders[name](weights=None, weights_backbone=None, num_classes=num_classes + 1)
