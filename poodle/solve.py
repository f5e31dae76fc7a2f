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
import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from poodle import defaults
from poodle.cells import Cell, Locations, make_cell
from poodle.distributed import is_main_process
from poodle.episodes import EpisodeSet, EpisodeSpec, episodes_source, load_episodes, save_episodes
from poodle.errors import ConfigError, EpisodeError, PoodleError, WriteError, mark
from poodle.evaluate import prepare_negatives
from poodle.events import OnEvent, ignore
from poodle.negatives import NegativeSpec
from poodle.pipeline import Inputs, RunOptions, run_cells
from poodle.results import cache_identity
from poodle.settings import EPISODE_KEYS, GENERAL_KEYS, WHEN_SET_EPISODE_KEYS
from poodle.utils import check_output

DOMAIN_FIELD = "{domain}"  # in an episode file's name: one file per domain
_DOMAIN_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")  # a domain's name (a cache given as NAME=PATH)
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
        kept: the labels of the methods whose records ``out`` already held (same identity: cache,
            episodes, negatives, options), read back instead of solved again (``resume``).
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
    kept: tuple[str, ...] = ()


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
            f"{mark('save_episodes_to')} and {mark('out')} both name {out}; give two files",
            params=("save_episodes_to", "out"),
            param="out",
            value=out,
        )
    if save_episodes_to is not None:
        check_output(save_episodes_to, "episodes", inputs=inputs, param="save_episodes_to")
    if out is not None:
        check_output(out, "results", inputs=inputs, param="out")


def _from_file(episodes_from: str | os.PathLike, settings: Mapping[str, Any]) -> tuple[EpisodeSet, dict[str, Any]]:
    """The episodes of a file and the settings they imply (their spec and count). A setting given
    as well must be the file's (the command that wrote it, repeated, solves it)."""
    given = [k for k in EPISODE_PARAMS if settings.get(k) is not None]
    eps = _load(episodes_from) if given else None
    of_file = {k: len(eps) if k == "episodes" else getattr(eps.spec, k, None) for k in given} if eps else {}
    clash = [k for k in given if settings[k] != of_file[k]]
    if clash:
        raise ConfigError(
            f"{', '.join(f'{mark(k)}={settings[k]!r}' for k in clash)} cannot be combined with {mark('episodes_from')} "
            f"{episodes_from}: its episodes have {', '.join(repr(of_file[k]) for k in clash)} there "
            "(the file fixes them: leave it out, or give what the file has)",
            params=(*clash, "episodes_from"),
            param="episodes_from",
            value=episodes_from,
        )
    eps = eps if eps is not None else _load(episodes_from)
    return eps, {**eps.spec.settings(), "episodes": len(eps)}


def _load(episodes_from: str | os.PathLike) -> EpisodeSet:
    """The episodes of the file, an error about it said as of ``episodes_from`` (as the checks
    against the cache in :func:`_prepare` say theirs)."""
    try:
        return load_episodes(Path(episodes_from))
    except EpisodeError as e:
        raise EpisodeError(
            f"{mark('episodes_from')} {e.marked_text}", param="episodes_from", value=episodes_from
        ) from None


def make_cells(
    cache: str | os.PathLike,
    methods: Sequence[str],
    options: Mapping[str, Any],
    settings: Mapping[str, Any],
    episodes: EpisodeSet | None = None,
    episodes_from: str | None = None,
    domains: Mapping[str, str | os.PathLike] | None = None,
) -> list[Cell]:
    """One cell per method on the setting ``settings`` (``options``: ``{method: {option: value}}``
    or ``{method: config}``, as :func:`solve` takes them; with ``episodes`` from ``episodes_from``: its
    setting, and its negatives for the methods that read some unless ``settings`` names others).
    With ``domains`` (``{name: cache file}``), ``cache`` is one of its names: the cells record the
    name as their ``cache`` (a grid's ``[caches]`` name), and read its file."""
    # one name is one method, not a sequence of letters
    methods = [methods] if isinstance(methods, str) else list(methods)
    if not methods:
        raise ConfigError("no method given", params=("methods",), param="methods", value=methods)
    dups = sorted({m for m in methods if methods.count(m) > 1})
    if dups:
        raise ConfigError(f"{mark('methods')} {', '.join(dups)} given twice", param="methods", value=methods)
    unchosen = sorted(set(options) - set(methods), key=str)
    if unchosen:
        # as the command line refuses --set M.KEY=V for a method not given with --method
        raise ConfigError(
            f"{mark('options')} for {', '.join(map(str, unchosen))}, not among the chosen {mark('methods')} "
            f"{', '.join(methods)}",
            param="options",
            value=sorted(map(str, unchosen)),
        )
    values = {k: v for k, v in settings.items() if v is not None}
    if episodes is not None and episodes.negatives is not None:
        values.setdefault("negatives", episodes.negative_source)
        values.setdefault("n_neg", int(episodes.negatives.shape[1]))
    locations = Locations(caches={k: str(v) for k, v in domains.items()}) if domains else None
    cells = []
    for i, m in enumerate(methods):
        given = options.get(m, {})
        # a config built by the caller (the command line's, checked there) is the cell's as it is
        own = dict(given) if isinstance(given, Mapping) else {}
        cell = make_cell(
            {**values, **own, "cache": str(cache), "method": m},
            strict=set(own),
            episodes_from=episodes_from,
            locations=locations,
            config=None if isinstance(given, Mapping) else given,
            index=i,
        )
        cells.append(cell)
    given = settings.get("negatives")
    if given not in (None, "none") and all(c.negatives == "none" for c in cells):
        raise ConfigError(
            f"{mark('negatives')} {given}: none of the chosen methods ({', '.join(methods)}) reads negatives",
            params=("negatives",),
            param="negatives",
            value=given,
        )
    return cells


@dataclass
class _Prepared:
    """A setting checked and made into cells, its episode file read: ready to solve."""

    path: Path
    cells: list[Cell]
    inputs: Inputs
    episodes: EpisodeSet | None
    episodes_from: str | os.PathLike | None
    save_episodes_to: str | os.PathLike | None


def _prepare(
    cache: str | os.PathLike,
    methods: Sequence[str],
    options: Mapping[str, Any] | None,
    episodes_from: str | os.PathLike | None,
    save_episodes_to: str | os.PathLike | None,
    out: str | os.PathLike | None,
    on_event: OnEvent,
    settings: dict[str, Any],
    name: str | None = None,
    domains: Mapping[str, str | os.PathLike] | None = None,
) -> _Prepared:
    """Every check of :func:`solve` that comes before solving, and its cells."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)}; settings are {', '.join(SETTINGS)}",
            param="settings",
            value=unknown,
        )
    path = Path(cache)
    check_outputs(path, episodes_from, settings.get("negatives"), save_episodes_to, out)
    episodes = None
    if episodes_from is not None:
        episodes, implied = _from_file(episodes_from, settings)
        settings = {**settings, **implied}
    cells = make_cells(
        name if name is not None else path,
        methods,
        options or {},
        settings,
        episodes,
        None if episodes_from is None else str(episodes_from),
        domains=domains if name is not None else None,
    )
    return _Prepared(path, cells, Inputs(on_event), episodes, episodes_from, save_episodes_to)


def _solve(
    prep: _Prepared,
    out: str | os.PathLike | None,
    run: RunOptions,
    on_event: OnEvent,
    t_start: float,
    resume: bool = True,
) -> SolveResult:
    """Solve one setting as one call, its checks done (:func:`_prepare`; :func:`solve_domains` checks
    every domain before solving any). An episode file is checked against its cache first; the
    episodes the pipeline uses (read, or drawn and saved) are handed to it in its :class:`Inputs`."""
    cells, inputs, episodes, path = prep.cells, prep.inputs, prep.episodes, prep.path
    if episodes is not None:
        inputs.put(cells[0], episodes)
        assert prep.episodes_from is not None  # episodes come from a file here
        # the cache the file records first (the most precise message), then its indices (files
        # that record none); either error names the file, before anything is written
        drawn_from, drawn_id = episodes_source(prep.episodes_from)
        if drawn_id is not None and drawn_id != cache_identity(path):
            raise EpisodeError(
                f"{mark('episodes_from')} {prep.episodes_from}: its episodes were drawn from the cache {drawn_from} "
                f"(content {drawn_id[:12]}), not from {path} (content {cache_identity(path)[:12]}): solve them "
                "on the cache they index",
                params=("episodes_from",),
                param="episodes_from",
                value=prep.episodes_from,
            )
        try:
            episodes.check_against(inputs.features(cells[0]).labels, where=str(prep.episodes_from))
        except EpisodeError as e:
            raise EpisodeError(
                f"{mark('episodes_from')} {e}",
                params=("episodes_from",),
                param="episodes_from",
                value=prep.episodes_from,
            ) from None
    if prep.save_episodes_to is not None and is_main_process():
        # the episodes drawn (with the negatives of the methods that read some) and written; the
        # run solves them as saved
        c0 = next((c for c in cells if c.negatives != "none"), cells[0])
        eps = inputs.episodes(c0)
        eps = eps if isinstance(eps, EpisodeSet) else eps.materialize()
        neg = c0.negative_spec()
        if neg is not None:
            eps, _ = prepare_negatives(eps, neg, path, inputs.features(c0).dim)
        inputs.put(c0, eps)
        save_episodes(prep.save_episodes_to, eps, cache=str(path), cache_id=cache_identity(path))
    res = run_cells(
        cells,
        out=out,
        meta={"command": "solve"},
        resume=resume,
        group="solve",
        options=dataclasses.replace(run, cells_per_call=len(cells)),
        on_event=on_event,
        inputs=inputs,
    )
    users = [c for c in cells if c.negatives != "none"]
    # a record read back holds its per-episode accuracies: the paired differences need them
    accs = {
        c.method: res.accs[r["key"]] if r["key"] in res.accs else torch.tensor(r["acc"], dtype=torch.float64)
        for c, r in zip(cells, res.records)
        if r["key"] in res.accs or "acc" in r
    }
    return SolveResult(
        records=res.records,
        accs=accs,
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
        kept=tuple(c.label for c, r in zip(cells, res.records) if r["key"] not in res.accs),
    )


def _check_domain_name(name: str) -> None:
    """ConfigError unless ``name`` may name a domain (it enters file names and seeds)."""
    if not _DOMAIN_NAME.match(name):
        raise ConfigError(
            f"domain name {name!r} may hold letters, digits and _ . + - only",
            params=("cache",),
            param="cache",
            value=name,
        )


def solve(
    cache: str | os.PathLike,
    methods: Sequence[str] = (defaults.METHOD,),
    *,
    options: Mapping[str, Any] | None = None,
    episodes_from: str | os.PathLike | None = None,
    save_episodes_to: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    run: RunOptions = RunOptions(),
    on_event: OnEvent = ignore,
    name: str | None = None,
    resume: bool = True,
    **settings: Any,
) -> SolveResult:
    """Solve one episode setting with ``methods`` on identical episodes and negatives.

    Args:
        cache: the feature cache (HDF5).
        methods: registered method names (each at most once).
        options: ``{method: {option: value}}``; a method keeps its defaults for what is not given.
            A method's entry may be its config instead (:func:`poodle.solvers.make_config`; the
            command line's, built and checked once where the flags are read), used as it is.
        episodes_from: an episodes file (:func:`poodle.episodes.save_episodes`) to solve; its
            negatives are the default of the methods that read negatives.
        save_episodes_to: write the episodes (with their negatives) here.
        out: a results file to append the records to (created when missing).
        resume: a method whose record ``out`` already holds (the same identity: cache, episodes,
            negatives, options) is not solved again: its record is read back (``SolveResult.kept``).
            False: every method is solved and its new record supersedes the old one.
        run: device, memory bound and workers (:class:`poodle.pipeline.RunOptions`).
        on_event: receives the run's events (:mod:`poodle.events`); ``Ready`` comes once every check
            up front has passed, before solving starts.
        settings: ``split``, ``way``, ``shot``, ``query``, ``episodes``, ``seed``, ``imbalance``,
            ``query_classes`` (not with ``episodes_from``), ``negatives``, ``n_neg``, ``preprocess``;
            ``None`` or absent: the protocol's default (:mod:`poodle.defaults`). Giving negatives
            other than ``none`` when no method reads negatives is an error.
        name: the cache's name, recorded as the records' ``cache`` (a domain's name, as
            :func:`solve_domains` gives it); default: the path as given.

    Returns:
        a :class:`SolveResult`.
    """
    t_start = time.perf_counter()
    if name is not None:
        _check_domain_name(name)
    domains = None if name is None else {name: cache}
    prep = _prepare(cache, methods, options, episodes_from, save_episodes_to, out, on_event, settings, name, domains)
    return _solve(prep, out, run, on_event, t_start, resume)


# ---------------------------------------------------------------------------------------------
# Several domains


def domain_caches(items: Sequence[str]) -> dict[str, Path]:
    """``{domain name: cache file}`` of ``NAME=PATH`` items (``poodle solve --cache``, repeated); a
    bare path is named by its file (``data/cub.h5``: ``cub``). A name is letters, digits and
    ``_ . + -``; two domains cannot share one (the error says to name them)."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if sep and not any(c in name for c in "/\\") and not Path(item).is_file():
            path = rest.strip()
            name = name.strip()
            if not name or not path:
                raise ConfigError(
                    f"{mark('cache')} {item!r}: expected NAME=PATH or a path",
                    params=("cache",),
                    param="cache",
                    value=item,
                )
        else:
            path = item
            name = Path(item).stem
        if not _DOMAIN_NAME.match(name):
            raise ConfigError(
                f"{mark('cache')} {item!r}: domain name {name!r} may hold letters, digits and _ . + - only "
                "(give NAME=PATH)",
                params=("cache",),
                param="cache",
                value=item,
            )
        if name in out:
            raise ConfigError(
                f"{mark('cache')} {item!r}: domain {name!r} given twice (also {out[name]}); name each with NAME=PATH",
                params=("cache",),
                param="cache",
                value=item,
            )
        out[name] = Path(path)
    if not out:
        raise ConfigError(f"no feature {mark('cache')} given", params=("cache",), param="cache", value=items)
    return out


def _in_domain(name: str, error: PoodleError) -> PoodleError:
    """``error`` said of domain ``name`` (a write error keeps its own form: it names its file)."""
    if isinstance(error, WriteError):
        return error
    return type(error)(
        f"domain {name!r}: {error.marked_text}", params=error.params, hint=error.marked_hint, needs=error.needs
    )


def domain_seed(seed: int, domain: str) -> int:
    """The seed of domain ``domain``'s episodes in a run of several domains with seed ``seed``: 63
    bits of SHA-256 of both, so that each domain has its own stream, unchanged when domains are
    added or removed. Solving that cache alone with ``seed=domain_seed(seed, domain)`` gives the
    same episodes (and results)."""
    digest = hashlib.sha256(f"poodle-domain\0{int(seed)}\0{domain}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def domain_file(path: str | os.PathLike, domain: str, param: str) -> Path:
    """Domain ``domain``'s episode file: ``path`` with ``{domain}`` replaced by its name."""
    text = str(path)
    if DOMAIN_FIELD not in Path(text).name:
        raise ConfigError(
            f"{mark(param)} {text}: with several caches give one file per domain, a name holding {DOMAIN_FIELD} "
            f"(e.g. episodes-{DOMAIN_FIELD}.h5)",
            params=(param,),
            param=param,
            value=path,
        )
    return Path(text.replace(DOMAIN_FIELD, domain))


@dataclass
class DomainsResult:
    """What :func:`solve_domains` returns.

    Attributes:
        domains: ``{domain name: SolveResult}`` in the order given; each one's records have the
            name as ``cache``.
        records: every domain's records, domain by domain (what :func:`poodle.report.domain_table` reads).
        solve_seconds, wall_seconds: time solving (all domains), and in the whole call.
    """

    domains: dict[str, SolveResult]
    records: list[dict[str, Any]]
    solve_seconds: float = 0.0
    wall_seconds: float = 0.0


def solve_domains(
    caches: Mapping[str, str | os.PathLike],
    methods: Sequence[str] = (defaults.METHOD,),
    *,
    options: Mapping[str, Any] | None = None,
    episodes_from: str | os.PathLike | None = None,
    save_episodes_to: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    run: RunOptions = RunOptions(),
    on_event: OnEvent = ignore,
    resume: bool = True,
    **settings: Any,
) -> DomainsResult:
    """Solve the same setting on several domains (Meta-Dataset's evaluation): each cache is a domain,
    solved as :func:`solve` solves it alone with its name as ``cache`` and its own episodes.

    Each domain's episodes are drawn with the seed :func:`domain_seed` (``seed``, its name): its
    records hold that seed, so identical settings on two domains have distinct identities, and
    solving the cache alone with that seed gives the same results. ``episodes`` is per domain
    (Meta-Dataset protocol: 600 by default). ``episodes_from`` and ``save_episodes_to`` name one
    file per domain with ``{domain}`` in the file name (:func:`domain_file`); a negative pool file
    in ``negatives`` serves every domain. Every domain's setting and files are checked before any
    is solved.

    Args:
        caches: ``{domain name: cache file}`` (:func:`domain_caches`), at least one.
        others: as :func:`solve`.
    """
    t_start = time.perf_counter()
    if not caches:
        raise ConfigError(f"no feature {mark('cache')} given", params=("cache",), param="cache", value=caches)
    for name, path in caches.items():
        _check_domain_name(name)
        if not Path(path).is_file():  # before any domain is solved, not when its turn comes
            raise _in_domain(
                name, ConfigError(f"feature {mark('cache')} {path} does not exist", param="cache", value=str(path))
            )
    seed = settings.get("seed")
    base_seed = int(seed) if seed is not None else defaults.SEED
    preps: dict[str, _Prepared] = {}
    for name, path in caches.items():
        ep_from = None if episodes_from is None else domain_file(episodes_from, name, "episodes_from")
        save_to = None if save_episodes_to is None else domain_file(save_episodes_to, name, "save_episodes_to")
        if ep_from is not None and not ep_from.is_file():
            raise ConfigError(
                f"{mark('episodes_from')}: no episode file {ep_from} for domain {name!r}",
                params=("episodes_from",),
                param="episodes_from",
                value=episodes_from,
            )
        own = dict(settings)
        if ep_from is None:
            own["seed"] = domain_seed(base_seed, name)
        try:
            preps[name] = _prepare(path, methods, options, ep_from, save_to, out, on_event, own, name, caches)
        except PoodleError as e:
            raise _in_domain(name, e) from None
    results: dict[str, SolveResult] = {}
    for name, prep in preps.items():
        # what the cache's contents decide (its classes, an episode file's indices) is found as
        # the domain is solved; the domains before it are already in ``out``
        try:
            results[name] = _solve(prep, out, run, on_event, t_start, resume)
        except PoodleError as e:
            raise _in_domain(name, e) from None
    return DomainsResult(
        domains=results,
        records=[r for res in results.values() for r in res.records],
        solve_seconds=sum(r.solve_seconds for r in results.values()),
        wall_seconds=time.perf_counter() - t_start,
    )


__all__ = [
    "DOMAIN_FIELD",
    "EPISODE_PARAMS",
    "SETTINGS",
    "DomainsResult",
    "SolveResult",
    "check_outputs",
    "domain_caches",
    "domain_file",
    "domain_seed",
    "make_cells",
    "solve",
    "solve_domains",
]
