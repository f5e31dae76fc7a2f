"""Stopping on SIGTERM or SIGINT without losing finished work (preemption by a cluster scheduler, Ctrl-C).

A scheduler sends SIGTERM to every process of a job (SIGKILL follows after a grace period); a user
presses Ctrl-C, which sends SIGINT to the terminal's process group. Inside :func:`stop_on_signals`,
the first of these signals only records a request to stop; the long loops call :func:`check` at
their safe points (a training step, a batch of images, a chunk of episodes, a cell), which raises
:class:`Interrupted` there. Everything committed before stays (epochs, splits, cells: each is
written atomically); what was under way is dropped or left resumable by the same cleanup that runs
for any exception. Should no safe point come within ``grace`` seconds, :class:`Interrupted` is
raised wherever the process is (as Ctrl-C always did); a second signal raises it at once (the same
signal again within :data:`REPEAT` seconds is the same request, as a torchrun rank under SLURM gets
it from both).

:class:`Interrupted` is a ``KeyboardInterrupt``, so code that cleans up after Ctrl-C cleans up after
a SIGTERM too, and a library caller that never enters :func:`stop_on_signals` sees no change.
DataLoader workers ignore both signals (:func:`quiet_worker`): the main process stops them, so they
print no traceback, and a worker's death is never mistaken for a failure; the main process
iterates through :func:`loader_batches`, which stops them on every way out.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Iterable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE = 3.0  # seconds from the signal to a hard stop when no safe point is reached
# Seconds within which the same signal again is the same request, not a second one: a scheduler
# signals every process of a job step, torchrun's ranks included, and torchrun passes the signal
# it got on to each rank as well, so a rank gets two at once; a person's second Ctrl-C comes later.
REPEAT = 1.0
_asked_at = [0.0]

_requested: list[int] = []  # the signal that asked to stop (at most one); empty: none


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop by signal ``signum`` (SIGINT or SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process killed by the signal: 128 + its number (130, 143)."""
        return 128 + self.signum


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _requested[0] if _requested else None


def check() -> None:
    """A safe point: raise :class:`Interrupted` if a stop was asked for."""
    if _requested:
        raise Interrupted(_requested[0])


def request(signum: int) -> None:
    """Ask to stop as signal ``signum`` would (what the handler does; also for another rank's request)."""
    if not _requested:
        _requested.append(int(signum))


def _on_signal(signum: int, frame: Any) -> None:
    if _requested:
        if signum == _requested[0] and time.monotonic() - _asked_at[0] < REPEAT:
            return  # the same request sent twice (SLURM signals a torchrun rank, and torchrun does too)
        raise Interrupted(_requested[0])  # a second signal: stop now
    _asked_at[0] = time.monotonic()
    request(signum)
    if _grace[0] is not None:
        signal.setitimer(signal.ITIMER_REAL, _grace[0])


def _on_alarm(signum: int, frame: Any) -> None:
    if _requested and not _critical:
        raise Interrupted(_requested[0])


_critical: list[bool] = []  # inside critical(): the hard stop waits for its end


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """A block the hard stop after the grace period must not cut in two (a checkpoint and its copy):
    a stop asked for meanwhile waits for the block's end, where it is raised."""
    _critical.append(True)
    try:
        yield
    finally:
        _critical.pop()
    if not _critical and _requested and _grace[0] is not None:
        check()


_grace: list[float | None] = [None]


@contextlib.contextmanager
def stop_on_signals(grace: float | None = GRACE) -> Iterator[None]:
    """Inside, SIGINT and SIGTERM ask to stop at the next :func:`check` (see the module's text);
    ``grace``: seconds after which :class:`Interrupted` is raised wherever the process is (None:
    only at safe points and on a second signal; for torchrun ranks, which must all stop at the same
    step, not in the middle of a collective). Outside the main thread, nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (*SIGNALS, signal.SIGALRM)}
    _requested.clear()
    _grace[0] = grace
    for s in SIGNALS:
        signal.signal(s, _on_signal)
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        _requested.clear()  # a request is about this run: a later call outside starts afresh


@contextlib.contextmanager
def loader_batches(loader: Iterable[Any]) -> Iterator[Iterator[Any]]:
    """``iter(loader)`` whose worker processes are shut down when the block is left, however it is
    left. Workers ignore SIGTERM (:func:`quiet_worker`), so one that outlives its iterator is never
    stopped by the interpreter's exit, which sends SIGTERM and then waits for it forever; and an
    exception raised in the loop keeps the iterator alive in its traceback, past the loop."""
    batches = iter(loader)
    try:
        yield batches
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)  # a multi-process DataLoader iterator
        if shutdown is not None:
            shutdown()


def quiet_worker(worker_id: int) -> None:
    """A DataLoader's ``worker_init_fn``: the worker ignores SIGINT and SIGTERM. The main process
    decides when to stop and shuts its workers down, so a signal sent to the whole process group
    neither kills a worker (which the main process would report as a failure) nor prints its
    traceback; a worker whose main process is gone exits by itself (torch's watchdog)."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


__all__ = [
    "GRACE",
    "Interrupted",
    "check",
    "critical",
    "loader_batches",
    "quiet_worker",
    "request",
    "requested",
    "stop_on_signals",
]
