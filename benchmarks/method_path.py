"""The way a method's name, or a cell, takes through poodle's functions: stops, climbs, returns.

    python benchmarks/method_path.py [--method tim-gd] [--show]

Runs two small solves on a synthetic cache (CPU, one worker, one chunk) under a profiler and lists,
in call order, every call of one of poodle's functions whose arguments hold the followed value:

- ``methods``: from :func:`poodle.solve.solve`, the method's name: the name itself, a list or tuple
  holding it (``(label, name, config)``), a dict or dataclass holding it (a record, a
  ``SolverInfo``), or a cell of that method, up to three levels deep;
- ``cells``: from :func:`poodle.pipeline.run_cells`, the cells made by :func:`poodle.solve.make_cells`
  (a cell, or a list, tuple, dict or dataclass holding one).

The object a method is called on (``self``) is not counted: a cell's own properties are the cell
read, not the value passed on; what they call with the value is counted. Nor are the caller's event
sink (``on_event``, here :func:`poodle.events.ignore`) and calls of code outside poodle.

The path is then the sequence of *stops*: a stop is a maximal run of such calls in one module (the
functions are listed with it). Counted: the modules passed, the stops, the *climbs* (a stop in a
higher layer than the stop before it; layers: ``benchmarks/imports.py``'s ``LAYERS``, described in
docs/architecture.md) and the *returns* (a stop in a module the path had already left), as issue 32
counts them; and the calls made from a lower layer to a higher one (a callback). A function that
calls two lower modules in turn makes a climb and a return of this count without any call going up:
the stops say where the value is, in order, not who calls whom.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from imports import LAYERS, layer_of  # noqa: E402

from poodle import events, solvers  # noqa: E402
from poodle.cache import write_arrays  # noqa: E402
from poodle.cells import Cell  # noqa: E402
from poodle.pipeline import RunOptions, run_cells  # noqa: E402
from poodle.solve import make_cells, solve  # noqa: E402

_CO_VARARGS, _CO_VARKEYWORDS = 0x04, 0x08
_ROOTS = {ROOT / "poodle": "poodle", ROOT / "cli": "poodle.cli"}


def module_of(filename: str) -> str | None:
    """``poodle.x.y`` of a file of poodle's, else None."""
    path = Path(filename)
    for root, top in _ROOTS.items():
        if path.is_relative_to(root):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([top, *parts])
    return None


def holder(match: Callable[[Any], bool]) -> Callable[[Any, int], bool]:
    """``holds(value, depth)``: whether ``value`` is matched or holds a matched value."""

    def holds(v: Any, depth: int = 3) -> bool:
        if match(v):
            return True
        if depth == 0 or isinstance(v, (str, bytes, int, float, bool)) or v is None:
            return False
        if isinstance(v, (list, tuple, set, frozenset)):
            return any(holds(x, depth - 1) for x in list(v)[:64])
        if isinstance(v, dict):
            return any(holds(x, depth - 1) for x in list(v.values())[:64])
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return any(holds(getattr(v, f.name, None), depth - 1) for f in dataclasses.fields(v))
        return False

    return holds


@dataclasses.dataclass(frozen=True)
class Call:
    module: str
    function: str
    caller: str | None  # the module of the nearest poodle function up the stack


def trace(fn: Callable[[], Any], match: Callable[[Any], bool]) -> list[Call]:
    """Every call of poodle's, in order, whose arguments hold a match."""
    holds = holder(match)
    calls: list[Call] = []
    modules: dict[str, str | None] = {}

    def module(frame: Any) -> str | None:
        name = frame.f_code.co_filename
        if name not in modules:
            modules[name] = module_of(name)
        return modules[name]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        here = module(frame)
        if here is None or code.co_name.startswith("<") or code is events.ignore.__code__:
            return
        n = code.co_argcount + code.co_kwonlyargcount
        n += bool(code.co_flags & _CO_VARARGS) + bool(code.co_flags & _CO_VARKEYWORDS)
        names = [a for a in code.co_varnames[:n] if a not in ("self", "cls")]
        local = frame.f_locals
        if any(holds(local.get(a)) for a in names):
            up = frame.f_back
            while up is not None and module(up) is None:
                up = up.f_back
            caller = None if up is None else module(up)
            calls.append(Call(here, getattr(code, "co_qualname", code.co_name), caller))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@dataclasses.dataclass
class Path_:
    stops: list[tuple[str, list[str]]]  # (module, functions called there in a row)
    upward: list[Call]  # calls whose caller is of a lower layer than the function called

    @property
    def modules(self) -> int:
        return len({m for m, _ in self.stops})

    @property
    def climbs(self) -> list[int]:
        """Indices of the stops in a higher layer than the stop before."""
        return [i for i in range(1, len(self.stops)) if layer_of(self.stops[i][0]) > layer_of(self.stops[i - 1][0])]

    @property
    def returns(self) -> list[int]:
        """Indices of the stops in a module already left."""
        seen: set[str] = set()
        out = []
        for i, (m, _) in enumerate(self.stops):
            if m in seen:
                out.append(i)
            seen.add(m)
        return out


def as_path(calls: list[Call]) -> Path_:
    stops: list[tuple[str, list[str]]] = []
    for c in calls:
        if stops and stops[-1][0] == c.module:
            if stops[-1][1][-1] != c.function:
                stops[-1][1].append(c.function)
        else:
            stops.append((c.module, [c.function]))
    upward = [c for c in calls if c.caller is not None and layer_of(c.caller) < layer_of(c.module)]
    return Path_(stops, list(dict.fromkeys(upward)))


def show(title: str, path: Path_, verbose: bool) -> None:
    climbs, returns = set(path.climbs), set(path.returns)
    print(
        f"{title}: {path.modules} modules, {len(path.stops)} stops, "
        f"{len(climbs)} climbs back to a higher layer, {len(returns)} returns to a module already left"
    )
    ups = ", ".join(f"{c.caller} -> {c.module}.{c.function}" for c in path.upward) or "none"
    print(f"  calls from a lower layer to a higher one: {len(path.upward)} ({ups})")
    if not verbose:
        return
    for i, (module, fns) in enumerate(path.stops):
        marks = ("  climb" if i in climbs else "") + ("  return" if i in returns else "")
        layer = LAYERS[layer_of(module)][0]
        print(f"  {i + 1:2d}. {module} [{layer}]: {', '.join(fns)}{marks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="tim-gd", help="the method followed")
    parser.add_argument("--show", action="store_true", help="list the stops")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    solvers.available()  # every method registered before the trace (registering is no passage)
    with tempfile.TemporaryDirectory() as tmp:

        def split(n_classes: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
            x = rng.standard_normal((n_classes * 20, 16)).astype(np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            return x, np.arange(n_classes).repeat(20), [f"c{i}" for i in range(n_classes)]

        cache = write_arrays(Path(tmp) / "c.h5", {"train": split(10), "test": split(8)})
        run = RunOptions(device="cpu", workers=1)
        settings: dict[str, Any] = {"episodes": 4, "query": 3}
        out = os.path.join(tmp, "r.jsonl")
        name = args.method
        calls = trace(
            lambda: solve(cache, [name], run=run, out=out, **settings),
            lambda v: (isinstance(v, str) and v == name) or (isinstance(v, Cell) and v.method == name),
        )
        show(f"the method's name from poodle.solve.solve ({name})", as_path(calls), args.show)
        cells = make_cells(cache, [name], {}, settings)
        out2 = os.path.join(tmp, "r2.jsonl")
        calls = trace(lambda: run_cells(cells, out=out2, options=run), lambda v: isinstance(v, Cell))
        show("the cells from poodle.pipeline.run_cells", as_path(calls), args.show)


if __name__ == "__main__":
    main()
