"""The read-ahead of a cache's features (poodle.prefetch) and its use by read_split and `poodle solve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle import prefetch
from poodle.cache import read_split, write_arrays
from poodle.cli.main import cli


@pytest.fixture
def cache(tmp_path, make_features):
    xtr, ytr = make_features(10, 12, 16, seed=1)
    xte, yte = make_features(6, 20, 16, seed=2)
    return write_arrays(
        tmp_path / "c.h5",
        {"train": (xtr, ytr, [f"b{i}" for i in range(10)]), "test": (xte, yte, [f"t{i}" for i in range(6)])},
    )


@pytest.fixture(autouse=True)
def _clean():
    prefetch.clear()
    yield
    prefetch.clear()


def test_prefetched_array_is_the_file_s_and_is_handed_out_once(cache):
    prefetch.start(cache, ["test", "train"])
    got = prefetch.take(cache, "test", (120, 16))
    assert isinstance(got, np.ndarray) and np.array_equal(got, read_split(cache, "test").features.numpy())
    assert prefetch.take(cache, "test", (120, 16)) is None  # once
    assert prefetch.take(cache, "train", (120, 16)) is not None  # same rows, other split


def test_nothing_is_used_from_a_changed_file_a_wrong_shape_or_a_failed_read(cache, tmp_path):
    prefetch.start(cache, ["test"])
    assert prefetch.take(cache, "test", (121, 16)) is None
    prefetch.start(cache, ["test"])
    prefetch.take(cache, "train", (120, 16))  # not started: None, and no effect on "test"
    for thread, _ in list(prefetch._pending.values()):
        thread.join()  # the read is over; then the file changes
    st = os.stat(cache)
    os.utime(cache, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert prefetch.take(cache, "test", (120, 16)) is None
    prefetch.start(cache, ["nosuchsplit"])
    assert prefetch.take(cache, "nosuchsplit", (1,)) is None
    prefetch.start(tmp_path / "absent.h5", ["test"])
    assert prefetch.take(tmp_path / "absent.h5", "test", (1,)) is None


def test_read_split_takes_the_prefetched_rows_and_still_checks_them(cache, monkeypatch):
    expected = read_split(cache, "test").features
    prefetch.start(cache, ["test"])
    assert prefetch._pending  # the read is registered until read_split takes it
    assert torch.equal(read_split(cache, "test").features, expected)
    assert not prefetch._pending
    # a prefetched array goes through the same row checks as one read by read_split itself
    bad = expected.numpy().copy()
    bad[7] *= 2
    monkeypatch.setattr(prefetch, "take", lambda *a: bad)
    with pytest.raises(Exception, match="features row 7 has L2 norm 2.0"):
        read_split(cache, "test")


@pytest.mark.parametrize(
    "negatives, expected",
    [("base", {("c.h5", "test"), ("c.h5", "train")}), ("random", {("c.h5", "test")}), ("none", {("c.h5", "test")})],
)
def test_solve_prefetches_its_split_and_pool(cache, negatives, expected):
    prefetch.start_for_solve(cache, "test", negatives)
    assert {(os.path.basename(p), s) for p, s in prefetch._pending} == expected


def test_solve_prefetches_a_pool_in_another_file(cache, tmp_path, make_features):
    x, y = make_features(3, 10, 16, seed=3)
    other = write_arrays(tmp_path / "o.h5", {"pool": (x, y, ["a", "b", "c"])})
    prefetch.start_for_solve(cache, None, f"{other}:pool")
    assert {(os.path.basename(p), s) for p, s in prefetch._pending} == {("c.h5", "test"), ("o.h5", "pool")}
    assert prefetch.take(other, "pool", (30, 16)) is not None


def test_poodle_solve_uses_the_read_ahead_and_gives_the_same_numbers(cache, tmp_path, monkeypatch):
    taken = []
    real_take = prefetch.take
    monkeypatch.setattr(prefetch, "take", lambda *a: taken.append(a[1]) or real_take(*a))
    args = ["solve", "--cache", str(cache), "--episodes", "6", "--steps", "3", "--n-neg", "20", "--device", "cpu"]
    res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "a.jsonl")])
    assert res.exit_code == 0, res.output
    assert sorted(taken) == ["test", "train"] and not prefetch._pending
    monkeypatch.setattr(prefetch, "start", lambda *a: None)  # no read-ahead at all
    res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "b.jsonl")])
    assert res.exit_code == 0, res.output

    def accs(p):
        recs = [json.loads(line) for line in p.read_text().splitlines()]
        return [r["acc"] for r in recs if r.get("kind") == "cell"]

    assert accs(tmp_path / "a.jsonl") == accs(tmp_path / "b.jsonl") != []


def test_the_module_imports_no_torch():
    code = "import sys, poodle.prefetch; print('torch' in sys.modules, 'h5py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
