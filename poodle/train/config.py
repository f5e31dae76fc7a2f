"""The training configuration: one dataclass whose defaults are the paper's recipe.

Sources: Le et al., NeurIPS 2021, section 5.1 "Implementation details" (SGD, lr 0.05, weight decay
5e-4, decay x0.1 at epochs 60/80 (tiered 60/80/90), 100 epochs, batch 64) and appendix A (the
simple, rot and rot + KD baselines, lambda = 1, tau = 4, two born-again generations); label
smoothing 0.1, validation every 4 epochs on 500 5-way 1-shot val episodes and the augmentation come
from the authors' release (configs, SmoothCrossEntropy, meta_val).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poodle import defaults
from poodle.errors import ConfigError, mark
from poodle.options import check_group, option
from poodle.utils import SEED_MAX

RECIPES = ("simple", "rot", "rot-kd")
AUGMENTATIONS = ("paper", "crop", "none")
TEACHERS = ("last", "best")

# Fields that do not change the weights a run produces: they may differ between an interrupted run
# and the command that resumes it.
RUNTIME_FIELDS = frozenset({"device", "workers", "cache_root", "data_root", "out", "amp"})


@dataclass
class TrainConfig:
    """Everything that defines a pre-training run.

    Each setting of the recipe and the run is declared once below with :func:`poodle.options.option`
    (default, bounds, help): ``poodle train``'s options, their checks (:meth:`check`) and the docs'
    table (docs/settings.md) are made from these declarations. Notes beyond a field's help:

    - ``batch_size`` is the global batch: under torchrun each of W processes takes batch/W.
    - ``milestones`` are 0-based epochs where the decay takes effect (at that epoch); None means 60%
      and 80% of ``epochs`` (and 90% for tiered), the paper's 60/80 (60/80/90) at 100 epochs.
    - ``label_smoothing`` is epsilon of the release's SmoothCrossEntropy (1 - eps on the true class,
      eps/(C-1) on each other class); ``rot_weight`` is lambda_ssl of appendix A eq. (2).
    - ``channels_last``: the weights differ from a channels-first run by float rounding, so it is a
      defining setting (docs/train.md).
    - ``workers``, ``device``, ``amp``, ``cache_root``, ``data_root`` and ``out`` are runtime only
      (:data:`RUNTIME_FIELDS`): a run may be resumed with others.

    Attributes:
        dataset, data_root: as for ``poodle extract`` (``glyphs``, ``mini``, ``csv``, ``folder``...).
        backbone: a name from :func:`poodle.backbones.available`.
        cache_root: where ``glyphs`` is generated and the default output directory lies.
        out: output directory (default ``<cache_root>/<dataset>/checkpoints/<backbone>-<recipe>``).
    """

    dataset: str
    backbone: str
    recipe: str = option(
        "simple",
        choices=RECIPES,
        help="simple (label-smoothed cross-entropy), rot (+ 4-rotation self-supervision) or rot-kd "
        "(rot, then born-again students distilled from the previous generation).",
    )
    data_root: str | None = None
    epochs: int = option(100, min=1, help="Training epochs (paper 5.1: 100).")
    batch_size: int = option(64, min=1, help="Global batch (split over torchrun processes).")
    lr: float = option(0.05, min=0, min_open=True, help="SGD learning rate (paper 5.1: 0.05).")
    momentum: float = option(0.9, min=0, max=1, max_open=True, help="SGD momentum (the release's; no Nesterov).")
    weight_decay: float = option(5e-4, min=0, help="SGD weight decay (paper 5.1: 5e-4).")
    milestones: tuple[int, ...] | None = option(
        None,
        min=1,
        metavar="EPOCHS",
        none_words=("auto",),
        help="Epochs where lr is multiplied by --gamma, e.g. 60,80 [default: 60%,80% of --epochs; tiered 60/80/90%].",
    )
    gamma: float = option(
        0.1, min=0, min_open=True, max=1, help="Factor of the lr at each milestone (paper 5.1: a tenth)."
    )
    label_smoothing: float = option(
        0.1, min=0, max=1, max_open=True, help="Label smoothing of the cross-entropy (the release's)."
    )
    rot_weight: float = option(1.0, min=0, help="lambda of the rotation loss.")  # appendix A: lambda_ssl = 1
    generations: int = option(2, min=0, help="Born-again students (rot-kd).")  # appendix A: T = 2
    temperature: float = option(4.0, min=0, min_open=True, help="Distillation temperature (rot-kd).")  # tau = 4
    teacher: str = option(
        "last",
        choices=TEACHERS,
        help="Checkpoint of the previous generation that teaches (paper: last; release: best).",
    )
    sup_weight: float = option(1.0, min=0, help="Supervised loss weight (release: 0.5).")  # appendix A: 1
    kd_weight: float = option(1.0, min=0, help="Distillation loss weight (release: 0.5).")  # appendix A: 1
    # paper 5.1: 84; None: the dataset's own (defaults.DATASET_IMAGE_SIZES: glyphs 28, CIFAR 32)
    image_size: int | None = option(
        None,
        min=1,
        help="Input side in pixels [default: 84, the paper's; glyphs 28, cifar-fs and fc100 32, their own].",
    )
    augment: str = option(
        "paper",
        choices=AUGMENTATIONS,
        help="paper: random resized crop + jitter + flip; crop: mild crop only (glyphs); none.",
    )  # the release's transform.py with_augment; crop: mirroring a glyph makes another character
    val_every: int = option(4, min=0, help="Meta-validate every N epochs (0: never).")  # release meta_val_interval
    val_episodes: int = option(500, min=1, help="Meta-validation episodes (nearest prototypes).")  # release meta_val
    val_way: int = option(5, min=2, help="Classes per meta-validation episode.")
    val_shot: int = option(1, min=1, help="Labelled images per class of a meta-validation episode.")
    val_query: int = option(15, min=1, help="Queries per class of a meta-validation episode.")
    val_split: str = option("val", cli=False, help="Split the meta-validation episodes come from.")
    seed: int = option(
        0,
        min=0,
        max=SEED_MAX,
        why="what torch, numpy and HDF5 hold: 63 bits",
        help="Seed of all of training's randomness (initialisation, data order, augmentation).",
    )
    channels_last: bool = option(
        False,
        help="Convolutions on NHWC tensors: 1.2-1.6x faster steps on a CPU; the weights differ by rounding.",
    )
    workers: int = option(  # type: ignore[assignment]  # None: resolved by __post_init__
        None, min=0, help="DataLoader worker processes [default: one per usable core, at most 4; poodle info --system]."
    )
    device: str = option(defaults.DEVICE, help="auto, cpu, cuda or cuda:N.")
    amp: bool | None = option(None, help="Mixed precision [default: on for CUDA, off on CPU].")
    cache_root: str = defaults.CACHE_ROOT
    out: str | None = None

    def __post_init__(self) -> None:
        if self.image_size is None:
            self.image_size = defaults.DATASET_IMAGE_SIZES.get(self.dataset, defaults.IMAGE_SIZE)
        if self.workers is None:
            from poodle.system import TRAIN_WORKERS, default_workers

            self.workers = default_workers(TRAIN_WORKERS)
        if isinstance(self.milestones, (list, tuple)):  # a checkpoint's list, numpy's integers: plain ints
            self.milestones = tuple(int(m) if _integral(m) else m for m in self.milestones)
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first impossible setting (and, in ``params``, the
        fields it speaks of): a value outside its declaration (:func:`poodle.options.check_group`),
        then the rules between settings."""
        check_group(self, ConfigError)
        if self.recipe == "rot-kd" and not self.generations:
            raise ConfigError(
                f"{mark('recipe')} rot-kd needs {mark('generations')} >= 1, got {self.generations}",
                param="generations",
                value=self.generations,
            )
        for m in self.milestones or ():
            if m >= self.epochs:  # each milestone an epoch before the last (its bound: at least 1)
                raise ConfigError(
                    f"{mark('milestones')} contain {m}, outside 1..{self.epochs - 1} ({mark('epochs')} {self.epochs})",
                    param="milestones",
                    value=self.milestones,
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


def _integral(m: Any) -> bool:
    return (isinstance(m, numbers.Integral) and not isinstance(m, bool)) or (isinstance(m, float) and m.is_integer())


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
