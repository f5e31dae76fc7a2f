"""Accuracy under each feature preprocessing (l2n, cl2n, power): proto, POODLE inductive and
transductive, TIM-GD (the POODLE authors' settings: preset poodle-paper, 250 steps), 1 and 5 shots,
on one cache; every cell on the same episodes and negatives.

    python benchmarks/preprocess.py --cache cache/glyphs/conv4_64-....h5 --episodes 500

Prints a Markdown table (accuracy % +- 95% CI) and the settings; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from poodle.cache import read_split
from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.evaluate import evaluate
from poodle.negatives import NegativeSpec
from poodle.preprocess import Preprocessor, parse
from poodle.run import RunOptions
from poodle.stats import mean_ci

METHODS = [
    ("proto", "proto", {}),
    ("POODLE", "poodle", {}),
    ("POODLE transductive", "poodle", {"transductive": True}),
    ("TIM-GD", "tim-gd", {"preset": "poodle-paper"}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True)
    ap.add_argument("--split", default="test")
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--shots", default="1,5")
    ap.add_argument("--preprocess", default="l2n,cl2n,power:0.5")
    ap.add_argument("--negatives", default="base")
    ap.add_argument("--n-neg", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: these solvers run many tiny ops; more threads only add overhead)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    raw = read_split(args.cache, args.split)
    shots = [int(s) for s in args.shots.split(",")]
    kinds = args.preprocess.split(",")
    results: dict[str, dict[str, list[float]]] = {}
    t0 = time.perf_counter()
    for kind in kinds:
        pre = Preprocessor.from_cache(kind, args.cache, log=print)
        feats = pre.split(raw)
        for shot in shots:
            eps = sample_episodes(
                raw.labels,
                EpisodeSpec(split=args.split, way=5, shot=shot, query=15, seed=args.seed),
                args.episodes,
                classes=raw.classes,
            )
            accs = evaluate(
                feats,
                eps,
                METHODS,
                negatives=NegativeSpec(args.negatives, args.n_neg),
                cache_path=args.cache,
                run=RunOptions(device="cpu", workers=args.workers),
                preprocess=pre,
            )
            for label, *_ in METHODS:
                mean, ci = mean_ci(accs[label])
                results.setdefault(f"{label} | {shot}-shot", {})[pre.spec.key] = [100 * mean, 100 * ci]
            print(f"{pre.spec.key} {shot}-shot done ({time.perf_counter() - t0:.0f} s)", flush=True)

    keys = [parse(k).key for k in kinds]
    print(
        f"\n{args.episodes} episodes per cell (5-way, 15 queries per class, seed {args.seed}), negatives "
        f"{args.negatives} x {args.n_neg}; cache {args.cache} split {args.split}"
    )
    print("| method | shots | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for row, vals in results.items():
        method, shot = row.split(" | ")
        print(
            f"| {method} | {shot.split('-')[0]} | "
            + " | ".join(f"{vals[k][0]:.2f} ± {vals[k][1]:.2f}" for k in keys)
            + " |"
        )
    cpu = platform.processor() or platform.machine()
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}, {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
