"""benchmarks/methods.py: the per-method table from roofline rows and release rows (the share of the
matmul rate in bold from 40%, the limit named below it, the release columns or why they are empty),
a tiny run end to end, and the releases skipped cleanly without checkouts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def mod():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("methods_bench", BENCH / "methods.py")
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        return m
    finally:
        sys.path.remove(str(BENCH))


def _row(method: str, eps: float, mflop: float, **extra) -> dict:
    return {
        "method": method, "eps_per_s": eps, "eps_per_s_cpu": eps, "flops_per_episode": mflop * 1e6,
        "flop_per_s": eps * mflop * 1e6, "flop_per_s_cpu": eps * mflop * 1e6, "ops_per_call": 5000,
        "floors_us": {"compute": 10.0, "memory": 20.0, "ops": 30.0}, **extra,
    }  # fmt: skip


def test_table_marks_40_percent_and_names_each_limit(mod):
    # matmul 100 GFLOP/s: tim-gd 50 GFLOP/s (50%), pt-map 1 GFLOP/s with its sweeps 80% of the time,
    # bms 1 GFLOP/s whose op floor explains most of its 1000 us, kmeans 1 GFLOP/s that no floor explains
    sinkhorn = {"sweep_share": 0.8, "sweeps_per_episode": 400, "sweep_us": 2.0, "bound_us": 0.5}
    rf = {
        "matmul_flops": 100e9, "matmul_flops_cpu": 100e9, "sweep_clock": "wall",
        "rows": [
            _row("tim-gd", 100, 500), _row("pt-map", 1000, 1, **sinkhorn),
            _row("bms", 1000, 1, floors_us={"compute": 10, "memory": 100, "ops": 800}),
            _row("kmeans", 1000, 1, iterations=3.25),
        ],
    }  # fmt: skip
    rel = [
        {"method": "tim-gd", "ours_eps": 40.0, "their_eps": 4.0, "ratio": 10.0, "identical": 20, "n": 20, "note": ""},
        {"method": "pt-map", "ours_eps": 300.0, "their_eps": 30.0, "ratio": 10.0, "identical": 9, "n": 10, "note": ""},
        {"method": "pt-map", "ours_eps": 300.0, "their_eps": 3.0, "ratio": 100.0, "identical": 10, "n": 10, "note": ""},
    ]
    for r, kind in zip(rel, ["raw", "raw", "l2n"]):
        r["kind"] = kind
    text = mod.table(rf, rel, compared=True)
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert lines["| TIM-GD"] == "| TIM-GD | 100.0 | 500.00 | 50.00 | **50.0%** | 40.0 | 4 | 10.0x | 20/20 |"
    # the first release row gives the speed; each row's agreement, the one on our L2N rows so named
    assert "| 1.0% | 300.0 | 30 | 10.0x | 9/10; 10/10 (on our L2N rows) |" in lines["| PT-MAP"]
    assert lines["| PEMnE-BMS"].endswith("| - | - | - | skipped (no checkout) |")
    assert "1.00 (at 3.2 iterations)" in lines["| k-means"] and lines["| k-means"].endswith("| no release |")
    notes = text.split("Below 40% of the matmul rate")[1]
    assert "TIM-GD" not in notes
    assert "- PT-MAP: Sinkhorn sweeps, memory/latency-bound: 80% of the time, 400 sweeps/episode" in notes
    assert "- PEMnE-BMS: op-count bound: 5,000 torch operations per call" in notes
    assert "- k-means: small operand shapes (no floor explains the time" in notes


def test_tiny_run_end_to_end_without_releases(mod, monkeypatch, capsys):
    import transductive

    monkeypatch.setattr(transductive, "CALIBRATE", [0.0, 1])
    argv = ["--no-releases", "--methods", "kmeans,paddle", "--chunk", "2", "--tp-seconds", "0", "--repeats", "1"]
    assert mod.main(argv) == 0
    out = capsys.readouterr().out
    assert "| k-means | " in out and "| PADDLE | " in out and "| no release |" in out and "| not run |" in out
    assert "(at " in out.split("| k-means |")[1].splitlines()[0]  # k-means counted at its iterations


def test_releases_are_skipped_cleanly_without_checkouts(mod, monkeypatch, capsys):
    import compare_official

    for k in [k for k in dict(__import__("os").environ) if k.startswith("POODLE_OFFICIAL_")]:
        monkeypatch.delenv(k)
    for name in ("write_synthetic", "run_all"):  # nothing is drawn or solved
        monkeypatch.setattr(compare_official, name, lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    assert mod.releases(mod.parse(["--methods", "pt-map,kmeans", "--episodes", "3"])) == []
    out = capsys.readouterr().out
    assert "pt-map: skipped (give --checkout pt-map=PATH, POODLE_OFFICIAL_PT_MAP or --checkouts DIR)" in out
    assert "kmeans" not in out  # no release: not asked for
