"""Several processes, one run: the plumbing `extract`, `solve`, `grid` and `train` share under torchrun.

``torchrun --nproc-per-node N $(which poodle) <command> ...`` starts N copies of the command with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in their environment. :func:`init` joins them into one
``torch.distributed`` process group (NCCL when each process has a GPU, gloo on the CPU) and gives
each process its device (``cuda:LOCAL_RANK``, or the CPU). Without those variables, or with
``WORLD_SIZE=1``, everything here degrades to a single process and no process group is made.

The stages follow three rules:

- Work is split by :func:`share` (contiguous, deterministic, disjoint ranges), so every rank knows
  every other rank's share without asking, and the results gathered on rank 0 can be put back in
  their one-process order. :func:`deal` gives a rank its part of rounds of units of work (a
  solve's calls, or one call's episodes) from their counts alone; the caller solves it and hands
  its tensors to :func:`gather_results`, which merges each round on rank 0: nothing here calls
  back into the stage that uses it.
- Every piece of work that can fail runs inside :meth:`Dist.guard`. Leaving the block is a
  collective: the ranks agree (one all-reduce) on whether any of them failed. If one did, the
  lowest failing rank re-raises its own error (which the command line prints) and every other rank
  raises :class:`RankFailed`, which the command line turns into a silent exit. So an error is printed
  once, and no rank is left waiting in a collective that a failed rank will never join. A rank that
  dies outright (killed, out of memory) is torn down with the others by torchrun itself; the
  process group's timeout (``POODLE_DIST_TIMEOUT`` seconds, default 3600) is the last resort.
- Rank 0 alone writes final files and prints; the library functions call their ``log`` and
  ``progress`` callbacks on rank 0 only.

Objects crossing processes are encoded as JSON in byte tensors (:meth:`Dist.broadcast_json`,
:meth:`Dist.gather_json`), never pickled; bulk numbers travel as tensors (:meth:`Dist.gather_tensor`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from poodle.errors import ConfigError, PoodleError, mark
from poodle.utils import resolve_device

DEFAULT_TIMEOUT_S = 3600


class RankFailed(PoodleError):
    """Raised on every rank but the one whose error is reported, when some rank of the run failed.

    ``quiet`` tells the command line to exit 1 without printing: the failing rank prints the error.
    """

    quiet = True


def env_world() -> tuple[int, int, int]:
    """``(world_size, rank, local_rank)`` from torchrun's environment; ``(1, 0, 0)`` without it."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as e:
        # not a caller's value: torchrun's environment variables, no parameter
        raise ConfigError(f"torchrun's environment is malformed: {e}") from None
    if world < 1 or not 0 <= rank < world:
        # not a caller's value: torchrun's environment variables, no parameter
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} from the environment do not fit together")
    return world, rank, local


def is_main_process() -> bool:
    """Whether this process is rank 0 (or not under torchrun): the one that prints and writes."""
    return env_world()[1] == 0


def share(n: int, world: int, rank: int, align: int = 1) -> range:
    """The contiguous share ``[a, b)`` of ``range(n)`` of ``rank`` among ``world`` ranks.

    Shares are disjoint, in rank order, cover ``range(n)`` and differ in size by at most ``align``
    items; boundaries fall on multiples of ``align`` (except ``n``).
    """
    if world < 1 or not 0 <= rank < world or align < 1 or n < 0:
        raise ValueError(f"share({n}, {world}, {rank}, align={align})")
    units = -(-n // align)
    a = min(n, (units * rank // world) * align)
    b = min(n, (units * (rank + 1) // world) * align)
    return range(a, b)


@dataclass
class Dist:
    """This process's place in the run: ``world`` processes, this one ``rank`` (``local_rank`` on its node)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        """Whether there is a process group (more than one process)."""
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, n: int, align: int = 1) -> range:
        """This rank's share of ``range(n)`` (see :func:`share`)."""
        return share(n, self.world, self.rank, align)

    # -- collectives; the backend's tensors live on ``comm_device`` (the GPU for NCCL)
    @property
    def comm_device(self) -> torch.device:
        if self.enabled and torch.distributed.get_backend() == "nccl":
            return self.device
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run the block on every rank; on leaving it, fail on every rank if it failed on any.

        Every rank must enter the same guards in the same order (each is one collective).
        """
        err: BaseException | None = None
        try:
            yield
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
            err = e
            if not self.enabled or isinstance(e, KeyboardInterrupt):
                raise  # an interrupt reaches every rank from torchrun at once: nothing to agree on
        if not self.enabled:
            return
        first = self._first_failed(err is not None)
        if first < 0:
            return
        if first == self.rank and err is not None:
            raise err
        # not a caller's value: another rank failed; that rank reports its error
        raise RankFailed(f"rank {first} of {self.world} failed")

    def stop_point(self) -> None:
        """A safe point every rank reaches at the same step: raise
        :class:`poodle.interrupt.Interrupted` on every rank if any was asked to stop (one all-reduce
        of the signal's number), so the ranks stop together and none waits in a collective for a
        rank that is gone."""
        from poodle import interrupt

        if self.enabled:
            t = torch.tensor([interrupt.requested() or 0], dtype=torch.int64, device=self.comm_device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            if int(t.item()):
                interrupt.request(int(t.item()))
        interrupt.check()

    def _first_failed(self, failed: bool) -> int:
        """Lowest rank that failed, or -1: one all-reduce (MIN over ``world`` for ranks that did not)."""
        t = torch.tensor([self.rank if failed else self.world], dtype=torch.int64, device=self.comm_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        v = int(t.item())
        return -1 if v >= self.world else v

    def broadcast_json(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (JSON-serialisable) on every rank."""
        if not self.enabled:
            return obj
        dev = self.comm_device
        data = json.dumps(obj).encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        torch.distributed.broadcast(size, src)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=dev)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.distributed.broadcast(buf, src)
        return json.loads(bytes(buf.cpu().tolist()).decode())

    def gather_json(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (JSON-serialisable), in rank order, on rank 0; None elsewhere."""
        if not self.enabled:
            return [obj]
        data = json.dumps(obj).encode()
        parts = self.gather_tensor(
            torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        )
        if parts is None:
            return None
        return [json.loads(bytes(p.tolist()).decode()) for p in parts]

    def gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's 1-d tensor ``t`` (sizes may differ; dtype must agree), in rank order, on
        rank 0 (on the CPU); None elsewhere."""
        t = t.reshape(-1)
        if not self.enabled:
            return [t.cpu()]
        dev = self.comm_device
        n = torch.tensor([t.numel()], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        torch.distributed.all_gather(sizes, n)
        counts = [int(s.item()) for s in sizes]
        # all_gather needs equal sizes: pad to the longest, cut after.
        longest = max(counts)
        padded = torch.zeros(longest, dtype=t.dtype, device=dev)
        padded[: t.numel()] = t.to(dev)
        bufs = [torch.zeros_like(padded) for _ in range(self.world)]
        torch.distributed.all_gather(bufs, padded)
        if not self.main:
            return None
        return [b[:c].cpu() for b, c in zip(bufs, counts)]


Solved = dict[str, tuple[torch.Tensor, dict]]  # {key: (per-row results, info)}


@dataclass(frozen=True)
class Round:
    """One round of :func:`deal`: the units it finishes, in order, and this rank's part of it.

    Attributes:
        units: the indices of the units finished in this round, in order (rank 0 takes up their
            results, merged by :func:`gather_results`, in this order).
        unit: the index of the unit this rank solves in the round, or None (nothing this round).
        rows: the rows of that unit's episodes this rank solves, or None (all of them).
    """

    units: tuple[int, ...]
    unit: int | None
    rows: range | None


def deal(d: Dist, n_rows: Sequence[int]) -> list[Round]:
    """This rank's share of ``len(n_rows)`` units of work (unit ``i`` has ``n_rows[i]`` rows, e.g. a
    call's episodes), in rounds, from the counts alone.

    With at least as many units as ranks, the units are dealt out in rounds of one per rank (a rank
    past the round's last unit has none); with fewer, each unit is a round whose rows are split
    across all ranks (:func:`share`; a rank with no rows has none). One process: one unit a round,
    all of its rows. Every rank gets the same rounds, in the same order: each rank solves its part
    of a round inside one :meth:`Dist.guard` and hands its results to :func:`gather_results`, and
    every rank goes through every round (each is a guard and a gather, collectives).
    """
    n = len(n_rows)
    if not d.enabled:
        return [Round((i,), i, None) for i in range(n)]
    if n >= d.world:
        rounds = [tuple(range(a, min(a + d.world, n))) for a in range(0, n, d.world)]
        return [Round(r, r[d.rank] if d.rank < len(r) else None, None) for r in rounds]
    out = []
    for i in range(n):
        rows = d.share(int(n_rows[i]))
        out.append(Round((i,), i if len(rows) else None, rows))
    return out


def gather_results(d: Dist, local: Solved) -> Solved | None:
    """Every rank's results of one round of :func:`deal`, merged on rank 0; None elsewhere.

    ``local`` is ``{key: (float64 [n] per-row results, info)}`` of this rank's part (``{}`` when it
    had none); ``info`` is JSON-serialisable and holds at least ``seconds``. A key solved by several
    ranks (a unit whose rows were split) has its parts put back in rank order, ``seconds`` being the
    slowest rank's and the rest of ``info`` rank 0's part's. Every rank must call it (two gathers).
    One process: ``local`` as it is.
    """
    if not d.enabled:
        return local
    keys = list(local)
    flat = (
        torch.cat([local[k][0].reshape(-1).to(torch.float64).cpu() for k in keys])
        if keys
        else torch.zeros(0, dtype=torch.float64)
    )
    values = d.gather_tensor(flat)
    metas = d.gather_json([[k, int(local[k][0].numel()), local[k][1]] for k in keys])
    if not d.main:
        return None
    assert values is not None and metas is not None
    parts: dict[str, list[tuple[torch.Tensor, dict]]] = {}
    for v, meta in zip(values, metas):
        at = 0
        for k, n, info in meta:
            parts.setdefault(k, []).append((v[at : at + n], info))
            at += n
    return {
        k: (
            torch.cat([t for t, _ in ps]),
            {**ps[0][1], "seconds": max(float(i.get("seconds", 0.0)) for _, i in ps)},
        )
        for k, ps in parts.items()
    }


def shared_map(
    d: Dist, units: Sequence[Any], solve: Callable[[Any, range | None], Solved], n_rows: Callable[[Any], int]
) -> Iterator[tuple[Any, Solved]]:
    """Deprecated (0.2.0): loop over :func:`deal`'s rounds and merge each with :func:`gather_results`.

    Solves ``units`` across the ranks with the callback ``solve(unit, rows)`` and yields
    ``(unit, results)`` on rank 0, in order (see :func:`deal` for who solves what); every rank must
    iterate the generator to its end.
    """
    warnings.warn(
        "poodle.distributed.shared_map is deprecated: loop over poodle.distributed.deal(d, n_rows) and merge "
        "each round with poodle.distributed.gather_results (removed in 0.3.0)",
        DeprecationWarning,
        stacklevel=2,
    )
    units = list(units)
    rounds = deal(d, [n_rows(u) for u in units]) if d.enabled else deal(d, [0] * len(units))

    def rounds_of() -> Iterator[tuple[Any, Solved]]:
        for rnd in rounds:
            local: Solved = {}
            with d.guard():
                if rnd.unit is not None:
                    local = solve(units[rnd.unit], rnd.rows)
            merged = gather_results(d, local)
            if merged is None:
                continue
            for i in rnd.units:
                yield units[i], merged

    return rounds_of()


_CURRENT: Dist | None = None


def init(device: str | torch.device = "auto") -> Dist:
    """Join torchrun's process group (once per process) and return this process's :class:`Dist`.

    ``device``: ``auto`` or ``cuda`` take ``cuda:LOCAL_RANK`` when CUDA is present (else the CPU);
    ``cpu`` keeps every rank on the CPU (gloo). A numbered GPU (``cuda:N``) is refused under torchrun:
    each process's GPU is its local rank. Without torchrun this is :func:`poodle.utils.resolve_device`.
    """
    global _CURRENT
    world, rank, local = env_world()
    if world == 1:
        return Dist(device=resolve_device(device))
    name = str(device)
    if _CURRENT is not None and torch.distributed.is_initialized():
        if name == "cpu" and _CURRENT.device.type != "cpu":
            raise ConfigError(
                f"this process already joined the run on a GPU; {mark('device')} cpu cannot change that",
                params=("device",),
                param="device",
                value=device,
            )
        return _CURRENT
    if name not in ("auto", "cuda", "cpu"):
        raise ConfigError(
            f"{mark('device')} {name}: under torchrun each process uses cuda:LOCAL_RANK; give cuda, auto or cpu",
            params=("device",),
            param="device",
            value=device,
        )
    use_cuda = name != "cpu" and torch.cuda.is_available()
    if name == "cuda" and not use_cuda:
        raise ConfigError(
            f"{mark('device')} cuda: CUDA is not available", params=("device",), param="device", value=device
        )
    if use_cuda:
        if local >= torch.cuda.device_count():
            # not a caller's value: torchrun's LOCAL_RANK against this node's GPUs
            raise ConfigError(
                f"LOCAL_RANK {local} but this node has {torch.cuda.device_count()} GPU(s): start "
                f"at most that many processes per node"
            )
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get("POODLE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)))
        kwargs: dict[str, Any] = {"backend": "nccl" if use_cuda else "gloo", "timeout": timeout}
        if use_cuda:
            kwargs["device_id"] = dev
        torch.distributed.init_process_group(**kwargs)
        atexit.register(_shutdown)
    _CURRENT = Dist(world, rank, local, dev)
    return _CURRENT


def _shutdown() -> None:
    if torch.distributed.is_initialized():
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()


__all__ = [
    "Dist",
    "RankFailed",
    "Round",
    "deal",
    "env_world",
    "gather_results",
    "init",
    "is_main_process",
    "share",
    "shared_map",
]
