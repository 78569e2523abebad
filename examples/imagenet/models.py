"""ResNets for the ImageNet example: torchvision's when it is installed, else the same ones here.

``resnet18``, ``resnet34`` and ``resnet50`` follow torchvision's definitions (He et al.,
"Deep Residual Learning for Image Recognition"; the stride on the 3x3 convolution of a
bottleneck, as torchvision and NVIDIA's recipes do), so checkpoints load in either.
``resnet_tiny`` is a CPU demo model: one basic block per stage at a quarter of ResNet-18's
width (0.31 M parameters for 10 classes, against ResNet-18's 11.7 M). Any other name is
looked up in ``torchvision.models`` when torchvision imports.
"""

from __future__ import annotations

from torch import nn

__all__ = ["ARCHS", "create"]


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, 1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, planes, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, planes * 4, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._stage(block, width, layers[0], 1)
        self.layer2 = self._stage(block, width * 2, layers[1], 2)
        self.layer3 = self._stage(block, width * 4, layers[2], 2)
        self.layer4 = self._stage(block, width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _stage(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [block(self.inplanes, planes, stride)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


ARCHS = {
    "resnet_tiny": lambda n: ResNet(BasicBlock, [1, 1, 1, 1], n, width=16),
    "resnet18": lambda n: ResNet(BasicBlock, [2, 2, 2, 2], n),
    "resnet34": lambda n: ResNet(BasicBlock, [3, 4, 6, 3], n),
    "resnet50": lambda n: ResNet(Bottleneck, [3, 4, 6, 3], n),
}


def _torchvision_models():
    try:
        import torchvision.models as tvm  # a CUDA build of torchvision fails to import on CPU torch
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return None
    return tvm


def names() -> list[str]:
    """Every architecture ``create`` accepts here."""
    tvm = _torchvision_models()
    extra = [] if tvm is None else [n for n in tvm.list_models(module=tvm) if n not in ARCHS]
    return sorted(ARCHS) + sorted(extra)


def create(arch: str, num_classes: int) -> tuple[nn.Module, str]:
    """The model and where it came from (``"torchvision"`` or ``"examples/imagenet/models.py"``)."""
    tvm = _torchvision_models()
    if tvm is not None and arch != "resnet_tiny" and arch in tvm.list_models(module=tvm):
        return tvm.get_model(arch, num_classes=num_classes), "torchvision"
    if arch not in ARCHS:
        hint = "" if tvm is not None else " (install torchvision for its other models)"
        raise SystemExit(f"unknown architecture {arch!r}; choose one of {', '.join(sorted(ARCHS))}{hint}")
    return ARCHS[arch](num_classes), "examples/imagenet/models.py"
