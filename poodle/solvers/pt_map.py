"""PT-MAP: power transform, then MAP estimation of class centres with Sinkhorn assignments.

Yuqing Hu, Vincent Gripon, Stéphane Pateux. "Leveraging the Feature Distribution in
Transfer-based Few-Shot Learning", ICANN 2021, arXiv:2006.03806.

Features go through a power transform ``x -> (x + 1e-6)^beta``, unit normalisation, and centring
(support and query sets each on their own mean, then unit normalisation again). Class centres start
at the support means. Each of ``steps`` iterations computes the query soft assignments as the
Sinkhorn optimal-transport plan of the cost ``||z_q - mu_k||^2`` at regularisation ``lam``, with
every query carrying mass 1 and every class receiving ``Nq / way`` (the method assumes balanced
queries), sets support assignments to their one-hot labels, and moves each centre a fraction
``alpha`` towards the assignment-weighted mean. Queries take the argmax of the final plan.
Transductive.

Differences from the authors' code: the QR dimension reduction is skipped (it is an isometry of
the samples' span and leaves every distance unchanged); a negative coordinate is transformed as
``sign(x) (|x| + 1e-6)^beta`` (the authors' features are post-ReLU, where this is their formula;
theirs would give NaN); Sinkhorn stops per episode (a mask) instead of when the whole batch has
converged; a zero vector after centring stays zero instead of becoming NaN.

On the CPU each episode's Sinkhorn sweeps run in one C loop (:mod:`poodle.solvers._sinkhorn_native`)
with the same arithmetic, on CUDA in one Triton program per episode
(:mod:`poodle.solvers._triton_sinkhorn`); elsewhere, or without a C compiler or Triton, the torch
formulation below. In a ragged
chunk every episode's means, marginals (``n_q / ways`` of its own) and plan run over its real queries
and classes only: a padded row is zero after the transform and a padded class gets no mass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers import _sinkhorn_native, _triton_sinkhorn
from poodle.solvers._span import RowSpan, span_flops, use_gram
from poodle.solvers._transductive import (
    CHECK_EVERY_SWEEPS,
    TINY,
    log_normalise,
    pow_anywhere,
    row_sqnorm,
    should_stop,
    syncs_freely,
)
from poodle.solvers.base import EpisodeBatch, SolverOutput, mask_classes, one_hot, register


@dataclass(frozen=True)
class PTMapConfig:
    MEANINGS: ClassVar[dict[str, str]] = {  # see base.MEANINGS
        "alpha": "prototype update rate",
        "beta": "power-transform exponent",
    }
    # Hu et al.'s released test script: beta 0.5, lam 10, alpha 0.2, 20 epochs; Sinkhorn eps 1e-6,
    # at most 1000 iterations.
    beta: float = option(0.5, min=0, min_open=True)
    lam: float = option(10.0, min=0, min_open=True)
    alpha: float = option(0.2, min=0, max=1)
    steps: int = option(20, min=0)
    sinkhorn_tol: float = option(1e-6, min=0)
    sinkhorn_max_iter: int = option(1000, min=1)


def power_transform(x: Tensor, beta: float, out: Tensor | None = None) -> Tensor:
    """``sign(x) (|x| + 1e-6)^beta`` (= the paper's ``(x + 1e-6)^beta`` for ``x >= 0``); an exact
    zero (either sign) maps to ``1e-6^beta``. Written into ``out`` (same shape) when given.

    At the methods' default ``beta = 1/2`` on the CPU, one pass of the fused library
    (:func:`~poodle.solvers._sinkhorn_native.power_half`) computes the same bits as the several
    passes below (ATen's pow at exponent 1/2 is its correctly rounded sqrt, as C's)."""
    if beta == 0.5 and x.dim() == 3 and _sinkhorn_native.usable(x):
        return _sinkhorn_native.power_half(x, torch.empty_like(x) if out is None else out, 1e-6**beta)
    t = torch.abs(x, out=out) if out is not None else x.abs()
    t.copy_(pow_anywhere(t.add_(1e-6), beta)).copysign_(x)
    return t.masked_fill_(x == 0, 1e-6**beta)


def unit_rows_(x: Tensor) -> Tensor:
    """``F.normalize(x, dim=-1)`` in place (the same values, no new ``[E, N, D]`` tensor)."""
    return x.div_(torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(1e-12))


def fused_transform(x: Tensor, beta: float) -> bool:
    """Whether the feature pipelines run in the fused library
    (:func:`~poodle.solvers._sinkhorn_native.pemne`): at exponent 1/2 (its formula) on features
    ``x [E, n, D]`` the library takes (reports the formulation to the backend)."""
    return beta == 0.5 and x.dim() == 3 and _sinkhorn_native.usable(x)


def real_rows(mask: Tensor | None, x: Tensor) -> Tensor:
    """``mask [E, n]`` (real rows of ``x [E, n, D]``), or all True where it is None."""
    return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask


def transformed_rows(parts: list[Tensor], beta: float) -> Tensor:
    """The power-transformed, unit rows of ``parts`` (each ``[E, n_i, D]``) stacked along the rows
    into one new ``[E, sum n_i, D]`` tensor: each pass over the features runs in place."""
    sizes = [t.shape[1] for t in parts]
    z = parts[0].new_empty(parts[0].shape[0], sum(sizes), parts[0].shape[2])
    for x, block in zip(parts, z.split(sizes, 1)):
        power_transform(x, beta, out=block)
    return unit_rows_(z)


def centre_(block: Tensor, mask: Tensor | None) -> Tensor:
    """``block [E, n, D]`` minus its mean row, in place; with ``mask [E, n]`` (real rows) the mean
    of the real rows, and the padded rows set to zero."""
    if mask is None:
        return block.sub_(block.mean(1, keepdim=True))
    w = mask.to(block.dtype).unsqueeze(2)
    block.mul_(w)
    return block.sub_(block.sum(1, keepdim=True).div_(w.sum(1, keepdim=True).clamp_min_(1))).mul_(w)


def preprocess(
    z_s: Tensor, z_q: Tensor, beta: float, s_mask: Tensor | None = None, q_mask: Tensor | None = None
) -> Tensor:
    """PT-MAP's feature pipeline for ``[E, Ns, D]`` support and ``[E, Nq, D]`` query sets (each
    centred on its own mean): ``[E, Ns + Nq, D]``, support first. With ``s_mask [E, Ns]`` /
    ``q_mask [E, Nq]`` (real rows), each mean is over the real rows and padded rows come out zero.

    At ``beta = 1/2`` on the CPU, the fused library's two passes over each episode's rows
    (:func:`~poodle.solvers._sinkhorn_native.pemne`) compute the same to float rounding."""
    if fused_transform(z_s, beta):
        keep = None
        if s_mask is not None or q_mask is not None:
            keep = torch.cat([real_rows(m, t) for m, t in ((s_mask, z_s), (q_mask, z_q))], 1)
        return _sinkhorn_native.pemne([z_s, z_q], "parts", keep, 1e-6**beta)
    z = transformed_rows([z_s, z_q], beta)
    for block, mask in zip(z.split([z_s.shape[1], z_q.shape[1]], 1), (s_mask, q_mask)):
        centre_(block, mask)
    return unit_rows_(z)


@dataclass
class Shape:
    """Each episode's own sizes in a ragged chunk, for the Sinkhorn loops: ``ways [E]`` classes
    (None: all) and ``cols [E]`` samples (the first ones of each plan; a padded sample among them is
    zero), ``keep [E, K, N]`` True on an episode's real classes and samples, ``mass [E]`` each class's
    mass."""

    ways: Tensor | None
    cols: Tensor
    keep: Tensor
    mass: Tensor

    def select(self, idx: Tensor) -> Shape:
        """The shape of the episodes ``idx`` (``[n]`` indices) alone."""
        ways = None if self.ways is None else self.ways[idx]
        return Shape(ways, self.cols[idx], self.keep[idx], self.mass[idx])


def plan_shape(batch: EpisodeBatch, n_lead: int = 0, dtype: torch.dtype | None = None) -> Shape | None:
    """The :class:`Shape` of the plans ``[E, way, n_lead + Nq]`` of a ragged ``batch``, or None for a
    fixed chunk: with ``n_lead = Ns`` the support samples come first (padded ones zero) and classes
    receive ``(n_s + n_q) / ways`` (protoLP's propagated labels), else ``n_q / ways`` (real rows)."""
    if not batch.ragged:
        return None
    dtype = dtype or batch.query.dtype
    dev, E, n_q = batch.query.device, batch.n_episodes, batch.query.shape[1]
    ways = batch.ways if batch.ways is not None else torch.full((E,), batch.way, dtype=torch.int64, device=dev)
    rows = batch.query_mask if batch.query_mask is not None else torch.ones(E, n_q, dtype=torch.bool, device=dev)
    real_q = rows.sum(1)
    real = real_q
    if n_lead:
        real = real_q + (batch.support_labels >= 0).sum(1)
        rows = torch.cat([batch.support_labels >= 0, rows], 1)
    classes = batch.class_mask
    keep = rows.unsqueeze(1).expand(E, batch.way, -1) if classes is None else classes.unsqueeze(2) & rows.unsqueeze(1)
    return Shape(batch.ways, real_q + n_lead, keep, real.to(dtype) / ways.to(dtype))


def sinkhorn(
    cost: Tensor, lam: float, col_mass: float, tol: float, max_iter: int, shape: Shape | None = None
) -> Tensor:
    """Entropic OT plan ``[E, K, N]`` for ``cost [E, K, N]`` (classes first; overwritten: the plan
    is written there): every sample (column) carries mass 1, every class (row) receives
    ``col_mass``. Each episode stops once its samples' masses moved by at most ``tol`` in one sweep.
    With ``shape`` (a ragged chunk), each episode over its real classes and samples, classes
    receiving ``shape.mass``; the plan is zero elsewhere."""
    p = cost.mul_(-lam).exp_()  # the caller's temporary
    if shape is not None:
        p.masked_fill_(~shape.keep, 0.0)
    return balance(p, col_mass, tol, max_iter, shape=shape, normalise=True)


def balance(
    p: Tensor,
    col_mass: float,
    tol: float,
    max_iter: int,
    reset: Tensor | None = None,
    shape: Shape | None = None,
    normalise: bool = False,
) -> Tensor:
    """Sinkhorn sweeps on ``p [E, K, N]`` (overwritten and returned): samples (columns) normalised
    to 1, then classes (rows) to ``col_mass``, and, with ``reset [E, K, Ns]``, the first ``Ns``
    samples set back to it; per episode, until the sample masses before a sweep are within ``tol``
    of those before the previous one (at most ``max_iter`` sweeps). ``normalise`` first divides
    each plan by its total. With ``shape`` (a ragged chunk; ``p`` zero outside each episode's real
    classes and samples), classes receive ``shape.mass`` and each episode runs over its own sizes.

    On the CPU the fused C loop (:mod:`poodle.solvers._sinkhorn_native`) runs every episode's sweeps
    to its own convergence, on CUDA the Triton loop (:mod:`poodle.solvers._triton_sinkhorn`, one
    launch, no host sync). The torch formulation keeps classes on the middle axis so that both
    reductions run along vectors (a sum over an innermost axis of 5 is several times slower). Where
    a look at the masks costs nothing (the CPU, :func:`~poodle.solvers._transductive.syncs_freely`)
    it looks every sweep and drops finished episodes from the batch once a quarter of it has
    finished; elsewhere it masks them and looks every ``CHECK_EVERY_SWEEPS`` sweeps. A zero entry
    stays zero in both."""
    mass: float | Tensor = col_mass if shape is None else shape.mass
    if _triton_sinkhorn.usable(p):
        p = p if p.is_contiguous() else p.contiguous()
        ways, cols = (None, None) if shape is None else (shape.ways, shape.cols)
        return _triton_sinkhorn.run(
            "balanced", p, mass, max_iter, tol=tol, reset=reset, normalise=normalise, ways=ways, cols=cols
        )
    if _sinkhorn_native.usable(p):
        p = p if p.is_contiguous() else p.contiguous()
        ways, cols = (None, None) if shape is None else (shape.ways, shape.cols)
        return _sinkhorn_native.run(
            "balanced", p, mass, max_iter, tol=tol, reset=reset, normalise=normalise, ways=ways, cols=cols
        )
    if normalise:
        p.div_(p.sum((1, 2), keepdim=True).clamp_min_(TINY))
    if isinstance(mass, Tensor):
        mass = mass.to(p.dtype).unsqueeze(1)  # [E, 1]
    if syncs_freely(p):
        return _balance_dropping(p, mass, tol, max_iter, reset)
    active = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
    u = p.new_zeros(p.shape[0], p.shape[2])
    for it in range(max_iter):
        rows = p.sum(1)  # [E, N]
        active &= (u - rows).abs_().amax(1) > tol
        if should_stop(active, it, CHECK_EVERY_SWEEPS):  # stopped episodes are frozen below
            break
        u = _sweep(p, rows, u, active, mass, reset)
    return p


def _sweep(
    p: Tensor, rows: Tensor, u: Tensor, live: Tensor | None, col_mass: float | Tensor, reset: Tensor | None
) -> Tensor:
    """One sweep on ``p`` in place, on the episodes of ``live [E]`` (None: all); returns the new ``u``.
    A finished episode is divided and multiplied by exactly 1: its values do not change."""
    if live is None:
        p.div_(rows.clamp_min(TINY).unsqueeze(1))
        p.mul_(p.sum(2).clamp_min_(TINY).reciprocal_().mul_(col_mass).unsqueeze(2))
        if reset is not None:
            p[:, :, : reset.shape[2]] = reset
        return rows
    on = live.unsqueeze(1)
    p.div_(torch.where(on, rows.clamp_min(TINY), 1.0).unsqueeze(1))
    p.mul_(torch.where(on, p.sum(2).clamp_min_(TINY).reciprocal_().mul_(col_mass), 1.0).unsqueeze(2))
    if reset is not None:
        ns = reset.shape[2]
        p[:, :, :ns] = torch.where(on.unsqueeze(2), reset, p[:, :, :ns])
    return torch.where(on, rows, u)


def _balance_dropping(p: Tensor, col_mass: float | Tensor, tol: float, max_iter: int, reset: Tensor | None) -> Tensor:
    """:func:`balance` on the CPU, where a look at the masks costs nothing: the batch shrinks to the
    episodes still running whenever a quarter of it has finished (each drop copies the rest)."""
    out = p
    idx: Tensor | None = None  # the rows of ``out`` that ``p`` holds, once it is a copy
    live: Tensor | None = None  # the episodes of ``p`` still running, when some are not
    u = p.new_zeros(p.shape[0], p.shape[2])
    for _ in range(max_iter):
        rows = p.sum(1)
        moved = (u - rows).abs_().amax(1) > tol
        if live is not None:
            moved &= live
        n = int(moved.count_nonzero())
        if n == 0:
            break
        if n == p.shape[0]:
            live = None
        elif 4 * n > 3 * p.shape[0]:
            live = moved
        else:
            keep = moved.nonzero().squeeze(1)
            if idx is None:  # ``p`` is ``out``: the finished episodes are already in place
                idx = keep
            else:
                gone = (~moved).nonzero().squeeze(1)
                out.index_copy_(0, idx.index_select(0, gone), p.index_select(0, gone))
                idx = idx.index_select(0, keep)
            p, rows, u, live = p.index_select(0, keep), rows.index_select(0, keep), u.index_select(0, keep), None
            if reset is not None:
                reset = reset.index_select(0, keep)
            if isinstance(col_mass, Tensor):
                col_mass = col_mass.index_select(0, keep)
        u = _sweep(p, rows, u, live, col_mass, reset)
    if idx is not None:
        out.index_copy_(0, idx, p)
    return out


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: PTMapConfig) -> float:
    gram = use_gram(Ns, Nq, D, way, cfg.steps + 1, cfg.steps)
    return span_flops(Ns, Nq, D, way, cfg.steps + 1, cfg.steps, gram)


@register(
    "pt-map",
    PTMapConfig,
    transductive="always",
    flops=_flops,
    summary="PT-MAP (Hu et al. 2021): power transform + Sinkhorn MAP centre estimation",
    floor=dict(sweep="balance", loops=("poodle.solvers.pt_map:balance",)),
)
def pt_map(batch: EpisodeBatch, cfg: PTMapConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]`` (log of the final plan's rows, normalised); state
    ``prototypes [E, way, D]`` (in the transformed space) and ``assignments [E, Nq, way]``."""
    z = preprocess(batch.support, batch.query, cfg.beta, batch.support_mask, batch.query_mask)
    way = batch.way
    col = batch.query.shape[1] / way
    shape = plan_shape(batch, dtype=z.dtype)
    y_t = one_hot(batch.support_labels, way, z.dtype).transpose(1, 2)  # [E, K, Ns]
    span = RowSpan(z, batch.support.shape[1], way, cfg.steps + 1, cfg.steps)
    support = span.support_sum(y_t)
    counts = y_t.sum(2, keepdim=True)  # [E, K, 1], >= 1 (every class has a support point)
    if batch.ways is not None:
        counts.clamp_min_(1.0)  # a padded class has none: its centre stays at zero
    mu = support / counts
    q2 = row_sqnorm(span.z_q).transpose(1, 2)  # [E, 1, Nq]

    def plan_of(mu: Tensor) -> Tensor:  # [E, K, Nq]
        dots, sq = span.scores(mu)
        cost = dots.mul(-2.0).add_(q2).add_(sq.unsqueeze(2)).clamp_min_(0.0)
        return sinkhorn(cost, cfg.lam, col, cfg.sinkhorn_tol, cfg.sinkhorn_max_iter, shape)

    for _ in range(cfg.steps):
        plan = plan_of(mu)
        est = span.mean(y_t, plan, plan.sum(2, keepdim=True).add_(counts), support=support)
        mu = mu + cfg.alpha * (est - mu)
    plan = plan_of(mu).transpose(1, 2).contiguous()
    return SolverOutput(plan_log_probs(plan, batch), {"prototypes": span.explicit(mu), "assignments": plan})


def plan_log_probs(plan: Tensor, batch: EpisodeBatch) -> Tensor:
    """``log_probs [E, Nq, way]`` of a plan's rows ``plan [E, Nq, way]``, normalised; a padded class
    of a ragged chunk gets log-probability -inf (exactly zero probability)."""
    if batch.class_mask is None:
        return log_normalise(plan)
    return torch.log_softmax(mask_classes(torch.log(plan.clamp_min(TINY)), batch), dim=-1)
