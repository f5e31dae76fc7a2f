"""Solve one episode setting with one or more methods: ``poodle solve`` without the table.

The methods become the cells of one setting (:func:`poodle.cells.make_cell`) and run through the
one pipeline (:func:`poodle.pipeline.run_cells`) as one call: the same episodes and negatives for
all of them, one record per method, optionally appended to a results file. What is particular to
``solve``: the episodes may come from an episode file (and then their negatives are the default of
the methods that read negatives), and the episodes may be saved with their negatives.

Errors name this function's parameters (``n_neg``, ``episodes_from``); the command line maps them
to its flags.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from poodle import defaults
from poodle.cells import Cell, make_cell
from poodle.distributed import is_main_process
from poodle.episodes import EpisodeSet, EpisodeSpec, load_episodes, save_episodes
from poodle.errors import ConfigError, EpisodeError
from poodle.evaluate import prepare_negatives
from poodle.events import OnEvent, ignore
from poodle.negatives import NegativeSpec
from poodle.pipeline import Inputs, RunOptions, run_cells
from poodle.settings import EPISODE_KEYS, GENERAL_KEYS, WHEN_SET_EPISODE_KEYS
from poodle.utils import check_output

# Settings that choose the episodes; they cannot be combined with ``episodes_from``.
EPISODE_PARAMS: tuple[str, ...] = EPISODE_KEYS + WHEN_SET_EPISODE_KEYS
# Every setting ``solve`` takes besides the methods: those of a grid cell but its cache and method.
SETTINGS: tuple[str, ...] = tuple(k for k in GENERAL_KEYS if k not in ("cache", "method"))


@dataclass
class SolveResult:
    """What :func:`solve` returns.

    Attributes:
        records: one results record per method, in the order given (``label`` = method name).
        accs: ``{method: float64 [E] accuracies}``.
        cells: the cells solved (one per method).
        spec, n_episodes: the episode setting and the number of episodes.
        negatives: the negatives of the methods that read them, or ``None`` when none does.
        cache: the cache file.
        device, processes, chunk_size: where and how the methods ran.
        solve_seconds, wall_seconds: time solving, and in the whole call.
    """

    records: list[dict[str, Any]]
    accs: dict[str, torch.Tensor]
    cells: list[Cell]
    spec: EpisodeSpec
    n_episodes: int
    negatives: NegativeSpec | None
    cache: Path
    device: torch.device
    processes: int = 1
    chunk_size: int | None = None
    solve_seconds: float = 0.0
    wall_seconds: float = 0.0


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
        raise ConfigError(
            f"save_episodes_to and out both name {out}; give two files", params=("save_episodes_to", "out")
        )
    if save_episodes_to is not None:
        check_output(save_episodes_to, "episodes", inputs=inputs, param="save_episodes_to")
    if out is not None:
        check_output(out, "results", inputs=inputs, param="out")


def _from_file(episodes_from: str | os.PathLike, settings: Mapping[str, Any]) -> tuple[EpisodeSet, dict[str, Any]]:
    """The episodes of a file and the settings they imply (their spec and count)."""
    clash = [k for k in EPISODE_PARAMS if settings.get(k) is not None]
    if clash:
        raise ConfigError(
            f"{', '.join(clash)} cannot be combined with episodes_from (the file fixes them)",
            params=(*clash, "episodes_from"),
        )
    eps = load_episodes(Path(episodes_from))
    return eps, {**eps.spec.settings(), "episodes": len(eps)}


def make_cells(
    cache: str | os.PathLike,
    methods: Sequence[str],
    options: Mapping[str, Mapping[str, Any]],
    settings: Mapping[str, Any],
    episodes: EpisodeSet | None = None,
    episodes_from: str | None = None,
) -> list[Cell]:
    """One cell per method on the setting ``settings`` (with ``episodes`` from ``episodes_from``: its
    setting, and its negatives for the methods that read some unless ``settings`` names others)."""
    methods = list(methods)
    if not methods:
        raise ConfigError("no method given", params=("methods",))
    dups = sorted({m for m in methods if methods.count(m) > 1})
    if dups:
        raise ConfigError(f"method {', '.join(dups)} given twice", params=("methods",))
    values = {k: v for k, v in settings.items() if v is not None}
    if episodes is not None and episodes.negatives is not None:
        values.setdefault("negatives", episodes.negative_source)
        values.setdefault("n_neg", int(episodes.negatives.shape[1]))
    cells = []
    for i, m in enumerate(methods):
        own = dict(options.get(m, {}))
        cell = make_cell(
            {**values, **own, "cache": str(cache), "method": m}, strict=set(own), episodes_from=episodes_from
        )
        cells.append(dataclasses.replace(cell, index=i))
    given = settings.get("negatives")
    if given not in (None, "none") and all(c.negatives == "none" for c in cells):
        raise ConfigError(
            f"negatives {given}: none of the chosen methods ({', '.join(methods)}) reads negatives",
            params=("negatives",),
        )
    return cells


def _save(inputs: Inputs, cells: Sequence[Cell], path: str | os.PathLike, cache: Path) -> None:
    """Draw the episodes (and the negatives of the methods that read some) and write them to ``path``."""
    c0 = next((c for c in cells if c.negatives != "none"), cells[0])
    eps = inputs.episodes(c0)
    eps = eps if isinstance(eps, EpisodeSet) else eps.materialize()
    neg = c0.negative_spec()
    if neg is not None:
        eps, _ = prepare_negatives(eps, neg, cache, inputs.features(c0).dim)
    inputs.put(c0, eps)
    save_episodes(path, eps, cache=str(cache))


def solve(
    cache: str | os.PathLike,
    methods: Sequence[str] = (defaults.METHOD,),
    *,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    episodes_from: str | os.PathLike | None = None,
    save_episodes_to: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    run: RunOptions = RunOptions(),
    on_event: OnEvent = ignore,
    **settings: Any,
) -> SolveResult:
    """Solve one episode setting with ``methods`` on identical episodes and negatives.

    Args:
        cache: the feature cache (HDF5).
        methods: registered method names (each at most once).
        options: ``{method: {option: value}}``; a method keeps its defaults for what is not given.
        episodes_from: an episodes file (:func:`poodle.episodes.save_episodes`) to solve; its
            negatives are the default of the methods that read negatives.
        save_episodes_to: write the episodes (with their negatives) here.
        out: a results file to append the records to (created when missing).
        run: device, memory bound and workers (:class:`poodle.pipeline.RunOptions`).
        on_event: receives the run's events (:mod:`poodle.events`); ``Ready`` comes once every check
            up front has passed, before solving starts.
        settings: ``split``, ``way``, ``shot``, ``query``, ``episodes``, ``seed``, ``imbalance``,
            ``query_classes`` (not with ``episodes_from``), ``negatives``, ``n_neg``, ``preprocess``;
            ``None`` or absent: the protocol's default (:mod:`poodle.defaults`). Giving negatives
            other than ``none`` when no method reads negatives is an error.

    Returns:
        a :class:`SolveResult`.
    """
    t_start = time.perf_counter()
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; settings are {', '.join(SETTINGS)}")
    path = Path(cache)
    check_outputs(path, episodes_from, settings.get("negatives"), save_episodes_to, out)
    episodes = None
    if episodes_from is not None:
        episodes, implied = _from_file(episodes_from, settings)
        settings = {**settings, **implied}
    cells = make_cells(
        path, methods, options or {}, settings, episodes, None if episodes_from is None else str(episodes_from)
    )
    inputs = Inputs(on_event)
    if episodes is not None:
        inputs.put(cells[0], episodes)
        # an error about the file's indices names the file, before anything is written
        try:
            episodes.check_against(inputs.features(cells[0]).labels, where=str(episodes_from))
        except EpisodeError as e:
            raise EpisodeError(f"episodes_from {e}", params=("episodes_from",)) from None
    if save_episodes_to is not None and is_main_process():
        _save(inputs, cells, save_episodes_to, path)
    res = run_cells(
        cells,
        out=out,
        meta={"command": "solve"},
        resume=False,
        group="solve",
        options=dataclasses.replace(run, cells_per_call=len(cells)),
        on_event=on_event,
        inputs=inputs,
    )
    users = [c for c in cells if c.negatives != "none"]
    return SolveResult(
        records=res.records,
        accs={c.method: res.accs[r["key"]] for c, r in zip(cells, res.records) if r["key"] in res.accs},
        cells=cells,
        spec=cells[0].spec,
        n_episodes=cells[0].n_episodes,
        negatives=users[0].negative_spec() if users else None,
        cache=path,
        device=res.device,
        processes=res.processes,
        chunk_size=next((r.get("chunk_size") for r in res.records), None),
        solve_seconds=res.solve_seconds,
        wall_seconds=time.perf_counter() - t_start,
    )


__all__ = ["EPISODE_PARAMS", "SETTINGS", "SolveResult", "check_outputs", "make_cells", "solve"]
