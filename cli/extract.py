"""``poodle extract``: write L2-normalised backbone features of every split to one HDF5 cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import click

from poodle import defaults
from poodle.cli._common import (
    console,
    friendly_errors,
    keep,
    note,
    out,
    pretrained_option,
    progress_bar,
    progress_option,
    say_glyphs_generation,
    styled,
)
from poodle.cli._schema import schema_options
from poodle.extract import ExtractOptions
from poodle.run import RunOptions

DATASETS = list(defaults.DATASETS)


def _list_backbones(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from poodle.backbones import BACKBONES
    from poodle.backbones.external import TIMM_HINT, timm_names, torchvision_names

    out.print(styled("The POODLE release's backbones", "bold", " (--backbone NAME):"))
    for name in sorted(BACKBONES):
        spec = BACKBONES[name]
        out.print(f"  {name:<14} D={spec.feature_dim:<5} {spec.summary}", highlight=False)
    tv = torchvision_names()
    out.print(styled("\ntorchvision", "bold", f" ({len(tv)} models; --backbone torchvision:NAME):"))
    out.print("  " + ", ".join(tv), highlight=False)
    tm = timm_names()
    if tm is None:
        out.print(styled("\ntimm", "bold", f": {TIMM_HINT}"), highlight=False)
    else:
        out.print(styled("\ntimm", "bold", f" ({len(tm)} models; --backbone timm:NAME):"))
        out.print("  " + ", ".join(tm), highlight=False)
    ctx.exit(0)


def describe(event: Any) -> str | None:
    """The line ``poodle extract`` prints for a library event (None: the event is not shown)."""
    from poodle.events import SplitResumed, SplitReused, SplitWritten
    from poodle.utils import count

    if isinstance(event, SplitWritten):
        by = f" by {event.processes} processes" if event.processes > 1 else ""
        skipped = f" ({count(event.skipped, 'unreadable image')} skipped)" if event.skipped else ""
        images, classes = count(event.images, "image"), count(event.classes, "class")
        return f"{event.split}: {images}, {classes} written to {event.path}{by}{skipped}"
    if isinstance(event, SplitReused):
        return f"{event.split}: already complete in {event.path}, skipped"
    if isinstance(event, SplitResumed):
        if event.shares is None:
            return f"{event.split}: resuming after image {event.done} of {event.total}"
        files = count(event.shares, "file")
        return f"{event.split}: resuming, {event.done} of {event.total} images already staged in {files}"
    return None


_done: list[str] = []  # the splits complete in the cache, for the line a stop prints


def say_event(event: Any) -> None:
    """Print a library event: a Notice as a note (its parameters written as flags), the others as
    :func:`describe` says them."""
    from poodle.events import Notice, SplitReused, SplitWritten

    if isinstance(event, (SplitWritten, SplitReused)):
        _done.append(event.split)
        keep("splits", f"split{'s' if len(_done) > 1 else ''} {', '.join(_done)} in {event.path}")
        keep("staged", None)
    if isinstance(event, Notice):
        note(event)
    elif (line := describe(event)) is not None:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--dataset",
    default=defaults.DATASET,
    show_default=True,
    type=click.Choice(DATASETS),
    help="Layout of the images: csv (images/ + <split>.csv), folder (<split>/<class>/<img>), "
    "the presets mini, tiered, cub, cifar-fs, fc100 (CIFAR-100's binary files), or the embedded glyphs.",
)
@click.option(
    "--cub-split",
    type=click.Choice(["release", "140-30-30"]),
    default=defaults.CUB_SPLIT,
    show_default=True,
    help="cub only: the release's 100/50/50 rule, or the 140/30/30 class lists (cached as cub-140-30-30).",
)
@click.option(
    "--class-split",
    default=None,
    metavar="NAME|DIR",
    help="folder only: class folders <data-root>/<class>/ split by class lists, Meta-Dataset's "
    "(md-ilsvrc, md-omniglot, md-aircraft, md-cub, md-dtd, md-quickdraw, md-fungi, md-vgg-flower, "
    "md-traffic-sign, md-mscoco; docs/datasets.md) or a folder of train.txt, val.txt, test.txt; "
    "cached as that name.",
)
@click.option(
    "--data-root", type=click.Path(file_okay=False), default=None, help="Folder of the dataset (not needed for glyphs)."
)
@click.option(
    "--backbone",
    required=True,
    help="Backbone name: resnet12, conv4_64, wrn28_10, ..., or torchvision:NAME / timm:NAME (see --list-backbones).",
)
@click.option(
    "--checkpoint",
    type=click.Path(dir_okay=False),
    default=None,
    help="Weights to load strictly: a torch state dict (the release's .pth.tar, ours, torchvision's, "
    "timm's, DINOv2's and CLIP's original files) or a .safetensors file [default: the newest complete "
    "`poodle train` or `poodle demo` run of --backbone on --dataset under --cache-root].",
)
@pretrained_option(
    "timm:/torchvision: backbones: the library's own pretrained weights, from its cache (HF_HOME, "
    "TORCH_HOME) or downloaded there: timm's for the tag in the name (timm:NAME.TAG); torchvision's "
    "default weights, or the member of its weights enum named (--pretrained IMAGENET1K_V2)."
)
@click.option(
    "--random-weights",
    is_flag=True,
    help="No weights: the network as initialised (seed 0), e.g. as a baseline.",
)
@click.option(
    "--splits", default=",".join(defaults.SPLITS), show_default=True, help="Comma-separated splits to extract."
)
@schema_options(ExtractOptions, but=("dtype",))  # dtype: below, with the cache's other options
@schema_options(RunOptions, only=("device",))
@click.option(
    "--cache-root",
    default=defaults.CACHE_ROOT,
    show_default=True,
    type=click.Path(file_okay=False),
    help="Cache files go to <cache-root>/<dataset>/<backbone>[-<tag>].h5.",
)
@click.option("--tag", default=None, help="Suffix of the cache file name, to keep several checkpoints apart.")
@schema_options(ExtractOptions, only=("dtype",))
@click.option(
    "--force",
    is_flag=True,
    help="Recompute complete splits, and replace a cache made with another checkpoint, backbone, "
    "image size or transform.",
)
@click.option(
    "--skip-bad",
    is_flag=True,
    help="Leave out images that do not decode (their paths are recorded in the cache) instead of stopping.",
)
@click.option(
    "--list-backbones",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_list_backbones,
    help="List the backbones available (release, torchvision, timm) and exit.",
)
@click.pass_context
@progress_option
@friendly_errors
def extract(
    ctx: click.Context,
    dataset: str,
    backbone: str,
    checkpoint: str | None,
    pretrained: str | None,
    random_weights: bool,
    **options: Any,
) -> None:
    """Write L2-normalised features of every split to one HDF5 cache.

    Interrupted runs resume: re-run the same command. Complete splits are skipped. The cache's
    path is printed on stdout. Under `torchrun --nproc-per-node N $(which poodle) extract ...` the
    processes share every split (one GPU each) and rank 0 writes the cache; an interrupted run
    resumes with any number of processes.
    """
    from poodle.extract import check_options
    from poodle.extract import extract as run_extract

    # the other options are ExtractOptions' fields, by name (image_size, workers, dtype, ...)
    opts = ExtractOptions(**options)
    weights = choose_weights(ctx, backbone, dataset, checkpoint, pretrained, random_weights)
    if weights.run is not None:
        checkpoint = str(weights.run.checkpoint)
        image_size = weights.run.image_size if opts.image_size is None else opts.image_size
        tag = opts.tag
        if tag is None:
            tag = _default_tag(backbone, dataset, str(opts.cache_root), checkpoint, image_size)
        opts = dataclasses.replace(opts, image_size=image_size, tag=tag)
    opts = dataclasses.replace(opts, checkpoint=checkpoint, pretrained=weights.pretrained)
    cache_root = str(opts.cache_root)
    check_options(dataset, backbone, opts)  # before the glyphs are generated (minutes)
    say_glyphs_generation(dataset, opts.data_root and str(opts.data_root), cache_root)

    _done.clear()

    def bar(desc: str, total: int):
        keep("staged", f"the batches of split {desc.split()[0]} extracted so far, staged to resume from")
        return progress_bar(desc, total, unit="img")

    path = run_extract(dataset, backbone, opts, progress_factory=bar, on_event=say_event)
    from poodle.distributed import is_main_process

    if is_main_process():  # under torchrun, rank 0 speaks for the run
        out.print(str(path), highlight=False, soft_wrap=True)
        root = "" if cache_root == defaults.CACHE_ROOT else f" --cache-root {cache_root}"
        console.print(f"next: poodle solve --episodes 10000{root} (takes this cache)", highlight=False, soft_wrap=True)


@dataclass
class Weights:
    """What ``--checkpoint``, ``--pretrained``, ``--random-weights`` or their default chose: a file
    (``checkpoint``), a library's weights (``pretrained``), the run a default checkpoint comes from,
    or nothing (random weights)."""

    checkpoint: str | None = None
    pretrained: str | None = None
    run: Any = None


def choose_weights(
    ctx: click.Context,
    backbone: str,
    dataset: str,
    checkpoint: str | None,
    pretrained: str | None,
    random_weights: bool,
) -> Weights:
    """The weights the options choose: at most one of them (a typed one wins over the project file's),
    else the newest complete training run of ``backbone`` on ``dataset`` under ``--cache-root``, said
    on the first line; where there is none, one line naming the command that makes one."""
    from poodle import backbones, project
    from poodle.cli._common import from_project
    from poodle.errors import ConfigError

    given = {
        k: v
        for k, v in (("checkpoint", checkpoint), ("pretrained", pretrained), ("random_weights", random_weights))
        if v
    }
    if len(given) > 1 and any(not from_project(ctx, k) for k in given):
        given = {k: v for k, v in given.items() if not from_project(ctx, k)}
    if len(given) > 1:
        raise ConfigError("give one of --checkpoint FILE, --pretrained and --random-weights")
    if given:
        return Weights(
            checkpoint=checkpoint if "checkpoint" in given else None,
            pretrained=pretrained if "pretrained" in given else None,
        )
    if backbones.is_external(backbone):
        raise ConfigError(
            f"which weights for {backbone}? give --pretrained (the library's own), --checkpoint FILE or "
            f"--random-weights"
        )
    name = backbones.get_spec(backbone).name
    run = project.latest_checkpoint(ctx.params.get("cache_root") or defaults.CACHE_ROOT, name, dataset)
    if run is None:
        how = f"poodle train --backbone {backbone}" + ("" if dataset == defaults.DATASET else f" --dataset {dataset}")
        how += f" --data-root {ctx.params['data_root']}" if ctx.params.get("data_root") else ""
        root = ctx.params.get("cache_root") or defaults.CACHE_ROOT
        stopped = project.unfinished_runs(root, name, dataset)
        unfinished = (
            f"; {stopped[-1]} has no complete train.json (a run that did not finish: the same poodle train "
            f"command resumes it)"
            if stopped
            else ""
        )
        raise ConfigError(
            f"no checkpoint of {name} on {dataset}{unfinished}: train one with '{how}' or give --checkpoint FILE "
            "or --random-weights"
        )
    console.print(
        f"checkpoint: {run.checkpoint} (the newest complete training run of {name} on {dataset}, {run.image_size} px)",
        soft_wrap=True,
        highlight=False,
    )
    return Weights(run=run)


def _default_tag(backbone: str, dataset: str, cache_root: str, checkpoint: str, image_size: int) -> str | None:
    """The tag of the cache that already holds this checkpoint's features (e.g. the demo's)."""
    from poodle import backbones, project
    from poodle.utils import file_sha256

    name = backbones.get_spec(backbone).name
    return project.default_tag(cache_root, dataset, name, name, file_sha256(checkpoint), image_size)
