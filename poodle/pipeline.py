"""The one pipeline: solve cells and write their records.

Every command that solves episodes goes through :func:`run_cells`: ``poodle solve`` (its methods
are the cells of one episode setting), ``poodle grid`` (a grid file's cells), ``poodle demo`` (its
table is a grid) and torchrun runs of either. In order:

1. the content fingerprint of every cache and negative pool file the cells read
   (:func:`fingerprints`), hence each cell's identity and results key (:func:`cell_keys`);
2. with ``resume``, the cells the results file already holds are finished;
3. the others are scheduled so that each cache split is read once and each episode set drawn once
   (:func:`schedule`), in calls of cells that share episodes and negatives (:func:`calls`);
4. each call is one :func:`poodle.evaluate.evaluate` over :class:`Inputs` (features, preprocessing,
   episodes) (:func:`solve_call`); under torchrun the calls, or their episodes, are dealt out by
   their counts (:func:`poodle.distributed.deal`) and each round's results merged on rank 0
   (:func:`poodle.distributed.gather_results`): the pipeline runs the loop, the distribution sees
   counts and tensors only;
5. each finished cell is one record (:func:`cell_record`) appended to the results file.

Progress and notices reach the caller as typed events (:mod:`poodle.events`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from poodle import __version__, distributed
from poodle.cache import SplitFeatures, read_split
from poodle.cells import Cell
from poodle.episodes import EpisodeSet, EpisodeStream, load_episodes
from poodle.errors import ConfigError, mark
from poodle.evaluate import ChunkPlan, Hooks, backend_for, evaluate
from poodle.events import CellFinished, CellsStarted, EpisodesSolved, Notice, OnEvent, Ready, ignore
from poodle.negatives import pool_file
from poodle.prefetch import pool_location
from poodle.preprocess import Preprocessor
from poodle.results import ResultsFile, cache_identity, identity_key, make_record
from poodle.run import RunOptions
from poodle.system import solve_workers
from poodle.utils import resolve_path


def versions() -> dict[str, str]:
    return {"poodle": __version__, "torch": torch.__version__, "python": platform.python_version()}


def machine(device: torch.device | str) -> str:
    """The device and what it is, as records say it: ``cpu (x86_64)``, ``cuda:0 (NVIDIA H100)``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({platform.processor() or platform.machine()})"


# ---------------------------------------------------------------------------------------------
# Identities


def fingerprints(cells: Sequence[Cell]) -> dict[Path, str]:
    """The content fingerprint (:func:`poodle.results.cache_identity`) of every cache and negative
    pool file the cells read, by file; a missing file is a ConfigError naming it."""
    files: set[Path] = set()
    for c in cells:
        resolve_path(c.cache_file, what="feature cache")
        if c.cache_file.is_dir():
            raise ConfigError(
                f"feature {mark('cache')} {c.cache_file} is a directory, not a file", param="cache", value=c.cache_file
            )
        if not c.cache_file.is_file():
            raise ConfigError(
                f"feature {mark('cache')} {c.cache_file} does not exist", param="cache", value=c.cache_file
            )
        files.add(c.cache_file)
        neg = c.negative_spec()
        if neg is not None and not neg.generated and neg.source != "base":
            files.add(pool_file(neg.source, c.cache_file))
    return {path: cache_identity(path) for path in sorted(files)}


def cell_identity(cell: Cell, prints: dict[Path, str]) -> dict[str, Any]:
    """The cell's identity in the results layer, with the fingerprints of the files it reads."""
    neg = cell.negative_spec()
    pool = None if neg is None or neg.generated or neg.source == "base" else pool_location(neg.source, None)[0]
    return cell.result_identity(prints[cell.cache_file], None if pool is None else prints[pool])


def cell_keys(cells: Sequence[Cell], prints: dict[Path, str]) -> dict[int, tuple[dict[str, Any], str]]:
    """``{cell.index: (identity, results key)}``."""
    out = {}
    for c in cells:
        ident = cell_identity(c, prints)
        out[c.index] = (ident, identity_key(ident))
    return out


# ---------------------------------------------------------------------------------------------
# Scheduling


def schedule(cells: Sequence[Cell], pending: Sequence[Cell]) -> list[Cell]:
    """``pending`` ordered so that each cache is read once and each episode set drawn once: caches
    in order of first appearance in ``cells``, then episode settings, then negatives, then ``cells``' order."""

    def first(key: Any) -> dict[Any, int]:
        return {k: i for i, k in reversed(list(enumerate(key(c) for c in cells)))}

    caches, episodes, negatives = first(lambda c: c.cache_file), first(Cell.episode_key), first(Cell.negative_key)
    return sorted(
        pending,
        key=lambda c: (caches[c.cache_file], episodes[c.episode_key()], negatives[c.negative_key()], c.index),
    )


def _joins(call: Sequence[Cell], c: Cell) -> bool:
    """Whether ``c`` can be solved in ``call``: the same episodes and preprocessing, and, if it reads
    negatives, the same ones as the cells of the call that read some (proto joins any call)."""
    c0 = call[0]
    if (c.episode_key(), c.preprocess) != (c0.episode_key(), c0.preprocess):
        return False
    users = [x for x in call if x.negatives != "none"]
    return c.negatives == "none" or not users or c.negative_key() == users[0].negative_key()


def calls(pending: Sequence[Cell], size: int) -> list[list[Cell]]:
    """Consecutive runs of cells that share episodes and negatives (:func:`_joins`), at most ``size`` long."""
    size = max(1, int(size))
    out: list[list[Cell]] = []
    for c in pending:
        if out and len(out[-1]) < size and _joins(out[-1], c):
            out[-1].append(c)
        else:
            out.append([c])
    return [sorted(batch, key=lambda c: c.index) for batch in out]  # records in the cells' order


# ---------------------------------------------------------------------------------------------
# Inputs


class Inputs:
    """The features, preprocessing and episodes of the cells in flight, each made once and kept
    while the schedule needs it (one cache split at a time).

    Episodes drawn for one call only are an :class:`~poodle.episodes.EpisodeStream` (each chunk is
    drawn by the worker that solves it); those that several calls share are drawn once
    (:meth:`keep`). An episode file is read once.
    """

    def __init__(self, on_event: OnEvent = ignore) -> None:
        self.on_event = on_event
        self._features: tuple[tuple[Path, str], SplitFeatures] | None = None
        self._preprocessed: dict[str, tuple[SplitFeatures, Preprocessor]] = {}
        self._episodes: dict[tuple, EpisodeSet | EpisodeStream] = {}
        self._shared: Counter[tuple] = Counter()
        self.load_seconds = 0.0
        self.sample_seconds = 0.0
        self._said: set[str] = set()

    def keep(self, call_list: Sequence[Sequence[Cell]]) -> None:
        """Tell which episode settings several calls share (those are drawn once, in full)."""
        self._shared = Counter(batch[0].episode_key() for batch in call_list)

    def features(self, cell: Cell) -> SplitFeatures:
        key = (cell.cache_file, cell.spec.split)
        if self._features is None or self._features[0] != key:
            t0 = time.perf_counter()
            self._features = None  # free the previous split before reading the next
            self._preprocessed, self._episodes = {}, {}
            self._features = (key, read_split(cell.cache_file, cell.spec.split))
            self.load_seconds += time.perf_counter() - t0
        return self._features[1]

    def preprocessed(self, cell: Cell) -> tuple[SplitFeatures, Preprocessor]:
        """The cell's split under its preprocessing, and the fitted transform (the negative pool
        gets it too)."""
        features = self.features(cell)
        if cell.preprocess not in self._preprocessed:

            def say(message: str) -> None:
                self.on_event(Notice("preprocess-fallback", message, ("preprocess",)))

            pre = Preprocessor.from_cache(cell.preprocess, cell.cache_file, log=say)
            self._preprocessed = {cell.preprocess: (pre.split(features), pre)}
        return self._preprocessed[cell.preprocess]

    def episodes(self, cell: Cell) -> EpisodeSet | EpisodeStream:
        """The cell's episodes: its episode file's, or drawn (a stream unless several calls share them)."""
        features = self.features(cell)
        key = cell.episode_key()
        if key not in self._episodes:
            t0 = time.perf_counter()
            eps: EpisodeSet | EpisodeStream
            if cell.episodes_from is not None:
                eps = load_episodes(cell.episodes_from)
                eps.check_against(features.labels, where=str(cell.episodes_from))
            else:
                eps = EpisodeStream(features.labels, cell.spec, cell.n_episodes, classes=features.classes)
                # ragged episodes are chunked by their shapes (buckets of similar size), known only
                # once drawn: they are drawn up front (600 per domain is Meta-Dataset's count)
                if self._shared[key] > 1 or eps.ragged:
                    eps = eps.materialize()
            self._episodes[key] = eps
            self.sample_seconds += time.perf_counter() - t0
        return self._episodes[key]

    def notice(self, event: Notice) -> None:
        """Emit ``event`` once per run (a word about every call would repeat it)."""
        if event.message not in self._said:
            self._said.add(event.message)
            self.on_event(event)

    def put(self, cell: Cell, episodes: EpisodeSet) -> None:
        """Use ``episodes`` (drawn and completed by the caller, e.g. to save them) for ``cell``'s setting."""
        self.features(cell)
        self._episodes[cell.episode_key()] = episodes


# ---------------------------------------------------------------------------------------------
# Solving and records


Solved = dict[str, tuple[torch.Tensor, dict[str, Any]]]  # {results key: (float64 [E] accuracies, info)}


def solve_call(
    batch: Sequence[Cell],
    keys: dict[int, tuple[dict[str, Any], str]],
    inputs: Inputs,
    options: RunOptions,
    device: torch.device,
    on_event: OnEvent,
    rows: range | None = None,
    ready: bool = False,
) -> Solved:
    """Solve ``batch`` (cells sharing episodes and negatives) with one :func:`~poodle.evaluate.evaluate`,
    on the episodes ``rows`` only when given (a rank's share)."""
    c0 = batch[0]
    users = [c for c in batch if c.negatives != "none"]
    features, pre = inputs.preprocessed(c0)
    episodes: Any = inputs.episodes(c0)
    if rows is not None:  # negatives are drawn per episode number: a share draws its own
        episodes = episodes[rows.start : rows.stop]
    labels = {c.index: keys[c.index][1] for c in batch}
    # each method as the cell holds it, resolved and configured (the config checked when the cell
    # was made): evaluate and its chunks trust them
    methods = [(labels[c.index], c.solver, c.cfg) for c in batch]
    stats: dict[str, Any] = {}
    raw = inputs.features(c0)
    # a preprocessing's copy is solved; the split as read stays in memory beside it (Inputs keeps it)
    also = {} if features is raw else {"the split as read, before preprocessing": _nbytes(raw.features)}

    def planned(plan: ChunkPlan) -> None:
        if options.max_memory is not None and device.type == "cpu" and pre.working_bytes:
            inputs.notice(
                Notice(
                    "memory-beyond-bound",
                    f"{mark('max_memory')} {_mib(plan.budget)} counts what each call holds ({_mib(plan.held)}) and its "
                    f"chunks; {mark('preprocess')} {pre.spec} also took {_mib(pre.working_bytes)} for a moment before "
                    f"solving (the rows it transforms, as float64), beyond the bound",
                    ("max_memory", "preprocess"),
                )
            )

    t0 = time.perf_counter()
    backend = backend_for(options)  # which arithmetic runs; afterwards, what ran
    accs = evaluate(
        features,
        episodes,
        methods,
        negatives=users[0].negative_spec() if users else None,
        cache_path=c0.cache_file,
        run=dataclasses.replace(
            options,
            device=device,
            workers=solve_workers() if options.workers is None and device.type == "cpu" else options.workers,
        ),
        hooks=Hooks(
            progress=lambda n: on_event(EpisodesSolved(n, len(batch))),
            ready=(lambda: on_event(Ready())) if ready else None,
            planned=planned,
            stats=stats,
        ),
        preprocess=pre,
        also_held=also,
        backend=backend,
        checked=True,  # each cell's negatives, against its method, when the cell was made
    )
    call_seconds = time.perf_counter() - t0
    info = {
        "call_seconds": round(call_seconds, 4),
        "call_cells": len(batch),
        "device": machine(device),
        "chunk_size": stats.get("chunk_size"),
        "workers": stats.get("workers"),
    }
    # A chunk is solved by every method of the call, one after another, and on CPU several chunk
    # workers run at once: a method's summed solve time is thread time, not a share of the wall
    # time. Its share of the call's wall time is apportioned by that summed time.
    worker = {c.index: float(stats["seconds"].get(labels[c.index], call_seconds / len(batch))) for c in batch}
    total = sum(worker.values())
    return {
        labels[c.index]: (
            accs[labels[c.index]].double().cpu(),
            {
                **info,
                "seconds": worker[c.index],
                "worker_seconds": round(worker[c.index], 4),
                "wall_seconds_share": round(
                    call_seconds * worker[c.index] / total if total > 0 else call_seconds / len(batch), 4
                ),
                # provenance, not identity: which arithmetic the method's fits ran here
                "formulation": backend.formulation(c.method, device),  # a cell holds the registered name
            },
        )
        for c in batch
    }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cell_record(
    cell: Cell,
    identity: dict[str, Any],
    acc: torch.Tensor,
    info: dict[str, Any],
    group: str,
    processes: int = 1,
    key: str | None = None,
) -> dict[str, Any]:
    """The results record of a solved cell (:func:`poodle.results.make_record`): its identity (and
    its key, when :func:`cell_keys` computed it), its label, cache as written, position and group,
    how and where it was solved, and ``acc [E]``; :func:`run_cells` makes it so where it appends it."""
    return make_record(
        identity,
        acc.tolist(),
        key=key,
        label=cell.label,
        cache=cell.cache,
        index=cell.index,
        group=group,
        processes=processes,
        **_how_solved(info, cell.episodes_from),
    )


def _how_solved(info: dict[str, Any], episodes_from: str | None) -> dict[str, Any]:
    """A record's fields of how, where and how fast a cell was solved (``info`` of
    :func:`solve_call`, its episode file), and the versions."""
    extra = {k: v for k, v in info.items() if k != "seconds"}
    if episodes_from is not None:
        extra["episodes_from"] = episodes_from
    return {"seconds": info["seconds"], "versions": versions(), **extra}


def as_cell(record: dict[str, Any], cell: Cell, group: str) -> dict[str, Any]:
    """A stored record shown as ``cell`` of this run (its label, cache name and position)."""
    return {**record, "label": cell.label, "cache": cell.cache, "index": cell.index, "group": group}


@dataclass
class CellRun:
    """What :func:`run_cells` did: every cell's record in cell order (each with the cell's label and
    index), the accuracies of the cells solved now by results key, and where the time went."""

    path: Path | None
    header: dict[str, Any]
    records: list[dict[str, Any]]
    accs: dict[str, torch.Tensor] = field(default_factory=dict)
    computed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    load_seconds: float = 0.0
    sample_seconds: float = 0.0
    solve_seconds: float = 0.0
    other_records: int = 0
    processes: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _finished(
    cells: Sequence[Cell], keys: dict[int, tuple[dict[str, Any], str]], results: ResultsFile | None, group: str
) -> dict[int, dict[str, Any]]:
    """The records the results file already holds for ``cells``, by cell index, shown as those cells."""
    if results is None:
        return {}
    return {c.index: as_cell(r, c, group) for c in cells if (r := results.get(keys[c.index][1])) is not None}


def run_cells(
    cells: Sequence[Cell],
    *,
    out: str | os.PathLike | None = None,
    meta: dict[str, Any] | None = None,
    resume: bool = True,
    group: str = "",
    options: RunOptions = RunOptions(),
    on_event: OnEvent = ignore,
    inputs: Inputs | None = None,
) -> CellRun:
    """Solve ``cells`` and write their records to the results file ``out`` (created with header
    fields ``meta`` when missing); with ``resume``, the cells it already holds are not solved again.

    Under torchrun rank 0 alone reads and writes the results file and tells the other ranks which
    cells are done; the calls (or, when fewer than the ranks, their episodes) are shared out, and
    rank 0 appends every record in the one-process order. Other ranks get a run without records.
    """
    t_start = time.perf_counter()
    cells = list(cells)
    inputs = inputs or Inputs(on_event)
    d = distributed.init(options.device)
    results: ResultsFile | None = None
    done: dict[int, dict[str, Any]] = {}
    with d.guard():
        keys = cell_keys(cells, fingerprints(cells))
        if d.main and out is not None:
            # created with its first record: a run that fails before (a bad row of the cache) leaves none
            results = ResultsFile(out, lazy=True, **(meta or {}))
            done = _finished(cells, keys, results, group) if resume else {}
    if d.enabled:
        done_idx = {int(i) for i in d.broadcast_json(sorted(done))}
    else:
        done_idx = set(done)
    emit = on_event if d.main else ignore
    if d.main:
        for n, c in enumerate(c for c in cells if c.index in done_idx):
            emit(CellFinished(c, done[c.index], n + 1, len(cells), skipped=True))
    pending: dict[str, Cell] = {}  # one computation per identity (two labels may name the same cell)
    for c in cells:
        if c.index not in done_idx:
            pending.setdefault(keys[c.index][1], c)
    call_list = calls(schedule(cells, list(pending.values())), options.cells_per_call)
    inputs.keep(call_list)
    run = CellRun(None if out is None else Path(out), results.header if results else {}, [])
    run.processes, run.device = d.world, d.device
    by_key: dict[str, dict[str, Any]] = {}
    n_done = len(done_idx)

    t0 = time.perf_counter()
    # the calls dealt out across torchrun's ranks by their episode counts (one process: each call
    # in turn, whole); rank 0 takes every record up in the calls' order
    for rnd in distributed.deal(d, [batch[0].n_episodes for batch in call_list]):
        local: Solved = {}
        with d.guard():
            if rnd.unit is not None:
                batch = call_list[rnd.unit]
                emit(CellsStarted(tuple(batch), n_done, len(cells)))
                ready = d.main and not by_key
                local = solve_call(batch, keys, inputs, options, d.device, emit, rnd.rows, ready=ready)
        solved = distributed.gather_results(d, local)
        if solved is None:  # not rank 0
            continue
        for c in (c for i in rnd.units for c in call_list[i]):
            identity, key = keys[c.index]
            acc, info = solved[key]
            record = by_key[key] = cell_record(c, identity, acc, info, group, d.world, key)
            if results is not None:
                results.append(record)
            run.accs[key] = acc
            done[c.index] = record
            n_done += 1
            emit(CellFinished(c, record, n_done, len(cells)))
    run.computed = len(by_key)
    run.solve_seconds = time.perf_counter() - t0
    run.load_seconds, run.sample_seconds = inputs.load_seconds, inputs.sample_seconds
    if d.main:
        # a cell with the identity of one solved above (another label) shares its record
        run.records = [done.get(c.index) or as_cell(by_key[keys[c.index][1]], c, group) for c in cells]
        own = {k for _, k in keys.values()}
        run.other_records = sum(1 for r in results.records if r["key"] not in own) if results else 0
        run.skipped = len(cells) - run.computed
    run.seconds = time.perf_counter() - t_start
    return run


__all__ = [
    "CellRun",
    "Inputs",
    "RunOptions",
    "as_cell",
    "calls",
    "cell_identity",
    "cell_keys",
    "cell_record",
    "fingerprints",
    "machine",
    "run_cells",
    "schedule",
    "solve_call",
    "versions",
]
