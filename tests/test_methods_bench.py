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


def _floor(us: float, share: float, binds: str = "matmul") -> dict:
    parts = {"matmul": us, "eigh": 0.0, "sweeps": 0.0, "memory": 1.0}
    return {
        "parts": parts, "floor_us": us, "binds": binds, "product": (80, 640, 5), "matmul_class": "batched",
        "product_rate": 20e9, "eigh_order": 0, "plan": None, "sweeps": None, "share": share, "gram": None,
    }  # fmt: skip


def _row(method: str, eps: float, mflop: float, **extra) -> dict:
    return {
        "method": method, "eps_per_s": eps, "eps_per_s_cpu": eps, "flops_per_episode": mflop * 1e6,
        "flop_per_s": eps * mflop * 1e6, "flop_per_s_cpu": eps * mflop * 1e6, "ops_per_call": 5000,
        "floors_us": {"compute": 10.0, "memory": 20.0, "ops": 30.0}, "floor": _floor(500.0, 0.5), **extra,
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
            _row("kmeans", 1000, 1, iterations=3.25, floor=_floor(600.0, 0.499, "eigh")),
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
    # the own floor beside the share of the matmul rate: bold from 50% of it
    assert lines["| TIM-GD"] == (
        "| TIM-GD | 100.0 | 500.00 | 50.00 | **50.0%** | 500 (matmul) | **50.0%** | 40.0 | 4 | 10.0x | 20/20 |"
    )
    assert "| 600 (eigh) | 49.9% |" in lines["| k-means"]
    # the first release row gives the speed; each row's agreement, the one on our L2N rows so named
    assert (
        "| 1.0% | 500 (matmul) | **50.0%** | 300.0 | 30 | 10.0x | 9/10; 10/10 (on our L2N rows) |" in lines["| PT-MAP"]
    )
    assert lines["| PEMnE-BMS"].endswith("| - | - | - | skipped (no checkout) |")
    assert "1.00 (at 3.2 iterations)" in lines["| k-means"] and lines["| k-means"].endswith("| no release |")
    notes = text.split("Below 40% of the matmul rate")[1].split("Own floor per episode")[0]
    assert "TIM-GD" not in notes
    assert "- PT-MAP: Sinkhorn sweeps, memory/latency-bound: 80% of the time, 400 sweeps/episode" in notes
    assert "- PEMnE-BMS: op-count bound: 5,000 torch operations per call" in notes
    assert "- k-means: small operand shapes (no floor explains the time" in notes
    own = text.split("Own floor per episode")[1]
    assert "- PT-MAP: matmul 500 us (80x640x5 at 20.0 GFLOP/s); memory 1 us; binds: matmul" in own


def test_tiny_run_end_to_end_without_releases(mod, monkeypatch, capsys):
    import transductive

    monkeypatch.setattr(transductive, "CALIBRATE", [0.0, 1])
    argv = ["--no-releases", "--methods", "kmeans,paddle", "--chunk", "2", "--tp-seconds", "0", "--repeats", "1"]
    assert mod.main(argv) == 0
    out = capsys.readouterr().out
    assert "| k-means | " in out and "| PADDLE | " in out and "| no release |" in out and "| not run |" in out
    assert "(at " in out.split("| k-means |")[1].splitlines()[0]  # k-means counted at its iterations
    # each with its own floor and the part that binds, in this run's measurements
    for label in ("k-means", "PADDLE"):
        cells = out.split(f"| {label} |")[1].splitlines()[0].split(" | ")
        us, binds = cells[4].split(" (")
        assert float(us) > 0 and binds == "matmul)" and cells[5].rstrip("%*").replace(".", "").isdigit()
    assert "- k-means: matmul " in out.split("Own floor per episode")[1]


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


class _Fixed:
    """A calibration of round numbers: narrow products at 10 GFLOP/s, a Gram matrix's 50 (a large
    matmul 100), eigh 500 us, a sweep 0.5 us, a pass 1 GB/s."""

    large, bandwidth = 100e9, 1e9

    def matmul(self, shape):
        return 50e9 if shape[0] == shape[2] else 10e9

    def eigh(self, order, dtype):
        return 500e-6

    def sweep(self, kind, way, columns):
        return 0.5e-6


def _floors():
    sys.path.insert(0, str(BENCH))
    try:
        import floors

        return floors
    finally:
        sys.path.remove(str(BENCH))


def test_each_method_floor_from_its_declared_parts():
    from poodle import solvers

    floors = _floors()
    shape = (5, 75, 0, 640, 5)
    mem = 1e6 * 4 * 80 * 640 / 1e9  # one pass over the 80 rows: 204.8 us

    def floor(name, flops, sweeps=None):
        return floors.method_floor(name, solvers.make_config(name, {}), shape, flops, _Fixed(), sweeps)

    # PT-MAP: its products at the batched rate plus its measured sweeps at the C loop's speed
    f = floor("pt-map", 10e6, sweeps=400)
    assert f["parts"] == pytest.approx({"matmul": 1000.0, "eigh": 0.0, "sweeps": 200.0, "memory": mem})
    assert f["floor_us"] == pytest.approx(1200.0) and f["binds"] == "matmul" and f["plan"] == (5, 75)
    # PEMnE-BMS: a fixed count of sweeps (20 steps x 50) whatever is measured
    f = floor("bms", 1e6, sweeps=7)
    assert f["sweeps"] == 1000 and f["parts"]["sweeps"] == pytest.approx(500.0) and f["binds"] == "sweeps"
    # protoLP: the Gram matrix and the eigh's 9 n^3 leave the products; the plan spans all 80 samples
    gram, dec = 2.0 * 80 * 80 * 640, 9.0 * 80**3
    f = floor("proto-lp", gram + dec + 1e6, sweeps=100)
    assert f["eigh_order"] == 80 and f["plan"] == (5, 80) and f["product"] == (80, 40, 5)
    assert f["parts"]["matmul"] == pytest.approx(1e6 * gram / 50e9 + 100.0)
    assert f["parts"]["eigh"] == pytest.approx(500.0) and f["parts"]["sweeps"] == pytest.approx(50.0)
    assert f["binds"] == "eigh" and f["floor_us"] == pytest.approx(f["parts"]["matmul"] + 550.0)
    f = floor("bayes-kmeans", gram + dec)
    assert f["binds"] == "eigh" and f["floor_us"] == pytest.approx(500.0 + 1e6 * gram / 50e9)
    # TIM-GD: the fused kernel's products, at the large matmul's rate
    f = floor("tim-gd", 1e9)
    assert f["parts"]["matmul"] == pytest.approx(1e4) and f["matmul_class"] == "large"
    # a method whose arithmetic is below one pass over its rows is held to the pass
    f = floor("proto", 1e5)
    assert f["binds"] == "memory" and f["floor_us"] == pytest.approx(mem)


def test_c_sweep_loop_balances_an_l1_plan():
    import ctypes

    import torch

    floors = _floors()
    lib = floors.sweep_library()
    assert lib is not None  # the system compiler built the loop
    p, s = torch.rand(5, 75, dtype=torch.float32).add_(0.1), torch.empty(75)
    lib.balance_sweeps(ctypes.c_void_p(p.data_ptr()), 5, 75, ctypes.c_float(15.0), 200, ctypes.c_void_p(s.data_ptr()))
    assert torch.allclose(p.sum(1), torch.full((5,), 15.0), rtol=1e-5)  # classes to their mass
    assert torch.allclose(p.sum(0), torch.ones(75), rtol=1e-4)  # samples to 1, converged
    q = torch.rand(5, 75).add_(0.1)
    q[0] *= 1e-3  # one class far under the minimum size
    lib.min_size_sweeps(ctypes.c_void_p(q.data_ptr()), 5, 75, ctypes.c_float(5.0), 1, ctypes.c_void_p(s.data_ptr()))
    assert q.sum(1)[0] == pytest.approx(5.0, rel=1e-5) and (q.sum(1)[1:] > 5.0).all()
    assert 0 < floors.sweep_seconds("balance", 5, 75, lambda fn: (fn(), 1e-3)[1], sweeps=10) == pytest.approx(1e-4)
