"""TIM-ADM: transductive information maximisation by alternating direction (closed-form) updates.

Malik Boudiaf, Imtiaz Masud Ziko, Jérôme Rony, Jose Dolz, Pablo Piantanida, Ismail Ben Ayed.
"Information Maximization for Few-Shot Learning", NeurIPS 2020, arXiv:2008.11297 (Sec. 3, ADM).

Same objective as TIM-GD, relaxed with auxiliary query assignments ``Q`` tied to the model's
``P`` by a KL penalty. Each iteration alternates two closed forms: ``Q ∝ P^(1+l_cond) /
(sum_q P^(1+l_cond))^(l_marg/(l_marg+1))`` (row-normalised), then prototypes = a weighted
average of support and query features under ``Y_s``, ``Q`` and the model's own ``P`` (with damping
``alpha``). Logits ``-(T/2)||z - w_k||^2``, T fixed. Transductive; assumes balanced queries (the
marginal term), like TIM-GD.

Differences from the TIM authors' code: the power sums and row sums are floored at 1e-30, so a
class whose probabilities all underflow cannot produce ``0/0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from poodle.options import option
from poodle.solvers._transductive import TINY, dist_flops, pow_anywhere, softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, one_hot, register


@dataclass
class TimADMConfig:
    """Defaults: mboudiaf/TIM ``src/tim.py`` config (temp 15, loss_weights [0.1, 1.0, 0.1],
    iter 150, alpha 1.0), which the TIM-ADM evaluation scripts use unchanged."""

    MEANINGS: ClassVar[dict[str, str]] = {"alpha": "prototype update rate"}  # see base.MEANINGS

    ce_weight: float = option(0.1, min=0)
    marginal_weight: float = option(1.0, min=0)
    conditional_weight: float = option(0.1, min=0)
    temperature: float = option(15.0, min=0, min_open=True)
    steps: int = option(150, min=0)
    # damping of the prototype update (1 = take the closed form)
    alpha: float = option(1.0, min=0, min_open=True, max=1)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: TimADMConfig) -> float:
    return cfg.steps * (2 * dist_flops(Ns + Nq, way, D) + dist_flops(Ns + Nq, way, D))


@register(
    "tim-adm",
    TimADMConfig,
    transductive="always",
    flops=_flops,
    summary="TIM-ADM (Boudiaf et al. 2020): alternating closed-form updates of TIM's objective",
)
def tim_adm(batch: EpisodeBatch, cfg: TimADMConfig) -> SolverOutput:
    """Solve ``batch`` with TIM-ADM. Returns ``log_probs [E, Nq, way]``, state ``prototypes``,
    ``assignments`` (the final ``Q``, ``[E, Nq, way]``)."""
    z_s, z_q = batch.support, batch.query
    n_s, n_q = z_s.shape[1], z_q.shape[1]
    y_s = one_hot(batch.support_labels, batch.way, z_s.dtype)
    w = class_means(z_s, batch.support_labels, batch.way)
    l_ce, l_marg, l_cond = cfg.ce_weight, cfg.marginal_weight, cfg.conditional_weight
    power = 1.0 + l_cond  # KL-penalty weight fixed to 1, as the TIM authors
    beta = l_marg / (l_marg + 1.0)
    c_s = l_ce / (1.0 + l_cond)
    c_q = n_s / n_q
    q = torch.softmax(softmax_logits(z_q, w, cfg.temperature), -1)
    for _ in range(cfg.steps):
        p_q = torch.softmax(softmax_logits(z_q, w, cfg.temperature), -1)
        pw = pow_anywhere(p_q, power)
        q = pw / pow_anywhere(pw.sum(1, keepdim=True).clamp_min(TINY), beta)
        q = q / q.sum(2, keepdim=True).clamp_min(TINY)
        p_s = torch.softmax(softmax_logits(z_s, w, cfg.temperature), -1)
        num = c_s * (
            torch.bmm(y_s.transpose(1, 2), z_s) + w * p_s.sum(1).unsqueeze(-1) - torch.bmm(p_s.transpose(1, 2), z_s)
        )
        num = num + c_q * (
            torch.bmm(q.transpose(1, 2), z_q) + w * p_q.sum(1).unsqueeze(-1) - torch.bmm(p_q.transpose(1, 2), z_q)
        )
        den = (c_s * y_s.sum(1) + c_q * q.sum(1)).unsqueeze(-1).clamp_min(TINY)
        w = w + cfg.alpha * (num / den - w)
    log_probs = torch.log_softmax(softmax_logits(z_q, w, cfg.temperature), -1)
    return SolverOutput(log_probs, {"prototypes": w, "assignments": q})
