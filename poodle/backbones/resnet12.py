"""ResNet-12 as in Lee et al., "Meta-Learning with Differentiable Convex Optimization" (MetaOptNet,
CVPR 2019, arXiv:1904.03758) and Tian et al., "Rethinking Few-Shot Image Classification: a Good
Embedding Is All You Need?" (ECCV 2020, arXiv:2003.11539), in the variant the POODLE release
trains (Le et al., NeurIPS 2021): widths 64-160-320-640, D = 640.

Each of the four stages is one residual block: three 3x3 conv + BN (LeakyReLU 0.1 after the first
two), a 1x1 stride-1 conv + BN shortcut, LeakyReLU, 2x2 max-pool, then regularisation: dropout 0.1
in stages 1-2 and DropBlock (Ghiasi et al., "DropBlock: A regularization method for convolutional
networks", NeurIPS 2018, arXiv:1810.12890; block size 5, keep rate annealed from 1 to 0.9) in
stages 3-4. 84x84 input: 84 -> 42 -> 21 -> 10 -> 5. Because the block ends in a LeakyReLU, the
features can be slightly negative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poodle.backbones.base import Backbone, init_weights, register

WIDTHS = (64, 160, 320, 640)
DROP_RATE = 0.1  # release default drop_rate
DROPBLOCK_SIZE = 5
ANNEAL_STEPS = 20 * 2000  # training forwards over which the DropBlock keep rate falls to 1 - DROP_RATE


class DropBlock(nn.Module):
    """Drop ``block_size`` x ``block_size`` squares of a feature map (training only; no parameters).

    ``gamma`` is the probability that a position seeds a dropped block. Surviving activations are
    rescaled by (number of positions / number kept), counted over the whole batch.
    """

    def __init__(self, block_size: int = DROPBLOCK_SIZE) -> None:
        super().__init__()
        self.block_size = block_size

    def forward(self, x: torch.Tensor, gamma: float) -> torch.Tensor:
        """``x [B, C, H, W] -> [B, C, H, W]``; identity in eval mode or when gamma == 0."""
        if not self.training or gamma <= 0:
            return x
        bs = min(self.block_size, x.shape[-2], x.shape[-1])
        b, c, h, w = x.shape
        # Seeds only where a whole block fits; max-pooling the zero-padded seed map grows each seed
        # into the bs x bs block that starts at it.
        seeds = torch.bernoulli(torch.full((b, c, h - bs + 1, w - bs + 1), gamma, device=x.device, dtype=x.dtype))
        dropped = F.max_pool2d(F.pad(seeds, (bs - 1,) * 4), bs, stride=1)
        keep = 1.0 - dropped
        return x * keep * (keep.numel() / keep.sum().clamp_min(1.0))


class ResNet12Block(nn.Module):
    """One ResNet-12 stage: ``[B, C_in, H, W] -> [B, C_out, H//2, W//2]``.

    ``dropblock_step`` counts training forwards for the keep-rate annealing. It is a plain Python
    int, so it is not part of the state dict (the release's key set has no such entry).
    """

    def __init__(self, in_planes: int, planes: int, drop_rate: float, use_dropblock: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=1, bias=False), nn.BatchNorm2d(planes))
        self.maxpool = nn.MaxPool2d(2)
        self.drop_rate = drop_rate
        self.use_dropblock = use_dropblock
        self.dropblock = DropBlock(DROPBLOCK_SIZE)
        self.dropblock_step = 0

    def dropblock_gamma(self, h: int, w: int) -> float:
        """Seed probability for an ``h x w`` map at the current annealing step.

        gamma = (1 - keep) / bs^2 * (h w) / ((h - bs + 1)(w - bs + 1)), the release's formula for
        square maps; bs shrinks to the map size on maps smaller than the block.
        """
        keep = max(1.0 - self.drop_rate * self.dropblock_step / ANNEAL_STEPS, 1.0 - self.drop_rate)
        bs = min(DROPBLOCK_SIZE, h, w)
        return (1.0 - keep) / bs**2 * (h * w) / ((h - bs + 1) * (w - bs + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.leaky_relu(self.bn1(self.conv1(x)), 0.1)
        out = F.leaky_relu(self.bn2(self.conv2(out)), 0.1)
        out = self.bn3(self.conv3(out))
        out = F.leaky_relu(out + self.downsample(x), 0.1)
        out = self.maxpool(out)
        if self.drop_rate > 0 and self.training:
            if self.use_dropblock:
                self.dropblock_step += 1
                out = self.dropblock(out, self.dropblock_gamma(out.shape[-2], out.shape[-1]))
            else:
                out = F.dropout(out, p=self.drop_rate, training=True)
        return out


class ResNet12(Backbone):
    """ResNet-12, ``[B, 3, H, W] -> [B, 640, H/16, W/16]``; classifier ``fc``; keys
    ``layer{1..4}.0.*``."""

    classifier_name = "fc"
    min_input_size = 16

    def __init__(
        self,
        *,
        num_classes: int = 0,
        rotation_head: bool = False,
        widths: tuple[int, ...] = WIDTHS,
        drop_rate: float = DROP_RATE,
    ) -> None:
        super().__init__(widths[-1])
        in_planes = 3
        for i, planes in enumerate(widths):
            # One block per stage, stored as ``layerN.0`` like the release's Sequential.
            block = ResNet12Block(in_planes, planes, drop_rate, use_dropblock=i >= 2)
            setattr(self, f"layer{i + 1}", nn.Sequential(block))
            in_planes = planes
        # The release initialises before creating the heads, so the heads keep PyTorch's defaults.
        init_weights(self, lambda w: nn.init.kaiming_normal_(w, mode="fan_out", nonlinearity="leaky_relu"))
        self._add_rotation_head(rotation_head)  # order of the release: further, fc2, fc
        self._add_classifier(num_classes)

    layer1: nn.Module  # set with setattr in __init__
    layer2: nn.Module  # set with setattr in __init__
    layer3: nn.Module  # set with setattr in __init__
    layer4: nn.Module  # set with setattr in __init__

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


@register(
    "resnet12",
    feature_dim=640,
    min_input_size=16,
    summary="ResNet-12 64-160-320-640 with DropBlock (the paper's main backbone)",
)
def resnet12(*, num_classes: int = 0, rotation_head: bool = False) -> ResNet12:
    return ResNet12(num_classes=num_classes, rotation_head=rotation_head)
