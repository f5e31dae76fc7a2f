"""PEMnE-BMS: power/mean/normalisation feature transform, then boosted min-size Sinkhorn.

Yuqing Hu, Stéphane Pateux, Vincent Gripon. "Squeezing Backbone Feature Distributions to the Max
for Efficient Few-Shot Learning", Algorithms 15(5):147, 2022, arXiv:2110.09446.

Features go through "PEMnE": a power transform ``x -> (x + 1e-6)^power``, unit normalisation,
centring on the episode's mean (support and queries together), unit normalisation again. Class
centres start at the unit-normalised support means. Each of ``steps`` iterations:

1. soft assignments of every sample, ``softmax_k(lam * <z, mu_k>)`` (cosine: both are unit), the
   support rows replaced by their one-hot labels;
2. the query block goes through ``sinkhorn_iter`` sweeps of the min-size Sinkhorn: rows
   normalised to 1, then every class whose total mass is below ``min_size`` rescaled to exactly
   ``min_size`` (classes above it are left alone, so the query set may be imbalanced);
3. ``min_size`` becomes the size of the smallest class of the argmax labels (support and queries
   together); it starts at ``shot``;
4. centres = unit-normalised assignment-weighted means of all samples; with ``epochs > 0`` they
   are then refined by ``epochs`` SGD steps (lr, momentum) of a cosine classifier with a learned
   scale on the soft labels, re-normalised after each step.

Queries take the argmax of the last min-size Sinkhorn output. Transductive.

Defaults are the authors' released script (yhu01/BMS ``test_standard_bms.py``, ``--method BMS
--preprocess PEME``): power 0.5, lam 8.5, 20 steps, 50 Sinkhorn sweeps, ``--epoch 0`` (the README
also lists 20 and 40), SGD lr 0.1, momentum 0.8.

Differences from the authors' code: the QR reduction after centring is skipped (an isometry of the
samples' span: no dot product changes); a negative coordinate is transformed as
``sign(x) (|x| + 1e-6)^power`` (their features are post-ReLU, where this is their formula; theirs
gives NaN); episodes need not be balanced nor laid out class by class (theirs reshape
``[shot + queries, way]``). benchmarks/compare_official.py runs their functions on the same
episodes (docs/transductive.md).

On the CPU each episode's min-size sweeps run in one C loop (:mod:`poodle.solvers._sinkhorn_native`)
with the same arithmetic, on CUDA in one Triton program per episode
(:mod:`poodle.solvers._triton_sinkhorn`); elsewhere, or without a C compiler or Triton, the torch
formulation below. In a ragged
chunk each episode's mean, softmax, class sizes (``min_size`` starts at its own ``n_s // ways``) and
sweeps run over its real rows and classes: a padded row is zero after the transform, a padded class
gets no probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from poodle.options import option
from poodle.solvers import _sinkhorn_native, _triton_sinkhorn
from poodle.solvers._span import RowSpan, span_flops, use_gram
from poodle.solvers._transductive import TINY, dist_flops, grad_ready, syncs_freely
from poodle.solvers.base import EpisodeBatch, SolverOutput, one_hot, register
from poodle.solvers.pt_map import (
    centre_,
    fused_transform,
    plan_log_probs,
    plan_shape,
    transformed_rows,
    unit_rows_,
)


@dataclass(frozen=True)
class BMSConfig:
    power: float = option(0.5, min=0, min_open=True)
    lam: float = option(8.5, min=0, min_open=True)
    steps: int = option(20, min=1)
    sinkhorn_iter: int = option(50, min=1)
    epochs: int = option(0, min=0)
    lr: float = option(0.1, min=0, min_open=True)
    momentum: float = option(0.8, min=0, max=1, max_open=True)


def peme(parts: list[Tensor], power: float, mask: Tensor | None = None) -> Tensor:
    """PEMnE on all samples of each episode, ``parts`` (``[E, n_i, D]`` each) stacked along the rows:
    ``[E, sum n_i, D]``. With ``mask [E, sum n_i]`` (real rows), the mean is over the real rows and
    padded rows come out zero. At ``power = 1/2`` on the CPU in the fused library's two passes
    over each episode's rows (:func:`~poodle.solvers._sinkhorn_native.pemne`; float rounding)."""
    if fused_transform(parts[0], power):
        return _sinkhorn_native.pemne(parts, "all", mask, 1e-6**power)
    return unit_rows_(centre_(transformed_rows(parts, power), mask))


def min_size_sinkhorn(
    p: Tensor, min_size: Tensor, n_iter: int, ways: Tensor | None = None, cols: Tensor | None = None
) -> Tensor:
    """``p [E, K, Nq]`` (classes first; overwritten and returned) -> samples (columns) summing to 1
    (before the last class step), every class mass at least ``min_size [E]``. With ``ways [E]`` and
    ``cols [E]`` (a ragged chunk; ``p`` zero outside each episode's first ``ways`` classes and
    ``cols`` samples), each episode over its own sizes.

    On the CPU the fused C loop (:mod:`poodle.solvers._sinkhorn_native`) runs each episode's sweeps,
    on CUDA the Triton loop (:mod:`poodle.solvers._triton_sinkhorn`).
    The torch formulation keeps classes on the middle axis so that both reductions run along vectors
    (see :func:`poodle.solvers.pt_map.balance`); a class above ``min_size`` is divided by exactly 1.
    The authors guard the rescaling against an empty class by summing ``p + 1e-20``; when every
    entry is above ``4e-20 / eps`` that sum is the plain sum, bit for bit (adding 1e-20 rounds back
    to each entry), so on the CPU, where looking costs nothing, the guard's pass is skipped then."""
    if _triton_sinkhorn.usable(p):
        p = p if p.is_contiguous() else p.contiguous()
        return _triton_sinkhorn.run("min-size", p, min_size, n_iter, ways=ways, cols=cols)
    if _sinkhorn_native.usable(p):
        p = p if p.is_contiguous() else p.contiguous()
        return _sinkhorn_native.run("min-size", p, min_size, n_iter, ways=ways, cols=cols)
    target = min_size[:, None].to(p.dtype)  # [E, 1]
    floor = 4e-20 / torch.finfo(p.dtype).eps
    guard: Tensor | None = None
    ragged = ways is not None or cols is not None
    # the guard on an episode's real samples only; a padded sample or class stays zero
    pad = None if cols is None else (torch.arange(p.shape[2], device=p.device) < cols[:, None]).unsqueeze(1)
    for _ in range(n_iter):
        p.div_(p.sum(1, keepdim=True).clamp_min_(TINY) if ragged else p.sum(1, keepdim=True))
        mass = p.sum(2)  # [E, K]
        small = mass < target
        if not syncs_freely(p) or ragged or float(p.amin()) <= floor:
            guard = torch.empty_like(p) if guard is None else guard
            torch.add(p, 1e-20, out=guard)
            mass = (guard.mul_(pad) if pad is not None else guard).sum(2)
            if ragged:
                mass.clamp_min_(TINY)
        p.div_(torch.where(small, mass.div_(target), 1.0).unsqueeze(2))
    return p


def _refine(
    z: Tensor,
    w: Tensor,
    target: Tensor,
    epochs: int,
    lr: float,
    momentum: float,
    classes: Tensor | None = None,
    n_rows: Tensor | None = None,
) -> Tensor:
    """The authors' ``train``: SGD on a cosine classifier ``s * <z, w_k / ||w_k||>`` with soft labels
    ``target [E, N, K]``, centres ``w [E, K, D]`` renormalised after every step; the scale ``s``
    restarts at 1 and is discarded. In a ragged chunk, ``classes [E, K]`` (real classes: a padded
    one takes no probability and stays zero) and ``n_rows [E]`` (real rows, whose targets are the
    only non-zero ones: the mean over rows is over them)."""
    # the one solver with autograd: it leaves the inference mode evaluate solves in
    with torch.inference_mode(False), torch.enable_grad():
        w = grad_ready(w).detach().clone().requires_grad_(True)
        s = torch.ones(z.shape[0], 1, 1, dtype=z.dtype, device=z.device, requires_grad=True)
        zz, target = grad_ready(z), grad_ready(target)
        opt = torch.optim.SGD([w, s], lr=lr, momentum=momentum)
        for _ in range(epochs):
            opt.zero_grad(set_to_none=True)
            scores = torch.bmm(zz, F.normalize(w, dim=-1).transpose(1, 2)) * s
            if classes is None and n_rows is None:
                loss = -(torch.log_softmax(scores, -1) * target).sum(2).mean(1).sum()
            else:
                logp = (
                    torch.log_softmax(scores, -1)
                    if classes is None
                    else torch.log_softmax(scores.masked_fill(~classes.unsqueeze(1), float("-inf")), -1)
                )
                if classes is not None:  # -inf * 0 on a padded class
                    logp = torch.where(classes.unsqueeze(1), logp, 0.0)
                per_row = (logp * target).sum(2)
                loss = -(per_row.sum(1) / (n_rows if n_rows is not None else per_row.shape[1])).sum()
            loss.backward()
            opt.step()
            with torch.no_grad():
                norm = w.norm(dim=-1, keepdim=True)
                w.div_(norm if classes is None else norm.clamp_min_(TINY))
    return w.detach()


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: BMSConfig) -> float:
    refine = cfg.steps * 3 * cfg.epochs * dist_flops(Ns + Nq, way, D)
    gram = cfg.epochs == 0 and use_gram(Ns, Nq, D, way, cfg.steps, cfg.steps)
    return (
        refine
        + span_flops(Ns, Nq, D, way, cfg.steps, cfg.steps, gram)
        + (0 if gram else cfg.steps * 2.0 * way * Ns * D)
    )


@register(
    "bms",
    BMSConfig,
    transductive="always",
    flops=_flops,
    summary="PEMnE-BMS (Hu et al. 2022): feature transform + boosted min-size Sinkhorn",
    floor=dict(sweep="min-size", sweeps=lambda cfg: cfg.steps * cfg.sinkhorn_iter),
)
def bms(batch: EpisodeBatch, cfg: BMSConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]``; state ``prototypes [E, way, D]`` (transformed space) and
    ``assignments [E, Nq, way]``."""
    n_s, way = batch.support.shape[1], batch.way
    shape = plan_shape(batch)
    rows = None if shape is None else torch.cat([batch.support_labels >= 0, shape.keep[:, 0]], 1)  # [E, N]
    z = peme([batch.support, batch.query], cfg.power, rows)
    y_t = one_hot(batch.support_labels, way, z.dtype).transpose(1, 2)  # [E, K, Ns]
    # the refinement's SGD needs explicit centres
    span = RowSpan(z, n_s, way, cfg.steps, cfg.steps, gram=False if cfg.epochs > 0 else None)
    classes = batch.class_mask
    den = y_t.sum(2, keepdim=True)
    # the unit centres and their scores, from one product in the Gram form
    mu, dots = span.normalize_dots(span.support_sum(y_t) / (den if classes is None else den.clamp_min(1.0)))
    if shape is None:
        min_size = torch.full((z.shape[0],), float(batch.shot), dtype=z.dtype, device=z.device)
    else:  # each episode's own shot, as a fixed episode's: its support rows // its ways
        ways = batch.ways if batch.ways is not None else torch.full_like(shape.cols, way)
        min_size = torch.div((batch.support_labels >= 0).sum(1), ways, rounding_mode="floor").to(z.dtype)
    q = None
    for _ in range(cfg.steps):
        logits = dots.mul_(cfg.lam)
        if shape is None:
            q = torch.softmax(logits, 1)
        else:
            q = torch.softmax(logits.masked_fill_(~shape.keep, float("-inf")), 1).nan_to_num_(0.0)
        own_ways, own_cols = (None, None) if shape is None else (shape.ways, shape.cols)
        q = min_size_sinkhorn(q, min_size, cfg.sinkhorn_iter, ways=own_ways, cols=own_cols)
        w = torch.cat([y_t, q], 2)  # [E, K, N]
        # max(1).indices: the argmax over the middle axis, without argmax's slow strided path
        label = w.max(1).indices
        if rows is not None:
            label.masked_fill_(~rows, -1)  # a padded row is no class's member
        counts = one_hot(label, way, z.dtype).sum(1)  # [E, K]
        min_size = (counts if classes is None else counts.masked_fill(~classes, float("inf"))).amin(1)
        den = w.sum(2, keepdim=True)
        state = span.sum(w) / (den if classes is None else den.clamp_min(TINY))
        if cfg.epochs > 0:
            n_rows = None if rows is None else rows.sum(1).to(z.dtype)
            mu = _refine(z, span.normalize(state), w.transpose(1, 2), cfg.epochs, cfg.lr, cfg.momentum, classes, n_rows)
            dots = span.dots(mu)
        else:
            mu, dots = span.normalize_dots(state)
    assert q is not None  # cfg.steps >= 1
    q = q.transpose(1, 2).contiguous()
    return SolverOutput(plan_log_probs(q, batch), {"prototypes": span.explicit(mu), "assignments": q})
