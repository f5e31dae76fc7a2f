"""The one pipeline (poodle.cells, poodle.pipeline, poodle.evaluate): cells made and checked in one
place, calls that share episodes, typed events, the pipelined chunk stream, the memory bound that
counts what a call holds, and the command line's one table of parameter names to flags."""

from __future__ import annotations

import dataclasses
import re

import click
import pytest
import torch
from click.testing import CliRunner

from poodle.cache import read_split, write_arrays
from poodle.cells import check_general, make_cell
from poodle.episodes import EpisodeSpec, EpisodeStream
from poodle.errors import ConfigError, EpisodeError, mark
from poodle.evaluate import Hooks, evaluate, plan_chunks
from poodle.events import CellFinished, CellsStarted, EpisodesSolved, Ready
from poodle.negatives import NegativeSpec
from poodle.pipeline import RunOptions, calls, run_cells, schedule
from poodle.settings import check_setting
from poodle.solve import solve

CPU = RunOptions(device="cpu")


@pytest.fixture
def cache(tmp_path, make_features):
    xtr, ytr = make_features(10, 20, 16, seed=1)
    xte, yte = make_features(8, 20, 16, seed=2, spread=0.5)
    return write_arrays(
        tmp_path / "c.h5",
        {"train": (xtr, ytr, [f"b{i}" for i in range(10)]), "test": (xte, yte, [f"t{i}" for i in range(8)])},
    )


def test_a_cell_is_checked_once_by_the_rule_that_owns_each_value(cache):
    c = make_cell({"cache": str(cache), "method": "poodle", "beta": 0.0, "negatives": "random", "shot": 2})
    assert c.negatives == "none" and c.n_neg is None  # beta = 0 reads no negatives: none recorded
    c = make_cell({"cache": str(cache), "method": "proto", "transductive": True, "alpha": 3})
    assert c.options == {"scale": 10.0} and not c.transductive  # the product's rule: options proto lacks are dropped
    with pytest.raises(ConfigError, match="method 'proto' is inductive only; it cannot be transductive"):
        make_cell({"cache": str(cache), "method": "proto", "transductive": True}, strict={"transductive"})
    with pytest.raises(ConfigError, match="negatives none: method 'poodle' .with these options. reads negative"):
        make_cell({"cache": str(cache), "method": "poodle", "negatives": "none"})
    with pytest.raises(EpisodeError, match=r"query_classes must be an integer from 1 to way=5, got 6"):
        make_cell({"cache": str(cache), "query_classes": 6})
    with pytest.raises(EpisodeError) as e:
        check_setting("shot", "five")
    assert (e.value.param, e.value.value, e.value.reason) == ("shot", "five", "must be a positive integer")
    assert check_setting("imbalance", "balanced") is None and check_setting("preprocess", "power") == "power:0.5"
    assert check_setting("episodes", 3.0) == 3 and check_setting("query_classes", "all") is None
    with pytest.raises(ConfigError, match="n_neg must be a positive integer, got 0") as e:
        check_setting("n_neg", 0)
    assert e.value.params == ("n_neg",)


def test_the_names_deprecated_in_0_2_warn_name_their_replacement_and_give_its_values():
    """poodle.cells.check_general and poodle.defaults' key tables still work for one release (the
    suite turns these warnings into errors everywhere else: pyproject.toml)."""
    from poodle import defaults, settings

    said = "poodle.cells.check_general is deprecated: use poodle.settings.check_setting (removed in 0.3.0)"
    for key, value in (("way", 3), ("preprocess", "power"), ("imbalance", "balanced"), ("episodes", 3.0)):
        with pytest.warns(DeprecationWarning, match="^" + re.escape(said) + "$"):
            assert check_general(key, value) == check_setting(key, value)
    with pytest.warns(DeprecationWarning, match="check_general is deprecated"):
        with pytest.raises(ConfigError, match="n_neg must be a positive integer, got 0"):
            check_general("n_neg", 0)
    moved = {
        "EPISODE_KEYS": ('("cache", *poodle.settings.EPISODE_KEYS)', ("cache", *settings.EPISODE_KEYS)),
        "OPTIONAL_EPISODE_KEYS": ("poodle.settings.WHEN_SET_EPISODE_KEYS", settings.WHEN_SET_EPISODE_KEYS),
        "NEGATIVE_KEYS": ("the keys of poodle.options.settings(NegativeSpec)", ("negatives", "n_neg")),
        "GENERAL_KEYS": ("poodle.settings.GENERAL_KEYS", settings.GENERAL_KEYS),
        "GENERAL_DEFAULTS": ("poodle.settings.general_defaults()", settings.general_defaults()),
    }
    for name, (instead, value) in moved.items():
        said = f"poodle.defaults.{name} is deprecated: use {instead}, derived from the settings' declarations"
        with pytest.warns(DeprecationWarning, match="^" + re.escape(said) + r" \(removed in 0\.3\.0\)$"):
            assert getattr(defaults, name) == value
    assert "way" in settings.EPISODE_KEYS and settings.general_defaults()["way"] == 5
    with pytest.raises(AttributeError, match="no attribute 'NOPE'"):
        defaults.NOPE  # noqa: B018


def test_a_config_is_checked_once_where_it_is_built_and_trusted_after(cache, monkeypatch):
    """A frozen config checked when it was built carries the fact: the chunks of a run trust it; a
    config made in Python is checked once per call, never per chunk; solvers.run checks what it is
    given unless the library built it."""
    from poodle import solvers
    from poodle.solvers import base
    from poodle.solvers.proto import ProtoConfig

    cfg = solvers.make_config("proto", {"scale": 5.0})
    assert solvers.is_checked(cfg) and not solvers.is_checked(dataclasses.replace(cfg, scale=6.0))
    assert vars(cfg) == {"scale": 5.0}  # the mark is kept beside the config: its attributes are its fields
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scale = -1.0  # type: ignore[misc]
    features = read_split(cache, "test")
    eps = EpisodeStream(features.labels, EpisodeSpec(way=5, shot=1, query=3), 6)
    checks: list[str] = []
    real = base.validate_config
    monkeypatch.setattr(base, "validate_config", lambda c, m="": checks.append(m) or real(c, m))
    run = RunOptions(device="cpu", chunk_size=1, workers=1)
    built = evaluate(features, eps, [("p", "proto", cfg)], run=run)
    assert checks == []  # six chunks, no check: it was checked when built
    made = evaluate(features, eps, [("p", "proto", ProtoConfig(scale=5.0))], run=run)
    assert checks == ["proto"]  # once for the call, not per chunk
    assert torch.equal(built["p"], made["p"])
    batch = solvers.EpisodeBatch(
        torch.eye(4)[None], torch.arange(4)[None], torch.eye(4)[None], None, 4
    )  # one 4-way 1-shot episode
    with pytest.raises(ConfigError, match=r"method 'proto': option 'scale' must lie in \(0, inf\), got -1"):
        solvers.run("proto", batch, ProtoConfig(scale=-1.0))
    assert checks == ["proto", "proto"]
    solvers.run("proto", batch, cfg)
    assert checks == ["proto", "proto"]  # the library's config is trusted


def test_the_negatives_rule_runs_once_where_the_negatives_are_chosen(cache, negatives_checks):
    """A method's negatives rule (:meth:`SolverInfo.check_negatives`) runs once per value: for a
    cell when it is made (the pipeline's calls and their chunks trust it), for evaluate or
    solve_batch called from Python once per call, never per chunk; a bad combination still raises."""
    from poodle import solvers
    from poodle.cells import numbered
    from poodle.evaluate import solve_batch

    seen = negatives_checks
    common = {"cache": str(cache), "way": 3, "shot": 1, "query": 2, "episodes": 6, "n_neg": 5}
    cells = numbered(
        [
            make_cell({**common, "method": "poodle", "steps": 3, **o}, label=label)
            for label, o in (("po-r", {"negatives": "random"}), ("po-b", {"negatives": "base"}), ("po-0", {"beta": 0}))
        ]
        + [make_cell({**common, "method": "proto"})]
    )
    assert seen == [("poodle", "random"), ("poodle", "base")]  # the two cells whose method reads negatives
    # four calls (one cell each) of three chunks: nothing checked again
    run = run_cells(cells, options=RunOptions(device="cpu", chunk_size=2, workers=1, cells_per_call=1))
    assert len(run.records) == 4 and seen == [("poodle", "random"), ("poodle", "base")]
    # from Python: once per call (three chunks), and a method that reads negatives without any raises
    features = read_split(cache, "test")
    eps = EpisodeStream(features.labels, EpisodeSpec(way=3, shot=1, query=2), 6)
    chunks = RunOptions(device="cpu", chunk_size=2, workers=1)
    po = [("p", "poodle", {"steps": 3})]
    evaluate(features, eps, po, negatives=NegativeSpec("random", 5), run=chunks)
    assert seen[2:] == [("poodle", "random")]
    with pytest.raises(ConfigError, match="negatives none: method 'poodle' .with these options. reads negative"):
        evaluate(features, eps, po, negatives=None, run=chunks)
    assert seen[3:] == [("poodle", None)]
    batch = solvers.EpisodeBatch(torch.eye(4)[None], torch.arange(4)[None], torch.eye(4)[None], None, 4)
    with pytest.raises(ConfigError, match="reads negative samples"):
        solve_batch(batch, "poodle", solvers.make_config("poodle", {"steps": 3}))
    assert seen[4:] == [("poodle", None)]


def test_a_cell_holds_its_config_and_its_old_form_warns(cache):
    from poodle import solvers
    from poodle.cells import Cell
    from poodle.results import jsonable

    c = make_cell({"cache": str(cache), "method": "tim-gd", "steps": 7})
    assert c.cfg == solvers.make_config("tim-gd", {"steps": 7}) and solvers.is_checked(c.cfg)
    assert c.solver is solvers.get("tim-gd") and c.config() is c.cfg
    assert c.options == jsonable(solvers.config_dict(c.cfg)) and c.options["steps"] == 7
    old = {k: getattr(c, k) for k in ("label", "cache", "episode", "negatives", "n_neg", "method", "transductive")}
    said = (
        "Cell(options=...) is deprecated: give cfg, the method's config (poodle.solvers.make_config), or make "
        "the cell with poodle.cells.make_cell (removed in 0.3.0)"
    )
    with pytest.warns(DeprecationWarning, match="^" + re.escape(said) + "$"):
        o = Cell(**old, options={"steps": 7})
    assert o == c and o.key == c.key and o.cfg == c.cfg
    # a config built by the caller (the command line's) makes the same cell, used as it is
    cfg = solvers.make_config("tim-gd", {"steps": 7})
    assert make_cell({"cache": str(cache), "method": "tim-gd"}, config=cfg).cfg is cfg
    with pytest.raises(ConfigError, match="method 'tim-gd': options steps given beside its config"):
        make_cell({"cache": str(cache), "method": "tim-gd", "steps": 3}, config=cfg)
    with pytest.raises(ConfigError, match="method 'proto': config must be a ProtoConfig, got TimGDConfig"):
        make_cell({"cache": str(cache), "method": "proto"}, config=cfg)


def test_methods_without_negatives_join_the_call_of_those_with_them(cache):
    base = {"cache": str(cache), "episodes": 4}
    cells = [
        make_cell({**base, "method": m, **o}, label=lab)
        for lab, m, o in [
            ("proto", "proto", {}),
            ("po-b", "poodle", {"negatives": "base"}),
            ("po-r", "poodle", {"negatives": "random"}),
            ("ce", "ce", {}),
        ]
    ]
    cells = [c.__class__(**{**c.__dict__, "index": i}) for i, c in enumerate(cells)]
    order = schedule(cells, cells)
    assert [[c.label for c in b] for b in calls(order, 8)] == [["proto", "po-b", "ce"], ["po-r"]]  # cells' order
    assert [[c.label for c in b] for b in calls(order, 2)] == [["proto", "ce"], ["po-b"], ["po-r"]]


def test_solve_is_cells_through_the_pipeline_with_typed_events(cache, tmp_path):
    events = []
    res = solve(
        cache,
        ["proto", "poodle"],
        options={"poodle": {"steps": 3}},
        episodes=6,
        n_neg=7,
        out=tmp_path / "r.jsonl",
        run=CPU,
        on_event=events.append,
    )
    kinds = [type(e) for e in events]
    assert kinds[0] is CellsStarted and kinds.count(Ready) == 1
    assert kinds.index(Ready) < kinds.index(EpisodesSolved)  # the checks pass before any episode
    assert sum(e.episodes for e in events if isinstance(e, EpisodesSolved)) == 6
    assert all(e.cells == 2 for e in events if isinstance(e, EpisodesSolved))  # one call for both
    done = [e for e in events if isinstance(e, CellFinished)]
    assert [e.cell.method for e in done] == ["proto", "poodle"] and not any(e.skipped for e in done)
    assert res.n_episodes == 6 and res.negatives == NegativeSpec("base", 7) and res.spec.shot == 1
    assert [r["label"] for r in res.records] == ["proto", "poodle"] and res.records[1]["call_cells"] == 2
    # the same cells run again through run_cells find their records and solve nothing
    again = run_cells(res.cells, out=tmp_path / "r.jsonl", options=CPU)
    assert again.computed == 0 and [r["acc"] for r in again.records] == [r["acc"] for r in res.records]
    with pytest.raises(ConfigError, match="unknown setting.s. wayy"):
        solve(cache, ["proto"], wayy=3, run=CPU)
    with pytest.raises(ConfigError, match="negatives random: none of the chosen methods .proto. reads negatives"):
        solve(cache, ["proto"], negatives="random", run=CPU)


def test_the_pipelined_chunk_stream_gives_the_same_results_in_order(cache):
    test = read_split(cache, "test")
    stream = EpisodeStream(test.labels, EpisodeSpec(way=5, shot=1, query=3, seed=5), 23)
    methods = [("p", "proto", None), ("po", "poodle", {"steps": 4, "transductive": True})]
    neg = NegativeSpec("random", 9)
    run = RunOptions(device="cpu", chunk_size=4, workers=1, overlap=False)
    solved: list[int] = []
    plain = evaluate(test, stream, methods, negatives=neg, run=run, hooks=Hooks(progress=solved.append))
    piped = evaluate(test, stream, methods, negatives=neg, run=dataclasses.replace(run, overlap=True))
    for k in ("p", "po"):
        assert torch.equal(plain[k], piped[k])
    assert sum(solved) == 23 and len(solved) == 6  # chunks of 4
    # the keywords of 0.1 still work for one release, with a warning naming the replacement, and give
    # the same numbers (the suite turns these warnings into errors everywhere else: pyproject.toml)
    instead = r" is deprecated: give run=RunOptions\(\.\.\.\) and hooks=Hooks\(\.\.\.\) \(removed in 0\.3\.0\)$"
    with pytest.warns(DeprecationWarning, match=r"^evaluate\(device=, chunk_size=, workers=, overlap=\)" + instead):
        old = evaluate(test, stream, methods, negatives=neg, device="cpu", chunk_size=4, workers=1, overlap=False)
    assert all(torch.equal(plain[k], old[k]) for k in ("p", "po"))
    # the callbacks too, next to a new-style run
    got: dict = {"progress": [], "ready": 0, "planned": [], "stats": {}}
    with pytest.warns(DeprecationWarning, match=r"^evaluate\(progress=, ready=, planned=, stats=\)" + instead):
        old = evaluate(
            test,
            stream,
            methods,
            negatives=neg,
            run=run,
            progress=got["progress"].append,
            ready=lambda: got.update(ready=got["ready"] + 1),
            planned=got["planned"].append,
            stats=got["stats"],
        )
    assert all(torch.equal(plain[k], old[k]) for k in ("p", "po"))
    assert got["progress"] == solved and got["ready"] == 1 and len(got["planned"]) == 1
    assert got["planned"][0].chunk == 4 and got["stats"]["n_chunks"] == 6 and got["stats"]["chunk_size"] == 4
    with pytest.raises(TypeError, match="unexpected keyword argument.s. devcie"):
        evaluate(test, stream, methods, negatives=neg, devcie="cpu")
    with pytest.raises(ConfigError, match="workers must be a positive integer, got 0"):
        RunOptions(workers=0)  # checked once, when made: evaluate trusts it


def test_an_explicit_memory_bound_counts_what_the_call_holds(cache):
    test = read_split(cache, "test")
    stream = EpisodeStream(test.labels, EpisodeSpec(way=5, shot=1, query=3), 10)
    methods = [("po", "poodle", {"steps": 2})]
    held = test.features.numel() * 4 + read_split(cache, "train").features.numel() * 4
    stats: dict = {}
    evaluate(
        test,
        stream,
        methods,
        negatives=NegativeSpec("base", 5),
        cache_path=cache,
        run=RunOptions(device="cpu"),
        hooks=Hooks(stats=stats),
    )
    assert stats["held_bytes"] == held
    with pytest.raises(ConfigError, match=f"features and negative pool held for the whole run take {held:,} bytes"):
        evaluate(
            test, stream, methods, negatives=NegativeSpec("base", 5), cache_path=cache, run=RunOptions(max_memory=held)
        )
    plan = plan_chunks(100, 20, 16, 5, torch.device("cpu"), max_memory=held + 100_000, held=held, workers=1)
    assert plan.chunk == 100_000 // (4 * (3 * 20 * 16 + 8 * 6 * 16 + 16 * 20 * 6))  # 6
    edges = [a for a, _ in plan.bounds] + [plan.bounds[-1][1]]
    assert edges[:4] == [0, 1, 3, 7] and edges[-1] == 100 and max(b - a for a, b in plan.bounds) == plan.chunk


def test_library_errors_name_parameters_and_each_command_writes_its_own_flags():
    from poodle.cli._common import friendly_errors

    def command(name, *opts):
        @click.command(name=name)
        @friendly_errors
        def cmd(**kw):
            raise ConfigError(f"{mark('n_neg')} must be a positive integer; {mark('save_episodes_to')} is set")

        for o in opts:
            cmd = click.option(*o)(cmd)
        return cmd

    with_flags = command("a", ("--n-neg", "n_neg"), ("--save-episodes", "save_episodes"))
    without = command("b")
    r = CliRunner().invoke(with_flags, [])
    assert r.exit_code == 1 and "--n-neg must be a positive integer; --save-episodes is set" in r.output
    r = CliRunner().invoke(without, [])
    assert r.exit_code == 1 and "error: n_neg must be a positive integer; save_episodes_to is set" in r.output


def test_solve_takes_one_method_name_and_refuses_options_of_a_method_not_chosen(cache):
    """A lone name is one method (it was read as its letters: ``method o given twice``); options for
    a method not among ``methods`` are an error naming them, as the command line's ``--set M.KEY``
    for a method not given is (they were dropped without a word)."""
    one = solve(cache, "proto", episodes=4)
    assert list(one.accs) == ["proto"] and [r["method"] for r in one.records] == ["proto"]
    with pytest.raises(ConfigError, match="options for tim-gd, not among the chosen methods proto") as e:
        solve(cache, ["proto"], episodes=4, options={"tim-gd": {"lr": 1.0}})
    assert (e.value.param, e.value.value) == ("options", ["tim-gd"])
