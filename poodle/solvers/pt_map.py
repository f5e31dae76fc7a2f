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
import torch.nn.functional as F
from torch import Tensor

from poodle.options import option
from poodle.solvers._span import RowSpan, span_flops, use_gram
from poodle.solvers._transductive import TINY, log_normalise, row_sqnorm
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


def power_transform(x: Tensor, beta: float) -> Tensor:
    """``sign(x) (|x| + 1e-6)^beta`` (= the paper's ``(x + 1e-6)^beta`` for ``x >= 0``); an exact
    zero (either sign) maps to ``1e-6^beta``. Four passes over ``x``, in place after the first."""
    t = x.abs().add_(1e-6).pow_(beta).copysign_(x)
    return t.masked_fill_(x == 0, 1e-6**beta)


def preprocess(z_s: Tensor, z_q: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """PT-MAP's feature pipeline for ``[E, N, D]`` support and query sets."""
    z_s = F.normalize(power_transform(z_s, beta), dim=-1)
    z_q = F.normalize(power_transform(z_q, beta), dim=-1)
    z_s = F.normalize(z_s - z_s.mean(1, keepdim=True), dim=-1)
    z_q = F.normalize(z_q - z_q.mean(1, keepdim=True), dim=-1)
    return z_s, z_q


# Off the CPU, how many sweeps run between two looks at the convergence masks (each look is a
# host sync); the masks freeze a converged episode, so when the loop notices changes no result.
CHECK_EVERY = 8


def sinkhorn(cost: Tensor, lam: float, col_mass: float, tol: float, max_iter: int) -> Tensor:
    """Entropic OT plan ``[E, K, N]`` for ``cost [E, K, N]`` (classes first): every sample (column)
    carries mass 1, every class (row) receives ``col_mass``. Each episode stops once its samples'
    masses moved by at most ``tol`` in one sweep."""
    p = torch.exp(cost.mul(-lam))
    p.div_(p.sum((1, 2), keepdim=True).clamp_min_(TINY))
    return balance(p, col_mass, tol, max_iter)


def balance(p: Tensor, col_mass: float, tol: float, max_iter: int, reset: Tensor | None = None) -> Tensor:
    """Sinkhorn sweeps on ``p [E, K, N]`` (overwritten and returned): samples (columns) normalised
    to 1, then classes (rows) to ``col_mass``, and, with ``reset [E, K, Ns]``, the first ``Ns``
    samples set back to it; per episode, until the sample masses before a sweep are within ``tol``
    of those before the previous one (at most ``max_iter`` sweeps).

    Classes are the middle axis so that both reductions run along vectors (a sum over an innermost
    axis of 5 is several times slower). On the CPU the loop looks at the masks every sweep and drops
    finished episodes from the batch; elsewhere it masks them and looks every ``CHECK_EVERY`` sweeps.
    """
    if p.device.type == "cpu":
        return _balance_compacting(p, col_mass, tol, max_iter, reset)
    active = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
    u = p.new_zeros(p.shape[0], p.shape[2])
    for it in range(max_iter):
        rows = p.sum(1)  # [E, N]
        active &= (u - rows).abs_().amax(1) > tol
        if it % CHECK_EVERY == CHECK_EVERY - 1 and not bool(active.any()):
            break
        live = active.unsqueeze(1)
        u = torch.where(live, rows, u)
        # a finished episode is divided and multiplied by exactly 1: its values do not change
        p.div_(torch.where(live, rows.clamp_min_(TINY), 1.0).unsqueeze(1))
        p.mul_(torch.where(live, p.sum(2).clamp_min_(TINY).reciprocal_().mul_(col_mass), 1.0).unsqueeze(2))
        if reset is not None:
            p[:, :, : reset.shape[2]] = torch.where(active[:, None, None], reset, p[:, :, : reset.shape[2]])
    return p


def _sweep(p: Tensor, rows: Tensor, col_mass: float, reset: Tensor | None) -> None:
    p.div_(rows.clamp_min(TINY).unsqueeze(1))
    p.mul_(p.sum(2).clamp_min_(TINY).reciprocal_().mul_(col_mass).unsqueeze(2))
    if reset is not None:
        p[:, :, : reset.shape[2]] = reset


def _balance_compacting(p: Tensor, col_mass: float, tol: float, max_iter: int, reset: Tensor | None) -> Tensor:
    """:func:`balance` on the CPU: the batch shrinks to the episodes still running."""
    out = p
    idx = torch.arange(p.shape[0], device=p.device)
    u = p.new_zeros(p.shape[0], p.shape[2])
    for _ in range(max_iter):
        rows = p.sum(1)
        moved = (u - rows).abs_().amax(1) > tol
        n = int(moved.sum())
        if n < p.shape[0]:
            done = ~moved
            out[idx[done]] = p[done]
            if n == 0:
                return out
            p, rows, idx = p[moved], rows[moved], idx[moved]
            if reset is not None:
                reset = reset[moved]
        u = rows
        _sweep(p, rows, col_mass, reset)
    out[idx] = p
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
)
def pt_map(batch: EpisodeBatch, cfg: PTMapConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]`` (log of the final plan's rows, normalised); state
    ``prototypes [E, way, D]`` (in the transformed space) and ``assignments [E, Nq, way]``."""
    z_s, z_q = preprocess(batch.support, batch.query, cfg.beta)
    way = batch.way
    col = z_q.shape[1] / way
    y_t = one_hot(batch.support_labels, way, z_s.dtype).transpose(1, 2)  # [E, K, Ns]
    span = RowSpan(torch.cat([z_s, z_q], 1), z_s.shape[1], way, cfg.steps + 1, cfg.steps)
    support = span.support_sum(y_t)
    counts = y_t.sum(2, keepdim=True)  # [E, K, 1], >= 1 (every class has a support point)
    mu = support / counts
    q2 = row_sqnorm(z_q).transpose(1, 2)  # [E, 1, Nq]

    def plan_of(mu: Tensor) -> Tensor:  # [E, K, Nq]
        dots, sq = span.scores(mu)
        cost = dots.mul(-2.0).add_(q2).add_(sq.unsqueeze(2)).clamp_min_(0.0)
        return sinkhorn(cost, cfg.lam, col, cfg.sinkhorn_tol, cfg.sinkhorn_max_iter)

    for _ in range(cfg.steps):
        plan = plan_of(mu)
        est = (support + span.query_sum(plan)) / (counts + plan.sum(2, keepdim=True))
        mu = mu + cfg.alpha * (est - mu)
    plan = plan_of(mu).transpose(1, 2).contiguous()
    return SolverOutput(log_normalise(plan), {"prototypes": span.explicit(mu), "assignments": plan})
