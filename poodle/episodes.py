"""Few-shot episodes: seeded, batched sampling (balanced or Dirichlet-imbalanced), HDF5 save/load.

Episode ``i`` of a run is a pure function of ``(labels, spec, i)``: it is drawn by its own generator
``poodle.utils.generator(spec.seed, i)``, so the chunk size, the device, the number of episodes
drawn and the methods that run never change it. The seed tuple deliberately leaves out way, shot,
query and imbalance: episode ``i`` of a 1-shot and of a 5-shot run with the same seed share their
classes, and the 1-shot support image of each class is the first of the 5-shot ones (nested designs
make shot and imbalance ablations paired too).

Drawing one episode, in this order from its generator:

1. ``way`` classes without replacement (``randperm`` over the split's classes); label ``k`` is the
   ``k``-th class drawn.
2. With ``imbalance=kappa``: query shares ``p ~ Dirichlet(kappa, ..., kappa)`` (from Gamma draws)
   and counts by largest remainder so they sum to exactly ``way * query`` (floors first, then one
   more to the classes with the largest fractional parts, ties to the lower label). A class may get
   0 queries. A class whose count would exceed its images minus ``shot`` gets all it has and the
   excess is re-spread over the others in proportion to their shares (never triggers when every
   class has ``shot + way * query`` images, e.g. mini-ImageNet).
   With ``query_classes=n`` (PADDLE's "K_eff", Martin et al. 2022): first ``n`` of the ``way``
   labels (``randperm(way)[:n]``) are the only ones with queries; the query set holds ``n * query``
   queries, ``query`` each, or (with ``imbalance``) Dirichlet shares over those ``n``, rounded and
   capped as above within the ``n``. Every support class is still present. Without it the draws
   are exactly those above (episode files written before it existed stay valid).
3. Per class in label order, a ``randperm`` of its images: the first ``shot`` are support, the
   next ``count`` are queries. Support and query are class-major.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import h5py
import numpy as np
import torch
from torch import Tensor

from poodle import defaults
from poodle._episodes_bulk import BulkDraw, SplitTables
from poodle._mt19937 import verified
from poodle.errors import ConfigError, EpisodeError
from poodle.options import check_group, check_value, option
from poodle.options import setting as schema_setting
from poodle.options import settings as schema
from poodle.utils import SEED_MAX, atomic_write, check_output, generator, resolve_path

FORMAT = "poodle-episodes"
VERSION = 1


@dataclass(frozen=True)
class EpisodeSpec:
    """What an episode set is drawn from. Paper defaults: 5-way, 15 queries per class (section 5.1).

    Each field is a setting (:func:`poodle.options.option`): declaring one here makes it a
    ``poodle solve`` option, a project-file key, a grid axis and a key of the results' identity
    (``when_set``: only when it differs from its default, so that older records keep their key)."""

    split: str = option(defaults.SPLIT, help="Split the episodes come from.")
    way: int = option(defaults.WAY, min=2, why="a 1-way episode is always right", help="Classes per episode.")
    shot: int = option(defaults.SHOT, min=1, help="Labelled images per class.")
    query: int = option(defaults.QUERY, min=1, help="Queries per class; an episode has way * query of them.")
    imbalance: float | None = option(
        None,
        min=0,
        min_open=True,
        why="a Dirichlet concentration",
        metavar="KAPPA",
        none_words=("balanced",),
        help="Dirichlet(KAPPA) query counts per class (alpha-TIM's protocol: 2) [default: balanced].",
    )
    seed: int = option(
        defaults.SEED, min=0, max=SEED_MAX, why="what torch, numpy and HDF5 hold: 63 bits", help="Seed of the episodes."
    )
    query_classes: int | None = option(
        None,
        min=1,
        when_set=True,
        metavar="N",
        none_words=("all",),
        help="Queries from only N of the way classes, chosen per episode (PADDLE's K_eff); N * query "
        "queries, balanced or Dirichlet (imbalance) over the N.",
    )

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> EpisodeSpec:
        """The spec of an episode-settings mapping (a results record's ``episode``, the solve
        parameters): its spec fields (a ``when_set`` one may be absent); other keys (``episodes``) ignored."""
        return cls(
            **{s.name: settings.get(s.key, s.default) if s.meta("when_set") else settings[s.key] for s in schema(cls)}
        )

    def validate(self) -> None:
        """EpisodeError naming the first setting outside its declared bounds, or ``query_classes``
        above ``way``. This is the one place these settings are checked, for the command line, grids
        and the library."""
        check_group(self, EpisodeError)
        n = self.query_classes
        if n is not None and n > self.way:
            least = getattr(schema_setting(EpisodeSpec, "query_classes").bounds, "lo", 1)
            raise EpisodeError.bad_value("query_classes", n, f"must be an integer in {least:g}..way={self.way}")

    @property
    def n_support(self) -> int:
        return self.way * self.shot

    @property
    def n_query(self) -> int:
        return (self.way if self.query_classes is None else self.query_classes) * self.query


@dataclass
class EpisodeSet:
    """``E`` episodes as row indices into one split of a cache.

    Attributes:
        support: int64 ``[E, way*shot]`` row indices, class-major.
        query: int64 ``[E, Nq]`` row indices, class-major (``Nq = way*query``; per-class counts vary
            with imbalance).
        support_labels: int64 ``[E, way*shot]`` in ``0..way-1``.
        query_labels: int64 ``[E, Nq]`` in ``0..way-1``.
        negatives: int64 ``[E, M]`` row indices into the negative pool, or ``None`` (not drawn yet,
            or generated negatives).
        spec: the :class:`EpisodeSpec` the set was drawn with.
        negative_source: the source ``negatives`` index into ("" when none).
        index: int64 ``[E]`` global episode numbers (``i`` of ``generator(seed, i)``).
        class_ids: int64 ``[E, way]`` the split's class index of each label.
    """

    support: Tensor
    query: Tensor
    support_labels: Tensor
    query_labels: Tensor
    negatives: Tensor | None
    spec: EpisodeSpec
    negative_source: str = ""
    index: Tensor | None = None
    class_ids: Tensor | None = None

    def __post_init__(self) -> None:
        if self.index is None:
            self.index = torch.arange(self.support.shape[0], dtype=torch.int64)

    def __len__(self) -> int:
        return int(self.support.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its index tensors."""
        ts = (
            self.support,
            self.query,
            self.support_labels,
            self.query_labels,
            self.negatives,
            self.index,
            self.class_ids,
        )
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def __getitem__(self, sl: slice) -> EpisodeSet:
        if not isinstance(sl, slice):
            raise TypeError("EpisodeSet supports slicing only, e.g. eps[10:20]")

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[sl]

        return EpisodeSet(
            self.support[sl],
            self.query[sl],
            self.support_labels[sl],
            self.query_labels[sl],
            cut(self.negatives),
            self.spec,
            self.negative_source,
            cut(self.index),
            cut(self.class_ids),
        )

    def with_negatives(self, negatives: Tensor | None, source: str) -> EpisodeSet:
        """A copy whose negative indices are ``negatives [E, M]`` from ``source``."""
        return dataclasses.replace(self, negatives=negatives, negative_source=source)

    def check_against(self, labels: Tensor, *, where: str = "episodes", pool_size: int | None = None) -> None:
        """EpisodeError unless every index fits a split with these ``labels [N]`` and the labels of
        each episode are consistent with it (label k's support and queries come from one class,
        different labels from different classes); negative indices must fit ``pool_size``."""
        n = int(labels.shape[0])
        for name, t in (("support", self.support), ("query", self.query)):
            if t.numel() and int(t.min()) < 0:
                e = int((t < 0).any(1).nonzero()[0, 0])
                raise EpisodeError(
                    f"{where}: {name} index {int(t.min())} (episode {e}) is negative; row indices lie in 0..{n - 1}"
                )
            if t.numel() and int(t.max()) >= n:
                raise EpisodeError(
                    f"{where}: {name} indices reach {int(t.max())} but the split has {n} rows "
                    f"(0..{n - 1}); the episodes were drawn from another cache or split"
                )
        way = self.spec.way
        cls_s = labels[self.support]  # [E, Ns]
        cls_q = labels[self.query]
        ref = cls_s.view(len(self), way, self.spec.shot)[:, :, 0]  # [E, way]
        ok_s = (cls_s == ref.gather(1, self.support_labels)).all(1)
        ok_q = (cls_q == ref.gather(1, self.query_labels)).all(1)
        distinct = (ref.unsqueeze(1) != ref.unsqueeze(2)).sum((1, 2)) == way * (way - 1)
        bad = ~(ok_s & ok_q & distinct)
        if bool(bad.any()):
            e = int(bad.nonzero()[0, 0])
            assert self.index is not None  # set in __post_init__
            raise EpisodeError(
                f"{where}: episode {int(self.index[e])} does not match the split's labels "
                f"(a label mixes classes); the episodes were drawn from another cache or split"
            )
        if self.negatives is not None and pool_size is not None and self.negatives.numel():
            hi = int(self.negatives.max())
            if int(self.negatives.min()) < 0:
                raise EpisodeError(
                    f"{where}: negative index {int(self.negatives.min())} is negative; the pool "
                    f"{self.negative_source!r} has rows 0..{pool_size - 1}"
                )
            if hi >= pool_size:
                raise EpisodeError(
                    f"{where}: negative indices reach {hi} but the negative pool "
                    f"{self.negative_source!r} has {pool_size} rows"
                )


def check_spec(labels: Tensor, spec: EpisodeSpec, classes: Sequence[str] | None = None) -> None:
    """EpisodeError, naming classes, unless ``spec`` can be drawn from a split with ``labels [N]``."""
    spec.validate()
    counts = torch.bincount(labels, minlength=len(classes) if classes is not None else 0)
    present = int((counts > 0).sum())
    names = list(classes) if classes is not None else [str(c) for c in range(len(counts))]
    if spec.way > present:
        raise EpisodeError(
            f"split {spec.split!r} has {present} classes with images; cannot draw {spec.way}-way episodes"
        )
    need = spec.shot + spec.query
    short = [(names[c], int(counts[c])) for c in range(len(counts)) if 0 < counts[c] < need]
    if short:
        shown = ", ".join(f"{n} ({k})" for n, k in short[:10]) + (
            f", ... ({len(short)} in all)" if len(short) > 10 else ""
        )
        raise EpisodeError(
            f"split {spec.split!r}: lower shot or query (or drop classes): {len(short)} class(es) have "
            f"fewer than shot + query = {need} images: {shown}",
            params=("shot", "query"),
        )


def imbalanced_counts(p: Tensor, total: int, capacity: Tensor) -> Tensor:
    """Largest-remainder rounding of ``total * p`` under per-class ``capacity``: int64 ``[way]``
    summing to ``total`` (requires ``capacity.sum() >= total``)."""
    way = p.shape[0]
    counts = torch.zeros(way, dtype=torch.int64)  # fixed (clipped) classes hold their capacity
    free = torch.ones(way, dtype=torch.bool)
    remaining = total
    while True:
        share = torch.where(free, p, torch.zeros_like(p))
        s = float(share.sum())
        share = share / s if s > 0 else free.to(p.dtype) / float(free.sum())
        raw = remaining * share
        add = torch.floor(raw).to(torch.int64)
        left = remaining - int(add.sum())
        frac = torch.where(free, raw - add.to(raw.dtype), torch.full_like(raw, -1.0))
        add[torch.sort(-frac, stable=True).indices[:left]] += 1
        new = counts + add
        over = free & (new > capacity)
        if not bool(over.any()):
            return new
        counts = torch.where(over, capacity, counts)
        free &= ~over
        remaining = total - int(counts.sum())


def query_counts(g: torch.Generator, spec: EpisodeSpec, capacity: Tensor) -> Tensor:
    """Queries per label, int64 ``[way]`` summing to ``spec.n_query``, drawn from ``g`` right after
    the classes (module docstring, step 2). ``capacity [way]``: each class's images minus ``shot``."""
    way = spec.way
    if spec.query_classes is None:
        if spec.imbalance is None:
            return torch.full((way,), spec.query, dtype=torch.int64)
        gam = torch._standard_gamma(torch.full((way,), float(spec.imbalance), dtype=torch.float64), generator=g)
        s = float(gam.sum())
        p = gam / s if s > 0 else torch.nn.functional.one_hot(torch.tensor(0), way).double()
        return imbalanced_counts(p, spec.n_query, capacity)
    n = spec.query_classes
    chosen = torch.randperm(way, generator=g)[:n]
    if spec.imbalance is None:
        counts = torch.zeros(way, dtype=torch.int64)
        counts[chosen] = spec.query
        return counts
    gam = torch._standard_gamma(torch.full((n,), float(spec.imbalance), dtype=torch.float64), generator=g)
    s = float(gam.sum())
    share = gam / s if s > 0 else torch.nn.functional.one_hot(torch.tensor(0), n).double()
    p = torch.zeros(way, dtype=torch.float64)
    p[chosen] = share
    # classes without queries have no capacity, so a capped class's excess stays within the n
    cap = torch.zeros_like(capacity)
    cap[chosen] = capacity[chosen]
    return imbalanced_counts(p, spec.n_query, cap)


def _draw_episode(
    g: torch.Generator, spec: EpisodeSpec, eligible: Tensor, members: list[Tensor], counts_all: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    way, shot = spec.way, spec.shot
    cls = eligible[torch.randperm(eligible.shape[0], generator=g)[:way]]
    qcounts = query_counts(g, spec, counts_all[cls] - shot)
    sup, qry, qlab = [], [], []
    for k in range(way):
        rows = members[int(cls[k])]
        take = rows[torch.randperm(rows.shape[0], generator=g)[: shot + int(qcounts[k])]]
        sup.append(take[:shot])
        qry.append(take[shot:])
        qlab.append(torch.full((int(qcounts[k]),), k, dtype=torch.int64))
    slab = torch.arange(way, dtype=torch.int64).repeat_interleave(shot)
    return torch.cat(sup), torch.cat(qry), slab, torch.cat(qlab), cls


class _Draw:
    """What drawing needs from a split's labels, computed once: the classes with images, each
    class's rows and counts.

    Episodes are drawn in bulk (:mod:`poodle._episodes_bulk`: one torch call per episode, the rest
    vectorised over episodes), the same episodes as the per-episode path :func:`_draw_episode`
    (``1 + way`` ``randperm`` calls each), which is kept as the reference and used where torch's
    generator is found to draw otherwise (:func:`poodle._mt19937.verified`) or ``bulk=False``.
    """

    def __init__(
        self, labels: Tensor, spec: EpisodeSpec, classes: Sequence[str] | None = None, *, bulk: bool = True
    ) -> None:
        labels = torch.as_tensor(labels, dtype=torch.int64).cpu()
        check_spec(labels, spec, classes)
        self.spec = spec
        self.n_rows = int(labels.shape[0])
        self.counts_all = torch.bincount(labels)
        self.eligible = (self.counts_all > 0).nonzero().flatten()
        order = torch.argsort(labels, stable=True)
        self.members = list(torch.split(order, self.counts_all.tolist()))
        self._bulk: BulkDraw | None = None
        if bulk and verified():
            size = self.counts_all.numpy()
            tables = SplitTables(order.numpy(), np.cumsum(size) - size, size, self.eligible.numpy())
            self._bulk = BulkDraw(spec, tables, self._one)

    def _one(self, i: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Episode ``i`` by the per-episode path: ``(support, query, query_labels, class_ids)``."""
        s, q, _, ql, c = _draw_episode(
            generator(self.spec.seed, i), self.spec, self.eligible, self.members, self.counts_all
        )
        return s, q, ql, c

    def __call__(self, start: int, n_episodes: int) -> EpisodeSet:
        spec = self.spec
        E, Ns = n_episodes, spec.n_support
        if self._bulk is not None:
            d = self._bulk(start, E)
            sup, qry, qlab, cls = d.support, d.query, d.query_labels, d.class_ids
        else:
            drawn = [self._one(start + e) for e in range(E)]
            sup, qry, qlab, cls = (torch.stack([d[k] for d in drawn]) for k in range(4))
        slab = torch.arange(spec.way, dtype=torch.int64).repeat_interleave(spec.shot)
        return EpisodeSet(
            sup,
            qry,
            slab.unsqueeze(0).expand(E, Ns).contiguous(),
            qlab,
            None,
            spec,
            "",
            torch.arange(start, start + E, dtype=torch.int64),
            cls,
        )


def check_count(n_episodes: object) -> None:
    """EpisodeError unless ``n_episodes`` is a number of episodes (:class:`poodle.settings.CellSpec`)."""
    from poodle.settings import CellSpec  # imported here: poodle.settings imports this module

    check_value(schema_setting(CellSpec, "episodes"), n_episodes, EpisodeError)


def sample_episodes(
    labels: Tensor, spec: EpisodeSpec, n_episodes: int, *, classes: list[str] | None = None, start: int = 0
) -> EpisodeSet:
    """Draw episodes ``start .. start+n_episodes-1`` from a split with ``labels [N]`` (int64).

    EpisodeError before any drawing when the setting is impossible (way above the number of
    classes, classes with fewer than ``shot + query`` images, named; non-positive counts).
    """
    check_count(n_episodes)
    return _Draw(labels, spec, classes)(start, int(n_episodes))


class EpisodeStream:
    """Episodes ``start .. start+n_episodes-1`` of ``(labels, spec)``, drawn only when a slice of them
    is asked for: ``stream[a:b]`` is exactly ``sample_episodes(labels, spec, b - a, start=start + a)``.

    :func:`poodle.evaluate.evaluate` accepts one in place of an :class:`EpisodeSet`; it draws each
    chunk's episodes (and negatives) in the worker that solves the chunk, so a run of any length
    starts solving at once and never holds the index tensors of all its episodes. The setting is
    checked (EpisodeError) when the stream is made, as by :func:`sample_episodes`.
    """

    negatives: Tensor | None = None
    negative_source: str = ""

    def __init__(
        self, labels: Tensor, spec: EpisodeSpec, n_episodes: int, *, classes: list[str] | None = None, start: int = 0
    ) -> None:
        check_count(n_episodes)
        self._draw = _Draw(labels, spec, classes)
        self.spec = spec
        self.start = int(start)
        self.n = int(n_episodes)

    def __len__(self) -> int:
        return self.n

    @property
    def index(self) -> Tensor:
        """int64 ``[E]`` global episode numbers."""
        return torch.arange(self.start, self.start + self.n, dtype=torch.int64)

    def __getitem__(self, sl: slice) -> EpisodeSet:
        if not isinstance(sl, slice):
            raise TypeError("EpisodeStream supports slicing only, e.g. stream[10:20]")
        a, b, step = sl.indices(self.n)
        if step != 1:
            raise TypeError("EpisodeStream slices must be contiguous (step 1)")
        if b <= a:
            raise EpisodeError(f"empty slice [{a}:{b}] of {self.n} episodes")
        return self._draw(self.start + a, b - a)

    def materialize(self) -> EpisodeSet:
        """All the episodes, drawn now."""
        return self[0 : self.n]

    def check_against(self, labels: Tensor, *, where: str = "episodes", pool_size: int | None = None) -> None:
        """EpisodeError unless ``labels`` has as many rows as the split the stream draws from."""
        if int(labels.shape[0]) != self._draw.n_rows:
            raise EpisodeError(
                f"{where}: drawn from a split of {self._draw.n_rows} rows, but the features have {int(labels.shape[0])}"
            )


# ------------------------------------------------------------------------------------------ files


def save_episodes(path: str | os.PathLike, eps: EpisodeSet, **attrs: object) -> Path:
    """Write ``eps`` to HDF5 (layout in docs/stage2.md; extra ``attrs`` are stored too), atomically."""
    path = Path(path)
    try:
        check_output(path, "episodes", what="episode file")
    except ConfigError as e:
        raise EpisodeError(str(e)) from None
    # built in memory, then written with plain file I/O: a full disk is then one clean error, never
    # a failed write inside HDF5 (whose library may crash at exit after one)
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        for name in ("support", "query", "support_labels", "query_labels", "index", "class_ids"):
            f.create_dataset(name, data=getattr(eps, name).cpu().numpy().astype(np.int64))
        if eps.negatives is not None:
            f.create_dataset("negatives", data=eps.negatives.cpu().numpy().astype(np.int64))
        a = f.attrs
        a["format"], a["version"] = FORMAT, VERSION
        a["split"], a["way"], a["shot"], a["query"] = eps.spec.split, eps.spec.way, eps.spec.shot, eps.spec.query
        a["imbalance"] = 0.0 if eps.spec.imbalance is None else float(eps.spec.imbalance)  # 0: balanced
        a["seed"] = eps.spec.seed
        a["query_classes"] = 0 if eps.spec.query_classes is None else int(eps.spec.query_classes)  # 0: all
        a["negative_source"] = eps.negative_source
        a["n_neg"] = 0 if eps.negatives is None else int(eps.negatives.shape[1])
        for k, v in attrs.items():
            a[k] = v
    atomic_write(path, buf.getbuffer())
    return path


def load_episodes(path: str | Path, *, labels: Tensor | None = None, pool_size: int | None = None) -> EpisodeSet:
    """Read an episode set written by :func:`save_episodes` (or any tool following the layout).

    Shapes and labels are validated; with ``labels [N]`` of the split (and ``pool_size`` of the
    negative pool) the indices are checked against the cache too. EpisodeError names the problem.
    """
    path = resolve_path(path, what="episodes file")
    if not path.is_file():
        raise EpisodeError(f"{path}: no such episodes file")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise EpisodeError(f"{path}: not an HDF5 file ({e})") from None
    with f:
        missing = [k for k in ("split", "way", "shot", "query", "seed") if k not in f.attrs]
        missing += [k for k in ("support", "query", "support_labels", "query_labels") if k not in f]
        if missing:
            raise EpisodeError(f"{path}: not an episodes file (missing {', '.join(missing)})")
        spec = _read_spec(path, f.attrs)
        arrays = _read_index_arrays(path, f)
        source = _text(f.attrs.get("negative_source", ""))
    _check_shapes(path, spec, arrays)
    eps = EpisodeSet(
        arrays["support"],
        arrays["query"],
        arrays["support_labels"],
        arrays["query_labels"],
        arrays.get("negatives"),
        spec,
        source,
        arrays.get("index"),
        arrays.get("class_ids"),
    )
    if labels is not None:
        eps.check_against(torch.as_tensor(labels), where=str(path), pool_size=pool_size)
    return eps


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _read_spec(path: Path, a: Any) -> EpisodeSpec:
    """The episode setting in the attributes ``a`` of an episode file, validated."""

    def num(key: str, default: object = None, what: str = "a number") -> float:
        v = a.get(key, default)
        v = v.item() if isinstance(v, np.generic) else v
        if isinstance(v, np.ndarray) and v.size == 1:
            v = v.reshape(()).item()
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise EpisodeError(f"{path}: attribute {key!r} must be {what}, got {_text(v)!r}")
        return float(v) if isinstance(v, float) else v

    def integer(key: str) -> int:
        v = num(key, what="an integer")
        if not float(v).is_integer():
            raise EpisodeError(f"{path}: attribute {key!r} must be an integer, got {v!r}")
        return int(v)

    kappa = float(num("imbalance", 0.0))
    n_qc = integer("query_classes") if "query_classes" in a else 0  # 0: every class has queries
    spec = EpisodeSpec(
        split=_text(a["split"]),
        way=integer("way"),
        shot=integer("shot"),
        query=integer("query"),
        imbalance=None if kappa == 0 or not math.isfinite(kappa) else kappa,
        seed=integer("seed"),
        query_classes=None if n_qc == 0 else n_qc,
    )
    try:
        spec.validate()
    except EpisodeError as e:
        raise EpisodeError(f"{path}: {e}") from None
    return spec


def _read_index_arrays(path: Path, f: h5py.File) -> dict[str, Tensor]:
    """The integer datasets of an episode file, as int64 tensors by name."""
    arrays = {}
    for name in ("support", "query", "support_labels", "query_labels", "negatives", "index", "class_ids"):
        if name in f:
            arr = np.asarray(f[name][()])
            if arr.dtype.kind not in "iu":
                raise EpisodeError(f"{path}: /{name} must hold integers, got {arr.dtype}")
            arrays[name] = torch.from_numpy(arr.astype(np.int64))
    return arrays


def _check_shapes(path: Path, spec: EpisodeSpec, arrays: dict[str, Tensor]) -> None:
    """Every array of an episode file has the shape ``spec`` implies; labels lie in ``0..way-1``."""
    E = arrays["support"].shape[0]
    if E == 0:
        raise EpisodeError(f"{path}: holds no episodes (/support has shape {tuple(arrays['support'].shape)})")
    shapes = {
        "support": (E, spec.n_support),
        "support_labels": (E, spec.n_support),
        "query": (E, spec.n_query),
        "query_labels": (E, spec.n_query),
        "index": (E,),
        "class_ids": (E, spec.way),
    }
    for name, shape in shapes.items():
        if name in arrays and tuple(arrays[name].shape) != shape:
            raise EpisodeError(
                f"{path}: /{name} has shape {tuple(arrays[name].shape)}, expected {shape} "
                f"for {spec.way}-way {spec.shot}-shot {spec.query}-query episodes"
            )
    if "negatives" in arrays and (arrays["negatives"].ndim != 2 or arrays["negatives"].shape[0] != E):
        raise EpisodeError(f"{path}: /negatives has shape {tuple(arrays['negatives'].shape)}, expected ({E}, M)")
    for name in ("support_labels", "query_labels"):
        t = arrays[name]
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= spec.way):
            raise EpisodeError(f"{path}: /{name} must lie in 0..{spec.way - 1}")


__all__ = [
    "EpisodeSpec",
    "EpisodeSet",
    "EpisodeStream",
    "sample_episodes",
    "save_episodes",
    "load_episodes",
    "check_spec",
    "imbalanced_counts",
    "query_counts",
]
