"""``poodle demo``: the whole pipeline on the embedded glyphs dataset, and a table like the paper's."""

from __future__ import annotations

import time
from typing import Any

import click

from poodle.cli._common import console, friendly_errors, keep, out, progress_bar, progress_option, render_table
from poodle.cli._schema import given, schema_options
from poodle.demo_settings import DemoConfig


@click.command()
@click.option(
    "--cache-root",
    type=click.Path(file_okay=False),
    default=DemoConfig.cache_root,
    show_default=True,
    help="Where the glyphs, the checkpoint, the features and the results are kept.",
)
@click.option("--backbone", default=DemoConfig.backbone, show_default=True)
@schema_options(DemoConfig)  # the demo's settings: DemoConfig's declarations
@click.pass_context
@progress_option
@friendly_errors
def demo(ctx: click.Context, **params: Any) -> None:
    """Train a small backbone on the embedded glyphs dataset, extract its features, solve thousands of
    5-way 1-shot and 5-shot episodes with proto, CE, POODLE (base and random negatives) and the
    transductive competitors, and print accuracy with 95% confidence intervals.

    A second run reuses the checkpoint, the features and every finished table cell.
    """
    import torch

    from poodle.cli.train import TrainDisplay
    from poodle.demo import LEGEND, RESULTS_FILE, quick_config, run_demo

    # the settings given (--quick's defaults give way to them); the others are DemoConfig's defaults
    opts = given(ctx, params)
    cfg = quick_config(**opts) if params["quick"] else DemoConfig(**opts)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if cfg.protocol == "meta-dataset":
        _meta_dataset(cfg)
        return
    t0 = time.perf_counter()
    # each stage is committed when it ends (the checkpoint every epoch, the features every batch,
    # each table cell when solved), and a re-run takes up from there
    keep("demo", f"every finished epoch, staged batch of features and table cell under {cfg.cache_root}")
    with TrainDisplay() as display:
        result = run_demo(
            cfg,
            log=lambda s: console.print(s, highlight=False),
            train_callback=display,
            progress_factory=lambda desc, total: progress_bar(
                desc, total, "episodes" if desc.startswith("solving") else "img"
            ),
        )
    total = time.perf_counter() - t0

    title = (
        f"glyphs · {cfg.backbone} ({cfg.recipe}, {cfg.epochs} epochs) · {cfg.episodes} episodes · "
        f"{cfg.way}-way · accuracy % ± 95% CI"
    )
    out.print(render_table(result.table, title=title))
    out.print(LEGEND, highlight=False)
    out.print(f"table: {result.markdown} (and .json); results: {result.json.parent / RESULTS_FILE}", highlight=False)
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
    out.print(f"total {total:.1f} s ({stages})", highlight=False)


def _meta_dataset(cfg: Any) -> None:
    """``--protocol meta-dataset``: the per-domain table (poodle.demo_domains)."""
    from poodle.cli.train import TrainDisplay
    from poodle.demo_domains import RESULTS_FILE, caption, run_domain_demo

    t0 = time.perf_counter()
    with TrainDisplay() as display:
        result = run_domain_demo(
            cfg,
            log=lambda s: console.print(s, highlight=False),
            train_callback=display,
            progress_factory=lambda desc, total: progress_bar(desc, total, "items"),
        )
    total = time.perf_counter() - t0
    out.print(render_table(result.table, title="glyphs · Meta-Dataset protocol · accuracy % ± 95% CI"))
    out.print(caption(cfg, result.methods), highlight=False)
    for note in result.table.notes:
        out.print(note, highlight=False)
    out.print(f"table: {result.markdown} (and .json); results: {result.json.parent / RESULTS_FILE}", highlight=False)
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
    out.print(f"total {total:.1f} s ({stages})", highlight=False)
