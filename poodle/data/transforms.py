"""Image transforms of the paper's code (docs/reference.md §5), and the image loader.

- :func:`eval_transform`: resize the shorter side to ``int(size * 256 / 224)`` (96 for 84), centre
  crop ``size``, to tensor, ImageNet mean/std. This is what the release uses for the final
  evaluation and feature extraction (``enlarge=True``).
- :func:`train_transform`: RandomResizedCrop(size) with torchvision's defaults, then the
  ``ImageJitter`` of brightness, contrast and colour (each factor ``1 + 0.4 * (2u - 1)``,
  in that order), horizontal flip, to tensor, ImageNet mean/std.

Images are always decoded to RGB first (:func:`load_rgb`). Each returned transform carries a
``description`` string; the feature cache records it, so features made with another transform are
never mixed with these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image, ImageEnhance
from torchvision import transforms as T

from poodle.defaults import IMAGENET_MEAN, IMAGENET_STD

JITTER = 0.4  # brightness, contrast and colour strength of the release's ImageJitter


def load_rgb(path: str | Path) -> Image.Image:
    """Decode an image file into an RGB PIL image (raises what PIL raises on a bad file).

    Images with more than 8 bits per channel (16-bit PNG: modes ``I;16*``/``I``; float TIFF: mode
    ``F``) are first mapped to 8 bits by their real range, since PIL's RGB conversion clips every
    value above 255 to white: integers by 65535 (values up to 255 are taken as 8-bit), floats in
    [0, 1] by 1 and floats in [0, 255] as they are. Anything else is a ValueError naming the range.
    """
    with open(path, "rb") as fh:
        img = Image.open(fh)
        if img.mode in ("I", "F") or img.mode.startswith("I;16"):
            return _wide_to_8bit(img).convert("RGB")
        return img.convert("RGB")


def _wide_to_8bit(img: Image.Image) -> Image.Image:
    a = np.asarray(img)
    a = a.astype(np.float64)
    if a.size == 0:
        return Image.fromarray(a.astype(np.uint8), mode="L")
    lo, hi = float(a.min()), float(a.max())
    if not np.isfinite(a).all():
        raise ValueError(f"{img.mode} image has non-finite pixel values")
    if img.mode == "F":
        if lo >= 0 and hi <= 1:
            scale = 255.0
        elif lo >= 0 and hi <= 255:
            scale = 1.0
        else:
            raise ValueError(f"float image with values in [{lo:g}, {hi:g}]: expected [0, 1] or [0, 255]")
    else:
        if lo < 0 or hi > 65535:
            raise ValueError(f"{img.mode} image with values in [{lo:g}, {hi:g}]: expected 16-bit data (0..65535)")
        # 16-bit data: full range; an "I" image whose values all fit 8 bits is 8-bit data in a wide mode
        scale = 255.0 / 65535.0 if (img.mode.startswith("I;16") or hi > 255) else 1.0
    return Image.fromarray(np.clip(np.rint(a * scale), 0, 255).astype(np.uint8), mode="L")


def resize_size(image_size: int) -> int:
    """The shorter-side size the evaluation transform resizes to: ``int(size * 256 / 224)``."""
    return int(image_size * 256 / 224)


class ImageJitter:
    """Random brightness, contrast and colour (saturation) enhancement, applied in that order.

    Each factor is ``1 + strength * (2u - 1)`` with ``u ~ U[0, 1)`` drawn by ``torch.rand`` (so the
    DataLoader's per-worker torch seeding governs it), as in the release's ``ImageJitter``.
    """

    def __init__(self, brightness: float = JITTER, contrast: float = JITTER, color: float = JITTER) -> None:
        self.params = [
            (ImageEnhance.Brightness, brightness),
            (ImageEnhance.Contrast, contrast),
            (ImageEnhance.Color, color),
        ]

    def __call__(self, img: Image.Image) -> Image.Image:
        u = torch.rand(len(self.params))
        for (enhancer, strength), ui in zip(self.params, u.tolist()):
            img = enhancer(img).enhance(1.0 + strength * (2.0 * ui - 1.0))
        return img

    def __repr__(self) -> str:
        return "ImageJitter(brightness={}, contrast={}, color={})".format(*(s for _, s in self.params))


def eval_transform(image_size: int = 84) -> Callable[[Image.Image], torch.Tensor]:
    """PIL RGB image -> float32 [3, image_size, image_size] tensor, as the paper evaluates."""
    if image_size < 1:
        raise ValueError(f"image size must be positive, got {image_size}")
    r = resize_size(image_size)
    tf = T.Compose([T.Resize(r), T.CenterCrop(image_size), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    tf.description = (
        f"eval: RGB, resize shorter side to {r} (bilinear), center crop {image_size}, normalize ImageNet mean/std"
    )
    return tf


def train_transform(image_size: int = 84) -> Callable[[Image.Image], torch.Tensor]:
    """PIL RGB image -> augmented float32 [3, image_size, image_size] tensor (the paper's training)."""
    if image_size < 1:
        raise ValueError(f"image size must be positive, got {image_size}")
    tf = T.Compose(
        [
            T.RandomResizedCrop(image_size),
            ImageJitter(),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    tf.description = (
        f"train: RGB, random resized crop {image_size} (scale 0.08-1, ratio 3/4-4/3), "
        f"jitter brightness/contrast/colour {JITTER}, horizontal flip, normalize ImageNet mean/std"
    )
    return tf


class _ExactSize:
    """Passes an image of side ``size`` through; any other size is an error, never silently rescaled."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        if img.size != (self.size, self.size):
            raise ValueError(f"image is {img.size[0]}x{img.size[1]}, expected {self.size}x{self.size}")
        return img


def native_eval_transform(image_size: int) -> Callable[[Image.Image], torch.Tensor]:
    """For datasets whose images all have side ``image_size`` (CIFAR's 32): no resize, no crop."""
    tf = T.Compose([_ExactSize(image_size), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    tf.description = f"eval: RGB, native {image_size}x{image_size} (no resize, no crop), normalize ImageNet mean/std"
    return tf
