"""A split extracted by several processes: staged shares keyed by row range, merged by rank 0.

Under torchrun every rank of ``poodle extract`` writes the rows ``[start, stop)`` of a split it was
given into its own staging file ``<cache>.<split>.<start>-<stop>.share`` (the :class:`SplitWriter`
format, flushed after every batch, plus one float64 row per batch: the sum of the batch's raw
features). A share is keyed by its row range, never by the rank that wrote it, so an interrupted run
resumes with any number of processes: rank 0 reads which rows every share file holds (its *covered*
range ``[start, start + consumed)``), and the rows no file covers are cut into whole batches of the
one-process run and dealt out again (:func:`plan`). A one-process run's staging file
``<cache>.<split>.partial`` counts as the share starting at row 0.

Rank 0 merges the shares in row order into a copy of the cache and renames it over the cache
(:func:`commit_shares`): features, labels and paths are the same bytes as a one-process run's,
because every batch holds the same images (boundaries at multiples of the batch size from row 0)
and the rows are copied, not recomputed; ``raw_mean`` too, because the per-batch sums are added in
the one-process run's order.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import h5py
import numpy as np
import torch

from poodle.cache import (
    _ROWS_PER_BLOCK,
    FEATURE_DTYPES,
    IDENTITY_ATTRS,
    PARTIAL_FORMAT,
    STRING,
    SplitWriter,
    _set_skipped,
    _set_vector,
    _strings,
    _text,
    cache_lock,
    partial_path,
    replace_with_copy,
)
from poodle.errors import CacheError


def share_path(cache_path: str | os.PathLike, split: str, start: int, stop: int) -> Path:
    """``<cache>.<split>.<start>-<stop>.share`` next to the cache."""
    p = Path(cache_path)
    return p.with_name(f"{p.name}.{split}.{start}-{stop}.share")


def share_files(cache_path: str | os.PathLike, split: str) -> list[Path]:
    """The share files of ``split`` present next to the cache, by start row."""
    p = Path(cache_path)
    pat = re.compile(re.escape(f"{p.name}.{split}.") + r"(\d+)-(\d+)\.share$")
    found = [(int(m.group(1)), q) for q in p.parent.glob(f"{p.name}.{split}.*.share") if (m := pat.match(q.name))]
    return [q for _, q in sorted(found)]


def share_key(
    samples_sha256: str, n_split: int, dim: int, dtype: str, root_attrs: Mapping[str, Any], batch_size: int
) -> dict[str, str]:
    """What a share file must match to be reused (without its row range): the image list, the
    features' provenance and storage type, and the batch size (batches must be the same images)."""
    return {
        "samples_sha256": samples_sha256,
        "n_split": str(n_split),
        "feature_dim": str(dim),
        "dtype": str(FEATURE_DTYPES[dtype]),
        "batch_size": str(batch_size),
        **{k: str(root_attrs[k]) for k in IDENTITY_ATTRS},
    }


class ShareWriter(SplitWriter):
    """Streams rows ``[start, stop)`` of a split into ``share_path(...)``; merged by :func:`commit_shares`.

    Every :meth:`append` must be one whole batch of ``batch_size`` images (the last one of the range
    may be shorter), so the per-batch raw sums line up with a one-process run's.
    """

    def __init__(
        self,
        cache_path: str | os.PathLike,
        split: str,
        start: int,
        stop: int,
        *,
        key: Mapping[str, str],
        root_attrs: Mapping[str, Any],
        classes: Sequence[str],
        dim: int,
        dtype: str = "float32",
        restart: bool = False,
    ) -> None:
        self.start, self.stop = int(start), int(stop)
        self.batch_size = int(key["batch_size"])
        if not 0 <= self.start < self.stop <= int(key["n_split"]) or self.start % self.batch_size:
            raise CacheError(
                f"share [{start}, {stop}) of split {split!r} does not start on a batch boundary "
                f"inside its {key['n_split']} images",
                param="start",
                value=start,
            )
        super().__init__(
            cache_path,
            split,
            root_attrs=root_attrs,
            classes=classes,
            samples_sha256=key["samples_sha256"],
            n_total=self.stop - self.start,
            dim=dim,
            dtype=dtype,
            restart=restart,
            path=share_path(cache_path, split, self.start, self.stop),
            extra_key={**key, "start": self.start, "stop": self.stop},
        )

    def _create(self) -> None:
        super()._create()
        assert self.f is not None
        self.f[self.split].create_dataset(
            "batch_sums", shape=(0, self.dim), maxshape=(None, self.dim), dtype=np.float64, chunks=(64, self.dim)
        )
        self.f.flush()

    def _try_resume(self) -> bool:
        ok = super()._try_resume()
        if not ok or self.f is None:
            return False
        # a share ends a batch, or its range; and holds the sum of every batch it has
        if (
            self.n_consumed % self.batch_size
            and self.n_consumed != self.n_total
            or self.f[self.split]["batch_sums"].shape[0] < _n_batches(self.n_consumed, self.batch_size)
        ):
            self.close()
            self.path.unlink()
            return False
        return True

    def append(
        self,
        raw: np.ndarray | torch.Tensor,
        labels: Sequence[int] | np.ndarray,
        paths: Sequence[str],
        *,
        n_consumed: int | None = None,
        skipped: Sequence[str] = (),
    ) -> None:
        assert self.f is not None, "writer is closed"
        if isinstance(raw, torch.Tensor):
            raw = raw.detach().cpu().numpy()
        raw = np.asarray(raw)
        n = len(raw) + len(skipped) if n_consumed is None else int(n_consumed)
        if n != min(self.batch_size, self.n_total - self.n_consumed):
            raise CacheError(
                f"share {self.path.name}: a batch of {n} images where {self.batch_size} were due",
                param="n_consumed",
                value=n,
            )
        # Written before the rows and the state (the commit point): a torn write leaves a spare row.
        k = _n_batches(self.n_consumed, self.batch_size)
        sums = self.f[self.split]["batch_sums"]
        sums.resize(k + 1, axis=0)
        # the same expression as SplitWriter.append's running sum, so the float64 values agree
        sums[k] = raw.astype(np.float64).sum(0) if raw.ndim == 2 and raw.shape[1] == self.dim else 0.0
        super().append(raw, labels, paths, n_consumed=n, skipped=skipped)


def _n_batches(consumed: int, batch_size: int) -> int:
    return -(-consumed // batch_size)


@dataclass
class Covered:
    """Rows ``[start, start + consumed)`` of a split held by one staging file."""

    path: Path
    start: int
    consumed: int
    kind: str  # "share" or "partial" (a one-process run's staging file)

    @property
    def end(self) -> int:
        return self.start + self.consumed


def scan(cache_path: str | os.PathLike, split: str, key: Mapping[str, str]) -> tuple[list[Covered], list[Path]]:
    """The usable staged rows of ``split`` (disjoint, by start) and the staging files to delete
    (made with other settings, unreadable, empty, or overlapping a file found earlier)."""
    found: list[Covered] = []
    stale: list[Path] = []
    part = partial_path(cache_path, split)
    if part.exists():
        c = _read_partial(part, split, key)
        (found.append(c) if c is not None and c.consumed else stale.append(part))
    for p in share_files(cache_path, split):
        c = _read_share(p, split, key)
        (found.append(c) if c is not None and c.consumed else stale.append(p))
    found.sort(key=lambda c: (c.start, -c.consumed))
    kept: list[Covered] = []
    for c in found:
        if kept and c.start < kept[-1].end:
            stale.append(c.path)
        else:
            kept.append(c)
    return kept, stale


def _read_state(f: h5py.File, dim: int) -> np.ndarray | None:
    """The staging file's committed state [rows, consumed, skipped, raw sum (D)] (the slot its
    ``state_head`` points at, checked against the head), or None when it is damaged."""
    head = np.asarray(f.attrs["state_head"], dtype=np.float64)
    slots = f["state"]
    if head.shape != (5,) or slots.shape != (2, 3 + dim) or head[0] not in (0, 1):
        return None
    state = np.asarray(slots[int(head[0])], dtype=np.float64)
    if not (np.isfinite(state).all() and (state[:3] == head[1:4]).all() and float(state.sum()) == float(head[4])):
        return None
    return state


def _state_ok(f: h5py.File, split: str, want: Mapping[str, str], dim: int) -> np.ndarray | None:
    a = f.attrs
    if _text(a.get("format")) != PARTIAL_FORMAT or any(str(_text(a.get(k))) != v for k, v in want.items()):
        return None
    state = _read_state(f, dim)
    if state is None:
        return None
    n_rows, n_consumed, n_skipped = (int(v) for v in state[:3])
    g = f[split]
    if not (
        g["features"].shape[0] >= n_rows
        and g["labels"].shape[0] >= n_rows
        and g["paths"].shape[0] >= n_rows
        and g["skipped"].shape[0] >= n_skipped
        and n_rows + n_skipped == n_consumed
    ):
        return None
    return state


def _read_share(path: Path, split: str, key: Mapping[str, str]) -> Covered | None:
    m = re.search(r"\.(\d+)-(\d+)\.share$", path.name)
    if m is None:
        return None
    start, stop = int(m.group(1)), int(m.group(2))
    try:
        with h5py.File(path, "r") as f:
            want = {**key, "start": str(start), "stop": str(stop), "n_total": str(stop - start)}
            state = _state_ok(f, split, want, int(key["feature_dim"]))
            if state is None or f[split]["batch_sums"].shape[0] < _n_batches(int(state[1]), int(key["batch_size"])):
                return None
            consumed = int(state[1])
    except (OSError, KeyError, ValueError):
        return None
    if consumed % int(key["batch_size"]) and start + consumed != stop:
        return None
    return Covered(path, start, consumed, "share")


def _read_partial(path: Path, split: str, key: Mapping[str, str]) -> Covered | None:
    want = {
        "samples_sha256": key["samples_sha256"],
        "n_total": key["n_split"],
        "feature_dim": key["feature_dim"],
        "dtype": key["dtype"],
        **{k: key[k] for k in IDENTITY_ATTRS},
    }
    try:
        with h5py.File(path, "r") as f:
            state = _state_ok(f, split, want, int(key["feature_dim"]))
    except (OSError, KeyError, ValueError):
        return None
    return None if state is None else Covered(path, 0, int(state[1]), "partial")


def plan(covered: Sequence[Covered], n: int, batch_size: int, world: int) -> list[list[tuple[int, int]]]:
    """Per rank, the row ranges ``[a, b)`` to extract: the rows no staging file covers, cut into the
    one-process run's batches, dealt out in contiguous runs of (nearly) equal batch counts."""
    gaps, pos = [], 0
    for c in sorted(covered, key=lambda c: c.start):
        if c.start > pos:
            gaps.append((pos, c.start))
        pos = max(pos, c.end)
    if pos < n:
        gaps.append((pos, n))
    batches = [(a, min(g1, a + batch_size)) for g0, g1 in gaps for a in range(g0, g1, batch_size)]
    out: list[list[tuple[int, int]]] = []
    for r in range(world):
        pieces: list[tuple[int, int]] = []
        for a, b in batches[len(batches) * r // world : len(batches) * (r + 1) // world]:
            if pieces and pieces[-1][1] == a:
                pieces[-1] = (pieces[-1][0], b)
            else:
                pieces.append((a, b))
        out.append(pieces)
    return out


@dataclass
class _Staged:
    """One staging file opened for the merge, with its committed state."""

    covered: Covered
    file: h5py.File
    state: np.ndarray  # [rows, consumed, skipped, raw sum (D)]

    @property
    def rows(self) -> int:
        return int(self.state[0])

    @property
    def n_skipped(self) -> int:
        return int(self.state[2])


def commit_shares(
    cache_path: str | os.PathLike,
    split: str,
    covered: Sequence[Covered],
    *,
    n_split: int,
    batch_size: int,
    root_attrs: Mapping[str, Any],
    classes: Sequence[str],
    dim: int,
    dtype: str,
    samples_sha256: str,
    fresh: bool = False,
) -> tuple[int, int]:
    """Write the split from its staged rows, in row order, into a copy of the cache (created when
    absent or ``fresh``), validate it, rename it over the cache and delete the staging files.

    ``covered`` must tile ``[0, n_split)``. Returns ``(rows written, images skipped)``.
    """
    cache_path = Path(cache_path)
    parts = _tiling(split, covered, n_split)
    files = [h5py.File(c.path, "r") for c in parts]
    done: dict[str, Any] = {}

    def fill(dst: h5py.Group) -> None:
        staged = [_Staged(c, f, _committed_state(c, f, dim)) for c, f in zip(parts, files)]
        n = sum(s.rows for s in staged)
        total, skipped = _merge_rows(dst, staged, split, n, dim, FEATURE_DTYPES[dtype], batch_size)
        labels = dst["labels"][()]
        if labels.size and (labels.min() < 0 or labels.max() >= len(classes)):
            # not a caller's value: the staging files poodle wrote disagree
            raise CacheError(f"split {split!r}: staged labels outside the {len(classes)} classes")
        dst.create_dataset("classes", data=np.array(list(classes), dtype=object), dtype=STRING)
        dst.attrs["n_images"] = n
        dst.attrs["feature_dim"] = dim
        _set_vector(dst, "raw_mean", (total / n if n else np.zeros(dim)).astype(np.float32))
        dst.attrs.create("samples_sha256", samples_sha256, dtype=STRING)
        _set_skipped(dst, skipped)
        dst.attrs["complete"] = True
        done.update(n=n, skipped=len(skipped))

    try:
        # commits into one cache are serialised by its lock (poodle.cache)
        with cache_lock(cache_path):
            replace_with_copy(cache_path, split, root_attrs, fill, fresh=fresh, staged="its share files")
    finally:
        for f in files:
            f.close()
    for c in parts:
        c.path.unlink()
    return done["n"], done["skipped"]


def _tiling(split: str, covered: Sequence[Covered], n_split: int) -> list[Covered]:
    """``covered`` by start row; CacheError unless it tiles ``[0, n_split)``."""
    parts = sorted(covered, key=lambda c: c.start)
    pos = 0
    for c in parts:
        if c.start != pos:
            # not a caller's value: the staging files poodle wrote disagree
            raise CacheError(f"split {split!r}: staged rows jump from {pos} to {c.start} ({c.path.name})")
        pos = c.end
    if pos != n_split:
        # not a caller's value: the staging files poodle wrote disagree
        raise CacheError(f"split {split!r}: only {pos} of {n_split} images are staged")
    return parts


def _committed_state(c: Covered, f: h5py.File, dim: int) -> np.ndarray:
    state = _read_state(f, dim)
    if state is None:
        # not a caller's value: a staging file poodle wrote is damaged
        raise CacheError(f"{c.path}: its state is damaged; delete it and run again")
    return state


def _merge_rows(
    dst: h5py.Group, staged: Sequence[_Staged], split: str, n: int, dim: int, fdtype: Any, batch_size: int
) -> tuple[np.ndarray, list[str]]:
    """Copy the staged rows, in order, into new ``features``, ``labels``, ``paths`` (and ``norms``)
    datasets of ``dst``; returns the sum of the raw features, float64 ``[D]``, added in the
    one-process run's order, and the skipped images."""
    fd = dst.create_dataset("features", shape=(n, dim), dtype=fdtype)
    ld = dst.create_dataset("labels", shape=(n,), dtype=np.int64)
    pd = dst.create_dataset("paths", shape=(n,), dtype=STRING)
    # raw row norms (cache version 2) when every part staged them
    nd = (
        dst.create_dataset("norms", shape=(n,), dtype=np.float32)
        if all("norms" in s.file[split] for s in staged)
        else None
    )
    total = np.zeros(dim, dtype=np.float64)
    skipped: list[str] = []
    at = 0
    for s in staged:
        src, rows = s.file[split], s.rows
        for a in range(0, rows, _ROWS_PER_BLOCK):
            b = min(rows, a + _ROWS_PER_BLOCK)
            fd[at + a : at + b] = src["features"][a:b]
            ld[at + a : at + b] = src["labels"][a:b]
            pd[at + a : at + b] = src["paths"].asstr()[a:b]
            if nd is not None:
                nd[at + a : at + b] = src["norms"][a:b]
        at += rows
        if s.n_skipped:
            skipped.extend(_strings(src["skipped"])[: s.n_skipped])
        if s.covered.kind == "partial":  # its running sum is the one-process prefix sum: continue from it
            total = total + s.state[3:]
        else:
            for row in src["batch_sums"][: _n_batches(s.covered.consumed, batch_size)]:
                total += row
    return total, skipped


def class_counts(covered: Sequence[Covered], split: str, n_classes: int) -> np.ndarray:
    """Rows per class over the staged rows, int64 [C]."""
    counts = np.zeros(n_classes, dtype=np.int64)
    for c in covered:
        with h5py.File(c.path, "r") as f:
            state = _read_state(f, int(f[split]["features"].shape[1]))
            rows = 0 if state is None else int(state[0])
            y = np.asarray(f[split]["labels"][:rows], dtype=np.int64)
        counts += np.bincount(y, minlength=n_classes)
    return counts
