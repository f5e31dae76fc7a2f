"""Conv-4 as in Vinyals et al., "Matching Networks for One Shot Learning" (NeurIPS 2016,
arXiv:1606.04080), in the two widths of the POODLE release (Le et al., NeurIPS 2021, appendix):
``conv4_64`` (64 channels throughout, D = 64) and ``conv4_512`` (hidden 64, last block 512, D = 512).

``encoder`` = 4 x [3x3 conv (bias) -> BN -> ReLU -> 2x2 max-pool]; the last map is globally
average-pooled (not flattened to 1600). 84x84 input: 84 -> 42 -> 21 -> 10 -> 5; 28x28: 28 -> 14 ->
7 -> 3 -> 1. PyTorch's default initialisation (the release sets none).
"""

from __future__ import annotations

import torch
from torch import nn

from poodle.backbones.base import Backbone, register


def conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    """``[B, C_in, H, W] -> [B, C_out, H//2, W//2]``; keys ``0.*`` (conv) and ``1.*`` (BN)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=True),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class ConvNet(Backbone):
    """Conv-4, ``[B, 3, H, W] -> [B, out_channels, H/16, W/16]``; classifier ``fc``; keys
    ``encoder.*``."""

    classifier_name = "fc"
    min_input_size = 16

    def __init__(
        self, *, hidden: int = 64, out_channels: int = 64, num_classes: int = 0, rotation_head: bool = False
    ) -> None:
        super().__init__(out_channels)
        widths = [3, hidden, hidden, hidden, out_channels]
        self.encoder = nn.Sequential(*[conv_block(widths[i], widths[i + 1]) for i in range(4)])
        self._add_classifier(num_classes)  # the release lists fc before further and fc2
        self._add_rotation_head(rotation_head)

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


@register("conv4_64", feature_dim=64, min_input_size=16, summary="Conv-4, 64 channels in every block")
def conv4_64(*, num_classes: int = 0, rotation_head: bool = False) -> ConvNet:
    return ConvNet(hidden=64, out_channels=64, num_classes=num_classes, rotation_head=rotation_head)


@register("conv4_512", feature_dim=512, min_input_size=16, summary="Conv-4, hidden 64, last block 512 channels")
def conv4_512(*, num_classes: int = 0, rotation_head: bool = False) -> ConvNet:
    return ConvNet(hidden=64, out_channels=512, num_classes=num_classes, rotation_head=rotation_head)
