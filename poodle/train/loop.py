"""The training loop shared by the three recipes, with exact resume and optional DDP.

Each generation (the teacher run, then each born-again student for ``rot-kd``) writes
``last.pt`` after every epoch and ``best.pt`` when meta-validation improves, in its own directory
(``<out>/`` for generation 0, ``<out>/student_<i>/`` for student i). A checkpoint holds, besides the
weights in the release's layout, everything needed to continue: optimizer (momentum buffers),
lr schedule, AMP scaler, RNG states, history and the configuration.

Resume is exact because every epoch's randomness (data order, augmentation, dropout) is a pure
function of ``(seed, generation, epoch, rank)``: the data order comes from a sampler seeded with the
run's seed and the epoch, and the global generators are re-seeded at the start of every epoch.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sized, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from poodle import defaults, distributed
from poodle.backbones import build, load_checkpoint, save_checkpoint
from poodle.data import ImageDataset, PixelCache, resolve_dataset
from poodle.data.transforms import eval_transform
from poodle.errors import CheckpointError, ConfigError, DataError, mark
from poodle.interrupt import critical, loader_batches, quiet_worker
from poodle.train.augment import train_transform
from poodle.train.config import TrainConfig, config_differences
from poodle.train.losses import distill_kl, rotate_all, smooth_cross_entropy
from poodle.train.state import capture_rng, restore_rng, seed_everything
from poodle.train.validate import Validator
from poodle.utils import atomic_path, check_writable_dir, derive_seed

CHECKPOINT_FORMAT = "poodle-train"


@dataclass
class TrainEvent:
    """What the loop reports to its callback.

    ``kind`` is one of ``generation`` (a generation starts: ``epoch`` = first epoch to run, ``total``
    = epochs; ``skipped`` when it was already complete), ``epoch`` (an epoch starts: ``total`` =
    its number of batches, ``lr``), ``step`` (a batch is done: ``images`` seen by all processes,
    running ``loss`` and ``acc`` of the epoch), ``validate`` (meta-validation starts: ``total`` =
    images to embed), ``validate_step`` (``images`` embedded), ``epoch_end`` (``loss``, ``acc``,
    ``val_acc`` or None, ``best_acc``, ``seconds``), ``done``.
    """

    kind: str
    generation: int = 0
    n_generations: int = 1
    epoch: int = 0
    epochs: int = 0
    total: int = 0
    images: int = 0
    loss: float = float("nan")
    acc: float = float("nan")
    lr: float = 0.0
    val_acc: float | None = None
    best_acc: float | None = None
    seconds: float = 0.0
    skipped: bool = False


Callback = Callable[[TrainEvent], None]


@dataclass
class TrainResult:
    """Where a run left its checkpoints.

    Attributes:
        out_dir: the run's directory.
        checkpoint: the checkpoint to extract features with: ``best.pt`` of the final generation
            (the release evaluates ``model_best``); ``last_checkpoint`` is its ``last.pt``.
        generations: one dict per generation: ``dir``, ``best_acc``, ``epochs_run`` (in this call).
        history: per-epoch records ``{generation, epoch, lr, loss, acc, val_acc, seconds}``.
        complete: False when ``stop_after`` interrupted the run.
    """

    out_dir: Path
    checkpoint: Path
    last_checkpoint: Path
    generations: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True


class _Stop(Exception):
    """Raised inside the loop when ``stop_after`` epochs have run (a simulated interruption)."""


# ---------------------------------------------------------------------------------------------
# distributed helpers


_Dist = distributed.Dist


def _init_distributed(device_name: str) -> tuple[_Dist, torch.device]:
    """DDP when launched by torchrun (``WORLD_SIZE`` > 1), else a single process (see poodle.distributed)."""
    d = distributed.init(device_name)
    return d, d.device


# ---------------------------------------------------------------------------------------------
# data


def _dataset(cfg: TrainConfig, split: str, transform: Callable, pixels: PixelCache | None = None) -> ImageDataset:
    """The split read for training or meta-validation, which visit every image every epoch: decoded
    images stay in ``pixels`` (within its budget), and items are uint8, finished per batch by
    ``dataset.finish`` (the same values as the float per-image transform)."""
    source = resolve_dataset(cfg.dataset, cfg.data_root, Path(cfg.cache_root))
    if split not in source.splits():
        raise DataError(
            f"dataset {cfg.dataset!r} has no {split!r} split (it has: {', '.join(source.splits())})",
            param="dataset",
            value=cfg.dataset,
        )
    return ImageDataset(source, split, transform, cache=pixels, uint8=True)


def _has_split(cfg: TrainConfig, split: str) -> bool:
    return split in resolve_dataset(cfg.dataset, cfg.data_root, Path(cfg.cache_root)).splits()


def dataset_labels(dataset: Dataset) -> tuple[torch.Tensor, list[str]]:
    """``(labels [N] int64, class names)`` of an :class:`poodle.data.ImageDataset`, without
    decoding any image."""
    ds = cast(Any, dataset)  # an ImageDataset, or a torchvision-style dataset with ``targets``
    classes = list(ds.classes)
    labels = getattr(ds, "labels", None)
    if labels is None:
        labels = ds.targets
    return torch.as_tensor(labels, dtype=torch.int64), classes


# ---------------------------------------------------------------------------------------------
# checkpoints


def _read_checkpoint(path: Path, out: Path) -> dict[str, Any]:
    """The training checkpoint ``path`` (inside the run directory ``out``)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(
            f"{path}: cannot read checkpoint ({type(e).__name__}: {e})", param="out", value=out
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{mark('out')} {out} holds {path.relative_to(out)}, which is not a checkpoint written by poodle.train; "
            f"pass {mark('force')} to start over or choose another folder",
            param="out",
            value=out,
        )
    return ckpt


def _copy_atomic(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def _check_config(path: Path, saved: dict[str, Any], cfg: TrainConfig) -> None:
    diffs = config_differences(saved, cfg.defining())
    if diffs:
        out = cfg.out_dir()
        raise ConfigError(
            f"{mark('out')} {out}: {path.relative_to(out)} was trained with other settings ({'; '.join(diffs)}); "
            f"pass {mark('force')} to start over or choose another folder",
            param="out",
            value=out,
        )


# ---------------------------------------------------------------------------------------------
# the loop


# Python-int counters some backbones keep outside the state dict (ResNet-12's DropBlock annealing
# step); a resumed run must restore them to continue exactly.
_COUNTERS = ("dropblock_step",)


def _get_counters(model: nn.Module) -> dict[str, int]:
    return {
        f"{name}.{attr}": int(getattr(m, attr))
        for name, m in model.named_modules()
        for attr in _COUNTERS
        if isinstance(getattr(m, attr, None), int)
    }


def _set_counters(model: nn.Module, counters: dict[str, int]) -> None:
    modules = dict(model.named_modules())
    for key, value in counters.items():
        name, attr = key.rsplit(".", 1)
        if name in modules:
            setattr(modules[name], attr, int(value))


def _build(cfg: TrainConfig, num_classes: int, generation: int) -> nn.Module:
    seed_everything(cfg.seed, generation, 0)
    return build(cfg.backbone, num_classes=num_classes, rotation_head=cfg.rotation)


class _Running:
    """Running sums of one epoch's loss and accuracy."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.correct = 0.0
        self.n = 0
        self.steps = 0

    def add(self, loss: float, correct: float, n: int) -> None:
        self.loss += loss
        self.correct += correct
        self.n += n
        self.steps += 1

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.steps, 1)

    @property
    def acc(self) -> float:
        return self.correct / max(self.n, 1)


def train(
    cfg: TrainConfig,
    *,
    callback: Callback | None = None,
    resume: bool | None = None,
    force: bool = False,
    stop_after: int | None = None,
    pixel_cache: PixelCache | None = None,
) -> TrainResult:
    """Pre-train ``cfg.backbone`` on the base (train) split of ``cfg.dataset`` with ``cfg.recipe``.

    Args:
        cfg: the run (see :class:`TrainConfig`).
        callback: receives a :class:`TrainEvent` at each generation, epoch, batch and validation.
        resume: ``None`` (default) continues a run found in the output directory when it was made
            with the same settings, else starts; ``True`` requires one to continue; ``False``
            refuses to touch an existing run. A complete run is returned as is.
        force: delete what the output directory holds and start over.
        stop_after: stop after this many epochs have run in this call, as if interrupted (tests).
        pixel_cache: where the train and val splits keep their decoded images across epochs (None:
            a cache of :data:`poodle.defaults.IMAGE_CACHE_BYTES` for this call); pass one to share it
            with a later :func:`poodle.extract.extract` of the same files, as ``poodle demo`` does.
    Returns:
        a :class:`TrainResult`.
    """
    dist, device = _init_distributed(cfg.device)
    amp = (device.type == "cuda") if cfg.amp is None else bool(cfg.amp and device.type == "cuda")
    if cfg.batch_size % dist.world:
        raise ConfigError(
            f"{mark('batch_size')} {cfg.batch_size} is not divisible by the {dist.world} processes",
            param="batch_size",
            value=cfg.batch_size,
        )
    out = cfg.out_dir()
    emit = callback if (callback is not None and dist.main) else (lambda e: None)

    with dist.guard():  # a refusal (existing run, other settings) is printed once, by rank 0
        if dist.main:
            _prepare_out(cfg, out, resume=resume, force=force)

    pixels = pixel_cache if pixel_cache is not None else PixelCache(defaults.IMAGE_CACHE_BYTES)
    train_set, classes = _train_split(cfg, pixels)
    validator = _validator(cfg, pixels) if cfg.val_every > 0 and dist.main else None
    run = _Run(cfg, classes, train_set, validator, dist, device, amp, emit, TrainResult(out, out, out), stop_after)
    try:
        for g in range(cfg.n_generations):
            run.result.generations.append(_train_generation(run, g))
    except _Stop:
        run.result.complete = False
    result = run.result
    final_dir = cfg.generation_dir(cfg.n_generations - 1)
    result.checkpoint = final_dir / "best.pt"
    result.last_checkpoint = final_dir / "last.pt"
    if result.complete and dist.main:
        _write_summary(cfg, result)
    dist.barrier()
    emit(TrainEvent("done", n_generations=cfg.n_generations))
    return result


def _train_split(cfg: TrainConfig, pixels: PixelCache) -> tuple[ImageDataset, list[str]]:
    """The train split with the training transform, and its class names; DataError when it cannot
    train a classifier."""
    train_set = _dataset(cfg, "train", train_transform(cfg.augment, cfg.size), pixels)
    _, classes = dataset_labels(train_set)
    if len(train_set) < 2:
        raise DataError(
            f"the train split of {cfg.dataset!r} has {len(train_set)} images; need at least 2",
            param="dataset",
            value=cfg.dataset,
        )
    if len(classes) < 2:
        # a one-class classifier has a constant cross-entropy: nothing would be learnt
        raise DataError(
            f"the train split of {cfg.dataset!r} has {len(classes)} class ({', '.join(classes)}); "
            f"training a classifier needs at least 2",
            param="dataset",
            value=cfg.dataset,
        )
    return train_set, classes


def _validator(cfg: TrainConfig, pixels: PixelCache) -> Validator | None:
    """Meta-validation on ``cfg.val_split`` (None when the dataset has no such split)."""
    if not _has_split(cfg, cfg.val_split):
        return None
    val_set = _dataset(cfg, cfg.val_split, eval_transform(cfg.size), pixels)
    val_labels, val_classes = dataset_labels(val_set)
    return Validator(
        val_set,
        val_labels,
        val_classes,
        way=cfg.val_way,
        shot=cfg.val_shot,
        query=cfg.val_query,
        n_episodes=cfg.val_episodes,
        seed=cfg.seed,
        split=cfg.val_split,
    )


def _prepare_out(cfg: TrainConfig, out: Path, *, resume: bool | None, force: bool) -> None:
    """Check that ``out`` can take this run: empty it with ``force``, else refuse a run made with
    other settings (or, as ``resume`` asks, a missing or an existing one)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output directory {out} is a file", param="out", value=out)
    check_writable_dir(out / "train.json", "output directory")
    last = out / "last.pt"
    if force and out.exists():
        for g in range(cfg.n_generations + 8):
            d = cfg.generation_dir(g)
            for name in ("last.pt", "best.pt", "train.json"):
                with contextlib.suppress(FileNotFoundError):
                    (d / name).unlink()
        return
    if not last.exists():
        if resume is True:
            raise ConfigError(
                f"{mark('resume')}: nothing to resume in {out} (no last.pt)",
                param="resume",
                value=resume,
            )
        return
    saved = _read_checkpoint(last, out)
    if resume is False:
        raise ConfigError(
            f"{mark('out')} {out} already holds a run (epoch {saved.get('epoch')}/{cfg.epochs}); "
            f"resume it, pass {mark('force')} to start over or choose another folder",
            param="out",
            value=out,
        )
    _check_config(last, saved.get("config", {}), cfg)


@dataclass
class _Run:
    """What every generation of one :func:`train` call works with."""

    cfg: TrainConfig
    classes: list[str]
    train_set: ImageDataset
    validator: Validator | None
    dist: _Dist
    device: torch.device
    amp: bool
    emit: Callback
    result: TrainResult
    budget: int | None  # epochs left before a simulated interruption (``stop_after``); None: no limit

    @property
    def per_rank(self) -> int:
        """Images per batch in each process."""
        return self.cfg.batch_size // self.dist.world


@dataclass
class _Saved:
    """What a generation's ``last.pt`` holds to continue from (a fresh start when there is none)."""

    start: int = 0
    best_acc: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    optimizer: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None


@dataclass
class _Generation:
    """One generation's model, the machinery that trains it and where it stands."""

    index: int
    dir: Path
    model: nn.Module
    net: nn.Module  # the model, or its DistributedDataParallel wrapper
    teacher: nn.Module | None
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: DistributedSampler[int]
    loader: DataLoader
    best_acc: float | None
    history: list[dict[str, Any]]

    @property
    def last(self) -> Path:
        return self.dir / "last.pt"

    @property
    def best(self) -> Path:
        return self.dir / "best.pt"


def _train_generation(run: _Run, g: int) -> dict[str, Any]:
    """Train (or continue) generation ``g`` to ``cfg.epochs``; its entry of ``TrainResult.generations``."""
    cfg = run.cfg
    gdir = cfg.generation_dir(g)
    model = _build(cfg, len(run.classes), g)
    saved = _load_last(cfg, model, gdir / "last.pt")
    run.result.history.extend(saved.history)
    if saved.start >= cfg.epochs:
        run.emit(
            TrainEvent(
                "generation", g, cfg.n_generations, saved.start, cfg.epochs, skipped=True, best_acc=saved.best_acc
            )
        )
        return {"dir": str(gdir), "best_acc": saved.best_acc, "epochs_run": 0}
    if cfg.workers > 0:
        # Workers are forked afresh every epoch and would lose what they cached: fill the cache here
        # once (when the split fits), before the first fork, so that every epoch's workers share it.
        for ds in (run.train_set, getattr(run.validator, "dataset", None)):
            if isinstance(ds, ImageDataset):
                ds.preload()
    gen = _setup_generation(run, g, gdir, model, saved)
    run.emit(TrainEvent("generation", g, cfg.n_generations, saved.start, cfg.epochs, best_acc=saved.best_acc))
    epochs_run = 0
    for epoch in range(saved.start, cfg.epochs):
        _train_epoch(run, gen, epoch)
        epochs_run += 1
        if run.budget is not None:
            run.budget -= 1
            if run.budget <= 0 and not (epoch + 1 == cfg.epochs and g + 1 == cfg.n_generations):
                raise _Stop
    return {"dir": str(gdir), "best_acc": gen.best_acc, "epochs_run": epochs_run}


def _load_last(cfg: TrainConfig, model: nn.Module, last: Path) -> _Saved:
    """Load the weights and counters of ``last`` (when it exists) into ``model``; the rest of its
    training state."""
    if not last.exists():
        return _Saved()
    saved = _read_checkpoint(last, cfg.out_dir())
    _check_config(last, saved.get("config", {}), cfg)
    load_checkpoint(model, last)
    _set_counters(model, saved.get("counters", {}))
    return _Saved(
        start=int(saved["epoch"]),
        best_acc=saved.get("best_prec1"),
        history=list(saved.get("history", [])),
        optimizer=saved["optimizer"],
        scaler=saved.get("scaler"),
        rng=saved.get("rng"),
    )


def _teacher(run: _Run, g: int) -> nn.Module:
    """Generation ``g - 1``'s ``cfg.teacher`` checkpoint, frozen, in eval mode on the device."""
    cfg = run.cfg
    teacher = _build(cfg, len(run.classes), g)  # architecture only; weights come from the file
    load_checkpoint(teacher, cfg.generation_dir(g - 1) / f"{cfg.teacher}.pt")
    teacher.to(run.device).eval()
    if cfg.channels_last:
        teacher.to(memory_format=torch.channels_last)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def _setup_generation(run: _Run, g: int, gdir: Path, model: nn.Module, saved: _Saved) -> _Generation:
    """The teacher, the (DDP-wrapped) model on the device, the optimizer and AMP scaler restored
    from ``saved``, and the data order of generation ``g``."""
    cfg, dist, device = run.cfg, run.dist, run.device
    teacher = _teacher(run, g) if g > 0 else None
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    net: nn.Module = model
    if dist.enabled:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(model) if device.type == "cuda" else model
        net = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(
        net.parameters(), lr=cfg.lr_at(saved.start), momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
    scaler = torch.amp.GradScaler(device.type, enabled=run.amp)
    if saved.optimizer is not None:
        optimizer.load_state_dict(saved.optimizer)
        if saved.scaler:
            scaler.load_state_dict(saved.scaler)
        assert saved.rng is not None  # written with the optimizer state by _save below
        restore_rng(saved.rng)
    sampler: DistributedSampler[int] = DistributedSampler(
        run.train_set,
        num_replicas=dist.world,
        rank=dist.rank,
        shuffle=True,
        seed=derive_seed(cfg.seed, g) % 2**62,
        drop_last=False,
    )
    loader = DataLoader(
        run.train_set,
        batch_size=run.per_rank,
        sampler=sampler,
        num_workers=cfg.workers,
        pin_memory=device.type == "cuda",
        drop_last=False,
        worker_init_fn=quiet_worker if cfg.workers > 0 else None,
    )
    return _Generation(g, gdir, model, net, teacher, optimizer, scaler, sampler, loader, saved.best_acc, saved.history)


def _train_epoch(run: _Run, gen: _Generation, epoch: int) -> None:
    """One epoch of generation ``gen``: training, meta-validation when due, checkpoints, events."""
    cfg, g = run.cfg, gen.index
    t0 = time.perf_counter()
    seed_everything(cfg.seed, g, epoch + 1, run.dist.rank)
    gen.sampler.set_epoch(epoch)
    lr = cfg.lr_at(epoch)
    for group in gen.optimizer.param_groups:
        group["lr"] = lr
    run.emit(TrainEvent("epoch", g, cfg.n_generations, epoch, cfg.epochs, total=len(gen.loader), lr=lr))
    stats = _run_epoch(run, gen, epoch)
    val_acc = _validate(run, gen, epoch)
    improved = val_acc is not None and (gen.best_acc is None or val_acc > gen.best_acc)
    if improved:
        gen.best_acc = val_acc
    seconds = time.perf_counter() - t0
    record = {
        "generation": g,
        "epoch": epoch,
        "lr": lr,
        "loss": stats.mean_loss,
        "acc": stats.acc,
        "val_acc": val_acc,
        "seconds": seconds,
    }
    gen.history.append(record)
    run.result.history.append(record)
    if run.dist.main:
        with critical():  # last.pt and best.pt of one epoch: a stop waits for both
            _save(run, gen, epoch, improved)
    run.dist.barrier()
    run.emit(
        TrainEvent(
            "epoch_end",
            g,
            cfg.n_generations,
            epoch,
            cfg.epochs,
            loss=stats.mean_loss,
            acc=stats.acc,
            lr=lr,
            val_acc=val_acc,
            best_acc=gen.best_acc,
            seconds=seconds,
        )
    )


def _validate(run: _Run, gen: _Generation, epoch: int) -> float | None:
    """Meta-validation accuracy after ``epoch`` when one is due (every ``val_every`` epochs and
    after the last), else None."""
    cfg, validator = run.cfg, run.validator
    due = cfg.val_every > 0 and ((epoch + 1) % cfg.val_every == 0 or epoch + 1 == cfg.epochs)
    if validator is None or not due:
        return None
    g = gen.index
    run.emit(TrainEvent("validate", g, cfg.n_generations, epoch, cfg.epochs, total=len(cast(Sized, validator.dataset))))
    return validator(
        gen.model,
        batch_size=max(run.per_rank, 64),
        device=run.device,
        workers=cfg.workers,
        amp=run.amp,
        progress=lambda n: run.emit(TrainEvent("validate_step", g, images=n)),
    )


def _save(run: _Run, gen: _Generation, epoch: int, improved: bool) -> None:
    """Write ``last.pt`` after ``epoch``, and copy it to ``best.pt`` when validation improved (or,
    after the last epoch, when nothing validated or no best exists yet)."""
    cfg = run.cfg
    save_checkpoint(
        gen.model,
        gen.last,
        format=CHECKPOINT_FORMAT,
        epoch=epoch + 1,
        best_prec1=gen.best_acc,
        optimizer=gen.optimizer.state_dict(),
        scheduler={"milestones": list(cfg.resolved_milestones()), "gamma": cfg.gamma, "last_epoch": epoch},
        scaler=gen.scaler.state_dict(),
        rng=capture_rng(),
        counters=_get_counters(gen.model),
        history=gen.history,
        config=cfg.to_dict(),
        classes=run.classes,
        recipe=cfg.recipe,
        generation=gen.index,
    )
    if improved or (epoch + 1 == cfg.epochs and (gen.best_acc is None or not gen.best.exists())):
        _copy_atomic(gen.last, gen.best)


def _run_epoch(run: _Run, gen: _Generation, epoch: int) -> _Running:
    """The training steps of one epoch over ``gen.loader``; the epoch's running loss and accuracy."""
    loader = gen.loader
    gen.net.train()
    stats = _Running()
    # uint8 batches from an ImageDataset: its ToTensor scaling and normalisation, once per batch
    finish = getattr(loader.dataset, "finish", None)
    with loader_batches(loader) as batches:
        for images, labels in batches:
            _train_step(run, gen, epoch, stats, finish, images, labels)
    return stats


def _train_step(
    run: _Run, gen: _Generation, epoch: int, stats: _Running, finish: Any, images: torch.Tensor, labels: torch.Tensor
) -> None:
    """One optimiser step of generation ``gen`` on a batch; adds to ``stats``."""
    cfg, device, loader = run.cfg, run.device, gen.loader
    # a safe point to stop at (SIGTERM, Ctrl-C): the epoch is dropped, last.pt holds the one before
    run.dist.stop_point()
    if loader.num_workers > 0 and hasattr(loader.dataset, "check"):
        loader.dataset.check(labels)  # a bad image in a worker arrives as a sentinel label
    if images.shape[0] < 2:  # BatchNorm cannot train on one image; the data order stays fixed
        return
    images = images.to(device, non_blocking=True)
    if finish is not None:
        images = finish(images)  # on the device: the uint8 batch is what is copied
    labels = labels.to(device, non_blocking=True)
    rot_labels = None
    if cfg.rotation:
        images, rot_labels = rotate_all(images)
        labels = labels.repeat(4)
    if cfg.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    logits, loss = _loss(run, gen, images, labels, rot_labels)
    if not torch.isfinite(loss):
        raise ConfigError(
            f"the loss became {loss.item()} in generation {gen.index}, epoch {epoch}: lower {mark('lr')} or "
            f"turn {mark('amp')} off",
        )
    gen.optimizer.zero_grad(set_to_none=True)
    gen.scaler.scale(loss).backward()
    gen.scaler.step(gen.optimizer)
    gen.scaler.update()
    correct = (logits.detach().argmax(1) == labels).sum().item()
    stats.add(loss.item(), correct, labels.shape[0])
    run.emit(
        TrainEvent(
            "step",
            gen.index,
            epoch=epoch,
            images=images.shape[0] // (4 if cfg.rotation else 1) * run.dist.world,
            loss=stats.mean_loss,
            acc=stats.acc,
        )
    )


def _loss(
    run: _Run, gen: _Generation, images: torch.Tensor, labels: torch.Tensor, rot_labels: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(class logits [B, C], loss)`` of one batch: label-smoothed cross-entropy, plus the rotation
    loss (``rot``) and the distillation loss (a student of ``rot-kd``)."""
    cfg = run.cfg
    with torch.autocast(run.device.type, dtype=torch.float16, enabled=run.amp):
        logits, rot_logits = gen.net(images)
        loss = smooth_cross_entropy(logits, labels, cfg.label_smoothing)
        if rot_labels is not None:
            loss = loss + cfg.rot_weight * smooth_cross_entropy(rot_logits, rot_labels, cfg.label_smoothing)
        if gen.teacher is not None:
            with torch.no_grad():
                t_logits, t_rot = gen.teacher(images)
            kd = distill_kl(logits, t_logits, cfg.temperature)
            if rot_labels is not None:
                kd = kd + distill_kl(rot_logits, t_rot, cfg.temperature)
            loss = cfg.sup_weight * loss + cfg.kd_weight * kd
    return logits, loss


def _write_summary(cfg: TrainConfig, result: TrainResult) -> None:
    summary = {
        "config": cfg.to_dict(),
        "checkpoint": str(result.checkpoint),
        "last_checkpoint": str(result.last_checkpoint),
        "generations": result.generations,
        "history": result.history,
    }
    path = cfg.out_dir() / "train.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(summary, indent=1))
