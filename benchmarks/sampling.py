"""Host cost of drawing episodes and negatives.

Prints, per setting, the CPU time (``time.process_time``, which a shared machine's load inflates far
less than wall time) of drawing episodes with the one sampler (:mod:`poodle.sampler`), in seconds
per 10,000, and of making negatives (torch's per-episode draws against the bulk path), in seconds
per 1,000 episodes of ``[400, 640]``; best of ``--repeat`` runs. The synthetic split has
mini-ImageNet's test shape (20 classes of 600 images); the Meta-Dataset rows draw from a split of
100 classes of 40 to 1,300 images (ImageNet-like sizes; ways 5 to 50). ``--check`` also compares
the fixed episodes with torch's own per-episode draws (tests/_episode_reference.py, also the
per-episode column: how poodle drew episodes before it had a bulk path).

    python benchmarks/sampling.py [--episodes 10000] [--negative-episodes 200] [--repeat 3] [--check]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from poodle.episodes import EpisodeSpec, _Draw
from poodle.negatives import NEG_STREAM, generate, sample_indices
from poodle.utils import generator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _episode_reference import reference_episodes  # noqa: E402  (torch's per-episode draws)


def cpu_seconds(f: Callable[[], object]) -> float:
    t = time.process_time()
    f()
    return time.process_time() - t


def per_episode_negatives(kind: str, index: list[int], n_neg: int, dim: int, seed: int) -> torch.Tensor:
    """The negatives as they were made before the bulk path: one episode at a time, then normalised."""
    out = torch.empty(len(index), n_neg, dim)
    for r, i in enumerate(index):
        g = generator(seed, i, NEG_STREAM)
        (torch.rand if kind == "random" else torch.randn)(n_neg, dim, generator=g, out=out[r])
    return torch.nn.functional.normalize(out, dim=-1)


def per_episode_indices(pool: int, index: list[int], n_neg: int, seed: int) -> torch.Tensor:
    return torch.stack([torch.randint(pool, (n_neg,), generator=generator(seed, i, NEG_STREAM)) for i in index])


def compare(name: str, old: Callable[[], object], new: Callable[[], object], repeat: int, scale: float) -> None:
    t_old = t_new = float("inf")
    for _ in range(repeat):  # alternated, so that load on a shared machine falls on both alike
        t_old = min(t_old, cpu_seconds(old))
        t_new = min(t_new, cpu_seconds(new))
    print(f"{name:34s} {t_old * scale:12.3f} {t_new * scale:8.3f} {t_old / t_new:8.1f}x")


def best(f: Callable[[], object], repeat: int) -> float:
    return min(cpu_seconds(f) for _ in range(repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--negative-episodes", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check", action="store_true", help="also check the episodes and negatives against torch's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    labels = torch.arange(20).repeat_interleave(600)
    E = args.episodes
    settings = {
        "balanced 5-way 1-shot": EpisodeSpec(way=5, shot=1, query=15),
        "balanced 5-way 5-shot": EpisodeSpec(way=5, shot=5, query=15),
        "Dirichlet 2 (alpha-TIM), 1-shot": EpisodeSpec(way=5, shot=1, query=15, imbalance=2.0),
        "Dirichlet 0.5, 5-shot": EpisodeSpec(way=5, shot=5, query=15, imbalance=0.5),
        "query classes 2 of 5": EpisodeSpec(way=5, shot=1, query=15, query_classes=2),
        "query classes 3, Dirichlet 1": EpisodeSpec(way=5, shot=1, query=15, imbalance=1.0, query_classes=3),
    }
    print(f"episodes: CPU seconds per 10,000 (best of {args.repeat}; {E:,} drawn; {args.threads} thread(s))")
    print(f"{'setting':34s} {'per-episode':>12s} {'sampler':>8s} {'ratio':>9s}")
    for name, spec in settings.items():
        draw = _Draw(labels, spec)
        one = lambda: reference_episodes(labels, spec, 0, E)  # noqa: E731, B023
        compare(name, one, lambda: draw(0, E), args.repeat, 10_000 / E)  # noqa: B023
        if args.check:
            got, ref = draw(0, E), reference_episodes(labels, spec, 0, E)
            assert all(torch.equal(getattr(got, f), ref[f]) for f in ("support", "query", "query_labels"))
    sizes = np.random.default_rng(0).integers(40, 1301, 100)
    md_labels = torch.from_numpy(np.repeat(np.arange(100), sizes))
    md = {
        "meta-dataset (ways 5-50)": EpisodeSpec.meta_dataset(),
        "meta-dataset 5-way 1-shot": EpisodeSpec.meta_dataset(way=5, shot=1),
    }
    Em = max(1, E // 10)
    for name, spec in md.items():
        draw = _Draw(md_labels, spec)
        print(f"{name:34s} {'':12s} {best(lambda: draw(0, Em), args.repeat) * 10_000 / Em:8.3f}")  # noqa: B023
    En = args.negative_episodes
    idx = list(range(En))
    print(f"\nnegatives [{En}, 400, 640]: CPU seconds per 1,000 episodes (best of {args.repeat})")
    print(f"{'kind':34s} {'per-episode':>12s} {'bulk':>8s} {'ratio':>9s}")
    t = torch.tensor(idx)
    compare(
        "base indices (pool of 38,400)",
        lambda: per_episode_indices(38_400, idx, 400, 0),
        lambda: sample_indices(38_400, t, 400, 0),
        args.repeat,
        1000 / En,
    )
    for kind in ("random", "sphere"):
        old_f = lambda: per_episode_negatives(kind, idx, 400, 640, 0)  # noqa: E731, B023
        new_f = lambda: generate(kind, t, 400, 640, 0)  # noqa: E731, B023
        compare(kind, old_f, new_f, args.repeat, 1000 / En)
        if args.check:
            assert torch.equal(old_f(), new_f())


if __name__ == "__main__":
    main()
