"""TIM-GD: transductive information maximisation by gradient descent, on the classifier only.

Malik Boudiaf, Imtiaz Masud Ziko, Jérôme Rony, Jose Dolz, Pablo Piantanida, Ismail Ben Ayed.
"Information Maximization for Few-Shot Learning", NeurIPS 2020, arXiv:2008.11297.

Prototypes start at the support class means; logits are ``-(T/2) ||z - w_k||^2``. Adam minimises,
per episode, ``l_ce * CE(support) - (l_marg * H(mean_q p) - l_cond * mean_q H(p))``: cross-entropy
on the support, plus the query mutual information (a confident prediction per query, and balanced
class proportions over the query set). The marginal term assumes balanced queries, which is why TIM
drops under query imbalance (POODLE paper, appendix table on imbalanced queries). Transductive.

Two presets:

- ``preset="tim"`` (default): the TIM authors' scripts: weights 0.1 / 1 / 0.1, fixed temperature
  15, Adam lr 1e-4, 1000 iterations, only the prototypes are optimised.
- ``preset="poodle-paper"``: what the POODLE authors ran (their ``src/fsl/tim.py``, docs/reference.md
  §2): weights 1 / 10 / 1 (the same ratio), one learnable scale per episode starting at 10,
  Adam lr 1e-3, 250 steps.

An explicit option (``ce_weight``, ``steps``, ...) overrides the preset's value.

Differences from both authors' code: the marginal entropy takes its log of ``max(p, 1e-30)``
(theirs has no guard, so a class whose mean probability underflows gives ``0 * log 0 = NaN``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers._optim import NativeLoss, Padding, fit_logit_loss, logit_loss_flops
from poodle.solvers._transductive import TINY, dist_flops, softmax_logits
from poodle.solvers.base import (
    EpisodeBatch,
    SolverOutput,
    class_means,
    mask_classes,
    one_hot,
    register,
    validate_config,
)

PRESETS: dict[str, dict[str, Any]] = {
    # mboudiaf/TIM: src/tim.py config (temp 15, loss_weights [0.1, 1.0, 0.1]) and
    # scripts/evaluate/tim_gd/*.sh (tim.iter=1000, lr 1e-4).
    "tim": dict(
        ce_weight=0.1,
        marginal_weight=1.0,
        conditional_weight=0.1,
        temperature=15.0,
        learn_temperature=False,
        lr=1e-4,
        steps=1000,
    ),
    # POODLE release src/fsl/tim.py (docs/reference.md §2): alpha 10, beta 1, CE 1, scale init 10
    # learnable, Adam lr 1e-3, number_fc_update 250.
    "poodle-paper": dict(
        ce_weight=1.0,
        marginal_weight=10.0,
        conditional_weight=1.0,
        temperature=10.0,
        learn_temperature=True,
        lr=1e-3,
        steps=250,
    ),
}


@dataclass(frozen=True)
class TimGDConfig:
    """TIM-GD options. A field left ``None`` takes the preset's value when the config is built (see
    :data:`PRESETS`), so a built config holds the values used."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS

    preset: str = "tim"
    ce_weight: float | None = option(None, min=0)
    marginal_weight: float | None = option(None, min=0)
    conditional_weight: float | None = option(None, min=0)
    temperature: float | None = option(None, min=0, min_open=True)  # initial value when learn_temperature
    learn_temperature: bool | None = None
    lr: float | None = option(None, min=0, min_open=True)
    steps: int | None = option(None, min=0)

    def __post_init__(self) -> None:
        validate_config(self, "tim-gd")

    def resolved(self) -> dict[str, Any]:
        """The settings used, by name (the preset's, overridden by the options given)."""
        return {k: getattr(self, k) for k in PRESETS[self.preset]}


def tim_loss(logits_s: Tensor, y_s: Tensor, logits_q: Tensor, w_ce: float, w_marg: float, w_cond: float) -> Tensor:
    """TIM's loss per episode ``[E]``: ``w_ce*CE - (w_marg*H(Y_q) - w_cond*H(Y_q|X_q))``.

    ``logits_s [E, Ns, K]``, ``y_s [E, Ns, K]`` one-hot, ``logits_q [E, Nq, K]``. Means over samples
    within an episode, as the TIM authors.
    """
    ce = -(y_s * torch.log_softmax(logits_s, -1)).sum(-1).mean(1)
    p_q = torch.softmax(logits_q, -1)
    cond_ent = -(p_q * torch.log(p_q + 1e-12)).sum(-1).mean(1)
    marg = p_q.mean(1)
    marg_ent = -(marg * torch.log(marg.clamp_min(TINY))).sum(-1)
    return w_ce * ce - (w_marg * marg_ent - w_cond * cond_ent)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: TimGDConfig) -> float:
    # what the fit computes (two products a step, no autograd graph), then the queries' logits
    return logit_loss_flops(Ns + Nq, D, way, int(cfg.steps or 0)) + dist_flops(Nq, way, D)


@register(
    "tim-gd",
    TimGDConfig,
    transductive="always",
    flops=_flops,
    aliases=("tim",),
    summary="TIM-GD (Boudiaf et al. 2020): CE + query mutual information, Adam on the prototypes",
    floor=dict(matmul="large", fixed_steps=True),
    triton_step=True,  # its loss is one the Triton step knows
)
def tim_gd(batch: EpisodeBatch, cfg: TimGDConfig) -> SolverOutput:
    """Solve ``batch`` with TIM-GD. Returns ``log_probs [E, Nq, way]`` and state ``prototypes
    [E, way, D]``, ``scale [E, 1, 1]``."""
    s = cfg.resolved()
    z_s, z_q = batch.support, batch.query
    Ns, Nq = z_s.shape[1], z_q.shape[1]
    w0 = class_means(z_s, batch.support_labels, batch.way)
    y_t = one_hot(batch.support_labels, batch.way, z_s.dtype).transpose(1, 2)  # [E, K, Ns]
    w_ce, w_marg, w_cond = s["ce_weight"], s["marginal_weight"], s["conditional_weight"]
    padding = Padding.of(batch.class_mask, (batch.support_mask, Ns), (batch.query_mask, Nq))

    def grad_logits(P: Tensor, L: Tensor, G: Tensor) -> None:
        # dL/dlogits of tim_loss, row by row (rows along the last axis: support, then queries)
        torch.sub(P[..., :Ns], y_t, out=G[..., :Ns]).mul_(w_ce / Ns)
        pq = P[..., Ns:]
        marg = pq.mean(2, keepdim=True)  # [E, K, 1]
        # d(-w_marg * H(marg)) / d marg = w_marg * (log marg + 1), the clamp's zero gradient included
        u = (torch.log(marg.clamp_min(TINY)) + (marg >= TINY).to(P.dtype)).mul_(w_marg)
        # d(w_cond * H(p)) / dp = -w_cond * (log(p + 1e-12) + p / (p + 1e-12)), H as in tim_loss
        a = torch.log(pq + 1e-12).add_(pq / (pq + 1e-12))
        u = (u - w_cond * a).div_(Nq)  # dL/dp for every query row [E, K, Nq]
        # through the softmax: dL/dl_j = p_j (u_j - sum_k p_k u_k)
        torch.mul(pq, u - (pq * u).sum(1, keepdim=True), out=G[..., Ns:])

    w, scale = fit_logit_loss(
        torch.cat([z_s, z_q], 1),
        w0,
        grad_logits if padding is None else ragged_tim_grad(batch, y_t, w_ce, w_marg, w_cond),
        scale0=s["temperature"],
        steps=s["steps"],
        lr=s["lr"],
        learn_scale=s["learn_temperature"],
        native=NativeLoss("tim", Ns, y_t, (w_ce, w_marg, w_cond)),
        padding=padding,
    )
    log_probs = torch.log_softmax(mask_classes(softmax_logits(z_q, w, scale), batch), -1)
    return SolverOutput(log_probs, {"prototypes": w, "scale": scale})


def ragged_rows(batch: EpisodeBatch, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A ragged chunk's row weights for the logit losses: ``[E, 1, Ns]`` and ``[E, 1, Nq]`` (1 on a
    real row, 0 on padding) and each episode's real support and query counts ``[E, 1, 1]``."""
    E, Ns, Nq = batch.n_episodes, batch.support.shape[1], batch.query.shape[1]
    dev = batch.support.device
    sm = torch.ones(E, 1, Ns, dtype=dtype, device=dev) if batch.support_mask is None else batch.support_mask
    qm = torch.ones(E, 1, Nq, dtype=dtype, device=dev) if batch.query_mask is None else batch.query_mask
    sm, qm = sm.to(dtype).view(E, 1, Ns), qm.to(dtype).view(E, 1, Nq)
    return sm, qm, sm.sum(2, keepdim=True), qm.sum(2, keepdim=True)


def ragged_tim_grad(
    batch: EpisodeBatch, y_t: Tensor, w_ce: float, w_marg: float, w_cond: float
) -> Callable[[Tensor, Tensor, Tensor], None]:
    """TIM's ``grad_logits`` on a ragged chunk: the support CE a mean over each episode's real
    support rows, the marginal and the conditional entropy over its real queries (a padded row
    takes no weight; a padded class has ``P = 0``, so no probability and no marginal mass)."""
    Ns = batch.support.shape[1]
    sm, qm, ns, nq = ragged_rows(batch, y_t.dtype)

    def grad_logits(P: Tensor, L: Tensor, G: Tensor) -> None:
        torch.sub(P[..., :Ns], y_t, out=G[..., :Ns]).mul_(sm * (w_ce / ns))
        pq = P[..., Ns:]
        marg = (pq * qm).sum(2, keepdim=True) / nq  # [E, K, 1]: over the real queries
        u = (torch.log(marg.clamp_min(TINY)) + (marg >= TINY).to(P.dtype)).mul_(w_marg)
        a = torch.log(pq + 1e-12).add_(pq / (pq + 1e-12))
        u = (u - w_cond * a).div_(nq)
        torch.mul(pq, u - (pq * u).sum(1, keepdim=True), out=G[..., Ns:]).mul_(qm)

    return grad_logits
