"""Solve one episode setting with one or more methods: read the cache, sample (or load) the episodes,
draw the negatives, evaluate every method on the same episodes, and return one results record per
method (:mod:`poodle.results`), optionally appended to a results file. ``poodle solve`` is this
function plus option parsing, a progress bar and a table.

Errors name this function's parameters (``n_neg``, ``episodes_from``); the command line maps them
to its flags.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from poodle import __version__, defaults, distributed, solvers
from poodle.cache import SplitFeatures, read_split
from poodle.episodes import EpisodeSet, EpisodeSpec, EpisodeStream, load_episodes, sample_episodes, save_episodes
from poodle.errors import ConfigError
from poodle.evaluate import prepare_negatives
from poodle.negatives import NegativeSpec, pool_location
from poodle.preprocess import Preprocessor
from poodle.results import ResultsFile, cache_identity, make_identity, make_record
from poodle.utils import check_output

# Parameters that choose the episodes; they cannot be combined with ``episodes_from``.
EPISODE_PARAMS = ("split", "way", "shot", "query", "episodes", "seed", "imbalance", "query_classes")


@dataclass
class SolveResult:
    """What :func:`solve` returns.

    Attributes:
        records: one results record per method, in the order given (``label`` = method name).
        accs: ``{method: float64 [E] accuracies}``.
        episodes: the episode set solved (negative indices attached when a pool was used), or the
            :class:`~poodle.episodes.EpisodeStream` it was drawn from chunk by chunk.
        negatives: the negatives used, or ``None`` when no method uses any.
        features: the split the episodes index.
        cache: the cache file.
        device: where the methods ran.
        stats: what :func:`poodle.evaluate.evaluate` reported (chunk size, workers, seconds per method).
        solve_seconds, wall_seconds: time in ``evaluate``, and in the whole call.
    """

    records: list[dict[str, Any]]
    accs: dict[str, torch.Tensor]
    episodes: EpisodeSet | EpisodeStream
    negatives: NegativeSpec | None
    features: SplitFeatures
    cache: Path
    device: torch.device
    stats: dict[str, Any] = field(default_factory=dict)
    solve_seconds: float = 0.0
    wall_seconds: float = 0.0


def versions() -> dict[str, str]:
    return {"poodle": __version__, "torch": torch.__version__, "python": platform.python_version()}


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({platform.processor() or platform.machine()})"


def _episodes(
    cache: Path, episodes_from: str | os.PathLike | None, given: Mapping[str, Any], lazy: bool = False
) -> tuple[SplitFeatures, EpisodeSet | EpisodeStream]:
    if episodes_from is not None:
        clash = [k for k in EPISODE_PARAMS if given.get(k) is not None]
        if clash:
            raise ConfigError(
                f"{', '.join(clash)} cannot be combined with episodes_from (the file fixes them)",
                params=(*clash, "episodes_from"),
            )
        eps = load_episodes(Path(episodes_from))
        features = read_split(cache, eps.spec.split)
        eps.check_against(features.labels, where=str(episodes_from))
        return features, eps
    g: dict[str, Any] = {
        k: (defaults.GENERAL_DEFAULTS.get(k) if given.get(k) is None else given[k]) for k in EPISODE_PARAMS
    }
    spec = EpisodeSpec.from_settings(g)
    spec.validate()
    features = read_split(cache, spec.split)
    # lazy: drawn chunk by chunk while solving (the same episodes), so solving starts at once
    draw = EpisodeStream if lazy else sample_episodes
    return features, draw(features.labels, spec, g["episodes"], classes=features.classes)


def check_outputs(
    cache: Path,
    episodes_from: str | os.PathLike | None,
    negatives: str | None,
    save_episodes_to: str | os.PathLike | None,
    out: str | os.PathLike | None,
) -> None:
    """Before any work: the output files must be writable, of their own kind (an episode file, a
    results file; never a cache or another kind of file, judged by content) and never an input."""
    inputs = [cache, episodes_from, negatives.split(":")[0] if negatives else None]
    if save_episodes_to is not None and out is not None and Path(save_episodes_to).resolve() == Path(out).resolve():
        raise ConfigError(f"--save-episodes and --out both name {out}; give two files")
    if save_episodes_to is not None:
        check_output(save_episodes_to, "episodes", inputs=inputs, what="--save-episodes")
    if out is not None:
        check_output(out, "results", inputs=inputs, what="--out")


def solve(
    cache: str | os.PathLike,
    methods: Sequence[str] = (defaults.METHOD,),
    *,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    split: str | None = None,
    way: int | None = None,
    shot: int | None = None,
    query: int | None = None,
    episodes: int | None = None,
    seed: int | None = None,
    imbalance: float | None = None,
    query_classes: int | None = None,
    negatives: str | None = None,
    n_neg: int | None = None,
    episodes_from: str | os.PathLike | None = None,
    save_episodes_to: str | os.PathLike | None = None,
    device: str | torch.device = defaults.DEVICE,
    max_memory: str | int | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    out: str | os.PathLike | None = None,
    preprocess: str | None = None,
    log: Callable[[str], None] | None = None,
    ready: Callable[[], None] | None = None,
) -> SolveResult:
    """Solve one episode setting with ``methods`` on identical episodes and negatives.

    Args:
        cache: the feature cache (HDF5).
        methods: registered method names (each at most once).
        options: ``{method: {option: value}}``; a method keeps its defaults for what is not given.
        split, way, shot, query, episodes, seed, imbalance: the episodes (``None``: the protocol's
            default, :mod:`poodle.defaults`); not with ``episodes_from``.
        query_classes: queries from only this many of the ``way`` classes (``None``: all).
        negatives, n_neg: the negative source and count for the methods that use negatives
            (``None``: those stored with ``episodes_from``, else base and 400). Giving a source other
            than ``none`` when no method uses negatives is an error.
        episodes_from: an episodes file (:func:`poodle.episodes.save_episodes`) to solve.
        save_episodes_to: write the episodes (with their negatives) here.
        device, max_memory, workers, progress: passed to :func:`poodle.evaluate.evaluate` (``max_memory``
            ``None``: :data:`poodle.defaults.MAX_MEMORY` on CPU, 80% of the free memory on CUDA). Under
            torchrun ``device`` is ``auto``, ``cuda`` or ``cpu`` (each process takes its local GPU) and
            ``progress`` counts rank 0's share.
        out: a results file to append the records to (created when missing).
        preprocess: ``l2n`` (default), ``cl2n`` or ``power[:BETA]`` (:mod:`poodle.preprocess`),
            applied to the split and the negative pool; recorded in the records.
        log: receives a line when the preprocessing falls back (a cache without raw norms).
        ready: called once (rank 0) when the checks up front (options, cache, episodes, negatives and
            their pool, outputs, the memory bound) have passed, before solving starts: where a caller
            starts its progress display, so that an error in the checks is reported alone.

    Returns:
        a :class:`SolveResult`.
    """
    t_start = time.perf_counter()
    # Under torchrun (poodle.distributed) every rank prepares the same episodes and negatives (in a
    # guard: an error is printed once), solves its share, and rank 0 gathers the accuracies in
    # episode order and writes; the other ranks get a result without records.
    d = distributed.init(device)
    dev = d.device
    with d.guard():
        methods = list(methods)
        if not methods:
            raise ConfigError("no method given", params=("methods",))
        dups = sorted({m for m in methods if methods.count(m) > 1})
        if dups:
            raise ConfigError(f"method {', '.join(dups)} given twice", params=("methods",))
        options = options or {}
        configs = [(m, m, solvers.make_config(m, options.get(m, {}), strict=True)) for m in methods]
        path = Path(cache)
        if path.is_dir():
            raise ConfigError(f"cache {path} is a directory, not a feature cache file")
        if not path.is_file():
            raise ConfigError(f"no feature cache at {path}")
        check_outputs(path, episodes_from, negatives, save_episodes_to, out)
        features, eps = _episodes(
            path,
            episodes_from,
            dict(
                split=split,
                way=way,
                shot=shot,
                query=query,
                episodes=episodes,
                seed=seed,
                imbalance=imbalance,
                query_classes=query_classes,
            ),
            lazy=save_episodes_to is None and not d.enabled,
        )
        users = [m for _, m, c in configs if solvers.get(m).needs_negatives(c)]
        # an episode file's negatives are the default only for methods that use negatives: replaying
        # POODLE's episodes with proto alone must not ask for them
        if episodes_from is not None and users:
            if negatives is None and eps.negative_source:
                negatives = eps.negative_source
            if n_neg is None and eps.negatives is not None:
                n_neg = int(eps.negatives.shape[1])

        source = defaults.NEGATIVES if negatives is None else negatives
        count = defaults.N_NEG if n_neg is None else n_neg
        neg_spec = NegativeSpec(source, count) if users else None
        if users and source == "none":
            raise ConfigError(
                f"negatives none: method(s) {', '.join(users)} need negatives; use base, random, sphere or FILE",
                params=("negatives",),
            )
        if not users and negatives is not None and negatives != "none":
            raise ConfigError(
                f"negatives {negatives}: none of the chosen methods ({', '.join(methods)}) uses negatives",
                params=("negatives",),
            )
        pre = Preprocessor.from_cache(preprocess, path, log=log)
        features = pre.split(features)
        if not isinstance(eps, EpisodeStream):  # a stream draws its negatives per chunk in evaluate()
            eps, _ = prepare_negatives(eps, neg_spec or NegativeSpec("none", count), path, features.dim)

        if save_episodes_to is not None and d.main:
            assert isinstance(eps, EpisodeSet)  # drawn eagerly when saved (lazy=False)
            save_episodes(save_episodes_to, eps, cache=str(path))

    stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    accs = distributed.evaluate_shared(
        d,
        features,
        eps,
        configs,
        negatives=neg_spec,
        cache_path=path,
        device=dev,
        max_memory=max_memory,
        progress=progress,
        stats=stats,
        workers=workers,
        preprocess=pre,
        ready=ready if d.main else None,
    )
    solve_s = time.perf_counter() - t0
    if accs is None:  # not rank 0
        return SolveResult([], {}, eps, neg_spec, features, path, dev, stats, solve_s, time.perf_counter() - t_start)

    cache_id = cache_identity(path)
    neg_id = None
    if neg_spec is not None and not neg_spec.generated and neg_spec.source != "base":
        neg_id = cache_identity(pool_location(neg_spec.source, path)[0])
    spec = eps.spec
    episode = {
        "split": spec.split,
        "way": spec.way,
        "shot": spec.shot,
        "query": spec.query,
        "imbalance": spec.imbalance,
        "seed": spec.seed,
        "episodes": len(eps),
        "query_classes": spec.query_classes,
    }
    records = []
    for i, (label, name, cfg) in enumerate(configs):
        info = solvers.get(name)
        uses = info.needs_negatives(cfg)
        identity = make_identity(
            cache_id=cache_id,
            episode=episode,
            negatives=neg_spec.source if (uses and neg_spec) else "none",
            n_neg=neg_spec.n_neg if (uses and neg_spec) else None,
            method=name,
            options=solvers.config_dict(cfg),
            transductive=info.is_transductive(cfg),
            negatives_id=neg_id if uses else None,
            preprocess=pre.spec.key,
        )
        extra: dict[str, Any] = {
            "episodes_from": None if episodes_from is None else str(episodes_from),
            "device": machine(dev),
            "chunk_size": stats.get("chunk_size"),
            "workers": stats.get("workers"),
            "processes": stats.get("processes", 1),
            "versions": versions(),
        }
        records.append(
            make_record(
                identity,
                accs[label].tolist(),
                label=label,
                cache=str(path),
                index=i,
                group="solve",
                seconds=float(stats["seconds"][label]),
                **extra,
            )
        )
    if out is not None:
        results = ResultsFile(out, command="solve")
        for r in records:
            results.append(r)
    return SolveResult(records, accs, eps, neg_spec, features, path, dev, stats, solve_s, time.perf_counter() - t_start)


__all__ = ["EPISODE_PARAMS", "SolveResult", "machine", "solve", "versions"]
