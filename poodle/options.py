"""Options with their bounds, declared next to the field: the one home of every option's interval.

A config dataclass (a method's, the training recipe's) declares a bounded field as

    lr: float = option(1e-3, min=0, min_open=True)     # (0, inf)
    alpha: float = option(2.0, min=0, exclude={1.0: "the Shannon limit: use tim-gd"})

and whoever checks a config asks :func:`violation` for each field: a number must be finite and
inside its interval, and never one of the excluded values. Nothing else declares a bound.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Bounds:
    """``lo <= value <= hi`` (strict where open), and ``value`` not a key of ``exclude``."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    exclude: Mapping[float, str] = field(default_factory=dict)

    def __str__(self) -> str:
        def num(x: float) -> str:
            return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"

        left = "(" if self.lo_open or self.lo == -math.inf else "["
        right = ")" if self.hi_open or self.hi == math.inf else "]"
        return f"{left}{num(self.lo)}, {num(self.hi)}{right}"

    def violation(self, value: float) -> str | None:
        """Why ``value`` is refused (``"must lie in [0, inf)"``), or None."""
        lo_bad = value < self.lo or (self.lo_open and value == self.lo)
        hi_bad = value > self.hi or (self.hi_open and value == self.hi)
        if lo_bad or hi_bad:
            return f"must lie in {self}"
        if value in self.exclude:
            return f"cannot be {value:g} ({self.exclude[value]})"
        return None


def option(
    default: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    max_open: bool = False,
    exclude: Mapping[float, str] | None = None,
    help: str = "",
) -> Any:
    """A dataclass field whose value must lie between ``min`` and ``max`` (excluded where open) and
    differ from the keys of ``exclude`` (each mapped to the reason); ``help`` is for listings."""
    bounds = Bounds(
        -math.inf if min is None else float(min),
        math.inf if max is None else float(max),
        min_open,
        max_open,
        dict(exclude or {}),
    )
    return field(default=default, metadata={"bounds": bounds, "help": help})


def bounds(f: dataclasses.Field) -> Bounds | None:
    """The bounds declared for field ``f`` (None: any finite number)."""
    return f.metadata.get("bounds")


def violation(f: dataclasses.Field, value: Any) -> str | None:
    """Why ``value`` cannot be field ``f``'s (not finite, outside its bounds, excluded), or None.
    Values that are not numbers (strings, flags, None) are left to the field's type."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return "must be a finite number"
    b = bounds(f)
    return None if b is None else b.violation(value)


__all__ = ["Bounds", "bounds", "option", "violation"]
