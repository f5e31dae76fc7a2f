"""CIFAR-FS and FC100 read from CIFAR-100's binary distribution (never the pickled Python one).

The binary files are sequences of 3,074-byte records: the coarse label (1 byte), the fine label
(1 byte), then the 32 x 32 image as 1,024 red, 1,024 green and 1,024 blue bytes, rows top to
bottom. ``train.bin`` holds 50,000 records and ``test.bin`` 10,000; few-shot splits pool both
(600 images per class) and divide the 100 classes:

- ``cifar-fs`` (Bertinetto et al., ICLR 2019): 64 / 16 / 20 fine classes, lists in
  ``poodle/data/splits/cifar-fs/``.
- ``fc100`` (Oreshkin et al., NeurIPS 2018): 12 / 4 / 4 superclasses (the coarse labels), hence
  60 / 20 / 20 fine classes, lists in ``poodle/data/splits/fc100/``.

A split's samples are the records of its classes, ``train.bin`` first, each file in record order;
the sample path is ``<file relative to the root>#<record index>``. The files are memory-mapped (in
every DataLoader worker, on first use), so nothing is decoded or held in memory ahead of use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from poodle.data.sources import SPLITS, DatasetSource, split_list
from poodle.errors import DataError, mark

RECORD = 3074  # 2 label bytes + 3 * 32 * 32 pixels
SIDE = 32
FILES = ("train.bin", "test.bin")


class CifarSource(DatasetSource):
    """``cifar-fs`` or ``fc100`` from the CIFAR-100 binary files in ``bin_dir``."""

    native_size = SIDE

    def __init__(self, root: Path, bin_dir: Path, name: str) -> None:
        if name not in ("cifar-fs", "fc100"):
            raise DataError(f"CIFAR-100 splits are cifar-fs and fc100, not {name!r}", param="name", value=name)
        super().__init__(name, root)
        self.bin_dir = Path(bin_dir)
        self.files = [self.bin_dir / f for f in FILES]
        for f in self.files:
            if not f.is_file():
                raise DataError(
                    f"{mark('dataset')} {name}: {f} does not exist (CIFAR-100's binary version: train.bin, "
                    f"test.bin, fine_label_names.txt, coarse_label_names.txt)",
                    param="data_root",
                    value=root,
                )
            size = f.stat().st_size
            if size == 0 or size % RECORD:
                raise DataError(
                    f"{f}: {size} bytes is not a whole number of {RECORD}-byte CIFAR-100 records",
                    param="bin_dir",
                    value=bin_dir,
                )
        self.fine_names = self._names("fine_label_names.txt")
        self.coarse_names = self._names("coarse_label_names.txt") if name == "fc100" else None
        self._maps: dict[Path, np.ndarray] = {}

    @classmethod
    def find(cls, root: Path, name: str) -> CifarSource:
        """The binary files in ``root`` or ``root/cifar-100-binary``."""
        for d in (root, root / "cifar-100-binary"):
            if (d / FILES[0]).is_file():
                return cls(root, d, name)
        raise DataError(
            f"{mark('dataset')} {name}: no {FILES[0]} in {root} or {root / 'cifar-100-binary'} (CIFAR-100's "
            f"binary version; the Python version's pickles are not read)",
            param="data_root",
            value=root,
        )

    def describe(self) -> str:
        return f"{self.name}: CIFAR-100 binary files in {self.bin_dir}"

    def __getstate__(self) -> dict[str, Any]:  # a worker maps the files itself instead of receiving copies
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def _names(self, filename: str) -> list[str]:
        path = self.bin_dir / filename
        if not path.is_file():
            raise DataError(
                f"{mark('dataset')} {self.name}: {path} does not exist",
                param="bin_dir",
                value=self.bin_dir,
            )
        names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        dup = {n for n in names if names.count(n) > 1}
        if not names or dup:
            raise DataError(
                f"{path}: " + ("no label names" if not names else f"label {sorted(dup)[0]!r} listed twice"),
                param="bin_dir",
                value=self.bin_dir,
            )
        return names

    def _map(self, path: Path) -> np.ndarray:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, RECORD)
        return self._maps[path]

    def splits(self) -> list[str]:
        return list(SPLITS)

    def _labels(self, path: Path) -> tuple[np.ndarray, np.ndarray]:
        """(coarse, fine) label of every record of ``path``, checked against the label name files."""
        m = self._map(path)
        coarse, fine = np.asarray(m[:, 0]), np.asarray(m[:, 1])
        for labels, names, what in ((fine, self.fine_names, "fine"), (coarse, self.coarse_names, "coarse")):
            if names is not None and labels.size and int(labels.max()) >= len(names):
                i = int(np.argmax(labels >= len(names)))
                raise DataError(
                    f"{path} record {i}: {what} label {int(labels[i])} but {len(names)} {what} label names",
                    param="bin_dir",
                    value=self.bin_dir,
                )
        return coarse, fine

    def _list(self, split: str) -> list[tuple[str, str]]:
        if split not in SPLITS:
            raise DataError(
                f"{mark('dataset')} {self.name} has splits {', '.join(SPLITS)}; not {split!r}",
                param="split",
                value=split,
            )
        labels = [self._labels(f) for f in self.files]
        if self.name == "cifar-fs":
            wanted = split_list("cifar-fs", split)
            index = {n: i for i, n in enumerate(self.fine_names)}
            missing = [c for c in wanted if c not in index]
            if missing:
                raise DataError(
                    f"{self.bin_dir / 'fine_label_names.txt'} has no class {missing[0]!r} "
                    f"of the CIFAR-FS {split} split",
                    param="bin_dir",
                    value=self.bin_dir,
                )
            keep = np.zeros(len(self.fine_names), dtype=bool)
            keep[[index[c] for c in wanted]] = True
            masks = [keep[fine] for _, fine in labels]
            groups = wanted
        else:
            assert self.coarse_names is not None
            wanted = split_list("fc100", split)
            index = {n: i for i, n in enumerate(self.coarse_names)}
            missing = [c for c in wanted if c not in index]
            if missing:
                raise DataError(
                    f"{self.bin_dir / 'coarse_label_names.txt'} has no superclass {missing[0]!r} of "
                    f"the FC100 {split} split",
                    param="bin_dir",
                    value=self.bin_dir,
                )
            keep = np.zeros(len(self.coarse_names), dtype=bool)
            keep[[index[c] for c in wanted]] = True
            masks = [keep[coarse] for coarse, _ in labels]
            groups = wanted
            self._check_hierarchy(labels)
        out: list[tuple[str, str]] = []
        for f, mask, (_, fine) in zip(self.files, masks, labels):
            rel = f.relative_to(self.root).as_posix()
            out.extend((f"{rel}#{i}", self.fine_names[int(fine[i])]) for i in np.flatnonzero(mask).tolist())
        present = {c for _, c in out}
        if self.name == "cifar-fs":
            empty = [c for c in groups if c not in present]
        else:
            assert self.coarse_names is not None
            seen = {
                self.coarse_names[int(c)] for (coarse, _), mask in zip(labels, masks) for c in np.unique(coarse[mask])
            }
            empty = [c for c in groups if c not in seen]
        if empty:
            raise DataError(
                f"{mark('dataset')} {self.name}: class {empty[0]!r} of the {split} split has no images in "
                f"{', '.join(str(f) for f in self.files)}",
                param="bin_dir",
                value=self.bin_dir,
            )
        return out

    def _check_hierarchy(self, labels: list[tuple[np.ndarray, np.ndarray]]) -> None:
        # FC100 splits by superclass: a fine class under two superclasses would land in two splits.
        parent: dict[int, int] = {}
        for coarse, fine in labels:
            pairs = np.unique(np.stack([fine, coarse], 1), axis=0) if fine.size else np.zeros((0, 2), np.uint8)
            for f, c in pairs.tolist():
                if parent.setdefault(f, c) != c:
                    raise DataError(
                        f"{self.bin_dir}: fine class {self.fine_names[f]!r} appears under superclasses "
                        f"{parent[f]} and {c}; the files are not CIFAR-100's",
                        param="bin_dir",
                        value=self.bin_dir,
                    )

    def open_image(self, rel_path: str) -> Image.Image:
        """The 32 x 32 RGB image of ``<file>#<record>``."""
        name, sep, idx = rel_path.rpartition("#")
        if not sep or not idx.isdigit():
            raise DataError(
                f"{rel_path!r} is not a CIFAR record path (<file>#<index>)", param="rel_path", value=rel_path
            )
        m = self._map(self.root / name)
        i = int(idx)
        if i >= m.shape[0]:
            raise DataError(
                f"{self.root / name} has {m.shape[0]} records, not {i + 1}", param="rel_path", value=rel_path
            )
        pixels = np.asarray(m[i, 2:]).reshape(3, SIDE, SIDE).transpose(1, 2, 0)
        return Image.fromarray(np.ascontiguousarray(pixels), "RGB")


def write_cifar100_binary(path: str | Path, images: np.ndarray, fine: np.ndarray, coarse: np.ndarray) -> Path:
    """Write records in CIFAR-100's binary format: ``images`` uint8 [N, 32, 32, 3], labels [N].

    For tests and for users converting their own 32 x 32 data; the inverse of :meth:`CifarSource.open_image`.
    """
    images = np.asarray(images, dtype=np.uint8)
    n = images.shape[0]
    if images.shape[1:] != (SIDE, SIDE, 3) or np.shape(fine) != (n,) or np.shape(coarse) != (n,):
        raise DataError(
            f"expected images [N, 32, 32, 3] and labels [N], got {images.shape}, {np.shape(fine)}, {np.shape(coarse)}",
            param="images",
            value=tuple(images.shape),
        )
    rec = np.empty((n, RECORD), dtype=np.uint8)
    rec[:, 0] = coarse
    rec[:, 1] = fine
    rec[:, 2:] = images.transpose(0, 3, 1, 2).reshape(n, -1)
    path = Path(path)
    path.write_bytes(rec.tobytes())
    return path
