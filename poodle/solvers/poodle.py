"""POODLE: prototypes fine-tuned with cross-entropy plus a pull towards in-distribution samples and
a push away from out-of-distribution ones, from

    Le, Nguyen, Nguyen, Tran, Nguyen, Hua. "POODLE: Improving Few-shot Learning via Penalizing
    Out-of-Distribution Samples". NeurIPS 2021, arXiv:2206.04679 (equations 4-5, Algorithm 1)

as the authors' released code runs it: prototypes start at the class means of the normalised
support, logits ``l_k(x) = -(gamma/2)||x - w_k||^2`` with one learnable gamma per episode (init 10),
Adam (lr 1e-3, default betas) for 250 steps on the per-episode loss::

    CE (mean over support) + alpha * pull - beta * push
    pull = mean_{x in positives} sum_k (gamma/2)||x - w_k||^2 * sg[p(k|x)]
    push = mean_{x in negatives} sum_k (gamma/2)||x - w_k||^2 * sg[p(k|x)]

summed over the episodes of a chunk. Positives are the support (inductive) or support + queries
(``transductive``); ``stopgrad_pull``/``stopgrad_push`` false drop the stop-gradient ``sg`` (Table 9);
``beta = 0`` gives the "CE + pull" rows of Table 3. Optionally transductive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from poodle.options import option
from poodle.solvers._optim import Padding, RowTerms, fit_weighted_distance, weighted_distance_flops
from poodle.solvers._transductive import softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, register
from poodle.solvers.ce import support_targets


@dataclass(frozen=True)
class PoodleConfig:
    # what a field name shared with other methods means here (see base.MEANINGS)
    MEANINGS: ClassVar[dict[str, str]] = {"alpha": "pull weight", "beta": "push weight"}
    alpha: float = option(1.0, min=0)  # pull weight (paper 5.1; authors' default)
    beta: float = option(0.5, min=0)  # push weight (paper 5.1; authors' default)
    steps: int = option(250, min=0)  # paper 5.1 / authors' number_fc_update
    lr: float = option(1e-3, min=0, min_open=True)  # paper 5.1: Adam, lr 1e-3, default betas
    scale: float = option(10.0, min=0, min_open=True)  # authors' code: learnable gamma per episode, init 10
    transductive: bool = False  # authors' evaluate path runs inductive POODLE
    stopgrad_pull: bool = True  # Table 9: stop-gradient on p in the pull term
    stopgrad_push: bool = True  # Table 9: stop-gradient on p in the push term


def build_rows(batch: EpisodeBatch, cfg: PoodleConfig) -> tuple[torch.Tensor, RowTerms, int]:
    """``X [E, n, D]`` = support, [queries], negatives, and the per-row coefficients of the loss.

    In a ragged chunk the means are each episode's own (the paper's loss of one episode): the CE
    over its real support rows, the pull over its real positives, the push over its negatives; a
    padded row gets zero coefficients."""
    s, q, neg = batch.support, batch.query, batch.negatives
    E, Ns, _ = s.shape
    parts = [s] + ([q] if cfg.transductive else []) + ([neg] if neg is not None and cfg.beta != 0 else [])
    x = torch.cat(parts, 1) if len(parts) > 1 else s
    n = x.shape[1]
    n_pos = Ns + (q.shape[1] if cfg.transductive else 0)
    M = n - n_pos
    kw: dict[str, Any] = dict(dtype=s.dtype, device=s.device)
    if batch.support_mask is None and (batch.query_mask is None or not cfg.transductive):
        ce = torch.zeros(1, 1, n, **kw)
        ce[..., :Ns] = 1.0 / Ns
        coef = torch.zeros(1, 1, n, **kw)
        coef[..., :n_pos] = -cfg.alpha / n_pos
        n_support: torch.Tensor | float = Ns
    else:
        sm = torch.ones(E, Ns, **kw) if batch.support_mask is None else batch.support_mask.to(s.dtype)
        qm = torch.ones(E, q.shape[1], **kw) if batch.query_mask is None else batch.query_mask.to(s.dtype)
        pos = torch.cat([sm, qm], 1) if cfg.transductive else sm
        n_support = sm.sum(1).view(E, 1, 1)
        ce = torch.zeros(E, 1, n, **kw)
        ce[:, 0, :Ns] = sm
        ce /= n_support
        coef = torch.zeros(E, 1, n, **kw)
        coef[:, 0, :n_pos] = pos * (-cfg.alpha)
        coef[..., :n_pos] /= pos.sum(1).view(E, 1, 1)
    if M:
        coef[..., n_pos:] = cfg.beta / M
    targets = torch.zeros(E, batch.way, n, **kw)
    targets[..., :Ns] = support_targets(batch.support_labels, batch.way, 0.0, s.dtype) / n_support
    free = None
    if not (cfg.stopgrad_pull and cfg.stopgrad_push):
        free = torch.zeros_like(coef)
        if not cfg.stopgrad_pull:
            free[..., :n_pos] = coef[..., :n_pos]
        if not cfg.stopgrad_push:
            free[..., n_pos:] = coef[..., n_pos:]
    return x, RowTerms(targets, ce, coef, free), n_pos


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: PoodleConfig) -> float:
    n = Ns + (Nq if cfg.transductive else 0) + (M if cfg.beta != 0 else 0)
    free = not (cfg.stopgrad_pull and cfg.stopgrad_push)
    return weighted_distance_flops(n, D, way, cfg.steps, free) + 2.0 * Nq * D * way


@register(
    "poodle",
    PoodleConfig,
    transductive="optional",
    uses_negatives=lambda cfg: cfg.beta != 0,
    flops=_flops,
    summary="POODLE: CE + alpha*pull (in-distribution) - beta*push (negatives), Le et al. 2021",
    floor=dict(matmul="large", fixed_steps=True),
    triton_step=True,  # its loss is one the Triton step knows
    flags={"pull_weight": "alpha", "push_weight": "beta"},
)
def poodle(batch: EpisodeBatch, cfg: PoodleConfig) -> SolverOutput:
    """Query log-probs ``[E, Nq, way]``; state: prototypes ``[E, way, D]``, scale ``[E, 1, 1]``."""
    x, terms, n_pos = build_rows(batch, cfg)
    w0 = class_means(batch.support, batch.support_labels, batch.way)
    Ns = batch.support.shape[1]
    query = (batch.query_mask, n_pos - Ns) if cfg.transductive else (None, 0)
    padding = Padding.of(batch.class_mask, (batch.support_mask, Ns), query, (None, x.shape[1] - n_pos))
    w, scale = fit_weighted_distance(x, terms, w0, scale0=cfg.scale, steps=cfg.steps, lr=cfg.lr, padding=padding)
    log_probs = torch.log_softmax(mask_classes(softmax_logits(batch.query, w, scale), batch), -1)
    return SolverOutput(log_probs, {"prototypes": w, "scale": scale})
