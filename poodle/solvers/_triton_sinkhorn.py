"""The Sinkhorn loops of PT-MAP, protoLP (balanced) and PEMnE-BMS (min-size) for CUDA, written in
Triton: one program per episode runs every sweep of that episode, to its own convergence, on a plan
held in registers, in one kernel launch for the whole chunk and with no host sync.

Why: the torch formulation (:func:`poodle.solvers.pt_map.balance`,
:func:`poodle.solvers.bms.min_size_sinkhorn`) is 15 to 20 batched operations a sweep, each one
kernel launch for a few hundred numbers an episode, and a convergence look (a host sync) every
``CHECK_EVERY_SWEEPS`` sweeps; a masked loop runs every episode to the chunk's slowest. On a GPU
that is launch-bound: the cost model counts about 66,000 launches per 4,096-episode chunk for
PT-MAP and protoLP, the same 1.2 s per 10,000 episodes on every GPU. Here a chunk's whole Sinkhorn
loop is one launch.

The arithmetic is the fused C loop's (``_sinkhorn_kernel.c``) sweep for sweep: the same formulas
(one reciprocal per sample, ``(1 / s) * mass`` per class, the authors' ``1e-20`` guard of the
min-size rescaling), the same stopping rule per episode (stop once no sample's mass moved by more
than ``tol`` in one sweep, the tolerance taken in the plan's dtype), the same sizes per episode
(``ways [E]`` classes and ``cols [E]`` leading samples; entries outside them are never read or
written, so a padded episode runs the loop it runs alone). Only the summation order of the sums
over classes and samples is the block reductions', so plans agree with the C loop and the torch
formulation to float rounding.

Which loop runs: on CUDA (or, for the tests, the devices the backend's ``sinkhorn_devices`` names,
under Triton's interpreter) when Triton is installed, the plan is float32 or float64 and fits
:data:`MAX_BLOCK`, and the backend (:class:`poodle.solvers.backend.Backend`: ``cuda_sinkhorn``,
whose default ``POODLE_CUDA_SINKHORN`` sets, and ``device_schedule``, what the cost model traces)
does not say otherwise; else the torch formulation. :func:`usable` reports the choice to the
backend as the method's formulation (``Backend.formulation(method, "cuda")``).

Known without a GPU: the kernel runs in Triton's interpreter on the CPU
(``tests/test_triton_sinkhorn.py``); it has never run on a GPU yet.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from poodle.solvers import backend as _backend

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR = ""
except ImportError as _e:  # CPU-only torch wheels come without Triton
    triton = None
    tl = None
    _IMPORT_ERROR = f"Triton is not installed ({_e})"

MODES = {"balanced": 0, "min-size": 1}
LOOPS = _backend.SINKHORN_LOOPS
# the smallest mass a division sees (pt_map's TINY) and the authors' min-size guard (bms)
TINY_MASS = 1e-30
GUARD = 1e-20
# the largest padded plan (classes x samples, each a power of two) one program holds: 64 classes x
# 1,024 samples. Beyond it the torch formulation runs (a tiled loop over samples is not written).
MAX_BLOCK = 65_536


def available() -> tuple[bool, str]:
    """``(True, "")`` when the kernel can run here, else ``(False, why)``."""
    return (triton is not None, _IMPORT_ERROR)


def blocks(K: int, N: int) -> tuple[int, int]:
    """The padded ``(classes, samples)`` of a program's plan block for plans ``[E, K, N]``."""
    return triton.next_power_of_2(max(K, 1)), triton.next_power_of_2(max(N, 1))


def warps(BK: int, BN: int) -> int:
    """Warps of a program holding a ``[BK, BN]`` block: 16 entries of the plan a thread up to 8,192
    entries, then 16 warps with more entries a thread. ptxas for sm_90 (float32, with a reset):
    PT-MAP's 8 x 128 in 80 registers, no spill; at most 24 bytes spilled up to 8,192 entries,
    452 at 16,384 and 6 KB at 65,536 (local memory, which L1 caches)."""
    return 4 if BK * BN <= 2048 else 8 if BK * BN <= 4096 else 16


def usable(p: Tensor) -> bool:
    """Whether the Triton loop runs on plan ``p [E, K, N]`` (see the module's docstring). Records
    the method's formulation on ``p``'s device kind when ``p`` is on a device the loop serves."""
    be = _backend.current()
    if p.device.type not in be.sinkhorn_devices:
        return False
    ok = False
    if be.cuda_sinkhorn != "triton":
        what = "torch"
    elif be.device_schedule:
        what = "torch (the device schedule)"
    elif triton is None:
        what = f"torch ({_IMPORT_ERROR})"
    elif p.dtype not in (torch.float32, torch.float64):
        what = f"torch (the Triton Sinkhorn loop takes float32 and float64, not {p.dtype})"
    elif p.dim() != 3 or blocks(p.shape[1], p.shape[2])[0] * blocks(p.shape[1], p.shape[2])[1] > MAX_BLOCK:
        what = f"torch (a plan of {tuple(p.shape[1:])} is beyond the Triton loop's {MAX_BLOCK:,} entries)"
    else:
        what, ok = "triton sinkhorn", True
    _backend.ran(what, p.device)
    return ok


if triton is not None:
    _TINY = tl.constexpr(TINY_MASS)
    _GUARD = tl.constexpr(GUARD)

    @triton.jit
    def _div(a, b):
        """``a / b`` correctly rounded, as C divides: Triton's float32 ``/`` is the approximate
        ``div.full`` (within 2 units in the last place), its float64 one IEEE."""
        if b.dtype == tl.float32:
            return tl.math.div_rn(a, b)
        else:
            return a / b

    @triton.jit
    def _sinkhorn(
        P,
        R,
        WAYS,
        COLS,
        TARGET,
        ITERS,
        p_es,
        r_es,
        r_ks,
        t_es,
        K,
        N,
        n_reset,
        max_iter,
        MODE: tl.constexpr,
        NORMALISE: tl.constexpr,
        HAS_RESET: tl.constexpr,
        HAS_WAYS: tl.constexpr,
        HAS_COLS: tl.constexpr,
        HAS_ITERS: tl.constexpr,
        TARGET_PER_EPISODE: tl.constexpr,
        TARGET_VALUE: tl.constexpr,
        TOL: tl.constexpr,
        BK: tl.constexpr,
        BN: tl.constexpr,
    ):
        """One episode's Sinkhorn loop: ``MODE`` 0 balanced (``pt_map.balance``), 1 min-size
        (``bms.min_size_sinkhorn``); the plan ``[BK, BN]`` in registers from the first sweep to the
        last, written back once."""
        e = tl.program_id(0).to(tl.int64)
        dt = P.dtype.element_ty
        ks = tl.arange(0, BK)
        js = tl.arange(0, BN)
        if HAS_WAYS:
            k = tl.load(WAYS + e).to(tl.int32)
        else:
            k = K
        if HAS_COLS:
            n = tl.load(COLS + e).to(tl.int32)
        else:
            n = N
        if TARGET_PER_EPISODE:
            mass = tl.load(TARGET + e * t_es).to(dt)
        else:
            mass = tl.full((), TARGET_VALUE, dt)
        tiny = tl.full((), _TINY, dt)
        kmask = ks < k
        jmask = js < n
        inside = kmask[:, None] & jmask[None, :]
        ptrs = P + e * p_es + ks[:, None] * N + js[None, :]
        p = tl.load(ptrs, mask=inside, other=0.0)
        it = 0
        if MODE == 0:
            if NORMALISE:
                p = _div(p, tl.maximum(tl.sum(tl.sum(p, axis=1), axis=0), tiny))
            tol = tl.full((), TOL, dt)
            rows = tl.sum(p, axis=0)  # [BN] each sample's mass
            # u = 0 before the first sweep: the C loop's first look
            go = (tl.max(((rows > tol) | (-rows > tol)).to(tl.int32), axis=0) > 0) & (max_iter > 0)
            if HAS_RESET:
                fixed = kmask[:, None] & (js < n_reset)[None, :]
                rptrs = R + e * r_es + ks[:, None] * r_ks + js[None, :]
            while go:
                u = rows
                p = p * _div(1.0, tl.maximum(rows, tiny))[None, :]
                cm = _div(1.0, tl.maximum(tl.sum(p, axis=1), tiny)) * mass
                p = p * tl.where(kmask, cm, 1.0)[:, None]
                if HAS_RESET:
                    # reloaded each sweep (from L1/L2) rather than held: registers go to the plan
                    p = tl.where(fixed, tl.load(rptrs, mask=fixed, other=0.0), p)
                rows = tl.sum(p, axis=0)
                it += 1
                d = u - rows
                go = (tl.max(((d > tol) | (-d > tol)).to(tl.int32), axis=0) > 0) & (it < max_iter)
        else:
            guard = tl.full((), _GUARD, dt)
            rows = tl.sum(p, axis=0)
            while it < max_iter:
                p = p * _div(1.0, tl.maximum(rows, tiny))[None, :]
                s = tl.sum(p, axis=1)
                # the authors' guarded mass, over the episode's own samples only
                guarded = tl.sum(tl.where(jmask[None, :], p + guard, 0.0), axis=1)
                cm = tl.where(kmask & (s < mass), _div(1.0, _div(guarded, mass)), 1.0)
                p = p * cm[:, None]
                rows = tl.sum(p, axis=0)
                it += 1
        tl.store(ptrs, p, mask=inside)
        if HAS_ITERS:
            tl.store(ITERS + e, it)


def run(
    mode: str,
    p: Tensor,
    target: Tensor | float,
    max_iter: int,
    *,
    tol: float = 0.0,
    reset: Tensor | None = None,
    normalise: bool = False,
    ways: Tensor | None = None,
    cols: Tensor | None = None,
    iters: Tensor | None = None,
) -> Tensor:
    """Sinkhorn sweeps on ``p [E, K, N]`` (classes first; contiguous; overwritten and returned), one
    launch: the contract of :func:`poodle.solvers._sinkhorn_native.run`.

    Args:
        mode: ``"balanced"`` (samples to 1, classes to ``target``, until no sample moved by more
            than ``tol``, at most ``max_iter`` sweeps; ``normalise`` divides each plan by its total
            first) or ``"min-size"`` (``max_iter`` sweeps).
        target: ``[E]`` or a number: each class's mass (balanced) or the smallest one (min-size).
        reset: ``[E, K, Ns]``: balanced, the first ``Ns`` samples set back to it after every sweep.
        ways, cols: ``[E]`` each episode's classes and samples (the first ones), or None (all);
            ``cols >= Ns`` with ``reset``.
        iters: ``[E]`` int32, out: the sweeps each episode ran (the tests), or None.
    """
    if triton is None:
        raise RuntimeError(_IMPORT_ERROR)
    if mode not in MODES:
        raise ValueError(f"the Sinkhorn mode must be one of {', '.join(MODES)}, not {mode!r}")
    if p.dim() != 3 or not p.is_contiguous():
        raise ValueError(f"the Triton Sinkhorn loop needs a contiguous [E, K, N] plan, got {tuple(p.shape)}")
    E, K, N = p.shape
    BK, BN = blocks(K, N)
    if BK * BN > MAX_BLOCK:
        raise ValueError(f"a plan of {K} x {N} pads to {BK} x {BN}, beyond the Triton loop's {MAX_BLOCK:,} entries")
    dev = p.device
    r = None
    if reset is not None and mode == "balanced":
        if reset.shape[:2] != (E, K) or reset.shape[2] > N:
            raise ValueError(f"reset {tuple(reset.shape)} does not fit the plan {tuple(p.shape)}")
        r = reset.to(device=dev, dtype=p.dtype)
        r = r if r.stride(2) == 1 else r.contiguous()
    t = target.to(dev) if isinstance(target, Tensor) else None
    if t is not None and (t.dim() != 1 or t.shape[0] != E):
        raise ValueError(f"target must be a number or [E] = [{E}], got {tuple(t.shape)}")
    if iters is not None and (iters.shape != (E,) or iters.dtype != torch.int32 or iters.device != dev):
        raise ValueError(f"iters must be an int32 [E] = [{E}] tensor on {dev}")
    if E == 0:
        return p
    w = None if ways is None else ways.to(dev)
    c = None if cols is None else cols.to(dev)
    n_warps = warps(BK, BN)
    dummy = p  # for the pointers a variant does not read
    # Triton launches on the current device: make it the plan's (a worker may hold another GPU's)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _sinkhorn[(E,)](
            p, dummy if r is None else r, dummy if w is None else w, dummy if c is None else c,
            dummy if t is None else t, dummy if iters is None else iters,
            p.stride(0), 0 if r is None else r.stride(0), 0 if r is None else r.stride(1),
            0 if t is None else t.stride(0), K, N, 0 if r is None else r.shape[2], max_iter,
            MODE=MODES[mode], NORMALISE=bool(normalise), HAS_RESET=r is not None, HAS_WAYS=w is not None,
            HAS_COLS=c is not None, HAS_ITERS=iters is not None, TARGET_PER_EPISODE=t is not None,
            TARGET_VALUE=0.0 if t is not None else float(target), TOL=float(tol), BK=BK, BN=BN, num_warps=n_warps,
        )  # fmt: skip
    return p


__all__ = ["LOOPS", "MAX_BLOCK", "MODES", "available", "blocks", "run", "usable", "warps"]
