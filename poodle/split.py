"""Cross-domain negative pools made reproducible: the paper's "noisy" and "disjoint" settings (Table 5).

In cross-domain few-shot learning POODLE's negatives come from the target domain. The paper uses two
kinds of pool (section 4 and appendix):

- ``noisy``: unlabelled images of the target domain that may include the test classes. The paper
  keeps 20% of every class's images as the unlabelled pool and tests on the other 80%.
- ``disjoint``: images of target-domain classes that no test episode uses: a share of the classes
  becomes the pool, the other classes the test split.

:func:`make_split` draws either from a folder of class folders (``<root>/<class>/<image>``) with an
explicit seed, and writes the csv layout that ``poodle extract --dataset csv`` reads::

    <out>/train.csv   the negative pool (the ``train`` split, so ``--negatives base`` draws from it)
    <out>/test.csv    the test split
    <out>/images      a symbolic link to <root>; the csv rows are <class>/<image> under it
    <out>/split.json  setting, seed, fraction, source folder and counts: how to make the files again

Rows keep their true class as the label (the solver never reads the pool's labels; they let one
measure how noisy a noisy pool is). The draw is a pure function of (setting, seed, fraction, the
sorted class and image names): the same call on the same folder writes the same files.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from poodle import __version__
from poodle.data.sources import _is_image
from poodle.errors import ConfigError, DataError, mark
from poodle.utils import atomic_path, resolve_path

SETTINGS = ("noisy", "disjoint")
DEFAULT_FRACTION = {"noisy": 0.2, "disjoint": 0.5}


def class_folders(root: Path) -> dict[str, list[str]]:
    """``{class: sorted image file names}`` of ``root/<class>/<image>``, classes sorted."""
    if not root.is_dir():
        raise DataError(f"{root} is not a directory", param="root", value=root)
    out: dict[str, list[str]] = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = sorted(f for f in os.listdir(d) if _is_image(f) and (d / f).is_file())
        if not files:
            raise DataError(f"class folder {d} has no images", param="root", value=root)
        out[d.name] = files
    if len(out) < 2:
        raise DataError(
            f"{root}: expected class folders <root>/<class>/<image>, found {len(out)}", param="root", value=root
        )
    return out


def draw(
    classes: dict[str, list[str]], setting: str, fraction: float, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(pool, test)`` rows ``(<class>/<image>, class)`` for ``setting`` (see the module docstring).

    noisy: per class (in sorted order), a permutation of its sorted images from one seeded generator;
    the first ``int(fraction * n)`` go to the pool (as the authors' script does) and the rest to test.
    disjoint: a permutation of the sorted classes; the first ``round(fraction * C)`` classes are the pool.
    Rows are written class by class, images in name order.
    """
    _check_setting(setting)
    if not 0.0 < fraction < 1.0:
        raise ConfigError(
            f"{mark('fraction')} {fraction}: must be strictly between 0 and 1",
            param="fraction",
            value=fraction,
        )
    rng = np.random.default_rng(seed)
    pool: list[tuple[str, str]] = []
    test: list[tuple[str, str]] = []
    names = list(classes)
    if setting == "noisy":
        for c in names:
            files = classes[c]
            k = int(fraction * len(files))
            chosen = set(rng.permutation(len(files))[:k].tolist())
            if k == len(files):
                raise DataError(
                    f"{mark('fraction')} {fraction} of the {len(files)} images of class {c!r} leaves none to test",
                    param="fraction",
                    value=fraction,
                )
            pool += [(f"{c}/{f}", c) for i, f in enumerate(files) if i in chosen]
            test += [(f"{c}/{f}", c) for i, f in enumerate(files) if i not in chosen]
        if not pool:
            most = max(len(f) for f in classes.values())
            raise DataError(
                f"{mark('fraction')} {fraction} of at most {most} images per class puts no image in the pool "
                f"(the count per class is rounded down); raise it or use more images per class",
                param="fraction",
                value=fraction,
            )
    else:
        k = int(round(fraction * len(names)))
        if not 0 < k < len(names):
            raise ConfigError(
                f"{mark('fraction')} {fraction} of {len(names)} classes gives {k} pool classes; "
                f"both the pool and the test split need at least one",
                param="fraction",
                value=fraction,
            )
        held = {names[i] for i in rng.permutation(len(names))[:k].tolist()}
        for c in names:
            rows = [(f"{c}/{f}", c) for f in classes[c]]
            (pool if c in held else test).extend(rows)
    return pool, test


def _check_setting(setting: str) -> None:
    if setting not in SETTINGS:
        raise ConfigError(
            f"{mark('setting')} {setting!r}: use one of {', '.join(SETTINGS)}",
            param="setting",
            value=setting,
        )


def _csv_text(rows: list[tuple[str, str]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["filename", "label"])
    w.writerows(rows)
    return buf.getvalue()


def _check_out(out: Path, record: dict[str, Any], force: bool) -> None:
    """ConfigError unless ``out`` is missing, empty or a split made with the settings of ``record``
    (or ``force`` replaces it)."""
    manifest = out / "split.json"
    if manifest.exists() and not force:
        try:
            old = json.loads(manifest.read_text())
        except (OSError, ValueError):
            old = {}
        keys = ("setting", "seed", "fraction", "source")
        if any(old.get(k) != record[k] for k in keys):
            raise ConfigError(
                f"{mark('out')} {out} holds a split made with "
                + ", ".join(f"{k}={old.get(k)!r}" for k in keys)
                + f"; pass {mark('force')} to replace it, or choose another folder",
                param="out",
                value=out,
            )
    elif out.exists() and any(out.iterdir()) and not manifest.exists() and not force:
        raise ConfigError(
            f"{mark('out')} {out} exists and is not a split folder; pass {mark('force')} or choose another folder",
            param="out",
            value=out,
        )


def _link_images(out: Path, root: Path, force: bool) -> None:
    """``out/images``: a symbolic link to ``root`` (a link elsewhere or a file is replaced with ``force``)."""
    link = out / "images"
    if link.is_symlink() or link.exists():
        if not link.is_symlink() or Path(os.readlink(link)) != root:
            if not force:
                raise ConfigError(
                    f"{mark('out')} {out} holds {link.name}, which is not a link to {root}; pass "
                    f"{mark('force')} or choose another folder",
                    param="out",
                    value=out,
                )
            if link.is_symlink() or link.is_file():
                link.unlink()
            else:
                raise ConfigError(
                    f"{mark('out')} {out} holds a folder {link.name}; remove it or choose another folder",
                    param="out",
                    value=out,
                )
    if not link.is_symlink():
        link.symlink_to(root, target_is_directory=True)


def make_split(
    data_root: str | os.PathLike,
    out: str | os.PathLike,
    *,
    setting: str,
    seed: int,
    fraction: float | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Write the pool and test split files of ``data_root`` into ``out``; returns the record written
    to ``out/split.json``. An existing ``out`` made with other settings is refused without ``force``."""
    root = resolve_path(Path(data_root).expanduser(), "data_root")
    if not root.exists():
        raise DataError(f"{mark('data_root')} {root} does not exist", param="data_root", value=data_root)
    root = root.resolve()
    out = resolve_path(out, "out")
    _check_setting(setting)
    fraction = DEFAULT_FRACTION[setting] if fraction is None else float(fraction)
    classes = class_folders(root)
    pool, test = draw(classes, setting, fraction, seed)
    record = {
        "format": "poodle-split",
        "setting": setting,
        "seed": int(seed),
        "fraction": fraction,
        "source": str(root),
        "pool_split": "train",
        "test_split": "test",
        "n_classes": len(classes),
        "n_images": sum(len(v) for v in classes.values()),
        "pool": {"images": len(pool), "classes": len({c for _, c in pool})},
        "test": {"images": len(test), "classes": len({c for _, c in test})},
        "poodle_version": __version__,
    }
    manifest = out / "split.json"
    _check_out(out, record, force)
    out.mkdir(parents=True, exist_ok=True)
    _link_images(out, root, force)
    for name, rows in (("train.csv", pool), ("test.csv", test)):
        with atomic_path(out / name) as tmp:
            tmp.write_text(_csv_text(rows), encoding="utf-8")
    with atomic_path(manifest) as tmp:  # last: a folder with split.json is complete
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    return record
