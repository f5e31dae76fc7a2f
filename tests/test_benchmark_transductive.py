"""benchmarks/transductive.py writes through the results layer: a re-run solves only the missing
cells, a record of another cache is never reused, and the table is built from the records."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from poodle.results import cache_identity, read_results

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "transductive.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_transductive", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(bench, monkeypatch, cache, out, *extra):
    """Run the benchmark; the labels of the cells it solved (the pipeline's calls of evaluate)."""
    import poodle.pipeline as pl

    keys: list[str] = []
    real = pl.evaluate

    def counting(features, eps, methods, **kw):
        keys.extend(key for key, _, _ in methods)  # the pipeline labels a call's methods by results key
        return real(features, eps, methods, **kw)

    monkeypatch.setattr(pl, "evaluate", counting)
    argv = ["--cache", str(cache), "--episodes", "4", "--shots", "1", "--n-neg", "16", "--chunk", "4"]
    argv += ["--skip-throughput", "--out", str(out), *extra]
    assert bench.main(argv) == 0
    labels = {r["key"]: r["label"] for r in read_results(out / bench.RESULTS_FILE).records}
    return [labels[k] for k in keys]


def test_records_resume_and_table(bench, monkeypatch, tmp_path):
    cache = bench.synthetic_cache(tmp_path / "a", dim=16)
    out = tmp_path / "out"
    rows = ["--imbalance", "none,1", "--rows", "proto,kmeans,POODLE-B beta=0.5"]
    solved = _run(bench, monkeypatch, cache, out, *rows)
    assert sorted(solved) == sorted(["Inductive (proto)", "k-means", "POODLE-B beta=0.5"] * 2)
    res = read_results(out / bench.RESULTS_FILE)
    assert len(res) == 6 and {r["cache_id"] for r in res.records} == {cache_identity(cache)}
    before = {r["key"]: r["acc"] for r in res.records}
    md = (out / "transductive.md").read_text()
    assert "| Method | balanced, 1-shot | κ=1, 1-shot |" in md and "| k-means |" in md
    summary = json.loads((out / "transductive.json").read_text())["accuracy"]
    assert set(summary["results"]) == {"1-shot/none", "1-shot/1"}
    assert not list(out.glob("*.partial.json"))

    # a row added: only its cells are solved, the others are taken from the file unchanged
    solved = _run(
        bench, monkeypatch, cache, out, "--imbalance", "none,1", "--rows", "proto,kmeans,bd-cspn,POODLE-B beta=0.5"
    )
    assert solved == ["BD-CSPN", "BD-CSPN"]
    res = read_results(out / bench.RESULTS_FILE)
    assert len(res) == 8 and all(res.get(k)["acc"] == acc for k, acc in before.items())
    assert "| BD-CSPN |" in (out / "transductive.md").read_text()

    # the same cells on another cache are all solved again, and the first cache's records stay
    other = bench.synthetic_cache(tmp_path / "b", dim=16, seed=1)
    solved = _run(bench, monkeypatch, other, out, *rows)
    assert len(solved) == 6
    assert len(read_results(out / bench.RESULTS_FILE)) == 14


def test_query_classes_columns(bench, monkeypatch, tmp_path):
    cache = bench.synthetic_cache(tmp_path, dim=16)
    out = tmp_path / "out"
    _run(bench, monkeypatch, cache, out, "--imbalance", "none", "--query-classes", "all,2", "--rows", "proto")
    md = (out / "transductive.md").read_text()
    assert "| Method | N=all, 1-shot | N=2, 1-shot |" in md
    recs = read_results(out / bench.RESULTS_FILE).records
    assert sorted(str(r["episode"].get("query_classes")) for r in recs) == ["2", "None"]


def test_roofline_part_counts_what_it_reports(bench, tmp_path, monkeypatch):
    # part 3 on PADDLE (no Sinkhorn), PEMnE-BMS (its sweeps counted), PT-MAP and protoLP (their C
    # loops' sweeps counted: the fused loop's and the fused step's), the 64-d set from a cache
    monkeypatch.setattr(bench, "CALIBRATE", [0.0, 1])
    cache = bench.synthetic_cache(tmp_path / "c", dim=64)
    methods = "paddle,bms,pt-map,proto-lp"
    argv = ["--skip-accuracy", "--skip-throughput", "--roofline", "--methods", methods, "--shots", "1"]
    argv += ["--roofline-cache", str(cache), "--roofline-chunk", "4", "--tp-seconds", "0", "--repeats", "1"]
    argv += ["--out", str(tmp_path / "o")]
    assert bench.main(argv) == 0
    rf = json.loads((tmp_path / "o" / "transductive.json").read_text())["roofline"]
    rows = {(r["method"], r["dim"]): r for r in rf["rows"]}
    assert set(rows) == {(m, d) for m in methods.split(",") for d in (640, 64)}
    assert rows[("bms", 640)]["sweeps_per_episode"] == 20 * 50  # steps x sweeps, every episode
    assert "sweep_share" not in rows[("paddle", 640)]
    for r in rows.values():
        assert r["eps_per_s"] > 0 and r["ops_per_call"] > 0 and r["flops_per_episode"] > 0
    assert "| bms | random 640-d | 1 | 4 |" in (tmp_path / "o" / "transductive.md").read_text()
    # each method's own floor, from its declared parts: PEMnE-BMS's fixed sweeps on its [5, 75] plan
    for r in rows.values():
        fl = r["floor"]
        assert set(fl["parts"]) == {"matmul", "eigh", "sweeps", "memory"} and fl["binds"] in fl["parts"]
        compute = fl["parts"]["matmul"] + fl["parts"]["eigh"] + fl["parts"]["sweeps"]
        assert fl["floor_us"] == max(fl["parts"]["memory"], compute) > 0 and fl["share"] > 0
    assert rows[("bms", 640)]["floor"]["sweeps"] == 1000 and rows[("bms", 640)]["floor"]["plan"] == [5, 75]
    assert rows[("bms", 640)]["floor"]["parts"]["sweeps"] > 0 and rows[("paddle", 64)]["floor"]["plan"] is None
    for m in ("pt-map", "proto-lp"):  # a balanced loop runs until it converges: at least one sweep a step
        assert rows[(m, 640)]["floor"]["sweeps"] == rows[(m, 640)]["sweeps_per_episode"] >= 1
        assert rows[(m, 640)]["floor"]["parts"]["sweeps"] > 0
    assert "Own floors per episode" in (tmp_path / "o" / "transductive.md").read_text()
