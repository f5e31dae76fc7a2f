"""BD-CSPN: bias-diminishing cosine-similarity prototypical network (prototype rectification).

Jinlu Liu, Liang Song, Yongqiang Qin. "Prototype Rectification for Few-Shot Learning", ECCV 2020,
arXiv:1911.10713.

Two corrections of the support-mean prototypes, then a cosine classifier. Cross-class bias: shift
every query by ``mean(support) - mean(query)``. Intra-class bias: pseudo-label the shifted queries
by their nearest prototype (cosine); each class's rectified prototype is the average of its
support points and pseudo-labelled queries, weighted by ``softmax(epsilon * cos(x, P_k))`` within
the class. Queries (shifted) are classified by ``softmax(epsilon * cos(x, P'_k))``. Transductive.

Relation to the POODLE authors' code: their "Mean-shift" row (``laplacian.py``, which cannot run as
shipped; docs/reference.md §2) is this rectification with ``softmax`` over *classes* as weights
(the LaplacianShot authors' version); here the weights follow the BD-CSPN paper (normalised over
the class's members). All queries predicted in a class join it (the paper keeps the top-Z; the
LaplacianShot and POODLE authors keep all). Nothing can be 0/0: every class has its support points.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poodle.options import option
from poodle.solvers._transductive import dist_flops, rectified_prototypes, shifted_cosine
from poodle.solvers.base import EpisodeBatch, SolverOutput, mask_classes, register


@dataclass(frozen=True)
class BDCSPNConfig:
    epsilon: float = option(10.0, min=0, min_open=True)  # Liu et al. Sec. 4: epsilon = 10
    shift: bool = True  # the cross-class bias reduction


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: BDCSPNConfig) -> float:
    return 2 * dist_flops(Ns + Nq, way, D) + dist_flops(Nq, way, D)


@register(
    "bd-cspn",
    BDCSPNConfig,
    transductive="always",
    flops=_flops,
    summary="BD-CSPN prototype rectification (Liu et al. 2020)",
)
def bd_cspn(batch: EpisodeBatch, cfg: BDCSPNConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes [E, way, D]`` (rectified)."""
    z_q = batch.query
    p, delta, q_norm = rectified_prototypes(
        batch.support, batch.support_labels, z_q, batch.way, cfg.epsilon, cfg.shift, pad=batch
    )
    log_probs = torch.log_softmax(mask_classes(cfg.epsilon * shifted_cosine(z_q, delta, p, q_norm), batch), -1)
    return SolverOutput(log_probs, {"prototypes": p})
