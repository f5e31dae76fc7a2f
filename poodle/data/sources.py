"""Where the images of a dataset are and which split and class each belongs to.

A :class:`DatasetSource` lists, per split, ``(relative_path, class_name)`` pairs; paths are relative
to ``source.root`` (the ``--data-root`` given, or the generated glyphs folder). Class names are the
label strings of the split files (e.g. wnids) or the class folder names; a split's class order is
the sorted order of its names (plain string order, as the authors' loader: "10" < "2").

Layouts (see docs/stage1.md):

- ``csv``: ``<root>/images/<filename>`` and ``<root>/<split>.csv`` with rows ``filename,label``.
  A first line that names no image and reads like a header (e.g. ``filename,label``) is a header;
  otherwise it is data. The authors' loader always drops line 1, which loses the first image of
  every header-less split file their own split scripts write.
- ``mini``: the csv layout, or the release's tree (``<root>/split/mini/<split>.csv``, images in
  ``<root>/images/``).
- ``tiered``: the csv layout as the release's split script makes it: ``<root>/<split>.csv``
  (header-less ``filename,specific-label`` rows) with the PNGs in ``<root>/data/`` (or ``images/``);
  or the release's tree, ``<root>/split/tiered/<split>.csv`` with images in
  ``<root>/tiered-imagenet/data/``; or the folder layout.
- ``cub``: the 200 class folders of CUB-200-2011 in ``<root>/images/`` (or ``<root>`` itself, or
  ``<root>/CUB_200_2011/images``). ``cub_split="release"``: the sorted folder list's index i goes to
  train when i % 2 == 0, val when i % 4 == 1, test when i % 4 == 3 (100/50/50; Chen et al. 2019, the
  release's split script). ``cub_split="140-30-30"``: the class lists shipped in
  ``poodle/data/splits/cub-140-30-30/`` (the split of easyfsl; see docs/datasets.md); the dataset is
  then named ``cub-140-30-30`` (its cache directory and the cache's ``dataset`` attribute).
- ``cifar-fs`` and ``fc100``: CIFAR-100's binary distribution (``train.bin``, ``test.bin``,
  ``fine_label_names.txt``, ``coarse_label_names.txt``) in ``<root>`` or ``<root>/cifar-100-binary``;
  both files' records are pooled (600 images per class) and split by the class lists shipped in
  ``poodle/data/splits/`` (CIFAR-FS: 64/16/20 fine classes, Bertinetto et al. 2019; FC100: 12/4/4
  superclasses = 60/20/20 fine classes, Oreshkin et al. 2018). Images are served from a memory map
  of the files; a sample's path is ``<file>#<record index>``, e.g. ``cifar-100-binary/train.bin#123``.
- ``folder``: ``<root>/<split>/<class>/<image>``. With ``class_split`` (a shipped split name such as
  ``md-ilsvrc``, see :data:`CLASS_SPLITS`, or a folder of ``train.txt``/``val.txt``/``test.txt``):
  ``<root>/<class>/<image>``, one folder per listed class, the lists saying which split each class
  belongs to (:class:`ListedSource`). A line may be a path under the root (Omniglot's
  ``images_background/Latin/character01``). The dataset is then named after the split (``md-cub``).
- ``glyphs``: the embedded generated dataset (folder layout), created under the cache root on first use.
"""

from __future__ import annotations

import csv
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from poodle import defaults
from poodle.data.transforms import load_rgb
from poodle.errors import ConfigError, DataError, mark

if TYPE_CHECKING:
    from PIL import Image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
HEADER_WORDS = {
    "filename",
    "file",
    "file_name",
    "path",
    "image",
    "image_name",
    "label",
    "class",
    "class_name",
    "wnid",
    "target",
}
SPLITS = ("train", "val", "test")
NAMES = defaults.DATASETS
CUB_SPLITS = ("release", "140-30-30")
SPLITS_DIR = Path(__file__).with_name("splits")  # package data: class lists of the named splits
# Meta-Dataset's class splits (google-research/meta-dataset's dataset conversion), for ``folder``
# datasets; where each list comes from: splits/README.md. A split without a list file has no classes
# there (Traffic Signs: test only; MSCOCO: validation and test only).
CLASS_SPLITS = (
    "md-ilsvrc",
    "md-omniglot",
    "md-aircraft",
    "md-cub",
    "md-dtd",
    "md-quickdraw",
    "md-fungi",
    "md-vgg-flower",
    "md-traffic-sign",
    "md-mscoco",
)


def _read_list(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def split_list(name: str, split: str) -> list[str]:
    """The class (or superclass) names of ``split`` in the shipped split ``name``, in file order
    (empty when the split has no list file: a test-only split's train and val)."""
    path = SPLITS_DIR / name / f"{split}.txt"
    if not path.is_file() and (SPLITS_DIR / name).is_dir():
        return []
    return _read_list(path)


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


class DatasetSource(ABC):
    """A dataset on disk: its splits, and per split the ``(relative_path, class_name)`` samples."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = Path(root)
        self._cache: dict[str, list[tuple[str, str]]] = {}

    @abstractmethod
    def splits(self) -> list[str]:
        """Names of the splits present on disk."""

    @abstractmethod
    def _list(self, split: str) -> list[tuple[str, str]]: ...

    def samples(self, split: str) -> list[tuple[str, str]]:
        """``[(path relative to root, class name)]`` in the split's order (file rows, or sorted).

        DataError when the split is absent, a listed image does not exist, or a class has no images.
        """
        if split not in self._cache:
            self._cache[split] = self._list(split)
        return self._cache[split]

    def classes(self, split: str) -> list[str]:
        """The split's class names, sorted; label index i means ``classes(split)[i]``."""
        return sorted({c for _, c in self.samples(split)})

    def describe(self) -> str:
        return f"{self.name} at {self.root}"

    # Pixel side of every image when the dataset has one size (CIFAR's 32): extract then feeds the
    # images as they are by default, without resizing and cropping.
    native_size: int | None = None

    def open_image(self, rel_path: str) -> Image.Image:
        """The RGB image of a sample path (a file under the root here; overridden by array-backed sets)."""
        return load_rgb(self.root / rel_path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class FolderSource(DatasetSource):
    """``root/<split>/<class>/<image>``: classes are the sorted folder names; images sorted by name."""

    def __init__(self, root: Path, name: str = "folder") -> None:
        super().__init__(name, root)

    def splits(self) -> list[str]:
        found = [d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")]
        return sorted(found, key=lambda s: (SPLITS.index(s) if s in SPLITS else len(SPLITS), s))

    def _list(self, split: str) -> list[tuple[str, str]]:
        d = self.root / split
        if not d.is_dir():
            raise DataError(
                f"no split folder {d} (found: {', '.join(self.splits()) or 'none'}; "
                f"the folder layout is <root>/<split>/<class>/<image>)",
                param="split",
                value=split,
            )
        class_dirs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not class_dirs:
            raise DataError(
                f"split folder {d} has no class folders (layout: <root>/<split>/<class>/<image>)",
                param="root",
                value=self.root,
            )
        out: list[tuple[str, str]] = []
        for cd in class_dirs:
            files = sorted(f for f in os.listdir(cd) if _is_image(f))
            if not files:
                raise DataError(
                    f"class {cd.name!r} has no images: {cd} (image extensions: {' '.join(IMAGE_EXTENSIONS)})",
                    param="root",
                    value=self.root,
                )
            out.extend((_rel(cd / f, self.root), cd.name) for f in files)
        return out


class CsvSource(DatasetSource):
    """Split files ``<csv_dir>/<split>.csv`` of ``filename,label`` rows, images in ``image_dir``."""

    def __init__(
        self, root: Path, name: str = "csv", image_dir: Path | None = None, csv_dir: Path | None = None
    ) -> None:
        super().__init__(name, root)
        self.image_dir = Path(image_dir) if image_dir is not None else self.root / "images"
        self.csv_dir = Path(csv_dir) if csv_dir is not None else self.root

    def describe(self) -> str:
        return f"{self.name}: split files in {self.csv_dir}, images in {self.image_dir}"

    def splits(self) -> list[str]:
        found = [p.stem for p in self.csv_dir.glob("*.csv")] if self.csv_dir.is_dir() else []
        return sorted(found, key=lambda s: (SPLITS.index(s) if s in SPLITS else len(SPLITS), s))

    def split_file(self, split: str) -> Path:
        return self.csv_dir / f"{split}.csv"

    def _list(self, split: str) -> list[tuple[str, str]]:
        path = self.split_file(split)
        if not path.is_file():
            raise DataError(
                f"split file {path} does not exist (found: "
                f"{', '.join(s + '.csv' for s in self.splits()) or 'no .csv files'})",
                param="split",
                value=split,
            )
        if not self.image_dir.is_dir():
            raise DataError(
                f"image folder {self.image_dir} does not exist (split files name images in it)",
                param="root",
                value=self.root,
            )
        prefix = _rel(self.image_dir, self.root) if self.image_dir != self.root else ""
        out: list[tuple[str, str]] = []
        try:
            with open(path, newline="", encoding="utf-8-sig") as fh:
                rows = list(enumerate(csv.reader(fh), start=1))
        except (UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"{path}: not a readable CSV file ({e})", param="root", value=self.root) from None
        rows = [(i, [c.strip() for c in r]) for i, r in rows if any(c.strip() for c in r)]
        if rows and self._is_header(rows[0][1]):
            rows = rows[1:]
        seen: dict[str, int] = {}
        for line, row in rows:
            if len(row) < 2 or not row[0] or not row[1]:
                raise DataError(
                    f"{path} line {line}: expected 'filename,label', got {','.join(row)!r}",
                    param="root",
                    value=self.root,
                )
            filename, label = row[0], row[1]
            # Paths are relative to the image folder: an absolute path or one climbing out of it would
            # be joined wrongly later (and fail only when the image is decoded), so refuse it here.
            if Path(filename).is_absolute() or filename.startswith(("/", "\\")) or ".." in Path(filename).parts:
                raise DataError(
                    f"{path} line {line}: image path {filename!r} must be relative to the image "
                    f"folder {self.image_dir} (no absolute paths, no '..')",
                    param="root",
                    value=self.root,
                )
            if not (self.image_dir / filename).is_file():
                raise DataError(
                    f"{path} line {line}: image {self.image_dir / filename} does not exist",
                    param="root",
                    value=self.root,
                )
            if filename in seen:
                # a repeated row would make one image two samples: it could be its own query
                raise DataError(
                    f"{path} lines {seen[filename]} and {line} both list {filename!r}; each image "
                    f"may appear once per split",
                    param="root",
                    value=self.root,
                )
            seen[filename] = line
            out.append((f"{prefix}/{filename}" if prefix else filename, label))
        if not out:
            raise DataError(f"split file {path} lists no images", param="root", value=self.root)
        return out

    def _is_header(self, row: list[str]) -> bool:
        # A header names no image; requiring header-like words too keeps a missing first image an error.
        return (
            len(row) >= 2
            and not (self.image_dir / row[0]).is_file()
            and all(c.lower().replace(" ", "_") in HEADER_WORDS for c in row[:2])
        )


class CubSource(DatasetSource):
    """CUB-200-2011 class folders. ``split="release"``: by sorted index, i%2==0 train, i%4==1 val,
    i%4==3 test; ``split="140-30-30"``: by the shipped class lists."""

    RULE = {"train": lambda i: i % 2 == 0, "val": lambda i: i % 4 == 1, "test": lambda i: i % 4 == 3}

    def __init__(self, root: Path, image_dir: Path, name: str = "cub", split: str = "release") -> None:
        if split not in CUB_SPLITS:
            raise ConfigError(
                f"{mark('cub_split')} {split!r}: use one of {', '.join(CUB_SPLITS)}",
                param="cub_split",
                value=split,
            )
        super().__init__(name if split == "release" else f"{name}-{split}", root)
        self.split_rule = split
        self.image_dir = image_dir
        self.class_dirs = sorted(p.name for p in image_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not self.class_dirs:
            raise DataError(
                f"{mark('dataset')} cub: no class folders in {image_dir}",
                param="data_root",
                value=root,
            )
        if split != "release":
            have = set(self.class_dirs)
            self.lists = {s: split_list(f"cub-{split}", s) for s in SPLITS}
            for s, names in self.lists.items():
                missing = [c for c in names if c not in have]
                if missing:
                    raise DataError(
                        f"{mark('cub_split')} {split}: class folder {missing[0]!r} of its {s} split is not in "
                        f"{image_dir} ({len(missing)} of {len(names)} missing)",
                        param="cub_split",
                        value=split,
                    )

    def describe(self) -> str:
        return f"{self.name}: {len(self.class_dirs)} class folders in {self.image_dir}"

    def splits(self) -> list[str]:
        return list(SPLITS)

    def _list(self, split: str) -> list[tuple[str, str]]:
        if split not in self.RULE:
            raise DataError(
                f"{mark('dataset')} cub has splits train, val, test; not {split!r}",
                param="split",
                value=split,
            )
        out: list[tuple[str, str]] = []
        wanted = set(self.lists[split]) if self.split_rule != "release" else None
        for i, name in enumerate(self.class_dirs):
            if not (self.RULE[split](i) if wanted is None else name in wanted):
                continue
            d = self.image_dir / name
            files = sorted(f for f in os.listdir(d) if _is_image(f))
            if not files:
                raise DataError(f"class {name!r} has no images: {d}", param="root", value=self.root)
            out.extend((_rel(d / f, self.root), name) for f in files)
        if not out:
            raise DataError(
                f"{mark('dataset')} cub: split {split!r} gets no classes from the "
                f"{len(self.class_dirs)} class folders in {self.image_dir}",
                param="split",
                value=split,
            )
        return out


class ListedSource(DatasetSource):
    """Class folders under one root, ``<root>/<class>/<image>``, assigned to splits by class lists.

    ``class_split``: a name of :data:`CLASS_SPLITS` (the lists shipped in ``splits/<name>/``) or a
    folder holding ``train.txt``, ``val.txt`` and ``test.txt`` (any of them; one class a line). A line
    is a class folder's path under the root (it may be nested, as Omniglot's
    ``images_background/Latin/character01``) and is the class's name. A split without a list file, or
    with an empty one, is absent. The dataset is named ``class_split`` (a folder: its name), so each
    split has its own cache directory. Only the listed folders are read, those of a split when its
    samples are listed: extracting ``test`` needs only the test classes on disk.
    """

    def __init__(self, root: Path, class_split: str) -> None:
        if class_split in CLASS_SPLITS:
            list_dir, name = SPLITS_DIR / class_split, class_split
        else:
            list_dir = Path(class_split).expanduser()
            if not list_dir.is_dir():
                raise ConfigError(
                    f"{mark('class_split')} {class_split!r} is neither a shipped split ({', '.join(CLASS_SPLITS)}) "
                    "nor a folder of train.txt, val.txt, test.txt",
                    param="class_split",
                    value=class_split,
                )
            name = list_dir.resolve().name
        super().__init__(name, root)
        self.class_split = class_split
        self.list_dir = list_dir
        self.lists = {s: _read_list(list_dir / f"{s}.txt") for s in SPLITS if (list_dir / f"{s}.txt").is_file()}
        self.lists = {s: v for s, v in self.lists.items() if v}
        if not self.lists:
            raise DataError(
                f"{mark('class_split')} {class_split}: no class list in {list_dir} (train.txt, val.txt, test.txt)",
                param="class_split",
                value=class_split,
            )
        owner: dict[str, str] = {}
        for s, names in self.lists.items():
            for c in names:
                # a class in two lists would make its images train and test samples at once
                if c in owner:
                    where = "twice" if owner[c] == s else f"in {owner[c]}.txt and {s}.txt"
                    raise DataError(
                        f"{mark('class_split')} {class_split}: class {c!r} is listed {where}",
                        param="class_split",
                        value=class_split,
                    )
                parts = Path(c).parts
                if Path(c).is_absolute() or ".." in parts or c.startswith(("/", "\\")):
                    raise DataError(
                        f"{mark('class_split')} {class_split}: class {c!r} of {s}.txt must be a folder path under the "
                        "data root (no absolute paths, no '..')",
                        param="class_split",
                        value=class_split,
                    )
                owner[c] = s

    def describe(self) -> str:
        return f"{self.name}: class folders in {self.root}, split by the lists in {self.list_dir}"

    def splits(self) -> list[str]:
        return list(self.lists)

    def _list(self, split: str) -> list[tuple[str, str]]:
        if split not in self.lists:
            raise DataError(
                f"{mark('class_split')} {self.class_split} has no {split} classes; extract the ones it has with "
                f"{mark('splits')} {','.join(self.lists)}",
                param="class_split",
                value=self.class_split,
            )
        names = sorted(self.lists[split])
        missing = [c for c in names if not (self.root / c).is_dir()]
        if missing:
            raise DataError(
                f"{mark('class_split')} {self.class_split}: class folder {missing[0]!r} of its {split} split is not in "
                f"{self.root} ({len(missing)} of {len(names)} missing)",
                params=("class_split", "data_root"),
                param="class_split",
                value=self.class_split,
            )
        out: list[tuple[str, str]] = []
        for c in names:
            d = self.root / c
            files = sorted(f for f in os.listdir(d) if _is_image(f) and (d / f).is_file())
            if not files:
                raise DataError(
                    f"class {c!r} has no images: {d} (image extensions: {' '.join(IMAGE_EXTENSIONS)})",
                    param="root",
                    value=self.root,
                )
            out.extend((_rel(d / f, self.root), c) for f in files)
        return out
