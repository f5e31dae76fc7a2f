"""PT-MAP: power transform, then MAP estimation of class centres with Sinkhorn assignments.

Yuqing Hu, Vincent Gripon, Stéphane Pateux. "Leveraging the Feature Distribution in
Transfer-based Few-Shot Learning", ICANN 2021, arXiv:2006.03806.

Features go through a power transform ``x -> (x + 1e-6)^beta``, unit normalisation, and centring
(support and query sets each on their own mean, then unit normalisation again). Class centres start
at the support means. Each of ``steps`` iterations computes the query soft assignments as the
Sinkhorn optimal-transport plan of the cost ``||z_q - mu_k||^2`` at regularisation ``lam``, with
every query carrying mass 1 and every class receiving ``Nq / way`` (the method assumes balanced
queries), sets support assignments to their one-hot labels, and moves each centre a fraction
``alpha`` towards the assignment-weighted mean. Queries take the argmax of the final plan.
Transductive.

Differences from the authors' code: the QR dimension reduction is skipped (it is an isometry of
the samples' span and leaves every distance unchanged); a negative coordinate is transformed as
``sign(x) (|x| + 1e-6)^beta`` (the authors' features are post-ReLU, where this is their formula;
theirs would give NaN); Sinkhorn stops per episode (a mask) instead of when the whole batch has
converged; a zero vector after centring stays zero instead of becoming NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers._span import RowSpan, span_flops, use_gram
from poodle.solvers._transductive import (
    CHECK_EVERY_SWEEPS,
    TINY,
    log_normalise,
    pow_anywhere,
    row_sqnorm,
    should_stop,
    syncs_freely,
)
from poodle.solvers.base import EpisodeBatch, SolverOutput, one_hot, register


@dataclass
class PTMapConfig:
    MEANINGS: ClassVar[dict[str, str]] = {  # see base.MEANINGS
        "alpha": "prototype update rate",
        "beta": "power-transform exponent",
    }
    # Hu et al.'s released test script: beta 0.5, lam 10, alpha 0.2, 20 epochs; Sinkhorn eps 1e-6,
    # at most 1000 iterations.
    beta: float = option(0.5, min=0, min_open=True)
    lam: float = option(10.0, min=0, min_open=True)
    alpha: float = option(0.2, min=0, max=1)
    steps: int = option(20, min=0)
    sinkhorn_tol: float = option(1e-6, min=0)
    sinkhorn_max_iter: int = option(1000, min=1)


def power_transform(x: Tensor, beta: float, out: Tensor | None = None) -> Tensor:
    """``sign(x) (|x| + 1e-6)^beta`` (= the paper's ``(x + 1e-6)^beta`` for ``x >= 0``); an exact
    zero (either sign) maps to ``1e-6^beta``. Written into ``out`` (same shape) when given."""
    t = torch.abs(x, out=out) if out is not None else x.abs()
    t.copy_(pow_anywhere(t.add_(1e-6), beta)).copysign_(x)
    return t.masked_fill_(x == 0, 1e-6**beta)


def unit_rows_(x: Tensor) -> Tensor:
    """``F.normalize(x, dim=-1)`` in place (the same values, no new ``[E, N, D]`` tensor)."""
    return x.div_(torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(1e-12))


def transformed_rows(parts: list[Tensor], beta: float) -> Tensor:
    """The power-transformed, unit rows of ``parts`` (each ``[E, n_i, D]``) stacked along the rows
    into one new ``[E, sum n_i, D]`` tensor: each pass over the features runs in place."""
    sizes = [t.shape[1] for t in parts]
    z = parts[0].new_empty(parts[0].shape[0], sum(sizes), parts[0].shape[2])
    for x, block in zip(parts, z.split(sizes, 1)):
        power_transform(x, beta, out=block)
    return unit_rows_(z)


def preprocess(z_s: Tensor, z_q: Tensor, beta: float) -> Tensor:
    """PT-MAP's feature pipeline for ``[E, Ns, D]`` support and ``[E, Nq, D]`` query sets (each
    centred on its own mean): ``[E, Ns + Nq, D]``, support first."""
    z = transformed_rows([z_s, z_q], beta)
    for block in z.split([z_s.shape[1], z_q.shape[1]], 1):
        block.sub_(block.mean(1, keepdim=True))
    return unit_rows_(z)


def sinkhorn(cost: Tensor, lam: float, col_mass: float, tol: float, max_iter: int) -> Tensor:
    """Entropic OT plan ``[E, K, N]`` for ``cost [E, K, N]`` (classes first; overwritten: the plan
    is written there): every sample (column) carries mass 1, every class (row) receives
    ``col_mass``. Each episode stops once its samples' masses moved by at most ``tol`` in one sweep."""
    p = cost.mul_(-lam).exp_()  # the caller's temporary
    p.div_(p.sum((1, 2), keepdim=True).clamp_min_(TINY))
    return balance(p, col_mass, tol, max_iter)


def balance(p: Tensor, col_mass: float, tol: float, max_iter: int, reset: Tensor | None = None) -> Tensor:
    """Sinkhorn sweeps on ``p [E, K, N]`` (overwritten and returned): samples (columns) normalised
    to 1, then classes (rows) to ``col_mass``, and, with ``reset [E, K, Ns]``, the first ``Ns``
    samples set back to it; per episode, until the sample masses before a sweep are within ``tol``
    of those before the previous one (at most ``max_iter`` sweeps).

    Classes are the middle axis so that both reductions run along vectors (a sum over an innermost
    axis of 5 is several times slower). Where a look at the masks costs nothing (the CPU,
    :func:`~poodle.solvers._transductive.syncs_freely`) the loop looks every sweep and drops finished
    episodes from the batch once a quarter of it has finished; elsewhere it masks them and looks
    every ``CHECK_EVERY_SWEEPS`` sweeps."""
    if syncs_freely(p):
        return _balance_dropping(p, col_mass, tol, max_iter, reset)
    active = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
    u = p.new_zeros(p.shape[0], p.shape[2])
    for it in range(max_iter):
        rows = p.sum(1)  # [E, N]
        active &= (u - rows).abs_().amax(1) > tol
        if should_stop(active, it, CHECK_EVERY_SWEEPS):  # stopped episodes are frozen below
            break
        u = _sweep(p, rows, u, active, col_mass, reset)
    return p


def _sweep(p: Tensor, rows: Tensor, u: Tensor, live: Tensor | None, col_mass: float, reset: Tensor | None) -> Tensor:
    """One sweep on ``p`` in place, on the episodes of ``live [E]`` (None: all); returns the new ``u``.
    A finished episode is divided and multiplied by exactly 1: its values do not change."""
    if live is None:
        p.div_(rows.clamp_min(TINY).unsqueeze(1))
        p.mul_(p.sum(2).clamp_min_(TINY).reciprocal_().mul_(col_mass).unsqueeze(2))
        if reset is not None:
            p[:, :, : reset.shape[2]] = reset
        return rows
    on = live.unsqueeze(1)
    p.div_(torch.where(on, rows.clamp_min(TINY), 1.0).unsqueeze(1))
    p.mul_(torch.where(on, p.sum(2).clamp_min_(TINY).reciprocal_().mul_(col_mass), 1.0).unsqueeze(2))
    if reset is not None:
        ns = reset.shape[2]
        p[:, :, :ns] = torch.where(on.unsqueeze(2), reset, p[:, :, :ns])
    return torch.where(on, rows, u)


def _balance_dropping(p: Tensor, col_mass: float, tol: float, max_iter: int, reset: Tensor | None) -> Tensor:
    """:func:`balance` on the CPU, where a look at the masks costs nothing: the batch shrinks to the
    episodes still running whenever a quarter of it has finished (each drop copies the rest)."""
    out = p
    idx: Tensor | None = None  # the rows of ``out`` that ``p`` holds, once it is a copy
    live: Tensor | None = None  # the episodes of ``p`` still running, when some are not
    u = p.new_zeros(p.shape[0], p.shape[2])
    for _ in range(max_iter):
        rows = p.sum(1)
        moved = (u - rows).abs_().amax(1) > tol
        if live is not None:
            moved &= live
        n = int(moved.count_nonzero())
        if n == 0:
            break
        if n == p.shape[0]:
            live = None
        elif 4 * n > 3 * p.shape[0]:
            live = moved
        else:
            keep = moved.nonzero().squeeze(1)
            if idx is None:  # ``p`` is ``out``: the finished episodes are already in place
                idx = keep
            else:
                gone = (~moved).nonzero().squeeze(1)
                out.index_copy_(0, idx.index_select(0, gone), p.index_select(0, gone))
                idx = idx.index_select(0, keep)
            p, rows, u, live = p.index_select(0, keep), rows.index_select(0, keep), u.index_select(0, keep), None
            if reset is not None:
                reset = reset.index_select(0, keep)
        u = _sweep(p, rows, u, live, col_mass, reset)
    if idx is not None:
        out.index_copy_(0, idx, p)
    return out


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: PTMapConfig) -> float:
    gram = use_gram(Ns, Nq, D, way, cfg.steps + 1, cfg.steps)
    return span_flops(Ns, Nq, D, way, cfg.steps + 1, cfg.steps, gram)


@register(
    "pt-map",
    PTMapConfig,
    transductive="always",
    flops=_flops,
    summary="PT-MAP (Hu et al. 2021): power transform + Sinkhorn MAP centre estimation",
    floor=dict(sweep="balance", loops=("poodle.solvers.pt_map:balance",)),
)
def pt_map(batch: EpisodeBatch, cfg: PTMapConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]`` (log of the final plan's rows, normalised); state
    ``prototypes [E, way, D]`` (in the transformed space) and ``assignments [E, Nq, way]``."""
    z = preprocess(batch.support, batch.query, cfg.beta)
    way = batch.way
    col = batch.query.shape[1] / way
    y_t = one_hot(batch.support_labels, way, z.dtype).transpose(1, 2)  # [E, K, Ns]
    span = RowSpan(z, batch.support.shape[1], way, cfg.steps + 1, cfg.steps)
    support = span.support_sum(y_t)
    counts = y_t.sum(2, keepdim=True)  # [E, K, 1], >= 1 (every class has a support point)
    mu = support / counts
    q2 = row_sqnorm(span.z_q).transpose(1, 2)  # [E, 1, Nq]

    def plan_of(mu: Tensor) -> Tensor:  # [E, K, Nq]
        dots, sq = span.scores(mu)
        cost = dots.mul(-2.0).add_(q2).add_(sq.unsqueeze(2)).clamp_min_(0.0)
        return sinkhorn(cost, cfg.lam, col, cfg.sinkhorn_tol, cfg.sinkhorn_max_iter)

    for _ in range(cfg.steps):
        plan = plan_of(mu)
        est = span.mean(y_t, plan, plan.sum(2, keepdim=True).add_(counts), support=support)
        mu = mu + cfg.alpha * (est - mu)
    plan = plan_of(mu).transpose(1, 2).contiguous()
    return SolverOutput(log_normalise(plan), {"prototypes": span.explicit(mu), "assignments": plan})
