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
from poodle.solvers._transductive import (
    CHECK_EVERY_SWEEPS,
    TINY,
    dist_flops,
    log_normalise,
    row_sqnorm,
    should_stop,
    sqdist,
)
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, one_hot, register


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
    """``sign(x) (|x| + 1e-6)^beta`` (= the paper's ``(x + 1e-6)^beta`` for ``x >= 0``)."""
    return torch.sign(x) * (x.abs() + 1e-6) ** beta + (x == 0).to(x.dtype) * (1e-6**beta)


def preprocess(z_s: Tensor, z_q: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """PT-MAP's feature pipeline for ``[E, N, D]`` support and query sets."""
    z_s = F.normalize(power_transform(z_s, beta), dim=-1)
    z_q = F.normalize(power_transform(z_q, beta), dim=-1)
    z_s = F.normalize(z_s - z_s.mean(1, keepdim=True), dim=-1)
    z_q = F.normalize(z_q - z_q.mean(1, keepdim=True), dim=-1)
    return z_s, z_q


def sinkhorn(cost: Tensor, lam: float, col_mass: float, tol: float, max_iter: int) -> Tensor:
    """Entropic OT plan ``[E, N, K]`` for ``cost [E, N, K]``: rows sum to 1, columns to
    ``col_mass``. Each episode stops once its row sums moved by at most ``tol`` in one sweep."""
    p = torch.exp(-lam * cost)
    p = p / p.sum((1, 2), keepdim=True).clamp_min(TINY)
    E = p.shape[0]
    active = torch.ones(E, dtype=torch.bool, device=p.device)
    u = torch.zeros(p.shape[:2], dtype=p.dtype, device=p.device)
    for it in range(max_iter):
        rows = p.sum(2)
        moved = (u - rows).abs().amax(1) > tol
        active = active & moved
        if should_stop(active, it, CHECK_EVERY_SWEEPS):  # stopped episodes are frozen below
            break
        q = p / rows.clamp_min(TINY).unsqueeze(2)
        q = q * (col_mass / q.sum(1).clamp_min(TINY)).unsqueeze(1)
        keep = ~active
        p = torch.where(keep[:, None, None], p, q)
        u = torch.where(keep[:, None], u, rows)
    return p


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: PTMapConfig) -> float:
    return (cfg.steps + 1) * (dist_flops(Nq, way, D) + dist_flops(Ns + Nq, way, D))


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
    y_s = one_hot(batch.support_labels, way, z_s.dtype)
    mu = class_means(z_s, batch.support_labels, way)
    q2 = row_sqnorm(z_q)
    for _ in range(cfg.steps):
        plan = sinkhorn(sqdist(z_q, mu, q2), cfg.lam, col, cfg.sinkhorn_tol, cfg.sinkhorn_max_iter)
        num = torch.bmm(y_s.transpose(1, 2), z_s) + torch.bmm(plan.transpose(1, 2), z_q)
        est = num / (y_s.sum(1) + plan.sum(1)).unsqueeze(-1)  # >= shots > 0
        mu = mu + cfg.alpha * (est - mu)
    plan = sinkhorn(sqdist(z_q, mu, q2), cfg.lam, col, cfg.sinkhorn_tol, cfg.sinkhorn_max_iter)
    return SolverOutput(log_normalise(plan), {"prototypes": mu, "assignments": plan})
