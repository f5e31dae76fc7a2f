"""The GPU check: everything the project must show on a GPU, as one command and one Markdown report.

    make gpu-check                                 # = python benchmarks/gpu.py (report: gpu-report.md)
    python benchmarks/gpu.py --authors-code /path/to/lehduong/poodle --out gpu-report.md
    python benchmarks/gpu.py --device cpu --quick  # the same script on a CPU, in seconds (CI runs it)

It needs no network: only torch, torchvision, h5py, click, rich and timm (and pytest for the test
section), after ``pip install --no-deps --no-build-isolation -e .`` in a checkout. Its features are
generated (clustered random rows, D = 640: the standard workload's shape), so no dataset is needed.
Sections, in order (each timed; one that fails is reported and the others still run; the exit
status is 1 if any failed):

1. environment: versions, device, CPU, commit;
2. tests: ``pytest tests/test_cuda.py tests/test_triton_step.py`` (per-episode CPU-vs-device
   agreement of every method, probabilities, the Triton step compiled and interpreted);
3. ``poodle solve --episodes 10000 --transductive`` end to end, the whole process timed;
4. the solver benchmark (benchmarks/solver.py on this device, with the authors' ``poodle()`` on the
   same device given ``--authors-code`` or ``POODLE_AUTHORS_CODE``);
5. CPU-versus-device per-episode agreement of every method (the CPU's own path against the device's
   torch formulation), and on CUDA the Triton step against the torch formulation;
6. every method's episodes/s on the device beside the cost model's prediction, the Triton step's
   episodes/s against the torch formulation's (CUDA), and the cost model's tables;
7. extraction throughput (benchmarks/extract.py);
8. a one-GPU torchrun solve (NCCL; gloo on a CPU) against the one-process run, per episode.

On a CPU (``--device cpu``) every section runs the same code on the CPU: the device's side of an
agreement is then the torch formulation against the CPU's fused kernel, and the Triton step is
checked in Triton's interpreter by the tests. ``--quick`` shrinks every section to seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import solver as solver_bench  # noqa: E402  (benchmarks/solver.py: features, device facts)

from poodle import costmodel, solvers  # noqa: E402
from poodle.cache import read_split, write_arrays  # noqa: E402
from poodle.episodes import EpisodeSpec, sample_episodes  # noqa: E402
from poodle.evaluate import evaluate, prepare_negatives  # noqa: E402
from poodle.negatives import NegativeSpec  # noqa: E402
from poodle.solvers import _optim, _triton_step  # noqa: E402
from poodle.utils import atomic_path, resolve_device  # noqa: E402

PACKAGES = ("torch", "torchvision", "triton", "numpy", "h5py", "click", "rich", "timm", "pytest", "poodle")
GOAL_S = 2.0  # issue 24: 10,000 standard POODLE episodes in at most 2 s on one H100


class Report:
    """The report's sections (Markdown) and its summary numbers, filled as the sections run."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.summary: list[tuple[str, str]] = []
        self.failed: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text.rstrip() + "\n")

    def number(self, name: str, value: Any) -> None:
        self.summary.append((name, str(value)))

    def run(self, title: str, fn: Callable[[], None]) -> None:
        """Run one section under its heading; a failure is reported in place and the others go on."""
        self.add(f"## {title}")
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # the report must still be written
            self.failed.append(title)
            self.add(f"**FAILED**: `{type(e).__name__}: {e}`\n\n```\n{traceback.format_exc()[-4000:]}\n```")
        self.add(f"_section time: {time.perf_counter() - t:.1f} s_")

    def markdown(self, header: str) -> str:
        rows = "\n".join(f"| {k} | {v} |" for k, v in self.summary)
        failed = ", ".join(self.failed) if self.failed else "none"
        summary = f"## Summary\n\n| check | result |\n|---|---|\n{rows}\n| sections failed | {failed} |\n"
        return header + "\n" + summary + "\n" + "\n".join(self.parts)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[str, float]:
    """Run ``cmd`` from the checkout's root; its output and wall seconds; an error with its output
    when it fails."""
    t = time.perf_counter()
    out = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - t
    text = out.stdout + (("\n" + out.stderr) if out.stderr.strip() else "")
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` exited {out.returncode}:\n{text[-3000:]}")
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


# ------------------------------------------------------------------ sections


def environment(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    lines = [f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}", f"- command: `{' '.join(sys.argv)}`"]
    lines.append(f"- python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    for p in PACKAGES:
        try:
            v = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            v = "not installed"
        lines.append(f"- {p} {v}")
    lines.append(f"- torch CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        lines.append(
            f"- device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
            f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB, compute capability {p.major}.{p.minor}"
        )
        rep.number("device", p.name)
    else:
        rep.number("device", f"cpu ({solver_bench.cpu_model()})")
    lines.append(f"- CPU: {solver_bench.cpu_model()}, {len(os.sched_getaffinity(0))} cores visible")
    lines.append(f"- Triton step: {'available' if _triton_step.available()[0] else _triton_step.available()[1]}")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    lines.append(f"- poodle commit: {commit or 'unknown (not a git checkout)'}")
    rep.add("\n".join(lines))


def tests(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        rep.add("pytest is not installed here: the test section did not run (section 5 still compares every method).")
        rep.number("tests", "not run (no pytest)")
        return
    files = ["tests/test_cuda.py"] + ([] if args.quick else ["tests/test_triton_step.py"])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if args.quick:
        cmd += ["-k", "probabilities and poodle"]
    out, wall = _run(cmd, timeout=540, env={"POODLE_TEST_DEVICE": str(dev)})
    last = [ln for ln in out.strip().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    rep.add(f"`{' '.join(cmd[1:])}` with POODLE_TEST_DEVICE={dev} ({wall:.1f} s):\n\n" + _block(out, 4000))
    rep.number("tests", last[-1].strip(" =") if last else "no summary line")


def solve_end_to_end(rep: Report, ctx: dict, args: argparse.Namespace) -> None:
    n = ctx["solve_episodes"]
    out_file = ctx["tmp"] / "solve.jsonl"
    cmd = [sys.executable, "-m", "poodle.cli.main", "solve", "--cache", str(ctx["cache"]), "--episodes", str(n)]
    cmd += ["--transductive", "--device", str(ctx["dev"]), "--out", str(out_file)]
    text, wall = _run(cmd, timeout=540)
    rec = _cell(out_file)
    ctx["solve_acc"] = np.asarray(rec["acc"])
    rep.add(
        f"`poodle solve --episodes {n} --transductive --device {ctx['dev']}` (the standard workload: 5-way 1-shot, "
        f"15 queries per class, 400 base negatives, D = 640, generated features): **{wall:.2f} s whole process** "
        f"({n / wall:,.1f} episodes/s, start-up included); the solve itself {rec['seconds']:.2f} s "
        f"({n / rec['seconds']:,.1f} episodes/s, chunks of {rec.get('chunk_size', '?')}); accuracy "
        f"{100 * rec['mean']:.2f} +- {100 * rec['ci95']:.2f}.\n\n" + _block(text, 3000)
    )
    rep.number(f"poodle solve {n} episodes, whole process (s)", f"{wall:.2f}")
    rep.number(f"poodle solve {n} episodes, solve only (s)", f"{rec['seconds']:.2f}")
    if n == 10_000 and ctx["dev"].type == "cuda":
        rep.number(f"goal: 10,000 episodes solved in <= {GOAL_S:g} s", "met" if rec["seconds"] <= GOAL_S else "not met")


def solver_benchmark(rep: Report, ctx: dict, args: argparse.Namespace) -> None:
    cmd = [sys.executable, "benchmarks/solver.py", "--device", str(ctx["dev"]), "--no-cost-model"]
    if args.quick:
        cmd += ["--quick", "--episodes", "16", "--autograd-episodes", "0", "--torch-episodes", "0"]
        cmd += ["--process-episodes", "0", "--startup-episodes", "0", "--authors-episodes", "4"]
    else:
        cmd += ["--episodes", str(ctx["solve_episodes"]), "--torch-episodes", "0", "--startup-episodes", "0"]
    if args.authors_code:
        cmd += ["--authors-code", args.authors_code]
    text, wall = _run(cmd, timeout=540)
    rates = re.findall(r"^  ([\d,.]+) episodes/s", text, flags=re.M)
    rep.add(f"`{' '.join(cmd[1:])}` ({wall:.1f} s):\n\n" + _block(text))
    rep.number("solver benchmark, POODLE 1-shot (episodes/s)", rates[0] if rates else "not found")
    authors = re.search(r"authors' poodle\(\) .*?: ([\d,.]+) episodes/s -> ours is ([\d,.]+)x", text)
    rep.number("authors' poodle() on this device", f"ours {authors.group(2)}x faster" if authors else "skipped")


def _all_methods() -> list[tuple[str, str, dict]]:
    return [
        (m, m, {"transductive": True} if solvers.get(m).transductive == "optional" else {}) for m in solvers.available()
    ]


def agreement(rep: Report, ctx: dict, args: argparse.Namespace) -> None:
    test, dev, n = ctx["test"], ctx["dev"], ctx["agree_episodes"]
    eps, neg = ctx["episodes"][:n], ctx["negatives"]
    methods = [m for m in _all_methods() if not args.quick or m[0] in ctx["quick_methods"]]
    kw = dict(negatives=neg, cache_path=ctx["cache"])
    ref = evaluate(test, eps, methods, device="cpu", **kw)
    before = _optim.USE_NATIVE
    _optim.USE_NATIVE = False
    try:
        got = evaluate(test, eps, methods, device=dev, **kw)
    finally:
        _optim.USE_NATIVE = before
    lines = ["| method | episodes identical | max accuracy difference |", "|---|---|---|"]
    total = same_all = 0
    for label, _, _ in methods:
        same = int((ref[label] == got[label].cpu()).sum())
        diff = float((ref[label] - got[label].cpu()).abs().max())
        total += n
        same_all += same
        lines.append(f"| {label} | {same}/{n} | {diff:.4f} |")
    what = "the CPU's fused kernel against the torch formulation" if dev.type == "cpu" else f"CPU against {dev}"
    rep.add(f"{n} standard episodes, every method, {what}:\n\n" + "\n".join(lines))
    rep.number("CPU vs device, episodes identical (all methods)", f"{same_all}/{total}")
    if dev.type == "cuda" and _triton_step.available()[0]:
        from poodle.solvers._optim import TRITON_METHODS as METHODS
        from poodle.solvers._optim import cuda_step

        sub = [m for m in methods if m[0] in METHODS]
        with cuda_step("triton"):
            tri = evaluate(test, eps, sub, device=dev, **kw)
        lines = ["| method | episodes identical (Triton vs torch formulation, on the device) |", "|---|---|"]
        same_t = 0
        for label, _, _ in sub:
            s = int((tri[label].cpu() == got[label].cpu()).sum())
            same_t += s
            lines.append(f"| {label} | {s}/{n} |")
        rep.add("The Triton step against the torch formulation, same episodes:\n\n" + "\n".join(lines))
        rep.number("Triton vs torch step, episodes identical", f"{same_t}/{n * len(sub)}")


def _rate(test, eps, method: tuple, dev: torch.device, kw: dict) -> float:
    evaluate(test, eps[: min(8, len(eps))], [method], device=dev, **kw)  # warm-up: allocator, compilation
    _sync(dev)
    t = time.perf_counter()
    evaluate(test, eps, [method], device=dev, **kw)
    _sync(dev)
    return len(eps) / (time.perf_counter() - t)


def _gpu_spec(dev: torch.device) -> costmodel.GPU | None:
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    if "H200" in name:
        return costmodel.H200
    if "H100" in name:
        return costmodel.H100_PCIE if "PCIe" in name else costmodel.H100_SXM
    return None


def methods_throughput(rep: Report, ctx: dict, args: argparse.Namespace) -> None:
    test, dev, eps = ctx["test"], ctx["dev"], ctx["episodes"]
    kw = dict(negatives=ctx["negatives"], cache_path=ctx["cache"])
    n = len(eps)
    traced = costmodel.ITERATIVE if not args.quick else [m for m in costmodel.ITERATIVE if m[0] in ctx["quick_methods"]]
    rows = costmodel.table(traced, traced_episodes=2 if args.quick else 4)
    rates: dict[str, float] = {}
    methods = [m for m in _all_methods() if not args.quick or m[0] in ctx["quick_methods"]]
    for m in methods:
        rates[m[0]] = _rate(test, eps, m, dev, kw)
    spec = _gpu_spec(dev)
    predicted = {r.method: r.seconds for r in rows}
    head = "| method | episodes/s | s per 10,000 | predicted s per 10,000 (" + (
        spec.name if spec else "H100 SXM / H100 PCIe / H200"
    )
    lines = [head + ") |", "|---|---|---|---|"]
    for label, rate in rates.items():
        p = predicted.get(label)
        pred = "-" if p is None else (f"{p[spec.name]:.2f}" if spec else " / ".join(f"{v:.2f}" for v in p.values()))
        lines.append(f"| {label} | {rate:,.1f} | {1e4 / rate:,.2f} | {pred} |")
    rep.add(f"{n} standard episodes per method on {dev} (after a warm-up):\n\n" + "\n".join(lines))
    rep.number("methods timed on the device", len(rates))
    rep.number("POODLE transductive on the device (episodes/s)", f"{rates['poodle']:,.1f}")
    if dev.type == "cuda" and _triton_step.available()[0]:
        from poodle.solvers._optim import TRITON_METHODS as METHODS
        from poodle.solvers._optim import cuda_step

        lines = ["| method | torch step episodes/s | Triton step episodes/s | Triton / torch |", "|---|---|---|---|"]
        for m in [m for m in methods if m[0] in METHODS]:
            with cuda_step("triton"):
                r = _rate(test, eps, m, dev, kw)
            lines.append(f"| {m[0]} | {rates[m[0]]:,.1f} | {r:,.1f} | {r / rates[m[0]]:.2f}x |")
        rep.add("The Triton step (opt-in) against the torch formulation, same episodes:\n\n" + "\n".join(lines))
    rep.add(
        "The cost model (poodle.costmodel, docs/gpu.md): traced per episode on the CPU with the torch formulation; "
        "seconds predicted for 10,000 episodes from published bandwidth and FP32 rates; measured here beside it:\n\n"
        + costmodel.markdown(rows, rates, str(dev))
        + "\n\nThe Triton step, predicted:\n\n"
        + costmodel.triton_markdown(rows)
    )


def extraction(rep: Report, ctx: dict, args: argparse.Namespace) -> None:
    cmd = [sys.executable, "benchmarks/extract.py", "--device", str(ctx["dev"])]
    if args.quick:
        cmd += ["--quick", "--images", "16", "--classes", "2", "--px", "32", "--size", "32", "--repeats", "1"]
        cmd += ["--workers", "0"]
    else:
        cmd += ["--images", "10000", "--backbone", "resnet12"]
    text, wall = _run(cmd, timeout=540)
    rep.add(f"`{' '.join(cmd[1:])}` ({wall:.1f} s):\n\n" + _block(text, 4000))
    m = re.search(r"extract[^\n]*?([\d,.]+) images/s", text)
    rep.number("extraction (images/s)", m.group(1) if m else "see section")


def torchrun(rep: Report, ctx: dict, args: argparse.Namespace) -> None:
    n = min(ctx["torchrun_episodes"], len(ctx.get("solve_acc", ())) or ctx["torchrun_episodes"])
    out_file = ctx["tmp"] / "torchrun.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["-m", "poodle.cli.main", "solve", "--cache", str(ctx["cache"]), "--episodes", str(n), "--transductive"]
    cmd += ["--device", "cuda" if ctx["dev"].type == "cuda" else "cpu", "--out", str(out_file)]
    text, wall = _run(cmd, timeout=300, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    rec = _cell(out_file)
    acc = np.asarray(rec["acc"])
    backend = "NCCL" if ctx["dev"].type == "cuda" else "gloo"
    line = f"`torchrun --standalone --nproc-per-node 1 poodle solve --episodes {n}` ({backend}): {wall:.1f} s, "
    line += f"processes {rec.get('processes')}, accuracy {100 * rec['mean']:.2f}"
    if "solve_acc" in ctx:
        same = int((acc == ctx["solve_acc"][:n]).sum())
        line += f"; per-episode identical to the one-process run's first {n} episodes: {same}/{n}"
        rep.number(f"torchrun ({backend}) vs one process, episodes identical", f"{same}/{n}")
    rep.add(line + "\n\n" + _block(text, 3000))


# ------------------------------------------------------------------ driver


def _features(tmp: Path, quick: bool) -> Path:
    """The generated standard-workload cache (D = 640): 64 base classes (the negative pool), 20 test."""
    per = 60 if quick else 600
    xtr, ytr = solver_bench.clustered(64, per, 640, seed=1)
    xte, yte = solver_bench.clustered(20, per, 640, seed=2, spread=1.2)
    splits = {"train": (xtr, ytr, [f"b{i}" for i in range(64)]), "test": (xte, yte, [f"t{i}" for i in range(20)])}
    return write_arrays(tmp / "features.h5", splits)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--out", type=Path, default=Path("gpu-report.md"), help="the Markdown report")
    ap.add_argument("--quick", action="store_true", help="every section in seconds (CI, on a CPU)")
    ap.add_argument("--episodes", type=int, default=10_000, help="episodes of the solve and throughput runs")
    ap.add_argument("--agree-episodes", type=int, default=300, help="episodes of the CPU-vs-device agreement")
    ap.add_argument("--torchrun-episodes", type=int, default=2000)
    ap.add_argument(
        "--authors-code",
        default=os.environ.get("POODLE_AUTHORS_CODE"),
        help="checkout of github lehduong/poodle for the solver benchmark (default: $POODLE_AUTHORS_CODE)",
    )
    ap.add_argument("--skip", default="", help="sections to leave out, comma-separated (1-8)")
    args = ap.parse_args(argv)
    dev = resolve_device(args.device)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rep = Report()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache = _features(tmp, args.quick)
        test = read_split(cache, "test")
        n = 12 if args.quick else args.episodes
        neg = NegativeSpec("base", costmodel.STANDARD.n_neg)
        eps = sample_episodes(test.labels, EpisodeSpec(way=5, shot=1, query=15, seed=0), n)
        eps, _ = prepare_negatives(eps, neg, cache, 640)
        ctx: dict[str, Any] = dict(dev=dev, tmp=tmp, cache=cache, test=test, episodes=eps, negatives=neg)
        ctx.update(solve_episodes=20 if args.quick else args.episodes)
        ctx.update(agree_episodes=min(n, 6 if args.quick else args.agree_episodes))
        ctx.update(torchrun_episodes=8 if args.quick else args.torchrun_episodes)
        ctx.update(quick_methods=("poodle", "entropy-min", "kmeans"))
        sections: list[tuple[str, str, Callable[[], None]]] = [
            ("1", "1. Environment", lambda: environment(rep, dev, args)),
            ("2", "2. Tests on the device", lambda: tests(rep, dev, args)),
            ("3", "3. poodle solve end to end", lambda: solve_end_to_end(rep, ctx, args)),
            ("4", "4. Solver benchmark", lambda: solver_benchmark(rep, ctx, args)),
            ("5", "5. CPU versus device, per episode", lambda: agreement(rep, ctx, args)),
            ("6", "6. Every method on the device, and the cost model", lambda: methods_throughput(rep, ctx, args)),
            ("7", "7. Extraction throughput", lambda: extraction(rep, ctx, args)),
            ("8", "8. torchrun, one process per GPU", lambda: torchrun(rep, ctx, args)),
        ]
        t0 = time.perf_counter()
        for key, title, fn in sections:
            if key not in skip:
                print(f"gpu check: {title} ...", flush=True)
                rep.run(title, fn)
        header = f"# GPU check: {rep.summary[0][1] if rep.summary else dev}\n\nTotal {time.perf_counter() - t0:.0f} s."
        header += " Generated by `benchmarks/gpu.py` (docs/gpu.md).\n"
        with atomic_path(args.out) as part:
            part.write_text(rep.markdown(header))
    print(f"gpu check: report written to {args.out}; sections failed: {', '.join(rep.failed) or 'none'}")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
