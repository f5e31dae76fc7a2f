"""Transductive fine-tuning by entropy minimisation, on the classifier only.

Guneet S. Dhillon, Pratik Chaudhari, Avinash Ravichandran, Stefano Soatto. "A Baseline for
Few-Shot Image Classification", ICLR 2020, arXiv:1909.02729.

The classifier's weights start at the support class means (Dhillon et al.'s "support-based
initialisation"); logits are ``-(scale/2)||z - w_k||^2``. Adam minimises, per episode, the support
cross-entropy plus ``entropy_weight`` times the mean Shannon entropy of the query predictions.
Transductive.

Difference from the paper: Dhillon et al. fine-tune the whole backbone; here only the classifier
(the backbone's features are cached). With the paper's learning rate (5e-5) and 25 epochs, Adam
moves each prototype by about ``25 * 5e-5 * sqrt(D)`` whatever the gradient's size, so whether the
result stays close to the nearest-prototype classifier depends on the features' margins: on the
demo's glyph features it changes 0.5% of the 1-shot predictions, on low-margin features far more
(docs/transductive.md has the measurements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from poodle.solvers._transductive import adam_minimise, dist_flops, grad_ready, softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, one_hot, register


@dataclass
class EntropyMinConfig:
    BOUNDS: ClassVar[dict[str, str]] = {"entropy_weight": "[0, inf)"}  # checked by solvers.base.validate_config
    steps: int = 25  # Dhillon et al.: 25 epochs (one step on support + query each)
    lr: float = 5e-5  # Dhillon et al.: Adam, lr 5e-5
    entropy_weight: float = 1.0  # Dhillon et al.: CE + entropy, unit weight
    scale: float = 10.0  # fixed temperature (the POODLE authors' initial scale)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: EntropyMinConfig) -> float:
    return 3.0 * cfg.steps * dist_flops(Ns + Nq, way, D)


@register(
    "entropy-min",
    EntropyMinConfig,
    transductive="always",
    flops=_flops,
    summary="Transductive entropy minimisation on the classifier (Dhillon et al. 2020)",
)
def entropy_min(batch: EpisodeBatch, cfg: EntropyMinConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes [E, way, D]``."""
    z_s, z_q = grad_ready(batch.support), grad_ready(batch.query)
    y_s = one_hot(batch.support_labels, batch.way, z_s.dtype)
    w = class_means(z_s, batch.support_labels, batch.way).detach().clone().requires_grad_(True)

    def loss() -> Tensor:
        ce = -(y_s * torch.log_softmax(softmax_logits(z_s, w, cfg.scale), -1)).sum(-1).mean(1)
        logp = torch.log_softmax(softmax_logits(z_q, w, cfg.scale), -1)
        ent = -(logp.exp() * logp).sum(-1).mean(1)
        return (ce + cfg.entropy_weight * ent).sum()

    adam_minimise([w], loss, cfg.steps, cfg.lr)
    with torch.no_grad():
        log_probs = torch.log_softmax(softmax_logits(z_q, w, cfg.scale), -1)
    return SolverOutput(log_probs, {"prototypes": w.detach()})
