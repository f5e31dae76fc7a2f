"""Datasets: where images are (:mod:`poodle.data.sources`; :mod:`poodle.data.resolve` picks the source
of a dataset name), how they are transformed (:mod:`poodle.data.transforms`), and a torch Dataset
over one split (:class:`ImageDataset`).

    >>> from poodle.data import resolve_dataset, ImageDataset
    >>> from poodle.data.transforms import eval_transform
    >>> source = resolve_dataset("mini", "data/mini-imagenet", cache_root="cache")
    >>> ds = ImageDataset(source, "train", eval_transform(84))   # ds[i] -> (tensor [3, 84, 84], label)

An image that does not decode inside a DataLoader worker would surface as a worker traceback, so
the dataset returns a sentinel instead (a zero image and the negative label ``-(index + 1)``) and
the main process turns it into a clean :class:`~poodle.errors.DataError` with :meth:`ImageDataset.check`
(or :func:`checked`), or skips it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, get_worker_info

from poodle.data.resolve import resolve_dataset
from poodle.data.sources import (
    IMAGE_EXTENSIONS,
    NAMES,
    CsvSource,
    CubSource,
    DatasetSource,
    FolderSource,
    ListedSource,
)
from poodle.data.transforms import Identity, eval_transform, load_rgb, train_transform, transform_stages
from poodle.errors import ConfigError, DataError

__all__ = [
    "DatasetSource",
    "CsvSource",
    "FolderSource",
    "CubSource",
    "ListedSource",
    "resolve_dataset",
    "ImageDataset",
    "PixelCache",
    "checked",
    "eval_transform",
    "train_transform",
    "load_rgb",
    "NAMES",
    "IMAGE_EXTENSIONS",
]


class PixelCache:
    """Decoded images kept in memory, by file, within a budget of ``max_bytes`` bytes of pixels.

    Holds the decoded PIL images (RGB or L) keyed by ``(source type, file path)``, counted by the
    bytes of their uint8 ``[H, W, C]`` (or ``[H, W]``) pixels; several :class:`ImageDataset` over the
    same files (with different transforms) may share one. An image that does not fit what is left
    of the budget is not stored; nothing is ever evicted. Images, not arrays, because rebuilding a
    PIL image from an array on every load cost as much as the augmentation of a 28 px image (PIL
    keeps RGB in 4 bytes per pixel, so the memory held is up to 4/3 of the budget).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ConfigError(
                f"the pixel cache's budget must be >= 0 bytes, got {max_bytes}", param="max_bytes", value=max_bytes
            )
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._images: dict[tuple[str, str], Image.Image] = {}

    def __len__(self) -> int:
        return len(self._images)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._images

    def get(self, key: tuple[str, str]) -> np.ndarray | None:
        """The pixels kept under ``key`` (a uint8 array, a copy), or None."""
        img = self._images.get(key)
        return None if img is None else np.asarray(img)

    def image(self, key: tuple[str, str]) -> Image.Image | None:
        """A copy of the image kept under ``key`` (the caller may change it), or None."""
        img = self._images.get(key)
        return None if img is None else img.copy()

    def put(self, key: tuple[str, str], pixels: np.ndarray | Image.Image) -> bool:
        """Keep ``pixels`` (a uint8 array or an RGB / L image, copied) under ``key`` if they fit the
        budget; whether they were kept."""
        if key in self._images:
            return True
        img = pixels.copy() if isinstance(pixels, Image.Image) else Image.fromarray(np.asarray(pixels))
        nbytes = img.width * img.height * len(img.getbands())
        if self.nbytes + nbytes > self.max_bytes:
            return False
        self._images[key] = img
        self.nbytes += nbytes
        return True

    def clear(self) -> None:
        self._images.clear()
        self.nbytes = 0


class ImageDataset(Dataset):
    """One split of a :class:`DatasetSource` as a torch Dataset of ``(image [3, H, W], label)``.

    ``label`` indexes ``self.classes`` (the split's sorted class names). ``on_error``:

    - ``"raise"`` (default): a bad image raises DataError naming it when loaded in the main
      process; inside a DataLoader worker it yields the sentinel, which :meth:`check` turns into the
      same DataError in the main process (use :func:`checked` around the loader).
    - ``"sentinel"``: always return the sentinel ``(zeros, -(index + 1))``; the caller skips or raises.

    Three options make repeated passes and batches cheaper without changing a single value:

    - ``cache_bytes``: keep decoded images in memory, up to this many bytes of pixels (uint8
      ``[H, W, C]`` arrays, per process), so that later epochs skip decoding. Filled as images are
      loaded (or all at once by :meth:`preload`); once the budget is spent, further images are decoded
      every time. A bad image is never cached. 0 (default): no cache.
    - ``cache``: a :class:`PixelCache` to use instead, shared with other datasets over the same files
      (``poodle demo`` shares one between training, validation and extraction).
    - ``uint8``: items are uint8 ``[3, H, W]`` pixels, and :attr:`finish` turns a collated batch
      ``[B, 3, H, W]`` into float32 ``[B, 3, H, W]`` (ToTensor's ``/ 255`` and the normalisation, once
      per batch instead of per image), equal bit for bit to stacking the float items. Only when the
      transform ends in ToTensor[, Normalize]; otherwise items stay as the transform makes them and
      :attr:`finish` is the identity, so ``finish(batch)`` is always what the model takes.
    """

    def __init__(
        self,
        source: DatasetSource,
        split: str,
        transform: Callable | None = None,
        *,
        on_error: str = "raise",
        cache_bytes: int = 0,
        cache: PixelCache | None = None,
        uint8: bool = False,
    ) -> None:
        if on_error not in ("raise", "sentinel"):
            raise ConfigError.bad_value("on_error", on_error, "must be 'raise' or 'sentinel'")
        if cache_bytes < 0:
            raise ConfigError.bad_value("cache_bytes", cache_bytes, "must be >= 0")
        self.source = source
        self.split = split
        self.root = Path(source.root)
        self.samples = source.samples(split)
        self.classes = source.classes(split)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.targets = [self.class_to_idx[c] for _, c in self.samples]
        self.transform = transform if transform is not None else eval_transform()
        self.on_error = on_error
        self.stages = transform_stages(self.transform)
        rest_uint8, finish = self.stages.rest_uint8, self.stages.finish
        self.uint8 = bool(uint8 and rest_uint8 is not None and finish is not None)
        self._rest = rest_uint8 if self.uint8 and rest_uint8 is not None else self.stages.rest
        self.finish: Callable[[torch.Tensor], torch.Tensor] = (
            finish if self.uint8 and finish is not None else Identity()
        )
        self.cache = cache if cache is not None else (PixelCache(cache_bytes) if cache_bytes else None)
        self._shape: tuple[int, ...] | None = None
        self._dtype: torch.dtype | None = None
        self._keys: list[tuple[str, str]] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def path(self, index: int) -> Path:
        return self.root / self.samples[index][0]

    def _decode(self, index: int) -> Image.Image:
        p = self.path(index)
        try:
            return self.source.open_image(self.samples[index][0])
        except Exception as e:  # noqa: BLE001 - PIL raises many types for damaged files
            raise DataError(
                f"cannot decode image {p}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                param="root",
                value=p,
            ) from None

    def _key(self, index: int) -> tuple[str, str]:
        if self._keys is None:  # built once: a path join per load costs as much as a 28 px crop
            kind = type(self.source).__name__
            self._keys = [(kind, str(self.root / rel)) for rel, _ in self.samples]
        return self._keys[index]

    def _fixed(self, index: int) -> Image.Image:
        """The image after the transform's deterministic steps; decoded pixels come from the cache
        when it holds them."""
        cache = self.cache
        img = cache.image(self._key(index)) if cache is not None else None  # a copy
        if img is None:
            img = self._decode(index)
            if cache is not None and img.mode in ("RGB", "L"):
                cache.put(self._key(index), img)
        return self.stages.fixed(img)

    def load(self, index: int) -> torch.Tensor:
        """The transformed image at ``index`` (uint8 with ``uint8=True``); DataError naming the file
        if it does not decode."""
        return self._rest(self._fixed(index))

    def preload(self) -> bool:
        """Decode every image into the cache now, in this process, when the split fits what is left
        of the budget (estimated from its first image); DataLoader workers forked afterwards share
        it. Bad images are left for loading to report. Returns whether every image is cached."""
        cache = self.cache
        if cache is None or not len(self):
            return False
        with contextlib.suppress(DataError):
            self._fixed(0)
        first = cache.get(self._key(0))
        if first is None or first.nbytes * (len(self) - 1) > cache.max_bytes - cache.nbytes:
            return False
        for i in range(1, len(self)):
            if self._key(i) not in cache:
                with contextlib.suppress(DataError):
                    self._fixed(i)
        return all(self._key(i) in cache for i in range(len(self)))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            x = self.load(index)
        except DataError:
            if self.on_error == "raise" and get_worker_info() is None:
                raise
            return torch.zeros(self._sentinel_shape(), dtype=self._dtype), -(index + 1)
        if self._shape is None:
            self._shape, self._dtype = tuple(x.shape), x.dtype
        return x, self.targets[index]

    def _sentinel_shape(self) -> tuple[int, ...]:
        if self._shape is None:
            # Same shape and type as a good image, so batches still collate: transform a blank image once.
            x = self._rest(self.stages.fixed(Image.new("RGB", (256, 256))))
            self._shape, self._dtype = tuple(x.shape), x.dtype
        return self._shape

    @staticmethod
    def bad_indices(labels: torch.Tensor) -> list[int]:
        """Dataset indices of the sentinels in a batch of labels."""
        return [-(int(v) + 1) for v in labels[labels < 0].tolist()]

    def error(self, index: int) -> DataError:
        """The DataError for the image at ``index`` (decoded again here to get PIL's reason)."""
        try:
            self.load(index)
        except DataError as e:
            return e
        return DataError(
            f"cannot decode image {self.path(index)} (it failed in a DataLoader worker)",
            param="root",
            value=self.path(index),
        )

    def check(self, labels: torch.Tensor) -> None:
        """Raise DataError for the first sentinel among a batch's labels, if any."""
        bad = self.bad_indices(labels)
        if bad:
            raise self.error(bad[0])


def checked(
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]], dataset: ImageDataset
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Iterate a DataLoader over ``dataset``, raising a clean DataError at the first bad image."""
    for x, y in loader:
        dataset.check(y)
        yield x, y
