"""A one-pass Adam step for CUDA, written in Triton: the fits of :mod:`poodle.solvers._optim`
(:func:`~poodle.solvers._optim.fit_weighted_distance` for POODLE, CE and naive-OOD; the logit-loss
fit for TIM-GD, alpha-TIM and entropy minimisation) with the same contract and the same arithmetic,
in one kernel launch for all the steps.

Why: the torch formulation of a step is two batched matmuls (``X W^T``, then ``G^T X``) and about
twenty elementwise passes over ``[E, K, n]`` buffers, so every step reads each episode's rows twice
from device memory, and memory is what bounds it on a GPU (``poodle.costmodel``: transductive POODLE
on the standard workload moves 2.96 MB per episode and step that way, 1.32 MB here). Here one
program owns one episode for all its steps:

- **Weighted distance (POODLE)**: the gradient of a row's logits depends on that row alone, so for
  each block of ``BN`` rows the program computes ``x.w`` over the whole of ``D`` and, while the
  block is still in the cache, adds its share ``G^T x`` to the episode's ``[K, D]`` gradient. Each
  row comes from device memory once per step.
- **Logit losses (TIM-GD, alpha-TIM, entropy-min)**: a query's gradient depends on the class
  marginal over all the queries, so the program makes two passes over the rows per step (logits,
  then ``G^T x``). An episode's rows are small (80 x 640 floats = 205 KB in the standard workload),
  so the second pass, and the next steps, find them in L2 when the episodes in flight fit in it:
  ``group`` bounds how many episodes one launch holds so that they do (see
  :func:`poodle.costmodel.resident_group`).

Adam is ``torch.optim.Adam``'s single-tensor arithmetic operation for operation (lerp of the first
moment, ``v*b2 + (1-b2)*g*g``, ``sqrt(v)/sqrt(1 - b2^t) + eps``, ``theta - lr/(1 - b1^t) * m / den``),
with the per-step scalars computed in double precision on the host and rounded to the rows' dtype,
as torch rounds them. Sums are taken in another order than torch's, so results agree with the torch
formulation to float rounding (the tests compare float64 fits to 1e-10 and float32 episodes'
predictions exactly).

Devices: CUDA tensors run compiled kernels. Under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is first imported: the tests) the same kernels run on CPU tensors, in numpy, one
program after the other, slowly. Where Triton is not installed :func:`available` says why.

Known without a GPU: it compiles for sm_90 and sm_80 (the tests compile it for sm_90 in CI); the
class axis is padded to at least 16 for ``tl.dot`` (3.2x the multiply-adds at 5 classes; the rows'
traffic is unchanged) and ``tl.dot`` runs in IEEE float32 (no TF32, as torch's default for float32
matmuls). Never run on a GPU yet: the GPU check (``benchmarks/gpu.py``) compares it with the torch
formulation per episode and times both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from poodle.errors import ConfigError
from poodle.solvers._transductive import TINY

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR = ""
except ImportError as _e:  # CPU-only torch wheels come without Triton
    triton = None
    tl = None
    _IMPORT_ERROR = f"Triton is not installed ({_e})"

# kinds of loss, as the kernel's KIND constant
WEIGHTED, TIM, ENTROPY, ALPHA = 0, 1, 2, 3
_KINDS = {"tim": TIM, "entropy": ENTROPY, "alpha": ALPHA}

# at most this many rows per block and columns per chunk of D (powers of two; tl.dot needs every
# dimension >= 16). Compiled for sm_90 without a GPU (tests/test_triton_step.py), 32 x 64 at 4 warps
# uses 255 registers a thread and spills at most 8 bytes in every variant; 32 x 128 spills 336-456.
BLOCK_ROWS = 32
BLOCK_D = 64
NUM_WARPS = 4

# whether Triton runs its interpreter (TRITON_INTERPRET=1 when it was imported): kernels then run
# on CPU tensors, one program after the other
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)


@dataclass
class LogitLoss:
    """A logit loss the kernel computes itself: the ``NativeLoss`` of :mod:`poodle.solvers._optim`
    (any object with these attributes will do), plus alpha-TIM.

    Attributes:
        kind: ``"tim"`` (weights ``(ce, marginal, conditional)``), ``"entropy"`` (weights ``(ce,
            entropy, unused)``) or ``"alpha"`` (alpha-TIM, weights ``(ce, marginal, conditional)``
            and the order ``alpha``).
        n_support: the number ``Ns`` of support rows, first among the rows.
        targets: ``[E, K, Ns]`` one-hot support labels.
        weights: the loss's three weights.
        alpha: the alpha-entropy order (``"alpha"`` only; not 1).
    """

    kind: str
    n_support: int
    targets: Tensor
    weights: tuple[float, float, float]
    alpha: float = 0.0


def available() -> tuple[bool, str]:
    """``(True, "")`` when the kernels can run here, else ``(False, why)``."""
    return (triton is not None, _IMPORT_ERROR)


if triton is not None:

    @triton.jit
    def _block_logits(X, W, w2, gamma, xoff, woff, r0, n, D, K, BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr):
        """``z = x.w - |w|^2/2``, logits ``l = gamma z`` and softmax ``p`` (padding: 0) of rows
        ``r0..r0+BN`` of one episode, each ``[BN, BK]``, and the row mask ``[BN]``."""
        rows = r0 + tl.arange(0, BN)
        cols = tl.arange(0, BD)
        ks = tl.arange(0, BK)
        rmask = rows < n
        kmask = ks < K
        s = tl.zeros((BN, BK), dtype=X.dtype.element_ty)
        xp = X + xoff + rows[:, None] * D + cols[None, :]
        wp = W + woff + ks[None, :] * D + cols[:, None]
        for d0 in range(0, D, BD):
            dm = (d0 + cols) < D
            x = tl.load(xp + d0, mask=rmask[:, None] & dm[None, :], other=0.0)
            wt = tl.load(wp + d0, mask=kmask[None, :] & dm[:, None], other=0.0)
            s += tl.dot(x, wt, input_precision="ieee")
        z = s - 0.5 * w2[None, :]
        lg = z * gamma
        lm = tl.where(kmask[None, :], lg, float("-inf"))
        ex = tl.exp(lm - tl.max(lm, axis=1)[:, None])
        p = ex / tl.sum(ex, axis=1)[:, None]
        p = tl.where(rmask[:, None], p, 0.0)
        return z, lg, p, rmask

    @triton.jit
    def _add_gx(X, GX, g, xoff, woff, r0, n, D, K, BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr):
        """``GX += g^T x`` over rows ``r0..r0+BN`` (``g [BN, BK]``, zero on padding); the first
        block writes instead of adding."""
        rows = r0 + tl.arange(0, BN)
        cols = tl.arange(0, BD)
        ks = tl.arange(0, BK)
        gt = tl.trans(g)
        xp = X + xoff + rows[:, None] * D + cols[None, :]
        gp = GX + woff + ks[:, None] * D + cols[None, :]
        rm = (rows < n)[:, None]
        km = (ks < K)[:, None]
        for d0 in range(0, D, BD):
            dm = ((d0 + cols) < D)[None, :]
            x = tl.load(xp + d0, mask=rm & dm, other=0.0)
            prev = tl.load(gp + d0, mask=km & dm & (r0 > 0), other=0.0)
            tl.store(gp + d0, prev + tl.dot(gt, x, input_precision="ieee"), mask=km & dm)

    @triton.jit
    def _adam_prototypes(
        W, M, V, GX, colsum, gamma, woff, D, K, HP, SC, t, LERP_LOW: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr
    ):
        """``dL/dW = gamma (GX - colsum * W)`` and torch.optim.Adam's update of ``W`` at step ``t``."""
        cols = tl.arange(0, BD)
        ks = tl.arange(0, BK)
        w1 = tl.load(HP + 0)  # 1 - b1 (the lerp weight)
        b2 = tl.load(HP + 1)
        w2 = tl.load(HP + 2)  # 1 - b2
        eps = tl.load(HP + 3)
        step_size = tl.load(SC + 2 * t)
        bc2 = tl.load(SC + 2 * t + 1)
        off0 = woff + ks[:, None] * D + cols[None, :]
        km = (ks < K)[:, None]
        for d0 in range(0, D, BD):
            m2 = km & ((d0 + cols) < D)[None, :]
            off = off0 + d0
            w = tl.load(W + off, mask=m2, other=0.0)
            gw = (tl.load(GX + off, mask=m2, other=0.0) - w * colsum[:, None]) * gamma
            m = tl.load(M + off, mask=m2, other=0.0)
            v = tl.load(V + off, mask=m2, other=0.0)
            # torch.lerp: start + weight * (end - start) below weight 0.5, end - (end - start) * (1 - weight) above
            if LERP_LOW:
                m = m + w1 * (gw - m)
            else:
                m = gw - (gw - m) * (1 - w1)
            v = v * b2 + w2 * gw * gw
            den = tl.sqrt(v) / bc2 + eps
            tl.store(W + off, w + (-step_size) * m / den, mask=m2)
            tl.store(M + off, m, mask=m2)
            tl.store(V + off, v, mask=m2)

    @triton.jit
    def _adam_scale(GAM, MG, VG, e, gg, HP, SC, t, LERP_LOW: tl.constexpr):
        """torch.optim.Adam's update of episode ``e``'s scale, gradient ``gg``, at step ``t``."""
        w1 = tl.load(HP + 0)
        b2 = tl.load(HP + 1)
        w2 = tl.load(HP + 2)
        eps = tl.load(HP + 3)
        step_size = tl.load(SC + 2 * t)
        bc2 = tl.load(SC + 2 * t + 1)
        m = tl.load(MG + e)
        v = tl.load(VG + e)
        if LERP_LOW:
            m = m + w1 * (gg - m)
        else:
            m = gg - (gg - m) * (1 - w1)
        v = v * b2 + w2 * gg * gg
        den = tl.sqrt(v) / bc2 + eps
        tl.store(GAM + e, tl.load(GAM + e) + (-step_size) * m / den)
        tl.store(MG + e, m)
        tl.store(VG + e, v)

    @triton.jit
    def _row_weights(p, lg, y, rows, ns, nq, marg, HP, KIND: tl.constexpr, POW_INT: tl.constexpr, kmask):
        """``dL/dl`` of a block of rows of a logit loss: support rows ``(p - y) w_ce / Ns``, query
        rows through the softmax, ``p (u - sum_k p u)``, with ``u = dL/dp`` of the loss's kind."""
        w_ce = tl.load(HP + 4)
        w_a = tl.load(HP + 5)  # marginal (tim, alpha) or entropy weight
        w_c = tl.load(HP + 6)  # conditional weight (tim, alpha)
        a = tl.load(HP + 7)  # alpha-entropy order
        tiny = tl.load(HP + 8)
        if KIND == 2:
            g_s = (p - y) / ns
        else:
            g_s = (p - y) * (w_ce / ns)
        if KIND == 1:
            # d(-w_marg H(marg))/dmarg = w_marg (log marg + 1) (clamped as tim_gd), d(w_cond H(p))/dp
            um = (tl.log(tl.maximum(marg, tiny)) + tl.where(marg >= tiny, 1.0, 0.0)) * w_a
            ac = tl.log(p + 1e-12) + p / (p + 1e-12)
            u = (um[None, :] - w_c * ac) / nq
            g_q = p * (u - tl.sum(p * u, axis=1)[:, None])
        elif KIND == 2:
            lm = tl.where(kmask[None, :], lg, float("-inf"))
            mx = tl.max(lm, axis=1)
            logp = (lg - mx[:, None]) - tl.log(tl.sum(tl.exp(lm - mx[:, None]), axis=1))[:, None]
            logp = tl.where(kmask[None, :], logp, 0.0)
            g_q = p * (logp - tl.sum(p * logp, axis=1)[:, None]) * (-(w_a / nq))
        else:
            q = p + 1e-12
            if POW_INT > 0:  # an integer power by products, as alpha-TIM's tuned orders 2 and 7 give
                pm = marg
                pq = q
                for _ in tl.static_range(POW_INT - 1):
                    pm = pm * marg
                    pq = pq * q
            else:
                pm = tl.exp((a - 1.0) * tl.log(marg))
                pq = tl.exp((a - 1.0) * tl.log(q))
            u = (pm[None, :] * w_a - pq * w_c) * (a / ((a - 1.0) * nq))
            g_q = p * (u - tl.sum(p * u, axis=1)[:, None])
        g = tl.where((rows < ns)[:, None], g_s, g_q)
        return tl.where(kmask[None, :], g, 0.0)

    @triton.jit
    def _fit_kernel(
        X, W, M, V, GAM, MG, VG, GX, KE, NE, NSE, PZ, TGT, R, FREE, C0, HP, SC,
        n, D, K, steps, ns,
        KIND: tl.constexpr, LEARN_SCALE: tl.constexpr, HAS_FREE: tl.constexpr, POW_INT: tl.constexpr,
        LERP_LOW: tl.constexpr, RAGGED: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """All ``steps`` Adam steps of one episode (program ``e``): rows ``X [E, n, D]``,
        prototypes ``W`` and moments ``M, V [E, K, D]``, scale ``GAM`` and moments ``MG, VG [E]``,
        scratch ``GX [E, K, D]`` and ``PZ [E, 2, n, BK]``. Weighted distance: targets ``TGT [E, K,
        n]``, row weights ``R``, ``FREE [E, n]``, constant ``C0 [E]``; logit losses: ``TGT [E, K,
        Ns]``. ``HP``: (1-b1, b2, 1-b2, eps, w_ce, w_a, w_c, alpha, tiny); ``SC [steps, 2]``:
        (lr / (1-b1^t), sqrt(1-b2^t)). ``RAGGED``: the episode's own classes, real rows and real
        support rows are ``KE, NE, NSE [E]`` (its real rows first, support before queries); every
        mask and loop runs over them, the layout stays the chunk's ``K``, ``n``, ``ns``."""
        e = tl.program_id(0).to(tl.int64)
        xoff = e * n * D
        woff = e * K * D
        if RAGGED:
            ke = tl.load(KE + e)
            ne = tl.load(NE + e)
            nse = tl.load(NSE + e)
        else:
            ke = K
            ne = n
            nse = ns
        ks = tl.arange(0, BK)
        kmask = ks < ke
        cols = tl.arange(0, BD)
        for t in range(steps):
            gamma = tl.load(GAM + e)
            w2 = tl.zeros((BK,), dtype=X.dtype.element_ty)
            for d0 in range(0, D, BD):
                m2 = kmask[:, None] & ((d0 + cols) < D)[None, :]
                w = tl.load(W + woff + ks[:, None] * D + (d0 + cols)[None, :], mask=m2, other=0.0)
                w2 += tl.sum(w * w, axis=1)
            colsum = tl.zeros((BK,), dtype=X.dtype.element_ty)
            ggk = tl.zeros((BK,), dtype=X.dtype.element_ty)
            if KIND == 0:
                for r0 in range(0, ne, BN):
                    z, lg, p, rmask = _block_logits(X, W, w2, gamma, xoff, woff, r0, ne, D, ke, BN, BD, BK)
                    rows = r0 + tl.arange(0, BN)
                    r = tl.load(R + e * n + rows, mask=rmask, other=0.0)
                    y = tl.load(
                        TGT + e * K * n + ks[None, :] * n + rows[:, None],
                        mask=rmask[:, None] & kmask[None, :],
                        other=0.0,
                    )
                    g = p * r[:, None] - y
                    if HAS_FREE:
                        fr = tl.load(FREE + e * n + rows, mask=rmask, other=0.0)
                        lbar = tl.sum(p * lg, axis=1)
                        g += (lg - lbar[:, None]) * p * fr[:, None]
                    g = tl.where(rmask[:, None] & kmask[None, :], g, 0.0)
                    ggk += tl.sum(g * z, axis=0)
                    colsum += tl.sum(g, axis=0)
                    _add_gx(X, GX, g, xoff, woff, r0, ne, D, ke, BN, BD, BK)
                    tl.debug_barrier()
            else:
                # pass 1: logits and probabilities of every row, the query marginal
                msum = tl.zeros((BK,), dtype=X.dtype.element_ty)
                for r0 in range(0, ne, BN):
                    z, lg, p, rmask = _block_logits(X, W, w2, gamma, xoff, woff, r0, ne, D, ke, BN, BD, BK)
                    rows = r0 + tl.arange(0, BN)
                    msum += tl.sum(tl.where((rows >= nse)[:, None], p, 0.0), axis=0)
                    pz = PZ + e * 2 * n * BK + rows[:, None] * BK + ks[None, :]
                    tl.store(pz, p, mask=rmask[:, None])
                    tl.store(pz + n * BK, z, mask=rmask[:, None])
                marg = msum / (ne - nse)
                tl.debug_barrier()
                # pass 2: each row's dL/dl, and G^T x
                for r0 in range(0, ne, BN):
                    rows = r0 + tl.arange(0, BN)
                    rmask = rows < ne
                    pz = PZ + e * 2 * n * BK + rows[:, None] * BK + ks[None, :]
                    p = tl.load(pz, mask=rmask[:, None], other=0.0)
                    z = tl.load(pz + n * BK, mask=rmask[:, None], other=0.0)
                    y = tl.load(
                        TGT + e * K * ns + ks[None, :] * ns + rows[:, None],
                        mask=(rows < nse)[:, None] & kmask[None, :],
                        other=0.0,
                    )
                    g = _row_weights(p, z * gamma, y, rows, nse, ne - nse, marg, HP, KIND, POW_INT, kmask)
                    g = tl.where(rmask[:, None], g, 0.0)
                    ggk += tl.sum(g * z, axis=0)
                    colsum += tl.sum(g, axis=0)
                    _add_gx(X, GX, g, xoff, woff, r0, ne, D, ke, BN, BD, BK)
                    tl.debug_barrier()
            _adam_prototypes(W, M, V, GX, colsum, gamma, woff, D, ke, HP, SC, t, LERP_LOW, BD, BK)
            if LEARN_SCALE:
                gg = tl.sum(ggk, axis=0)
                if KIND == 0:
                    gg -= tl.load(C0 + e)
                _adam_scale(GAM, MG, VG, e, gg, HP, SC, t, LERP_LOW)
            tl.debug_barrier()


def _kernel_for(device: torch.device) -> Any:
    """The kernel, if it can run on ``device``: compiled for CUDA tensors; tensors elsewhere need
    Triton's interpreter, which Triton chooses when it is first imported (``TRITON_INTERPRET=1``)."""
    ok, why = available()
    if not ok:
        # not a caller's value: this system cannot run Triton
        raise ConfigError(f"the Triton step cannot run: {why}")
    if device.type != "cuda" and not INTERPRETED:
        raise ConfigError(
            f"the Triton step runs on CUDA tensors, or on {device.type} tensors in Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is first imported)",
            param="device",
            value=device,
        )
    return _fit_kernel


def _check(x: Tensor, w0: Tensor) -> None:
    if x.dim() != 3 or w0.dim() != 3 or w0.shape[0] != x.shape[0] or w0.shape[2] != x.shape[2]:
        raise ConfigError(
            f"rows must be [E, n, D] and prototypes [E, K, D]; got {tuple(x.shape)} and {tuple(w0.shape)}",
            param="x",
            value=tuple(x.shape),
        )
    if x.dtype not in (torch.float32, torch.float64) or w0.dtype != x.dtype:
        raise ConfigError(
            f"the Triton step takes float32 or float64 rows and prototypes; got {x.dtype}, {w0.dtype}",
            param="x",
            value=x.dtype,
        )


def _run(
    x: Tensor,
    w0: Tensor,
    scale0: float,
    steps: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    kind: int,
    learn_scale: bool,
    tensors: dict[str, Tensor],
    ns: int,
    loss_params: tuple[float, ...],
    pow_int: int,
    group: int | None,
    sizes: Any = None,
    launch_plan: Any = None,
) -> tuple[Tensor, Tensor]:
    """Launch the kernel over the ``E`` episodes, ``group`` at a time (all at once when ``None``,
    unless ``launch_plan``, the backend's sizing, gives a group on CUDA);
    ``sizes``: each episode's own (``ways``, ``rows``, ``support_rows``, each ``[E]`` or ``None``)."""
    E, n, D = x.shape
    K = w0.shape[1]
    dev, dt = x.device, x.dtype
    x = x.contiguous()
    W = w0.contiguous().clone()
    gam = torch.full((E,), float(scale0), device=dev, dtype=dt)
    if steps == 0 or E == 0:
        return W, gam.view(E, 1, 1)
    b1, b2 = betas
    BK = max(16, triton.next_power_of_2(K))
    BN = min(BLOCK_ROWS, max(16, triton.next_power_of_2(n)))
    BD = min(BLOCK_D, max(16, triton.next_power_of_2(D)))
    M, V, GX = torch.zeros_like(W), torch.zeros_like(W), torch.empty_like(W)
    mg, vg = torch.zeros_like(gam), torch.zeros_like(gam)
    pz = torch.empty(E, 2, n, BK, device=dev, dtype=dt) if kind != WEIGHTED else torch.empty(1, device=dev, dtype=dt)
    hp = torch.tensor([1 - b1, b2, 1 - b2, eps, *loss_params], dtype=torch.float64).to(dev, dt)
    # lr / (1 - b1^t) and sqrt(1 - b2^t) in double, rounded to the rows' dtype as torch rounds them
    sc = torch.tensor([[lr / (1 - b1**t), (1 - b2**t) ** 0.5] for t in range(1, steps + 1)], dtype=torch.float64).to(
        dev, dt
    )
    dummy = torch.zeros(1, device=dev, dtype=dt)
    tgt, r, free, c0 = (tensors.get(k, dummy) for k in ("targets", "r", "free", "c0"))
    ragged = sizes is not None and any(t is not None for t in (sizes.ways, sizes.rows, sizes.support_rows))

    def own(t: Tensor | None, full: int) -> Tensor:
        return torch.full((E,), full, dtype=torch.int32, device=dev) if t is None else t.to(dev, torch.int32)

    ke, ne, nse = (
        (own(sizes.ways, K), own(sizes.rows, n), own(sizes.support_rows, ns))
        if ragged
        else (torch.zeros(E, dtype=torch.int32, device=dev),) * 3
    )
    kernel = _kernel_for(dev)
    if group is None and launch_plan is not None and dev.type == "cuda":
        group = launch_plan(E, n, D, K, steps, ns if kind != WEIGHTED else None, dev, x.element_size())
    step = E if group is None else max(1, int(group))
    for a in range(0, E, step):
        sl = slice(a, min(E, a + step))
        per_episode = [t[sl] for t in (x, W, M, V, gam, mg, vg, GX, ke, ne, nse)]
        terms = [t[sl] if t.shape[0] == E else t for t in (pz, tgt, r, free, c0)]
        kernel[(sl.stop - a,)](
            *per_episode, *terms, hp, sc, n, D, K, steps, ns,
            KIND=kind, LEARN_SCALE=bool(learn_scale), HAS_FREE="free" in tensors, POW_INT=pow_int,
            LERP_LOW=1 - b1 < 0.5, RAGGED=ragged, BN=BN, BD=BD, BK=BK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return W, gam.view(E, 1, 1)


def fit_weighted_distance(
    x: Tensor,
    terms: Any,
    w0: Tensor,
    *,
    scale0: float = 10.0,
    steps: int = 250,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    learn_scale: bool = True,
    group: int | None = None,
    sizes: Any = None,
    launch_plan: Any = None,
) -> tuple[Tensor, Tensor]:
    """:func:`poodle.solvers._optim.fit_weighted_distance` in one kernel launch (per ``group``).

    Args:
        x: ``[E, n, D]`` every row that enters the loss (float32 or float64).
        terms: the :class:`~poodle.solvers._optim.RowTerms` of the rows (``targets [E or 1, K, n]``,
            ``ce``, ``coef``, ``free`` ``[E or 1, 1, n]``).
        w0: ``[E, K, D]`` initial prototypes.
        scale0, steps, lr, betas, eps, learn_scale: as the torch formulation.
        group: episodes per launch; ``None``: on CUDA, what ``launch_plan`` (the backend's sizing,
            :func:`poodle.costmodel.resident_plan` in a run) says, else all in one launch.
        launch_plan: ``(E, n, D, K, steps, n_support, device, itemsize) -> group or None``.
        sizes: a ragged chunk's episode sizes (``ways``, ``rows``, ``support_rows``, each ``[E]`` or
            ``None``; :class:`poodle.solvers._native.EpisodeSizes`), each episode's real rows first.

    Returns:
        ``(W [E, K, D], gamma [E, 1, 1])`` after ``steps`` Adam steps.
    """
    _check(x, w0)
    E, n, _ = x.shape
    K = w0.shape[1]
    x2 = (x * x).sum(-1).unsqueeze(1)
    tensors = {
        "targets": terms.targets.expand(E, K, n).contiguous(),
        "r": (terms.ce + terms.coef).expand(E, 1, n).reshape(E, n).contiguous(),
        "c0": (terms.coef * x2).sum((1, 2)).mul_(0.5).expand(E).contiguous(),
    }
    if terms.free is not None:
        tensors["free"] = terms.free.expand(E, 1, n).reshape(E, n).contiguous()
    params = (0.0, 0.0, 0.0, 0.0, TINY)
    return _run(
        x, w0, scale0, steps, lr, betas, eps, WEIGHTED, learn_scale, tensors, 0, params, 0, group, sizes, launch_plan
    )


def fit_logit_loss(
    x: Tensor,
    w0: Tensor,
    loss: Any,
    *,
    scale0: float,
    steps: int,
    lr: float,
    learn_scale: bool,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    group: int | None = None,
    sizes: Any = None,
    launch_plan: Any = None,
) -> tuple[Tensor, Tensor]:
    """:func:`poodle.solvers._optim.fit_logit_loss` for the losses the kernel knows, given as a
    :class:`LogitLoss` (or the torch formulation's ``NativeLoss``, with ``alpha`` for kind
    ``"alpha"``) instead of a ``grad_logits`` callback.

    Args:
        x: ``[E, n, D]`` support rows then query rows.
        w0: ``[E, K, D]`` initial prototypes.
        loss: the loss (kind, ``n_support``, ``targets [E, K, Ns]``, weights, alpha).
        scale0, steps, lr, learn_scale, betas, eps, group, sizes, launch_plan: as
            :func:`fit_weighted_distance`.

    Returns:
        ``(W [E, K, D], gamma [E, 1, 1])``.
    """
    _check(x, w0)
    if loss.kind not in _KINDS:
        raise ConfigError(
            f"the Triton step knows the losses {sorted(_KINDS)}, not {loss.kind!r}", param="loss", value=loss.kind
        )
    E, n, _ = x.shape
    K = w0.shape[1]
    ns = int(loss.n_support)
    if not 0 < ns < n:
        raise ConfigError(
            f"a logit loss needs support and query rows; got {ns} support rows of {n}", param="loss", value=ns
        )
    kind = _KINDS[loss.kind]
    a = float(getattr(loss, "alpha", 0.0))
    if kind == ALPHA and a == 1.0:
        raise ConfigError(
            "alpha-entropy order 1 is the Shannon limit, which kind 'tim' computes", param="loss", value=a
        )
    pow_int = int(a - 1) if kind == ALPHA and a - 1 == int(a - 1) and 1 <= a - 1 <= 8 else 0
    w_ce, w_a, w_c = (float(v) for v in loss.weights)
    tensors = {"targets": loss.targets.to(x.dtype).expand(E, K, ns).contiguous()}
    params = (w_ce, w_a, w_c, a, TINY)
    return _run(
        x, w0, scale0, steps, lr, betas, eps, kind, learn_scale, tensors, ns, params, pow_int, group, sizes, launch_plan
    )


__all__ = ["LogitLoss", "available", "fit_weighted_distance", "fit_logit_loss", "INTERPRETED"]
