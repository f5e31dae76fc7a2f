"""How cells are solved: :class:`RunOptions`, the settings of a run that change no result.

It is its own module so that the pipeline (:mod:`poodle.pipeline`) and one call of it
(:func:`poodle.evaluate.evaluate`) take the same object, checked once where it is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poodle import defaults
from poodle.errors import ConfigError
from poodle.options import check_group, option


@dataclass(frozen=True)
class RunOptions:
    """How cells are solved; nothing here changes a result.

    Attributes:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (under torchrun: ``auto``, ``cuda`` or ``cpu``).
        max_memory: bound on what a call holds (bytes or ``"2GiB"``; ``None``: the device's default,
            :func:`poodle.evaluate.default_budget`).
        workers: CPU chunks solved at once (``None``: :func:`poodle.system.solve_workers`, torch's
            thread count within the usable cores).
        cells_per_call: cells on the same episodes and negatives solved by one call (each chunk's
            episodes are then gathered, and their negatives drawn, once for all of them).
        chunk_size: episodes per chunk, overriding the automatic choice (tests, benchmarks).
        cuda_step: the fine-tuning fits' step on CUDA, ``"torch"`` or ``"triton"``
            (the run's :class:`poodle.solvers.Backend`, :func:`poodle.evaluate.backend_for`: the same
            accuracies, probabilities to float rounding).
        overlap: one pipelined stream of chunks, the next prepared while one is solved (``None``: on
            a GPU; :func:`poodle.evaluate.run_chunks`).
    """

    device: str | torch.device = option(
        defaults.DEVICE,
        help="auto, cpu, cuda or cuda:N (under torchrun: auto, cuda or cpu; each process its local GPU).",
    )
    max_memory: str | int | None = option(
        None,
        cli_type="size",
        help=f"Bound on the memory a call holds (features, negative pool, chunks in flight; on CPU also the "
        f"episodes drawn in advance); sets the chunk size [{defaults.MAX_MEMORY} for the chunks on CPU; 80% of "
        f"the free memory on CUDA].",
    )
    workers: int | None = option(
        None,
        min=1,
        help="CPU: chunks solved at once, each single-threaded [default: torch's thread count within the "
        "usable cores; poodle info --system].",
    )
    cells_per_call: int = option(
        defaults.CELLS_PER_CALL,
        min=1,
        help="Cells on the same episodes and negatives solved together (one gather per chunk).",
    )
    chunk_size: int | None = option(None, min=1, cli=False, help="Episodes per chunk (tests, benchmarks).")
    cuda_step: str = option(
        defaults.CUDA_STEP,
        choices=defaults.CUDA_STEPS,
        help="The fine-tuning fits' step on CUDA: torch, or triton (one pass over the rows a step; "
        "opt-in until timed on a GPU, docs/gpu.md).",
    )

    overlap: bool | None = option(None, cli=False, help="Prepare the next chunk while one is solved [on a GPU].")

    def __post_init__(self) -> None:
        check_group(self, ConfigError)  # refused when made, before any file is read


__all__ = ["RunOptions"]
