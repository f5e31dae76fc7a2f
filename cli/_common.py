"""What every command shares: the console, one-line errors, progress bars, option types.

Both consoles print text literally (``markup=False``): messages carry paths, class names and option
values that the user wrote, and rich markup would rewrite ``run[bold]1.h5`` or fail on ``[/]``.
Styling is applied with :func:`styled` (a ``rich.text.Text``), never by markup in a string.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from typing import Any, Callable, Iterator

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from poodle.errors import PoodleError

console = Console(stderr=True, markup=False, highlight=False)
out = Console(markup=False, highlight=False)


def styled(label: str, style: str, rest: str = "") -> Text:
    """``label`` in ``style`` followed by ``rest``, both printed literally."""
    return Text.assemble((label, style), rest)


def as_flags(message: str, params: tuple[str, ...], flags: dict[str, str] | None = None) -> str:
    """``message`` with each library parameter name in ``params`` written as its command-line flag
    (``n_neg`` -> ``--n-neg``, or as ``flags`` maps it)."""
    for p in params:
        flag = (flags or {}).get(p, "--" + p.replace("_", "-"))
        message = re.sub(rf"(?<![\w-]){re.escape(p)}(?![\w-])", flag, message, count=1)
    return message


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`PoodleError` into ``error: <message>`` on stderr (library parameter names
    written as flags) and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PoodleError as e:
            if getattr(e, "quiet", False):  # another rank of a torchrun run failed and printed its error
                sys.exit(1)
            text = as_flags(str(e), getattr(e, "params", ()))
            console.print(styled("error:", "bold red", " " + text), soft_wrap=True)
            sys.exit(1)
        except OSError as e:
            # what the checks up front could not foresee (disk full, permissions changed mid-run): one
            # line naming the file, not a traceback from deep inside h5py or PIL
            where = (
                f" {e.filename}" + (f" -> {e.filename2}" if getattr(e, "filename2", None) else "")
                if getattr(e, "filename", None)
                else ""
            )
            console.print(styled("error:", "bold red", f"{where} {e.strerror or e}".rstrip()), soft_wrap=True)
            sys.exit(1)
        except KeyboardInterrupt:
            console.print(
                styled("interrupted", "yellow", ": completed work is kept; re-run the same command to resume"),
                soft_wrap=True,
            )
            sys.exit(130)

    return wrapper


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, unit: str = "items") -> Iterator[Callable[[int], None]]:
    """A rich progress bar; yields ``advance(n)``, the callback the library functions accept."""
    columns = [
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total, rate="")

        def advance(n: int) -> None:
            progress.advance(task, n)
            t = progress.tasks[task]
            speed = t.finished_speed or t.speed
            if speed:
                progress.update(task, rate=f"{speed:,.1f} {unit}/s")

        yield advance


class SizeType(click.ParamType):
    """A memory size like 4GiB or 512MiB, converted to bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from poodle.utils import parse_size

        try:
            return parse_size(value)
        except PoodleError as e:
            self.fail(str(e), param, ctx)


def render_table(table: Any, title: str | None = None) -> Any:
    """A :class:`poodle.report.Table` as a rich table: the one renderer of result tables (``report``,
    ``demo``, ``grid``); bold entries in bold green."""
    from rich.table import Table
    from rich.text import Text

    from poodle.report import key_name

    t = Table(show_lines=False, title=title)
    for k in table.row_keys:
        t.add_column(key_name(k))
    for j in range(len(table.cols)):
        t.add_column(table.col_label(j, sep="\n"), justify="right")
    for title, _ in table.extra:
        t.add_column(title, justify="right")
    for i in range(len(table.rows)):
        cells = [Text(v) for v in table.row_labels(i)]
        for j in range(len(table.cols)):
            e = table.entries.get((i, j))
            cells.append(Text(table.cell_text(i, j), style="bold green" if e is not None and e.bold else ""))
        cells += [Text(texts[i]) for _, texts in table.extra]
        t.add_row(*cells)
    return t
