"""``poodle grid GRID.toml``: run an ablation grid over one cache and one episode set, resumably."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from poodle import defaults
from poodle.cli._common import console, friendly_errors, keep, note, parse_set, progress_option, styled
from poodle.cli._schema import schema_options
from poodle.run import RunOptions


def _parse_set(items: tuple[str, ...]) -> dict[str, Any]:
    """``--set episodes=200 --set shot=[1,5]``: values are read as TOML values, else as strings."""
    from poodle.grid import tomllib

    out: dict[str, Any] = {}
    for item in items:
        key, text = parse_set(item, "KEY=VALUE (e.g. --set episodes=200)")
        try:
            out[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = text
    return out


@click.command()
@click.argument("grid_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Results file (JSON Lines). Default: GRID.results.jsonl next to the grid file.",
)
@click.option(
    "--cache",
    "cache",
    type=click.Path(dir_okay=False),
    default=None,
    help="Use this feature cache instead of the grid's `cache` [a grid without one: the cache "
    "`poodle extract` wrote last under --cache-root].",
)
@click.option(
    "--cache-root",
    default=defaults.CACHE_ROOT,
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where the cache extract wrote last is looked up, for a grid that names no cache.",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a grid option, e.g. --set episodes=200 or --set 'shot=[1,5]'. Repeatable.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Recompute every cell of the grid; the new records supersede the old "
    "ones (records of other cells stay in the file).",
)
@click.option("--dry-run", is_flag=True, help="List the cells and what is already done; solve nothing.")
@schema_options(RunOptions, but=("workers",))
@progress_option
@friendly_errors
def grid(
    grid_file: Path,
    out: Path | None,
    cache: str | None,
    cache_root: str,
    sets: tuple[str, ...],
    force: bool,
    cells_per_call: int,
    dry_run: bool,
    device: str,
    max_memory: int | None,
    cuda_step: str,
) -> None:
    """Run every cell of GRID_FILE (a TOML grid, see docs/grid.md) and append its results.

    Cells with the same episode settings share identical episodes and negatives (paired). A re-run
    skips finished cells; an interrupted run resumes.
    """
    from poodle import distributed
    from poodle import grid as G
    from poodle.system import formulations

    # under torchrun: every rank reads the grid (an error is printed once), rank 0 alone displays
    d = distributed.init(device) if not dry_run else distributed.Dist()
    with d.guard():
        overrides = _parse_set(sets)
        if cache is not None:
            overrides["cache"] = str(Path(cache).expanduser().resolve())
        spec = G.load_grid(grid_file, overrides, default_cache=_latest_cache(cache_root))
        if spec.cache_defaulted and d.main:
            console.print(f"features: {spec.axes['cache'][0]} (the cache poodle extract wrote last)", soft_wrap=True)
        cells = G.expand(spec)
        out = out or G.default_results_path(grid_file)
    if dry_run:
        _dry_run(spec, cells, out)
        return
    n_episodes = sum(c.n_episodes for c in cells)
    t0 = time.perf_counter()
    with d.guard():
        G.fingerprints(cells)  # a missing cache or pool is an error before any bar is drawn
    options = RunOptions(device=device, max_memory=max_memory, cells_per_call=cells_per_call, cuda_step=cuda_step)
    if not d.main:
        G.run_grid(spec, out, force=force, options=options, on_event=_safe_points(None, out), cells=cells)
        return
    with _GridProgress(len(cells), n_episodes, _varying(cells)) as display:
        on_event = _safe_points(display.on_event, out)
        result = G.run_grid(spec, out, force=force, options=options, on_event=on_event, cells=cells)
    wall = time.perf_counter() - t0
    console.print(
        styled(
            "done",
            "green",
            f": {result.computed} cells computed, {result.skipped} already there; "
            f"{wall:.1f} s (reading caches {result.load_seconds:.1f} s, sampling episodes "
            f"{result.sample_seconds:.1f} s, solving {result.solve_seconds:.1f} s) -> {out}",
        )
    )
    if result.other_records:
        _note(
            f"{out} also holds {result.other_records} record(s) of cells not in this grid (earlier versions of it, "
            f"or other caches); poodle report shows them too: select with --where"
        )
    console.print(f"arithmetic: {formulations(result.records)}", highlight=False, soft_wrap=True)
    console.print(f"next: poodle report {out} --rows ... --cols ...", highlight=False)


def _safe_points(display: Any, out: Path) -> Any:
    """The run's listener: ``display`` (None: nothing shown), the cells kept in ``out``, and after
    each event a safe point to stop at (:mod:`poodle.interrupt`)."""
    from poodle import interrupt
    from poodle.events import CellFinished

    def on_event(event: Any) -> None:
        if display is not None:
            display(event)
        if isinstance(event, CellFinished):
            keep("cells", f"{event.done} of {event.total} cells in {out}")
        interrupt.check()

    return on_event


def _latest_cache(cache_root: str) -> str | None:
    from poodle.project import latest_cache

    found = latest_cache(cache_root)
    return str(found.path.resolve()) if found is not None else None


def _note(message: str) -> None:
    console.print(styled("note", "yellow", f": {message}"))


def _dry_run(spec: Any, cells: list, out: Path) -> None:
    from rich.table import Table

    from poodle import grid as G
    from poodle.cli._common import out as stdout
    from poodle.errors import PoodleError

    done: set[int] = set()
    if out.exists():
        try:
            keys = G.cell_keys(cells, G.fingerprints(cells))
            res = G.read_results(out)
            done = {i for i, (_, k) in keys.items() if k in res}
        except PoodleError as e:  # a dry run only reports
            _note(f"cannot read {out}: {e}")
    vary = _varying(cells)
    t = Table(title=f"{spec.name}: {len(cells)} cells ({len(done)} done), grid hash {G.grid_hash(cells)}")
    for k in ["#", "label"] + vary + ["done"]:
        t.add_column(k)
    for c in cells:
        flat = c.flat()
        values = [G.format_option(flat[k]) if k in flat else "–" for k in vary]
        t.add_row(str(c.index), c.label, *values, "yes" if c.index in done else "")
    stdout.print(t)


def _varying(cells: list) -> list[str]:
    """Keys worth showing for a cell: those that vary, without ``method`` (the label says it) and
    without ``negatives``/``n_neg`` unless they vary among the cells that use negatives."""
    flats = [c.flat() for c in cells]
    users = [f for f in flats if f["negatives"] != "none"]
    keys: list[str] = []
    for f in flats:
        for k in f:
            if k in keys or k in ("label", "method"):
                continue
            # options are compared among the cells whose method has them (proto has no steps)
            pool = users if k in ("negatives", "n_neg") else [x for x in flats if k in x]
            if len({repr(x.get(k)) for x in pool}) > 1:
                keys.append(k)
    return keys


class _GridProgress:
    """Two bars: cells done / total with the current cell's name, and episodes with their rate and
    the time left for the whole grid."""

    def __init__(self, n_cells: int, n_episodes: int, keys: list[str]) -> None:
        self.keys = keys
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.table import Column

        from poodle.cli._progress import new_progress

        self.progress = new_progress(
            TextColumn("{task.description}", style="bold", markup=False, table_column=Column(min_width=8)),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}", markup=False, table_column=Column(no_wrap=True, overflow="ellipsis")),
        )
        self.cells = self.progress.add_task("cells", total=n_cells, info="", unit="cells")
        self.episodes = self.progress.add_task("episodes", total=n_episodes, info="", unit="episodes")
        self._started = 0.0
        self._cell_done = 0
        self._cell_total = 1
        self._solved = 0
        self._t0 = time.perf_counter()

    def __enter__(self) -> _GridProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def on_event(self, event: Any) -> None:
        """The run's events (:mod:`poodle.events`) as the two bars."""
        from poodle.events import CellFinished, CellsStarted, EpisodesSolved, Notice

        if isinstance(event, CellsStarted):
            batch = event.cells
            self._cell_done = 0
            self._cell_total = sum(c.n_episodes for c in batch)
            more = f" (+{len(batch) - 1} more on the same episodes)" if len(batch) > 1 else ""
            self.progress.update(self.cells, completed=event.done, info=f"now: {batch[0].describe(self.keys)}{more}")
        elif isinstance(event, CellFinished) and event.skipped:
            self.progress.update(self.cells, completed=event.done, info="(finished earlier)")
            self.progress.advance(self.episodes, event.cell.n_episodes)
            # skipped work must not count into the rate: restart the episodes task's clock
            self.progress.reset(
                self.episodes,
                completed=int(self.progress.tasks[self.episodes].completed),
                info=self.progress.tasks[self.episodes].fields.get("info", ""),
            )
        elif isinstance(event, CellFinished):
            # cells of one call finish together: settle the count of the call's episodes
            rest = self._cell_total - self._cell_done
            if rest > 0:
                self.advance(rest)
            rec = event.record
            self.progress.update(
                self.cells,
                completed=event.done,
                info=f"last: {event.cell.describe(self.keys)} {100 * rec['mean']:.2f} ± "
                f"{100 * rec['ci95']:.2f} ({rec.get('wall_seconds_share', rec['seconds']):.1f} s wall share)",
            )
        elif isinstance(event, EpisodesSolved):
            self.advance(event.episodes * event.cells)
        elif isinstance(event, Notice):
            note(event)

    def advance(self, n: int) -> None:
        n = min(n, self._cell_total - self._cell_done)
        if n <= 0:
            return
        self._cell_done += n
        self.progress.advance(self.episodes, n)
        t = self.progress.tasks[self.episodes]
        speed = t.speed
        if speed:
            self.progress.update(self.episodes, info=f"{speed:,.0f} episodes/s")
