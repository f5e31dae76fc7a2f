"""MobileNet (v1) from Howard et al., "MobileNets: Efficient Convolutional Neural Networks for
Mobile Vision Applications" (arXiv:1704.04861), with the first two down-sampling steps removed as in
SimpleShot (Wang et al., arXiv:1911.04623) and the POODLE release (Le et al., NeurIPS 2021,
appendix).

``conv1`` (3 -> 32, 3x3 stride 1, no bias) + ``bn1`` + ReLU, then 13 depthwise-separable blocks
(``conv1`` depthwise 3x3, ``bn1``, ReLU, ``conv2`` pointwise 1x1, ``bn2``, ReLU) with widths 64,
128/2, 128, 256/2, 256, 512/2, 5 x 512, 1024/2, 1024 (/2 = stride 2), then global average pool,
D = 1024 (84x84 input: final map 1024 x 6 x 6). PyTorch's default initialisation (the release sets
none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poodle.backbones.base import Backbone, register

# (output channels, stride) of the 13 blocks.
CFG = (
    (64, 1),
    (128, 2),
    (128, 1),
    (256, 2),
    (256, 1),
    (512, 2),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (1024, 2),
    (1024, 1),
)


class Block(nn.Module):
    """Depthwise 3x3 + pointwise 1x1, each with BN and ReLU.

    ``[B, C_in, H, W] -> [B, C_out, H/stride, W/stride]``.
    """

    def __init__(self, in_planes: int, out_planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, in_planes, 3, stride=stride, padding=1, groups=in_planes, bias=False)
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv2 = nn.Conv2d(in_planes, out_planes, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class MobileNet(Backbone):
    """MobileNet v1, ``[B, 3, H, W] -> [B, 1024, H/16, W/16]``; classifier ``linear``."""

    classifier_name = "linear"
    min_input_size = 1

    def __init__(self, *, num_classes: int = 0, rotation_head: bool = False) -> None:
        super().__init__(CFG[-1][0])
        self.conv1 = nn.Conv2d(3, 32, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        blocks, in_planes = [], 32
        for out_planes, stride in CFG:
            blocks.append(Block(in_planes, out_planes, stride))
            in_planes = out_planes
        self.layers = nn.Sequential(*blocks)
        self._add_rotation_head(rotation_head)  # release order: further, fc2, linear
        self._add_classifier(num_classes)

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(F.relu(self.bn1(self.conv1(x))))


@register(
    "mobilenet", feature_dim=1024, min_input_size=1, summary="MobileNet v1 without its first two down-sampling steps"
)
def mobilenet(*, num_classes: int = 0, rotation_head: bool = False) -> MobileNet:
    return MobileNet(num_classes=num_classes, rotation_head=rotation_head)
