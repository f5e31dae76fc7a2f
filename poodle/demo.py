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
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from poodle import defaults
from poodle.errors import CacheError, ConfigError
from poodle.utils import atomic_path, file_sha256

DATASET = "glyphs"
# The transductive methods the paper compares with (Table 4 and appendix Tables 9-10): entropy
# minimisation, CAN-T, LaplacianShot, TIM-GD, mean-shift, Bayes k-means and soft k-means.
PAPER_COMPETITORS = ("entropy-min", "can-t", "laplacianshot", "tim-gd", "mean-shift", "bayes-kmeans",
                     "soft-kmeans")
COLUMNS = (("inductive", 1), ("inductive", 5), ("transductive", 1), ("transductive", 5))
ProgressFactory = Callable[[str, int], ContextManager[Callable[[int], None]]]


@dataclass
class DemoConfig:
    """What ``poodle demo`` runs. Defaults: a conv4 trained about 3 CPU minutes, the paper's
    evaluation protocol (2,000 episodes, 5-way, 15 queries, 400 negatives; section 5.1).

    ``quick`` shrinks everything for tests: a small subset of glyph classes, one epoch, few episodes.
    """

    cache_root: str = "cache"
    backbone: str = "conv4_64"
    image_size: int = 28
    recipe: str = "simple"
    epochs: int = 6
    batch_size: int = 64
    lr: float = 0.05
    augment: str = "crop"
    val_every: int = 3
    episodes: int = defaults.EPISODES
    way: int = defaults.WAY
    shots: tuple[int, ...] = (1, 5)
    query: int = defaults.QUERY
    n_neg: int = defaults.N_NEG
    seed: int = defaults.SEED
    device: str = defaults.DEVICE
    workers: int = 0
    max_memory: str = defaults.MAX_MEMORY
    competitors: str | tuple[str, ...] = "paper"
    quick: bool = False

    def __post_init__(self) -> None:
        self.shots = tuple(int(s) for s in self.shots)
        if self.episodes < 1 or self.epochs < 1:
            raise ConfigError("--episodes and --epochs must be positive")

    def train_config(self, dataset: str = DATASET, data_root: str | None = None):
        """The :class:`poodle.train.TrainConfig` of the demo's backbone."""
        from poodle.train import TrainConfig

        return TrainConfig(dataset=dataset, data_root=data_root, backbone=self.backbone, recipe=self.recipe,
                           epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, image_size=self.image_size,
                           augment=self.augment, val_every=self.val_every,
                           val_episodes=100 if self.quick else 500, seed=self.seed, workers=self.workers,
                           device=self.device, cache_root=self.cache_root)


def quick_config(**overrides: Any) -> DemoConfig:
    """The ``--quick`` settings (tests, smoke runs): a small glyph subset, 1 epoch, 40 episodes;
    ``overrides`` win."""
    opts: dict[str, Any] = dict(quick=True, epochs=1, episodes=40, val_every=1, batch_size=32)
    opts.update(overrides)
    return DemoConfig(**opts)


@dataclass
class Row:
    """One table row: a method (and its negatives) in every setting it supports."""

    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    negatives: str | None = None          # NegativeSpec source, or None
    settings: tuple[str, ...] = ("inductive",)


@dataclass
class DemoResult:
    """The table: ``cells[(row label, setting, shot)] = (mean %, 95% CI %)``, plus paths and times."""

    rows: list[Row]
    cells: dict[tuple[str, str, int], tuple[float, float]]
    checkpoint: Path
    features: Path
    markdown: Path
    json: Path
    seconds: dict[str, float]
    reused: dict[str, bool]
    config: DemoConfig

    def markdown_table(self) -> str:
        return markdown_table(self.rows, self.cells, self.config)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


LEGEND = ("Proto: nearest class mean; CE: prototypes fine-tuned with the support cross-entropy; "
          "POODLE-B / POODLE-R: CE + pull - push with negatives from the base classes / uniform random "
          "features; transductive: the queries are used as unlabelled data.")


def competitor_names(which: str | tuple[str, ...] | list[str]) -> list[str]:
    """Registered always-transductive methods selected by ``which``: ``paper`` (those the paper
    compares with, :data:`PAPER_COMPETITORS`), ``all``, ``none``, or names (a tuple or a
    comma-separated string). An unknown or non-transductive name is a ConfigError."""
    from poodle import solvers

    registered = [n for n in solvers.available() if solvers.get(n).transductive == "always"
                  and not solvers.get(n).uses_negatives]
    if isinstance(which, str):
        if which == "all":
            return registered
        if which == "none":
            return []
        names = list(PAPER_COMPETITORS) if which == "paper" else [w.strip() for w in which.split(",") if w.strip()]
    else:
        names = list(which)
    if which == "paper":
        return [n for n in names if n in registered]  # a missing solver leaves its row out
    for n in names:
        if n not in registered:
            raise ConfigError(f"--competitors: {n!r} is not a registered transductive method; choose from "
                              f"{', '.join(registered)} (or paper, all, none)")
    return names


def demo_rows(competitors: str | tuple[str, ...] = "paper") -> list[Row]:
    """The methods of the table: proto, CE, POODLE-B/-R, then the transductive competitors."""
    from poodle import solvers

    def settings_of(name: str) -> tuple[str, ...]:
        return solvers.get(name).settings()

    # short labels keep the printed table within 80 columns; LEGEND explains them
    rows = [Row("Proto", "proto", settings=settings_of("proto")),
            Row("CE", "ce", settings=settings_of("ce")),
            Row("POODLE-B", "poodle", negatives="base", settings=settings_of("poodle")),
            Row("POODLE-R", "poodle", negatives="random", settings=settings_of("poodle"))]
    for name in competitor_names(competitors):
        rows.append(Row(name, name, settings=("transductive",)))
    return rows


def _fmt(cell: tuple[float, float] | None) -> str:
    return "—" if cell is None else f"{cell[0]:.2f} ± {cell[1]:.2f}"


def markdown_table(rows: list[Row], cells: dict, cfg: DemoConfig) -> str:
    cols = [(s, k) for s, k in COLUMNS if k in cfg.shots]
    head = "| Method | " + " | ".join(f"{s} {k}-shot" for s, k in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r.label} | " + " | ".join(_fmt(cells.get((r.label, s, k))) for s, k in cols) + " |")
    return "\n".join(lines)


QUICK_GLYPHS = {"max_per_alphabet": 6, "instances": 20}  # ~100 classes, 2,000 images


def _data(cfg: DemoConfig, progress: Callable[[int], None] | None = None) -> tuple[str, str | None, Path]:
    """``(dataset, data_root, cache_root)`` for training and extraction.

    The full demo uses the ``glyphs`` dataset itself. ``--quick`` generates a reduced glyph set (its
    own folder) and reads it as a ``folder`` dataset, with its feature cache under
    ``<cache>/glyphs/quick/`` so it never mixes with the full demo's.
    """
    from poodle.data.glyphs import ensure_glyphs

    cache_root = Path(cfg.cache_root)
    if not cfg.quick:
        ensure_glyphs(cache_root, progress=progress)
        return DATASET, None, cache_root
    root = ensure_glyphs(cache_root, progress=progress, **QUICK_GLYPHS)
    return "folder", str(root), cache_root / DATASET / "quick"


def run_demo(cfg: DemoConfig, *, log: Callable[[str], None] = lambda s: None,
             train_callback: Callable | None = None,
             progress_factory: ProgressFactory | None = None) -> DemoResult:
    """Run (or reuse) every stage and return the table.

    Args:
        cfg: the demo's settings.
        log: receives one line per stage.
        train_callback: receives :class:`poodle.train.TrainEvent` s.
        progress_factory: ``(description, total) -> context manager yielding advance(n)`` (as
            :func:`poodle.extract.extract` takes it), used for extraction and evaluation progress.
    """
    from poodle.cache import read_split
    from poodle.extract import extract
    from poodle.train import train

    seconds: dict[str, float] = {}
    reused: dict[str, bool] = {}
    cache_root = Path(cfg.cache_root)
    demo_dir = cache_root / DATASET / "demo"

    t = time.perf_counter()
    dataset, data_root, data_cache = _data(cfg)
    seconds["glyphs"] = time.perf_counter() - t
    log(f"glyphs ready under {data_root or cache_root / DATASET} ({seconds['glyphs']:.1f} s)")

    t = time.perf_counter()
    tcfg = cfg.train_config(dataset, data_root)
    key = _digest(tcfg.defining())[:10]
    tcfg.out = str(cache_root / DATASET / "checkpoints" / f"{cfg.backbone}-{cfg.recipe}-demo-{key}")
    result = train(tcfg, callback=train_callback)
    reused["train"] = all(g["epochs_run"] == 0 for g in result.generations)
    seconds["train"] = time.perf_counter() - t
    checkpoint = Path(result.checkpoint)
    log(f"backbone {cfg.backbone} {'reused' if reused['train'] else 'trained'}: {checkpoint} "
        f"({seconds['train']:.1f} s)")

    t = time.perf_counter()
    extract_opts = dict(data_root=data_root, checkpoint=checkpoint, splits=("train", "val", "test"),
                        image_size=cfg.image_size, batch_size=256, device=cfg.device, cache_root=data_cache,
                        tag=f"demo-{key}", workers=cfg.workers, progress_factory=progress_factory)
    try:
        features = Path(extract(dataset, cfg.backbone, **extract_opts))
    except CacheError as e:
        # the checkpoint was retrained since (e.g. deleted by hand): its old features are stale
        log(f"replacing stale features ({e})")
        features = Path(extract(dataset, cfg.backbone, force=True, **extract_opts))
    seconds["extract"] = time.perf_counter() - t
    log(f"features: {features} ({seconds['extract']:.1f} s)")

    t = time.perf_counter()
    test = read_split(features, "test")
    rows = demo_rows(cfg.competitors)
    cells, n_solved = _evaluate_cells(cfg, rows, test, features, file_sha256(features), demo_dir,
                                      progress_factory)
    reused["evaluate"] = n_solved == 0
    seconds["evaluate"] = time.perf_counter() - t
    log(f"{len(cells)} table cells, {n_solved} solved now ({seconds['evaluate']:.1f} s)")

    md_path, json_path = _write_table(cfg, rows, cells, demo_dir, key, checkpoint, features, seconds)
    return DemoResult(rows, cells, checkpoint, features, md_path, json_path, seconds, reused, cfg)


def _evaluate_cells(cfg: DemoConfig, rows: list[Row], test, features_path: Path, features_sha: str,
                    demo_dir: Path, progress_factory: ProgressFactory | None
                    ) -> tuple[dict[tuple[str, str, int], tuple[float, float]], int]:
    """Solve (or load) every cell; episodes are shared by all methods of one shot count."""
    from poodle import solvers
    from poodle.episodes import EpisodeSpec, sample_episodes
    from poodle.evaluate import evaluate, summarize
    from poodle.negatives import NegativeSpec

    cells: dict[tuple[str, str, int], tuple[float, float]] = {}
    solved = 0
    for shot in cfg.shots:
        spec = EpisodeSpec(split="test", way=cfg.way, shot=shot, query=cfg.query, seed=cfg.seed)
        episodes = None
        # group the work by negative source: evaluate() takes one NegativeSpec per call
        todo: dict[str | None, list[tuple[str, str, Any, tuple[str, str, int], Path]]] = {}
        for row in rows:
            for setting in row.settings:
                options = dict(row.options)
                if solvers.get(row.method).transductive == "optional":
                    options["transductive"] = setting == "transductive"
                config = solvers.make_config(row.method, options)
                ident = {"features": features_sha, "spec": dataclasses.asdict(spec), "episodes": cfg.episodes,
                         "method": row.method, "config": dataclasses.asdict(config),
                         "negatives": row.negatives, "n_neg": cfg.n_neg if row.negatives else None,
                         "version": 1}
                path = demo_dir / "cells" / f"{_digest(ident)[:20]}.json"
                cell_key = (row.label, setting, shot)
                if path.exists():
                    saved = json.loads(path.read_text())
                    cells[cell_key] = (saved["mean"], saved["ci"])
                    continue
                label = f"{row.label} [{setting}]"
                todo.setdefault(row.negatives, []).append((label, row.method, config, cell_key, path))
        for source, items in todo.items():
            if episodes is None:
                episodes = sample_episodes(test.labels, spec, cfg.episodes, classes=test.classes)
            negatives = NegativeSpec(source=source, n_neg=cfg.n_neg) if source else None
            methods = [(label, method, config) for label, method, config, _, _ in items]
            desc = f"{shot}-shot, {len(methods)} method(s)" + (f", {source} negatives" if source else "")
            ctx = progress_factory(desc, cfg.episodes) if progress_factory else None
            with (ctx if ctx is not None else contextlib.nullcontext()) as advance:
                accs = evaluate(test, episodes, methods, negatives=negatives, cache_path=features_path,
                                device=cfg.device, max_memory=cfg.max_memory, progress=advance)
            for label, method, config, cell_key, path in items:
                acc = accs[label]
                mean, ci = summarize(acc * 100.0)
                cells[cell_key] = (float(mean), float(ci))
                with atomic_path(path) as tmp:
                    tmp.write_text(json.dumps({"label": cell_key[0], "setting": cell_key[1], "shot": shot,
                                               "method": method, "negatives": source, "mean": float(mean),
                                               "ci": float(ci), "episodes": int(acc.numel()),
                                               "accuracy": [round(float(a), 6) for a in acc]}))
                solved += 1
    return cells, solved


def _write_table(cfg: DemoConfig, rows: list[Row], cells, demo_dir: Path, key: str, checkpoint: Path,
                 features: Path, seconds: dict[str, float]) -> tuple[Path, Path]:
    md = (f"glyphs, {cfg.backbone} ({cfg.recipe}, {cfg.epochs} epochs, {cfg.image_size} px), "
          f"{cfg.episodes} episodes of {cfg.way}-way with {cfg.query} queries per class; "
          f"accuracy % with 95% CI\n\n" + markdown_table(rows, cells, cfg) + "\n\n" + LEGEND + "\n")
    payload = {"config": dataclasses.asdict(cfg), "checkpoint": str(checkpoint), "features": str(features),
               "seconds": seconds,
               "machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "cpu_count": os.cpu_count(), "torch": torch.__version__,
                           "torch_threads": torch.get_num_threads()},
               "rows": [{"label": r.label, "method": r.method, "negatives": r.negatives,
                         "cells": {f"{s} {k}-shot": list(cells[(r.label, s, k)])
                                   for s, k in COLUMNS if (r.label, s, k) in cells}} for r in rows]}
    tag = f"{key}-{_digest([cfg.episodes, cfg.shots, cfg.way, cfg.query, cfg.n_neg, cfg.seed])[:8]}"
    md_path, json_path = demo_dir / f"table-{tag}.md", demo_dir / f"table-{tag}.json"
    for path, text in ((md_path, md), (json_path, json.dumps(payload, indent=1))):
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return md_path, json_path

