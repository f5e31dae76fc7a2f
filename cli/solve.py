"""``poodle solve``: sample episodes from a feature cache and solve them all at once with one or more
methods; print mean accuracy +- 95% CI (and paired differences to the first method)."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from poodle.cli._common import SizeType, console, friendly_errors, out, progress_bar

# CLI option -> (config field, value to pass when the option is given)
_SOLVER_OPTIONS = {
    "alpha": "alpha", "beta": "beta", "steps": "steps", "lr": "lr", "label_smoothing": "label_smoothing",
    "transductive": "transductive", "no_stopgrad_pull": "stopgrad_pull", "no_stopgrad_push": "stopgrad_push",
    "preset": "preset",
}


def _explicit(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def solver_options(ctx: click.Context, methods: list[str], sets: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per-method option dicts holding only what the user gave explicitly (so every method keeps its
    own paper defaults). An explicit option no chosen method accepts is a ConfigError naming it."""
    from poodle import solvers
    from poodle.errors import ConfigError
    from poodle.solvers.base import config_fields

    given: dict[str, tuple[str, Any]] = {}          # config field -> (how the user wrote it, value)
    for opt, field in _SOLVER_OPTIONS.items():
        if _explicit(ctx, opt):
            v = ctx.params[opt]
            if opt.startswith("no_stopgrad"):
                v = not v
            given[field] = (_flag(opt), v)
    for item in sets:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        given[key] = (f"--set {key}", value.strip())
    infos = {m: solvers.get(m) for m in methods}

    def accepts(m: str, field: str) -> bool:
        if field == "transductive":
            return infos[m].transductive != "never"
        return field in config_fields(infos[m].config)

    per: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for field, (how, value) in given.items():
        takers = [m for m in methods if accepts(m, field)]
        if not takers:
            raise ConfigError(f"option {how} is not an option of the chosen method(s) {', '.join(methods)}")
        for m in takers:
            per[m][field] = value
    return per


def _cache_path(cache: str | None, dataset: str | None, backbone: str | None, cache_root: str,
                tag: str | None) -> Path:
    from poodle.errors import ConfigError

    if cache and (dataset or backbone):
        raise ConfigError("give either --cache FILE or --dataset NAME --backbone NAME, not both")
    if cache:
        return Path(cache)
    if not (dataset and backbone):
        raise ConfigError("which features? give --cache FILE, or --dataset NAME and --backbone NAME")
    return Path(cache_root) / dataset / (backbone + (f"-{tag}" if tag else "") + ".h5")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        pv = version("poodle")
    except PackageNotFoundError:
        pv = "unknown"
    return {"poodle": pv, "torch": torch.__version__, "python": platform.python_version()}


class _ListsMethods(click.Command):
    """``--help`` ends with every registered method and its one-line summary (imported lazily, so
    ``poodle --help`` does not load the solvers)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from poodle import solvers

        with formatter.section("Methods (--method)"):
            formatter.write_dl([(n, solvers.get(n).summary) for n in solvers.available()])
        super().format_epilog(ctx, formatter)


@click.command(cls=_ListsMethods, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--cache", type=click.Path(dir_okay=False), help="Feature cache file (HDF5).")
@click.option("--dataset", help="Dataset name: the cache is CACHE_ROOT/DATASET/BACKBONE[-TAG].h5.")
@click.option("--backbone", help="Backbone name (with --dataset).")
@click.option("--cache-root", default="cache", show_default=True, type=click.Path(file_okay=False))
@click.option("--tag", help="Cache tag (with --dataset/--backbone).")
@click.option("--split", default="test", show_default=True, help="Split the episodes come from.")
@click.option("--way", default=5, show_default=True, type=int)
@click.option("--shot", default=1, show_default=True, type=int)
@click.option("--query", default=15, show_default=True, type=int, help="Queries per class.")
@click.option("--episodes", default=2000, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--method", "methods", multiple=True, default=("poodle",), show_default=True,
              help="Method (repeatable); all run on the same episodes and negatives.")
@click.option("--transductive", is_flag=True, help="Use the queries (methods that can).")
@click.option("--alpha", type=float, help="POODLE pull weight [1].")
@click.option("--beta", type=float, help="POODLE push weight [0.5].")
@click.option("--steps", type=int, help="Optimisation steps [each method's default: 250 for POODLE].")
@click.option("--lr", type=float, help="Adam learning rate [1e-3].")
@click.option("--label-smoothing", type=float, help="CE label smoothing (ce) [0].")
@click.option("--no-stopgrad-pull", is_flag=True, help="Drop the stop-gradient in the pull term (Table 9).")
@click.option("--no-stopgrad-push", is_flag=True, help="Drop the stop-gradient in the push term (Table 9).")
@click.option("--preset", help="A method's named preset (e.g. tim-gd: poodle-paper).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Any config field of the methods (repeatable).")
@click.option("--negatives", default="base", show_default=True, metavar="base|random|sphere|none|FILE[:SPLIT]")
@click.option("--n-neg", default=400, show_default=True, type=int, help="Negatives per episode.")
@click.option("--imbalance", type=float, metavar="KAPPA",
              help="Dirichlet(KAPPA) query counts per class (alpha-TIM's protocol: --imbalance 2).")
@click.option("--query-classes", type=int, metavar="N",
              help="Queries from only N of the way classes, chosen per episode (PADDLE's K_eff); "
                   "N * query queries, balanced or Dirichlet (--imbalance) over the N.")
@click.option("--save-episodes", type=click.Path(dir_okay=False), help="Write the episodes (HDF5).")
@click.option("--episodes-from", type=click.Path(dir_okay=False), help="Solve the episodes of this file.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--max-memory", default="2GiB", show_default=True, type=SizeType(),
              help="Bound on the working set of the chunks in flight (sets the chunk size).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="CPU: chunks solved at once, each single-threaded [default: torch's thread count].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write everything to this JSON file.")
@click.pass_context
@friendly_errors
def solve(ctx: click.Context, cache, dataset, backbone, cache_root, tag, split, way, shot, query, episodes,
          seed, methods, transductive, alpha, beta, steps, lr, label_smoothing, no_stopgrad_pull,
          no_stopgrad_push, preset, sets, negatives, n_neg, imbalance, query_classes, save_episodes, episodes_from, device,
          max_memory, workers, json_path) -> None:
    """Sample episodes from a feature cache and solve them all at once."""
    from poodle import solvers
    from poodle.cache import read_split
    from poodle.episodes import EpisodeSpec, load_episodes, sample_episodes
    from poodle.episodes import save_episodes as write_episodes
    from poodle.errors import ConfigError
    from poodle.evaluate import evaluate, needs_negatives, paired_difference, prepare_negatives, summarize
    from poodle.negatives import NegativeSpec
    from poodle.utils import atomic_path, resolve_device

    t_start = time.perf_counter()
    methods = list(methods)
    dups = {m for m in methods if methods.count(m) > 1}
    if dups:
        raise ConfigError(f"--method {', '.join(sorted(dups))} given twice")
    per = solver_options(ctx, methods, sets)
    configs = [(m, m, solvers.make_config(m, per[m], strict=True)) for m in methods]
    dev = resolve_device(device)
    path = _cache_path(cache, dataset, backbone, cache_root, tag)
    if not path.is_file():
        raise ConfigError(f"no feature cache at {path} (run `poodle extract` or give --cache FILE)")

    if episodes_from:
        given = [f"--{o.replace('_', '-')}" for o in ("split", "way", "shot", "query", "episodes", "seed", "imbalance",
                                                             "query_classes") if _explicit(ctx, o)]
        if given:
            raise ConfigError(f"{', '.join(given)} cannot be combined with --episodes-from (the file fixes them)")
        eps = load_episodes(episodes_from)
        features = read_split(path, eps.spec.split)
        eps.check_against(features.labels, where=str(episodes_from))
        if not _explicit(ctx, "negatives") and eps.negative_source:
            negatives = eps.negative_source
        if not _explicit(ctx, "n_neg") and eps.negatives is not None:
            n_neg = int(eps.negatives.shape[1])
    else:
        spec = EpisodeSpec(split=split, way=way, shot=shot, query=query, imbalance=imbalance, seed=seed,
                           query_classes=query_classes)
        spec.validate()
        features = read_split(path, split)
        eps = sample_episodes(features.labels, spec, episodes, classes=features.classes)

    users = [m for _, m, c in configs if needs_negatives(m, c)]
    neg_spec = NegativeSpec(negatives, n_neg) if users else NegativeSpec("none", n_neg)
    if users and neg_spec.is_none:
        raise ConfigError(f"method(s) {', '.join(users)} need negatives; use --negatives base|random|sphere|FILE")
    if not users and _explicit(ctx, "negatives") and negatives != "none":
        raise ConfigError(f"--negatives {negatives}: none of the chosen methods ({', '.join(methods)}) uses negatives")
    eps, _ = prepare_negatives(eps, neg_spec, path, features.dim)
    if save_episodes:
        write_episodes(save_episodes, eps, cache=str(path))
        console.print(f"episodes written to {save_episodes}")

    spec = eps.spec
    console.print(f"[bold]{len(eps):,}[/] episodes: {spec.way}-way {spec.shot}-shot, {spec.query} queries/class"
                  + (f", imbalance kappa={spec.imbalance:g}" if spec.imbalance else "")
                  + (f", queries from {spec.query_classes} of the {spec.way} classes" if spec.query_classes else "")
                  + f", split {spec.split} of {path}; negatives: "
                  + (f"{neg_spec.source} x {neg_spec.n_neg}" if users else "none") + f"; device {dev}",
                  highlight=False)
    stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    with progress_bar("solving", total=len(eps), unit="episodes") as advance:
        accs = evaluate(features, eps, configs, negatives=neg_spec if users else None, cache_path=path,
                        device=dev, max_memory=max_memory, progress=advance, stats=stats, workers=workers)
    solve_s = time.perf_counter() - t0

    from rich import box
    from rich.table import Table

    first = methods[0]
    table = Table(box=box.SIMPLE_HEAD, title=f"{spec.way}-way {spec.shot}-shot, {len(eps):,} episodes",
                  title_justify="left")
    for col, just in (("method", "left"), ("accuracy %", "right"), ("95% CI", "right"),
                      (f"diff vs {first}", "right"), ("95% CI ", "right"), ("s", "right")):
        table.add_column(col, justify=just)
    results: dict[str, Any] = {}
    for label, name, cfg in configs:
        mean, ci = summarize(accs[label])
        row = [label, f"{100 * mean:.2f}", f"± {100 * ci:.2f}", "", "", f"{stats['seconds'][label]:.1f}"]
        entry: dict[str, Any] = {"method": name, "config": dataclasses.asdict(cfg), "mean": mean, "ci95": ci,
                                 "mean_pct": 100 * mean, "ci95_pct": 100 * ci,
                                 "seconds": stats["seconds"][label], "acc": accs[label].tolist()}
        if label != first and len(methods) > 1:
            d, dci = paired_difference(accs[label], accs[first])
            row[3], row[4] = f"{100 * d:+.2f}", f"± {100 * dci:.2f}"
            entry["paired_difference"] = {"vs": first, "mean": d, "ci95": dci, "mean_pct": 100 * d,
                                          "ci95_pct": 100 * dci}
        table.add_row(*row)
        results[label] = entry
    out.print(table)
    console.print(f"{len(eps) / solve_s:,.1f} episodes/s ({solve_s:.1f} s, chunks of {stats['chunk_size']})")

    if json_path:
        record = {
            "command": "solve",
            "config": {"cache": str(path), "split": spec.split, "way": spec.way, "shot": spec.shot,
                       "query": spec.query, "imbalance": spec.imbalance, "query_classes": spec.query_classes,
                       "seed": spec.seed, "episodes": len(eps),
                       "episodes_from": episodes_from, "negatives": neg_spec.source if users else "none",
                       "n_neg": neg_spec.n_neg if users else 0, "device": str(dev), "max_memory": max_memory,
                       "chunk_size": stats["chunk_size"], "workers": stats["workers"], "methods": methods,
                       "options": {m: {k: v for k, v in per[m].items()} for m in methods}},
            "results": results,
            "summary": {label: {"mean_pct": r["mean_pct"], "ci95_pct": r["ci95_pct"]} for label, r in results.items()},
            "device": str(dev) + (f" ({_gpu_name(dev)})" if dev.type == "cuda" else f" ({platform.processor() or platform.machine()})"),
            "versions": _versions(),
            "wall_seconds": time.perf_counter() - t_start,
            "solve_seconds": solve_s,
            "episodes_per_s": len(eps) / solve_s if solve_s > 0 else None,
        }
        with atomic_path(json_path) as tmp:
            tmp.write_text(json.dumps(record, indent=1, default=str))
        console.print(f"results written to {json_path}")


def _gpu_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev)
