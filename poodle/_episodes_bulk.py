"""Episodes drawn in bulk: the same episodes as :func:`poodle.episodes._draw_episode`, thousands at once.

Episode ``i`` is drawn by its own generator ``generator(seed, i)`` in this order (see
:mod:`poodle.episodes`): ``randperm`` of the split's ``C`` classes (``C - 1`` words), with
``query_classes`` a ``randperm(way)`` (``way - 1`` words), with ``imbalance`` the Gamma draws of the
Dirichlet shares (a variable number of words), then per class ``k`` in label order a ``randperm`` of
its ``n_k`` images (``n_k - 1`` words). Here every episode's words come from one call to torch
(:func:`poodle._mt19937.packed_words`) and each of those steps runs once for all the episodes of a
block, in numpy (:mod:`poodle._mt19937`), with the arithmetic and tie rules of the per-episode code.

Two things make a block's episodes need more words than guessed: classes larger than the smallest
(the episode's words are then drawn again, to their exact count) and a Gamma draw that needs more
than its budget of words (astronomically rare; that episode is drawn by the per-episode path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import Tensor

from poodle._mt19937 import packed_words, randperm_prefix, standard_gamma, word_at
from poodle.utils import derive_seeds

if TYPE_CHECKING:
    from poodle.episodes import EpisodeSpec

_BLOCK_WORDS = 1 << 22  # packed words held per block (32 MiB)
_GAMMA_WORDS = 16  # words allowed per Gamma draw (about 5 on average), plus _GAMMA_SLACK per episode
_GAMMA_SLACK = 64


@dataclass(frozen=True)
class SplitTables:
    """A split's rows by class: ``order`` (row indices sorted by class, stable), ``first[c]`` (where
    class ``c`` starts in ``order``), ``size[c]`` (its images) and ``eligible`` (classes with images)."""

    order: np.ndarray
    first: np.ndarray
    size: np.ndarray
    eligible: np.ndarray


@dataclass(frozen=True)
class Drawn:
    """A block's episodes: int64 tensors ``support [E, way*shot]``, ``query [E, Nq]``,
    ``query_labels [E, Nq]``, ``class_ids [E, way]``."""

    support: Tensor
    query: Tensor
    query_labels: Tensor
    class_ids: Tensor


def imbalanced_counts_batch(p: Tensor, total: int, capacity: Tensor) -> Tensor:
    """:func:`poodle.episodes.imbalanced_counts` for every row of ``p [E, way]`` (float64) and
    ``capacity [E, way]`` at once: int64 ``[E, way]``, row ``e`` equal to
    ``imbalanced_counts(p[e], total, capacity[e])`` (same operations, same order, same ties)."""
    E, way = p.shape
    counts = torch.zeros(E, way, dtype=torch.int64)
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
    # p = gam / gam.sum(), as query_counts divides (torch's own row sums)
    g = torch.from_numpy(gam)
    s = g.sum(1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(torch.zeros(len(g), dtype=torch.int64), g.shape[1]).double()
    return torch.where(s > 0, g / s, one_hot)


class _Words:
    """Words of a block's episodes: from the block's packed words, or, for the episodes that need
    more (``need > have``, classes larger than the smallest), from their own longer draw."""

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


class BulkDraw:
    """Draws blocks of episodes of ``spec`` from ``tables``; ``slow(i)`` draws episode ``i`` by the
    per-episode path (used for the rare episode whose Gamma draws outrun their words)."""

    def __init__(self, spec: EpisodeSpec, tables: SplitTables, slow: Callable[[int], tuple[Tensor, ...]]) -> None:
        self.spec = spec
        self.t = tables
        self.slow = slow
        s = self.spec
        way, qc = s.way, s.query_classes
        self.C = len(tables.eligible)
        self.prefix = self.C - 1 + (way - 1 if qc is not None else 0)
        self.n_gamma = 0 if s.imbalance is None else (way if qc is None else qc)
        self.gamma_words = self.n_gamma * _GAMMA_WORDS + (_GAMMA_SLACK if self.n_gamma else 0)
        n_min = int(tables.size[tables.eligible].min())
        self.guess = self.prefix + self.gamma_words + way * (n_min - 1)  # enough when classes are equal
        self.block = max(1, min(1024, _BLOCK_WORDS // max(self.guess, 1)))

    def __call__(self, start: int, n: int) -> Drawn:
        parts = [self._block(a, min(self.block, start + n - a)) for a in range(start, start + n, self.block)]
        return Drawn(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("support", "query", "query_labels", "class_ids"))
        )

    def _block(self, start: int, E: int) -> Drawn:
        s, t = self.spec, self.t
        way, shot = s.way, s.shot
        seeds = derive_seeds(s.seed, range(start, start + E))
        packed = packed_words(seeds, self.guess)
        rows = np.arange(E)
        # 1. way classes of the C
        steps = np.minimum(np.arange(way), max(self.C - 2, 0))  # words past the permutation's are ignored
        cls_pos = randperm_prefix(np.full(E, self.C), np.full(E, way), word_at(packed, rows[:, None], steps[None, :]))
        cls = t.eligible[cls_pos]  # [E, way]
        # 2. queries per class
        counts, ptr, ok = self._query_counts(packed, rows, cls)
        # 3. per class (row r = e * way + k) a randperm of its images: the first take[r] of them
        steps = t.size[cls] - 1  # [E, way] words of each class's randperm
        first = (ptr[:, None] + np.cumsum(steps, 1) - steps).reshape(-1)  # the class's first word
        words = _Words(packed, seeds, ptr + steps.sum(1), self.guess)
        size, take = steps.reshape(-1) + 1, (shot + counts).reshape(-1)
        r = np.repeat(np.arange(E * way), take)  # one entry per image drawn, class-major
        k = np.arange(len(r)) - np.repeat(np.cumsum(take) - take, take)  # its place in the class's randperm
        w = np.zeros((E * way, int(take.max())), dtype=np.int64)
        draws = k < size[r] - 1  # the last place draws no word
        w[r[draws], k[draws]] = words.at(r[draws] // way, first[r[draws]] + k[draws])
        perm = randperm_prefix(size, take, w)
        chosen = t.order[t.first[cls].reshape(-1)[r] + perm[r, k]]  # rows of the split
        sup = k < shot
        Nq = s.n_query
        drawn = Drawn(
            torch.from_numpy(chosen[sup].reshape(E, way * shot)),
            torch.from_numpy(chosen[~sup].reshape(E, Nq)),
            torch.from_numpy((r[~sup] % way).reshape(E, Nq)),
            torch.from_numpy(cls.astype(np.int64)),
        )
        for e in np.flatnonzero(~ok):  # Gamma draws ran past their words: the per-episode path
            sup, qry, qlab, c = self.slow(start + int(e))
            drawn.support[e], drawn.query[e], drawn.query_labels[e], drawn.class_ids[e] = sup, qry, qlab, c
        return drawn

    def _query_counts(
        self, packed: np.ndarray, rows: np.ndarray, cls: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries per label ``[E, way]``, the next word of each episode ``[E]`` and whether its
        Gamma draws fitted their words ``[E]`` (as :func:`poodle.episodes.query_counts`)."""
        s, t = self.spec, self.t
        E, way, qc, q = len(rows), s.way, s.query_classes, s.query
        ptr = np.full(E, self.prefix, dtype=np.int64)
        ok = np.ones(E, dtype=bool)
        if qc is not None:
            steps = self.C - 1 + np.minimum(np.arange(qc), way - 2)
            chosen = randperm_prefix(np.full(E, way), np.full(E, qc), word_at(packed, rows[:, None], steps[None, :]))
        if s.imbalance is None:
            if qc is None:
                return np.full((E, way), q, dtype=np.int64), ptr, ok
            counts = np.zeros((E, way), dtype=np.int64)
            counts[rows[:, None], chosen] = q
            return counts, ptr, ok
        gam, ptr, ok = standard_gamma(packed, rows, ptr, ptr + self.gamma_words, float(s.imbalance), self.n_gamma)
        gam[~ok] = 1.0  # meaningless rows (redrawn one by one): any valid shares
        share = _shares(gam)
        capacity = torch.from_numpy(t.size[cls] - s.shot)
        if qc is None:
            return imbalanced_counts_batch(share, s.n_query, capacity).numpy(), ptr, ok
        r, c = torch.from_numpy(rows[:, None]), torch.from_numpy(chosen)
        p = torch.zeros(E, way, dtype=torch.float64)
        p[r, c] = share
        cap = torch.zeros_like(capacity)
        cap[r, c] = capacity[r, c]  # classes without queries have no capacity
        return imbalanced_counts_batch(p, s.n_query, cap).numpy(), ptr, ok
