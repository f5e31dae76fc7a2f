"""The heads every backbone of the POODLE release carries (Le et al., "POODLE: Improving Few-shot
Learning via Penalizing Out-of-Distribution Samples", NeurIPS 2021; appendix A).

* the **classifier** over the base classes: one ``nn.Linear(D, num_classes)`` on the pooled feature,
  stored under the attribute name the release uses for that architecture (``fc``, ``linear`` or
  ``classifier``);
* the **rotation head** of the self-supervised baseline (Gidaris et al., "Boosting Few-Shot Visual
  Learning with Self-Supervision", ICCV 2019, arXiv:1906.05186): ``further``, a :class:`ConvBlock`
  ``C -> C`` applied to the final feature map, then global average pooling and
  ``fc2 = nn.Linear(C, 4)`` (0/90/180/270 degrees).

The state-dict keys are ``further.layers.Conv.weight``, ``further.layers.BatchNorm.*`` and
``fc2.{weight,bias}``, as in the release.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

ROTATIONS = 4


class ConvBlock(nn.Module):
    """3x3 conv (no bias) -> BatchNorm -> ReLU -> 2x2 max-pool, held in a Sequential named ``layers``.

    The max-pool is skipped on a map smaller than 2x2 (conv4 at 28x28 input ends at 1x1, where the
    release's pool would fail); it has no parameters, so the state-dict keys do not change.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            OrderedDict(
                [
                    ("Conv", nn.Conv2d(in_channels, out_channels, 3, stride=1, padding=1, bias=False)),
                    ("BatchNorm", nn.BatchNorm2d(out_channels)),
                    ("ReLU", nn.ReLU(inplace=True)),
                    ("MaxPool", nn.MaxPool2d(2)),
                ]
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, C_in, H, W] -> [B, C_out, H//2, W//2]`` (``[B, C_out, H, W]`` when H or W < 2)."""
        conv, bn, relu, pool = self.layers
        x = relu(bn(conv(x)))
        if min(x.shape[-2:]) >= 2:
            x = pool(x)
        return x


def global_pool(fmap: torch.Tensor) -> torch.Tensor:
    """Global average pooling: ``[B, C, H, W] -> [B, C]``."""
    return F.adaptive_avg_pool2d(fmap, 1).flatten(1)
