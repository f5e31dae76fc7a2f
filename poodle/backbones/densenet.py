"""DenseNet-121 from Huang et al., "Densely Connected Convolutional Networks" (CVPR 2017,
arXiv:1608.06993), adapted to 84x84 images as in SimpleShot (Wang et al., arXiv:1911.04623) and the
POODLE release (Le et al., NeurIPS 2021, appendix): ``features.conv0`` is a 3x3 stride-1 conv and
the stem's norm0/relu0/pool0 are removed.

DenseNet-BC: growth 32, bottleneck 4 x growth, blocks (6, 12, 24, 16), compression 0.5;
transitions BN-ReLU-1x1 conv-2x2 avg-pool; ``features.norm5`` -> ReLU -> global average pool,
D = 1024 (84x84 input: final map 1024 x 10 x 10). Initialisation as torchvision's DenseNet
(Kaiming-normal convs, BN 1/0, linear bias 0).

Difference from the release: its rotation head ``fc2`` is ``Linear(1024, num_classes)`` (a bug; the
rotation loss only ever targets outputs 0-3). Here ``fc2`` has 4 outputs like every other backbone,
and :meth:`DenseNet.remap_release` keeps the first 4 rows of a released ``fc2``: the rows the
rotation targets trained.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from poodle.backbones.base import Backbone, init_weights, register
from poodle.backbones.heads import ROTATIONS


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (bn_size*growth), BN-ReLU-3x3 conv (growth).

    ``[B, C, H, W] -> [B, growth, H, W]``.
    """

    def __init__(self, in_channels: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_channels, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class DenseBlock(nn.ModuleDict):
    """``denselayer1..n``; each layer reads the concatenation of the input and all earlier outputs:
    ``[B, C, H, W] -> [B, C + n*growth, H, W]``."""

    def __init__(self, n_layers: int, in_channels: int, growth: int, bn_size: int) -> None:
        super().__init__()
        for i in range(n_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(in_channels + i * growth, growth, bn_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [x]
        for layer in self.values():
            feats.append(layer(torch.cat(feats, 1)))
        return torch.cat(feats, 1)


def transition(in_channels: int, out_channels: int) -> nn.Sequential:
    """BN-ReLU-1x1 conv-2x2 avg-pool: ``[B, C_in, H, W] -> [B, C_out, H//2, W//2]``."""
    return nn.Sequential(
        OrderedDict(
            [
                ("norm", nn.BatchNorm2d(in_channels)),
                ("relu", nn.ReLU(inplace=True)),
                ("conv", nn.Conv2d(in_channels, out_channels, 1, bias=False)),
                ("pool", nn.AvgPool2d(2, stride=2)),
            ]
        )
    )


class DenseNet(Backbone):
    """DenseNet-BC, ``[B, 3, H, W] -> [B, 1024, H/8, W/8]``; classifier ``classifier``; keys
    ``features.*``."""

    classifier_name = "classifier"
    min_input_size = 8

    def __init__(
        self,
        *,
        growth: int = 32,
        blocks: tuple[int, ...] = (6, 12, 24, 16),
        bn_size: int = 4,
        compression: float = 0.5,
        num_classes: int = 0,
        rotation_head: bool = False,
    ) -> None:
        channels = 2 * growth
        modules: list[tuple[str, nn.Module]] = [("conv0", nn.Conv2d(3, channels, 3, stride=1, padding=1, bias=False))]
        for i, n in enumerate(blocks):
            modules.append((f"denseblock{i + 1}", DenseBlock(n, channels, growth, bn_size)))
            channels += n * growth
            if i < len(blocks) - 1:
                out = int(channels * compression)
                modules.append((f"transition{i + 1}", transition(channels, out)))
                channels = out
        modules.append(("norm5", nn.BatchNorm2d(channels)))
        super().__init__(channels)
        self.features = nn.Sequential(OrderedDict(modules))
        self._add_classifier(num_classes)  # the release lists classifier before further
        self._add_rotation_head(rotation_head)
        init_weights(self, nn.init.kaiming_normal_, zero_linear_bias=True)

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.features(x))

    def remap_release(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cut the release's ``fc2`` ``[num_classes, 1024]`` to its first 4 rows (see module doc)."""
        w, b = state_dict.get("fc2.weight"), state_dict.get("fc2.bias")
        if (
            self.fc2 is not None
            and w is not None
            and b is not None
            and w.dim() == 2
            and w.shape[0] > ROTATIONS
            and w.shape[1] == self.feature_dim
        ):
            state_dict = dict(state_dict)
            state_dict["fc2.weight"], state_dict["fc2.bias"] = w[:ROTATIONS], b[:ROTATIONS]
        return state_dict


@register(
    "densenet121", feature_dim=1024, min_input_size=8, summary="DenseNet-121 (BC, growth 32), 3x3 stem without pooling"
)
def densenet121(*, num_classes: int = 0, rotation_head: bool = False) -> DenseNet:
    return DenseNet(num_classes=num_classes, rotation_head=rotation_head)
