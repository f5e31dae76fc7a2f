"""Progress in the form that suits where the output goes (``--progress``, one option for every
long command).

- ``bar``: rich's live bars, for a person at a terminal;
- ``plain``: one line per stage at a steady interval (``--progress-interval``, 30 s by default, also
  ``POODLE_PROGRESS_INTERVAL`` or the project file's ``progress_interval``) and at the stage's end,
  with the count done of the total, the rate and the time left, for a log file;
- ``json``: the same as one JSON object per line on stderr, for tools that read logs;
- ``none``: no progress (the command's other lines still print);
- ``auto`` (the default): ``bar`` when stderr is a terminal, ``plain`` otherwise.

:func:`new_progress` gives a rich ``Progress`` for ``bar`` and otherwise a :class:`LineProgress`,
which has the part of rich's interface the displays use (``add_task``, ``update``, ``advance``,
``remove_task``, ``reset``, ``tasks``), so each command's display is written once.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from poodle.options import option

MODES = ("auto", "bar", "plain", "json", "none")
DEFAULT_INTERVAL = 30.0
INTERVAL_ENV = "POODLE_PROGRESS_INTERVAL"


@dataclass(frozen=True)
class ProgressOptions:
    """How a long command shows its progress: the settings behind every long command's
    ``--progress`` and ``--progress-interval`` (and the project file's keys of those names)."""

    progress: str = option(
        "auto",
        choices=MODES,
        help="Progress display: bar (live bars), plain (a line every --progress-interval seconds and at "
        "each stage's end, for logs), json (one object a line on stderr), none; auto: bar on a terminal, "
        "plain otherwise.",
    )
    progress_interval: float = option(
        DEFAULT_INTERVAL,
        min=0,
        min_open=True,
        metavar="SECONDS",
        help=f"Seconds between plain or json progress lines (also {INTERVAL_ENV}).",
    )


_state: dict[str, Any] = {"mode": "auto", "interval": DEFAULT_INTERVAL}


def configure(mode: str, interval: float) -> None:
    """Set the form of progress (one of :data:`MODES`) and the plain lines' interval in seconds."""
    _state["mode"], _state["interval"] = mode, float(interval)


def mode() -> str:
    """The form in effect: ``auto`` resolved against whether stderr is a terminal."""
    from poodle.cli._console import console

    m = str(_state["mode"])
    if m == "auto":
        return "bar" if console.is_terminal else "plain"
    return m


def interval() -> float:
    return float(_state["interval"])


def new_progress(*columns: Any, transient: bool = False) -> Any:
    """A rich ``Progress`` of ``columns`` on the console when the form is ``bar``, else a
    :class:`LineProgress` of that form."""
    from poodle.cli._console import console

    m = mode()
    if m == "bar":
        from rich.progress import Progress

        return Progress(*columns, console=console, transient=transient)
    return LineProgress(m, interval())


@dataclass
class Task:
    """What :class:`LineProgress` keeps of a stage (the attributes the displays read of rich's)."""

    description: str
    total: float | None
    fields: dict[str, Any]
    completed: float = 0.0
    started: float = field(default_factory=lambda: time.monotonic())
    start_count: float = 0.0  # done when the rate started being measured (a reset)
    printed_final: bool = False
    ended: float | None = None  # when the stage ended: its time and rate stay those of its last line

    @property
    def elapsed(self) -> float:
        return (time.monotonic() if self.ended is None else self.ended) - self.started

    @property
    def finished_time(self) -> float | None:
        """Seconds from the start to the end of the stage (rich's name); None while it runs."""
        return None if self.ended is None else self.ended - self.started

    @property
    def speed(self) -> float | None:
        """Items a second since the stage started (a steady figure, as a log wants)."""
        t = self.elapsed
        return (self.completed - self.start_count) / t if t > 0 and self.completed > self.start_count else None

    finished_speed = None

    @property
    def finished(self) -> bool:
        return self.total is not None and self.completed >= self.total

    @property
    def remaining(self) -> float | None:
        s = self.speed
        if self.total is None or not s:
            return None
        return max(0.0, (self.total - self.completed) / s)


def clock(seconds: float | None) -> str:
    """``seconds`` as ``H:MM:SS`` (``?`` when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class LineProgress:
    """Progress as lines: ``plain`` (text) or ``json`` (one object a line), on stderr; ``none``:
    nothing. A stage's line is printed when ``interval`` seconds have passed since the last line and
    when the stage ends (its count reaches its total, or it is removed unfinished)."""

    def __init__(self, form: str, interval: float) -> None:
        self.form, self.interval = form, interval
        self.tasks: dict[int, Task] = {}
        self._next = 0
        self._last = time.monotonic()

    # -- rich's interface ----------------------------------------------------------------------

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        for t in list(self.tasks.values()):
            self._end(t)

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        task_id = self._next
        self._next += 1
        self.tasks[task_id] = Task(description, total, dict(fields))
        return task_id

    def remove_task(self, task_id: int) -> None:
        t = self.tasks.pop(task_id, None)
        if t is not None:
            self._end(t)

    def reset(self, task_id: int, total: float | None = None, completed: float = 0, **fields: Any) -> None:
        t = self.tasks[task_id]
        if total is not None:
            t.total = total
        t.completed, t.start_count, t.started = completed, completed, time.monotonic()
        t.printed_final, t.ended = False, None
        t.fields.update(fields)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(
        self,
        task_id: int,
        *,
        total: float | None = None,
        completed: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        **fields: Any,
    ) -> None:
        t = self.tasks[task_id]
        if total is not None:
            t.total = total
        if completed is not None:
            t.completed = completed
        if advance is not None:
            t.completed += advance
        if description is not None:
            t.description = description
        t.fields.update(fields)
        if t.finished:
            self._end(t)
        elif time.monotonic() - self._last >= self.interval:
            for other in self.tasks.values():
                if not other.printed_final:
                    self._emit(other, final=False)
            self._last = time.monotonic()

    # -- the lines -----------------------------------------------------------------------------

    def _end(self, t: Task) -> None:
        if not t.printed_final:
            t.printed_final, t.ended = True, time.monotonic()
            self._emit(t, final=True)

    def _emit(self, t: Task, final: bool) -> None:
        if self.form == "none":
            return
        unit = str(t.fields.get("unit", ""))
        # a rate a display wrote for its bar ("52 episodes/s"): the line says its own
        extra = {
            k: v
            for k, v in t.fields.items()
            if k not in ("unit", "rate") and v not in ("", "-", None) and not re.fullmatch(r"[\d,.]+ \S+/s", str(v))
        }
        speed, left = t.speed, t.remaining
        if self.form == "json":
            obj: dict[str, Any] = {
                "event": "progress",
                "stage": t.description,
                "done": int(t.completed) if float(t.completed).is_integer() else t.completed,
                "total": None if t.total is None else int(t.total),
                "unit": unit or None,
                "rate": None if speed is None else round(speed, 3),
                "elapsed_s": round(t.elapsed, 3),
                "left_s": None if left is None else round(left, 1),
                "final": final,
                **{k: str(v) for k, v in extra.items()},
            }
            sys.stderr.write(json.dumps(obj) + "\n")
            sys.stderr.flush()
            return
        count = f"{int(t.completed):,}" + ("" if t.total is None else f"/{int(t.total):,}")
        pct = f" ({100 * t.completed / t.total:.0f}%)" if t.total else ""
        rate = f", {speed:,.1f} {unit or 'it'}/s" if speed else ""
        when = f", {clock(t.elapsed)} elapsed" + ("" if final or left is None else f", {clock(left)} left")
        info = "".join(f", {v}" if k == "info" else f", {k} {v}" for k, v in extra.items())
        from poodle.cli._console import console

        console.print(
            f"{t.description}: {count}{' ' + unit if unit else ''}{pct}{rate}{when}{info}"
            + ("" if not final or t.finished else " (stopped)"),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


__all__ = ["DEFAULT_INTERVAL", "INTERVAL_ENV", "MODES", "LineProgress", "clock", "configure", "mode", "new_progress"]
