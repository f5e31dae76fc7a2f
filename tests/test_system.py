"""Which arithmetic ran, said everywhere it matters: each results record's ``formulation`` (provenance,
outside the identity: keys of records written before it existed are unchanged, and those files
still read), the solve summary's ``arithmetic:`` line with the kernel's one notice, and
``poodle info --system`` (poodle.system) with what a bug report needs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from poodle.cache import write_arrays
from poodle.pipeline import RunOptions, run_cells
from poodle.results import IDENTITY_FIELDS, ResultsFile, identity_key, read_results
from poodle.solve import solve
from poodle.solvers import _native
from poodle.system import formulations, system_info

CPU = RunOptions(device="cpu")


@pytest.fixture
def cache(tmp_path, make_features):
    xtr, ytr = make_features(10, 20, 16, seed=1)
    xte, yte = make_features(8, 20, 16, seed=2, spread=0.5)
    return write_arrays(
        tmp_path / "c.h5",
        {"train": (xtr, ytr, [f"b{i}" for i in range(10)]), "test": (xte, yte, [f"t{i}" for i in range(8)])},
    )


def test_records_say_which_arithmetic_ran_outside_their_identity(cache, tmp_path):
    out = tmp_path / "r.jsonl"
    methods = ["proto", "poodle", "alpha-tim"]
    res = solve(cache, methods, options={m: {"steps": 3} for m in methods[1:]}, episodes=4, n_neg=5, out=out, run=CPU)
    got = {r["label"]: r["formulation"] for r in res.records}
    st = _native.state()
    assert got["proto"] == "torch"  # no fit of the engine
    assert got["poodle"] == (f"kernel {st.source_hash[:12]}" if st.loaded else f"torch ({st.reason})")
    assert got["alpha-tim"] == got["poodle"]  # the alpha loss is in the fused kernel too
    assert formulations(res.records) == f"proto: torch; poodle, alpha-tim: {got['poodle']}"
    for r in res.records:
        identity = {k: r[k] for k in IDENTITY_FIELDS if k in r}
        assert r["key"] == identity_key(identity) == identity_key({**identity, "formulation": "anything"})
    # a file written before the field existed: its records read, keep their keys and are found again
    lines = out.read_text().splitlines()
    old = [json.loads(line) for line in lines]
    for r in old[1:]:
        del r["formulation"]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    records = read_results(out).records
    assert [r["key"] for r in records] == [r["key"] for r in res.records]
    assert formulations(records) == "proto, poodle, alpha-tim: not recorded"
    again = run_cells(res.cells, out=out, options=CPU)
    assert again.computed == 0 and len(ResultsFile(out).records) == 3


def test_solve_says_the_arithmetic_and_the_refused_kernel_once(cache, tmp_path, monkeypatch):
    from poodle.cli.solve import solve as solve_cmd

    if _native._compiler() is None:
        pytest.skip("no C compiler: the kernel is not refused but absent")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_state", None)
    monkeypatch.setenv("POODLE_NATIVE_DIR", str(shared))
    args = ["--cache", cache, "--episodes", 6, "--method", "poodle", "--method", "ce", "--steps", 3, "--n-neg", 5]
    r = CliRunner().invoke(solve_cmd, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    assert r.output.count("note: the fused kernel is not loaded: directory") == 1
    assert f"{shared} is writable by group or others (mode 0777)" in r.output
    reason = f"torch (not loaded: directory {shared} is writable by group or others (mode 0777))"
    assert f"arithmetic: poodle, ce: {reason}" in r.output
    assert not list(shared.iterdir())


def test_info_system_prints_what_a_bug_report_needs():
    from poodle.cli.info import info

    facts = system_info()
    assert set(facts) == {"versions", "BLAS", "threads and workers", "devices", "fused CPU kernel"}
    assert {"poodle", "python", "torch", "numpy", "h5py"} <= set(facts["versions"])
    assert {"state", "compiler", "flags", "directory", "source sha256"} <= set(facts["fused CPU kernel"])
    r = CliRunner().invoke(info, ["--system"])
    assert r.exit_code == 0, r.output
    import h5py
    import numpy
    import torch

    st = _native.state()
    for text in (
        f"torch: {torch.__version__}",
        f"numpy: {numpy.__version__}",
        f"h5py: {h5py.version.version}",
        "BLAS",
        f"torch intra-op threads: {torch.get_num_threads()}",
        f"CUDA available: {torch.cuda.is_available()}",
        "state: loaded" if st.loaded else f"state: not loaded: {st.reason}",
        f"directory: {st.directory}",
        f"source sha256: {st.source_hash}",
    ):
        assert text in r.output, text
    r = CliRunner().invoke(info, [])
    assert r.exit_code == 2 and "give a feature cache FILE, or --system" in r.output


def test_default_workers_follow_the_cores_the_process_may_use(tmp_path, monkeypatch):
    """Affinity and a cgroup CPU limit (v2 ``cpu.max``, v1 quota/period) bound the default worker
    counts; torchrun's processes on a node share them; ``info --system`` prints them."""
    import os

    from poodle import system

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert system._cgroup_cpus(str(v2)) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert system._cgroup_cpus(str(v2)) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert system._cgroup_cpus(str(tmp_path / "v1")) == 3.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert system._cgroup_cpus(str(tmp_path / "v1")) is None

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(system, "_cgroup_cpus", lambda: 2.5)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert system.usable_cpus() == 3
    assert system.default_workers(8) == 3 and system.default_workers(2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert system.default_workers(8) == 1
    monkeypatch.setattr(system, "_cgroup_cpus", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert system.usable_cpus() == 6 and system.default_workers(4) == 4
    from poodle.extract import default_workers
    from poodle.train import TrainConfig

    assert default_workers() == 6
    assert TrainConfig(dataset="glyphs", backbone="conv4_64").workers == 4
    assert TrainConfig(dataset="glyphs", backbone="conv4_64", workers=0).workers == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert TrainConfig(dataset="glyphs", backbone="conv4_64").workers == 2

    from poodle.cli.info import info

    r = CliRunner().invoke(info, ["--system"])
    assert r.exit_code == 0, r.output
    for text in ("usable CPUs: 2", "train DataLoader workers (default): 2", "extract DataLoader workers (default): 2"):
        assert text in r.output, text


def test_timings_say_what_they_are(cache, tmp_path):
    """Methods solved by one call on two chunk workers: each record's ``worker_seconds`` is its solve
    time summed over the workers (``seconds`` keeps that meaning), ``wall_seconds_share`` its share
    of the call's wall time; the summary's ``wall s`` column shows the share and a line says so."""
    from poodle.cli.solve import solve as solve_cmd
    from poodle.report import solve_table, timing_note

    methods = ["proto", "poodle"]
    res = solve(
        cache,
        methods,
        options={"poodle": {"steps": 5}},
        episodes=12,
        n_neg=5,
        run=RunOptions("cpu", workers=2, chunk_size=4),
    )
    recs = res.records
    assert [(r["workers"], r["call_cells"]) for r in recs] == [(2, 2)] * 2
    assert all(r["worker_seconds"] == round(r["seconds"], 4) for r in recs)
    wall = recs[0]["call_seconds"]
    assert sum(r["wall_seconds_share"] for r in recs) == pytest.approx(wall, abs=1e-3)
    summed = sum(r["worker_seconds"] for r in recs)
    for r in recs:
        assert r["wall_seconds_share"] == pytest.approx(wall * r["worker_seconds"] / summed, abs=1e-3)
    table = solve_table(recs)
    assert table.extra[2] == ("wall s", [f"{r['wall_seconds_share']:.1f}" for r in recs])
    note = timing_note(recs)
    assert note is not None and f"{wall:.1f} s wall time of the one call that solved all 2 methods" in note
    assert "summed over 2 worker threads" in note
    assert timing_note(recs[:1]) is None
    args = ["--cache", cache, "--episodes", 6, "--method", "proto", "--method", "ce", "--steps", 3, "--n-neg", 5]
    r = CliRunner().invoke(solve_cmd, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    assert "wall s" in r.output and "wall s: each method's share of the" in r.output
    assert " s wall, chunks of " in r.output
