"""The fused CPU Sinkhorn loops (``_sinkhorn_kernel.c``) of PT-MAP, protoLP and PEMnE-BMS: each
episode's sweeps, to its own convergence, in one C loop over a plan that stays in L1.

Why: the torch formulation of a sweep (:func:`poodle.solvers.pt_map.balance`,
:func:`poodle.solvers.bms.min_size_sinkhorn`) is 15 to 20 batched operations on a ``[E, 5, 75]``
plan, each costing microseconds of dispatch for a few hundred numbers; PT-MAP spent about 60% of its
time in about 400 such sweeps an episode. The C loop does the same arithmetic with the sums written
out and one reciprocal per sample (6.5x faster sweeps on the standard workload, plans within float
rounding of torch's). On CUDA the same loop runs as one Triton program per episode
(:mod:`poodle.solvers._triton_sinkhorn`). The same library holds the three methods' feature
pipeline at exponent 1/2 (:func:`pemne`, :func:`power_half`) and protoLP's label propagation
(:func:`propagate`), each an episode at a time in cache where torch makes a pass over the chunk per
operation.

The library is built and loaded by the machinery of :mod:`poodle.solvers._native` (the same private
directory, ownership and mode checks, compiler, flags and CPU key, the same interface and
source-hash handshake), as its own file ``sinkhorn_kernel-<key>.so``; where it cannot be had, the
solvers run the torch formulation (:func:`state` says why). The backend's ``native``
(:class:`poodle.solvers.backend.Backend`) switches both kernels off together (the cost model and
the tests use it).

Each episode passes its own sizes (``ways [E]`` classes and ``cols [E]`` leading samples), so the
padded episodes of a ragged chunk run exactly the loop they run alone.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from poodle.events import Notice, NoticeWarning
from poodle.solvers import _native
from poodle.solvers._native import KernelState

_SOURCE = Path(__file__).with_name("_sinkhorn_kernel.c")
# POODLE_SINKHORN_INTERFACE of the C file: bump both with any change of SinkhornArgs
SINKHORN_INTERFACE = 2
MODES = {"balanced": 0, "min-size": 1}
_DTYPES = {torch.float32: 0, torch.float64: 1}


class SinkhornArgs(ctypes.Structure):
    """``struct poodle_sinkhorn_args`` of ``_sinkhorn_kernel.c``, field for field."""

    _fields_ = [
        ("version", ctypes.c_int32),
        ("size", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        ("E", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("max_iter", ctypes.c_int32),
        ("n_reset", ctypes.c_int32),
        ("normalise", ctypes.c_int32),
        ("p_es", ctypes.c_int64),
        ("r_es", ctypes.c_int64),
        ("p", ctypes.c_void_p),
        ("reset", ctypes.c_void_p),
        ("ways", ctypes.c_void_p),
        ("cols", ctypes.c_void_p),
        ("target", ctypes.c_void_p),
        ("iters", ctypes.c_void_p),
        ("reserved", ctypes.c_int32),
        ("tol", ctypes.c_double),
    ]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_state: KernelState | None = None  # None: not tried yet in this process


def _open(path: Path, source_hash: str) -> ctypes.CDLL:
    """Load the library at ``path`` after checking it and its directory are private (as
    :func:`poodle.solvers._native._open`); raises ``_native._Stale`` when it does not say this
    module's interface and source."""
    _native._check(path.parent, directory=True)
    _native._check(path, directory=False)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise _native._Stale(f"it does not load ({e})") from None
    try:
        lib.poodle_sinkhorn_interface.restype = ctypes.c_int
        lib.poodle_sinkhorn_source.restype = ctypes.c_char_p
        interface, source = lib.poodle_sinkhorn_interface(), (lib.poodle_sinkhorn_source() or b"").decode()
    except AttributeError:
        interface, source = -1, ""
    if interface != SINKHORN_INTERFACE or source != source_hash:
        _native._dlclose(lib)
        raise _native._Stale(f"it says interface {interface} and source {source[:12] or '?'}")
    lib.poodle_sinkhorn.restype = ctypes.c_int
    lib.poodle_sinkhorn.argtypes = [ctypes.POINTER(SinkhornArgs)]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.poodle_power_half.restype = ctypes.c_int
    lib.poodle_power_half.argtypes = [ctypes.c_int32, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ctypes.c_double]
    lib.poodle_propagate.restype = ctypes.c_int
    lib.poodle_propagate.argtypes = [ctypes.c_int32, i64, ctypes.c_int32, ctypes.c_int32, ptr, ptr, ctypes.c_double]
    lib.poodle_propagate.argtypes += [ptr, ptr]
    lib.poodle_lp_assign_step.restype = ctypes.c_int
    i32, f64 = ctypes.c_int32, ctypes.c_double
    lib.poodle_lp_assign_step.argtypes = [i32, i64, i32, i32, ptr, ptr, f64, ptr, ptr, ptr, f64, f64, f64, ptr, i32]
    lib.poodle_lp_assign_step.argtypes += [ptr, f64, i32, ptr, ptr, ptr, ptr, ptr]
    lib.poodle_pemne.restype = ctypes.c_int
    lib.poodle_pemne.argtypes = [i32, i64, i64, i32, ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_double, i32, ptr, i64]
    return lib


def _build(cc: str, st: KernelState) -> ctypes.CDLL:
    """:func:`poodle.solvers._native._build` for this source: the first flag set the compiler
    accepts, rebuilt once where the file found does not say this source and interface."""
    source = _SOURCE.read_bytes()
    st.source_hash = hashlib.sha256(source).hexdigest()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    st.compiler_version = (version.strip().splitlines() or [""])[0]
    directory = _native._private_dir(st)
    errors = []
    for flags in _native._FLAG_SETS:
        parts = [source, version.encode(), " ".join(flags).encode(), _native._cpu_identity().encode()]
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
        path = directory / f"sinkhorn_kernel-{key}.so"
        st.flags, st.library = tuple(flags), str(path)
        built = not os.path.lexists(path)
        if built and (err := _native._compile(cc, flags, path, st.source_hash, _SOURCE)):
            errors.append(err)
            continue
        try:
            return _open(path, st.source_hash)
        except _native._Stale as e:
            if built:
                raise RuntimeError(f"{path} was just built but {e}") from None
        _native._check(path, directory=False)  # only a file of ours is replaced
        path.unlink(missing_ok=True)
        if err := _native._compile(cc, flags, path, st.source_hash, _SOURCE):
            errors.append(err)
            continue
        try:
            return _open(path, st.source_hash)
        except _native._Stale as e:
            raise RuntimeError(f"{path} was rebuilt but {e}") from None
    raise RuntimeError("; ".join(errors))


def _load() -> tuple[ctypes.CDLL | None, KernelState]:
    st = KernelState()
    if os.environ.get("POODLE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        st.reason = "disabled by POODLE_NATIVE=0"
        return None, st
    st.compiler = _native._compiler()
    fallback = "the CPU Sinkhorn loops run their torch formulation (same results to float rounding, slower)"
    if st.compiler is None:
        st.reason = "no C compiler (cc, gcc or clang) on PATH"
        st.notice = f"{st.reason}; {fallback}. Install a C compiler to get the fused loop."
        return None, st
    try:
        lib = _build(st.compiler, st)
    except _native._Refused as e:
        st.reason = f"not loaded: {e}"
        st.notice = (
            f"the fused Sinkhorn loop is {st.reason}; {fallback}. Make it private (chmod go-w, owned by you) "
            "or set POODLE_NATIVE_DIR to a private directory."
        )
        return None, st
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        st.reason = f"the fused Sinkhorn loop did not build: {e}"
        st.notice = f"{st.reason}; {fallback}."
        return None, st
    st.loaded = True
    return lib, st


def load() -> ctypes.CDLL | None:
    """The compiled loop, or ``None`` (with one :class:`~poodle.events.NoticeWarning` per process,
    unless switched off on purpose) where it cannot be had."""
    global _lib, _state
    if _state is not None:
        return _lib
    with _lock:
        if _state is None:
            _lib, st = _load()
            _state = st
            if st.notice:
                warnings.warn(NoticeWarning(Notice("native-kernel", st.notice)), stacklevel=2)
    return _lib


def state() -> KernelState:
    """Where the loop stands (loading it first if this process has not tried yet)."""
    load()
    assert _state is not None
    return _state


def formulation() -> str:
    """The arithmetic of the CPU Sinkhorn loops, as records say it: ``sinkhorn kernel <source
    hash>`` or ``torch (<why>)``."""
    st = state()
    return f"sinkhorn kernel {st.source_hash[:12]}" if st.loaded else f"torch ({st.reason})"


def usable(p: Tensor) -> bool:
    """Whether the loop runs on plan ``p``: a CPU float32/float64 tensor outside
    :func:`~poodle.solvers._transductive.device_schedule` (which runs what a GPU runs), the native
    kernels not switched off (the backend's ``native``) and a loadable library. Reports the
    method's formulation to the backend."""
    from poodle.solvers import backend as _backend
    from poodle.solvers._transductive import syncs_freely

    if p.device.type != "cpu":
        return False
    if not syncs_freely(p):
        what, ok = "torch (the device schedule)", False
    elif not _backend.current().native:
        what, ok = "torch (the fused kernel switched off)", False
    elif p.dtype not in _DTYPES:
        what, ok = f"torch (the fused Sinkhorn loop takes float32 and float64, not {p.dtype})", False
    else:
        ok = load() is not None
        what = formulation()
    _backend.ran(what, "cpu")
    return ok


def _sizes(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.to(device="cpu", dtype=torch.int64).contiguous()


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
    """Sinkhorn sweeps on ``p [E, K, N]`` (classes first; overwritten and returned).

    Args:
        mode: ``"balanced"`` (:func:`poodle.solvers.pt_map.balance`: samples to 1, classes to
            ``target``, until no sample moved by more than ``tol``, at most ``max_iter`` sweeps;
            ``normalise`` divides each plan by its total first, as ``pt_map.sinkhorn``) or
            ``"min-size"`` (:func:`poodle.solvers.bms.min_size_sinkhorn`, ``max_iter`` sweeps).
        target: ``[E]`` or a number: each class's mass (balanced) or the smallest one (min-size).
        reset: ``[E, K, Ns]``: balanced, the first ``Ns`` samples set back to it after every sweep.
        ways, cols: ``[E]`` each episode's classes and samples (the first ones), or None (all).
        iters: ``[E]`` int32 (contiguous, on the CPU), out: the sweeps each episode ran, or None.
    """
    lib = load()
    assert lib is not None
    E, K, N = p.shape
    if not p.is_contiguous():
        raise ValueError(f"the fused Sinkhorn loop needs a contiguous plan, got strides {p.stride()}")
    dt = p.dtype
    tgt = torch.as_tensor(target, dtype=torch.float64).expand(E).contiguous()
    r = None if reset is None else reset.to(dt).contiguous()
    w, c = _sizes(ways), _sizes(cols)
    if iters is not None and (iters.dtype != torch.int32 or tuple(iters.shape) != (E,) or not iters.is_contiguous()):
        raise ValueError(f"iters must be a contiguous int32 [{E}] tensor, got {iters.dtype} {tuple(iters.shape)}")
    args = SinkhornArgs(
        version=SINKHORN_INTERFACE,
        size=ctypes.sizeof(SinkhornArgs),
        dtype=_DTYPES[dt],
        mode=MODES[mode],
        E=E,
        K=K,
        N=N,
        max_iter=max_iter,
        n_reset=0 if r is None else r.shape[2],
        normalise=int(normalise),
        p_es=p.stride(0),
        r_es=0 if r is None else r.stride(0),
        p=p.data_ptr(),
        reset=None if r is None else r.data_ptr(),
        ways=None if w is None else w.data_ptr(),
        cols=None if c is None else c.data_ptr(),
        target=tgt.data_ptr(),
        iters=None if iters is None else iters.data_ptr(),
        tol=tol,
    )
    rc = lib.poodle_sinkhorn(ctypes.byref(args))
    if rc == -1:
        raise MemoryError(f"the fused Sinkhorn loop could not allocate its buffers for {N} samples")
    if rc != 0:
        raise RuntimeError(f"the fused Sinkhorn loop refused its arguments (code {rc})")
    return p


def power_half(x: Tensor, out: Tensor, zero_value: float) -> Tensor:
    """``out = sign(x) sqrt(|x| + 1e-6)``, an exact zero to ``zero_value``, in one pass over ``x [E, n,
    D]`` (rows contiguous; ``out`` of the same shape and dtype): what
    :func:`poodle.solvers.pt_map.power_transform` computes at exponent 1/2, bit for bit."""
    lib = load()
    assert lib is not None
    if x.shape != out.shape or x.dtype != out.dtype or x.dim() != 3:
        raise ValueError(f"power_half: x {tuple(x.shape)} {x.dtype} and out {tuple(out.shape)} {out.dtype} differ")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out.stride(-1) != 1:
        raise ValueError(f"power_half: the rows of out must be contiguous, got strides {out.stride()}")
    E, n, D = x.shape
    rc = lib.poodle_power_half(
        _DTYPES[x.dtype], E, n, D, x.data_ptr(), x.stride(0), x.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1), zero_value,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the fused power transform refused its arguments (code {rc})")
    return out


CENTRES = {"none": 0, "all": 1, "parts": 2}


def pemne(parts: list[Tensor], centre: str, keep: Tensor | None, zero_value: float) -> Tensor:
    """The rows of ``parts`` (``[E, n_i, D]`` each, one dtype) stacked into a new ``[E, sum n_i, D]``:
    each row's power transform at exponent 1/2 (:func:`power_half`) divided by its norm (floored at
    1e-12, ``F.normalize``); with ``centre`` ``"all"`` (PEMnE-BMS) every row then minus the mean of
    all, with ``"parts"`` (PT-MAP) each part's rows minus their own mean, and divided by the new
    norm (``"none"``: protoLP, no centring). ``keep [E, sum n_i]`` (bool, or None: all) marks the
    real rows of a ragged chunk: a padded row comes out zero and enters no mean. Each episode's rows
    in two passes of the C library (``poodle_pemne``) that keep them in cache; the same values as
    the torch formulation (:func:`poodle.solvers.pt_map.preprocess`, :func:`poodle.solvers.bms.peme`)
    to float rounding (norms and means summed in another order)."""
    lib = load()
    assert lib is not None
    dt, (E, _, D) = parts[0].dtype, parts[0].shape
    if any(t.dim() != 3 or t.shape[0] != E or t.shape[2] != D or t.dtype != dt for t in parts) or dt not in _DTYPES:
        raise ValueError(f"pemne: parts {[(tuple(t.shape), t.dtype) for t in parts]} do not stack along the rows")
    parts = [t if t.stride(-1) == 1 else t.contiguous() for t in parts]
    rows = [t.shape[1] for t in parts]
    out = parts[0].new_empty(E, sum(rows), D)
    if keep is not None:
        if keep.shape != out.shape[:2]:
            raise ValueError(f"pemne: keep {tuple(keep.shape)} is not [E, rows] = {tuple(out.shape[:2])}")
        keep = keep.to(device="cpu", dtype=torch.bool).contiguous()
    n = len(parts)
    i64s = ctypes.c_int64 * n
    rc = lib.poodle_pemne(
        _DTYPES[dt], E, D, n, i64s(*rows), (ctypes.c_void_p * n)(*[t.data_ptr() for t in parts]),
        i64s(*[t.stride(0) for t in parts]), i64s(*[t.stride(1) for t in parts]),
        out.data_ptr(), out.stride(0), out.stride(1), zero_value, CENTRES[centre],
        None if keep is None else keep.data_ptr(), 0 if keep is None else keep.stride(0),
    )  # fmt: skip
    if rc == -1:
        raise MemoryError(f"the fused feature transform could not allocate its buffer for D = {D}")
    if rc != 0:
        raise RuntimeError(f"the fused feature transform refused its arguments (code {rc})")
    return out


def propagate(z: Tensor, yty: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """protoLP's label propagation (:func:`poodle.solvers.proto_lp.propagate`) of assignments
    ``z [E, K, N]`` (classes first) with ``yty [E, K, K]``, each episode in one C pass
    (``poodle_propagate``: the graph, the Cholesky factor of its system, the solve and the
    product): ``(P^T [E, K, N], bad [E])``, ``bad`` True where the system is not positive definite
    (those episodes' rows of ``P^T`` are left for the caller's pseudo-inverse). The same as the torch
    formulation to float rounding."""
    lib = load()
    assert lib is not None
    E, K, N = z.shape
    if yty.shape != (E, K, K) or yty.dtype != z.dtype or z.dtype not in _DTYPES:
        raise ValueError(f"propagate: z {tuple(z.shape)} {z.dtype} and yty {tuple(yty.shape)} {yty.dtype} differ")
    z, yty = z.contiguous(), yty.contiguous()
    out = torch.zeros_like(z)
    bad = torch.zeros(E, dtype=torch.int32)
    rc = lib.poodle_propagate(
        _DTYPES[z.dtype], E, K, N, z.data_ptr(), yty.data_ptr(), gamma, out.data_ptr(), bad.data_ptr()
    )
    if rc == -1:
        raise MemoryError(f"the fused label propagation could not allocate its buffers for {K} x {N}")
    if rc < 0:
        raise RuntimeError(f"the fused label propagation refused its arguments (code {rc})")
    return out, bad.bool()


class LPStep:
    """protoLP's step after its assignments' kernel, one C call a step (``poodle_lp_assign_step``)
    on buffers made once per solve: the queries' ``exp(-lam cost)`` is balanced as
    :func:`poodle.solvers.pt_map.sinkhorn` balances it (each plan divided by its total, samples 1,
    classes ``plan_target``, to ``plan_tol``), the step's assignments ``z = [reset | plan]`` formed,
    then :func:`propagate`, the balanced sweeps of :func:`poodle.solvers.proto_lp.lp_normalise`
    (classes ``target``, the support samples reset to ``reset [E, K, Ns]`` after each sweep, to
    ``tol``) and the mask ``clamp(mix P + (1 - mix) z, 0, 1)``. ``ways``, ``plan_cols``, ``cols``
    (``[E]`` or None): a ragged chunk's classes and samples of each plan. The same as the torch
    formulation to float rounding. ``sweeps [E]`` (int32) adds up each episode's sweeps of both
    loops over the calls (what the floor model counts)."""

    def __init__(
        self,
        yty: Tensor,
        reset: Tensor,
        n_plan: int,
        gamma: float,
        mix: float,
        plan_target: Tensor | float,
        plan_tol: float,
        target: Tensor | float,
        tol: float,
        max_iter: int,
        ways: Tensor | None = None,
        plan_cols: Tensor | None = None,
        cols: Tensor | None = None,
    ) -> None:
        lib = load()
        assert lib is not None
        E, K, n_reset = reset.shape
        dt = reset.dtype
        if yty.shape != (E, K, K) or dt not in _DTYPES:
            raise ValueError(f"LPStep: yty {tuple(yty.shape)} and reset {tuple(reset.shape)} {dt} differ")
        self.lib, self.dtype, self.shape = lib, dt, (E, K, n_plan)
        self.yty, self.reset = yty.to(dt).contiguous(), reset.contiguous()
        self.plan_target = torch.as_tensor(plan_target, dtype=torch.float64).expand(E).contiguous()
        self.target = torch.as_tensor(target, dtype=torch.float64).expand(E).contiguous()
        self.ways, self.plan_cols, self.cols = _sizes(ways), _sizes(plan_cols), _sizes(cols)
        self.z = reset.new_empty(E, K, n_reset + n_plan)
        self.out = torch.empty_like(self.z)
        self.bad = torch.zeros(E, dtype=torch.int32)
        self.sweeps = torch.zeros(E, dtype=torch.int32)  # both loops' sweeps of every call so far

        def ptr(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self._head = (_DTYPES[dt], E, K, n_reset + n_plan)
        self._tail = (
            ptr(self.plan_target), plan_tol, ptr(self.plan_cols), self.z.data_ptr(), self.yty.data_ptr(), gamma, mix,
            1 - mix, self.reset.data_ptr(), n_reset, self.target.data_ptr(), tol, max_iter, ptr(self.ways),
            ptr(self.cols), self.out.data_ptr(), self.bad.data_ptr(), self.sweeps.data_ptr(),
        )  # fmt: skip

    def __call__(self, plan: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``plan [E, K, Nq]``: the queries' ``exp(-lam cost)`` (overwritten with their balanced
        plan). Returns ``(mask [E, K, N], z [E, K, N], bad)`` (buffers of this object, rewritten by
        the next call); ``bad [E]`` (bool) marks the episodes whose system was not positive
        definite (their mask is left to the caller), None when there is none."""
        if plan.shape != self.shape or plan.dtype != self.dtype or not plan.is_contiguous():
            raise ValueError(f"LPStep: plan {tuple(plan.shape)} {plan.dtype} is not a contiguous {self.shape}")
        rc = self.lib.poodle_lp_assign_step(*self._head, plan.data_ptr(), *self._tail)
        if rc == -1:
            raise MemoryError(f"protoLP's fused step could not allocate its buffers for {self.shape}")
        if rc < 0:
            raise RuntimeError(f"protoLP's fused step refused its arguments (code {rc})")
        return self.out, self.z, (self.bad.bool() if rc else None)


__all__ = [
    "CENTRES",
    "MODES",
    "SINKHORN_INTERFACE",
    "SinkhornArgs",
    "formulation",
    "LPStep",
    "load",
    "pemne",
    "power_half",
    "propagate",
    "run",
    "state",
    "usable",
]
