"""Benchmark of the batched POODLE solver on the standard workload.

D = 640, 5-way, 15 queries per class, 400 base negatives, 250 steps, POODLE transductive, 1 and 5
shots, on clustered random features written to a temporary cache. Prints, from one run: episodes/s,
peak memory, the FLOP/s of a large matmul measured in the same run, the method's FLOPs per episode
and the fraction of that roofline reached; then a straightforward autograd implementation (the
authors' style: [T, n, D] tensors, ||x||^2 recomputed every step, torch.optim.Adam) on the same
episodes, for context and as a float32 cross-check.

    python benchmarks/solver.py                 # full workload (2,000 episodes per shot)
    python benchmarks/solver.py --quick         # under a minute
    python benchmarks/solver.py --device cuda --episodes 10000
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from poodle import solvers
from poodle.cache import read_split, write_arrays
from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.evaluate import evaluate, prepare_negatives, summarize
from poodle.negatives import NegativeSpec
from poodle.solvers.base import EpisodeBatch
from poodle.utils import resolve_device

D, WAY, QUERY, N_NEG, STEPS = 640, 5, 15, 400, 250


def clustered(n_classes: int, per_class: int, dim: int, seed: int, spread: float = 0.6):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_classes, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres.repeat(per_class, 0) + spread * 4 / np.sqrt(dim) * rng.standard_normal(
        (n_classes * per_class, dim)).astype(np.float32)
    return x, np.arange(n_classes).repeat(per_class)


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
    return 2 * n ** 3 / best


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
        return g * (x @ w.transpose(1, 2) - 0.5 * (w ** 2).sum(-1).unsqueeze(1) - 0.5 * (x ** 2).sum(-1, keepdim=True))

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="200 episodes, 1-shot only, short autograd check")
    ap.add_argument("--chunk", type=int, default=None, help="episodes per chunk (default: automatic)")
    ap.add_argument("--max-memory", default="2GiB")
    ap.add_argument("--autograd-episodes", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--workers", type=int, default=None,
                    help="CPU chunks solved at once, each single-threaded (default: the thread count)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    n_ep = 200 if args.quick and args.episodes == 2000 else args.episodes
    shots = (1,) if args.quick else (1, 5)

    with tempfile.TemporaryDirectory() as tmp:
        xtr, ytr = clustered(64, 120, D, seed=1)
        xte, yte = clustered(20, 200, D, seed=2, spread=1.2)
        path = write_arrays(Path(tmp) / "bench.h5", {"train": (xtr, ytr, [f"b{i}" for i in range(64)]),
                                                     "test": (xte, yte, [f"t{i}" for i in range(20)])})
        test = read_split(path, "test")
        flops_mm = matmul_flops(dev)
        print(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor() or platform.machine()}), "
              f"torch {torch.__version__}, threads {torch.get_num_threads()}")
        print(f"large matmul (2048^3, float32): {flops_mm / 1e9:,.1f} GFLOP/s")
        info = solvers.get("poodle")
        cfg = solvers.make_config("poodle", {"transductive": True})
        for shot in shots:
            spec = EpisodeSpec(way=WAY, shot=shot, query=QUERY, seed=0)
            eps = sample_episodes(test.labels, spec, n_ep)
            eps, _ = prepare_negatives(eps, NegativeSpec("base", N_NEG), path, D)
            # warm-up (allocator, first-call overheads) on a few episodes
            evaluate(test, eps[:4], [("p", "poodle", cfg)], negatives=NegativeSpec("base", N_NEG), cache_path=path,
                     device=dev, chunk_size=args.chunk)
            base = reset_peak(dev)
            stats: dict = {}
            _sync(dev)
            t = time.perf_counter()
            acc = evaluate(test, eps, [("p", "poodle", cfg)], negatives=NegativeSpec("base", N_NEG), cache_path=path,
                           device=dev, max_memory=args.max_memory, chunk_size=args.chunk, stats=stats,
                           workers=args.workers)["p"]
            _sync(dev)
            dt = time.perf_counter() - t
            pk = peak(dev)
            eps_s = n_ep / dt
            f_ep = info.flops(WAY * shot, WAY * QUERY, N_NEG, D, WAY, cfg)
            mean, ci = summarize(acc)
            print(f"\n{shot}-shot, {n_ep} episodes, POODLE transductive, {N_NEG} base negatives, {STEPS} steps, "
                  f"chunks of {stats['chunk_size']}, {stats['workers']} worker(s):")
            print(f"  {eps_s:,.1f} episodes/s ({dt:.2f} s); accuracy {100 * mean:.2f} +- {100 * ci:.2f}")
            print(f"  peak memory {pk / 2**20:,.0f} MiB ({(pk - base) / 2**20:+,.0f} MiB over the {base / 2**20:,.0f} MiB before)")
            print(f"  {f_ep / 1e9:.3f} GFLOP per episode -> {f_ep * eps_s / 1e9:,.1f} GFLOP/s = "
                  f"{100 * f_ep * eps_s / flops_mm:.1f}% of the matmul roofline")

            k = min(args.autograd_episodes if not args.quick else 8, n_ep)
            sub = eps[:k]
            batch = EpisodeBatch(test.features[sub.support], sub.support_labels, test.features[sub.query],
                                 read_split(path, "train").features[sub.negatives], WAY).to(dev)
            _sync(dev)
            t = time.perf_counter()
            w_ref = autograd_poodle(batch, STEPS)
            _sync(dev)
            dt_ref = time.perf_counter() - t
            w_ours = solvers.run("poodle", batch, cfg).state["prototypes"]
            print(f"  autograd (authors' style) on {k} of the same episodes: {k / dt_ref:,.1f} episodes/s "
                  f"-> ours is {eps_s / (k / dt_ref):,.1f}x faster; max |prototype difference| "
                  f"{float((w_ref - w_ours).abs().max()):.1e}")


if __name__ == "__main__":
    main()
