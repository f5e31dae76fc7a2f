"""Soft k-means prototype refinement.

Mengye Ren, Eleni Triantafillou, Sachin Ravi, Jake Snell, Kevin Swersky, Joshua B. Tenenbaum,
Hugo Larochelle, Richard S. Zemel. "Meta-Learning for Semi-Supervised Few-Shot Classification",
ICLR 2018, arXiv:1803.00676 (Sec. 4.1, "Prototypical Networks with Soft k-Means").

Prototypes start at the support class means. Each refinement step soft-assigns every query to the
classes by ``softmax(-(scale/2)||z_q - p_k||^2)`` and recomputes each prototype as the mean of its
support points (hard labels) and of all queries weighted by their soft assignment. Queries are then
classified by the same softmax against the refined prototypes. Transductive.

Differences from the POODLE authors' ``soft_kmeans``: theirs soft-assigned the *support* points too
(ignoring their labels); here, as in Ren et al., support points count fully for their own class
(``fix_support=False`` gives their behaviour). The prediction uses the same scale as the assignment
(theirs used scale 1, which does not change the argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

from poodle.options import option
from poodle.solvers._transductive import (
    class_softmax,
    dist_flops,
    row_weight,
    softmax_logits,
    support_share,
    weighted_means,
)
from poodle.solvers.base import EpisodeBatch, SolverOutput, mask_classes, one_hot, register


@dataclass(frozen=True)
class SoftKMeansConfig:
    steps: int = option(1, min=0)  # Ren et al.: a single refinement step
    # Ren et al. use -||x-p||^2 on unnormalised features; on unit features a temperature is needed:
    # the POODLE authors' 10 (as -(10/2)||x-p||^2, their get_logits).
    scale: float = option(10.0, min=0, min_open=True)
    fix_support: bool = True  # support points keep their labels (Ren et al.)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: SoftKMeansConfig) -> float:
    # the support means; per step the queries' logits and the means over the queries (and the
    # support's logits and means when they are re-assigned); the final logits
    per_step = dist_flops(Nq, way, D) * 2 + (2 * dist_flops(Ns, way, D) if not cfg.fix_support else 0.0)
    return dist_flops(Ns, way, D) + cfg.steps * per_step + dist_flops(Nq, way, D)


@register(
    "soft-kmeans",
    SoftKMeansConfig,
    transductive="always",
    flops=_flops,
    summary="Soft k-means refinement of the prototypes (Ren et al. 2018)",
)
def soft_kmeans(batch: EpisodeBatch, cfg: SoftKMeansConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``, state ``prototypes [E, way, D]``, ``assignments``
    (the queries' last soft assignments ``[E, Nq, way]``)."""
    z_s, z_q = batch.support, batch.query
    y_s = one_hot(batch.support_labels, batch.way, z_s.dtype)
    labelled = support_share(y_s, z_s)  # the support's share of an update, and its class means
    p = labelled[0] / labelled[1].clamp_min(1.0).unsqueeze(-1)
    # a ragged chunk: padded classes take no probability, padded rows no weight in the means
    q_w, s_w = batch.query_weight(), row_weight(batch.support_mask, z_s.dtype)
    a_q = None
    for _ in range(cfg.steps):
        a_q = class_softmax(mask_classes(softmax_logits(z_q, p, cfg.scale), batch))
        if q_w is not None:
            a_q = a_q * q_w
        if cfg.fix_support:
            a_s = labelled
        else:
            soft_s = class_softmax(mask_classes(softmax_logits(z_s, p, cfg.scale), batch))
            a_s = support_share(soft_s if s_w is None else soft_s * s_w, z_s)
        p = weighted_means(a_s, a_q, z_q, p)
    logits = mask_classes(softmax_logits(z_q, p, cfg.scale), batch)
    if a_q is None:  # no refinement: the assignments to the support means
        a_q = class_softmax(logits)
    return SolverOutput(class_softmax(logits, log=True), {"prototypes": p, "assignments": a_q})
