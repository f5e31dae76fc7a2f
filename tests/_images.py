"""Small generated image sets for tests (import as ``import _images`` from a test module).

Every class has its own colour, shape and position, plus per-image noise, so a backbone's features
separate the classes and two images never coincide. Class names are distinct across splits, as in
few-shot benchmarks. Layouts:

- :func:`write_folder`: ``root/<split>/<class>/<image>.png``
- :func:`write_csv`: ``root/images/<file>.png`` + ``root/<split>.csv`` (``filename,label``)
- :func:`write_cub`: ``root/images/<NNN.Class>/<image>.jpg`` (class folders only, no split files)
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Mapping

import numpy as np
from PIL import Image, ImageDraw

DEFAULT_CLASSES = {"train": 4, "val": 2, "test": 3}


def _classes(classes_per_split: int | Mapping[str, int], splits: tuple[str, ...]) -> dict[str, int]:
    if isinstance(classes_per_split, int):
        return {s: classes_per_split for s in splits}
    return dict(classes_per_split)


def make_image(class_index: int, image_index: int, size: int = 24, seed: int = 0) -> Image.Image:
    """An RGB ``size`` x ``size`` image: class colour, shape and position, with per-image noise."""
    rng = np.random.default_rng([seed, class_index, image_index])
    base = np.random.default_rng([seed, class_index, 10**6])
    background = base.integers(0, 256, 3)
    colour = base.integers(0, 256, 3)
    pixels = np.clip(background + rng.normal(0, 18, (size, size, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(img)
    kind = class_index % 3
    c = size // 2 + int(base.integers(-size // 6, size // 6 + 1)) + int(rng.integers(-1, 2))
    r = size // 4 + class_index % 4
    box = (c - r, c - r, c + r, c + r)
    fill = tuple(int(v) for v in colour)
    if kind == 0:
        draw.ellipse(box, fill=fill)
    elif kind == 1:
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(c, c - r), (c - r, c + r), (c + r, c + r)], fill=fill)
    return img


def write_folder(
    root: str | Path,
    classes_per_split: int | Mapping[str, int] = DEFAULT_CLASSES,
    images_per_class: int = 5,
    *,
    size: int = 24,
    seed: int = 0,
    splits: tuple[str, ...] = ("train", "val", "test"),
    ext: str = "png",
) -> Path:
    """Write ``root/<split>/<class>/<i>.<ext>``; class names ``<split>_cNN``. Returns ``root``."""
    root = Path(root)
    k = 0
    for split, n_classes in _classes(classes_per_split, splits).items():
        for c in range(n_classes):
            d = root / split / f"{split}_c{c:02d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(images_per_class):
                make_image(k, i, size, seed).save(d / f"{i:03d}.{ext}")
            k += 1
    return root


def write_csv(
    root: str | Path,
    classes_per_split: int | Mapping[str, int] = DEFAULT_CLASSES,
    images_per_class: int = 5,
    *,
    size: int = 24,
    seed: int = 0,
    header: bool = True,
    splits: tuple[str, ...] = ("train", "val", "test"),
    image_dir: str = "images",
    csv_dir: str = ".",
    numeric_labels: bool = False,
) -> Path:
    """Write the mini-ImageNet layout: ``root/<image_dir>/<file>.png`` and ``root/<csv_dir>/<split>.csv``.

    Labels are wnid-like (``n0000NNNN``) or, with ``numeric_labels``, integers as the release's split
    scripts write them. ``header`` writes the ``filename,label`` line. Returns ``root``.
    """
    root = Path(root)
    (root / image_dir).mkdir(parents=True, exist_ok=True)
    (root / csv_dir).mkdir(parents=True, exist_ok=True)
    k = 0
    for split, n_classes in _classes(classes_per_split, splits).items():
        rows = []
        for _c in range(n_classes):
            label = str(k) if numeric_labels else f"n{k:08d}"
            for i in range(images_per_class):
                name = f"{split}_{label}_{i:04d}.png"
                make_image(k, i, size, seed).save(root / image_dir / name)
                rows.append((name, label))
            k += 1
        with open(root / csv_dir / f"{split}.csv", "w", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            if header:
                w.writerow(("filename", "label"))
            w.writerows(rows)
    return root


def write_cub(
    root: str | Path, n_classes: int = 8, images_per_class: int = 3, *, size: int = 24, seed: int = 0
) -> Path:
    """Write ``root/images/<NNN.Class_k>/<k>_<i>.jpg`` class folders (CUB's layout). Returns ``root``."""
    root = Path(root)
    for c in range(n_classes):
        d = root / "images" / f"{c + 1:03d}.Class_{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(images_per_class):
            make_image(c, i, size, seed).save(d / f"Class_{c}_{i:04d}.jpg", quality=95)
    return root


def write_bad_image(path: str | Path) -> Path:
    """A file with an image extension that does not decode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not an image\n" * 4)
    return path
