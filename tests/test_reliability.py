"""Promises about bad and unusual input, one test per case found by trying to break every command.

Each test asserts the exit code (or the exception), that the message names the culprit (file, row,
split, option, key, global), and that no input file was changed (bytes and mtime compared before
and after). Commands run in-process through click's CliRunner; real processes are used only where
the promise is about processes (concurrent commits into one cache).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import _images
import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle.cache import list_splits, read_attrs, read_split, write_arrays
from poodle.cli.main import cli
from poodle.errors import CacheError, ConfigError, EpisodeError

D = 16


# ---------------------------------------------------------------------------------------------- helpers


def snapshot(*paths: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under ``paths``: what "no file was damaged" compares."""
    out = {}
    for p in paths:
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()) if p.exists() else []
        for f in files:
            out[str(f)] = (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
    return out


def run(*args: object):
    """``poodle ARGS`` in-process: (exit code, everything printed)."""
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"traceback instead of an error: {res.exception!r}\n{res.output}") from res.exception
    return res.exit_code, res.output


def one_line_error(output: str) -> str:
    """The ``error:`` line (rich may wrap a long one: joined back)."""
    assert "error:" in output, output
    text = output[output.index("error:") :]
    return " ".join(text.split())


def _features(n_classes: int, per_class: int, seed: int, dim: int = D) -> tuple[np.ndarray, np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_classes, dim))
    x = centres.repeat(per_class, 0) + 0.5 * rng.standard_normal((n_classes * per_class, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), np.arange(n_classes).repeat(per_class), [f"c{i}" for i in range(n_classes)]


@pytest.fixture
def cache(tmp_path) -> Path:
    return write_arrays(tmp_path / "c.h5", {"train": _features(8, 10, 1), "test": _features(6, 20, 2)})


def _damage(path: Path, split: str, row: int, value) -> None:
    """Write ``value`` (a float or a vector) into one feature row of a cache, in place."""
    with h5py.File(path, "a") as f:
        x = f[split]["features"][row]
        f[split]["features"][row] = np.full_like(x, value) if np.isscalar(value) else value


SOLVE = ("solve", "--episodes", 4, "--device", "cpu", "--workers", 1)


# ============================================================================ data is never lost

_COMMITTER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    from poodle import cache
    split, go, caches = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    attrs = cache.make_root_attrs("ds", "bb", image_size=8, transform="t")
    rng = np.random.default_rng(len(split))
    writers = []
    for c in caches:
        w = cache.SplitWriter(c, split, root_attrs=attrs, classes=["a", "b"], samples_sha256=split, n_total=40,
                              dim=64)
        w.append(rng.standard_normal((40, 64)), [0, 1] * 20, [f"{split}{i}" for i in range(40)])
        writers.append(w)
    while not go.exists():
        time.sleep(0.001)
    for w in writers:
        w.commit()
""")


def test_two_processes_committing_splits_into_one_cache_keep_both(tmp_path):
    # A big existing split makes each commit's copy slow enough for the two processes to overlap.
    caches = [tmp_path / f"c{i}.h5" for i in range(4)]
    big = _features(4, 5000, 0, dim=64)
    for c in caches:
        write_arrays(c, {"val": big}, dataset="ds", backbone="bb", image_size=8, transform="t")
    script = tmp_path / "commit.py"
    script.write_text(_COMMITTER)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), split, str(go), *map(str, caches)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for split in ("train", "test")
    ]
    # both have staged their split (the staging files exist) before the commits start together
    for _ in range(3000):
        if all(Path(f"{c}.{s}.partial").exists() for c in caches for s in ("train", "test")):
            break
        subprocess.run(["sleep", "0.01"])
    go.touch()
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for c in caches:
        assert list_splits(c) == ["train", "val", "test"], c
        assert read_attrs(c)["dataset"] == "ds"
        assert read_split(c, "train").paths[0] == "train0" and read_split(c, "test").paths[0] == "test0"
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name or p.name.endswith(".partial")) == []


def test_save_episodes_refuses_to_overwrite_a_cache(tmp_path, cache):
    other = write_arrays(tmp_path / "other.h5", {"test": _features(6, 20, 3)})
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "proto", "--save-episodes", other)
    assert code == 1
    assert "--save-episodes" in one_line_error(out) and "feature cache" in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_json_refuses_the_input_cache(tmp_path, cache):
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "proto", "--json", cache)  # --json is --out
    assert code == 1 and "--out" in one_line_error(out) and "input file" in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_grid_out_refuses_a_cache_and_the_grid_file(tmp_path, cache):
    grid = tmp_path / "g.toml"
    grid.write_text('cache = "c.h5"\nepisodes = 4\nmethod = "proto"\n')
    other = write_arrays(tmp_path / "other.h5", {"test": _features(6, 20, 3)})
    before = snapshot(tmp_path)
    for target, culprit in ((cache, "is the input file"), (grid, "is the input file"), (other, "feature cache")):
        code, out = run("grid", grid, "--out", target, "--force")
        assert code == 1 and f"--out {target}" in one_line_error(out) and culprit in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_json_refuses_an_episode_file_and_save_episodes_refuses_a_results_file(tmp_path, cache):
    eps = tmp_path / "eps.h5"
    assert run(*SOLVE, "--cache", cache, "--method", "proto", "--save-episodes", eps)[0] == 0
    res = tmp_path / "r.json"
    assert run(*SOLVE, "--cache", cache, "--method", "proto", "--json", res)[0] == 0
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "proto", "--json", eps)
    assert code == 1 and "episode file" in one_line_error(out)
    code, out = run(*SOLVE, "--cache", cache, "--method", "proto", "--save-episodes", res)
    assert code == 1 and "results file" in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_same_kind_outputs_are_replaced_atomically(tmp_path, cache):
    from poodle.results import read_results

    eps, res = tmp_path / "eps.h5", tmp_path / "r.jsonl"
    for seed in (0, 1):
        code, out = run(
            *SOLVE, "--cache", cache, "--method", "proto", "--seed", seed, "--save-episodes", eps, "--json", res
        )
        assert code == 0, out
    # the episode file is replaced; the results file (append-only records) gains the second run's
    assert sorted(r["episode"]["seed"] for r in read_results(res).records) == [0, 1]
    with h5py.File(eps, "r") as f:
        assert int(f.attrs["seed"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5", "eps.h5", "r.jsonl"]  # no temporaries left


# ============================================================== nothing silently wrong (exit 0)


@pytest.mark.parametrize(
    "split, row, value, culprit",
    [
        ("test", 7, np.nan, "not finite"),
        ("test", 3, np.inf, "not finite"),
        ("test", 11, "double", "L2 norm 2.000000"),
        ("train", 5, np.nan, "not finite"),  # a row of the base-negative pool
    ],
)
def test_a_bad_row_in_the_cache_is_refused_by_solve(tmp_path, cache, split, row, value, culprit):
    if isinstance(value, str):
        with h5py.File(cache, "r") as f:
            value = 2 * f[split]["features"][row]
    _damage(cache, split, row, value)
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "poodle", "--steps", 2, "--n-neg", 10)
    msg = one_line_error(out)
    assert code == 1 and f"split '{split}'" in msg and f"row {row}" in msg and culprit in msg
    assert snapshot(tmp_path) == before


def test_a_bad_row_in_the_cache_is_refused_by_grid(tmp_path, cache):
    _damage(cache, "test", 2, np.nan)
    grid = tmp_path / "g.toml"
    grid.write_text('cache = "c.h5"\nepisodes = 4\nsteps = 2\nn_neg = 10\n')
    before = snapshot(cache)
    code, out = run("grid", grid, "--device", "cpu")
    msg = one_line_error(out)
    assert code == 1 and "split 'test'" in msg and "row 2" in msg
    assert snapshot(cache) == before


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--lr", "inf"], "'lr' must be a finite number"),
        (["--alpha", "inf"], "'alpha' must be a finite number"),
        (["--alpha", "nan"], "'alpha' must be a finite number"),
        (["--alpha", "-1"], "'alpha' must lie in [0, inf)"),
        (["--beta", "nan"], "'beta' must be a finite number"),
        (["--set", "scale=nan"], "'scale' must be a finite number"),
        (["--set", "scale=0"], "'scale' must lie in (0, inf)"),
        (["--way", "1"], "way must be an integer >= 2"),
    ],
)
def test_meaningless_solver_options_are_refused(tmp_path, cache, args, culprit):
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "poodle", "--steps", 2, "--n-neg", 10, *args)
    assert code == 1 and culprit in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_grid_and_library_get_the_same_option_check(tmp_path, cache):
    from poodle import solvers
    from poodle.episodes import EpisodeSpec, sample_episodes
    from poodle.evaluate import evaluate
    from poodle.run import RunOptions
    from poodle.solvers.poodle import PoodleConfig

    grid = tmp_path / "g.toml"
    grid.write_text('cache = "c.h5"\nepisodes = 4\nalpha = nan\n')
    code, out = run("grid", grid, "--dry-run")
    assert code == 1 and "g.toml" in one_line_error(out) and "'alpha' must be a finite number" in one_line_error(out)
    grid.write_text('cache = "c.h5"\nepisodes = 4\nway = 1\n')
    code, out = run("grid", grid, "--dry-run")
    assert code == 1 and "'way'" in one_line_error(out)
    feats = read_split(cache, "test")
    eps = sample_episodes(feats.labels, EpisodeSpec(), 2)
    with pytest.raises(ConfigError, match="'alpha' must be a finite number"):
        evaluate(feats, eps, [("p", "poodle", PoodleConfig(alpha=float("nan")))], run=RunOptions(device="cpu"))
    with pytest.raises(ConfigError, match="'lr' must lie in"):
        solvers.make_config("tim-gd", {"lr": -1})
    with pytest.raises(EpisodeError, match="way must be an integer >= 2"):
        sample_episodes(feats.labels, EpisodeSpec(way=1), 2)


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--momentum", "5"], "--momentum must be a number in [0, 1), got 5.0"),
        (["--weight-decay", "-1"], "--weight-decay must be a number in [0, inf), got -1.0"),
        (["--lr", "nan"], "--lr must be"),
        (
            ["--seed", str(2**64)],
            "--seed must be an integer in 0..9223372036854775807 (what torch, numpy and HDF5 hold: 63 bits)",
        ),
    ],
)
def test_meaningless_training_options_are_refused(tmp_path, args, culprit):
    code, out = run(
        "train",
        "--dataset",
        "folder",
        "--data-root",
        tmp_path,
        "--backbone",
        "conv4_64",
        "--out",
        tmp_path / "run",
        *args,
    )
    assert code == 1 and culprit in one_line_error(out)
    assert not (tmp_path / "run").exists()


def test_16_bit_png_and_float_tiff_keep_their_range(tmp_path):
    from PIL import Image

    from poodle.data.transforms import load_rgb

    ramp = np.arange(64 * 64, dtype=np.float64).reshape(64, 64) / (64 * 64 - 1)
    Image.fromarray((ramp * 65535).astype(np.uint16)).save(tmp_path / "wide.png")
    Image.fromarray(ramp.astype(np.float32), mode="F").save(tmp_path / "float.tif")
    for name in ("wide.png", "float.tif"):
        before = snapshot(tmp_path)
        rgb = np.asarray(load_rgb(tmp_path / name), dtype=np.float64)
        assert rgb.shape == (64, 64, 3)
        np.testing.assert_allclose(rgb[..., 0], ramp * 255, atol=0.51)  # not clipped to white
        assert snapshot(tmp_path) == before
    Image.fromarray((ramp * 1e4 - 5).astype(np.float32), mode="F").save(tmp_path / "odd.tif")
    with pytest.raises(ValueError, match=r"values in \[-5"):
        load_rgb(tmp_path / "odd.tif")


def test_duplicated_rows_in_a_split_file_are_refused(tmp_path):
    root = _images.write_csv(
        tmp_path / "d", {"train": 2, "test": 2}, images_per_class=3, size=12, splits=("train", "test")
    )
    lines = (root / "test.csv").read_text().splitlines()
    (root / "test.csv").write_text("\n".join(lines + [lines[2]]) + "\n")
    before = snapshot(root)
    code, out = run(
        "extract",
        "--random-weights",
        "--splits",
        "train,test",
        "--dataset",
        "csv",
        "--data-root",
        root,
        "--backbone",
        "conv4_64",
        "--image-size",
        16,
        "--workers",
        0,
        "--device",
        "cpu",
        "--cache-root",
        tmp_path / "cache",
    )
    msg = one_line_error(out)
    assert code == 1 and "test.csv" in msg and f"lines 3 and {len(lines) + 1}" in msg
    assert snapshot(root) == before and not (tmp_path / "cache").exists()


def test_integer_weights_are_refused_and_a_constant_cache_is_flagged(tmp_path):
    from poodle import backbones
    from poodle.backbones.checkpoint import load_checkpoint

    model = backbones.build("conv4_64")
    ck = tmp_path / "int.pth"
    torch.save({k: v.to(torch.int64) for k, v in model.state_dict().items()}, ck)
    before = snapshot(ck)
    with pytest.raises(Exception, match=r"non-floating data: .*weight \(torch.int64\)"):
        load_checkpoint(backbones.build("conv4_64"), ck)
    assert snapshot(ck) == before
    # what such weights give: every row zero (or every row the same vector)
    for name, row in (("zero.h5", np.zeros(D)), ("constant.h5", np.eye(D)[0])):
        path = write_arrays(tmp_path / name, {"test": _features(4, 5, 0)})
        with h5py.File(path, "a") as f:
            f["test"]["features"][...] = np.tile(row, (20, 1))
        before = snapshot(path)
        what = "zero" if name == "zero.h5" else "the same vector"
        code, out = run("info", path)
        assert code == 1 and "split 'test'" in one_line_error(out)
        assert f"all 20 feature rows are {what}" in one_line_error(out)
        with pytest.raises(CacheError, match=f"all 20 feature rows are {what}"):
            read_split(path, "test")
        assert snapshot(path) == before
    some = write_arrays(tmp_path / "some.h5", {"test": _features(4, 5, 0)})
    _damage(some, "test", 5, 0.0)  # one zero row (an image the backbone gave zeros for): valid, flagged
    code, out = run("info", some)
    assert code == 0 and "warning: split 'test' has 1 all-zero" in " ".join(out.split())


def test_max_memory_that_cannot_be_met_says_by_how_much(tmp_path, cache):
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "poodle", "--steps", 2, "--n-neg", 10, "--max-memory", "1B")
    msg = one_line_error(out)
    assert code == 1 and "--max-memory 1 bytes cannot be met" in msg and "more" in msg
    assert snapshot(tmp_path) == before


def _grid_results(tmp_path, cache) -> Path:
    grid = tmp_path / "g.toml"
    grid.write_text('cache = "c.h5"\nepisodes = 30\nsteps = 3\nn_neg = 10\nalpha = [0.0, 1.0]\nshot = [1, 2]\n')
    assert run("grid", grid, "--device", "cpu")[0] == 0
    return tmp_path / "g.results.jsonl"


def test_report_on_a_cut_results_file_names_the_missing_cells_and_does_not_bold_them(tmp_path, cache):
    from poodle import report as R

    res = _grid_results(tmp_path, cache)
    raw = res.read_bytes()
    res.write_bytes(raw[:-25])  # the last line cut, as by a killed run
    before = snapshot(res)
    code, out = run("report", res, "--rows", "alpha", "--cols", "shot")
    text = " ".join(out.split())
    assert code == 0
    assert "g.results.jsonl: 3 of 4 cells finished" in text and "last line is cut" in text
    assert "Empty entries (1)" in text and "1 / 2-shot" in text and "gets no bold" in text
    table = R.build_table(R.load_results([res]), "alpha", "shot")
    missing_col = [j for j in range(2) if any((i, j) not in table.entries for i in range(2))]
    assert missing_col and not any(
        table.entries[(i, j)].bold for i in range(2) for j in missing_col if (i, j) in table.entries
    )
    assert snapshot(res) == before


@pytest.mark.parametrize("p", ["2", "0", "-0.1", "nan"])
def test_report_p_must_lie_in_the_open_unit_interval(tmp_path, p):
    res = tmp_path / "r.jsonl"
    res.write_text('{"format": "poodle-results", "version": 2, "kind": "header", "n_cells": 0}\n')
    before = snapshot(res)
    code, out = run("report", res, "--p", p)
    assert snapshot(res) == before
    assert code == 1 and "--p" in one_line_error(out) and "(0, 1)" in one_line_error(out)


# ====================================================== tracebacks become one-line errors


@pytest.mark.parametrize("option", ["--save-episodes", "--out"])
def test_unwritable_output_directories(tmp_path, cache, option):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "proto", option, blocker / "out.h5")
    msg = one_line_error(out)
    assert code == 1 and option in msg and "not-a-dir is a file, not a directory" in msg
    assert snapshot(tmp_path) == before


def _csv_dataset(tmp_path: Path) -> Path:
    return _images.write_csv(
        tmp_path / "d", {"train": 2, "test": 2}, images_per_class=3, size=12, splits=("train", "test")
    )


def _no_model(monkeypatch):
    from poodle import backbones

    def refuse(*a, **k):
        raise AssertionError("the model was built before the input was checked")

    monkeypatch.setattr(backbones, "build", refuse)


def test_unwritable_cache_root_is_refused_before_work(tmp_path, monkeypatch):
    root = _csv_dataset(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _no_model(monkeypatch)
    before = snapshot(tmp_path)
    code, out = run(
        "extract",
        "--random-weights",
        "--splits",
        "train,test",
        "--dataset",
        "csv",
        "--data-root",
        root,
        "--backbone",
        "conv4_64",
        "--image-size",
        16,
        "--device",
        "cpu",
        "--cache-root",
        blocker / "cache",
    )
    assert code == 1 and "file is a file, not a directory" in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_a_cache_path_that_is_a_directory_is_refused_before_work(tmp_path, monkeypatch):
    root = _csv_dataset(tmp_path)
    (tmp_path / "cache" / "csv" / "conv4_64.h5").mkdir(parents=True)
    _no_model(monkeypatch)
    before = snapshot(tmp_path)
    for extra in ([], ["--force"]):
        code, out = run(
            "extract",
            "--random-weights",
            "--splits",
            "train,test",
            "--dataset",
            "csv",
            "--data-root",
            root,
            "--backbone",
            "conv4_64",
            "--image-size",
            16,
            "--device",
            "cpu",
            "--cache-root",
            tmp_path / "cache",
            *extra,
        )
        assert code == 1 and "conv4_64.h5 is a directory" in one_line_error(out)
    assert snapshot(tmp_path) == before and not list((tmp_path / "cache" / "csv").glob("*.partial"))
    code, out = run(*SOLVE, "--cache", tmp_path / "cache" / "csv" / "conv4_64.h5", "--method", "proto")
    assert code == 2 and "conv4_64.h5' is a directory" in out  # click's usage error names it


@pytest.mark.parametrize("device", ["meta", "mps", "cuda:-1", "cpu:0", "tpu"])
def test_unusable_devices_are_one_line_errors(tmp_path, cache, device):
    before = snapshot(tmp_path)
    code, out = run("solve", "--cache", cache, "--episodes", 2, "--method", "proto", "--device", device)
    assert code == 1 and f"--device '{device}'" in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_episode_file_with_a_non_numeric_attribute(tmp_path, cache):
    eps = tmp_path / "eps.h5"
    assert run(*SOLVE, "--cache", cache, "--method", "proto", "--save-episodes", eps)[0] == 0
    with h5py.File(eps, "a") as f:
        f.attrs["shot"] = "one"
    before = snapshot(tmp_path)
    code, out = run("solve", "--cache", cache, "--method", "proto", "--episodes-from", eps)
    assert (
        code == 1 and "eps.h5" in one_line_error(out) and "attribute 'shot' must be an integer" in one_line_error(out)
    )
    assert snapshot(tmp_path) == before


def test_episode_file_with_zero_episodes(tmp_path, cache):
    eps = tmp_path / "eps.h5"
    assert run(*SOLVE, "--cache", cache, "--method", "proto", "--save-episodes", eps)[0] == 0
    with h5py.File(eps, "a") as f:
        for name in ("support", "query", "support_labels", "query_labels", "index", "class_ids"):
            data = f[name][()]
            del f[name]
            f.create_dataset(name, data=data[:0])
    before = snapshot(tmp_path)
    code, out = run("solve", "--cache", cache, "--method", "proto", "--episodes-from", eps)
    assert code == 1 and "eps.h5: holds no episodes" in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_a_seed_that_does_not_fit_64_bits(tmp_path, cache):
    before = snapshot(tmp_path)
    code, out = run(*SOLVE, "--cache", cache, "--method", "proto", "--seed", 2**64 + 1)
    assert code == 1 and one_line_error(out) == (
        f"error: --seed must be an integer in 0..{2**63 - 1} (what torch, numpy and HDF5 hold: 63 bits), "
        f"got {2**64 + 1}"
    )
    assert snapshot(tmp_path) == before


def test_a_grid_file_that_is_not_utf8(tmp_path, cache):
    grid = tmp_path / "g.toml"
    grid.write_bytes(b'cache = "c.h5"\n# caf\xe9\nepisodes = 4\n')
    before = snapshot(tmp_path)
    code, out = run("grid", grid)
    assert code == 1 and "g.toml: not UTF-8" in one_line_error(out) and "line 2" in one_line_error(out)
    assert snapshot(tmp_path) == before


def test_training_on_a_split_with_one_class(tmp_path):
    root = _images.write_folder(tmp_path / "d", {"train": 1}, images_per_class=4, size=12, splits=("train",))
    before = snapshot(root)
    code, out = run(
        "train",
        "--dataset",
        "folder",
        "--data-root",
        root,
        "--backbone",
        "conv4_64",
        "--epochs",
        1,
        "--image-size",
        16,
        "--workers",
        0,
        "--device",
        "cpu",
        "--out",
        tmp_path / "run",
    )
    msg = one_line_error(out)
    assert code == 1 and "1 class (train_c00)" in msg and "at least 2" in msg
    assert snapshot(root) == before


def test_a_feature_dimension_beyond_the_attribute_limit(tmp_path):
    from poodle import cache as C

    big = _features(2, 3, 0, dim=20_000)
    path = write_arrays(tmp_path / "wide.h5", {"test": big})
    s = read_split(path, "test")
    assert s.raw_mean.shape == (20_000,) and s.features.shape == (6, 20_000)
    # a split extracted with D = 20,000 (staging state and raw_mean are datasets), committed and resumed
    attrs = C.make_root_attrs("ds", "bb")
    w = C.SplitWriter(
        tmp_path / "x.h5", "train", root_attrs=attrs, classes=["a", "b"], samples_sha256="s", n_total=4, dim=20_000
    )
    w.append(np.ones((2, 20_000)), [0, 1], ["p0", "p1"])
    w.close()
    w = C.SplitWriter(
        tmp_path / "x.h5", "train", root_attrs=attrs, classes=["a", "b"], samples_sha256="s", n_total=4, dim=20_000
    )
    assert w.resumed and w.n_rows == 2
    w.append(-np.ones((2, 20_000)) + np.eye(2, 20_000), [0, 1], ["p2", "p3"])
    w.commit()
    assert C.validate(tmp_path / "x.h5")["splits"]["train"]["feature_dim"] == 20_000
    np.testing.assert_allclose(read_split(tmp_path / "x.h5", "train").raw_mean[:3].numpy(), [0.25, 0.25, 0.0])


# ================================================================= errors name the culprit


def test_user_text_is_printed_literally(tmp_path, cache):
    odd = tmp_path / "run[bold]1 [/] :smile:.h5"
    before = snapshot(tmp_path)
    code, out = run("solve", "--cache", odd, "--method", "proto")
    assert code == 1 and str(odd) in one_line_error(out).replace("\n", "")
    assert snapshot(tmp_path) == before
    code, out = run("info", tmp_path / "[/]")
    assert code == 1 and "[/]: no such cache file" in one_line_error(out)


def test_an_unknown_grid_section_is_named_and_top_level_options_are_accepted(tmp_path, cache):
    grid = tmp_path / "g.toml"
    grid.write_text('cache = "c.h5"\n[bogus]\nx = 1\n')
    code, out = run("grid", grid, "--dry-run")
    msg = one_line_error(out)
    assert code == 1 and "unknown section [bogus]" in msg and "[episodes], [negatives], [solver]" in msg
    # "episodes" and "negatives" are section names and options: the documentation allows either at top level
    grid.write_text('cache = "c.h5"\nepisodes = 4\nnegatives = "random"\nn_neg = 10\nsteps = 2\n')
    code, out = run("grid", grid, "--device", "cpu")
    assert code == 0, out
    rec = [json.loads(line) for line in (tmp_path / "g.results.jsonl").read_text().splitlines()][1]
    assert len(rec["acc"]) == 4 and rec["negatives"] == "random"


def test_episodes_from_with_a_negative_index_names_it(tmp_path, cache):
    eps = tmp_path / "eps.h5"
    assert run(*SOLVE, "--cache", cache, "--method", "proto", "--save-episodes", eps)[0] == 0
    with h5py.File(eps, "a") as f:
        f["query"][1, 4] = -3
    before = snapshot(tmp_path)
    code, out = run("solve", "--cache", cache, "--method", "proto", "--episodes-from", eps)
    msg = one_line_error(out)
    assert code == 1 and "query index -3 (episode 1) is negative" in msg and "0..119" in msg
    assert snapshot(tmp_path) == before


def test_a_csv_row_with_an_absolute_path_is_named_before_the_model_is_built(tmp_path, monkeypatch):
    root = _csv_dataset(tmp_path)
    lines = (root / "train.csv").read_text().splitlines()
    name = lines[2].split(",")[0]
    lines[2] = lines[2].replace(name, str(root / "images" / name))
    (root / "train.csv").write_text("\n".join(lines) + "\n")
    _no_model(monkeypatch)
    before = snapshot(root)
    code, out = run(
        "extract",
        "--random-weights",
        "--splits",
        "train,test",
        "--dataset",
        "csv",
        "--data-root",
        root,
        "--backbone",
        "conv4_64",
        "--image-size",
        16,
        "--device",
        "cpu",
        "--cache-root",
        tmp_path / "cache",
    )
    msg = one_line_error(out)
    assert code == 1 and "train.csv line 3" in msg and "must be relative" in msg and "--skip-bad" not in msg
    assert snapshot(root) == before


def test_a_checkpoint_refused_by_weights_only_loading_names_the_global(tmp_path):
    import argparse

    from poodle.backbones.checkpoint import read_checkpoint

    ck = tmp_path / "release.pth.tar"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "args": argparse.Namespace(lr=0.1)}, ck)
    before = snapshot(ck)
    with pytest.raises(Exception, match=r"refuses to unpickle: argparse\.Namespace"):
        read_checkpoint(ck)
    root = _csv_dataset(tmp_path)
    code, out = run(
        "extract",
        "--splits",
        "train,test",
        "--dataset",
        "csv",
        "--data-root",
        root,
        "--backbone",
        "conv4_64",
        "--checkpoint",
        ck,
        "--image-size",
        16,
        "--device",
        "cpu",
        "--cache-root",
        tmp_path / "cache",
    )
    assert code == 1 and "release.pth.tar" in one_line_error(out) and "argparse.Namespace" in one_line_error(out)
    assert snapshot(ck) == before
