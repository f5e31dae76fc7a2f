"""Solve an episode set with one or more methods, chunk by chunk, and score it.

Three parts, each with one job:

- **planning** (:func:`plan_chunks`): the chunk size is the smaller of what the memory bound allows
  (a per-episode estimate of the gathered rows and the solver's buffers, :func:`episode_bytes`) and,
  on CPU, what keeps a chunk's rows cache-resident (the fine-tuning solvers read them twice per
  step; docs/stage2.md has the measurements). Peak memory depends on the chunk, not on the number
  of episodes. An explicit ``max_memory`` counts everything the call holds: the features and the
  negative pool placed on the device for the whole call, and the chunks in flight.
- **gathering** (:class:`Gatherer`): the features and the negative pool are placed on the device
  once; a chunk's host work (drawing its episodes from an
  :class:`~poodle.episodes.EpisodeStream`, its negative indices or generated negatives) is
  :meth:`Gatherer.prepare`, and its rows are gathered on the device from index tensors
  (:meth:`Gatherer.gather`; on CUDA the index tensors are the only host-to-device copies,
  pinned and non-blocking).
- **the worker pool** (:func:`run_chunks`): on CPU, several single-threaded workers solve whole
  chunks at once (at most two chunks per worker in flight); on a GPU one stream of chunks is
  pipelined: chunk i+1's host work is prepared in a thread while chunk i computes, and chunk i's
  accuracies are read back only after chunk i+1 is launched, so the device never waits for the host
  between chunks. The solvers' step loops never read a value back to the host.

Every method sees the same chunk, hence identical episodes and identical negatives, and results
depend neither on the chunking nor on the number of workers (tested).

Ragged episodes (an :class:`~poodle.episodes.EpisodeSet` with ``ways``: each episode its own way,
shots and queries, index tensors padded with -1) are solved in chunks padded to each chunk's
largest episode (masks and ways on the :class:`~poodle.solvers.base.EpisodeBatch`; accuracy over
real queries), planned at each chunk's padded shape and cut in buckets of similar size where that
pads fewer rows (:func:`plan_ragged`); each episode's result is the one it gets alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, overload

import torch
from torch import Tensor

from poodle import costmodel, defaults, solvers
from poodle.episodes import EpisodeSet, EpisodeStream
from poodle.errors import ConfigError, EpisodeError, mark
from poodle.negatives import NegativeSpec, generate, load_pool, sample_indices
from poodle.run import RunOptions
from poodle.solvers.backend import Backend, for_call
from poodle.solvers.base import EpisodeBatch, SolverInfo
from poodle.utils import parse_size, resolve_device

# On CPU a chunk's gathered rows should stay within the last-level cache share of the cores
# (32 MiB L3 shared by 2 cores here; measured best around 6-12 MiB of rows per chunk).
CPU_CHUNK_BYTES = 8 * 2**20
# Upper bound on a chunk on GPU: beyond a few thousand episodes nothing is gained.
GPU_MAX_CHUNK = 4096
# Ragged episodes in buckets (plan_ragged): a chunk of episodes sorted by size stops growing once
# its padded rows would pass this many times its real rows, unless it holds fewer episodes than
# BUCKET_LEAST (a GPU stays busy with a few hundred episodes; on CPU the cache share cuts first).
BUCKET_WASTE = 1.1
BUCKET_LEAST = {"cpu": 4, "cuda": 256}

# (label, registered method name or its registry entry, config); :func:`evaluate` resolves each to its
# entry and a checked config once, and its chunks trust them
Method = tuple[str, str | SolverInfo, Any]


# ---------------------------------------------------------------------------------------------
# Planning


def episode_bytes(n_rows: int, dim: int, way: int, itemsize: int = 4) -> int:
    """Estimated peak bytes per episode: the gathered rows (support, query, negatives), the
    solver's concatenated copy of them, and its ``[K, D]`` / ``[K, n]`` buffers."""
    k = way + 1
    return itemsize * (3 * n_rows * dim + 8 * k * dim + 16 * n_rows * k)


def choose_chunk(n_rows: int, dim: int, way: int, device: torch.device, max_memory: int, itemsize: int = 4) -> int:
    """Episodes per chunk: bounded by ``max_memory`` and, on CPU, by cache residency."""
    by_memory = max(1, max_memory // episode_bytes(n_rows, dim, way, itemsize))
    if device.type == "cpu":
        return max(1, min(by_memory, CPU_CHUNK_BYTES // (n_rows * dim * itemsize)))
    return max(1, min(by_memory, GPU_MAX_CHUNK))


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def default_budget(device: torch.device) -> int:
    """The bound on the chunks in flight when none is given: ``poodle.defaults.MAX_MEMORY`` on CPU;
    on CUDA 80% of the device's free memory (``torch.cuda.mem_get_info``), measured once the
    features and the negative pool are placed there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1 << 26, int(0.8 * free))
    return parse_size(defaults.MAX_MEMORY)


def held_text(held: int, parts: Mapping[str, int] | None = None) -> str:
    """What is held for a whole call, said: ``the features and negative pool held for the whole run
    take 59.8 MiB`` (``parts``: bytes by what holds them, when more than the features and pool)."""
    parts = {k: v for k, v in (parts or {}).items() if v}
    if len(parts) <= 1:
        return f"{next(iter(parts), 'the features and negative pool')} held for the whole run take {_mib(held)}"
    each = ", ".join(f"{k} {_mib(v)}" for k, v in parts.items())
    return f"what is held for the whole run takes {_mib(held)} ({each})"


def check_memory_bound(
    budget: int,
    n_rows: int,
    dim: int,
    way: int,
    workers: int,
    itemsize: int = 4,
    held: int = 0,
    held_parts: Mapping[str, int] | None = None,
) -> int:
    """The number of chunk workers that fits ``budget`` bytes once ``held`` bytes (features and
    pool, and what ``held_parts`` names) are set aside (fewer workers than asked when one chunk
    per worker would not fit); a ConfigError saying what is held and by how much the bound falls
    short when not even one episode fits."""
    need = episode_bytes(n_rows, dim, way, itemsize)
    if need + held > budget:
        what = f"{held_text(held, held_parts)}, and " if held else ""
        raise ConfigError(
            f"{mark('max_memory')} {_mib(budget)} cannot be met: {what}one episode ({n_rows} rows of D={dim}, "
            f"negatives included) needs about {_mib(need)}: {_mib(need + held - budget)} more; raise it to at "
            f"least {_mib(need + held)} or lower {mark('n_neg')}",
            params=("max_memory", "n_neg"),
            param="max_memory",
            value=budget,
        )
    return max(1, min(workers, (budget - held) // need))


def take_rows(table: Tensor, idx: Tensor) -> Tensor:
    """``table [N, D]`` rows at ``idx [...]`` (non-negative) -> ``[..., D]``, as ``table[idx]``.

    ``index_select`` copies whole rows; advanced indexing goes element by element and took 2.5x as
    long on the CPU (9.3 against 3.7 ms for a chunk of 40 episodes of 75 rows of 640, one thread),
    a quarter of a fast method's whole run."""
    return table.index_select(0, idx.reshape(-1)).view(*idx.shape, table.shape[-1])


@dataclass(frozen=True)
class ChunkPlan:
    """How a call is cut: ``bounds`` of the chunks (episode ranges, in order), the chunk size (the
    largest chunk's), the workers, the bytes the chunks may use and the bytes held for the whole
    call. For ragged episodes, ``real_rows`` and ``padded_rows`` count the support and query rows
    the chunks hold without and with their padding, and ``order`` (``None``: episode order) is the
    order of the episodes the bounds cut (:func:`plan_ragged`)."""

    chunk: int
    workers: int
    bounds: tuple[tuple[int, int], ...]
    budget: int
    held: int = 0
    real_rows: int = 0
    padded_rows: int = 0
    order: Tensor | None = None


def plan_chunks(
    n_episodes: int,
    n_rows: int,
    dim: int,
    way: int,
    device: torch.device,
    *,
    max_memory: str | int | None = None,
    workers: int | None = None,
    chunk_size: int | None = None,
    itemsize: int = 4,
    held: int = 0,
    held_parts: Mapping[str, int] | None = None,
    shapes: Tensor | None = None,
    waste: float | None = None,
) -> ChunkPlan:
    """Chunk size, workers and chunk bounds of a call of ``n_episodes`` episodes of ``n_rows`` rows
    of ``dim`` floats. An explicit ``max_memory`` counts the ``held`` bytes too (``held_parts``:
    what holds them, for the message when the bound cannot be met); the default bound
    (:func:`default_budget`) is for the chunks alone. The first chunks ramp up (1, 2, 4, ... up to the
    chunk size) so the first results come within a fraction of a second.

    Ragged episodes: ``shapes [E, 3]`` int64 gives each episode's support rows, query rows and ways
    (in the order the chunks are cut), ``n_rows`` and ``way`` the largest episode's (rows with the
    negatives). A chunk is padded to its largest episode, so each chunk takes as many episodes as
    its padded shape fits (the memory bound, and on CPU the cache share) and, with ``waste``, no
    more than keep its padded rows within ``waste`` times its real rows once it holds
    ``BUCKET_LEAST`` episodes; an explicit ``chunk_size`` cuts chunks of that many episodes as for
    fixed ones."""
    if device.type != "cpu":
        workers = 1
    elif workers is None:
        workers = torch.get_num_threads()
    if workers < 1:
        raise ConfigError.bad_value("workers", workers, "must be at least 1")
    budget = parse_size(max_memory) if max_memory is not None else default_budget(device) + held
    if chunk_size is None:
        workers = check_memory_bound(budget, n_rows, dim, way, workers, itemsize, held, held_parts)
    # each worker holds one chunk: the memory bound is shared between them
    per_worker = max(1, (budget - held) // workers)
    chunk = chunk_size or choose_chunk(n_rows, dim, way, device, per_worker, itemsize)
    chunk = max(1, min(int(chunk), n_episodes))
    bounds, a, size = [], 0, max(1, chunk // 8) if n_episodes > 8 * chunk else chunk
    if shapes is not None and chunk_size is None:
        n_neg = n_rows - int((shapes[:, 0] + shapes[:, 1]).max())
        bounds = _fitted_bounds(shapes, n_neg, dim, device, per_worker, itemsize, size, waste)
        chunk = max(b - a for a, b in bounds)
    else:
        while a < n_episodes:
            bounds.append((a, min(n_episodes, a + size)))
            a, size = a + size, min(chunk, 2 * size)
    real = padded = 0
    if shapes is not None:
        real, padded = padding_rows(shapes, bounds)
    return ChunkPlan(chunk, min(workers, len(bounds)), tuple(bounds), budget, held, real, padded)


def _fitted_bounds(
    shapes: Tensor,
    n_neg: int,
    dim: int,
    device: torch.device,
    max_memory: int,
    itemsize: int,
    first: int,
    waste: float | None = None,
) -> list[tuple[int, int]]:
    """Chunks of ragged episodes (``shapes [E, 3]``, see :func:`plan_chunks`), in order, each as many
    episodes as fit ``max_memory`` (and on CPU the cache share) at the chunk's padded shape: its
    largest support, query and way. The first chunk takes at most ``first`` episodes, each next at
    most twice the one before (the ramp of fixed episodes). ``waste``: a chunk of more than
    ``BUCKET_LEAST`` episodes also keeps its padded rows within ``waste`` times its real rows."""
    least = BUCKET_LEAST["cpu" if device.type == "cpu" else "cuda"]
    E = shapes.shape[0]
    cap = GPU_MAX_CHUNK if device.type != "cpu" else E
    bounds, a, limit = [], 0, first
    while a < E:
        n_max = min(E - a, limit, cap)
        s = shapes[a : a + n_max]
        rows = torch.cummax(s[:, 0], 0).values + torch.cummax(s[:, 1], 0).values + n_neg
        way = torch.cummax(s[:, 2], 0).values
        n = torch.arange(1, n_max + 1, dtype=torch.int64)
        k = way + 1  # episode_bytes, for every prefix at once
        per_episode = itemsize * (3 * rows * dim + 8 * k * dim + 16 * rows * k)
        fits = n * per_episode <= max_memory
        if device.type == "cpu":
            fits &= n * rows * dim * itemsize <= CPU_CHUNK_BYTES
        if waste is not None:
            padded = n * (rows - n_neg)
            fits &= (n <= least) | (padded <= waste * torch.cumsum(s[:, 0] + s[:, 1], 0))
        # a chunk is the longest prefix whose every shorter prefix fits too
        count = max(1, int(fits.to(torch.int64).cumprod(0).sum()))
        bounds.append((a, a + count))
        a, limit = a + count, 2 * limit
    return bounds


def padding_rows(shapes: Tensor, bounds: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """``(real, padded)``: the support and query rows the chunks ``bounds`` of ragged episodes
    (``shapes [E, 3]``) hold, without and with the padding to each chunk's largest episode."""
    real = int((shapes[:, 0] + shapes[:, 1]).sum())
    padded = sum((b - a) * int(shapes[a:b, 0].max() + shapes[a:b, 1].max()) for a, b in bounds)
    return real, padded


def episode_shapes(episodes: EpisodeSet) -> Tensor:
    """``[E, 3]`` int64: each ragged episode's support rows, query rows (up to its last real one:
    the columns a chunk must keep for it) and ways."""
    assert episodes.ways is not None

    def width(t: Tensor) -> Tensor:
        if t.shape[1] == 0:
            return torch.zeros(t.shape[0], dtype=torch.int64)
        return ((t >= 0) * torch.arange(1, t.shape[1] + 1, dtype=torch.int64)).amax(1)

    return torch.stack([width(episodes.support), width(episodes.query), episodes.ways.to(torch.int64)], 1)


def plan_ragged(episodes: EpisodeSet, n_neg: int, dim: int, device: torch.device, **kw: Any) -> ChunkPlan:
    """The :class:`ChunkPlan` of a ragged episode set (``kw``: :func:`plan_chunks`'s options): its
    chunks cut in episode order or, where that pads fewer rows, in order of size (buckets of
    episodes of similar shape; ``order`` then says which episode each position holds). Results are
    the same either way: each episode's is the one it gets alone."""
    shapes = episode_shapes(episodes)
    n_rows = int((shapes[:, 0] + shapes[:, 1]).max()) + n_neg
    way = int(shapes[:, 2].max())
    plain = plan_chunks(len(episodes), n_rows, dim, way, device, shapes=shapes, **kw)
    # Support and query are padded separately, so episodes of one total size can pad badly together
    # (500 support rows and 50 queries next to 100 and 450): buckets are bands of query counts
    # (each 1.25 times the one before), by support rows within a band, then ways. On Meta-Dataset's
    # shapes (2,000 episodes drawn by its rules, D = 640) this pads 1.03x the real rows on CPU against
    # 1.07x sorted by total rows (1.16x against 1.36x in the few large chunks of a GPU; in episode
    # order 1.25x and 1.40x).
    ns, nq, ways = shapes[:, 0], shapes[:, 1], shapes[:, 2]
    band = torch.floor(torch.log(nq.clamp_min(1).double()) / math.log(1.25)).long()
    key = (band * (int(ns.max()) + 1) + ns) * (way + 1) + ways
    order = torch.sort(key, stable=True).indices
    bucketed = plan_chunks(len(episodes), n_rows, dim, way, device, shapes=shapes[order], waste=BUCKET_WASTE, **kw)
    if bucketed.padded_rows < plain.padded_rows:
        return dataclasses.replace(bucketed, order=order)
    return plain


# ---------------------------------------------------------------------------------------------
# Negatives


@overload
def prepare_negatives(
    episodes: EpisodeSet, negatives: NegativeSpec, cache_path: Any, dim: int
) -> tuple[EpisodeSet, Tensor | None]: ...


@overload
def prepare_negatives(
    episodes: EpisodeSet | EpisodeStream, negatives: NegativeSpec, cache_path: Any, dim: int
) -> tuple[EpisodeSet | EpisodeStream, Tensor | None]: ...


def prepare_negatives(
    episodes: EpisodeSet | EpisodeStream, negatives: NegativeSpec, cache_path: Any, dim: int
) -> tuple[EpisodeSet | EpisodeStream, Tensor | None]:
    """Attach the negative indices of a pool source to ``episodes`` (reusing the ones it holds when
    they come from the same source) and return ``(episodes, pool [P, D] | None)``; generated
    sources return the episodes unchanged and no pool. Errors (missing pool, dimension mismatch,
    wrong count or out-of-range indices) come before any solving."""
    negatives.validate()
    if negatives.is_none or negatives.generated:
        return episodes, None
    pool = load_pool(negatives.source, cache_path, dim=dim)
    M = negatives.n_neg
    if episodes.negatives is not None and episodes.negative_source == negatives.source:
        _check_held(episodes.negatives, M, negatives.source, pool.shape[0])
        return episodes, pool
    if isinstance(episodes, EpisodeStream):
        episodes = episodes.materialize()
    assert episodes.index is not None  # set in EpisodeSet.__post_init__
    idx = sample_indices(pool.shape[0], episodes.index, M, episodes.spec.seed)
    return episodes.with_negatives(idx, negatives.source), pool


def _check_held(neg: Tensor, M: int, source: str, pool_rows: int) -> None:
    if neg.shape[1] != M:
        raise EpisodeError(
            f"the episodes hold {neg.shape[1]} negatives per episode from {source!r}, but {mark('n_neg')} is {M}",
            params=("n_neg",),
            param="n_neg",
            value=M,
        )
    hi = int(neg.max()) if neg.numel() else 0
    if (int(neg.min()) if neg.numel() else 0) < 0 or hi >= pool_rows:
        raise EpisodeError(
            f"negative indices reach {hi} but the pool {source!r} has {pool_rows} rows; "
            "the episodes were saved with another pool",
            param="negatives",
            value=source,
        )


@dataclass
class _Negatives:
    """The negatives of a call: the spec (``None``: no method reads any), the pool on the host
    (``None`` for generated ones), whether the episodes' own indices are used, and the count."""

    spec: NegativeSpec | None = None
    pool: Tensor | None = None
    held: bool = False
    count: int = 0


def _negatives(
    users: Sequence[tuple[SolverInfo, Any]],
    negatives: NegativeSpec | None,
    episodes: EpisodeSet | EpisodeStream,
    cache_path: Any,
    dim: int,
    preprocess: Any,
    checked: bool = False,
) -> _Negatives:
    """What the methods that read negatives (``users``: each one's registry entry and config) get;
    every check (the source, its pool file and rows, held indices) before any solving. ``checked``:
    the negatives rule of each method and the spec's settings were checked where they were chosen
    (:func:`evaluate`'s ``checked``), the files are read and checked here."""
    if not checked:
        source = None if negatives is None or negatives.is_none else negatives.source
        for info, cfg in users:
            info.check_negatives(cfg, source)
    if not users or negatives is None:
        return _Negatives()
    if not checked:
        negatives.validate()
    if negatives.generated:
        return _Negatives(negatives, count=negatives.n_neg)
    # read once: through the preprocessing when there is one (no untransformed copy kept besides)
    pool = load_pool(negatives.source, cache_path, dim=dim) if preprocess is None else None
    if preprocess is not None:
        pool = preprocess.pool(negatives.source, cache_path, dim)
    assert pool is not None
    held = episodes.negatives is not None and episodes.negative_source == negatives.source
    if held:
        assert episodes.negatives is not None
        _check_held(episodes.negatives, negatives.n_neg, negatives.source, pool.shape[0])
    return _Negatives(negatives, pool, held, negatives.n_neg)


def _resolve_methods(methods: Sequence[Method]) -> tuple[list[Method], list[tuple[SolverInfo, Any]]]:
    """``(label, registry entry, config)`` of each ``(label, method, config)``: the method looked up
    (once: a cell gives its entry), the config built from a dict or ``None``, or checked (once: a
    config the library built was checked then); and the entry and config of each method that reads
    negatives. The chunks trust what this returns."""
    if not methods:
        raise ConfigError("no method to run", params=("methods",), param="methods", value=methods)
    out: list[Method] = []
    seen: set[str] = set()
    users: list[tuple[SolverInfo, Any]] = []
    for item in methods:
        if len(item) != 3:
            raise ConfigError(
                f"{mark('methods')} are (label, method, config) triples, got {item!r}",
                params=("methods",),
                param="methods",
                value=item,
            )
        label, method, cfg = item
        info = method if isinstance(method, SolverInfo) else solvers.get(method)
        if cfg is None or isinstance(cfg, Mapping):
            cfg = solvers.build_config(info, cfg or {}, strict=True)
        elif not isinstance(cfg, info.config):
            raise ConfigError(
                f"method {info.name!r}: config must be a {info.config.__name__}, got {type(cfg).__name__}",
                param="methods",
                value=info.name,
            )
        elif not solvers.is_checked(cfg):  # a config the library built was checked then
            solvers.base.check_config(info.name, cfg)
        if label in seen:
            raise ConfigError(
                f"two methods share the label {label!r}; give each a distinct label", param="methods", value=label
            )
        seen.add(label)
        out.append((label, info, cfg))
        if info.needs_negatives(cfg):
            users.append((info, cfg))
    return out, users


# ---------------------------------------------------------------------------------------------
# Gathering


@dataclass
class Padding:
    """A chunk of ragged episodes, padded to its largest: its ``way``, each episode's own ``ways
    [n]`` (``None`` when all have ``way``), and whether any support or query row is padding."""

    way: int
    ways: Tensor | None
    support: bool
    query: bool


@dataclass
class HostChunk:
    """A chunk's host work, done: its episodes (row indices) and negative indices or generated
    negatives, pinned for the copy when the device is a GPU; ``padding`` for ragged episodes (their
    index tensors cropped to the chunk's largest episode, padded with -1)."""

    episodes: EpisodeSet
    negatives: Tensor | None = None  # indices into the pool [n, M], or generated rows [n, M, D]
    padding: Padding | None = None


@dataclass
class Chunk:
    """A chunk on the device: its rows and labels, ready for the solvers (padded rows zero with label
    -1, and the masks and ways of :class:`~poodle.solvers.base.EpisodeBatch`, for ragged episodes)."""

    support: Tensor
    support_labels: Tensor
    query: Tensor
    query_labels: Tensor
    negatives: Tensor | None
    way: int
    ways: Tensor | None = None
    support_mask: Tensor | None = None
    query_mask: Tensor | None = None


def crop_ragged(sub: EpisodeSet) -> tuple[EpisodeSet, Padding]:
    """A chunk of ragged episodes cropped to its largest (the columns that hold a real row of one of
    them), and its :class:`Padding`."""
    assert sub.ways is not None
    shapes = episode_shapes(sub)
    ns, nq, way = (int(v) for v in shapes.max(0).values)
    sub = dataclasses.replace(
        sub,
        support=sub.support[:, :ns],
        support_labels=sub.support_labels[:, :ns],
        query=sub.query[:, :nq],
        query_labels=sub.query_labels[:, :nq],
    )
    own: Tensor = shapes[:, 2]
    ways = own if bool((own != way).any()) else None
    return sub, Padding(way, ways, bool((sub.support < 0).any()), bool((sub.query < 0).any()))


class Gatherer:
    """A call's features and negative pool, placed on the device once, and the per-chunk work."""

    def __init__(
        self,
        features: Tensor,
        episodes: EpisodeSet | EpisodeStream,
        negatives: _Negatives,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.episodes, self.negatives, self.device, self.dtype = episodes, negatives, device, dtype
        self.spec = episodes.spec
        # no copy when they already are on the device in the solvers' dtype
        self.features = features.to(device=device, dtype=dtype)
        self.pool = None if negatives.pool is None else negatives.pool.to(device=device, dtype=dtype)
        self.cuda = device.type == "cuda"
        self.order: Tensor | None = None  # the episodes' order in the chunks (reorder); None: theirs

    @property
    def held_bytes(self) -> int:
        """What the call holds whatever the chunking: the features and the pool, on the device."""
        return sum(t.numel() * t.element_size() for t in (self.features, self.pool) if t is not None)

    def _pin(self, t: Tensor) -> Tensor:
        return t.pin_memory() if self.cuda and t.device.type == "cpu" else t

    def reorder(self, order: Tensor) -> None:
        """Take the episodes in ``order`` (``[E]``, a permutation; :func:`plan_ragged`'s buckets):
        position ``i`` of every later chunk is episode ``order[i]`` (each chunk's index rows are
        taken when it is prepared: no reordered copy of the set is held)."""
        if not isinstance(self.episodes, EpisodeSet):
            raise TypeError("only an episode set drawn in advance can be solved in buckets")
        self.order = order

    def _episodes(self, a: int, b: int) -> EpisodeSet:
        if self.order is None:
            return self.episodes[a:b]
        eps, rows = self.episodes, self.order[a:b]
        assert isinstance(eps, EpisodeSet)

        def take(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

        fields = ("support", "query", "support_labels", "query_labels", "negatives", "index", "class_ids", "ways")
        taken: dict[str, Any] = {f: take(getattr(eps, f)) for f in fields}
        return dataclasses.replace(eps, **taken)

    def prepare(self, a: int, b: int) -> HostChunk:
        """The host work of episodes ``a..b-1``: draw them (a stream draws here) and their negatives
        (on a GPU drawn there, from the same per-episode streams: no host generation, no copy); a
        chunk of ragged episodes is cropped to its largest."""
        sub = self._episodes(a, b)
        padding = None
        if sub.ways is not None:
            sub, padding = crop_ragged(sub)
        neg = None
        if self.negatives.spec is not None:
            assert sub.index is not None  # set in EpisodeSet.__post_init__
            seed, M = self.spec.seed, self.negatives.count
            on = self.device if self.cuda else None
            if self.negatives.held:
                neg = sub.negatives
            elif self.pool is not None:
                neg = sample_indices(self.pool.shape[0], sub.index, M, seed, device=on)
            else:
                neg = generate(
                    self.negatives.spec.source, sub.index, M, self.features.shape[1], seed, self.dtype, device=on
                )
        if self.cuda:
            sub = dataclasses.replace(
                sub,
                support=self._pin(sub.support),
                query=self._pin(sub.query),
                support_labels=self._pin(sub.support_labels),
                query_labels=self._pin(sub.query_labels),
            )
            if padding is not None and padding.ways is not None:
                padding = dataclasses.replace(padding, ways=self._pin(padding.ways))
        return HostChunk(sub, None if neg is None else self._pin(neg), padding)

    def gather(self, host: HostChunk) -> Chunk:
        """The chunk's rows on the device (asynchronous on a GPU)."""

        def dev(t: Tensor) -> Tensor:
            return t.to(self.device, non_blocking=True) if self.cuda else t

        e = host.episodes
        neg = host.negatives
        if neg is not None:
            neg = take_rows(self.pool, dev(neg)) if self.pool is not None else dev(neg).to(self.dtype)
        pad = host.padding
        if pad is not None:
            s_idx, q_idx = dev(e.support), dev(e.query)
            s_mask = s_idx >= 0 if pad.support else None
            q_mask = q_idx >= 0 if pad.query else None
            return Chunk(
                self._rows(s_idx, s_mask),
                self._labels(dev(e.support_labels), s_mask),
                self._rows(q_idx, q_mask),
                self._labels(dev(e.query_labels), q_mask),
                neg,
                pad.way,
                None if pad.ways is None else dev(pad.ways),
                s_mask,
                q_mask,
            )
        return Chunk(
            take_rows(self.features, dev(e.support)),
            dev(e.support_labels),
            take_rows(self.features, dev(e.query)),
            dev(e.query_labels),
            neg,
            self.spec.fixed("way"),
        )

    def _rows(self, idx: Tensor, mask: Tensor | None) -> Tensor:
        """The feature rows of ``idx [n, L]``; a padded row (``mask`` False, index -1) is zeros."""
        if mask is None:
            return take_rows(self.features, idx)
        return take_rows(self.features, idx.clamp_min(0)).masked_fill_(~mask.unsqueeze(-1), 0.0)

    @staticmethod
    def _labels(labels: Tensor, mask: Tensor | None) -> Tensor:
        return labels if mask is None else labels.masked_fill(~mask, -1)


# ---------------------------------------------------------------------------------------------
# Solving a chunk and the worker pool


class _Clock:
    """Per-method solve time: wall time on CPU; on CUDA, events read when the chunk is collected
    (the launch returns before the work is done)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> Callable[[], float]:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return lambda: start.elapsed_time(end) / 1000.0
        seconds = time.perf_counter() - start
        return lambda: seconds


Solved = dict[str, tuple[Tensor, Callable[[], float]]]  # {label: (correct [n] on the device, seconds)}


def backend_for(run: RunOptions) -> Backend:
    """The :class:`~poodle.solvers.backend.Backend` of a run: its ``cuda_step``, and the Triton
    step's launches sized by the cost model (:func:`poodle.costmodel.launch_plan`)."""
    return Backend(cuda_step=run.cuda_step, launch_plan=costmodel.launch_plan)


def solve_batch(
    batch: EpisodeBatch, method: str | SolverInfo, cfg: Any, backend: Backend | None = None, *, checked: bool = False
) -> Tensor:
    """Query log-probabilities ``[E, Nq, way]`` of ``method`` (a name or its registry entry)
    configured by ``cfg`` on ``batch``, whose negatives are passed to the method only when it reads
    them: ``poodle predict``'s one task. ``cfg`` is checked unless it was when built, and the
    negatives rule against the batch's, unless ``checked``: the caller checked the rule where the
    negatives were chosen (``poodle predict``'s, before any image was read). ``backend``: which
    arithmetic runs (``None``: the library's default), which reports what did."""
    info = method if isinstance(method, SolverInfo) else solvers.get(method)
    if not solvers.is_checked(cfg):
        solvers.base.check_config(info.name, cfg)
    if not checked:
        info.check_negatives(cfg, None if batch.negatives is None else "given")
    return _solve(batch, info, cfg, backend)


def _solve(batch: EpisodeBatch, info: SolverInfo, cfg: Any, backend: Backend | None) -> Tensor:
    """:func:`solve_batch` of a method resolved and checked once (every chunk of :func:`evaluate`)."""
    if not info.needs_negatives(cfg):
        batch = dataclasses.replace(batch, negatives=None)
    # nothing a solver returns needs a gradient (BMS, the one with autograd inside, leaves this mode
    # for its refinement): no version counters or autograd bookkeeping on any operation
    with torch.inference_mode():
        return for_call(backend).solve(info, batch, cfg).log_probs


def solve_chunk(chunk: Chunk, methods: Sequence[Method], clock: _Clock, backend: Backend | None = None) -> Solved:
    """Every method on one chunk: per-episode accuracy (left on the device) and solve time.
    ``methods`` as :func:`evaluate` resolved them (registry entries, configs checked: trusted); a
    method given by name is looked up and checked here (:func:`solve_batch`)."""
    out: Solved = {}
    batch = EpisodeBatch(
        chunk.support,
        chunk.support_labels,
        chunk.query,
        chunk.negatives,
        chunk.way,
        chunk.ways,
        chunk.support_mask,
        chunk.query_mask,
    )
    for label, method, cfg in methods:
        t0 = clock.start()
        if isinstance(method, SolverInfo):
            log_probs = _solve(batch, method, cfg, backend)
        else:
            log_probs = solve_batch(batch, method, cfg, backend)
        hits = log_probs.argmax(-1) == chunk.query_labels
        if chunk.query_mask is None:
            correct = hits.to(torch.float64).mean(1)
        else:  # the real queries only, each episode its own count
            real = chunk.query_mask
            correct = (hits & real).to(torch.float64).sum(1) / real.to(torch.float64).sum(1)
        out[label] = (correct, clock.stop(t0))
    return out


@contextlib.contextmanager
def _single_threaded_ops(active: bool) -> Iterator[None]:
    """Run torch operations single-threaded inside the block (process-wide, restored after)."""
    if not active:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


Collect = Callable[[int, int, Solved], None]


def _run_workers(
    bounds: Sequence[tuple[int, int]], work: Callable[[int, int], Solved], n: int, collect: Collect
) -> None:
    """CPU: ``n`` threads solve whole chunks with single-threaded operations, at most two chunks per
    worker in flight (memory does not grow with the number of chunks)."""
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="poodle-chunk") as ex:
        pending: dict[Future, tuple[int, int]] = {}
        todo = iter(bounds)
        try:
            for a, b in todo:
                pending[ex.submit(work, a, b)] = (a, b)
                if len(pending) >= 2 * n:
                    break
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    a, b = pending.pop(fut)
                    collect(a, b, fut.result())
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending[ex.submit(work, *nxt)] = nxt
        finally:
            for fut in pending:
                fut.cancel()


def _run_pipelined(
    bounds: Sequence[tuple[int, int]],
    prepare: Callable[[int, int], HostChunk],
    launch: Callable[[HostChunk], Solved],
    collect: Collect,
) -> None:
    """One stream of chunks: chunk i+1's host work is prepared in a thread while chunk i is launched,
    and chunk i is collected (read back) only once chunk i+1 is launched."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="poodle-prepare") as ex:
        nxt = ex.submit(prepare, *bounds[0])
        previous: tuple[int, int, Solved] | None = None
        for i, (a, b) in enumerate(bounds):
            host = nxt.result()
            if i + 1 < len(bounds):
                nxt = ex.submit(prepare, *bounds[i + 1])
            solved = launch(host)
            if previous is not None:
                collect(*previous)
            previous = (a, b, solved)
        if previous is not None:
            collect(*previous)


def run_chunks(
    plan: ChunkPlan,
    gatherer: Gatherer,
    methods: Sequence[Method],
    collect: Collect,
    overlap: bool | None = None,
    backend: Backend | None = None,
) -> None:
    """Solve every chunk of ``plan`` and give each chunk's results to ``collect(a, b, solved)``:
    several CPU workers, or (``overlap``; by default on a GPU) one pipelined stream of chunks;
    ``backend``: which arithmetic the solvers run."""
    clock = _Clock(gatherer.device)

    def work(a: int, b: int) -> Solved:
        return solve_chunk(gatherer.gather(gatherer.prepare(a, b)), methods, clock, backend)

    overlap = gatherer.device.type != "cpu" if overlap is None else overlap
    with _single_threaded_ops(plan.workers > 1):
        if plan.workers > 1:
            _run_workers(plan.bounds, work, plan.workers, collect)
        elif overlap:
            _run_pipelined(
                plan.bounds,
                gatherer.prepare,
                lambda h: solve_chunk(gatherer.gather(h), methods, clock, backend),
                collect,
            )
        else:
            for a, b in plan.bounds:
                collect(a, b, work(a, b))


# ---------------------------------------------------------------------------------------------
# The call


@dataclass
class _Tally:
    """The call's results as chunks are collected."""

    results: dict[str, Tensor]
    seconds: dict[str, float]
    progress: Callable[[int], None] | None
    t_call: float
    first_chunk_s: float | None = None
    chunks: int = field(default=0)

    def __call__(self, a: int, b: int, solved: Solved) -> None:
        if self.first_chunk_s is None:
            self.first_chunk_s = time.perf_counter() - self.t_call
        for label, (correct, seconds) in solved.items():
            self.results[label][a:b] = correct.cpu()  # the read-back (a sync on CUDA)
            self.seconds[label] += seconds()
        self.chunks += 1
        if self.progress is not None:
            self.progress(b - a)

    def in_episode_order(self, order: Tensor | None) -> dict[str, Tensor]:
        """The results by episode: position ``i`` of the chunks held episode ``order[i]``."""
        if order is None:
            return self.results
        out = {}
        for label, r in self.results.items():
            out[label] = torch.empty_like(r)
            out[label][order] = r
        return out

    def stats(self, plan: ChunkPlan, gatherer: Gatherer, n_neg: int) -> dict[str, Any]:
        """What :func:`evaluate` reports in its ``stats``."""
        ragged = {}
        if plan.real_rows:
            ragged = {"rows": plan.real_rows, "padded_rows": plan.padded_rows, "bucketed": plan.order is not None}
        return {
            **ragged,
            "chunk_size": plan.chunk,
            "n_chunks": len(plan.bounds),
            "device": str(gatherer.device),
            "seconds": self.seconds,
            "n_neg": n_neg,
            "workers": plan.workers,
            "first_chunk_s": self.first_chunk_s,
            "max_memory": plan.budget,
            "held_bytes": gatherer.held_bytes,
        }


def _held_parts(
    gatherer: Gatherer, episodes: EpisodeSet | EpisodeStream, also_held: Mapping[str, int] | None
) -> dict[str, int]:
    """What a call holds from its start to its end, by what holds it: the features and the pool on
    the device and, on the CPU (where the bound is the host's memory), the episodes drawn in
    advance and what the caller names."""
    parts = {"the features and negative pool": gatherer.held_bytes}
    if gatherer.device.type == "cpu":
        if isinstance(episodes, EpisodeSet):
            parts["the episodes drawn in advance"] = episodes.nbytes
        parts.update(also_held or {})
    return {k: v for k, v in parts.items() if v}


def _check_episodes(features: Any, episodes: EpisodeSet | EpisodeStream) -> None:
    if len(episodes) == 0:
        raise EpisodeError("no episodes to solve", param="episodes", value=len(episodes))
    split_name = getattr(features, "name", None)
    if split_name and split_name != episodes.spec.split:
        raise EpisodeError(
            f"the episodes were drawn from split {episodes.spec.split!r} but the features are split {split_name!r}",
            param="episodes",
            value=episodes.spec.split,
        )
    if isinstance(episodes, EpisodeSet) and episodes.ways is not None:
        check_ragged(episodes, features.labels)
    else:
        episodes.check_against(features.labels)


def check_ragged(episodes: EpisodeSet, labels: Tensor, where: str = "episodes") -> None:
    """EpisodeError, naming the episode, unless a ragged set fits a split with these ``labels [N]``:
    indices in ``0..N-1`` or ``-1`` (padding, with label ``-1``), each episode's labels in
    ``0..ways[e]-1`` with every class in its support and at least one query, and label ``k``'s rows
    all from one class, different labels from different classes."""
    assert episodes.ways is not None and episodes.index is not None
    n, E = int(labels.shape[0]), len(episodes)
    ways = episodes.ways.to(torch.int64)

    def fail(e: int, why: str) -> None:
        raise EpisodeError(f"{where}: episode {int(episodes.index[e])} {why}", param="episodes", value=where)  # type: ignore[index]

    if ways.shape != (E,):
        raise EpisodeError(
            f"{where}: ways has shape {tuple(ways.shape)}, expected ({E},)", param="episodes", value=where
        )
    if bool((ways < 2).any()):
        e = int((ways < 2).nonzero()[0, 0])
        fail(e, f"has {int(ways[e])} classes; an episode needs at least 2")
    way = int(ways.max())
    ref = torch.full((E, way), -1, dtype=torch.int64)  # the split class of each label
    for name, idx, lab in (
        ("support", episodes.support, episodes.support_labels),
        ("query", episodes.query, episodes.query_labels),
    ):
        if idx.shape != lab.shape:
            raise EpisodeError(
                f"{where}: {name} indices {tuple(idx.shape)} and labels {tuple(lab.shape)} differ",
                param="episodes",
                value=where,
            )
        real = idx >= 0
        bad = (idx < -1) | (idx >= n) | (real != (lab >= 0)) | (lab >= ways.unsqueeze(1))
        if bool(bad.any()):
            e, j = (int(v) for v in bad.nonzero()[0])
            fail(
                e,
                f"{name} entry {j} (index {int(idx[e, j])}, label {int(lab[e, j])}) is out of range: indices lie in "
                f"0..{n - 1} (-1 for padding, with label -1) and labels in 0..{int(ways[e]) - 1}",
            )
        cls = torch.where(real, labels[idx.clamp_min(0)], -1)
        flat = lab.clamp_min(0) + way * torch.arange(E).unsqueeze(1)
        lo = torch.full((E * way,), n, dtype=torch.int64).scatter_reduce(
            0, flat[real], cls[real], "amin", include_self=True
        )
        hi = torch.full((E * way,), -1, dtype=torch.int64).scatter_reduce(
            0, flat[real], cls[real], "amax", include_self=True
        )
        lo, hi = lo.view(E, way), hi.view(E, way)
        present = torch.arange(way).unsqueeze(0) < ways.unsqueeze(1)
        missing = present & (hi < 0)
        if bool(missing.any()):
            e, k = (int(v) for v in missing.nonzero()[0])
            fail(e, f"has no {name} row of class {k}; each of its {int(ways[e])} classes needs one")
        mixed = present & ((lo != hi) | ((ref >= 0) & (ref != lo)))
        if bool(mixed.any()):
            e, k = (int(v) for v in mixed.nonzero()[0])
            fail(e, f"label {k} mixes classes of the split; the episodes were drawn from another cache or split")
        ref = torch.where(present, lo, ref)
    srt = ref.masked_fill(ref < 0, -1).sort(1).values
    same = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(same.any()):
        fail(int(same.nonzero()[0, 0]), "gives two labels the same class of the split")


@dataclass(frozen=True)
class Hooks:
    """What a call of :func:`evaluate` tells its caller; every field optional.

    Attributes:
        progress: called with the number of episodes just solved (all methods).
        ready: called once every check has passed, just before solving starts.
        planned: called with the :class:`ChunkPlan` (bound, bytes held) once the call is planned.
        stats: if given, filled with ``chunk_size``, ``n_chunks``, ``device``, ``seconds`` per label,
            ``n_neg``, ``workers``, ``first_chunk_s``, ``max_memory`` and ``held_bytes``; for ragged
            episodes also ``rows``, ``padded_rows`` (support and query rows without and with the
            chunks' padding) and ``bucketed``.
    """

    progress: Callable[[int], None] | None = None
    ready: Callable[[], None] | None = None
    planned: Callable[[ChunkPlan], None] | None = None
    stats: dict | None = None


# evaluate's keywords before 0.2.0, now fields of ``run`` (RunOptions) or ``hooks`` (Hooks)
_RUN_KEYWORDS = ("device", "max_memory", "workers", "chunk_size", "overlap")
_HOOK_KEYWORDS = ("progress", "ready", "planned", "stats")


def _old_keywords(run: RunOptions, hooks: Hooks, old: Mapping[str, Any]) -> tuple[RunOptions, Hooks]:
    """``run`` and ``hooks`` with the keywords of the old signature folded in (a DeprecationWarning)."""
    unknown = sorted(set(old) - set(_RUN_KEYWORDS) - set(_HOOK_KEYWORDS))
    if unknown:
        raise TypeError(f"evaluate() got unexpected keyword argument(s) {', '.join(unknown)}")
    warnings.warn(
        f"evaluate({', '.join(f'{k}=' for k in old)}) is deprecated: give run=RunOptions(...) and "
        f"hooks=Hooks(...) (removed in 0.3.0)",
        DeprecationWarning,
        stacklevel=3,
    )
    run = dataclasses.replace(run, **{k: v for k, v in old.items() if k in _RUN_KEYWORDS})
    hooks = dataclasses.replace(hooks, **{k: v for k, v in old.items() if k in _HOOK_KEYWORDS})
    return run, hooks


def evaluate(
    features: Any,
    episodes: EpisodeSet | EpisodeStream,
    methods: Sequence[Method],
    *,
    negatives: NegativeSpec | None = None,
    cache_path: Any = None,
    run: RunOptions = RunOptions(),
    hooks: Hooks = Hooks(),
    dtype: torch.dtype = torch.float32,
    preprocess: Any = None,
    also_held: Mapping[str, int] | None = None,
    backend: Backend | None = None,
    checked: bool = False,
    **deprecated: Any,
) -> dict[str, Tensor]:
    """Per-episode accuracies of every method on ``episodes``.

    Args:
        features: a ``poodle.cache.SplitFeatures`` (``features [N, D]``, ``labels [N]``) of the split
            the episodes index.
        episodes: an episode set (its ``negatives`` indices are used when their source matches), or
            an :class:`~poodle.episodes.EpisodeStream` (drawn chunk by chunk: same results, flat memory;
            a stream of ragged episodes is drawn in advance, as its shapes plan the chunks).
        methods: ``(label, method, config)`` triples; method a registered name or its registry entry
            (:class:`~poodle.solvers.SolverInfo`), config a dataclass (checked unless it was when
            built), a dict of options or None. Each is resolved and checked once, not per chunk.
        negatives: the negative source and count; ``None`` means no negatives.
        cache_path: the cache file (its ``train`` split is the ``base`` pool).
        run: where and how (:class:`poodle.run.RunOptions`: device, max_memory, workers, chunk_size,
            overlap; module docstring, :func:`plan_chunks`, :func:`run_chunks`); no result depends on
            it. Checked when it was made.
        hooks: the callbacks and the stats dict (:class:`Hooks`).
        dtype: the solvers' float type (float64 for references).
        preprocess: a :class:`poodle.preprocess.Preprocessor` whose transform the negative pool gets
            (the caller transforms ``features`` itself).
        also_held: bytes the caller holds for the whole call, by what holds them (``{"the split as
            read, before preprocessing": n}``): an explicit ``max_memory`` on the CPU counts them.
        backend: which arithmetic the solvers run, and the report of what did (``None``:
            :func:`backend_for` ``(run)``; a caller that records what ran passes its own).
        checked: the caller checked each method's negatives rule against ``negatives``, and the
            negative settings, where it chose them (the pipeline's cells, when
            :func:`poodle.cells.make_cell` made them): not checked again. Left False (a call from
            Python), they are checked here, once per call, not per chunk.
        deprecated: the keywords of 0.1 (``device=``, ``progress=`` ...), folded into ``run`` and
            ``hooks`` with a DeprecationWarning.

    Returns:
        ``{label: float64 [E] accuracies in [0, 1]}`` on the CPU.
    """
    if deprecated:
        run, hooks = _old_keywords(run, hooks, deprecated)
    device, max_memory, workers, chunk_size, overlap = (
        run.device,
        run.max_memory,
        run.workers,
        run.chunk_size,
        run.overlap,
    )
    progress, ready, planned, stats = hooks.progress, hooks.ready, hooks.planned, hooks.stats
    t_call = time.perf_counter()
    dev = resolve_device(device)
    methods, users = _resolve_methods(methods)
    if isinstance(episodes, EpisodeStream) and getattr(episodes, "ragged", False):
        # episodes of different shapes are planned by their shapes (each chunk's padded size, the
        # buckets), which only drawing them tells
        episodes = episodes.materialize()
    _check_episodes(features, episodes)
    spec = episodes.spec
    D = features.features.shape[1]
    neg = _negatives(users, negatives, episodes, cache_path, D, preprocess, checked)
    gatherer = Gatherer(features.features, episodes, neg, dev, dtype)
    parts = _held_parts(gatherer, episodes, also_held) if max_memory is not None else {}
    plan_kw: dict[str, Any] = dict(
        max_memory=max_memory,
        workers=workers,
        chunk_size=chunk_size,
        itemsize=torch.empty((), dtype=dtype).element_size(),
        held=sum(parts.values()),
        held_parts=parts,
    )
    if isinstance(episodes, EpisodeSet) and episodes.ways is not None:
        # ragged: each chunk padded to its largest episode, in buckets of similar size where that pads less
        plan = plan_ragged(episodes, neg.count, D, dev, **plan_kw)
        if plan.order is not None:
            gatherer.reorder(plan.order)
    else:
        plan = plan_chunks(
            len(episodes), spec.n_support + spec.n_query + neg.count, D, spec.fixed("way"), dev, **plan_kw
        )
    if planned is not None:
        planned(plan)
    if ready is not None:
        ready()
    E = len(episodes)
    tally = _Tally(
        {label: torch.empty(E, dtype=torch.float64) for label, _, _ in methods},
        {label: 0.0 for label, _, _ in methods},
        progress,
        t_call,
    )
    run_chunks(plan, gatherer, methods, tally, overlap, backend_for(run) if backend is None else backend)
    if stats is not None:
        stats.update(tally.stats(plan, gatherer, neg.count))
    return tally.in_episode_order(plan.order)


__all__ = [
    "ChunkPlan",
    "Gatherer",
    "Padding",
    "Hooks",
    "check_memory_bound",
    "check_ragged",
    "choose_chunk",
    "crop_ragged",
    "default_budget",
    "episode_bytes",
    "episode_shapes",
    "evaluate",
    "padding_rows",
    "plan_chunks",
    "plan_ragged",
    "prepare_negatives",
    "run_chunks",
    "solve_batch",
    "solve_chunk",
]
