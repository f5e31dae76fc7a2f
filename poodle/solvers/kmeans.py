"""Hard k-means over support and query, and TAFSSL's Bayesian k-means.

``kmeans``: seeded (constrained) k-means, the clustering baseline of
Moshe Lichtenstein, Prasanna Sattigeri, Rogerio Feris, Raja Giryes, Leonid Karlinsky.
"TAFSSL: Task-Adaptive Feature Sub-Space Learning for few-shot classification", ECCV 2020,
arXiv:2003.06670, run as the POODLE authors did: centres start at the support class means; each
iteration assigns every query to its nearest centre and sets each centre to the mean of its
support points and assigned queries; an episode stops when no assignment changes (per-episode
masks: converged episodes are frozen while the others go on). Transductive.

``bayes-kmeans``: TAFSSL's "BKM" (same paper, Sec. 3.3): centre the support and query sets,
project each episode onto its top principal directions (TAFSSL's task-adaptive sub-space; PCA
here, ICA is not available without scikit-learn), run k-means with ``way`` clusters over all
samples *ignoring* labels, then score a query by Bayes' rule over clusters:
``p(y|q) = sum_c p(c|q) p(y|q,c)``, ``p(c|q)`` the query's (hard) cluster,
``p(y|q,c) ∝ sum_{s in y} exp(-sigma||z_s - z_q||^2) p(c|s)``, ``p(c|s) = softmax_c(-sigma||z_s -
mu_c||^2)``.

Differences from the POODLE authors' ``kmeans``/``bayes_kmeans`` (docs/reference.md §2):
their k-means re-assigned the support points too, ignoring their labels (``fix_support=False``
restores that for ``kmeans``); an empty cluster made their centre NaN (here it keeps its previous
centre); their one-hot was sized by the labels present in the whole batch (here by ``way``); their
early stop waited until *every* episode had converged and printed it. Their Bayes step used soft
query assignments with scale 10 in the full feature space; ours follows TAFSSL (hard query cluster,
sigma 1, centred and projected features, unsupervised k-means with centres seeded at the support
means instead of k-means++ so that it is deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from poodle.options import option
from poodle.solvers._transductive import (
    centre_and_project,
    dist_flops,
    mask_padded_classes,
    row_sqnorm,
    row_weight,
    should_stop,
    softmax_logits,
    sqdist,
    support_share,
    weighted_means,
)
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, one_hot, register


def kmeans_loop(
    z_s: Tensor,
    labels_s: Tensor,
    z_q: Tensor,
    centres: Tensor,
    max_iter: int,
    fix_support: bool,
    pad: EpisodeBatch | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Batched hard k-means with per-episode convergence.

    ``z_s [E, Ns, D]``, ``labels_s [E, Ns]``, ``z_q [E, Nq, D]``, ``centres [E, K, D]`` (start).
    Returns ``(centres [E, K, D], query_assign [E, Nq], support_assign [E, Ns], iterations [E])``.
    Ties go to the lowest class index. A cluster left without members keeps its centre. ``pad``: the
    ragged batch whose masks apply: no row joins a padded cluster, and a padded row joins none (its
    assignment is -1), so it moves no centre and never keeps an episode iterating.
    """
    cm = s_mask = q_mask = None
    if pad is not None and pad.ragged:
        cm, s_mask, q_mask = pad.class_mask, pad.support_mask, pad.query_mask
    E, K = centres.shape[0], centres.shape[1]
    active = torch.ones(E, dtype=torch.bool, device=z_s.device)
    prev_q = torch.full(z_q.shape[:2], -1, dtype=torch.long, device=z_s.device)
    prev_s = labels_s.clone() if fix_support else torch.full_like(labels_s, -1)
    iters = torch.zeros(E, dtype=torch.long, device=z_s.device)
    q2 = row_sqnorm(z_q)
    s2 = None if fix_support else row_sqnorm(z_s)
    # fixed support labels: their share of every update is the same, made once
    fixed = support_share(one_hot(labels_s, K, z_s.dtype), z_s) if fix_support else None
    for it in range(max_iter):
        lab_q = mask_padded_classes(sqdist(z_q, centres, q2), cm, float("inf")).argmin(-1)
        if q_mask is not None:
            lab_q = lab_q.masked_fill(~q_mask, -1)
        unchanged = (lab_q == prev_q).all(1)
        if not fix_support:
            lab_s = mask_padded_classes(sqdist(z_s, centres, s2), cm, float("inf")).argmin(-1)
            if s_mask is not None:
                lab_s = lab_s.masked_fill(~s_mask, -1)
            unchanged = unchanged & (lab_s == prev_s).all(1)
        active = active & ~unchanged
        if should_stop(active, it):  # a converged episode is frozen below, so looking late changes nothing
            break
        share = fixed if fixed is not None else support_share(one_hot(lab_s, K, z_s.dtype), z_s)
        new = weighted_means(share, one_hot(lab_q, K, z_s.dtype), z_q, centres)
        keep = ~active
        centres = torch.where(keep[:, None, None], centres, new)
        prev_q = torch.where(keep[:, None], prev_q, lab_q)
        if not fix_support:
            prev_s = torch.where(keep[:, None], prev_s, lab_s)
        iters = iters + active.long()
    return centres, prev_q, prev_s, iters


@dataclass(frozen=True)
class KMeansConfig:
    max_iter: int = option(250, min=0)  # the POODLE authors' cap (number_fc_update)
    fix_support: bool = True  # support points keep their labels (seeded/constrained k-means)
    scale: float = option(10.0, min=0, min_open=True)  # only shapes the returned probabilities: -(scale/2)||z - mu||^2


def _flops_km(Ns: int, Nq: int, M: int, D: int, way: int, cfg: KMeansConfig) -> float:
    # An episode that moves its centres ``max_iter`` times: max_iter + 1 assignment passes (the last
    # finds nothing changed) and max_iter mean updates, besides the support means and the final
    # logits. Linear in max_iter: benchmarks count it at the measured mean iterations (a handful).
    assign = dist_flops(Nq if cfg.fix_support else Ns + Nq, way, D)
    return (
        dist_flops(Ns, way, D)
        + (cfg.max_iter + 1) * assign
        + cfg.max_iter * dist_flops(Ns + Nq, way, D)
        + dist_flops(Nq, way, D)
    )


@register(
    "kmeans",
    KMeansConfig,
    transductive="always",
    flops=_flops_km,
    summary="Seeded hard k-means over support + query (TAFSSL baseline / POODLE authors)",
    floor=dict(loops=("poodle.solvers.kmeans:kmeans_loop",), steps_field="max_iter"),
)
def kmeans(batch: EpisodeBatch, cfg: KMeansConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes`` (final centres) and ``iterations [E]``."""
    z_s, z_q = batch.support, batch.query
    c0 = class_means(z_s, batch.support_labels, batch.way)
    c, _, _, iters = kmeans_loop(z_s, batch.support_labels, z_q, c0, cfg.max_iter, cfg.fix_support, batch)
    log_probs = torch.log_softmax(mask_classes(softmax_logits(z_q, c, cfg.scale), batch), -1)
    return SolverOutput(log_probs, {"prototypes": c, "iterations": iters})


@dataclass(frozen=True)
class BayesKMeansConfig:
    # TAFSSL src/utils/misc.py parse_args: sigma 1, n_clusters = way; reduced_dim 10 for "& bkm".
    sigma: float = option(1.0, min=0, min_open=True)
    reduced_dim: int = option(10, min=0)  # 0: no projection
    centre: bool = True  # subtract the support mean and the query mean (TAFSSL "ber")
    max_iter: int = option(300, min=0)  # scikit-learn KMeans default, which TAFSSL uses


def _flops_bkm(Ns: int, Nq: int, M: int, D: int, way: int, cfg: BayesKMeansConfig) -> float:
    n = Ns + Nq
    r = min(cfg.reduced_dim, n, D) if cfg.reduced_dim > 0 else D
    pca = 2.0 * n * n * D + 9.0 * n**3 if cfg.reduced_dim > 0 else 0.0  # Gram + eigh
    # k-means over all n rows as in _flops_km (linear in max_iter), then the Bayes step
    clustering = (2 * cfg.max_iter + 1) * dist_flops(n, way, r) + dist_flops(Ns, way, r)
    return pca + clustering + dist_flops(Ns, way, r) + dist_flops(Ns, Nq, r)


@register(
    "bayes-kmeans",
    BayesKMeansConfig,
    transductive="always",
    flops=_flops_bkm,
    summary="Bayesian k-means in a task-adaptive PCA sub-space (TAFSSL, Lichtenstein et al. 2020)",
    floor=dict(
        gram=lambda Ns, Nq, M, D, way, cfg: (Ns + Nq, D) if cfg.reduced_dim > 0 else None,
        eigh=lambda Ns, Nq, M, D, way, cfg: Ns + Nq if cfg.reduced_dim > 0 else 0,
        product=lambda Ns, Nq, M, D, way, cfg: (Ns + Nq, min(cfg.reduced_dim, Ns + Nq, D) or D, way),
        loops=("poodle.solvers.kmeans:kmeans_loop",),
        steps_field="max_iter",
    ),
)
def bayes_kmeans(batch: EpisodeBatch, cfg: BayesKMeansConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``centres [E, way, r]`` (in the projected space),
    ``clusters [E, Nq]`` (each query's cluster) and ``iterations [E]`` (the k-means updates)."""
    z_s, z_q = batch.support, batch.query
    if cfg.centre or cfg.reduced_dim > 0:
        # a ragged chunk's padded rows take no part in the means or the PCA (they come out zero)
        s_w, q_w = row_weight(batch.support_mask, z_s.dtype), batch.query_weight()
        z_s, z_q = centre_and_project(z_s, z_q, cfg.reduced_dim, s_w, q_w)
    way = batch.way
    c0 = class_means(z_s, batch.support_labels, way)
    c, cq, _, iters = kmeans_loop(z_s, batch.support_labels, z_q, c0, cfg.max_iter, fix_support=False, pad=batch)
    # p(c|s) against unit-norm centres, as TAFSSL (an episode's padded clusters take no probability)
    log_pcs = torch.log_softmax(mask_classes(-cfg.sigma * sqdist(z_s, F.normalize(c, dim=-1)), batch), -1)
    log_kern = -cfg.sigma * sqdist(z_s, z_q)  # [E, Ns, Nq]
    E, Ns, Nq = log_kern.shape
    # p(c*(q)|s); a padded query (cluster -1) reads cluster 0: its row is padding whatever it holds
    log_pcs_q = torch.gather(log_pcs, 2, cq.clamp_min(0).unsqueeze(1).expand(E, Ns, Nq))
    joint = log_kern + log_pcs_q  # [E, Ns, Nq]
    member = one_hot(batch.support_labels, way, z_s.dtype)  # [E, Ns, way]
    log_member = torch.log(member).unsqueeze(2)  # 0 / -inf
    per_class = torch.logsumexp(joint.unsqueeze(-1) + log_member, dim=1)  # [E, Nq, way]
    log_probs = torch.log_softmax(per_class, -1)
    return SolverOutput(log_probs, {"centres": c, "clusters": cq, "iterations": iters})
