"""Benchmark of the batched POODLE solver on the standard workload, with the authors' code side by side.

D = 640, 5-way, 15 queries per class, 375 base negatives (the authors' count: way x queries), 250 steps,
POODLE transductive, 1 and 5 shots, on clustered random features written to a temporary cache.
Prints, from one run: the machine (CPU model, torch/numpy/BLAS versions, threads, workers);
episodes/s, peak memory, the FLOP/s of a large matmul measured in the same run, the method's FLOPs
per episode and the fraction of that roofline reached; a straightforward autograd implementation
on a few of the same episodes (float32 cross-check); and, given a checkout of the authors' release
(github lehduong/poodle; ``--authors-code DIR`` or ``POODLE_AUTHORS_CODE=DIR``), their ``poodle()``
on the same episodes and negatives (patched only to run on this device): speed ratio, per-episode
agreement, and the whole-process comparison (``poodle solve`` timed as a subprocess, start-up
included, against their function alone). Last, the GPU cost model (``poodle.costmodel``) of every
iterative method on the standard workload (400 negatives where used): bytes moved and FLOPs per step
and episode, kernel launches and host syncs, the predicted seconds of 10,000 episodes on an H100 SXM,
H100 PCIe and H200 beside the measured episodes/s on this device, and the Triton step's bytes per
step against the torch formulation's.

    python benchmarks/solver.py                 # full workload (2,000 episodes per shot)
    python benchmarks/solver.py --quick         # a few minutes
    POODLE_AUTHORS_CODE=/tmp/ext/poodle python benchmarks/solver.py --authors-episodes 100
    python benchmarks/solver.py --device cuda --episodes 10000
    python benchmarks/solver.py --cost-only     # the cost model and its measurements alone
    python benchmarks/solver.py --methods laplacianshot,kmeans --episodes 2000   # per-method roofline
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from poodle import costmodel, solvers
from poodle.cache import read_split, write_arrays
from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.evaluate import Hooks, evaluate, prepare_negatives
from poodle.negatives import NegativeSpec
from poodle.run import RunOptions
from poodle.solvers import _native
from poodle.solvers.backend import Backend
from poodle.solvers.base import EpisodeBatch
from poodle.stats import mean_ci
from poodle.system import blas
from poodle.utils import resolve_device

D, WAY, QUERY, N_NEG, STEPS = 640, 5, 15, 375, 250


def clustered(n_classes: int, per_class: int, dim: int, seed: int, spread: float = 0.6):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_classes, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres.repeat(per_class, 0) + spread * 4 / np.sqrt(dim) * rng.standard_normal(
        (n_classes * per_class, dim)
    ).astype(np.float32)
    return x, np.arange(n_classes).repeat(per_class)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_summary() -> str:
    """torch's BLAS/LAPACK/oneDNN lines and numpy's BLAS, in one line each (:func:`poodle.system.blas`)."""
    found = blas()
    return f"torch: {found['torch']}\nnumpy {np.__version__} BLAS: {found['numpy']}"


def matmul_flops(device: torch.device, n: int = 2048, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:  # Linux: "5" resets the peak resident set size (VmHWM) of this process
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status("VmRSS")


def peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status("VmHWM")


def autograd_poodle(batch: EpisodeBatch, steps: int, alpha=1.0, beta=0.5) -> torch.Tensor:
    """The authors' way: autograd over [T, n, D] tensors, ||x||^2 recomputed, torch.optim.Adam."""
    s, q, neg = batch.support, batch.query, batch.negatives
    y = torch.nn.functional.one_hot(batch.support_labels, WAY).to(s.dtype)
    w = (y.transpose(1, 2) @ s / y.sum(1).unsqueeze(-1)).clone().requires_grad_(True)
    g = torch.full((s.shape[0], 1, 1), 10.0, dtype=s.dtype, requires_grad=True)
    opt = torch.optim.Adam([w, g], lr=1e-3)
    pos = torch.cat([s, q], 1)

    def get_logits(x):
        return g * (x @ w.transpose(1, 2) - 0.5 * (w**2).sum(-1).unsqueeze(1) - 0.5 * (x**2).sum(-1, keepdim=True))

    for _ in range(steps):
        ls, lp, ln = get_logits(s), get_logits(pos), get_logits(neg)
        ce = -(y * torch.log_softmax(ls, -1)).sum(-1).mean(1).sum()
        pull = -(lp * lp.softmax(-1).detach()).sum(-1).mean(1).sum()
        push = -(ln * ln.softmax(-1).detach()).sum(-1).mean(1).sum()
        loss = ce + alpha * pull - beta * push
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach()


def autograd_side_by_side(sub, test, train, dev: torch.device, cfg, eps_s: float) -> None:
    """The authors' way (:func:`autograd_poodle`) on the episodes ``sub``: its speed against ours
    (``eps_s`` episodes/s) and the largest prototype difference."""
    batch = EpisodeBatch(
        test.features[sub.support],
        sub.support_labels,
        test.features[sub.query],
        train.features[sub.negatives],
        WAY,
    ).to(dev)
    k = batch.n_episodes
    _sync(dev)
    t = time.perf_counter()
    w_ref = autograd_poodle(batch, STEPS)
    _sync(dev)
    dt_ref = time.perf_counter() - t
    w_ours = solvers.run("poodle", batch, cfg).state["prototypes"]
    print(
        f"  autograd (authors' style) on {k} of the same episodes: {k / dt_ref:,.1f} episodes/s "
        f"-> ours is {eps_s / (k / dt_ref):,.1f}x faster; max |prototype difference| "
        f"{float((w_ref - w_ours).abs().max()):.1e}"
    )


# ------------------------------------------------------------------ the authors' release, side by side


class _OnDevice:
    """Stands in for the ``torch`` module inside the authors' file: ``torch.tensor(..., device='cuda:0')``
    lands on our device instead; everything else is torch itself."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def tensor(self, *a, device=None, **k):
        return torch.tensor(*a, device=self._device, **k)


class _FixedDraws:
    """Stands in for ``numpy`` inside the authors' file: ``np.random.randint`` returns our negative
    indices (so both sides see the same negatives); everything else is numpy itself."""

    def __init__(self, idx: np.ndarray) -> None:
        def randint(low, high, size):
            if int(np.prod(size)) != idx.size or high <= int(idx.max()):
                raise RuntimeError(
                    f"the authors' code asked for {size} negatives from {high} rows; we hold {idx.size} indices"
                )
            return idx.reshape(size)

        self.random = types.SimpleNamespace(randint=randint)

    def __getattr__(self, name: str):
        return getattr(np, name)


def load_authors(root: str | None):
    """The authors' ``fsl.poodle`` module from a checkout of github lehduong/poodle, or a reason why not."""
    if not root:
        return None, "no checkout given (--authors-code DIR or POODLE_AUTHORS_CODE=DIR, github lehduong/poodle)"
    src = Path(root) / "src"
    if not (src / "fsl" / "poodle.py").is_file():
        return None, f"{root}: no src/fsl/poodle.py (expected a checkout of github lehduong/poodle)"
    sys.path.insert(0, str(src))
    try:
        return importlib.import_module("fsl.poodle"), ""
    except Exception as e:  # their imports may need packages we do not have
        return None, f"importing {src}/fsl/poodle.py failed: {type(e).__name__}: {e}"


@contextlib.contextmanager
def _cuda_calls_to(device: torch.device):
    """``tensor.cuda()`` moves to ``device`` instead (the only other device-specific call in their file)."""
    before = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self.to(device)
    try:
        yield
    finally:
        torch.Tensor.cuda = before


def run_authors(
    mod, test, train_np: np.ndarray, eps, shot: int, device: torch.device, batch: int
) -> tuple[np.ndarray, float]:
    """Their ``poodle()`` (transductive, alpha 1, beta 0.5, 250 steps) on ``eps`` with our negatives,
    ``batch`` tasks per call as their evaluation does; returns (per-episode accuracy, seconds)."""
    accs, secs = [], 0.0
    args = types.SimpleNamespace(meta_val_way=WAY, number_fc_update=STEPS)
    feats = test.features.numpy()
    for a in range(0, len(eps), batch):
        sub = eps[a : a + batch]
        mod.np = _FixedDraws(sub.negatives.numpy())
        mod.torch = _OnDevice(device)
        g, q = feats[sub.support.numpy()], feats[sub.query.numpy()]
        ys, yq = sub.support_labels.numpy(), sub.query_labels.numpy()
        with _cuda_calls_to(device):
            _sync(device)
            t = time.perf_counter()
            out = mod.poodle(g, q, ys, yq, shot, train_feature=train_np, transductive=True, args=args)
            _sync(device)
            secs += time.perf_counter() - t
        accs.extend(float(x) for x in out)
    return np.asarray(accs), secs


def whole_process(cache: Path, shot: int, n_ep: int, workers: int | None) -> dict:
    """``poodle solve`` on the standard workload as a subprocess: wall seconds, start-up included."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "poodle.cli.main",
            "solve",
            "--cache",
            str(cache),
            "--method",
            "poodle",
            "--transductive",
            "--negatives",
            "base",
            "--n-neg",
            str(N_NEG),
            "--steps",
            str(STEPS),
            "--shot",
            str(shot),
            "--episodes",
            str(n_ep),
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
        if workers:
            cmd += ["--workers", str(workers)]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t
        rec = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        acc = next(r["acc"] for r in rec if r.get("kind") == "cell")
    return {"wall": wall, "acc": np.asarray(acc), "cmd": " ".join(cmd[1:])}


_STARTUP = r"""
import contextlib, os, sys, time
import poodle.cli._common as common  # rich and click only: nothing of the library yet

@contextlib.contextmanager
def first_chunk(*a, **k):
    def advance(n):
        print(time.time(), flush=True)
        os._exit(0)
    advance.start = lambda: None  # the lazy bar's "checks passed" hook
    yield advance

common.progress_bar = first_chunk  # before poodle.cli.solve binds it
from poodle.cli.main import main
sys.argv = ["poodle", "solve"] + sys.argv[1:]
main()
"""


def startup(cache: Path, n_ep: int, reps: int = 3) -> float:
    """Seconds from launching a fresh interpreter to the first chunk of ``poodle solve --episodes
    n_ep`` solved (the real command on the standard workload: its imports, option parsing, cache
    read, episode and negative draws). The driver only swaps the progress bar for one that prints
    the time and exits at the first chunk. Best of ``reps`` launches, like :func:`torch_import`."""
    args = ["--cache", str(cache), "--method", "poodle", "--transductive", "--negatives", "base"]
    args += ["--n-neg", str(N_NEG), "--steps", str(STEPS), "--episodes", str(n_ep), "--device", "cpu"]
    best = float("inf")
    for _ in range(reps):
        t = time.time()
        out = subprocess.run([sys.executable, "-c", _STARTUP, *args], check=True, capture_output=True, text=True).stdout
        best = min(best, float(out.strip().splitlines()[-1]) - t)
    return best


def torch_import(reps: int = 3) -> float:
    """Seconds for a fresh interpreter to import torch and exit (best of ``reps``): the floor under
    any torch program's start-up on this machine."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        best = min(best, time.perf_counter() - t)
    return best


def cost_model_section(test, path: Path, dev: torch.device, n_ep: int, traced: int, workers: int | None) -> str:
    """The cost model's tables with each method's episodes/s measured here on ``n_ep`` standard
    episodes (400 base negatives where the method uses them), as Markdown."""
    wl = costmodel.STANDARD
    rows = costmodel.table(traced_episodes=traced)
    # the Sinkhorn methods again, their loops as the CUDA Triton loop runs them (one launch a call)
    rows += costmodel.table(traced_episodes=traced, fused_sinkhorn=True)
    measured: dict[str, float] = {}
    if n_ep:
        spec = EpisodeSpec(way=wl.way, shot=wl.shot, query=wl.query, seed=1)
        neg = NegativeSpec("base", wl.n_neg)
        eps, _ = prepare_negatives(sample_episodes(test.labels, spec, n_ep), neg, path, test.features.shape[1])
        for method, options in costmodel.ITERATIVE:
            cfg = solvers.make_config(method, options)
            kw = dict(negatives=neg, cache_path=path, run=RunOptions(device=dev, workers=workers))
            evaluate(test, eps[: min(4, n_ep)], [(method, method, cfg)], **kw)  # warm-up
            _sync(dev)
            t = time.perf_counter()
            evaluate(test, eps, [(method, method, cfg)], **kw)
            _sync(dev)
            measured[method] = n_ep / (time.perf_counter() - t)
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return (
        costmodel.markdown(rows, measured, label)
        + "\n\nThe Triton step (poodle/solvers/_triton_step.py), per GPU: seconds for 10,000 episodes with the rows "
        + "streamed from memory every step, and with episode groups resident in half the L2 (group size):\n\n"
        + costmodel.triton_markdown(rows)
    )


# ------------------------------------------------------------------ per-method roofline

# the configuration field that counts a method's iterations, for methods that stop per episode and
# report ``iterations`` in their state: their FLOPs per episode are counted at the mean iterations
_ITER_FIELDS = {"kmeans": "max_iter", "bayes-kmeans": "max_iter", "laplacianshot": "steps"}


def episode_flops(method: str, cfg, iterations: float | None) -> float:
    """FLOPs per episode of ``method`` (its registered count), at ``iterations`` per episode for the
    methods of ``_ITER_FIELDS`` (the count is linear in the iteration field)."""
    info = solvers.get(method)
    args = (WAY, WAY * QUERY, 0, D, WAY)
    field = _ITER_FIELDS.get(method)
    if field is None or iterations is None:
        return float(info.flops(*args, cfg))
    f0, f1 = (info.flops(*args, solvers.make_config(method, {**_fields(cfg), field: k})) for k in (0, 1))
    return float(f0 + iterations * (f1 - f0))


def _fields(cfg) -> dict:
    return {k: v for k, v in solvers.config_dict(cfg).items() if v is not None}


def kernel_ceilings(dev: torch.device, e: int) -> dict[str, float]:
    """GFLOP/s of the kernels these methods are made of, one thread, on a chunk of ``e`` standard
    episodes: the ``[75, 640] x [640, 5]`` distance product, the ``[75, 640] x [640, 75]`` Gram
    product, LaplacianShot's ``[75, 75] x [75, 5]`` kNN product, the ``80 x 80`` symmetric
    eigen-decomposition (9 n^3 FLOPs), a softmax over 5 classes (as 5 FLOPs per value: its rate
    beside the others), and the large matmul."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(e, 80, D, generator=g).to(dev)
    w = torch.randn(e, WAY, D, generator=g).to(dev)
    gram = torch.bmm(x, x.transpose(1, 2))
    knn = (torch.rand(e, 75, 75, generator=g) < 0.04).to(dev, torch.float32)
    y = torch.rand(e, 75, WAY, generator=g).to(dev)
    a, b = torch.randn(1024, 1024, generator=g).to(dev), torch.randn(1024, 1024, generator=g).to(dev)
    cases = {
        "bmm [75,640]x[640,5]": (lambda: torch.bmm(x[:, 5:], w.transpose(1, 2)), 2 * e * 75 * WAY * D),
        "bmm [75,640]x[640,75]": (lambda: torch.bmm(x[:, 5:], x[:, 5:].transpose(1, 2)), 2 * e * 75 * 75 * D),
        "bmm [75,75]x[75,5]": (lambda: torch.bmm(knn, y), 2 * e * 75 * 75 * WAY),
        "eigh 80x80": (lambda: torch.linalg.eigh(gram), 9 * e * 80**3),
        "softmax [75,5]": (lambda: torch.softmax(y, -1), 5 * e * 75 * WAY),
        "matmul 1024^3": (lambda: a @ b, 2 * 1024**3),
    }
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name, (fn, flops) in cases.items():
            best = float("inf")
            for _ in range(5):
                _sync(dev)
                t = time.perf_counter()
                fn()
                _sync(dev)
                best = min(best, time.perf_counter() - t)
            out[name] = flops / best / 1e9
    finally:
        torch.set_num_threads(before)
    return out


def roofline_section(test, dev: torch.device, methods: list[str], n_ep: int, workers: int | None, flops_mm: float):
    """Each method's episodes/s on ``n_ep`` standard episodes (1-shot, no negatives) through
    ``evaluate`` (its chunking and workers), its FLOPs per episode and the fraction of the large-matmul
    rate it reaches, as Markdown; then the one-thread rates of the kernels these methods are made of."""
    spec = EpisodeSpec(way=WAY, shot=1, query=QUERY, seed=3)
    eps = sample_episodes(test.labels, spec, n_ep)
    lines = [
        "| method | episodes/s | iterations (mean) | MFLOP/episode | GFLOP/s | % of matmul |",
        "|---|---|---|---|---|---|",
    ]
    for method in methods:
        cfg = solvers.make_config(method, {})
        iters = None
        if method in _ITER_FIELDS:
            sub = eps[: min(200, n_ep)]
            batch = EpisodeBatch(test.features[sub.support], sub.support_labels, test.features[sub.query], None, WAY)
            done = solvers.run(method, batch.to(dev), cfg).state.get("iterations")
            iters = None if done is None else float(done.double().mean())
        f_ep = episode_flops(method, cfg, iters)
        evaluate(test, eps[:4], [(method, method, cfg)], run=RunOptions(device=dev, workers=workers))  # warm-up
        best = float("inf")
        for _ in range(2):
            _sync(dev)
            t = time.perf_counter()
            evaluate(test, eps, [(method, method, cfg)], run=RunOptions(device=dev, workers=workers))
            _sync(dev)
            best = min(best, time.perf_counter() - t)
        rate = n_ep / best
        it = f"{iters:.2f}" if iters is not None else "-"
        lines.append(
            f"| {method} | {rate:,.1f} | {it} | {f_ep / 1e6:.2f} | {rate * f_ep / 1e9:.2f} | "
            f"{100 * rate * f_ep / flops_mm:.1f}% |"
        )
    ceil = kernel_ceilings(dev, 40)
    mm1 = ceil["matmul 1024^3"]
    kern = ", ".join(f"{k} {v:.1f} GFLOP/s ({100 * v / mm1:.0f}%)" for k, v in ceil.items() if "matmul" not in k)
    return "\n".join(lines) + f"\n\nOne thread, 40 episodes: matmul 1024^3 {mm1:.1f} GFLOP/s; {kern} of it."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="200 episodes, 1-shot only, short cross-checks")
    ap.add_argument("--chunk", type=int, default=None, help="episodes per chunk (default: automatic)")
    ap.add_argument("--max-memory", default=None)
    ap.add_argument("--autograd-episodes", type=int, default=16, help="(at most 8 with --quick; 0 skips it)")
    ap.add_argument(
        "--torch-episodes",
        type=int,
        default=200,
        help="episodes solved again with the torch formulation (no fused kernel), side by side (0 skips it)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="CPU chunks solved at once, each single-threaded (default: the thread count)",
    )
    ap.add_argument(
        "--authors-code",
        default=os.environ.get("POODLE_AUTHORS_CODE"),
        help="checkout of github lehduong/poodle (default: $POODLE_AUTHORS_CODE)",
    )
    ap.add_argument("--authors-episodes", type=int, default=100, help="episodes given to the authors' poodle()")
    ap.add_argument("--authors-batch", type=int, default=50, help="tasks per call of the authors' poodle()")
    ap.add_argument(
        "--process-episodes",
        type=int,
        default=2000,
        help="episodes of the whole-process `poodle solve` run (CPU; default: solve's own default; 0 skips it)",
    )
    ap.add_argument("--startup-episodes", type=int, default=10000, help="episodes of the start-up run (0 skips it)")
    ap.add_argument(
        "--cost-episodes",
        type=int,
        default=200,
        help="episodes each method solves beside the GPU cost model (0: the model alone; --quick: 16)",
    )
    ap.add_argument("--no-cost-model", action="store_true", help="skip the GPU cost model")
    ap.add_argument("--cost-only", action="store_true", help="only the GPU cost model and its measurements")
    ap.add_argument(
        "--methods",
        default=None,
        help="only the per-method roofline table of these methods (comma-separated), on --episodes episodes",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    n_ep = 200 if args.quick and args.episodes == 2000 else args.episodes
    shots = (1,) if args.quick else (1, 5)
    authors, why = load_authors(args.authors_code)

    with tempfile.TemporaryDirectory() as tmp:
        xtr, ytr = clustered(64, 600, D, seed=1)
        xte, yte = clustered(20, 600, D, seed=2, spread=1.2)
        path = write_arrays(
            Path(tmp) / "bench.h5",
            {"train": (xtr, ytr, [f"b{i}" for i in range(64)]), "test": (xte, yte, [f"t{i}" for i in range(20)])},
        )
        test = read_split(path, "test")
        train = read_split(path, "train")
        mm_n = 1024 if args.quick else 2048
        flops_mm = matmul_flops(dev, n=mm_n)
        dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
        print(
            f"device {dev} ({dev_name}); python {platform.python_version()}, torch {torch.__version__}, "
            f"numpy {np.__version__}"
        )
        print(blas_summary())
        print(f"CPU solver formulation: {_native.status()}")
        if args.methods:
            print(
                f"large matmul ({mm_n}^3, float32, {torch.get_num_threads()} thread(s)): "
                f"{flops_mm / 1e9:,.1f} GFLOP/s; workers {args.workers or 'default'}\n"
            )
            print(roofline_section(test, dev, args.methods.split(","), n_ep, args.workers, flops_mm))
            return
        if args.cost_only:
            cost_ep = 16 if args.quick and args.cost_episodes == 200 else args.cost_episodes
            print("\nGPU cost model, standard workload:\n")
            print(cost_model_section(test, path, dev, cost_ep, 2 if args.quick else 4, args.workers))
            return
        print(
            f"torch threads {torch.get_num_threads()}, CPUs visible {len(os.sched_getaffinity(0))}, "
            f"workers {args.workers or ('1' if dev.type != 'cpu' else f'default ({torch.get_num_threads()})')}"
        )
        print(
            f"large matmul ({mm_n}^3, float32, {torch.get_num_threads()} thread(s)): {flops_mm / 1e9:,.1f} GFLOP/s "
            "(the roofline below)"
        )
        info = solvers.get("poodle")
        cfg = solvers.make_config("poodle", {"transductive": True})
        ours_rate: dict[int, float] = {}
        for shot in shots:
            spec = EpisodeSpec(way=WAY, shot=shot, query=QUERY, seed=0)
            eps = sample_episodes(test.labels, spec, n_ep)
            eps, _ = prepare_negatives(eps, NegativeSpec("base", N_NEG), path, D)
            # warm-up (allocator, first-call overheads) on a few episodes
            evaluate(
                test,
                eps[:4],
                [("p", "poodle", cfg)],
                negatives=NegativeSpec("base", N_NEG),
                cache_path=path,
                run=RunOptions(device=dev, chunk_size=args.chunk),
            )
            base = reset_peak(dev)
            stats: dict = {}
            _sync(dev)
            t = time.perf_counter()
            acc = evaluate(
                test,
                eps,
                [("p", "poodle", cfg)],
                negatives=NegativeSpec("base", N_NEG),
                cache_path=path,
                run=RunOptions(device=dev, max_memory=args.max_memory, chunk_size=args.chunk, workers=args.workers),
                hooks=Hooks(stats=stats),
            )["p"]
            _sync(dev)
            dt = time.perf_counter() - t
            pk = peak(dev)
            eps_s = ours_rate[shot] = n_ep / dt
            f_ep = info.flops(WAY * shot, WAY * QUERY, N_NEG, D, WAY, cfg)
            mean, ci = mean_ci(acc)
            print(
                f"\n{shot}-shot, {n_ep} episodes, POODLE transductive, {N_NEG} base negatives, {STEPS} steps, "
                f"chunks of {stats['chunk_size']}, {stats['workers']} worker(s):"
            )
            print(f"  {eps_s:,.1f} episodes/s ({dt:.2f} s); accuracy {100 * mean:.2f} +- {100 * ci:.2f}")
            print(
                f"  peak memory {pk / 2**20:,.0f} MiB ({(pk - base) / 2**20:+,.0f} MiB"
                f" over the {base / 2**20:,.0f} MiB before)"
            )
            print(
                f"  {f_ep / 1e9:.3f} GFLOP per episode -> {f_ep * eps_s / 1e9:,.1f} GFLOP/s = "
                f"{100 * f_ep * eps_s / flops_mm:.1f}% of the matmul roofline"
            )

            if dev.type == "cpu" and _native.usable(test.features) and args.torch_episodes:
                kt = min(args.torch_episodes, n_ep)
                t = time.perf_counter()
                acc_t = evaluate(
                    test,
                    eps[:kt],
                    [("p", "poodle", cfg)],
                    negatives=NegativeSpec("base", N_NEG),
                    cache_path=path,
                    run=RunOptions(device=dev, max_memory=args.max_memory, chunk_size=args.chunk, workers=args.workers),
                    backend=Backend(native=False),
                )["p"]
                dt_t = time.perf_counter() - t
                diff = acc_t != acc[:kt]
                print(
                    f"  torch formulation (no fused kernel) on {kt} of the same episodes: {kt / dt_t:,.1f} episodes/s "
                    f"-> the fused kernel is {eps_s / (kt / dt_t):,.2f}x faster; per-episode accuracy differs in "
                    f"{int(diff.sum())}/{kt} episodes (max |difference| "
                    f"{float((acc_t - acc[:kt]).abs().max()):.4f})"
                )

            k = min(args.autograd_episodes, 8 if args.quick else n_ep, n_ep)
            if k:
                autograd_side_by_side(eps[:k], test, train, dev, cfg, eps_s)

            if authors is None:
                print(f"  authors' poodle(): skipped: {why}")
                continue
            ka = min(args.authors_episodes, 20 if args.quick else n_ep, n_ep)
            a_acc, a_s = run_authors(authors, test, train.features.numpy(), eps[:ka], shot, dev, args.authors_batch)
            same = np.asarray(acc[:ka].numpy() == a_acc)
            print(
                f"  authors' poodle() (github lehduong/poodle, device patched to {dev}) on {ka} of the same episodes"
                f" and negatives, {args.authors_batch} tasks per call: {ka / a_s:,.2f} episodes/s -> ours is "
                f"{eps_s / (ka / a_s):,.1f}x faster; per-episode accuracy identical on {int(same.sum())}/{ka}, "
                f"max |difference| {float(np.abs(acc[:ka].numpy() - a_acc).max()):.4f}"
            )
            if dev.type == "cpu" and args.process_episodes and not args.quick:
                wp = whole_process(path, shot, args.process_episodes, args.workers)
                rate = args.process_episodes / wp["wall"]
                print(
                    f"  whole process: `{wp['cmd']}`: {wp['wall']:.1f} s wall = {rate:,.2f} episodes/s, start-up "
                    f"included -> {rate / (ka / a_s):,.1f}x the authors' poodle() alone"
                )

        if not args.no_cost_model:
            cost_ep = 16 if args.quick and args.cost_episodes == 200 else args.cost_episodes
            print("\nGPU cost model, standard workload (poodle.costmodel; docs/gpu.md):\n")
            print(cost_model_section(test, path, dev, cost_ep, 2 if args.quick else 4, args.workers))

        if dev.type == "cpu" and args.startup_episodes:
            s0 = startup(path, args.startup_episodes)
            s_torch = torch_import()
            print(
                f"\nstart-up: {s0:.2f} s from launching python to the first chunk solved of a "
                f"{args.startup_episodes:,}-episode run (imports, cache read, draws included); "
                f"`python -c 'import torch'` alone takes {s_torch:.2f} s here, so poodle's own part is "
                f"{s0 - s_torch:.2f} s"
            )


if __name__ == "__main__":
    main()
