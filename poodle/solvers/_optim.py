"""The shared engine of the fine-tuning solvers (ce, poodle, naive-ood, tim-gd, alpha-tim,
entropy-min): an analytic-gradient, batched fit of prototypes ``W [E, K, D]`` and one scale
``gamma [E]`` per episode, under any loss of the distance logits, with a hand-written batched Adam.

Why not autograd: the authors' implementation builds the loss from ``[T, n, D]`` tensors every
step (recomputing ``||x||^2`` of every fixed row), which is memory-bound and allocates per step.
Here every row of an episode (support, query when transductive, negatives) sits once in one tensor
``X [E, n, D]``, and one step is two thin batched matmuls (``X W^T`` and ``G^T X``) plus a few small
elementwise operations on ``[E, K, n]`` and ``[E, K*D]`` buffers that are allocated once; on CPU
the fused kernel (:mod:`poodle.solvers._native`) does the same arithmetic in one pass over the rows.

The logits are ``l_ik = gamma * (x_i.w_k - ||w_k||^2/2)`` (``-(gamma/2) ||x_i - w_k||^2`` up to a
per-row constant, which the softmax ignores) and ``p_i = softmax_k(l_i)``. Given ``G = dL/dl``
(rows along the last axis, ``[E, K, n]``), the chain rule through ``l`` gives
``dL/dw_k = gamma * (sum_i G_ik x_i - (sum_i G_ik) w_k)`` and
``dL/dgamma = sum_ik G_ik (x_i.w_k - ||w_k||^2/2) - c0``, where ``c0`` is what the loss's
``||x||^2`` terms add, a constant of the episode.

**How a loss plugs in.** A loss is an object with

- ``grad_logits(P, L, G)``: writes ``dL/dl [E, K, n]`` into ``G`` from the probabilities ``P`` and
  the logits ``L`` (both ``[E, K, n]``): the torch formulation;
- ``gamma_offset``: ``[E]`` or ``None``, the constant ``c0`` above;
- ``kernel()``: the :class:`~poodle.solvers._native.KernelTerms` of the fused CPU kernel, or
  ``None`` where the kernel does not know the loss (the torch formulation then runs on CPU too).

:func:`fit` runs it: the kernel where it can, otherwise :func:`fit_torch`, the one step loop of
the torch formulation; on CUDA with the backend's ``cuda_step="triton"``, the Triton step
(:mod:`poodle.solvers._triton_step`) for the losses it knows. The two losses here are
:class:`WeightedDistance` (POODLE, CE, naive-OOD: per-row coefficients, :class:`RowTerms`) and
:class:`LogitLoss` (a ``grad_logits`` callback, with a :class:`NativeLoss` where a kernel computes
it: TIM-GD, entropy minimisation, alpha-TIM). A new fused
loss in the kernel is a ``LOSS_`` case in ``_fit_kernel.c`` (its dL/dlogits of the query rows), a
key of ``_native.LOSSES`` and the ``kernel()`` of its loss object here.

The weighted-distance loss of one episode, with ``p_i = softmax_k(l_i)``, is::

    L = sum_i ce_i * (-sum_k t_ik log p_ik)              # cross-entropy rows (t: target distribution)
      + sum_i c_i * sum_k l'_ik * q_ik                   # weighted-distance rows, q = stopgrad(p) or p

with ``l'_ik = l_ik - gamma ||x_i||^2 / 2``, the full distance logit. Its gradient with respect to
the logits is, row by row (``lbar_i = sum_k p_ik l_ik``)::

    dL/dl_ik = ce_i * (p_ik - t_ik) + c_i * p_ik + [no stop-gradient] c_i * p_ik * (l_ik - lbar_i)

and ``sum_k G_ik = c_i`` exactly (the cross-entropy part sums to zero over classes, and so does the
no-stop-gradient part), so ``c0 = sum_i c_i ||x_i||^2 / 2``. Losses of the softmax alone (TIM,
entropy) have rows of ``G`` summing to zero and no ``c0``.

The loss of a chunk is the sum of its episodes' losses, so with Adam (element-wise) every episode
is optimised exactly as it would be alone.

**Ragged chunks** (episodes of different shapes padded to the largest, :class:`Padding`): a padded
class gets the logit ``-inf`` (no probability; its ``P``, ``L`` and ``G`` are zero, so its prototype
never moves) and a padded row must carry no weight in the loss (zero coefficients, or the loss's
own masks in ``grad_logits``). The kernels take each episode's own sizes: :func:`fit` moves each
episode's real rows to the front of every array of rows (support before queries) and passes its
numbers of classes, rows and support rows, so that every loop runs over the episode's own rows and
classes and computes what the episode computes alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from poodle.solvers import _native
from poodle.solvers import backend as _backend
from poodle.solvers._native import KernelTerms

# Padding of each episode's parameter row: keeps the K*D prototype block and the scale in one
# buffer (one Adam for both) while every episode's row starts on a 64-byte boundary.
_PAD = 16


@dataclass(frozen=True)
class FitOptions:
    """The fit's start and Adam: ``scale0`` (the initial ``gamma`` of every episode), ``steps``,
    ``lr``, ``betas``, ``eps`` with exactly ``torch.optim.Adam``'s arithmetic, and ``learn_scale``
    (whether ``gamma`` is learned; it is in the authors' code)."""

    scale0: float = 10.0
    steps: int = 250
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    learn_scale: bool = True


@dataclass
class Padding:
    """Where a ragged chunk is padding, for :func:`fit`.

    Attributes:
        classes: ``[E, K]`` bool, True for an episode's real classes, or ``None`` (all real).
        rows: ``[E, n]`` bool, True for the real rows of ``x``, or ``None`` (all real). A logit
            loss's support rows are the first ``n_support`` of the ``n`` either way.
    """

    classes: Tensor | None = None
    rows: Tensor | None = None

    @property
    def any(self) -> bool:
        return self.classes is not None or self.rows is not None

    @staticmethod
    def of(classes: Tensor | None, *parts: tuple[Tensor | None, int]) -> Padding | None:
        """The padding of rows made of ``parts`` (each ``(mask [E, n_i] or None, n_i)``, in the
        rows' order; ``None``: all ``n_i`` real) and of ``classes``; ``None`` when nothing is padded."""
        masks = [m for m, _ in parts if m is not None]
        if classes is None and not masks:
            return None
        rows = None
        if masks:
            E, dev = masks[0].shape[0], masks[0].device
            rows = torch.cat([torch.ones(E, n, dtype=torch.bool, device=dev) if m is None else m for m, n in parts], 1)
        return Padding(classes, rows)


class Loss(Protocol):
    """A loss of the distance logits (see the module docstring: how a loss plugs in)."""

    gamma_offset: Tensor | None

    def grad_logits(self, P: Tensor, L: Tensor, G: Tensor) -> None: ...

    def kernel(self) -> KernelTerms | None: ...


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


class WeightedDistance:
    """The weighted-distance loss of rows ``x [E, n, D]`` with coefficients ``terms`` (POODLE, CE,
    naive-OOD)."""

    def __init__(self, x: Tensor, terms: RowTerms) -> None:
        self.terms = terms
        self.shape = x.shape
        # the ||x||^2 part of dL/dgamma, -sum_i c_i ||x_i||^2 / 2, is constant over the steps
        x2 = (x * x).sum(-1).unsqueeze(1)  # [E, 1, n]
        self.gamma_offset: Tensor | None = (terms.coef * x2).sum((1, 2)).mul_(0.5)  # [E]
        self._buffers: tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None] | None = None

    def kernel(self) -> KernelTerms:
        t = self.terms
        return KernelTerms("weighted-distance", t.targets, t.ce + t.coef, t.free, self.gamma_offset)

    def _prepared(self, P: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """``r``, the targets and ``free`` expanded to every episode, and the no-stop-gradient scratch."""
        if self._buffers is None:
            E, K, n = P.shape
            t = self.terms
            free = None if t.free is None else t.free.expand(E, 1, n).contiguous()
            lbar = torch.empty(E, 1, n, device=P.device, dtype=P.dtype) if free is not None else None
            t1 = torch.empty_like(P) if free is not None else None
            r = (t.ce + t.coef).expand(E, 1, n).contiguous()
            self._buffers = (r, t.targets.expand(E, K, n).contiguous(), free, lbar, t1)
        return self._buffers

    def grad_logits(self, P: Tensor, L: Tensor, G: Tensor) -> None:
        r, targets, free, lbar, T1 = self._prepared(P)
        torch.mul(P, r, out=G)
        G.sub_(targets)
        if free is not None:
            assert T1 is not None and lbar is not None
            torch.mul(P, L, out=T1)
            torch.sum(T1, 1, keepdim=True, out=lbar)
            torch.sub(L, lbar, out=T1)
            T1.mul_(P).mul_(free)
            G.add_(T1)


@dataclass
class NativeLoss:
    """A logit loss the fused CPU kernel computes itself, given to :func:`fit_logit_loss` beside the
    ``grad_logits`` of the torch formulation, which it replaces there.

    Attributes:
        kind: ``"tim"`` (TIM's mutual information, weights ``(ce, marginal, conditional)``),
            ``"entropy"`` (mean query entropy, weights ``(ce, entropy, unused)``) or ``"alpha"``
            (alpha-TIM, weights as ``"tim"``).
        n_support: the number ``Ns`` of support rows, first among the rows.
        targets: ``[E, K, Ns]`` one-hot support labels.
        weights: the loss's three weights (see ``kind``).
        alpha: the alpha-entropy order (``"alpha"`` only).
    """

    kind: str
    n_support: int
    targets: Tensor
    weights: tuple[float, float, float]
    alpha: float = 0.0


class LogitLoss:
    """A loss of the softmax probabilities given by its ``grad_logits`` (TIM-GD, alpha-TIM,
    entropy minimisation), with its :class:`NativeLoss` where the kernel knows it."""

    gamma_offset: Tensor | None = None

    def __init__(self, grad_logits: Callable[[Tensor, Tensor, Tensor], None], native: NativeLoss | None) -> None:
        self.grad_logits = grad_logits
        self.native = native

    def kernel(self) -> KernelTerms | None:
        n = self.native
        if n is None or n.kind not in _native.LOSSES:
            return None
        return KernelTerms(n.kind, n.targets, n_support=n.n_support, weights=n.weights, alpha=n.alpha)


# ---------------------------------------------------------------------------------------------
# The engine


def adam_step(theta: Tensor, grad: Tensor, m: Tensor, v: Tensor, den: Tensor, step: int, opts: FitOptions) -> None:
    """One step of torch.optim.Adam (its single-tensor path), operation for operation, in place on
    ``theta`` with moments ``m``, ``v`` and scratch ``den`` (all shaped like ``theta``)."""
    b1, b2 = opts.betas
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    step_size = opts.lr / (1 - b1**step)
    torch.sqrt(v, out=den)
    den.div_((1 - b2**step) ** 0.5).add_(opts.eps)
    theta.addcdiv_(m, den, value=-step_size)


def fit_torch(
    x: Tensor, w0: Tensor, loss: Loss, opts: FitOptions, classes: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The torch formulation: ``opts.steps`` Adam steps on the prototypes and scales of ``E``
    episodes, rows ``x [E, n, D]``, from ``w0 [E, K, D]`` -> ``(W [E, K, D], gamma [E, 1, 1])``;
    ``classes [E, K]`` (a ragged chunk's real classes) gives the others no probability."""
    E, n, D = x.shape
    K = w0.shape[1]
    F = K * D
    dev, dt = x.device, x.dtype
    # prototypes and scale in one buffer per episode (one Adam for both), and their gradient
    theta = torch.zeros(E, F + _PAD, device=dev, dtype=dt)
    theta[:, :F] = w0.reshape(E, F)
    theta[:, F] = opts.scale0
    W, gamma = theta[:, :F].view(E, K, D), theta[:, F].view(E, 1, 1)
    grad = torch.zeros_like(theta)
    gW, gg = grad[:, :F].view(E, K, D), grad[:, F]
    m, v, den = torch.zeros_like(theta), torch.zeros_like(theta), torch.empty_like(theta)
    xt = x.transpose(1, 2)
    S = torch.empty(E, K, n, device=dev, dtype=dt)
    Z, L, P, G, GZ = (torch.empty_like(S) for _ in range(5))
    GX = torch.empty(E, K, D, device=dev, dtype=dt)
    w2 = torch.empty(E, K, device=dev, dtype=dt)
    colsum = torch.empty(E, K, device=dev, dtype=dt)
    softmax_out = torch.ops.aten._softmax.out
    pad = None if classes is None else ~classes.unsqueeze(-1)  # [E, K, 1]
    for step in range(1, opts.steps + 1):
        torch.bmm(W, xt, out=S)  # x.w
        torch.linalg.vecdot(W, W, out=w2)
        torch.sub(S, w2.unsqueeze(-1), alpha=0.5, out=Z)  # x.w - |w|^2/2
        torch.mul(Z, gamma, out=L)  # logits
        if pad is not None:
            L.masked_fill_(pad, float("-inf"))
        softmax_out(L, 1, False, out=P)
        if pad is not None:
            L.masked_fill_(pad, 0.0)  # P and L zero on a padded class: no loss term sees it
        loss.grad_logits(P, L, G)  # dL/dlogits
        if pad is not None:
            G.masked_fill_(pad, 0.0)
        if opts.learn_scale:
            torch.mul(G, Z, out=GZ)
            torch.sum(GZ.view(E, -1), 1, out=gg)
            if loss.gamma_offset is not None:
                gg.sub_(loss.gamma_offset)
        torch.sum(G, 2, out=colsum)
        torch.bmm(G, x, out=GX)  # (an in-place baddbmm on the
        torch.addcmul(GX, W, colsum.unsqueeze(-1), value=-1.0, out=gW)  # strided gW runs per episode)
        gW.mul_(gamma)
        adam_step(theta, grad, m, v, den, step, opts)
    return W.clone(), gamma.clone()


def fit(x: Tensor, w0: Tensor, loss: Loss, opts: FitOptions, padding: Padding | None = None) -> tuple[Tensor, Tensor]:
    """Fit the prototypes and scales of ``E`` episodes under ``loss``: the fused kernel where it
    can run (CPU, float32/64, the loss known to it, the backend's ``native``), else
    :func:`fit_torch`; on a device the backend's ``step_devices`` name with ``cuda_step="triton"``,
    the Triton step. Reports what ran to the backend (:func:`poodle.solvers.backend.ran`).

    Args:
        x: ``[E, n, D]`` every row the loss sees.
        w0: ``[E, K, D]`` initial prototypes (zero for a padded class).
        loss: see :class:`Loss`.
        opts: the start scale and Adam.
        padding: a ragged chunk's padded classes and rows (``None``: none).

    Returns:
        ``(W [E, K, D], gamma [E, 1, 1])`` after ``opts.steps`` Adam steps.
    """
    if padding is not None and not padding.any:
        padding = None
    be = _backend.current()
    triton = _triton_loss(x, loss, be)
    terms = loss.kernel() if be.native and x.device.type == "cpu" and triton is None else None
    if triton is not None:
        what, result = "triton", _triton_fit(x, w0, triton, opts, padding, be)
    elif terms is not None and _native.usable(x):
        what = _native.formulation()
        if padding is None:
            result = _native.fit(x, w0, terms, opts)
        else:
            xp, terms, sizes = _pack_kernel(x, terms, padding)
            result = _native.fit(xp, w0, terms, opts, sizes)
    else:
        if x.device.type != "cpu":
            what = "torch" if be.cuda_step == "torch" else "torch (no Triton step for this fit here)"
        elif not be.native:
            what = "torch (the fused kernel switched off)"
        elif terms is None:
            what = "torch (no fused kernel for this loss)"
        elif x.dtype not in (torch.float32, torch.float64):
            what = f"torch (the fused kernel takes float32 and float64, not {x.dtype})"
        else:
            what = _native.formulation()
        result = fit_torch(x, w0, loss, opts, None if padding is None else padding.classes)
    _backend.ran(what, x.device)
    return result


def _front(rows: Tensor) -> Tensor:
    """``[E, n]`` the order that puts each episode's real rows (``rows [E, n]`` True) first, in
    their order, its padded rows after them."""
    return torch.sort((~rows).to(torch.uint8), dim=1, stable=True).indices


def _gather_rows(t: Tensor, idx: Tensor) -> Tensor:
    """``t [E or 1, c, n]`` with its rows (last axis) in the order ``idx [E, n]``."""
    t = t.expand(idx.shape[0], t.shape[1], idx.shape[1])
    return t.gather(2, idx.unsqueeze(1).expand_as(t))


def _sizes(padding: Padding, n_support: int | None) -> tuple[Tensor | None, _native.EpisodeSizes]:
    """The order putting real rows first (``None`` when no row is padded) and each episode's sizes."""
    ways = None if padding.classes is None else padding.classes.sum(1)
    if padding.rows is None:
        return None, _native.EpisodeSizes(ways=ways)
    support = None if n_support is None else padding.rows[:, :n_support].sum(1)
    return _front(padding.rows), _native.EpisodeSizes(ways, padding.rows.sum(1), support)


def _pack_kernel(x: Tensor, terms: KernelTerms, padding: Padding) -> tuple[Tensor, KernelTerms, _native.EpisodeSizes]:
    """``x`` and ``terms`` with each episode's real rows first, and its sizes, for the kernel."""
    wd = terms.loss == "weighted-distance"
    idx, sizes = _sizes(padding, None if wd else terms.n_support)
    if idx is None:
        return x, terms, sizes
    E, n, D = x.shape
    xp = x.gather(1, idx.unsqueeze(-1).expand(E, n, D))
    if wd:
        r = None if terms.r is None else _gather_rows(terms.r, idx)
        free = None if terms.free is None else _gather_rows(terms.free, idx)
        return xp, dataclasses.replace(terms, targets=_gather_rows(terms.targets, idx), r=r, free=free), sizes
    # the real support rows come first among the real rows: their targets in the same order
    assert padding.rows is not None
    targets = _gather_rows(terms.targets, _front(padding.rows[:, : terms.n_support]))
    return xp, dataclasses.replace(terms, targets=targets), sizes


def _triton_loss(x: Tensor, loss: Loss, be: _backend.Backend) -> RowTerms | NativeLoss | None:
    """What the Triton step is given for ``loss``, when it is to take this fit; else ``None``."""
    if be.cuda_step != "triton" or x.device.type not in be.step_devices:
        return None
    if isinstance(loss, WeightedDistance):
        described: RowTerms | NativeLoss | None = loss.terms
    elif isinstance(loss, LogitLoss):
        described = loss.native
    else:
        return None
    from poodle.solvers import _triton_step

    return described if described is not None and _triton_step.available()[0] else None


def _triton_fit(
    x: Tensor,
    w0: Tensor,
    what: RowTerms | NativeLoss,
    opts: FitOptions,
    padding: Padding | None = None,
    be: _backend.Backend | None = None,
) -> tuple[Tensor, Tensor]:
    from poodle.solvers import _triton_step

    kw: dict = dict(scale0=opts.scale0, steps=opts.steps, lr=opts.lr, betas=opts.betas, eps=opts.eps)
    if be is not None and be.launch_plan is not None:
        kw["launch_plan"] = be.launch_plan
    wd = isinstance(what, RowTerms)
    if padding is not None:
        # as for the C kernel: each episode's real rows first, and its own sizes
        idx, sizes = _sizes(padding, None if isinstance(what, RowTerms) else what.n_support)
        kw["sizes"] = sizes
        if idx is not None:
            E, n, D = x.shape
            x = x.gather(1, idx.unsqueeze(-1).expand(E, n, D))
            if isinstance(what, RowTerms):
                free = None if what.free is None else _gather_rows(what.free, idx)
                g = _gather_rows
                what = RowTerms(g(what.targets, idx), g(what.ce, idx), g(what.coef, idx), free)
            else:
                assert padding.rows is not None
                support = _front(padding.rows[:, : what.n_support])
                what = dataclasses.replace(what, targets=_gather_rows(what.targets, support))
    if wd:
        return _triton_step.fit_weighted_distance(x, what, w0, learn_scale=opts.learn_scale, **kw)
    return _triton_step.fit_logit_loss(x, w0, what, learn_scale=opts.learn_scale, **kw)


# ---------------------------------------------------------------------------------------------
# The solvers' entry points


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
    padding: Padding | None = None,
) -> tuple[Tensor, Tensor]:
    """Fine-tune the prototypes and scales of ``E`` episodes under the weighted-distance loss.

    Args:
        x: ``[E, n, D]`` every row that enters the loss (support, [query], negatives).
        terms: per-row coefficients (see :class:`RowTerms`; zero on a padded row).
        w0: ``[E, K, D]`` initial prototypes.
        scale0, steps, lr, betas, eps, learn_scale: see :class:`FitOptions`.
        padding: a ragged chunk's padded classes and rows (see :class:`Padding`).

    Returns:
        ``(W [E, K, D], gamma [E, 1, 1])`` after ``steps`` Adam steps.
    """
    opts = FitOptions(scale0, steps, lr, betas, eps, learn_scale)
    return fit(x, w0, WeightedDistance(x, terms), opts, padding)


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
    padding: Padding | None = None,
) -> tuple[Tensor, Tensor]:
    """Adam on the prototypes and scale of ``E`` episodes for any loss of the distance logits
    whose gradient rows sum to zero over classes (every loss of the softmax probabilities does: the
    softmax ignores a constant added to a row), given ``dL/dl`` by ``grad_logits(P, L, G)``, which
    writes it into ``G``. What autograd would compute, with one pass of a few fused operations per
    step instead of a recorded graph (TIM-GD runs 1,000 steps of it).

    Args:
        x: ``[E, n, D]`` every row the loss sees.
        w0: ``[E, K, D]`` initial prototypes.
        grad_logits: fills ``G [E, K, n]`` from the probabilities ``P [E, K, n]`` (softmax over
            ``K``) and the logits ``L [E, K, n]``.
        scale0, steps, lr, learn_scale, betas, eps: see :class:`FitOptions`.
        native: the same loss as ``grad_logits``, for the fused CPU kernel: one pass over an
            episode's rows per step instead of about 25 torch operations, each a pass over
            ``[E, K, n]``.
        padding: a ragged chunk's padded classes and rows (see :class:`Padding`); ``grad_logits``
            must then give a padded row no weight (the kernels take each episode's own sizes).

    Returns:
        ``(W [E, K, D], gamma [E, 1, 1])``.
    """
    opts = FitOptions(scale0, steps, lr, betas, eps, learn_scale)
    return fit(x, w0, LogitLoss(grad_logits, native), opts, padding)


def weighted_distance_flops(n: int, D: int, K: int, steps: int, free: bool = False) -> float:
    """FLOPs of :func:`fit_weighted_distance` per episode: two ``n x D x K`` matmuls per step plus the
    elementwise work on ``[n, K]`` and the Adam update on ``K*D + 1`` parameters."""
    per_step = 4.0 * n * D * K + (14 if free else 8) * n * K + 4 * K * D + 12 * (K * D + 1)
    return steps * per_step


def logit_loss_flops(n: int, D: int, K: int, steps: int) -> float:
    """FLOPs of :func:`fit_logit_loss` per episode (TIM-GD, alpha-TIM, entropy minimisation): per
    step the two ``n x D x K`` products (``x.w`` and ``G^T x``), about 18 operations on each of the
    ``n x K`` logits (the logits, the softmax, the loss's dL/dlogits, the column sums and
    ``sum G Z``; an exp, log or power counted as one), the gradient of ``W`` and the Adam update."""
    per_step = 4.0 * n * D * K + 18 * n * K + 4 * K * D + 12 * (K * D + 1)
    return steps * per_step


__all__ = [
    "FitOptions",
    "Loss",
    "LogitLoss",
    "NativeLoss",
    "Padding",
    "RowTerms",
    "WeightedDistance",
    "adam_step",
    "fit",
    "fit_logit_loss",
    "fit_torch",
    "fit_weighted_distance",
    "logit_loss_flops",
    "weighted_distance_flops",
]
