"""The fused CPU kernels of :func:`poodle.solvers._optim.fit_weighted_distance` and of the logit
losses of :func:`poodle.solvers._optim.fit_logit_loss` (TIM-GD, entropy minimisation), compiled at
first use.

Why: on CPU the torch formulation of one Adam step is two batched matmuls with 5-row operands,
which BLAS runs at about a third of its large-GEMM rate, plus elementwise passes; the kernel in
``_wd_kernel.c`` reads every row once per step and keeps the blocks in L1. It is plain C99 with
GCC/Clang vector extensions (no Python or torch headers), so compiling it takes about a second with
the system's C compiler; the shared library is cached under ``$POODLE_NATIVE_DIR`` (default
``~/.cache/poodle/native``), keyed by the source, the compiler, its flags and the CPU, so a home
directory shared by several kinds of machines never loads a library built for another CPU.

Where no compiler is available (or ``POODLE_NATIVE=0``) the solvers run the torch formulation, which
computes the same thing: results agree to float rounding (the tests check both against the same
float64 references). One notice says so, once per process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = Path(__file__).with_name("_wd_kernel.c")
_FLAG_SETS = (
    ["-O3", "-fno-math-errno", "-march=native"],
    ["-O3", "-fno-math-errno", "-mcpu=native"],
    ["-O3", "-fno-math-errno"],
)
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_reason = ""


def _cpu_identity() -> str:
    """What the compiled code depends on: the CPU model and its feature flags where the OS says."""
    info = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    info += line
                if line.strip() == "":
                    break  # the first processor describes them all
    except OSError:
        pass
    return info


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    root = os.environ.get("POODLE_NATIVE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "poodle" / "native"


def _build(cc: str) -> ctypes.CDLL:
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(), _cpu_identity().encode()]))
        out_dir = _cache_dir()
        lib_path = out_dir / f"wd_kernel-{key.hexdigest()[:16]}.so"
        if not lib_path.exists():
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError:
                out_dir = Path(tempfile.gettempdir()) / f"poodle-native-{os.getuid() if hasattr(os, 'getuid') else 0}"
                out_dir.mkdir(parents=True, exist_ok=True)
                lib_path = out_dir / lib_path.name
            # a unique temporary name renamed when complete: concurrent processes never load half a file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
            os.close(fd)
            cmd = [cc, *flags, "-fPIC", "-shared", "-o", tmp, str(_SOURCE), "-lm"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{' '.join(cmd)}: {res.stderr.strip()[-300:]}")
                continue
            os.replace(tmp, lib_path)
        lib = ctypes.CDLL(str(lib_path))
        for suffix, real in (("_f32", ctypes.c_void_p), ("_f64", ctypes.c_void_p)):
            fn = getattr(lib, "wd_fit" + suffix)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int] * 4 + [
                real,
                real,
                ctypes.c_long,
                real,
                ctypes.c_long,
                real,
                ctypes.c_long,
                real,
                real,
                real,
                ctypes.c_int,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_int,
            ]
            fn = getattr(lib, "lf_fit" + suffix)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int] * 5 + [real] * 4 + [ctypes.c_int] + [ctypes.c_double] * 4
            fn.argtypes += [ctypes.c_int, ctypes.c_int] + [ctypes.c_double] * 3
        return lib
    raise RuntimeError("; ".join(errors))


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` (with one notice on stderr) where it cannot be had."""
    global _lib, _tried, _reason
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("POODLE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            _reason = "disabled by POODLE_NATIVE=0"
        elif (cc := _compiler()) is None:
            _reason = "no C compiler (cc, gcc or clang) on PATH"
            print(
                f"poodle: {_reason}; the CPU solvers run their torch formulation (same results to float "
                "rounding, about 2x slower). Install a C compiler to get the fused kernel.",
                file=sys.stderr,
            )
        else:
            try:
                _lib = _build(cc)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _reason = f"the fused kernel did not build: {e}"
                print(f"poodle: {_reason}; the CPU solvers run their torch formulation.", file=sys.stderr)
        _tried = True
    return _lib


def status() -> str:
    """One line for benchmarks and ``--version``-style reports: which formulation the CPU solvers run."""
    lib = load()
    return "fused C kernel" if lib is not None else f"torch formulation ({_reason})"


def usable(x: Tensor) -> bool:
    """Whether the kernel can fit rows ``x``: a CPU float32/float64 tensor and a loadable library."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and load() is not None


def _buffers(x: Tensor, w0: Tensor, scale0: float) -> tuple[ctypes.CDLL, Tensor, Tensor, Tensor]:
    """The library, the contiguous rows, and the fitted outputs' buffers holding their start values:
    ``W [E, K, D]`` (a copy of ``w0`` in ``x``'s dtype) and ``gamma [E]``."""
    lib = load()
    assert lib is not None
    W = w0.to(x.dtype).contiguous().clone()
    return lib, x.contiguous(), W, torch.full((x.shape[0],), float(scale0), dtype=x.dtype)


def _result(rc: int, W: Tensor, gamma: Tensor, n: int, D: int) -> tuple[Tensor, Tensor]:
    """The outputs of a kernel call that returned ``rc``: ``(W [E, K, D], gamma [E, 1, 1])``."""
    E = W.shape[0]
    if rc != 0:
        raise MemoryError(f"the fused solver kernel could not allocate its buffers for {E} episodes of {n} x {D}")
    return W, gamma.view(E, 1, 1)


def fit(
    x: Tensor,
    targets: Tensor,
    r: Tensor,
    free: Tensor | None,
    c0: Tensor,
    w0: Tensor,
    scale0: float,
    steps: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    learn_scale: bool,
) -> tuple[Tensor, Tensor]:
    """Run the kernel. ``x [E, n, D]``, ``targets [E, K, n]``, ``r``/``free`` ``[E, 1, n]``,
    ``c0 [E]``, ``w0 [E, K, D]`` -> ``(W [E, K, D], gamma [E, 1, 1])``."""
    lib, xs, W, gamma = _buffers(x, w0, scale0)
    E, n, D = x.shape
    K = w0.shape[1]
    dt = x.dtype
    ts = targets.to(dt).expand(E, K, n).contiguous()
    rs = r.to(dt).expand(E, 1, n).contiguous()
    fs = None if free is None else free.to(dt).expand(E, 1, n).contiguous()
    cs = c0.to(dt).contiguous()
    fn = lib.wd_fit_f32 if dt == torch.float32 else lib.wd_fit_f64
    rc = fn(
        E,
        n,
        D,
        K,
        xs.data_ptr(),
        ts.data_ptr(),
        K * n,
        rs.data_ptr(),
        n,
        None if fs is None else fs.data_ptr(),
        n,
        cs.data_ptr(),
        W.data_ptr(),
        gamma.data_ptr(),
        steps,
        lr,
        betas[0],
        betas[1],
        eps,
        int(learn_scale),
    )
    return _result(rc, W, gamma, n, D)


# the query losses lf_fit knows (its ``loss`` argument)
LOGIT_LOSSES = {"tim": 0, "entropy": 1}


def fit_logits(
    x: Tensor,
    n_support: int,
    targets: Tensor,
    loss: str,
    weights: tuple[float, float, float],
    w0: Tensor,
    scale0: float,
    steps: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    learn_scale: bool,
) -> tuple[Tensor, Tensor]:
    """Run the logit-loss kernel. ``x [E, n, D]`` (the ``n_support`` support rows first),
    ``targets [E, K, n_support]`` one-hot, ``w0 [E, K, D]`` -> ``(W [E, K, D], gamma [E, 1, 1])``.
    ``loss`` is a key of :data:`LOGIT_LOSSES`; ``weights`` are the CE weight and the query loss's
    one or two weights (see ``lf_fit`` in ``_wd_kernel.c``)."""
    lib, xs, W, gamma = _buffers(x, w0, scale0)
    E, n, D = x.shape
    K = w0.shape[1]
    dt = x.dtype
    ts = targets.to(dt).expand(E, K, n_support).contiguous()
    fn = lib.lf_fit_f32 if dt == torch.float32 else lib.lf_fit_f64
    rc = fn(
        E,
        n_support,
        n,
        D,
        K,
        xs.data_ptr(),
        ts.data_ptr(),
        W.data_ptr(),
        gamma.data_ptr(),
        steps,
        lr,
        betas[0],
        betas[1],
        eps,
        int(learn_scale),
        LOGIT_LOSSES[loss],
        *weights,
    )
    return _result(rc, W, gamma, n, D)


__all__ = ["load", "status", "usable", "fit", "fit_logits", "LOGIT_LOSSES"]
