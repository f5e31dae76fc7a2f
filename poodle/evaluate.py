"""Solve an episode set with one or more methods, chunk by chunk, and score it.

Chunks of episodes are gathered from the in-memory features onto the device and solved together;
every method sees the same chunk, hence identical episodes and identical negatives. The chunk
size is the smaller of what ``max_memory`` allows (a per-episode estimate of the gathered rows and
the solver's buffers) and, on CPU, what keeps a chunk's rows cache-resident (the fine-tuning
solvers read them twice per step; see docs/stage2.md for the measurements). Peak memory therefore
depends on the chunk, not on the number of episodes: at most two chunks per worker are in flight,
and an :class:`~poodle.episodes.EpisodeStream` draws each chunk's episodes and negatives in the
worker that solves it, so nothing is held per episode but its accuracy.

The features and the negative pool are placed on the device once; each chunk is gathered there
from index tensors (on CUDA the only host-to-device copies, pinned and non-blocking), and the
solvers' step loops never read a value back to the host. The CUDA path is written for this but
has not been run (no GPU was available when it was written).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Mapping, Sequence, overload

import torch
from torch import Tensor

from poodle import defaults, solvers
from poodle.episodes import EpisodeSet, EpisodeStream
from poodle.errors import ConfigError, EpisodeError
from poodle.negatives import NegativeSpec, generate, load_pool, sample_indices
from poodle.solvers.base import EpisodeBatch
from poodle.utils import parse_size, resolve_device

# On CPU a chunk's gathered rows should stay within the last-level cache share of the cores
# (32 MiB L3 shared by 2 cores here; measured best around 6-12 MiB of rows per chunk).
CPU_CHUNK_BYTES = 8 * 2**20
# Upper bound on a chunk on GPU: beyond a few thousand episodes nothing is gained.
GPU_MAX_CHUNK = 4096


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


def needs_negatives(name: str, cfg: Any) -> bool:
    """Whether method ``name`` with ``cfg`` consumes negatives (POODLE with beta = 0 does not)."""
    return solvers.get(name).needs_negatives(cfg)


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


def check_memory_bound(budget: int, n_rows: int, dim: int, way: int, workers: int, itemsize: int = 4) -> int:
    """The number of chunk workers that fits ``budget`` bytes (fewer than asked when one chunk per
    worker would not fit); ConfigError saying by how much when not even one episode fits."""
    need = episode_bytes(n_rows, dim, way, itemsize)
    if need > budget:
        raise ConfigError(
            f"--max-memory {_mib(budget)} cannot be met: one episode ({n_rows} rows of D={dim}, "
            f"negatives included) needs about {_mib(need)}, {_mib(need - budget)} more; raise "
            f"--max-memory to at least {_mib(need)} or lower --n-neg"
        )
    return max(1, min(workers, budget // need))


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


def _resolve_methods(methods: Sequence[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    if not methods:
        raise ConfigError("no method to run")
    out, seen = [], set()
    for item in methods:
        if len(item) != 3:
            raise ConfigError(f"methods are (label, method, config) triples, got {item!r}")
        label, name, cfg = item
        info = solvers.get(name)
        if cfg is None:
            cfg = solvers.make_config(name, {})
        elif isinstance(cfg, Mapping):
            cfg = solvers.make_config(name, cfg, strict=True)
        elif not isinstance(cfg, info.config):
            raise ConfigError(f"method {name!r}: config must be a {info.config.__name__}, got {type(cfg).__name__}")
        else:
            solvers.base.check_config(info.name, cfg)
        if label in seen:
            raise ConfigError(f"two methods share the label {label!r}; give each a distinct label")
        seen.add(label)
        out.append((label, name, cfg))
    return out


def default_budget(device: torch.device) -> int:
    """The bound on the chunks in flight when none is given: ``poodle.defaults.MAX_MEMORY`` on CPU; on CUDA 80% of the
    device's free memory (``torch.cuda.mem_get_info``) less the features already placed there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1 << 26, int(0.8 * free))
    return parse_size(defaults.MAX_MEMORY)


def evaluate(
    features: Any,
    episodes: EpisodeSet | EpisodeStream,
    methods: Sequence[tuple[str, str, Any]],
    *,
    negatives: NegativeSpec | None = None,
    cache_path: Any = None,
    device: str | torch.device = "auto",
    max_memory: str | int | None = None,
    progress: Callable[[int], None] | None = None,
    chunk_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    workers: int | None = None,
    stats: dict | None = None,
    preprocess: Any = None,
    ready: Callable[[], None] | None = None,
) -> dict[str, Tensor]:
    """Per-episode accuracies of every method on ``episodes``.

    Args:
        features: a ``poodle.cache.SplitFeatures`` (``features [N, D]`` normalised, ``labels [N]``)
            of the split the episodes index.
        episodes: the episode set (its ``negatives`` indices are used when their source matches), or
            an :class:`~poodle.episodes.EpisodeStream`, whose episodes and negatives are then drawn
            chunk by chunk in the workers (identical results, flat memory, no start-up wait).
        methods: ``(label, method_name, config)`` triples; config a dataclass, a dict of options or None.
        negatives: the negative source and count; ``None`` means no negatives.
        cache_path: the cache file (its ``train`` split is the ``base`` pool).
        device: where to solve. The features and the negative pool are placed there once and every
            chunk is gathered there (on CUDA only the small index tensors cross, pinned, non-blocking).
        max_memory: the bound on the working set of the chunks in flight (all workers together);
            ``None``: 2 GiB on CPU, 80% of the free device memory on CUDA.
        progress: called with the number of episodes just solved (all methods).
        ready: called once every check has passed (negatives and their pool, the memory bound), just
            before solving starts (where a caller starts its progress display).
        chunk_size: episodes per chunk, overriding the automatic choice (tests, benchmarks).
        dtype: the solvers' float type (float64 for references).
        workers: chunks solved at once (CPU only; default: torch's thread count). Each worker
            solves whole chunks with single-threaded operations: a solver step is a few small
            operations, and splitting each of them across cores costs more in synchronisation than
            it gains (under any other load on the machine, far more). Results do not depend on it.
        stats: if given, filled with ``chunk_size``, ``n_chunks``, ``device``, ``seconds`` per label,
            ``first_chunk_s`` (from the call to the first chunk solved).
        preprocess: a :class:`poodle.preprocess.Preprocessor` whose transform the negative pool gets
            (the caller transforms ``features`` itself).

    Returns:
        ``{label: float64 [E] accuracies in [0, 1]}`` on the CPU.
    """
    t_call = time.perf_counter()
    dev = resolve_device(device)
    methods = _resolve_methods(methods)
    feats: Tensor = features.features
    labels: Tensor = features.labels
    spec = episodes.spec
    if len(episodes) == 0:
        raise EpisodeError("no episodes to solve")
    split_name = getattr(features, "name", None)
    if split_name and split_name != spec.split:
        raise EpisodeError(
            f"the episodes were drawn from split {spec.split!r} but the features are split {split_name!r}"
        )
    episodes.check_against(labels)
    N, D = feats.shape

    # --- negatives: one draw shared by every method
    users = [name for _, name, cfg in methods if needs_negatives(name, cfg)]
    neg_spec = negatives if negatives is not None else NegativeSpec("none")
    pool: Tensor | None = None
    held = False  # whether the episodes' own negative indices are used
    M = 0
    if users:
        if neg_spec.is_none:
            raise ConfigError(
                f"method(s) {', '.join(sorted(set(users)))} need negatives; "
                "set negatives to base, random, sphere or FILE[:SPLIT]"
            )
        neg_spec.validate()
        M = neg_spec.n_neg
        if not neg_spec.generated:
            pool = load_pool(neg_spec.source, cache_path, dim=D)
            if preprocess is not None:
                pool = preprocess.pool(neg_spec.source, cache_path, D)
            held = episodes.negatives is not None and episodes.negative_source == neg_spec.source
            if held:
                assert episodes.negatives is not None
                _check_held(episodes.negatives, M, neg_spec.source, pool.shape[0])

    E = len(episodes)
    Ns, Nq = spec.n_support, spec.n_query
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dev.type != "cpu":
        workers = 1
    elif workers is None:
        workers = torch.get_num_threads()
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    # features and pool live on the device, in the solvers' dtype, once (no copy when they already do)
    feats_d = feats.to(device=dev, dtype=dtype)
    pool_d = pool.to(device=dev, dtype=dtype) if pool is not None else None
    budget = parse_size(max_memory) if max_memory is not None else default_budget(dev)
    if chunk_size is None:
        workers = check_memory_bound(budget, Ns + Nq + M, D, spec.way, workers, itemsize)
    # each worker holds one chunk: the memory bound is shared between them
    chunk = chunk_size or choose_chunk(Ns + Nq + M, D, spec.way, dev, max(1, budget // workers), itemsize)
    chunk = max(1, min(int(chunk), E))
    if ready is not None:  # every check has passed (negatives, pool, memory bound): solving starts
        ready()
    results = {label: torch.empty(E, dtype=torch.float64) for label, _, _ in methods}
    seconds = {label: 0.0 for label, _, _ in methods}
    cuda = dev.type == "cuda"

    def to_dev(t: Tensor) -> Tensor:
        # index tensors are the only host -> device traffic per chunk
        return t.pin_memory().to(dev, non_blocking=True) if cuda else t

    def solve_chunk(a: int, b: int) -> dict[str, tuple[Tensor, float]]:
        sub = episodes[a:b]
        sup = feats_d[to_dev(sub.support)]
        qry = feats_d[to_dev(sub.query)]
        neg = None
        if users:
            assert sub.index is not None  # set in EpisodeSet.__post_init__
            if pool_d is not None:
                idx = sub.negatives if held else sample_indices(pool_d.shape[0], sub.index, M, spec.seed)
                assert idx is not None  # held: the episodes carry their negatives
                neg = pool_d[to_dev(idx)]
            else:
                neg = to_dev(generate(neg_spec.source, sub.index, M, D, spec.seed)).to(dtype)
        sup_labels = to_dev(sub.support_labels)
        qlab = to_dev(sub.query_labels)
        done: dict[str, tuple[Tensor, float]] = {}
        for label, name, cfg in methods:
            t0 = time.perf_counter()
            b_in = EpisodeBatch(sup, sup_labels, qry, neg if needs_negatives(name, cfg) else None, spec.way)
            out = solvers.get(name).fn(b_in, cfg)
            correct = (out.log_probs.argmax(-1) == qlab).to(torch.float64).mean(1).cpu()  # syncs on CUDA
            done[label] = (correct, time.perf_counter() - t0)
            del out, b_in
        return done

    # the first chunks ramp up (1, 2, 4, ... episodes up to the chunk size) so the first results come
    # within a fraction of a second; results do not depend on chunking (tested)
    bounds, a, size = [], 0, max(1, chunk // 8) if E > 8 * chunk else chunk
    while a < E:
        bounds.append((a, min(E, a + size)))
        a, size = a + size, min(chunk, 2 * size)
    n_workers = min(workers, len(bounds))
    first_chunk_s: float | None = None

    def collect(a: int, b: int, done: dict[str, tuple[Tensor, float]]) -> None:
        nonlocal first_chunk_s
        if first_chunk_s is None:
            first_chunk_s = time.perf_counter() - t_call
        for label, (correct, secs) in done.items():
            results[label][a:b] = correct
            seconds[label] += secs
        if progress is not None:
            progress(b - a)

    with _single_threaded_ops(n_workers > 1):
        if n_workers > 1:
            # at most two chunks per worker in flight: memory does not grow with the number of chunks
            with ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="poodle-chunk") as ex:
                pending: dict[Future, tuple[int, int]] = {}
                todo = iter(bounds)
                try:
                    for a, b in todo:
                        pending[ex.submit(solve_chunk, a, b)] = (a, b)
                        if len(pending) >= 2 * n_workers:
                            break
                    while pending:
                        finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                        for fut in finished:
                            a, b = pending.pop(fut)
                            collect(a, b, fut.result())
                            nxt = next(todo, None)
                            if nxt is not None:
                                pending[ex.submit(solve_chunk, *nxt)] = nxt
                finally:
                    for fut in pending:
                        fut.cancel()
        else:
            for a, b in bounds:
                collect(a, b, solve_chunk(a, b))
    if stats is not None:
        stats.update(
            chunk_size=chunk,
            n_chunks=len(bounds),
            device=str(dev),
            seconds=seconds,
            n_neg=M if users else 0,
            workers=n_workers,
            first_chunk_s=first_chunk_s,
            max_memory=budget,
        )
    return results


def _check_held(neg: Tensor, M: int, source: str, pool_rows: int) -> None:
    if neg.shape[1] != M:
        raise EpisodeError(f"the episodes hold {neg.shape[1]} negatives per episode from {source!r}, but n_neg is {M}")
    hi = int(neg.max()) if neg.numel() else 0
    if (int(neg.min()) if neg.numel() else 0) < 0 or hi >= pool_rows:
        raise EpisodeError(
            f"negative indices reach {hi} but the pool {source!r} has {pool_rows} rows; "
            "the episodes were saved with another pool"
        )


__all__ = [
    "evaluate",
    "prepare_negatives",
    "choose_chunk",
    "episode_bytes",
    "needs_negatives",
]
