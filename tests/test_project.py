"""A project's defaults: the project file (poodle.toml / --config) through click's default_map, the
newest complete training run, and the cache extract wrote last (poodle.project)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from poodle import project
from poodle.cache import write_arrays
from poodle.cli.main import cli


def run(*args: object) -> tuple[int, str]:
    """``poodle ARGS`` in-process: (exit code, everything printed); a traceback fails the test."""
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"traceback instead of an error: {res.exception!r}\n{res.output}") from res.exception
    return res.exit_code, res.output


def one_line(output: str) -> str:
    """The only line printed (rich wraps long lines: joined back); fails when more was printed."""
    assert output.startswith("error: "), output
    return " ".join(output.split())


@pytest.fixture
def features(tmp_path, make_features):
    """A small cache: 8 base classes, 6 test classes, D=16."""

    def make(path: Path, seed: int = 0, **attrs) -> Path:
        xtr, ytr = make_features(8, 20, 16, seed=seed + 1)
        xte, yte = make_features(6, 20, 16, seed=seed + 2, spread=0.4)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_arrays(
            path,
            {"train": (xtr, ytr, [f"b{i}" for i in range(8)]), "test": (xte, yte, [f"t{i}" for i in range(6)])},
            **attrs,
        )

    return make


# ------------------------------------------------------------------------------------------ project file


def test_the_project_file_sets_defaults_and_typed_options_win(tmp_path, monkeypatch, features):
    features(tmp_path / "feat.h5")
    (tmp_path / "poodle.toml").write_text(
        '[defaults]\ndevice = "cpu"\n\n[solve]\ncache = "feat.h5"\nepisodes = 30\nmethod = "proto"\n'
    )
    monkeypatch.chdir(tmp_path)
    code, out = run("solve")
    assert code == 0, out
    assert "30 episodes: 5-way 1-shot" in out and "split test of feat.h5" in out and "device cpu" in out
    code, out = run("solve", "--episodes", 40, "--method", "ce", "--steps", 5)
    assert code == 0, out
    assert "40 episodes" in out and "ce" in out
    # --dataset/--backbone typed: the file's cache gives way (no "give either ... not both")
    code, out = run("solve", "--dataset", "mini", "--backbone", "resnet12")
    assert code == 1 and "no feature cache at cache/mini/resnet12.h5" in one_line(out)


def test_config_names_another_file_whose_paths_are_read_from_its_folder(tmp_path, monkeypatch, features):
    features(tmp_path / "proj" / "feat.h5")
    (tmp_path / "proj" / "settings.toml").write_text('[solve]\ncache = "feat.h5"\nepisodes = 25\nmethod = "proto"\n')
    (tmp_path / "poodle.toml").write_text("[solve]\nepisodes = 999\n")  # not read: --config names another
    monkeypatch.chdir(tmp_path)
    code, out = run("--config", "proj/settings.toml", "solve", "--device", "cpu")
    assert code == 0, out
    assert "25 episodes" in out and f"split test of {Path('proj') / 'feat.h5'}" in out
    code, out = run("--config", "proj/absent.toml", "solve")
    assert code == 1 and one_line(out) == "error: project file proj/absent.toml does not exist"


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "[solv]\nepisodes = 3\n",
            "poodle.toml: unknown table [solv]; tables are [defaults] and the commands [extract]",
        ),
        ("[solve]\nepisods = 3\n", "poodle.toml: [solve] episods: solve has no option 'episods' (its options:"),
        ("[defaults]\nnope = 1\n", "poodle.toml: [defaults] nope: no command has an option 'nope'"),
        ('[solve]\nepisodes = "many"\n', 'poodle.toml: [solve] episodes = "many": expected an integer'),
        (
            '[extract]\ndataset = "imagenet"\n',
            "poodle.toml: [extract] dataset = \"imagenet\": 'imagenet' is not one of",
        ),
        ("episodes = 3\n", "poodle.toml: 'episodes' is outside any table"),
        ("[solve\n", "project file poodle.toml is not valid TOML"),
    ],
)
def test_a_bad_project_file_is_one_line_naming_the_file_table_and_key(tmp_path, monkeypatch, text, message):
    (tmp_path / "poodle.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    code, out = run("solve")
    assert code == 1 and message in one_line(out), out
    assert sorted(os.listdir(tmp_path)) == ["poodle.toml"]


def test_a_bad_method_option_of_the_project_file_is_said_with_its_file_and_key(tmp_path, monkeypatch, features):
    """A method's option from the project file is the file's value, not a typed one: its error names
    the file, the table and the key (as every other value of the file), before any episode."""
    features(tmp_path / "feat.h5")
    monkeypatch.chdir(tmp_path)
    for text, message in [
        (
            "lr = -1\n",
            "error: --lr (poodle.toml [solve] lr): method 'tim-gd': option 'lr' must lie in (0, inf), got -1",
        ),
        ('set = ["lr=-1"]\n', "error: --set lr (poodle.toml [solve] set): method 'tim-gd': option 'lr' must lie in"),
        ("alpha = 2\n", "error: option --alpha (poodle.toml [solve] alpha) is not an option of the chosen method(s)"),
    ]:
        (tmp_path / "poodle.toml").write_text(f'[solve]\ncache = "feat.h5"\nmethod = "tim-gd"\n{text}')
        code, out = run("solve", "--episodes", 3)
        assert code == 1 and one_line(out).startswith(message), out
    (tmp_path / "poodle.toml").write_text('[solve]\ncache = "feat.h5"\nmethod = "tim-gd"\nlr = 0.5\n')
    code, out = run("solve", "--episodes", 3, "--lr", -2)  # typed over the file's: the flag alone
    assert code == 1 and one_line(out).startswith("error: --lr: method 'tim-gd': option 'lr' must lie in"), out


def test_an_option_with_an_optional_value_set_to_true_is_the_option_alone(tmp_path, monkeypatch):
    from poodle.cli._common import project_default_map

    (tmp_path / "poodle.toml").write_text('[extract]\npretrained = true\n[predict]\npretrained = "IMAGENET1K_V2"\n')
    monkeypatch.chdir(tmp_path)
    got = project_default_map(cli.make_context("poodle", ["extract"]), None)
    assert got == {"extract": {"pretrained": "DEFAULT"}, "predict": {"pretrained": "IMAGENET1K_V2"}}


def test_defaults_table_reaches_every_command_with_that_option(tmp_path, monkeypatch):
    (tmp_path / "poodle.toml").write_text('[defaults]\ncache-root = "elsewhere"\n\n[extract]\nbackbone = "resnet12"\n')
    monkeypatch.chdir(tmp_path)
    # extract's default checkpoint is looked up under the cache root of the file, with its backbone
    code, out = run("extract")
    assert code == 1
    assert one_line(out) == (
        "error: no checkpoint of resnet12 on glyphs: train one with 'poodle train --backbone resnet12' "
        "or give --checkpoint FILE or --random-weights"
    )
    code, out = run("solve")
    assert code == 1 and "written by poodle extract under elsewhere" in one_line(out)
    assert sorted(os.listdir(tmp_path)) == ["poodle.toml"]


# ------------------------------------------------------------------------------------------ training runs


def _fake_run(root: Path, dataset: str, name: str, backbone: str, *, mtime: float, image_size: int = 28, student=None):
    out = root / dataset / "checkpoints" / name
    final = out / f"student_{student}" if student is not None else out
    final.mkdir(parents=True)
    (final / "best.pt").write_bytes(b"weights of " + name.encode())
    cfg = {"dataset": dataset, "backbone": backbone, "recipe": "simple", "image_size": image_size}
    written = f"somewhere/else/{final.relative_to(root).as_posix()}/best.pt"  # as the training command saw it
    (out / "train.json").write_text(json.dumps({"config": cfg, "checkpoint": written}))
    os.utime(out / "train.json", (mtime, mtime))
    return final / "best.pt"


def test_latest_checkpoint_is_the_newest_complete_run_of_that_backbone_on_that_dataset(tmp_path):
    root = tmp_path / "cache"
    assert project.latest_checkpoint(root, "conv4_64", "glyphs") is None
    old = _fake_run(root, "glyphs", "conv4_64-simple", "conv4_64", mtime=1_000)
    new = _fake_run(root, "glyphs", "conv4_64-rot-kd", "conv4_64", mtime=2_000, image_size=32, student=1)
    _fake_run(root, "glyphs", "resnet12-simple", "resnet12", mtime=3_000)
    _fake_run(root, "mini", "conv4_64-simple", "conv4_64", mtime=4_000)
    incomplete = root / "glyphs" / "checkpoints" / "conv4_64-rot"
    incomplete.mkdir()
    (incomplete / "last.pt").write_bytes(b"x")  # no train.json: still training, or stopped
    run_ = project.latest_checkpoint(root, "conv4_64", "glyphs")
    assert run_ is not None and run_.checkpoint == new and run_.image_size == 32 and run_.recipe == "simple"
    new.unlink()  # a run whose checkpoint is gone is no candidate
    assert project.latest_checkpoint(root, "conv4_64", "glyphs").checkpoint == old
    assert project.latest_checkpoint(root, "conv4_64", "mini").out_dir.parent.parent.name == "mini"


# ------------------------------------------------------------------------------------------ the caches' index


def test_the_index_names_the_cache_written_last(tmp_path, features):
    root = tmp_path / "cache"
    a = features(root / "glyphs" / "conv4_64.h5")
    b = features(root / "mini" / "resnet12-x.h5", seed=5)
    assert project.latest_cache(root) is None
    project.record_cache(
        root, a, {"dataset": "glyphs", "backbone": "conv4_64", "checkpoint_sha256": "aa", "image_size": 28}
    )
    project.record_cache(
        root, b, {"dataset": "mini", "backbone": "resnet12", "checkpoint_sha256": "bb", "image_size": 84}
    )
    assert project.latest_cache(root).path == b
    assert project.latest_cache(root, dataset="glyphs").path == a
    assert project.latest_cache(root, backbone="resnet50") is None
    assert project.cache_of(root, "glyphs", "conv4_64", "aa", 28).path == a
    assert project.cache_of(root, "glyphs", "conv4_64", "aa", 84) is None
    assert project.default_tag(root, "mini", "resnet12", "resnet12", "bb", 84) == "x"
    assert project.default_tag(root, "glyphs", "conv4_64", "conv4_64", "aa", 28) is None
    project.record_cache(
        root, a, {"dataset": "glyphs", "backbone": "conv4_64", "checkpoint_sha256": "aa", "image_size": 28}
    )
    assert project.latest_cache(root).path == a  # written again: last again, listed once
    assert [r.path for r in project.cache_records(root)] == [b, a]
    a.unlink()
    assert project.latest_cache(root).path == b  # a deleted cache is skipped
    data = json.loads((root / "caches.json").read_text())
    assert [e["path"] for e in data["caches"]] == ["mini/resnet12-x.h5", "glyphs/conv4_64.h5"]
    (root / "caches.json").write_text("{cut")
    assert project.latest_cache(root) is None


def test_a_cache_written_before_the_index_is_found_by_its_attributes(tmp_path, features):
    root = tmp_path / "cache"
    features(root / "glyphs" / "conv4_64-demo-ab12.h5", backbone="conv4_64", checkpoint_sha256="cc", image_size=28)
    features(root / "glyphs" / "conv4_64.h5", backbone="conv4_64", checkpoint_sha256="dd", image_size=28)
    assert project.default_tag(root, "glyphs", "conv4_64", "conv4_64", "cc", 28) == "demo-ab12"
    assert project.default_tag(root, "glyphs", "conv4_64", "conv4_64", "dd", 28) is None
    assert project.default_tag(root, "glyphs", "conv4_64", "conv4_64", "cc", 84) is None
    assert project.default_tag(root, "mini", "conv4_64", "conv4_64", "cc", 28) is None


def test_solve_and_grid_without_a_cache_take_the_one_extract_wrote_last(tmp_path, monkeypatch, features):
    monkeypatch.chdir(tmp_path)
    code, out = run("solve", "--episodes", 20)
    assert code == 1 and one_line(out) == (
        "error: no feature cache written by poodle extract under cache: make one with "
        "'poodle extract --backbone NAME' or give --cache FILE"
    )
    path = features(Path("cache") / "glyphs" / "conv4_64.h5")
    project.record_cache("cache", path, {"dataset": "glyphs", "backbone": "conv4_64"})
    code, out = run("solve", "--episodes", 20, "--method", "proto", "--device", "cpu")
    assert code == 0, out
    assert out.splitlines()[0] == f"features: {path} (the cache poodle extract wrote last)"
    assert "20 episodes" in out
    code, out = run("solve", "--episodes", 20, "--dataset", "mini")
    assert code == 1 and "no feature cache of dataset mini written by poodle extract" in one_line(out)
    (tmp_path / "g.toml").write_text('method = "proto"\nepisodes = 20\nshot = [1, 5]\n')
    code, out = run("grid", "g.toml", "--device", "cpu")
    assert code == 0, out
    assert out.splitlines()[0] == f"features: {path.resolve()} (the cache poodle extract wrote last)"
    assert "2 cells computed" in out
