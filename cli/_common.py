"""What every command shares: the console, one-line errors, progress bars, option types."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

import click
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from poodle.errors import PoodleError

console = Console(stderr=True)
out = Console()


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`PoodleError` into ``error: <message>`` on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PoodleError as e:
            if getattr(e, "quiet", False):  # another rank of a torchrun run failed and printed its error
                sys.exit(1)
            console.print(f"[bold red]error:[/] {e}", highlight=False, markup=True, soft_wrap=True)
            sys.exit(1)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]: completed work is kept; re-run the same command to resume")
            sys.exit(130)

    return wrapper


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, unit: str = "items") -> Iterator[Callable[[int], None]]:
    """A rich progress bar; yields ``advance(n)``, the callback the library functions accept."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TaskProgressColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
               TimeRemainingColumn()]
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
