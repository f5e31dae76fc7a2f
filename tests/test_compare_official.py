"""benchmarks/compare_official.py without the authors' checkouts: every method is skipped with a
message naming what to give, nothing is solved, the exit status is 0; and the episodes handed to
the PT-MAP family's scripts are in their shot-major layout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_every_method_is_skipped_cleanly_without_a_checkout(monkeypatch, capsys):
    for k in [k for k in dict(__import__("os").environ) if k.startswith("POODLE_OFFICIAL_")]:
        monkeypatch.delenv(k)
    mod = _load("compare_official")
    monkeypatch.setattr(mod, "run_ours", lambda *a, **k: (_ for _ in ()).throw(AssertionError("solved")))
    assert mod.main(["--synthetic", "relu", "--dim", "8", "--episodes", "3"]) == 0
    out = capsys.readouterr().out
    for method in mod.METHODS:
        env = "POODLE_OFFICIAL_" + method.upper().replace("-", "_")
        assert out.count(f"{method}: skipped (give --checkout {method}=PATH, {env}, ") == 1  # once per method
    assert "POODLE_OFFICIAL_DIR=DIR with DIR/LaplacianShot from imtiazziko/LaplacianShot" in out


def test_our_side_is_a_poodle_solve_process_and_shows_its_command(tmp_path):
    mod = _load("compare_official")
    a = mod.parse(["--synthetic", "relu", "--dim", "8", "--episodes", "3"])
    cache = mod.write_synthetic(a.synthetic, tmp_path, a.dim, a.seed)
    ours = mod.run_ours(cache, mod.episode_file(a, cache, tmp_path), "proto", ("--preprocess", "l2n"))
    assert ours["cmd"].startswith(f"poodle solve --cache {cache} --episodes-from ")  # runnable as shown
    assert ours["cmd"].endswith("--method proto --preprocess l2n") and len(ours["acc"]) == 3 and ours["wall"] > 0


def test_interleaved_layout_is_shot_major_with_the_queries_after():
    rel = _load("official_releases")
    E, way, shot, nq, D = 2, 3, 2, 4, 5
    y_s = torch.arange(way).repeat_interleave(shot).expand(E, -1).contiguous()  # class-major, as sampled
    s = y_s.unsqueeze(-1).float().expand(E, way * shot, D) + 0.1 * torch.arange(way * shot).view(1, -1, 1)
    q = torch.randn(E, nq, D)
    y_q = torch.tensor([[0, 0, 1, 2], [2, 2, 2, 0]])
    ep = rel.Episodes(s, q, s, q, y_s, y_q, way, shot, None)
    data, labels = ep.interleaved("raw")
    # position k * way + c holds shot k of class c; then the queries unchanged
    assert labels[:, : way * shot].tolist() == [[0, 1, 2, 0, 1, 2]] * E
    assert torch.equal(data[:, way * shot :], q) and torch.equal(labels[:, way * shot :], y_q)
    for k in range(shot):
        for c in range(way):
            assert torch.equal(data[:, k * way + c], s[:, c * shot + k])


def test_one_ulp_moves_each_coordinate_by_at_most_one_unit_in_the_last_place():
    rel = _load("official_releases")
    g = torch.Generator().manual_seed(0)
    s, q = torch.randn(3, 5, 64, generator=g), torch.randn(3, 15, 64, generator=g)
    ep = rel.Episodes(s, q, s * 2, q * 2, torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 15), 5, 1, None)
    moved = ep.one_ulp(seed=1)
    for a, b in [(ep.s_raw, moved.s_raw), (ep.q_raw, moved.q_raw), (ep.q_l2n, moved.q_l2n)]:
        changed = a != b
        assert 0.3 < changed.double().mean() < 0.7  # about half the coordinates move
        up, down = torch.nextafter(a, torch.full_like(a, 1e30)), torch.nextafter(a, torch.full_like(a, -1e30))
        assert bool(((b == a) | (b == up) | (b == down)).all())  # and by exactly one ulp where they do
        assert bool((b > a).any()) and bool((b < a).any())
    assert torch.equal(moved.q_raw, ep.one_ulp(seed=1).q_raw) and not torch.equal(moved.q_raw, ep.one_ulp(2).q_raw)
    assert moved.y_s is ep.y_s and moved.way == 5


def test_a_release_that_differs_from_ours_is_rerun_on_rows_one_ulp_away(monkeypatch, capsys):
    import numpy as np

    mod = _load("compare_official")
    rel = sys.modules["official_releases"]
    seen: list[float] = []

    def fake_run(flip: bool):
        def run(checkout, ep, kind):  # accuracy 1 where the first coordinate's last bit is even
            seen.append(float(ep.q_raw[0, 0, 0]))
            bits = ep.q_raw[:, 0, 0].view(torch.int32) & 1
            acc = (bits == 0).double().numpy() if flip else np.full(ep.n, 0.5)
            return rel.Theirs(acc, None, 1.0, "fake")

        return run

    rows = (rel.Release("pt-map", "o/A", fake_run(True)), rel.Release("bms", "o/B", fake_run(False)))
    monkeypatch.setattr(mod, "RELEASES", rows)
    monkeypatch.setattr(mod, "run_ours", lambda *a: {"acc": np.full(8, 0.5), "wall": 1.0, "cmd": "poodle solve"})
    monkeypatch.setattr(mod, "our_predictions", lambda *a: None)
    E = 8
    s, q = torch.rand(E, 5, 4), torch.rand(E, 75, 4)
    ep = rel.Episodes(s, q, s, q, torch.zeros(E, 5, dtype=torch.long), torch.zeros(E, 75, dtype=torch.long), 5, 1, None)
    monkeypatch.setattr(mod, "load", lambda *a: ep)
    a = mod.parse(["--checkout", "pt-map=/x", "--checkout", "bms=/y"])
    out = mod.run_all(a, Path("c.h5"), Path("e.h5"))
    differs, same = out
    assert differs["identical"] == 0 and "itself" in differs  # theirs 0 or 1, ours 0.5
    bits = ep.q_raw[:, 0, 0].view(torch.int32) & 1
    # rerun on the nudged rows: an episode keeps its accuracy where its coordinate's parity is kept
    kept = ep.one_ulp(a.seed).q_raw[:, 0, 0].view(torch.int32) & 1 == bits
    assert differs["itself"] == int(kept.sum())
    assert same["identical"] == E and "itself" not in same and len(seen) == 3  # identical: not rerun
    assert (
        f"the release against itself on rows one ulp away: {differs['itself']}/{E} identical" in capsys.readouterr().out
    )
    assert f"| {differs['itself']}/{E} |" in mod.table(out)
    a = mod.parse(["--checkout", "pt-map=/x", "--no-self-check"])
    assert "itself" not in mod.run_all(a, Path("c.h5"), Path("e.h5"))[0]
