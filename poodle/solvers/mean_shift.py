"""Mean-shift propagation (MSP) in a task-adaptive sub-space.

Moshe Lichtenstein, Prasanna Sattigeri, Rogerio Feris, Raja Giryes, Leonid Karlinsky.
"TAFSSL: Task-Adaptive Feature Sub-Space Learning for few-shot classification", ECCV 2020,
arXiv:2003.06670 (Sec. 3.3, "MSP").

Centre the support and query sets on their own means and project each episode onto its top
principal directions (TAFSSL's sub-space; PCA here). Score queries by
``p(k|q) = softmax_k(-sigma ||z_q - mu_k||^2)``. Then, ``steps`` times: for each class, rank the
queries by ``p(k|q)``; take the largest ``d`` such that the ``d``-th best query of *every* class
has ``p > threshold``; each class's prototype becomes the mean of its support points and its top
``d`` queries; re-score. ``d`` is per episode (a mask, not a loop). Transductive.

Differences from the POODLE authors' "Mean-shift" (their ``laplacian.py``, which cannot run as
shipped, docs/reference.md §2): theirs was BD-CSPN's prototype rectification (see ``bd-cspn``);
this file is TAFSSL's MSP with PCA in place of ICA (scikit-learn's FastICA is not a dependency) and
one support mean for centring (TAFSSL subtracts, per shot index, the mean over classes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers._transductive import (
    centre_and_project,
    class_softmax,
    dist_flops,
    row_sqnorm,
    row_weight,
    sqdist,
    support_share,
)
from poodle.solvers.base import EpisodeBatch, SolverOutput, mask_classes, one_hot, register


@dataclass(frozen=True)
class MeanShiftConfig:
    # TAFSSL src/utils/misc.py: n_iter_msp 4, sigma 1, most_confident thresh 0.3; "& msp" runs
    # use reduced_dim 10 (exp_table / exp_unbalanced).
    steps: int = option(4, min=0)
    sigma: float = option(1.0, min=0, min_open=True)
    threshold: float = option(0.3, min=0, max=1)
    reduced_dim: int = option(10, min=0)  # 0: no projection
    centre: bool = True


def confident_top_d(
    p_q: Tensor, threshold: float, query_mask: Tensor | None = None, class_mask: Tensor | None = None
) -> Tensor:
    """TAFSSL's ``most_confident`` for a batch: ``p_q [E, Nq, K]`` -> selection mask ``[E, Nq, K]``.

    ``mask[e, q, k]`` is 1 when query ``q`` is among the ``d_e`` most probable queries of class
    ``k``, with ``d_e`` the number of ranks at which every class's query has ``p > threshold``.
    A ragged chunk's padded queries (``query_mask [E, Nq]`` False) rank last and are never
    selected; its padded classes (``class_mask [E, K]`` False) bound no rank and select nothing.
    """
    E, Nq, K = p_q.shape
    if query_mask is not None:
        p_q = p_q.masked_fill(~query_mask.unsqueeze(-1), -1.0)
    srt, order = p_q.sort(dim=1, descending=True, stable=True)  # [E, Nq, K]
    if class_mask is not None:
        srt = srt.masked_fill(~class_mask.unsqueeze(1), float("inf"))
    d = (srt.min(dim=2).values > threshold).sum(1)  # [E]
    within = (torch.arange(Nq, device=p_q.device).view(1, Nq, 1) < d.view(E, 1, 1)).to(p_q.dtype)
    if class_mask is not None:
        within = within * class_mask.unsqueeze(1).to(p_q.dtype)
    return torch.zeros_like(p_q).scatter(1, order, within.expand(E, Nq, K))


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: MeanShiftConfig) -> float:
    n = Ns + Nq
    r = min(cfg.reduced_dim, n, D) if cfg.reduced_dim > 0 else D
    pca = 2.0 * n * n * D + 9.0 * n**3 if cfg.reduced_dim > 0 else 0.0  # Gram + eigh
    return pca + (cfg.steps + 1) * 2 * dist_flops(Nq, way, r)


@register(
    "mean-shift",
    MeanShiftConfig,
    transductive="always",
    flops=_flops,
    summary="TAFSSL mean-shift propagation in a task-adaptive PCA sub-space (Lichtenstein et al. 2020)",
    floor=dict(
        gram=lambda Ns, Nq, M, D, way, cfg: (Ns + Nq, D) if cfg.reduced_dim > 0 else None,
        eigh=lambda Ns, Nq, M, D, way, cfg: Ns + Nq if cfg.reduced_dim > 0 else 0,
        product=lambda Ns, Nq, M, D, way, cfg: (Nq, min(cfg.reduced_dim, Ns + Nq, D) or D, way),
    ),
)
def mean_shift(batch: EpisodeBatch, cfg: MeanShiftConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes [E, way, r]`` (projected space) and
    ``selected [E]`` (queries added per class at the last step)."""
    z_s, z_q = batch.support, batch.query
    if cfg.centre or cfg.reduced_dim > 0:
        # a ragged chunk's padded rows take no part in the means or the PCA (they come out zero)
        s_w, q_w = row_weight(batch.support_mask, z_s.dtype), batch.query_weight()
        z_s, z_q = centre_and_project(z_s, z_q, cfg.reduced_dim, s_w, q_w)
    labelled = support_share(one_hot(batch.support_labels, batch.way, z_s.dtype), z_s)  # fixed: made once
    mu = labelled[0] / labelled[1].clamp_min(1.0).unsqueeze(-1)  # the support class means
    q2 = row_sqnorm(z_q)
    log_p = class_softmax(mask_classes(-cfg.sigma * sqdist(z_q, mu, q2), batch), log=True)
    selected = torch.zeros(z_s.shape[0], dtype=torch.long, device=z_s.device)
    for _ in range(cfg.steps):
        sel = confident_top_d(log_p.exp(), cfg.threshold, batch.query_mask, batch.class_mask)  # [E, Nq, K]
        num = labelled[0] + torch.bmm(sel.transpose(1, 2), z_q)
        den = (labelled[1] + sel.sum(1)).unsqueeze(-1)  # >= shots >= 1
        mu = num / den.clamp_min(1.0)
        log_p = class_softmax(mask_classes(-cfg.sigma * sqdist(z_q, mu, q2), batch), log=True)
        selected = sel.sum(1)[:, 0].long()
    return SolverOutput(log_p, {"prototypes": mu, "selected": selected})
