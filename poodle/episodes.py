"""Few-shot episodes: seeded, batched sampling (fixed or Meta-Dataset's), HDF5 save/load.

Episode ``i`` of a run is a pure function of ``(labels, spec, i)``: it is made of the words of its
own generator ``poodle.utils.generator(spec.seed, i)`` by the one sampler (:mod:`poodle.sampler`,
thousands of episodes at a time), so the chunk size, the device, the number of episodes drawn and
the methods that run never change it. The seed tuple deliberately leaves out way, shot, query and
imbalance: episode ``i`` of a 1-shot and of a 5-shot run with the same seed share their classes,
and the 1-shot support image of each class is the first of the 5-shot ones (nested designs make
shot and imbalance ablations paired too).

The fixed protocol (``protocol="fixed"``, the default) draws one episode in this order, as torch's
samplers would from its generator:

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

The Meta-Dataset protocol (``protocol="meta-dataset"``, Triantafillou et al., ICLR 2020) draws each
episode's ways, per-class shots and queries by the rules of google-research/meta-dataset's
``meta_dataset/data/sampling.py`` (:func:`poodle.sampler.draw_meta_dataset` gives the formulas and
the words they read); ``way``, ``shot`` or ``query`` given fix that part (its fixed-shape variants),
and ``bilevel`` draws a superclass first, then its classes. Its episodes are ragged: an
:class:`EpisodeSet` pads them with -1 and carries each episode's ``ways``.
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

from poodle import defaults, sampler
from poodle.errors import ConfigError, EpisodeError, mark
from poodle.options import check_group, check_value, option
from poodle.options import setting as schema_setting
from poodle.options import settings as schema
from poodle.utils import SEED_MAX, atomic_write, check_output, resolve_path

FORMAT = "poodle-episodes"
VERSION = 1  # fixed episodes
RAGGED_VERSION = 2  # ragged episodes: /ways, /shots, /queries, -1 padding, the protocol's attributes


@dataclass(frozen=True)
class EpisodeSpec:
    """What an episode set is drawn from. Paper defaults: 5-way, 15 queries per class (section 5.1).

    Each field is a setting (:func:`poodle.options.option`): declaring one here makes it a
    ``poodle solve`` option, a project-file key, a grid axis and a key of the results' identity
    (``when_set``: only when it differs from its default, so that older records keep their key).

    ``way``, ``shot`` and ``query`` are None only under the Meta-Dataset protocol, where None means
    drawn per episode (:meth:`meta_dataset` makes such a spec). The Meta-Dataset fields keep
    sampling.py's names and defaults and are read only under that protocol (recorded in an identity
    only under it, every one of them: :func:`poodle.cells.episode_setting`)."""

    split: str = option(defaults.SPLIT, help="Split the episodes come from.")
    way: int | None = option(
        defaults.WAY,
        min=2,
        why="a 1-way episode is always right",
        help="Classes per episode (Meta-Dataset protocol: drawn per episode unless given).",
    )
    shot: int | None = option(
        defaults.SHOT, min=1, help="Labelled images per class (Meta-Dataset protocol: drawn unless given)."
    )
    query: int | None = option(
        defaults.QUERY,
        min=1,
        help="Queries per class; an episode has way * query of them (Meta-Dataset protocol: drawn unless given).",
    )
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
    protocol: str = option(
        defaults.PROTOCOL,
        choices=defaults.PROTOCOLS,
        when_set=True,
        help="How episodes are drawn: fixed (way, shot, query) or meta-dataset (ways, shots and "
        "queries drawn per episode by Meta-Dataset's rules, set by the options below, named as in its "
        "sampling.py; way/shot/query given fix that part).",
    )
    min_ways: int = option(5, min=2, when_set=True, help="Meta-Dataset: the fewest classes an episode has.")
    max_ways_upper_bound: int = option(50, min=2, when_set=True, help="Meta-Dataset: the most classes an episode has.")
    max_num_query: int = option(10, min=1, when_set=True, help="Meta-Dataset: the most queries per class.")
    max_support_set_size: int = option(
        500, min=1, when_set=True, help="Meta-Dataset: the most support images an episode has."
    )
    max_support_size_contrib_per_class: int = option(
        100, min=1, when_set=True, help="Meta-Dataset: the most one class adds to the support set's size."
    )
    min_log_weight: float = option(
        math.log(0.5),
        when_set=True,
        default_text="log(1/2) = -0.693",
        help="Meta-Dataset: the low end of the random log-weights that skew the shots per class.",
    )
    max_log_weight: float = option(
        math.log(2.0),
        when_set=True,
        default_text="log(2) = 0.693",
        help="Meta-Dataset: the high end of the random log-weights that skew the shots per class.",
    )
    bilevel: bool = option(
        False,
        when_set=True,
        help="Meta-Dataset: draw a superclass, then its classes (Omniglot's alphabets); a class's "
        "superclass is the part of its name before the first '/' (ALPHABET/CHARACTER) or else before "
        "the last '_' (the glyphs' alphabet_XXXX).",
    )

    @classmethod
    def meta_dataset(cls, **values: Any) -> EpisodeSpec:
        """A Meta-Dataset spec: ``way``, ``shot`` and ``query`` drawn unless given."""
        return cls(**{"way": None, "shot": None, "query": None, "protocol": "meta-dataset", **values})

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> EpisodeSpec:
        """The spec of an episode-settings mapping (a results record's ``episode``, the solve
        parameters): its spec fields (a ``when_set`` one may be absent); other keys (``episodes``) ignored."""
        return cls(
            **{s.name: settings.get(s.key, s.default) if s.meta("when_set") else settings[s.key] for s in schema(cls)}
        )

    @property
    def ragged(self) -> bool:
        """Whether episodes of this spec differ in shape (the Meta-Dataset protocol)."""
        return self.protocol == "meta-dataset"

    def settings(self) -> dict[str, Any]:
        """The spec as settings (a results record's ``episode`` keys): the fixed protocol's fields,
        plus the protocol and its parameters only under Meta-Dataset (``bilevel`` only when on),
        so a fixed spec has exactly the keys it had before the protocol existed."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not self.ragged:
            for k in ("protocol", *defaults.META_DATASET_KEYS):
                del out[k]
        elif not self.bilevel:
            del out["bilevel"]
        return out

    def validate(self) -> None:
        """EpisodeError naming the first setting outside its declared bounds, ``query_classes`` above
        ``way``, or a combination the protocol does not take (``way``, ``shot`` or ``query`` drawn
        under the fixed protocol; ``imbalance`` or ``query_classes`` under Meta-Dataset's, which
        draws its own counts). This is the one place these settings are checked, for the command
        line, grids and the library."""
        check_group(self, EpisodeError)
        if not self.ragged:
            for name in ("way", "shot", "query"):
                if getattr(self, name) is None:
                    raise EpisodeError.bad_value(name, None, "is drawn per episode only under protocol meta-dataset")
        n = self.query_classes
        if n is not None and self.way is not None and n > self.way:
            least = getattr(schema_setting(EpisodeSpec, "query_classes").bounds, "lo", 1)
            raise EpisodeError.bad_value(
                "query_classes", n, f"must be an integer from {least:g} to {mark('way')}={self.way}", others=("way",)
            )
        for lo, hi in (("min_ways", "max_ways_upper_bound"), ("min_log_weight", "max_log_weight")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a <= b:
                continue
            show = (lambda v: f"{v:g}") if isinstance(a, float) else str
            # blame the one of the two that was changed (the other at its default)
            if a == schema_setting(EpisodeSpec, lo).default:
                raise EpisodeError.bad_value(hi, b, f"must be at least {mark(lo)}={show(a)}", others=(lo,))
            raise EpisodeError.bad_value(lo, a, f"must be at most {mark(hi)}={show(b)}", others=(hi,))
        if not self.ragged:
            return
        for name in ("imbalance", "query_classes"):
            if getattr(self, name) is not None:
                raise EpisodeError(
                    f"{mark(name)} belongs to the fixed protocol; the Meta-Dataset protocol draws its own "
                    "per-class counts",
                    params=(name,),
                    param=name,
                    value=getattr(self, name),
                )
        if self.bilevel and self.way is not None:
            raise EpisodeError(
                f"{mark('bilevel')} draws the ways within a superclass; it cannot be combined with a fixed "
                f"{mark('way')} "
                "(as in meta_dataset's sampler)",
                param="way",
                value=self.way,
            )

    def describe(self) -> str:
        """The setting in words: ``5-way 1-shot, 15 queries/class``; under Meta-Dataset's protocol
        what it draws, by its rules (``Meta-Dataset protocol (5-50 ways, shots drawn: at most 500
        support images, at most 10 queries/class)``), and what the user fixed (``5-way``)."""
        if not self.ragged:
            return f"{self.way}-way {self.shot}-shot, {self.query} queries/class"
        parts = [
            f"{self.way}-way" if self.way is not None else f"{self.min_ways}-{self.max_ways_upper_bound} ways",
            f"{self.shot}-shot"
            if self.shot is not None
            else f"shots drawn: at most {self.max_support_set_size} support images",
            f"{self.query} queries/class" if self.query is not None else f"at most {self.max_num_query} queries/class",
        ]
        return f"Meta-Dataset protocol ({', '.join(parts)}{', bilevel' if self.bilevel else ''})"

    @property
    def n_support(self) -> int:
        """Support images per episode (fixed episodes only)."""
        return self.fixed("way") * self.fixed("shot")

    @property
    def n_query(self) -> int:
        """Queries per episode (fixed episodes only)."""
        return (self.fixed("way") if self.query_classes is None else self.query_classes) * self.fixed("query")

    def fixed(self, name: str) -> int:
        """``way``, ``shot`` or ``query``; EpisodeError when it is drawn per episode."""
        v = getattr(self, name)
        if v is None:
            raise EpisodeError(
                f"{name} is drawn per episode under the {self.protocol} protocol; ask the episodes",
                param="protocol",
                value=self.protocol,
            )
        return int(v)


@dataclass(frozen=True)
class CellSpec:
    """What a cell solves besides its episode setting, negatives and preprocessing. ``episodes`` is
    recorded with the episode setting (results that agree on it and on :class:`EpisodeSpec` are paired).
    Declared here, beside EpisodeSpec, because the sampler checks a number of episodes by it
    (:func:`check_count`); :mod:`poodle.settings` groups it with the others."""

    cache: str | None = option(None, cli=False, help="Feature cache file (a path, or a grid's [caches] name).")
    method: str = option(defaults.METHOD, cli=False, help="Registered method name.")
    episodes: int = option(
        defaults.EPISODES,
        min=1,
        why="the number of episodes",
        help="Episodes drawn.",
        # the Meta-Dataset protocol reports fewer a domain (poodle solve and the grid take them then)
        default_text=f"{defaults.EPISODES}; {defaults.META_DATASET_EPISODES} under --protocol meta-dataset",
    )


@dataclass
class EpisodeSet:
    """``E`` episodes as row indices into one split of a cache.

    Attributes:
        support: int64 ``[E, Ns]`` row indices, class-major (``Ns = way*shot``; ragged: the largest
            episode's support size, padded with -1).
        query: int64 ``[E, Nq]`` row indices, class-major (``Nq = way*query``; per-class counts vary
            with imbalance; ragged: padded with -1).
        support_labels: int64 ``[E, Ns]`` in ``0..way-1`` (-1 on padding).
        query_labels: int64 ``[E, Nq]`` in ``0..way-1`` (-1 on padding).
        negatives: int64 ``[E, M]`` row indices into the negative pool, or ``None`` (not drawn yet,
            or generated negatives).
        spec: the :class:`EpisodeSpec` the set was drawn with.
        negative_source: the source ``negatives`` index into ("" when none).
        index: int64 ``[E]`` global episode numbers (``i`` of ``generator(seed, i)``).
        class_ids: int64 ``[E, way]`` the split's class index of each label (ragged: ``[E, max
            ways]``, -1 past an episode's ways).
        ways: int64 ``[E]`` each episode's own number of classes, or ``None`` for fixed episodes
            (every episode has ``spec.way``). Ragged episodes (each its own way, shots and queries)
            pad ``support``, ``query`` and both label tensors with ``-1`` to the set's largest
            episode; :mod:`poodle.evaluate` solves them in padded chunks.
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
    ways: Tensor | None = None

    def __post_init__(self) -> None:
        if self.index is None:
            self.index = torch.arange(self.support.shape[0], dtype=torch.int64)

    def __len__(self) -> int:
        return int(self.support.shape[0])

    @property
    def ragged(self) -> bool:
        """Whether the episodes differ in shape (``ways`` is set)."""
        return self.ways is not None

    @property
    def way(self) -> int:
        """The most classes an episode of the set has (``spec.way`` for fixed episodes)."""
        if self.ways is None:
            return int(self.spec.way or 0)
        return int(self.ways.max()) if len(self) else 0

    def support_counts(self) -> Tensor:
        """int64 ``[E, way]`` support images of each label (0 past an episode's ways)."""
        return _label_counts(self.support_labels, self.way)

    def query_counts(self) -> Tensor:
        """int64 ``[E, way]`` queries of each label (0 past an episode's ways)."""
        return _label_counts(self.query_labels, self.way)

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
            self.ways,
        )
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def __getitem__(self, sl: slice) -> EpisodeSet:
        """Episodes ``sl`` (a ragged slice is cropped to its own largest episode)."""
        if not isinstance(sl, slice):
            raise TypeError("EpisodeSet supports slicing only, e.g. eps[10:20]")

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[sl]

        out = EpisodeSet(
            self.support[sl],
            self.query[sl],
            self.support_labels[sl],
            self.query_labels[sl],
            cut(self.negatives),
            self.spec,
            self.negative_source,
            cut(self.index),
            cut(self.class_ids),
            cut(self.ways),
        )
        return out.cropped() if out.ragged else out

    def cropped(self) -> EpisodeSet:
        """A ragged set with its padding cut to its own largest episode (rows, labels, ways)."""
        if self.ways is None or not len(self):
            return self

        def width(labels: Tensor) -> int:
            return max(int((labels >= 0).sum(1).max()), 1)

        ns, nq, w = width(self.support_labels), width(self.query_labels), max(self.way, 1)
        return dataclasses.replace(
            self,
            support=self.support[:, :ns],
            support_labels=self.support_labels[:, :ns],
            query=self.query[:, :nq],
            query_labels=self.query_labels[:, :nq],
            class_ids=None if self.class_ids is None else self.class_ids[:, :w],
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
            real = t if self.ways is None else t[t >= 0]
            if real.numel() and int(real.min()) < 0:
                e = int((t < 0).any(1).nonzero()[0, 0])
                raise EpisodeError(
                    f"{where}: {name} index {int(t.min())} (episode {e}) is negative; row indices lie in 0..{n - 1}",
                    param="episodes",
                    value=where,
                )
            if real.numel() and int(real.max()) >= n:
                raise EpisodeError(
                    f"{where}: {name} indices reach {int(real.max())} but the split has {n} rows "
                    f"(0..{n - 1}); the episodes were drawn from another cache or split",
                    param="episodes",
                    value=where,
                )
        bad = self._mixed(labels) if self.ways is not None else self._mixed_fixed(labels)
        if bool(bad.any()):
            e = int(bad.nonzero()[0, 0])
            assert self.index is not None  # set in __post_init__
            raise EpisodeError(
                f"{where}: episode {int(self.index[e])} does not match the split's labels "
                f"(a label mixes classes); the episodes were drawn from another cache or split",
                param="episodes",
                value=where,
            )
        if self.negatives is not None and pool_size is not None and self.negatives.numel():
            hi = int(self.negatives.max())
            if int(self.negatives.min()) < 0:
                raise EpisodeError(
                    f"{where}: negative index {int(self.negatives.min())} is negative; the pool "
                    f"{self.negative_source!r} has rows 0..{pool_size - 1}",
                    param="episodes",
                    value=where,
                )
            if hi >= pool_size:
                raise EpisodeError(
                    f"{where}: negative indices reach {hi} but the negative pool "
                    f"{self.negative_source!r} has {pool_size} rows",
                    param="episodes",
                    value=where,
                )

    def _mixed_fixed(self, labels: Tensor) -> Tensor:
        way, shot = int(self.spec.way or 0), int(self.spec.shot or 0)
        cls_s = labels[self.support]  # [E, Ns]
        cls_q = labels[self.query]
        ref = cls_s.view(len(self), way, shot)[:, :, 0]  # [E, way]
        ok_s = (cls_s == ref.gather(1, self.support_labels)).all(1)
        ok_q = (cls_q == ref.gather(1, self.query_labels)).all(1)
        distinct = (ref.unsqueeze(1) != ref.unsqueeze(2)).sum((1, 2)) == way * (way - 1)
        return ~(ok_s & ok_q & distinct)

    def _mixed(self, labels: Tensor) -> Tensor:
        """``[E]`` episodes where a label's rows span classes, two labels share one, or a label of
        ``0..ways-1`` has no support row (ragged sets)."""
        assert self.ways is not None
        E, W = len(self), self.way
        big = int(labels.max()) + 1 if labels.numel() else 1
        lo = torch.full((E, W), big, dtype=torch.int64)
        hi = torch.full((E, W), -1, dtype=torch.int64)
        for rows, lab in ((self.support, self.support_labels), (self.query, self.query_labels)):
            real = lab >= 0
            cls = torch.where(real, labels[rows.clamp(min=0)], 0)
            at = lab.clamp(min=0)
            lo.scatter_reduce_(1, at, torch.where(real, cls, big), "amin")
            hi.scatter_reduce_(1, at, torch.where(real, cls, -1), "amax")
        present = torch.arange(W).unsqueeze(0) < self.ways.unsqueeze(1)
        counted = self.support_counts() > 0
        one = (lo == hi) | ~present
        ref = torch.where(present, lo, -1 - torch.arange(W).unsqueeze(0))  # padding: distinct negatives
        distinct = (ref.unsqueeze(1) != ref.unsqueeze(2)).sum((1, 2)) == W * (W - 1)
        return ~(one.all(1) & distinct & (counted | ~present).all(1))


def _label_counts(labels: Tensor, way: int) -> Tensor:
    E = labels.shape[0]
    out = torch.zeros(E, max(way, 1) + 1, dtype=torch.int64)
    out.scatter_add_(1, torch.where(labels >= 0, labels, way).clamp(max=way), torch.ones_like(labels))
    return out[:, :way]


def check_spec(
    labels: Tensor,
    spec: EpisodeSpec,
    classes: Sequence[str] | None = None,
    superclasses: Sequence[str] | None = None,
) -> None:
    """EpisodeError, naming classes, unless ``spec`` can be drawn from a split with ``labels [N]``
    (and, with ``bilevel``, these ``superclasses``: one name per class)."""
    spec.validate()
    counts = torch.bincount(labels, minlength=len(classes) if classes is not None else 0)
    present = int((counts > 0).sum())
    names = list(classes) if classes is not None else [str(c) for c in range(len(counts))]
    if spec.ragged:
        _check_meta_dataset(spec, counts, names, superclasses)
        return
    assert spec.way is not None and spec.shot is not None and spec.query is not None  # validated
    if spec.way > present:
        raise EpisodeError(
            f"split {spec.split!r} has {present} classes with images; cannot draw {spec.way}-way episodes "
            f"(lower {mark('way')} to at most {present})",
            param="way",
            value=spec.way,
        )
    need = spec.shot + spec.query
    _short(spec, counts, names, need, f"shot + query = {need}")


def _short(spec: EpisodeSpec, counts: Tensor, names: list[str], need: int, what: str) -> None:
    short = [(names[c], int(counts[c])) for c in range(len(counts)) if 0 < counts[c] < need]
    if short:
        shown = ", ".join(f"{n} ({k})" for n, k in short[:10]) + (
            f", ... ({len(short)} in all)" if len(short) > 10 else ""
        )
        raise EpisodeError(
            f"split {spec.split!r}: lower {mark('shot')} or {mark('query')} (or drop classes): {len(short)} "
            f"class(es) have fewer than {what} images: {shown}",
            param="shot",
            value=spec.shot,
        )


def _check_meta_dataset(
    spec: EpisodeSpec, counts: Tensor, names: list[str], superclasses: Sequence[str] | None
) -> None:
    """The Meta-Dataset protocol's conditions (those under which sampling.py raises)."""
    present = int((counts > 0).sum())
    least = spec.way if spec.way is not None else spec.min_ways
    if least > present:
        key = "way" if spec.way is not None else "min_ways"
        raise EpisodeError(
            f"split {spec.split!r} has {present} classes with images; Meta-Dataset episodes need at "
            f"least {mark(key)} = {least}",
            params=(key,),
            param=key,
            value=least,
        )
    # every class must leave at least one support image and one query
    if spec.query is not None:
        need = (spec.shot or 1) + spec.query
        what = f"{'shot' if spec.shot else '1'} + query = {need}"
    elif spec.shot is not None:
        need, what = spec.shot + 1, f"shot + 1 = {spec.shot + 1}"
    else:
        need, what = 2, "2 (a support image and a query)"
    _short(spec, counts, names, need, what)
    most = spec.way if spec.way is not None else min(spec.max_ways_upper_bound, present)
    if spec.shot is None and spec.max_support_set_size < most:
        raise EpisodeError.bad_value(
            "max_support_set_size",
            spec.max_support_set_size,
            f"must be at least the most ways an episode can have here ({most}): one support image per class",
        )
    if spec.bilevel:
        given = list(superclasses) if superclasses is not None else superclass_names(names)
        if len(given) != len(counts):
            raise EpisodeError(
                f"{len(given)} superclasses given for the split's {len(counts)} classes",
                params=("bilevel",),
                param="bilevel",
                value=spec.bilevel,
            )
        per: dict[str, int] = {}
        for c, sup in enumerate(given):
            if counts[c] > 0:
                per[sup] = per.get(sup, 0) + 1
        small = sorted((name, k) for name, k in per.items() if k < spec.min_ways)
        if small:
            shown = ", ".join(f"{n} ({k})" for n, k in small[:10])
            raise EpisodeError(
                f"split {spec.split!r}: {mark('bilevel')} needs every superclass to have at least {mark('min_ways')} = "
                f"{spec.min_ways} classes with images; {len(small)} have fewer: {shown}",
                param="bilevel",
                value=spec.bilevel,
            )


def superclass_names(classes: Sequence[str]) -> list[str]:
    """Each class's superclass, from its name: the part before the first ``/`` when every name has
    one (Omniglot's ``Alphabet/character`` folders), else the part before the last ``_`` when
    every name has one (the glyphs' ``alphabet_XXXX``); otherwise EpisodeError. Give
    ``superclasses`` to :func:`sample_episodes` for another mapping."""
    names = list(classes)
    if names and all("/" in c for c in names):
        return [c.split("/", 1)[0] for c in names]
    if names and all("_" in c for c in names):
        return [c.rsplit("_", 1)[0] for c in names]
    raise EpisodeError(
        f"{mark('bilevel')} needs each class's superclass: class names of the form SUPER/NAME or SUPER_NAME "
        f"(e.g. {names[0] if names else ''!r} has neither), or superclasses given to the sampler",
        param="bilevel",
        value=True,
    )


def superclass_index(superclasses: Sequence[str]) -> np.ndarray:
    """int64 ``[C]``: each class's superclass (one name per class) as an index into their sorted names."""
    at = {s: j for j, s in enumerate(sorted(set(superclasses)))}
    return np.array([at[s] for s in superclasses], dtype=np.int64)


imbalanced_counts = sampler.imbalanced_counts


class _Draw:
    """What drawing needs from a split's labels, computed once (the classes with images, each
    class's rows, the superclasses for ``bilevel``); called with ``(start, n)`` it draws those
    episodes with :func:`poodle.sampler.draw`."""

    def __init__(
        self,
        labels: Tensor,
        spec: EpisodeSpec,
        classes: Sequence[str] | None = None,
        *,
        superclasses: Sequence[str] | None = None,
    ) -> None:
        labels = torch.as_tensor(labels, dtype=torch.int64).cpu()
        check_spec(labels, spec, classes, superclasses)
        self.spec = spec
        self.n_rows = int(labels.shape[0])
        sup = None
        if spec.ragged and spec.bilevel:
            n_cls = len(torch.bincount(labels, minlength=len(classes) if classes is not None else 0))
            names = list(classes) if classes is not None else [str(c) for c in range(n_cls)]
            sup = superclass_index(list(superclasses) if superclasses is not None else superclass_names(names))
        self.tables = sampler.SplitTables.of(labels, sup)

    def __call__(self, start: int, n_episodes: int) -> EpisodeSet:
        d = sampler.draw(self.spec, self.tables, start, n_episodes)
        eps = EpisodeSet(
            d.support,
            d.query,
            d.support_labels,
            d.query_labels,
            None,
            self.spec,
            "",
            torch.arange(start, start + n_episodes, dtype=torch.int64),
            d.class_ids,
            d.ways,
        )
        return eps.cropped()


def check_count(n_episodes: object) -> None:
    """EpisodeError unless ``n_episodes`` is a number of episodes (:class:`CellSpec`)."""
    check_value(schema_setting(CellSpec, "episodes"), n_episodes, EpisodeError)


def sample_episodes(
    labels: Tensor,
    spec: EpisodeSpec,
    n_episodes: int,
    *,
    classes: list[str] | None = None,
    start: int = 0,
    superclasses: Sequence[str] | None = None,
) -> EpisodeSet:
    """Draw episodes ``start .. start+n_episodes-1`` from a split with ``labels [N]`` (int64).

    EpisodeError before any drawing when the setting is impossible (way above the number of
    classes, classes with fewer than ``shot + query`` images, named; non-positive counts).
    ``superclasses`` (one name per class) serve ``bilevel``; without them they are read from the
    class names (:func:`superclass_names`).
    """
    check_count(n_episodes)
    return _Draw(labels, spec, classes, superclasses=superclasses)(start, int(n_episodes))


class EpisodeStream:
    """Episodes ``start .. start+n_episodes-1`` of ``(labels, spec)``, drawn only when a slice of them
    is asked for: ``stream[a:b]`` is exactly ``sample_episodes(labels, spec, b - a, start=start + a)``.

    :func:`poodle.evaluate.evaluate` accepts one in place of an :class:`EpisodeSet`; it draws each
    chunk's episodes (and negatives) in the worker that solves the chunk, so a run of any length
    starts solving at once and never holds the index tensors of all its episodes. The setting is
    checked (EpisodeError) when the stream is made, as by :func:`sample_episodes`. Under the
    Meta-Dataset protocol (``ragged``) each slice is a ragged :class:`EpisodeSet`, padded to its
    own largest episode.
    """

    negatives: Tensor | None = None
    negative_source: str = ""

    def __init__(
        self,
        labels: Tensor,
        spec: EpisodeSpec,
        n_episodes: int,
        *,
        classes: list[str] | None = None,
        start: int = 0,
        superclasses: Sequence[str] | None = None,
    ) -> None:
        check_count(n_episodes)
        self._draw = _Draw(labels, spec, classes, superclasses=superclasses)
        self.spec = spec
        self.start = int(start)
        self.n = int(n_episodes)

    def __len__(self) -> int:
        return self.n

    @property
    def ragged(self) -> bool:
        """Whether its episodes differ in shape (each chunk is an :class:`EpisodeSet` with ``ways``)."""
        return self.spec.ragged

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
            raise EpisodeError(f"empty slice [{a}:{b}] of {self.n} episodes", param="sl", value=sl)
        return self._draw(self.start + a, b - a)

    def materialize(self) -> EpisodeSet:
        """All the episodes, drawn now."""
        return self[0 : self.n]

    def check_against(self, labels: Tensor, *, where: str = "episodes", pool_size: int | None = None) -> None:
        """EpisodeError unless ``labels`` has as many rows as the split the stream draws from."""
        if int(labels.shape[0]) != self._draw.n_rows:
            raise EpisodeError(
                f"{where}: drawn from a split of {self._draw.n_rows} rows, "
                f"but the features have {int(labels.shape[0])}",
                param="episodes",
                value=where,
            )


# ------------------------------------------------------------------------------------------ files


def save_episodes(path: str | os.PathLike, eps: EpisodeSet, **attrs: object) -> Path:
    """Write ``eps`` to HDF5 (layout in docs/stage2.md; extra ``attrs`` are stored too), atomically.

    Fixed episodes keep the layout other tools read (version 1). Ragged ones (version 2) add
    ``/ways [E]``, ``/shots [E, W]`` and ``/queries [E, W]`` (each label's support and query
    counts, 0 past an episode's ways), pad the index arrays with -1, write 0 for a ``way``,
    ``shot`` or ``query`` drawn per episode, and record the protocol and its parameters."""
    path = Path(path)
    try:
        check_output(path, "episodes", what="episode file")
    except ConfigError as e:
        raise EpisodeError(str(e), param="path", value=path) from None
    spec = eps.spec
    # built in memory, then written with plain file I/O: a full disk is then one clean error, never
    # a failed write inside HDF5 (whose library may crash at exit after one)
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        for name in ("support", "query", "support_labels", "query_labels", "index", "class_ids"):
            f.create_dataset(name, data=getattr(eps, name).cpu().numpy().astype(np.int64))
        if eps.negatives is not None:
            f.create_dataset("negatives", data=eps.negatives.cpu().numpy().astype(np.int64))
        if eps.ways is not None:
            f.create_dataset("ways", data=eps.ways.cpu().numpy().astype(np.int64))
            f.create_dataset("shots", data=eps.support_counts().numpy())
            f.create_dataset("queries", data=eps.query_counts().numpy())
        a = f.attrs
        a["format"], a["version"] = FORMAT, VERSION if eps.ways is None else RAGGED_VERSION
        a["split"] = spec.split
        a["way"], a["shot"], a["query"] = (0 if v is None else int(v) for v in (spec.way, spec.shot, spec.query))
        a["imbalance"] = 0.0 if spec.imbalance is None else float(spec.imbalance)  # 0: balanced
        a["seed"] = spec.seed
        a["query_classes"] = 0 if spec.query_classes is None else int(spec.query_classes)  # 0: all
        if spec.ragged:
            a["protocol"] = spec.protocol
            for k in defaults.META_DATASET_KEYS:
                v = getattr(spec, k)
                a[k] = int(v) if isinstance(v, (bool, np.bool_)) else v  # bilevel: 0 or 1
        a["negative_source"] = eps.negative_source
        a["n_neg"] = 0 if eps.negatives is None else int(eps.negatives.shape[1])
        for k, v in attrs.items():
            a[k] = v
    atomic_write(path, buf.getbuffer())
    return path


def episodes_source(path: str | os.PathLike) -> tuple[str | None, str | None]:
    """The cache an episodes file says its episodes were drawn from: ``(path, cache_id)`` as
    :func:`poodle.solve.solve` records them (``cache`` and ``cache_id``, the content fingerprint of
    :func:`poodle.results.cache_identity`); None for what a file does not record (files written
    before 0.2.0 and by other tools hold no ``cache_id``)."""
    path = resolve_path(path, what="episodes file")
    try:
        with h5py.File(path, "r") as f:
            cache, cache_id = f.attrs.get("cache"), f.attrs.get("cache_id")
    except OSError as e:
        raise EpisodeError(f"{path}: not an HDF5 file ({e})", param="episodes_from", value=path) from None
    return (None if cache is None else _text(cache)), (None if cache_id is None else _text(cache_id))


def load_episodes(path: str | Path, *, labels: Tensor | None = None, pool_size: int | None = None) -> EpisodeSet:
    """Read an episode set written by :func:`save_episodes` (or any tool following the layout).

    Shapes and labels are validated; with ``labels [N]`` of the split (and ``pool_size`` of the
    negative pool) the indices are checked against the cache too. EpisodeError names the problem.
    """
    path = resolve_path(path, what="episodes file")
    if not path.is_file():
        raise EpisodeError(f"{path}: no such episodes file", param="episodes_from", value=path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise EpisodeError(f"{path}: not an HDF5 file ({e})", param="episodes_from", value=path) from None
    with f:
        # attributes and datasets apart: "query" is both (queries per class, and their indices)
        attrs = [k for k in ("split", "way", "shot", "query", "seed") if k not in f.attrs]
        sets = [f"/{k}" for k in ("support", "query", "support_labels", "query_labels") if k not in f]
        missing = [
            f"{what}{'s' if len(ks) > 1 else ''} {', '.join(ks)}"
            for what, ks in (("attribute", attrs), ("dataset", sets))
            if ks
        ]
        if missing:
            raise EpisodeError(
                f"{path}: not an episodes file (missing {'; '.join(missing)})", param="episodes_from", value=path
            )
        spec = _read_spec(path, f.attrs)
        arrays = _read_index_arrays(path, f)
        source = _text(f.attrs.get("negative_source", ""))
    if spec.ragged:
        _check_ragged(path, spec, arrays)
    else:
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
        arrays.get("ways"),
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
            raise EpisodeError(
                f"{path}: attribute {key!r} must be {what}, got {_text(v)!r}", param="episodes_from", value=path
            )
        return float(v) if isinstance(v, float) else v

    def integer(key: str) -> int:
        v = num(key, what="an integer")
        if not float(v).is_integer():
            raise EpisodeError(
                f"{path}: attribute {key!r} must be an integer, got {v!r}", param="episodes_from", value=path
            )
        return int(v)

    protocol = _text(a.get("protocol", defaults.PROTOCOL))
    ragged = protocol == "meta-dataset"
    kappa = float(num("imbalance", 0.0))
    n_qc = integer("query_classes") if "query_classes" in a else 0  # 0: every class has queries
    shape: dict[str, Any] = {k: integer(k) for k in ("way", "shot", "query")}
    rules: dict[str, Any] = {}
    if ragged:  # 0: drawn per episode
        shape = {k: (None if v == 0 else v) for k, v in shape.items()}
        for k in defaults.META_DATASET_KEYS:
            if k not in a:
                raise EpisodeError(
                    f"{path}: a Meta-Dataset episode file needs attribute {k!r}", param="episodes_from", value=path
                )
            rules[k] = bool(integer(k)) if k == "bilevel" else num(k) if k.endswith("log_weight") else integer(k)
    spec = EpisodeSpec(
        split=_text(a["split"]),
        imbalance=None if kappa == 0 or not math.isfinite(kappa) else kappa,
        seed=integer("seed"),
        query_classes=None if n_qc == 0 else n_qc,
        protocol=protocol,
        **shape,
        **rules,
    )
    try:
        spec.validate()
    except EpisodeError as e:
        raise EpisodeError(f"{path}: {e}", param="episodes_from", value=path) from None
    return spec


def _read_index_arrays(path: Path, f: h5py.File) -> dict[str, Tensor]:
    """The integer datasets of an episode file, as int64 tensors by name."""
    arrays = {}
    names = ("support", "query", "support_labels", "query_labels", "negatives", "index", "class_ids")
    for name in names + ("ways", "shots", "queries"):
        if name in f:
            arr = np.asarray(f[name][()])
            if arr.dtype.kind not in "iu":
                raise EpisodeError(
                    f"{path}: /{name} must hold integers, got {arr.dtype}", param="episodes_from", value=path
                )
            arrays[name] = torch.from_numpy(arr.astype(np.int64))
    return arrays


def _check_shapes(path: Path, spec: EpisodeSpec, arrays: dict[str, Tensor]) -> None:
    """Every array of an episode file has the shape ``spec`` implies; labels lie in ``0..way-1``."""
    E = arrays["support"].shape[0]
    if E == 0:
        raise EpisodeError(
            f"{path}: holds no episodes (/support has shape {tuple(arrays['support'].shape)})",
            param="episodes_from",
            value=path,
        )
    way = spec.fixed("way")
    shapes = {
        "support": (E, spec.n_support),
        "support_labels": (E, spec.n_support),
        "query": (E, spec.n_query),
        "query_labels": (E, spec.n_query),
        "index": (E,),
        "class_ids": (E, way),
    }
    for name, shape in shapes.items():
        if name in arrays and tuple(arrays[name].shape) != shape:
            raise EpisodeError(
                f"{path}: /{name} has shape {tuple(arrays[name].shape)}, expected {shape} "
                f"for {spec.way}-way {spec.shot}-shot {spec.query}-query episodes",
                param="episodes_from",
                value=path,
            )
    _check_negatives(path, arrays, E)
    for name in ("support_labels", "query_labels"):
        t = arrays[name]
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= way):
            raise EpisodeError(f"{path}: /{name} must lie in 0..{way - 1}", param="episodes_from", value=path)


def _check_negatives(path: Path, arrays: dict[str, Tensor], E: int) -> None:
    if "negatives" in arrays and (arrays["negatives"].ndim != 2 or arrays["negatives"].shape[0] != E):
        raise EpisodeError(
            f"{path}: /negatives has shape {tuple(arrays['negatives'].shape)}, expected ({E}, M)",
            param="episodes_from",
            value=path,
        )


def _check_ragged(path: Path, spec: EpisodeSpec, arrays: dict[str, Tensor]) -> None:
    """A ragged file's arrays: ``/ways``, rows and labels padded together with -1, labels of
    episode ``e`` in ``0..ways[e]-1`` with every label in its support, ``/class_ids`` as wide as
    the most ways, and ``/shots`` and ``/queries`` (when present) the labels' counts."""
    if "ways" not in arrays:
        raise EpisodeError(
            f"{path}: a Meta-Dataset episode file needs /ways (each episode's number of classes)",
            param="episodes_from",
            value=path,
        )
    ways = arrays["ways"]
    E = ways.shape[0]
    if ways.ndim != 1 or E == 0:
        raise EpisodeError(
            f"{path}: /ways has shape {tuple(ways.shape)}, expected (E,) with E > 0", param="episodes_from", value=path
        )
    if int(ways.min()) < 2:
        e = int((ways < 2).nonzero()[0, 0])
        raise EpisodeError(
            f"{path}: /ways[{e}] is {int(ways[e])}; an episode has at least 2 classes",
            param="episodes_from",
            value=path,
        )
    if spec.way is not None and bool((ways != spec.way).any()):
        raise EpisodeError(f"{path}: /ways differs from the file's way = {spec.way}", param="episodes_from", value=path)
    W = int(ways.max())
    for rows, labels in (("support", "support_labels"), ("query", "query_labels")):
        r, lab = arrays[rows], arrays[labels]
        if r.ndim != 2 or r.shape[0] != E or lab.shape != r.shape:
            raise EpisodeError(
                f"{path}: /{rows} {tuple(r.shape)} and /{labels} {tuple(lab.shape)} must both be ({E}, N)",
                param="episodes_from",
                value=path,
            )
        bad = (lab < -1) | (lab >= ways.unsqueeze(1)) | ((lab == -1) != (r == -1))
        if bool(bad.any()):
            e, j = (int(x) for x in bad.nonzero()[0])
            raise EpisodeError(
                f"{path}: /{labels}[{e}, {j}] = {int(lab[e, j])} with /{rows}[{e}, {j}] = {int(r[e, j])}: labels "
                f"lie in 0..ways-1 = {int(ways[e]) - 1}, and -1 (padding) exactly where the row is -1",
                param="episodes_from",
                value=path,
            )
    for name, shape in (("index", (E,)), ("class_ids", (E, W))):
        if name in arrays and tuple(arrays[name].shape) != shape:
            raise EpisodeError(
                f"{path}: /{name} has shape {tuple(arrays[name].shape)}, expected {shape}",
                param="episodes_from",
                value=path,
            )
    _check_negatives(path, arrays, E)
    for name, labels in (("shots", "support_labels"), ("queries", "query_labels")):
        counts = _label_counts(arrays[labels], W)
        if name in arrays and not torch.equal(arrays[name], counts):
            raise EpisodeError(
                f"{path}: /{name} disagrees with /{labels} (each label's count of rows)",
                param="episodes_from",
                value=path,
            )
    missing = (_label_counts(arrays["support_labels"], W) == 0) & (torch.arange(W) < ways.unsqueeze(1))
    if bool(missing.any()):
        e, k = (int(x) for x in missing.nonzero()[0])
        raise EpisodeError(f"{path}: episode {e}: label {k} has no support row", param="episodes_from", value=path)


def describe_episodes(eps: EpisodeSet) -> dict[str, tuple[float, float, float]]:
    """``{"ways", "shots per class", "queries per class"}``: each as ``(min, mean, max)`` over the
    episodes (the counts over every class of every episode)."""
    ways = eps.ways if eps.ways is not None else torch.full((len(eps),), eps.way, dtype=torch.int64)
    real = torch.arange(eps.way).unsqueeze(0) < ways.unsqueeze(1)
    out = {"ways": ways.double()}
    out["shots per class"] = eps.support_counts()[real].double()
    out["queries per class"] = eps.query_counts()[real].double()
    return {k: (float(v.min()), float(v.mean()), float(v.max())) for k, v in out.items()}


__all__ = [
    "CellSpec",
    "EpisodeSpec",
    "EpisodeSet",
    "EpisodeStream",
    "sample_episodes",
    "save_episodes",
    "load_episodes",
    "check_spec",
    "episodes_source",
    "imbalanced_counts",
    "superclass_names",
    "describe_episodes",
]
