"""The results layer: identity, append/lookup, a cut last line,
and the rules a config follows (presets resolved, one coercion, bounds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from poodle import results as RS
from poodle import solvers
from poodle.errors import ConfigError

EPISODE = {"split": "test", "way": 5, "shot": 1, "query": 15, "imbalance": None, "seed": 0, "episodes": 3}


def _identity(cache_id="abc", **kw):
    opts = dict(
        cache_id=cache_id,
        episode=EPISODE,
        negatives="base",
        n_neg=400,
        method="poodle",
        options={"alpha": 1.0, "beta": 0.5},
        transductive=False,
    )
    opts.update(kw)
    return RS.make_identity(**opts)


def test_identity_key_covers_the_configuration_and_the_cache_but_not_the_label():
    a = RS.make_record(_identity(), [0.5, 0.6, 0.7], label="A", cache="x.h5")
    b = RS.make_record(_identity(), [0.5, 0.6, 0.7], label="B", cache="moved/x.h5")
    assert a["key"] == b["key"]
    assert RS.identity_key(_identity(cache_id="other")) != a["key"]
    assert RS.identity_key(_identity(n_neg=200)) != a["key"]
    assert RS.identity_key(_identity(options={"alpha": 1.0, "beta": 0.25})) != a["key"]
    assert RS.identity_key(_identity(episode={**EPISODE, "seed": 1})) != a["key"]
    # without negatives the count is not part of the cell
    assert RS.identity_key(_identity(negatives="none", n_neg=400)) == RS.identity_key(
        _identity(negatives="none", n_neg=7)
    )
    assert a["mean"] == pytest.approx(0.6) and a["n"] == 3
    assert a["ci95"] == pytest.approx(1.96 * (0.02 / 3) ** 0.5 / 3**0.5)


def test_append_lookup_last_wins_and_a_cut_last_line_is_dropped(tmp_path):
    path = tmp_path / "r.jsonl"
    f = RS.ResultsFile(path, name="t")
    r1 = RS.make_record(_identity(), [1.0, 0.0, 1.0], label="a", cache="c")
    r2 = RS.make_record(_identity(cache_id="zzz"), [0.0, 0.0, 1.0], label="b", cache="c")
    f.append(r1)
    f.append(r2)
    f.append({**r1, "acc": [1.0, 1.0, 1.0]})
    res = RS.read_results(path)
    assert res.header["name"] == "t" and len(res) == 2
    assert res.get(r1["key"])["acc"] == [1.0, 1.0, 1.0] and res.get(r2["key"])["label"] == "b"
    with open(path, "ab") as fh:
        fh.write(b'{"kind":"cell","key":"0123","acc":[0.5,')
    assert len(RS.read_results(path)) == 2
    torn = path.read_bytes()
    f2 = RS.ResultsFile(path)  # opening reads and changes nothing; the next append cuts the partial line off
    assert path.read_bytes() == torn and len(f2.records) == 2
    f2.append(r2)
    assert path.read_bytes() == torn[: torn.rindex(b"\n") + 1] + RS._line(r2)
    lines = path.read_text().splitlines()
    lines.insert(1, "not json")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        RS.read_results(path)
    spec = tmp_path / "g.toml"  # a grid spec given where its results file was meant
    spec.write_text('name = "g"\n[grid]\nshot = [1, 5]\n')
    with pytest.raises(ConfigError, match=r"g.toml is not a results file \(its first line is not JSON"):
        RS.read_results(spec)


def test_configs_hold_the_values_used_and_values_are_checked_in_one_place():
    a = solvers.make_config("tim-gd", {})
    b = solvers.make_config("tim-gd", {"steps": 1000})
    assert a == b and a.steps == 1000 and a.temperature == 15.0  # preset resolved when built
    p = solvers.make_config("tim-gd", {"preset": "poodle-paper", "steps": "7"})
    assert p.steps == 7 and p.lr == 1e-3 and p.learn_temperature is True
    with pytest.raises(ConfigError, match=r"method .tim-gd.: option .steps. must lie in \[0, inf\)"):
        solvers.make_config("tim-gd", {"steps": -1})
    with pytest.raises(ConfigError, match=r"option 'steps' of method 'tim-gd' expects an int, got 'many'"):
        solvers.make_config("tim-gd", {"steps": "many"})
    with pytest.raises(ConfigError, match=r"option 'steps' of method 'poodle' expects an int, got 2.5"):
        solvers.make_config("poodle", {"steps": 2.5})
    info = solvers.get("poodle")
    assert info.is_transductive(solvers.make_config("poodle", {"transductive": "yes"}))
    assert not info.is_transductive(solvers.make_config("poodle", {}))
    assert solvers.get("tim-gd").is_transductive(a) and not solvers.get("proto").is_transductive(None)
    assert info.settings() == ("inductive", "transductive") and solvers.get("ce").settings() == ("inductive",)


def test_results_written_by_poodle_0_1_are_found_finished(tmp_path):
    """tests/data/results_v0.1 holds a grid, its cache and the results file poodle 0.1 (main at
    c104825, before the settings schema) wrote for it: 32 cells across shot, imbalance, query_classes,
    negatives, n_neg, preprocess and seed. Today's code must compute the same identity for every cell,
    so the grid finds every cell finished and solves nothing."""
    import shutil

    from poodle import grid as G
    from poodle.pipeline import RunOptions

    data = Path(__file__).parent / "data" / "results_v0.1"
    for name in ("grid.toml", "features.h5", "results.jsonl"):
        shutil.copy(data / name, tmp_path / name)
    before = (tmp_path / "results.jsonl").read_bytes()
    written = RS.read_results(tmp_path / "results.jsonl").records
    assert len(written) == 32 and {r["versions"]["poodle"] for r in written} == {"0.1.0"}
    assert sum("query_classes" in r["episode"] for r in written) == 16
    assert {r.get("preprocess") for r in written} == {None, "cl2n", "power:0.4"}
    spec = G.load_grid(tmp_path / "grid.toml")
    cells = G.expand(spec)
    run = G.run_grid(spec, tmp_path / "results.jsonl", options=RunOptions(device="cpu"), cells=cells)
    assert (run.computed, run.skipped) == (0, 32)
    assert [r["key"] for r in run.records] == [r["key"] for r in written]
    assert (tmp_path / "results.jsonl").read_bytes() == before
