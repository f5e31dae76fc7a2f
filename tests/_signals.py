"""Real signals sent to real ``poodle`` processes at chosen points of their run (import as
``import _signals`` from a test module; tests/test_preempt.py says why and how)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from poodle.cli.main import cli

# the child: from progress update AT on, each update waits a little, and the first one says so
_SLOW_FROM = """
import pathlib, time
import poodle.cli._progress as P
_update, _n = P.LineProgress.update, [0]
def update(self, *a, **k):
    if not self.tasks[a[0]].description.startswith({stage!r}):
        return _update(self, *a, **k)
    _n[0] += 1
    if _n[0] == {at}:
        pathlib.Path("at").touch()
    if _n[0] >= {at}:
        time.sleep(0.2)
    return _update(self, *a, **k)
P.LineProgress.update = update
"""


# chunks of 4 episodes, so that a solve has many safe points (the numbers do not depend on the chunks)
SMALL_CHUNKS = "import poodle.evaluate\npoodle.evaluate.choose_chunk = lambda *a, **k: 4\n"


def interrupted(
    args: list[str], cwd: Path, at: int, sig: int, code: str = "", stage: str = "", timeout: float = 240
) -> subprocess.CompletedProcess:
    """``poodle ARGS`` in its own process group, sent ``sig`` once its progress update ``at`` came
    (counting the updates of the stages whose name starts with ``stage``; ``code`` runs first)."""
    program = (
        code + _SLOW_FROM.format(at=at, stage=stage) + "from poodle.cli.main import cli\ncli(prog_name='poodle')\n"
    )
    (cwd / "at").unlink(missing_ok=True)
    env = {**os.environ, "POODLE_NATIVE": "0", "COLUMNS": "200"}
    p = subprocess.Popen(
        [sys.executable, "-c", program, *args, "--progress", "plain", "--progress-interval", "0.01"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which the signal goes to
    )
    deadline = time.monotonic() + timeout
    while not (cwd / "at").exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, f"finished before progress update {at}: {p.stderr.read() if p.stderr else ''}"
    os.killpg(p.pid, sig)
    out, err = p.communicate(timeout=timeout)
    (cwd / "at").unlink(missing_ok=True)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def stopped_cleanly(p: subprocess.CompletedProcess, sig: int, args: list[str], root: Path) -> str:
    """Exit status 128 + sig, one ``stopped by`` line naming the command that continues, no
    traceback, no lock file and no temporary under ``root``. Returns the line."""
    assert p.returncode == 128 + sig, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("stopped by")]
    assert len(lines) == 1, p.stderr[-3000:]
    name = signal.Signals(sig).name
    assert lines[0].startswith(f"stopped by {name}: kept "), lines[0]
    assert lines[0].endswith("continue with: poodle " + " ".join(args) + " --progress plain --progress-interval 0.01")
    left = [str(f.relative_to(root)) for f in root.rglob("*") if f.name.endswith(".lock")]
    left += [str(f.relative_to(root)) for f in root.rglob("*") if re.search(r"\.\d+\.[0-9a-f]{8}\.\w+$", f.name)]
    assert not left, left
    return lines[0]


def run(args: list[str], cwd: Path) -> None:
    """``poodle ARGS`` in this process (the run to compare with, and the one that continues)."""
    before = Path.cwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(cli, args)
    finally:
        os.chdir(before)
    assert res.exit_code == 0, res.output
