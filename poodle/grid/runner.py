"""Running a grid: its cells through the one pipeline (:func:`poodle.pipeline.run_cells`), each
finished cell a record appended (and fsynced) to the results file, so an interrupted run resumes
where it stopped. A record is found again by its identity, which holds the cache's content
fingerprint, so adding cells computes only the new ones and a record of another cache is never reused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from poodle.cells import Cell
from poodle.events import OnEvent, ignore
from poodle.grid.spec import GridSpec, default_results_path, expand
from poodle.pipeline import CellRun, RunOptions, run_cells
from poodle.utils import check_output

GridRun = CellRun  # what run_grid returns


def run_grid(
    spec: GridSpec,
    out: str | os.PathLike | None = None,
    *,
    force: bool = False,
    options: RunOptions = RunOptions(),
    on_event: OnEvent = ignore,
    cells: Sequence[Cell] | None = None,
) -> CellRun:
    """Run every cell of ``spec`` that the results file ``out`` does not hold yet.

    Args:
        spec: the parsed grid (:func:`poodle.grid.load_grid`).
        out: the JSON Lines results file (default: next to the grid file, see
            :func:`poodle.grid.default_results_path`); it may hold records of other grids too.
        force: recompute every cell of this grid (new records supersede the old ones).
        options: device, memory bound, cells per call (:class:`poodle.pipeline.RunOptions`).
        on_event: receives the run's events (:mod:`poodle.events`): cells started, finished or found
            done, episodes solved.
        cells: the expanded cells, when the caller already has them.

    Returns:
        a :class:`poodle.pipeline.CellRun`; its ``records`` are those of all cells, in grid order.
    """
    cells = list(cells) if cells is not None else expand(spec)
    path = Path(out) if out is not None else default_results_path(spec.path)
    # never a cache, the grid file or another kind of file: only a results file gains records
    check_output(path, "results", inputs=[spec.path, *{c.cache_file for c in cells}], param="out")
    meta = {"name": spec.name, "grid_file": str(spec.path), "n_cells": len(cells)}
    return run_cells(cells, out=path, meta=meta, resume=not force, group=spec.name, options=options, on_event=on_event)


__all__ = ["GridRun", "run_grid"]
