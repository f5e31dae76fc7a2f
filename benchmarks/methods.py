"""Every iterative method in one table: our batched speed, its share of the matmul rate and of its own
floor, and the authors' release on the same episodes.

One run does two things and joins them per method:

* the roofline (``benchmarks/transductive.py --roofline``, standard workload only: D=640, 5-way
  1-shot, 15 queries per class, one thread on the chunk ``evaluate`` picks): episodes/s, the
  registered FLOPs per episode, GFLOP/s and their share of a large matmul measured in the same run;
  below 40% the line under the table names what limits the method, from the roofline's per-episode
  floors (compute, traced bytes at the pass bandwidth, operations x one operation's cost) and, for
  the Sinkhorn methods, the share of the time in their sweeps; beside it, each method's own floor
  (``benchmarks/floors.py``: its products at the rate of a batched matmul of their shape, LAPACK
  ``eigh`` of its matrix, its Sinkhorn sweeps at a plain C loop's speed on an L1-resident plan, a
  pass over its rows; from the facts its ``@register`` declares), the part that binds and ep/s as a
  share of that floor;
* the release comparison (``benchmarks/compare_official.py``, ``--synthetic standard-nonneg``: the
  standard workload's features shifted non-negative so that the power transforms of PT-MAP, BMS and
  protoLP are defined): ``poodle solve`` as a whole process on ``--episodes`` episodes against the
  release's own evaluation loop on the first ``--their-episodes`` of them; per-episode agreement
  (episodes with identical accuracy / compared) and the speed ratio. Without checkouts the release
  columns say so and the exit status stays 0.

    python benchmarks/methods.py --checkouts /tmp/ext --episodes 2000 \\
        --their-episodes alpha-tim=20 --their-episodes tim-gd=200 --their-episodes 400
    python benchmarks/methods.py --no-releases            # the roofline columns only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_official  # noqa: E402
import transductive  # noqa: E402

# (label, method): every method that iterates, and POODLE for reference
METHODS = [
    ("alpha-TIM", "alpha-tim"),
    ("TIM-GD", "tim-gd"),
    ("TIM-ADM", "tim-adm"),
    ("entropy-min", "entropy-min"),
    ("PADDLE", "paddle"),
    ("PT-MAP", "pt-map"),
    ("PEMnE-BMS", "bms"),
    ("protoLP", "proto-lp"),
    ("LaplacianShot", "laplacianshot"),
    ("k-means", "kmeans"),
    ("soft k-means", "soft-kmeans"),
    ("Bayes k-means (TAFSSL)", "bayes-kmeans"),
    ("mean-shift (TAFSSL)", "mean-shift"),
    ("POODLE (transductive, no negatives; reference)", "poodle"),
]
OPTIONS = {"poodle": {"transductive": True}}
TARGET = 0.40
FLOOR_TARGET = 0.50  # of the method's own floor (issue: every iterative method at least half of it)


def limit(r: dict[str, Any]) -> str:
    """What stops a method below :data:`TARGET` of the matmul rate, in the roofline's own numbers
    (per episode, CPU time): the largest floor and how much of the measured time it explains."""
    us = 1e6 / r["eps_per_s_cpu"]
    fl = r["floors_us"]
    floors = f"floors compute {fl['compute']:.0f} / memory {fl['memory']:.0f} / ops {fl['ops']:.0f} us of {us:.0f} us"
    if r.get("sweep_share", 0.0) > 0.5:
        return (
            f"Sinkhorn sweeps, memory/latency-bound: {100 * r['sweep_share']:.0f}% of the time, "
            f"{r['sweeps_per_episode']:.0f} sweeps/episode at {r['sweep_us']:.2f} us each vs {r['bound_us']:.2f} us "
            f"at the pass bandwidth ({floors})"
        )
    big = max(fl, key=fl.get)
    if big == "ops" and fl["ops"] >= 0.3 * us:
        return f"op-count bound: {r['ops_per_call']:,} torch operations per call ({floors})"
    if big == "memory" and fl["memory"] >= 0.3 * us:
        return f"memory-bound: traced bytes at the pass bandwidth ({floors})"
    return f"small operand shapes (no floor explains the time: {floors})"


def roofline(args: argparse.Namespace) -> dict[str, Any]:
    """``transductive.run_roofline`` on the standard workload, 1-shot, every method of :data:`METHODS`."""
    ns = argparse.Namespace(
        methods=",".join(m for _, m in METHODS if m in args.methods), shots=[1], tp_seconds=args.tp_seconds,
        repeats=args.repeats, roofline_clock=args.clock, roofline_chunk=args.chunk, roofline_cache=None,
        roofline_standard_only=True, roofline_options=OPTIONS,
    )  # fmt: skip
    return transductive.run_roofline(ns)


def releases(args: argparse.Namespace) -> list[dict]:
    """``compare_official.run_all`` on the standard workload's non-negative features (nothing
    without checkouts: every release is skipped with a message)."""
    argv = ["--synthetic", "standard-nonneg", "--episodes", str(args.episodes), "--seed", str(args.seed)]
    argv += [f"--checkout={c}" for c in args.checkout] + [f"--their-episodes={n}" for n in args.their_episodes]
    argv += ["--checkouts", args.checkouts] if args.checkouts else []
    argv += [] if args.self_check else ["--no-self-check"]
    argv += [f"--method={m}" for m in compare_official.METHODS if m in args.methods]
    a = compare_official.parse(argv)
    found = {r.method for r in compare_official.RELEASES if compare_official.checkout_for(r.method, r.repo, a)}
    for m in a.method:
        if m not in found:
            env = "POODLE_OFFICIAL_" + m.upper().replace("-", "_")
            print(f"{m}: skipped (give --checkout {m}=PATH, {env} or --checkouts DIR)", flush=True)
    a.method = [m for m in a.method if m in found]
    if not a.method:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        cache = compare_official.write_synthetic(a.synthetic, Path(tmp), a.dim, a.seed)
        return compare_official.run_all(a, cache, compare_official.episode_file(a, cache, Path(tmp)))


def _input(row: dict) -> str:
    """What tells a method's release rows apart: the note, and "on our L2N rows" for ``--l2n-too``
    style rows (the release fed poodle's L2-normalised rows instead of its own input)."""
    return ", ".join(([row["note"]] if row["note"] else []) + (["on our L2N rows"] if row["kind"] == "l2n" else []))


def _itself(row: dict) -> str:
    """The release against itself on rows one ulp away, where it was rerun (it differed from ours)."""
    return f" [release vs itself, rows one ulp away: {row['itself']}/{row['n']}]" if "itself" in row else ""


def release_cells(method: str, theirs: list[dict], compared: bool) -> list[str]:
    """Ours whole process, the release's episodes/s, the ratio (from the method's first release
    row: the release's own setting) and every release row's agreement; or why there is none."""
    if not theirs:
        why = "skipped (no checkout)" if compared else "not run"
        return ["-", "-", "-", why if method in compare_official.METHODS else "no release"]
    t = theirs[0]
    agree = "; ".join(
        f"{x['identical']}/{x['n']}" + (f" ({how})" if (how := _input(x)) else "") + _itself(x) for x in theirs
    )
    return [f"{t['ours_eps']:.1f}", f"{t['their_eps']:.3g}", f"{t['ratio']:.1f}x", agree]


def table(rf: dict[str, Any], rel: list[dict], compared: bool) -> str:
    """One Markdown row per method: the roofline's columns, then its release's (the first release
    row of a method gives the speed; every row's agreement is listed), then the notes below 40%."""
    mm = rf["matmul_flops_cpu"] if rf["sweep_clock"] == "cpu" else rf["matmul_flops"]
    eps, fps = ("eps_per_s_cpu", "flop_per_s_cpu") if rf["sweep_clock"] == "cpu" else ("eps_per_s", "flop_per_s")
    lines = [
        "| method | ours ep/s (batched, 1 thread) | MFLOP/episode | GFLOP/s | % of matmul | own floor us/episode "
        "(binds) | % of own floor | ours ep/s (`poodle solve`, whole process) | release ep/s | ours / release "
        "| identical accuracy (release) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    parts: list[str] = []
    notes: list[str] = []
    over: list[str] = []
    rows = {r["method"]: r for r in rf["rows"]}
    for label, m in METHODS:
        if m not in rows:
            continue
        r, theirs = rows[m], [x for x in rel if x["method"] == m]
        pct = r[fps] / mm
        mflop = f"{r['flops_per_episode'] / 1e6:.2f}"
        mflop += f" (at {r['iterations']:.1f} iterations)" if r.get("iterations") is not None else ""
        cells = [label, f"{r[eps]:.1f}", mflop, f"{r[fps] / 1e9:.2f}"]
        cells.append(f"**{100 * pct:.1f}%**" if pct >= TARGET else f"{100 * pct:.1f}%")
        cells += own_floor_cells(r)
        if "floor" in r:
            parts.append(f"- {label}: {transductive.floors.describe(r['floor'])}")
        cells += release_cells(m, theirs, compared)
        lines.append("| " + " | ".join(cells) + " |")
        if pct < TARGET:
            notes.append(f"- {label}: {limit(r)}")
        elif pct > 1:
            over.append(label)
    head = f"Below {100 * TARGET:.0f}% of the matmul rate, the limit (the roofline's floors per episode, CPU time):"
    if over:
        notes += [
            "",
            f"Above 100% ({', '.join(over)}): the registered FLOPs count more arithmetic than the CPU code does "
            "(e.g. a backward pass counted at 2x the forward where only the weights' gradient is formed).",
        ]
    own = [
        "",
        "Own floor per episode (benchmarks/floors.py; max(memory, matmul + eigh + sweeps), each part timed "
        f"in this run by a micro-benchmark that is not the method's code; from {100 * FLOOR_TARGET:.0f}% in bold):",
        "",
    ]
    return "\n".join(lines + ["", head, ""] + notes + (own + parts if parts else []))


def own_floor_cells(r: dict[str, Any]) -> list[str]:
    """The method's own floor per episode, the part that binds, and ep/s as a share of that floor
    (the floor's time over the measured time, on the roofline's clock); ``-`` without one."""
    if "floor" not in r:
        return ["-", "-"]
    fl = r["floor"]
    share = f"{100 * fl['share']:.1f}%"
    return [f"{fl['floor_us']:.0f} ({fl['binds']})", f"**{share}**" if fl["share"] >= FLOOR_TARGET else share]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(m for _, m in METHODS), help="comma-separated (default: all)")
    compare_official.add_release_options(ap)
    ap.add_argument("--no-releases", action="store_true", help="the roofline columns only")
    ap.add_argument("--episodes", type=int, default=2000, help="episodes of the release comparison (ours)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=0, help="roofline episodes per call (0: the chunk evaluate picks)")
    ap.add_argument("--tp-seconds", type=float, default=1.0, help="roofline: minimum work per timing")
    ap.add_argument("--repeats", type=int, default=3, help="roofline timings: best of N")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="the roofline's clock")
    a = ap.parse_args(argv)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    rf = roofline(a)
    rel = [] if a.no_releases else releases(a)
    print(f"\n{table(rf, rel, not a.no_releases)}")
    mm = rf["matmul_flops_cpu" if rf["sweep_clock"] == "cpu" else "matmul_flops"]
    print(
        f"\nMatmul (1024^3 float32, 1 thread, {rf['sweep_clock']} clock): {mm / 1e9:.1f} GFLOP/s; "
        f"{time.perf_counter() - t0:.0f} s in all"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
