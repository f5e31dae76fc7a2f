"""Peak memory of a whole `poodle solve` process against the number of episodes.

The engine issue's check: `poodle solve --method poodle --transductive --steps 5 --n-neg 400
--max-memory 512MiB --device cpu` on a cache of 38,400 train rows (the negative pool) and 12,000
test rows, D = 640, at 2,000 and at 20,000 episodes, for the default workers and ``--workers 1`` and
``2``. Each run is a fresh process; its peak RSS is the kernel's ``ru_maxrss`` for that child
(``os.wait4``), so nothing else on the machine is counted. The target: the 20,000-episode peak within
1.25x of the 2,000-episode one and under 1.5 GiB.

    python benchmarks/memory.py                      # about a minute on 2 cores
    python benchmarks/memory.py --episodes 2000,20000,50000 --workers default,1,2
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

D = 640


def features(n_classes: int, per_class: int, seed: int):  # -> (np.ndarray [N, D], np.ndarray [N])
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_classes, D)).astype(np.float32)
    x = np.repeat(centres, per_class, 0) + 0.8 * rng.standard_normal((n_classes * per_class, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, np.repeat(np.arange(n_classes), per_class)


def peak_rss(cmd: list[str], log: Path) -> tuple[int, float]:
    """``(peak RSS in bytes, wall seconds)`` of one child process run to completion.

    Linux starts a child's ``ru_maxrss`` at its parent's high-water mark (it is kept across
    ``exec``), so this process stays small: it imports neither torch nor numpy, and the cache is
    written by a child of its own (:func:`make_cache`)."""
    t = time.perf_counter()
    with open(log, "wb"):
        pass
    actions = [
        (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_TRUNC, 0),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    pid = os.posix_spawn(cmd[0], cmd, dict(os.environ), file_actions=actions)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text()[-2000:]}")
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return usage.ru_maxrss * scale, wall


def make_cache(path: str) -> None:
    """Write the benchmark's cache and print the versions (run in a child process)."""
    import platform

    import numpy as np
    import torch

    from poodle.cache import write_arrays
    from poodle.solvers import _native

    xtr, ytr = features(64, 600, seed=1)
    xte, yte = features(20, 600, seed=2)
    write_arrays(
        Path(path),
        {"train": (xtr, ytr, [f"b{i}" for i in range(64)]), "test": (xte, yte, [f"t{i}" for i in range(20)])},
    )
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"CPUs {len(os.sched_getaffinity(0))}, solver: {_native.status()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", default="2000,20000", help="comma-separated episode counts (first: the base)")
    ap.add_argument("--workers", default="default,1,2", help="comma-separated: default or a number")
    ap.add_argument("--max-memory", default="512MiB")
    ap.add_argument("--make-cache", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_cache:
        make_cache(args.make_cache)
        return
    counts = [int(c) for c in args.episodes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "mem.h5"
        log = Path(tmp) / "log.txt"
        peak_rss([sys.executable, os.path.abspath(__file__), "--make-cache", str(cache)], log)
        print(log.read_text().strip().splitlines()[-1])
        size = cache.stat().st_size / 2**20
        print(f"cache: 38,400 train rows (the pool) + 12,000 test rows, D = {D}, {size:.0f} MiB")
        print(f"this process's own peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        # the floor under any torch program: it differs between installs of the same torch build (the
        # share of its shared libraries that is resident), so it is measured here, beside the runs
        torch_rss, _ = peak_rss([sys.executable, "-c", "import torch"], log)
        print(f"python -c 'import torch' alone: peak RSS {torch_rss / 2**20:,.0f} MiB")
        base = [sys.executable, "-m", "poodle.cli.main", "solve", "--cache", str(cache), "--method", "poodle"]
        base += ["--transductive", "--steps", "5", "--n-neg", "400", "--max-memory", args.max_memory, "--device", "cpu"]
        ok = True
        for w in args.workers.split(","):
            extra = [] if w == "default" else ["--workers", w]
            peaks = []
            for n in counts:
                rss, wall = peak_rss(base + ["--episodes", str(n)] + extra, log)
                peaks.append(rss)
                print(f"  workers {w:>7}, {n:>7,} episodes: peak RSS {rss / 2**20:7,.0f} MiB ({wall:.1f} s)")
            ratio = peaks[-1] / peaks[0]
            good = ratio <= 1.25 and max(peaks) < 1.5 * 2**30
            ok &= good
            verdict = "(ok)" if good else "(TARGET MISSED)"
            print(f"  workers {w:>7}: {counts[-1]:,} / {counts[0]:,} episodes = {ratio:.2f}x {verdict}")
        print(f"command: {' '.join(base[1:])} --episodes N [--workers W]")
        print("all within 1.25x and under 1.5 GiB" if ok else "some runs missed the target")


if __name__ == "__main__":
    main()
