"""Host cost of drawing episodes and negatives: the bulk path against torch's per-episode path.

Prints seconds per 10,000 episodes (drawing) and per 1,000 episodes (negatives), best of
``--repeat`` runs, old and new alternated in one process so that a shared machine's load falls on
both alike. The synthetic split is mini-ImageNet's test split in shape (20 classes of 600 images).

    python benchmarks/sampling.py [--episodes 10000] [--repeat 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from poodle.episodes import EpisodeSpec, _Draw
from poodle.negatives import generate, sample_indices


def best(f: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--negative-episodes", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    labels = torch.arange(20).repeat_interleave(600)
    E = args.episodes
    settings = {
        "balanced 5-way 1-shot": EpisodeSpec(way=5, shot=1, query=15),
        "balanced 5-way 5-shot": EpisodeSpec(way=5, shot=5, query=15),
        "imbalanced kappa=2, 1-shot": EpisodeSpec(way=5, shot=1, query=15, imbalance=2.0),
        "imbalanced kappa=0.5, 5-shot": EpisodeSpec(way=5, shot=5, query=15, imbalance=0.5),
        "query classes 2 of 5": EpisodeSpec(way=5, shot=1, query=15, query_classes=2),
    }
    print(f"episodes: seconds per 10,000 (best of {args.repeat}, {E:,} drawn, {args.threads} thread(s))")
    print(f"{'setting':32s} {'per-episode':>12s} {'bulk':>8s} {'speed-up':>9s}")
    for name, spec in settings.items():
        old, new = _Draw(labels, spec, bulk=False), _Draw(labels, spec)
        t_old = t_new = float("inf")
        for _ in range(args.repeat):  # alternate, so that load on a shared machine falls on both
            t_old = min(t_old, best(lambda: old(0, E), 1))  # noqa: B023 (called at once)
            t_new = min(t_new, best(lambda: new(0, E), 1))  # noqa: B023
        scale = 10_000 / E
        print(f"{name:32s} {t_old * scale:12.3f} {t_new * scale:8.3f} {t_old / t_new:8.1f}x")
    En = args.negative_episodes
    idx = torch.arange(En)
    print(f"\nnegatives [{En}, 400, 640]: seconds per 1,000 episodes (best of {args.repeat})")
    for name, f in {
        "base indices (pool 38,400)": lambda: sample_indices(38_400, idx, 400, 0),
        "random": lambda: generate("random", idx, 400, 640, 0),
        "sphere": lambda: generate("sphere", idx, 400, 640, 0),
    }.items():
        print(f"{name:32s} {best(f, args.repeat) * 1000 / En:8.3f}")


if __name__ == "__main__":
    main()
