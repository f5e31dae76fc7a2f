"""Negative (out-of-distribution) samples for POODLE's push term.

Sources (``NegativeSpec.source``):

- ``base``: rows of the cache's own ``train`` split (the base classes; POODLE-B).
- ``random``: i.i.d. U[0, 1) per coordinate, then L2-normalised, as the authors' code does
  (POODLE-R; these lie in the positive orthant, near the diagonal, not uniformly on the sphere).
- ``sphere``: Gaussian then L2-normalised: uniform on the unit sphere, as the paper's text says.
- ``FILE[:SPLIT]``: rows of another cache (cross-domain "disjoint" or "noisy" pools); SPLIT
  defaults to ``train``.
- ``none``: no negatives.

``n_neg`` negatives per episode (400, paper section 5.1; the authors' code uses 375 base or 75
random ones), drawn once per episode and fixed for all steps. Pool rows are drawn uniformly *with
replacement* (as the authors' ``np.random.randint``) from generator ``(seed, i, NEG_STREAM)`` of
episode ``i``; generated negatives come from the same per-episode generator, so no negative
depends on the chunk size or device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from poodle import defaults
from poodle.cache import read_split
from poodle.errors import CacheError, ConfigError
from poodle.prefetch import pool_location
from poodle.utils import generator

# Third component of the negatives' generator seed: keeps them independent of the episode draw.
NEG_STREAM = 1
GENERATED = ("random", "sphere")
KEYWORDS = defaults.NEGATIVE_KEYWORDS


@dataclass(frozen=True)
class NegativeSpec:
    """Where the negatives come from and how many per episode (paper 5.1: K = 400)."""

    source: str = defaults.NEGATIVES
    n_neg: int = defaults.N_NEG

    def validate(self) -> None:
        if isinstance(self.n_neg, bool) or not isinstance(self.n_neg, int) or self.n_neg < 1:
            raise ConfigError.bad_value("n_neg", self.n_neg, "must be a positive integer")
        if not self.source:
            raise ConfigError("empty negative source: use base, random, sphere, none or FILE[:SPLIT]")

    @property
    def generated(self) -> bool:
        return self.source in GENERATED

    @property
    def is_none(self) -> bool:
        return self.source == "none"


_POOLS: dict[tuple[str, str, int, int], Tensor] = {}


def pool_file(source: str, cache_path: Path | str | None) -> Path:
    """The file of a pool source (``base``: the cache itself); a ConfigError when it is missing."""
    path = pool_location(source, cache_path)[0]
    if not path.is_file():
        raise ConfigError(
            f"negatives {source}: no such cache file {str(path)!r} (the keywords are base, random, sphere and "
            f"none; anything else names a pool file, FILE[:SPLIT])",
            params=("negatives",),
        )
    return path


def load_pool(source: str, cache_path: Path | str | None, dim: int | None = None) -> Tensor:
    """The pool's features ``[N, D]`` float32 (L2-normalised), read once per (file, split) and kept
    in memory. ConfigError/CacheError when the file or split is missing or ``dim`` differs."""
    path = pool_file(source, cache_path)
    split = pool_location(source, cache_path)[1]
    st = path.stat()
    key = (str(path.resolve()), split, st.st_mtime_ns, st.st_size)
    if key not in _POOLS:
        try:
            feats = read_split(path, split).features
        except CacheError as e:
            raise CacheError(f"negative pool {source!r}: {e}") from None
        _POOLS.clear()  # keep one pool at a time: they can be large
        _POOLS[key] = feats
    pool = _POOLS[key]
    if pool.shape[0] == 0:
        raise CacheError(f"negative pool {source!r} ({path}:{split}) has no rows")
    if dim is not None and pool.shape[1] != dim:
        raise ConfigError(
            f"negative pool {source!r} ({path}:{split}) has feature dimension {pool.shape[1]}, "
            f"but the episodes' features have {dim}"
        )
    return pool


def sample_indices(pool_size: int, episode_index: Tensor, n_neg: int, seed: int) -> Tensor:
    """int64 ``[E, n_neg]`` pool rows, uniform with replacement, episode ``i`` from its own generator."""
    out = torch.empty(len(episode_index), n_neg, dtype=torch.int64)
    for r, i in enumerate(episode_index.tolist()):
        out[r] = torch.randint(pool_size, (n_neg,), generator=generator(seed, i, NEG_STREAM))
    return out


def generate(
    kind: str, episode_index: Tensor, n_neg: int, dim: int, seed: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Generated negatives ``[E, n_neg, dim]`` (L2-normalised) for the episodes numbered ``episode_index``.

    ``random``: U[0,1) per coordinate (the authors' ``torch.rand_like``), ``sphere``: N(0,1). Drawn
    in float32 on the CPU from episode ``i``'s generator, whatever the device, then normalised.
    """
    out = torch.empty(len(episode_index), n_neg, dim, dtype=torch.float32)
    for r, i in enumerate(episode_index.tolist()):
        g = generator(seed, i, NEG_STREAM)
        if kind == "random":
            torch.rand(n_neg, dim, generator=g, out=out[r])
        elif kind == "sphere":
            torch.randn(n_neg, dim, generator=g, out=out[r])
        else:
            raise ConfigError(f"unknown generated negatives {kind!r}: use random or sphere")
    out = torch.nn.functional.normalize(out, dim=-1)
    return out.to(dtype)


__all__ = [
    "NegativeSpec",
    "load_pool",
    "pool_file",
    "sample_indices",
    "generate",
    "pool_location",
    "NEG_STREAM",
    "KEYWORDS",
]
