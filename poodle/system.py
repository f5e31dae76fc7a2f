"""What a bug report needs to know about this installation (``poodle info --system``), and which
arithmetic produced a set of results records.

:func:`system_info` gathers, as plain values: the versions of poodle, Python, torch, numpy and h5py;
the BLAS libraries torch and numpy use; thread and worker counts; the devices; and the state of the
fused CPU kernel (its compiler, flags, directory, and whether it is loaded or why not; loading it
first if this process has not tried). :func:`formulations` sums up the ``formulation`` field of
records (which arithmetic each cell ran: the kernel, or the torch formulation and why).
"""

from __future__ import annotations

import math
import os
import platform
from typing import Any, Mapping, Sequence

import h5py
import numpy as np
import torch

from poodle import __version__


def blas() -> dict[str, str]:
    """torch's BLAS/LAPACK, oneDNN, OpenMP and CPU-capability lines, and numpy's BLAS, one line each."""
    keep = ("Math Kernel", "MKL-DNN", "OpenBLAS", "BLAS_INFO", "CPU capability", "OpenMP")
    lines = [ln.strip(" -") for ln in torch.__config__.show().splitlines() if any(k in ln for k in keep)]
    lines = [ln if "BLAS_INFO" not in ln else "BLAS_INFO=" + ln.split("BLAS_INFO=")[1].split(",")[0] for ln in lines]
    try:
        cfg = np.show_config(mode="dicts")
        found = cfg.get("Build Dependencies", {}).get("blas", {})
        np_blas = f"{found.get('name', '?')} {found.get('version', '')}".strip()
    except TypeError:  # numpy < 1.25 has no mode="dicts"
        np_blas = "unknown"
    return {"torch": "; ".join(lines), "numpy": np_blas}


def _cgroup_cpus(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU limit of this process's cgroup in cores (``cpu.max``, cgroup v2; ``cpu.cfs_quota_us``
    over ``cpu.cfs_period_us``, v1), or None when there is none or it cannot be read."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = f.read().strip()
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = f.read().strip()
        return None if int(quota) <= 0 else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """The cores this process may use: those it may run on (``os.sched_getaffinity``: taskset, a
    SLURM allocation) within its cgroup's CPU limit (a container's ``--cpus``, Kubernetes' limit),
    rounded up; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = _cgroup_cpus()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def default_workers(at_most: int) -> int:
    """Worker processes (DataLoader) or threads (solve) when none are asked for: one per usable core
    (:func:`usable_cpus`), shared among torchrun's processes on the node (``LOCAL_WORLD_SIZE``), at
    most ``at_most``. More would only contend for the same cores (torch warns about it)."""
    per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(at_most, usable_cpus() // per_node))


# at most this many DataLoader workers by default: decoding small images saturates well before
TRAIN_WORKERS = 4
EXTRACT_WORKERS = 8


def _threads() -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limit = _cgroup_cpus()
    out: dict[str, Any] = {
        "CPUs (machine / visible)": f"{os.cpu_count()} / {cpus}",
        "cgroup CPU limit": "none" if limit is None else f"{limit:g}",
        "usable CPUs": usable_cpus(),
        "torch intra-op threads": torch.get_num_threads(),
        "torch inter-op threads": torch.get_num_interop_threads(),
        # poodle.pipeline: CPU chunks solved at once, one thread each
        "solve workers (CPU, default)": solve_workers(),
        "train DataLoader workers (default)": default_workers(TRAIN_WORKERS),
        "extract DataLoader workers (default)": default_workers(EXTRACT_WORKERS),
    }
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var):
            out[var] = os.environ[var]
    return out


def solve_workers() -> int:
    """CPU chunks solved at once when none are asked for: torch's thread count, within the usable
    cores (torch counts the cores it may run on, not a cgroup's limit)."""
    return max(1, min(torch.get_num_threads(), usable_cpus()))


def _devices() -> dict[str, Any]:
    out: dict[str, Any] = {"CUDA available": torch.cuda.is_available(), "CUDA (torch built with)": torch.version.cuda}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out[f"cuda:{i}"] = f"{p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out["mps"] = True
    return out


def _kernel() -> dict[str, Any]:
    from poodle.solvers import _native  # imports the solvers' engine: only when asked about it

    st = _native.state()
    return {
        "state": "loaded" if st.loaded else f"not loaded: {st.reason}",
        "compiler": (f"{st.compiler} ({st.compiler_version})" if st.compiler_version else st.compiler) or "none",
        "flags": " ".join(st.flags) or "-",
        "directory": st.directory or "-",
        "library": st.library or "-",
        "source sha256": st.source_hash or "-",
        "interface": _native.FIT_INTERFACE,
        "POODLE_NATIVE": os.environ.get("POODLE_NATIVE", "(unset)"),
        "POODLE_NATIVE_DIR": os.environ.get("POODLE_NATIVE_DIR", "(unset)"),
    }


def system_info() -> dict[str, dict[str, Any]]:
    """``{section: {item: value}}``: versions, BLAS, threads and workers, devices, the fused kernel."""
    return {
        "versions": {
            "poodle": __version__,
            "python": f"{platform.python_version()} ({platform.python_implementation()})",
            "platform": platform.platform(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "h5py": f"{h5py.version.version} (HDF5 {h5py.version.hdf5_version})",
        },
        "BLAS": blas(),
        "threads and workers": _threads(),
        "devices": _devices(),
        "fused CPU kernel": _kernel(),
    }


def formulations(records: Sequence[Mapping[str, Any]], names: int = 6) -> str:
    """Which arithmetic produced ``records``, in one line: the labels of the records (or their
    count, beyond ``names``) before each ``formulation``, as ``poodle, ce: kernel 951d3560b313;
    proto: torch``; records written before the field existed count as ``not recorded``."""
    groups: dict[str, list[str]] = {}
    for r in records:
        groups.setdefault(str(r.get("formulation", "not recorded")), []).append(str(r.get("label", "?")))
    parts = []
    for what, labels in groups.items():
        shown = ", ".join(dict.fromkeys(labels)) if len(labels) <= names else f"{len(labels)} cells"
        parts.append(f"{shown}: {what}")
    return "; ".join(parts)


__all__ = [
    "EXTRACT_WORKERS",
    "TRAIN_WORKERS",
    "blas",
    "default_workers",
    "formulations",
    "solve_workers",
    "system_info",
    "usable_cpus",
]
