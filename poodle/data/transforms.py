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

:func:`transform_stages` cuts such a transform in three for :class:`poodle.data.ImageDataset`: the
deterministic leading steps (a function of the image alone), the per-image rest ending in
uint8 pixels, and the float conversion and normalisation, applied to a whole collated batch
(:class:`BatchFinish`, a lookup into a table that the per-image operations themselves computed for
every byte value and channel), so a finished batch equals the stack of the per-image outputs exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageEnhance
from torchvision import transforms as T
from torchvision.transforms import functional as TF

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


class RandomResizedCrop(T.RandomResizedCrop):
    """``T.RandomResizedCrop`` with the log of its aspect-ratio range computed once, not for every image.

    ``get_params`` of torchvision builds ``torch.log(torch.tensor(ratio))`` and indexes it on every call,
    about a tenth of a 28 px image's loading time. This is the same procedure with those values kept:
    the same random draws from the global generator, in the same order, the same float32 ``exp``, and so
    the same crops (tests/test_pipeline.py compares the two over thousands of draws)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        log_ratio = torch.log(torch.tensor(self.ratio))
        self._log_ratio = (float(log_ratio[0]), float(log_ratio[1]))  # what uniform_ receives per call

    def forward(self, img):
        if isinstance(img, Image.Image) and len(self.size) == 2:
            # What TF.resized_crop does with a PIL image (crop, then PIL's resize unless the crop
            # already has the output size; PIL always antialiases), without its dispatch layers,
            # which cost more than the crop and the resize of a 28 px image.
            width, height = img.size
            i, j, h, w = self._params_hw(height, width)
            img = img.crop((j, i, j + w, i + h))
            if (h, w) == (self.size[0], self.size[1]):
                return img
            return img.resize((self.size[1], self.size[0]), TF.pil_modes_mapping[self.interpolation])
        i, j, h, w = self._params(img)
        return TF.resized_crop(img, i, j, h, w, self.size, self.interpolation, antialias=self.antialias)

    def _params(self, img) -> tuple[int, int, int, int]:
        _, height, width = TF.get_dimensions(img)
        return self._params_hw(height, width)

    def _params_hw(self, height: int, width: int) -> tuple[int, int, int, int]:
        area = height * width
        scale, ratio, (lo, hi) = self.scale, self.ratio, self._log_ratio
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(lo, hi)).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return int(i), int(j), h, w
        # torchvision's fallback: a central crop
        in_ratio = float(width) / float(height)
        if in_ratio < min(ratio):
            w = width
            h = int(round(w / min(ratio)))
        elif in_ratio > max(ratio):
            h = height
            w = int(round(h * max(ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


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
            RandomResizedCrop(image_size),
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

    deterministic = True  # see transform_stages: its output depends on the image alone

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


# --------------------------------------------------------------------------------------------- stages

# PIL steps whose output is a function of the input image alone (no randomness).
_DETERMINISTIC = (T.Resize, T.CenterCrop)


def _is_deterministic(step: object) -> bool:
    return isinstance(step, _DETERMINISTIC) or bool(getattr(step, "deterministic", False))


class ToUint8Tensor:
    """PIL image (mode RGB or L) -> uint8 ``[C, H, W]`` tensor: ``T.ToTensor`` without its ``/ 255``
    (which :class:`BatchFinish` applies to the batch), in the same contiguous CHW layout."""

    def __call__(self, img: Image.Image) -> torch.Tensor:
        if img.mode not in ("RGB", "L"):
            raise TypeError(f"ToUint8Tensor takes RGB or L images, got mode {img.mode}")
        a = np.asarray(img, dtype=np.uint8)  # [H, W, C], or [H, W] for L
        if a.ndim == 2:
            a = a[:, :, None]
        return torch.from_numpy(np.array(a.transpose(2, 0, 1), order="C"))  # a writable contiguous copy

    def __repr__(self) -> str:
        return "ToUint8Tensor()"


class BatchFinish:
    """uint8 ``[B, C, H, W]`` -> float ``[B, C, H, W]``: ToTensor's conversion (to the default float
    dtype, then ``/ 255``) and the Normalize step if any, on a collated batch.

    Both are elementwise and per channel, so each output value is a function of its byte and its
    channel alone: the batch is finished by looking values up in a ``[C, 256]`` table made by those
    very operations (``ToTensor``'s ``to(float).div(255)``, then the ``Normalize`` object itself) on
    the 256 byte values of every channel. The result therefore equals the stack of the per-image
    outputs bit for bit. The lookup runs in numpy, single-threaded: torch would split a batch-sized
    elementwise operation over its threads, and on a busy machine waiting for the second thread cost
    more than the whole operation (0.5 ms per 28 px image on 2 shared cores, against 5 us here).
    """

    def __init__(self, normalize: T.Normalize | None = None) -> None:
        self.normalize = normalize
        self._tables: dict[tuple[int, torch.dtype], np.ndarray] = {}
        self._device_tables: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}

    def table(self, channels: int) -> np.ndarray:
        """``[channels, 256]``: the finished value of byte v in channel c, in the default float dtype."""
        key = (channels, torch.get_default_dtype())
        t = self._tables.get(key)
        if t is None:
            v = torch.arange(256, dtype=torch.uint8).repeat(channels, 1).view(channels, 1, 256)
            y = v.to(dtype=torch.get_default_dtype()).div(255)  # T.ToTensor's conversion of a byte image
            if self.normalize is not None:
                y = self.normalize(y)
            t = self._tables[key] = y.reshape(channels, 256).numpy()
        return t

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, C, H, W]`` on any device -> float ``[B, C, H, W]`` on that device. On a GPU the
        lookup runs there, so the uint8 batch (a quarter of the bytes) is what crosses the bus."""
        if x.dtype != torch.uint8 or x.dim() != 4:
            raise TypeError(f"BatchFinish takes uint8 image batches [B, C, H, W], got {x.dtype} {tuple(x.shape)}")
        if x.device.type != "cpu":
            return self._lookup_torch(x)
        table = self.table(x.shape[1])
        xn = x.numpy()
        out = np.empty(xn.shape, dtype=table.dtype)
        for c in range(xn.shape[1]):
            np.take(table[c], xn[:, c], out=out[:, c], mode="wrap")  # bytes index 0..255: never wraps
        return torch.from_numpy(out)

    def _lookup_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same lookup with torch indexing on ``x``'s device (a gather: no arithmetic, same values)."""
        c = x.shape[1]
        key = (c, torch.get_default_dtype(), str(x.device))
        table = self._device_tables.get(key)
        if table is None:
            table = self._device_tables[key] = torch.from_numpy(self.table(c)).to(x.device)
        channel = torch.arange(c, device=x.device).view(1, c, 1, 1)
        return table[channel, x.long()].contiguous()

    def __repr__(self) -> str:
        return f"BatchFinish({self.normalize!r})"


class Identity:
    """Returns its input: an empty stage, and the finish of a dataset whose images are already final."""

    def __call__(self, x: Any) -> Any:
        return x


def _compose(steps: list) -> Callable:
    if not steps:
        return Identity()  # the identity, picklable
    return steps[0] if len(steps) == 1 else T.Compose(steps)


@dataclass
class TransformStages:
    """A transform cut in stages; ``rest(fixed(img))`` is ``transform(img)``.

    Attributes:
        fixed: the leading deterministic PIL steps (resize, centre crop, RGB/size checks), PIL -> PIL:
            their output is a function of the image alone.
        rest: the remaining steps, PIL -> the transform's output (float ``[C, H, W]``).
        rest_uint8: the remaining steps with ToTensor and Normalize replaced by :class:`ToUint8Tensor`,
            PIL -> uint8 ``[C, H, W]``; None when the transform does not end in ToTensor[, Normalize].
        finish: uint8 ``[B, C, H, W]`` -> what stacking ``rest`` outputs gives, float ``[B, C, H, W]``;
            None with ``rest_uint8``.
    """

    fixed: Callable[[Image.Image], Image.Image]
    rest: Callable[[Image.Image], torch.Tensor]
    rest_uint8: Callable[[Image.Image], torch.Tensor] | None
    finish: BatchFinish | None


def transform_stages(transform: Callable) -> TransformStages:
    """Cut ``transform`` (a ``T.Compose`` as :func:`eval_transform` and the training transforms build,
    or any callable, which then is one opaque stage) into :class:`TransformStages`."""
    steps = list(transform.transforms) if isinstance(transform, T.Compose) else None
    if steps is None:
        return TransformStages(Identity(), transform, None, None)
    k = 0
    while k < len(steps) and _is_deterministic(steps[k]):
        k += 1
    fixed, rest = steps[:k], steps[k:]
    rest_uint8, finish = None, None
    # ToTensor, or ToTensor then Normalize, at the end (a Normalize with inplace=True would change its
    # input, which the batched form does not mirror; torchvision's transforms build it with False)
    if rest and isinstance(rest[-1], T.ToTensor):
        rest_uint8, finish = _compose([*rest[:-1], ToUint8Tensor()]), BatchFinish(None)
    elif len(rest) >= 2 and isinstance(rest[-2], T.ToTensor) and isinstance(rest[-1], T.Normalize):
        if not rest[-1].inplace:
            rest_uint8, finish = _compose([*rest[:-2], ToUint8Tensor()]), BatchFinish(rest[-1])
    return TransformStages(_compose(fixed), _compose(rest), rest_uint8, finish)
