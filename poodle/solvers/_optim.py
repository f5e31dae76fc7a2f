"""The shared engine of the fine-tuning solvers (ce, poodle, naive-ood): an analytic-gradient,
batched fit of prototypes ``W [E, K, D]`` and one scale ``gamma [E]`` per episode, under any loss
of the "weighted distance" family, followed by a hand-written batched Adam.

Why not autograd: the authors' implementation builds the loss from ``[T, n, D]`` tensors every
step (recomputing ``||x||^2`` of every fixed row), which is memory-bound and allocates per step.
Here every row of an episode (support, query when transductive, negatives) sits once in one tensor
``X [E, n, D]`` with per-row coefficients, ``||x||^2`` is precomputed, and one step is two thin
batched matmuls (``X W^T`` and ``G^T X``) plus a few small elementwise operations on ``[E, n, K]``
and ``[E, K*D]`` buffers that are allocated once.

The loss of one episode, with logits ``l_ik = gamma * (x_i.w_k - ||x_i||^2/2 - ||w_k||^2/2)``
(= ``-(gamma/2) ||x_i - w_k||^2``) and ``p_i = softmax_k(l_i)``, is::

    L = sum_i ce_i * (-sum_k t_ik log p_ik)              # cross-entropy rows (t: target distribution)
      + sum_i c_i * sum_k l_ik * q_ik                    # weighted-distance rows, q = stopgrad(p) or p

Its gradient with respect to the logits is, row by row (``lbar_i = sum_k p_ik l_ik``)::

    dL/dl_ik = ce_i * (p_ik - t_ik) + c_i * p_ik + [no stop-gradient] c_i * p_ik * (l_ik - lbar_i)

and the chain rule through ``l`` gives ``dL/dw_k = gamma * (sum_i G_ik x_i - (sum_i G_ik) w_k)``
and ``dL/dgamma = sum_ik G_ik (x_i.w_k - ||w_k||^2/2) - sum_i (sum_k G_ik) ||x_i||^2/2``, where
``sum_k G_ik = c_i`` exactly (the cross-entropy part sums to zero over classes, and so does the
no-stop-gradient part), so the last term is a per-episode constant computed once.

The loss of a chunk is the sum of its episodes' losses, so with Adam (element-wise) every episode
is optimised exactly as it would be alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from poodle.solvers import _native

# Whether CPU fits may use the fused C kernel (see _native.py); the tests switch it off to check the
# torch formulation against the same references.
USE_NATIVE = True

# Padding of each episode's parameter row: keeps the K*D prototype block and the scale in one
# buffer (one Adam for both) while every episode's row starts on a 64-byte boundary.
_PAD = 16


@dataclass
class RowTerms:
    """Per-row coefficients of the weighted-distance loss for the ``n`` rows of every episode.

    Rows run along the last axis (``[.., K, n]``): the softmax over the ``K`` classes then
    vectorises across rows, which matters on CPU where a softmax over a last axis of 5 is slow.

    Attributes:
        targets: ``[E or 1, K, n]`` CE target distribution of each row already multiplied by its
            ``ce`` weight (zero columns for rows without a CE term).
        ce: ``[E or 1, 1, n]`` weight of each row's cross-entropy term (``1/Ns`` for support rows).
        coef: ``[E or 1, 1, n]`` weight ``c_i`` of each row's weighted-distance term
            (``-alpha/N_pos`` for positives, ``+beta/M`` for negatives, 0 otherwise).
        free: ``[E or 1, 1, n]`` or ``None``: ``c_i`` for the rows whose weights ``p`` are *not*
            stop-gradiented (the paper's Table 9 ablation), 0 for the others.
    """

    targets: Tensor
    ce: Tensor
    coef: Tensor
    free: Tensor | None = None


@dataclass
class NativeLoss:
    """A logit loss the fused CPU kernel computes itself (``lf_fit`` in ``_wd_kernel.c``), given to
    :func:`fit_logit_loss` beside the ``grad_logits`` of the torch formulation, which it replaces.

    Attributes:
        kind: ``"tim"`` (TIM's mutual information, weights ``(ce, marginal, conditional)``) or
            ``"entropy"`` (mean query entropy, weights ``(ce, entropy, unused)``).
        n_support: the number ``Ns`` of support rows, first among the rows.
        targets: ``[E, K, Ns]`` one-hot support labels.
        weights: the loss's three weights (see ``kind``).
    """

    kind: str
    n_support: int
    targets: Tensor
    weights: tuple[float, float, float]


def _adam_step(
    theta: Tensor,
    grad: Tensor,
    m: Tensor,
    v: Tensor,
    den: Tensor,
    step: int,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
) -> None:
    """One step of torch.optim.Adam (its single-tensor path), operation for operation, in place on
    ``theta`` with moments ``m``, ``v`` and scratch ``den`` (all shaped like ``theta``)."""
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    step_size = lr / (1 - b1**step)
    torch.sqrt(v, out=den)
    den.div_((1 - b2**step) ** 0.5).add_(eps)
    theta.addcdiv_(m, den, value=-step_size)


def fit_weighted_distance(
    x: Tensor,
    terms: RowTerms,
    w0: Tensor,
    *,
    scale0: float = 10.0,
    steps: int = 250,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    learn_scale: bool = True,
) -> tuple[Tensor, Tensor]:
    """Fine-tune the prototypes and scales of ``E`` episodes at once.

    Args:
        x: ``[E, n, D]`` every row that enters the loss (support, [query], negatives).
        terms: per-row coefficients (see :class:`RowTerms`).
        w0: ``[E, K, D]`` initial prototypes.
        scale0: initial scale ``gamma`` (the same for every episode).
        steps, lr, betas, eps: Adam, with exactly ``torch.optim.Adam``'s arithmetic.
        learn_scale: whether gamma is learned (it is in the authors' code).

    Returns:
        ``(W [E, K, D], gamma [E, 1, 1])`` after ``steps`` Adam steps.
    """
    E, n, D = x.shape
    K = w0.shape[1]
    F = K * D
    dev, dt = x.device, x.dtype
    if USE_NATIVE and _native.usable(x):
        x2n = (x * x).sum(-1).unsqueeze(1)
        c0n = (terms.coef * x2n).sum((1, 2)).mul_(0.5)
        return _native.fit(
            x, terms.targets, terms.ce + terms.coef, terms.free, c0n, w0, scale0, steps, lr, betas, eps, learn_scale
        )
    theta = torch.zeros(E, F + _PAD, device=dev, dtype=dt)
    theta[:, :F] = w0.reshape(E, F)
    theta[:, F] = scale0
    W = theta[:, :F].view(E, K, D)
    gamma = theta[:, F].view(E, 1, 1)
    xt = x.transpose(1, 2)

    grad = torch.zeros_like(theta)
    gW = grad[:, :F].view(E, K, D)
    gg = grad[:, F]
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    den = torch.empty_like(theta)

    S = torch.empty(E, K, n, device=dev, dtype=dt)
    Z = torch.empty_like(S)
    L = torch.empty_like(S)
    P = torch.empty_like(S)
    G = torch.empty_like(S)
    GZ = torch.empty_like(S)
    GX = torch.empty(E, K, D, device=dev, dtype=dt)
    w2 = torch.empty(E, K, device=dev, dtype=dt)
    colsum = torch.empty(E, K, device=dev, dtype=dt)
    free = None if terms.free is None else terms.free.expand(E, 1, n).contiguous()
    lbar = torch.empty(E, 1, n, device=dev, dtype=dt) if free is not None else None
    T1 = torch.empty_like(S) if free is not None else None

    x2 = (x * x).sum(-1).unsqueeze(1)  # [E, 1, n]
    r = (terms.ce + terms.coef).expand(E, 1, n).contiguous()
    targets = terms.targets.expand(E, K, n).contiguous()
    # the ||x||^2 part of dL/dgamma, -sum_i c_i ||x_i||^2 / 2, is constant over the steps
    c0 = (terms.coef * x2).sum((1, 2)).mul_(0.5)  # [E]

    b1, b2 = betas
    softmax_out = torch.ops.aten._softmax.out
    for step in range(1, steps + 1):
        torch.bmm(W, xt, out=S)  # x.w
        torch.linalg.vecdot(W, W, out=w2)
        torch.sub(S, w2.unsqueeze(-1), alpha=0.5, out=Z)  # x.w - |w|^2/2
        torch.mul(Z, gamma, out=L)  # logits + gamma|x|^2/2
        softmax_out(L, 1, False, out=P)
        torch.mul(P, r, out=G)  # dL/dlogits
        G.sub_(targets)
        if free is not None:
            assert T1 is not None and lbar is not None
            torch.mul(P, L, out=T1)
            torch.sum(T1, 1, keepdim=True, out=lbar)
            torch.sub(L, lbar, out=T1)
            T1.mul_(P).mul_(free)
            G.add_(T1)
        if learn_scale:
            torch.mul(G, Z, out=GZ)
            torch.sum(GZ.view(E, -1), 1, out=gg)
            gg.sub_(c0)
        torch.sum(G, 2, out=colsum)
        torch.bmm(G, x, out=GX)  # (an in-place baddbmm on the
        torch.addcmul(GX, W, colsum.unsqueeze(-1), value=-1.0, out=gW)  # strided gW runs per episode)
        gW.mul_(gamma)

        _adam_step(theta, grad, m, v, den, step, lr, b1, b2, eps)
    return W.clone(), gamma.clone()


def fit_logit_loss(
    x: Tensor,
    w0: Tensor,
    grad_logits: Callable[[Tensor, Tensor, Tensor], None],
    *,
    scale0: float,
    steps: int,
    lr: float,
    learn_scale: bool,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    native: NativeLoss | None = None,
) -> tuple[Tensor, Tensor]:
    """Adam on the prototypes and scale of ``E`` episodes for any loss of the distance logits
    ``l_ik = gamma * (x_i.w_k - ||w_k||^2/2)`` whose gradient rows sum to zero over classes (every
    loss of the softmax probabilities does: the softmax ignores a constant added to a row), given
    ``dL/dl`` by ``grad_logits(P, L, G)``, which writes it into ``G``. What autograd would compute,
    with one pass of a few fused operations per step instead of a recorded graph (TIM-GD runs 1,000
    steps of it).

    Args:
        x: ``[E, n, D]`` every row the loss sees.
        w0: ``[E, K, D]`` initial prototypes.
        grad_logits: fills ``G [E, K, n]`` from the probabilities ``P [E, K, n]`` (softmax over
            ``K``) and the logits ``L [E, K, n]``.
        scale0, steps, lr, learn_scale, betas, eps: as :func:`fit_weighted_distance`.
        native: the same loss as ``grad_logits``, for the fused CPU kernel (used when given, the
            kernel is usable and :data:`USE_NATIVE`): one pass over an episode's rows per step
            instead of about 25 torch operations, each a pass over ``[E, K, n]``.

    Returns:
        ``(W [E, K, D], gamma [E, 1, 1])``.
    """
    if native is not None and USE_NATIVE and _native.usable(x):
        return _native.fit_logits(
            x,
            native.n_support,
            native.targets,
            native.kind,
            native.weights,
            w0,
            scale0,
            steps,
            lr,
            betas,
            eps,
            learn_scale,
        )
    E, n, D = x.shape
    K = w0.shape[1]
    F = K * D
    dev, dt = x.device, x.dtype
    theta = torch.zeros(E, F + _PAD, device=dev, dtype=dt)
    theta[:, :F] = w0.reshape(E, F)
    theta[:, F] = scale0
    W = theta[:, :F].view(E, K, D)
    gamma = theta[:, F].view(E, 1, 1)
    xt = x.transpose(1, 2)
    grad = torch.zeros_like(theta)
    gW = grad[:, :F].view(E, K, D)
    gg = grad[:, F]
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    den = torch.empty_like(theta)
    S = torch.empty(E, K, n, device=dev, dtype=dt)
    Z, L, P, G, GZ = (torch.empty_like(S) for _ in range(5))
    GX = torch.empty(E, K, D, device=dev, dtype=dt)
    w2 = torch.empty(E, K, device=dev, dtype=dt)
    colsum = torch.empty(E, K, device=dev, dtype=dt)
    b1, b2 = betas
    for step in range(1, steps + 1):
        torch.bmm(W, xt, out=S)
        torch.linalg.vecdot(W, W, out=w2)
        torch.sub(S, w2.unsqueeze(-1), alpha=0.5, out=Z)
        torch.mul(Z, gamma, out=L)
        torch.softmax(L, 1, out=P)
        grad_logits(P, L, G)
        if learn_scale:
            torch.mul(G, Z, out=GZ)
            torch.sum(GZ.view(E, -1), 1, out=gg)
        torch.sum(G, 2, out=colsum)
        torch.bmm(G, x, out=GX)
        torch.addcmul(GX, W, colsum.unsqueeze(-1), value=-1.0, out=gW)
        gW.mul_(gamma)
        _adam_step(theta, grad, m, v, den, step, lr, b1, b2, eps)
    return W.clone(), gamma.clone()


def weighted_distance_flops(n: int, D: int, K: int, steps: int, free: bool = False) -> float:
    """FLOPs of :func:`fit_weighted_distance` per episode: two ``n x D x K`` matmuls per step plus the
    elementwise work on ``[n, K]`` and the Adam update on ``K*D + 1`` parameters."""
    per_step = 4.0 * n * D * K + (14 if free else 8) * n * K + 4 * K * D + 12 * (K * D + 1)
    return steps * per_step


def episode_bytes(n: int, D: int, K: int, itemsize: int = 4) -> int:
    """Working set of one episode in :func:`fit_weighted_distance` (bytes): the rows, the
    parameter/Adam buffers and the ``[n, K]`` temporaries."""
    return itemsize * (n * D + 6 * (K * D + _PAD) + 10 * n * K + 2 * n)


__all__ = [
    "RowTerms",
    "NativeLoss",
    "fit_weighted_distance",
    "fit_logit_loss",
    "weighted_distance_flops",
    "episode_bytes",
]
