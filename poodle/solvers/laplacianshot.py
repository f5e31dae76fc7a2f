"""LaplacianShot: Laplacian-regularised transductive inference by bound optimisation.

Imtiaz Masud Ziko, Jose Dolz, Eric Granger, Ismail Ben Ayed. "Laplacian Regularized Few-Shot
Learning", ICML 2020, arXiv:2006.15486.

Minimises, per episode, ``sum_q y_q . a_q - lambda sum_{q,q'} w_{qq'} y_q . y_q'`` over query
assignments ``y_q`` on the simplex, with unary ``a_q[k] = ||z_q - m_k||^2`` to the prototypes
``m_k`` (BD-CSPN-rectified by default, as the authors' released runs) and ``w`` the kNN graph of
the queries (``w_{qq'} = 1`` when ``q'`` is among the ``knn`` nearest other queries of ``q``).
The concave-convex bound gives independent closed-form updates ``y_q = softmax(-a_q + lambda
sum_q' w_{qq'} y_q')``, iterated until the bound's energy changes by at most ``tol`` (relative) or
for ``steps`` iterations; each episode stops on its own (a mask). Transductive.

Differences from the POODLE authors' ``laplacian.py`` (docs/reference.md §2; it cannot run as
shipped): batched over episodes (kNN by ``torch.cdist`` + ``topk`` per episode batch, no
scikit-learn); ``knn``, ``lmd`` have values (theirs referenced undefined options); a class with no
predicted sample keeps its prototype (theirs dropped it, shrinking the prototype list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from poodle.solvers._transductive import TINY, dist_flops, rectified_prototypes, sqdist
from poodle.solvers.base import EpisodeBatch, SolverOutput, class_means, register


@dataclass
class LaplacianShotConfig:
    # intervals checked by solvers.base.validate_config (lr, steps, scale, ... have common ones)
    BOUNDS: ClassVar[dict[str, str]] = {
        "knn": "[1, inf)",
        "lmd": "[0, inf)",
        "tol": "[0, inf)",
        "epsilon": "(0, inf)"}
    knn: int = 3              # Ziko et al.: k = 3 nearest neighbours
    lmd: float = 0.7          # lambda; tuned on validation in the paper (their grid 0.1..1.0)
    steps: int = 20           # bound iterations (authors' bound_update default)
    tol: float = 1e-6         # relative energy change that stops an episode
    rectify: bool = True      # BD-CSPN prototype rectification (the authors' proto_rect)
    epsilon: float = 10.0     # rectification temperature


def knn_graph(z_q: Tensor, k: int) -> Tensor:
    """``z_q [E, Nq, D]`` -> ``[E, Nq, Nq]`` 0/1 affinity: row ``q`` marks its ``k`` nearest other
    queries (Euclidean; self excluded; ``k`` clipped to ``Nq - 1``)."""
    E, n, _ = z_q.shape
    k = min(k, n - 1)
    w = torch.zeros(E, n, n, dtype=z_q.dtype, device=z_q.device)
    if k <= 0:
        return w
    d = torch.cdist(z_q, z_q)
    d = d + torch.diag(torch.full((n,), float("inf"), dtype=d.dtype, device=d.device))
    idx = d.topk(k, dim=-1, largest=False).indices
    return w.scatter(2, idx, 1.0)


def bound_energy(y: Tensor, unary: Tensor, w: Tensor, lmd: float) -> Tensor:
    """The authors' energy ``sum(y*a - lmd*(W y)*y + y*log y)`` per episode ``[E]``."""
    pair = torch.bmm(w, y)
    return (unary * y - lmd * pair * y + y * torch.log(y.clamp_min(1e-20))).sum((1, 2))


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: LaplacianShotConfig) -> float:
    rect = 3 * dist_flops(Ns + Nq, way, D) if cfg.rectify else 0.0
    return rect + dist_flops(Nq, Nq, D) + dist_flops(Nq, way, D) + cfg.steps * 2 * dist_flops(Nq, way, Nq)


@register("laplacianshot", LaplacianShotConfig, transductive="always", flops=_flops,
          summary="LaplacianShot (Ziko et al. 2020): kNN Laplacian regularisation, bound updates")
def laplacianshot(batch: EpisodeBatch, cfg: LaplacianShotConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]`` (log of the final assignments ``Y``); state
    ``prototypes [E, way, D]``, ``iterations [E]``."""
    z_s, z_q = batch.support, batch.query
    if cfg.rectify:
        m, _ = rectified_prototypes(z_s, batch.support_labels, z_q, batch.way, cfg.epsilon)
    else:
        m = class_means(z_s, batch.support_labels, batch.way)
    unary = sqdist(z_q, m)                                              # [E, Nq, way]
    w = knn_graph(z_q, cfg.knn)
    logits = -unary
    y = torch.softmax(logits, -1)
    E = z_q.shape[0]
    active = torch.ones(E, dtype=torch.bool, device=z_q.device)
    old = torch.full((E,), float("inf"), dtype=z_q.dtype, device=z_q.device)
    iters = torch.zeros(E, dtype=torch.long, device=z_q.device)
    for i in range(cfg.steps):
        new_logits = -unary + cfg.lmd * torch.bmm(w, y)
        new_y = torch.softmax(new_logits, -1)
        keep = ~active
        logits = torch.where(keep[:, None, None], logits, new_logits)
        y = torch.where(keep[:, None, None], y, new_y)
        iters = iters + active.long()
        energy = bound_energy(y, unary, w, cfg.lmd)
        done = (energy - old).abs() <= cfg.tol * old.abs() if i > 1 else torch.zeros_like(active)
        old = torch.where(active, energy, old)
        active = active & ~done
        if not bool(active.any()):
            break
    log_probs = torch.log_softmax(logits, -1)
    return SolverOutput(log_probs, {"prototypes": m, "iterations": iters, "assignments": y.clamp_min(TINY)})
