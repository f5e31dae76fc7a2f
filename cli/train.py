"""``poodle train``: pre-train a backbone with the simple, rot or rot-kd recipe."""

from __future__ import annotations

import os
import time
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from poodle import defaults
from poodle.cli._common import console, friendly_errors, keep, progress_option, say_glyphs_generation


def _milestones(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None or value == "auto":
        return None
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated epochs like 60,80, got {value!r}") from None


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


def _default(name: str) -> Any:
    """The default of TrainConfig's field ``name``: the recipe's defaults live in one place."""
    import dataclasses

    from poodle.train.config import TrainConfig

    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}[name]


@click.command()
@click.option(
    "--dataset",
    default=defaults.DATASET,
    show_default=True,
    help="glyphs (embedded, generated on first use), mini, tiered, cub, cifar-fs, fc100, csv or folder.",
)
@click.option("--data-root", type=click.Path(file_okay=False), default=None, help="Dataset root folder.")
@click.option("--backbone", required=True, help="Backbone name (see `poodle extract --help`).")
@click.option("--recipe", type=click.Choice(["simple", "rot", "rot-kd"]), default=_default("recipe"), show_default=True)
@click.option("--epochs", type=int, default=_default("epochs"), show_default=True)
@click.option(
    "--batch-size",
    type=int,
    default=_default("batch_size"),
    show_default=True,
    help="Global batch (split over torchrun processes).",
)
@click.option("--lr", type=float, default=_default("lr"), show_default=True)
@click.option("--momentum", type=float, default=_default("momentum"), show_default=True)
@click.option("--weight-decay", type=float, default=_default("weight_decay"), show_default=True)
@click.option(
    "--milestones",
    callback=_milestones,
    default=None,
    help="Epochs where lr is multiplied by --gamma, e.g. 60,80 [default: 60%,80% of --epochs; tiered 60/80/90%].",
)
@click.option("--gamma", type=float, default=_default("gamma"), show_default=True)
@click.option("--label-smoothing", type=float, default=_default("label_smoothing"), show_default=True)
@click.option(
    "--rot-weight", type=float, default=_default("rot_weight"), show_default=True, help="lambda of the rotation loss."
)
@click.option(
    "--generations", type=int, default=_default("generations"), show_default=True, help="Born-again students (rot-kd)."
)
@click.option(
    "--temperature",
    type=float,
    default=_default("temperature"),
    show_default=True,
    help="Distillation temperature (rot-kd).",
)
@click.option(
    "--teacher",
    type=click.Choice(["last", "best"]),
    default=_default("teacher"),
    show_default=True,
    help="Checkpoint of the previous generation that teaches (paper: last; release: best).",
)
@click.option(
    "--sup-weight",
    type=float,
    default=_default("sup_weight"),
    show_default=True,
    help="Supervised loss weight (release: 0.5).",
)
@click.option(
    "--kd-weight",
    type=float,
    default=_default("kd_weight"),
    show_default=True,
    help="Distillation loss weight (release: 0.5).",
)
@click.option(
    "--image-size",
    type=int,
    default=None,
    help="Input side in pixels [default: 84, the paper's; glyphs 28, cifar-fs and fc100 32, their own].",
)
@click.option(
    "--augment",
    type=click.Choice(["paper", "crop", "none"]),
    default=_default("augment"),
    show_default=True,
    help="paper: random resized crop + jitter + flip; crop: mild crop only (glyphs); none.",
)
@click.option(
    "--val-every",
    type=int,
    default=_default("val_every"),
    show_default=True,
    help="Meta-validate every N epochs (0: never).",
)
@click.option("--val-episodes", type=int, default=_default("val_episodes"), show_default=True)
@click.option("--val-way", type=int, default=_default("val_way"), show_default=True)
@click.option("--val-shot", type=int, default=_default("val_shot"), show_default=True)
@click.option("--val-query", type=int, default=_default("val_query"), show_default=True)
@click.option("--seed", type=int, default=_default("seed"), show_default=True)
@click.option(
    "--channels-last/--no-channels-last",
    default=_default("channels_last"),
    show_default=True,
    help="Convolutions on NHWC tensors: 1.2-1.6x faster steps on a CPU; the weights differ by rounding.",
)
@click.option(
    "--workers",
    type=int,
    default=None,
    help="DataLoader worker processes [default: one per usable core, at most 4; poodle info --system].",
)
@click.option("--device", default=_default("device"), show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--amp/--no-amp", default=None, help="Mixed precision [default: on for CUDA, off on CPU].")
@click.option("--cache-root", type=click.Path(file_okay=False), default=_default("cache_root"), show_default=True)
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
    from poodle.train import TrainConfig
    from poodle.train import train as run_train

    resume, force = opts.pop("resume"), opts.pop("force")
    if resume and force:
        raise click.UsageError("--resume and --force exclude each other")
    cfg = TrainConfig(**opts)
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
