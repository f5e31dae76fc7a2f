"""Progress in the form that suits where the output goes: ``--progress plain`` lines at a steady
interval and at each stage's end, ``json`` objects on stderr, ``none``; the interval from the
option, ``POODLE_PROGRESS_INTERVAL`` or the project file."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from poodle.cache import write_arrays
from poodle.cli import _progress
from poodle.cli.main import cli


@pytest.fixture
def cache(tmp_path, make_features):
    xtr, ytr = make_features(10, 20, 16, seed=1)
    xte, yte = make_features(8, 20, 16, seed=2, spread=0.5)
    return write_arrays(
        tmp_path / "c.h5",
        {"train": (xtr, ytr, [f"b{i}" for i in range(10)]), "test": (xte, yte, [f"t{i}" for i in range(8)])},
    )


def _solve(cache, *extra: str, env: dict | None = None):
    args = ["solve", "--cache", str(cache), "--episodes", "30", "--method", "proto", "--device", "cpu", *extra]
    res = CliRunner().invoke(cli, args, env=env)
    assert res.exit_code == 0, res.output
    return res


def test_line_progress_prints_at_the_interval_and_at_each_stage_end(monkeypatch, capsys):
    clock = [100.0]
    monkeypatch.setattr(_progress.time, "monotonic", lambda: clock[0])
    p = _progress.LineProgress("plain", 30.0)
    t = p.add_task("epoch 1/3", total=100, loss="-", unit="steps")
    for _ in range(10):  # 10 steps in 10 s: no line before 30 s
        clock[0] += 1
        p.update(t, advance=1, loss="2.000")
    assert capsys.readouterr().err == ""
    clock[0] += 20
    p.update(t, advance=10, loss="1.500")  # 20 of 100 after 30 s: 0.67 steps/s, 80 left
    line = capsys.readouterr().err.strip()
    assert line == "epoch 1/3: 20/100 steps (20%), 0.7 steps/s, 0:00:30 elapsed, 0:02:00 left, loss 1.500"
    clock[0] += 5
    p.update(t, completed=100)  # the stage's end: at once, whatever the interval
    assert capsys.readouterr().err.strip().startswith("epoch 1/3: 100/100 steps (100%), 2.9 steps/s, 0:00:35 elapsed")
    p.remove_task(t)
    unfinished = p.add_task("val", total=10, unit="img")
    p.update(unfinished, advance=3)
    p.stop()  # removed or stopped unfinished: one last line says so
    assert capsys.readouterr().err.strip().endswith("(stopped)")


def test_json_progress_is_one_object_a_line_on_stderr(cache):
    res = _solve(cache, "--progress", "json", "--progress-interval", "0.000001")
    # stderr holds the progress objects alone (a JSON Lines parser reads every line of it)
    objects = [json.loads(line) for line in res.stderr.splitlines() if line.strip()]
    assert objects and all(o["event"] == "progress" and o["stage"] == "solving" for o in objects)
    last = objects[-1]
    assert last["final"] and last["done"] == last["total"] == 30 and last["unit"] == "episodes"
    assert all(set(o) >= {"done", "total", "rate", "elapsed_s", "left_s"} for o in objects)
    assert "solving:" not in res.stderr  # no plain line beside them
    assert "proto" in res.stdout and "episodes/s" in res.stdout  # the table and the human lines: stdout


def test_the_interval_comes_from_the_option_the_environment_or_the_project_file(cache, tmp_path, monkeypatch):
    # not a terminal: auto is plain, and the stage's end is always said
    res = _solve(cache)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("solving:")]
    assert len(lines) == 1 and lines[0].startswith("solving: 30/30 episodes (100%)")
    assert not [ln for ln in _solve(cache, "--progress", "none").stderr.splitlines() if ln.startswith("solving")]
    seen = {}
    real = _progress.configure

    def spy(mode: str, interval: float) -> None:
        seen["mode"], seen["interval"] = mode, interval
        real(mode, interval)

    monkeypatch.setattr(_progress, "configure", spy)
    _solve(cache, env={"POODLE_PROGRESS_INTERVAL": "7.5"})
    assert seen == {"mode": "auto", "interval": 7.5}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "poodle.toml").write_text("[defaults]\nprogress_interval = 4\nprogress = 'json'\n")
    _solve(cache)
    assert seen == {"mode": "json", "interval": 4.0}
    _solve(cache, "--progress-interval", "2", env={"POODLE_PROGRESS_INTERVAL": "9"})
    assert seen["interval"] == 2.0
    res = CliRunner().invoke(cli, ["solve", "--cache", str(cache), "--progress-interval", "0"])
    assert res.exit_code == 2 and "--progress-interval" in res.output


def test_a_stage_of_unknown_size_that_ends_is_not_said_stopped(cache, tmp_path, monkeypatch, capsys):
    """--episodes-from: the count is known only from the file, so the bar has no total; a run that
    finishes ends its line complete, never with "(stopped)", which is kept for a stage cut short."""
    from poodle.cli._common import progress_bar

    ep = tmp_path / "e.h5"
    _solve(cache, "--save-episodes", str(ep))
    args = ["solve", "--cache", str(cache), "--episodes-from", str(ep), "--method", "proto", "--progress", "plain"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("solving:")]
    assert line.startswith("solving: 30/30 episodes (100%)") and "(stopped)" not in line
    monkeypatch.setitem(_progress._state, "mode", "plain")
    capsys.readouterr()
    with progress_bar("reading", total=None, unit="img") as advance:
        advance(3)
    assert capsys.readouterr().err.startswith("reading: 3/3 img (100%)")
    with pytest.raises(RuntimeError), progress_bar("reading", total=None, unit="img") as advance:
        advance(3)
        raise RuntimeError("cut short")
    line = capsys.readouterr().err.strip()
    assert line.startswith("reading: 3 img,") and line.endswith("(stopped)")


def test_the_summary_repeats_the_progress_lines_rate_and_names_the_whole_runs(cache):
    """The progress line's rate (episodes since solving started) and the summary's are one figure,
    said as "solving"; the rate over the whole run (loading and drawing included) is named so."""
    import re

    res = _solve(cache, "--progress", "plain")
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("solving:")]
    rate = re.match(r"solving: 30/30 episodes \(100%\), ([\d,.]+) episodes/s,", line).group(1)
    text = " ".join((res.stdout + res.stderr).split())
    assert f"{rate} episodes/s solving (the progress line's rate), " in text
    whole = re.search(r"([\d,.]+) episodes/s over the whole run \(loading, drawing and solving: ([\d.]+) s wall", text)
    assert whole is not None and float(whole.group(1).replace(",", "")) <= float(rate.replace(",", "")) * 1.01


def test_a_command_that_reads_the_glyphs_generates_them_first_with_its_progress(monkeypatch, tmp_path, capsys):
    """train and extract on the embedded glyphs: a first use (minutes) is said, and its images
    counted like any stage; a set already there, another dataset or a given root: nothing."""
    from poodle.cli._common import say_glyphs_generation
    from poodle.data import glyphs

    calls = []

    def fake_ensure(cache_root, progress=None, **settings):
        calls.append((str(cache_root), settings))
        for _ in range(3):
            progress(20)
        return cache_root

    left = {"n": 60}
    monkeypatch.setattr(glyphs, "glyphs_to_generate", lambda cache_root: left["n"])
    monkeypatch.setattr(glyphs, "ensure_glyphs", fake_ensure)
    monkeypatch.setitem(_progress._state, "mode", "plain")
    say_glyphs_generation("glyphs", None, str(tmp_path))
    err = capsys.readouterr().err
    assert "generating the glyphs dataset under" in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("generating glyphs:")]
    assert line.startswith("generating glyphs: 60/60 img (100%)")
    assert calls == [(str(tmp_path), {})]
    left["n"] = 0
    say_glyphs_generation("glyphs", None, str(tmp_path))
    say_glyphs_generation("mini", str(tmp_path), str(tmp_path))
    say_glyphs_generation("glyphs", str(tmp_path), str(tmp_path))
    assert len(calls) == 1 and capsys.readouterr().err == ""


def test_glyphs_to_generate_counts_the_images_of_a_set_not_there_yet(tmp_path):
    from poodle.data.glyphs import ensure_glyphs, glyph_classes, glyphs_to_generate

    subset = {"alphabets": ["latin"], "max_per_alphabet": 3, "instances": 2}
    n = glyphs_to_generate(tmp_path, **subset)
    assert n == len(glyph_classes(["latin"], 3)) * 2 == 6
    seen = []
    ensure_glyphs(tmp_path, progress=seen.append, workers=1, **subset)
    assert sum(seen) == n and glyphs_to_generate(tmp_path, **subset) == 0
    assert glyphs_to_generate(tmp_path, **{**subset, "instances": 3}) == 9
