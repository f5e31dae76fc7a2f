"""The GPU check: everything the project must show on a GPU, in a fixed time budget, one report.

    python3 benchmarks/gpu.py --budget 270 --out-dir "${OUT:-gpu-check}"   # the prepared command
    make gpu-check                                     # = python3 benchmarks/gpu.py (300 s, gpu-report.md)
    python3 benchmarks/gpu.py --device cpu --budget 60 # the same script on a CPU (CI runs it)

It needs no network: only torch, torchvision, h5py, click, rich and timm (and pytest for the test
section), after ``pip install --no-deps --no-build-isolation -e .`` in a checkout. Its features are
generated (clustered random rows, D = 640: the standard workload's shape), so no dataset is needed.

GPU time is short, so the whole check, set-up included, keeps to ``--budget`` seconds (default
300). Sections run in order of value; each is sized from the time left when it starts (episodes,
repeats; a share of that time by its weight) and held to a hard deadline: the end of the budget
(a subprocess's timeout is the time left, and its whole process group is killed at it; in-process
work is interrupted by an alarm). Once the budget is spent the remaining sections are listed as
skipped, not started. The names are what ``--skip`` takes:

1. ``environment``: versions, device, CPU, commit (set-up, milliseconds);
2. ``solve``: ``poodle solve --episodes 10000 --transductive`` end to end, the whole process timed;
3. ``agreement``: CPU-versus-device per-episode agreement of every method;
4. ``triton``: the Triton step against the torch step, per episode and in episodes/s (CUDA), and
   the cost model's prediction for both;
5. ``methods``: every method's episodes/s on the device beside the cost model's prediction;
6. ``tests``: ``pytest tests/test_cuda.py tests/test_triton_step.py`` on the device;
7. ``benchmark``: benchmarks/solver.py on this device (the authors' ``poodle()`` beside it given
   ``--authors-code`` or ``POODLE_AUTHORS_CODE``);
8. ``extraction``: extraction throughput (benchmarks/extract.py);
9. ``torchrun``: a one-GPU torchrun solve (NCCL; gloo on a CPU) against the one-process run.

Nothing finished is lost: the Markdown report and a JSON of the same numbers are rewritten (under a
temporary name, then renamed) after every section, and a one-screen summary is printed after every
section and at the end. SIGTERM (or Ctrl-C) stops the section in flight and its processes, writes the
report with every section finished before, and exits 143 (130); the exit status is 1 when a section
failed. On a CPU (``--device cpu``) every section runs the same code on the CPU: the device's side of
an agreement is then the torch formulation against the CPU's fused kernel, and the Triton step is
checked in Triton's interpreter by the tests.
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here: set-up (imports, features) included

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime as dt  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import solver as solver_bench  # noqa: E402  (benchmarks/solver.py: features, device facts)

from poodle import costmodel, solvers  # noqa: E402
from poodle.cache import read_split, write_arrays  # noqa: E402
from poodle.episodes import EpisodeSpec, sample_episodes  # noqa: E402
from poodle.evaluate import backend_for, evaluate, prepare_negatives  # noqa: E402
from poodle.negatives import NegativeSpec  # noqa: E402
from poodle.run import RunOptions  # noqa: E402
from poodle.solvers import _triton_step  # noqa: E402
from poodle.solvers.backend import Backend  # noqa: E402
from poodle.utils import atomic_path, resolve_device  # noqa: E402

IMPORT_S = time.monotonic() - T0  # a child process that imports torch and poodle pays about this again

PACKAGES = ("torch", "torchvision", "triton", "numpy", "h5py", "click", "rich", "timm", "pytest", "poodle")
GOAL_S = 2.0  # issue 24: 10,000 standard POODLE episodes in at most 2 s on one H100
RESERVE_S = 2.0  # kept back from the budget for the last report and the exit
SUMMARY_LIMIT = 6000  # characters of the printed summary: one screen, well inside a 12,000-character tail

# A child runs under this shim, which takes the child's whole process tree down with it: it leads a
# new process group, adopts the orphans of the tree (PR_SET_CHILD_SUBREAPER: torchrun's workers, for
# one, start sessions of their own, out of the group's reach), asks the kernel for SIGTERM when the
# check dies (PR_SET_PDEATHSIG: a check killed with SIGKILL cannot clean up), and on SIGTERM kills
# every descendant it finds in /proc, then its group and itself. Linux; elsewhere it kills its group.
SHIM = """
import os, signal, subprocess, sys, time
os.setpgrp()
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1)
    libc.prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass

def tree():
    kids = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            f = open("/proc/" + d + "/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if d.isdigit() and f[0] != "Z":
            kids.setdefault(int(f[1]), []).append(int(d))
    out, todo = [], [os.getpid()]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out

def stop(*_):
    for _ in range(50):
        pids = tree()
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.02)
    os.killpg(0, signal.SIGKILL)

signal.signal(signal.SIGTERM, stop)
if os.getppid() != int(sys.argv[1]):
    stop()
sys.exit(subprocess.call(sys.argv[2:]))
"""


class Deadline(BaseException):
    """The budget's end came (an alarm): raised in whatever the section was doing. A BaseException
    so that no ``except Exception`` on the way swallows it."""


class Stopped(BaseException):
    """SIGTERM or SIGINT from outside: the check stops after writing its report."""


def _alarm(signum: int, frame: Any) -> None:
    raise Deadline()


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


@contextmanager
def _quiet() -> Iterator[None]:
    """No alarm or stop inside (report writing, bookkeeping): they are held and arrive at the end."""
    sigs = {signal.SIGALRM, signal.SIGTERM, signal.SIGINT}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Budget:
    """The whole check's seconds, counted from the script's start (:data:`T0`)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = T0 + seconds - RESERVE_S

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def used(self) -> float:
        return time.monotonic() - T0


@dataclasses.dataclass
class Section:
    """One section: what ``--skip`` takes (``name``), its heading, its weight in the split of the time
    left, the least time it can do anything useful in, and, once run, its outcome."""

    name: str
    title: str
    fn: Callable[[Section, Ctx], None]
    weight: float
    min_s: float
    status: str = "not started"  # done | failed | stopped | skipped | not started
    reason: str = ""
    seconds: float = 0.0
    allotted: float = 0.0
    soft_end: float = 0.0
    parts: list[str] = dataclasses.field(default_factory=list)
    numbers: dict[str, Any] = dataclasses.field(default_factory=dict)
    headline: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add(self, text: str) -> None:
        self.parts.append(text.rstrip() + "\n")

    def number(self, key: str, value: Any, headline: bool = True) -> None:
        """A number of the report (the JSON's and the Markdown's); ``headline``: also on the screen."""
        self.numbers[key] = value
        if headline:
            self.headline.append(key)

    def soft_left(self) -> float:
        """Seconds left of this section's share (work is sized to it; the hard deadline is the budget's)."""
        return self.soft_end - time.monotonic()


@dataclasses.dataclass
class Ctx:
    """What the sections share."""

    args: argparse.Namespace
    dev: torch.device
    budget: Budget
    tmp: Path
    cache: Path
    test: Any
    neg: NegativeSpec
    rates: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)  # method -> (n, seconds)
    cost_rows: dict[str, Any] = dataclasses.field(default_factory=dict)
    solve_acc: np.ndarray | None = None
    _eps: Any = None

    def episodes(self, n: int) -> Any:
        """The first ``n`` standard episodes (5-way 1-shot, 15 queries a class, 400 base negatives);
        sampled again, larger, when more are asked for (episode i is the same either way)."""
        if self._eps is None or len(self._eps) < n:
            size = min(max(n, 2 * len(self._eps) if self._eps is not None else 0), max(n, 10_000))
            eps = sample_episodes(self.test.labels, EpisodeSpec(way=5, shot=1, query=15, seed=0), size)
            self._eps, _ = prepare_negatives(eps, self.neg, self.cache, 640)
        return self._eps[:n]

    def kw(self) -> dict[str, Any]:
        return dict(negatives=self.neg, cache_path=self.cache)

    def child_s(self) -> float:
        """A child process's fixed cost: Python, torch and poodle imported (as this one took) and more."""
        return 1.5 * IMPORT_S + 1.0


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


class Report:
    """The sections, their outcome and numbers, as Markdown, JSON and a one-screen summary, written
    after every section."""

    def __init__(self, sections: list[Section], md: Path, js: Path, budget: Budget, dev: torch.device) -> None:
        self.sections, self.md, self.js, self.budget, self.dev = sections, md, js, budget, dev
        self.device = str(dev)
        self.stopped = ""
        self.finished = False

    def _status(self, s: Section) -> str:
        return s.status + (f" ({s.reason})" if s.reason else "")

    def markdown(self) -> str:
        head = f"# GPU check: {self.device}\n\nBudget {self.budget.seconds:g} s, {self.budget.used():.0f} s used"
        head += (
            "; " + ("finished" if self.finished else f"stopped: {self.stopped}" if self.stopped else "in progress")
        ) + ".\n"
        head += "Generated by `benchmarks/gpu.py` (docs/gpu.md); the same numbers are in "
        head += f"`{self.js.name}`.\n\n- command: `{' '.join(sys.argv)}`\n"
        rows = ["## Summary", "", "| section | status | seconds | numbers |", "|---|---|---|---|"]
        for s in self.sections:
            nums = "; ".join(f"{k}: {_fmt(v)}" for k, v in s.numbers.items() if k in s.headline)
            rows.append(f"| {s.name} | {self._status(s)} | {s.seconds:.1f} | {nums} |")
        failed = [s.name for s in self.sections if s.status == "failed"]
        rows.append(f"\nSections failed: {', '.join(failed) or 'none'}.\n")
        body = []
        for i, s in enumerate(self.sections, 1):
            if s.status in ("skipped", "not started"):
                continue
            body.append(f"## {i}. {s.title} (`{s.name}`)\n")
            body.extend(s.parts)
            if s.numbers:
                body.append(
                    "| number | value |\n|---|---|\n" + "\n".join(f"| {k} | {_fmt(v)} |" for k, v in s.numbers.items())
                )
            body.append(f"\n_{self._status(s)}; {s.seconds:.1f} s of {s.allotted:.0f} s allotted_\n")
        return head + "\n" + "\n".join(rows) + "\n" + "\n".join(body)

    def json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "budget_s": self.budget.seconds,
            "used_s": round(self.budget.used(), 2),
            "finished": self.finished,
            "stopped": self.stopped or None,
            "command": sys.argv,
            "sections": [
                {
                    "name": s.name,
                    "title": s.title,
                    "status": s.status,
                    "reason": s.reason,
                    "seconds": round(s.seconds, 2),
                    "allotted_s": round(s.allotted, 1),
                    "numbers": s.numbers,
                    "headline": s.headline,
                    "data": s.data,
                }
                for s in self.sections
            ],
        }

    def summary(self) -> str:
        """The numbers that matter, one screen (at most :data:`SUMMARY_LIMIT` characters)."""
        state = "finished" if self.finished else f"stopped: {self.stopped}" if self.stopped else "in progress"
        lines = [
            f"== GPU check on {self.device}: {self.budget.used():.0f} s of {self.budget.seconds:g} s, {state}; "
            f"report {self.md} =="
        ]
        for s in self.sections:
            lines.append(f"{s.name:<12} {self._status(s)[:90]:<40} {s.seconds:6.1f} s")
            for k in s.headline:
                lines.append(f"    {k}: {_fmt(s.numbers[k])}"[:160])
        text = "\n".join(lines)
        return text if len(text) <= SUMMARY_LIMIT else text[: SUMMARY_LIMIT - 4] + "\n..."

    def write(self) -> None:
        with _quiet():
            for path, text in ((self.md, self.markdown()), (self.js, json.dumps(self.json(), indent=1) + "\n")):
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(path) as part:
                    part.write_text(text)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop a child run under :data:`SHIM` and everything it started: SIGTERM to the shim, which
    kills the tree; its process group killed outright if it has not gone in 5 s."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _run(sec: Section, ctx: Ctx, cmd: list[str], env: dict | None = None) -> tuple[str, float]:
    """Run ``cmd`` from the checkout's root in its own process group (:data:`SHIM`), its timeout the
    budget's time left; its output and wall seconds. At the timeout, or when the check is stopped,
    the whole group is killed and the output so far goes into the section."""
    log = ctx.tmp / f"{sec.name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    t = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", SHIM, str(os.getpid()), *cmd],
            cwd=ROOT,
            env=full_env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            try:
                code = proc.wait(timeout=max(ctx.budget.left(), 0.1))
            except subprocess.TimeoutExpired:
                raise Deadline() from None
        except BaseException:
            with _quiet():
                _kill_tree(proc)
            with _quiet():
                sec.add(
                    f"`{' '.join(cmd[1:])}` stopped after {time.perf_counter() - t:.1f} s, its process group "
                    "killed; its output so far:\n\n" + _block(log.read_text(errors="replace"), 3000)
                )
            raise
    wall = time.perf_counter() - t
    text = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` exited {code}:\n{text[-3000:]}")
    return text, wall


def _cell(path: Path) -> dict:
    """The one results record (``kind: cell``) of a ``poodle solve --out`` file."""
    cells = [
        r for r in (json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()) if r.get("kind") == "cell"
    ]
    if len(cells) != 1:
        raise RuntimeError(f"{path}: expected one results record, found {len(cells)}")
    return cells[0]


def _block(text: str, limit: int = 12000) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip()
    return "```\n" + (text if len(text) <= limit else "...\n" + text[-limit:]) + "\n```"


_ENDS: list[float] = []  # the ends (time.monotonic) of the shares in force, the innermost last


def _alarm_in(seconds: float) -> None:
    """:class:`Deadline` in ``seconds`` (0: no alarm)."""
    signal.signal(signal.SIGALRM, _alarm)  # SIGALRM's default ends the process
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _arm(ctx: Ctx) -> None:
    """The alarm at the nearest end in force: a share's, or the budget's."""
    end = min([ctx.budget.end, *_ENDS])
    _alarm_in(max(0.001, end - time.monotonic()))


@contextmanager
def _share(ctx: Ctx, seconds: float) -> Iterator[list[bool]]:
    """Inside: work stopped after ``seconds`` (the alarm's :class:`Deadline`, caught here: the list
    yielded then holds True); an outer share's end or the budget's, if sooner, goes on out."""
    cut = [False]
    mine = time.monotonic() + seconds
    _ENDS.append(mine)
    _arm(ctx)
    try:
        yield cut
    except Deadline:
        if mine >= min([ctx.budget.end, *_ENDS[:-1]]):
            raise
        cut[0] = True
    finally:
        _ENDS.pop()
        _arm(ctx)


def _grow(run: Callable[[int], float], n0: int, n_max: int, seconds: float, runs: list[tuple[int, float]]) -> None:
    """Call ``run(n)`` (which returns its wall seconds) at growing ``n``: ``n0`` twice (the first
    run warms up: the allocator, CUDA's context and kernels, Triton's compilation), then, projecting
    from the last run, a run at least twice as large while it fits in half of what is left of
    ``seconds``, up to ``n_max``. Each run's ``(n, seconds)`` is appended to ``runs`` as it ends.
    Projecting linearly is cautious on a GPU, where a small run costs about what a full chunk does."""
    n, spent = max(1, min(n0, n_max)), 0.0
    spent += run(n)
    while True:
        t = run(n)
        runs.append((n, t))
        spent += t
        nxt = min(n_max, int(n * 0.5 * (seconds - spent) / max(t, 1e-6)))
        if n >= n_max or nxt < 2 * n and nxt < n_max:
            return
        n = nxt


def _method_share(seconds: float, methods: list[tuple[str, str, dict]], i: int) -> float:
    """Method ``i``'s part of ``seconds`` shared by methods ``i`` onwards: POODLE, the method the
    check is for, weighs three times any other."""
    w = [3.0 if m[0] == "poodle" else 1.0 for m in methods[i:]]
    return seconds * w[0] / sum(w)


def _timed(ctx: Ctx, method: tuple, n: int, backend: Backend | None = None) -> float:
    eps = ctx.episodes(n)
    _sync(ctx.dev)
    t = time.perf_counter()
    evaluate(ctx.test, eps, [method], run=RunOptions(device=ctx.dev), backend=backend, **ctx.kw())
    _sync(ctx.dev)
    return time.perf_counter() - t


def _rate(ctx: Ctx, method: tuple, n_max: int, seconds: float) -> tuple[int, float] | None:
    """Episodes/s of ``method`` on the device, sized to ``seconds``: a warm-up, then runs growing
    until one fills its share (:func:`_grow`), all cut at twice the share; ``(episodes,
    episodes/s)`` of the last timed run finished, None if none was."""
    runs: list[tuple[int, float]] = []
    with _share(ctx, max(2 * seconds, 1.0)):
        _grow(lambda k: _timed(ctx, method, k), 4, n_max, seconds, runs)
    return (runs[-1][0], runs[-1][0] / runs[-1][1]) if runs else None


def _ordered(methods: list[tuple[str, str, dict]]) -> list[tuple[str, str, dict]]:
    """POODLE first (the method the check is for), then the registry's order."""
    return sorted(methods, key=lambda m: m[0] != "poodle")


def _all_methods() -> list[tuple[str, str, dict]]:
    return [
        (m, m, {"transductive": True} if solvers.get(m).transductive == "optional" else {}) for m in solvers.available()
    ]


def _cost_row(ctx: Ctx, method: str) -> Any:
    """The cost model's line for ``method`` (traced once, on the CPU, 2 standard episodes)."""
    if method not in ctx.cost_rows:
        opts = dict(costmodel.ITERATIVE).get(method)
        if opts is None:
            return None
        ctx.cost_rows[method] = costmodel.table([(method, opts)], traced_episodes=2)[0]
    return ctx.cost_rows[method]


def _gpu_spec(dev: torch.device) -> costmodel.GPU | None:
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    if "H200" in name:
        return costmodel.H200
    if "H100" in name:
        return costmodel.H100_PCIE if "PCIe" in name else costmodel.H100_SXM
    return None


# ------------------------------------------------------------------ sections


def environment(sec: Section, ctx: Ctx) -> None:
    dev = ctx.dev
    lines = [f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}", f"- command: `{' '.join(sys.argv)}`"]
    lines.append(f"- python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    missing = []
    for p in PACKAGES:
        try:
            v = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            v = "not installed"
            missing.append(p)
        lines.append(f"- {p} {v}")
    lines.append(f"- torch CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        lines.append(
            f"- device: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
            f"L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB, compute capability {props.major}.{props.minor}"
        )
        sec.number("device", props.name)
    else:
        sec.number("device", f"cpu ({solver_bench.cpu_model()})")
    lines.append(f"- CPU: {solver_bench.cpu_model()}, {len(os.sched_getaffinity(0))} cores visible")
    ok, why = _triton_step.available()
    lines.append(f"- Triton step: {'available' if ok else why}")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    lines.append(f"- poodle commit: {commit or 'unknown (not a git checkout)'}")
    lines.append(f"- set-up (imports, generated features): {ctx.budget.used():.1f} s, imports {IMPORT_S:.1f} s")
    sec.add("\n".join(lines))
    sec.number("packages missing", ", ".join(missing) or "none")
    sec.number("set-up (s)", round(ctx.budget.used(), 1))


def solve_end_to_end(sec: Section, ctx: Ctx) -> None:
    """``poodle solve --episodes N --transductive``: N is 10,000 (``--episodes``) unless the rate
    measured here in-process says that fewer fill the section's share."""
    poodle = ("poodle", "poodle", {"transductive": True})
    probe = _rate(ctx, poodle, ctx.args.episodes, 0.2 * sec.soft_left())
    rate = probe[1] if probe else 1.0
    if probe:
        ctx.rates["poodle"] = probe
    room = sec.soft_left() - ctx.child_s() - 1.0
    n = int(min(ctx.args.episodes, max(10, 0.6 * rate * room)))
    out_file = ctx.tmp / "solve.jsonl"
    cmd = [sys.executable, "-m", "poodle.cli.main", "solve", "--cache", str(ctx.cache), "--episodes", str(n)]
    cmd += ["--transductive", "--device", str(ctx.dev), "--out", str(out_file)]
    text, wall = _run(sec, ctx, cmd)
    rec = _cell(out_file)
    ctx.solve_acc = np.asarray(rec["acc"])
    sized = "" if n == ctx.args.episodes else f" (sized to the budget from {rate:,.1f} episodes/s measured in-process)"
    sec.add(
        f"`poodle solve --episodes {n} --transductive --device {ctx.dev}`{sized} (the standard workload: 5-way "
        f"1-shot, 15 queries per class, 400 base negatives, D = 640, generated features): **{wall:.2f} s whole "
        f"process** ({n / wall:,.1f} episodes/s, start-up included); the solve itself {rec['seconds']:.2f} s "
        f"({n / rec['seconds']:,.1f} episodes/s, chunks of {rec.get('chunk_size', '?')}); accuracy "
        f"{100 * rec['mean']:.2f} +- {100 * rec['ci95']:.2f}.\n\n" + _block(text, 3000)
    )
    sec.number("episodes", n)
    sec.number("whole process (s)", round(wall, 2))
    sec.number("solve only (s)", round(rec["seconds"], 3))
    sec.number("solve only (episodes/s)", round(n / rec["seconds"], 1))
    if n == 10_000 and ctx.dev.type == "cuda":
        sec.number(f"goal: 10,000 episodes solved in <= {GOAL_S:g} s", "met" if rec["seconds"] <= GOAL_S else "not met")


def _agree_one(ctx: Ctx, m: tuple, cap: int, share: float, row: dict[str, Any]) -> None:
    """The CPU's own path against the device's torch formulation for method ``m`` on the first
    episodes, in batches sized from the time the last one took, into ``row`` as each batch ends."""
    done, step, spent = 0, 2, 0.0
    while done < cap and step >= 1:
        b = min(cap, done + step)
        eps = ctx.episodes(b)[done:b]
        t = time.perf_counter()
        ref = evaluate(ctx.test, eps, [m], run=RunOptions(device="cpu"), **ctx.kw())[m[0]]
        torch_only = Backend(native=False)
        got = evaluate(ctx.test, eps, [m], run=RunOptions(device=ctx.dev), backend=torch_only, **ctx.kw())[m[0]].cpu()
        took = time.perf_counter() - t
        spent += took
        with _quiet():
            row["identical"] += int((ref == got).sum())
            row["max_acc_diff"] = max(row["max_acc_diff"], float((ref - got).abs().max()))
            row["episodes"] = b
        step = int(0.8 * (share - spent) / (took / (b - done)))
        done = b


def agreement(sec: Section, ctx: Ctx) -> None:
    """Per method, the CPU's own path against the device's torch formulation on the same episodes,
    as many as the method's share of the section's time allows (at most ``--agree-episodes``); a
    method whose first batch outlasts twice its share is cut there and the next one starts."""
    cap, methods = ctx.args.agree_episodes, _ordered(_all_methods())
    rows: dict[str, dict[str, Any]] = {}
    try:
        for i, m in enumerate(methods):
            share = _method_share(sec.soft_left(), methods, i)
            if share <= 0 and rows:
                break
            rows[m[0]] = {"episodes": 0, "identical": 0, "max_acc_diff": 0.0, "cut": False}
            with _share(ctx, max(2 * share, 1.0)) as cut:
                _agree_one(ctx, m, cap, share, rows[m[0]])
            rows[m[0]]["cut"] = cut[0]
    finally:
        with _quiet():
            _agreement_report(sec, ctx, methods, rows)


def _agreement_report(sec: Section, ctx: Ctx, methods: list, rows: dict[str, dict[str, Any]]) -> None:
    lines = ["| method | episodes identical | max accuracy difference |", "|---|---|---|"]
    for k, r in rows.items():
        cut = " (cut: its share of the time ran out)" if r["cut"] else ""
        diff = f"{r['max_acc_diff']:.4f}" if r["episodes"] else "-"
        lines.append(f"| {k} | {r['identical']}/{r['episodes']}{cut} | {diff} |")
    dev = ctx.dev
    what = "the CPU's fused kernel against the torch formulation" if dev.type == "cpu" else f"CPU against {dev}"
    untried = [m[0] for m in methods if m[0] not in rows]
    sec.add(
        f"Standard episodes, every method, {what} (episodes per method: as many as its share of the time "
        f"allows, at most {ctx.args.agree_episodes}):\n\n"
        + "\n".join(lines)
        + (f"\n\nNot reached in the time: {', '.join(untried)}." if untried else "")
    )
    sec.data["per_method"] = rows
    same_all, total = sum(r["identical"] for r in rows.values()), sum(r["episodes"] for r in rows.values())
    compared = [k for k, r in rows.items() if r["episodes"]]
    sec.number("methods compared", f"{len(compared)}/{len(methods)}")
    sec.number("episodes identical (all methods)", f"{same_all}/{total}")
    worse = [k for k, r in rows.items() if r["identical"] < r["episodes"]]
    sec.number("methods with a differing episode", ", ".join(worse) or "none")
    if "poodle" in rows:
        p = rows["poodle"]
        sec.number("POODLE episodes identical", f"{p['identical']}/{p['episodes']}" + (" (cut)" if p["cut"] else ""))


def triton(sec: Section, ctx: Ctx) -> None:
    """On CUDA: the Triton step against the torch formulation, per episode and in episodes/s, for
    each method it serves; everywhere: the cost model's prediction of both."""
    dev, kw = ctx.dev, ctx.kw()
    on_dev = RunOptions(device=dev)
    triton_step = backend_for(RunOptions(cuda_step="triton"))
    methods = _ordered([m for m in _all_methods() if solvers.get(m[1]).triton_step])
    ok, why = _triton_step.available()
    per: dict[str, dict[str, Any]] = sec.data.setdefault("per_method", {})
    if dev.type == "cuda" and ok:
        try:
            for i, m in enumerate(methods):
                share = _method_share(0.8 * sec.soft_left(), methods, i)
                if share <= 0:
                    break
                row: dict[str, Any] = {}
                with _share(ctx, max(2 * share, 1.0)):
                    eps = ctx.episodes(ctx.args.agree_episodes)
                    torch_acc = evaluate(ctx.test, eps, [m], run=on_dev, **kw)[m[0]].cpu()
                    tri_acc = evaluate(ctx.test, eps, [m], run=on_dev, backend=triton_step, **kw)[m[0]].cpu()
                    row.update(episodes=len(eps), identical=int((tri_acc == torch_acc).sum()))
                    per[m[0]] = row
                    got = _rate(ctx, m, ctx.args.episodes, share * 0.4)
                    if got:  # the Triton step on as many episodes (compiled and warm by now)
                        row.update(torch_eps_s=got[1], timed_episodes=got[0])
                        row.update(triton_eps_s=got[0] / _timed(ctx, m, got[0], triton_step))
        finally:
            with _quiet():
                _triton_report(sec, per)
    else:
        reason = why or f"no CUDA device ({dev})"
        sec.add(
            f"The Triton step is not run here ({reason}): on a CPU it is checked in Triton's interpreter by "
            "tests/test_triton_step.py (the `tests` section). Its prediction follows."
        )
        sec.number("Triton step measured", f"no ({reason})")
    rows: list[Any] = []
    for m in methods:
        if sec.soft_left() <= 0 and rows:
            break
        rows.append(_cost_row(ctx, m[0]))
    sec.add("The cost model's prediction for the Triton step (docs/gpu.md):\n\n" + costmodel.triton_markdown(rows))
    sec.number("methods predicted", len(rows), headline=False)


def _triton_report(sec: Section, per: dict[str, dict[str, Any]]) -> None:
    def r(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    lines = [
        "| method | episodes identical | episodes timed | torch step episodes/s | Triton step episodes/s "
        "| Triton / torch |",
        "|---|---|---|---|---|---|",
    ]
    for k, row in per.items():
        a, b = row.get("torch_eps_s"), row.get("triton_eps_s")
        ratio = f"{b / a:.2f}x" if a and b else "-"
        timed = f"{row['timed_episodes']:,}" if "timed_episodes" in row else "-"
        lines.append(f"| {k} | {row['identical']}/{row['episodes']} | {timed} | {r(a)} | {r(b)} | {ratio} |")
    sec.add(
        "The Triton step (opt-in) against the torch formulation on the device, same episodes:\n\n" + "\n".join(lines)
    )
    same, total = sum(x["identical"] for x in per.values()), sum(x["episodes"] for x in per.values())
    sec.number("episodes identical (Triton vs torch)", f"{same}/{total}")
    pd = per.get("poodle", {})
    if pd.get("torch_eps_s") and pd.get("triton_eps_s"):
        sec.number("POODLE Triton / torch step (episodes/s)", f"{pd['triton_eps_s'] / pd['torch_eps_s']:.2f}x")


def methods_throughput(sec: Section, ctx: Ctx) -> None:
    """Every method's episodes/s, each run sized to its share of the section (warm-up first), then
    the cost model's line for as many methods as the rest of the share allows."""
    methods = _ordered(_all_methods())
    rates: dict[str, float] = {}
    timed: dict[str, int] = {}
    rows: list[Any] = []
    try:
        for i, m in enumerate(methods):
            share = _method_share(0.7 * sec.soft_left(), methods, i)
            if share <= 0 and rates:
                break
            got = _rate(ctx, m, ctx.args.episodes, share)
            if got:
                with _quiet():
                    timed[m[0]], rates[m[0]] = got
                    ctx.rates[m[0]] = got
        for method, _ in costmodel.ITERATIVE:
            if sec.soft_left() <= 0:
                break
            rows.append(_cost_row(ctx, method))
    finally:
        with _quiet():
            _methods_report(sec, ctx, methods, rates, timed, rows)


def _methods_report(sec: Section, ctx: Ctx, methods: list, rates: dict, timed: dict, rows: list) -> None:
    dev = ctx.dev
    spec = _gpu_spec(dev)
    predicted = {r.method: r.seconds for r in rows}
    head = "| method | episodes timed | episodes/s | s per 10,000 | predicted s per 10,000 (" + (
        spec.name if spec else "H100 SXM / H100 PCIe / H200"
    )
    lines = [head + ") |", "|---|---|---|---|---|"]
    for label, rate in rates.items():
        p = predicted.get(label)
        pred = "-" if p is None else (f"{p[spec.name]:.2f}" if spec else " / ".join(f"{v:.2f}" for v in p.values()))
        lines.append(f"| {label} | {timed[label]:,} | {rate:,.1f} | {1e4 / rate:,.2f} | {pred} |")
    missing = [m[0] for m in methods if m[0] not in rates]
    sec.add(
        f"Standard episodes per method on {dev}, each run sized to its share of the time (at most "
        f"{ctx.args.episodes:,}; the first run also warms up):\n\n"
        + "\n".join(lines)
        + (f"\n\nNot timed in the time: {', '.join(missing)}." if missing else "")
    )
    sec.data["episodes_per_s"] = rates
    sec.data["episodes_timed"] = timed
    if rows:
        sec.add(
            "The cost model (poodle.costmodel, docs/gpu.md): traced per episode on the CPU with the torch "
            "formulation; seconds predicted for 10,000 episodes from published bandwidth and FP32 rates; measured "
            f"here beside it ({len(rows)} of {len(costmodel.ITERATIVE)} iterative methods traced in the time):\n\n"
            + costmodel.markdown(rows, rates, str(dev))
        )
    sec.number("methods timed", f"{len(rates)}/{len(methods)}")
    sec.number("methods traced by the cost model", f"{len(rows)}/{len(costmodel.ITERATIVE)}")
    if "poodle" in rates:
        sec.number("POODLE transductive (episodes/s)", round(rates["poodle"], 1))
        if spec and "poodle" in predicted:
            sec.number(f"POODLE predicted on {spec.name} (episodes/s)", round(1e4 / predicted["poodle"][spec.name], 1))
    slowest = sorted(rates.items(), key=lambda kv: kv[1])[:3]
    sec.number("slowest (episodes/s)", ", ".join(f"{k} {v:,.1f}" for k, v in slowest) or "-")


def tests(sec: Section, ctx: Ctx) -> None:
    """The device tests, as many as the section's share allows: both files, the CUDA agreement file,
    or (short of time) its POODLE probabilities test."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        sec.add("pytest is not installed here: the test section did not run (`agreement` still compares every method).")
        sec.number("tests", "not run (no pytest)")
        return
    room = sec.soft_left()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if room >= 150 and ctx.dev.type == "cuda":
        cmd += ["tests/test_cuda.py", "tests/test_triton_step.py"]
    elif room >= 60:
        cmd += ["tests/test_cuda.py"]
    else:
        cmd += ["tests/test_cuda.py", "-k", "probabilities and poodle"]
    out, wall = _run(sec, ctx, cmd, env={"POODLE_TEST_DEVICE": str(ctx.dev)})
    last = [ln for ln in out.strip().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    sec.add(f"`{' '.join(cmd[1:])}` with POODLE_TEST_DEVICE={ctx.dev} ({wall:.1f} s):\n\n" + _block(out, 4000))
    sec.number("tests", last[-1].strip(" =") if last else "no summary line")


def solver_benchmark(sec: Section, ctx: Ctx) -> None:
    n_rate = ctx.rates.get("poodle", (0, 10.0))[1]
    room = max(1.0, sec.soft_left() - 3 * ctx.child_s())
    n = int(min(ctx.args.episodes, max(16, n_rate * room / 4)))
    cmd = [sys.executable, "benchmarks/solver.py", "--device", str(ctx.dev), "--no-cost-model", "--episodes", str(n)]
    cmd += ["--torch-episodes", "0", "--startup-episodes", "0", "--process-episodes", "0"]
    if room < 60:
        cmd += ["--quick", "--autograd-episodes", "0", "--authors-episodes", "4"]
    if ctx.args.authors_code:
        cmd += ["--authors-code", ctx.args.authors_code]
    text, wall = _run(sec, ctx, cmd)
    rates = re.findall(r"^  ([\d,.]+) episodes/s", text, flags=re.M)
    sec.add(f"`{' '.join(cmd[1:])}` ({wall:.1f} s):\n\n" + _block(text))
    sec.number("POODLE 1-shot (episodes/s)", rates[0] if rates else "not found")
    authors = re.search(r"authors' poodle\(\) .*?: ([\d,.]+) episodes/s -> ours is ([\d,.]+)x", text)
    sec.number("authors' poodle() on this device", f"ours {authors.group(2)}x faster" if authors else "skipped")


def extraction(sec: Section, ctx: Ctx) -> None:
    room = sec.soft_left() - 2 * ctx.child_s()
    cmd = [sys.executable, "benchmarks/extract.py", "--device", str(ctx.dev), "--repeats", "1"]
    if ctx.dev.type == "cuda" and room > 30:
        cmd += ["--images", str(int(min(10_000, max(400, 40 * room)))), "--backbone", "resnet12"]
    else:
        cmd += ["--quick", "--images", "16", "--classes", "2", "--px", "32", "--size", "32", "--workers", "0"]
    text, wall = _run(sec, ctx, cmd)
    sec.add(f"`{' '.join(cmd[1:])}` ({wall:.1f} s):\n\n" + _block(text, 4000))
    m = re.search(r"extract[^\n]*?([\d,.]+) images/s", text)
    sec.number("extraction (images/s)", m.group(1) if m else "see section")


def torchrun(sec: Section, ctx: Ctx) -> None:
    rate = ctx.rates.get("poodle", (0, 10.0))[1]
    room = max(1.0, sec.soft_left() - 2 * ctx.child_s())
    n = int(min(ctx.args.torchrun_episodes, max(8, 0.5 * rate * room)))
    if ctx.solve_acc is not None:
        n = min(n, len(ctx.solve_acc))
    out_file = ctx.tmp / "torchrun.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["-m", "poodle.cli.main", "solve", "--cache", str(ctx.cache), "--episodes", str(n), "--transductive"]
    cmd += ["--device", "cuda" if ctx.dev.type == "cuda" else "cpu", "--out", str(out_file)]
    text, wall = _run(sec, ctx, cmd, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    rec = _cell(out_file)
    acc = np.asarray(rec["acc"])
    backend = "NCCL" if ctx.dev.type == "cuda" else "gloo"
    line = f"`torchrun --standalone --nproc-per-node 1 poodle solve --episodes {n}` ({backend}): {wall:.1f} s, "
    line += f"processes {rec.get('processes')}, accuracy {100 * rec['mean']:.2f}"
    sec.number("backend", backend, headline=False)
    if ctx.solve_acc is not None:
        same = int((acc == ctx.solve_acc[:n]).sum())
        line += f"; per-episode identical to the one-process run's first {n} episodes: {same}/{n}"
        sec.number("episodes identical to the one-process run", f"{same}/{n}")
    else:
        sec.number("episodes", n)
    sec.add(line + "\n\n" + _block(text, 3000))


# ------------------------------------------------------------------ driver

SECTIONS: list[tuple[str, str, Callable[[Section, Ctx], None], float, str]] = [
    # name (what --skip takes), title, function, weight, least time ("0", "child": a child's start, ...)
    ("environment", "Environment", environment, 0.0, "0"),
    ("solve", "poodle solve end to end", solve_end_to_end, 3.0, "child+3"),
    ("agreement", "CPU versus device, per episode", agreement, 3.0, "2"),
    ("triton", "The Triton step against the torch step", triton, 1.5, "1"),
    ("methods", "Every method on the device, and the cost model", methods_throughput, 3.0, "3"),
    ("tests", "Tests on the device", tests, 1.5, "child+3"),
    ("benchmark", "Solver benchmark", solver_benchmark, 1.0, "3*child+4"),
    ("extraction", "Extraction throughput", extraction, 0.7, "2*child+4"),
    ("torchrun", "torchrun, one process per GPU", torchrun, 0.7, "2*child+4"),
]
NAMES = [s[0] for s in SECTIONS]


def _least(expr: str, child: float) -> float:
    """``"2*child+4"`` -> seconds."""
    total = 0.0
    for term in expr.split("+"):
        if "child" in term:
            total += float(term.split("*")[0]) * child if "*" in term else child
        else:
            total += float(term)
    return total


def _features(tmp: Path) -> Path:
    """The generated standard-workload cache (D = 640): 64 base classes (the negative pool), 20 test,
    100 rows each (enough for 5-way 1-shot episodes with 15 queries a class and 400 negatives)."""
    per = 100
    xtr, ytr = solver_bench.clustered(64, per, 640, seed=1)
    xte, yte = solver_bench.clustered(20, per, 640, seed=2, spread=1.2)
    splits = {"train": (xtr, ytr, [f"b{i}" for i in range(64)]), "test": (xte, yte, [f"t{i}" for i in range(20)])}
    return write_arrays(tmp / "features.h5", splits)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole check, set-up included")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--out", type=Path, default=None, help="the Markdown report (the JSON beside it: .json)")
    out.add_argument(
        "--out-dir", type=Path, default=None, help="write gpu-report.md and gpu-report.json into this folder"
    )
    ap.add_argument("--episodes", type=int, default=10_000, help="most episodes of the solve and of a timed run")
    ap.add_argument("--agree-episodes", type=int, default=300, help="most episodes per method of the agreement")
    ap.add_argument("--torchrun-episodes", type=int, default=2000, help="most episodes of the torchrun solve")
    ap.add_argument(
        "--authors-code",
        default=os.environ.get("POODLE_AUTHORS_CODE"),
        help="checkout of github lehduong/poodle for the solver benchmark (default: $POODLE_AUTHORS_CODE)",
    )
    ap.add_argument("--skip", default="", help=f"sections to leave out, comma-separated: {', '.join(NAMES)}")
    args = ap.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = sorted(args.skip - set(NAMES))
    if unknown:
        ap.error(f"--skip: no section named {', '.join(unknown)} (the sections: {', '.join(NAMES)})")
    if args.budget <= RESERVE_S:
        ap.error(f"--budget {args.budget:g}: must be more than {RESERVE_S:g} seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # line by line: a run stopped from outside loses no line
        sys.stdout.reconfigure(line_buffering=True)
    args = _parse(argv)
    md = args.out or (args.out_dir / "gpu-report.md" if args.out_dir else Path("gpu-report.md"))
    budget = Budget(args.budget)
    dev = resolve_device(args.device)
    child = 1.5 * IMPORT_S + 1.0
    sections = [Section(n, t, f, w, _least(least, child)) for n, t, f, w, least in SECTIONS]
    rep = Report(sections, md, md.with_suffix(".json"), budget, dev)
    for s in sections:
        if s.name in args.skip:
            s.status, s.reason = "skipped", "--skip"
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    code = 0
    try:
        rep.write()
        print(f"gpu check: budget {args.budget:g} s on {dev}; report {md} and {rep.js.name}, after every section")
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            cache = _features(tmp)
            ctx = Ctx(
                args, dev, budget, tmp, cache, read_split(cache, "test"), NegativeSpec("base", costmodel.STANDARD.n_neg)
            )
            _run_sections(sections, ctx, rep)
        rep.finished = True
    except Stopped as e:
        for sig in (signal.SIGTERM, signal.SIGINT):  # stopping already: a second signal must not cut the report
            signal.signal(sig, signal.SIG_IGN)
        rep.stopped = f"{e} from outside"
        code = 143 if str(e) == "SIGTERM" else 130
        for s in sections:
            if s.status == "not started":
                s.reason = f"the check was stopped ({e})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        rep.write()
    print(rep.summary())
    failed = [s.name for s in sections if s.status == "failed"]
    print(f"gpu check: report written to {md} and {rep.js}; sections failed: {', '.join(failed) or 'none'}")
    return code or (1 if failed else 0)


def _run_sections(sections: list[Section], ctx: Ctx, rep: Report) -> None:
    """Every section not skipped by name, in order, the report written after each that ran. The
    sections come in order of value: once one is skipped for want of time, every one after it is
    too (a cheaper later one must not run in its place)."""
    for i, sec in enumerate(sections):
        if sec.status == "skipped":
            continue
        if _run_section(sec, ctx, sections[i:]):
            rep.write()
            print(rep.summary())
            continue
        for later in sections[i + 1 :]:
            if later.status == "not started":
                later.status = "skipped"
                later.reason = f"budget spent: {sec.name}, before it, did not fit"
        return


def _run_section(sec: Section, ctx: Ctx, rest: list[Section]) -> bool:
    """Run one section under the budget's hard deadline; record how it ended. A failure is reported
    in place and the others go on; a stop from outside is recorded and passed on. False when it was
    skipped for want of time."""
    left = ctx.budget.left()
    if left <= 0 or left < sec.min_s:
        sec.status = "skipped"
        sec.reason = f"budget spent: {left:.0f} s left, needs about {sec.min_s:.0f} s"
        return False
    weights = sum(s.weight for s in rest if s.status == "not started")
    share = left * sec.weight / weights if weights else left
    sec.allotted = min(left, max(sec.min_s, share))
    print(f"gpu check: {sec.name} ({sec.title}), {sec.allotted:.0f} s of {left:.0f} s left ...")
    t = time.monotonic()
    sec.soft_end = t + sec.allotted
    sec.status = "running"
    _alarm_in(max(0.001, left))
    try:
        sec.fn(sec, ctx)
        sec.status = "done"
    except Deadline:
        sec.status, sec.reason = "stopped", "the budget ran out: stopped at its deadline"
    except Stopped as e:
        sec.status, sec.reason = "stopped", f"{e} from outside"
        raise
    except Exception as e:  # the report must still be written, and the others run
        sec.status = "failed"
        sec.reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        sec.add(f"**FAILED**: `{type(e).__name__}: {e}`\n\n```\n{traceback.format_exc()[-4000:]}\n```")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sec.seconds = time.monotonic() - t
    return True


if __name__ == "__main__":
    sys.exit(main())
