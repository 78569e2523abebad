"""uint8 pixels normalised by whoever receives them: an HP group's consumers (staged as uint8, a
quarter of float32's bytes), and a trainer whose Ray actors send uint8 (``RayPrep(output="uint8")``)."""

from __future__ import annotations

import torch

__all__ = ["Normaliser"]


class Normaliser:
    """A recipe's ``mean`` and ``std`` (fractions of 255, per channel) as x255 NCHW tensors, applied
    to a batch of uint8 pixels: ``(pixels - mean) / std`` in float32, as the recipe's pipeline makes."""

    def __init__(self, mean, std):
        self.mean = torch.tensor([m * 255 for m in mean]).view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in std]).view(1, 3, 1, 1)

    @classmethod
    def of(cls, recipe) -> Normaliser:
        """The normaliser of a recipe whose pixels may travel as uint8 (``recipe.normalisation()``)."""
        return cls(*recipe.normalisation())

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels`` (NCHW, on any device) normalised; in place when they are float32 already."""
        out = pixels.to(torch.float32)
        return out.sub_(self.mean.to(out.device)).div_(self.std.to(out.device))
