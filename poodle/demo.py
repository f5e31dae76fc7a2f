"""The whole pipeline on the embedded ``glyphs`` dataset, on a CPU, in minutes (``poodle demo``).

1. generate the glyphs image folder once (:func:`poodle.data.glyphs.ensure_glyphs`);
2. pre-train a small backbone on the base alphabets (:func:`poodle.train.train`);
3. extract L2-normalised features of every split into one cache (:func:`poodle.extract.extract`);
4. solve thousands of 5-way 1-shot and 5-shot test episodes with nearest prototypes, fine-tuned
   prototypes (CE), POODLE with base and with random negatives (inductive and transductive), and the
   transductive methods the paper compares with (Le et al., "POODLE: Improving Few-shot Learning via
   Penalizing Out-of-Distribution Samples", NeurIPS 2021, arXiv:2206.04679, Tables 2 and 3);
5. tabulate mean accuracy with 95% confidence intervals, as Markdown and JSON in the cache.

Every stage reuses what an earlier run left: the image folder, the checkpoint (its directory name
holds a hash of the training settings), the feature cache (tagged with the same hash) and each
table cell (a JSON file named by a hash of everything that determines it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import numpy as np
import torch

from poodle import defaults, solvers
from poodle.data import PixelCache
from poodle.data.glyphs import ensure_glyphs, glyphs_to_generate
from poodle.demo_settings import (
    DATASET,
    PAPER_COMPETITORS,
    QUICK,
    DemoConfig,
    competitor_names,
    quick_config,
)
from poodle.errors import CacheError
from poodle.events import CellFinished, EpisodesSolved, Event
from poodle.extract import extract
from poodle.grid import GridSpec, expand, parse_grid, run_grid
from poodle.pipeline import RunOptions
from poodle.report import Result, Table, build_table, to_markdown
from poodle.results import record_flat
from poodle.train import train
from poodle.utils import atomic_path, content_hash, resolve_device

RESULTS_FILE = "results.jsonl"
ProgressFactory = Callable[[str, int], ContextManager[Callable[[int], None]]]


@dataclass
class Row:
    """One table row: a method (and its negatives) in every setting it supports."""

    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    negatives: str | None = None  # NegativeSpec source, or None
    settings: tuple[str, ...] = ("inductive",)


@dataclass
class DemoResult:
    """The table (:class:`poodle.report.Table`), its records (one per cell), paths and times."""

    rows: list[Row]
    table: Table
    records: list[dict[str, Any]]
    checkpoint: Path
    features: Path
    markdown: Path
    json: Path
    seconds: dict[str, float]
    reused: dict[str, bool]
    config: DemoConfig

    def markdown_table(self) -> str:
        return to_markdown(self.table)

    def cell(self, label: str, setting: str, shot: int) -> tuple[float, float] | None:
        """``(mean %, 95% CI %)`` of a row in one column, or ``None`` when the row lacks it."""
        for r in self.records:
            if (r["label"], r["transductive"], r["episode"]["shot"]) == (label, setting == "transductive", shot):
                return 100 * r["mean"], 100 * r["ci95"]
        return None


def _digest(obj: Any) -> str:
    # json's default separators: the names of every demo run trained so far are made with them
    return content_hash(obj, separators=(", ", ": "))


LEGEND = (
    "Proto: nearest class mean; CE: prototypes fine-tuned with the support cross-entropy; "
    "POODLE-B / POODLE-R: CE + pull - push with negatives from the base classes / uniform random "
    "features; transductive: the queries are used as unlabelled data."
)


def demo_rows(competitors: str | tuple[str, ...] = "paper") -> list[Row]:
    """The methods of the table: proto, CE, POODLE-B/-R, then the transductive competitors."""

    def settings_of(name: str) -> tuple[str, ...]:
        return solvers.get(name).settings()

    # short labels keep the printed table within 80 columns; LEGEND explains them
    rows = [
        Row("Proto", "proto", settings=settings_of("proto")),
        Row("CE", "ce", settings=settings_of("ce")),
        Row("POODLE-B", "poodle", negatives="base", settings=settings_of("poodle")),
        Row("POODLE-R", "poodle", negatives="random", settings=settings_of("poodle")),
    ]
    for name in competitor_names(competitors):
        rows.append(Row(name, name, settings=("transductive",)))
    return rows


QUICK_GLYPHS: dict[str, Any] = {"max_per_alphabet": 6, "instances": 20}  # ~100 classes, 2,000 images


def _data(cfg: DemoConfig, progress_factory: ProgressFactory | None = None) -> tuple[str, str | None, Path]:
    """``(dataset, data_root, cache_root)`` for training and extraction.

    The full demo uses the ``glyphs`` dataset itself. ``--quick`` generates a reduced glyph set (its
    own folder) and reads it as a ``folder`` dataset, with its feature cache under
    ``<cache>/glyphs/quick/`` so it never mixes with the full demo's. A generation (first use:
    minutes) reports its images through ``progress_factory("generating glyphs", images)``.
    """
    cache_root = Path(cfg.cache_root)
    subset: dict[str, Any] = QUICK_GLYPHS if cfg.quick else {}
    n = glyphs_to_generate(cache_root, **subset) if progress_factory is not None else 0
    with progress_factory("generating glyphs", n) if progress_factory and n else contextlib.nullcontext() as advance:
        root = ensure_glyphs(cache_root, progress=advance, **subset)
    if not cfg.quick:
        return DATASET, None, cache_root
    return "folder", str(root), cache_root / DATASET / "quick"


@dataclass
class _Stages:
    """What the stages of one demo run share: the settings, the log, the times and reuse flags."""

    cfg: DemoConfig
    log: Callable[[str], None]
    progress_factory: ProgressFactory | None
    seconds: dict[str, float] = field(default_factory=dict)
    reused: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the device is read here, before the glyphs are generated (minutes) or anything is written
        resolve_device(self.cfg.device)

    @property
    def cache_root(self) -> Path:
        return Path(self.cfg.cache_root)

    def train(self, dataset: str, data_root: str | None, pixels: PixelCache, callback: Callable | None) -> tuple:
        """``(checkpoint, key)``: the backbone trained (or reused: its folder is named by the hash
        ``key`` of the training settings)."""
        cfg, t = self.cfg, time.perf_counter()
        tcfg = cfg.train_config(dataset, data_root)
        key = _digest(tcfg.defining())[:10]
        tcfg.out = str(self.cache_root / DATASET / "checkpoints" / f"{cfg.backbone}-{cfg.recipe}-demo-{key}")
        result = train(tcfg, callback=callback, pixel_cache=pixels)
        self.reused["train"] = all(g["epochs_run"] == 0 for g in result.generations)
        self.seconds["train"] = time.perf_counter() - t
        checkpoint = Path(result.checkpoint)
        how = "reused" if self.reused["train"] else "trained"
        self.log(f"backbone {cfg.backbone} {how}: {checkpoint} ({self.seconds['train']:.1f} s)")
        return checkpoint, key

    def extract(
        self, dataset: str, data_root: str | None, data_cache: Path, checkpoint: Path, key: str, pixels: PixelCache
    ) -> Path:
        """The features of every split (reused when the cache holds them for this checkpoint)."""
        cfg, t = self.cfg, time.perf_counter()
        opts: dict[str, Any] = dict(
            data_root=data_root,
            checkpoint=checkpoint,
            splits=("train", "val", "test"),
            image_size=cfg.image_size,
            batch_size=256,
            device=cfg.device,
            cache_root=data_cache,
            tag=f"demo-{key}",
            workers=cfg.workers,
            progress_factory=self.progress_factory,
            pixel_cache=pixels,
        )
        try:
            features = Path(extract(dataset, cfg.backbone, **opts))
        except CacheError as e:
            # the checkpoint was retrained since (e.g. deleted by hand): its old features are stale
            self.log(f"replacing stale features ({e})")
            features = Path(extract(dataset, cfg.backbone, force=True, **opts))
        self.seconds["extract"] = time.perf_counter() - t
        self.log(f"features: {features} ({self.seconds['extract']:.1f} s)")
        return features

    @staticmethod
    def progress_events(advance: Callable[[int], None] | None) -> Callable[[Event], None]:
        """A grid run's event handler that advances a progress bar by the episodes solved or found."""

        def on_event(event: Event) -> None:
            if advance is None:
                return
            if isinstance(event, CellFinished) and event.skipped:
                advance(event.cell.n_episodes)
            elif isinstance(event, EpisodesSolved):
                advance(event.episodes * event.cells)

        return on_event

    def table(self, rows: list[Row], features: Path, demo_dir: Path) -> Any:
        """The table's cells solved (or found in the demo's results file), as a grid run."""
        cfg, t = self.cfg, time.perf_counter()
        spec = demo_grid(cfg, rows, features, demo_dir)
        cells = expand(spec)
        ctx = (
            self.progress_factory("solving the table", sum(c.n_episodes for c in cells))
            if self.progress_factory
            else None
        )
        with ctx if ctx is not None else contextlib.nullcontext() as advance:
            options = RunOptions(device=cfg.device, max_memory=cfg.max_memory, cells_per_call=len(cells))
            on_event = self.progress_events(advance)
            run = run_grid(spec, demo_dir / RESULTS_FILE, options=options, cells=cells, on_event=on_event)
        self.reused["evaluate"] = run.computed == 0
        self.seconds["evaluate"] = time.perf_counter() - t
        self.log(
            f"{len(cells)} table cells, {run.computed} solved now ({self.seconds['evaluate']:.1f} s: reading the "
            f"cache {run.load_seconds:.1f} s, sampling episodes {run.sample_seconds:.1f} s, solving "
            f"{run.solve_seconds:.1f} s)"
        )
        return run


def run_demo(
    cfg: DemoConfig,
    *,
    log: Callable[[str], None] = lambda s: None,
    train_callback: Callable | None = None,
    progress_factory: ProgressFactory | None = None,
) -> DemoResult:
    """Run (or reuse) every stage and return the table.

    Args:
        cfg: the demo's settings.
        log: receives one line per stage.
        train_callback: receives :class:`poodle.train.TrainEvent` s.
        progress_factory: ``(description, total) -> context manager yielding advance(n)`` (as
            :func:`poodle.extract.extract` takes it), used for the glyph generation, extraction and
            evaluation progress.
    """
    stages = _Stages(cfg, log, progress_factory)
    demo_dir = stages.cache_root / DATASET / "demo"
    t = time.perf_counter()
    dataset, data_root, data_cache = _data(cfg, progress_factory)
    stages.seconds["glyphs"] = time.perf_counter() - t
    log(f"glyphs ready under {data_root or stages.cache_root / DATASET} ({stages.seconds['glyphs']:.1f} s)")
    # Training keeps the decoded train and val images here; extraction then reads them instead of
    # decoding them a second time (the test split is decoded once, by extraction).
    pixels = PixelCache(defaults.IMAGE_CACHE_BYTES)
    checkpoint, key = stages.train(dataset, data_root, pixels, train_callback)
    features = stages.extract(dataset, data_root, data_cache, checkpoint, key, pixels)
    pixels.clear()  # the images are not needed any more: free the memory before solving
    rows = demo_rows(cfg.competitors)
    run = stages.table(rows, features, demo_dir)
    table = demo_table(run.records)
    md_path, json_path = _write_table(
        cfg, rows, table, run.records, demo_dir, key, checkpoint, features, stages.seconds
    )
    return DemoResult(
        rows, table, run.records, checkpoint, features, md_path, json_path, stages.seconds, stages.reused, cfg
    )


def demo_grid(cfg: DemoConfig, rows: list[Row], features: Path, demo_dir: Path) -> GridSpec:
    """The demo's table as a grid: one explicit cell per row, over the shots and the row's settings,
    all on the same episodes per shot (so the rows are paired)."""
    entries = []
    for r in rows:
        entry: dict[str, Any] = {"label": r.label, "method": r.method, **r.options}
        if r.negatives:
            entry["negatives"] = r.negatives
        if solvers.get(r.method).transductive == "optional":
            entry["transductive"] = [s == "transductive" for s in r.settings]
        entries.append(entry)
    data = {
        "name": "demo",
        "cache": str(Path(features).resolve()),
        "product": False,
        "cell": entries,
        "episodes": {
            "split": "test",
            "way": cfg.way,
            "shot": list(cfg.shots),
            "query": cfg.query,
            "episodes": cfg.episodes,
            "seed": cfg.seed,
        },
        "negatives": {"n_neg": cfg.n_neg},
    }
    return parse_grid(data, demo_dir / "demo.toml")


def demo_table(records: list[dict[str, Any]]) -> Table:
    """The table of the demo's records: a row per label, columns inductive/transductive x shot."""
    results = [
        Result(record_flat(r), np.asarray(r["acc"], dtype=np.float64), RESULTS_FILE, i) for i, r in enumerate(records)
    ]
    table = build_table(results, rows=["label"], cols=["transductive", "shot"], bold="none")
    table.notes = []
    return table


def _write_table(
    cfg: DemoConfig,
    rows: list[Row],
    table: Table,
    records: list[dict[str, Any]],
    demo_dir: Path,
    key: str,
    checkpoint: Path,
    features: Path,
    seconds: dict[str, float],
) -> tuple[Path, Path]:
    md = (
        f"glyphs, {cfg.backbone} ({cfg.recipe}, {cfg.epochs} epochs, {cfg.image_size} px), "
        f"{cfg.episodes} episodes of {cfg.way}-way with {cfg.query} queries per class; "
        f"accuracy % with 95% CI\n\n" + to_markdown(table) + "\n" + LEGEND + "\n"
    )
    by_label: dict[str, dict[str, list[float]]] = {}
    for r in records:
        setting = "transductive" if r["transductive"] else "inductive"
        by_label.setdefault(r["label"], {})[f"{setting} {r['episode']['shot']}-shot"] = [
            100 * r["mean"],
            100 * r["ci95"],
        ]
    payload = {
        "config": dataclasses.asdict(cfg),
        "checkpoint": str(checkpoint),
        "features": str(features),
        "results": str(demo_dir / RESULTS_FILE),
        "seconds": seconds,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "rows": [
            {"label": r.label, "method": r.method, "negatives": r.negatives, "cells": by_label.get(r.label, {})}
            for r in rows
        ],
    }
    tag = f"{key}-{_digest([cfg.episodes, cfg.shots, cfg.way, cfg.query, cfg.n_neg, cfg.seed])[:8]}"
    md_path, json_path = demo_dir / f"table-{tag}.md", demo_dir / f"table-{tag}.json"
    for path, text in ((md_path, md), (json_path, json.dumps(payload, indent=1))):
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return md_path, json_path


__all__ = [
    "DATASET",
    "LEGEND",
    "PAPER_COMPETITORS",
    "QUICK",
    "RESULTS_FILE",
    "DemoConfig",
    "DemoResult",
    "Row",
    "competitor_names",
    "demo_grid",
    "demo_rows",
    "demo_table",
    "quick_config",
    "run_demo",
]
