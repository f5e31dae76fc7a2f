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

import numpy as np
import torch
from torch import Tensor

from poodle import defaults
from poodle._mt19937 import M32, MT19937, RANGE64, normal_fill_, packed_words, random64_at, verified, word_at
from poodle.cache import read_split
from poodle.errors import CacheError, ConfigError, mark
from poodle.options import check_group, option
from poodle.prefetch import pool_location
from poodle.utils import derive_seeds, generator, resolve_path

# Third component of the negatives' generator seed: keeps them independent of the episode draw.
NEG_STREAM = 1
GENERATED = ("random", "sphere")
KEYWORDS = defaults.NEGATIVE_KEYWORDS


@dataclass(frozen=True)
class NegativeSpec:
    """Where the negatives come from and how many per episode (paper 5.1: K = 400)."""

    source: str = option(
        defaults.NEGATIVES,
        key="negatives",
        metavar="base|random|sphere|none|FILE[:SPLIT]",
        help="Negatives of the methods that read some: the base classes, generated ones, none, or a cache's split.",
    )
    n_neg: int = option(defaults.N_NEG, min=1, help="Negatives per episode.")

    def validate(self) -> None:
        """ConfigError naming the setting (``negatives``, ``n_neg``) that is not as declared."""
        check_group(self, ConfigError)

    @property
    def generated(self) -> bool:
        return self.source in GENERATED

    @property
    def is_none(self) -> bool:
        return self.source == "none"


_POOLS: dict[tuple[str, str, int, int], Tensor] = {}


def pool_file(source: str, cache_path: Path | str | None) -> Path:
    """The file of a pool source (``base``: the cache itself); a ConfigError when it is missing."""
    path = resolve_path(pool_location(source, cache_path)[0], "negatives")
    if not path.is_file():
        raise ConfigError(
            f"{mark('negatives')} {source}: no such cache file {str(path)!r} (the keywords are base, random, "
            f"sphere and none; anything else names a pool file, FILE[:SPLIT])",
            param="negatives",
            value=source,
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
            raise CacheError(
                f"negative pool ({mark('negatives')} {source!r}): {e}", param="negatives", value=source
            ) from None
        _POOLS.clear()  # keep one pool at a time: they can be large
        _POOLS[key] = feats
    pool = _POOLS[key]
    if pool.shape[0] == 0:
        raise CacheError(
            f"negative pool ({mark('negatives')} {source!r}) ({path}:{split}) has no rows",
            param="negatives",
            value=source,
        )
    if dim is not None and pool.shape[1] != dim:
        raise ConfigError(
            f"negative pool ({mark('negatives')} {source!r}) ({path}:{split}) has feature dimension {pool.shape[1]}, "
            f"but the episodes' features have {dim}",
            param="negatives",
            value=source,
        )
    return pool


def sample_indices(
    pool_size: int, episode_index: Tensor, n_neg: int, seed: int, *, device: str | torch.device | None = None
) -> Tensor:
    """int64 ``[E, n_neg]`` pool rows, uniform with replacement, episode ``i`` from its own generator
    ``(seed, i, NEG_STREAM)``: ``torch.randint(pool_size, (n_neg,), generator=...)`` for each episode.

    Drawn in bulk (one torch call per episode, or on ``device`` with :class:`poodle._mt19937.MT19937`),
    the same numbers on any device; the result is on ``device`` (default: the CPU).
    """
    dev = torch.device("cpu") if device is None else torch.device(device)
    idx = episode_index.tolist()
    E = len(idx)
    on_device = dev.type != "cpu" and pool_size < RANGE64
    if not E or not verified(dev if on_device else None):
        out = torch.empty(E, n_neg, dtype=torch.int64)
        for r, i in enumerate(idx):
            out[r] = torch.randint(pool_size, (n_neg,), generator=generator(seed, i, NEG_STREAM))
        return out.to(dev)
    seeds = derive_seeds(seed, idx, NEG_STREAM)
    if on_device:
        return indices_on_device(pool_size, seeds, n_neg, dev)
    rows = np.arange(E)[:, None]
    if pool_size < RANGE64:  # torch draws one word per index
        w = word_at(packed_words(seeds, n_neg), rows, np.arange(n_neg)[None, :]) % pool_size
    else:  # random64() per index
        w = random64_at(packed_words(seeds, 2 * n_neg), rows, 2 * np.arange(n_neg)[None, :]) % np.uint64(pool_size)
    return torch.from_numpy(w.astype(np.int64)).to(dev)


def generate(
    kind: str,
    episode_index: Tensor,
    n_neg: int,
    dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    *,
    device: str | torch.device | None = None,
) -> Tensor:
    """Generated negatives ``[E, n_neg, dim]`` (L2-normalised) for the episodes numbered ``episode_index``.

    ``random``: U[0,1) per coordinate (the authors' ``torch.rand_like``), ``sphere``: N(0,1): what
    ``torch.rand`` / ``torch.randn(n_neg, dim)`` draw in float32 from episode ``i``'s generator
    ``(seed, i, NEG_STREAM)``, then normalised. On the CPU (``device`` None or ``cpu``) torch's own
    generators draw them. On another device they are drawn there, in bulk, by
    :class:`poodle._mt19937.MT19937` (no host work or copy): the same uniforms as on the CPU, so
    ``random`` negatives agree with the CPU's to the rounding of the normalisation and ``sphere``
    ones to a few units in the last place (the device's ``log``/``sin``/``cos``).
    """
    if kind not in GENERATED:
        raise ConfigError(
            f"unknown generated {mark('negatives')} {kind!r}: use random or sphere",
            param="negatives",
            value=kind,
        )
    dev = torch.device("cpu") if device is None else torch.device(device)
    idx = episode_index.tolist()
    size = n_neg * dim
    if dev.type == "cpu" or not idx or (kind == "sphere" and size < 16) or not verified(dev):
        out = torch.empty(len(idx), n_neg, dim, dtype=torch.float32)
        draw = torch.rand if kind == "random" else torch.randn
        for r, i in enumerate(idx):
            draw(n_neg, dim, generator=generator(seed, i, NEG_STREAM), out=out[r])
        # in place, all at once: one parallel region (per episode, the threads would wait on the draws)
        return torch.nn.functional.normalize(out, dim=-1, out=out).to(device=dev, dtype=dtype)
    return generate_on_device(kind, derive_seeds(seed, idx, NEG_STREAM), n_neg, dim, dev).to(dtype)


def _streams(seeds: list[int], device: torch.device) -> MT19937:
    return MT19937(torch.tensor([s & M32 for s in seeds], dtype=torch.int64).to(device))


def indices_on_device(pool_size: int, seeds: list[int], n_neg: int, device: torch.device) -> Tensor:
    """int64 ``[E, n_neg]`` as :func:`sample_indices` draws them (``pool_size < 2**28``), from the
    generators seeded ``seeds``, drawn on ``device`` (any device, the CPU included, for tests)."""
    mt = _streams(seeds, device)
    return torch.cat([mt.block() for _ in range(-(-n_neg // MT19937.N))], 1)[:, :n_neg] % pool_size


def generate_on_device(kind: str, seeds: list[int], n_neg: int, dim: int, device: torch.device) -> Tensor:
    """float32 ``[E, n_neg, dim]`` as :func:`generate` makes them, from the generators seeded
    ``seeds``, drawn on ``device`` (any device, the CPU included, for tests; sphere needs
    ``n_neg * dim >= 16``, below which torch draws its normals otherwise)."""
    size = n_neg * dim
    tail = 16 if kind == "sphere" and size % 16 else 0  # torch's normal_ redraws the last 16 values
    u = _streams(seeds, device).uniform_(torch.empty(len(seeds), size + tail, dtype=torch.float32, device=device))
    if kind == "sphere":
        normal_fill_(u[:, :size], u[:, size:] if tail else None)
    return torch.nn.functional.normalize(u[:, :size].view(len(seeds), n_neg, dim), dim=-1)


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
