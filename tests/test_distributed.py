"""Stages under torchrun (2 gloo processes on the CPU) against their one-process output.

Each torchrun start costs seconds, so the launches are few and each checks several things.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from poodle.distributed import Dist, RankFailed, Round, deal, gather_results, share, shared_map
from poodle.extract import cache_path, extract

SIZE = 32
POODLE = str(Path(sys.executable).with_name("poodle"))
TIMEOUT = 240  # seconds; a hang fails the test instead of the suite


def torchrun(*args: str, n: int = 2, cwd: Path | None = None, script: str = POODLE) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node n <script> args`` with gloo on the CPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POODLE_DIST_TIMEOUT": "120", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        script,
        *map(str, args),
    ]
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


def test_deal_gives_each_rank_its_part_of_every_round_from_the_counts():
    # one process: every unit in turn, whole
    assert deal(Dist(), [7, 3]) == [Round((0,), 0, None), Round((1,), 1, None)]
    assert deal(Dist(), []) == []
    # at least as many units as ranks: rounds of one unit per rank, the last round short
    two = [deal(Dist(world=2, rank=r), [5, 5, 5]) for r in range(2)]
    assert two[0] == [Round((0, 1), 0, None), Round((2,), 2, None)]
    assert two[1] == [Round((0, 1), 1, None), Round((2,), None, None)]
    # fewer units than ranks: each unit a round, its rows shared out; a rank with none solves nothing
    three = [deal(Dist(world=3, rank=r), [7, 1]) for r in range(3)]
    assert [[rnd.units for rnd in ranks] for ranks in three] == [[(0,), (1,)]] * 3
    assert [ranks[0].rows for ranks in three] == [range(0, 2), range(2, 4), range(4, 7)]
    assert [(ranks[1].unit, ranks[1].rows) for ranks in three] == [
        (None, range(0, 0)),
        (None, range(0, 0)),
        (1, range(0, 1)),
    ]


def test_one_process_results_pass_through_and_the_old_callback_map_warns():
    local = {"k": (torch.tensor([0.5, 1.0], dtype=torch.float64), {"seconds": 1.0})}
    assert gather_results(Dist(), local) is local
    said = (
        "poodle.distributed.shared_map is deprecated: loop over poodle.distributed.deal(d, n_rows) and merge "
        "each round with poodle.distributed.gather_results (removed in 0.3.0)"
    )
    seen = []

    def solve(unit, rows):
        seen.append((unit, rows))
        return {unit: (torch.full((2,), float(len(unit))), {"seconds": 0.0})}

    with pytest.warns(DeprecationWarning, match="^" + re.escape(said) + "$"):
        got = list(shared_map(Dist(), ["a", "bb"], solve, len))
    assert seen == [("a", None), ("bb", None)]
    assert [(u, {k: v[0].tolist() for k, v in r.items()}) for u, r in got] == [
        ("a", {"a": [1.0, 1.0]}),
        ("bb", {"bb": [2.0, 2.0]}),
    ]


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
    return extract(
        "folder",
        "conv4_64",
        data_root=data,
        checkpoint=ckpt,
        image_size=SIZE,
        batch_size=4,
        cache_root=tmp_path_factory.mktemp("ref"),
        workers=0,
        device="cpu",
    )


def _same_cache(a: Path, b: Path, *, same_root: bool = True) -> None:
    """Same splits with the same bytes of features, labels, paths, classes, and the same attributes."""
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        assert list(fa) == list(fb)
        skip = {"created"} | (set() if same_root else {"data_root"})
        assert {k: str(v) for k, v in fa.attrs.items() if k not in skip} == {
            k: str(v) for k, v in fb.attrs.items() if k not in skip
        }
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
    return [
        "extract",
        "--dataset",
        "folder",
        "--data-root",
        data,
        "--backbone",
        "conv4_64",
        "--checkpoint",
        ckpt,
        "--image-size",
        SIZE,
        "--batch-size",
        4,
        "--workers",
        0,
        "--cache-root",
        root,
        "--device",
        "cpu",
        *extra,
    ]


def test_torchrun_extract_resumes_a_one_process_run_into_the_same_cache(reference, data, ckpt, tmp_path):
    # one process, interrupted in val after one batch: train is complete, val staged in <cache>.val.partial
    kw = dict(
        data_root=data, checkpoint=ckpt, image_size=SIZE, batch_size=4, cache_root=tmp_path, workers=0, device="cpu"
    )
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

    extract(
        "folder",
        "conv4_64",
        data_root=root,
        checkpoint=ckpt,
        image_size=SIZE,
        batch_size=4,
        cache_root=tmp_path / "c",
        workers=0,
        device="cpu",
        progress_factory=count,
    )
    assert totals == {"val": 2, "test": 10}
    _same_cache(out, reference, same_root=False)


# --------------------------------------------------------------------------- solve and grid

GRID = """cache = "feat.h5"
[episodes]
shot = [1, 5]
query = 5
episodes = 9
[negatives]
n_neg = 20
[solver]
method = ["proto", "poodle"]
alpha = [0.0, 1.0]
beta = 0.5
steps = 3
"""
ONE_CELL = """cache = "feat.h5"
[episodes]
episodes = 7
query = 4
[negatives]
n_neg = 10
[solver]
method = "poodle"
steps = 2
"""
SOLVE = [
    "solve",
    "--cache",
    "feat.h5",
    "--episodes",
    "7",
    "--query",
    "5",
    "--method",
    "poodle",
    "--method",
    "proto",
    "--steps",
    "3",
    "--n-neg",
    "20",
    "--device",
    "cpu",
]
# how a record was computed, not what: timings, machine, chunking (the resumed grid runs one cell per call)
TIMINGS = {
    "seconds",
    "episodes_per_s",
    "call_seconds",
    "call_cells",
    "worker_seconds",
    "wall_seconds_share",
    "finished",
    "processes",
    "device",
    "workers",
    "chunk_size",
    "versions",
    "formulation",
}


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in TIMINGS}
    return obj


def _records(path):
    """The records of a results file without their timings, by key."""
    from poodle.results import read_results

    return {r["key"]: _strip(r) for r in read_results(path).records}


def test_torchrun_solve_and_grid_match_one_process(tmp_path, make_features, monkeypatch):
    from click.testing import CliRunner

    from poodle import grid as G
    from poodle.cache import write_arrays
    from poodle.cli.solve import solve as solve_cmd
    from poodle.episodes import load_episodes
    from poodle.events import CellFinished
    from poodle.pipeline import RunOptions

    x, y = make_features(10, 24, 16, seed=3, spread=0.9)
    xb, yb = make_features(8, 20, 16, seed=4, spread=0.9)
    write_arrays(
        tmp_path / "feat.h5",
        {"test": (x, y, [f"t{i}" for i in range(10)]), "train": (xb, yb, [f"b{i}" for i in range(8)])},
    )
    (tmp_path / "grid.toml").write_text(GRID)
    (tmp_path / "one.toml").write_text(ONE_CELL)
    # one process: solve, the grid in full, the grid interrupted after 3 cells, the one-cell grid
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(solve_cmd, SOLVE[1:] + ["--json", "one.json", "--save-episodes", "one-eps.h5"])
    assert res.exit_code == 0, res.output
    spec = G.load_grid(tmp_path / "grid.toml")
    cpu = RunOptions(device="cpu")
    full = G.run_grid(spec, tmp_path / "full.jsonl", options=cpu)
    assert len(full.records) == 6  # 2 shots x (proto, poodle alpha 0/1) = 6 cells in 4 calls: shared by cells

    def crash_after_3(event):
        if isinstance(event, CellFinished) and event.done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        G.run_grid(
            spec, tmp_path / "part.jsonl", options=RunOptions(device="cpu", cells_per_call=1), on_event=crash_after_3
        )
    G.run_grid(G.load_grid(tmp_path / "one.toml"), tmp_path / "one-ref.jsonl", options=cpu)

    # two processes: solve; the interrupted grid resumed (one process before, two now; its 3 pending
    # cells, one per call, are dealt out to the ranks); the one-cell grid, whose 7 episodes are split
    # 4 + 3 across the ranks
    runs = [
        SOLVE + ["--json", "two.json", "--save-episodes", "two-eps.h5"],
        ["grid", "grid.toml", "--out", "part.jsonl", "--device", "cpu", "--cells-per-call", "1"],
        ["grid", "one.toml", "--out", "one-two.jsonl", "--device", "cpu"],
    ]
    import json as _json

    r = torchrun(_json.dumps(runs), cwd=tmp_path, script=str(Path(__file__).with_name("_dist_driver.py")))
    assert r.returncode == 0, r.stderr[-3000:]
    from poodle.results import read_results

    one, two = read_results(tmp_path / "one.json").records, read_results(tmp_path / "two.json").records
    assert [r["processes"] for r in one + two] == [1, 1, 2, 2]
    assert [_strip(r) for r in one] == [_strip(r) for r in two]  # per-episode accuracies, means, CIs, identity
    a, b = load_episodes(tmp_path / "one-eps.h5"), load_episodes(tmp_path / "two-eps.h5")
    for f in ("support", "query", "support_labels", "query_labels", "negatives", "index"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert r.stdout.count("diff vs") == 1  # rank 0 alone prints the table
    assert _records(tmp_path / "part.jsonl") == _records(full.path)
    assert _records(tmp_path / "one-two.jsonl") == _records(tmp_path / "one-ref.jsonl")
    assert len((tmp_path / "part.jsonl").read_text().splitlines()) == 1 + 6  # header + 6 cells, none twice


def test_shares_merge_into_the_split_a_single_writer_makes(tmp_path):
    """Rows, skipped images and raw_mean of shares [0, 4) [4, 8) [8, 10) equal one SplitWriter's."""
    from poodle.cache_shares import ShareWriter, commit_shares, scan, share_key

    rng = np.random.default_rng(0)
    raw = rng.standard_normal((10, 6)).astype(np.float32) * 3
    labels = np.array([0, 1] * 5)
    paths = [f"img{i}.png" for i in range(10)]
    bad = {5}  # skipped, in the second batch
    attrs = cache.make_root_attrs("d", "b")
    kw = dict(root_attrs=attrs, classes=["a", "b"], dim=6)

    def batches(a, b):
        for s in range(a, b, 4):
            rows = [i for i in range(s, min(b, s + 4)) if i not in bad]
            yield (
                raw[rows],
                labels[rows],
                [paths[i] for i in rows],
                [paths[i] for i in range(s, min(b, s + 4)) if i in bad],
            )

    one = tmp_path / "one.h5"
    with cache.SplitWriter(one, "test", samples_sha256="x", n_total=10, **kw) as w:
        for x, y, p, sk in batches(0, 10):
            w.append(x, y, p, skipped=sk)
        w.commit()
    two = tmp_path / "two.h5"
    key = share_key("x", 10, 6, "float32", attrs, 4)
    for a, b in ((4, 8), (0, 4), (8, 10)):
        with ShareWriter(two, "test", a, b, key=key, **kw) as w:
            for x, y, p, sk in batches(a, b):
                w.append(x, y, p, skipped=sk)
    covered, stale = scan(two, "test", key)
    assert [(c.start, c.consumed) for c in covered] == [(0, 4), (4, 4), (8, 2)] and not stale
    assert commit_shares(
        two,
        "test",
        covered,
        n_split=10,
        batch_size=4,
        root_attrs=attrs,
        classes=["a", "b"],
        dim=6,
        dtype="float32",
        samples_sha256="x",
    ) == (9, 1)
    assert not share_files(two, "test")
    a, b = cache.read_split(one, "test"), cache.read_split(two, "test")
    assert torch.equal(a.features, b.features) and torch.equal(a.raw_mean, b.raw_mean) and a.paths == b.paths
    import h5py as _h5

    def skipped(f):
        return [s.decode() if isinstance(s, bytes) else str(s) for s in f["test"].attrs["skipped"]]

    with _h5.File(one) as fa, _h5.File(two) as fb:
        assert skipped(fa) == skipped(fb) == ["img5.png"]
        assert fa["test"].attrs["n_skipped"] == fb["test"].attrs["n_skipped"] == 1


# --------------------------------------------------------------------------- a stop by a signal


def test_torchrun_train_stopped_by_sigterm_continues_to_the_weights_of_a_whole_run(tmp_path):
    """SIGTERM as a scheduler sends it, to torchrun and to its ranks (torchrun starts each rank in
    a session of its own and passes the signal on too, so each rank gets it twice), in epoch 2 of 3:
    both ranks stop at the same step with status 143 and rank 0's one line, epoch 1 is kept and
    nothing else is written; torchrun itself ends with status 1 and its own traceback (its agent
    re-raises the signal as an exception, whatever the ranks' codes). The same command then ends
    with the weights of an uninterrupted run."""
    import signal
    import time

    from _signals import _SLOW_FROM

    _images.write_folder(tmp_path / "data", {"train": 3, "val": 2}, 4, size=16, splits=("train", "val"))
    args = ["train", "--dataset", "folder", "--data-root", "data", "--backbone", "conv4_64", "--recipe", "simple"]
    args += ["--epochs", "3", "--batch-size", "6", "--image-size", "16", "--augment", "crop", "--val-every", "0"]
    args += ["--workers", "0", "--device", "cpu", "--progress", "plain", "--progress-interval", "0.01"]
    # rank 0 slows down from its 3rd progress update (epoch 2, step 1) and says so; every rank
    # writes down its exit status, which torchrun does not pass on
    (tmp_path / "slow.py").write_text(
        _SLOW_FROM.format(at=3, stage="")
        + "import os\nfrom poodle.cli.main import cli\ntry:\n    cli(prog_name='poodle')\n"
        + "except SystemExit as e:\n    pathlib.Path(f\"rank{os.environ['RANK']}.exit\").write_text(str(e.code))\n"
        + "    raise\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POODLE_DIST_TIMEOUT": "120", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "slow.py"]
    p = subprocess.Popen(
        [*cmd, *args, "--out", "cut"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + TIMEOUT
    while not (tmp_path / "at").exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()[1][-3000:]
    ranks = [int(c) for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    assert len(ranks) == 2 and all(os.getpgid(r) == r for r in ranks)  # each in a group of its own
    for group in (p.pid, *ranks):
        os.killpg(group, signal.SIGTERM)
    _, err = p.communicate(timeout=TIMEOUT)

    assert p.returncode == 1 and err.count("Traceback") == 1, err[-3000:]
    assert "SignalException: Process" in err.split("Traceback")[1]  # torchrun's, none from a rank
    assert [(tmp_path / f"rank{r}.exit").read_text() for r in (0, 1)] == ["143", "143"]
    stopped = [ln for ln in err.splitlines() if ln.startswith("stopped by")]
    assert stopped == [
        "stopped by SIGTERM: kept epoch 1/3 (finished) in cut/last.pt; continue with: the same torchrun "
        f"command (... poodle {' '.join(args)} --out cut)"
    ], err[-3000:]
    assert sorted(f.name for f in (tmp_path / "cut").iterdir()) == ["last.pt"]
    assert torch.load(tmp_path / "cut" / "last.pt", weights_only=True)["epoch"] == 1
    assert not [f for f in tmp_path.rglob("*") if f.name.endswith(".lock") or ".tmp" in f.name]

    # the printed command, and an uninterrupted run, in one launch
    r = torchrun(
        json.dumps([[*args, "--out", "cut"], [*args, "--out", "whole"]]),
        cwd=tmp_path,
        script=str(Path(__file__).with_name("_dist_driver.py")),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at epoch 2/3" in r.stderr
    cut, whole = (torch.load(tmp_path / d / "last.pt", weights_only=True) for d in ("cut", "whole"))
    assert cut["epoch"] == whole["epoch"] == 3
    for k, v in whole["state_dict"].items():
        assert torch.equal(cut["state_dict"][k], v), k
