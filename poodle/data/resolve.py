"""``resolve_dataset``: the :class:`~poodle.data.sources.DatasetSource` of a ``--dataset`` name.

Apart from :mod:`poodle.data.sources` because it also builds the sources defined elsewhere
(:mod:`poodle.data.cifar`, which subclasses ``DatasetSource``, and the generated glyphs).
"""

from __future__ import annotations

import os
from pathlib import Path

from poodle.data.cifar import CifarSource
from poodle.data.sources import CUB_SPLITS, NAMES, CsvSource, CubSource, DatasetSource, FolderSource, ListedSource
from poodle.errors import ConfigError, DataError, mark
from poodle.utils import resolve_path


def _need_root(name: str, data_root: str | os.PathLike | None) -> Path:
    if data_root is None:
        raise ConfigError(
            f"{mark('dataset')} {name} needs a {mark('data_root')} folder",
            param="data_root",
            value=data_root,
        )
    root = resolve_path(Path(data_root).expanduser(), "data_root")
    if not root.exists():
        raise DataError(f"data root {root} does not exist", param="data_root", value=data_root)
    if not root.is_dir():
        raise DataError(f"data root {root} is not a directory", param="data_root", value=data_root)
    return root


def _preset_csv(name: str, root: Path, images: tuple[str, ...], release_csv: str, release_images: str) -> DatasetSource:
    if (root / "train.csv").is_file() or (root / "test.csv").is_file():
        image_dir = next((root / d for d in images if (root / d).is_dir()), root / images[0])
        return CsvSource(root, name, image_dir=image_dir)
    if (root / release_csv).is_dir():
        return CsvSource(root, name, image_dir=root / release_images, csv_dir=root / release_csv)
    if name == "tiered" and (root / "train").is_dir():
        return FolderSource(root, name)
    raise DataError(
        f"dataset {name}: no split files in {root}: expected {root / 'train.csv'} with images in "
        f"{root / images[0]}/, or the release's {root / release_csv}/train.csv with images in "
        f"{root / release_images}/",
        param="data_root",
        value=root,
    )


def resolve_dataset(
    name: str,
    data_root: str | os.PathLike | None,
    cache_root: str | Path = "cache",
    *,
    cub_split: str = "release",
    class_split: str | None = None,
) -> DatasetSource:
    """The :class:`DatasetSource` of dataset ``name`` at ``data_root`` (``cub_split``: see ``cub``,
    ``class_split``: see ``folder`` in :mod:`poodle.data.sources`).

    Checks only that the root exists (and for presets, which of their layouts is present); the split
    files and images are checked when a split's samples are listed.
    """
    if name == "glyphs":
        # here, not at the top: the glyph generator (scipy.ndimage, matplotlib, fontTools) would add
        # about 0.4 s to every `import poodle.data` (extract, train, predict, split) for one dataset
        from poodle.data.glyphs import ensure_glyphs, verify_glyphs

        if data_root is not None:  # a glyph set generated elsewhere (another seed or size, a subset)
            verify_glyphs(Path(data_root))
            return FolderSource(Path(data_root), "glyphs")
        return FolderSource(Path(ensure_glyphs(Path(cache_root))), "glyphs")
    if name not in NAMES:
        raise ConfigError(f"unknown dataset {name!r}; known: {', '.join(NAMES)}", param="dataset", value=name)
    if class_split is not None and name != "folder":
        raise ConfigError(
            f"{mark('class_split')} {class_split} is an option of {mark('dataset')} folder, not {name}",
            param="class_split",
            value=class_split,
        )
    root = _need_root(name, data_root)
    if name == "csv":
        return CsvSource(root, "csv")
    if name == "folder":
        return FolderSource(root, "folder") if class_split is None else ListedSource(root, class_split)
    if name == "mini":
        return _preset_csv("mini", root, ("images",), "split/mini", "images")
    if name == "tiered":
        return _preset_csv("tiered", root, ("data", "images"), "split/tiered", "tiered-imagenet/data")
    if name in ("cifar-fs", "fc100"):
        return CifarSource.find(root, name)
    # cub
    if cub_split not in CUB_SPLITS:
        raise ConfigError.bad_value("cub_split", cub_split, f"must be one of {', '.join(CUB_SPLITS)}")
    for cand in (root / "images", root / "CUB_200_2011" / "images", root):
        if cand.is_dir() and any(p.is_dir() for p in cand.iterdir()):
            return CubSource(root, cand, split=cub_split)
    raise DataError(f"dataset cub: no class folders in {root / 'images'}", param="data_root", value=root)
