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

from pathlib import Path
from typing import Callable, Iterable, Iterator

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
)
from poodle.data.transforms import eval_transform, load_rgb, train_transform
from poodle.errors import ConfigError, DataError

__all__ = [
    "DatasetSource",
    "CsvSource",
    "FolderSource",
    "CubSource",
    "resolve_dataset",
    "ImageDataset",
    "checked",
    "eval_transform",
    "train_transform",
    "load_rgb",
    "NAMES",
    "IMAGE_EXTENSIONS",
]


class ImageDataset(Dataset):
    """One split of a :class:`DatasetSource` as a torch Dataset of ``(image [3, H, W], label)``.

    ``label`` indexes ``self.classes`` (the split's sorted class names). ``on_error``:

    - ``"raise"`` (default): a bad image raises DataError naming it when loaded in the main
      process; inside a DataLoader worker it yields the sentinel, which :meth:`check` turns into the
      same DataError in the main process (use :func:`checked` around the loader).
    - ``"sentinel"``: always return the sentinel ``(zeros, -(index + 1))``; the caller skips or raises.
    """

    def __init__(
        self, source: DatasetSource, split: str, transform: Callable | None = None, *, on_error: str = "raise"
    ) -> None:
        if on_error not in ("raise", "sentinel"):
            raise ConfigError(f"on_error must be 'raise' or 'sentinel', got {on_error!r}")
        self.source = source
        self.split = split
        self.root = Path(source.root)
        self.samples = source.samples(split)
        self.classes = source.classes(split)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.targets = [self.class_to_idx[c] for _, c in self.samples]
        self.transform = transform if transform is not None else eval_transform()
        self.on_error = on_error
        self._shape: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def path(self, index: int) -> Path:
        return self.root / self.samples[index][0]

    def load(self, index: int) -> torch.Tensor:
        """The transformed image at ``index``; DataError naming the file if it does not decode."""
        p = self.path(index)
        try:
            img = self.source.open_image(self.samples[index][0])
        except Exception as e:  # noqa: BLE001 - PIL raises many types for damaged files
            raise DataError(
                f"cannot decode image {p}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from None
        return self.transform(img)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            x = self.load(index)
        except DataError:
            if self.on_error == "raise" and get_worker_info() is None:
                raise
            return torch.zeros(self._sentinel_shape()), -(index + 1)
        if self._shape is None:
            self._shape = tuple(x.shape)
        return x, self.targets[index]

    def _sentinel_shape(self) -> tuple[int, ...]:
        if self._shape is None:
            # Same shape as a good image, so batches still collate: transform a blank image once.
            self._shape = tuple(self.transform(Image.new("RGB", (256, 256))).shape)
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
        return DataError(f"cannot decode image {self.path(index)} (it failed in a DataLoader worker)")

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
