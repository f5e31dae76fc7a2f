"""The one episode sampler: every kind of episode, thousands at a time, from each episode's own words.

Episode ``i`` of a setting is a pure function of ``(seed, i, setting)``: its random numbers are the
32-bit words of the mt19937 generator seeded with the low 32 bits of ``derive_seed(seed, i)``
(:func:`poodle.utils.generator`; the words come from torch, one call per episode,
:func:`poodle._mt19937.packed_words`), and everything made of them is computed here with numpy and
torch over all the episodes of a block at once. Nothing else draws episodes.

The fixed protocol (``protocol = "fixed"``: ``way`` classes, ``shot`` support images and ``query``
queries each, optionally Dirichlet-imbalanced queries or queries from ``query_classes`` classes)
reads its words exactly as torch's own samplers did when poodle drew episodes one by one with
``randperm`` and ``_standard_gamma`` (:mod:`poodle.episodes` gives the order), so every episode
drawn since keeps its value: ``randperm(n)`` is the Fisher-Yates loop of torch's CPU kernel
(:func:`poodle._mt19937.randperm_prefix`; it consumes ``n - 1`` words), ``_standard_gamma`` is
Marsaglia and Tsang's method as torch computes it (:func:`poodle._mt19937.standard_gamma`).
``tests/test_sampling_bulk.py`` compares both with torch's own calls.

The Meta-Dataset protocol (``protocol = "meta-dataset"``) reads its words in a layout of its own,
fixed by the setting and the split, and draws ragged episodes (:func:`draw_meta_dataset` gives the
layout and the formulas); ``tests/test_meta_dataset.py`` checks it against a plain per-episode
reimplementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from poodle._mt19937 import packed_words, randperm_prefix, standard_gamma, uniform64_at, word_at
from poodle.errors import EpisodeError
from poodle.utils import derive_seeds

if TYPE_CHECKING:
    from poodle.episodes import EpisodeSpec

_BLOCK_WORDS = 1 << 22  # packed words held per block (32 MiB)
_BLOCK_ENTRIES = 1 << 22  # per-class draws held per block of ragged episodes ([rows, longest] int64)
_GAMMA_WORDS = 16  # words first allowed per Gamma draw (about 5 on average), plus _GAMMA_SLACK per episode
_GAMMA_SLACK = 64

# The first words of mt19937 seeded with 5489 (the reference implementation's default seed).
_MT19937_5489 = (3499211612, 581869302, 3890346734, 3586334585)
_WORDS_OK: list[bool] = []


def check_words() -> None:
    """EpisodeError unless torch's CPU generator yields the mt19937 words that episodes are made of
    (checked once per process against the reference sequence)."""
    if not _WORDS_OK:
        got = [int(w) for w in word_at(packed_words([5489], 4), np.zeros(4, np.int64), np.arange(4))]
        _WORDS_OK.append(got == list(_MT19937_5489))
    if not _WORDS_OK[0]:
        # not a caller's value: this torch's generator, not a setting
        raise EpisodeError(
            f"torch {torch.__version__}'s CPU generator does not yield mt19937's words; episodes "
            "cannot be drawn as defined (they are made of those words)"
        )


@dataclass(frozen=True)
class SplitTables:
    """A split's rows by class: ``order`` (row indices sorted by class, stable), ``first[c]`` (where
    class ``c`` starts in ``order``), ``size[c]`` (its images), ``eligible`` (classes with images,
    ascending) and ``superclass`` (``[n_classes]`` each class's superclass, or None)."""

    order: np.ndarray
    first: np.ndarray
    size: np.ndarray
    eligible: np.ndarray
    superclass: np.ndarray | None = None

    @classmethod
    def of(cls, labels: Tensor, superclass: np.ndarray | None = None) -> SplitTables:
        """The tables of a split with ``labels [N]`` (int64 class indices)."""
        lab = torch.as_tensor(labels, dtype=torch.int64).cpu().numpy()
        size = np.bincount(lab) if lab.size else np.zeros(0, np.int64)
        order = np.argsort(lab, kind="stable")
        return cls(order, np.cumsum(size) - size, size, np.flatnonzero(size > 0), superclass)


@dataclass(frozen=True)
class Drawn:
    """A block's episodes, int64 tensors: ``support [E, Ns]``, ``query [E, Nq]``, their labels
    ``support_labels [E, Ns]`` and ``query_labels [E, Nq]`` (class-major), ``class_ids [E, W]``
    (the split's class of each label), and ``ways [E]`` for ragged episodes (None for fixed ones).
    Ragged episodes are padded with -1 to the block's largest (rows, labels and class ids)."""

    support: Tensor
    query: Tensor
    support_labels: Tensor
    query_labels: Tensor
    class_ids: Tensor
    ways: Tensor | None = None


def draw(spec: EpisodeSpec, tables: SplitTables, start: int, n: int) -> Drawn:
    """Episodes ``start .. start + n - 1`` of ``spec`` from a split's ``tables`` (the setting was
    checked against the split by :func:`poodle.episodes.check_spec`)."""
    check_words()
    if spec.protocol == "meta-dataset":
        return _cat([draw_meta_dataset(spec, tables, a, b) for a, b in _blocks(start, n, _md_block(spec, tables))])
    fixed = _Fixed(spec, tables)
    return _cat([fixed(a, b) for a, b in _blocks(start, n, fixed.block)])


def _blocks(start: int, n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(size, start + n - a)) for a in range(start, start + n, size)]


def _cat(parts: list[Drawn]) -> Drawn:
    """The blocks' episodes in one, ragged ones padded with -1 to the widest block."""
    if len(parts) == 1:
        return parts[0]

    def cat(ts: list[Tensor]) -> Tensor:
        width = max(t.shape[1] for t in ts)
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in ts])

    ways = None if parts[0].ways is None else torch.cat([p.ways for p in parts if p.ways is not None])
    return Drawn(
        cat([p.support for p in parts]),
        cat([p.query for p in parts]),
        cat([p.support_labels for p in parts]),
        cat([p.query_labels for p in parts]),
        cat([p.class_ids for p in parts]),
        ways,
    )


# ------------------------------------------------------------------------------------ fixed


def imbalanced_counts(p: Tensor, total: int, capacity: Tensor) -> Tensor:
    """Largest-remainder rounding of ``total * p`` under per-class ``capacity``, for every row of
    ``p [E, way]`` (float64; or one ``[way]``) at once: int64 counts of the same shape, each row
    summing to ``total`` (requires ``capacity.sum(-1) >= total``).

    Floors first, then one more to the classes with the largest fractional parts (ties to the lower
    label); a class whose count would exceed its capacity gets its capacity and the rest is rounded
    again over the others, by their shares."""
    if p.dim() == 1:
        return imbalanced_counts(p.unsqueeze(0), total, capacity.unsqueeze(0))[0]
    E, way = p.shape
    counts = torch.zeros(E, way, dtype=torch.int64)  # fixed (clipped) classes hold their capacity
    free = torch.ones(E, way, dtype=torch.bool)
    remaining = torch.full((E,), total, dtype=torch.int64)
    result = torch.empty(E, way, dtype=torch.int64)
    todo = torch.arange(E)
    ranks = torch.arange(way).expand(E, way)
    while todo.numel():
        pt, ft, ct, cap = p[todo], free[todo], counts[todo], capacity[todo]
        share = torch.where(ft, pt, torch.zeros_like(pt))
        s = share.sum(1, keepdim=True)
        even = ft.to(p.dtype) / ft.sum(1, keepdim=True).to(p.dtype)
        share = torch.where(s > 0, share / s, even)
        raw = remaining[todo].unsqueeze(1).to(p.dtype) * share
        add = torch.floor(raw).to(torch.int64)
        left = remaining[todo] - add.sum(1)
        frac = torch.where(ft, raw - add.to(raw.dtype), torch.full_like(raw, -1.0))
        order = torch.sort(-frac, dim=1, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, ranks[: len(todo)])
        new = ct + add + (rank < left.unsqueeze(1)).to(torch.int64)
        over = ft & (new > cap)
        done = ~over.any(1)
        result[todo[done]] = new[done]
        counts[todo] = torch.where(over, cap, ct)
        free[todo] = ft & ~over
        remaining[todo] = total - counts[todo].sum(1)
        todo = todo[~done]
    return result


def _shares(gam: np.ndarray) -> Tensor:
    # p = gam / gam.sum(): torch's row sums (the order of a float sum changes its last bit)
    g = torch.from_numpy(gam)
    s = g.sum(1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(torch.zeros(len(g), dtype=torch.int64), g.shape[1]).double()
    return torch.where(s > 0, g / s, one_hot)


class _Words:
    """Words of a block's episodes: from the block's packed words, or, for the episodes that need
    more (``need > have``: classes larger than the smallest, long Gamma draws), from their own
    longer draw."""

    def __init__(self, packed: np.ndarray, seeds: list[int], need: np.ndarray, have: int) -> None:
        self.packed = packed
        self.long = np.full(len(seeds), -1, dtype=np.int64)
        idx = np.flatnonzero(need > have)
        self.long[idx] = np.arange(len(idx))
        self.more = packed_words([seeds[i] for i in idx], need[idx].tolist()) if idx.size else packed

    def at(self, ep: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """int64 words ``pos`` of episodes ``ep`` (of the block; arrays of one shape)."""
        j = self.long[ep]
        if not (j >= 0).any():
            return word_at(self.packed, ep, pos)
        out = np.empty(ep.shape, dtype=np.int64)
        own = j >= 0
        out[own] = word_at(self.more, j[own], pos[own])
        out[~own] = word_at(self.packed, ep[~own], pos[~own])
        return out


class _Fixed:
    """Blocks of fixed-protocol episodes of ``spec`` from ``tables``: the words of torch's
    ``randperm`` of the classes, ``randperm(way)`` for ``query_classes``, ``_standard_gamma`` for
    the Dirichlet shares, and a ``randperm`` of each class's images, in that order."""

    def __init__(self, spec: EpisodeSpec, tables: SplitTables) -> None:
        self.spec, self.t = spec, tables
        self.way, self.shot, self.query = spec.fixed("way"), spec.fixed("shot"), spec.fixed("query")
        way, qc = self.way, spec.query_classes
        self.C = len(tables.eligible)
        self.prefix = self.C - 1 + (way - 1 if qc is not None else 0)
        self.n_gamma = 0 if spec.imbalance is None else (way if qc is None else qc)
        gamma_words = self.n_gamma * _GAMMA_WORDS + (_GAMMA_SLACK if self.n_gamma else 0)
        n_min = int(tables.size[tables.eligible].min())
        self.guess = self.prefix + gamma_words + way * (n_min - 1)  # enough when classes are equal
        self.block = max(1, min(1024, _BLOCK_WORDS // max(self.guess, 1)))

    def __call__(self, start: int, E: int) -> Drawn:
        s, t = self.spec, self.t
        way, shot = self.way, self.shot
        seeds = derive_seeds(s.seed, range(start, start + E))
        packed = packed_words(seeds, self.guess)
        rows = np.arange(E)
        # 1. way classes of the C
        steps = np.minimum(np.arange(way), max(self.C - 2, 0))  # words past the permutation's are ignored
        cls_pos = randperm_prefix(np.full(E, self.C), np.full(E, way), word_at(packed, rows[:, None], steps[None, :]))
        cls = t.eligible[cls_pos]  # [E, way]
        # 2. queries per class
        counts, ptr = self._query_counts(packed, seeds, rows, cls)
        # 3. per class (row r = e * way + k) a randperm of its images: the first take[r] of them
        steps = t.size[cls] - 1  # [E, way] words of each class's randperm
        first = (ptr[:, None] + np.cumsum(steps, 1) - steps).reshape(-1)  # the class's first word
        words = _Words(packed, seeds, ptr + steps.sum(1), self.guess)
        size, take = steps.reshape(-1) + 1, (shot + counts).reshape(-1)
        r = np.repeat(np.arange(E * way), take)  # one entry per image drawn, class-major
        k = np.arange(len(r)) - np.repeat(np.cumsum(take) - take, take)  # its place in the class's randperm
        w = np.zeros((E * way, int(take.max())), dtype=np.int64)
        drawn = k < size[r] - 1  # the last place draws no word
        w[r[drawn], k[drawn]] = words.at(r[drawn] // way, first[r[drawn]] + k[drawn])
        perm = randperm_prefix(size, take, w)
        chosen = t.order[t.first[cls].reshape(-1)[r] + perm[r, k]]  # rows of the split
        sup = k < shot
        Nq, Ns = s.n_query, way * shot
        return Drawn(
            torch.from_numpy(chosen[sup].reshape(E, Ns)),
            torch.from_numpy(chosen[~sup].reshape(E, Nq)),
            torch.arange(way, dtype=torch.int64).repeat_interleave(shot).expand(E, Ns).contiguous(),
            torch.from_numpy((r[~sup] % way).reshape(E, Nq)),
            torch.from_numpy(cls.astype(np.int64)),
        )

    def _query_counts(
        self, packed: np.ndarray, seeds: list[int], rows: np.ndarray, cls: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Queries per label ``[E, way]`` and the next word of each episode ``[E]``."""
        s, t = self.spec, self.t
        E, way, qc, q = len(rows), self.way, s.query_classes, self.query
        ptr = np.full(E, self.prefix, dtype=np.int64)
        if qc is not None:
            steps = self.C - 1 + np.minimum(np.arange(qc), way - 2)
            chosen = randperm_prefix(np.full(E, way), np.full(E, qc), word_at(packed, rows[:, None], steps[None, :]))
        if s.imbalance is None:
            if qc is None:
                return np.full((E, way), q, dtype=np.int64), ptr
            counts = np.zeros((E, way), dtype=np.int64)
            counts[rows[:, None], chosen] = q
            return counts, ptr
        gam, ptr = self._gamma(packed, seeds, ptr)
        share = _shares(gam)
        capacity = torch.from_numpy(t.size[cls] - self.shot)
        if qc is None:
            return imbalanced_counts(share, s.n_query, capacity).numpy(), ptr
        r, c = torch.from_numpy(rows[:, None]), torch.from_numpy(chosen)
        p = torch.zeros(E, way, dtype=torch.float64)
        p[r, c] = share
        cap = torch.zeros_like(capacity)
        cap[r, c] = capacity[r, c]  # classes without queries have no capacity
        return imbalanced_counts(p, s.n_query, cap).numpy(), ptr

    def _gamma(self, packed: np.ndarray, seeds: list[int], ptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The Gamma draws of each episode ``[E, n_gamma]`` from word ``ptr``, and the word after
        them. An episode whose draws run past its words (rare: rejections) has them drawn again
        from more of its words, as many times as it takes."""
        E = len(seeds)
        have = np.full(E, self.guess, dtype=np.int64)
        gam, nxt, ok = standard_gamma(packed, np.arange(E), ptr, have, float(self.spec.imbalance or 0), self.n_gamma)
        more = 2 * self.guess
        while not ok.all():
            idx = np.flatnonzero(~ok)
            again = packed_words([seeds[i] for i in idx], more)
            g, p, fit = standard_gamma(
                again,
                np.arange(len(idx)),
                ptr[idx],
                np.full(len(idx), more),
                float(self.spec.imbalance or 0),
                self.n_gamma,
            )
            gam[idx[fit]], nxt[idx[fit]], ok[idx[fit]] = g[fit], p[fit], True
            more *= 2
        return gam, nxt


# ----------------------------------------------------------------------------- Meta-Dataset


def md_layout(spec: EpisodeSpec, tables: SplitTables) -> tuple[int, int]:
    """``(W, header)``: the most ways an episode of ``spec`` can have on this split, and the words
    an episode reads before its images (:func:`draw_meta_dataset`)."""
    W = md_max_ways(spec, tables)
    return W, 2 + W + 2 + 2 * W


def md_max_ways(spec: EpisodeSpec, tables: SplitTables) -> int:
    """The most classes an episode of ``spec`` can have on this split."""
    if spec.way is not None:
        return int(spec.way)
    if spec.bilevel:
        assert tables.superclass is not None
        per_super = np.bincount(tables.superclass[tables.eligible])
        return int(min(spec.max_ways_upper_bound, per_super.max()))
    return int(min(spec.max_ways_upper_bound, len(tables.eligible)))


def _md_block(spec: EpisodeSpec, tables: SplitTables) -> int:
    W = md_max_ways(spec, tables)
    longest = int(spec.max_support_set_size if spec.shot is None else spec.shot)
    longest += int(spec.max_num_query if spec.query is None else spec.query)
    return max(1, min(1024, _BLOCK_ENTRIES // (W * longest)))


def _candidates(spec: EpisodeSpec, tables: SplitTables, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each episode's classes to choose from: ``[E, n]`` (padded with -1) and how many ``[E]``."""
    E = len(words)
    eligible = tables.eligible
    if not spec.bilevel:
        return np.broadcast_to(eligible, (E, len(eligible))), np.full(E, len(eligible))
    assert tables.superclass is not None
    sup = tables.superclass[eligible]
    supers = np.unique(sup)
    chosen = supers[words % len(supers)]  # [E]
    members = [eligible[sup == s_] for s_ in supers]
    width = max(len(m) for m in members)
    table = np.full((len(supers), width), -1, dtype=np.int64)
    for j, m in enumerate(members):
        table[j, : len(m)] = m
    j = np.searchsorted(supers, chosen)
    return table[j], np.array([len(members[i]) for i in j], dtype=np.int64)


def draw_meta_dataset(spec: EpisodeSpec, tables: SplitTables, start: int, E: int) -> Drawn:
    """Episodes ``start .. start + E - 1`` by Meta-Dataset's rules (``meta_dataset/data/sampling.py``
    of google-research/meta-dataset), ragged.

    Words of episode ``i`` (its own generator), with ``W`` the most ways the setting allows here:

    - word 0: the superclass, ``word % S`` of the ``S`` superclasses in ascending order (``bilevel``;
      read but unused otherwise);
    - word 1: ``ways = min_ways + word % (hi - min_ways + 1)``, ``hi = min(max_ways_upper_bound,
      classes)`` (the superclass's classes with ``bilevel``; unused when ``way`` is given);
    - words 2 .. 2 + W - 1: the classes, the first ``ways`` entries of a Fisher-Yates shuffle of
      the candidates (step ``t`` swaps ``t`` and ``t + word_t % (n - t)``, as ``randperm``);
    - the next 2 words: ``beta``, a float64 uniform in [0, 1) (53 bits of two words, as torch);
    - the next ``2 W``: per label ``k < ways`` a uniform ``u_k``; its log-weight is
      ``min_log_weight + (max_log_weight - min_log_weight) * u_k``;
    - then per label in order, a Fisher-Yates shuffle of its class's images, one word per image
      taken (``shot_k + query``): the first ``shot_k`` are its support, the next ``query`` its queries.

    Counts (``n_k`` the images of label ``k``'s class; sums run in label order):
    ``query = min(max_num_query, min_k floor(n_k / 2))`` (with ``shot`` given, ``min(max_num_query,
    min_k n_k - shot)``; ``query`` given fixes it); ``S = min(max_support_set_size, sum_k floor(beta
    * min(max_support_size_contrib_per_class, n_k - query) + 1))``; ``w_k = n_k exp(log-weight_k)``,
    ``shot_k = min(floor(w_k / sum w * (S - ways)) + 1, n_k - query)`` (``shot`` given fixes it).
    """
    s, t = spec, tables
    W, header = md_layout(spec, tables)
    seeds = derive_seeds(s.seed, range(start, start + E))
    longest = int(s.max_support_set_size if s.shot is None else W * s.shot)
    longest += W * int(s.max_num_query if s.query is None else s.query)
    packed = packed_words(seeds, header + longest)
    rows = np.arange(E)
    # ways and classes
    cand, n_cand = _candidates(s, t, word_at(packed, rows, np.zeros(E, np.int64)))
    if s.way is not None:
        ways = np.full(E, int(s.way), dtype=np.int64)
    else:
        hi = np.minimum(s.max_ways_upper_bound, n_cand)
        ways = s.min_ways + word_at(packed, rows, np.ones(E, np.int64)) % (hi - s.min_ways + 1)
    steps = np.arange(W)
    pos = randperm_prefix(n_cand, ways, word_at(packed, rows[:, None], 2 + steps[None, :]))
    real = steps[None, :] < ways[:, None]  # [E, W] labels that exist
    cls = np.where(real, np.take_along_axis(cand, np.maximum(pos, 0), 1), -1)
    n = np.where(real, t.size[np.maximum(cls, 0)], 0)  # [E, W] images per label
    big = np.iinfo(np.int64).max
    # queries per class
    if s.query is not None:
        q = np.full(E, int(s.query), dtype=np.int64)
    elif s.shot is not None:
        q = np.minimum(s.max_num_query, np.where(real, n, big).min(1) - s.shot)
    else:
        q = np.minimum(s.max_num_query, np.where(real, n // 2, big).min(1))
    # support sizes and shots
    if s.shot is not None:
        shots = np.where(real, int(s.shot), 0)
    else:
        beta = uniform64_at(packed, rows, np.full(E, 2 + W))
        remaining = np.where(real, n - q[:, None], 0)
        contrib = np.where(
            real, np.floor(beta[:, None] * np.minimum(s.max_support_size_contrib_per_class, remaining) + 1), 0
        )
        size = np.minimum(s.max_support_set_size, np.cumsum(contrib, 1)[:, -1]).astype(np.int64)
        u = uniform64_at(packed, rows[:, None], 2 + W + 2 + 2 * steps[None, :])
        logw = s.min_log_weight + (s.max_log_weight - s.min_log_weight) * u
        weight = np.where(real, n * np.exp(logw), 0.0)
        share = weight / np.cumsum(weight, 1)[:, -1:]
        want = np.floor(share * (size - ways)[:, None]).astype(np.int64) + 1
        shots = np.where(real, np.minimum(want, remaining), 0)
    queries = np.where(real, q[:, None], 0)
    # images: per label (row r = e * W + k), the first take[r] of a shuffle of its class's images
    take = (shots + queries).reshape(-1)
    r = np.repeat(np.arange(E * W), take)
    k = np.arange(len(r)) - np.repeat(np.cumsum(take) - take, take)
    first = (header + np.cumsum(shots + queries, 1) - shots - queries).reshape(-1)
    w = np.zeros((E * W, max(int(take.max()), 1)), dtype=np.int64)
    w[r, k] = word_at(packed, r // W, first[r] + k)
    size_r = n.reshape(-1)
    perm = randperm_prefix(np.maximum(size_r, 1), take, w)
    cls_r = np.maximum(cls, 0).reshape(-1)
    chosen = t.order[t.first[cls_r][r] + perm[r, k]]
    sup = k < shots.reshape(-1)[r]
    ep, lab = r // W, r % W
    support, support_labels = _pad_rows(ep[sup], lab[sup], chosen[sup], E)
    query, query_labels = _pad_rows(ep[~sup], lab[~sup], chosen[~sup], E)
    return Drawn(
        support,
        query,
        support_labels,
        query_labels,
        torch.from_numpy(cls.astype(np.int64)),
        torch.from_numpy(ways.astype(np.int64)),
    )


def _pad_rows(ep: np.ndarray, lab: np.ndarray, val: np.ndarray, E: int) -> tuple[Tensor, Tensor]:
    """Entries ``(episode, label, row)`` in episode order gathered into ``[E, longest]`` rows and
    labels, padded with -1."""
    count = np.bincount(ep, minlength=E)
    width = max(int(count.max()) if E else 0, 1)
    col = np.arange(len(ep)) - np.repeat(np.cumsum(count) - count, count)
    rows, labels = np.full((E, width), -1, np.int64), np.full((E, width), -1, np.int64)
    rows[ep, col], labels[ep, col] = val, lab
    return torch.from_numpy(rows), torch.from_numpy(labels)


__all__ = ["Drawn", "SplitTables", "check_words", "draw", "draw_meta_dataset", "imbalanced_counts", "md_layout"]
