"""The transductive competitors on imbalanced queries (the POODLE paper's appendix table), and their
batched throughput.

Part 1 (accuracy): every transductive method of ``poodle.solvers`` plus the inductive prototype
classifier and transductive POODLE at beta 0, 0.5, 0.75, 1.0 (alpha 1, base negatives) on one
cache and one episode set per (way, query classes, imbalance, shot): by default 5-way, 15 queries
per class on average (75 in all), shots 1 and 5, ``--imbalance`` none (balanced) and Dirichlet
concentrations 0.5, 1, 2 (alpha-TIM's protocol) and 5. ``--ways 5,20 --query-classes 1,2,3,4,5``
sweeps PADDLE's setting: queries from only N of the way classes (N x 15 queries).
``--rows`` keeps only some rows (labels or method names, comma-separated).
Every method sees the same episodes (paired). Each (row, way, query classes, imbalance, shot) cell
is a record of ``transductive.results.jsonl`` in ``--out`` (:mod:`poodle.results`: its identity is
the method's resolved options, the episode settings and the cache's content fingerprint), so a
re-run, or an interrupted one, solves only the cells that file lacks for this cache, and ``poodle
report`` reads it. From the records it writes ``transductive.md`` (rows = methods, columns =
settings, mean +- 95% CI in %, built by :mod:`poodle.report`: the significant best of a column in
bold) and ``transductive.json``.

Part 2 (throughput): each method's episodes/s on the standard workload (D=640, 5-way, 1-shot,
15 queries per class, random clustered features), batched (one call over ``--tp-batch`` episodes)
against one episode at a time, same configuration. The batched run must not be slower per episode.
``--tp-methods`` limits it to some rows (e.g. ``alpha-tim,paddle,bms,proto-lp``).

Part 3 (``--roofline``): each method of ``--methods`` (default PT-MAP, PEMnE-BMS, protoLP, PADDLE)
on one thread, as each CPU worker of ``evaluate`` runs it, on the chunk ``evaluate`` picks: episodes/s,
the registered FLOPs per episode, the GFLOP/s reached and their share of a large matmul's rate
measured in the same run; for the Sinkhorn methods, the share of the time in the Sinkhorn sweeps,
the sweeps per episode and their time against that of the cheapest torch pass over the same bytes.
On the standard workload (D=640) and a demo-like 64-d set (``--roofline-cache FILE``: a cache's test
split, e.g. the demo's conv4 features; else post-ReLU clustered features).

    python benchmarks/transductive.py --skip-accuracy --skip-throughput --roofline --methods pt-map,paddle
    python benchmarks/transductive.py                   # full: 500 episodes per setting (~10 min, 2 quiet cores)
    python benchmarks/transductive.py --quick           # 20 episodes, balanced and kappa=1, small throughput run
    python benchmarks/transductive.py --cache cache/glyphs/conv4_64.h5 --episodes 2000 --device cuda

Features: ``--cache FILE``; by default the embedded glyphs dataset's cache ``cache/glyphs/*.h5`` if
one exists; otherwise synthetic clustered random features (said so in the output) written to a
temporary cache, D=128, 64 base classes (the negative pool) and 20 test classes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poodle import costmodel, solvers
from poodle.cache import list_splits, read_split, write_arrays
from poodle.cells import Cell, make_cell, numbered
from poodle.evaluate import choose_chunk
from poodle.pipeline import RunOptions, run_cells
from poodle.report import Result, Table, build_table, to_markdown
from poodle.results import record_flat
from poodle.solvers import EpisodeBatch
from poodle.utils import atomic_path, parse_size, resolve_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floors  # noqa: E402

# noise norm of the synthetic features relative to the class centres: the prototype classifier
# then scores about 67% (1-shot) and 93% (5-shot), near the paper's mini-ImageNet regime
SPREAD = 2.5

BETAS = [0.0, 0.5, 0.75, 1.0]
QUERY = 15  # queries per queried class (on average, with --imbalance)
RESULTS_FILE = "transductive.results.jsonl"

# (label, method, options): the table's rows, in order
ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("Inductive (proto)", "proto", {}),
    ("Mean-shift (TAFSSL MSP)", "mean-shift", {}),
    ("Bayes k-means (TAFSSL)", "bayes-kmeans", {}),
    ("k-means", "kmeans", {}),
    ("Soft k-means", "soft-kmeans", {}),
    ("CAN-T", "can-t", {}),
    ("BD-CSPN", "bd-cspn", {}),
    ("LaplacianShot", "laplacianshot", {}),
    ("PT-MAP", "pt-map", {}),
    ("Entropy-min", "entropy-min", {}),
    ("TIM-GD", "tim-gd", {}),
    ("TIM-GD (POODLE authors' settings)", "tim-gd", {"preset": "poodle-paper"}),
    ("TIM-ADM", "tim-adm", {}),
    ("LaplacianShot (authors' code, --preset official)", "laplacianshot", {"preset": "official"}),
    ("alpha-TIM", "alpha-tim", {}),
    ("PADDLE", "paddle", {}),
    ("PEMnE-BMS", "bms", {}),
    ("protoLP", "proto-lp", {}),
]
POODLE_ROWS = [(f"POODLE-B beta={b:g}", "poodle", {"transductive": True, "alpha": 1.0, "beta": b}) for b in BETAS]


def imb_key(kappa: float | None) -> str:
    return "none" if kappa is None else f"{kappa:g}"


def setting_key(way: int, qc: int | None, kappa: float | None, shot: int) -> str:
    """The results key; 5-way with every class queried keeps the older ``{shot}-shot/{kappa}`` form."""
    key = f"{shot}-shot/{imb_key(kappa)}"
    if way != 5 or qc is not None:
        key = f"{way}-way/N={'all' if qc is None else qc}/" + key
    return key


def settings(args: argparse.Namespace) -> list[tuple[int, int | None, float | None, int]]:
    return [
        (w, qc, k, s)
        for w in args.ways
        for qc in args.query_classes
        for k in args.imbalance
        for s in args.shots
        if qc is None or qc <= w
    ]


def chosen_rows(rows: list[tuple[str, str, dict[str, Any]]], spec: str | None) -> list[tuple[str, str, dict[str, Any]]]:
    if not spec:
        return rows
    want = {w.strip() for w in spec.split(",") if w.strip()}
    return [r for r in rows if r[0] in want or r[1] in want]


def clustered(
    n_classes: int, per_class: int, dim: int, spread: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Features around random unit class centres, ``spread`` the noise norm relative to them."""
    centres = rng.standard_normal((n_classes, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres.repeat(per_class, 0) + spread * rng.standard_normal((n_classes * per_class, dim)) / math.sqrt(dim)
    return x.astype(np.float32), np.arange(n_classes).repeat(per_class)


def synthetic_cache(folder: Path, dim: int = 128, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tr_x, tr_y = clustered(64, 100, dim, SPREAD, rng)
    te_x, te_y = clustered(20, 100, dim, SPREAD, rng)
    return write_arrays(
        folder / "synthetic.h5",
        {
            "train": (tr_x, tr_y, [f"base{i}" for i in range(64)]),
            "test": (te_x, te_y, [f"novel{i}" for i in range(20)]),
        },
        dataset="synthetic-clustered",
        backbone="none",
    )


def find_cache(arg: str | None, tmp: Path) -> tuple[Path, str]:
    if arg:
        return Path(arg), f"cache {arg}"
    found = sorted(Path("cache/glyphs").glob("*.h5"))
    for f in found:
        try:
            if "test" in list_splits(f) and "train" in list_splits(f):
                return f, f"embedded glyphs dataset features ({f})"
        except Exception:  # noqa: BLE001 - a broken or partial cache is simply not used
            continue
    return synthetic_cache(tmp), f"SYNTHETIC clustered random features (D=128, noise {SPREAD}; no glyphs cache found)"


def setting_cells(
    cache: Path, rows: list[tuple[str, str, dict[str, Any]]], setting: tuple, args: argparse.Namespace
) -> list[Cell]:
    """The cells of one setting: every row on the same episodes, base negatives for the rows that
    read negatives (POODLE with beta > 0)."""
    way, qc, kappa, shot = setting
    values = {
        "cache": str(cache),
        "split": "test",
        "way": way,
        "shot": shot,
        "query": QUERY,
        "imbalance": kappa,
        "seed": args.seed,
        "episodes": args.episodes,
        "query_classes": qc,
        "negatives": "base",
        "n_neg": args.n_neg,
    }
    cells = [make_cell({**values, **o, "method": m}, label=lab, strict=set(o)) for lab, m, o in rows]
    return numbered(cells)


def run_accuracy(cache: Path, source: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Solve every (setting, row) cell that ``out/transductive.results.jsonl`` does not hold yet for
    this cache (looked up by identity, through the pipeline) and return the records of all of them,
    by setting and label."""
    test = read_split(cache, "test")
    rows = chosen_rows(ROWS, args.rows) + chosen_rows(POODLE_ROWS, args.rows)
    if not rows:
        raise SystemExit(
            f"--rows {args.rows!r} matches no row; rows: {', '.join(lab for lab, _, _ in ROWS + POODLE_ROWS)}"
        )
    meta = {
        "features": source,
        "episodes": args.episodes,
        "imbalance": [imb_key(k) for k in args.imbalance],
        "shots": args.shots,
        "seed": args.seed,
        "ways": args.ways,
        "query": QUERY,
        "query_classes": args.query_classes,
        "rows": args.rows,
        "n_neg": args.n_neg,
        "negatives": "base",
        "dim": test.dim,
    }
    # every (setting, row) cell is a record of the results layer, found again by its identity (which
    # holds the cache's content fingerprint): a re-run, or an interrupted one, solves only the cells
    # missing for this very cache
    path = out / RESULTS_FILE
    options = RunOptions(device=args.device, cells_per_call=len(rows))
    records: dict[str, dict[str, dict[str, Any]]] = {}
    for setting in settings(args):
        key = setting_key(*setting)
        t0 = time.perf_counter()
        run = run_cells(
            setting_cells(cache, rows, setting, args),
            out=path,
            meta={"name": "transductive-benchmark"},
            group=key,
            options=options,
        )
        records[key] = {r["label"]: r for r in run.records}
        print(
            f"{key:24s} {time.perf_counter() - t0:7.1f}s  "
            + (f"({run.skipped} cells taken from the results file)  " if run.skipped else "")
            + "  ".join(f"{lab.split(' ')[0]}={100 * records[key][lab]['mean']:.1f}" for lab, _, _ in rows),
            file=sys.stderr,
        )
    return {
        "meta": meta,
        "results_file": str(path),
        "records": records,
        "rows": [lab for lab, _, _ in rows],
        "settings": settings(args),
    }


def accuracy_summary(acc: dict[str, Any]) -> dict[str, Any]:
    """The accuracy part of ``transductive.json``: mean and CI (%) and seconds by setting and label."""
    return {
        "meta": acc["meta"],
        "results_file": acc["results_file"],
        "results": {
            key: {
                lab: {"mean": 100 * r["mean"], "ci": 100 * r["ci95"], "seconds": r.get("seconds"), "key": r["key"]}
                for lab, r in by_label.items()
            }
            for key, by_label in acc["records"].items()
        },
        "rows": acc["rows"],
        "settings": [[w, qc, imb_key(k), s] for w, qc, k, s in acc["settings"]],
        "ways": acc["meta"]["ways"],
    }


def accuracy_table(acc: dict[str, Any]) -> Table:
    """The records as a :class:`poodle.report.Table`: a row per label, a column per setting (the
    keys among way, query classes and imbalance that vary, and shot), the significant best of each
    column in bold (paired t-test over the shared episodes)."""
    cells: list[Result] = []
    for lab in acc["rows"]:  # rows outer: the table lists labels in order of first appearance
        for way, qc, kappa, shot in acc["settings"]:
            r = acc["records"][setting_key(way, qc, kappa, shot)].get(lab)
            if r is not None:
                flat = {**record_flat(r), "label": lab}  # the label of this run (a record keeps its own)
                cells.append(Result(flat, np.asarray(r["acc"], dtype=np.float64), acc["results_file"], len(cells)))
    cols = [  # shot always named; the other keys where they vary
        k
        for i, k in enumerate(("way", "query_classes", "imbalance", "shot"))
        if k == "shot" or len({s[i] for s in acc["settings"]}) > 1
    ]
    return build_table(cells, rows=["label"], cols=cols)


def markdown_table(acc: dict[str, Any]) -> str:
    """The table as Markdown (:func:`poodle.report.to_markdown`, with its notes), rows headed "Method"."""
    text = to_markdown(accuracy_table(acc))
    return text.replace("| label |", "| Method |", 1)


def standard_batch(n: int, dim: int = 640, shot: int = 1, seed: int = 0) -> EpisodeBatch:
    """``n`` episodes of the standard workload from random clustered features (5-way, 15 q/class)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(n, 5, dim, generator=g), dim=-1)

    def around(k: int) -> torch.Tensor:
        noise = SPREAD * torch.randn(n, 5, k, dim, generator=g) / math.sqrt(dim)
        return torch.nn.functional.normalize(centres.unsqueeze(2) + noise, dim=-1).reshape(n, 5 * k, dim)

    labels = torch.arange(5).repeat_interleave(shot).expand(n, -1).contiguous()
    return EpisodeBatch(around(shot), labels, around(15), None, 5)


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    dev = resolve_device(args.device)
    methods = [(lab, m, o) for lab, m, o in chosen_rows(ROWS, args.tp_methods) if m != "proto"]
    if not args.tp_batch:
        # the chunk evaluate() would use for this workload on this device
        args.tp_batch = choose_chunk(80, 640, 5, dev, parse_size("2GiB"))
    big = standard_batch(max(args.tp_batch, 64)).to(dev)
    res: dict[str, Any] = {}
    print(
        f"\nthroughput, standard workload (D=640, 5-way 1-shot, 75 queries), {dev}, "
        f"{torch.get_num_threads()} thread(s):",
        file=sys.stderr,
    )
    print(f"{'method':36s} {'batched eps/s':>14s} {'one-at-a-time eps/s':>20s} {'ratio':>7s}", file=sys.stderr)
    chunk = EpisodeBatch(
        big.support[: args.tp_batch], big.support_labels[: args.tp_batch], big.query[: args.tp_batch], None, 5
    )
    for lab, name, opts in methods:
        cfg = solvers.make_config(name, opts, strict=True)
        info = solvers.get(name)

        def clock(fn) -> float:
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return time.perf_counter() - t0

        # warm-up, and enough work per measurement (>= --tp-seconds) that timer noise and a busy
        # machine matter less; batched and one-at-a-time alternate, best of --repeats each
        t_one = clock(lambda info=info, cfg=cfg: info.fn(big.episode(0), cfg))
        t_chunk = clock(lambda info=info, cfg=cfg: info.fn(chunk, cfg))
        n_calls = max(1, math.ceil(args.tp_seconds / max(t_chunk, 1e-6)))
        n_single = min(big.n_episodes, max(args.tp_single, math.ceil(args.tp_seconds / max(t_one, 1e-6))))
        best_b = best_s = float("inf")
        for _ in range(args.repeats):
            t_b = clock(lambda info=info, cfg=cfg, n_calls=n_calls: [info.fn(chunk, cfg) for _ in range(n_calls)])
            t_s = clock(
                lambda info=info, cfg=cfg, n_single=n_single: [info.fn(big.episode(i), cfg) for i in range(n_single)]
            )
            best_b = min(best_b, t_b / (n_calls * args.tp_batch))
            best_s = min(best_s, t_s / n_single)
        batched, single = 1.0 / best_b, 1.0 / best_s
        flops = info.flops(5, 75, 0, 640, 5, cfg) if info.flops else float("nan")
        res[lab] = {
            "batched_eps_per_s": batched,
            "single_eps_per_s": single,
            "ratio": batched / single,
            "gflop_per_s_batched": batched * flops / 1e9,
        }
        print(f"{lab:36s} {batched:14.1f} {single:20.1f} {batched / single:7.1f}x", file=sys.stderr)
    return {
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "batch": args.tp_batch,
        "single_episodes": args.tp_single,
        "methods": res,
    }


def throughput_table(tp: dict[str, Any]) -> str:
    lines = [
        f"| Method | batched eps/s ({tp['batch']} episodes per call) | one episode at a time, eps/s | ratio |",
        "|---|---|---|---|",
    ]
    for lab, v in tp["methods"].items():
        lines.append(f"| {lab} | {v['batched_eps_per_s']:.1f} | {v['single_eps_per_s']:.1f} | {v['ratio']:.1f}x |")
    return "\n".join(lines)


# ------------------------------------------------------------------ part 3: the roofline per method

ROOFLINE_METHODS = "pt-map,bms,proto-lp,paddle"


def demo_like_batch(n: int, dim: int = 64, shot: int = 1, seed: int = 0) -> EpisodeBatch:
    """``n`` standard episodes (5-way, 15 queries per class) of post-ReLU clustered features, tighter
    than :func:`standard_batch`'s: like the demo's conv4 features (64-d, many exact zeros, classes
    well apart), on which PT-MAP's Sinkhorn needs ten times more sweeps than on 640-d random ones."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n, 5, dim, generator=g)

    def around(k: int) -> torch.Tensor:
        x = (centres.unsqueeze(2) + torch.randn(n, 5, k, dim, generator=g)).clamp_min(0)
        return torch.nn.functional.normalize(x, dim=-1).reshape(n, 5 * k, dim)

    labels = torch.arange(5).repeat_interleave(shot).expand(n, -1).contiguous()
    return EpisodeBatch(around(shot), labels, around(15), None, 5)


def cache_batch(path: str, n: int, shot: int, seed: int = 0) -> EpisodeBatch:
    """``n`` standard episodes drawn from the ``test`` split of a feature cache."""
    from poodle.episodes import EpisodeSpec, sample_episodes

    test = read_split(path, "test")
    eps = sample_episodes(test.labels, EpisodeSpec(way=5, shot=shot, query=QUERY, seed=seed), n)
    return EpisodeBatch(test.features[eps.support], eps.support_labels, test.features[eps.query], None, 5)


# the roofline's clock: wall time, or this thread's CPU time (--roofline-clock cpu: on a shared,
# oversubscribed machine the time the thread computed, not the time it waited for a core)
CLOCK = [time.perf_counter]


def _best_seconds(fn, min_seconds: float, repeats: int) -> float:
    """Seconds per call of ``fn`` on :data:`CLOCK`: see :func:`_best_both`."""
    wall, cpu = _best_both(fn, min_seconds, repeats)
    return cpu if CLOCK[0] is time.thread_time else wall


def _best_both(fn, min_seconds: float, repeats: int) -> tuple[float, float]:
    """(wall, thread CPU) seconds per call of ``fn``: the best of ``repeats`` timings of enough calls
    to last ``min_seconds``, each clock's best on its own."""
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, math.ceil(min_seconds / once))
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        wall = min(wall, (time.perf_counter() - t0) / calls)
        cpu = min(cpu, (time.thread_time() - c0) / calls)
    return wall, cpu


# seconds and repeats of the roofline's calibrations (matmul, one operation, one pass); the test
# shortens them
CALIBRATE = [0.3, 5]


def matmul_rate(n: int = 1024) -> tuple[float, float]:
    """FLOP/s of a large float32 matmul on this thread count (the roofline), by the wall clock and
    by the thread's CPU time."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    wall, cpu = _best_both(lambda: a @ b, *CALIBRATE)
    return 2.0 * n**3 / wall, 2.0 * n**3 / cpu


def op_seconds() -> float:
    """CPU seconds of one in-place operation on 40 numbers: what any torch operation costs at least
    (dispatch, checks, the loop's set-up)."""
    x = torch.rand(40)
    return _best_both(lambda: x.mul_(1.0), *CALIBRATE)[1]


def pass_seconds(shape: tuple[int, ...]) -> tuple[float, float]:
    """(seconds of one in-place elementwise pass over a float32 tensor of ``shape``, its bandwidth in
    bytes/s counting a read and a write): the cheapest full pass torch makes at that size."""
    x = torch.rand(shape)
    t = _best_seconds(lambda: x.mul_(1.0), *CALIBRATE)
    return t, 2 * 4 * x.numel() / t


class _SweepClock:
    """Counts and times the Sinkhorn loops of PT-MAP and protoLP (``balance``: the time of the whole
    loop, the episodes of each sweep counted at ``_sweep``) and of PEMnE-BMS (``min_size_sinkhorn``)
    while installed (absent in older code: then counts nothing)."""

    def __init__(self) -> None:
        self.episode_sweeps = 0
        self.seconds = 0.0
        self.bytes = 0.0
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap(self, module: Any, name: str, count: Any = None, nbytes: Any = None, timed: bool = True) -> None:
        fn = getattr(module, name, None)
        if fn is None:
            return

        def wrapped(*a: Any, **k: Any) -> Any:
            t0 = CLOCK[0]()
            out = fn(*a, **k)
            if timed:
                self.seconds += CLOCK[0]() - t0
            if count is not None:
                self.episode_sweeps += count(*a)
                self.bytes += nbytes(*a)
            return out

        self._undo.append((module, name, fn))
        setattr(module, name, wrapped)

    def __enter__(self) -> _SweepClock:
        from poodle.solvers import bms, proto_lp, pt_map

        # bytes per episode-sweep: balance reads p for each of its two sums and reads and writes it
        # for each of its two scalings (6 K N floats) and makes 8 passes over N-vectors; the min-size
        # sweep has three sums, two scalings and the guard's add (9 K N)
        def kn(p: torch.Tensor) -> int:
            return p.shape[1] * p.shape[2]

        if hasattr(pt_map, "_sweep"):
            sweep_bytes = lambda p, *a: 4.0 * p.shape[0] * (6 * kn(p) + 8 * p.shape[2])  # noqa: E731
            self._wrap(pt_map, "_sweep", lambda p, *a: p.shape[0], sweep_bytes, timed=False)
            self._wrap(pt_map, "balance")
            self._wrap(proto_lp, "balance")
        self._count_native()
        self._wrap(
            bms,
            "min_size_sinkhorn",
            lambda p, m, n: p.shape[0] * n,
            lambda p, m, n: 4.0 * p.shape[0] * n * (9 * kn(p) + 4 * p.shape[1]),
        )
        return self

    def _count_native(self) -> None:
        """The fused C loops' balanced sweeps (PT-MAP's, protoLP's two a step), which the torch
        loop's ``_sweep`` never sees: each call's per-episode counts, read back from the kernel."""
        from poodle.solvers import _sinkhorn_native as native

        run = getattr(native, "run", None)
        step = native.LPStep.__call__ if hasattr(native, "LPStep") else None
        if run is not None:

            def counted_run(mode: str, p: torch.Tensor, *a: Any, iters: Any = None, **k: Any) -> Any:
                mine = torch.zeros(p.shape[0], dtype=torch.int32) if iters is None else iters
                out = run(mode, p, *a, iters=mine, **k)
                if mode == "balanced":  # BMS's min-size sweeps are counted at min_size_sinkhorn
                    self.episode_sweeps += int(mine.sum())
                return out

            self._undo.append((native, "run", run))
            native.run = counted_run
        if step is not None:

            def counted_step(obj: Any, plan: torch.Tensor) -> Any:
                before = int(obj.sweeps.sum())
                out = step(obj, plan)
                self.episode_sweeps += int(obj.sweeps.sum()) - before
                return out

            self._undo.append((native.LPStep, "__call__", step))
            native.LPStep.__call__ = counted_step

    def __exit__(self, *exc: Any) -> None:
        for module, name, fn in reversed(self._undo):
            setattr(module, name, fn)


def roofline_cases(args: argparse.Namespace) -> list[tuple[str, int, Any]]:
    """(label, D, batch maker) of the roofline's feature sets: the standard workload (D=640) and a
    demo-like 64-d one (``--roofline-cache``'s test split, else :func:`demo_like_batch`)."""
    cases: list[tuple[str, int, Any]] = [("random 640-d", 640, lambda n, shot: standard_batch(n, 640, shot, seed=1))]
    if getattr(args, "roofline_standard_only", False):  # benchmarks/methods.py: the standard workload alone
        return cases
    if args.roofline_cache:
        dim = read_split(args.roofline_cache, "test").dim
        cases.append(
            (
                f"{Path(args.roofline_cache).name} {dim}-d",
                dim,
                lambda n, shot: cache_batch(args.roofline_cache, n, shot),
            )
        )
    else:
        cases.append(("demo-like 64-d", 64, lambda n, shot: demo_like_batch(n, 64, shot, seed=1)))
    return cases


def run_roofline(args: argparse.Namespace) -> dict[str, Any]:
    """Each method of ``--methods`` on one thread (as each CPU worker of ``evaluate`` runs it), on
    the chunk ``evaluate`` picks for the workload: episodes/s, its registered FLOPs per episode, the
    GFLOP/s reached and their share of the large-matmul rate measured in the same run; and where a
    Sinkhorn loop is in the way, the share of the time it takes, its sweeps per episode, the bytes
    they move and the time the cheapest torch pass over the same tensor would take for them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    CLOCK[0] = time.thread_time if args.roofline_clock == "cpu" else time.perf_counter
    try:
        mm, mm_cpu = matmul_rate()
        t_op = op_seconds()
        rows = []
        for label, dim, make in roofline_cases(args):
            chunk = args.roofline_chunk or choose_chunk(80, dim, 5, torch.device("cpu"), parse_size("2GiB"))
            bandwidth = pass_seconds((chunk, 80, dim))[1]  # an in-place pass over a chunk's features
            large = mm_cpu if CLOCK[0] is time.thread_time else mm
            cal = floors.Calibration(lambda fn: _best_seconds(fn, *CALIBRATE), chunk, bandwidth, large)
            for shot in args.shots:
                batch = make(chunk, shot)
                for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
                    rows.append(_roofline_row(name, label, dim, shot, chunk, batch, args))
                    r = rows[-1]
                    r["floors_us"] = {  # per episode: the arithmetic, the bytes, the operations
                        "compute": 1e6 * r["flops_per_episode"] / mm_cpu,
                        "memory": 1e6 * r["bytes_per_episode"] / bandwidth,
                        "ops": 1e6 * r["ops_per_call"] * t_op / chunk,
                    }
                    r["floor"] = method_floor(r, name, cal, args)
                    print(_roofline_line(rows[-1], mm, mm_cpu), file=sys.stderr)
        mm_after, mm_cpu_after = matmul_rate()
    finally:
        torch.set_num_threads(before)
    return {
        "matmul_flops": mm,
        "matmul_flops_after": mm_after,
        "matmul_flops_cpu": mm_cpu,
        "matmul_flops_cpu_after": mm_cpu_after,
        "rows": rows,
        "sweep_clock": args.roofline_clock,
        "op_seconds": t_op,
    }


def method_floor(r: dict[str, Any], name: str, cal: floors.Calibration, args: argparse.Namespace) -> dict[str, Any]:
    """The method's own floor per episode (:func:`floors.method_floor`) for roofline row ``r``: at
    its FLOPs as counted, and at the Sinkhorn sweeps it made (where their number is not fixed)."""
    cfg = solvers.make_config(name, getattr(args, "roofline_options", {}).get(name, {}), strict=True)
    shape = (5 * r["shot"], 5 * QUERY, 0, r["dim"], 5)
    fl = floors.method_floor(name, cfg, shape, r["flops_per_episode"], cal, r.get("sweeps_per_episode"))
    us = 1e6 / (r["eps_per_s_cpu"] if CLOCK[0] is time.thread_time else r["eps_per_s"])
    fl["share"] = fl["floor_us"] / us
    return fl


# the configuration field that counts a method's iterations, for methods that stop per episode and
# report ``iterations`` in their state (as benchmarks/solver.py): their registered FLOPs, linear in
# that field, are counted at the mean iterations the call made, not at the cap
ITER_FIELDS = {"kmeans": "max_iter", "bayes-kmeans": "max_iter", "laplacianshot": "steps"}


def episode_flops(name: str, cfg: Any, ns: int, dim: int, iterations: float | None) -> float:
    """Registered FLOPs per standard episode (``ns`` support rows, 75 queries, 5-way, ``dim``), at
    ``iterations`` per episode for the methods of :data:`ITER_FIELDS` (else at the configuration's)."""
    info = solvers.get(name)
    if info.flops is None:
        return float("nan")
    shape = (ns, 5 * QUERY, 0, dim, 5)
    if iterations is None:
        return float(info.flops(*shape, cfg))
    f0, f1 = (info.flops(*shape, dataclasses.replace(cfg, **{ITER_FIELDS[name]: k})) for k in (0, 1))
    return float(f0 + iterations * (f1 - f0))


def _roofline_row(name: str, label: str, dim: int, shot: int, chunk: int, batch: EpisodeBatch, args) -> dict[str, Any]:
    # options per method (benchmarks/methods.py runs POODLE transductive); none from the command line
    cfg = solvers.make_config(name, getattr(args, "roofline_options", {}).get(name, {}), strict=True)
    info = solvers.get(name)
    sec, cpu = _best_both(lambda: info.fn(batch, cfg), args.tp_seconds, args.repeats)
    with _SweepClock() as clock:  # a separate, instrumented call
        t0 = CLOCK[0]()
        out = info.fn(batch, cfg)
        total = CLOCK[0]() - t0
    iters = out.state.get("iterations") if name in ITER_FIELDS else None
    flops = episode_flops(name, cfg, 5 * shot, dim, None if iters is None else float(iters.double().mean()))
    with costmodel._tracer(chunk) as mode:  # what the call does on this device's own schedule
        info.fn(batch, cfg)
    row = {"method": name, "features": label, "dim": dim, "shot": shot, "chunk": chunk}
    row |= {"ops_per_call": mode.trace.launches, "bytes_per_episode": mode.trace.bytes}
    row |= {"iterations": None if iters is None else float(iters.double().mean())}
    row |= {"eps_per_s": chunk / sec, "flops_per_episode": flops, "flop_per_s": flops * chunk / sec}
    row |= {"eps_per_s_cpu": chunk / cpu, "flop_per_s_cpu": flops * chunk / cpu}
    if clock.episode_sweeps:
        # the cheapest in-place pass over the sweep's [E, K, Nq] tensor, at this chunk's size
        t_pass, bw = pass_seconds((chunk, 5, 5 * QUERY))
        row |= {
            "sweep_share": clock.seconds / total,
            "sweeps_per_episode": clock.episode_sweeps / chunk,
            "sweep_us": 1e6 * clock.seconds / clock.episode_sweeps,
            "sweep_bytes": clock.bytes / clock.episode_sweeps,
            "pass_bandwidth": bw,
            "bound_us": 1e6 * clock.bytes / clock.episode_sweeps / bw,
        }
    return row


def _roofline_line(r: dict[str, Any], mm: float, mm_cpu: float) -> str:
    text = (
        f"{r['method']:9s} {r['features']:>22s} {r['shot']}-shot chunk {r['chunk']:4d}: {r['eps_per_s']:8.1f} eps/s, "
        f"{r['flops_per_episode'] / 1e6:7.2f} MFLOP/ep, {r['flop_per_s'] / 1e9:6.2f} GFLOP/s = "
        f"{100 * r['flop_per_s'] / mm:5.1f}% of matmul (CPU clock: {r['eps_per_s_cpu']:.1f} eps/s, "
        f"{100 * r['flop_per_s_cpu'] / mm_cpu:.1f}%)"
    )
    if "floor" in r:
        fl = r["floor"]
        text += f"; own floor {fl['floor_us']:.0f} us/ep = {100 * fl['share']:.0f}% ({floors.describe(fl)})"
    if "sweep_share" in r:
        text += (
            f"; Sinkhorn {100 * r['sweep_share']:.0f}% of the time, {r['sweeps_per_episode']:.0f} sweeps/ep, "
            f"{r['sweep_us']:.2f} us/sweep/ep vs {r['bound_us']:.2f} us at the pass bandwidth "
            f"({r['pass_bandwidth'] / 1e9:.1f} GB/s, {r['sweep_bytes'] / 1e3:.1f} kB)"
        )
    return text


def roofline_table(rf: dict[str, Any]) -> str:
    mm, mm_cpu = rf["matmul_flops"], rf["matmul_flops_cpu"]
    lines = [
        f"Large matmul (1024^3 float32, 1 thread): {mm / 1e9:.1f} GFLOP/s before the methods, "
        f"{rf['matmul_flops_after'] / 1e9:.1f} after (by the thread's CPU time: {mm_cpu / 1e9:.1f} and "
        f"{rf['matmul_flops_cpu_after'] / 1e9:.1f}); the Sinkhorn columns by the {rf['sweep_clock']} clock.",
        "",
        f"One in-place operation on 40 numbers: {1e6 * rf['op_seconds']:.1f} us of CPU time. Floors per episode "
        "(CPU time): compute = FLOPs / the matmul rate; memory = the bytes the operations move (traced) / "
        "the bandwidth of an in-place pass over the chunk's features; ops = operations per call x one "
        "operation's cost / chunk. Own floor: each method's parts timed by micro-benchmarks of their own "
        "(a batched matmul of its product shape, LAPACK eigh of its matrix, a plain C Sinkhorn sweep on an "
        "L1-resident plan, a pass over its rows), on the roofline's clock.",
        "",
        "| method | features | shot | chunk | eps/s (1 thread) | MFLOP/episode | GFLOP/s | % of matmul "
        "| CPU-time eps/s | CPU-time % | us/episode (CPU) | compute floor | memory floor | ops/call | op floor "
        "| Sinkhorn share | sweeps/episode | us per episode-sweep | us at pass bandwidth "
        "| own floor us/episode | binds | % of own floor |",
        "|" + "---|" * 22,
    ]
    for r in rf["rows"]:
        sweep = ["-"] * 4
        if "sweep_share" in r:
            sweep = [f"{100 * r['sweep_share']:.0f}%", f"{r['sweeps_per_episode']:.0f}", f"{r['sweep_us']:.2f}"]
            sweep.append(f"{r['bound_us']:.2f}")
        cells = [r["method"], r["features"], str(r["shot"]), str(r["chunk"]), f"{r['eps_per_s']:.1f}"]
        cells += [f"{r['flops_per_episode'] / 1e6:.2f}", f"{r['flop_per_s'] / 1e9:.2f}"]
        cells += [f"{100 * r['flop_per_s'] / mm:.1f}", f"{r['eps_per_s_cpu']:.1f}"]
        cells.append(f"{100 * r['flop_per_s_cpu'] / mm_cpu:.1f}")
        fl = r["floors_us"]
        cells += [f"{1e6 / r['eps_per_s_cpu']:.0f}", f"{fl['compute']:.0f}", f"{fl['memory']:.0f}"]
        cells += [f"{r['ops_per_call']:,}", f"{fl['ops']:.0f}"]
        own = ["-"] * 3
        if "floor" in r:
            own = [f"{r['floor']['floor_us']:.0f}", r["floor"]["binds"], f"{100 * r['floor']['share']:.0f}"]
        lines.append("| " + " | ".join(cells + sweep + own) + " |")
    floors_text = [
        f"- {r['method']} ({r['features']}, {r['shot']}-shot): {floors.describe(r['floor'])}"
        for r in rf["rows"]
        if "floor" in r
    ]
    if floors_text:
        lines += ["", "Own floors per episode (benchmarks/floors.py: max(memory, matmul + eigh + sweeps)):", ""]
    return "\n".join(lines + floors_text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="feature cache (HDF5) with 'test' and 'train' splits")
    ap.add_argument(
        "--episodes",
        type=int,
        default=500,
        help="episodes per (way, query classes, imbalance, shot) setting",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--imbalance",
        default="none,0.5,1,2,5",
        help="comma-separated query distributions: none (balanced) or Dirichlet kappa values",
    )
    ap.add_argument("--ways", default="5", help="comma-separated ways")
    ap.add_argument(
        "--query-classes", default="all", help="comma-separated N (queries from only N of the way classes) or all"
    )
    ap.add_argument("--rows", help="only these rows: labels or method names, comma-separated")
    ap.add_argument("--tp-methods", help="throughput of these rows only (labels or method names)")
    ap.add_argument("--shots", default="1,5", help="comma-separated shots")
    ap.add_argument("--n-neg", type=int, default=400, help="base negatives per episode for POODLE")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--chunk", type=int, default=256, help="episodes per chunk for the competitors")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--tp-batch",
        type=int,
        default=0,
        help="episodes in the batched throughput call (0: the chunk evaluate() picks)",
    )
    ap.add_argument("--tp-single", type=int, default=4, help="episodes run one at a time")
    ap.add_argument("--repeats", type=int, default=3, help="throughput timings: best of N")
    ap.add_argument("--tp-seconds", type=float, default=1.0, help="minimum work per throughput measurement")
    ap.add_argument("--out", default="cache/results/transductive", help="output folder")
    ap.add_argument(
        "--quick", action="store_true", help="20 episodes, balanced and kappa=1 only, small throughput run (~1 min)"
    )
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument(
        "--roofline", action="store_true", help="part 3: each method's GFLOP/s against the matmul rate (one thread)"
    )
    ap.add_argument("--methods", default=ROOFLINE_METHODS, help="the roofline's methods (comma-separated)")
    ap.add_argument("--roofline-cache", help="feature cache whose test split is the roofline's second feature set")
    ap.add_argument("--roofline-chunk", type=int, default=0, help="episodes per call (0: the chunk evaluate picks)")
    ap.add_argument(
        "--roofline-clock",
        choices=["wall", "cpu"],
        default="wall",
        help="the roofline's clock: wall time, or the thread's CPU time (a shared, oversubscribed machine)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.episodes, args.tp_single, args.repeats, args.tp_seconds = 20, 2, 2, 0.2
        args.imbalance = "none,1"
    try:
        args.imbalance = [None if k.strip() == "none" else float(k) for k in args.imbalance.split(",")]
        args.shots = [int(k) for k in args.shots.split(",")]
        args.ways = [int(k) for k in args.ways.split(",")]
        args.query_classes = [None if k.strip() == "all" else int(k) for k in args.query_classes.split(",")]
    except ValueError:
        ap.error("--imbalance takes 'none' or numbers and --shots integers, e.g. --imbalance none,0.5,1")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    report: dict[str, Any] = {"command": "python benchmarks/transductive.py " + " ".join(given)}
    md = [f"Command: `{report['command']}`", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_accuracy:
            cache, source = find_cache(args.cache, Path(tmp))
            print(f"features: {source}", file=sys.stderr)
            acc = run_accuracy(cache, source, args, out)
            report["accuracy"] = accuracy_summary(acc)
            md += [
                f"Features: {source}; {args.episodes} episodes per setting, seed {args.seed}, "
                f"{'/'.join(map(str, args.ways))}-way, {QUERY} queries per queried class on average "
                f"(N x {QUERY} with N query classes), POODLE with {args.n_neg} base negatives; every cell is "
                f"a record of {acc['results_file']}.",
                "",
                markdown_table(acc),
                "",
            ]
    if not args.skip_throughput:
        tp = run_throughput(args)
        report["throughput"] = tp
        md += [
            f"Throughput on the standard workload ({tp['device']}, {tp['threads']} thread(s)):",
            "",
            throughput_table(tp),
            "",
        ]
    if args.roofline:
        rf = run_roofline(args)
        report["roofline"] = rf
        md += ["Roofline, one thread, the chunk evaluate() picks:", "", roofline_table(rf), ""]
    with atomic_path(out / "transductive.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1))
    with atomic_path(out / "transductive.md") as tmp:
        tmp.write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
