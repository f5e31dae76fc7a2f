"""Ablation grids: many solver configurations over one cache and one episode set, as paired cells.

:mod:`poodle.grid.spec` reads a grid file (TOML) and expands it into cells; :mod:`poodle.grid.runner`
solves the cells that the results file (:mod:`poodle.results`) does not hold yet. See docs/grid.md.
"""

from poodle.grid.runner import CellEvent, GridRun, batches, cell_keys, fingerprints, run_grid, schedule
from poodle.grid.spec import (
    DEFAULTS,
    Cell,
    GridSpec,
    default_results_path,
    expand,
    format_option,
    grid_hash,
    load_grid,
    parse_grid,
    resolve_cache,
    resolve_negatives,
    tomllib,
)
from poodle.results import read_results, record_flat

__all__ = [
    "DEFAULTS",
    "Cell",
    "CellEvent",
    "GridRun",
    "GridSpec",
    "batches",
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
    "resolve_negatives",
    "run_grid",
    "schedule",
    "tomllib",
]
