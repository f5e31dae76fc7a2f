"""Ablation grids: expansion, pairing, resume after interruption, results-file identity, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poodle import grid as G
from poodle.errors import ConfigError
from poodle.events import CellFinished
from poodle.pipeline import RunOptions

CPU = RunOptions(device="cpu")

N_EP = 12


@pytest.fixture
def cache(tmp_path, make_features):
    from poodle.cache import write_arrays

    x, y = make_features(10, 24, 16, seed=3, spread=0.9)
    xb, yb = make_features(8, 20, 16, seed=4, spread=0.9)
    path = tmp_path / "feat.h5"
    write_arrays(path, {"test": (x, y, [f"t{i}" for i in range(10)]), "train": (xb, yb, [f"b{i}" for i in range(8)])})
    return path


def _grid(tmp_path: Path, body: str, name: str = "g.toml") -> Path:
    p = tmp_path / name
    p.write_text(f'cache = "feat.h5"\n{body}')
    return p


SMALL = f"""
[episodes]
shot = [1, 5]
query = 5
episodes = {N_EP}
[negatives]
n_neg = 20
[solver]
method = ["proto", "poodle"]
alpha = [0.0, 1.0]
beta = [0.0, 0.5]
steps = 3
"""


# ---------------------------------------------------------------------------------------------
# Expansion


def test_each_setting_of_a_grid_is_checked_once_as_the_file_is_read(tmp_path, cache, monkeypatch):
    import poodle.cells
    import poodle.grid.spec

    checked: list[str] = []
    for module in (poodle.cells, poodle.grid.spec):
        real = module.check_setting
        monkeypatch.setattr(module, "check_setting", lambda k, v, real=real: checked.append(k) or real(k, v))
    spec = G.load_grid(_grid(tmp_path, SMALL))
    # each value of the file once, at its line: cache, shot (2), query, episodes, n_neg, method (2)
    assert sorted(checked) == sorted(["cache", "shot", "shot", "query", "episodes", "n_neg", "method", "method"])
    cells = G.expand(spec)
    assert len(cells) == 10 and len(checked) == 8  # the cells take them as they are
    with pytest.raises(ConfigError, match=r"g.toml, line 4: option 'shot' must be a positive integer, got 0"):
        G.load_grid(_grid(tmp_path, SMALL.replace("shot = [1, 5]", "shot = [1, 0]")))


def test_product_skips_options_a_method_lacks_and_adds_explicit_cells(tmp_path, cache):
    p = _grid(
        tmp_path,
        SMALL
        + """
transductive = [false, true]

[[cell]]
label = "CE"
alpha = 0.0
beta = 0.0
steps = [1, 2]

[[cell]]
method = "proto"
shot = 10
""",
    )
    cells = G.expand(G.load_grid(p))
    proto = [c for c in cells if c.method == "proto"]
    poodle = [c for c in cells if c.method == "poodle" and c.label == "poodle"]
    ce = [c for c in cells if c.label == "CE"]
    # proto has no alpha/beta/steps/negatives and is inductive only: one cell per shot, not 2*2*2.
    assert sorted(c.episode["shot"] for c in proto) == [1, 5, 10]
    assert all(not c.transductive and c.negatives == "none" and c.n_neg is None for c in proto)
    assert all("alpha" not in c.options for c in proto)
    assert len(poodle) == 2 * 2 * 2 * 2  # shot x alpha x beta x transductive
    assert {(c.options["alpha"], c.options["beta"], c.transductive) for c in poodle} == {
        (a, b, t) for a in (0.0, 1.0) for b in (0.0, 0.5) for t in (False, True)
    }
    assert all(c.episode["query"] == 5 for c in poodle)
    # POODLE with beta = 0 consumes no negatives: recorded as such (and n_neg lists would not
    # multiply it); with beta > 0 it uses the grid's negatives.
    assert all((c.negatives, c.n_neg) == (("base", 20) if c.options["beta"] else ("none", None)) for c in poodle)
    # The explicit CE cell inherits method = [proto, poodle]: only poodle has alpha, so only poodle
    # cells, over the inherited shot and transductive lists and its own steps list.
    assert len(ce) == 2 * 2 * 2 and {c.method for c in ce} == {"poodle"}
    assert {c.options["steps"] for c in ce} == {1, 2}
    assert len(cells) == len(proto) + len(poodle) + len(ce)
    assert [c.index for c in cells] == list(range(len(cells)))
    assert len({c.key for c in cells}) == len(cells)


def test_grid_hash_ignores_formatting_but_not_cells(tmp_path, cache):
    a = G.expand(G.load_grid(_grid(tmp_path, SMALL, "a.toml")))
    b_text = SMALL.replace("alpha = [0.0, 1.0]", "alpha = [1, 0]   # same values, other order")
    b = G.expand(G.load_grid(_grid(tmp_path, b_text, "b.toml")))
    c = G.expand(G.load_grid(_grid(tmp_path, SMALL.replace("beta = [0.0, 0.5]", "beta = [0.0, 0.75]"), "c.toml")))
    assert G.grid_hash(a) == G.grid_hash(b) != G.grid_hash(c)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "[solver]\nmethod = 'poodle'\nalpah = [1.0]\n",
            r"unknown option 'alpah' for method poodle; known options: cache, split.*solver options: .*alpha.*beta",
        ),
        (
            "[solver]\nmethod = 'proto'\nbeta = 0.5\n",
            r"unknown option 'beta' for method proto \(it is an option of .*poodle",
        ),
        ("[solver]\nalpha = ['abc']\n", r"option 'alpha' of method 'poodle' expects a float, got 'abc'"),
        ("[solver]\nsteps = 2.5\n", r"option 'steps' of method 'poodle' expects an int, got 2.5"),
        ("[episodes]\nshot = [1, 'five']\n", r"option 'shot' must be a positive integer, got 'five'"),
        (
            "[episodes]\nimbalance = -1\n",
            r"g.toml, line 3: option 'imbalance' must be a number in \(0, inf\) \(a Dirichlet concentration\), "
            r"got -1.0",
        ),
        (
            "[episodes]\nway = true\n",
            r"option 'way' must be an integer >= 2 \(a 1-way episode is always right\), got True",
        ),
        ("[solver]\nmethod = 'nope'\n", r"unknown method 'nope'; known methods: .*poodle"),
        ("[solvers]\nalpha = 1\n", r"unknown section \[solvers\]"),
        ("[[cell]]\nmethod = 'proto'\ntransductive = true\n", r"'proto' is inductive only"),
        ("[[cell]]\nmethod = 'proto'\nalpha = 1.0\n", r"\[\[cell\]\] #1: unknown option 'alpha' for method proto"),
        ("[episodes]\nshot = 1\n[solver]\nshot = 5\n", r"option 'shot' is given twice"),
        ("alpha = [\n", r"not valid TOML"),
    ],
)
def test_bad_grid_files_give_one_line_errors(tmp_path, body, message):
    p = _grid(tmp_path, body)
    with pytest.raises(ConfigError, match=message) as e:
        G.expand(G.load_grid(p))
    assert "\n" not in str(e.value)
    assert str(p) in str(e.value)


@pytest.mark.parametrize(
    "body, message",
    [
        ("[episodes]\nshot = [1, 'five']\n", "g.toml, line 3: option 'shot' must be a positive integer, got 'five'"),
        ("way = [5, true]\n", "g.toml, line 2: option 'way' must be an integer >= 2"),
        (
            'description = """\nway = 3\n"""\nway = [\n  5,\n  [6],\n]\n',
            "g.toml, line 5: option 'way' must be an integer >= 2",
        ),
        ("alpha = [1.0, 'x']\n", "g.toml, line 2: option 'alpha' of method 'poodle' expects a float, got 'x'"),
        (
            "alpha = 1.0\n[[cell]]\nmethod = 'proto'\n[[cell]]\nlabel = 'b'\n# alpha = 2\nalpha = [0.5, 'x']\n",
            "g.toml: [[cell]] #2, line 8: option 'alpha' of method 'poodle' expects a float, got 'x'",
        ),
        (  # a cell's value written outside it: that line
            "product = false\nsteps = 'x'\n[[cell]]\nmethod = 'poodle'\n",
            "g.toml: [[cell]] #1, line 3: option 'steps' of method 'poodle' expects an int, got 'x'",
        ),
    ],
)
def test_a_bad_value_in_a_grid_file_names_its_line(tmp_path, body, message):
    """An option's value said at the line that sets it: in a list, in a multi-line array, in a
    [[cell]] (its own line, else the grid's); a value given as an override is said as the override."""
    p = _grid(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        G.expand(G.load_grid(p))
    assert str(e.value).startswith(f"{p}") and message in str(e.value), str(e.value)
    key = message.split("option '")[1].split("'")[0]
    with pytest.raises(ConfigError) as e:
        G.expand(G.load_grid(_grid(tmp_path, "", "o.toml"), overrides={key: [0.5, "x"] if key == "alpha" else "x"}))
    # the override's value is said as the override: the file does not hold it
    assert "line" not in str(e.value) and f"o.toml, overrides {key}: option {key!r}" in str(e.value), str(e.value)
    from click.testing import CliRunner

    from poodle.cli.grid import grid

    r = CliRunner().invoke(grid, [str(tmp_path / "o.toml"), "--set", f"{key}=x", "--dry-run"])
    assert r.exit_code == 1 and f"o.toml, --set {key}: option {key!r}" in r.output.replace("\n", ""), r.output


@pytest.mark.parametrize(
    "body",
    [
        "[solver]\nmethod = ['poodle', 'alpha-tim']\nalpha = [1.0, 2.0]\n",
        # a [[cell]] inherits the grid's alpha: POODLE's pull weight would become alpha-TIM's order
        "[solver]\nmethod = 'poodle'\nalpha = [1.0, 2.0]\n[[cell]]\nmethod = 'alpha-tim'\n",
        "[[cell]]\nmethod = ['poodle', 'alpha-tim']\nalpha = 2.0\n",
    ],
)
def test_an_option_name_with_two_meanings_is_not_swept_for_both(tmp_path, body):
    p = _grid(tmp_path, body)
    with pytest.raises(ConfigError, match=r"option 'alpha' would set different parameters") as e:
        G.expand(G.load_grid(p))
    assert "poodle's pull weight" in str(e.value) and "alpha-tim's alpha-entropy order" in str(e.value)


def test_each_method_gets_its_own_value_of_a_shared_name_in_its_cell(tmp_path):
    body = "[solver]\nmethod = 'poodle'\nalpha = [1.0, 2.0]\n[[cell]]\nmethod = 'alpha-tim'\nalpha = [3.0, 5.0]\n"
    cells = G.expand(G.load_grid(_grid(tmp_path, body)))
    assert sorted((c.method, c.options["alpha"]) for c in cells) == [
        ("alpha-tim", 3.0),
        ("alpha-tim", 5.0),
        ("poodle", 1.0),
        ("poodle", 2.0),
    ]
    # the same meaning for every method is one value for all (PT-MAP and protoLP: prototype update rate)
    body = "[solver]\nmethod = ['pt-map', 'proto-lp']\nalpha = 0.3\n"
    assert {c.options["alpha"] for c in G.expand(G.load_grid(_grid(tmp_path, body, "h.toml")))} == {0.3}


def test_realistic_queries_example_keeps_each_methods_own_alpha():
    spec = G.load_grid(Path(__file__).parent.parent / "examples" / "realistic_queries.toml")
    alphas = {(c.method, c.options.get("alpha"), c.options.get("beta")) for c in G.expand(spec)}
    assert ("poodle", 1.0, 0.75) in alphas and ("alpha-tim", 0.0, None) in alphas
    assert ("pt-map", 0.2, 0.5) in alphas and ("proto-lp", 0.2, None) in alphas


def test_missing_cache_is_an_error(tmp_path):
    p = tmp_path / "nocache.toml"
    p.write_text("[solver]\nalpha = 1.0\n")
    with pytest.raises(ConfigError, match="no cache given"):
        G.load_grid(p)


# ---------------------------------------------------------------------------------------------
# Running: read once, pairing, resume


def _records(path: Path) -> dict[str, dict]:
    return {r["key"]: r for r in G.read_results(path).records}


def test_cache_read_once_episodes_sampled_once_per_setting_and_cells_paired(tmp_path, cache, monkeypatch):
    import poodle.pipeline as pl

    reads, streams, episode_sets, negatives = [], [], {}, {}
    real_read, real_stream, real_eval = pl.read_split, pl.EpisodeStream, pl.evaluate
    monkeypatch.setattr(pl, "read_split", lambda *a, **k: reads.append(a[1]) or real_read(*a, **k))

    class Stream(real_stream):
        def __init__(self, labels, spec, *a, **k):
            streams.append(spec)
            super().__init__(labels, spec, *a, **k)

    monkeypatch.setattr(pl, "EpisodeStream", Stream)

    def spy(features, episodes, methods, **kw):
        # every call of a setting gets the same episodes (a stream, or the set drawn once when
        # several calls share it) and the same negative source
        episode_sets.setdefault(episodes.spec.shot, set()).add(id(episodes))
        if kw.get("negatives") is not None:
            negatives.setdefault(episodes.spec.shot, set()).add(kw["negatives"])
        return real_eval(features, episodes, methods, **kw)

    monkeypatch.setattr(pl, "evaluate", spy)
    p = _grid(
        tmp_path,
        SMALL
        + """
[[cell]]
label = "twin-a"
method = "poodle"
alpha = 1.0
beta = 0.5
[[cell]]
label = "twin-b"
method = "poodle"
alpha = 1.0
beta = 0.5
""",
    )
    run = G.run_grid(G.load_grid(p), tmp_path / "r.jsonl", options=CPU)
    # the twins have the configuration of a product cell: one computation serves all three
    assert len(run.records) == 2 * (1 + 4 + 2) and run.computed == 2 * (1 + 4)
    assert len(_records(run.path)) == run.computed
    assert reads.count("test") == 1  # one cache, one split: read once
    assert sorted(s.shot for s in streams) == [1, 5]  # one episode set per setting
    assert all(len(ids) == 1 for ids in episode_sets.values())  # every call got that same set
    assert all(len(n) == 1 for n in negatives.values())  # and the same negatives
    by = {(r["label"], r["episode"]["shot"]): r for r in run.records}
    for shot in (1, 5):
        # Two cells with the same options: identical per-episode accuracies (same episodes and
        # negatives), differing labels only.
        assert by[("twin-a", shot)]["acc"] == by[("twin-b", shot)]["acc"]
        assert len(by[("twin-a", shot)]["acc"]) == N_EP
    rec = by[("proto", 1)]
    assert rec["n"] == N_EP and 0.0 <= rec["mean"] <= 1.0 and rec["seconds"] >= 0
    assert rec["mean"] == pytest.approx(sum(rec["acc"]) / N_EP)


def test_interrupted_grid_resumes_and_matches_an_uninterrupted_run(tmp_path, cache):
    spec = G.load_grid(_grid(tmp_path, SMALL))
    full = G.run_grid(spec, tmp_path / "full.jsonl", options=CPU)
    out = tmp_path / "part.jsonl"
    k = 3

    def crash_after_k(event):
        if isinstance(event, CellFinished) and event.done == k:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        G.run_grid(spec, out, options=RunOptions(device="cpu", cells_per_call=1), on_event=crash_after_k)
    assert len(_records(out)) == k
    # A crash in the middle of writing a line leaves a truncated last line: tolerated, cut off.
    with open(out, "ab") as f:
        f.write(b'{"kind":"cell","key":"0123","acc":[0.5,')
    started = []
    rest = G.run_grid(
        spec,
        out,
        options=CPU,
        on_event=lambda e: started.append(e.cell.key) if isinstance(e, CellFinished) and not e.skipped else None,
    )
    assert rest.computed == len(started) == len(full.records) - k and rest.skipped == k
    assert out.read_bytes().endswith(b"\n")
    assert {key: r["acc"] for key, r in _records(out).items()} == {
        key: r["acc"] for key, r in _records(full.path).items()
    }
    # A third run has nothing to do.
    assert G.run_grid(spec, out, options=CPU).computed == 0


def test_changed_grid_computes_only_new_cells_and_force_recomputes(tmp_path, cache):
    out = tmp_path / "r.jsonl"
    first = G.run_grid(G.load_grid(_grid(tmp_path, SMALL)), out, options=CPU)
    # one more value of beta: only the new cells are solved, the old records are kept and reused
    bigger = G.load_grid(_grid(tmp_path, SMALL.replace("beta = [0.0, 0.5]", "beta = [0.0, 0.5, 1.0]"), "b.toml"))
    run = G.run_grid(bigger, out, options=CPU)
    assert run.computed == 2 * 2 and run.skipped == len(first.records)
    old = {r["key"]: r["acc"] for r in first.records}
    assert all(r["acc"] == old[r["key"]] for r in run.records if r["key"] in old)
    # another value of steps changes every POODLE cell; proto (no steps) is reused
    other = G.load_grid(_grid(tmp_path, SMALL.replace("steps = 3", "steps = 2"), "other.toml"))
    run = G.run_grid(other, out, options=CPU)
    assert run.computed == 2 * 4 and run.other_records == 2 * 4 + 2 * 2
    assert {r["options"]["steps"] for r in run.records if r["method"] == "poodle"} == {2}
    again = G.run_grid(other, out, options=CPU, force=True)
    assert again.computed == len(again.records) == 2 * 5
    assert [r["acc"] for r in again.records] == [r["acc"] for r in run.records]
    assert len(G.read_results(out).records) == 2 * 1 + 2 * 4 + 2 * 2 + 2 * 4  # force superseded, not added


def test_records_of_a_changed_cache_are_never_reused(tmp_path, cache, make_features):
    from poodle.cache import write_arrays

    spec = G.load_grid(_grid(tmp_path, SMALL.replace("shot = [1, 5]", "shot = 1")))
    out = tmp_path / "r.jsonl"
    first = G.run_grid(spec, out, options=CPU)
    x, y = make_features(10, 24, 16, seed=99)
    xb, yb = make_features(8, 20, 16, seed=98)
    write_arrays(cache, {"test": (x, y, [f"t{i}" for i in range(10)]), "train": (xb, yb, [f"b{i}" for i in range(8)])})
    second = G.run_grid(spec, out, options=CPU)
    assert second.computed == len(first.records) and second.skipped == 0
    assert {r["cache_id"] for r in first.records}.isdisjoint({r["cache_id"] for r in second.records})
    assert [r["acc"] for r in first.records] != [r["acc"] for r in second.records]


def test_damaged_results_file_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"format": "poodle-results", "version": 2, "kind": "header"}) + "\nnot json\n{}\n")
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        G.read_results(p)
    q = tmp_path / "foreign.jsonl"
    q.write_text('{"hello": 1}\n')
    with pytest.raises(ConfigError, match="not a poodle results file"):
        G.read_results(q)


def test_cli_grid_then_report(tmp_path, cache):
    from click.testing import CliRunner

    from poodle.cli.grid import grid
    from poodle.cli.report import report

    p = _grid(tmp_path, SMALL)
    runner = CliRunner()
    res = runner.invoke(grid, [str(p), "--device", "cpu", "--set", "shot=1", "--set", "beta=[0.0]"])
    assert res.exit_code == 0, res.output
    out = G.default_results_path(p)
    assert len(_records(out)) == 1 + 2
    res = runner.invoke(report, [str(out), "--rows", "method,alpha", "--format", "markdown"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("|")]
    assert len(lines) == 2 + 3 and lines[0].count("|") == 4
    res = runner.invoke(grid, [str(p), "--device", "cpu", "--set", "alpah=1"])
    assert res.exit_code == 1 and "error: " in res.output and "alpah" in res.output
    # a missing cache or negative pool: the error alone, before any progress bar
    for args, needle in [
        (["--cache", str(tmp_path / "none.h5")], "none.h5 does not exist"),
        (["--set", f"negatives={tmp_path / 'pool.h5'}"], f"negatives {tmp_path / 'pool.h5'}: no such cache file"),
    ]:
        res = runner.invoke(grid, [str(p), "--device", "cpu", "--set", "shot=1", *args])
        assert res.exit_code == 1 and needle in res.output.replace("\n", ""), res.output
        assert "cells" not in res.output.replace("no such", ""), res.output


@pytest.mark.parametrize(
    "name, n_cells",
    [
        ("alpha_beta", 7 * 7 * 2 * 2 + 2),
        ("negatives", 4 * 2 * 2 + 2),
        ("steps", 4 * 2 * 2 + 4 * 2 + 2),
        ("ood_domains", 4 * 5 + 4),
        ("stopgrad", 2**5 + 2),
        ("imbalance", 2 * 4 * 4 + 3 * 2 * 4),
        ("realistic_queries", 2 * 2 * 5 * (1 + 8)),
    ],
)
def test_shipped_examples_expand(name, n_cells):
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.toml"
    cells = G.expand(G.load_grid(path))
    assert len(cells) == n_cells


def test_preprocess_key_is_an_axis_recorded_in_results_and_matches_solve(tmp_path, cache):
    from poodle.results import read_results
    from poodle.solve import solve

    p = _grid(
        tmp_path,
        f"""
[episodes]
shot = 1
query = 5
episodes = {N_EP}
[negatives]
n_neg = 20
preprocess = ["l2n", "cl2n"]
[solver]
method = ["proto", "poodle"]
steps = 3
""",
    )
    spec = G.load_grid(p)
    cells = G.expand(spec)
    assert sorted(c.preprocess for c in cells) == ["cl2n", "cl2n", "l2n", "l2n"]
    # the default stays out of the cell's identity: grids written before the key keep their keys
    assert "preprocess" not in cells[0].written() and cells[-1].written()["preprocess"] == "cl2n"
    G.run_grid(spec, tmp_path / "r.jsonl", options=CPU)
    recs = {(r["method"], r.get("preprocess", "l2n")): r for r in read_results(tmp_path / "r.jsonl").records}
    assert len(recs) == 4
    for pre in ("l2n", "cl2n"):
        res = solve(
            cache,
            ["proto", "poodle"],
            options={"poodle": {"steps": 3}},
            shot=1,
            query=5,
            episodes=N_EP,
            n_neg=20,
            preprocess=pre,
            run=CPU,
        )
        for r in res.records:
            assert r["acc"] == recs[(r["method"], pre)]["acc"] and r["key"] == recs[(r["method"], pre)]["key"]
    assert recs[("proto", "l2n")]["acc"] != recs[("proto", "cl2n")]["acc"]
    with pytest.raises(ConfigError, match="use l2n, cl2n or power"):
        G.load_grid(_grid(tmp_path, 'preprocess = "zca"\n', "bad.toml"))


def test_query_classes_is_an_episode_key_recorded_only_when_set(tmp_path, cache):
    p = _grid(
        tmp_path,
        """
[episodes]
query = 4
episodes = 4
query_classes = ["none", 1, 3]
[solver]
method = "proto"
""",
    )
    spec = G.load_grid(p)
    run = G.run_grid(spec, tmp_path / "r.jsonl", options=CPU)
    assert len(run.records) == 3
    by = {r["episode"].get("query_classes"): r for r in run.records}
    assert set(by) == {None, 1, 3} and "query_classes" not in by[None]["episode"]
    # a grid without the key keeps the cell keys it had before the option existed
    plain = G.load_grid(
        _grid(tmp_path, '[episodes]\nquery = 4\nepisodes = 4\n[solver]\nmethod = "proto"\n', name="p.toml")
    )
    assert G.expand(plain)[0].key == [c for c in G.expand(spec) if "query_classes" not in c.episode][0].key
