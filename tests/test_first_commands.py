"""The commands users type, verbatim, in an empty folder and in the demo's folder: `poodle train
--backbone conv4_64 --epochs 1`, `poodle extract --backbone conv4_64`, `poodle solve --episodes N
--transductive`. Each finds what the previous one made under ./cache (the newest complete training
run, the cache extract wrote last) and says so on its first line; where nothing is there, one line
names the command that makes it.

The embedded glyphs are generated from a subset of the alphabets (the full set takes minutes): the
commands are the same, only the dataset is smaller."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from poodle.cli.main import cli

SUBSET = {"max_per_alphabet": 2, "instances": 20}  # 18 train, 8 val and 8 test classes of 20 images
EPISODES = 300


def run(*args: object) -> tuple[int, str, str]:
    """``poodle ARGS`` in-process: (exit code, stderr + stdout as printed, stdout alone)."""
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"traceback instead of an error: {res.exception!r}\n{res.output}") from res.exception
    return res.exit_code, res.output, res.stdout


@pytest.fixture(scope="module")
def glyph_subset(tmp_path_factory):
    """A cache root holding the glyph subset, generated once for the module."""
    from poodle.data.glyphs import ensure_glyphs

    root = tmp_path_factory.mktemp("glyphs-template")
    ensure_glyphs(root, **SUBSET)
    return root / "glyphs"


@pytest.fixture
def folder(tmp_path, monkeypatch, glyph_subset):
    """An empty working folder whose glyphs, once asked for, are the subset (copied, not generated)."""
    import poodle.data.glyphs as glyphs

    original = glyphs.ensure_glyphs

    def subset(cache_root, **kwargs):
        target = Path(cache_root) / "glyphs"
        if not target.exists():
            shutil.copytree(glyph_subset, target)
        return original(cache_root, **{**SUBSET, **kwargs})

    monkeypatch.setattr(glyphs, "ensure_glyphs", subset)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_extract_in_an_empty_folder_names_the_command_that_makes_its_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run("extract", "--backbone", "resnet12")
    assert code == 1 and out == (
        "error: no checkpoint of resnet12 on glyphs: train one with 'poodle train --backbone resnet12' or give "
        "--checkpoint FILE or --random-weights\n"
    )
    assert os.listdir(tmp_path) == []  # nothing generated, nothing written


def test_train_extract_solve_as_typed_in_an_empty_folder(folder):
    code, out, stdout = run("train", "--backbone", "conv4_64", "--epochs", 1)
    assert code == 0, out
    assert out.splitlines()[0].startswith("training conv4_64 on glyphs (simple, 1 epochs")
    assert stdout.splitlines()[-1] == "cache/glyphs/checkpoints/conv4_64-simple/best.pt"

    code, out, stdout = run("extract", "--backbone", "conv4_64")
    assert code == 0, out
    assert out.splitlines()[0] == (
        "checkpoint: cache/glyphs/checkpoints/conv4_64-simple/best.pt (the newest complete training run of "
        "conv4_64 on glyphs, 28 px)"
    )
    assert stdout.splitlines()[-1] == "cache/glyphs/conv4_64.h5"

    code, out, _ = run("solve", "--episodes", EPISODES, "--transductive")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "features: cache/glyphs/conv4_64.h5 (the cache poodle extract wrote last)"
    assert any(line.startswith(f"{EPISODES} episodes: 5-way 1-shot") for line in lines), out

    # a second extraction finds every split complete: nothing is recomputed
    code, out, _ = run("extract", "--backbone", "conv4_64")
    assert code == 0 and out.count("already complete in cache/glyphs/conv4_64.h5, skipped") == 3, out


def test_the_demos_folder_gives_the_demos_checkpoint_and_cache(folder):
    code, out, _ = run("demo", "--epochs", 1, "--episodes", 20, "--competitors", "none", "--device", "cpu")
    assert code == 0, out
    (ckpt,) = Path("cache/glyphs/checkpoints").glob("conv4_64-simple-demo-*/best.pt")
    (features,) = Path("cache/glyphs").glob("conv4_64-demo-*.h5")

    code, out, stdout = run("extract", "--backbone", "conv4_64")
    assert code == 0, out
    assert out.splitlines()[0] == (
        f"checkpoint: {ckpt} (the newest complete training run of conv4_64 on glyphs, 28 px)"
    )
    assert out.count(f"already complete in {features}, skipped") == 3, out  # the demo's cache, as it is
    assert stdout.splitlines()[-1] == str(features)

    code, out, _ = run("solve", "--episodes", 20, "--transductive")
    assert code == 0, out
    assert out.splitlines()[0] == f"features: {features} (the cache poodle extract wrote last)"
