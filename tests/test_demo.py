"""`poodle demo`, reduced (`--quick`: a small glyph subset, one epoch, few episodes): it runs end to
end, prints the table, and a second run reuses every artefact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from poodle.cli.main import cli
from poodle.demo import (
    PAPER_COMPETITORS,
    _old_cell_path,
    competitor_names,
    demo_grid,
    demo_rows,
    quick_config,
    run_demo,
)
from poodle.errors import ConfigError
from poodle.grid import cell_keys, expand, fingerprints
from poodle.results import read_results

EPISODES = 20


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo-cache")
    args = ["demo", "--quick", "--cache-root", str(cache), "--episodes", str(EPISODES), "--device", "cpu"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    return cache, args, res.output


def _table_rows(output: str) -> dict[str, list[str]]:
    """Method -> its four cells, read from the printed rich table."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if len(cells) == 5 and (cells[1].count("±") or cells[1] == "–"):
            rows[cells[0]] = cells[1:]
    return rows


def test_demo_prints_the_table_of_every_method_and_setting(first_run):
    cache, _, output = first_run
    rows = _table_rows(output)
    expected = [r.label for r in demo_rows("paper")]
    assert list(rows) == expected
    # proto and CE are inductive only; POODLE has both settings; competitors are transductive only
    assert rows["Proto"][2:] == ["–", "–"]
    for label in ("POODLE-B", "POODLE-R"):
        assert all("±" in c for c in rows[label])
    for name in competitor_names("paper"):
        assert rows[name][:2] == ["–", "–"] and all("±" in c for c in rows[name][2:])
    for cells in rows.values():
        for c in cells:
            if c != "–":
                mean, ci = (float(v) for v in c.split("±"))
                assert 20.0 <= mean <= 100.0 and 0.0 < ci < 30.0  # 5-way: chance is 20%

    # the Markdown and JSON copies in the cache hold the same numbers
    (md,) = (cache / "glyphs" / "demo").glob("table-*.md")
    text = md.read_text()
    assert "| POODLE-B |" in text and f"{EPISODES} episodes" in text
    payload = json.loads(md.with_suffix(".json").read_text())
    b = next(r for r in payload["rows"] if r["method"] == "poodle" and r["negatives"] == "base")
    assert f"{b['cells']['transductive 5-shot'][0]:.2f}" == rows["POODLE-B"][3].split("±")[0].strip()
    records = read_results(cache / "glyphs" / "demo" / "results.jsonl").records
    assert len(records) == 2 * (2 + 2 * 2 + len(competitor_names("paper")))
    assert all(len(r["acc"]) == EPISODES and r["group"] == "demo" for r in records)


def test_second_run_reuses_checkpoint_features_and_results(first_run):
    cache, args, output = first_run
    ckpts = list((cache / "glyphs" / "checkpoints").rglob("*.pt"))
    stamps = {p: p.stat().st_mtime_ns for p in ckpts}
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "already complete" in res.output and "0 solved now" in res.output
    assert _table_rows(res.output) == _table_rows(output)
    assert {p: p.stat().st_mtime_ns for p in ckpts} == stamps

    result = run_demo(quick_config(cache_root=str(cache), episodes=EPISODES, device="cpu"))
    assert result.reused == {"train": True, "evaluate": True}


def test_cells_of_the_earlier_demo_cache_are_taken_over(first_run, tmp_path):
    """The demo before the results layer kept one JSON file per cell (accuracies rounded to 6
    digits); those cells are converted to records with the exact accuracies, not solved again."""
    cache, args, output = first_run
    demo_dir = cache / "glyphs" / "demo"
    results = demo_dir / "results.jsonl"
    records = read_results(results).records
    cfg = quick_config(cache_root=str(cache), episodes=EPISODES, device="cpu")
    spec = demo_grid(cfg, demo_rows(cfg.competitors), Path(records[0]["cache"]), demo_dir)
    by_key = {r["key"]: r for r in records}
    cells = expand(spec)
    keys = cell_keys(cells, fingerprints(spec, cells))
    for c in cells:
        old = _old_cell_path(cfg, c, records[0]["cache_id"], demo_dir)
        old.parent.mkdir(parents=True, exist_ok=True)
        acc = by_key[keys[c.index][1]]["acc"]
        old.write_text(json.dumps({"accuracy": [round(a, 6) for a in acc]}))
    results.rename(tmp_path / "saved.jsonl")
    try:
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, res.output
        assert f"{len(cells)} table cells taken over" in res.output and "0 solved now" in res.output
        assert _table_rows(res.output) == _table_rows(output)
        assert {r["key"]: r["acc"] for r in read_results(results).records} == {k: r["acc"] for k, r in by_key.items()}
    finally:
        for c in cells:
            _old_cell_path(cfg, c, records[0]["cache_id"], demo_dir).unlink()


def test_more_episodes_are_new_cells_but_the_same_backbone(first_run):
    cache, _, _ = first_run
    result = run_demo(quick_config(cache_root=str(cache), episodes=EPISODES + 5, device="cpu", competitors="none"))
    assert result.reused["train"] and not result.reused["evaluate"]
    assert {r.label for r in result.rows} == {r.label for r in demo_rows("none")}


def test_competitor_selection():
    assert competitor_names("none") == []
    assert set(competitor_names("paper")) <= set(PAPER_COMPETITORS)
    assert {"tim-gd", "alpha-tim", "paddle", "bms", "proto-lp"} <= set(competitor_names("all"))
    with pytest.raises(ConfigError, match="'poodle' is not a registered transductive method"):
        competitor_names("tim-gd,poodle")
