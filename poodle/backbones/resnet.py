"""ResNet-10 and ResNet-18 from He et al., "Deep Residual Learning for Image Recognition" (CVPR
2016, arXiv:1512.03385), adapted to 84x84 few-shot images as in the POODLE release (Le et al.,
NeurIPS 2021): torchvision's BasicBlock layout with a 3x3 stride-1 ``conv1`` and no max-pool.

Stages of [1, 1, 1, 1] (ResNet-10) or [2, 2, 2, 2] (ResNet-18) blocks, widths 64-128-256-512,
strides 1, 2, 2, 2; the first block of stages 2-4 has a 1x1 conv + BN ``downsample``. D = 512;
84x84 input: final map 512 x 11 x 11. Initialisation as torchvision's ResNet (Kaiming-normal
fan_out for convs, BN weight 1 and bias 0), which the facts about the release do not contradict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poodle.backbones.base import Backbone, init_weights, register


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN + shortcut, ReLU: ``[B, C_in, H, W] -> [B, planes, H/s, W/s]``."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet(Backbone):
    """ResNet with BasicBlocks, ``[B, 3, H, W] -> [B, 512, H/8, W/8]``; classifier ``fc``."""

    classifier_name = "fc"
    min_input_size = 1

    def __init__(self, blocks: tuple[int, int, int, int], *, num_classes: int = 0, rotation_head: bool = False) -> None:
        super().__init__(512)
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        in_planes = 64
        for i, (planes, n, stride) in enumerate(zip((64, 128, 256, 512), blocks, (1, 2, 2, 2))):
            layer = []
            for j in range(n):
                layer.append(BasicBlock(in_planes, planes, stride if j == 0 else 1))
                in_planes = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        init_weights(self, lambda w: nn.init.kaiming_normal_(w, mode="fan_out", nonlinearity="relu"))
        self._add_rotation_head(rotation_head)  # release order: further, fc2, fc
        self._add_classifier(num_classes)

    layer1: nn.Module  # set with setattr in __init__
    layer2: nn.Module  # set with setattr in __init__
    layer3: nn.Module  # set with setattr in __init__
    layer4: nn.Module  # set with setattr in __init__

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return self.layer4(self.layer3(self.layer2(self.layer1(out))))


@register(
    "resnet10", feature_dim=512, min_input_size=1, summary="ResNet-10 (BasicBlock [1,1,1,1]), 3x3 stem, no max-pool"
)
def resnet10(*, num_classes: int = 0, rotation_head: bool = False) -> ResNet:
    return ResNet((1, 1, 1, 1), num_classes=num_classes, rotation_head=rotation_head)


@register(
    "resnet18", feature_dim=512, min_input_size=1, summary="ResNet-18 (BasicBlock [2,2,2,2]), 3x3 stem, no max-pool"
)
def resnet18(*, num_classes: int = 0, rotation_head: bool = False) -> ResNet:
    return ResNet((2, 2, 2, 2), num_classes=num_classes, rotation_head=rotation_head)
