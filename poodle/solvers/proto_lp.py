"""protoLP: prototype-based label propagation by iterative graph refinement.

Hao Zhu, Piotr Koniusz. "Transductive Few-shot Learning with Prototype-based Label Propagation by
Iterative Graph Refinement", CVPR 2023, arXiv:2304.11598.

Features: power transform ``(x + 1e-6)^power``, unit normalisation, projection of every episode
(support and queries together, uncentred) onto its top ``reduced_dim`` right singular vectors,
centring on the episode mean and unit normalisation. Prototypes start at the unit-normalised
support means. Each of ``steps`` iterations:

1. ``Z``: every sample's assignment to the prototypes, the support rows their one-hot labels and
   the query rows the Sinkhorn plan of the cost ``||z_q - mu_k||^2`` at regularisation ``lam``
   (rows 1, classes ``Nq / K``: PT-MAP's assignment);
2. a graph whose nodes are the prototypes: ``W = Z^T Z diag(1 / sum_i Z_ik)``, ``L = I - W``;
   label propagation solves ``(Z_s^T Z_s + gamma L) A = Z_s^T Y_s`` for the prototypes' labels
   ``A [K, K]`` and predicts ``P = Z A``, which Sinkhorn-normalises (rows 1, classes ``(Ns + Nq) / K``,
   the support rows reset to their labels after every sweep, tolerance ``lp_tol``);
3. prototypes move a fraction ``alpha`` towards the means weighted by
   ``clamp(mix * P + (1 - mix) * Z, 0, 1)``.

Queries take the argmax of the final Sinkhorn plan. With ``balanced = False`` both Sinkhorn steps
are replaced by plain row normalisation (step 1 becomes soft k-means at temperature ``lam``, which
the paper names as the alternative for its Eq. 4), so no class proportion is imposed. Transductive.

Defaults are the authors' released script (allenhaozhu/protoLP ``test_standard_GSSL_lapshot.py``,
its mini-ImageNet setting; their ``..._unbalance.py`` runs the same algorithm): power 0.5,
``reduced_dim`` 40, ``lam`` 10, Sinkhorn tolerance 1e-3, ``alpha`` 0.2, ``gamma`` 1, ``mix`` 0.6,
100 iterations, balanced Sinkhorn.

Differences from the authors' code: theirs hard-codes 5 ways and 10,000 episodes (the identity
they build) and assumes ``shot + queries`` samples per class; here any way, shot and query counts.
``W`` is not symmetric, and their ``torch.linalg.cholesky`` reads only its lower triangle: we solve
the same lower-triangle-symmetrised system (and fall back to a pseudo-inverse where it is not
positive definite, where theirs raises). A non-positive row sum of ``P`` is floored at 1e-30 (theirs
divides by it). A negative coordinate is transformed as ``sign(x) (|x| + 1e-6)^power`` (their
features are post-ReLU; theirs gives NaN). Both Sinkhorn loops stop per episode; theirs stop when the
whole batch has converged, so their result for an episode depends on its batch-mates (identical to
ours with one episode per call; 99.3% of predictions agree when they run 100 glyph episodes at once).
Their released code has no command line; benchmarks/compare_official.py drives their functions on
the same episodes (docs/transductive.md).

On the CPU a balanced step runs in one C call (:class:`poodle.solvers._sinkhorn_native.LPStep`:
per episode, the assignments' sweeps, the propagation and its solve, the label sweeps and the mix),
the final assignments' sweeps in the C loop (:mod:`poodle.solvers._sinkhorn_native`); on CUDA both
Sinkhorn loops run in one Triton program per episode
(:mod:`poodle.solvers._triton_sinkhorn`); elsewhere, or without a C compiler or Triton, the torch
formulation. In a ragged chunk a padded row is zero from the power transform on (it enters neither
the projection's Gram matrix nor a mean nor the graph) and a padded class takes no mass: each
episode's marginals are its own (``n_q / ways``, ``(n_s + n_q) / ways``) over its real rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers import _sinkhorn_native
from poodle.solvers._span import RowSpan, span_flops, use_gram
from poodle.solvers._transductive import TINY, batched_eigh, row_sqnorm
from poodle.solvers.base import EpisodeBatch, SolverOutput, one_hot, register
from poodle.solvers.pt_map import (
    Shape,
    balance,
    centre_,
    fused_transform,
    plan_log_probs,
    plan_shape,
    sinkhorn,
    transformed_rows,
    unit_rows_,
)


@dataclass(frozen=True)
class ProtoLPConfig:
    MEANINGS: ClassVar[dict[str, str]] = {"alpha": "prototype update rate"}  # see base.MEANINGS

    power: float = option(0.5, min=0, min_open=True)
    reduced_dim: int = option(40, min=0)
    lam: float = option(10.0, min=0, min_open=True)
    alpha: float = option(0.2, min=0, max=1)
    gamma: float = option(1.0, min=0, min_open=True)
    mix: float = option(0.6, min=0, max=1)
    steps: int = option(100, min=0)
    balanced: bool = True
    sinkhorn_tol: float = option(1e-3, min=0)
    lp_tol: float = option(0.01, min=0)
    sinkhorn_max_iter: int = option(1000, min=1)


def svd_project(x: Tensor, dim: int) -> Tensor:
    """Coordinates of ``x [E, N, D]`` in its top ``dim`` right singular vectors (no centring):
    ``[E, N, min(dim, N, D)]``, up to a per-direction sign (no distance sees it).

    From the eigen-decomposition of the smaller Gram matrix (``x x^T`` when ``N <= D``, whose
    eigenvectors scaled by the singular values are the coordinates; else ``x^T x``, whose
    eigenvectors are the right singular vectors), formed and decomposed in float64: the float32
    Gram matrix loses the weaker directions' precision (it changed about 1% of the predictions on
    the glyph features); the float64 one gives a float64 SVD's coordinates to 1e-13, and from
    float32 rows to 3e-8 where a float32 SVD gave them to 3e-5 (Gram matrices of the coordinates,
    standard workload). A batched float32 SVD of ``[E, 80, 640]`` costs 3x more on a CPU (3.7 ms
    against 1.25 ms an episode, one thread); on CUDA either would run one matrix at a time, and
    :func:`~poodle.solvers._transductive.batched_eigh` sends the batch to the host in bulk."""
    n, d = x.shape[1], x.shape[2]
    r = min(dim, n, d)
    xd = x.double()
    if n <= d:
        w, u = batched_eigh(torch.bmm(xd, xd.transpose(1, 2)))  # ascending
        coords = u[:, :, n - r :] * w[:, None, n - r :].clamp_min(0).sqrt()
    else:
        coords = torch.bmm(xd, batched_eigh(torch.bmm(xd.transpose(1, 2), xd))[1][:, :, d - r :])
    return coords.flip(-1).to(x.dtype)


def preprocess(parts: list[Tensor], power: float, reduced_dim: int, mask: Tensor | None = None) -> Tensor:
    """The features of ``parts`` (``[E, n_i, D]`` each) stacked along the rows, transformed:
    ``[E, sum n_i, d]``. With ``mask [E, sum n_i]`` (real rows), padded rows are zero from the
    power transform on: they enter neither the projection nor the mean."""
    w = None if mask is None else mask.to(parts[0].dtype).unsqueeze(2)
    if fused_transform(parts[0], power):  # padded rows come out zero
        z = _sinkhorn_native.pemne(parts, "none", mask, 1e-6**power)
    else:
        z = transformed_rows(parts, power)
        if w is not None:
            z.mul_(w)
    if reduced_dim > 0:
        z = svd_project(z, reduced_dim)
        if w is not None:
            z.mul_(w)  # the rounding of the zero rows' coordinates
    return unit_rows_(centre_(z, mask))


def lower_symmetric(m: Tensor) -> Tensor:
    """The symmetric matrix whose lower triangle is ``m``'s (what a Cholesky factorisation reads)."""
    low = torch.tril(m)
    return low + torch.tril(m, -1).transpose(-1, -2)


def propagate(z: Tensor, yty: Tensor, gamma: float) -> Tensor:
    """Label propagation over the prototype graph: ``z [E, K, N]`` assignments (classes first, the
    support samples first and one-hot), ``yty = Y_s^T Y_s [E, K, K]`` -> ``P^T = (z^T A)^T [E, K, N]``.

    On the CPU each episode's graph, solve and product run in one C pass
    (:func:`~poodle.solvers._sinkhorn_native.propagate`, float rounding of the torch formulation:
    about 20 batched operations and two LAPACK calls per matrix of a few classes); an episode whose
    system is not positive definite takes the torch formulation's pseudo-inverse."""
    if _sinkhorn_native.usable(z):
        out, bad = _sinkhorn_native.propagate(z, yty, gamma)
        if bool(bad.any()):
            idx = bad.nonzero().squeeze(1)
            out[idx] = _propagate(z[idx], yty[idx], gamma)
        return out
    return _propagate(z, yty, gamma)


def _propagate(z: Tensor, yty: Tensor, gamma: float) -> Tensor:
    """:func:`propagate`'s torch formulation."""
    k = z.shape[1]
    delta = z.sum(2).clamp_min(TINY)  # [E, K]
    w = torch.bmm(z, (z / delta.unsqueeze(2)).transpose(1, 2))
    eye = torch.eye(k, dtype=z.dtype, device=z.device)
    # the support rows of z are the labels: Z_s^T Z_s = Z_s^T Y_s = Y_s^T Y_s
    m = lower_symmetric(yty + gamma * (eye - w))
    chol, info = torch.linalg.cholesky_ex(m)
    a = torch.cholesky_solve(yty, chol)
    bad = info != 0
    if bool(bad.any()):
        a = torch.where(bad[:, None, None], torch.linalg.pinv(m, hermitian=True) @ yty, a)
    return torch.bmm(a.transpose(1, 2), z)


def lp_normalise(
    p: Tensor, y_t: Tensor, col_mass: float, balanced: bool, tol: float, max_iter: int, shape: Shape | None = None
) -> Tensor:
    """The authors' normalisation of the propagated labels ``p [E, K, N]`` (classes first): Sinkhorn
    sweeps (samples 1, classes ``col_mass``) with the support samples reset to ``y_t [E, K, Ns]``
    after each, until the sample sums move by at most ``tol`` (per episode); samples only when not
    ``balanced``. ``shape``: a ragged chunk's sizes (``p`` zero outside them)."""
    if not balanced:
        p = p / p.sum(1, keepdim=True).clamp_min(TINY)
        return torch.cat([y_t, p[:, :, y_t.shape[2] :]], 2)
    return balance(p, col_mass, tol, max_iter, reset=y_t, shape=shape)


def lp_mask(zz: Tensor, yty: Tensor, y_t: Tensor, cfg: ProtoLPConfig, col_mass: float, shape: Shape | None) -> Tensor:
    """A step's weights after the assignments ``zz [E, K, N]``: the propagated labels, normalised
    (:func:`lp_normalise`), mixed with ``zz`` and clamped to ``[0, 1]`` (``[E, K, N]``)."""
    p = lp_normalise(
        propagate(zz, yty, cfg.gamma), y_t, col_mass, cfg.balanced, cfg.lp_tol, cfg.sinkhorn_max_iter, shape
    )
    return (cfg.mix * p + (1 - cfg.mix) * zz).clamp_(0, 1)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: ProtoLPConfig) -> float:
    d = min(cfg.reduced_dim, Ns + Nq, D) if cfg.reduced_dim > 0 else D
    gram = use_gram(Ns, Nq, d, way, cfg.steps + 1, cfg.steps)
    n, m = Ns + Nq, min(Ns + Nq, D)
    # the projection (float64): the smaller Gram matrix, its eigen-decomposition (9 m^3, LAPACK's
    # usual count with vectors) and, from x^T x, the product with its top vectors
    project = 2.0 * n * D * m + 9.0 * m**3 + (2.0 * n * D * d if n > D else 0.0) if cfg.reduced_dim > 0 else 0.0
    # the steps' weighted sums run over all N rows: count the support part too
    return (
        project
        + span_flops(Ns, Nq, d, way, cfg.steps + 1, cfg.steps, gram)
        + (0 if gram else cfg.steps * 2.0 * way * Ns * d)
    )


@register(
    "proto-lp",
    ProtoLPConfig,
    transductive="always",
    flops=_flops,
    summary="protoLP (Zhu & Koniusz 2023): label propagation over a prototype graph, refined iteratively",
    floor=dict(
        gram=lambda Ns, Nq, M, D, way, cfg: (Ns + Nq, D) if cfg.reduced_dim > 0 else None,
        eigh=lambda Ns, Nq, M, D, way, cfg: min(Ns + Nq, D) if cfg.reduced_dim > 0 else 0,
        eigh_dtype="float64",
        product=lambda Ns, Nq, M, D, way, cfg: (Ns + Nq, min(cfg.reduced_dim, Ns + Nq, D) or D, way),
        sweep="balance",
        sweep_columns="all",
        loops=("poodle.solvers.pt_map:balance", "poodle.solvers.proto_lp:balance"),
    ),
)
def proto_lp(batch: EpisodeBatch, cfg: ProtoLPConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]`` (log of the final plan's rows, normalised); state
    ``prototypes [E, way, d]`` (transformed space) and ``assignments [E, Nq, way]``."""
    n_s, n_q, way = batch.support.shape[1], batch.query.shape[1], batch.way
    shape, lp_shape = plan_shape(batch), plan_shape(batch, n_lead=n_s)
    rows = None if lp_shape is None else lp_shape.keep[:, 0]  # [E, N] real rows (class 0 is always real)
    z = preprocess([batch.support, batch.query], cfg.power, cfg.reduced_dim, rows)
    y_t = one_hot(batch.support_labels, way, z.dtype).transpose(1, 2)  # [E, K, Ns]
    yty = torch.bmm(y_t, y_t.transpose(1, 2))
    span = RowSpan(z, n_s, way, cfg.steps + 1, cfg.steps)
    den = y_t.sum(2, keepdim=True)
    mu = span.normalize(span.support_sum(y_t) / (den if batch.ways is None else den.clamp_min(1.0)))
    q2 = row_sqnorm(span.z_q).transpose(1, 2)  # [E, 1, Nq]

    def assign(mu: Tensor) -> Tensor:  # [E, K, Nq]
        dots, sq = span.scores(mu)
        cost = dots.mul(-2.0).add_(q2).add_(sq.unsqueeze(2)).clamp_min_(0.0)
        if cfg.balanced:
            return sinkhorn(cost, cfg.lam, n_q / way, cfg.sinkhorn_tol, cfg.sinkhorn_max_iter, shape)
        if shape is None:
            return torch.softmax(cost.mul_(-cfg.lam), 1)
        # a padded class takes no probability, a padded query (no real class) none at all
        return torch.softmax(cost.mul_(-cfg.lam).masked_fill_(~shape.keep, float("-inf")), 1).nan_to_num_(0.0)

    lp_mass = (n_s + n_q) / way
    # balanced on the CPU: from the assignments' kernel to the weights, one C call a step (float
    # rounding of the torch formulation below)
    fused = None
    if cfg.balanced and _sinkhorn_native.usable(y_t):
        fused = _sinkhorn_native.LPStep(
            yty, y_t, n_q, cfg.gamma, cfg.mix, n_q / way if shape is None else shape.mass, cfg.sinkhorn_tol,
            lp_mass if lp_shape is None else lp_shape.mass, cfg.lp_tol, cfg.sinkhorn_max_iter,
            ways=None if shape is None else shape.ways, plan_cols=None if shape is None else shape.cols,
            cols=None if lp_shape is None else lp_shape.cols,
        )  # fmt: skip

    def weights(mu: Tensor) -> Tensor:  # [E, K, N]
        if fused is None:
            zz = torch.cat([y_t, assign(mu)], 2)
            return lp_mask(zz, yty, y_t, cfg, lp_mass, lp_shape)
        dots, sq = span.scores(mu)  # the kernel as sinkhorn() takes it
        kernel = dots.mul(-2.0).add_(q2).add_(sq.unsqueeze(2)).clamp_min_(0.0).mul_(-cfg.lam).exp_().contiguous()
        if shape is not None:
            kernel.masked_fill_(~shape.keep, 0.0)
        mask, zz, bad = fused(kernel)
        if bad is not None:  # a system that is not positive definite: the pseudo-inverse
            idx = bad.nonzero().squeeze(1)
            sub = None if lp_shape is None else lp_shape.select(idx)
            mask[idx] = lp_mask(zz[idx], yty[idx], y_t[idx], cfg, lp_mass, sub)
        return mask

    for _ in range(cfg.steps):
        mask = weights(mu)
        den = mask.sum(2, keepdim=True)  # [E, K, 1] >= support
        est = span.sum(mask) / den.clamp_min(TINY)
        mu = mu + cfg.alpha * (est - mu)
    plan = assign(mu).transpose(1, 2).contiguous()
    return SolverOutput(plan_log_probs(plan, batch), {"prototypes": span.explicit(mu), "assignments": plan})
