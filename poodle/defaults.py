"""The evaluation protocol's defaults, in one place.

The defaults are the paper's main protocol (Le et al., NeurIPS 2021, section 5.1): 5-way episodes
with 15 queries per class, 2,000 test episodes, K = 400 negatives per episode drawn from the base
classes. The settings' declarations (:class:`poodle.episodes.EpisodeSpec`,
:class:`poodle.negatives.NegativeSpec`, :mod:`poodle.settings` ...) take their defaults from here.
"""

from __future__ import annotations

from typing import Any, Callable

SPLIT = "test"
WAY = 5
SHOT = 1
QUERY = 15  # queries per class; an episode has WAY * QUERY of them
EPISODES = 2000
SEED = 0
NEGATIVES = "base"
N_NEG = 400
METHOD = "poodle"
PREPROCESS = "l2n"  # feature preprocessing (poodle.preprocess): the cached L2-normalised rows
DEVICE = "auto"
# The step of the fine-tuning fits on CUDA: "torch" (two batched matmuls a step) or "triton" (one
# kernel that reads each row once a step; opt-in until a GPU has timed both, docs/gpu.md).
CUDA_STEP = "torch"
CUDA_STEPS = ("torch", "triton")
CACHE_ROOT = "cache"  # where extract, train and demo keep what they make, by dataset
DATASET = "glyphs"  # the embedded dataset (generated on first use): extract's and train's default
# the names --dataset takes (poodle.data.resolve_dataset): extract's and train's choices
DATASETS: tuple[str, ...] = ("csv", "folder", "mini", "tiered", "cub", "glyphs", "cifar-fs", "fc100")
# Image side fed to a backbone of the release: the paper's 84, except where a dataset has its own
# (the glyphs are drawn at 28 px, as the demo trains and extracts them; CIFAR's images are 32 px).
IMAGE_SIZE = 84
DATASET_IMAGE_SIZES: dict[str, int] = {"glyphs": 28, "cifar-fs": 32, "fc100": 32}
PRETRAINED = "DEFAULT"  # pretrained weights of a timm/torchvision model: its library's default ones
PROJECT_FILE = "poodle.toml"  # a project's defaults, read from the working directory (poodle.project)
CACHE_INDEX = "caches.json"  # <cache_root>/caches.json: the caches extract wrote, the last one last
MAX_MEMORY = "2GiB"
# Feature extraction (poodle extract): the splits written, images per forward pass, storage type,
# and CUB's class split (the release's rule; see poodle.data.sources).
SPLITS: tuple[str, ...] = ("train", "val", "test")
EXTRACT_BATCH_SIZE = 64
FEATURE_DTYPE = "float32"
CUB_SPLIT = "release"
# poodle predict decodes its few images in-process: worker start-up costs more than it saves.
PREDICT_WORKERS = 0
# Cells on the same episodes and negatives solved by one call of evaluate (poodle grid).
CELLS_PER_CALL = 4

# Negative sources that are keywords, not files (see poodle.negatives).
NEGATIVE_KEYWORDS: tuple[str, ...] = ("base", "random", "sphere", "none")

# How episodes are drawn: "fixed" (way, shot and query per episode, the paper's) or "meta-dataset"
# (Triantafillou et al., ICLR 2020: ways, shots and queries drawn per episode by the rules of
# google-research/meta-dataset's meta_dataset/data/sampling.py; their parameters and defaults are
# EpisodeSpec's fields of those names).
PROTOCOL = "fixed"
PROTOCOLS: tuple[str, ...] = ("fixed", "meta-dataset")
# Episodes per domain under the Meta-Dataset protocol when not given (its papers report 600).
META_DATASET_EPISODES = 600
META_DATASET_KEYS: tuple[str, ...] = (
    "min_ways",
    "max_ways_upper_bound",
    "max_num_query",
    "max_support_set_size",
    "max_support_size_contrib_per_class",
    "min_log_weight",
    "max_log_weight",
    "bilevel",
)

# The key tables of the settings (which keys choose the episodes, which are recorded only when set,
# the general keys and their defaults) are derived from the settings' declarations: poodle.settings.
_MOVED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "EPISODE_KEYS": ('("cache", *poodle.settings.EPISODE_KEYS)', lambda s: ("cache", *s.EPISODE_KEYS)),
    "OPTIONAL_EPISODE_KEYS": ("poodle.settings.WHEN_SET_EPISODE_KEYS", lambda s: s.WHEN_SET_EPISODE_KEYS),
    "NEGATIVE_KEYS": (
        "the keys of poodle.options.settings(NegativeSpec)",
        lambda s: tuple(x.key for x in s.settings(s.NegativeSpec)),
    ),
    "GENERAL_KEYS": ("poodle.settings.GENERAL_KEYS", lambda s: s.GENERAL_KEYS),
    "GENERAL_DEFAULTS": ("poodle.settings.general_defaults()", lambda s: s.general_defaults()),
}


def __getattr__(name: str) -> Any:
    """The key tables that lived here before 0.2.0, derived from poodle.settings, with a warning."""
    if name not in _MOVED:
        raise AttributeError(f"module 'poodle.defaults' has no attribute {name!r}")
    import warnings

    from poodle import settings

    instead, derive = _MOVED[name]
    warnings.warn(
        f"poodle.defaults.{name} is deprecated: use {instead}, derived from the settings' declarations "
        f"(removed in 0.3.0)",
        DeprecationWarning,
        stacklevel=2,
    )
    return derive(settings)


# Input normalisation of ImageNet-pretrained backbones (torchvision's constants).
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

# Bytes of decoded pixels a training run keeps in memory (train and val splits together) so that
# later epochs skip decoding (poodle.data.PixelCache): the glyphs' 24,960 train and 7,160 val images
# take 76 MB, CIFAR-FS's 38,400 train images 118 MB; images beyond the budget are decoded every epoch.
IMAGE_CACHE_BYTES = 256 * 2**20
