"""The fixed-protocol episodes as torch's own samplers draw them, one episode at a time: the
reference that poodle.sampler's vectorised draws must equal bit for bit (how poodle drew every
episode before the one sampler; written plainly: ``randperm``, ``_standard_gamma``, a loop)."""

from __future__ import annotations

import torch
from torch import Tensor

from poodle.episodes import EpisodeSpec
from poodle.utils import generator


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


def reference_episodes(labels: Tensor, spec: EpisodeSpec, start: int, n: int) -> dict[str, Tensor]:
    """Episodes ``start .. start + n - 1`` drawn one by one: ``support``, ``query``,
    ``support_labels``, ``query_labels``, ``class_ids``, ``index``."""
    counts_all = torch.bincount(labels)
    eligible = (counts_all > 0).nonzero().flatten()
    order = torch.argsort(labels, stable=True)
    members = list(torch.split(order, counts_all.tolist()))
    drawn = [
        _draw_episode(generator(spec.seed, i), spec, eligible, members, counts_all) for i in range(start, start + n)
    ]
    names = ("support", "query", "support_labels", "query_labels", "class_ids")
    out = {k: torch.stack([d[j] for d in drawn]) for j, k in enumerate(names)}
    out["index"] = torch.arange(start, start + n)
    return out
