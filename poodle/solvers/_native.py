"""The fused CPU kernel of :func:`poodle.solvers._optim.fit` (``_fit_kernel.c``): the fits of the
weighted-distance loss (POODLE, CE, naive-OOD) and of the logit losses (TIM-GD, entropy
minimisation, alpha-TIM) and TIM-ADM's closed-form iterations, on fixed or ragged chunks (each
episode its own classes and rows), compiled at first use and loaded only from a directory no other account can write.

Why: on CPU the torch formulation of one Adam step is two batched matmuls with 5-row operands,
which BLAS runs at about a third of its large-GEMM rate, plus elementwise passes; the kernel reads
every row once per step and keeps the blocks in L1. It is plain C99 with GCC/Clang vector
extensions (no Python or torch headers), so compiling it takes about a second with the system's C
compiler.

Where the library comes from. It is built into ``$POODLE_NATIVE_DIR`` (default
``~/.cache/poodle/native``), keyed by the source, the compiler, its flags and the CPU, so a home
directory shared by several kinds of machines never loads a library built for another CPU. A
library is code that runs in this process, so:

- the directory is created private (0700), and before every load the directory and the library
  file must be owned by this user and writable by no one else; anything else is refused with one
  notice (:class:`poodle.events.NoticeWarning`) and the torch formulation runs;
- where the directory cannot be created (a read-only home), the library is built into a fresh
  private temporary directory of this process (removed at exit), never into a shared path whose
  name another account could guess and fill first;
- the library says its interface version and the hash of the source it was built from (compiled
  in); one that does not say what this module expects is rebuilt, never called;
- one call passes one struct (:class:`FitArgs`, ``struct poodle_fit_args`` in the C file), whose
  version and size the C side checks again.

Where no compiler is available (or ``POODLE_NATIVE=0``) the solvers run the torch formulation,
which computes the same thing: results agree to float rounding (the tests check both against the
same float64 references). :func:`state` says which and why (``poodle info --system``).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from poodle.events import Notice, NoticeWarning

if TYPE_CHECKING:
    from poodle.solvers._optim import FitOptions

_SOURCE = Path(__file__).with_name("_fit_kernel.c")
# POODLE_FIT_INTERFACE of the C file: bump both with any change of FitArgs or of a field's meaning
FIT_INTERFACE = 3
# the losses the kernel computes (the C file's LOSS_ constants)
LOSSES = {"weighted-distance": 0, "tim": 1, "entropy": 2, "alpha": 3, "adm": 4}
_FLAG_SETS = (
    ["-O3", "-fno-math-errno", "-march=native"],
    ["-O3", "-fno-math-errno", "-mcpu=native"],
    ["-O3", "-fno-math-errno"],
)
_DTYPES = {torch.float32: 0, torch.float64: 1}


class FitArgs(ctypes.Structure):
    """``struct poodle_fit_args`` of ``_fit_kernel.c``, field for field (sizes, strides in elements,
    pointers, hyper-parameters; see the C file for each field)."""

    _fields_ = [
        ("version", ctypes.c_int32),
        ("size", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("loss", ctypes.c_int32),
        ("E", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("D", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("n_support", ctypes.c_int32),
        ("steps", ctypes.c_int32),
        ("learn_scale", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("x_es", ctypes.c_int64),
        ("x_rs", ctypes.c_int64),
        ("t_es", ctypes.c_int64),
        ("t_ks", ctypes.c_int64),
        ("r_es", ctypes.c_int64),
        ("f_es", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("targets", ctypes.c_void_p),
        ("r", ctypes.c_void_p),
        ("free_", ctypes.c_void_p),
        ("c0", ctypes.c_void_p),
        ("W", ctypes.c_void_p),
        ("gamma", ctypes.c_void_p),
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weights", ctypes.c_double * 3),
        ("alpha", ctypes.c_double),
        ("ways", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("support_rows", ctypes.c_void_p),
        ("Q", ctypes.c_void_p),
    ]


@dataclass
class KernelTerms:
    """What the kernel needs of a loss besides the rows.

    Attributes:
        loss: a key of :data:`LOSSES`.
        targets: weighted distance: ``[E or 1, K, n]`` CE targets times each row's CE weight;
            logit losses: ``[E or 1, K, Ns]`` one-hot support labels.
        r: weighted distance: ``[E or 1, 1, n]`` each row's ``ce + coef``.
        free: weighted distance: ``[E or 1, 1, n]`` or ``None`` (see ``RowTerms.free``).
        c0: weighted distance: ``[E]``, the constant part of ``dL/dgamma``.
        n_support: logit losses: the support rows ``Ns``, first among the rows.
        weights: logit losses: the support CE weight and the query loss's one or two weights.
        alpha: ``"alpha"``: the alpha-entropy order.
    """

    loss: str
    targets: Tensor
    r: Tensor | None = None
    free: Tensor | None = None
    c0: Tensor | None = None
    n_support: int = 0
    weights: tuple[float, float, float] = (0.0, 0.0, 0.0)
    alpha: float = 0.0


@dataclass
class EpisodeSizes:
    """Each episode's own sizes in a ragged chunk, its real rows first among the rows of every
    array (``_optim`` packs them so): ``ways``, ``rows`` and, for a logit loss, ``support_rows``
    (its real support rows, first among its real rows), each ``[E]`` int or ``None`` where every
    episode has the chunk's ``K``, ``n`` or ``n_support``."""

    ways: Tensor | None = None
    rows: Tensor | None = None
    support_rows: Tensor | None = None


@dataclass
class KernelState:
    """Where the kernel stands in this process (:func:`state`).

    Attributes:
        loaded: whether the CPU fits run the kernel.
        reason: why not (empty when loaded).
        notice: the one notice given (empty for a deliberate ``POODLE_NATIVE=0``).
        compiler, compiler_version, flags: the build's.
        directory, library: where the library was looked for, built and loaded.
        source_hash: sha256 of ``_fit_kernel.c``, which the loaded library says it was built from.
    """

    loaded: bool = False
    reason: str = ""
    notice: str = ""
    compiler: str | None = None
    compiler_version: str = ""
    flags: tuple[str, ...] = ()
    directory: str | None = None
    library: str | None = None
    source_hash: str = ""


class _Refused(Exception):
    """A directory or library file another account could have written."""


class _Stale(Exception):
    """A library that does not say this module's interface and source (or does not load)."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_state: KernelState | None = None  # None: not tried yet in this process


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


def _not_private(path: Path, directory: bool) -> str | None:
    """Why ``path`` (a directory, or a library file) could hold what another account wrote, or ``None``."""
    st = os.stat(path) if directory else os.lstat(path)
    if directory and not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _check(path: Path, directory: bool) -> None:
    problem = _not_private(path, directory)
    if problem:
        raise _Refused(f"{'directory' if directory else 'library'} {path} is {problem}")


def _private_dir(st: KernelState) -> Path:
    """The library's directory, created private (0700); where it cannot be created, a fresh private
    temporary directory of this process, removed at exit. Raises :class:`_Refused` for an existing
    directory that is not private."""
    root = _cache_dir()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        root = Path(tempfile.mkdtemp(prefix="poodle-native-"))
        atexit.register(shutil.rmtree, root, True)
    st.directory = str(root)
    _check(root, directory=True)
    return root


def _compile(cc: str, flags: list[str], path: Path, source_hash: str, source: Path = _SOURCE) -> str | None:
    """Build the library of ``source`` at ``path``; the compiler's complaint when it fails."""
    # a unique temporary name renamed when complete: concurrent processes never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    define = f'-DPOODLE_KERNEL_SOURCE="{source_hash}"'
    cmd = [cc, *flags, define, "-fPIC", "-shared", "-o", tmp, str(source), "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        os.unlink(tmp)
        return f"{' '.join(cmd)}: {res.stderr.strip()[-300:]}"
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)
    return None


def _dlclose(lib: ctypes.CDLL) -> None:
    """Unload ``lib``, so that a rebuilt file at its path is loaded afresh (the dynamic loader hands
    back an already loaded library of the same name without reading the file)."""
    import _ctypes  # CPython's own module; dlclose exists on POSIX only

    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        close(lib._handle)


def _open(path: Path, source_hash: str) -> ctypes.CDLL:
    """Load the library at ``path`` after checking it and its directory are private; raises
    :class:`_Stale` when it does not say this module's interface and source."""
    _check(path.parent, directory=True)
    _check(path, directory=False)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise _Stale(f"it does not load ({e})") from None
    try:
        lib.poodle_kernel_interface.restype = ctypes.c_int
        lib.poodle_kernel_source.restype = ctypes.c_char_p
        interface, source = lib.poodle_kernel_interface(), (lib.poodle_kernel_source() or b"").decode()
    except AttributeError:
        interface, source = -1, ""
    if interface != FIT_INTERFACE or source != source_hash:
        _dlclose(lib)
        raise _Stale(f"it says interface {interface} and source {source[:12] or '?'}")
    lib.poodle_fit.restype = ctypes.c_int
    lib.poodle_fit.argtypes = [ctypes.POINTER(FitArgs)]
    return lib


def _build(cc: str, st: KernelState) -> ctypes.CDLL:
    """Load the library of the first flag set the compiler accepts, building it if needed (once
    more if the file found does not say this source and interface)."""
    source = _SOURCE.read_bytes()
    st.source_hash = hashlib.sha256(source).hexdigest()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    st.compiler_version = (version.strip().splitlines() or [""])[0]
    directory = _private_dir(st)
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(), _cpu_identity().encode()]))
        path = directory / f"fit_kernel-{key.hexdigest()[:16]}.so"
        st.flags, st.library = tuple(flags), str(path)
        built = not os.path.lexists(path)
        if built and (err := _compile(cc, flags, path, st.source_hash)):
            errors.append(err)
            continue
        try:
            return _open(path, st.source_hash)
        except _Stale as e:
            if built:
                raise RuntimeError(f"{path} was just built but {e}") from None
        _check(path, directory=False)  # only a file of ours is replaced
        path.unlink(missing_ok=True)  # (another process may have replaced it already)
        if err := _compile(cc, flags, path, st.source_hash):
            errors.append(err)
            continue
        try:
            return _open(path, st.source_hash)
        except _Stale as e:
            raise RuntimeError(f"{path} was rebuilt but {e}") from None
    raise RuntimeError("; ".join(errors))


def _load() -> tuple[ctypes.CDLL | None, KernelState]:
    st = KernelState()
    if os.environ.get("POODLE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        st.reason = "disabled by POODLE_NATIVE=0"
        return None, st
    st.compiler = _compiler()
    fallback = "the CPU solvers run their torch formulation (same results to float rounding, slower)"
    if st.compiler is None:
        st.reason = "no C compiler (cc, gcc or clang) on PATH"
        st.notice = f"{st.reason}; {fallback}. Install a C compiler to get the fused kernel."
        return None, st
    try:
        lib = _build(st.compiler, st)
    except _Refused as e:
        st.reason = f"not loaded: {e}"
        st.notice = (
            f"the fused kernel is {st.reason}; {fallback}. Make it private (chmod go-w, owned by you) "
            "or set POODLE_NATIVE_DIR to a private directory."
        )
        return None, st
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        st.reason = f"the fused kernel did not build: {e}"
        st.notice = f"{st.reason}; {fallback}."
        return None, st
    st.loaded = True
    return lib, st


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` (with one :class:`~poodle.events.NoticeWarning` per process,
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
    """Where the kernel stands (loading it first if this process has not tried yet)."""
    load()
    assert _state is not None
    return _state


def status() -> str:
    """One line for benchmarks: which formulation the CPU solvers run."""
    st = state()
    return "fused C kernel" if st.loaded else f"torch formulation ({st.reason})"


def formulation() -> str:
    """The CPU fits' arithmetic, as records say it: ``kernel <source hash>`` or ``torch (<why>)``."""
    st = state()
    return f"kernel {st.source_hash[:12]}" if st.loaded else f"torch ({st.reason})"


def usable(x: Tensor) -> bool:
    """Whether the kernel can fit rows ``x``: a CPU float32/float64 tensor and a loadable library."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and load() is not None


def _rows(t: Tensor, *shape: int) -> Tensor:
    """``t`` broadcast to ``shape`` with a contiguous last axis (a shared leading axis keeps stride 0)."""
    t = t.expand(*shape)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _stride(t: Tensor | None, dim: int) -> int:
    return 0 if t is None or t.shape[dim] == 1 else t.stride(dim)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _sizes(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.to(device="cpu", dtype=torch.int32).contiguous()


def fit_adm(
    x: Tensor, w0: Tensor, terms: KernelTerms, opts: FitOptions, sizes: EpisodeSizes | None = None
) -> tuple[Tensor, Tensor]:
    """TIM-ADM's closed-form iterations (``terms.loss == "adm"``, ``opts.steps >= 1``; see
    ``tim_adm.py``) -> ``(W [E, K, D], Q [E, K, n - n_support])``, ``Q`` the last assignments, each
    episode's real queries first."""
    E, n, _ = x.shape
    Q = torch.zeros(E, w0.shape[1], n - terms.n_support, dtype=x.dtype)
    W, _ = fit(x, w0, terms, opts, sizes, Q)
    return W, Q


def fit(
    x: Tensor,
    w0: Tensor,
    terms: KernelTerms,
    opts: FitOptions,
    sizes: EpisodeSizes | None = None,
    Q: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Fit ``E`` episodes with the kernel: rows ``x [E, n, D]``, initial prototypes ``w0 [E, K, D]``
    and scale ``opts.scale0``, the loss ``terms``, each episode's own ``sizes`` in a ragged chunk
    (its real rows first) -> ``(W [E, K, D], gamma [E, 1, 1])``; a padded class's prototype is
    ``w0``'s."""
    lib = load()
    assert lib is not None
    E, n, D = x.shape
    K, dt = w0.shape[1], x.dtype
    xs = x if x.stride(-1) == 1 else x.contiguous()
    W = w0.to(dt).contiguous().clone()
    gamma = torch.full((E,), float(opts.scale0), dtype=dt)
    wd = terms.loss == "weighted-distance"
    t = _rows(terms.targets.to(dt), E, K, n if wd else terms.n_support)
    r = _rows(terms.r.to(dt), E, 1, n) if wd and terms.r is not None else None
    f = _rows(terms.free.to(dt), E, 1, n) if wd and terms.free is not None else None
    c0 = terms.c0.to(dt).contiguous() if wd and terms.c0 is not None else None
    sz = sizes or EpisodeSizes()
    ways, rows, support_rows = _sizes(sz.ways), _sizes(sz.rows), _sizes(sz.support_rows)
    args = FitArgs(
        version=FIT_INTERFACE,
        size=ctypes.sizeof(FitArgs),
        dtype=_DTYPES[dt],
        loss=LOSSES[terms.loss],
        E=E,
        n=n,
        D=D,
        K=K,
        n_support=terms.n_support,
        steps=opts.steps,
        learn_scale=int(opts.learn_scale),
        x_es=_stride(xs, 0),
        x_rs=xs.stride(1),
        t_es=_stride(t, 0),
        t_ks=t.stride(1),
        r_es=_stride(r, 0),
        f_es=_stride(f, 0),
        x=_ptr(xs),
        targets=_ptr(t),
        r=_ptr(r),
        free_=_ptr(f),
        c0=_ptr(c0),
        W=_ptr(W),
        gamma=_ptr(gamma),
        lr=opts.lr,
        beta1=opts.betas[0],
        beta2=opts.betas[1],
        eps=opts.eps,
        weights=(ctypes.c_double * 3)(*terms.weights),
        alpha=terms.alpha,
        ways=_ptr(ways),
        rows=_ptr(rows),
        support_rows=_ptr(support_rows),
        Q=_ptr(Q),
    )
    rc = lib.poodle_fit(ctypes.byref(args))
    if rc == -1:
        raise MemoryError(f"the fused solver kernel could not allocate its buffers for {E} episodes of {n} x {D}")
    if rc == -4:
        raise ValueError(
            f"an episode's sizes are outside its chunk's ({K} classes, {n} rows, {terms.n_support} support)"
        )
    if rc != 0:
        raise RuntimeError(f"the fused solver kernel refused its arguments (code {rc})")
    return W, gamma.view(E, 1, 1)


__all__ = [
    "FIT_INTERFACE",
    "EpisodeSizes",
    "FitArgs",
    "KernelState",
    "KernelTerms",
    "LOSSES",
    "fit",
    "fit_adm",
    "formulation",
    "load",
    "state",
    "status",
    "usable",
]
