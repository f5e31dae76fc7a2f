"""benchmarks/gpu.py, the GPU check, run end to end on the CPU (--device cpu --quick): every section
runs, the report has each section and the summary's numbers, and agreements are complete; a failing
section is reported in place while the others still run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
SECTIONS = [
    "## 1. Environment",
    "## 2. Tests on the device",
    "## 3. poodle solve end to end",
    "## 4. Solver benchmark",
    "## 5. CPU versus device, per episode",
    "## 6. Every method on the device, and the cost model",
    "## 7. Extraction throughput",
    "## 8. torchrun, one process per GPU",
]


def _summary(text: str) -> dict[str, str]:
    block = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [ln.strip("| ").split(" | ") for ln in block.splitlines() if ln.startswith("| ") and " | " in ln]
    return {k: v for k, v in rows[1:]}


def test_gpu_check_on_the_cpu(tmp_path):
    out = tmp_path / "report.md"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions) and "FAILED" not in text
    s = _summary(text)
    assert s["sections failed"] == "none"
    assert s["device"].startswith("cpu")
    assert re.fullmatch(r"1 passed, \d+ deselected in [\d.]+s", s["tests"])
    assert (
        float(s["poodle solve 20 episodes, whole process (s)"])
        > float(s["poodle solve 20 episodes, solve only (s)"])
        > 0
    )
    assert float(s["solver benchmark, POODLE 1-shot (episodes/s)"]) > 0
    assert s["CPU vs device, episodes identical (all methods)"] == "18/18"  # 3 methods x 6 episodes
    assert int(s["methods timed on the device"]) == 3
    assert float(s["POODLE transductive on the device (episodes/s)"].replace(",", "")) > 0
    assert float(s["extraction (images/s)"].replace(",", "")) > 0
    assert s["torchrun (gloo) vs one process, episodes identical"] == "8/8"
    for package in ("torch", "torchvision", "h5py", "click", "rich", "timm"):
        assert re.search(rf"^- {package} \d", text, flags=re.M), package
    # the cost model's tables, with the measured rate beside the predictions
    assert re.search(r"^\| poodle \| 250 \| 3\.0\d\d \| 76\d\.\d \|", text, flags=re.M)
    assert re.search(r"^\| poodle \| 480 \| 3\.0\d\d \| 1\.345 \| 2\.2\dx \|", text, flags=re.M)


def test_a_failing_section_is_reported_and_the_rest_run():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rep = mod.Report()
    rep.run("A", lambda: 1 / 0)
    rep.run("B", lambda: rep.number("b", 2))
    text = rep.markdown("# x\n")
    assert rep.failed == ["A"]
    assert "**FAILED**: `ZeroDivisionError" in text and "## B" in text and "| b | 2 |" in text
    assert "| sections failed | A |" in text
