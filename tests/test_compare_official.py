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
        assert f"{method}: skipped (give --checkout {method}=PATH, {env}" in out


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
