"""PADDLE: primal-dual minimum-description-length clustering for realistic query sets.

Ségolène Martin, Malik Boudiaf, Emilie Chouzenoux, Jean-Christophe Pesquet, Ismail Ben Ayed.
"Towards Practical Few-shot Query Sets: Transductive Minimum Description Length Inference",
NeurIPS 2022, arXiv:2210.14545.

A k-means-like data term (support points fixed to their class, queries softly assigned) plus an
MDL penalty ``-lambda sum_k pi_k log pi_k`` on the query class proportions ``pi``, which lets
classes absent from the query set empty out instead of being forced to take queries: the method
does not assume that every support class appears among the queries (``--query-classes``).
Block-coordinate updates, per iteration and episode:

    u = softmax_k(-||z_q - w_k||^2 / 2 + (lambda / Nq) v_k)         query assignments [Nq, K]
    v = log(mean_q u + 1e-6) + 1                                    dual variable [K]
    w = (u^T z_q + y_s^T z_s) / (sum_q u + sum_s y_s)               centres [K, D]

starting from ``w`` = support means and ``v = 0``; queries take the argmax of the final ``u``.
Features are first min-max scaled per episode and dimension over the query set (support scaled
with the query set's statistics). Transductive.

Defaults are the authors' released configuration (SegoleneMartin/PADDLE,
``config/*/methods_config/paddle.yaml``: ``iter: 100``, ``alpha: 75``, the same for every dataset
and backbone; ``results/params`` logs their sweep of 15-90 on mini-ImageNet, best at 70-75). Their
code multiplies ``v`` by ``alpha / Nq``, and their protocol always has ``Nq = 75`` queries
(``config/main_config.yaml``), so the coefficient is 1 there; with other query counts ``lmd = 75``
keeps their code's behaviour exactly, and ``lmd = 0`` instead scales ``lambda`` with the query count
(``lambda = Nq``, a unit coefficient for any ``Nq``).

Differences from the authors' code: their min-max scaler computes ``x / range - min`` (an in-place
``mul_`` then ``sub_``) where ``(x - min) / range`` is meant; the two differ by a per-dimension
translation shared by support and query points, which no distance and no weighted mean sees, so
we use the intended form. A dimension constant over the queries gets range 1, as theirs.
benchmarks/compare_official.py runs their class on the same episodes (docs/transductive.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers._span import RowSpan, span_flops, use_gram
from poodle.solvers.base import EpisodeBatch, SolverOutput, mask_classes, one_hot, register


@dataclass(frozen=True)
class PaddleConfig:
    lmd: float = option(75.0, min=0)  # lambda (their "alpha"); 0: lambda = Nq, the query count
    steps: int = option(100, min=1)  # the authors' iter: 100
    scale_features: bool = True  # the authors' per-episode min-max scaling over the queries


def minmax_scale(z_s: Tensor, z_q: Tensor, query_mask: Tensor | None = None) -> Tensor:
    """Per episode and dimension, map the query set onto ``[0, 1]`` and the support set with the same
    affine map: ``z_s [E, Ns, D]``, ``z_q [E, Nq, D]`` -> both stacked, ``[E, Ns + Nq, D]``.
    ``query_mask [E, Nq]``: a ragged chunk's real queries, over which the range is taken."""
    if query_mask is None:
        lo = z_q.amin(1, keepdim=True)
        rng = z_q.amax(1, keepdim=True) - lo
    else:
        pad = ~query_mask.unsqueeze(-1)
        lo = z_q.masked_fill(pad, float("inf")).amin(1, keepdim=True)
        rng = z_q.masked_fill(pad, float("-inf")).amax(1, keepdim=True) - lo
    rng = torch.where(rng == 0, torch.ones_like(rng), rng)
    z = z_q.new_empty(z_q.shape[0], z_s.shape[1] + z_q.shape[1], z_q.shape[2])
    torch.sub(z_s, lo, out=z[:, : z_s.shape[1]])
    torch.sub(z_q, lo, out=z[:, z_s.shape[1] :])
    return z.div_(rng)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: PaddleConfig) -> float:
    return span_flops(Ns, Nq, D, way, cfg.steps, cfg.steps, use_gram(Ns, Nq, D, way, cfg.steps, cfg.steps))


@register(
    "paddle",
    PaddleConfig,
    transductive="always",
    flops=_flops,
    floor=dict(fixed_steps=True),
    summary="PADDLE (Martin et al. 2022): MDL-penalised clustering; query classes may be absent",
)
def paddle(batch: EpisodeBatch, cfg: PaddleConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]`` (log of the final assignments ``u``); state ``prototypes
    [E, way, D]`` (in the scaled space) and ``assignments [E, Nq, way]``."""
    n_s, n_q, way = batch.support.shape[1], batch.query.shape[1], batch.way
    if cfg.scale_features:
        z = minmax_scale(batch.support, batch.query, batch.query_mask)
    else:
        z = torch.cat([batch.support, batch.query], 1)
    q_w = batch.query_weight()  # [E, Nq, 1] of a ragged chunk, else None
    if batch.ragged:
        # each episode its own query count: lambda / Nq, and the mean over its real queries
        n_qe = batch.n_query().to(z.dtype).view(-1, 1, 1)
        coef: Tensor | float = (cfg.lmd / n_qe) if cfg.lmd > 0 else torch.ones_like(n_qe)
    else:
        coef = (cfg.lmd if cfg.lmd > 0 else float(n_q)) / n_q
    y_t = one_hot(batch.support_labels, way, z.dtype).transpose(1, 2)  # [E, K, Ns]
    span = RowSpan(z, n_s, way, cfg.steps, cfg.steps, centre=True, query_weight=q_w)
    ys_t_zs = span.support_sum(y_t)
    counts = y_t.sum(2, keepdim=True)  # [E, K, 1], >= 1 per class
    w = ys_t_zs / counts
    v = None
    u = None
    for _ in range(cfg.steps):
        dots, sq = span.scores(w)
        logits = dots.add_(sq.mul_(-0.5).unsqueeze(2))  # [E, K, Nq]: <z_q, w_k> - ||w_k||^2 / 2
        if batch.ragged:
            logits = mask_classes(logits.transpose(1, 2), batch).transpose(1, 2)
        u = torch.softmax(logits if v is None else logits.add_(v), 1)
        if q_w is None:
            v = u.mean(2, keepdim=True).add_(1e-6).log_().add_(1.0).mul_(coef)  # coef * v, [E, K, 1]
        else:
            u = u * q_w.transpose(1, 2)  # a padded query takes no part in v or the centres
            v = (u.sum(2, keepdim=True) / n_qe).add_(1e-6).log_().add_(1.0).mul_(coef)
        den = u.sum(2, keepdim=True).add_(counts)
        if batch.ragged:
            den = den.clamp_min_(1.0)  # a padded class has no member: a zero centre, not 0/0
        w = span.mean(y_t, u, den, support=ys_t_zs)
    assert u is not None  # cfg.steps >= 1
    u = u.transpose(1, 2).contiguous()
    log_u = mask_classes(torch.log(u.clamp_min(1e-30)), batch)  # a padded class: exactly no probability
    return SolverOutput(torch.log_softmax(log_u, -1), {"prototypes": span.explicit(w), "assignments": u})
