"""Transductive fine-tuning by entropy minimisation, on the classifier only.

Guneet S. Dhillon, Pratik Chaudhari, Avinash Ravichandran, Stefano Soatto. "A Baseline for
Few-Shot Image Classification", ICLR 2020, arXiv:1909.02729.

The classifier's weights start at the support class means (Dhillon et al.'s "support-based
initialisation"); logits are ``-(scale/2)||z - w_k||^2``. Adam minimises, per episode, the support
cross-entropy plus ``entropy_weight`` times the mean Shannon entropy of the query predictions.
Transductive. The gradient of that loss is written out (``grad_logits``) and the fit runs in
:func:`~poodle.solvers._optim.fit_logit_loss` (the fused kernel on CPU), like TIM-GD's: autograd
of the same expression gave the same predictions on every one of 2,000 demo episodes per shot,
about ten times slower.

Difference from the paper: Dhillon et al. fine-tune the whole backbone; here only the classifier
(the backbone's features are cached). With the paper's learning rate (5e-5) and 25 epochs, Adam
moves each prototype by about ``25 * 5e-5 * sqrt(D)`` whatever the gradient's size, so whether the
result stays close to the nearest-prototype classifier depends on the features' margins: on the
demo's glyph features it changes 0.5% of the 1-shot predictions, on low-margin features far more
(docs/transductive.md has the measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers._optim import NativeLoss, Padding, fit_logit_loss, logit_loss_flops
from poodle.solvers._transductive import dist_flops, softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, one_hot, register
from poodle.solvers.tim_gd import ragged_rows


@dataclass(frozen=True)
class EntropyMinConfig:
    steps: int = option(25, min=0)  # Dhillon et al.: 25 epochs (one step on support + query each)
    lr: float = option(5e-5, min=0, min_open=True)  # Dhillon et al.: Adam, lr 5e-5
    entropy_weight: float = option(1.0, min=0)  # Dhillon et al.: CE + entropy, unit weight
    scale: float = option(10.0, min=0, min_open=True)  # fixed temperature (the POODLE authors' initial scale)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: EntropyMinConfig) -> float:
    # what the fit computes (two products a step, no autograd graph), then the queries' logits
    return logit_loss_flops(Ns + Nq, D, way, cfg.steps) + dist_flops(Nq, way, D)


@register(
    "entropy-min",
    EntropyMinConfig,
    transductive="always",
    flops=_flops,
    summary="Transductive entropy minimisation on the classifier (Dhillon et al. 2020)",
    floor=dict(matmul="large", fixed_steps=True),
    triton_step=True,  # its loss is one the Triton step knows
)
def entropy_min(batch: EpisodeBatch, cfg: EntropyMinConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes [E, way, D]``."""
    z_s, z_q = batch.support, batch.query
    Ns, Nq = z_s.shape[1], z_q.shape[1]
    y_t = one_hot(batch.support_labels, batch.way, z_s.dtype).transpose(1, 2)  # [E, K, Ns]
    w0 = class_means(z_s, batch.support_labels, batch.way)
    c = cfg.entropy_weight / Nq

    # The loss, per episode: mean_s CE(log_softmax(l_s), y) + entropy_weight * mean_q H(softmax(l_q)),
    # l = scale * (z.w - |w|^2/2). Its gradient is written out (what autograd of that expression
    # gives, to rounding) so that the fit runs in fit_logit_loss's buffers, or the fused kernel,
    # instead of recording 25 autograd graphs.
    def grad_logits(P: Tensor, L: Tensor, G: Tensor) -> None:
        # rows along the last axis: support, then queries
        torch.sub(P[..., :Ns], y_t, out=G[..., :Ns]).div_(Ns)
        pq, logp = P[..., Ns:], torch.log_softmax(L[..., Ns:], 1)
        # dH/dl_j = -p_j (log p_j - sum_k p_k log p_k)
        torch.mul(pq, logp - (pq * logp).sum(1, keepdim=True), out=G[..., Ns:]).mul_(-c)

    padding = Padding.of(batch.class_mask, (batch.support_mask, Ns), (batch.query_mask, Nq))
    if padding is not None:
        sm, qm, ns, nq = ragged_rows(batch, z_s.dtype)
        cm = batch.class_mask
        pad = None if cm is None else ~cm.unsqueeze(-1)  # [E, K, 1]

        def ragged_grad_logits(P: Tensor, L: Tensor, G: Tensor) -> None:
            # the same means over each episode's own support rows and queries; log p over its classes
            torch.sub(P[..., :Ns], y_t, out=G[..., :Ns]).mul_(sm / ns)
            pq, lq = P[..., Ns:], L[..., Ns:]
            logp = torch.log_softmax(lq if pad is None else lq.masked_fill(pad, float("-inf")), 1)
            if pad is not None:
                logp = logp.masked_fill(pad, 0.0)
            g = torch.mul(pq, logp - (pq * logp).sum(1, keepdim=True), out=G[..., Ns:])
            g.mul_(qm * (-cfg.entropy_weight / nq))

        grad_logits = ragged_grad_logits

    w, _ = fit_logit_loss(
        torch.cat([z_s, z_q], 1),
        w0,
        grad_logits,
        scale0=cfg.scale,
        steps=cfg.steps,
        lr=cfg.lr,
        learn_scale=False,
        native=NativeLoss("entropy", Ns, y_t, (1.0, cfg.entropy_weight, 0.0)),
        padding=padding,
    )
    log_probs = torch.log_softmax(mask_classes(softmax_logits(z_q, w, cfg.scale), batch), -1)
    return SolverOutput(log_probs, {"prototypes": w})
