"""``poodle demo``: the whole pipeline on the embedded glyphs dataset, and a table like the paper's."""

from __future__ import annotations

import time
from typing import Any

import click

from poodle import defaults
from poodle.cli._common import console, friendly_errors, keep, out, progress_bar, progress_option, render_table


@click.command()
@click.option(
    "--cache-root",
    type=click.Path(file_okay=False),
    default=defaults.CACHE_ROOT,
    show_default=True,
    help="Where the glyphs, the checkpoint, the features and the results are kept.",
)
@click.option(
    "--protocol",
    type=click.Choice(["fixed", "meta-dataset"]),
    default="fixed",
    show_default=True,
    help="fixed: the paper's 5-way table; meta-dataset: the per-domain table on domains of test alphabets "
    "(docs/demo.md).",
)
@click.option(
    "--episodes",
    type=int,
    default=None,
    help="Episodes per shot count, or per domain with --protocol meta-dataset [default: 2000, 600; --quick: 40].",
)
@click.option("--backbone", default="conv4_64", show_default=True)
@click.option("--recipe", type=click.Choice(["simple", "rot", "rot-kd"]), default="simple", show_default=True)
@click.option("--epochs", type=int, default=None, help="Training epochs [default: 3, about 2 CPU minutes; --quick: 1].")
@click.option("--batch-size", type=int, default=None, help="Training batch [default: the demo's].")
@click.option("--lr", type=float, default=None, help="Training learning rate [default: the demo's].")
@click.option(
    "--channels-last/--no-channels-last",
    default=None,
    help="Train on NHWC tensors: 1.2-1.6x faster per step on a CPU, more for larger batches [default: on].",
)
@click.option("--image-size", type=int, default=28, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=defaults.DEVICE, show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--workers", type=int, default=0, show_default=True, help="DataLoader worker processes.")
@click.option(
    "--threads",
    type=int,
    default=0,
    show_default=True,
    help="CPU threads for torch (0: torch's default, one per core). On a busy machine 1 can be much faster.",
)
@click.option(
    "--competitors",
    default="paper",
    show_default=True,
    help="Transductive methods to add: paper (those the paper compares with), all, none, or a comma list.",
)
@click.option("--quick", is_flag=True, help="A tiny run (a few glyph classes, 1 epoch, 40 episodes) for tests.")
@progress_option
@friendly_errors
def demo(
    cache_root: str,
    protocol: str,
    episodes: int | None,
    backbone: str,
    recipe: str,
    epochs: int | None,
    batch_size: int | None,
    lr: float | None,
    channels_last: bool | None,
    image_size: int,
    seed: int,
    device: str,
    workers: int,
    threads: int,
    competitors: str,
    quick: bool,
) -> None:
    """Train a small backbone on the embedded glyphs dataset, extract its features, solve thousands of
    5-way 1-shot and 5-shot episodes with proto, CE, POODLE (base and random negatives) and the
    transductive competitors, and print accuracy with 95% confidence intervals.

    A second run reuses the checkpoint, the features and every finished table cell.
    """
    import torch

    from poodle.cli.train import TrainDisplay
    from poodle.demo import LEGEND, RESULTS_FILE, DemoConfig, quick_config, run_demo

    opts: dict[str, Any] = dict(
        cache_root=cache_root,
        backbone=backbone,
        recipe=recipe,
        image_size=image_size,
        seed=seed,
        device=device,
        workers=workers,
        competitors=competitors,
    )
    if episodes is not None:
        opts["episodes"] = episodes
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("lr", lr), ("channels_last", channels_last)):
        if value is not None:
            opts[name] = value
    if protocol == "meta-dataset" and episodes is None and not quick:
        from poodle.demo_domains import EPISODES

        opts["episodes"] = EPISODES
    cfg = quick_config(**opts) if quick else DemoConfig(**opts)
    if threads > 0:
        torch.set_num_threads(threads)
    if protocol == "meta-dataset":
        _meta_dataset(cfg)
        return
    t0 = time.perf_counter()
    # each stage is committed when it ends (the checkpoint every epoch, the features every batch,
    # each table cell when solved), and a re-run takes up from there
    keep("demo", f"every finished epoch, staged batch of features and table cell under {cache_root}")
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
