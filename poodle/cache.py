"""The HDF5 feature cache: the one module that knows its schema.

A cache is one file per (dataset, backbone, checkpoint), ``<cache-root>/<dataset>/<backbone>[-<tag>].h5``::

    /                  attrs: format="poodle-features", version=2, dataset, backbone,
                              checkpoint_sha256 (or "none"), image_size, transform, created, poodle_version,
                              pretrained weights' provenance (weights, weights_source, weights_repository,
                              weights_revision, weights_file, weights_url; optional)
    /<split>/features  float32 or float16 [N, D], every row L2-normalised
    /<split>/labels    int64 [N], indices into /<split>/classes
    /<split>/classes   utf-8 strings [C], class names
    /<split>/paths     utf-8 strings [N], image paths relative to the dataset root (optional)
    /<split>/norms     float32 [N], each row's L2 norm before normalisation (optional; version 2)
    /<split>           attrs: complete=True, n_images, feature_dim, raw_mean (float32 [D])

``raw_mean`` is an attribute when it fits the 64 KiB limit of HDF5 attributes (D up to 12,000) and a
dataset ``/<split>/raw_mean`` beyond; readers accept either.

Version 2 added the optional ``norms`` dataset (``features * norms[:, None]`` are the backbone's
raw outputs, which SimpleShot-style centring needs); version 1 files, which lack it, are still read.

Optional split attributes written by :mod:`poodle.extract`: ``samples_sha256`` (digest of the image
list the split was made from), ``n_skipped`` and ``skipped`` (paths of unreadable images left out
with ``--skip-bad``).

Writing is safe against interruption: :func:`write_arrays` writes under a temporary name, and
:class:`SplitWriter` stages a split being extracted in its own ``<cache>.<split>.partial`` file
(flushed after every batch, so an interrupted run resumes from the last batch) that
:meth:`SplitWriter.commit` copies into a fresh copy of the cache, which then replaces the cache
with ``os.replace``. The cache file itself is therefore never open for writing, and only ever holds
complete splits. Commits of several processes into one cache are serialised by an exclusive lock
on ``<cache>.lock`` (``fcntl.flock``) held across re-reading the cache, copying it under a name
unique to the process and renaming it, so each commit starts from the cache the previous one left;
the lock file is removed on release (:func:`cache_lock`), so none is left after a run.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import h5py
import numpy as np
import torch

from poodle import __version__, prefetch
from poodle.errors import CacheError
from poodle.utils import FailSafeFile, atomic_path, resolve_path, write_errno, write_error

FORMAT = "poodle-features"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no /<split>/norms
PARTIAL_FORMAT = "poodle-features-partial-3"  # -2: the state is a dataset; -3: raw row norms are staged
ROOT_ATTRS = (
    "format",
    "version",
    "dataset",
    "backbone",
    "checkpoint_sha256",
    "image_size",
    "transform",
    "created",
    "poodle_version",
)
# Root attributes that say how features were made: a cache that differs in any of them holds other features.
IDENTITY_ATTRS = ("dataset", "backbone", "checkpoint_sha256", "image_size", "transform")
# Root attributes of pretrained weights, besides their sha256 (which alone decides identity): the
# name they were asked by (``timm:NAME.TAG``, ``ResNet50_Weights.IMAGENET1K_V2``), how they were
# found (``hf-hub``, ``torchvision``, ``url``, ``file``), the hub repository and revision, the file
# and its URL (:mod:`poodle.backbones.pretrained`).
PROVENANCE_ATTRS = (
    "weights",
    "weights_source",
    "weights_repository",
    "weights_revision",
    "weights_file",
    "weights_url",
)
FEATURE_DTYPES: dict[str, np.dtype[Any]] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}
# |norm - 1| allowed per row: float16 rounds each coordinate to ~5e-4 relative, float32 to ~6e-8.
NORM_TOLERANCE = {np.dtype(np.float32): 1e-3, np.dtype(np.float16): 5e-3}
STRING = h5py.string_dtype("utf-8")
_SPLIT_ORDER = ("train", "val", "test")
_ROWS_PER_BLOCK = 16384  # rows read or copied at once, so memory stays flat for any N
_MAX_SKIPPED_ATTR_BYTES = 48_000  # HDF5 attributes are limited to 64 KiB in the default file format
_MAX_VECTOR_ATTR_BYTES = 48_000  # a longer vector (raw_mean of D > 12,000) is stored as a dataset


@dataclass
class SplitFeatures:
    """One split of a cache, in memory.

    ``features`` float32 [N, D] (L2-normalised rows; float16 caches are upcast), ``labels`` int64 [N]
    (indices into ``classes``), ``classes`` the C class names, ``paths`` the N image paths (None for
    imported arrays), ``raw_mean`` float32 [D] the mean feature before normalisation (None if absent),
    ``norms`` float32 [N] each row's norm before normalisation (None for caches without them).
    """

    name: str
    features: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    paths: list[str] | None = None
    raw_mean: torch.Tensor | None = None
    norms: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def n_classes(self) -> int:
        return len(self.classes)


# ------------------------------------------------------------------------------------------ reading


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO":
        return [_text(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _strings(ds: h5py.Dataset) -> list[str]:
    return [s if isinstance(s, str) else s.decode("utf-8") for s in ds.asstr()[()].tolist()]


def _is_string_dataset(ds: h5py.Dataset) -> bool:
    return h5py.check_string_dtype(ds.dtype) is not None


class _Reader:
    """Opens a file read-only and checks that it is a poodle cache, turning h5py errors into CacheError."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __enter__(self) -> h5py.File:
        resolve_path(self.path, what="cache")
        if not self.path.exists():
            raise CacheError(f"{self.path}: no such cache file", param="cache", value=self.path)
        if self.path.is_dir():
            raise CacheError(f"{self.path}: is a directory, not a cache file", param="cache", value=self.path)
        try:
            self.f = h5py.File(self.path, "r")
        except OSError as e:
            raise CacheError(
                f"{self.path}: not a poodle feature cache (not a readable HDF5 file: {str(e).splitlines()[0]})",
                param="cache",
                value=self.path,
            ) from None
        try:
            check_root(self.f, self.path)
        except BaseException:
            self.f.close()
            raise
        return self.f

    def __exit__(self, *exc: Any) -> None:
        self.f.close()


def check_root(f: h5py.File, path: str | os.PathLike) -> dict[str, Any]:
    """Check the root attributes of an open file; return them as Python values. CacheError if foreign."""
    fmt = _text(f.attrs.get("format"))
    if fmt != FORMAT:
        what = "has no 'format' attribute" if fmt is None else f"has format={fmt!r}"
        raise CacheError(
            f"{path}: not a poodle feature cache (the root {what}, expected {FORMAT!r})", param="cache", value=path
        )
    attrs = {k: _text(v) for k, v in f.attrs.items()}
    missing = [k for k in ROOT_ATTRS if k not in attrs]
    if missing:
        raise CacheError(f"{path}: root attribute(s) {', '.join(missing)} missing", param="cache", value=path)
    try:
        version = int(attrs["version"])
    except (TypeError, ValueError):
        raise CacheError(
            f"{path}: root attribute version={attrs['version']!r} is not an integer", param="cache", value=path
        ) from None
    if version not in READABLE_VERSIONS:
        raise CacheError(
            f"{path}: cache format version {version}, this poodle reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}",
            param="cache",
            value=path,
        )
    try:
        attrs["image_size"] = int(attrs["image_size"])
    except (TypeError, ValueError):
        raise CacheError(
            f"{path}: root attribute image_size={attrs['image_size']!r} is not an integer", param="cache", value=path
        ) from None
    for k in ("dataset", "backbone", "checkpoint_sha256", "transform", "created", "poodle_version"):
        if not isinstance(attrs[k], str):
            raise CacheError(f"{path}: root attribute {k}={attrs[k]!r} is not a string", param="cache", value=path)
    return attrs


def _split_names(f: h5py.File) -> list[str]:
    names = [k for k, v in f.items() if isinstance(v, h5py.Group)]
    return sorted(names, key=lambda n: (_SPLIT_ORDER.index(n) if n in _SPLIT_ORDER else len(_SPLIT_ORDER), n))


def _is_complete(g: h5py.Group) -> bool:
    c = g.attrs.get("complete", False)
    try:
        return bool(c) and not isinstance(c, (str, bytes))
    except (TypeError, ValueError):
        return False


def read_attrs(path: str | os.PathLike) -> dict[str, Any]:
    """The root attributes of a cache as Python values (CacheError if the file is not a poodle cache)."""
    with _Reader(path) as f:
        return check_root(f, path)


def list_splits(path: str | os.PathLike) -> list[str]:
    """Names of the complete splits in the cache (train, val, test first, then the others sorted)."""
    with _Reader(path) as f:
        return [n for n in _split_names(f) if _is_complete(f[n])]


def _check_split(g: h5py.Group, path: Path, name: str) -> dict[str, Any]:
    """Shape/dtype checks of one split (no pass over the rows). Returns n, dim, dtype, n_classes."""
    where = f"{path}: split {name!r}"
    if not _is_complete(g):
        raise CacheError(
            f"{where} is incomplete (attribute complete is not True); re-run the command "
            f"that writes it (poodle extract resumes)",
            param="cache",
            value=path,
        )
    for key in ("features", "labels", "classes"):
        if key not in g or not isinstance(g[key], h5py.Dataset):
            raise CacheError(f"{where}: dataset {name}/{key} missing", param="cache", value=path)
    feats, labels, classes = g["features"], g["labels"], g["classes"]
    if feats.ndim != 2:
        raise CacheError(f"{where}: features must be 2-D [N, D], got shape {feats.shape}", param="cache", value=path)
    if feats.dtype not in NORM_TOLERANCE:
        raise CacheError(f"{where}: features must be float32 or float16, got {feats.dtype}", param="cache", value=path)
    n, dim = feats.shape
    if labels.dtype != np.int64 or labels.shape != (n,):
        raise CacheError(
            f"{where}: labels must be int64 [{n}], got {labels.dtype} {labels.shape}", param="cache", value=path
        )
    if not _is_string_dataset(classes) or classes.ndim != 1 or classes.shape[0] == 0:
        raise CacheError(
            f"{where}: classes must be a non-empty 1-D string dataset, got {classes.dtype} {classes.shape}",
            param="cache",
            value=path,
        )
    if "paths" in g:
        p = g["paths"]
        if not isinstance(p, h5py.Dataset) or not _is_string_dataset(p) or p.shape != (n,):
            raise CacheError(
                f"{where}: paths must be a string dataset [{n}], got "
                f"{getattr(p, 'dtype', '?')} {getattr(p, 'shape', '?')}",
                param="cache",
                value=path,
            )
    if "norms" in g:
        nm = g["norms"]
        if not isinstance(nm, h5py.Dataset) or nm.dtype.kind != "f" or nm.shape != (n,):
            raise CacheError(
                f"{where}: norms must be float [{n}], got {getattr(nm, 'dtype', '?')} {getattr(nm, 'shape', '?')}",
                param="cache",
                value=path,
            )
    for key, want in (("n_images", n), ("feature_dim", dim)):
        if key not in g.attrs:
            raise CacheError(f"{where}: attribute {key} missing", param="cache", value=path)
        try:
            ok = int(g.attrs[key]) == want
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise CacheError(
                f"{where}: attribute {key}={_text(g.attrs[key])!r} but the features have {want}",
                param="cache",
                value=path,
            )
    rm = _get_vector(g, "raw_mean")
    if rm is None:
        raise CacheError(f"{where}: attribute raw_mean missing", param="cache", value=path)
    if rm.dtype.kind != "f" or rm.shape != (dim,) or not np.isfinite(rm).all():
        raise CacheError(
            f"{where}: attribute raw_mean must be finite float [{dim}], got {rm.dtype} {rm.shape}",
            param="cache",
            value=path,
        )
    return {"n": n, "dim": dim, "dtype": feats.dtype, "n_classes": int(classes.shape[0])}


def _get_vector(g: h5py.Group, key: str) -> np.ndarray | None:
    """A per-split vector stored as a dataset ``<split>/<key>`` or as an attribute (older caches)."""
    if key in g and isinstance(g[key], h5py.Dataset):
        return np.asarray(g[key][()])
    if key in g.attrs:
        return np.asarray(g.attrs[key])
    return None


def _set_vector(g: h5py.Group, key: str, value: np.ndarray) -> None:
    """Store a vector as an attribute when it fits HDF5's attribute limit, else as a dataset."""
    value = np.asarray(value)
    if value.nbytes <= _MAX_VECTOR_ATTR_BYTES:
        g.attrs[key] = value
    else:
        g.create_dataset(key, data=value)


def _degenerate(n: int, zero: bool) -> str:
    what = "zero" if zero else "the same vector"
    return (
        f"all {n} feature rows are {what}: the features do not depend on the image (were the backbone's "
        f"weights loaded? a checkpoint of the wrong dtype or an untrained network gives this)"
    )


def check_unit_rows(
    features: torch.Tensor, where: str, tol: float = 1e-3, *, cache: str | os.PathLike | None = None
) -> None:
    """CacheError naming the first row of ``features [N, D]`` that is not finite or whose L2 norm is
    neither 1 (within ``tol``) nor 0, or when every row is the same vector (``cache``: the file the
    rows were read from, the error's value). Blockwise, so it costs one
    pass and little memory.

    The norms are taken in the rows' own dtype: a float32 norm errs by about 1e-7 relative, far inside
    any tolerance here, and a NaN or Inf anywhere in a row makes its norm non-finite. Only a flagged
    row is looked at again in float64, to say what is wrong with it. (Converting every row to float64
    first cost 0.3 s of ``poodle solve``'s start-up on a 50,000-row cache.)"""
    n = int(features.shape[0])
    same = n > 1
    for a in range(0, n, _ROWS_PER_BLOCK):
        x = features[a : a + _ROWS_PER_BLOCK]
        if same:
            same = bool((x == features[0]).all())
        norms = torch.linalg.vector_norm(x.float() if x.dtype == torch.float16 else x, dim=1)
        flagged = ~torch.isfinite(norms) | (((norms - 1).abs() > tol) & (norms != 0))
        for r in flagged.nonzero()[:, 0].tolist():  # nearly always none
            row = x[r].double()
            if not bool(torch.isfinite(row).all()):
                raise CacheError(
                    f"{where}: features row {a + r} is not finite (NaN or Inf); re-extract the split or fix the file",
                    param="cache",
                    value=cache,
                )
            norm = float(torch.linalg.vector_norm(row))
            if abs(norm - 1) > tol and norm != 0:
                raise CacheError(
                    f"{where}: features row {a + r} has L2 norm {norm:.6f}, expected 1 (rows must be L2-normalised)",
                    param="cache",
                    value=cache,
                )
    if same:
        raise CacheError(f"{where}: {_degenerate(n, not bool(features[0].any()))}", param="cache", value=cache)


def read_split(path: str | os.PathLike, split: str, *, check_rows: bool = True) -> SplitFeatures:
    """Load one complete split. CacheError if the file is foreign, the split absent or incomplete, or
    (``check_rows``) a row not finite or not of unit norm: the solvers assume unit rows, and one NaN
    row silently moves every accuracy that touches it. Zero rows are allowed (see :func:`validate`)."""
    path = Path(path)
    with _Reader(path) as f:
        names = _split_names(f)
        complete = [n for n in names if _is_complete(f[n])]
        if split not in names:
            raise CacheError(
                f"{path}: no split {split!r}; complete splits: {', '.join(complete) or 'none'}",
                param="split",
                value=split,
            )
        g = f[split]
        if not _is_complete(g):
            raise CacheError(
                f"{path}: split {split!r} is incomplete; complete splits: {', '.join(complete) or 'none'}",
                param="split",
                value=split,
            )
        info = _check_split(g, path, split)
        ds = g["features"]
        raw = prefetch.take(path, split, ds.shape)  # read ahead by the command line, if it did
        feats = torch.from_numpy(np.asarray(ds[()] if raw is None else raw, dtype=np.float32))
        labels = torch.from_numpy(np.asarray(g["labels"][()], dtype=np.int64))
        classes = _strings(g["classes"])
        paths = _strings(g["paths"]) if "paths" in g else None
        norms = torch.from_numpy(np.asarray(g["norms"][()], dtype=np.float32)) if "norms" in g else None
        raw_mean = torch.from_numpy(np.asarray(_get_vector(g, "raw_mean"), dtype=np.float32))
    if info["n"] and (int(labels.min()) < 0 or int(labels.max()) >= len(classes)):
        raise CacheError(f"{path}: split {split!r}: labels outside [0, {len(classes)})", param="cache", value=path)
    if norms is not None and not (torch.isfinite(norms).all() and (norms >= 0).all()):
        raise CacheError(f"{path}: split {split!r}: norms must be finite and non-negative", param="cache", value=path)
    if check_rows:
        check_unit_rows(feats, f"{path}: split {split!r}", NORM_TOLERANCE[info["dtype"]], cache=path)
    return SplitFeatures(
        name=split, features=feats, labels=labels, classes=classes, paths=paths, raw_mean=raw_mean, norms=norms
    )


def validate(path: str | os.PathLike) -> dict[str, Any]:
    """Check a cache completely: schema, dtypes, lengths, label ranges, row norms, completeness.

    Returns ``{"path", "attrs": {root attributes}, "splits": {name: {n_images, n_classes,
    feature_dim, dtype, complete, norm_min, norm_max, zero_rows, has_paths, has_norms, n_skipped}}}``.
    Raises CacheError naming the file, split and problem. Rows that are exactly zero (a backbone
    whose output was all zeros for an image) are allowed and counted in ``zero_rows``; ``constant``
    A split whose rows are all the same vector (all zero, or constant: a backbone that ignores its
    input, e.g. weights that did not load) is a CacheError; ``poodle info`` warns about zero rows.
    """
    path = Path(path)
    with _Reader(path) as f:
        attrs = check_root(f, path)
        names = _split_names(f)
        if not names:
            raise CacheError(f"{path}: holds no splits", param="cache", value=path)
        splits = {name: _validate_split(f[name], path, name) for name in names}
    return {"path": str(path), "attrs": attrs, "splits": splits}


def _validate_split(g: h5py.Group, path: Path, name: str) -> dict[str, Any]:
    info = _check_split(g, path, name)
    n, dim, dtype, n_classes = info["n"], info["dim"], info["dtype"], info["n_classes"]
    where = f"{path}: split {name!r}"
    classes = _strings(g["classes"])
    if len(set(classes)) != len(classes):
        dup = sorted({c for c in classes if classes.count(c) > 1})
        raise CacheError(f"{where}: class names repeat: {', '.join(dup[:5])}", param="cache", value=path)
    tol = NORM_TOLERANCE[dtype]
    counts = np.zeros(n_classes, dtype=np.int64)
    norm_min, norm_max, zero_rows = np.inf, -np.inf, 0
    first_row: np.ndarray | None = None
    all_same = n > 1
    for a in range(0, n, _ROWS_PER_BLOCK):
        x = np.asarray(g["features"][a : a + _ROWS_PER_BLOCK], dtype=np.float64)
        if not np.isfinite(x).all():
            row = a + int(np.argwhere(~np.isfinite(x))[0, 0])
            raise CacheError(f"{where}: features row {row} is not finite", param="cache", value=path)
        if all_same and len(x):
            first_row = x[0] if first_row is None else first_row
            all_same = bool((x == first_row).all())
        norms = np.linalg.norm(x, axis=1)
        zero = norms == 0
        zero_rows += int(zero.sum())
        bad = np.flatnonzero(~zero & (np.abs(norms - 1.0) > tol))
        if bad.size:
            r = int(bad[0])
            raise CacheError(
                f"{where}: features row {a + r} has L2 norm {norms[r]:.6f}, expected 1 "
                f"(rows must be L2-normalised; tolerance {tol} for {dtype})",
                param="cache",
                value=path,
            )
        if (~zero).any():
            norm_min = min(norm_min, float(norms[~zero].min()))
            norm_max = max(norm_max, float(norms[~zero].max()))
        y = np.asarray(g["labels"][a : a + _ROWS_PER_BLOCK])
        out = np.flatnonzero((y < 0) | (y >= n_classes))
        if out.size:
            r = int(out[0])
            raise CacheError(
                f"{where}: labels row {a + r} is {int(y[r])}, outside [0, {n_classes})", param="cache", value=path
            )
        counts += np.bincount(y, minlength=n_classes)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise CacheError(
            f"{where}: class {classes[int(empty[0])]!r} has no rows ({empty.size} class(es) without rows)",
            param="cache",
            value=path,
        )
    if all_same and n > 1:
        raise CacheError(f"{where}: {_degenerate(n, zero_rows == n)}", param="cache", value=path)
    return {
        "n_images": n,
        "n_classes": n_classes,
        "feature_dim": dim,
        "dtype": str(dtype),
        "complete": True,
        "norm_min": norm_min if n > zero_rows else 0.0,
        "norm_max": norm_max if n > zero_rows else 0.0,
        "zero_rows": zero_rows,
        "has_paths": "paths" in g,
        "has_norms": "norms" in g,
        "n_skipped": int(g.attrs.get("n_skipped", 0)),
    }


# ------------------------------------------------------------------------------------------ writing


def make_root_attrs(
    dataset: str,
    backbone: str,
    *,
    checkpoint_sha256: str = "none",
    image_size: int = 0,
    transform: str = "none",
    weights: Mapping[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Root attributes of a new cache (``created`` is now, ``poodle_version`` this package's);
    ``weights``: where pretrained weights came from (:data:`PROVENANCE_ATTRS`)."""
    unknown = sorted(set(weights or {}) - set(PROVENANCE_ATTRS))
    if unknown:
        raise CacheError(
            f"weights provenance has unknown fields {unknown}; known: {', '.join(PROVENANCE_ATTRS)}",
            param="weights",
            value=weights,
        )
    attrs: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "dataset": str(dataset),
        "backbone": str(backbone),
        "checkpoint_sha256": str(checkpoint_sha256 or "none"),
        "image_size": int(image_size),
        "transform": str(transform),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "poodle_version": __version__,
    }
    attrs.update({k: str(v) for k, v in (weights or {}).items()})
    attrs.update(extra)
    return attrs


def identity_mismatches(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """``key: existing != wanted`` for each identity attribute that differs (empty: same features)."""
    out = []
    for k in IDENTITY_ATTRS:
        a, b = existing.get(k), wanted.get(k)
        if str(a) != str(b):
            out.append(f"{k}={_short(a)} (this run: {_short(b)})")
    return out


def _short(v: Any) -> str:
    s = str(v)
    return s[:12] + "…" if len(s) == 64 and all(c in "0123456789abcdef" for c in s) else repr(s)


def _set_attrs(obj: h5py.HLObject, attrs: Mapping[str, Any]) -> None:
    for k, v in attrs.items():
        if isinstance(v, str):
            obj.attrs.create(k, v, dtype=STRING)
        else:
            obj.attrs[k] = v


def _set_skipped(g: h5py.Group, skipped: Sequence[str]) -> None:
    g.attrs["n_skipped"] = len(skipped)
    if not skipped:
        return
    if sum(len(s.encode()) + 16 for s in skipped) <= _MAX_SKIPPED_ATTR_BYTES:
        g.attrs.create("skipped", np.array(list(skipped), dtype=object), dtype=STRING)
    else:  # too many for an attribute: keep them all in a dataset, and say so in the attribute
        g.create_dataset("skipped", data=np.array(list(skipped), dtype=object), dtype=STRING)
        g.attrs.create("skipped", f"{len(skipped)} paths, see dataset {g.name}/skipped", dtype=STRING)


def _l2_normalise(x: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (computed in float64); all-zero rows stay zero."""
    x64 = x.astype(np.float64, copy=False)
    norms = np.linalg.norm(x64, axis=1, keepdims=True)
    return x64 / np.where(norms > 0, norms, 1.0)


def write_arrays(
    path: str | os.PathLike,
    splits: Mapping[str, tuple[Any, Any, Sequence[str]] | tuple[Any, Any, Sequence[str], Sequence[str]]],
    *,
    dataset: str = "arrays",
    backbone: str = "none",
    normalise: bool = True,
    dtype: str = "float32",
    **attrs: Any,
) -> Path:
    """Write a complete, valid cache in one go (features imported from elsewhere, tests).

    ``splits`` maps a split name to ``(features [N, D], labels [N] ints in [0, C), classes [C])``
    or the same with ``paths [N]`` appended. ``raw_mean`` is the mean of the features as given;
    with ``normalise`` the rows are then L2-normalised and their norms stored (otherwise they must
    already be normalised, and no norms are stored).
    Extra keyword arguments become root attributes (``checkpoint_sha256``, ``image_size``,
    ``transform`` default to "none", 0, "none"). The file is validated before it appears under
    ``path``; on any error nothing is left there. Returns ``path``.
    """
    path = Path(path)
    if dtype not in FEATURE_DTYPES:
        raise CacheError(f"dtype {dtype!r}: use one of {', '.join(FEATURE_DTYPES)}", param="dtype", value=dtype)
    if not splits:
        raise CacheError(f"{path}: no splits to write", param="splits", value=splits)
    root = make_root_attrs(dataset, backbone, **attrs)
    with atomic_path(path, suffix=".tmp") as tmp:
        with h5py.File(tmp, "w") as f:
            _set_attrs(f, root)
            for name, item in splits.items():
                if len(item) not in (3, 4):
                    raise CacheError(
                        f"split {name!r}: expected (features, labels, classes[, paths])", param="splits", value=name
                    )
                feats = np.asarray(item[0].detach().cpu() if isinstance(item[0], torch.Tensor) else item[0])
                labels = np.asarray(item[1].detach().cpu() if isinstance(item[1], torch.Tensor) else item[1])
                classes = [str(c) for c in item[2]]
                paths = None if len(item) == 3 or item[3] is None else [str(p) for p in item[3]]
                if feats.ndim != 2 or labels.shape != (feats.shape[0],):
                    raise CacheError(
                        f"split {name!r}: features must be [N, D] and labels [N], got {feats.shape} and {labels.shape}",
                        param="splits",
                        value=name,
                    )
                if paths is not None and len(paths) != feats.shape[0]:
                    raise CacheError(
                        f"split {name!r}: {len(paths)} paths for {feats.shape[0]} rows", param="splits", value=name
                    )
                raw_mean = feats.astype(np.float64).mean(0) if len(feats) else np.zeros(feats.shape[1])
                x = _l2_normalise(feats) if normalise else feats
                g = f.create_group(name)
                g.create_dataset("features", data=x.astype(FEATURE_DTYPES[dtype]))
                g.create_dataset("labels", data=labels.astype(np.int64))
                g.create_dataset("classes", data=np.array(classes, dtype=object), dtype=STRING)
                if paths is not None:
                    g.create_dataset("paths", data=np.array(paths, dtype=object), dtype=STRING)
                if normalise:
                    g.create_dataset("norms", data=np.linalg.norm(feats.astype(np.float64), axis=1).astype(np.float32))
                g.attrs["n_images"] = int(feats.shape[0])
                g.attrs["feature_dim"] = int(feats.shape[1])
                _set_vector(g, "raw_mean", raw_mean.astype(np.float32))
                g.attrs["complete"] = True
        try:
            validate(tmp)
        except CacheError as e:  # name the file the caller asked for, not the temporary one
            raise CacheError(
                e.marked_message.replace(str(tmp), str(path), 1),
                params=e.params,
                hint=e.marked_hint,
                param=e.param,
                value=path if e.value == tmp else e.value,
            ) from None
    return path


def samples_digest(samples: Iterable[tuple[str, str]]) -> str:
    """sha256 over an image list ``[(relative_path, class_name)]``: tells whether a split was made from it."""
    h = hashlib.sha256()
    for p, c in samples:
        h.update(f"{p}\t{c}\n".encode())
    return h.hexdigest()


def partial_path(cache_path: str | os.PathLike, split: str) -> Path:
    """Where a split being extracted is staged: ``<cache>.<split>.partial`` next to the cache."""
    p = Path(cache_path)
    return p.with_name(f"{p.name}.{split}.partial")


@contextlib.contextmanager
def cache_lock(cache_path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``<cache>.lock`` (``fcntl.flock``; blocks until free), removed on
    release so that nothing is left beside the user's files.

    Removing a lock file invites a race: a process that opened the file before it was removed locks
    the removed file while a third creates and locks a new one at the path. So a lock counts only
    when, after ``flock`` returns, the path still names the very file locked (same device and
    inode); otherwise it is dropped and taken again on the file now there."""
    p = Path(cache_path)
    lock = p.with_name(p.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl  # POSIX only: imported here so that the module loads elsewhere
    except ImportError:  # not POSIX: no inter-process lock available
        yield
        return
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(lock)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # the holder before removed it: lock the file at the path now
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # while still held: whoever waits on this file finds it gone and retries
        os.close(fd)  # closing releases the flock


def _lock_or_fail(fd: int, path: Path) -> None:
    """Lock the open staging file ``fd`` for this process (``flock``, not waiting): a CacheError
    when another process holds it."""
    try:
        import fcntl  # POSIX only: imported here so that the module loads elsewhere
    except ImportError:  # not POSIX: no inter-process lock available
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise CacheError(
            f"{path}: in use by another process (is another `poodle extract` writing this cache?)",
            param="cache_path",
            value=path,
        ) from None


def replace_with_copy(
    cache_path: Path,
    split: str,
    root_attrs: Mapping[str, Any],
    fill: Callable[[h5py.Group], None],
    *,
    fresh: bool = False,
    staged: str = "",
) -> None:
    """Put split ``split`` into the cache atomically: a copy of the cache (a new file with
    ``root_attrs`` when the cache is absent or ``fresh``) under a name unique to this process gets
    the group, which ``fill`` writes; the split is validated and the copy renamed over the cache.
    The caller holds :func:`cache_lock`. Written through a :class:`~poodle.utils.FailSafeFile`: a
    failed write (a full disk) is a :class:`~poodle.errors.WriteError` naming the cache, which is
    then as it was (the copy is removed; ``staged``: where the split stays for a re-run)."""
    tmp = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    kept = "is as it was" if cache_path.exists() and not fresh else "was not made"
    outcome = f"the cache {kept}" + (f"; split {split!r} stays staged in {staged} for a re-run" if staged else "")
    io_: FailSafeFile | None = None
    try:
        copied = cache_path.exists() and not fresh
        if copied:
            shutil.copyfile(cache_path, tmp)
        io_ = FailSafeFile(tmp, "r+" if copied else "w+")
        with h5py.File(io_, "r+" if copied else "w") as f:
            if not copied:
                _set_attrs(f, root_attrs)
            if split in f:
                del f[split]
            fill(f.create_group(split))
            f.flush()
            io_.check(cache_path, outcome)  # before reading back what may not have been written
            _validate_split(f[split], tmp, split)
        io_.close()
        io_.check(cache_path, outcome)
        os.replace(tmp, cache_path)
    except BaseException as e:
        if io_ is not None:
            io_.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and write_errno(e) is not None:  # copying the cache
            raise write_error(cache_path, e, outcome) from e
        raise


class SplitWriter:
    """Streams one split into its staging file, batch by batch, and commits it into the cache.

    The staging file holds resizable ``features``/``labels``/``paths``/``norms``/``skipped``
    datasets, what it
    was made with, and the running state [rows written, image-list entries consumed, images skipped,
    running sum of the raw features (D values, for ``raw_mean``)] in two slots of a float64 dataset
    ``state [2, 3 + D]`` (a dataset: for large D it exceeds HDF5's attribute limit). Each
    :meth:`append` writes its rows, then the state into the slot not in use, flushes, and only then
    points the small attribute ``state_head`` = [slot, rows, consumed, skipped, checksum] at it, so an
    interrupted run resumes after the last batch whose ``state_head`` reached the disk (rows past it
    are overwritten; a torn state slot is never the one pointed at). A staging file that cannot
    be read, or that was made with other settings or another image list, is started afresh.
    """

    def __init__(
        self,
        cache_path: str | os.PathLike,
        split: str,
        *,
        root_attrs: Mapping[str, Any],
        classes: Sequence[str],
        samples_sha256: str,
        n_total: int,
        dim: int,
        dtype: str = "float32",
        restart: bool = False,
        path: str | os.PathLike | None = None,
        extra_key: Mapping[str, Any] | None = None,
    ) -> None:
        # path, extra_key: another staging file and what else it must match (poodle.cache_shares)
        if dtype not in FEATURE_DTYPES:
            raise CacheError(f"dtype {dtype!r}: use one of {', '.join(FEATURE_DTYPES)}", param="dtype", value=dtype)
        self.cache_path = Path(cache_path)
        self.split = split
        self.path = Path(path) if path is not None else partial_path(self.cache_path, split)
        self.root_attrs = dict(root_attrs)
        self.classes = list(classes)
        self.n_total = int(n_total)
        self.dim = int(dim)
        self.dtype = FEATURE_DTYPES[dtype]
        self._key = {
            "samples_sha256": samples_sha256,
            "n_total": self.n_total,
            "feature_dim": self.dim,
            "dtype": str(self.dtype),
            **{k: str(self.root_attrs[k]) for k in IDENTITY_ATTRS},
            **{k: str(v) for k, v in (extra_key or {}).items()},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f: h5py.File | None = None
        self._io: FailSafeFile | None = None
        self.resumed = False
        if not restart and self.path.exists():
            self.resumed = self._try_resume()
        if not self.resumed:
            self._create()

    # -- opening
    def _open(self, mode: str) -> h5py.File:
        """The staging file, existing (``a``) or made empty (``w``), locked for this process and
        opened through a :class:`~poodle.utils.FailSafeFile`: HDF5 never sees a failed write (a
        full disk), which :meth:`_check` then reports."""
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if mode == "w" else 0), 0o666)
        try:
            _lock_or_fail(fd, self.path)
            if mode == "w":  # emptied only once locked: never under another process writing it
                os.ftruncate(fd, 0)
            io_ = FailSafeFile(fd, "r+")
        except BaseException:
            os.close(fd)
            raise
        try:
            f = h5py.File(io_, "r+" if mode == "a" else "w")
        except BaseException:
            io_.close()
            raise
        self._io = io_
        return f

    def _check(self, outcome: str) -> None:
        """The :class:`~poodle.errors.WriteError` of the staging file when a write to it failed."""
        if self._io is not None:
            self._io.check(self.path, outcome)

    def _try_resume(self) -> bool:
        try:
            f = self._open("a")
        except CacheError:
            raise
        except OSError:
            self.path.unlink()
            return False
        try:
            a = f.attrs
            ok = _text(a.get("format")) == PARTIAL_FORMAT and all(
                str(_text(a.get(k))) == str(v) for k, v in self._key.items()
            )
            if ok:
                head = np.asarray(a["state_head"], dtype=np.float64)
                slots = f["state"]
                ok = head.shape == (5,) and slots.shape == (2, 3 + self.dim) and head[0] in (0, 1)
            if ok:
                state = np.asarray(slots[int(head[0])], dtype=np.float64)
                ok = (
                    bool(np.isfinite(state).all())
                    and bool((state[:3] == head[1:4]).all())
                    and float(state.sum()) == float(head[4])
                )
                self._slot = int(head[0])
            if ok:
                n_rows, n_consumed, n_skipped = (int(v) for v in state[:3])
                g = f[self.split]
                ok = (
                    g["features"].shape[0] >= n_rows
                    and g["labels"].shape[0] >= n_rows
                    and "norms" in g
                    and g["norms"].shape[0] >= n_rows
                    and g["paths"].shape[0] >= n_rows
                    and g["skipped"].shape[0] >= n_skipped
                    and 0 <= n_rows <= n_consumed <= self.n_total
                    and n_rows + n_skipped == n_consumed
                )
                if ok and n_rows:  # touch the last committed row: a torn write shows up here
                    g["features"][n_rows - 1]
                    g["paths"][n_rows - 1]
        except Exception:  # noqa: BLE001 - any damage means: start this split again
            ok = False
        if not ok:
            self.f = f
            self.close()
            self.path.unlink()
            return False
        self.f = f
        self._state = state
        return True

    def _create(self) -> None:
        f = self._open("w")
        _set_attrs(f, {"format": PARTIAL_FORMAT, **self._key})
        self._state = np.zeros(3 + self.dim, dtype=np.float64)
        self._slot = 0
        f.create_dataset("state", data=np.zeros((2, 3 + self.dim), dtype=np.float64))
        f.attrs["state_head"] = np.zeros(5, dtype=np.float64)
        g = f.create_group(self.split)
        chunk_rows = max(1, min(1024, (1 << 20) // max(1, self.dim * self.dtype.itemsize)))
        g.create_dataset(
            "features", shape=(0, self.dim), maxshape=(None, self.dim), dtype=self.dtype, chunks=(chunk_rows, self.dim)
        )
        g.create_dataset("labels", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(4096,))
        g.create_dataset("paths", shape=(0,), maxshape=(None,), dtype=STRING, chunks=(1024,))
        g.create_dataset("norms", shape=(0,), maxshape=(None,), dtype=np.float32, chunks=(4096,))
        g.create_dataset("skipped", shape=(0,), maxshape=(None,), dtype=STRING, chunks=(256,))
        f.flush()
        self.f = f
        self._check("nothing else was changed")

    # -- state
    @property
    def n_consumed(self) -> int:
        """How many entries of the image list are done (written or skipped)."""
        return int(self._state[1])

    @property
    def n_rows(self) -> int:
        return int(self._state[0])

    @property
    def n_skipped(self) -> int:
        return int(self._state[2])

    def append(
        self,
        raw: np.ndarray | torch.Tensor,
        labels: Sequence[int] | np.ndarray,
        paths: Sequence[str],
        *,
        n_consumed: int | None = None,
        skipped: Sequence[str] = (),
    ) -> None:
        """Add a batch: raw features [B, D] (normalised here), labels [B], paths [B].

        ``n_consumed`` is how many image-list entries the batch covers (B plus skipped images).
        """
        assert self.f is not None, "writer is closed"
        if isinstance(raw, torch.Tensor):
            raw = raw.detach().cpu().numpy()
        raw = np.asarray(raw)
        b = raw.shape[0]
        if raw.ndim != 2 or raw.shape[1] != self.dim or len(labels) != b or len(paths) != b:
            raise CacheError(
                f"batch of shape {raw.shape} with {len(labels)} labels and {len(paths)} paths "
                f"does not fit split {self.split!r} of dim {self.dim}",
                param="raw",
                value=tuple(raw.shape),
            )
        n_consumed = b + len(skipped) if n_consumed is None else int(n_consumed)
        if n_consumed != b + len(skipped):
            raise CacheError(
                f"batch covers {n_consumed} images but holds {b} rows and {len(skipped)} skipped",
                param="n_consumed",
                value=n_consumed,
            )
        self._append(raw, labels, paths, n_consumed, skipped)
        # on disk the state head still points at the last whole batch: a re-run resumes from there
        self._check("the batches written before are kept for a re-run to resume from")

    def _append(
        self,
        raw: np.ndarray,
        labels: Sequence[int] | np.ndarray,
        paths: Sequence[str],
        n_consumed: int,
        skipped: Sequence[str],
    ) -> None:
        assert self.f is not None, "writer is closed"
        b = raw.shape[0]
        f, g = self.f, self.f[self.split]
        n0 = self.n_rows
        if b:
            if not np.isfinite(raw).all():
                raise CacheError(
                    f"split {self.split!r}: the backbone produced non-finite features for "
                    f"{paths[int(np.argwhere(~np.isfinite(raw))[0, 0])]}",
                    param="paths",
                    value=paths[int(np.argwhere(~np.isfinite(raw))[0, 0])],
                )
            for key in ("features", "labels", "paths", "norms"):
                g[key].resize(n0 + b, axis=0)
            g["features"][n0 : n0 + b] = _l2_normalise(raw).astype(self.dtype)
            g["norms"][n0 : n0 + b] = np.linalg.norm(raw.astype(np.float64), axis=1).astype(np.float32)
            g["labels"][n0 : n0 + b] = np.asarray(labels, dtype=np.int64)
            g["paths"][n0 : n0 + b] = np.array(list(paths), dtype=object)
        if skipped:
            s0 = self.n_skipped
            g["skipped"].resize(s0 + len(skipped), axis=0)
            g["skipped"][s0:] = np.array(list(skipped), dtype=object)
        # The state goes last: into the free slot, flushed, then the head (one small attribute write)
        # points at it. Until the head is flushed, a resumed run ignores the rows just written.
        state = self._state.copy()
        state[0] += b
        state[1] += n_consumed
        state[2] += len(skipped)
        state[3:] += raw.astype(np.float64).sum(0)
        slot = 1 - self._slot
        f["state"][slot] = state
        f.flush()
        f.attrs["state_head"] = np.array([slot, *state[:3], float(state.sum())], dtype=np.float64)
        f.flush()
        self._state, self._slot = state, slot

    def close(self) -> None:
        """Close the staging file (what HDF5 still holds is written; a write that fails leaves the
        file as a killed process would: a re-run resumes after the last whole batch)."""
        if self.f is not None:
            self.f.close()
            self.f = None
        if self._io is not None:
            self._io.close()  # also releases the lock
            self._io = None

    def reopen(self) -> None:
        """Open the staging file again after :meth:`close` (e.g. once DataLoader workers are forked,
        which would otherwise inherit the file's lock and hold it past a crash of this process)."""
        if self.f is None:
            self.f = self._open("a")

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def class_counts(self) -> np.ndarray:
        """Rows written per class so far, int64 [C]."""
        assert self.f is not None
        y = self.f[self.split]["labels"][: self.n_rows]
        return np.bincount(np.asarray(y, dtype=np.int64), minlength=len(self.classes))

    def commit(self, *, fresh: bool = False, extra_attrs: Mapping[str, Any] | None = None) -> Path:
        """Mark the split complete and put it into the cache file atomically; remove the staging file.

        The cache is copied (or created, when absent or ``fresh``), the split is written into the
        copy, the copy is validated and then renamed over the cache. Returns the cache path.
        """
        assert self.f is not None, "writer is closed"
        if self.n_consumed != self.n_total:
            # not a caller's value: the writer's own state
            raise CacheError(f"split {self.split!r}: only {self.n_consumed} of {self.n_total} images done")
        name = self.split
        with cache_lock(self.cache_path):
            # Re-read under the lock: another process may have committed a split since this one began.
            if self.cache_path.exists() and not fresh:
                try:
                    now = read_attrs(self.cache_path)
                except CacheError as e:
                    raise CacheError(
                        f"{e}; it changed while this split was extracted", param="cache_path", value=self.cache_path
                    ) from None
                mism = identity_mismatches(now, self.root_attrs)
                if mism:
                    raise CacheError(
                        f"{self.cache_path} was replaced while split {name!r} was extracted "
                        f"and now holds features made with {'; '.join(mism)}",
                        param="cache_path",
                        value=self.cache_path,
                    )
            replace_with_copy(
                self.cache_path,
                name,
                self.root_attrs,
                lambda dst: self._write_split(dst, extra_attrs),
                fresh=fresh,
                staged=str(self.path),
            )
        self.close()
        self.path.unlink()
        return self.cache_path

    def _write_split(self, dst: h5py.Group, extra_attrs: Mapping[str, Any] | None) -> None:
        """The staged split, complete, into the group ``dst`` of the cache's copy."""
        assert self.f is not None, "writer is closed"
        src, n = self.f[self.split], self.n_rows
        fd = dst.create_dataset("features", shape=(n, self.dim), dtype=self.dtype)
        ld = dst.create_dataset("labels", shape=(n,), dtype=np.int64)
        pd = dst.create_dataset("paths", shape=(n,), dtype=STRING)
        nd = dst.create_dataset("norms", shape=(n,), dtype=np.float32)
        for a in range(0, n, _ROWS_PER_BLOCK):
            b = min(n, a + _ROWS_PER_BLOCK)
            fd[a:b] = src["features"][a:b]
            nd[a:b] = src["norms"][a:b]
            ld[a:b] = src["labels"][a:b]
            pd[a:b] = src["paths"].asstr()[a:b]
        dst.create_dataset("classes", data=np.array(self.classes, dtype=object), dtype=STRING)
        raw_mean = self._state[3:] / n if n else np.zeros(self.dim)
        dst.attrs["n_images"] = n
        dst.attrs["feature_dim"] = self.dim
        _set_vector(dst, "raw_mean", raw_mean.astype(np.float32))
        dst.attrs.create("samples_sha256", self._key["samples_sha256"], dtype=STRING)
        _set_skipped(dst, _strings(src["skipped"])[: self.n_skipped] if self.n_skipped else [])
        if extra_attrs:
            _set_attrs(dst, extra_attrs)
        dst.attrs["complete"] = True

    def discard(self) -> None:
        """Close and delete the staging file."""
        self.close()
        if self.path.exists():
            self.path.unlink()
