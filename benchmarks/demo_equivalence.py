"""Behaviour check: re-solve the cells of a results file with this version and compare every
episode's accuracy with the stored one.

Each record's cell is rebuilt from its identity (method, resolved options, episode setting,
negatives, preprocessing) and solved through the pipeline on the first N of its episodes (episode i
depends only on (seed, i), so they are the first N stored). The cache must be the one the record
was made from (its content fingerprint is checked).

    python benchmarks/demo_equivalence.py                       # the demo's table, 200 episodes per cell
    python benchmarks/demo_equivalence.py RESULTS.jsonl [N]      # any results file (solve --out, grid, demo)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from poodle.cells import Cell, make_cell, numbered
from poodle.pipeline import RunOptions, run_cells
from poodle.results import cache_identity, read_results

DEMO_RESULTS = Path("cache") / "glyphs" / "demo" / "results.jsonl"


def cell_of(record: dict[str, Any], n: int) -> Cell:
    """The cell a record was solved from, on its first ``n`` episodes."""
    values = {**record["episode"], "episodes": min(n, record["episode"]["episodes"])}
    values.update(record["options"], cache=record["cache"], method=record["method"])
    if record["negatives"] != "none":
        values.update(negatives=record["negatives"], n_neg=record["n_neg"])
    if record.get("preprocess"):
        values["preprocess"] = record["preprocess"]
    return make_cell(values, label=record["label"], strict=set(record["options"]))


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DEMO_RESULTS
    n = int(argv[1]) if len(argv) > 1 else 200
    records = sorted(read_results(path).records, key=lambda r: r.get("index", 0))
    cells = numbered([cell_of(r, n) for r in records])
    for c, r in zip(cells, records):
        if cache_identity(c.cache_file) != r["cache_id"]:
            print(f"{c.label}: {c.cache_file} is not the cache this record was solved on; skipped")
            return 2
    t = time.perf_counter()
    run = run_cells(cells, out=Path(tempfile.mkdtemp()) / "r.jsonl", options=RunOptions(cells_per_call=len(cells)))
    print(f"{len(cells)} cells x {n} episodes solved in {time.perf_counter() - t:.1f} s")
    same = 0
    for c, old, new in zip(cells, records, run.records):
        nq = c.spec.n_query
        a = [round(x * nq) for x in old["acc"][:n]]
        b = [round(x * nq) for x in new["acc"]]
        ok = a == b
        same += ok
        print(
            f"{c.label:14s} shot={c.episode['shot']} transductive={c.transductive!s:5s} "
            f"{'identical' if ok else 'DIFFERENT'} ({sum(x != y for x, y in zip(a, b))} episodes differ)"
        )
    print(f"identical per-episode accuracies: {same} of {len(cells)} cells")
    return 0 if same == len(cells) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
