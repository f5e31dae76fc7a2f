"""WRN-28-10 from Zagoruyko & Komodakis, "Wide Residual Networks" (BMVC 2016, arXiv:1605.07146),
in the few-shot variant of Rusu et al. (LEO) and Wang et al. (SimpleShot, arXiv:1911.04623) that the
POODLE release trains (Le et al., NeurIPS 2021, appendix): D = 640.

``conv1`` (3 -> 16, 3x3, bias) -> three stages of 4 pre-activation ``wide_basic`` blocks (BN-ReLU-
conv3x3-BN-ReLU-conv3x3, convs with bias; the second conv carries the stride) of widths 160, 320,
640 with strides 1, 2, 2 -> ``bn1`` (momentum 0.9, as the release) -> ReLU -> global average pool.
The first block of each stage has a 1x1 conv shortcut with bias (``shortcut.0``). Dropout is 0, so
no dropout layers are built. 84x84 input: final map 640 x 21 x 21. PyTorch's default
initialisation (the release's ``conv_init`` is never called).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poodle.backbones.base import Backbone, register


class WideBasic(nn.Module):
    """Pre-activation block ``[B, C_in, H, W] -> [B, planes, H/stride, W/stride]``."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, padding=1, bias=True)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=True)
        self.shortcut = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return out + (self.shortcut(x) if self.shortcut is not None else x)


class WideResNet(Backbone):
    """WRN-depth-k, ``[B, 3, H, W] -> [B, 64k, H/4, W/4]``; classifier ``linear``."""

    classifier_name = "linear"
    min_input_size = 1

    def __init__(
        self, *, depth: int = 28, widen_factor: int = 10, num_classes: int = 0, rotation_head: bool = False
    ) -> None:
        if (depth - 4) % 6:
            raise ValueError("WRN depth must be 6n + 4")
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        super().__init__(widths[-1])
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=True)
        in_planes = widths[0]
        for i, (planes, stride) in enumerate(zip(widths[1:], (1, 2, 2))):
            blocks = []
            for j in range(n):
                blocks.append(WideBasic(in_planes, planes, stride if j == 0 else 1))
                in_planes = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.bn1 = nn.BatchNorm2d(widths[-1], momentum=0.9)
        self._add_rotation_head(rotation_head)  # release order: further, fc2, linear
        self._add_classifier(num_classes)

    layer1: nn.Module  # set with setattr in __init__
    layer2: nn.Module  # set with setattr in __init__
    layer3: nn.Module  # set with setattr in __init__

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        return F.relu(self.bn1(out))


@register("wrn28_10", feature_dim=640, min_input_size=1, summary="Wide ResNet 28-10 (release --arch wideres)")
def wrn28_10(*, num_classes: int = 0, rotation_head: bool = False) -> WideResNet:
    return WideResNet(depth=28, widen_factor=10, num_classes=num_classes, rotation_head=rotation_head)
