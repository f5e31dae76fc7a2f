"""The settings of ``poodle demo``: :class:`DemoConfig`, declared once (poodle.options), and the
choice of its transductive competitors.

Its own module, below :mod:`poodle.demo` (which runs it), so that :mod:`poodle.settings` reads its
declarations for the docs' tables without importing the stages it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from poodle import defaults, solvers
from poodle.episodes import CellSpec, EpisodeSpec
from poodle.errors import ConfigError, mark
from poodle.negatives import NegativeSpec
from poodle.options import check_group, option, option_like
from poodle.run import RunOptions
from poodle.train.config import TrainConfig

DATASET = "glyphs"

# The transductive methods the paper compares with (Table 4 and appendix Tables 9-10): entropy
# minimisation, CAN-T, LaplacianShot, TIM-GD, mean-shift, Bayes k-means and soft k-means.
PAPER_COMPETITORS = ("entropy-min", "can-t", "laplacianshot", "tim-gd", "mean-shift", "bayes-kmeans", "soft-kmeans")
# What --quick changes (quick_config): 1 epoch of small batches, validated once, 40 episodes.
QUICK: dict[str, Any] = {"epochs": 1, "episodes": 40, "val_every": 1, "batch_size": 32}
EPOCHS, BATCH_SIZE = 3, 128  # about 2 CPU minutes of training (docs/demo.md)


@dataclass
class DemoConfig:
    """What ``poodle demo`` runs. Defaults: a conv4 trained about 2 CPU minutes (3 epochs of batches
    of 128 at lr 0.1, no augmentation, channels-last: docs/demo.md), the paper's evaluation
    protocol (2,000 episodes, 5-way, 15 queries, 400 negatives; section 5.1).

    A setting the demo passes on to another stage is that stage's declaration with the demo's
    default (:func:`poodle.options.option_like`: its bounds, checks and help are
    :class:`poodle.train.TrainConfig`'s, :class:`poodle.episodes.EpisodeSpec`'s ...); the demo's own
    are declared here. ``poodle demo``'s options are made from these fields (those with a
    command-line option), and the docs' table (docs/settings.md).

    ``quick`` shrinks everything for tests: a small subset of glyph classes, one epoch, few episodes
    (:func:`quick_config`).
    """

    cache_root: str = defaults.CACHE_ROOT
    backbone: str = "conv4_64"
    protocol: str = option_like(
        EpisodeSpec,
        "protocol",
        when_set=False,
        help="fixed: the paper's 5-way table; meta-dataset: the per-domain table on domains of test "
        "alphabets (docs/demo.md).",
    )
    episodes: int | None = option_like(
        CellSpec,
        "episodes",
        None,
        help="Episodes per shot count, or per domain with --protocol meta-dataset.",
        default_text=f"{defaults.EPISODES}, {defaults.META_DATASET_EPISODES}; --quick: {QUICK['episodes']}",
    )
    recipe: str = option_like(TrainConfig, "recipe")
    epochs: int = option_like(
        TrainConfig,
        "epochs",
        EPOCHS,
        help="Training epochs of the demo's backbone.",
        default_text=f"{EPOCHS}, about 2 CPU minutes; --quick: {QUICK['epochs']}",
    )
    batch_size: int = option_like(
        TrainConfig,
        "batch_size",
        BATCH_SIZE,
        help="Training batch.",
        default_text=f"{BATCH_SIZE}; --quick: {QUICK['batch_size']}",
    )
    lr: float = option_like(TrainConfig, "lr", 0.1, help="Training learning rate.")
    channels_last: bool = option_like(
        TrainConfig,
        "channels_last",
        True,
        help="Train on NHWC tensors: 1.2-1.6x faster per step on a CPU, more for larger batches.",
    )
    image_size: int = option_like(TrainConfig, "image_size", 28, help="Input side in pixels (the glyphs' own).")
    seed: int = option_like(TrainConfig, "seed", defaults.SEED, help="Seed of training and of the episodes.")
    device: str = option_like(TrainConfig, "device")
    workers: int = option_like(TrainConfig, "workers", 0, help="DataLoader worker processes.")
    threads: int = option(
        0,
        min=0,
        help="CPU threads for torch (0: torch's default, one per core). On a busy machine 1 can be much faster.",
    )
    competitors: str | tuple[str, ...] = option(
        "paper",
        help="Transductive methods to add: paper (those the paper compares with), all, none, or a comma list.",
    )
    quick: bool = option(False, help="A tiny run (a few glyph classes, 1 epoch, 40 episodes) for tests.")
    # the rest is the demo's own choice, with no command-line option
    augment: str = option_like(TrainConfig, "augment", "none", cli=False)
    val_every: int = option_like(TrainConfig, "val_every", 3, cli=False)
    way: int = option_like(EpisodeSpec, "way", cli=False, help="Classes per episode of the table.")
    shots: tuple[int, ...] = option_like(EpisodeSpec, "shot", (1, 5), cli=False, help="The table's shot counts.")
    query: int = option_like(EpisodeSpec, "query", cli=False, help="Queries per class of an episode of the table.")
    n_neg: int = option_like(NegativeSpec, "n_neg", cli=False)
    max_memory: str = option_like(RunOptions, "max_memory", defaults.MAX_MEMORY, cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.shots, (list, tuple)):
            self.shots = tuple(int(s) if isinstance(s, np.integer) else s for s in self.shots)
        if self.episodes is None:  # the Meta-Dataset protocol reports fewer a domain
            self.episodes = defaults.META_DATASET_EPISODES if self.protocol == "meta-dataset" else defaults.EPISODES
        check_group(self, ConfigError)
        competitor_names(self.competitors)  # an unknown name refused now, not after training

    def milestones(self) -> tuple[int, ...]:
        """The lr decays (x0.1 at the start of these epochs): one, before the last epoch, from 4
        epochs on; none below. Measured on the val episodes (docs/demo.md): after 3 epochs at lr 0.1,
        64.6%, and 60.0% when the third ran at 0.01 instead; after 4 with the fourth at 0.01, 68.2%.
        The paper's 60%/80% schedule is for 90+ epochs."""
        return (self.epochs - 1,) if self.epochs >= 4 else ()

    def train_config(self, dataset: str = DATASET, data_root: str | None = None):
        """The :class:`poodle.train.TrainConfig` of the demo's backbone."""
        return TrainConfig(
            dataset=dataset,
            data_root=data_root,
            backbone=self.backbone,
            recipe=self.recipe,
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            milestones=self.milestones(),
            image_size=self.image_size,
            augment=self.augment,
            channels_last=self.channels_last,
            val_every=self.val_every,
            val_episodes=100 if self.quick else 500,
            seed=self.seed,
            workers=self.workers,
            device=self.device,
            cache_root=self.cache_root,
        )


def quick_config(**overrides: Any) -> DemoConfig:
    """The ``--quick`` settings (tests, smoke runs): a small glyph subset, 1 epoch, 40 episodes
    (:data:`QUICK`); ``overrides`` win."""
    return DemoConfig(**{**QUICK, "quick": True, **overrides})


def competitor_names(which: str | tuple[str, ...] | list[str]) -> list[str]:
    """Registered always-transductive methods selected by ``which``: ``paper`` (those the paper
    compares with, :data:`PAPER_COMPETITORS`), ``all``, ``none``, or names (a tuple or a
    comma-separated string). An unknown or non-transductive name is a ConfigError."""
    registered = [
        n for n in solvers.available() if solvers.get(n).transductive == "always" and not solvers.get(n).uses_negatives
    ]
    if isinstance(which, str):
        if which == "all":
            return registered
        if which == "none":
            return []
        names = list(PAPER_COMPETITORS) if which == "paper" else [w.strip() for w in which.split(",") if w.strip()]
    else:
        names = list(which)
    if which == "paper":
        return [n for n in names if n in registered]  # a missing solver leaves its row out
    for n in names:
        if n not in registered:
            raise ConfigError(
                f"{mark('competitors')}: {n!r} is not a registered transductive method; choose from "
                f"{', '.join(registered)} (or paper, all, none)",
                param="competitors",
                value=n,
            )
    return names


__all__ = ["PAPER_COMPETITORS", "QUICK", "DemoConfig", "competitor_names", "quick_config"]
