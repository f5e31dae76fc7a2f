"""How far a transductive method moves the prototype classifier's predictions, on a feature cache.

For each method, on the same episodes: its accuracy, the prototype classifier's, the paired
difference, and the share of queries whose predicted label differs from the prototype classifier's.
Used for docs/transductive.md's statement about entropy-min's defaults.

    python benchmarks/prediction_drift.py --cache cache/glyphs/conv4_64-demo-XXXX.h5 --method entropy-min
    python benchmarks/prediction_drift.py --cache FILE --method entropy-min --set lr=1e-3 --shot 5
    python benchmarks/prediction_drift.py --synthetic 640,6 --method entropy-min     # low-margin features

``--synthetic D,SPREAD``: instead of a cache, 20 classes x 100 random features in D dimensions,
unit-normalised Gaussian class centres plus Gaussian noise of norm about SPREAD (6 at D=640 gives a
1-shot prototype accuracy near 40%: low margins).
"""

from __future__ import annotations

import argparse
import platform

import torch

from poodle import solvers
from poodle.cache import read_split
from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.solvers import EpisodeBatch
from poodle.stats import mean_ci, paired_difference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache")
    ap.add_argument("--synthetic", metavar="D,SPREAD")
    ap.add_argument("--split", default="test")
    ap.add_argument("--method", action="append", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="options for every method")
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--shot", type=int, default=1)
    ap.add_argument("--query", type=int, default=15)
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=100)
    a = ap.parse_args()
    opts = dict(kv.split("=", 1) for kv in a.set)
    if a.synthetic:
        dim, spread = int(a.synthetic.split(",")[0]), float(a.synthetic.split(",")[1])
        g = torch.Generator().manual_seed(a.seed)
        centres = torch.nn.functional.normalize(torch.randn(20, dim, generator=g), dim=-1)
        x = centres.repeat_interleave(100, 0) + spread * torch.randn(2000, dim, generator=g) / dim**0.5
        x = torch.nn.functional.normalize(x, dim=-1)
        labels, classes, source = torch.arange(20).repeat_interleave(100), None, f"synthetic D={dim} spread {spread}"
    elif a.cache:
        feats = read_split(a.cache, a.split)
        x, labels, classes, source = feats.features.float(), feats.labels, feats.classes, f"{a.cache} ({feats.dim}-d)"
    else:
        ap.error("give --cache FILE or --synthetic D,SPREAD")
    spec = EpisodeSpec(split=a.split, way=a.way, shot=a.shot, query=a.query, seed=a.seed)
    eps = sample_episodes(labels, spec, a.episodes, classes=classes)
    print(
        f"{source}, {a.episodes} episodes {a.way}-way {a.shot}-shot, seed {a.seed}; "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}"
    )
    preds: dict[str, list[torch.Tensor]] = {m: [] for m in ["proto"] + a.method}
    for lo in range(0, a.episodes, a.chunk):
        sl = slice(lo, lo + a.chunk)
        batch = EpisodeBatch(x[eps.support[sl]], eps.support_labels[sl], x[eps.query[sl]], None, a.way)
        for m in preds:
            cfg = solvers.make_config(m, opts if m != "proto" else {})
            preds[m].append(solvers.run(m, batch, cfg).log_probs.argmax(-1))
    y = eps.query_labels
    base = torch.cat(preds["proto"])
    acc0 = (base == y).double().mean(1)
    print(f"proto: {100 * mean_ci(acc0)[0]:.2f} ± {100 * mean_ci(acc0)[1]:.2f}")
    for m in a.method:
        p = torch.cat(preds[m])
        acc = (p == y).double().mean(1)
        d, dci = paired_difference(acc, acc0)
        moved = (p != base).double().mean().item()
        print(
            f"{m} {opts or ''}: {100 * mean_ci(acc)[0]:.2f} ± {100 * mean_ci(acc)[1]:.2f}; "
            f"vs proto {100 * d:+.2f} ± {100 * dci:.2f} points; predictions changed {100 * moved:.1f}%"
        )


if __name__ == "__main__":
    main()
