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
from torch import Tensor

from poodle.options import option
from poodle.solvers import _native, _optim
from poodle.solvers import backend as _backend
from poodle.solvers._native import KernelTerms
from poodle.solvers._optim import Padding
from poodle.solvers._transductive import TINY, dist_flops, pow_anywhere, row_sqnorm, softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, one_hot, register


@dataclass(frozen=True)
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
    # per step the two products over every row (x.w, then the weighted sums G^T x), about 16
    # operations on each of the n x K logits (softmax, the power and its normalisations) and the
    # update of the prototypes; then the queries' logits
    n = Ns + Nq
    per_step = 2 * dist_flops(n, way, D) + 16 * n * way + 4 * way * D
    return cfg.steps * per_step + dist_flops(Ns, way, D) + dist_flops(Nq, way, D)


@register(
    "tim-adm",
    TimADMConfig,
    transductive="always",
    flops=_flops,
    floor=dict(matmul="large", fixed_steps=True),
    summary="TIM-ADM (Boudiaf et al. 2020): alternating closed-form updates of TIM's objective",
)
def tim_adm(batch: EpisodeBatch, cfg: TimADMConfig) -> SolverOutput:
    """Solve ``batch`` with TIM-ADM. Returns ``log_probs [E, Nq, way]``, state ``prototypes``,
    ``assignments`` (the final ``Q``, ``[E, Nq, way]``; zero on a padded query row or class).

    One step is two batched products over all the rows ``X = [support; queries]``: the logits
    ``W X^T`` and the weighted sums ``G X``, with ``G = [-c_s P_s, c_q (Q - P_q)]`` (``[E, K, n]``),
    since the closed form's numerator is ``c_s (Y_s^T z_s + w sum P_s - P_s^T z_s) + c_q (Q^T z_q +
    w sum P_q - P_q^T z_q)`` and ``Y_s^T z_s`` never changes. Classes run along the middle axis and
    rows along the last (``[E, K, n]``), so every softmax and sum over the classes runs across rows in
    vector lanes. On CPU the fused kernel (:mod:`poodle.solvers._native`) runs the same iterations,
    one pass over an episode's rows at a time. In a ragged chunk a padded class has no probability and
    a padded row no weight: each episode's sums run over its own rows, ``c_q = Ns / Nq`` is its own."""
    z_s, z_q = batch.support, batch.query
    E, n_s, D = z_s.shape
    n_q = z_q.shape[1]
    K, dt = batch.way, z_s.dtype
    y_t = one_hot(batch.support_labels, K, dt).transpose(1, 2)  # [E, K, Ns]
    w = class_means(z_s, batch.support_labels, K)
    l_ce, l_marg, l_cond = cfg.ce_weight, cfg.marginal_weight, cfg.conditional_weight
    power = 1.0 + l_cond  # KL-penalty weight fixed to 1, as the TIM authors
    beta = l_marg / (l_marg + 1.0)
    c_s = l_ce / (1.0 + l_cond)
    x = torch.cat([z_s, z_q], 1)  # [E, n, D]
    xt = x.transpose(1, 2)
    pad = None if batch.class_mask is None else ~batch.class_mask.unsqueeze(-1)  # [E, K, 1]
    sm: Tensor | float = 1.0
    qm: Tensor | float = 1.0
    c_q: Tensor | float = n_s / n_q
    if batch.support_mask is not None or batch.query_mask is not None:
        from poodle.solvers.tim_gd import ragged_rows

        sm, qm, ns, nq = ragged_rows(batch, dt)
        c_q = ns / nq
    ysum = y_t.sum(2, keepdim=True)  # [E, K, 1]
    base = torch.bmm(y_t, z_s).mul_(c_s)  # c_s Y_s^T z_s: the same every step
    T = cfg.temperature

    def probs(w: Tensor) -> Tensor:
        """``[E, K, n]`` softmax over the classes of every row's logits."""
        logits = T * (torch.bmm(w, xt) - 0.5 * row_sqnorm(w))  # [E, K, n]
        if pad is not None:
            logits.masked_fill_(pad, float("-inf"))
        return torch.softmax(logits, 1)

    def assign(p_q: Tensor) -> Tensor:
        pw = pow_anywhere(p_q, power)
        q = pw / pow_anywhere(pw.sum(2, keepdim=True).clamp_min(TINY), beta)
        return q / q.sum(1, keepdim=True).clamp_min(TINY)

    terms = KernelTerms("adm", y_t, n_support=n_s, weights=(c_s, power, beta), alpha=cfg.alpha)
    native = _backend.current().native
    if native and cfg.steps >= 1 and _native.usable(x):
        # the fused kernel: the same iterations, one pass over an episode's rows a step
        _backend.ran(_native.formulation(), x.device)
        padding = Padding.of(batch.class_mask, (batch.support_mask, n_s), (batch.query_mask, n_q))
        opts = _optim.FitOptions(scale0=T, steps=cfg.steps, learn_scale=False)
        if padding is None:
            w_k, q_k = _native.fit_adm(x, w.contiguous(), terms, opts)
        else:
            xp, packed, sizes = _optim._pack_kernel(x, terms, padding)
            w_k, q_k = _native.fit_adm(xp, w.contiguous(), packed, opts, sizes)
            if batch.query_mask is not None:  # back to the queries' places (padding: zeros)
                order = _optim._front(batch.query_mask).unsqueeze(1).expand_as(q_k)
                q_k = torch.zeros_like(q_k).scatter_(2, order, q_k)
        log_probs = torch.log_softmax(mask_classes(softmax_logits(z_q, w_k, T), batch), -1)
        return SolverOutput(log_probs, {"prototypes": w_k, "assignments": q_k.transpose(1, 2)})
    if x.device.type == "cpu":
        why = "torch (the fused kernel switched off)" if not native else _native.formulation()
        if native and _native.state().loaded:
            why = "torch" if cfg.steps < 1 else f"torch (the fused kernel takes float32 and float64, not {x.dtype})"
        _backend.ran(why, x.device)
    q: Tensor | None = None
    for _ in range(cfg.steps):
        p = probs(w)
        p_s, p_q = p[..., :n_s] * sm, p[..., n_s:] * qm
        q = assign(p_q) * qm
        g = torch.cat([p_s * -c_s, (q - p_q) * c_q], 2)  # [E, K, n]
        num = torch.baddbmm(base, g, x).addcmul_(w, p_s.sum(2, keepdim=True).mul_(c_s))
        num.addcmul_(w, p_q.sum(2, keepdim=True).mul_(c_q))
        den = (ysum * c_s + q.sum(2, keepdim=True) * c_q).clamp_min(TINY)
        w = w + cfg.alpha * (num / den - w)
    if q is None:  # no step: the model's own probabilities
        q = probs(w)[..., n_s:] * qm
    log_probs = torch.log_softmax(mask_classes(softmax_logits(z_q, w, T), batch), -1)
    return SolverOutput(log_probs, {"prototypes": w, "assignments": q.transpose(1, 2)})
