"""Running a grid: solve every cell the results file does not hold yet, writing each through
:mod:`poodle.results`.

The cache is read (and normalised) once per run and split, the episodes are sampled once per
episode setting and the negatives drawn once per (episodes, source, count); cells on the same
episodes and negatives are solved together by one call of :func:`poodle.evaluate.evaluate`. Each
finished cell is one record appended (and fsynced) to the results file, so an interrupted run
resumes where it stopped; a record is found again by its identity, which holds the cache's content
fingerprint, so adding cells computes only the new ones and a record of another cache is never
reused.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from poodle import distributed, solvers
from poodle.cache import SplitFeatures, read_split
from poodle.defaults import NEGATIVE_KEYWORDS
from poodle.episodes import EpisodeSet, EpisodeSpec, sample_episodes
from poodle.errors import ConfigError
from poodle.evaluate import evaluate, prepare_negatives
from poodle.grid.spec import Cell, GridSpec, default_results_path, expand, grid_hash, resolve_cache, resolve_negatives
from poodle.negatives import NegativeSpec
from poodle.preprocess import Preprocessor
from poodle.results import ResultsFile, cache_identity, identity_key, make_record
from poodle.utils import check_output


@dataclass
class CellEvent:
    """What the progress callbacks receive.

    ``kind`` is ``"start"`` (``cells`` are about to be solved together; ``cell`` is the first),
    ``"done"`` (``cell`` finished and written, ``record`` is its line) or ``"skip"`` (already in the
    results file). ``done``/``total`` count cells of the grid.
    """

    kind: str
    cell: Cell
    done: int
    total: int
    record: dict[str, Any] | None = None
    cells: list[Cell] = field(default_factory=list)


@dataclass
class GridRun:
    """Outcome of :func:`run_grid`: the results file's header and every cell's record, in grid order
    (each with the cell's label and index), and where the time went."""

    path: Path
    header: dict[str, Any]
    records: list[dict[str, Any]]
    computed: int
    skipped: int
    seconds: float
    load_seconds: float = 0.0
    sample_seconds: float = 0.0
    solve_seconds: float = 0.0
    other_records: int = 0


def fingerprints(spec: GridSpec, cells: Sequence[Cell]) -> dict[str, str]:
    """Content fingerprint (:func:`poodle.results.cache_identity`) of every cache and negative pool
    file the cells read, by the name the grid gives it."""
    files: dict[str, tuple[Path, str]] = {}
    for c in cells:
        files[c.cache] = (resolve_cache(spec, c.cache), "cache")
        if c.negatives not in NEGATIVE_KEYWORDS:
            _, p = resolve_negatives(spec, c.negatives)
            if p is not None:
                files.setdefault(c.negatives.partition(":")[0], (p, "negative pool"))
    out = {}
    for name, (p, kind) in sorted(files.items()):
        if not p.exists():
            raise ConfigError(f"{spec.path}: {kind} {name!r} -> {p} does not exist")
        out[name] = cache_identity(p)
    return out


def cell_keys(cells: Sequence[Cell], prints: dict[str, str]) -> dict[int, tuple[dict[str, Any], str]]:
    """``{cell.index: (identity, results key)}`` for cells whose caches have ``prints``."""
    out = {}
    for c in cells:
        neg_id = None if c.negatives in NEGATIVE_KEYWORDS else prints.get(c.negatives.partition(":")[0])
        ident = c.result_identity(prints[c.cache], neg_id)
        out[c.index] = (ident, identity_key(ident))
    return out


def schedule(cells: Sequence[Cell], pending: Sequence[Cell]) -> list[Cell]:
    """``pending`` ordered so that each cache is read once and each episode set sampled once: caches
    in order of first appearance in ``cells``, then episode settings, then negatives, then the grid
    order."""
    cache_order = {k: i for i, k in reversed(list(enumerate(c.cache for c in cells)))}
    ep_order = {k: i for i, k in reversed(list(enumerate(c.episode_key() for c in cells)))}
    neg_order = {k: i for i, k in reversed(list(enumerate(c.negative_key() for c in cells)))}
    return sorted(
        pending, key=lambda c: (cache_order[c.cache], ep_order[c.episode_key()], neg_order[c.negative_key()], c.index)
    )


def batches(pending: Sequence[Cell], size: int) -> Iterable[list[Cell]]:
    """Consecutive runs of cells that share episodes and negatives, at most ``size`` long."""
    size = max(1, int(size))
    batch: list[Cell] = []
    for c in pending:
        if batch and (
            len(batch) >= size
            or (c.episode_key(), c.negative_key()) != (batch[0].episode_key(), batch[0].negative_key())
        ):
            yield batch
            batch = []
        batch.append(c)
    if batch:
        yield batch


class _Inputs:
    """Features, episodes and negatives of the cells in flight, each made once and kept while the
    schedule needs it (one cache split, its episode sets, one negative draw)."""

    def __init__(self, spec: GridSpec) -> None:
        self.spec = spec
        self.features: SplitFeatures | None = None
        self.features_key: tuple[str, str] | None = None
        self.episode_sets: dict[tuple, EpisodeSet] = {}
        self.prepared: dict[tuple, EpisodeSet] = {}
        self.load_seconds = 0.0
        self.sample_seconds = 0.0
        self.preprocessed: dict[str, tuple[SplitFeatures, Preprocessor]] = {}

    def features_for(self, c: Cell) -> SplitFeatures:
        key = (c.cache, c.episode["split"])
        if self.features_key != key or self.features is None:
            t0 = time.perf_counter()
            self.features = None  # free the previous cache's features before reading the next
            self.features = read_split(resolve_cache(self.spec, c.cache), c.episode["split"])
            self.features_key = key
            self.episode_sets = {}
            self.prepared = {}
            self.preprocessed = {}
            self.load_seconds += time.perf_counter() - t0
        return self.features

    def preprocessed_for(self, c: Cell) -> tuple[SplitFeatures, Preprocessor]:
        """The cell's split under its ``preprocess`` (poodle.preprocess), and the fitted transform
        (which the negative pool gets too)."""
        features = self.features_for(c)
        if c.preprocess not in self.preprocessed:
            pre = Preprocessor.from_cache(c.preprocess, resolve_cache(self.spec, c.cache))
            self.preprocessed = {c.preprocess: (pre.split(features), pre)}
        return self.preprocessed[c.preprocess]

    def episodes_for(self, c: Cell) -> EpisodeSet:
        features = self.features_for(c)
        ek = c.episode_key()
        if ek not in self.episode_sets:
            t0 = time.perf_counter()
            e = c.episode
            es = EpisodeSpec.from_settings(e)
            self.episode_sets[ek] = sample_episodes(features.labels, es, e["episodes"], classes=features.classes)
            self.sample_seconds += time.perf_counter() - t0
        return self.episode_sets[ek]

    def negatives_for(self, c: Cell) -> tuple[EpisodeSet, NegativeSpec | None]:
        """The cell's episodes with their negative indices drawn (once per episodes, source, count)."""
        episodes = self.episodes_for(c)
        if c.negatives == "none":
            return episodes, None
        source, _ = resolve_negatives(self.spec, c.negatives)
        negatives = NegativeSpec(source=source, n_neg=int(c.n_neg or 0))
        nk = (c.episode_key(), source, c.n_neg)
        if nk not in self.prepared:
            self.prepared.clear()
            assert self.features is not None
            self.prepared[nk] = prepare_negatives(
                episodes, negatives, resolve_cache(self.spec, c.cache), self.features.features.shape[1]
            )[0]
        return self.prepared[nk], negatives


def run_grid(
    spec: GridSpec,
    out: str | os.PathLike | None = None,
    *,
    force: bool = False,
    device: str = "auto",
    max_memory: str | int = "2GiB",
    on_cell: Callable[[CellEvent], None] | None = None,
    progress: Callable[[int], None] | None = None,
    cells: Sequence[Cell] | None = None,
    cells_per_call: int = 4,
    warn: Callable[[str], None] | None = None,
) -> GridRun:
    """Run every cell of ``spec`` that the results file ``out`` does not hold yet.

    Args:
        spec: the parsed grid (:func:`poodle.grid.load_grid`).
        out: the JSON Lines results file (default: next to the grid file, see
            :func:`poodle.grid.default_results_path`); it may hold records of other grids too.
        force: recompute every cell of this grid (new records supersede the old ones).
        device, max_memory: passed to :func:`poodle.evaluate.evaluate`.
        on_cell: called with a :class:`CellEvent` before and after each cell (and for skipped ones).
        progress: called with the number of cell-episodes just solved (for an episodes/s display).
        cells: the expanded cells, when the caller already has them.
        cells_per_call: cells on the same episodes and negatives are solved by one call of
            ``evaluate`` (up to this many): each chunk of episodes is then gathered, and its negatives
            drawn, once for all of them. Results are written after each call, so an interruption
            loses at most one call's cells.
        warn: receives a line when an older results file is converted.

    Returns:
        a :class:`GridRun`; its ``records`` are those of all cells, in grid order.
    """
    t_start = time.perf_counter()
    cells = list(cells) if cells is not None else expand(spec)
    path = Path(out) if out is not None else default_results_path(spec.path)
    prints = fingerprints(spec, cells)
    keys = cell_keys(cells, prints)
    # Under torchrun (poodle.distributed) rank 0 alone reads and writes the results file and tells the
    # other ranks which cells are done; the calls (or, when fewer than the ranks, their episodes) are
    # shared out, and rank 0 appends every record in the one-process order.
    d = distributed.init(device)
    results: ResultsFile | None = None
    done: dict[int, dict[str, Any]] = {}
    with d.guard():
        # never a cache, the grid file or another kind of file: only a results file gains records
        check_output(path, "results", inputs=[spec.path, *{resolve_cache(spec, c.cache) for c in cells}], what="--out")
        if d.main:
            results = ResultsFile(path, warn=warn, name=spec.name, grid_file=str(spec.path), n_cells=len(cells))
            if not force:
                for c in cells:
                    rec = results.get(keys[c.index][1])
                    if rec is not None:
                        done[c.index] = _as_cell(rec, c, spec.name)
    if d.enabled:
        done_idx = d.broadcast_json(sorted(done))
        if not d.main:
            done = {int(i): {} for i in done_idx}
            on_cell = progress = None
    total = len(cells)
    n_done = 0
    for c in cells:
        if c.index in done:
            n_done += 1
            if on_cell:
                on_cell(CellEvent("skip", c, n_done, total, done[c.index]))

    inputs = _Inputs(spec)
    computed = 0
    solve_s = 0.0
    pending: dict[str, Cell] = {}  # one computation per identity (two labels may name the same cell)
    for c in cells:
        if c.index not in done:
            pending.setdefault(keys[c.index][1], c)

    def solve(batch: list[Cell], rows: range | None) -> dict[str, tuple[Any, dict[str, Any]]]:
        if on_cell:
            on_cell(CellEvent("start", batch[0], n_done, total, cells=list(batch)))
        return _evaluate_batch(spec, batch, inputs, keys, d.device, max_memory, progress, rows)

    calls = list(batches(schedule(cells, list(pending.values())), cells_per_call))
    t0 = time.perf_counter()
    for batch, res in distributed.shared_map(d, calls, solve, lambda b: int(b[0].episode["episodes"])):
        assert results is not None
        for c in batch:
            acc, info = res[keys[c.index][1]]
            record = make_record(
                keys[c.index][0],
                acc.tolist(),
                label=c.label,
                cache=c.cache,
                index=c.index,
                group=spec.name,
                seconds=info["seconds"],
                call_seconds=round(info["call_seconds"], 4),
                call_cells=len(batch),
                device=info["device"],
                chunk_size=info["chunk_size"],
            )
            results.append(record)
            done[c.index] = record
            computed += 1
            n_done += 1
            if on_cell:
                on_cell(CellEvent("done", c, n_done, total, record))
    solve_s = time.perf_counter() - t0
    if results is None:  # not rank 0
        return GridRun(
            path=path,
            header={},
            records=[],
            computed=0,
            skipped=0,
            seconds=time.perf_counter() - t_start,
            load_seconds=inputs.load_seconds,
            sample_seconds=inputs.sample_seconds,
            solve_seconds=solve_s,
        )

    for c in cells:
        if c.index not in done:  # the same identity as a cell computed above
            rec = results.get(keys[c.index][1])
            assert rec is not None
            done[c.index] = _as_cell(rec, c, spec.name)
    own = {k for _, k in keys.values()}
    return GridRun(
        path=path,
        header=results.header,
        records=[done[c.index] for c in cells],
        computed=computed,
        skipped=total - computed,
        seconds=time.perf_counter() - t_start,
        load_seconds=inputs.load_seconds,
        sample_seconds=inputs.sample_seconds,
        solve_seconds=solve_s,
        other_records=sum(1 for r in results.records if r["key"] not in own),
    )


def _as_cell(record: dict[str, Any], c: Cell, group: str) -> dict[str, Any]:
    """A stored record shown as cell ``c`` of this grid (its label, cache name and position)."""
    return {**record, "label": c.label, "cache": c.cache, "index": c.index, "group": group}


def _evaluate_batch(
    spec: GridSpec,
    batch: Sequence[Cell],
    inputs: _Inputs,
    keys: dict[int, tuple[dict, str]],
    device: Any,
    max_memory: str | int,
    progress: Callable[[int], None] | None,
    rows: range | None = None,
) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Solve cells that share episodes and negatives with one call of ``evaluate`` (on the episodes
    ``rows`` only, when given: a rank's share); ``{identity key: (float64 accuracies, timing info)}``."""
    c0 = batch[0]
    features, pre = inputs.preprocessed_for(c0)
    episodes, negatives = inputs.negatives_for(c0)
    if rows is not None:  # negatives are per episode: they come along with the slice
        episodes = episodes[rows.start : rows.stop]
    labels = {c.index: keys[c.index][1] for c in batch}
    methods = [(labels[c.index], c.method, solvers.make_config(c.method, dict(c.options), strict=True)) for c in batch]
    # evaluate reports episodes per chunk for all the methods of the call: count cell-episodes
    call_progress = None if progress is None else (lambda n, k=len(batch): progress(n * k))
    stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    accs = evaluate(
        features,
        episodes,
        methods,
        negatives=negatives,
        cache_path=resolve_cache(spec, c0.cache),
        device=device,
        max_memory=max_memory,
        progress=call_progress,
        stats=stats,
        preprocess=pre,
    )
    call_seconds = time.perf_counter() - t0
    return {
        labels[c.index]: (
            accs[labels[c.index]].double().cpu(),
            {
                "seconds": float(stats.get("seconds", {}).get(labels[c.index], call_seconds / len(batch))),
                "call_seconds": call_seconds,
                "device": str(stats.get("device", device)),
                "chunk_size": stats.get("chunk_size"),
            },
        )
        for c in batch
    }


__all__ = ["CellEvent", "GridRun", "batches", "cell_keys", "fingerprints", "grid_hash", "run_grid", "schedule"]
