"""Read a feature cache's large arrays in a background thread while the interpreter imports torch.

``import torch`` takes 1.7-2.6 s on a 2-core machine, most of it loading shared libraries and running
module code, and ``poodle solve`` cannot start solving before it ends. Reading the features of the
evaluated split and of the negative pool (0.2 s for 50,000 rows of D = 640) does not need torch:
``poodle solve`` starts that read in a thread before it imports the library, and
:func:`poodle.cache.read_split` takes the arrays when it gets there. Measured on the 2-core machine,
the read then costs nothing and torch's import is not slowed (HDF5 reads run outside the GIL).

Nothing here is required for correctness: a prefetched array is used only if the file still has the
size and modification time it had when the read started and the array has the dataset's shape;
otherwise, and on any error in the thread, :func:`take` returns None and the caller reads the file
itself (and reports whatever is wrong with it). This module imports neither torch nor anything that
does, so the command line can call it first.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterable

from poodle import defaults
from poodle.errors import ConfigError

_Key = tuple[str, str]  # (resolved file path, split)

_lock = threading.Lock()
_pending: dict[_Key, tuple[threading.Thread, dict[str, Any]]] = {}


def pool_location(source: str, cache_path: Path | str | None) -> tuple[Path, str]:
    """``(file, split)`` of a negative pool source (``base`` or ``FILE[:SPLIT]``)."""
    if source == "base":
        if cache_path is None:
            raise ConfigError(
                "negatives = base needs the cache file (its train split is the pool)", param="negatives", value=source
            )
        return Path(cache_path), "train"
    path, sep, split = source.rpartition(":")
    # "C:\\x.h5" or a path without ":SPLIT": the whole text is the file
    if not sep or not split or "/" in split or "\\" in split or not path:
        return Path(source), "train"
    return Path(path), split


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


def _read(path: Path, splits: list[str], box: dict[str, Any]) -> None:
    try:
        import h5py  # here, not at the top: the caller has not imported it yet, and need not wait

        box["stamp"] = _stamp(path)
        with h5py.File(path, "r") as f:
            for split in splits:
                box[split] = f[split]["features"][()]
    except Exception as e:  # the caller's own read reports what is wrong
        box["error"] = e


def start(path: str | os.PathLike, splits: Iterable[str]) -> None:
    """Begin reading ``features`` of ``splits`` of the cache at ``path`` in a thread.
    Does nothing for a file that does not exist or splits already being read.

    The thread is not a daemon: a process that ends before taking the arrays (a bad option found
    first) waits for the read, which holds h5py's global lock; a daemon thread frozen holding it
    made the interpreter's shutdown, which frees h5py objects, wait forever."""
    p = Path(path)
    try:
        key_path = os.path.realpath(p)  # never raises (a link loop is reported by the caller's own read)
        if not p.is_file():
            return
    except OSError:
        return
    with _lock:
        todo = [s for s in dict.fromkeys(splits) if (key_path, s) not in _pending]
        if not todo:
            return
        box: dict[str, Any] = {}
        t = threading.Thread(target=_read, args=(p, todo, box), name="poodle-prefetch", daemon=False)
        for s in todo:
            _pending[(key_path, s)] = (t, box)
    t.start()


def start_for_solve(
    cache_path: str | os.PathLike, split: str | None, negatives: str | None, *, default_split: str = "test"
) -> None:
    """:func:`start` for what ``poodle solve`` reads first: ``split`` of the cache and, for a pool
    source (``base`` or ``FILE[:SPLIT]``), the pool's split. ``split`` None: ``default_split``."""
    groups: dict[Path, list[str]] = {Path(cache_path): [split or default_split]}
    if negatives and (negatives == "base" or negatives not in defaults.NEGATIVE_KEYWORDS):
        try:
            pool, pool_split = pool_location(negatives, Path(cache_path))
        except ConfigError:
            pool = None
        if pool is not None:
            groups.setdefault(pool, []).append(pool_split)  # the cache itself for base
    for p, splits in groups.items():
        start(p, splits)


def take(path: str | os.PathLike, split: str, shape: tuple[int, ...]) -> Any | None:
    """The prefetched ``features`` array of ``split`` (numpy, the file's dtype), or None when nothing
    was prefetched, the read failed, the file changed since, or the array is not of ``shape``.
    Waits for the read if it is still running. An array is handed out once."""
    p = Path(path)
    try:
        key = (os.path.realpath(p), split)
    except OSError:
        return None
    with _lock:
        entry = _pending.pop(key, None)
    if entry is None:
        return None
    thread, box = entry
    thread.join()
    arr = box.pop(split, None)
    if arr is None or "error" in box:
        return None
    try:
        if _stamp(p) != box.get("stamp"):
            return None
    except OSError:
        return None
    return arr if tuple(arr.shape) == tuple(shape) else None


def clear() -> None:
    """Forget every prefetched array (waiting for reads in progress)."""
    with _lock:
        entries = list(_pending.values())
        _pending.clear()
    for thread, _ in entries:
        thread.join()


__all__ = ["pool_location", "start", "start_for_solve", "take", "clear"]
