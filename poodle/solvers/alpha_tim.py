"""alpha-TIM: TIM with alpha-entropies, for query sets with arbitrary class proportions.

Olivier Veilleux, Malik Boudiaf, Pablo Piantanida, Ismail Ben Ayed. "Realistic Evaluation of
Transductive Few-Shot Learning", NeurIPS 2021, arXiv:2204.11181.

TIM-GD's objective with the Shannon entropies of the query marginal and of the query predictions
replaced by Tsallis alpha-entropies ``H_a(p) = (1 - sum_k p_k^a) / (a - 1)``; the support term stays
the Shannon cross-entropy. Per episode, Adam minimises

    ce_weight * CE(support) - (marginal_weight * H_a(mean_q p_q) - conditional_weight * mean_q H_a(p_q))

over the prototypes (initialised at the support means), with logits ``-(T/2)||z - w_k||^2`` at a
fixed temperature ``T``. A larger ``a`` flattens the marginal term's push towards uniform class
proportions, which is what keeps alpha-TIM from collapsing on imbalanced (Dirichlet) query sets.
The authors evaluate on Dirichlet(2) query proportions: ``poodle solve --imbalance 2``.
Transductive.

Defaults are the authors' released configuration (oveilleux/Realistic_Transductive_Few_Shot,
``config/*/methods_config/alpha_tim.yaml``, identical in the balanced and Dirichlet folders):
temperature 15, loss weights [1, 1, 1], Adam lr 1e-4, 1000 iterations, and
``use_tuned_alpha_values: True``, which sets ``a = 2`` at 1 shot and ``a = 7`` from 5 shots
(``a = 5``, the yaml's value, in between); ``alpha = 0`` here means exactly that rule.

Differences from the authors' code: the support cross-entropy uses ``log_softmax`` where theirs
takes ``log(softmax + 1e-12)``; the query probabilities inside the alpha-entropy of the
predictions get the same ``+1e-12`` as theirs; the loss is summed over the episodes of a chunk,
as theirs over their task batch (Adam is element-wise, so each episode is optimised as if alone).
benchmarks/compare_official.py runs their class on the same episodes (docs/transductive.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers._optim import NativeLoss, Padding, fit_logit_loss, logit_loss_flops
from poodle.solvers._transductive import dist_flops, pow_anywhere, softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, one_hot, register
from poodle.solvers.tim_gd import ragged_rows


@dataclass(frozen=True)
class AlphaTimConfig:
    MEANINGS: ClassVar[dict[str, str]] = {"alpha": "alpha-entropy order"}  # see base.MEANINGS

    # 0: the authors' tuned value (2 at 1 shot, 7 from 5 shots, else 5)
    alpha: float = option(0.0, min=0, exclude={1.0: "the Shannon limit: use tim-gd"})
    ce_weight: float = option(1.0, min=0)
    marginal_weight: float = option(1.0, min=0)
    conditional_weight: float = option(1.0, min=0)
    temperature: float = option(15.0, min=0, min_open=True)
    lr: float = option(1e-4, min=0, min_open=True)
    steps: int = option(1000, min=0)


def tuned_alpha(shot: int) -> float:
    """The authors' ``get_alpha_values``: 2 at 1 shot, 7 from 5 shots, the yaml's 5 otherwise."""
    return 2.0 if shot == 1 else 7.0 if shot >= 5 else 5.0


def alpha_entropy(p: Tensor, a: float) -> Tensor:
    """Tsallis entropy ``(1 - sum_k p_k^a) / (a - 1)`` over the last axis."""
    return (1.0 - p.pow(a).sum(-1)) / (a - 1.0)


def alpha_tim_loss(
    logits_s: Tensor, y_s: Tensor, logits_q: Tensor, a: float, w_ce: float, w_marg: float, w_cond: float
) -> Tensor:
    """alpha-TIM's loss per episode ``[E]``; ``logits_s [E, Ns, K]``, ``y_s [E, Ns, K]`` one-hot,
    ``logits_q [E, Nq, K]``."""
    ce = -(y_s * torch.log_softmax(logits_s, -1)).sum(-1).mean(1)
    p_q = torch.softmax(logits_q, -1)
    marg = alpha_entropy(p_q.mean(1), a)
    cond = alpha_entropy(p_q + 1e-12, a).mean(1)
    return w_ce * ce - (w_marg * marg - w_cond * cond)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: AlphaTimConfig) -> float:
    # what the fit computes (two products a step, no autograd graph), then the queries' logits
    return logit_loss_flops(Ns + Nq, D, way, cfg.steps) + dist_flops(Nq, way, D)


@register(
    "alpha-tim",
    AlphaTimConfig,
    transductive="always",
    flops=_flops,
    summary="alpha-TIM (Veilleux et al. 2021): TIM with alpha-entropies, robust to imbalanced queries",
    floor=dict(matmul="large", fixed_steps=True),
    triton_step=True,  # its loss is one the Triton step knows
    flags={"entropy_alpha": "alpha"},
)
def alpha_tim(batch: EpisodeBatch, cfg: AlphaTimConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes [E, way, D]``."""
    if not batch.ragged:
        w = _fit(batch, cfg.alpha if cfg.alpha > 0 else tuned_alpha(batch.shot), cfg)  # tuned values are never 1
    else:
        # each episode its own tuned order (from its own shots): one fit per order
        E = batch.n_episodes
        n_support = batch.support_labels.ge(0).sum(1)
        shots = n_support // (batch.ways if batch.ways is not None else batch.way)
        orders = [cfg.alpha if cfg.alpha > 0 else tuned_alpha(int(s)) for s in shots.tolist()]
        w = torch.empty(E, batch.way, batch.support.shape[2], dtype=batch.support.dtype, device=batch.support.device)
        for a in sorted(set(orders)):
            idx = torch.tensor([e for e in range(E) if orders[e] == a], device=w.device)
            w[idx] = _fit(batch if len(idx) == E else _select(batch, idx), a, cfg)
    log_probs = torch.log_softmax(mask_classes(softmax_logits(batch.query, w, cfg.temperature), batch), -1)
    return SolverOutput(log_probs, {"prototypes": w})


def _select(batch: EpisodeBatch, idx: Tensor) -> EpisodeBatch:
    """The episodes ``idx`` of a ragged chunk, padded as in the chunk."""

    def pick(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[idx]

    s, y, q = batch.support[idx], batch.support_labels[idx], batch.query[idx]
    return EpisodeBatch(
        s, y, q, pick(batch.negatives), batch.way, pick(batch.ways), pick(batch.support_mask), pick(batch.query_mask)
    )


def _fit(batch: EpisodeBatch, a: float, cfg: AlphaTimConfig) -> Tensor:
    """The prototypes ``[E, way, D]`` of the episodes of ``batch``, all of alpha-entropy order ``a``."""
    z_s, z_q = batch.support, batch.query
    Ns, Nq = z_s.shape[1], z_q.shape[1]
    y_t = one_hot(batch.support_labels, batch.way, z_s.dtype).transpose(1, 2)  # [E, K, Ns]
    w_ce, w_marg, w_cond = cfg.ce_weight, cfg.marginal_weight, cfg.conditional_weight
    padding = Padding.of(batch.class_mask, (batch.support_mask, Ns), (batch.query_mask, Nq))
    # the weights of the rows and the means' counts: plain numbers for a fixed chunk, [E, 1, *] else
    sm: Tensor | float = 1.0
    qm: Tensor | float = 1.0
    ns: Tensor | float = Ns
    nq: Tensor | float = Nq
    if padding is not None:
        sm, qm, ns, nq = ragged_rows(batch, z_s.dtype)

    def grad_logits(P: Tensor, L: Tensor, G: Tensor) -> None:
        # dL/dlogits of alpha_tim_loss, row by row (rows along the last axis: support, then queries)
        torch.sub(P[..., :Ns], y_t, out=G[..., :Ns]).mul_(w_ce / Ns)
        pq = P[..., Ns:]
        marg = pq.mean(2, keepdim=True)  # [E, K, 1]
        # d(-w_marg H_a(marg) + w_cond H_a(p + 1e-12)) / dp, with dH_a(q)/dq = -a q^(a-1) / (a - 1)
        u = (pow_anywhere(marg, a - 1.0).mul_(w_marg) - pow_anywhere(pq + 1e-12, a - 1.0).mul_(w_cond)).mul_(
            a / ((a - 1.0) * Nq)
        )
        # through the softmax: dL/dl_j = p_j (u_j - sum_k p_k u_k)
        torch.mul(pq, u - (pq * u).sum(1, keepdim=True), out=G[..., Ns:])

    def ragged_grad_logits(P: Tensor, L: Tensor, G: Tensor) -> None:
        # the same over each episode's real rows: means over its own support rows and queries
        torch.sub(P[..., :Ns], y_t, out=G[..., :Ns]).mul_(sm * (w_ce / ns))
        pq = P[..., Ns:]
        marg = (pq * qm).sum(2, keepdim=True) / nq
        u = (pow_anywhere(marg, a - 1.0).mul_(w_marg) - pow_anywhere(pq + 1e-12, a - 1.0).mul_(w_cond)).mul_(
            a / ((a - 1.0) * nq)
        )
        torch.mul(pq, u - (pq * u).sum(1, keepdim=True), out=G[..., Ns:]).mul_(qm)

    w, _ = fit_logit_loss(
        torch.cat([z_s, z_q], 1),
        class_means(z_s, batch.support_labels, batch.way),
        grad_logits if padding is None else ragged_grad_logits,
        scale0=cfg.temperature,
        steps=cfg.steps,
        lr=cfg.lr,
        learn_scale=False,
        # the loss for the fused CPU kernel and the Triton step
        native=NativeLoss("alpha", Ns, y_t, (w_ce, w_marg, w_cond), alpha=a),
        padding=padding,
    )
    return w
