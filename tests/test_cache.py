"""The feature cache: schema round trip, validation of hand-written and damaged files, staged writes."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle import cache
from poodle.cli.info import info
from poodle.errors import CacheError


def _raw(n: int, d: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, d)) * 3 + 1).astype(np.float32)


def test_write_arrays_round_trip(tmp_path):
    x, y = _raw(12, 5), np.repeat(np.arange(3), 4)
    paths = [f"img/{i}.png" for i in range(12)]
    p = cache.write_arrays(
        tmp_path / "c.h5",
        {"test": (x[:6], y[:6] % 2, ["t0", "t1"]), "train": (x, y, ["a", "b", "c"], paths)},
        dataset="mine",
        backbone="bb",
        checkpoint_sha256="ab" * 32,
        image_size=84,
    )
    assert cache.list_splits(p) == ["train", "test"]
    s = cache.read_split(p, "train")
    assert s.features.dtype == torch.float32 and s.features.shape == (12, 5)
    expected = x / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    np.testing.assert_allclose(s.features.numpy(), expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(s.raw_mean.numpy(), x.astype(np.float64).mean(0), rtol=1e-6)
    assert s.labels.dtype == torch.int64 and s.labels.tolist() == y.tolist()
    assert s.classes == ["a", "b", "c"] and s.paths == paths and s.name == "train" and len(s) == 12
    assert cache.read_split(p, "test").paths is None
    attrs = cache.read_attrs(p)
    assert attrs["format"] == "poodle-features" and attrs["version"] == 2
    assert (attrs["dataset"], attrs["backbone"], attrs["image_size"]) == ("mine", "bb", 84)
    assert attrs["checkpoint_sha256"] == "ab" * 32 and attrs["transform"] == "none"
    summary = cache.validate(p)
    assert summary["splits"]["train"]["n_images"] == 12 and summary["splits"]["train"]["feature_dim"] == 5
    assert abs(summary["splits"]["train"]["norm_max"] - 1) < 1e-6
    assert not list(tmp_path.glob("*.tmp"))


def test_float16_cache_is_upcast_and_normalised(tmp_path):
    x, y = _raw(40, 64, seed=1), np.arange(40) % 4
    p = cache.write_arrays(tmp_path / "c.h5", {"train": (x, y, list("abcd"))}, dtype="float16")
    with h5py.File(p) as f:
        assert f["train/features"].dtype == np.float16
    s = cache.read_split(p, "train")
    assert s.features.dtype == torch.float32
    norms = s.features.double().norm(dim=1)
    assert (norms - 1).abs().max() < 5e-3 and (norms - 1).abs().max() > 0  # really rounded, still valid
    assert cache.validate(p)["splits"]["train"]["dtype"] == "float16"


def test_write_arrays_checks_its_input_and_leaves_nothing(tmp_path):
    x = _raw(6, 3)
    with pytest.raises(CacheError, match="class 'c' has no rows"):
        cache.write_arrays(tmp_path / "c.h5", {"train": (x, np.array([0, 0, 1, 1, 0, 1]), ["a", "b", "c"])})
    with pytest.raises(CacheError, match=r"features must be \[N, D\] and labels \[N\]"):
        cache.write_arrays(tmp_path / "c.h5", {"train": (x, np.zeros(5, int), ["a"])})
    with pytest.raises(CacheError, match="not L2-normalised|norm"):
        cache.write_arrays(tmp_path / "c.h5", {"train": (x, np.zeros(6, int), ["a"])}, normalise=False)
    assert list(tmp_path.iterdir()) == []


def _hand_written(path, *, fixed_length_strings=False):
    """A cache written with nothing but h5py and numpy, following the schema in the docs."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for k, v in {
            "format": "poodle-features",
            "dataset": "mine",
            "backbone": "other-tool",
            "checkpoint_sha256": "none",
            "transform": "whatever",
            "created": "2024-01-01",
            "poodle_version": "external",
        }.items():
            f.attrs[k] = v
        f.attrs["version"] = 1
        f.attrs["image_size"] = 84
        for split, n_classes in (("train", 3), ("test", 2)):
            raw = rng.standard_normal((n_classes * 5, 8)).astype(np.float32)
            g = f.create_group(split)
            g["features"] = (raw / np.linalg.norm(raw, axis=1, keepdims=True)).astype(np.float32)
            g["labels"] = np.repeat(np.arange(n_classes), 5).astype(np.int64)
            names = [f"{split}{c}" for c in range(n_classes)]
            if fixed_length_strings:
                g["classes"] = np.array([s.encode() for s in names])
            else:
                g.create_dataset("classes", data=names, dtype=h5py.string_dtype())
            g.attrs["complete"] = True
            g.attrs["n_images"] = n_classes * 5
            g.attrs["feature_dim"] = 8
            g.attrs["raw_mean"] = raw.mean(0)
    return path


@pytest.mark.parametrize("fixed", [False, True])
def test_hand_written_file_passes_validate_and_info(tmp_path, fixed):
    p = _hand_written(tmp_path / "hand.h5", fixed_length_strings=fixed)
    assert set(cache.validate(p)["splits"]) == {"train", "test"}
    assert cache.read_split(p, "test").classes == ["test0", "test1"]
    result = CliRunner().invoke(info, [str(p)])
    assert result.exit_code == 0, result.output
    assert "train" in result.output and "other-tool" in result.output and "valid" in result.output
    # no line padded with spaces to the tables' width (a pasted copy, a diff of two caches' info)
    assert all(line == line.rstrip() for line in result.output.splitlines()), result.output
    assert any(line.startswith(" train ") or line.startswith("train ") for line in result.output.splitlines())


def _mutate(path, how):
    with h5py.File(path, "a") as f:
        g = f["train"]
        if how == "foreign":
            f.attrs["format"] = "something-else"
        elif how == "no-format":
            del f.attrs["format"]
        elif how == "missing-attr":
            del f.attrs["transform"]
        elif how == "version":
            f.attrs["version"] = 7
        elif how == "incomplete":
            g.attrs["complete"] = False
        elif how == "float64":
            x = g["features"][()]
            del g["features"]
            g["features"] = x.astype(np.float64)
        elif how == "int32-labels":
            y = g["labels"][()]
            del g["labels"]
            g["labels"] = y.astype(np.int32)
        elif how == "norm":
            g["features"][3] = g["features"][3] * 1.5
        elif how == "nan":
            g["features"][2, 0] = np.nan
        elif how == "label-range":
            g["labels"][4] = 3
        elif how == "n_images":
            g.attrs["n_images"] = 99
        elif how == "empty-class":
            g["labels"][10:] = 0
        elif how == "raw_mean":
            g.attrs["raw_mean"] = np.zeros(3, np.float32)
        elif how == "no-features":
            del g["features"]
        elif how == "paths-length":
            g.create_dataset("paths", data=["a.png"], dtype=h5py.string_dtype())


@pytest.mark.parametrize(
    "how, message",
    [
        ("foreign", "not a poodle feature cache .*format='something-else'"),
        ("no-format", "not a poodle feature cache .*no 'format' attribute"),
        ("missing-attr", "root attribute.* transform missing"),
        ("version", "version 7"),
        ("incomplete", "split 'train' is incomplete"),
        ("float64", "features must be float32 or float16, got float64"),
        ("int32-labels", "labels must be int64"),
        ("norm", "row 3 has L2 norm 1.5"),
        ("nan", "row 2 is not finite"),
        ("label-range", r"labels row 4 is 3, outside \[0, 3\)"),
        ("n_images", "n_images=99"),
        ("empty-class", "class 'train2' has no rows"),
        ("raw_mean", r"raw_mean must be finite float \[8\]"),
        ("no-features", "train/features missing"),
        ("paths-length", r"paths must be a string dataset \[15\]"),
    ],
)
def test_validate_names_the_problem(tmp_path, how, message):
    p = _hand_written(tmp_path / "bad.h5")
    _mutate(p, how)
    with pytest.raises(CacheError, match=message) as e:
        cache.validate(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_info_fails_cleanly_on_bad_files(tmp_path):
    not_h5 = tmp_path / "notes.h5"
    not_h5.write_text("hello")
    for p, message in ((not_h5, "not a readable HDF5 file"), (tmp_path / "absent.h5", "no such cache file")):
        result = CliRunner().invoke(info, [str(p)])
        assert result.exit_code == 1
        assert f"error: {p}" in result.output and message in result.output
        assert "Traceback" not in result.output
    p = _hand_written(tmp_path / "inc.h5")
    _mutate(p, "incomplete")
    result = CliRunner().invoke(info, [str(p)])
    assert result.exit_code == 1 and "incomplete" in result.output


def test_read_split_lists_the_complete_splits(tmp_path):
    p = _hand_written(tmp_path / "c.h5")
    with h5py.File(p, "a") as f:
        f["test"].attrs["complete"] = False
    assert cache.list_splits(p) == ["train"]
    with pytest.raises(CacheError, match=r"no split 'val'; complete splits: train"):
        cache.read_split(p, "val")
    with pytest.raises(CacheError, match=r"split 'test' is incomplete; complete splits: train"):
        cache.read_split(p, "test")


def _writer(path, **kw):
    args = dict(
        root_attrs=cache.make_root_attrs("ds", "bb", image_size=32, transform="t"),
        classes=["a", "b"],
        samples_sha256="s",
        n_total=6,
        dim=4,
        dtype="float32",
    )
    args.update(kw)
    return cache.SplitWriter(path, "train", **args)


def test_split_writer_resumes_and_commits_atomically(tmp_path):
    target = tmp_path / "c.h5"
    x = _raw(6, 4)
    w = _writer(target)
    w.append(x[:2], [0, 0], ["p0", "p1"])
    w.close()  # an interrupted run: the staging file holds 2 rows, the cache does not exist
    assert not target.exists() and cache.partial_path(target, "train").exists()
    w = _writer(target)
    assert w.resumed and w.n_consumed == 2
    w.append(x[2:4], [0, 1], ["p2", "p3"])
    w.append(x[5:], [1], ["p5"], skipped=["p4"])
    w.commit()
    assert not cache.partial_path(target, "train").exists()
    s = cache.read_split(target, "train")
    assert s.paths == ["p0", "p1", "p2", "p3", "p5"] and s.labels.tolist() == [0, 0, 0, 1, 1]
    kept = x[[0, 1, 2, 3, 5]].astype(np.float64)
    np.testing.assert_allclose(s.raw_mean.numpy(), kept.mean(0), rtol=1e-6)
    with h5py.File(target) as f:
        assert list(f["train"].attrs["skipped"]) == ["p4"] and f["train"].attrs["n_skipped"] == 1


def test_split_writer_restarts_damaged_or_different_staging(tmp_path):
    target = tmp_path / "c.h5"
    w = _writer(target)
    w.append(_raw(2, 4), [0, 1], ["a", "b"])
    w.close()
    other = _writer(target, samples_sha256="other list")
    assert not other.resumed
    other.close()  # it holds the staging file (locked) until closed
    staging = cache.partial_path(target, "train")
    staging.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)  # killed mid-write: unreadable
    w = _writer(target)
    assert not w.resumed and w.n_consumed == 0
    w.close()


def test_commit_keeps_other_splits_and_leaves_no_tmp(tmp_path):
    target = tmp_path / "c.h5"
    cache.write_arrays(
        target,
        {"val": (_raw(4, 4), [0, 0, 1, 1], ["v0", "v1"])},
        dataset="ds",
        backbone="bb",
        image_size=32,
        transform="t",
    )
    w = _writer(target, n_total=2)
    w.append(_raw(2, 4, seed=3), [0, 1], ["a", "b"])
    w.commit()
    assert cache.list_splits(target) == ["train", "val"]
    # neither the lock file (removed on release, see cache.cache_lock) nor a temporary is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]


def _unit(n: int, d: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=1, keepdim=True)


@pytest.mark.parametrize(
    "row, value, message",
    [
        (0, float("nan"), "row 0 is not finite"),
        (9, float("-inf"), "row 9 is not finite"),
        # squares overflow float32 (norm inf) but the row is finite: the message must say so
        (5, 3e20, r"row 5 has L2 norm \d{21}\.\d{6}, expected 1"),
        (7, 0.5, "row 7 has L2 norm"),
    ],
)
def test_check_unit_rows_names_the_first_bad_row(row, value, message):
    x = _unit(12, 6)
    x[row] = x[row] * value if value == 0.5 else value
    with pytest.raises(CacheError, match=message):
        cache.check_unit_rows(x, "f.h5")


def test_check_unit_rows_passes_unit_and_zero_rows_and_looks_past_a_near_miss():
    x = _unit(40, 8)
    x[3] = 0
    x[4] *= 1 + 0.9e-3  # inside the tolerance
    cache.check_unit_rows(x, "f.h5")
    x[30] *= 1.01  # a bad row after a near miss in the same block
    with pytest.raises(CacheError, match="row 30 has L2 norm 1.01"):
        cache.check_unit_rows(x, "f.h5")
    with pytest.raises(CacheError, match="same vector"):
        cache.check_unit_rows(x[:1].repeat(5, 1), "f.h5")


def _count_under_lock(path: str, times: int) -> None:
    import time

    for _ in range(times):
        with cache.cache_lock(path):
            counter = Path(path + ".count")
            n = int(counter.read_text()) if counter.exists() else 0
            time.sleep(0.001)  # widen the window a second holder would need to lose an update
            counter.write_text(str(n + 1))


def test_cache_lock_excludes_other_processes_and_leaves_no_lock_file(tmp_path):
    """The lock file is removed on release, and still no two processes hold the lock at once: one
    that locked the removed file notices and locks the new one (else increments would be lost)."""
    import multiprocessing

    target = str(tmp_path / "c.h5")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_count_under_lock, args=(target, 25)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert (tmp_path / "c.h5.count").read_text() == "100"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5.count"]
