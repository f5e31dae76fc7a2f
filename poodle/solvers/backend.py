"""Which arithmetic runs, as a value: :class:`Backend`.

A run chooses once (``poodle.evaluate`` makes one from its :class:`~poodle.run.RunOptions`; a
library caller of :func:`poodle.solvers.run` gets :func:`default`) whether CPU fits and Sinkhorn
loops take the fused C kernels, which step CUDA fits take (torch or Triton), which loop CUDA
Sinkhorn plans take, and whether CPU loops check convergence on a GPU's schedule (what the cost
model traces). :func:`poodle.solvers.run` hands its backend to the method it calls for the length
of the call (:func:`active`, a context variable: each thread and each call sees its own, nothing is
process-wide), and the engines (``_optim``, ``_sinkhorn_native``, ``_triton_sinkhorn``,
``_transductive``) read it with :func:`current`. Each engine reports what it ran into the same
object's :class:`Report`, which the records' ``formulation`` is read from
(:meth:`Backend.formulation`).

The environment sets the defaults only: ``POODLE_CUDA_SINKHORN`` (``torch`` or ``triton``) the
CUDA Sinkhorn loop; ``POODLE_NATIVE=0`` keeps the C kernels from loading (``_native.state``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from poodle.errors import ConfigError

if TYPE_CHECKING:  # the registry's types (a name only: nothing here reads the registry)
    from poodle.solvers.base import EpisodeBatch, SolverInfo, SolverOutput

# the choices (``poodle.defaults`` holds the same for RunOptions: a test keeps them equal); this
# module imports nothing of the library above it
CUDA_STEPS = ("torch", "triton")
SINKHORN_LOOPS = ("torch", "triton")

# (E, n, D, K, steps, n_support or None, device, itemsize) -> episodes per Triton launch, or None
LaunchPlan = Callable[[int, int, int, int, int, "int | None", torch.device, int], "int | None"]


class Report:
    """What each method's arithmetic was on each kind of device, as the engines say it
    (``kernel <hash>``, ``torch (<why>)``, ``triton``, ``triton sinkhorn``...). Thread-safe: the
    chunks of a run may be solved in worker threads."""

    def __init__(self) -> None:
        self._ran: dict[tuple[str | None, str], str] = {}
        self._lock = threading.Lock()

    def record(self, method: str | None, device: torch.device | str, what: str) -> None:
        with self._lock:
            self._ran[(method, torch.device(device).type)] = what

    def get(self, method: str, device: torch.device | str) -> str:
        """What ``method`` ran on ``device``'s kind; ``torch`` where no engine reported."""
        with self._lock:
            return self._ran.get((method, torch.device(device).type), "torch")


def _env_sinkhorn() -> str:
    return os.environ.get("POODLE_CUDA_SINKHORN", "triton").strip().lower() or "triton"


def check_cuda_step(name: str) -> None:
    """ConfigError unless ``name`` is one of :data:`CUDA_STEPS`."""
    if name not in CUDA_STEPS:
        raise ConfigError(
            f"cuda_step must be one of {', '.join(CUDA_STEPS)}, not {name!r}",
            param="cuda_step",
            value=name,
            reason=f"must be one of {', '.join(CUDA_STEPS)}",
        )


def check_sinkhorn(name: str, param: str = "cuda_sinkhorn") -> None:
    """ConfigError unless ``name`` is one of :data:`SINKHORN_LOOPS`."""
    if name not in SINKHORN_LOOPS:
        what = "POODLE_CUDA_SINKHORN" if param == "POODLE_CUDA_SINKHORN" else "the CUDA Sinkhorn loop"
        raise ConfigError(
            f"{what} must be one of {', '.join(SINKHORN_LOOPS)}, not {name!r}",
            param=param,
            value=name,
            reason=f"must be one of {', '.join(SINKHORN_LOOPS)}",
        )


@dataclass(frozen=True)
class Backend:
    """Which arithmetic a run's solvers take; made once per run and passed down.

    Attributes:
        native: whether CPU fits and Sinkhorn loops may use the fused C kernels (where they load).
        cuda_step: the fine-tuning fits' step on CUDA, ``"torch"`` or ``"triton"`` (for the methods
            registered with ``triton_step=True``; other fits and a machine without Triton run torch).
        cuda_sinkhorn: the Sinkhorn loop of CUDA plans, ``"triton"`` or ``"torch"``.
        device_schedule: CPU loops check convergence (and take every sync-free branch) as a GPU
            does: what the cost model traces and what tests compare with the CPU's own schedule.
        step_devices: the device kinds the Triton step serves (others than CUDA need Triton's
            interpreter: the tests).
        sinkhorn_devices: the device kinds the Triton Sinkhorn loop serves.
        launch_plan: how many episodes one Triton step launch takes (``None``: all in one), given by
            the layer above (``poodle.costmodel.resident_plan``), so the step imports no cost model.
        report: what ran (:meth:`formulation`); shared by the copies :meth:`with_` makes.
    """

    native: bool = True
    cuda_step: str = "torch"
    cuda_sinkhorn: str = field(default_factory=_env_sinkhorn)
    device_schedule: bool = False
    step_devices: tuple[str, ...] = ("cuda",)
    sinkhorn_devices: tuple[str, ...] = ("cuda",)
    launch_plan: LaunchPlan | None = field(default=None, compare=False, repr=False)
    report: Report = field(default_factory=Report, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_cuda_step(self.cuda_step)
        # a value from the environment is named as such in the error
        check_sinkhorn(
            self.cuda_sinkhorn, "POODLE_CUDA_SINKHORN" if self.cuda_sinkhorn == _env_sinkhorn() else "cuda_sinkhorn"
        )

    def solve(self, info: SolverInfo, batch: EpisodeBatch, config: Any) -> SolverOutput:
        """The method ``info`` (a registry entry) on ``batch`` with ``config`` as given, under this
        backend: nothing looked up or checked (:func:`poodle.solvers.call`'s caller did that once);
        the method's engines take this backend's arithmetic and report what ran under its name."""
        with active(self, info.name):
            return info.fn(batch, config)

    def with_(self, **changes: object) -> Backend:
        """A copy with ``changes``, reporting into the same :class:`Report`."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def formulation(self, method: str, device: torch.device | str) -> str:
        """The arithmetic ``method`` ran under this backend on ``device``'s kind: ``kernel <source
        hash>`` (the fused CPU kernel), ``torch (<why not the kernel>)`` on CPU, ``triton`` or
        ``torch`` on a GPU, and ``torch`` for methods without an engine that reports."""
        return self.report.get(method, device)


@dataclass(frozen=True)
class _Call:
    backend: Backend
    method: str | None


_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("poodle_backend", default=None)


_DEFAULTS: dict[str, Backend] = {}  # a memo of immutable values, by the environment's setting


def default() -> Backend:
    """The backend of a caller that names none: the defaults (and the environment's). One value
    per setting of the environment, made once: engines called outside :func:`poodle.solvers.run`
    read it at every loop iteration."""
    key = os.environ.get("POODLE_CUDA_SINKHORN", "")
    be = _DEFAULTS.get(key)
    if be is None:
        be = _DEFAULTS[key] = Backend()
    return be


def for_call(backend: Backend | None) -> Backend:
    """The backend a call of :func:`poodle.solvers.run` runs under: ``backend``, else that of the
    call it is inside, else the :func:`default` with a :class:`Report` of its own (what one call
    ran is never read from another's)."""
    if backend is not None:
        return backend
    call = _CURRENT.get()
    return call.backend if call is not None else default().with_(report=Report())


@contextlib.contextmanager
def active(backend: Backend, method: str | None = None) -> Iterator[Backend]:
    """Inside: the engines of this thread use ``backend`` and report under ``method``
    (:func:`poodle.solvers.run` wraps each method call in it; tests wrap a direct call)."""
    token = _CURRENT.set(_Call(backend, method))
    try:
        yield backend
    finally:
        _CURRENT.reset(token)


def current() -> Backend:
    """The backend of the call in progress in this thread (:func:`default` outside any)."""
    call = _CURRENT.get()
    return default() if call is None else call.backend


def ran(what: str, device: torch.device | str) -> None:
    """Report that the method in progress ran the arithmetic ``what`` on ``device``."""
    call = _CURRENT.get()
    if call is not None:
        call.backend.report.record(call.method, device, what)


__all__ = [
    "Backend",
    "Report",
    "CUDA_STEPS",
    "SINKHORN_LOOPS",
    "active",
    "check_cuda_step",
    "current",
    "default",
    "for_call",
    "ran",
]
