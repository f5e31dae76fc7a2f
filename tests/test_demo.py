"""`poodle demo`, reduced (`--quick`: a small glyph subset, one epoch, few episodes): it runs end to
end, prints the table, and a second run reuses every artefact."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from poodle.cache import read_split
from poodle.cli.main import cli
from poodle.demo import (
    PAPER_COMPETITORS,
    competitor_names,
    demo_rows,
    quick_config,
    run_demo,
)
from poodle.demo_domains import DOMAIN_METHODS, DOMAINS, MORE_METHODS, alphabet_of, domain_methods
from poodle.errors import ConfigError
from poodle.results import read_results

ROOT = Path(__file__).resolve().parents[1]

EPISODES = 20


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo-cache")
    args = ["demo", "--quick", "--cache-root", str(cache), "--episodes", str(EPISODES), "--device", "cpu"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    return cache, args, res.output


def _table_rows(output: str) -> dict[str, list[str]]:
    """Method -> its four cells, read from the printed rich table (without the ``*`` that marks a
    bold entry in plain text)."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip().removesuffix("*") for c in re.split(r"[│┃]", line)[1:-1]]
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

    # not a terminal: plain progress lines, the glyph generation's and meta-validation's included
    (manifest,) = (cache / "glyphs").glob("images-*/manifest.json")
    splits = json.loads(manifest.read_text())["splits"]
    n = sum(s["images"] for s in splits.values())
    assert f"generating glyphs: {n:,}/{n:,} img (100%)" in output
    assert f"epoch 1/1 validating: {splits['val']['images']:,}/{splits['val']['images']:,} img (100%)" in output


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


def test_the_demo_results_re_solved_cell_by_cell_are_identical(first_run):
    """benchmarks/demo_equivalence.py rebuilds every cell of a results file from its record and
    solves it again through the pipeline: the same accuracy on every episode."""
    cache, _, _ = first_run
    results = cache / "glyphs" / "demo" / "results.jsonl"
    n = len(read_results(results).records)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "demo_equivalence.py"), str(results), "12"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"identical per-episode accuracies: {n} of {n} cells" in proc.stdout


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


def test_demo_stopped_at_three_points_continues_to_the_same_features_and_cells(first_run, tmp_path):
    """SIGTERM or SIGINT to the demo's process group while it extracts the train split, the val
    split (train committed), and solves the table (features committed); then the same command
    finishes with the features and per-episode accuracies of the uninterrupted first run."""
    import shutil

    import torch
    from _signals import interrupted, run, stopped_cleanly

    from poodle.cache import read_split

    cache, _, _ = first_run
    shutil.copytree(cache, tmp_path / "c")
    (features,) = (tmp_path / "c").rglob("quick/**/*.h5")
    features.unlink()
    (tmp_path / "c" / "glyphs" / "demo" / "results.jsonl").unlink()
    args = ["demo", "--quick", "--cache-root", "c", "--episodes", str(EPISODES), "--device", "cpu"]
    args += ["--competitors", "none"]
    for stage, sig in (("train", signal.SIGTERM), ("val", signal.SIGINT), ("solving", signal.SIGTERM)):
        p = interrupted(args, tmp_path, 2, sig, stage=stage)
        line = stopped_cleanly(p, sig, args, tmp_path)
        assert "every finished epoch, staged batch of features and table cell under c" in line
    run(args, tmp_path)
    original = next(cache.rglob("quick/**/*.h5"))
    for split in ("train", "val", "test"):
        a, b = read_split(original, split), read_split(features, split)
        assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)

    def cells(path: Path) -> dict[tuple, list[float]]:  # by setting (the key holds the cache's identity)
        records = read_results(path).records
        return {(r["label"], json.dumps(r["episode"], sort_keys=True), r["transductive"]): r["acc"] for r in records}

    before = cells(cache / "glyphs" / "demo" / "results.jsonl")
    after = cells(tmp_path / "c" / "glyphs" / "demo" / "results.jsonl")
    assert len(after) == 12 and all(before[k] == v for k, v in after.items())  # 12 cells: competitors none


# ------------------------------------------------------------------ --protocol meta-dataset


MD_EPISODES = 12


@pytest.fixture(scope="module")
def md_run(first_run):
    """The per-domain demo on the same reduced glyphs, backbone and features as ``first_run``."""
    cache, _, _ = first_run
    args = ["demo", "--quick", "--protocol", "meta-dataset", "--cache-root", str(cache)]
    args += ["--episodes", str(MD_EPISODES), "--device", "cpu"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    return cache, args, res.output


def _domain_rows(output: str) -> dict[str, list[str]]:
    """Label -> its printed cells (domains, mean over domains, average rank), from the rich table."""
    rows = {}
    labels = {m.label for m in DOMAIN_METHODS}
    for line in output.splitlines():
        parts = line.replace("│", " ").replace("┃", " ").split()  # a boxed table's rows
        if parts and parts[0] in labels:
            rows[parts[0]] = re.findall(r"\d+\.\d+ ± \d+\.\d+|\d+\.\d+ \[\d+\.\d+, \d+\.\d+\]", line)
    return rows


def test_meta_dataset_demo_prints_the_per_domain_table_of_its_records(md_run):
    cache, _, output = md_run
    out_dir = cache / "glyphs" / "quick" / "demo-meta-dataset"
    records = read_results(out_dir / "results.jsonl").records
    methods = domain_methods()
    domains = [d.name for d in DOMAINS]
    assert len(records) == len(methods) * len(domains)
    assert f"{len(records)} solved now" in output
    for r in records:
        assert r["cache"] in domains and len(r["acc"]) == MD_EPISODES
        assert r["episode"]["protocol"] == "meta-dataset" and r["episode"]["bilevel"] is True
        assert r["episode"]["way"] is None and r["episode"]["shot"] is None

    rows = _domain_rows(output)
    assert list(rows) == [m.label for m in methods]
    by = {(r["label"], r["cache"]): np.asarray(r["acc"]) for r in records}
    for label, cells in rows.items():
        assert len(cells) == len(domains) + 2
        means = []
        for j, d in enumerate(domains):
            acc = by[label, d]
            mean, ci = (float(v) for v in cells[j].split("±"))
            assert mean == pytest.approx(100 * acc.mean(), abs=0.006)  # the printed mean of the episodes
            assert ci == pytest.approx(100 * 1.96 * acc.std() / np.sqrt(len(acc)), abs=0.006)  # population std
            means.append(100 * acc.mean())
        assert float(cells[-2].split("±")[0]) == pytest.approx(np.mean(means), abs=0.006)
        rank = float(cells[-1].split()[0])
        assert 1.0 <= rank <= len(methods)
    # the average ranks are those of the per-domain means (1 = best; tied means share their positions)
    for lab, cells in rows.items():
        rank = 0.0
        for d in domains:
            m = by[lab, d].mean()
            above = sum(by[o, d].mean() > m + 1e-9 for o in rows)
            tied = sum(abs(by[o, d].mean() - m) <= 1e-9 for o in rows)
            rank += (above + (tied + 1) / 2) / len(domains)
        assert float(cells[-1].split()[0]) == pytest.approx(rank, abs=0.006)

    # the JSON copy holds the same numbers; the domain caches hold their alphabets' classes only
    (js,) = out_dir.glob("table-*.json")
    payload = json.loads(js.read_text())
    assert payload["per_domain"]["Proto"]["scripts"][0] == pytest.approx(100 * by["Proto", "scripts"].mean())
    for d in DOMAINS:
        split = read_split(payload["domains"][d.name]["cache"], "test")
        assert {alphabet_of(c) for c in split.classes} == set(d.alphabets)


def test_meta_dataset_demo_second_run_solves_nothing(md_run):
    cache, args, output = md_run
    out_dir = cache / "glyphs" / "quick" / "demo-meta-dataset" / "domains"
    stamps = {p: p.stat().st_mtime_ns for p in out_dir.glob("*.h5")}
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "0 solved now" in res.output
    assert _domain_rows(res.output) == _domain_rows(output)
    assert {p: p.stat().st_mtime_ns for p in out_dir.glob("*.h5")} == stamps


def test_domain_method_selection():
    assert domain_methods() == list(DOMAIN_METHODS)
    assert domain_methods("all") == list(DOMAIN_METHODS + MORE_METHODS)
    assert [m.method for m in domain_methods("Proto,pt-map")] == ["proto", "pt-map"]
    with pytest.raises(ConfigError, match="'ce' is not a method of the per-domain demo"):
        domain_methods("proto,ce")


# ---- the demo's settings: DemoConfig's declarations ------------------------------------------------


def _config_of(monkeypatch, *args):
    """The DemoConfig ``poodle demo ARGS`` would run (the run itself replaced by a stop)."""
    import poodle.demo
    import poodle.demo_domains

    seen = []

    def stop(cfg, **kw):
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(poodle.demo, "run_demo", stop)
    monkeypatch.setattr(poodle.demo_domains, "run_domain_demo", stop)
    res = CliRunner().invoke(cli, ["demo", *args])
    assert res.exit_code == 0 and len(seen) == 1, res.output
    return seen[0]


def test_quick_gives_way_to_the_settings_given(monkeypatch, tmp_path):
    root = ["--cache-root", str(tmp_path)]
    full = _config_of(monkeypatch, *root)
    assert (full.epochs, full.batch_size, full.episodes, full.lr, full.channels_last, full.quick) == (
        3,
        128,
        2000,
        0.1,
        True,
        False,
    )
    quick = _config_of(monkeypatch, *root, "--quick")
    assert (quick.epochs, quick.batch_size, quick.episodes, quick.val_every) == (1, 32, 40, 1)
    given = _config_of(monkeypatch, *root, "--quick", "--epochs", "2", "--no-channels-last", "--threads", "1")
    assert (given.epochs, given.batch_size, given.channels_last, given.threads) == (2, 32, False, 1)
    domains = _config_of(monkeypatch, *root, "--protocol", "meta-dataset")
    assert (domains.protocol, domains.episodes) == ("meta-dataset", 600)
    assert _config_of(monkeypatch, *root, "--protocol", "meta-dataset", "--episodes", "7").episodes == 7


@pytest.mark.parametrize(
    "args, said",
    [
        (["--workers", "-1"], "--workers must be an integer >= 0, got -1"),
        (["--image-size", "0"], "--image-size must be a positive integer, got 0"),
        (["--threads", "-1"], "--threads must be an integer >= 0, got -1"),
        (["--lr", "0"], "--lr must be a number in (0, inf), got 0.0"),
        (["--competitors", "tim-gd,xx"], "--competitors: 'xx' is not a registered transductive method"),
        (["--device", "tpu"], "--device 'tpu': use auto, cpu, cuda or cuda:N (N >= 0)"),
        (["--device", "tpu", "--protocol", "meta-dataset"], "--device 'tpu': use auto, cpu, cuda or cuda:N"),
    ],
)
def test_a_bad_demo_setting_is_refused_before_any_work(tmp_path, monkeypatch, args, said):
    """By its declaration (TrainConfig's for what the demo trains with), before the glyphs are made."""
    import poodle.demo

    def generate(*a, **kw):  # minutes of work the refusal must come before
        raise AssertionError("the glyphs were generated before the setting was refused")

    monkeypatch.setattr(poodle.demo, "ensure_glyphs", generate)
    res = CliRunner().invoke(cli, ["demo", "--cache-root", str(tmp_path / "c"), *args])
    assert res.exit_code == 1 and f"error: {said}" in res.output, res.output
    assert not (tmp_path / "c").exists()


def test_the_demo_declares_what_it_passes_on_as_the_stage_it_goes_to():
    """A setting the demo trains or solves with is that stage's declaration (bounds, help) with the
    demo's default: one declaration, however many stages take it."""
    from poodle.demo import DemoConfig
    from poodle.episodes import EpisodeSpec
    from poodle.options import setting
    from poodle.train import TrainConfig

    for key, group in (("lr", TrainConfig), ("epochs", TrainConfig), ("image_size", TrainConfig), ("way", EpisodeSpec)):
        mine, theirs = setting(DemoConfig, key), setting(group, key)
        assert mine.bounds == theirs.bounds and mine.meta("why") == theirs.meta("why")
    assert setting(DemoConfig, "lr").default == 0.1 and setting(TrainConfig, "lr").default == 0.05
    with pytest.raises(ConfigError, match=r"^lr must be a number in \(0, inf\), got 0.0$") as e:
        DemoConfig(lr=0)
    assert e.value.params == ("lr",)
