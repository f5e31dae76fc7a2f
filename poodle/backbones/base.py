"""The :class:`Backbone` interface and the registry of backbone names.

Every backbone of the POODLE release (Le et al., "POODLE: Improving Few-shot Learning via
Penalizing Out-of-Distribution Samples", NeurIPS 2021) is a CNN whose last feature map is globally
average-pooled into the vector that the feature cache stores; two optional heads sit on top (see
:mod:`poodle.backbones.heads`). A family module builds its network in :meth:`Backbone.forward_map`
and registers one small constructor per variant with :func:`register`, so the command line can list
what exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from poodle.backbones.heads import ROTATIONS, ConvBlock, global_pool
from poodle.errors import ConfigError


class Backbone(nn.Module):
    """A feature extractor with an optional classifier and an optional rotation head.

    Attributes:
        name: the registry name (``resnet12``, ...), set by :func:`build`.
        feature_dim: D, the length of the pooled feature (= channels of the last feature map).
        classifier_name: attribute that holds the classifier in the release (``fc``, ``linear`` or
            ``classifier``); it is ``None`` when the model was built with ``num_classes=0``.
        num_classes: number of base classes of the classifier (0 = none).
        rotation_head: whether ``further`` and ``fc2`` exist (else both are ``None``).
        min_input_size: smallest input side (pixels) the network accepts.
    """

    classifier_name: str = "fc"
    min_input_size: int = 1

    def __init__(self, feature_dim: int) -> None:
        super().__init__()
        self.name = type(self).__name__.lower()
        self.feature_dim = int(feature_dim)
        self.num_classes = 0
        self.rotation_head = False

    # ---- heads, created by the subclass in the release's registration order ------------------
    def _add_classifier(self, num_classes: int) -> None:
        self.num_classes = int(num_classes)
        head = nn.Linear(self.feature_dim, self.num_classes) if self.num_classes > 0 else None
        setattr(self, self.classifier_name, head)

    def _add_rotation_head(self, enabled: bool) -> None:
        self.rotation_head = bool(enabled)
        self.further = ConvBlock(self.feature_dim, self.feature_dim) if enabled else None
        self.fc2 = nn.Linear(self.feature_dim, ROTATIONS) if enabled else None

    @property
    def class_head(self) -> nn.Linear | None:
        """The classifier module (whatever the release calls it), or ``None``."""
        return getattr(self, self.classifier_name, None)

    def head_prefixes(self) -> dict[str, bool]:
        """State-dict prefixes of the heads (``"fc."``, ``"further."``, ``"fc2."``) -> present?"""
        return {
            self.classifier_name + ".": self.class_head is not None,
            "further.": self.further is not None,
            "fc2.": self.fc2 is not None,
        }

    def remap_release(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Family-specific fixes of a release state dict (prefix already stripped). Default: none."""
        return state_dict

    # ---- forward ------------------------------------------------------------------------------
    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        """The last feature map, ``x [B, 3, H, W] -> [B, D, h, w]``. Implemented by each family."""
        raise NotImplementedError

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ConfigError(
                f"{self.name} expects images [B, 3, H, W], got a tensor of shape {list(x.shape)}",
                param="x",
                value=tuple(x.shape),
            )
        if min(x.shape[-2:]) < self.min_input_size:
            raise ConfigError(
                f"{self.name} needs inputs of at least {self.min_input_size}x"
                f"{self.min_input_size} pixels, got {x.shape[-2]}x{x.shape[-1]}",
                param="x",
                value=tuple(x.shape),
            )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled pre-logit features, ``x [B, 3, H, W] -> [B, D]`` (what the release caches)."""
        self._check_input(x)
        return global_pool(self.forward_map(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``x [B, 3, H, W] -> (class_logits [B, num_classes] | None, rot_logits [B, 4] | None)``.

        The rotation head reads the final feature map (not the pooled vector), as in the release.
        """
        self._check_input(x)
        fmap = self.forward_map(x)
        head = self.class_head
        logits = head(global_pool(fmap)) if head is not None else None
        rot = None
        if self.further is not None:
            assert self.fc2 is not None  # further and fc2 exist together
            rot = self.fc2(global_pool(self.further(fmap)))
        return logits, rot

    def extra_repr(self) -> str:
        return (
            f"name={self.name}, feature_dim={self.feature_dim}, num_classes={self.num_classes}, "
            f"rotation_head={self.rotation_head}"
        )


def init_weights(
    module: nn.Module, conv_init: Callable[[torch.Tensor], object], *, zero_linear_bias: bool = False
) -> None:
    """``conv_init`` on every Conv2d weight, BatchNorm weight 1 and bias 0 (and Linear bias 0).

    Does nothing on the meta device, where only shapes exist (random draws there are slow).
    """
    for m in module.modules():
        if getattr(m, "weight", None) is not None and m.weight.is_meta:
            continue
        if isinstance(m, nn.Conv2d):
            conv_init(m.weight)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear) and zero_linear_bias:
            nn.init.zeros_(m.bias)


@dataclass(frozen=True)
class BackboneSpec:
    """A registry entry: ``constructor(num_classes=, rotation_head=)`` builds the model."""

    name: str
    constructor: Callable[..., Backbone]
    feature_dim: int
    min_input_size: int
    summary: str

    def __call__(self, *, num_classes: int = 0, rotation_head: bool = False) -> Backbone:
        return build(self.name, num_classes=num_classes, rotation_head=rotation_head)


BACKBONES: dict[str, BackboneSpec] = {}

# Names the release's ``--arch`` flag uses for the same networks.
ALIASES: dict[str, str] = {"wideres": "wrn28_10"}


def register(
    name: str, *, feature_dim: int, min_input_size: int, summary: str
) -> Callable[[Callable[..., Backbone]], Callable[..., Backbone]]:
    """Decorator that adds a constructor to :data:`BACKBONES` under ``name``."""

    def deco(fn: Callable[..., Backbone]) -> Callable[..., Backbone]:
        if name in BACKBONES:
            raise RuntimeError(f"backbone {name!r} registered twice")
        BACKBONES[name] = BackboneSpec(name, fn, feature_dim, min_input_size, summary)
        return fn

    return deco


def available() -> list[str]:
    """Registered backbone names, sorted."""
    return sorted(BACKBONES)


def get_spec(name: str) -> BackboneSpec:
    """The registry entry of ``name`` (or an alias); ConfigError listing the known names."""
    spec = BACKBONES.get(ALIASES.get(name, name))
    if spec is None:
        raise ConfigError(
            f"unknown backbone {name!r}; known backbones: {', '.join(available())}", param="backbone", value=name
        )
    return spec


def build(name: str, *, num_classes: int = 0, rotation_head: bool = False) -> Backbone:
    """Build backbone ``name`` with a ``num_classes``-way classifier (none when 0) and, when
    ``rotation_head``, the 4-way rotation head. Weights are freshly initialised."""
    spec = get_spec(name)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise ConfigError.bad_value("num_classes", num_classes, "must be an integer >= 0")
    model = spec.constructor(num_classes=num_classes, rotation_head=bool(rotation_head))
    model.name = spec.name
    return model
