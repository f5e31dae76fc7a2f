"""Prototypes fine-tuned with the support cross-entropy only: the "learning cosine classifier" row
(Table 6, row 1) and, with ``label_smoothing``, the "label smoothing" row (Table 6, row 4) of

    Le, Nguyen, Nguyen, Tran, Nguyen, Hua. "POODLE: Improving Few-shot Learning via Penalizing
    Out-of-Distribution Samples". NeurIPS 2021, arXiv:2206.04679

Prototypes start at the class means, one scale gamma per episode at 10, logits
``-(gamma/2)||x - w||^2``; Adam (lr 1e-3, default betas) on (W, gamma) for 250 steps minimising the
mean support CE. Label smoothing puts ``1 - eps`` on the true class and ``eps/(way-1)`` on each
other one (the paper's Table 6 description). Inductive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poodle.options import option
from poodle.solvers._optim import Padding, RowTerms, fit_weighted_distance, weighted_distance_flops
from poodle.solvers._transductive import softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, one_hot, register


@dataclass(frozen=True)
class CEConfig:
    steps: int = option(250, min=0)  # paper 5.1 / authors' number_fc_update
    lr: float = option(1e-3, min=0, min_open=True)  # paper 5.1: Adam, lr 1e-3
    scale: float = option(10.0, min=0, min_open=True)  # authors' code: learnable gamma initialised at 10
    label_smoothing: float = option(0.0, min=0, max=1, max_open=True)  # Table 6 row 4 uses 0.1


def support_targets(
    labels: torch.Tensor, way: int, eps: float, dtype: torch.dtype, ways: torch.Tensor | None = None
) -> torch.Tensor:
    """``[E, way, Ns]`` target distributions of the support rows (label-smoothed when ``eps > 0``,
    over each episode's own ``ways [E]`` classes where given: a padded class gets no mass; a padded
    row's column is not a distribution, and its loss weight is zero)."""
    y = one_hot(labels, way, dtype).transpose(1, 2)
    if eps > 0:
        if ways is None:
            y = y * (1 - eps) + (1 - y) * (eps / max(way - 1, 1))
        else:
            real = (torch.arange(way, device=labels.device) < ways.unsqueeze(1)).to(dtype).unsqueeze(-1)
            # eps / (ways - 1) as a division (a scalar over a tensor is eps * (1 / t) in torch: not
            # the bits of the fixed path's eps / (way - 1))
            other = torch.full((len(ways), 1, 1), eps, dtype=dtype, device=labels.device)
            other /= (ways - 1).clamp_min(1).to(dtype).view(-1, 1, 1)
            y = y * (1 - eps) + (real - y) * other
    return y


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: CEConfig) -> float:
    return weighted_distance_flops(Ns, D, way, cfg.steps) + 2.0 * Nq * D * way


@register(
    "ce",
    CEConfig,
    transductive="never",
    uses_negatives=False,
    flops=_flops,
    summary="prototypes and scale fine-tuned with the support cross-entropy (Table 6 row 1)",
    floor=dict(matmul="large", fixed_steps=True),
    triton_step=True,  # its loss is one the Triton step knows
)
def ce(batch: EpisodeBatch, cfg: CEConfig) -> SolverOutput:
    """Support rows only: ``X = support [E, Ns, D]``, CE weight ``1/Ns`` per row."""
    x, way = batch.support, batch.way
    E, Ns, _ = x.shape
    w0 = class_means(x, batch.support_labels, way)
    wt = torch.full((1, 1, Ns), 1.0 / Ns, dtype=x.dtype, device=x.device)
    if batch.support_mask is not None:  # a mean over each episode's real support rows
        sm = batch.support_mask.to(x.dtype).unsqueeze(1)
        wt = sm / sm.sum(2, keepdim=True)
    terms = RowTerms(
        targets=support_targets(batch.support_labels, way, cfg.label_smoothing, x.dtype, batch.ways) * wt,
        ce=wt,
        coef=torch.zeros_like(wt),
    )
    padding = Padding.of(batch.class_mask, (batch.support_mask, Ns))
    w, scale = fit_weighted_distance(x, terms, w0, scale0=cfg.scale, steps=cfg.steps, lr=cfg.lr, padding=padding)
    log_probs = torch.log_softmax(mask_classes(softmax_logits(batch.query, w, scale), batch), -1)
    return SolverOutput(log_probs, {"prototypes": w, "scale": scale})
