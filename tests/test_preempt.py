"""Preemption loses nothing: SIGTERM (a cluster scheduler) and SIGINT (Ctrl-C) sent to the whole
process group of a real ``poodle`` process at three points of its run.

The child is slowed a little from a chosen progress update on (and says when it got there, by a
file), so that the signal lands where the test means it to; then the test sends the signal with
``os.killpg``, as a scheduler does, DataLoader workers included. Every time: the exit status is
the one of a process killed by that signal (128 + its number), one line says what was kept and
the exact command that continues, no traceback (from the process or a worker), no ``*.lock`` and
no temporary left; the same command then completes the run to exactly the results of an
uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import _images
import pytest
import torch
from _signals import SMALL_CHUNKS, interrupted, run, stopped_cleanly

from poodle import interrupt
from poodle.cache import read_split, write_arrays
from poodle.results import read_results

# ================================================================================================ train


def _train_args() -> list[str]:
    args = ["train", "--dataset", "folder", "--data-root", "data", "--backbone", "conv4_64", "--recipe", "simple"]
    args += ["--epochs", "3", "--batch-size", "6", "--image-size", "16", "--augment", "crop", "--val-every", "0"]
    return args + ["--workers", "2", "--device", "cpu"]


def test_train_stopped_at_three_points_continues_to_the_same_weights(tmp_path):
    _images.write_folder(tmp_path / "data", {"train": 3, "val": 2}, 4, size=16, splits=("train", "val"))
    # with DataLoader workers, which get the signal too
    args = _train_args()
    run([*args, "--out", "whole"], tmp_path)
    whole = torch.load(tmp_path / "whole" / "last.pt", weights_only=True)
    # 2 steps an epoch, one progress update each; counted from where each run starts: in epoch 1
    # (nothing kept), in epoch 2 (epoch 1 kept), then resumed at epoch 2, in epoch 3
    for (at, sig), done in zip(((1, signal.SIGTERM), (3, signal.SIGINT), (3, signal.SIGTERM)), (0, 1, 2)):
        p = interrupted([*args, "--out", "cut"], tmp_path, at, sig)
        line = stopped_cleanly(p, sig, [*args, "--out", "cut"], tmp_path)
        assert (f"epoch {done}/3 (finished)" in line) if done else "nothing finished yet" in line, line
        saved = torch.load(tmp_path / "cut" / "last.pt", weights_only=True) if done else None
        assert (saved is None and not (tmp_path / "cut" / "last.pt").exists()) or saved["epoch"] == done
    run([*args, "--out", "cut"], tmp_path)
    cut = torch.load(tmp_path / "cut" / "last.pt", weights_only=True)
    assert cut["epoch"] == whole["epoch"] == 3
    for k, v in whole["state_dict"].items():
        assert torch.equal(cut["state_dict"][k], v), k


# ============================================================================================== extract


def test_extract_stopped_at_three_points_continues_to_the_same_cache(tmp_path):
    from poodle import backbones

    _images.write_folder(tmp_path / "data", {"train": 4, "test": 4}, 6, size=16, splits=("train", "test"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        backbones.save_checkpoint(backbones.build("conv4_64"), tmp_path / "ck.pt")
    args = ["extract", "--dataset", "folder", "--data-root", "data", "--backbone", "conv4_64", "--checkpoint", "ck.pt"]
    args += ["--image-size", "16", "--workers", "2", "--device", "cpu", "--batch-size", "4", "--splits", "train,test"]
    run([*args, "--cache-root", "whole"], tmp_path)
    # 6 batches a split, 2 progress updates a batch, counted from where each run starts: in train
    # after its first batch; resumed, the 5 left of train and the first of test; resumed, 3 of test
    for (at, sig), train_done in zip(((2, signal.SIGTERM), (12, signal.SIGINT), (6, signal.SIGTERM)), (0, 1, 1)):
        p = interrupted([*args, "--cache-root", "cut"], tmp_path, at, sig)
        line = stopped_cleanly(p, sig, [*args, "--cache-root", "cut"], tmp_path)
        assert "staged to resume from" in line and ("split train in" in line) == bool(train_done), line
    run([*args, "--cache-root", "cut"], tmp_path)
    for split in ("train", "test"):
        a = read_split(tmp_path / "whole" / "folder" / "conv4_64.h5", split)
        b = read_split(tmp_path / "cut" / "folder" / "conv4_64.h5", split)
        assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
    assert not list((tmp_path / "cut").rglob("*.partial"))


# ================================================================================================ solve


@pytest.fixture
def cache(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)

    def split(n_classes: int, per: int, seed: int):
        centres = torch.randn(n_classes, 16, generator=g)
        x = centres.repeat_interleave(per, 0) + 0.5 * torch.randn(n_classes * per, 16, generator=g)
        x = x / x.norm(dim=1, keepdim=True)
        return x.numpy(), [i for i in range(n_classes) for _ in range(per)], [f"c{seed}_{i}" for i in range(n_classes)]

    return write_arrays(tmp_path / "c.h5", {"train": split(8, 10, 1), "test": split(6, 20, 2)})


def test_solve_stopped_at_three_points_continues_to_the_same_records(tmp_path, cache):
    args = ["solve", "--cache", "c.h5", "--episodes", "60", "--method", "proto", "--method", "poodle"]
    args += ["--steps", "3", "--n-neg", "10", "--device", "cpu", "--workers", "1", "--max-memory", "64MiB"]
    run([*args, "--out", "whole.jsonl"], tmp_path)
    for at, sig in ((1, signal.SIGTERM), (6, signal.SIGINT), (20, signal.SIGTERM)):  # of 30 updates
        p = interrupted([*args, "--out", "cut.jsonl"], tmp_path, at, sig, code=SMALL_CHUNKS)
        line = stopped_cleanly(p, sig, [*args, "--out", "cut.jsonl"], tmp_path)
        # the methods share one call: an unfinished call leaves no cell
        assert "kept nothing finished yet" in line, line
        assert not (tmp_path / "cut.jsonl").exists() or not read_results(tmp_path / "cut.jsonl").records
    run([*args, "--out", "cut.jsonl"], tmp_path)
    whole, cut = read_results(tmp_path / "whole.jsonl").records, read_results(tmp_path / "cut.jsonl").records
    assert [(r["key"], r["acc"]) for r in cut] == [(r["key"], r["acc"]) for r in whole]


# ================================================================================================= grid


def test_grid_stopped_at_three_points_keeps_every_finished_cell(tmp_path, cache):
    (tmp_path / "g.toml").write_text('cache = "c.h5"\nepisodes = 12\nsteps = 2\nn_neg = 10\nalpha = [0.0, 0.5, 1.0]\n')
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "g.toml").write_text((tmp_path / "g.toml").read_text().replace('"c.h5"', '"../c.h5"'))
    args = ["grid", "g.toml", "--device", "cpu", "--cells-per-call", "1"]
    run(["grid", "one/g.toml", "--device", "cpu"], tmp_path)
    # 8 progress updates a cell (start, 3 chunks of 4 episodes, end), counted from where each run
    # starts: in cell 1; in cell 2 (cell 1 kept); past the cells kept (2 updates each), at cell 3
    for (at, sig), kept in zip(((3, signal.SIGTERM), (10, signal.SIGINT), (11, signal.SIGTERM)), (0, 1, 2)):
        p = interrupted(args, tmp_path, at, sig, code=SMALL_CHUNKS)
        line = stopped_cleanly(p, sig, args, tmp_path)
        records = read_results(tmp_path / "g.results.jsonl").records if (tmp_path / "g.results.jsonl").exists() else []
        assert len(records) == kept, line
        assert (f"kept {kept} of 3 cells in g.results.jsonl" in line) if kept else "nothing finished" in line, line
    run(args, tmp_path)
    whole = {r["key"]: r["acc"] for r in read_results(tmp_path / "one" / "g.results.jsonl").records}
    cut = {r["key"]: r["acc"] for r in read_results(tmp_path / "g.results.jsonl").records}
    assert cut == whole


def test_a_second_signal_or_the_grace_period_stops_without_a_safe_point(monkeypatch):
    """Inside stop_on_signals the first signal only asks; with no safe point, the grace period's
    alarm raises Interrupted wherever the process is; a second signal raises it at once, unless it
    is the same signal within REPEAT seconds (a rank that SLURM and torchrun both signal)."""
    with interrupt.stop_on_signals(grace=0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupt.requested() == signal.SIGTERM
        t0 = time.monotonic()
        with pytest.raises(interrupt.Interrupted) as e:
            while time.monotonic() - t0 < 5:
                pass
        assert e.value.signum == signal.SIGTERM and e.value.exit_code == 143
        assert time.monotonic() - t0 < 2
    monkeypatch.setattr(interrupt, "REPEAT", 0.3)
    with interrupt.stop_on_signals(grace=None):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same request again: still only asked
        assert interrupt.requested() == signal.SIGINT
        time.sleep(0.35)
        with pytest.raises(interrupt.Interrupted) as e:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert e.value.exit_code == 130
    with interrupt.stop_on_signals(grace=None):
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(interrupt.Interrupted) as e:  # another signal at once: stop now
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert e.value.exit_code == 143
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_workers_that_ignore_sigterm_are_shut_down_when_the_loop_raises():
    """A loop that raises keeps its iterator alive in the traceback; its workers ignore SIGTERM
    (quiet_worker), so without loader_batches they outlive the error, and the interpreter's exit,
    which sends them SIGTERM and then waits, never ends."""
    import multiprocessing as mp

    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, worker_init_fn=interrupt.quiet_worker)
    with pytest.raises(ValueError) as held:  # the traceback (and the iterator in its frame) stays
        with interrupt.loader_batches(loader) as batches:
            for _ in batches:
                assert mp.active_children()  # the worker is up
                raise ValueError("a bad image")
    assert held.traceback and not mp.active_children()
