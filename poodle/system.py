"""What a bug report needs to know about this installation (``poodle info --system``), and which
arithmetic produced a set of results records.

:func:`system_info` gathers, as plain values: the versions of poodle, Python, torch, numpy and h5py;
the BLAS libraries torch and numpy use; thread and worker counts; the devices; and the state of the
fused CPU kernel (its compiler, flags, directory, and whether it is loaded or why not; loading it
first if this process has not tried). :func:`formulations` sums up the ``formulation`` field of
records (which arithmetic each cell ran: the kernel, or the torch formulation and why).
"""

from __future__ import annotations

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


def _threads() -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out: dict[str, Any] = {
        "CPUs (machine / visible)": f"{os.cpu_count()} / {cpus}",
        "torch intra-op threads": torch.get_num_threads(),
        "torch inter-op threads": torch.get_num_interop_threads(),
        # poodle.evaluate.plan_chunks: CPU chunks solved at once, one thread each
        "solve workers (CPU, default)": torch.get_num_threads(),
    }
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var):
            out[var] = os.environ[var]
    return out


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


__all__ = ["blas", "formulations", "system_info"]
