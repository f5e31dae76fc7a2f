"""``poodle train``: pre-train a backbone with the simple, rot or rot-kd recipe."""

from __future__ import annotations

import os
import time
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from poodle import defaults
from poodle.cli._common import console, friendly_errors, keep, progress_option, say_glyphs_generation
from poodle.cli._schema import schema_options
from poodle.train.config import TrainConfig


class TrainDisplay:
    """Renders :class:`poodle.train.TrainEvent` s: a bar per epoch with loss, accuracy and images/s,
    then one for its meta-validation (images embedded), and one summary line per epoch."""

    def __init__(self, where: str = "its last.pt") -> None:
        from poodle.cli._progress import new_progress

        self.where = where

        self.progress = new_progress(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  acc {task.fields[acc]}  {task.fields[rate]}", markup=False),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            transient=True,
        )
        self.task: Any = None
        self.t0 = 0.0
        self.t_end: float | None = None  # end of the epoch's training part (before validation)
        self.images = 0
        self.val_t0, self.val_images = 0.0, 0

    def __enter__(self) -> TrainDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def _prefix(self, e) -> str:
        gen = f"gen {e.generation + 1}/{e.n_generations} " if e.n_generations > 1 else ""
        return f"{gen}epoch {e.epoch + 1}/{e.epochs}"

    def __call__(self, e) -> None:
        p = self.progress
        if e.kind == "generation":
            name = "teacher" if e.generation == 0 else f"student_{e.generation - 1}"
            what = f"generation {e.generation} ({name})" if e.n_generations > 1 else "training"
            if e.skipped:
                console.print(f"{what}: already complete, reusing it")
            elif e.epoch > 0:
                console.print(f"{what}: resuming at epoch {e.epoch + 1}/{e.epochs}")
                keep("train", f"{what}: epoch {e.epoch}/{e.epochs} (finished) in {self.where}")
        elif e.kind == "epoch":
            if self.task is not None:
                p.remove_task(self.task)
            self.task = p.add_task(self._prefix(e), total=e.total, loss="-", acc="-", rate="", unit="steps")
            self.t0, self.t_end, self.images = time.perf_counter(), None, 0
        elif e.kind == "step" and self.task is not None:
            self.images += e.images
            rate = self.images / max(time.perf_counter() - self.t0, 1e-9)
            p.update(self.task, advance=1, loss=f"{e.loss:.3f}", acc=f"{100 * e.acc:.1f}%", rate=f"{rate:,.0f} img/s")
        elif e.kind == "validate":
            # its own stage (images embedded for the meta-validation episodes): the epoch's line
            # has said its end, and a log then shows validation's progress as it goes
            self.t_end = time.perf_counter()
            if self.task is not None:
                p.remove_task(self.task)
            self.task = p.add_task(
                self._prefix(e) + " validating", total=e.total, loss="-", acc="-", rate="", unit="img"
            )
            self.val_t0, self.val_images = time.perf_counter(), 0
        elif e.kind == "validate_step" and self.task is not None:
            self.val_images += e.images
            rate = self.val_images / max(time.perf_counter() - self.val_t0, 1e-9)
            p.update(self.task, advance=e.images, rate=f"{rate:,.0f} img/s")
        elif e.kind == "epoch_end":
            val = "" if e.val_acc is None else f"  val {100 * e.val_acc:.2f}% (best {100 * e.best_acc:.2f}%)"
            rate = self.images / max((self.t_end or time.perf_counter()) - self.t0, 1e-9)
            console.print(
                f"{self._prefix(e)}  lr {e.lr:.2g}  loss {e.loss:.4f}  acc {100 * e.acc:.2f}%"
                f"{val}  {e.seconds:.1f} s  {rate:,.0f} img/s",
                highlight=False,
            )
            keep("train", f"{self._prefix(e)} (finished) in {self.where}")
        elif e.kind == "done" and self.task is not None:
            p.remove_task(self.task)
            self.task = None


@click.command()
@click.option(
    "--dataset",
    default=defaults.DATASET,
    show_default=True,
    type=click.Choice(defaults.DATASETS),
    help="glyphs (embedded, generated on first use), mini, tiered, cub, cifar-fs, fc100, csv or folder.",
)
@click.option("--data-root", type=click.Path(file_okay=False), default=None, help="Dataset root folder.")
@click.option("--backbone", required=True, help="Backbone name (see `poodle extract --help`).")
@schema_options(TrainConfig)  # every setting of the recipe and the run: TrainConfig's declarations
@click.option("--cache-root", type=click.Path(file_okay=False), default=defaults.CACHE_ROOT, show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder [default: <cache-root>/<dataset>/checkpoints/<backbone>-<recipe>].",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Require an interrupted run to continue (one with the same settings is continued anyway).",
)
@click.option("--force", is_flag=True, help="Discard checkpoints in the output folder and start over.")
@progress_option
@friendly_errors
def train(**opts: Any) -> None:
    """Pre-train a backbone on the base classes (paper appendix A) and keep the best checkpoint.

    Checkpoints (release key layout) load in `poodle extract --checkpoint` unchanged. Under
    `torchrun --nproc-per-node N poodle train ...` the same command trains with DistributedDataParallel.
    """
    from poodle.train import train as run_train
    from poodle.utils import resolve_device

    resume, force = opts.pop("resume"), opts.pop("force")
    if resume and force:
        raise click.UsageError("--resume and --force exclude each other")
    cfg = TrainConfig(**opts)
    # the device is read now, before the glyphs are generated (minutes) or the output folder made
    resolve_device(cfg.device)
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports
    if not main_process:
        run_train(cfg, resume=True if resume else None, force=force)
        return
    console.print(
        f"training {cfg.backbone} on {cfg.dataset} ({cfg.recipe}, {cfg.epochs} epochs, "
        f"lr decay at {', '.join(map(str, cfg.resolved_milestones())) or 'never'}) -> {cfg.out_dir()}",
        highlight=False,
    )
    say_glyphs_generation(cfg.dataset, cfg.data_root, cfg.cache_root)
    with TrainDisplay(str(cfg.out_dir() / "last.pt")) as display:
        result = run_train(cfg, callback=display, resume=True if resume else None, force=force)
    best = [g["best_acc"] for g in result.generations]
    best_txt = ", ".join("-" if b is None else f"{100 * b:.2f}%" for b in best)
    console.print(f"done. best val accuracy per generation: {best_txt}")
    # extract takes the newest run under its cache root by default; one written elsewhere is named
    extra = "" if cfg.dataset == defaults.DATASET else f" --dataset {cfg.dataset}"
    extra += f" --data-root {cfg.data_root}" if cfg.data_root else ""
    extra += f" --cache-root {cfg.cache_root}" if cfg.cache_root != defaults.CACHE_ROOT else ""
    extra += f" --checkpoint {result.checkpoint}" if cfg.out is not None else ""
    console.print(f"next: poodle extract --backbone {cfg.backbone}{extra}", highlight=False, soft_wrap=True)
    click.echo(str(result.checkpoint))
