"""Stages under torchrun (2 gloo processes on the CPU) against their one-process output.

Each torchrun start costs seconds, so the launches are few and each checks several things.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import _images
import h5py
import numpy as np
import pytest
import torch

from poodle import backbones, cache
from poodle.cache_shares import Covered, plan, share_files
from poodle.distributed import Dist, RankFailed, share
from poodle.extract import cache_path, extract

SIZE = 32
POODLE = str(Path(sys.executable).with_name("poodle"))
TIMEOUT = 240  # seconds; a hang fails the test instead of the suite


def torchrun(*args: str, n: int = 2, cwd: Path | None = None, script: str = POODLE) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node n <script> args`` with gloo on the CPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POODLE_DIST_TIMEOUT": "120", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script,
           *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


# --------------------------------------------------------------------------- pure parts


def test_shares_are_disjoint_contiguous_and_aligned():
    for n, world, align in [(10, 3, 4), (0, 2, 1), (7, 4, 1), (100, 7, 8), (3, 5, 2)]:
        parts = [share(n, world, r, align) for r in range(world)]
        assert [i for p in parts for i in p] == list(range(n))
        assert all(p.start % align == 0 for p in parts if len(p))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= align


def test_plan_deals_out_the_uncovered_batches():
    def cov(a, c):
        return Covered(Path(f"x{a}"), a, c, "share")

    # 22 rows, batches of 4: [0,4) [4,8) ... [20,22); rows [4, 12) staged already
    pieces = plan([cov(4, 8)], 22, 4, 2)
    assert pieces == [[(0, 4), (12, 16)], [(16, 22)]]
    assert plan([], 10, 4, 3) == [[(0, 4)], [(4, 8)], [(8, 10)]]
    assert plan([cov(0, 10)], 10, 4, 2) == [[], []]
    # more ranks than batches: some get nothing
    assert plan([], 5, 4, 3) == [[], [(0, 4)], [(4, 5)]]


def test_a_single_process_guard_passes_errors_through():
    d = Dist()
    with pytest.raises(ValueError):
        with d.guard():
            raise ValueError("x")
    assert d.broadcast_json({"a": [1]}) == {"a": [1]}
    assert [t.tolist() for t in d.gather_tensor(torch.arange(3))] == [[0, 1, 2]]
    assert RankFailed("r").quiet


# --------------------------------------------------------------------------- extract


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _images.write_folder(tmp_path_factory.mktemp("data"), {"train": 3, "val": 2, "test": 2}, 5, size=SIZE)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = backbones.build("conv4_64")
    return backbones.save_checkpoint(model, tmp_path_factory.mktemp("ck") / "conv4.pth.tar")


@pytest.fixture(scope="module")
def reference(data, ckpt, tmp_path_factory):
    return extract("folder", "conv4_64", data_root=data, checkpoint=ckpt, image_size=SIZE, batch_size=4,
                   cache_root=tmp_path_factory.mktemp("ref"), workers=0, device="cpu")


def _same_cache(a: Path, b: Path, *, same_root: bool = True) -> None:
    """Same splits with the same bytes of features, labels, paths, classes, and the same attributes."""
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        assert list(fa) == list(fb)
        skip = {"created"} | (set() if same_root else {"data_root"})
        assert {k: str(v) for k, v in fa.attrs.items() if k not in skip} == \
               {k: str(v) for k, v in fb.attrs.items() if k not in skip}
        for s in fa:
            assert sorted(fa[s]) == sorted(fb[s])
            for k in fa[s]:
                x, y = fa[s][k][()], fb[s][k][()]
                assert x.dtype == y.dtype and _raw(x) == _raw(y), (s, k)
            assert sorted(fa[s].attrs) == sorted(fb[s].attrs)
            for k in fa[s].attrs:
                assert _raw(np.asarray(fa[s].attrs[k])) == _raw(np.asarray(fb[s].attrs[k])), (s, k)


def _raw(x: np.ndarray) -> bytes | list:
    return x.tolist() if x.dtype == object else x.tobytes()


class _Stop(Exception):
    pass


def _stop_in(split, batches):
    @contextlib.contextmanager
    def factory(desc, total):
        count = [0]

        def advance(n):
            count[0] += 1
            if desc.startswith(split) and count[0] == batches:
                raise _Stop

        yield advance

    return factory


def _args(data, ckpt, root, *extra):
    return ["extract", "--dataset", "folder", "--data-root", data, "--backbone", "conv4_64", "--checkpoint", ckpt,
            "--image-size", SIZE, "--batch-size", 4, "--workers", 0, "--cache-root", root, "--device", "cpu", *extra]


def test_torchrun_extract_resumes_a_one_process_run_into_the_same_cache(reference, data, ckpt, tmp_path):
    # one process, interrupted in val after one batch: train is complete, val staged in <cache>.val.partial
    kw = dict(data_root=data, checkpoint=ckpt, image_size=SIZE, batch_size=4, cache_root=tmp_path, workers=0,
              device="cpu")
    with pytest.raises(_Stop):
        extract("folder", "conv4_64", progress_factory=_stop_in("val", 1), **kw)
    out = cache_path(tmp_path, "folder", "conv4_64")
    assert cache.partial_path(out, "val").exists()
    # two processes finish val from row 4 and do test from scratch, both shared
    r = torchrun(*_args(data, ckpt, tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)  # rank 0 alone prints
    assert "val: resuming, 4 of 10 images already staged" in r.stderr
    assert r.stderr.count("test: 10 images, 2 classes written") == 1
    assert not list(tmp_path.rglob("*.partial")) and not list(tmp_path.rglob("*.share"))
    _same_cache(out, reference)


def test_a_failing_rank_stops_the_run_once_and_the_rest_resumes_with_one_process(reference, data, ckpt, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(data, root)
    # val: 10 images in batches of 4; with 2 ranks rank 1 gets rows [4, 10) and fails in its second batch
    bad = root / cache.read_split(reference, "val").paths[9]
    good = bad.read_bytes()
    bad.write_bytes(b"not an image")
    r = torchrun(*_args(root, ckpt, tmp_path / "c"))
    assert r.returncode != 0
    assert r.stderr.count("error: cannot decode image") == 1 and str(bad.name) in r.stderr
    assert r.stderr.count("Traceback (most recent call last)") <= 1  # torchrun's own report, none of a rank
    out = cache_path(tmp_path / "c", "folder", "conv4_64")
    assert cache.list_splits(out) == ["train"]
    assert [p.name.split(".")[-2] for p in share_files(out, "val")] == ["0-4", "4-10"]
    # repaired, one process resumes the shared split from its staged rows: only the last batch is left
    bad.write_bytes(good)
    totals = {}

    @contextlib.contextmanager
    def count(desc, total):
        totals[desc] = total
        yield lambda n: None

    extract("folder", "conv4_64", data_root=root, checkpoint=ckpt, image_size=SIZE, batch_size=4,
            cache_root=tmp_path / "c", workers=0, device="cpu", progress_factory=count)
    assert totals == {"val": 2, "test": 10}
    _same_cache(out, reference, same_root=False)
