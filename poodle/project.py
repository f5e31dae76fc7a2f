"""A project's defaults: its project file, and what earlier commands left under the cache root.

Three things let a command run with little typed:

- the project file (``poodle.toml`` in the working directory, :data:`poodle.defaults.PROJECT_FILE`):
  one table per command whose keys are that command's option names, and a ``[defaults]`` table for
  keys that several commands share (:func:`read_project`, :func:`project_defaults`);
- the training runs under the cache root: ``poodle train`` and ``poodle demo`` write
  ``<cache_root>/<dataset>/checkpoints/<run>/train.json`` when a run is complete, with its
  configuration and the checkpoint to extract features with (:func:`trained_runs`,
  :func:`latest_checkpoint`);
- the index of the caches that :func:`poodle.extract.extract` wrote (``<cache_root>/caches.json``,
  the last one last; :func:`record_cache`, :func:`latest_cache`, :func:`cache_of`).

The command line turns these into option defaults; every function here returns None where there is
nothing to find, and the caller says which command makes it. The module imports neither torch nor h5py
(``poodle solve`` finds its cache here before it imports them).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poodle import defaults
from poodle.errors import CacheError, ConfigError, PoodleError

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10: the tomli backport (a dependency there)
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULTS_TABLE = "defaults"
_INDEX_ENTRIES = 200  # the index keeps the caches written last; older entries are dropped


# ------------------------------------------------------------------------------------------ project file


def read_project(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The tables of the project file ``path``: ``{table: {key: value}}``, keys as written.

    Raises ConfigError naming the file when it is missing, not UTF-8 TOML, or holds anything at its top
    level but tables."""
    p = Path(path)
    try:
        # utf-8-sig: a byte order mark (Windows editors write one) is not part of the TOML text
        text = p.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        dangling = " (a symbolic link to nothing)" if p.is_symlink() else ""
        raise ConfigError(f"project file {p} does not exist{dangling}", param="path", value=path) from None
    except IsADirectoryError:
        raise ConfigError(f"project file {p} is a directory", param="path", value=path) from None
    except OSError as e:  # a symbolic link loop, no permission to read, an I/O error
        raise ConfigError(f"project file {p} cannot be read: {_os_reason(e)}", param="path", value=path) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"project file {p} is not UTF-8 text (byte {e.start})", param="path", value=path) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"project file {p} is not valid TOML: {e}", param="path", value=path) from None
    for key, value in data.items():
        if not isinstance(value, dict):
            raise ConfigError(
                f"{p}: {key!r} is outside any table; write it under [{DEFAULTS_TABLE}] or a command's table "
                f"such as [extract]",
                param="path",
                value=path,
            )
    return data


def _os_reason(e: OSError) -> str:
    import errno

    if e.errno == errno.ELOOP:
        return "a symbolic link loop"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return (e.strerror or str(e)).lower()


def project_defaults(
    path: str | os.PathLike, tables: Mapping[str, dict[str, Any]], options: Mapping[str, Collection[str]]
) -> dict[str, dict[str, tuple[str, str, Any]]]:
    """``{command: {option: (table, key as written, value)}}`` of a project file's ``tables`` (as
    :func:`read_project` returns them), for the commands of ``options`` (``{command: its option
    names}``). A command's own table wins over ``[defaults]``, whose keys apply to every command that
    has an option of that name. Dashes in keys read as underscores (``data-root`` is ``data_root``).

    Raises ConfigError naming the file, the table and the key for a table that is no command, a key
    that is no option of its command, or a ``[defaults]`` key that no command has."""
    p = Path(path)
    out: dict[str, dict[str, tuple[str, str, Any]]] = {}
    for table in tables:
        if table != DEFAULTS_TABLE and table not in options:
            raise ConfigError(
                f"{p}: unknown table [{table}]; tables are [{DEFAULTS_TABLE}] and the commands "
                f"{', '.join(f'[{c}]' for c in options)}",
                param="path",
                value=path,
            )
    shared = tables.get(DEFAULTS_TABLE, {})
    for key, value in shared.items():
        name = key.replace("-", "_")
        takers = [c for c, names in options.items() if name in names]
        if not takers:
            raise ConfigError(
                f"{p}: [{DEFAULTS_TABLE}] {key}: no command has an option {key!r}", param="path", value=path
            )
        for c in takers:
            out.setdefault(c, {})[name] = (DEFAULTS_TABLE, key, value)
    for table, entries in tables.items():
        if table == DEFAULTS_TABLE:
            continue
        for key, value in entries.items():
            name = key.replace("-", "_")
            if name not in options[table]:
                raise ConfigError(
                    f"{p}: [{table}] {key}: {table} has no option {key!r} (its options: "
                    f"{', '.join(sorted(options[table]))})",
                    param="path",
                    value=path,
                )
            out.setdefault(table, {})[name] = (table, key, value)
    return out


# ------------------------------------------------------------------------------------------ training runs


@dataclass(frozen=True)
class TrainedRun:
    """A complete training run (``poodle train`` or ``poodle demo``) found under a cache root.

    ``checkpoint`` is the file to extract features with (``best.pt`` of the final generation),
    ``image_size`` the side the network was trained at, ``finished`` when its ``train.json`` was
    written (seconds since the epoch)."""

    checkpoint: Path
    out_dir: Path
    backbone: str
    dataset: str
    recipe: str
    image_size: int
    finished: float


def _run_of(summary: Path) -> TrainedRun | None:
    """The run whose ``train.json`` is ``summary``, or None when it is unreadable or its checkpoint is gone."""
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
        cfg = data["config"]
        written = Path(str(data["checkpoint"]))
        finished = summary.stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # the path was written as the training command saw it (relative to its working directory): find
    # the file from the run's folder instead, where the final generation keeps it
    out = summary.parent
    checkpoint = (
        out / written.parent.name / written.name if written.parent.name.startswith("student_") else out / written.name
    )
    if not checkpoint.is_file() or not isinstance(cfg, dict):
        return None
    try:
        return TrainedRun(
            checkpoint=checkpoint,
            out_dir=out,
            backbone=str(cfg["backbone"]),
            dataset=str(cfg["dataset"]),
            recipe=str(cfg.get("recipe", "")),
            image_size=int(cfg.get("image_size") or defaults.IMAGE_SIZE),
            finished=finished,
        )
    except (KeyError, TypeError, ValueError):
        return None


def trained_runs(cache_root: str | os.PathLike) -> list[TrainedRun]:
    """Every complete training run under ``<cache_root>/<dataset>/checkpoints/``, oldest first. A run
    is complete when its ``train.json`` exists (``poodle.train`` writes it after the last epoch, and
    deletes it when a run is started over)."""
    root = Path(cache_root)
    runs = [r for s in root.glob("*/checkpoints/*/train.json") if (r := _run_of(s)) is not None]
    return sorted(runs, key=lambda r: (r.finished, str(r.out_dir)))


def latest_checkpoint(cache_root: str | os.PathLike, backbone: str, dataset: str) -> TrainedRun | None:
    """The newest complete run of ``backbone`` on ``dataset`` under ``cache_root``, or None."""
    runs = [r for r in trained_runs(cache_root) if r.backbone == backbone and r.dataset == dataset]
    return runs[-1] if runs else None


def unfinished_runs(cache_root: str | os.PathLike, backbone: str, dataset: str) -> list[Path]:
    """The run folders of ``backbone`` on ``dataset`` under ``cache_root`` (``poodle train``'s default
    ``<backbone>-<recipe>``) that hold a checkpoint but no readable ``train.json``: stopped before the
    last epoch, or with that file damaged. No default checkpoint is taken from them."""
    folder = Path(cache_root) / dataset / "checkpoints"
    return [
        d
        for d in sorted(folder.glob(f"{backbone}-*"))
        if d.is_dir() and any((d / f).is_file() for f in ("last.pt", "best.pt")) and _run_of(d / "train.json") is None
    ]


# ------------------------------------------------------------------------------------------ the caches' index


@dataclass(frozen=True)
class CacheRecord:
    """One cache that extract wrote: its path (as seen from the working directory), what it holds and
    when it was written (ISO 8601, UTC)."""

    path: Path
    dataset: str
    backbone: str
    checkpoint_sha256: str
    image_size: int
    written: str


def index_path(cache_root: str | os.PathLike) -> Path:
    """``<cache_root>/caches.json``: the caches extract wrote, the last one last."""
    return Path(cache_root) / defaults.CACHE_INDEX


def _entries(cache_root: str | os.PathLike) -> list[dict[str, Any]]:
    try:
        data = json.loads(index_path(cache_root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # no index yet, or one cut short by hand: no cache is known
    entries = data.get("caches") if isinstance(data, dict) else None
    return (
        [e for e in entries if isinstance(e, dict) and isinstance(e.get("path"), str)]
        if isinstance(entries, list)
        else []
    )


def record_cache(cache_root: str | os.PathLike, cache: str | os.PathLike, attrs: Mapping[str, Any]) -> None:
    """Record that ``cache`` (under ``cache_root``; ``attrs`` its root attributes) was just written or
    completed: it becomes the last entry of the index. The index is replaced atomically under a lock,
    so concurrent extractions each leave their entry."""
    # here, not at the top: they import h5py and torch, which `poodle solve` imports only after it has
    # started reading the cache this module finds for it (poodle.prefetch)
    from poodle.cache import cache_lock
    from poodle.utils import atomic_path

    root = Path(cache_root)
    rel = os.path.relpath(Path(cache).resolve(), root.resolve())
    entry = {
        "path": Path(rel).as_posix(),
        "dataset": str(attrs.get("dataset", "")),
        "backbone": str(attrs.get("backbone", "")),
        "checkpoint_sha256": str(attrs.get("checkpoint_sha256", "none")),
        "image_size": int(attrs.get("image_size", 0) or 0),
        "written": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    index = index_path(root)
    with cache_lock(index):
        entries = [e for e in _entries(root) if e.get("path") != entry["path"]][-(_INDEX_ENTRIES - 1) :]
        with atomic_path(index) as tmp:
            tmp.write_text(json.dumps({"format": "poodle-cache-index", "caches": [*entries, entry]}, indent=1) + "\n")


def cache_records(cache_root: str | os.PathLike) -> list[CacheRecord]:
    """The caches of the index whose files still exist, the one written last last."""
    root = Path(cache_root)
    out = []
    for e in _entries(root):
        path = root / e["path"]
        if not path.is_file():
            continue
        try:
            out.append(
                CacheRecord(
                    path=path,
                    dataset=str(e.get("dataset", "")),
                    backbone=str(e.get("backbone", "")),
                    checkpoint_sha256=str(e.get("checkpoint_sha256", "none")),
                    image_size=int(e.get("image_size", 0)),
                    written=str(e.get("written", "")),
                )
            )
        except (TypeError, ValueError):
            continue
    return out


def latest_cache(
    cache_root: str | os.PathLike, *, dataset: str | None = None, backbone: str | None = None
) -> CacheRecord | None:
    """The cache extract wrote last under ``cache_root`` (of ``dataset`` / ``backbone`` when given), or None."""
    found = [
        r
        for r in cache_records(cache_root)
        if (dataset is None or r.dataset == dataset) and (backbone is None or r.backbone == backbone)
    ]
    return found[-1] if found else None


def _read_index(cache_root: str | os.PathLike) -> tuple[list[Any], str | None]:
    """The index's entries as written, and why it cannot be read (None: it can, or there is none)."""
    index = index_path(cache_root)
    if not os.path.lexists(index):
        return [], None
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except IsADirectoryError:
        return [], f"{index} is a directory, not the index of caches"
    except OSError as e:
        return [], f"{index} cannot be read: {_os_reason(e)}"
    except UnicodeDecodeError as e:
        return [], f"{index} is not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        return [], f"{index} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})"
    entries = data.get("caches") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return [], f"{index} is not an index of caches (no list 'caches')"
    return entries, None


def index_trouble(
    cache_root: str | os.PathLike, *, dataset: str | None = None, backbone: str | None = None
) -> str | None:
    """Why the index gives no cache (of ``dataset`` / ``backbone`` when given) although it exists:
    it cannot be read, is not JSON (cut short, edited by hand) or not an index, or the cache it
    names last was deleted. None where there is no index or nothing is wrong with it."""
    entries, trouble = _read_index(cache_root)
    if trouble is not None:
        return trouble
    root = Path(cache_root)
    named = [
        e
        for e in entries
        if isinstance(e, dict)
        and isinstance(e.get("path"), str)
        and (dataset is None or e.get("dataset") == dataset)
        and (backbone is None or e.get("backbone") == backbone)
    ]
    if named and not (root / named[-1]["path"]).is_file():
        return f"{index_path(root)} names last {root / named[-1]['path']}, which no longer exists"
    return None


def check_index(cache_root: str | os.PathLike) -> str | None:
    """Before an extraction writes anything: CacheError when the index could not be replaced after
    it (something other than a file in its place); else what is wrong with an index that
    :func:`record_cache` will start anew (it cannot be read), or None."""
    index = index_path(cache_root)
    if os.path.lexists(index) and not index.is_file():
        what = "a directory" if index.is_dir() else "not a regular file"
        raise CacheError(
            f"{index}, the index of the caches extract writes, is {what}: move it out of the way",
            param="cache_root",
            value=cache_root,
        )
    return _read_index(cache_root)[1]


def cache_of(
    cache_root: str | os.PathLike, dataset: str, backbone: str, checkpoint_sha256: str, image_size: int
) -> CacheRecord | None:
    """The cache written last with the features of this checkpoint (``dataset``, ``backbone``, the
    checkpoint's sha256 and ``image_size`` as recorded), or None."""
    found = [
        r
        for r in cache_records(cache_root)
        if (r.dataset, r.backbone, r.checkpoint_sha256, r.image_size)
        == (dataset, backbone, checkpoint_sha256, int(image_size))
    ]
    return found[-1] if found else None


def default_tag(
    cache_root: str | os.PathLike, dataset: str, stem: str, backbone: str, checkpoint_sha256: str, image_size: int
) -> str | None:
    """The tag of the cache ``<cache_root>/<dataset>/<stem>[-<tag>].h5`` written last with this
    checkpoint's features (:func:`cache_of`), so that extracting them again finds it complete (the
    demo's cache is ``<stem>-demo-<key>.h5``); None for the untagged file or when there is none."""
    folder = Path(cache_root) / dataset
    found = cache_of(cache_root, dataset, backbone, checkpoint_sha256, image_size)
    if found is not None and found.path.parent.resolve() == folder.resolve():
        path: Path | None = found.path
    else:  # caches written before the index existed: their root attributes say the same
        path = _cache_holding(folder, stem, backbone, checkpoint_sha256, image_size)
    if path is None:
        return None
    return path.stem[len(stem) + 1 :] if path.stem.startswith(stem + "-") else None


def _cache_holding(folder: Path, stem: str, backbone: str, checkpoint_sha256: str, image_size: int) -> Path | None:
    """The newest ``<stem>[-<tag>].h5`` in ``folder`` whose root attributes name these weights."""
    from poodle.cache import read_attrs  # h5py and torch: see record_cache

    found = []
    for path in [folder / f"{stem}.h5", *folder.glob(f"{stem}-*.h5")]:
        try:
            attrs = read_attrs(path) if path.is_file() else None
        except (PoodleError, OSError):
            continue
        if attrs is not None and (str(attrs.get("backbone")), str(attrs.get("checkpoint_sha256"))) == (
            backbone,
            checkpoint_sha256,
        ):
            if int(attrs.get("image_size", 0) or 0) == int(image_size):
                found.append((path.stat().st_mtime, str(path), path))
    return max(found)[2] if found else None
