"""benchmarks/ragged.py: Meta-Dataset-style episodes drawn by the published rules, the ragged
methods told apart from the others, and a tiny run end to end (batched and one-at-a-time accuracies
agree episode by episode; the padding overhead of buckets is at most that of episode order)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from poodle.evaluate import check_ragged, episode_shapes

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("ragged_bench", BENCH / "ragged.py")
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_the_local_draw_follows_meta_datasets_rules(mod):
    split = mod.synthetic_split(30, 6, 300, 16, seed=1, spread=1.0)
    eps = mod.local_draw(split, 200, seed=2)
    check_ragged(eps, split.labels)  # indices, labels and classes consistent, every class present
    n_img = torch.bincount(split.labels)
    ways = eps.ways
    assert int(ways.min()) >= 5 and int(ways.max()) <= 30 and len(set(ways.tolist())) > 15
    for e in range(len(eps)):
        w = int(ways[e])
        cls = eps.class_ids[e, :w]
        assert len(set(cls.tolist())) == w and bool((eps.class_ids[e, w:] == -1).all())
        n = n_img[cls]
        q = min(10, int((n // 2).min()))
        s_lab = eps.support_labels[e][eps.support_labels[e] >= 0]
        q_lab = eps.query_labels[e][eps.query_labels[e] >= 0]
        assert torch.equal(torch.bincount(q_lab, minlength=w), torch.full((w,), q))
        shots = torch.bincount(s_lab, minlength=w)
        assert int(shots.min()) >= 1 and bool((shots <= n - q).all())
        # the support size never passes its bound: min(500, sum_c floor(beta * min(100, n_c - q) + 1)), beta < 1
        assert int(shots.sum()) <= min(500, int(torch.clamp(n - q, max=100).sum()))
    # a class with 6 images gives 3 queries a class to every episode that draws it
    assert int(episode_shapes(eps)[:, 1].min()) < 10 * int(ways.min())


def test_a_method_that_leaks_into_padding_is_not_ragged(mod, monkeypatch):
    split = mod.synthetic_split(10, 20, 40, 16, seed=0, spread=1.0)
    batch = mod.probe_batch(split, 4, seed=0)
    assert batch.ragged and batch.ways is not None and batch.query_mask is not None
    assert mod.ragged_reason("proto", batch) is None

    def uniform(b, method, cfg):  # every class of the chunk, padded or not, equally likely
        return torch.full((b.n_episodes, b.query.shape[1], b.way), -math.log(b.way), dtype=b.query.dtype)

    monkeypatch.setattr(mod.ev, "solve_batch", uniform)
    assert "probability on a padded class" in mod.ragged_reason("proto", batch)

    def broken(b, method, cfg):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(mod.ev, "solve_batch", broken)
    assert mod.ragged_reason("proto", batch) == "fails on a padded chunk: RuntimeError: shape mismatch"


def test_quick_run_prints_the_table_and_agrees_episode_by_episode(mod, tmp_path, capsys):
    out = tmp_path / "ragged.json"
    res = mod.main(["--quick", "--methods", "proto,soft-kmeans,kmeans", "--profile", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert json.loads(out.read_text())["episodes"] == res["episodes"] == 40
    assert res["alone"] == 10 and res["dim"] == 64
    assert {r["method"] for r in res["rows"]} | set(res["not_ragged"]) == {"proto", "soft-kmeans", "kmeans"}
    assert {r["method"] for r in res["rows"]} >= {"proto", "soft-kmeans", "kmeans"}  # all three are ragged on main
    for r in res["rows"]:
        assert r["agree"] == r["alone_episodes"] == 10 and r["agree_episode_order"] == r["episodes"] == 40
        assert r["differ"] == []
        assert r["eps_buckets"] > 0 and r["eps_alone"] > 0
        assert r["speedup"] == pytest.approx(r["eps_buckets"] / r["eps_alone"])
        assert 1.0 <= r["padding_buckets"] <= r["padding_episode_order"]
        assert f"| {r['method']} | " in text
        assert r["profile_alone"]["ops_per_episode"] > 0 and r["profile_batched"]["ops_per_episode"] > 0
        assert 0.0 <= r["op_share"] <= 1.0 and r["batching_bound"] >= 1.0
    for where in ("cpu", "gpu"):
        p = res["padding_plans"][where]
        assert 1.0 <= p["buckets"] <= p["episode_order"]
    assert "| method | ep/s batched (buckets) |" in text and "padding (padded rows / real rows)" in text
    assert "iterative methods below 5x batched:" in text
