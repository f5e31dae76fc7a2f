"""Nearest prototype: the baseline of every table of

    Le, Nguyen, Nguyen, Tran, Nguyen, Hua. "POODLE: Improving Few-shot Learning via Penalizing
    Out-of-Distribution Samples". NeurIPS 2021, arXiv:2206.04679

("cosine" / "baseline" rows; Snell et al. 2017's prototypes on L2-normalised features). The
prototype of a class is the mean of its normalised support features (not re-normalised, as the
authors' code), a query goes to the nearest prototype in Euclidean distance; no fine-tuning.
Inductive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poodle.options import option
from poodle.solvers._transductive import softmax_logits
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, mask_classes, register


@dataclass(frozen=True)
class ProtoConfig:
    # authors' distance_based_classifier: gamma = 10 (calibration only, not argmax)
    scale: float = option(10.0, min=0, min_open=True)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: ProtoConfig) -> float:
    return 2.0 * Ns * D + 2.0 * Nq * D * way + 3.0 * way * D


@register(
    "proto",
    ProtoConfig,
    transductive="never",
    uses_negatives=False,
    flops=_flops,
    summary="nearest class mean of the normalised support features (no fine-tuning)",
)
def proto(batch: EpisodeBatch, cfg: ProtoConfig) -> SolverOutput:
    """Prototypes ``[E, way, D]`` = class means; log-probs ``[E, Nq, way]`` of ``-(scale/2)||q - w||^2``
    (a ragged chunk's padded classes -inf)."""
    w = class_means(batch.support, batch.support_labels, batch.way)
    scale = torch.full((w.shape[0], 1, 1), cfg.scale, dtype=w.dtype, device=w.device)
    logits = mask_classes(softmax_logits(batch.query, w, scale), batch)
    return SolverOutput(torch.log_softmax(logits, -1), {"prototypes": w, "scale": scale})
