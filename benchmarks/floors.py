"""Each method's own floor, from what it computes per episode (its :class:`poodle.solvers.base.Floor`
facts and registered FLOPs), timed in the same run by micro-benchmarks that are not the method's code:

* ``matmul``: its FLOPs (less the decomposition's; a declared Gram matrix at the rate of its own
  shape) at the rate of a batched float32 matmul of its
  shape class (``[C, rows, depth] @ [C, depth, columns]``, the chunk's episodes at once, the better
  of the two layouts: the narrow products these methods make, far below a square matmul's rate), or,
  for the methods the fused kernel runs (declared ``matmul="large"``), at a large square matmul's;
* ``eigh``: LAPACK's ``eigh`` of its matrix (order and precision as declared), one matrix at a time
  on one thread, as the solvers call it on the CPU;
* ``sweeps``: its Sinkhorn sweeps (measured per episode, or the declared fixed count) at the time of
  one sweep of a plain C loop over an L1-resident ``[way, columns]`` plan (compiled here at run time
  with the system compiler; no torch, no dispatch);
* ``memory``: one pass over its input rows (``(Ns + Nq + M) x D`` floats) at the bandwidth of an
  in-place pass over the chunk's features.

The compute parts add up (on one thread they run one after another: each consumes the last one's
result); the memory pass bounds them from below but does not add (the rows stream through the cache
while the products use them). So a method's floor per episode is ``max(memory, matmul + eigh +
sweeps)``, and the part that binds is the largest of the four.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from poodle import solvers
from poodle.solvers.base import eigh_flops

# a plain C loop of ``n`` Sinkhorn sweeps on one plan p [K][N] (row-major), as the solvers sweep:
# balance: samples (columns) to 1, then classes (rows) to ``mass``; min-size: samples to 1, then
# the classes whose mass is under ``mass`` scaled up to it. Plain C99, no intrinsics: what any
# compiler makes of the textbook loop.
_SOURCE = r"""
#include <stddef.h>
static void cols_to_one(float *p, int K, int N, float *s) {
    for (int j = 0; j < N; j++) s[j] = 0.0f;
    for (int k = 0; k < K; k++) for (int j = 0; j < N; j++) s[j] += p[(size_t)k * N + j];
    for (int j = 0; j < N; j++) s[j] = 1.0f / s[j];
    for (int k = 0; k < K; k++) for (int j = 0; j < N; j++) p[(size_t)k * N + j] *= s[j];
}
static float row_sum(const float *r, int N) {
    float t = 0.0f;
    for (int j = 0; j < N; j++) t += r[j];
    return t;
}
void balance_sweeps(float *p, int K, int N, float mass, int n, float *s) {
    for (int it = 0; it < n; it++) {
        cols_to_one(p, K, N, s);
        for (int k = 0; k < K; k++) {
            float f = mass / row_sum(p + (size_t)k * N, N);
            for (int j = 0; j < N; j++) p[(size_t)k * N + j] *= f;
        }
    }
}
void min_size_sweeps(float *p, int K, int N, float mass, int n, float *s) {
    for (int it = 0; it < n; it++) {
        cols_to_one(p, K, N, s);
        for (int k = 0; k < K; k++) {
            float m = row_sum(p + (size_t)k * N, N);
            if (m < mass) {
                float f = mass / m;
                for (int j = 0; j < N; j++) p[(size_t)k * N + j] *= f;
            }
        }
    }
}
"""

_LIB: list[Any] = []


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def sweep_library() -> Any | None:
    """The compiled sweep loops (ctypes), built once per process in a private temporary folder;
    None without a compiler (the sweep floor is then left out and said so)."""
    if _LIB:
        return _LIB[0]
    cc, lib = _compiler(), None
    if cc is not None:
        folder = Path(tempfile.mkdtemp(prefix="poodle-floors-"))
        src, out = folder / "sweeps.c", folder / "sweeps.so"
        src.write_text(_SOURCE)
        try:
            for flags in (["-O3", "-march=native"], ["-O3"]):
                done = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(out), str(src)], capture_output=True)
                if done.returncode == 0:
                    lib = ctypes.CDLL(str(out))
                    break
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # a loaded library stays mapped
    _LIB.append(lib)
    return lib


def sweep_seconds(kind: str, way: int, columns: int, best: Callable[..., float], sweeps: int = 2000) -> float:
    """Seconds of one Sinkhorn sweep (``kind``: ``"balance"`` or ``"min-size"``) of the plain C
    loop on one ``[way, columns]`` float32 plan that stays in L1, or NaN without a compiler.
    ``best(fn)``: the caller's timer (seconds per call)."""
    lib = sweep_library()
    if lib is None:
        return float("nan")
    fn = lib.balance_sweeps if kind == "balance" else lib.min_size_sweeps
    p = torch.rand(way, columns, generator=torch.Generator().manual_seed(0)).add_(0.5)
    s = torch.empty(columns)
    # balance: classes take the columns' share; min-size: a floor a third of it (some classes scale)
    mass = ctypes.c_float(columns / way if kind == "balance" else columns / (3 * way))
    args = (ctypes.c_void_p(p.data_ptr()), way, columns, mass, sweeps, ctypes.c_void_p(s.data_ptr()))
    return best(lambda: fn(*args)) / sweeps


def matmul_rate(shape: tuple[int, int, int], chunk: int, best: Callable[..., float]) -> float:
    """FLOP/s of a batched float32 matmul ``[chunk, rows, depth] @ [chunk, depth, columns]``: the
    better of its two layouts (rows first, and classes first: ``[chunk, columns, depth] @ [chunk,
    depth, rows]``; with 5 columns the second runs about 3x faster on MKL), the same arithmetic."""
    n, d, k = shape
    a, b = torch.randn(chunk, n, d), torch.randn(chunk, d, k)
    bt, at = b.transpose(1, 2).contiguous(), a.transpose(1, 2)
    seconds = min(best(lambda: torch.bmm(a, b)), best(lambda: torch.bmm(bt, at)))
    return 2.0 * chunk * n * d * k / seconds


def eigh_seconds(order: int, dtype: str, best: Callable[..., float], batch: int = 8) -> float:
    """Seconds of LAPACK's ``eigh`` (with eigenvectors) of one ``order x order`` symmetric matrix
    of ``dtype``, one matrix after another on this thread."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, order, 2 * order, generator=g, dtype=getattr(torch, dtype))
    mats = [m @ m.T for m in x]  # well-conditioned, distinct eigenvalues: LAPACK's usual case

    def run() -> None:
        for m in mats:
            torch.linalg.eigh(m)

    return best(run) / batch


class Calibration:
    """The micro-benchmarks of one run, each measured once per size (``best(fn)``: seconds per call
    of ``fn`` on the run's clock)."""

    def __init__(self, best: Callable[..., float], chunk: int, bandwidth: float, large: float) -> None:
        self.best, self.chunk, self.bandwidth, self.large = best, chunk, bandwidth, large
        self._cache: dict[tuple, float] = {}

    def _get(self, key: tuple, make: Callable[[], float]) -> float:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def matmul(self, shape: tuple[int, int, int]) -> float:
        return self._get(("mm", shape), lambda: matmul_rate(shape, self.chunk, self.best))

    def eigh(self, order: int, dtype: str) -> float:
        return self._get(("eigh", order, dtype), lambda: eigh_seconds(order, dtype, self.best))

    def sweep(self, kind: str, way: int, columns: int) -> float:
        return self._get(("sweep", kind, way, columns), lambda: sweep_seconds(kind, way, columns, self.best))

    def facts(self) -> dict[str, float]:
        """Every measurement, by a readable key (for the JSON report)."""
        return {"/".join(map(str, k)): v for k, v in self._cache.items()}


def method_floor(
    name: str,
    cfg: Any,
    shape: tuple[int, int, int, int, int],
    flops: float,
    cal: Calibration,
    sweeps: float | None = None,
) -> dict[str, Any]:
    """The floor of ``name`` per episode (module docstring): ``shape = (Ns, Nq, M, D, way)``,
    ``flops`` the FLOPs its code computes per episode (registered count, at the measured iterations),
    ``sweeps`` its measured Sinkhorn sweeps per episode (a declared fixed count takes precedence). Returns the
    parts in microseconds (``parts``: matmul, eigh, sweeps, memory; absent parts are 0), ``floor_us``,
    ``binds`` (the largest part) and the facts they came from."""
    Ns, Nq, M, D, way = shape
    f = solvers.get(name).floor
    order = f.eigh_order(*shape, cfg)
    dec_flops = eigh_flops(order) if order else 0.0
    product = f.product_shape(*shape, cfg)
    mm_rate = cal.large if f.matmul == "large" else cal.matmul(product)
    gram = f.gram_shape(*shape, cfg)
    gram_flops = 2.0 * gram[0] ** 2 * gram[1] if gram else 0.0
    rest = max(flops - dec_flops - gram_flops, 0.0)
    matmul_us = 1e6 * rest / mm_rate + (1e6 * gram_flops / cal.matmul((gram[0], gram[1], gram[0])) if gram else 0.0)
    parts = {"matmul": matmul_us, "eigh": 0.0, "sweeps": 0.0}
    if order:
        parts["eigh"] = 1e6 * cal.eigh(order, f.eigh_dtype)
    plan = f.plan(Ns, Nq, way)
    n_sweeps = None
    if plan is not None:
        n_sweeps = f.sweeps(cfg) if f.sweeps else sweeps  # a fixed count is the count
        if n_sweeps is not None:
            one = cal.sweep(f.sweep or "balance", *plan)
            parts["sweeps"] = 1e6 * n_sweeps * one if math.isfinite(one) else 0.0
    parts["memory"] = 1e6 * 4.0 * (Ns + Nq + M) * D / cal.bandwidth
    compute = parts["matmul"] + parts["eigh"] + parts["sweeps"]
    return {
        "parts": parts,
        "floor_us": max(parts["memory"], compute),
        "binds": max(parts, key=lambda k: parts[k]),
        "product": product,
        "matmul_class": f.matmul,
        "gram": gram,
        "product_rate": mm_rate,
        "eigh_order": order,
        "plan": plan,
        "sweeps": n_sweeps,
    }


def describe(fl: dict[str, Any]) -> str:
    """One line: the parts of a floor and which binds (per episode)."""
    p = fl["parts"]
    shape = "large" if fl["matmul_class"] == "large" else "x".join(map(str, fl["product"]))
    gram = f"; Gram {'x'.join(map(str, fl['gram']))}" if fl.get("gram") else ""
    bits = [f"matmul {p['matmul']:.0f} us ({shape} at {fl['product_rate'] / 1e9:.1f} GFLOP/s{gram})"]
    if fl["eigh_order"]:
        bits.append(f"eigh {p['eigh']:.0f} us ({fl['eigh_order']}^2)")
    if fl["plan"] is not None and fl["sweeps"] is not None:
        bits.append(f"sweeps {p['sweeps']:.0f} us ({fl['sweeps']:.0f} x {'x'.join(map(str, fl['plan']))} plan)")
    bits.append(f"memory {p['memory']:.0f} us")
    return "; ".join(bits) + f"; binds: {fl['binds']}"
