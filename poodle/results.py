"""The results layer: one record per solved cell, in an append-only JSON Lines file.

Every command that solves episodes (``grid``, ``demo``, ``solve --out``, the benchmarks) writes its
results through this module, and ``report`` reads them only through it.

A *cell* is one method configuration solved on one episode set. Its **identity** is everything that
determines its per-episode accuracies:

- ``cache_id``: the content fingerprint of the feature cache (:func:`cache_identity`, the sha256 of
  the file), so a record is never reused for another cache, even one at the same path;
- ``episode``: ``{split, way, shot, query, imbalance, seed, episodes}``;
- ``negatives`` (the source: ``base``, ``random``, ``sphere``, ``none`` or a file), its fingerprint
  ``negatives_id`` for a file pool, and ``n_neg`` (``None`` without negatives);
- ``method``, ``options`` (every field of the method's resolved config: the values used, never
  "the default") and ``transductive``;
- ``preprocess`` (:mod:`poodle.preprocess`: ``cl2n``, ``power:0.5``); absent for the default
  ``l2n``, so records written before the option existed keep their keys.

The record's ``key`` is a hash of the identity (:func:`identity_key`); a lookup by key finds a
record only when all of it agrees. What is only shown (``label``, the cache's path as written,
``index``, ``group``) and what was measured (``acc``, ``mean``, ``ci95``, timings, device) are
outside the identity. The file: a header line ``{"format": "poodle-results", "version": 2,
"kind": "header", ...}``, then one ``{"kind": "cell", ...}`` line per record, each appended and
fsynced alone; a cut last line (a run killed mid-write) is ignored and cut off on the next append.
When a key occurs twice the last record wins. The schema is in docs/architecture.md.

"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from poodle import __version__
from poodle.errors import ConfigError, mark
from poodle.options import setting
from poodle.preprocess import PreprocessSpec
from poodle.settings import EPISODE_KEYS, episode_record
from poodle.stats import mean_ci
from poodle.utils import atomic_write, check_size_limit, content_hash, file_sha256, resolve_path, write_error

FORMAT = "poodle-results"
VERSION = 2

# Fields of a record that make up its identity.
IDENTITY_FIELDS: tuple[str, ...] = (
    "cache_id",
    "episode",
    "negatives",
    "negatives_id",
    "n_neg",
    "method",
    "options",
    "transductive",
    "preprocess",
)
# Identity fields left out of the key (and of the identity) when they hold their default value.
_OPTIONAL_IDENTITY: dict[str, Any] = {"preprocess": setting(PreprocessSpec, "preprocess").default}

_FINGERPRINTS: dict[tuple[str, int, int], str] = {}


def cache_identity(path: str | os.PathLike) -> str:
    """The content fingerprint of a cache file (hex sha256 of its bytes), computed once per process
    for an unchanged file (same path, size and modification time)."""
    p = resolve_path(path, what="feature cache")
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"feature {mark('cache')} {p} does not exist", param="cache", value=path) from None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = file_sha256(p)
    return _FINGERPRINTS[key]


def jsonable(v: Any) -> Any:
    """``v`` as plain JSON values (tuples -> lists, unknown objects -> str)."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return str(v)


def make_identity(
    *,
    cache_id: str,
    episode: Mapping[str, Any],
    negatives: str,
    n_neg: int | None,
    method: str,
    options: Mapping[str, Any],
    transductive: bool,
    negatives_id: str | None = None,
    preprocess: str | None = None,
) -> dict[str, Any]:
    """A cell's identity (see the module docstring); ``episode`` must hold every episode field."""
    missing = [k for k in EPISODE_KEYS if k not in episode]
    if missing:
        raise ConfigError(f"episode settings lack {', '.join(missing)}", param="episode", value=episode)
    ep = {k: jsonable(v) for k, v in episode_record(dict(episode)).items()}
    identity = {
        "cache_id": cache_id,
        "episode": ep,
        "negatives": negatives,
        "negatives_id": negatives_id,
        "n_neg": None if negatives == "none" else n_neg,
        "method": method,
        "options": jsonable(dict(options)),
        "transductive": bool(transductive),
    }
    if preprocess is not None and preprocess != _OPTIONAL_IDENTITY["preprocess"]:
        identity["preprocess"] = str(preprocess)
    return identity


def identity_key(identity: Mapping[str, Any]) -> str:
    """The lookup key of an identity: 20 hex digits of its canonical hash."""
    return content_hash(_identity_fields(identity))[:20]


def _identity_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k in IDENTITY_FIELDS:
        if k in _OPTIONAL_IDENTITY and d.get(k) in (None, _OPTIONAL_IDENTITY[k]):
            continue
        out[k] = d.get(k)
    return out


def make_record(
    identity: Mapping[str, Any],
    acc: Sequence[float],
    *,
    label: str,
    cache: str,
    index: int = 0,
    group: str = "",
    seconds: float | None = None,
    key: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A cell record: the identity, its key (:func:`identity_key` of it; ``key``: that key, computed
    once by the caller), display fields, per-episode accuracies ``acc [E]`` in [0, 1], their mean
    and 95% half-width (1.96 * population std / sqrt(E)), and ``extra`` fields (timings, device, ...)."""
    values = [float(a) for a in acc]
    n = len(values)
    mean, ci95 = mean_ci(values)
    record: dict[str, Any] = {
        "kind": "cell",
        "key": identity_key(identity) if key is None else key,
        **identity,
        "label": label,
        "cache": cache,
        "index": index,
        "group": group,
        "mean": mean,
        "ci95": ci95,
        "n": n,
    }
    if seconds is not None:
        record["seconds"] = round(float(seconds), 4)
        record["episodes_per_s"] = round(n / seconds, 2) if seconds > 0 else None
    record.update(jsonable(extra))
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record["acc"] = values
    return record


def record_flat(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record as one namespace for reports: label, cache (as written), episode settings,
    negatives, method, the method's options and ``transductive``."""
    d = {
        "label": record["label"],
        "cache": record["cache"],
        **record["episode"],
        "negatives": record["negatives"],
        "n_neg": record["n_neg"],
        "preprocess": record.get("preprocess") or _OPTIONAL_IDENTITY["preprocess"],
        "method": record["method"],
    }
    for k, v in record.get("options", {}).items():
        d.setdefault(k, v)
    d["transductive"] = record.get("transductive", False)
    return d


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class ResultsContent:
    """A results file's content: its header and its records (last record per key), in file order."""

    path: Path
    header: dict[str, Any]
    records: list[dict[str, Any]]
    complete_bytes: int = 0
    _by_key: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_key = {r["key"]: r for r in self.records}

    def get(self, key: str) -> dict[str, Any] | None:
        return self._by_key.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self.records)


def _parse_lines(path: Path, raw: bytes) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """``([(line number, object)], bytes of complete lines)``; a cut last line is dropped."""
    objs: list[tuple[int, dict[str, Any]]] = []
    lines = raw.split(b"\n")
    complete = offset = 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        end = offset + len(line) + (0 if last else 1)
        if not line.strip():
            offset = end
            if not last:
                complete = end
            continue
        try:
            obj = json.loads(line)
            if last:
                # JSON without its newline may still be cut short (e.g. a number); only a line that
                # ended with "\n" was surely written whole.
                raise ValueError("no newline")
        except ValueError:
            if last:
                break
            if not objs:  # nothing read yet: not a results file at all (a grid spec, a CSV ...)
                raise ConfigError(
                    f"{path} is not a results file (its first line is not JSON; results files are the JSON "
                    f"Lines that solving with an output file, a grid and the demo write)",
                    param="path",
                    value=path,
                ) from None
            raise ConfigError(
                f"{path}: line {i + 1} is not valid JSON; the file is damaged", param="path", value=path
            ) from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}: line {i + 1} is not a JSON object", param="path", value=path)
        objs.append((i + 1, obj))
        complete = offset = end
    return objs, complete


def read_results(path: str | os.PathLike) -> ResultsContent:
    """Read a results file. A malformed line other than a cut last one is a :class:`ConfigError`
    naming the line."""
    path = resolve_path(path, what="results file")
    try:
        raw = _read_locked(path)
    except FileNotFoundError:
        raise ConfigError(f"results file {path} does not exist", param="path", value=path) from None
    except IsADirectoryError:
        raise ConfigError(f"results file {path} is a directory", param="path", value=path) from None
    return _parse(path, raw)


def _read_locked(path: Path) -> bytes:
    """The file's bytes, read under a shared lock: never half of an append in progress."""
    with open(path, "rb") as f, _locked(f.fileno(), exclusive=False):
        return f.read()


def _parse(path: Path, raw: bytes) -> ResultsContent:
    objs, complete = _parse_lines(path, raw)
    if not objs:
        raise ConfigError(f"{path} is empty or has no header line", param="path", value=path)
    header = objs[0][1]
    if header.get("format") != FORMAT:
        raise ConfigError(
            f"{path} is not a poodle results file (its first line has no format={FORMAT!r})", param="path", value=path
        )
    if header.get("version") != VERSION:
        raise ConfigError(
            f"{path}: results format version {header.get('version')} is not supported (this poodle reads "
            f"version {VERSION})",
            param="path",
            value=path,
        )
    records: dict[str, dict[str, Any]] = {}
    for line, obj in objs[1:]:
        if obj.get("kind") != "cell":
            continue
        missing = [k for k in ("key", "acc", "method", "episode") if k not in obj]
        if missing:
            raise ConfigError(
                f"{path}: line {line} is a cell record without {', '.join(missing)}", param="path", value=path
            )
        records.pop(obj["key"], None)
        records[obj["key"]] = obj
    return ResultsContent(path, header, list(records.values()), complete)


@contextlib.contextmanager
def _locked(fd: int, exclusive: bool) -> Iterator[None]:
    """An advisory lock (``flock``) on an open results file, released on leaving: appends hold it
    exclusively, so two processes writing one file never interleave or cut each other's records."""
    try:
        import fcntl  # POSIX only: imported here so that the module loads elsewhere
    except ImportError:  # pragma: no cover - no locking where there is no fcntl
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Writing


def new_header(**meta: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "header",
        "poodle_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **jsonable(meta),
    }


class ResultsFile:
    """A results file opened for lookups and appends.

    Opening creates the file (header only) when it does not exist, or when ``fresh`` (then its old
    content is discarded); with ``lazy``, a missing (or empty) file is created by the first append
    instead, so that a run that fails before it has a record leaves no file behind. Several processes
    may append to one file at once (two ``poodle grid`` runs of one grid): every append holds an
    exclusive lock, first cuts off a torn last line (a writer killed mid-append) and, if the write
    fails (disk full), cuts its own bytes off again, so that the file holds whole records only and
    every record of another writer is kept.
    """

    def __init__(self, path: str | os.PathLike, *, fresh: bool = False, lazy: bool = False, **meta: Any) -> None:
        self.path = resolve_path(path, what="results file")
        header = _line(new_header(**meta))
        self._pending: bytes | None = None
        if fresh:
            atomic_write(self.path, header)
        elif lazy and not (self.path.exists() and self.path.stat().st_size > 0):
            self._pending = header  # written with the first record
            self.results = _parse(self.path, header)
            return
        else:
            _create_exclusive(self.path, header)
        self.results = _parse(self.path, _read_locked(self.path))

    @property
    def header(self) -> dict[str, Any]:
        return self.results.header

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.results.records

    def get(self, key: str) -> dict[str, Any] | None:
        return self.results.get(key)

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one record (a line, written whole under the lock and fsynced) and make it visible
        to :meth:`get`. A :class:`~poodle.errors.WriteError` when it cannot be written; the file is
        then as it was."""
        if record.get("kind") != "cell" or "key" not in record:
            raise ValueError("a results record needs kind='cell' and a key (see make_record)")
        data = _line(record)
        if self._pending is not None:
            _create_exclusive(self.path, self._pending)
            self._pending = None
        fd = os.open(self.path, os.O_RDWR)
        try:
            with _locked(fd, exclusive=True):
                end = _whole_lines_end(fd)
                try:
                    if end < os.fstat(fd).st_size:  # a torn last line of a killed writer goes first
                        os.ftruncate(fd, end)
                    check_size_limit(end + len(data))
                    _write_all(fd, data, end)
                    os.fsync(fd)
                except OSError as e:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, end)
                        os.fsync(fd)
                    raise write_error(self.path, e, "the record was not appended; the file is as it was") from e
        finally:
            os.close(fd)
        rec = dict(record)
        self.results._by_key.pop(rec["key"], None)
        self.results.records = [r for r in self.results.records if r["key"] != rec["key"]] + [rec]
        self.results._by_key[rec["key"]] = rec


def _create_exclusive(path: Path, header: bytes) -> None:
    """Create ``path`` holding ``header`` unless a file is there. The header is written whole under
    a temporary name, then hard-linked to ``path``, which fails when another process created the
    file first: its file, and any record already appended to it, is kept. An empty file (which
    :func:`poodle.utils.check_output` lets one replace) is replaced."""
    target = Path(os.path.realpath(path))  # a link's target is created, the link kept
    if target.exists() and target.stat().st_size > 0:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    try:
        try:
            with open(tmp, "xb") as f:
                f.write(header)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise write_error(path, e, "nothing was written under that name") from e
        try:
            os.link(tmp, target)
        except FileExistsError:
            if target.stat().st_size == 0:
                os.replace(tmp, target)
        except OSError:  # a file system without hard links: the header is written in place
            with contextlib.suppress(FileExistsError), open(target, "xb") as f:
                f.write(header)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _whole_lines_end(fd: int) -> int:
    """The length of the file's part made of whole lines (a torn last line of a killed writer is
    after it). Read from the end in blocks: records are long, but only the tail is read."""
    size = os.fstat(fd).st_size
    pos = size
    while pos > 0:
        start = max(0, pos - (1 << 16))
        block = os.pread(fd, pos - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            return start + nl + 1
        pos = start
    return 0


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _line(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), allow_nan=True) + "\n").encode()


__all__ = [
    "FORMAT",
    "VERSION",
    "IDENTITY_FIELDS",
    "ResultsContent",
    "ResultsFile",
    "cache_identity",
    "identity_key",
    "jsonable",
    "make_identity",
    "make_record",
    "new_header",
    "read_results",
    "record_flat",
]
