"""What a GPU should do with each solver, by arithmetic: bytes moved, FLOPs, kernel launches and host
syncs per episode on the standard workload, and the time 10,000 episodes should take on an H100 SXM,
an H100 PCIe and an H200 from their published figures. No GPU is needed: the counts come from
running the solver on the CPU under a ``TorchDispatchMode`` that records every ATen operation, with
the fused CPU kernel switched off so that the torch formulation, which is what CUDA runs, is counted.

The model (per chunk of ``C`` episodes; 10,000 episodes are chunks of 4,096, 4,096 and 1,808 as
``poodle.evaluate`` plans them on a GPU):

- an operation reads its inputs and writes its outputs once from device memory (no reuse between
  operations: a chunk's buffers are hundreds of MB, far beyond the 50 MB L2), and takes at least
  :data:`KERNEL_FLOOR_S`; a tensor broadcast along an axis (stride 0) is read once;
- the device time of a chunk is the sum over its operations of ``max(bytes / bandwidth,
  floor)``, and the whole chunk is also bounded below by ``FLOPs / FP32 rate``;
- the host issues each operation in :data:`HOST_OP_S` and runs ahead of the device, so the chunk
  takes the larger of the two; every host sync (``.item()``, ``bool(tensor)``) drains the device and
  adds :data:`SYNC_S`;
- a loop that stops per episode (a method's declared ``Floor.loops``) runs, masked, to the chunk's
  slowest episode: its traced operations and syncs are repeated by :func:`loop_scale`, the ratio of
  the expected maximum of the measured per-episode iterations (:func:`iteration_counts`) over the
  chunk to that over the traced episodes;
- a decomposition the GPU path sends to the host (``batched_eigh`` of a matrix above 32 x 32) adds
  its LAPACK time on this machine, spread over :data:`HOST_CORES` (:func:`host_seconds`).

FLOPs are the method's registered count (``poodle.solvers.get(name).flops``; a method without one
gets no FLOP figure), and the traced matmul FLOPs are reported beside it so the two can be
reconciled. Every per-method fact the model reads (FLOPs, ``Floor``: loops, fixed steps, the
iteration-count field) is declared at the method's ``@register``; the model keeps no table of
methods. Views, allocations (``empty``) and metadata operations move nothing.

Published figures (FP32 = dense, non-tensor-core FP32, which torch uses for float32 matmuls unless
TF32 is enabled; bandwidth = HBM):

- H100 SXM5 80 GB: 3.35 TB/s, 67 TFLOP/s FP32, 132 SMs, 50 MB L2 (NVIDIA H100 Tensor Core GPU
  datasheet, 2023; NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022).
- H100 PCIe 80 GB: 2.0 TB/s, 51 TFLOP/s FP32, 114 SMs, 50 MB L2 (same sources).
- H200 SXM 141 GB: 4.8 TB/s, 67 TFLOP/s FP32 (NVIDIA H200 Tensor Core GPU datasheet, 2024), the
  same GH100 die as the H100 SXM (132 SMs, 50 MB L2).

The one-pass Triton step (``poodle/solvers/_triton_step.py``) is modelled analytically
(:func:`triton_step_bytes`): the rows once per step, the ``[K, D]`` parameter buffers, the per-row
terms; and, when an episode group's rows fit in half the L2 (:func:`resident_group`), the rows not at
all after the first step, at the cost of fewer programs than SMs (:func:`triton_seconds`).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

KERNEL_FLOOR_S = 2.5e-6  # the shortest kernel on a Hopper GPU, launch to completion (assumed)
HOST_OP_S = 6e-6  # host time to issue one eager PyTorch operation on CUDA (assumed)
SYNC_S = 20e-6  # a host sync: the device drains and the host waits for it (assumed)
L2_SHARE = 0.5  # the share of L2 an episode group may fill and still stay resident
# The Triton Sinkhorn loop (poodle/solvers/_triton_sinkhorn.py): one program per episode sweeps its
# register-resident plan to its own convergence. A sweep is two block reductions (warp shuffles and
# a barrier each) and a division per entry: FUSED_SWEEP_S each (assumed). A PT-MAP program (8 x 128
# plan, 4 warps, 80 registers a thread) leaves room for 6 on an SM (65,536 registers):
# FUSED_PROGRAMS_PER_SM run at once, the rest in later waves.
FUSED_SWEEP_S = 2e-6
FUSED_PROGRAMS_PER_SM = 6
GPU_CHUNK = 4096  # poodle.evaluate.GPU_MAX_CHUNK: episodes per chunk on a GPU


@dataclass(frozen=True)
class GPU:
    """A GPU's published figures: HBM bandwidth (bytes/s), dense FP32 rate (FLOP/s), L2, SMs."""

    name: str
    bandwidth: float
    fp32: float
    l2_bytes: int
    sms: int


H100_SXM = GPU("H100 SXM", 3.35e12, 67e12, 50 * 2**20, 132)
H100_PCIE = GPU("H100 PCIe", 2.0e12, 51e12, 50 * 2**20, 114)
H200 = GPU("H200", 4.8e12, 67e12, 50 * 2**20, 132)
GPUS = (H100_SXM, H100_PCIE, H200)


@dataclass(frozen=True)
class Workload:
    """The standard workload: 5-way 1-shot, 15 queries per class, 400 negatives where the method uses
    them, D = 640, float32; 10,000 episodes."""

    way: int = 5
    shot: int = 1
    query: int = 15
    n_neg: int = 400
    dim: int = 640
    episodes: int = 10_000
    itemsize: int = 4

    @property
    def n_support(self) -> int:
        return self.way * self.shot

    @property
    def n_query(self) -> int:
        return self.way * self.query


STANDARD = Workload()


# ------------------------------------------------------------------ analytic counts


def row_bytes(n: int, dim: int, itemsize: int = 4) -> int:
    """Bytes of an episode's ``n`` rows of ``dim`` values."""
    return n * dim * itemsize


def torch_step_bytes(
    n: int, dim: int, way: int, free: bool = False, learn_scale: bool = True, itemsize: int = 4
) -> int:
    """Bytes one step of ``_optim.fit_weighted_distance``'s torch formulation moves per episode,
    operation by operation (the traced count equals it: tests/test_costmodel.py). The rows are read
    twice (``X W^T``, ``G^T X``); the rest is the ``[K, n]`` elementwise chain (18 passes), the
    prototypes' ``[K, D]`` work (11, of which ``vecdot`` decomposes into a multiply and a sum) and
    Adam on the ``K*D + 16`` padded parameters (19 passes)."""
    K, D, F = way, dim, way * dim + 16
    rows = 2 * n * D
    kn = (18 + (14 if free else 0) - (0 if learn_scale else 4)) * K * n
    kd = 11 * K * D
    per_row = n + (3 * n if free else 0)
    small = 4 * K + (6 if learn_scale else 2)
    return itemsize * (rows + kn + kd + per_row + small + 19 * F)


def triton_step_bytes(n: int, dim: int, way: int, n_support: int | None = None, itemsize: int = 4) -> dict[str, int]:
    """Bytes one step of the Triton kernel moves per episode: ``dram`` from device memory when the rows
    stream from it (rows once, prototypes and both Adam moments read and written, the gradient
    scratch written and read once, the per-row terms), ``resident`` when the rows stay in L2 across
    steps (the rest only), and ``l2`` the traffic that stays in L2 within a step (the rows' second
    look, the gradient scratch per row block, the logit scratch of the two-pass losses).

    ``n_support``: ``None`` for the weighted-distance loss (POODLE: targets ``[K, n]``, row weights),
    else the logit losses' support size (targets ``[K, Ns]``, probabilities kept between passes)."""
    K, D = way, dim
    params = 8 * K * D  # W, M, V, GX read; W, M, V, GX written
    terms = (K + 2) * n if n_support is None else K * n_support
    rows = n * D
    bk = max(16, 1 << (K - 1).bit_length())
    blocks = -(-n // 32)
    l2 = rows + 2 * blocks * K * D + (0 if n_support is None else rows + 4 * n * bk)
    return {
        "dram": itemsize * (rows + params + terms),
        "resident": itemsize * (params + terms),
        "l2": itemsize * l2,
    }


def resident_group(n: int, dim: int, way: int, gpu: GPU, itemsize: int = 4) -> int:
    """Episodes whose rows and parameter buffers fit in :data:`L2_SHARE` of ``gpu``'s L2: one launch
    of that many keeps its rows resident across all its steps."""
    per = itemsize * (n * dim + 4 * way * dim)
    return max(1, int(L2_SHARE * gpu.l2_bytes) // per)


def triton_seconds(
    n: int, dim: int, way: int, steps: int, episodes: int, gpu: GPU, n_support: int | None = None, itemsize: int = 4
) -> dict[str, float]:
    """Predicted seconds of the Triton step for ``episodes`` episodes: ``stream`` (every launch holds
    all episodes; rows from device memory each step) and ``resident`` (launches of
    :func:`resident_group` episodes, rows from L2 after the first step, compute at the share of SMs
    the group occupies), and ``group``. FLOPs count the class axis padded to 16, as ``tl.dot`` runs it.
    """
    b = triton_step_bytes(n, dim, way, n_support, itemsize)
    bk = max(16, 1 << (way - 1).bit_length())
    flops = steps * episodes * (4.0 * n * dim * bk + 40.0 * n * bk + 12.0 * way * dim)
    stream = max(steps * episodes * b["dram"] / gpu.bandwidth, flops / gpu.fp32)
    g = min(resident_group(n, dim, way, gpu, itemsize), episodes)
    occupancy = min(1.0, g / gpu.sms)
    first = episodes * row_bytes(n, dim, itemsize) / gpu.bandwidth
    resident = first + max(steps * episodes * b["resident"] / gpu.bandwidth, flops / (gpu.fp32 * occupancy))
    return {"stream": stream, "resident": resident, "group": float(g)}


def chunks(episodes: int, chunk: int = GPU_CHUNK) -> list[int]:
    """The chunk sizes ``episodes`` are solved in."""
    return [min(chunk, episodes - a) for a in range(0, episodes, chunk)]


# ------------------------------------------------------------------ traced counts


@dataclass
class Trace:
    """What one call of a solver did, per episode of the traced batch.

    Attributes:
        op_bytes: bytes each operation moved, per episode, in order (one kernel launch each).
        syncs: host syncs per call (``.item()``, ``bool(tensor)``, ``.tolist()`` ...).
        matmul_flops: FLOPs of the matrix products per episode (torch.utils.flop_counter's count).
        names: ATen operation names, in order.
        loop_ops: the indices (into ``op_bytes``) of the operations made inside the method's loops
            that stop per episode (its :class:`~poodle.solvers.base.Floor` ``loops``): on a GPU
            they repeat until the chunk's slowest episode stops (:func:`loop_scale`).
        loop_syncs: the host syncs made inside those loops.
        fused_sweeps: per launch of a fused Sinkhorn loop (:func:`trace` with ``fused_sinkhorn``,
            whose launches are also in ``op_bytes``), the sweeps each traced episode ran.
    """

    op_bytes: list[float] = field(default_factory=list)
    syncs: int = 0
    matmul_flops: float = 0.0
    names: list[str] = field(default_factory=list)
    loop_ops: list[int] = field(default_factory=list)
    loop_syncs: int = 0
    fused_sweeps: list[list[int]] = field(default_factory=list)

    @property
    def bytes(self) -> float:
        return float(sum(self.op_bytes))

    @property
    def launches(self) -> int:
        return len(self.op_bytes)


_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "lift_fresh", "detach", "alias", "_to_copy_meta"}
# reads of a tensor's value on the host
_SYNCS = {"_local_scalar_dense", "is_nonzero", "item", "equal"}
# decompositions whose CUDA kernels read their error codes back to the host (torch's
# ``_linalg_check_errors`` inside them: one sync each, hidden from this mode; where it is called
# on its own, as by ``linalg.inv`` or ``linalg.solve``, it is counted as the sync it is)
_CHECKED = {"_linalg_eigh", "_linalg_svd", "linalg_pinv"}


def _unique_bytes(t: Tensor) -> int:
    """Bytes of the distinct elements of ``t`` (a stride-0 axis is read once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tracer(per: int, answer: bool | None = None) -> Any:
    """A TorchDispatchMode that fills a :class:`Trace`, dividing bytes and FLOPs by ``per`` episodes.

    ``answer``: a host read of a tensor's value (``.item()``, ``bool(t)``) is not run but answered
    with this value (``int``/``float`` of it for numbers), so that solvers run on the ``meta``
    device, which has shapes and no values (``bool(active.any())`` answered False: every episode
    has converged)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.trace = Trace()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            name = func.__name__.split(".")[0]
            if name in _SYNCS and answer is not None:
                self.trace.syncs += 1
                return _answer(args[0], answer) if name == "_local_scalar_dense" else answer
            out = func(*args, **kwargs)
            if name in _SYNCS or name == "_linalg_check_errors":
                self.trace.syncs += 1
                return out
            if name in _CHECKED:
                self.trace.syncs += 1
            if func.is_view or name in _NO_TRAFFIC:
                return out
            outs = {a.name for a in func._schema.arguments if a.is_out}
            ins = tree_flatten((args, {k: v for k, v in kwargs.items() if k not in outs}))[0]
            moved = sum(_unique_bytes(t) for t in ins if isinstance(t, Tensor))
            moved += sum(_unique_bytes(t) for t in tree_flatten(out)[0] if isinstance(t, Tensor))
            self.trace.op_bytes.append(moved / per)
            self.trace.names.append(str(func))
            packet = func._overloadpacket
            if packet in flop_registry:
                self.trace.matmul_flops += flop_registry[packet](*args, out_val=out, **kwargs) / per
            return out

    return _Count()


def _answer(t: Tensor, value: bool) -> bool | int | float:
    if t.dtype == torch.bool:
        return value
    return float(value) if t.dtype.is_floating_point else int(value)


def standard_batch(workload: Workload = STANDARD, episodes: int = 4, seed: int = 0) -> Any:
    """``episodes`` episodes of ``workload`` on the CPU: L2-normalised rows around one random
    centre per class (a spread that a prototype classifier gets about two-thirds right, like real
    features), negatives around other centres."""
    from poodle.solvers import EpisodeBatch

    g = torch.Generator().manual_seed(seed)
    E, K, D = episodes, workload.way, workload.dim
    centres = torch.nn.functional.normalize(torch.randn(E, K, D, generator=g), dim=-1)

    def around(c: Tensor, per: int) -> tuple[Tensor, Tensor]:
        labels = torch.arange(c.shape[1]).repeat_interleave(per).expand(E, -1)
        x = c.repeat_interleave(per, 1) + 1.5 / math.sqrt(D) * torch.randn(E, c.shape[1] * per, D, generator=g)
        return torch.nn.functional.normalize(x, dim=-1), labels.contiguous()

    s, ys = around(centres, workload.shot)
    q, _ = around(centres, workload.query)
    other = torch.nn.functional.normalize(torch.randn(E, 8, D, generator=g), dim=-1)
    neg, _ = around(other, -(-workload.n_neg // 8))
    return EpisodeBatch(s, ys, q, neg[:, : workload.n_neg].contiguous(), K)


@contextlib.contextmanager
def _watch_loops(
    loops: tuple[str, ...], snapshot: Callable[[], tuple[int, int]] | None = None, keep_active: bool = False
) -> Iterator[list[dict]]:
    """While inside, every call of a loop function of ``loops`` (``"module:function"``) appends a
    record to the yielded list: ``looks``, the calls of ``should_stop`` in that module during it
    (one per iteration), ``start``/``end``, ``snapshot()`` before and after (the tracer's
    operation and sync counts), and with ``keep_active`` ``active``, the ``[E]`` mask of the
    episodes still iterating at each look. Loops nested in a watched loop count in the outer one."""
    records: list[dict] = []
    running: list[dict] = []
    undo: list[tuple[Any, str, Any]] = []
    patched: set[str] = set()
    snap = snapshot or (lambda: (0, 0))
    for spec in loops:
        mod_name, fn_name = spec.split(":")
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name)

        def loop(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            if running:  # already inside a watched loop
                return _fn(*a, **k)
            rec = {"looks": 0, "start": snap()}
            running.append(rec)
            try:
                return _fn(*a, **k)
            finally:
                running.pop()
                rec["end"] = snap()
                records.append(rec)

        undo.append((mod, fn_name, fn))
        setattr(mod, fn_name, loop)
        home = importlib.import_module(fn.__module__)  # where the loop looks up its should_stop
        if home.__name__ not in patched and hasattr(home, "should_stop"):
            patched.add(home.__name__)
            stop = getattr(home, "should_stop")  # noqa: B009

            def look(active: Tensor, *a: Any, _stop: Any = stop, **k: Any) -> bool:
                if running:
                    running[-1]["looks"] += 1
                    if keep_active:
                        running[-1].setdefault("active", []).append(active.detach().to("cpu", copy=True))
                return bool(_stop(active, *a, **k))

            undo.append((home, "should_stop", stop))
            setattr(home, "should_stop", look)  # noqa: B010 (a module attribute mypy cannot see)
    try:
        yield records
    finally:
        for mod, name, fn in reversed(undo):
            setattr(mod, name, fn)


@contextlib.contextmanager
def _fused_sinkhorn(mode: Any, per: int) -> Iterator[None]:
    """Inside, the solvers' Sinkhorn loops take the Triton path (:mod:`poodle.solvers._triton_sinkhorn`),
    each call counted as the one launch it is there: its plan read and written once, its other
    inputs read, and the sweeps of each episode (run by the fused C loop, which sweeps as the
    Triton program does, outside the trace)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from poodle.solvers import _sinkhorn_native, _triton_sinkhorn

    def run(kind: str, p: Tensor, target: Tensor | float, max_iter: int, **kw: Any) -> Tensor:
        if _sinkhorn_native.load() is None or p.device.type != "cpu":
            raise RuntimeError("the model of the fused Sinkhorn loop counts its sweeps with the C loop, not built here")
        kw.pop("iters", None)
        sweeps = torch.zeros(p.shape[0], dtype=torch.int32)
        with _disable_current_modes():
            out = _sinkhorn_native.run(kind, p, target, max_iter, iters=sweeps, **kw)
        extra = (target, kw.get("reset"), kw.get("ways"), kw.get("cols"))
        moved = 2 * _unique_bytes(p) + sum(_unique_bytes(t) for t in extra if isinstance(t, Tensor))
        mode.trace.op_bytes.append(moved / per)
        mode.trace.names.append(f"triton_sinkhorn.{kind}")
        mode.trace.fused_sweeps.append(sweeps.tolist())
        return out

    undo = [(name, getattr(_triton_sinkhorn, name)) for name in ("usable", "run")]
    _triton_sinkhorn.usable = lambda p: True  # type: ignore[assignment]
    _triton_sinkhorn.run = run  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, fn in undo:
            setattr(_triton_sinkhorn, name, fn)


def _run_traced(method: str, cfg: Any, batch: Any, fused_sinkhorn: bool = False) -> Trace:
    from poodle import solvers

    # with the fused loop, the method's loops that stop per episode are inside its one launch
    loops = () if fused_sinkhorn else solvers.get(method).floor.loops
    # the torch formulation (what a GPU runs), its convergence checks as a GPU makes them (once per
    # CHECK_EVERY iterations), not per iteration
    traced = solvers.Backend(native=False, device_schedule=True)
    with _tracer(batch.n_episodes) as mode:
        fused = _fused_sinkhorn(mode, batch.n_episodes) if fused_sinkhorn else contextlib.nullcontext()
        with fused, _watch_loops(loops, lambda: (len(mode.trace.op_bytes), mode.trace.syncs)) as records:
            solvers.run(method, batch, cfg, backend=traced)
    result: Trace = mode.trace
    for rec in records:
        result.loop_ops += range(rec["start"][0], rec["end"][0])
        result.loop_syncs += rec["end"][1] - rec["start"][1]
    return result


def trace(
    method: str,
    options: Mapping[str, Any] | None = None,
    batch: Any = None,
    workload: Workload = STANDARD,
    extrapolate: bool = True,
    fused_sinkhorn: bool = False,
) -> Trace:
    """Run ``method`` on ``batch`` (default :func:`standard_batch`) with the torch formulation and
    count what it did, per episode. Methods registered with ``Floor.fixed_steps`` are run at 1 and
    2 steps and the difference, one step's operations, repeated to the configured count (``extrapolate``; the test
    compares it with a full trace). ``fused_sinkhorn``: the method's Sinkhorn loops as the CUDA
    Triton loop runs them, one launch a call (traced whole, not extrapolated)."""
    from poodle import solvers

    batch = standard_batch(workload) if batch is None else batch
    options = dict(options or {})
    cfg = solvers.make_config(method, options, strict=True)
    if batch.negatives is not None and not solvers.get(method).needs_negatives(cfg):
        batch = type(batch)(batch.support, batch.support_labels, batch.query, None, batch.way)
    steps = method_steps(method, cfg, workload)
    if fused_sinkhorn or not (extrapolate and solvers.get(method).floor.fixed_steps and steps > 2):
        return _run_traced(method, cfg, batch, fused_sinkhorn)
    one, two = (
        _run_traced(method, solvers.make_config(method, {**options, "steps": k}, strict=True), batch) for k in (1, 2)
    )
    extra = Counter(zip(two.names, two.op_bytes))
    extra.subtract(Counter(zip(one.names, one.op_bytes)))
    step = [(name, b) for (name, b), c in extra.items() for _ in range(c)]
    if len(step) != two.launches - one.launches or any(c < 0 for c in extra.values()):
        return _run_traced(method, cfg, batch)  # the steps differ after all: trace them all
    out = Trace(list(one.op_bytes), one.syncs, one.matmul_flops, list(one.names))
    for _ in range(steps - 1):
        out.names += [name for name, _ in step]
        out.op_bytes += [b for _, b in step]
    out.syncs += (steps - 1) * (two.syncs - one.syncs)
    out.matmul_flops += (steps - 1) * (two.matmul_flops - one.matmul_flops)
    return out


# ------------------------------------------------------------------ predictions


def method_flops(method: str, cfg: Any, workload: Workload = STANDARD, uses_negatives: bool = False) -> float | None:
    """FLOPs per episode of ``method``: its registered count, else None."""
    from poodle import solvers

    fn = solvers.get(method).flops
    if fn is None:
        return None
    M = workload.n_neg if uses_negatives else 0
    return float(fn(workload.n_support, workload.n_query, M, workload.dim, workload.way, cfg))


def method_steps(method: str, cfg: Any, workload: Workload = STANDARD) -> int:
    """The iteration count of ``method`` as configured (``cfg.resolved()`` for presets), from the
    field its registration names (``Floor.steps_field``)."""
    from poodle import solvers

    values = cfg.resolved() if hasattr(cfg, "resolved") else {}
    values = values if isinstance(values, dict) else {}
    name = solvers.get(method).floor.steps_field
    v = values.get(name, getattr(cfg, name, None))
    steps_of = solvers.get(method).floor.steps_of
    if steps_of is not None:  # a count the method derives from the episode's shape
        v = steps_of(cfg, workload.n_query)
    return max(1, int(v or 1))


def predict(
    tr: Trace,
    flops: float,
    gpu: GPU,
    episodes: int = 10_000,
    chunk: int = GPU_CHUNK,
    loops: Callable[[int], float] | None = None,
    host_s: float = 0.0,
) -> float:
    """Seconds ``episodes`` episodes should take on ``gpu`` (module docstring's model).

    ``loops(c)``: how many times the trace's loop operations (``tr.loop_ops``, ``tr.loop_syncs``)
    repeat in a chunk of ``c`` episodes for the once they were traced (:func:`loop_scale`; None:
    as traced). ``host_s``: host seconds per episode of work the device waits for (the host-side
    ``eigh``, :func:`host_seconds`)."""
    total = 0.0
    loop_bytes = [tr.op_bytes[i] for i in tr.loop_ops]
    resident = gpu.sms * FUSED_PROGRAMS_PER_SM
    for c in chunks(episodes, chunk):
        extra = (loops(c) - 1.0) if loops is not None and tr.loop_ops else 0.0

        all_ops = sum(max(c * b / gpu.bandwidth, KERNEL_FLOOR_S) for b in tr.op_bytes)
        device = all_ops + extra * sum(max(c * b / gpu.bandwidth, KERNEL_FLOOR_S) for b in loop_bytes)
        # a fused loop's waves of programs, each wave as long as its slowest episode's sweeps
        waves = math.ceil(c / resident)
        device += sum(waves * expected_max(s, min(c, resident)) * FUSED_SWEEP_S for s in tr.fused_sweeps if s)
        device = max(device, c * flops / gpu.fp32)
        launches = tr.launches + extra * len(loop_bytes)
        total += max(device, launches * HOST_OP_S) + (tr.syncs + extra * tr.loop_syncs) * SYNC_S + c * host_s
    return total


# ------------------------------------------------------------------ loops to the slowest episode


def expected_max(counts: Sequence[float], k: int) -> float:
    """The expected maximum of ``k`` draws (with replacement) from ``counts``, exactly: with the
    counts sorted, ``sum_i x_(i) ((i/n)^k - ((i-1)/n)^k)``. What a masked loop over a chunk of ``k``
    episodes runs to, when ``counts`` is the distribution of the iterations one episode needs."""
    x = sorted(float(v) for v in counts)
    n = len(x)
    if n == 0:
        raise ValueError("expected_max of no counts")
    return sum(v * (((i + 1) / n) ** k - (i / n) ** k) for i, v in enumerate(x))


def iteration_counts(
    method: str,
    options: Mapping[str, Any] | None = None,
    workload: Workload = STANDARD,
    episodes: int = 32,
    seed: int = 1,
) -> list[list[int]]:
    """The iterations each of ``episodes`` standard episodes needs in each of the method's loops
    that stop per episode (:class:`~poodle.solvers.base.Floor` ``loops``), measured on the CPU in
    one batched call with the loops masked as on a GPU and looking at every iteration: an episode's
    count is the looks that found it still iterating, plus the one that found it done (at most the
    call's looks). ``counts[e][j]``: episode ``e``'s iterations in the ``j``-th loop call ([]
    without loops). A masked episode's values are those it gets alone, so its count is too."""
    from poodle import solvers

    info = solvers.get(method)
    loops = info.floor.loops
    if not loops:
        return []
    cfg = solvers.make_config(method, dict(options or {}), strict=True)
    batch = standard_batch(workload, episodes, seed)
    if not info.needs_negatives(cfg):
        batch = type(batch)(batch.support, batch.support_labels, batch.query, None, batch.way)
    # the modules the loops are defined in, whose syncs_freely picks their path
    modules = {
        importlib.import_module(getattr(importlib.import_module(spec.split(":")[0]), spec.split(":")[1]).__module__)
        for spec in loops
    }
    undo = [(m, getattr(m, "syncs_freely")) for m in modules if hasattr(m, "syncs_freely")]  # noqa: B009
    counts = []
    try:
        for m, _ in undo:  # the masked (GPU) path of each loop; should_stop still looks every time
            setattr(m, "syncs_freely", lambda t: False)  # noqa: B010
        with _watch_loops(loops, keep_active=True) as records:
            # the torch loops, whose looks are counted (the native ones stop alike)
            solvers.run(method, batch, cfg, backend=solvers.Backend(native=False))
        per_call = []
        for r in records:
            seen = (
                torch.stack(r["active"]).long().sum(0) if r.get("active") else torch.zeros(episodes, dtype=torch.long)
            )
            per_call.append((seen + 1).clamp_max(max(int(r["looks"]), 1)).tolist())
        counts = [[int(call[e]) for call in per_call] for e in range(episodes)]
    finally:
        for m, fn in undo:
            setattr(m, "syncs_freely", fn)  # noqa: B010
    return counts


def loop_scale(counts: list[list[int]], traced: int) -> Callable[[int], float]:
    """``c -> `` how many times more loop iterations a chunk of ``c`` episodes runs than the trace
    of ``traced`` episodes did: each loop call runs to its slowest episode, so the ratio of the
    expected maxima (:func:`expected_max`) of each call's measured iterations, summed over the calls.
    ``counts`` from :func:`iteration_counts` (a call an episode did not make counts 0)."""
    if not counts:
        return lambda c: 1.0
    width = max(len(row) for row in counts)
    columns = [[row[j] if j < len(row) else 0 for row in counts] for j in range(width)]
    base = sum(expected_max(col, traced) for col in columns)

    def scale(c: int) -> float:
        return sum(expected_max(col, c) for col in columns) / base if base else 1.0

    return scale


# ------------------------------------------------------------------ host-side decompositions

HOST_CORES = 16  # host cores a GPU process spreads its batched eigh over (assumed; a 16-core host)


def eigh_seconds(order: int, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Seconds of LAPACK's ``eigh`` (with eigenvectors) of one ``order x order`` symmetric matrix
    on one thread of this machine (the thread's CPU time, best of ``repeats``): the rate the
    host-side decompositions run at."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(order, 2 * order, dtype=dtype, generator=torch.Generator().manual_seed(0))
        m = x @ x.T
        torch.linalg.eigh(m)
        best = float("inf")
        for _ in range(repeats):  # the thread's CPU time: the decomposition's, not a busy machine's waits
            t0 = time.thread_time()
            torch.linalg.eigh(m)
            best = min(best, time.thread_time() - t0)
    finally:
        torch.set_num_threads(before)
    return best


def host_seconds(method: str, cfg: Any, workload: Workload = STANDARD, cores: int = HOST_CORES) -> tuple[int, float]:
    """``(order, seconds per episode)`` of the host-side decomposition ``method`` makes per episode
    on a GPU (``batched_eigh`` sends matrices larger than 32 x 32 to the host, spread over its
    ``cores``), from its :class:`~poodle.solvers.base.Floor` facts and this machine's LAPACK rate;
    ``(0, 0.0)`` without one."""
    from poodle import solvers

    f = solvers.get(method).floor
    shape = (workload.n_support, workload.n_query, 0, workload.dim, workload.way)
    order = f.eigh_order(*shape, cfg)
    if order <= 32:  # on the device (batched_eigh), or none
        return order, 0.0
    return order, eigh_seconds(order, getattr(torch, f.eigh_dtype)) / cores


@dataclass
class Row:
    """One method's line of the cost table (per episode unless said)."""

    method: str
    steps: int
    bytes: float
    flops: float
    traced_flops: float
    launches: int
    syncs: int
    seconds: dict[str, float]
    flops_source: str
    loop_share: float = 0.0
    loop_scale: float = 1.0
    eigh_order: int = 0
    host_s: float = 0.0
    variant: str = ""  # "" (the torch formulation) or what else the row models ("Triton Sinkhorn loop")

    @property
    def bytes_per_step(self) -> float:
        return self.bytes / self.steps

    @property
    def flops_per_step(self) -> float:
        return self.flops / self.steps


# every method that iterates, with the options of the standard workload
ITERATIVE: list[tuple[str, dict[str, Any]]] = [
    ("poodle", {"transductive": True}),
    ("ce", {}),
    ("naive-ood", {}),
    ("tim-gd", {}),
    ("alpha-tim", {}),
    ("entropy-min", {}),
    ("tim-adm", {}),
    ("paddle", {}),
    ("pt-map", {}),
    ("bms", {}),
    ("proto-lp", {}),
    ("laplacianshot", {}),
    ("kmeans", {}),
    ("bayes-kmeans", {}),
    ("soft-kmeans", {}),
    ("mean-shift", {}),
    ("can-t", {}),
]


def table(
    methods: list[tuple[str, dict[str, Any]]] | None = None,
    workload: Workload = STANDARD,
    gpus: tuple[GPU, ...] = GPUS,
    traced_episodes: int = 4,
    loop_episodes: int = 64,
    fused_sinkhorn: bool = False,
) -> list[Row]:
    """The cost model's line for every method of ``methods`` (default :data:`ITERATIVE`). A method's
    loops that stop per episode are counted to the chunk's slowest episode from the iterations of
    ``loop_episodes`` episodes measured on the CPU (:func:`iteration_counts`, :func:`loop_scale`);
    its host-side ``eigh`` at this machine's LAPACK rate (:func:`host_seconds`). ``fused_sinkhorn``:
    the methods with a Sinkhorn sweep (``Floor.sweep``) only, their Sinkhorn loops as the CUDA Triton
    loop runs them (one launch a call, no host sync; the other methods are left out)."""
    from poodle import solvers

    batch = standard_batch(workload, traced_episodes)
    rows = []
    for method, options in methods or ITERATIVE:
        if fused_sinkhorn and solvers.get(method).floor.sweep is None:
            continue
        cfg = solvers.make_config(method, options, strict=True)
        uses_neg = solvers.get(method).needs_negatives(cfg)
        tr = trace(method, options, batch, workload, fused_sinkhorn=fused_sinkhorn)
        registered = solvers.get(method).flops is not None
        fl = method_flops(method, cfg, workload, uses_neg)
        source = "registered" if registered else ("fallback" if fl is not None else "traced")
        flops = tr.matmul_flops if fl is None else fl
        counts = [] if fused_sinkhorn else iteration_counts(method, options, workload, loop_episodes)
        scale = loop_scale(counts, traced_episodes)
        order, host = host_seconds(method, cfg, workload)
        secs = {g.name: predict(tr, flops, g, workload.episodes, loops=scale, host_s=host) for g in gpus}
        steps = method_steps(method, cfg, workload)
        row = Row(method, steps, tr.bytes, flops, tr.matmul_flops, tr.launches, tr.syncs, secs, source)
        row.loop_share = len(tr.loop_ops) / max(tr.launches, 1)
        row.loop_scale, row.eigh_order, row.host_s = scale(GPU_CHUNK), order, host * workload.episodes
        row.variant = "Triton Sinkhorn loop" if fused_sinkhorn else ""
        rows.append(row)
    return rows


def markdown(rows: list[Row], measured: Mapping[str, float] | None = None, label: str = "CPU") -> str:
    """The cost table in Markdown: per method, what one episode moves and computes, the launches and
    host syncs of a chunk, the predicted seconds of 10,000 episodes per GPU, and beside them the
    measured episodes/s (``measured``, by method, on ``label``) and its 10,000-episode time."""
    gpus = list(rows[0].seconds) if rows else []
    head = ["method", "steps", "MB/step", "MB/episode", "GFLOP/episode", "FLOPs", "launches", "syncs"]
    head += [f"masked loops x at {GPU_CHUNK:,}", "host eigh s"]
    head += [f"{g} s" for g in gpus] + [f"{label} episodes/s", f"{label} s per 10k"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rate = None if r.variant else (measured or {}).get(r.method)
        name = f"{r.method} ({r.variant})" if r.variant else r.method
        cells = [name, str(r.steps), f"{r.bytes_per_step / 1e6:.3f}", f"{r.bytes / 1e6:.1f}"]
        cells += [f"{r.flops / 1e9:.3f}", f"{r.flops_source} (traced matmuls {r.traced_flops / 1e9:.3f})"]
        cells += [f"{r.launches:,}", f"{r.syncs:,}"]
        cells.append(f"{r.loop_scale:.2f} ({100 * r.loop_share:.0f}% of launches)" if r.loop_share else "-")
        cells.append(f"{r.host_s:.2f} ({r.eigh_order}^2)" if r.host_s else "-")
        cells += [f"{r.seconds[g]:.2f}" for g in gpus]
        cells += [f"{rate:,.1f}" if rate else "-", f"{1e4 / rate:,.1f}" if rate else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# the fits the Triton step runs: (method, options, rows n, classes K, n_support for logit losses)
def triton_cases(workload: Workload = STANDARD) -> list[tuple[str, int, int, int | None]]:
    """``(method, rows, classes, n_support or None)`` of each method the Triton step serves, on
    ``workload`` (POODLE transductive with its negatives, naive-OOD with its extra class)."""
    ns, nq, m, k = workload.n_support, workload.n_query, workload.n_neg, workload.way
    return [
        ("poodle", ns + nq + m, k, None),
        ("ce", ns, k, None),
        ("naive-ood", ns + m, k + 1, None),
        ("tim-gd", ns + nq, k, ns),
        ("alpha-tim", ns + nq, k, ns),
        ("entropy-min", ns + nq, k, ns),
    ]


def triton_markdown(rows: list[Row], workload: Workload = STANDARD, gpus: tuple[GPU, ...] = GPUS) -> str:
    """Bytes per step of the Triton step against the torch formulation's (traced, ``rows``), and its
    predicted seconds for ``workload.episodes`` episodes streaming the rows and with groups resident
    in L2, per GPU."""
    traced = {r.method: r for r in rows}
    head = ["method", "rows", "torch MB/step", "Triton MB/step", "torch/Triton"]
    head += [f"{g.name} s (stream / resident, group)" for g in gpus] + ["torch formulation, H100 SXM s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, n, k, ns in triton_cases(workload):
        r = traced.get(method)
        if r is None:
            continue
        tri = triton_step_bytes(n, workload.dim, k, ns, workload.itemsize)["dram"]
        cells = [method, str(n), f"{r.bytes_per_step / 1e6:.3f}", f"{tri / 1e6:.3f}", f"{r.bytes_per_step / tri:.2f}x"]
        for g in gpus:
            t = triton_seconds(n, workload.dim, k, r.steps, workload.episodes, g, ns, workload.itemsize)
            best = "stream" if t["stream"] <= t["resident"] else "resident"
            cells.append(f"{t['stream']:.2f} / {t['resident']:.2f} ({int(t['group'])}): {best}")
        cells.append(f"{r.seconds.get(H100_SXM.name, float('nan')):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "GPU",
    "GPUS",
    "H100_SXM",
    "H100_PCIE",
    "H200",
    "Workload",
    "STANDARD",
    "Trace",
    "Row",
    "row_bytes",
    "torch_step_bytes",
    "triton_step_bytes",
    "resident_group",
    "resident_plan",
    "device_gpu",
    "launch_plan",
    "triton_seconds",
    "chunks",
    "trace",
    "standard_batch",
    "method_flops",
    "method_steps",
    "predict",
    "expected_max",
    "iteration_counts",
    "loop_scale",
    "eigh_seconds",
    "host_seconds",
    "HOST_CORES",
    "table",
    "ITERATIVE",
    "markdown",
    "triton_cases",
    "triton_markdown",
]


def resident_plan(
    E: int, n: int, D: int, K: int, steps: int, n_support: int | None, gpu: GPU, itemsize: int = 4
) -> int | None:
    """Episodes per Triton step launch when :func:`triton_seconds` predicts that keeping a group's
    rows resident in L2 beats streaming them every step on ``gpu``, else ``None`` (one launch of
    all ``E``)."""
    t = triton_seconds(n, D, K, steps, E, gpu, n_support, itemsize)
    return int(t["group"]) if t["resident"] < t["stream"] and t["group"] < E else None


def device_gpu(device: torch.device) -> GPU:
    """This model's view of a CUDA device: its L2 and SMs; bandwidth and FP32 rate of an H100 SXM
    (only their ratio enters :func:`resident_plan`'s choice)."""
    p = torch.cuda.get_device_properties(device)
    ref = H100_SXM
    l2 = int(getattr(p, "L2_cache_size", 0) or ref.l2_bytes)
    return GPU(p.name, ref.bandwidth, ref.fp32, l2, int(p.multi_processor_count))


def launch_plan(
    E: int, n: int, D: int, K: int, steps: int, n_support: int | None, device: torch.device, itemsize: int
) -> int | None:
    """The Triton step's sizing a run's :class:`~poodle.solvers.backend.Backend` carries
    (``launch_plan``): :func:`resident_plan` on ``device``'s own L2 and SMs."""
    return resident_plan(E, n, D, K, steps, n_support, device_gpu(device), itemsize)
