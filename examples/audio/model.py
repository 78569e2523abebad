"""M5 (Dai et al., 2017): a 5-layer 1-D CNN on raw waveforms, in plain torch.

"Very Deep Convolutional Neural Networks for Raw Waveforms" (ICASSP 2017) classifies 8 kHz
audio with a first convolution of 80 samples (10 ms) at stride 4, then 3-sample convolutions,
each block followed by batch norm, ReLU and a max pool of 4, and a global average pool before
the classifier. CoorDL's paper trains M5 on FMA. The channel layout here is PyTorch's audio
tutorial's (``n, n, 2n, 2n``); the paper's M5 has 128, 128, 256, 512.
"""

from __future__ import annotations

import torch
from torch import nn


def block(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Conv1d + BatchNorm + ReLU + MaxPool(4): one of M5's four blocks."""
    return nn.Sequential(
        nn.Conv1d(cin, cout, kernel, stride=stride), nn.BatchNorm1d(cout), nn.ReLU(inplace=True), nn.MaxPool1d(4)
    )


class M5(nn.Module):
    """M5 on waveforms ``(B, 1, samples)``; returns class logits ``(B, num_classes)``.

    Args:
        num_classes: classes to tell apart.
        n_channel: channels of the first two blocks; the last two have twice as many. 32 (default)
            keeps it quick on a CPU (25 k parameters with 4 classes); the paper's and the tutorial's larger
            models use 128.
        stride: the first convolution's stride, 4 as in the paper (the tutorial uses 16).
        n_input: input channels (1: mono).

    The input needs at least :attr:`min_samples` samples (1,772 at stride 4: 0.22 s at 8 kHz) for
    the four pools to leave something to average.
    """

    def __init__(self, num_classes: int, n_channel: int = 32, stride: int = 4, n_input: int = 1):
        super().__init__()
        n = n_channel
        self.features = nn.Sequential(
            block(n_input, n, 80, stride),
            block(n, n, 3),
            block(n, 2 * n, 3),
            block(2 * n, 2 * n, 3),
        )
        self.fc = nn.Linear(2 * n, num_classes)
        # Backwards from one output step: each pool needs 4 inputs, each 3-tap convolution 2 more.
        steps = 1
        for _ in range(3):
            steps = 4 * steps + 2
        self.min_samples = 80 + (4 * steps - 1) * stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.fc(x.mean(dim=-1))  # global average pool over time
