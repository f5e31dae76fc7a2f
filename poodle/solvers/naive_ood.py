"""Naive OOD: the "w/ naive OOD" baseline (Table 6, row 2) of

    Le, Nguyen, Nguyen, Tran, Nguyen, Hua. "POODLE: Improving Few-shot Learning via Penalizing
    Out-of-Distribution Samples". NeurIPS 2021, arXiv:2206.04679

"a (k+1)-way classifier with 1 additional class for OOD samples using CE loss". The paper gives no
more detail; this implementation uses POODLE's classifier and optimiser so that only the use of the
negatives differs: ``way + 1`` prototypes (the class means, plus the mean of the episode's negatives
for the OOD class), logits ``-(gamma/2)||x - w_k||^2`` with a learnable gamma (init 10), Adam
(lr 1e-3) for 250 steps on::

    mean_{support} CE(x, y) + ood_weight * mean_{negatives} CE(x, OOD)

(the two means weighted equally, so 400 negatives do not drown 5 support images). Queries are
classified among the ``way`` real classes only (the OOD column is dropped and the rest renormalised).
Inductive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from poodle.options import option
from poodle.solvers._optim import Padding, RowTerms, fit_weighted_distance, weighted_distance_flops
from poodle.solvers._transductive import softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, register
from poodle.solvers.ce import support_targets


@dataclass(frozen=True)
class NaiveOODConfig:
    steps: int = option(250, min=0)  # as POODLE (paper 5.1)
    lr: float = option(1e-3, min=0, min_open=True)  # as POODLE (paper 5.1)
    scale: float = option(10.0, min=0, min_open=True)  # as POODLE (authors' code)
    ood_weight: float = option(1.0, min=0)  # weight of the negatives' mean CE relative to the support's (our choice)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: NaiveOODConfig) -> float:
    return weighted_distance_flops(Ns + M, D, way + 1, cfg.steps) + 2.0 * Nq * D * way


@register(
    "naive-ood",
    NaiveOODConfig,
    transductive="never",
    uses_negatives=True,
    flops=_flops,
    summary="(way+1)-way classifier whose extra class is fitted to the negatives (Table 6 row 2)",
    floor=dict(matmul="large", fixed_steps=True),
    triton_step=True,  # its loss is one the Triton step knows
)
def naive_ood(batch: EpisodeBatch, cfg: NaiveOODConfig) -> SolverOutput:
    """Query log-probs ``[E, Nq, way]`` over the real classes; state: the ``way`` real prototypes,
    the OOD prototype ``[E, 1, D]`` and the scale."""
    s, neg, way = batch.support, batch.negatives, batch.way
    assert neg is not None  # solvers.run checks the negatives rule (SolverInfo.check_negatives)
    if batch.ragged:
        return _ragged(batch, cfg)
    E, Ns, _ = s.shape
    M = neg.shape[1]
    x = torch.cat([s, neg], 1)
    n = Ns + M
    kw: dict[str, Any] = dict(dtype=s.dtype, device=s.device)
    ce = torch.empty(1, 1, n, **kw)
    ce[..., :Ns] = 1.0 / Ns
    ce[..., Ns:] = cfg.ood_weight / M
    targets = torch.zeros(E, way + 1, n, **kw)
    targets[:, :way, :Ns] = support_targets(batch.support_labels, way, 0.0, s.dtype)
    targets[:, way, Ns:] = 1.0
    targets *= ce
    w0 = torch.cat([class_means(s, batch.support_labels, way), neg.mean(1, keepdim=True)], 1)
    w, scale = fit_weighted_distance(
        x, RowTerms(targets, ce, torch.zeros_like(ce)), w0, scale0=cfg.scale, steps=cfg.steps, lr=cfg.lr
    )
    real = w[:, :way]
    return SolverOutput(
        torch.log_softmax(softmax_logits(batch.query, real, scale), -1),
        {"prototypes": real, "ood_prototype": w[:, way:], "scale": scale},
    )


def _ragged(batch: EpisodeBatch, cfg: NaiveOODConfig) -> SolverOutput:
    """A ragged chunk: each episode's OOD class right after its own classes (class ``ways[e]``, as
    alone), then the padding; the support CE a mean over its real support rows."""
    s, neg, way = batch.support, batch.negatives, batch.way
    assert neg is not None
    E, Ns, D = s.shape
    M = neg.shape[1]
    kw: dict[str, Any] = dict(dtype=s.dtype, device=s.device)
    ways = batch.ways if batch.ways is not None else torch.full((E,), way, device=s.device)
    ood = ways.view(E, 1, 1)
    x = torch.cat([s, neg], 1)
    sm = torch.ones(E, Ns, **kw) if batch.support_mask is None else batch.support_mask.to(s.dtype)
    ce = torch.cat([sm / sm.sum(1, keepdim=True), torch.full((E, M), cfg.ood_weight / M, **kw)], 1).unsqueeze(1)
    targets = torch.zeros(E, way + 1, Ns + M, **kw)
    targets[:, :way, :Ns] = support_targets(batch.support_labels, way, 0.0, s.dtype)
    targets[:, :, Ns:] = (torch.arange(way + 1, device=s.device).view(1, -1, 1) == ood).to(s.dtype)
    targets *= ce
    w0 = torch.cat([class_means(s, batch.support_labels, way), torch.zeros(E, 1, D, **kw)], 1)
    w0.scatter_(1, ood.expand(E, 1, D), neg.mean(1, keepdim=True))
    classes = torch.arange(way + 1, device=s.device) <= ways.unsqueeze(1)
    padding = Padding.of(classes, (batch.support_mask, Ns), (None, M))
    w, scale = fit_weighted_distance(
        x,
        RowTerms(targets, ce, torch.zeros_like(ce)),
        w0,
        scale0=cfg.scale,
        steps=cfg.steps,
        lr=cfg.lr,
        padding=padding,
    )
    real = w[:, :way] * (torch.arange(way, device=s.device) < ways.unsqueeze(1)).unsqueeze(-1).to(s.dtype)
    return SolverOutput(
        torch.log_softmax(mask_classes(softmax_logits(batch.query, real, scale), batch), -1),
        {"prototypes": real, "ood_prototype": w.gather(1, ood.expand(E, 1, D)), "scale": scale},
    )
