"""``poodle solve``: sample episodes from a feature cache and solve them all at once with one or more
methods; print mean accuracy +- 95% CI (and paired differences to the first method)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Sequence

import click

from poodle import defaults
from poodle.cli._common import (
    console,
    friendly_errors,
    from_project,
    keep,
    note,
    out,
    parse_set,
    progress_bar,
    progress_option,
    user_set,
)
from poodle.cli._schema import run_options, schema_options
from poodle.episodes import EpisodeSpec
from poodle.negatives import NegativeSpec
from poodle.preprocess import PreprocessSpec
from poodle.run import RunOptions
from poodle.settings import CellSpec

# CLI option -> (library config field, the one method it is for; None: every chosen method with that field).
# A field name that methods use with different meanings (solvers.homonyms: ``alpha`` is POODLE's pull
# weight and alpha-TIM's alpha-entropy order) has a flag per method, declared at the method's
# @register (``flags=``, read from the registry below); the shared spelling (--alpha) is kept for
# when the chosen methods give it one meaning, and is an error naming these flags otherwise.
_SHARED_OPTIONS: dict[str, tuple[str, str | None]] = {
    "alpha": ("alpha", None),
    "beta": ("beta", None),
    "steps": ("steps", None),
    "lr": ("lr", None),
    "label_smoothing": ("label_smoothing", None),
    "transductive": ("transductive", None),
    "no_stopgrad_pull": ("stopgrad_pull", None),
    "no_stopgrad_push": ("stopgrad_push", None),
    "preset": ("preset", None),
}


def _solver_options() -> dict[str, tuple[str, str | None]]:
    """The methods' own flags (from the registry), then the shared ones."""
    from poodle import solvers

    own = {flag: (field, m) for m in solvers.available() for flag, field in solvers.get(m).flags.items()}
    return {**own, **_SHARED_OPTIONS}


def _explicit(ctx: click.Context, name: str) -> bool:
    # the project file's values count as the user's: they reach the library as typed ones do
    return user_set(ctx, name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def method_flag(method: str, field: str) -> str:
    """How to set ``field`` of ``method`` alone: its own flag, else ``--set METHOD.FIELD=V``."""
    for opt, (f, only) in _solver_options().items():
        if only == method and f == field:
            return _flag(opt)
    return f"--set {method}.{field}=V"


def solver_configs(ctx: click.Context, methods: list[str], sets: tuple[str, ...]) -> dict[str, Any]:
    """Per-method configs built from only what the user gave explicitly (so every method keeps its
    own paper defaults): each checked here, once, where an error can name the flag that set the
    value, and handed to the library as it is. An explicit option no chosen method accepts, or a
    shared name (--alpha) that means different things for the chosen methods, is a ConfigError
    naming the flag."""
    from poodle import solvers
    from poodle.cli._common import given_as
    from poodle.errors import ConfigError

    given: list[tuple[str, str, Any, str | None]] = []  # (config field, how the user wrote it, value, method)
    for opt, (field, only) in _solver_options().items():
        if _explicit(ctx, opt):
            v = ctx.params[opt]
            if opt.startswith("no_stopgrad"):
                v = not v
            # a value from the project file is said with its file, table and key, as every other one
            given.append((field, given_as(ctx, {opt: _flag(opt)})[opt], v, only))
    in_file = given_as(ctx, {"sets": "--set"})["sets"].removeprefix("--set")  # " (poodle.toml [solve] set)"
    for item in sets:
        key, value = parse_set(item, "KEY=VALUE or METHOD.KEY=VALUE")
        method: str | None = None
        if "." in key:
            method, _, key = key.rpartition(".")
            try:
                method = solvers.get(method.strip().replace("_", "-")).name
            except ConfigError as e:
                raise ConfigError(f"--set {item!r}: {e}") from None
        given.append((key.strip(), f"--set {item.partition('=')[0].strip()}{in_file}", value, method))
    infos = {m: solvers.get(m) for m in methods}

    def accepts(m: str, field: str) -> bool:
        if field == "transductive":
            return infos[m].can_transduce
        return field in infos[m].options()

    per: dict[str, dict[str, Any]] = {m: {} for m in methods}
    how_set: dict[tuple[str, str], str] = {}
    for field, how, value, only in given:
        if only is not None:
            takers = [m for m in methods if infos[m].name == only]
            if not takers:
                raise ConfigError(
                    f"option {how} is for method {only}, which is not among the chosen method(s) "
                    f"{', '.join(methods)} (add --method {only})"
                )
            if not accepts(takers[0], field):
                raise ConfigError(f"option {how}: method {only} has no option {field!r}")
        else:
            takers = [m for m in methods if accepts(m, field)]
            if not takers:
                raise ConfigError(f"option {how} is not an option of the chosen method(s) {', '.join(methods)}")
            clash = solvers.homonyms(takers, field)
            if clash:
                what = [
                    f"{' and '.join(ms)}'s {meaning} ({', '.join(method_flag(m, field) for m in ms)})"
                    for meaning, ms in clash.items()
                ]
                raise ConfigError(
                    f"option {how} is ambiguous with methods {', '.join(methods)}: {field!r} is "
                    f"{'; '.join(what)}. Set each with its own flag"
                )
        for m in takers:
            if (m, field) in how_set:
                raise ConfigError(f"options {how_set[m, field]} and {how} both set {field!r} of method {m}")
            how_set[m, field] = how
            per[m][field] = value
    # each method's configuration checks its values now, before any work, with the flag named
    configs: dict[str, Any] = {}
    for m in methods:
        try:
            configs[m] = solvers.make_config(m, per[m], strict=True)
        except ConfigError as e:
            culprit = next((how_set[m, f] for f in e.params if (m, f) in how_set), None)
            raise ConfigError(f"{culprit}: {e}" if culprit else str(e)) from None
    return configs


def _cache_path(ctx: click.Context, cache: str | None, dataset: str | None, backbone: str | None) -> Path:
    """The cache to solve on: ``--cache``, else ``CACHE_ROOT/DATASET/BACKBONE[-TAG].h5``, else the cache
    that ``poodle extract`` wrote last under the cache root (of ``--dataset`` / ``--backbone`` when one
    is given), said on the first line. Typed options win over the project file's."""
    from poodle.errors import ConfigError
    from poodle.project import index_trouble, latest_cache

    cache_root, tag = ctx.params["cache_root"], ctx.params["tag"]
    if cache and (dataset or backbone):
        if from_project(ctx, "caches"):
            cache = None
        elif all(from_project(ctx, k) for k, v in (("dataset", dataset), ("backbone", backbone)) if v):
            dataset = backbone = None
    if cache and (dataset or backbone):
        raise ConfigError("give either --cache FILE or --dataset NAME --backbone NAME, not both")
    if cache:
        return Path(cache)
    if not (dataset and backbone):
        found = latest_cache(cache_root, dataset=dataset, backbone=backbone)
        if found is None:
            of = " and ".join(x for x in (backbone and f"backbone {backbone}", dataset and f"dataset {dataset}") if x)
            trouble = index_trouble(cache_root, dataset=dataset, backbone=backbone)
            raise ConfigError(
                f"no feature cache{' of ' + of if of else ''} written by poodle extract under {cache_root}"
                f"{': ' + trouble + ';' if trouble else ':'} make one with 'poodle extract --backbone NAME' or "
                f"give --cache FILE"
            )
        console.print(f"features: {found.path} (the cache poodle extract wrote last)", soft_wrap=True)
        return found.path
    path = Path(cache_root) / dataset / (backbone + (f"-{tag}" if tag else "") + ".h5")
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a feature cache file")
    if not path.is_file():
        near = sorted(p.name for p in path.parent.glob(f"{backbone}-*.h5")) if not tag else []
        hint = f"; beside it: {', '.join(near[:4])} (--tag picks one)" if near else ""
        raise ConfigError(f"no feature cache at {path} (run `poodle extract` or give --cache FILE){hint}")
    return path


def _domains(ctx: click.Context, caches: tuple[str, ...], dataset: str | None, backbone: str | None) -> dict[str, Path]:
    """``--cache`` as ``{domain name: file}`` (empty: no ``--cache``, the cache is found by
    :func:`_cache_path`). One ``--cache`` is one cache as today (a path holding ``=`` that names a
    file stays a path); several are domains (:func:`poodle.solve.domain_caches`)."""
    from poodle.solve import domain_caches

    if not caches:
        return {}
    if len(caches) == 1 and ("=" not in caches[0] or Path(caches[0]).is_file()):
        path = _cache_path(ctx, caches[0], dataset, backbone)
        return {path.stem: path}
    if (dataset or backbone) and not all(from_project(ctx, k) for k in ("dataset", "backbone") if ctx.params[k]):
        if not from_project(ctx, "caches"):
            from poodle.errors import ConfigError

            raise ConfigError("give either --cache FILE or --dataset NAME --backbone NAME, not both")
    return domain_caches(caches)


class _ListsMethods(click.Command):
    """``--help`` ends with every registered method and its one-line summary (imported lazily, so
    ``poodle --help`` does not load the solvers)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from poodle import solvers

        with formatter.section("Methods (--method)"):
            formatter.write_dl([(n, solvers.get(n).summary) for n in solvers.available()])
        super().format_epilog(ctx, formatter)


@click.command(cls=_ListsMethods, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--cache",
    "caches",
    multiple=True,
    metavar="[NAME=]PATH",
    type=click.Path(dir_okay=False),
    help="Feature cache file (HDF5) [default: the one `poodle extract` wrote last under --cache-root]. "
    "Repeated: several domains, each NAME=PATH (a bare path is named by its file), each with its own "
    "episodes, and the per-domain table.",
)
@click.option("--dataset", help="Dataset name: the cache is CACHE_ROOT/DATASET/BACKBONE[-TAG].h5.")
@click.option("--backbone", help="Backbone name (with --dataset).")
@click.option("--cache-root", default=defaults.CACHE_ROOT, show_default=True, type=click.Path(file_okay=False))
@click.option("--tag", help="Cache tag (with --dataset/--backbone).")
@click.option(
    "--method",
    "methods",
    multiple=True,
    default=(defaults.METHOD,),
    show_default=True,
    help="Method (repeatable); all run on the same episodes and negatives.",
)
@click.option("--transductive", is_flag=True, help="Use the queries (methods that can).")
@click.option("--pull-weight", type=float, help="POODLE's pull weight, alpha in the paper [1].")
@click.option("--push-weight", type=float, help="POODLE's push weight, beta in the paper [0.5].")
@click.option(
    "--entropy-alpha",
    type=float,
    help="alpha-TIM's alpha-entropy order [0: the authors' tuned value, 2 at 1 shot, 7 from 5 shots].",
)
@click.option(
    "--alpha",
    type=float,
    help="The 'alpha' of the one chosen method that has one (POODLE: --pull-weight, alpha-TIM: "
    "--entropy-alpha, PT-MAP ...); an error when the chosen methods give it different meanings.",
)
@click.option(
    "--beta",
    type=float,
    help="The 'beta' of the chosen method (POODLE: --push-weight, PT-MAP: power transform); as --alpha.",
)
@click.option("--steps", type=int, help="Optimisation steps [each method's default: 250 for POODLE].")
@click.option("--lr", type=float, help="Adam learning rate [1e-3].")
@click.option("--label-smoothing", type=float, help="CE label smoothing (ce) [0].")
@click.option("--no-stopgrad-pull", is_flag=True, help="Drop the stop-gradient in the pull term (Table 9).")
@click.option("--no-stopgrad-push", is_flag=True, help="Drop the stop-gradient in the push term (Table 9).")
@click.option("--preset", help="A method's named preset (e.g. tim-gd: poodle-paper).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Any config field of the methods (repeatable).")
@click.option(
    "--save-episodes",
    type=click.Path(dir_okay=False),
    help="Write the episodes (HDF5); with several --cache, one file a domain: {domain} in the name.",
)
@click.option(
    "--episodes-from",
    type=click.Path(dir_okay=False),
    help="Solve the episodes of this file; with several --cache, one a domain: {domain} in the name.",
)
@schema_options(EpisodeSpec, CellSpec, NegativeSpec, PreprocessSpec)
@schema_options(RunOptions, but=("cells_per_call",))  # solve's methods are one call
@click.option(
    "--out",
    "--json",
    "results_path",
    type=click.Path(dir_okay=False),
    help="Append one results record per method (JSON Lines, read by `poodle report`) to this file; "
    "a method whose record it already holds (same cache, episodes and options) is read back, not solved again.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Solve every method even if --out holds its record; the new records supersede the old ones.",
)
@click.pass_context
@progress_option
@friendly_errors
def solve(ctx: click.Context, **params: Any) -> None:
    """Sample episodes from a feature cache and solve them all at once."""
    from poodle import prefetch

    p = params
    domains = _domains(ctx, p["caches"], p["dataset"], p["backbone"])
    path = next(iter(domains.values())) if domains else _cache_path(ctx, None, p["dataset"], p["backbone"])
    episodes_from, save_episodes, results_path = p["episodes_from"], p["save_episodes"], p["results_path"]
    if not episodes_from:  # (an episodes file names its own split)
        # the cache read overlaps the import of torch below (see poodle.prefetch)
        prefetch.start_for_solve(path, p["split"], p["negatives"])

    from poodle.distributed import env_world, share
    from poodle.solve import DOMAIN_FIELD, SETTINGS, domain_file, solve_domains
    from poodle.solve import solve as run_solve

    methods = list(p["methods"])
    configs = solver_configs(ctx, methods, p["sets"])
    # only what the user gave: the library fills the defaults (and takes them from --episodes-from)
    given = {k: ctx.params[k] for k in SETTINGS if _explicit(ctx, k)}
    # under torchrun (poodle.distributed) rank 0 alone shows a bar (of its share) and prints
    world, rank, _ = env_world()
    episodes = p["episodes"]
    if not _explicit(ctx, "episodes") and p["protocol"] == "meta-dataset":
        episodes = defaults.META_DATASET_EPISODES
    n_domains = max(1, len(domains))
    total = (
        None if episodes_from or episodes < 1 else n_domains * len(share(episodes, world, rank))
    )  # < 1: the library says
    # drawn once the library's checks up front have passed (Ready): an error there comes alone
    bar = (
        progress_bar("solving", total=total, unit="episodes", lazy=True) if rank == 0 else contextlib.nullcontext(None)
    )
    with bar as advance:
        common = dict(
            options=configs,
            episodes_from=episodes_from,
            save_episodes_to=save_episodes,
            out=results_path,
            resume=not p["force"],
            run=run_options(p, RunOptions),
            on_event=solve_events(advance, results_path),
        )
        if len(domains) > 1:
            several = solve_domains(domains, methods, **common, **given)
        else:
            name = next(iter(domains), None) if domains and "=" in p["caches"][0] else None
            # a file name holding {domain} (a script looping over domains) is the domain's file
            label = name or Path(path).stem
            for key in ("episodes_from", "save_episodes_to"):
                if common[key] and DOMAIN_FIELD in Path(str(common[key])).name:
                    common[key] = domain_file(str(common[key]), label, key)
            save_episodes = common["save_episodes_to"]
            res = run_solve(path, methods, name=name, **common, **given)
    if rank == 0:
        solving = advance.rate() if advance is not None else None
        if len(domains) > 1:
            _domains_summary(several, domains, save_episodes, results_path, solving)
        else:
            _summary(res, path, save_episodes, results_path, solving)


def solve_events(advance: Any, results_path: str | None = None) -> Any:
    """The command line's listener of a solve: the progress bar, the notices, the cells kept in
    ``results_path`` and, after each event, a safe point to stop at (:mod:`poodle.interrupt`)."""
    from poodle import interrupt
    from poodle.events import CellFinished, EpisodesSolved, Notice, Ready

    written = [0]

    def on_event(event: Any) -> None:
        if isinstance(event, Ready) and advance is not None:
            advance.start()
        elif isinstance(event, EpisodesSolved) and advance is not None:
            advance(event.episodes)
        elif isinstance(event, Notice):
            note(event)
        elif isinstance(event, CellFinished) and results_path:
            written[0] += 1
            keep("cells", f"{written[0]} of {event.total} cells in {results_path}")
        interrupt.check()

    if not results_path:
        keep("cells", "no cell (without --out nothing is written)")
    return on_event


def _title(spec: Any) -> str:
    """A table's title of ``spec``: ``5-way 1-shot``; ``Meta-Dataset protocol`` and what of it is fixed."""
    if not spec.ragged:
        return f"{spec.way}-way {spec.shot}-shot"
    fixed = [f"{v} {k}" for k, v in (("way", spec.way), ("shot", spec.shot), ("query", spec.query)) if v]
    return "Meta-Dataset protocol" + (f" ({', '.join(fixed)})" if fixed else "")


def _inference(records: list[dict[str, Any]]) -> str:
    """Whether the methods used the queries, as their records say: ``transductive`` or ``inductive``
    when all agree, else ``transductive: poodle; inductive: proto``."""
    by: dict[bool, list[str]] = {True: [], False: []}
    for r in records:
        name = str(r.get("label") or r["method"])
        if name not in by[bool(r.get("transductive"))]:
            by[bool(r.get("transductive"))].append(name)
    if not by[False] or not by[True]:
        return "transductive" if by[True] else "inductive"
    return f"transductive: {', '.join(by[True])}; inductive: {', '.join(by[False])}"


def _rates(solving: float | None, episodes: int, seconds: float, chunks: str = "") -> str:
    """The throughput line: the progress line's rate (episodes solved a second from the moment
    solving started, ``solving``), then the rate over the whole run, loading and drawing included
    (``episodes`` in ``seconds``), which is lower by what those took."""
    whole = f"{episodes / seconds:,.1f} episodes/s" if seconds > 0 else "? episodes/s"
    run = f"over the whole run (loading, drawing and solving: {seconds:.1f} s wall{chunks})"
    return (f"{solving:,.1f} episodes/s solving (the progress line's rate), " if solving else "") + f"{whole} {run}"


def _summary(
    res: Any, path: Path, save_episodes: str | None, results_path: str | None, solving: float | None = None
) -> None:
    """The setting, the table (paired differences to the first method) and the throughput
    (``solving``: the progress bar's rate, :meth:`poodle.cli._common.Bar.rate`)."""
    from poodle.cli._common import render_table
    from poodle.report import solve_table, timing_note
    from poodle.system import formulations

    if save_episodes:
        console.print(f"episodes written to {save_episodes}")
    spec = res.spec
    title = _title(spec)
    console.print(
        f"{res.n_episodes:,} episodes: {spec.describe()}"
        + (f", imbalance kappa={spec.imbalance:g}" if spec.imbalance else "")
        + (f", queries from {spec.query_classes} of the {spec.way} classes" if spec.query_classes else "")
        + f", split {spec.split} of {path}; negatives: "
        + (f"{res.negatives.source} x {res.negatives.n_neg}" if res.negatives else "none")
        + f"; preprocess {res.records[0].get('preprocess', 'l2n')}; {_inference(res.records)}; device {res.device}"
        + (f" x {res.processes} processes" if res.processes > 1 else ""),
        highlight=False,
    )
    out.print(render_table(solve_table(res.records), title=f"{title}, {res.n_episodes:,} episodes"))
    why = timing_note(res.records)
    if why:
        console.print(why, highlight=False, soft_wrap=True)
    if len(res.kept) < len(res.records):  # a rate of nothing solved says nothing
        console.print(
            _rates(solving, res.n_episodes, res.solve_seconds, f", chunks of {res.chunk_size}"),
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"arithmetic: {formulations(res.records)}", highlight=False, soft_wrap=True)
    _appended(results_path, res.kept, len(res.records))


def _appended(results_path: str | None, kept: Sequence[str], n: int) -> None:
    """Where the records went: appended to ``results_path``, or read back from it (``kept``)."""
    if not results_path:
        return
    if kept:
        console.print(
            f"{', '.join(kept)}: read back from {results_path}, which holds their records (same cache, episodes "
            "and options); --force solves them again",
            highlight=False,
            soft_wrap=True,
        )
    if len(kept) < n:
        console.print(f"results appended to {results_path}")


def _domains_summary(
    res: Any,
    domains: dict[str, Path],
    save_episodes: str | None,
    results_path: str | None,
    solving: float | None = None,
) -> None:
    """Several domains: the setting, the per-domain table (:func:`poodle.report.domain_table`) and
    the throughput (as :func:`_summary`)."""
    from poodle.cli._common import render_table
    from poodle.report import domain_table
    from poodle.solve import domain_file
    from poodle.system import formulations

    first = next(iter(res.domains.values()))
    if save_episodes:
        console.print(
            "episodes written to " + ", ".join(str(domain_file(save_episodes, d, "save_episodes")) for d in domains),
            soft_wrap=True,
        )
    spec = first.spec
    console.print(
        f"{len(domains)} domains, {first.n_episodes:,} episodes each: {spec.describe()}, split {spec.split}; "
        + ", ".join(f"{d} = {p}" for d, p in domains.items())
        + "; negatives: "
        + (f"{first.negatives.source} x {first.negatives.n_neg}" if first.negatives else "none")
        + f"; {_inference(res.records)}; device {first.device}",
        highlight=False,
        soft_wrap=True,
    )
    table = domain_table(res.records)
    out.print(render_table(table, title=f"{_title(spec)}, {first.n_episodes:,} episodes per domain"))
    for line in table.notes:
        console.print(line, highlight=False, soft_wrap=True)
    n = sum(r.n_episodes for r in res.domains.values() if len(r.kept) < len(r.records))
    if n:  # a rate of nothing solved says nothing
        console.print(_rates(solving, n, res.solve_seconds), highlight=False, soft_wrap=True)
    console.print(f"arithmetic: {formulations(res.records)}", highlight=False, soft_wrap=True)
    kept = [f"{d}: {m}" for d, r in res.domains.items() for m in r.kept]
    _appended(results_path, kept, len(res.records))
