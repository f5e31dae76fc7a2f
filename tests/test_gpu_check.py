"""benchmarks/gpu.py, the GPU check, on the CPU.

- The README's prepared command, exactly as typed there (and in docs/gpu.md), runs here with
  ``--device cpu --budget 60`` appended: it ends within 75 s and every section is reported (done, or
  stopped at the budget's deadline) or listed as skipped, the Markdown and the JSON holding the same
  numbers, and the printed summary fits a screen.
- Stopped from outside mid-run (SIGTERM, then SIGKILL if it lingers) while a child is running, the
  check leaves its report with every section finished before and none of its processes running.
- A child's process tree dies with the check even when the check is killed with SIGKILL, a
  grandchild in a session of its own too (torchrun's workers start one).
- A failing section is reported in place and the next one still runs; a section past the budget's
  end is stopped at it; a share's end cuts only the work inside it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
NAMES = ["environment", "solve", "agreement", "triton", "methods", "tests", "benchmark", "extraction", "torchrun"]
INSTALL = "python3 -m pip install -q --no-deps --no-build-isolation -e ."


def _prepared_command() -> str:
    """The one-line command of the README's GPU-check section (the same line must be in docs/gpu.md)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("### The GPU check", 1)[1].split("\n## ", 1)[0]
    lines = [ln.strip() for ln in section.splitlines() if ln.startswith("    ") and "benchmarks/gpu.py" in ln]
    assert len(lines) == 1, lines
    assert lines[0] in (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8"), "docs/gpu.md has another command"
    return lines[0]


def _marked(mark: str) -> list[int]:
    """The processes whose environment carries ``mark`` (every process the check started, orphans too)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark.encode() in (d / "environ").read_bytes():
                    stat = (d / "stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] != "Z":  # a zombie has stopped running
                        pids.append(int(d.name))
            except OSError:
                pass
    return pids


def _none_left(mark: str, seconds: float = 10.0) -> list[int]:
    end = time.monotonic() + seconds
    while (left := _marked(mark)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def _env(mark: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if mark:
        env["GPU_CHECK_TEST_MARK"] = mark
    return env


def test_the_prepared_command_runs_on_the_cpu_within_its_budget(gpu, tmp_path):
    install, run = _prepared_command().split(" && ")
    assert install == INSTALL
    words = shlex.split(run)
    assert words[:2] == ["python3", "benchmarks/gpu.py"] and "--device" not in words
    env = {**_env(), "OUT": str(tmp_path)}
    t = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", run + " --device cpu --budget 60"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    wall = time.monotonic() - t
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert wall <= 75, f"{wall:.1f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-report.json", "gpu-report.md"]
    rep = json.loads((tmp_path / "gpu-report.json").read_text())
    md = (tmp_path / "gpu-report.md").read_text()
    assert rep["finished"] and rep["budget_s"] == 60 and rep["used_s"] < wall
    secs = {s["name"]: s for s in rep["sections"]}
    assert [s["name"] for s in rep["sections"]] == NAMES
    for name, s in secs.items():
        assert s["status"] in ("done", "stopped", "skipped"), (name, s["status"], s["reason"])
        if s["status"] == "skipped":
            assert s["reason"].startswith("budget spent: "), s
        else:
            assert f"(`{name}`)" in md
        # the Markdown's summary row has the section's status and every headline number, as in the JSON
        row = next(ln for ln in md.splitlines() if ln.startswith(f"| {name} | "))
        assert row.startswith(f"| {name} | {s['status']}")
        for k in s["headline"]:
            assert f"{k}: {gpu._fmt(s['numbers'][k])}" in row, (k, row)
    # the most valuable sections fit in any budget; once one is skipped for time, so are all after it
    assert secs["environment"]["status"] == secs["solve"]["status"] == "done"
    statuses = [s["status"] for s in rep["sections"]]
    if "skipped" in statuses:
        assert set(statuses[statuses.index("skipped") :]) == {"skipped"}
    solve = secs["solve"]["numbers"]
    assert solve["whole process (s)"] > solve["solve only (s)"] > 0 and solve["episodes"] >= 10
    if secs["agreement"]["status"] == "done":  # on a CPU: the fused kernel against the torch formulation
        per = secs["agreement"]["data"]["per_method"]
        # float32 rounding decides the near-ties of these random-feature episodes (CE's 250 Adam steps
        # leave kernel and torch 5e-4 apart in probability: about a third of its episodes move one
        # query), so a method agrees on most episodes and by at most a few queries, never wholesale
        assert per and all(r["identical"] >= 0.5 * r["episodes"] and r["max_acc_diff"] <= 0.1 for r in per.values()), (
            per
        )
        assert per["poodle"]["identical"] == per["poodle"]["episodes"], per["poodle"]
    assert "- torch 2" in md and "- h5py 3" in md
    # a one-screen summary after every section that ran, and at the end
    summaries = done.stdout.split("== GPU check on cpu: ")
    ran = sum(s["status"] != "skipped" for s in rep["sections"])
    assert len(summaries) - 1 == ran + 1
    assert len(summaries[-1]) < 6000 and "finished; report" in summaries[-1]


def test_stopped_from_outside_it_keeps_every_finished_section_and_leaves_no_process(tmp_path):
    mark = uuid.uuid4().hex
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--budget", "120", "--out-dir", str(tmp_path)]
    cmd += ["--episodes", "10", "--skip", "solve,agreement,triton,methods,tests,benchmark,extraction"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(mark), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = []
        for line in proc.stdout:  # type: ignore[union-attr]
            out.append(line)
            if line.startswith("gpu check: torchrun"):
                break
        # the torchrun child (the shim and the launcher, which starts a worker) is under way
        end = time.monotonic() + 60
        while len(_marked(mark)) < 3 and time.monotonic() < end:
            time.sleep(0.1)
        assert len(_marked(mark)) >= 3, "".join(out)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rest = proc.stdout.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, "".join(out) + rest
    assert _none_left(mark) == []
    rep = json.loads((tmp_path / "gpu-report.json").read_text())
    secs = {s["name"]: s for s in rep["sections"]}
    assert rep["stopped"] == "SIGTERM from outside" and not rep["finished"]
    assert secs["environment"]["status"] == "done" and secs["environment"]["numbers"]["packages missing"] == "none"
    assert secs["torchrun"]["status"] == "stopped" and secs["torchrun"]["reason"] == "SIGTERM from outside"
    assert all(secs[n]["status"] == "skipped" for n in NAMES[1:-1])
    md = (tmp_path / "gpu-report.md").read_text()
    assert "(`environment`)" in md and "- torch 2" in md and "its process group killed" in md
    assert "stopped: SIGTERM from outside" in rest


def test_a_childs_process_group_dies_with_a_killed_check():
    """The check killed with SIGKILL cannot clean up: the shim under each child does, also for a
    descendant that left the child's process group."""
    tree = ast.parse(SCRIPT.read_text(encoding="utf-8"))
    shim = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SHIM"
    )
    mark = uuid.uuid4().hex
    # the grandchild starts a session of its own, as torchrun's workers do: out of its group's reach
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
    sleeper += "start_new_session=True); time.sleep(60)"
    check = f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {shim!r}, str(os.getpid()), "
    check += f"sys.executable, '-c', {sleeper!r}]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", check], env=_env(mark))
    try:
        end = time.monotonic() + 20
        while len(_marked(mark)) < 4 and time.monotonic() < end:  # the check, the shim, a child, a grandchild
            time.sleep(0.1)
        assert len(_marked(mark)) == 4
        proc.kill()
        proc.wait()
        assert _none_left(mark) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _sections(gpu, *fns):
    return [gpu.Section(f"s{i}", f"S{i}", fn, 1.0, 0.0) for i, fn in enumerate(fns)]


def test_a_failing_section_is_reported_and_the_next_one_runs(gpu, tmp_path):
    ctx = types.SimpleNamespace(budget=gpu.Budget(1e6))
    secs = _sections(gpu, lambda s, c: 1 / 0, lambda s, c: s.number("b", 2))
    rep = gpu.Report(secs, tmp_path / "r.md", tmp_path / "r.json", ctx.budget, "cpu")
    assert gpu._run_section(secs[0], ctx, secs) and gpu._run_section(secs[1], ctx, secs[1:])
    rep.write()
    text = (tmp_path / "r.md").read_text()
    assert [s.status for s in secs] == ["failed", "done"]
    assert "**FAILED**: `ZeroDivisionError" in text and "| s1 | done | " in text and "b: 2" in text
    assert "Sections failed: s0." in text
    assert json.loads((tmp_path / "r.json").read_text())["sections"][1]["numbers"] == {"b": 2}


def test_a_section_is_stopped_at_the_budgets_end_and_a_share_cuts_only_its_work(gpu):
    ctx = types.SimpleNamespace(budget=gpu.Budget(1e6))
    ctx.budget.end = time.monotonic() + 0.5
    log = []

    def work(sec, c):
        with gpu._share(c, 0.1) as cut:
            time.sleep(5)
        log.append(("cut", cut[0]))
        time.sleep(5)  # past the budget's end
        log.append("not reached")

    secs = _sections(gpu, work, lambda s, c: None)
    secs[1].min_s = 1.0
    t = time.monotonic()
    gpu._run_section(secs[0], ctx, secs)
    assert time.monotonic() - t < 1.5
    assert log == [("cut", True)]
    assert secs[0].status == "stopped" and "deadline" in secs[0].reason
    assert not gpu._run_section(secs[1], ctx, secs[1:])
    assert secs[1].status == "skipped" and secs[1].reason.startswith("budget spent")


def test_once_a_section_is_skipped_for_time_every_one_after_it_is(gpu, tmp_path):
    """The sections come in order of value: a cheaper one after a section that did not fit is skipped
    too, not run in its place (it ran when its own minimum still fitted the time left)."""
    ctx = types.SimpleNamespace(budget=gpu.Budget(1e6))  # counted from the module's import
    ran = []
    secs = _sections(gpu, lambda s, c: ran.append(0), lambda s, c: ran.append(1), lambda s, c: ran.append(2))
    secs[1].min_s = 1e9  # cannot fit; s2 (no minimum) could
    rep = gpu.Report(secs, tmp_path / "r.md", tmp_path / "r.json", ctx.budget, "cpu")
    gpu._run_sections(secs, ctx, rep)
    assert ran == [0] and [s.status for s in secs] == ["done", "skipped", "skipped"]
    assert secs[1].reason.startswith("budget spent: ") and secs[2].reason == "budget spent: s1, before it, did not fit"


def test_skip_takes_the_sections_names(gpu, capsys):
    assert [s[0] for s in gpu.SECTIONS] == NAMES
    with pytest.raises(SystemExit):
        gpu._parse(["--skip", "solve,7"])
    assert "no section named 7" in capsys.readouterr().err
    assert gpu._parse(["--skip", "solve, torchrun"]).skip == {"solve", "torchrun"}


def test_the_summary_stays_on_one_screen(gpu, tmp_path):
    secs = _sections(gpu, *[lambda s, c: None] * 9)
    for s in secs:
        for i in range(40):
            s.number(f"number {i} " + "x" * 50, "y" * 300)
    rep = gpu.Report(secs, tmp_path / "r.md", tmp_path / "r.json", gpu.Budget(60), "cpu")
    text = rep.summary()
    assert len(text) <= gpu.SUMMARY_LIMIT < 12_000 and text.endswith("...")
    assert re.match(r"== GPU check on cpu: \d+ s of 60 s, in progress", text)
