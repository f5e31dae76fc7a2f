"""The command line's two consoles: ``console`` (stderr: progress, notes, errors) and ``out`` (stdout:
tables and results). Their own module, below :mod:`poodle.cli._common`, so that the progress displays
(:mod:`poodle.cli._progress`) print on them without importing the module that imports them.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

# the width of a console that is not a terminal, COLUMNS unset: wide enough for any table
NATURAL_WIDTH = 100_000


class _Console(Console):
    """A rich console that is as wide as its text when it writes to a file or a pipe: rich would lay
    everything out for 80 columns there (or for the terminal its stdin happens to be)."""

    @property
    def size(self) -> Any:
        from rich.console import ConsoleDimensions

        if self._width is None and not self.is_terminal and not self.is_jupyter:
            columns = self._environ.get("COLUMNS", "")
            return ConsoleDimensions(int(columns) if columns.isdigit() else NATURAL_WIDTH, 25)
        return Console.size.fget(self)  # type: ignore[attr-defined]

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


console = _Console(stderr=True, markup=False, highlight=False)
out = _Console(markup=False, highlight=False)


__all__ = ["NATURAL_WIDTH", "console", "out"]
