"""Training-time image transforms by name: the paper's, a mild crop for glyph-like data, or none."""

from __future__ import annotations

from typing import Callable

from PIL import Image
from torchvision import transforms as T

from poodle.data import transforms
from poodle.defaults import IMAGENET_MEAN, IMAGENET_STD
from poodle.errors import ConfigError


class _ToRGB:
    """PIL image -> RGB (a class, not a lambda, so DataLoader workers can pickle it)."""

    deterministic = True  # a function of the image alone (see poodle.data.transforms.transform_stages)

    def __call__(self, img: Image.Image) -> Image.Image:
        return img if img.mode == "RGB" else img.convert("RGB")


def mild_crop_transform(image_size: int) -> Callable:
    """Random resized crop of 50-100% of the area with aspect 0.9-1.1, then ImageNet normalisation.

    For characters, where the paper's augmentation hurts: a horizontal flip turns many glyphs into
    other characters, and a crop of 8% of the area keeps a stroke fragment.
    """
    return T.Compose(
        [
            _ToRGB(),
            transforms.RandomResizedCrop(image_size, scale=(0.5, 1.0), ratio=(0.9, 1.1)),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def train_transform(kind: str, image_size: int) -> Callable:
    """``paper``: :func:`poodle.data.transforms.train_transform`; ``crop``: :func:`mild_crop_transform`;
    ``none``: the evaluation transform (resize, centre crop, normalise)."""
    if kind == "paper":
        return transforms.train_transform(image_size)
    if kind == "crop":
        return mild_crop_transform(image_size)
    if kind == "none":
        return transforms.eval_transform(image_size)
    raise ConfigError(f"unknown augmentation {kind!r}; choose paper, crop or none", param="augment", value=kind)
