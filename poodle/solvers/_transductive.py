"""Private helpers shared by the transductive competitors (tim-*, k-means family, can-t, ...).

Everything here works on a leading episode dimension ``E`` and never loops over episodes, classes
or queries. Names follow the papers: ``z_s`` support features, ``z_q`` query features, ``y_s``
one-hot support labels.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from poodle.solvers import backend as _backend
from poodle.solvers.base import EpisodeBatch, one_hot

# Smallest probability any log below is allowed to see: keeps 0 * log(0) and 0 / 0 out of every
# method without changing a result that was finite (it is far below float32 resolution near 1).
TINY = 1e-30


# ---------------------------------------------------------------------------------------------
# Ragged chunks: a padded row takes no weight, a padded class no probability (EpisodeBatch). Every
# helper below that takes a ``pad`` batch (or row weights) uses its masks; with ``None`` it runs the
# code of fixed chunks unchanged, so their bits stay what they were.


def row_weight(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``[E, N, 1]`` 1.0 for a real row of ``mask [E, N]`` and 0.0 for padding (``None``: all real)."""
    return None if mask is None else mask.to(dtype).unsqueeze(-1)


def masked_mean(z: Tensor, weight: Tensor | None) -> Tensor:
    """The mean of each episode's real rows: ``z [E, N, D]``, ``weight [E, N, 1]`` (0/1, or ``None``
    for all rows) -> ``[E, 1, D]``."""
    if weight is None:
        return z.mean(1, keepdim=True)
    return (z * weight).sum(1, keepdim=True) / weight.sum(1, keepdim=True).clamp_min(1.0)


def mask_padded_classes(scores: Tensor, class_mask: Tensor | None, fill: float = float("-inf")) -> Tensor:
    """``scores [E, N, K]`` with each episode's padded classes (``class_mask [E, K]`` False) set to
    ``fill``; ``scores`` itself when ``class_mask`` is ``None``."""
    if class_mask is None:
        return scores
    return scores.masked_fill(~class_mask.unsqueeze(1), fill)


# ---------------------------------------------------------------------------------------------
# Convergence checks. A loop that stops per episode keeps an ``active [E]`` mask on the device and
# freezes an episode's state once it has converged, so its result does not depend on when the loop
# as a whole stops: the loop may look at the mask as seldom as it likes. Looking is a host sync
# (``bool(active.any())``): on a GPU it drains the queue the host has run ahead to fill, so off the
# CPU a loop looks once per CHECK_EVERY iterations. On the CPU a look costs nothing and stopping at
# once saves up to CHECK_EVERY - 1 sweeps over every episode, so there it looks every iteration
# (measured: docs/gpu.md, "Host syncs").
CHECK_EVERY = 8
# A Sinkhorn sweep is about 15 operations, so its loops look once per 16 sweeps: at most one sync
# per 150 device operations, the bound tests/test_meta_device.py holds every method to.
CHECK_EVERY_SWEEPS = 16


def syncs_freely(t: Tensor) -> bool:
    """Whether reading a value of ``t`` on the host costs nothing: on the CPU (unless the backend
    runs the device schedule, :attr:`poodle.solvers.backend.Backend.device_schedule`), where there
    is no device queue to drain."""
    return t.device.type == "cpu" and not _backend.current().device_schedule


def should_stop(active: Tensor, it: int, every: int = CHECK_EVERY) -> bool:
    """Whether a per-episode loop may stop after iteration ``it`` (0-based): no episode of
    ``active [E]`` (bool) is still iterating. Looks (one host sync) at every iteration where that is
    free (:func:`syncs_freely`), otherwise only after every ``every``-th iteration, and answers
    False in between (the caller's masks keep every episode's result the same either way)."""
    if not syncs_freely(active) and (it + 1) % every:
        return False
    return not bool(active.any())


# ---------------------------------------------------------------------------------------------
# Batched decompositions where they are fast.
#
# On CUDA, torch sends a batch of symmetric eigenproblems to cuSOLVER's batched Jacobi solver
# (syevjBatched) only when n <= 32, and SVDs to gesvdjBatched only when m, n <= 32 (the size
# cuSOLVER documents for gesvdjBatched); above that it loops over the batch, one solver call per
# matrix (pytorch PR #62003 set the gate; issue #174674 measured 914 ms for 500 float32 100 x 100
# eighs on one GPU, 8.4 ms with one batched call; issue #175585 an 83x step from n = 32 to 33). So a
# [4096, 80, 80] batch would be 4,096 serial calls: such batches go to the host in bulk instead, one
# copy each way, LAPACK per matrix in the input's dtype (the CPU path's own arithmetic, so CPU and
# CUDA get the same decomposition of the same matrix), the batch split over the host's cores.
# On the CPU, LAPACK runs single-threaded per matrix: measured on [256, 80, 80] float32 (2-core
# EPYC), 1.2 ms per matrix with one thread against 13.8 ms with two (MKL's threads fight over an
# 80 x 80 problem); docs/gpu.md, "Host syncs".
BATCHED_SOLVER_MAX = 32
HOST_MIN_PER_THREAD = 64  # matrices per host thread below which one thread does them all


def _on_host(a: Tensor) -> bool:
    return a.device.type == "cuda" and a.dim() > 2 and max(a.shape[-2:]) > BATCHED_SOLVER_MAX


def batched_eigh(a: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of ``a [E, n, n]`` (symmetric; ascending eigenvalues ``[E, n]``,
    eigenvectors ``[E, n, n]``) placed where it is fast: on a CUDA device when ``n <= 32``, else
    on the host in bulk (see above); on the CPU single-threaded per matrix. Every matrix's
    decomposition is the one LAPACK gives it alone, whatever the batch."""
    w, v = _placed(torch.linalg.eigh, a)
    return w, v


def batched_svd(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.linalg.svd(a, full_matrices=False)`` of ``a [E, m, n]`` placed as :func:`batched_eigh`
    (``U [E, m, k]``, ``S [E, k]``, ``Vh [E, k, n]``, ``k = min(m, n)``)."""
    u, s, vh = _placed(lambda x: torch.linalg.svd(x, full_matrices=False), a)
    return u, s, vh


def _placed(fn: Callable[[Tensor], tuple[Tensor, ...]], a: Tensor) -> tuple[Tensor, ...]:
    if _on_host(a):
        host = a.detach().to("cpu")  # one host sync, as the device solver's own error check is
        out = _host_map(fn, host, max(1, len(os.sched_getaffinity(0))))
        return tuple(t.to(a.device, non_blocking=True) for t in out)
    if a.device.type == "cpu":
        return _host_map(fn, a, 1)
    return fn(a)


def _host_map(fn: Callable[[Tensor], tuple[Tensor, ...]], a: Tensor, threads: int) -> tuple[Tensor, ...]:
    """``fn`` of a CPU batch, each matrix single-threaded, the batch split over ``threads``."""
    n_parts = max(1, min(threads, a.shape[0] // HOST_MIN_PER_THREAD)) if a.dim() > 2 else 1
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        if n_parts == 1:
            return tuple(fn(a))
        with ThreadPoolExecutor(n_parts, thread_name_prefix="poodle-linalg") as ex:
            parts = list(ex.map(fn, a.chunk(n_parts)))
        return tuple(torch.cat(ts) for ts in zip(*parts))
    finally:
        if before != 1:
            torch.set_num_threads(before)


def grad_ready(t: Tensor) -> Tensor:
    """``t`` usable inside autograd even when the caller built it under ``torch.inference_mode``."""
    if t.is_inference():
        with torch.inference_mode(False):
            return t.clone()
    return t


def row_sqnorm(x: Tensor) -> Tensor:
    """``||x||^2`` per row: ``[E, N, D]`` -> ``[E, N, 1]`` (no ``[E, N, D]`` temporary)."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()


def row_dot(x: Tensor, v: Tensor) -> Tensor:
    """``x . v`` for every row: ``x [E, N, D]``, ``v [E, 1, D]`` -> ``[E, N, 1]``.

    A batched matrix-vector product as ``torch.bmm`` with one output column takes a CPU path
    whose rounding depends on how many episodes share the batch (1 or 3 episodes differ from 2, 7
    or 40 in the last bit), which would make an episode's result depend on its chunk. With a zero
    second column the product takes the matrix path, the same bits for every batch size (and the
    same as the one-column product of the large batches that `poodle solve` runs)."""
    two = torch.cat([v, torch.zeros_like(v)], 1)
    return torch.bmm(x, two.transpose(1, 2))[..., :1]


def times_narrow(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``a [E, N, M]`` and a narrow ``b [E, M, K]`` (a few classes) -> ``[E, N, K]``.

    On CPU a batched product whose right operand is row-major with a few columns rounds an
    episode's product differently depending on its position in the batch; with the operand
    column-major (and the left one starting 64-byte aligned, as MKL rounds by alignment too) every
    episode gets the same bits in any chunk."""
    return torch.bmm(a, b.transpose(1, 2).contiguous().transpose(1, 2))


# ATen runs an elementwise kernel on one thread below this many elements (its parallel grain, 32768)
_SERIAL_BLOCK = 511 * 64


def pow_anywhere(x: Tensor, exponent: float) -> Tensor:
    """``x ** exponent``, each element rounded the same wherever it sits in ``x``.

    ATen's CPU kernel computes a tensor's last few elements (after the last whole pair of vectors)
    with the scalar ``std::pow``, the rest with the vectorised one, and the two can differ in the last
    bit: an episode's result would depend on its place in the chunk. Here every element takes the
    vector path: the flat tensor is padded to a multiple of 64 elements (two vectors of any width)
    and raised in blocks under ATen's parallel grain (one thread each, no split inside a block)."""
    if x.device.type != "cpu":
        return x**exponent
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.ones(-(-n // 64) * 64, dtype=x.dtype)
    padded[:n] = flat
    for block in padded.split(_SERIAL_BLOCK):
        block.pow_(exponent)
    return padded[:n].view_as(x)


def sqdist(x: Tensor, w: Tensor, x2: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances ``x [E, N, D]``, ``w [E, K, D]`` -> ``[E, N, K]`` (never negative).

    ``x2`` is ``row_sqnorm(x)`` when the caller has it (it is loop-invariant in every solver).
    """
    if x2 is None:
        x2 = row_sqnorm(x)
    d = torch.baddbmm(x2 + row_sqnorm(w).transpose(1, 2), x, w.transpose(1, 2), alpha=-2.0)
    return d.clamp_min(0.0)


def class_softmax(logits: Tensor, log: bool = False) -> Tensor:
    """``softmax`` (``log``: ``log_softmax``) of ``logits [E, N, K]`` over its last axis, the
    classes, computed classes-first: ATen's CPU kernel over a last axis of a few classes handles
    each row alone and took 6-7x as long (972 against 137 us for ``[40, 75, 5]``, one thread) as
    the same softmax over the middle axis of ``[E, K, N]``, which runs along vectors of samples.
    The same values but for the rounding of the sum over the classes (its order differs). Returns
    ``[E, N, K]`` (contiguous)."""
    if logits.device.type != "cpu" or logits.dim() != 3:
        return torch.log_softmax(logits, -1) if log else torch.softmax(logits, -1)
    t = logits.transpose(1, 2).contiguous()
    out = torch.log_softmax(t, 1) if log else torch.softmax(t, 1)
    return out.transpose(1, 2).contiguous()


def softmax_logits(x: Tensor, w: Tensor, scale: Tensor | float) -> Tensor:  # the one definition, every solver
    """``scale * (x.w - ||w||^2/2)``: the logits ``-(scale/2)||x - w||^2`` less the per-row constant
    ``-(scale/2)||x||^2``, which no softmax over classes (and no argmax) sees. ``[E, N, K]``."""
    return scale * torch.baddbmm(-0.5 * row_sqnorm(w).transpose(1, 2), x, w.transpose(1, 2))


def cosine(x: Tensor, w: Tensor, x_norm: Tensor | None = None) -> Tensor:
    """Cosine similarities ``[E, N, K]`` as ``F.normalize`` would give them (a zero vector has
    cosine 0 with everything, not NaN), without normalising ``x`` itself: ``x_norm [E, N, 1]``
    is ``||x||`` when the caller has it."""
    if x_norm is None:
        x_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    w_norm = torch.linalg.vector_norm(w, dim=-1).unsqueeze(1)
    return torch.bmm(x, w.transpose(1, 2)) / (x_norm.clamp_min(1e-12) * w_norm.clamp_min(1e-12))


def support_share(a_s: Tensor, z_s: Tensor) -> tuple[Tensor, Tensor]:
    """The support's part of :func:`weighted_means`: ``(a_s^T z_s [E, K, D], sum a_s [E, K])`` for
    assignments ``a_s [E, Ns, K]`` (made once where the support's assignments are fixed)."""
    return torch.bmm(a_s.transpose(1, 2), z_s), a_s.sum(1)


def weighted_means(support: tuple[Tensor, Tensor], a_q: Tensor, z_q: Tensor, fallback: Tensor) -> Tensor:
    """``(a_s^T z_s + a_q^T z_q) / (sum a_s + sum a_q)`` per class: ``[E, K, D]``.

    ``support`` is :func:`support_share` of the support's assignments; ``a_q [E, Nq, K]`` the
    queries' (soft or hard) assignments. A class with zero total weight keeps ``fallback [E, K, D]``
    (its previous centre) instead of becoming NaN.
    """
    num_s, den_s = support
    num = num_s + torch.bmm(a_q.transpose(1, 2), z_q)
    den = (den_s + a_q.sum(1)).unsqueeze(-1)  # [E, K, 1]
    empty = den <= 0
    return torch.where(empty, fallback, num / torch.where(empty, torch.ones_like(den), den))


def centre_and_project(
    z_s: Tensor,
    z_q: Tensor,
    reduced_dim: int,
    s_weight: Tensor | None = None,
    q_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """TAFSSL's task-adaptive sub-space: centre support and query sets on their own means,
    L2-normalise, then (``reduced_dim > 0``) project every episode onto the top ``reduced_dim``
    right singular vectors of its stacked samples and normalise again.

    ``z_s [E, Ns, D]``, ``z_q [E, Nq, D]`` -> the same with ``D`` replaced by ``min(reduced_dim,
    Ns + Nq, D)`` (or unchanged when ``reduced_dim == 0``). ``s_weight [E, Ns, 1]`` and ``q_weight
    [E, Nq, 1]`` (0/1; :func:`row_weight`) mark a ragged chunk's real rows: the means are over them,
    padded rows take no part in the decomposition (their block of the Gram matrix is decoupled, its
    eigenvalues below every real direction's) and come out zero.
    """
    if reduced_dim <= 0:
        return _centred(z_s, weight=s_weight), _centred(z_q, weight=q_weight)
    # both sets, centred and normalised, written straight into one [E, N, D] buffer (no concatenation)
    E, ns, D = z_s.shape
    x = torch.empty(E, ns + z_q.shape[1], D, dtype=z_s.dtype, device=z_s.device)
    _centred(z_s, out=x[:, :ns], weight=s_weight)
    _centred(z_q, out=x[:, ns:], weight=q_weight)
    n = x.shape[1]
    r = min(reduced_dim, n, x.shape[2])
    # Coordinates in the top-r principal directions, x V_r = U_r S_r, from the eigen-decomposition
    # of the small N x N Gram matrix (cheaper than an SVD of N x D). Distances after projection do
    # not depend on the sign/rotation ambiguity of the basis within the sub-space.
    gram = torch.bmm(x, x.transpose(1, 2))
    real = None
    if s_weight is not None or q_weight is not None:
        ones = torch.ones_like(x[:, :1, :1])
        w_s = ones.expand(E, ns, 1) if s_weight is None else s_weight
        w_q = ones.expand(E, z_q.shape[1], 1) if q_weight is None else q_weight
        real = torch.cat([w_s, w_q], 1)  # [E, N, 1]
        # A padded row's Gram row and column are zero; a zero block of repeated eigenvalues is what
        # LAPACK's float32 solver fails to converge on (measured), so its diagonal is -1 instead: its
        # eigenvalues -1 lie below every real one (>= 0), its eigenvectors are the padded coordinates,
        # and the real block's decomposition is untouched.
        gram.diagonal(dim1=1, dim2=2).add_(real.squeeze(-1) - 1)
    evals, evecs = batched_eigh(gram)  # ascending
    top = evecs[:, :, n - r :] * evals[:, n - r :].clamp_min(0).sqrt().unsqueeze(1)
    top = F.normalize(top, dim=-1)
    if real is not None:
        top = top * real  # a padded row's coordinates are exactly zero
    return top[:, : z_s.shape[1]], top[:, z_s.shape[1] :]


def _centred(z: Tensor, out: Tensor | None = None, weight: Tensor | None = None) -> Tensor:
    """``F.normalize(z - mean(z), dim=-1)`` over the rows of each episode of ``z [E, N, D]``, the
    same arithmetic as that expression, written into ``out`` when given; with ``weight [E, N, 1]``
    the mean is over the real rows and padded rows come out zero."""
    if weight is None:
        c = z - z.mean(1, keepdim=True)
    else:
        c = (z - masked_mean(z, weight)) * weight
    return torch.div(c, torch.linalg.vector_norm(c, dim=-1, keepdim=True).clamp_min(1e-12), out=out)


def log_normalise(p: Tensor) -> Tensor:
    """Log of ``p`` normalised over its last axis, finite everywhere (``p >= 0``)."""
    return torch.log_softmax(torch.log(p.clamp_min(TINY)), dim=-1)


def dist_flops(n: int, k: int, d: int) -> float:
    """FLOPs of one ``[n, d] x [d, k]`` distance/similarity matrix."""
    return 2.0 * n * k * d


def rectified_prototypes(
    z_s: Tensor,
    labels_s: Tensor,
    z_q: Tensor,
    way: int,
    epsilon: float,
    shift: bool = True,
    q2: Tensor | None = None,
    pad: EpisodeBatch | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """BD-CSPN's bias-diminished prototypes (Liu et al. 2020, Eqs. 5-8).

    Cross-class bias: queries are shifted by ``delta = mean(z_s) - mean(z_q)`` (when ``shift``).
    Intra-class bias: each class's set is its support points plus the (shifted) queries whose
    nearest basic prototype (cosine) is that class; the rectified prototype is the average of that
    set weighted by ``softmax_i(epsilon * cos(x_i, P_k))`` over the set's members.

    ``z_s [E, Ns, D]``, ``labels_s [E, Ns]``, ``z_q [E, Nq, D]`` (``q2``: its :func:`row_sqnorm` when
    the caller has it) -> ``(prototypes [E, way, D], delta [E, 1, D], ||z_q + delta|| [E, Nq, 1])``.
    The shifted queries are never materialised: every product with them is ``z_q . v + delta . v``
    (the solver is memory-bound; this reads the features fewer times); their norms are returned for
    the caller's :func:`shifted_cosine`. Every class contains its support points, so no weight is 0/0.
    ``pad``: the ragged batch whose masks apply (the means are over real rows, a padded query joins
    no class, no query joins a padded class, and a padded class's prototype is zero).
    """
    ragged = pad is not None and pad.ragged
    s_w = row_weight(pad.support_mask, z_s.dtype) if ragged and pad is not None else None
    q_w = pad.query_weight() if ragged and pad is not None else None
    cm = pad.class_mask if ragged and pad is not None else None
    if shift:
        delta = (
            masked_mean(z_s, s_w) - masked_mean(z_q, q_w)
            if ragged
            else z_s.mean(1, keepdim=True) - z_q.mean(1, keepdim=True)
        )
    else:
        delta = torch.zeros_like(z_s[:, :1])
    y_s = one_hot(labels_s, way, z_s.dtype)
    base = torch.bmm(y_s.transpose(1, 2), z_s) / y_s.sum(1).clamp_min(1.0).unsqueeze(-1)
    cos_s = cosine(z_s, base)
    q_norm = shifted_norm(z_q, delta, q2)
    cos_q = shifted_cosine(z_q, delta, base, q_norm)
    member_q = one_hot(mask_padded_classes(cos_q, cm).argmax(-1), way, torch.bool)
    if q_w is not None:
        member_q = member_q & (q_w > 0)
    logits = (epsilon * torch.cat([cos_s, cos_q], 1)).masked_fill(~torch.cat([y_s.bool(), member_q], 1), float("-inf"))
    w = torch.softmax(logits, dim=1)  # over the set's members
    if ragged:
        w = w.nan_to_num(0.0)  # a padded class has no member: zero weights, not 0/0
    w_s, w_q = w[:, : z_s.shape[1]], w[:, z_s.shape[1] :]
    protos = (
        torch.bmm(w_s.transpose(1, 2), z_s) + torch.bmm(w_q.transpose(1, 2), z_q) + w_q.sum(1).unsqueeze(-1) * delta
    )
    return protos, delta, q_norm


def shifted_norm(z_q: Tensor, delta: Tensor, q2: Tensor | None = None) -> Tensor:
    """``||z_q + delta||`` per row, ``[E, Nq, 1]``, without making ``z_q + delta`` (``q2``:
    :func:`row_sqnorm` of ``z_q`` when the caller has it)."""
    q2 = row_sqnorm(z_q) if q2 is None else q2
    return (q2 + 2 * row_dot(z_q, delta) + row_sqnorm(delta)).clamp_min(0.0).sqrt()


def shifted_cosine(z_q: Tensor, delta: Tensor, w: Tensor, q_norm: Tensor | None = None) -> Tensor:
    """``cos(z_q + delta, w)``: ``z_q [E, Nq, D]``, ``delta [E, 1, D]``, ``w [E, K, D]`` -> ``[E, Nq, K]``
    (``q_norm``: :func:`shifted_norm` when the caller has it)."""
    wt = w.transpose(1, 2)
    dot = torch.bmm(z_q, wt) + torch.bmm(delta, wt)
    q_norm = shifted_norm(z_q, delta) if q_norm is None else q_norm
    w_norm = torch.linalg.vector_norm(w, dim=-1).unsqueeze(1)
    return dot / (q_norm.clamp_min(1e-12) * w_norm.clamp_min(1e-12))
