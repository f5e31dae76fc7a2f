"""Faults lose nothing: writes that fail midway, concurrent writers, a killed writer, and path
arguments that cannot be resolved.

Each command runs in a real process where the promise is about processes: a file-size limit
(``RLIMIT_FSIZE``, set in the child before it starts) makes writes fail as on a full disk, with
SIGXFSZ ignored (Python's default: the write raises EFBIG) or left at its default (the process
would be killed by it). Every file that existed before must be unchanged byte for byte, and the
command must say one line naming the file and the cause, with no traceback.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import _images
import click
import numpy as np
import pytest
from click.testing import CliRunner

from poodle import results as RS
from poodle.cache import read_split, validate, write_arrays
from poodle.cli.main import COMMANDS, cli
from poodle.errors import ConfigError, WriteError

D = 16


def _features(n_classes: int, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_classes, D)).repeat(per_class, 0) + 0.5 * rng.standard_normal((n_classes * per_class, D))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), np.arange(n_classes).repeat(per_class), [f"c{seed}_{i}" for i in range(n_classes)]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # the commands in this process and in the children name the same files relative to tmp_path
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def cache(tmp_path) -> Path:
    return write_arrays(tmp_path / "c.h5", {"train": _features(8, 10, 1), "test": _features(6, 20, 2)})


def hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``: what "every file that existed before is intact" compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def poodle(
    *args: object, cwd: Path, limit: int | None = None, xfsz: str = "ignore", code: str = "", timeout: float = 300
) -> subprocess.CompletedProcess:
    """``poodle ARGS`` in a new process, with a file-size limit of ``limit`` bytes; ``xfsz``:
    SIGXFSZ ignored (the write fails with EFBIG) or ``default`` (it kills); ``code`` runs first."""
    head = "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n" if xfsz == "default" else ""
    program = f"import signal, sys\n{head}{code}\nfrom poodle.cli.main import cli\ncli(prog_name='poodle')\n"

    def limited() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "POODLE_NATIVE": "0", "COLUMNS": "300"}
    return subprocess.run(
        [sys.executable, "-c", program, *map(str, args)],
        cwd=cwd,
        preexec_fn=limited,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def one_error_line(p: subprocess.CompletedProcess) -> str:
    """The command failed with exit code 1 and said one ``error:`` line and no traceback."""
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, p.stderr[-3000:]
    return lines[0]


TOO_LARGE = "File too large (beyond the file-size limit of this process"


# ================================================================================ writes failing midway


@pytest.mark.parametrize("xfsz", ["ignore", "default"])
def test_solve_out_on_a_full_disk_leaves_the_results_file_as_it_was(tmp_path, cache, xfsz):
    solve = ("solve", "--cache", "c.h5", "--episodes", 4, "--device", "cpu", "--workers", 1, "--steps", 2)
    res = CliRunner().invoke(cli, [*map(str, solve), "--n-neg", "10", "--out", str(tmp_path / "r.jsonl")])
    assert res.exit_code == 0, res.output
    before = hashes(tmp_path)
    size = (tmp_path / "r.jsonl").stat().st_size
    p = poodle(
        *solve, "--method", "proto", "--method", "poodle", "--out", "r.jsonl", cwd=tmp_path, limit=size + 50, xfsz=xfsz
    )
    assert one_error_line(p).startswith(f"error: cannot write r.jsonl: {TOO_LARGE}")
    assert "the record was not appended; the file is as it was" in p.stderr
    assert hashes(tmp_path) == before


def test_save_episodes_on_a_full_disk_leaves_the_episode_file_as_it_was(tmp_path, cache):
    solve = ("solve", "--cache", "c.h5", "--method", "proto", "--device", "cpu", "--workers", 1)
    res = CliRunner().invoke(cli, [*map(str, solve), "--episodes", "4", "--save-episodes", str(tmp_path / "e.h5")])
    assert res.exit_code == 0, res.output
    before = hashes(tmp_path)
    p = poodle(*solve, "--episodes", 9, "--save-episodes", "e.h5", cwd=tmp_path, limit=6000)
    assert (
        one_error_line(p)
        == f"error: cannot write e.h5: {TOO_LARGE}, ulimit -f, or of the file system); e.h5 is as it was"
    )
    assert hashes(tmp_path) == before  # and no temporary left behind


def test_grid_on_a_full_disk_keeps_the_results_file(tmp_path, cache):
    grid = tmp_path / "g.toml"
    grid.write_text('cache = "c.h5"\nepisodes = 5\nsteps = 2\nn_neg = 10\nalpha = [0.0, 1.0]\n')
    assert CliRunner().invoke(cli, ["grid", str(grid), "--device", "cpu"]).exit_code == 0
    grid.write_text('cache = "c.h5"\nepisodes = 5\nsteps = 2\nn_neg = 10\nalpha = [0.0, 1.0, 2.0]\n')
    before = hashes(tmp_path)
    p = poodle(
        "grid", "g.toml", "--device", "cpu", cwd=tmp_path, limit=(tmp_path / "g.results.jsonl").stat().st_size + 60
    )
    assert one_error_line(p).startswith(f"error: cannot write g.results.jsonl: {TOO_LARGE}")
    assert hashes(tmp_path) == before


def test_extract_on_a_full_disk_keeps_the_cache_and_resumes(tmp_path):
    import h5py
    import torch

    from poodle import backbones

    _images.write_folder(tmp_path / "data", {"train": 2, "test": 2}, 4, size=16, splits=("train", "test"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        backbones.save_checkpoint(backbones.build("conv4_64"), tmp_path / "ck.pt")
    args = ("extract", "--dataset", "folder", "--data-root", "data", "--backbone", "conv4_64", "--checkpoint", "ck.pt")
    args += ("--image-size", 16, "--cache-root", "cr", "--workers", 0, "--device", "cpu", "--batch-size", 4)
    res = CliRunner().invoke(cli, [*map(str, args), "--splits", "train"])
    assert res.exit_code == 0, res.output
    cache = tmp_path / "cr" / "folder" / "conv4_64.h5"
    with h5py.File(cache, "a") as f:  # a bigger cache: its copy (the commit) exceeds what the staging needs
        f.create_dataset("padding", data=np.zeros(100_000))
    before = hashes(tmp_path)
    size = cache.stat().st_size
    # the staging file cannot be written; then the copy of the cache that takes the new split cannot
    for limit, culprit, outcome in (
        (20_000, "cr/folder/conv4_64.h5.test.partial", "the batches written before are kept for a re-run"),
        (size + 2000, "cr/folder/conv4_64.h5", "the cache is as it was; split 'test' stays staged in"),
    ):
        for staged in (tmp_path / "cr" / "folder").glob("*.partial"):
            staged.unlink()
        p = poodle(*args, "--splits", "test", cwd=tmp_path, limit=limit)
        assert one_error_line(p).startswith(f"error: cannot write {culprit}: {TOO_LARGE}"), p.stderr
        assert outcome in p.stderr
        after = hashes(tmp_path)
        assert {k: after[k] for k in before} == before
        assert [k for k in after if k not in before] == ["cr/folder/conv4_64.h5.test.partial"]
    # nothing lost: the same command without the limit completes the cache from what was staged
    res = CliRunner().invoke(cli, [*map(str, args), "--splits", "test"])
    assert res.exit_code == 0, res.output
    assert list(validate(cache)["splits"]) == ["train", "test"] and len(read_split(cache, "test")) == 8


def test_train_on_a_full_disk_keeps_every_earlier_file(tmp_path):
    _images.write_folder(tmp_path / "data", {"train": 3, "val": 2}, 4, size=16, splits=("train", "val"))
    args = ("train", "--dataset", "folder", "--data-root", "data", "--backbone", "conv4_64", "--recipe", "simple")
    args += ("--epochs", 1, "--batch-size", 6, "--image-size", 16, "--augment", "crop", "--val-every", 1)
    args += ("--val-episodes", 2, "--val-way", 2, "--val-query", 1, "--workers", 0, "--device", "cpu")
    res = CliRunner().invoke(cli, [*map(str, args), "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    before = hashes(tmp_path)
    p = poodle(*args, "--out", "b", cwd=tmp_path, limit=50_000)
    assert one_error_line(p).startswith(f"error: cannot write b/last.pt: {TOO_LARGE}")
    after = hashes(tmp_path)
    assert {k: after[k] for k in before} == before and not [k for k in after if k.startswith("b/")]


def test_an_append_that_fails_midway_is_cut_back(tmp_path, monkeypatch):
    # a full disk found after half the record was written (ENOSPC, which no limit can predict)
    path = tmp_path / "r.jsonl"
    f = RS.ResultsFile(path)
    ident = RS.make_identity(
        cache_id="x",
        episode={"split": "test", "way": 5, "shot": 1, "query": 15, "imbalance": None, "seed": 0, "episodes": 2},
        negatives="none",
        n_neg=None,
        method="proto",
        options={},
        transductive=False,
    )
    f.append(RS.make_record(ident, [1.0, 0.5], label="a", cache="c"))
    before = path.read_bytes()
    real = os.pwrite

    def half_then_full(fd: int, data, offset: int) -> int:
        n = real(fd, bytes(data[: len(data) // 2]), offset)
        monkeypatch.setattr(
            os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        )
        return n

    monkeypatch.setattr(os, "pwrite", half_then_full)
    with pytest.raises(
        WriteError, match=r"cannot write .*r.jsonl: No space left on device \(the disk is full\); the record"
    ):
        f.append(RS.make_record({**ident, "method": "poodle"}, [0.0, 0.5], label="b", cache="c"))
    assert path.read_bytes() == before


# ============================================================================ concurrent and killed writers

_WAIT_FOR_GO = textwrap.dedent("""
    import time, pathlib
    while not pathlib.Path("go").exists():
        time.sleep(0.005)
""")


def test_two_grid_processes_on_one_results_file_lose_nothing(tmp_path, cache):
    body = 'cache = "c.h5"\nepisodes = 6\nsteps = 2\nn_neg = 10\nalpha = [0.0, 0.5, 1.0]\nshot = [1, 2]\n'
    (tmp_path / "g.toml").write_text(body)
    args = ("grid", "g.toml", "--device", "cpu", "--cells-per-call", 1)
    env_code = "import torch, poodle.pipeline\n" + _WAIT_FOR_GO  # both past their imports, then at once
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"{env_code}\nfrom poodle.cli.main import cli\ncli(prog_name='poodle')",
                *map(str, args),
            ],
            cwd=tmp_path,
            env={**os.environ, "POODLE_NATIVE": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(2)
    ]
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    raw = (tmp_path / "g.results.jsonl").read_bytes()
    lines = raw.decode().splitlines()
    assert raw.endswith(b"\n") and json.loads(lines[0])["kind"] == "header"
    records = [json.loads(line) for line in lines[1:]]  # every line whole: no torn record
    counts: dict[str, int] = {}
    for r in records:
        counts[r["key"]] = counts.get(r["key"], 0) + 1
    assert len(counts) == 6 and set(counts.values()) <= {1, 2}  # every cell once or twice, none lost
    # the report equals the one of a single process
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "g.toml").write_text(body.replace('"c.h5"', '"../c.h5"'))
    assert CliRunner().invoke(cli, ["grid", str(tmp_path / "one" / "g.toml"), "--device", "cpu"]).exit_code == 0

    def report(path: Path) -> str:
        res = CliRunner().invoke(
            cli, ["report", str(path), "--rows", "alpha", "--cols", "shot", "--format", "markdown"]
        )
        assert res.exit_code == 0, res.output
        return res.output

    assert report(tmp_path / "g.results.jsonl") == report(tmp_path / "one" / "g.results.jsonl")


_KILLED_MID_APPEND = textwrap.dedent("""
    import os, signal
    import poodle.results as R
    def half_then_killed(fd, data, offset):
        os.pwrite(fd, bytes(data[: len(data) // 2]), offset)
        os.kill(os.getpid(), signal.SIGKILL)
    R._write_all = half_then_killed
""")


def test_solve_killed_mid_append_leaves_a_file_that_reads(tmp_path, cache):
    solve = ("solve", "--cache", "c.h5", "--episodes", 4, "--device", "cpu", "--workers", 1, "--method", "proto")
    res = CliRunner().invoke(cli, [*map(str, solve), "--out", str(tmp_path / "r.jsonl")])
    assert res.exit_code == 0, res.output
    whole = (tmp_path / "r.jsonl").read_bytes()
    p = poodle(*solve, "--seed", 1, "--out", "r.jsonl", cwd=tmp_path, code=_KILLED_MID_APPEND)
    assert p.returncode == -signal.SIGKILL, p.stderr
    torn = (tmp_path / "r.jsonl").read_bytes()
    assert torn.startswith(whole) and len(torn) > len(whole) and not torn.endswith(b"\n")
    # it reads: the torn line is left out (and said), the whole records are there
    assert len(RS.read_results(tmp_path / "r.jsonl")) == 1
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "r.jsonl")])
    assert res.exit_code == 0 and "last line is cut" in " ".join(res.output.split()), res.output
    # the next append cuts the torn line off first
    res = CliRunner().invoke(cli, [*map(str, solve), "--seed", "2", "--out", str(tmp_path / "r.jsonl")])
    assert res.exit_code == 0, res.output
    after = (tmp_path / "r.jsonl").read_bytes()
    assert after.startswith(whole) and after.endswith(b"\n") and len(RS.read_results(tmp_path / "r.jsonl")) == 2


# ================================================================================ unresolvable paths


def _base_args(tmp_path: Path, cache: Path) -> dict[str, list[str]]:
    """Arguments each command accepts up to its path check (required options given)."""
    grid = tmp_path / "g.toml"
    grid.write_text('cache = "c.h5"\nepisodes = 4\n')
    res = tmp_path / "r.jsonl"
    RS.ResultsFile(res)
    d = str(tmp_path)
    return {
        "extract": ["--dataset", "folder", "--backbone", "conv4_64", "--data-root", d],
        "split": ["--data-root", d, "--out", str(tmp_path / "s"), "--setting", "noisy"],
        "info": [str(cache)],
        "solve": ["--cache", str(cache)],
        "train": ["--dataset", "folder", "--data-root", d, "--backbone", "conv4_64"],
        "grid": [str(grid)],
        "report": [str(res)],
        "predict": ["--support", d, "--query", d, "--backbone", "conv4_64", "--out", str(tmp_path / "p.csv")],
        "demo": [],
    }


def _path_params() -> list[tuple[str, str]]:
    ctx = click.Context(cli)
    return [
        (name, p.name or "")
        for name in COMMANDS
        for p in cli.get_command(ctx, name).params  # type: ignore[union-attr]
        if isinstance(p.type, click.Path)
    ]


@pytest.mark.parametrize("command, param", _path_params())
def test_every_path_option_that_cannot_be_resolved_is_one_line(tmp_path, cache, command, param):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    args = _base_args(tmp_path, cache)[command]
    cmd = cli.get_command(click.Context(cli), command)
    p = next(q for q in cmd.params if q.name == param)
    if isinstance(p, click.Option):
        flag = next(o for o in p.opts if o.startswith("--"))
        args = [a for i, a in enumerate(args) if a != flag and (i == 0 or args[i - 1] != flag)] + [flag, str(loop)]
        shown = flag
    else:
        args, shown = [str(loop)], p.human_readable_name
    before = hashes(tmp_path)
    res = CliRunner().invoke(cli, [command, *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and text.count("error:") == 1, res.output
    assert f"error: {shown} {loop}: cannot be resolved: a symbolic link loop" in text
    assert hashes(tmp_path) == before


def test_paths_inside_values_and_files_and_the_library_say_the_same(tmp_path, cache):
    from poodle.episodes import load_episodes

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    res = CliRunner().invoke(cli, ["solve", "--cache", str(cache), "--negatives", str(loop), "--episodes", "4"])
    assert res.exit_code == 1 and f"error: --negatives {loop}: cannot be resolved" in " ".join(res.output.split())
    grid = tmp_path / "g.toml"
    grid.write_text('cache = "loop"\nepisodes = 4\n')
    res = CliRunner().invoke(cli, ["grid", str(grid), "--device", "cpu"])
    assert res.exit_code == 1 and f"error: feature cache {loop}: cannot be resolved: a symbolic link loop" in " ".join(
        res.output.split()
    ), res.output
    for call in (lambda: read_split(loop, "test"), lambda: load_episodes(loop), lambda: RS.read_results(loop)):
        with pytest.raises(ConfigError, match="loop: cannot be resolved: a symbolic link loop"):
            call()
    # a link loop on the way, or a file used as a folder, is named
    with pytest.raises(ConfigError, match=r"loop/e.h5: cannot be resolved: .*loop is a symbolic link loop$"):
        load_episodes(loop / "e.h5")
    with pytest.raises(ConfigError, match=r"cannot be resolved: .*c.h5 is a file, not a directory"):
        RS.ResultsFile(cache / "r.jsonl")


# ================================================================================ the memory bound


def test_a_memory_bound_below_the_pool_is_refused_and_one_above_says_what_it_leaves_out(tmp_path):
    big = write_arrays(tmp_path / "big.h5", {"train": _features(40, 1000, 3), "test": _features(5, 20, 4)})
    pool, split = 40_000 * D * 4, 100 * D * 4  # bytes: the base pool is the train split

    def mib(n: float) -> str:
        return f"{n / 2**20:,.1f} MiB"

    solve = ("solve", "--cache", str(big), "--episodes", 4, "--device", "cpu", "--workers", 1, "--steps", 2)
    before = hashes(tmp_path)
    res = CliRunner().invoke(cli, [*map(str, solve), "--max-memory", "2MiB"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "error: --max-memory 2.0 MiB cannot be met" in text, text
    assert f"the features and negative pool held for the whole run take {mib(pool + split)}" in text
    assert "raise it to at least" in text and hashes(tmp_path) == before
    # met: what each call holds is counted (with cl2n, the split as read besides its centred copy);
    # the preprocessing's working copies come on top, for a moment, and are said with their size
    res = CliRunner().invoke(cli, [*map(str, solve), "--max-memory", "16MiB", "--preprocess", "cl2n"])
    text = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert f"note: --max-memory 16.0 MiB counts what each call holds ({mib(pool + 2 * split)}) and its chunks" in text
    working = 40_000 * D * (4 + 8)  # the pool as read and its float64 copy
    assert f"--preprocess cl2n also took {mib(working)} for a moment before solving" in text
    assert "beyond the bound" in text and hashes(tmp_path) == before
    # without an explicit bound there is nothing to say
    res = CliRunner().invoke(cli, [*map(str, solve), "--preprocess", "cl2n"])
    assert res.exit_code == 0 and "note:" not in res.output


def test_an_explicit_bound_counts_the_episodes_and_what_the_caller_holds(cache):
    from poodle.episodes import EpisodeSpec, EpisodeStream
    from poodle.evaluate import Hooks, evaluate
    from poodle.negatives import NegativeSpec
    from poodle.run import RunOptions

    test = read_split(cache, "test")
    eps = EpisodeStream(test.labels, EpisodeSpec(way=5, shot=1, query=3), 10).materialize()
    methods = [("po", "poodle", {"steps": 2})]
    neg = NegativeSpec("base", 5)
    pool = read_split(cache, "train").features.numel() * 4
    plans = []
    kw = dict(negatives=neg, cache_path=cache, also_held={"the caller's copy": 1000})
    run = RunOptions(device="cpu", workers=1, max_memory=10**7)
    evaluate(test, eps, methods, run=run, hooks=Hooks(planned=plans.append), **kw)
    assert plans[0].held == test.features.numel() * 4 + pool + eps.nbytes + 1000 and plans[0].budget == 10**7
    with pytest.raises(ConfigError) as e:
        evaluate(test, eps, methods, run=RunOptions(device="cpu", workers=1, max_memory=plans[0].held), **kw)
    assert (
        f"what is held for the whole run takes {plans[0].held:,} bytes (the features and negative pool "
        f"{test.features.numel() * 4 + pool:,} bytes, the episodes drawn in advance {eps.nbytes:,} bytes, "
        f"the caller's copy 1,000 bytes)" in str(e.value)
    )
