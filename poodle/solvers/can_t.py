"""CAN-T: transductive iterative pseudo-labelling of the most confident queries.

Ruibing Hou, Hong Chang, Bingpeng Ma, Shiguang Shan, Xilin Chen. "Cross Attention Network for
Few-shot Classification", NeurIPS 2019, arXiv:1910.07677 (Sec. 3.4, transductive inference).

Prototypes are the L2-normalised support class means; queries are scored by
``softmax(scale * cos(z_q, p_k))``. At iteration ``i`` (``i = 1..n``) the ``i * step`` queries
with the highest confidence (max probability) in the episode join the support set with their
predicted labels, and the normalised prototypes are recomputed from the support plus those
queries. ``n = Nq // step`` unless ``iterations`` is given. Transductive.

Differences from the POODLE authors' ``CAN_T`` (docs/reference.md §2): their index arithmetic
hard-coded 75 queries per episode; here the top-k is taken per episode over its own ``Nq``
queries (any count, balanced or not). The cross-attention module of CAN is a backbone component
and is not part of this solver (as in the POODLE authors' reimplementation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from poodle.options import option
from poodle.solvers._transductive import class_softmax, cosine, dist_flops
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, one_hot, register


@dataclass(frozen=True)
class CanTConfig:
    step: int = option(30, min=1)  # queries added per iteration (the POODLE authors' reimplementation)
    iterations: int = option(-1, min=-1)  # -1: Nq // step (2 for 75 queries, as theirs)
    scale: float = option(10.0, min=0, min_open=True)  # cosine temperature of the confidence softmax


def _n_iter(cfg: CanTConfig, n_q: int) -> int:
    return n_q // cfg.step if cfg.iterations < 0 else cfg.iterations


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: CanTConfig) -> float:
    return (_n_iter(cfg, Nq) + 1) * (dist_flops(Nq, way, D) + dist_flops(Ns + Nq, way, D))


@register(
    "can-t",
    CanTConfig,
    transductive="always",
    flops=_flops,
    floor=dict(steps_field="iterations", steps_of=_n_iter),
    summary="CAN-T (Hou et al. 2019): iterative pseudo-labelling of the most confident queries",
)
def can_t(batch: EpisodeBatch, cfg: CanTConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes [E, way, D]`` (unit norm)."""
    z_s, z_q = batch.support, batch.query
    n_q = z_q.shape[1]  # a ragged chunk's largest episode: the most iterations any episode makes
    y_s = one_hot(batch.support_labels, batch.way, z_s.dtype)
    p = F.normalize(class_means(z_s, batch.support_labels, batch.way), dim=-1)
    q_norm = torch.linalg.vector_norm(z_q, dim=-1, keepdim=True)
    if batch.ragged:
        # each episode its own query count, hence its own number of iterations and top-k sizes
        n_qe = batch.n_query().long()  # [E]
        n_iter_e = n_qe // cfg.step if cfg.iterations < 0 else torch.full_like(n_qe, cfg.iterations)
        ranks = torch.arange(n_q, device=z_q.device).expand_as(q_norm[..., 0])
    for i in range(_n_iter(cfg, n_q)):
        prob = class_softmax(mask_classes(cfg.scale * cosine(z_q, p, q_norm), batch))
        conf, pseudo = prob.max(-1)  # [E, Nq]
        if not batch.ragged:
            k = min((i + 1) * cfg.step, n_q)
            top = conf.topk(k, dim=1).indices
            chosen = torch.zeros_like(conf).scatter(1, top, 1.0)  # [E, Nq]
        else:
            if batch.query_mask is not None:
                conf = conf.masked_fill(~batch.query_mask, float("-inf"))  # a padded query ranks last
            order = conf.argsort(dim=1, descending=True, stable=True)
            rank = torch.empty_like(order).scatter_(1, order, ranks)
            chosen = (rank < ((i + 1) * cfg.step)) & (rank < n_qe.unsqueeze(1))
            chosen = chosen.to(z_s.dtype)
        a_q = one_hot(pseudo, batch.way, z_s.dtype) * chosen.unsqueeze(-1)
        # every class keeps its support points, so the mean is never 0/0
        num = torch.bmm(y_s.transpose(1, 2), z_s) + torch.bmm(a_q.transpose(1, 2), z_q)
        new = F.normalize(num / (y_s.sum(1) + a_q.sum(1)).unsqueeze(-1).clamp_min(1.0), dim=-1)
        p = new if not batch.ragged else torch.where((i < n_iter_e)[:, None, None], new, p)
    log_probs = class_softmax(mask_classes(cfg.scale * cosine(z_q, p, q_norm), batch), log=True)
    return SolverOutput(log_probs, {"prototypes": p})
