"""The training configuration: one dataclass whose defaults are the paper's recipe.

Sources: Le et al., NeurIPS 2021, section 5.1 "Implementation details" (SGD, lr 0.05, weight decay
5e-4, decay x0.1 at epochs 60/80 (tiered 60/80/90), 100 epochs, batch 64) and appendix A (the
simple, rot and rot + KD baselines, lambda = 1, tau = 4, two born-again generations); label
smoothing 0.1, validation every 4 epochs on 500 5-way 1-shot val episodes and the augmentation come
from the authors' release (configs, SmoothCrossEntropy, meta_val).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poodle import defaults
from poodle.errors import ConfigError
from poodle.options import option, violation
from poodle.utils import check_seed

RECIPES = ("simple", "rot", "rot-kd")
AUGMENTATIONS = ("paper", "crop", "none")
TEACHERS = ("last", "best")

# Fields that do not change the weights a run produces: they may differ between an interrupted run
# and the command that resumes it.
RUNTIME_FIELDS = frozenset({"device", "workers", "cache_root", "data_root", "out", "amp"})


@dataclass
class TrainConfig:
    """Everything that defines a pre-training run.

    Attributes:
        dataset, data_root: as for ``poodle extract`` (``glyphs``, ``mini``, ``csv``, ``folder``...).
        backbone: a name from :func:`poodle.backbones.available`.
        recipe: ``simple`` (label-smoothed CE), ``rot`` (+ 4-rotation self-supervision) or
            ``rot-kd`` (rot, then ``generations`` born-again students distilled from the previous one).
        epochs, batch_size, lr, momentum, weight_decay: SGD settings (paper section 5.1).
            ``batch_size`` is the global batch: under torchrun each of W processes takes batch/W.
        milestones: epochs (0-based, the decay takes effect *at* that epoch) where the lr is
            multiplied by ``gamma``; ``None`` means 60% and 80% of ``epochs`` (and 90% for tiered),
            i.e. the paper's 60/80 (60/80/90) at 100 epochs.
        label_smoothing: epsilon of the release's SmoothCrossEntropy (1 - eps on the true class,
            eps/(C-1) on each other class).
        rot_weight: lambda_ssl of appendix A eq. (2).
        generations, temperature, teacher: born-again KD (appendix A): the number of students, tau,
            and which checkpoint of the previous generation teaches (``last`` as the paper says;
            the release uses ``best``).
        sup_weight, kd_weight: loss = sup_weight * supervised + kd_weight * distillation; the paper
            says 1/1, the release uses 0.5/0.5.
        image_size: input side in pixels (None: 84, the paper's, or the dataset's own size: glyphs 28,
            cifar-fs and fc100 32); augment: ``paper`` (random resized crop, jitter 0.4, flip),
            ``crop`` (a mild random resized crop, scale 0.5-1, no flip/jitter: for glyphs, where
            mirroring makes another character) or ``none`` (the eval transform).
        val_every, val_episodes, val_way, val_shot, val_query, val_split: meta-validation with
            nearest prototypes (0 disables it; the best checkpoint is then the last).
        channels_last: run the convolutions on channels-last (NHWC) tensors. On a CPU it makes
            a training step 1.2-1.6x faster (docs/train.md); the weights then differ from a
            channels-first run by float rounding, so it is a defining setting.
        seed: all randomness (init, data order, augmentation) derives from it.
        workers, device, amp: runtime only (``amp=None``: on for CUDA, off on CPU).
        cache_root: where ``glyphs`` is generated and the default output directory lies.
        out: output directory (default ``<cache_root>/<dataset>/checkpoints/<backbone>-<recipe>``).
    """

    # Numeric fields declare their bounds (poodle.options.option), checked once in :meth:`check`, so
    # the command line and the library get the same check; every number must also be finite.
    dataset: str
    backbone: str
    recipe: str = "simple"
    data_root: str | None = None
    epochs: int = option(100, min=1)  # paper 5.1
    batch_size: int = option(64, min=1)  # paper 5.1
    lr: float = option(0.05, min=0, min_open=True)  # paper 5.1
    momentum: float = option(0.9, min=0, max=1, max_open=True)  # release configs (SGD, nesterov off)
    weight_decay: float = option(5e-4, min=0)  # paper 5.1
    milestones: tuple[int, ...] | None = None  # paper 5.1: 60/80 (tiered 60/80/90) of 100
    gamma: float = option(0.1, min=0, min_open=True, max=1)  # paper 5.1: "decreased by a factor of 10"
    label_smoothing: float = option(0.1, min=0, max=1, max_open=True)  # release default (SmoothCrossEntropy)
    rot_weight: float = option(1.0, min=0)  # appendix A: lambda_ssl = 1
    generations: int = option(2, min=0)  # appendix A: T = 2
    temperature: float = option(4.0, min=0, min_open=True)  # appendix A: tau = 4
    teacher: str = "last"  # appendix A: "the last checkpoint"
    sup_weight: float = option(1.0, min=0)  # appendix A: lambdas = 1 (release: 0.5)
    kd_weight: float = option(1.0, min=0)  # appendix A: lambdas = 1 (release: 0.5)
    # paper 5.1: 84; None: the dataset's own (defaults.DATASET_IMAGE_SIZES: glyphs 28, CIFAR 32)
    image_size: int | None = option(None, min=1)
    augment: str = "paper"  # release transform.py with_augment
    val_every: int = option(4, min=0)  # release meta_val_interval
    val_episodes: int = option(500, min=1)  # release meta_val
    val_way: int = option(5, min=2)
    val_shot: int = option(1, min=1)  # release meta_val_shot
    val_query: int = option(15, min=1)
    val_split: str = "val"
    seed: int = 0
    channels_last: bool = False
    workers: int = option(None, min=0)  # type: ignore[assignment]  # None: one per usable core, at most 4
    device: str = defaults.DEVICE
    amp: bool | None = None
    cache_root: str = defaults.CACHE_ROOT
    out: str | None = None

    def __post_init__(self) -> None:
        if self.image_size is None:
            self.image_size = defaults.DATASET_IMAGE_SIZES.get(self.dataset, defaults.IMAGE_SIZE)
        if self.workers is None:
            from poodle.system import TRAIN_WORKERS, default_workers

            self.workers = default_workers(TRAIN_WORKERS)
        if self.milestones is not None:
            self.milestones = tuple(int(m) for m in self.milestones)
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first impossible setting (and, in ``params``, the
        fields it speaks of)."""
        if self.recipe not in RECIPES:
            raise ConfigError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}", params=("recipe",))
        if self.augment not in AUGMENTATIONS:
            raise ConfigError(
                f"augment {self.augment!r} is unknown; choose one of {', '.join(AUGMENTATIONS)}", params=("augment",)
            )
        if self.teacher not in TEACHERS:
            raise ConfigError(
                f"teacher must be one of {', '.join(TEACHERS)}, got {self.teacher!r}", params=("teacher",)
            )
        for f in dataclasses.fields(self):
            why = violation(f, getattr(self, f.name))
            if why is not None:
                raise ConfigError.bad_value(f.name, getattr(self, f.name), why)
        try:
            check_seed(self.seed)
        except ConfigError as e:
            raise ConfigError(str(e), params=("seed",)) from None
        if self.recipe == "rot-kd" and not self.generations:  # a rule between two settings
            raise ConfigError(
                f"recipe rot-kd needs generations >= 1, got {self.generations}", params=("recipe", "generations")
            )
        for m in self.milestones or ():
            if m < 1 or m >= self.epochs:  # each milestone an epoch after the first: a rule between two settings
                raise ConfigError(
                    f"milestones contain {m}, outside 1..{self.epochs - 1} (epochs {self.epochs})",
                    params=("milestones", "epochs"),
                )

    # -- derived values ---------------------------------------------------------------------

    @property
    def rotation(self) -> bool:
        return self.recipe in ("rot", "rot-kd")

    @property
    def n_generations(self) -> int:
        """Training runs in total: the teacher run plus the born-again students."""
        return 1 + (self.generations if self.recipe == "rot-kd" else 0)

    @property
    def size(self) -> int:
        """The input side: ``image_size`` as :meth:`__post_init__` resolved it."""
        assert self.image_size is not None
        return int(self.image_size)

    def resolved_milestones(self) -> tuple[int, ...]:
        """The lr-decay epochs; ``None`` scales the paper's 60/80 (tiered 60/80/90) to ``epochs``."""
        if self.milestones is not None:
            return tuple(sorted(self.milestones))
        fractions = (0.6, 0.8, 0.9) if self.dataset == "tiered" else (0.6, 0.8)
        return tuple(sorted({m for m in (round(f * self.epochs) for f in fractions) if 0 < m < self.epochs}))

    def lr_at(self, epoch: int) -> float:
        """Learning rate of 0-based ``epoch``: decayed *from* each milestone on (the release decays
        one epoch late; see docs/train.md)."""
        return self.lr * self.gamma ** sum(1 for m in self.resolved_milestones() if epoch >= m)

    def out_dir(self) -> Path:
        if self.out is not None:
            return Path(self.out)
        return Path(self.cache_root) / self.dataset / "checkpoints" / f"{self.backbone}-{self.recipe}"

    def generation_dir(self, generation: int) -> Path:
        """Generation 0 writes to the output directory itself, student ``i`` to ``student_<i>/``
        (the release's layout)."""
        root = self.out_dir()
        return root if generation == 0 else root / f"student_{generation - 1}"

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (stored in every checkpoint, loadable with ``weights_only=True``)."""
        d = dataclasses.asdict(self)
        d["milestones"] = list(self.resolved_milestones())
        return d

    def defining(self) -> dict[str, Any]:
        """The fields that determine the trained weights (compared on resume)."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``["epochs: 100 -> 10", ...]`` for every defining field that differs. A field that a run
    saved by an earlier version lacks counts as its default (the behaviour that version had)."""
    field_defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    diffs = []
    for key in sorted(set(saved) | set(current)):
        if key in RUNTIME_FIELDS:
            continue
        a, b = saved.get(key, field_defaults.get(key)), current.get(key, field_defaults.get(key))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            a, b = list(a), list(b)
        if a != b:
            diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs
