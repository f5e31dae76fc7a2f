"""``poodle demo --protocol meta-dataset``: Meta-Dataset's per-domain table on the embedded glyphs.

Meta-Dataset (Triantafillou et al., "Meta-Dataset: A Dataset of Datasets for Learning to Learn from
Few Examples", ICLR 2020) reports each method on several domains, every episode drawn with its own
number of ways, its own imbalanced shots and its own queries. This module builds such a benchmark
without a download, from the demo's own backbone and features (:mod:`poodle.demo`):

- the domains (:data:`DOMAINS`) are groups of the glyphs' *test* alphabets (never seen in
  training), each written as its own feature cache: the rows of the demo's test features whose
  class belongs to the group, so no image is extracted twice;
- every domain draws its episodes by the Meta-Dataset rules with the bilevel rule on alphabets (an
  alphabet first, then its characters; ``EpisodeSpec(protocol="meta-dataset", bilevel=True)``), its
  own stream (the domain's name enters the seed, as a grid's ``cache`` does);
- the methods (:data:`DOMAIN_METHODS`) solve them as one grid over the domains' caches, and
  :func:`poodle.report.domain_table` makes the table: a column per domain, the mean over domains
  and the average rank with its 95% interval.

A second run reuses the checkpoint, the features, the domain caches and every finished cell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from poodle import defaults
from poodle.cache import read_attrs, read_split, write_arrays
from poodle.data import PixelCache
from poodle.demo import DATASET, DemoConfig, ProgressFactory, _data, _digest, _Stages
from poodle.errors import ConfigError
from poodle.grid import GridSpec, expand, parse_grid, run_grid
from poodle.pipeline import RunOptions
from poodle.report import DomainTable, domain_table, to_markdown
from poodle.utils import atomic_path

EPISODES = defaults.META_DATASET_EPISODES  # per domain, as Meta-Dataset reports
RESULTS_FILE = "results.jsonl"


@dataclass(frozen=True)
class Domain:
    """A domain of the benchmark: the glyphs' test classes of these alphabets."""

    name: str
    alphabets: tuple[str, ...]


# Two domains of two test alphabets each (docs/glyphs.md): letters of two scripts (74 + 120
# classes) and symbols of two Unicode blocks (53 + 122); the bilevel rule draws one alphabet, then
# 5 to 50 of its characters.
DOMAINS: tuple[Domain, ...] = (
    Domain("scripts", ("armenian", "georgian")),
    Domain("symbols", ("technical", "geometric")),
)


@dataclass(frozen=True)
class DomainMethod:
    """A row of the per-domain table: a registered method, its options and negatives."""

    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    negatives: str | None = None  # "base": the demo's train split as the pool


# Every method of the table, in its order. POODLE is transductive here, as the methods it is
# compared with; its negatives are the base classes' features (the demo's train split).
DOMAIN_METHODS: tuple[DomainMethod, ...] = (
    DomainMethod("Proto", "proto"),
    DomainMethod("POODLE-B", "poodle", {"transductive": True}, negatives="base"),
    DomainMethod("TIM-GD", "tim-gd"),
    DomainMethod("PT-MAP", "pt-map"),
    DomainMethod("LaplacianShot", "laplacianshot"),
    DomainMethod("BD-CSPN", "bd-cspn"),
    DomainMethod("CAN-T", "can-t"),
    DomainMethod("soft-kmeans", "soft-kmeans"),
    DomainMethod("BMS", "bms"),
)
# Ragged methods left out of the default table for its time (each costs 1.5-5x PT-MAP on these
# episodes: docs/demo.md); ``run_domain_demo(cfg, "all")`` or their names add them.
MORE_METHODS: tuple[DomainMethod, ...] = (
    DomainMethod("mean-shift", "mean-shift"),
    DomainMethod("bayes-kmeans", "bayes-kmeans"),
    DomainMethod("PADDLE", "paddle"),
    DomainMethod("protoLP", "proto-lp"),
)


def domain_methods(which: str | tuple[str, ...] = "ragged") -> list[DomainMethod]:
    """The rows: ``ragged`` (default: :data:`DOMAIN_METHODS`), ``all`` (with :data:`MORE_METHODS`),
    or labels/method names (a tuple or a
    comma-separated string, taken as given). An unknown name is a ConfigError."""
    if which == "ragged":
        return list(DOMAIN_METHODS)
    every = DOMAIN_METHODS + MORE_METHODS
    if which == "all":
        return list(every)
    names = [w.strip() for w in which.split(",") if w.strip()] if isinstance(which, str) else list(which)
    out: list[DomainMethod] = []
    for n in names:
        found = [m for m in every if n in (m.label, m.method)]
        if not found:
            known = ", ".join(m.method for m in every)
            raise ConfigError(
                f"methods: {n!r} is not a method of the per-domain demo; choose from {known}", param="methods", value=n
            )
        out.extend(m for m in found if m not in out)
    return out


def domain_config(**overrides: Any) -> DemoConfig:
    """The demo's settings with :data:`EPISODES` episodes per domain; ``overrides`` win."""
    opts: dict[str, Any] = {"episodes": EPISODES}
    opts.update(overrides)
    return DemoConfig(**opts)


def alphabet_of(class_name: str) -> str:
    """A glyph class's alphabet: its name up to the last ``_`` (``latin_ext_0100`` -> ``latin_ext``)."""
    return class_name.rsplit("_", 1)[0]


def write_domain_caches(features: Path, out_dir: Path, domains: tuple[Domain, ...] = DOMAINS) -> dict[str, Path]:
    """``{domain: cache}``: each domain's rows of the test split of ``features``, as a cache with one
    ``test`` split (its classes in the source's order, relabelled 0..C-1; rows already unit, kept
    bit for bit). A cache already there for the same checkpoint is reused, so its sha256, and with
    it every record's identity, stays. ConfigError when a domain has no class."""
    attrs = read_attrs(features)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    split = None
    for d in domains:
        path = out_dir / f"{features.stem}-{d.name}.h5"
        paths[d.name] = path
        if path.is_file() and read_attrs(path).get("checkpoint_sha256") == attrs["checkpoint_sha256"]:
            continue
        split = split if split is not None else read_split(features, "test")
        keep = [c for c, name in enumerate(split.classes) if alphabet_of(name) in d.alphabets]
        if not keep:
            raise ConfigError(
                f"domain {d.name!r}: no test class of {features} is in the alphabets {d.alphabets}",
                param="features",
                value=features,
            )
        new_label = np.full(len(split.classes), -1, dtype=np.int64)
        new_label[keep] = np.arange(len(keep))
        labels = new_label[split.labels.numpy()]
        rows = np.nonzero(labels >= 0)[0]
        item: tuple[Any, ...] = (split.features.numpy()[rows], labels[rows], [split.classes[c] for c in keep])
        if split.paths is not None:
            item += ([split.paths[i] for i in rows],)
        splits: dict[str, Any] = {"test": item}
        write_arrays(
            path,
            splits,
            dataset=f"{attrs['dataset']}-{d.name}",
            backbone=str(attrs["backbone"]),
            normalise=False,
            checkpoint_sha256=str(attrs["checkpoint_sha256"]),
            image_size=int(attrs.get("image_size", 0)),
            transform=str(attrs.get("transform", "none")),
            source_features=str(features),
            alphabets=",".join(d.alphabets),
        )
    return paths


def domain_grid(
    cfg: DemoConfig, rows: list[DomainMethod], caches: dict[str, Path], features: Path, out_dir: Path
) -> GridSpec:
    """The per-domain table as a grid: one explicit cell per method and domain, every method of a
    domain on the same episodes (Meta-Dataset protocol, bilevel on alphabets)."""
    cells = []
    for m in rows:
        for name in caches:
            entry: dict[str, Any] = {"label": m.label, "method": m.method, "cache": name, **m.options}
            if m.negatives == "base":
                entry["negatives"] = f"{Path(features).resolve()}:train"
            cells.append(entry)
    data = {
        "name": "demo-meta-dataset",
        "caches": {name: str(Path(p).resolve()) for name, p in caches.items()},
        "product": False,
        "cell": cells,
        "episodes": {
            "split": "test",
            "protocol": "meta-dataset",
            "bilevel": True,
            "episodes": cfg.episodes,
            "seed": cfg.seed,
        },
        "negatives": {"n_neg": cfg.n_neg},
    }
    return parse_grid(data, out_dir / "demo-meta-dataset.toml")


@dataclass
class DomainResult:
    """The per-domain table, its records (one per method and domain), paths and times."""

    methods: list[DomainMethod]
    table: DomainTable
    records: list[dict[str, Any]]
    caches: dict[str, Path]
    markdown: Path
    json: Path
    seconds: dict[str, float]
    reused: dict[str, bool]
    config: DemoConfig

    def markdown_table(self) -> str:
        return to_markdown(self.table)


def run_domain_demo(
    cfg: DemoConfig,
    methods: str | tuple[str, ...] = "ragged",
    *,
    log: Callable[[str], None] = lambda s: None,
    train_callback: Callable | None = None,
    progress_factory: ProgressFactory | None = None,
) -> DomainResult:
    """Run (or reuse) the demo's backbone and features, write the domain caches and solve the
    per-domain table (``cfg.episodes`` episodes per domain). Arguments as :func:`poodle.demo.run_demo`;
    ``methods`` as :func:`domain_methods`."""
    rows = domain_methods(methods)
    stages = _Stages(cfg, log, progress_factory)
    t = time.perf_counter()
    dataset, data_root, data_cache = _data(cfg)
    stages.seconds["glyphs"] = time.perf_counter() - t
    pixels = PixelCache(defaults.IMAGE_CACHE_BYTES)
    checkpoint, key = stages.train(dataset, data_root, pixels, train_callback)
    features = stages.extract(dataset, data_root, data_cache, checkpoint, key, pixels)
    pixels.clear()
    t = time.perf_counter()
    out_dir = stages.cache_root / DATASET / ("quick" if cfg.quick else "") / "demo-meta-dataset"
    caches = write_domain_caches(features, out_dir / "domains")
    stages.seconds["domains"] = time.perf_counter() - t
    log(f"{len(caches)} domain caches: {out_dir / 'domains'} ({stages.seconds['domains']:.1f} s)")

    t = time.perf_counter()
    spec = domain_grid(cfg, rows, caches, features, out_dir)
    cells = expand(spec)
    total = sum(c.n_episodes for c in cells)
    ctx = progress_factory("solving the domains", total) if progress_factory else None
    with ctx if ctx is not None else contextlib.nullcontext() as advance:
        run = run_grid(
            spec,
            out_dir / RESULTS_FILE,
            options=RunOptions(device=cfg.device, max_memory=cfg.max_memory, cells_per_call=len(cells)),
            cells=cells,
            on_event=stages.progress_events(advance),
        )
    stages.reused["evaluate"] = run.computed == 0
    stages.seconds["evaluate"] = time.perf_counter() - t
    log(
        f"{len(cells)} cells ({len(rows)} methods x {len(caches)} domains x {cfg.episodes} episodes), "
        f"{run.computed} solved now ({stages.seconds['evaluate']:.1f} s: sampling episodes "
        f"{run.sample_seconds:.1f} s, solving {run.solve_seconds:.1f} s)"
    )
    table = domain_table(run.records)
    md_path, json_path = _write(cfg, rows, table, run.records, out_dir, key, caches, stages.seconds)
    return DomainResult(rows, table, run.records, caches, md_path, json_path, stages.seconds, stages.reused, cfg)


def caption(cfg: DemoConfig, rows: list[DomainMethod], domains: tuple[Domain, ...] = DOMAINS) -> str:
    """What the table shows, in one paragraph."""
    doms = "; ".join(f"{d.name}: {' + '.join(d.alphabets)}" for d in domains)
    return (
        f"glyphs, {cfg.backbone} ({cfg.recipe}, {cfg.epochs} epoch{'s' if cfg.epochs > 1 else ''}); "
        f"{len(domains)} domains of test alphabets ({doms}); {cfg.episodes} Meta-Dataset episodes per domain "
        f"(5-50 ways, imbalanced shots, bilevel on alphabets), the same for every method; Proto inductive, "
        f"the others transductive; accuracy % with 95% CI. {len(rows)} methods."
    )


def _write(
    cfg: DemoConfig,
    rows: list[DomainMethod],
    table: DomainTable,
    records: list[dict[str, Any]],
    out_dir: Path,
    key: str,
    caches: dict[str, Path],
    seconds: dict[str, float],
) -> tuple[Path, Path]:
    md = caption(cfg, rows) + "\n\n" + to_markdown(table) + "\n"
    labels = [" ".join(str(v) for v in r) for r in table.rows]
    payload = {
        "config": dataclasses.asdict(cfg),
        "methods": [dataclasses.asdict(m) for m in rows],
        "domains": {d.name: {"alphabets": list(d.alphabets), "cache": str(caches[d.name])} for d in DOMAINS},
        "seconds": seconds,
        "per_domain": {
            lab: {
                str(table.cols[j][0]): [100 * table.entries[i, j].result.mean, 100 * table.entries[i, j].result.ci95]
                for j in range(len(table.cols))
                if (i, j) in table.entries
            }
            for i, lab in enumerate(labels)
        },
        "mean_over_domains": {
            lab: [100 * float(table.mean[i]), 100 * float(table.mean_ci[i])] for i, lab in enumerate(labels)
        },
        "average_rank": {
            lab: [float(table.rank[i]), float(table.rank_low[i]), float(table.rank_high[i])]
            for i, lab in enumerate(labels)
        },
    }
    tag = f"{key}-{_digest([cfg.episodes, cfg.n_neg, cfg.seed, [m.label for m in rows]])[:8]}"
    md_path, json_path = out_dir / f"table-{tag}.md", out_dir / f"table-{tag}.json"
    for path, text in ((md_path, md), (json_path, json.dumps(payload, indent=1))):
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return md_path, json_path


__all__ = [
    "DOMAINS",
    "DOMAIN_METHODS",
    "EPISODES",
    "MORE_METHODS",
    "Domain",
    "DomainMethod",
    "DomainResult",
    "alphabet_of",
    "caption",
    "domain_config",
    "domain_grid",
    "domain_methods",
    "run_domain_demo",
    "write_domain_caches",
]
