"""Ablation grids: many solver configurations over one cache and one episode set, as paired cells.

:mod:`poodle.grid.spec` reads a grid file (TOML) and expands it into cells (:mod:`poodle.cells`);
:mod:`poodle.grid.runner` solves those that the results file (:mod:`poodle.results`) does not hold
yet, through the one pipeline (:mod:`poodle.pipeline`). See docs/grid.md.
"""

from poodle.cells import Cell, format_option
from poodle.grid.runner import GridRun, run_grid
from poodle.grid.spec import (
    DEFAULTS,
    GridSpec,
    default_results_path,
    expand,
    grid_hash,
    load_grid,
    parse_grid,
    resolve_cache,
    tomllib,
)
from poodle.pipeline import calls, cell_keys, fingerprints, schedule
from poodle.results import read_results, record_flat

__all__ = [
    "DEFAULTS",
    "Cell",
    "GridRun",
    "GridSpec",
    "calls",
    "cell_keys",
    "default_results_path",
    "expand",
    "fingerprints",
    "format_option",
    "grid_hash",
    "load_grid",
    "parse_grid",
    "read_results",
    "record_flat",
    "resolve_cache",
    "run_grid",
    "schedule",
    "tomllib",
]
