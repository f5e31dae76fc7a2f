"""Behaviour check: the demo's table cells, solved as a grid by this version, against the per-cell
files the demo before the results layer wrote on the same cache (``cache/glyphs/demo/cells``), on
the first N episodes of its 2,000 (episode i depends only on (seed, i)).

    python benchmarks/demo_equivalence.py [N]     # in a checkout whose cache/ holds such a demo
"""

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from poodle.demo import DATASET, DemoConfig, _old_cell_path, demo_grid, demo_rows
from poodle.grid import expand, fingerprints, run_grid

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
full = DemoConfig(cache_root="cache")
cfg = DemoConfig(cache_root="cache", episodes=N)
demo_dir = Path("cache") / DATASET / "demo"
features = next((Path("cache") / DATASET).glob("conv4_64-demo-*.h5"))
spec = demo_grid(cfg, demo_rows(cfg.competitors), features, demo_dir)
cells = expand(spec)
sha = fingerprints(spec, cells)[cells[0].cache]
t = time.perf_counter()
run = run_grid(spec, Path(tempfile.mkdtemp()) / "r.jsonl", device="cpu", cells=cells, cells_per_call=len(cells))
print(f"{len(cells)} cells x {N} episodes solved in {time.perf_counter() - t:.1f} s")
nq = cfg.way * cfg.query
same = 0
for c, rec in zip(cells, run.records):
    c2000 = dataclasses.replace(c, episode={**c.episode, "episodes": full.episodes})
    old = _old_cell_path(full, c2000, sha, demo_dir)
    a = [round(x * nq) for x in json.loads(old.read_text())["accuracy"][:N]]
    b = [round(x * nq) for x in rec["acc"]]
    ok = a == b
    same += ok
    print(
        f"{c.label:14s} shot={c.episode['shot']} transductive={c.transductive!s:5s} "
        f"{'identical' if ok else 'DIFFERENT'} ({sum(x != y for x, y in zip(a, b))} episodes differ)"
    )
print(f"identical per-episode accuracies: {same} of {len(cells)} cells")
