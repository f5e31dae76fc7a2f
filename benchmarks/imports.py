"""poodle's import graph: its circles and the imports that climb to a higher layer.

    python benchmarks/imports.py [--max-length N] [--max-cycles N]

Reads every module of ``poodle/`` and ``cli/`` (installed as ``poodle.cli``) with :mod:`ast`, never
imports them, and prints

- the strongly connected components of the graph of module-level imports (an import at the top of a
  module, in a class body, or under a module-level ``try``/``if``; ``if TYPE_CHECKING:`` blocks are
  left out: they never run);
- the deferred imports that close a circle: an import written inside a function whose target
  imports the importer back at module level (directly or through other modules). Such an import is
  a circle put off until the call, so it counts as one; a deferred import of a module that does not
  lead back (an optional dependency, a heavy module only one function needs) is not a circle;
- each elementary circle of the graph of both kinds of import, up to ``--max-length`` modules;
- every import from a module of a lower layer to one of a higher layer (``LAYERS`` below; the layers
  are described in docs/architecture.md, "Layers").

An import names the module it loads: ``from poodle import settings`` is an import of
``poodle.settings``, ``from poodle.solvers import run`` one of ``poodle.solvers`` (its
``__init__``). The packages a submodule's import loads first (``poodle``, ``poodle.solvers`` for
``poodle.solvers.base``) are not counted: every module would otherwise be in a circle with its
package. ``tests/test_code_rules.py`` imports this module and fails on any circle or climb.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where each top-level name's modules are on disk.
PACKAGES = {"poodle": ROOT / "poodle", "poodle.cli": ROOT / "cli"}

# The layers, lowest first: a module may import modules of its own layer and of lower ones. The
# first prefix that matches a module's name gives its layer (so "poodle.solvers" before "poodle").
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundations",  # constants, errors, the schema's machinery, file helpers, events
        (
            "poodle",  # the package's __init__ only (it imports poodle.errors)
            "poodle.defaults",
            "poodle.errors",
            "poodle.options",
            "poodle.utils",
            "poodle.events",
            "poodle.interrupt",
            "poodle._mt19937",
            "poodle.stats",
        ),
    ),
    (
        "data",  # images, backbones, caches, episodes, negatives, preprocessing, the run's options
        (
            "poodle.data",
            "poodle.backbones",
            "poodle.prefetch",
            "poodle.project",
            "poodle.cache",
            "poodle.cache_shares",
            "poodle.distributed",
            "poodle.sampler",
            "poodle.episodes",
            "poodle.negatives",
            "poodle.preprocess",
            "poodle.run",
            "poodle.split",
        ),
    ),
    ("solvers", ("poodle.solvers",)),
    (
        "stages",  # what reads the groups and the registry: settings, results, cost model, extract, train
        (
            "poodle.settings",
            "poodle.results",
            "poodle.costmodel",
            "poodle.system",
            "poodle.extract",
            "poodle.train",
            "poodle.demo_settings",
        ),
    ),
    ("evaluation", ("poodle.evaluate", "poodle.cells", "poodle.predict")),
    ("pipeline", ("poodle.pipeline",)),
    (
        "jobs",
        ("poodle.solve", "poodle.grid", "poodle.report", "poodle.report_figures", "poodle.demo", "poodle.demo_domains"),
    ),
    ("command line", ("poodle.cli",)),
)


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    deferred: bool  # written inside a function: runs when the function is called


def modules() -> dict[str, Path]:
    """Every module's dotted name and file (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([top, *parts])
            if name.startswith("poodle.cli") and top == "poodle":
                continue  # never under poodle/, but keep the two roots apart
            found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """The import statements that run, each with whether it is inside a function."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit_one(other, deferred)
                continue
            visit_one(child, deferred)

    def visit_one(node: ast.AST, deferred: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, deferred))
            return
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        visit(node, inner)

    visit(tree, False)
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def edges(known: dict[str, Path] | None = None) -> list[Import]:
    """Every import of one of poodle's modules by one of poodle's modules."""
    known = modules() if known is None else known
    found: list[Import] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, deferred in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = _package_of(name, path).split(".")
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, base]) if base else ".".join(package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in known else base)
            for target in targets:
                while target and target not in known:  # `import poodle.x.y` of a non-module y
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.append(Import(name, target, node.lineno, deferred))
    return found


def _graph(imports: list[Import], names: list[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {n: set() for n in names}
    for imp in imports:
        graph[imp.source].add(imp.target)
    return graph


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:  # recursion depth is bounded by the module count (~200)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen = {start}
    todo = [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in graph[v] - seen:
            seen.add(w)
            todo.append(w)
    return False


def closing_deferred(imports: list[Import], graph: dict[str, set[str]]) -> list[Import]:
    """The deferred imports whose target imports their module back at module level."""
    return [i for i in imports if i.deferred and _reaches(graph, i.target, i.source)]


def cycles(graph: dict[str, set[str]], max_length: int, max_count: int) -> list[list[str]]:
    """The elementary circles of at most ``max_length`` modules, each starting at its least module."""
    found: list[list[str]] = []

    def walk(start: str, path: list[str]) -> None:
        for w in sorted(graph[path[-1]]):
            if len(found) >= max_count:
                return
            if w == start:
                found.append(list(path))
            elif w > start and w not in path and len(path) < max_length:
                walk(start, [*path, w])

    for start in sorted(graph):
        walk(start, [start])
    return found


def layer_of(name: str) -> int:
    """The index of the layer of module ``name`` in :data:`LAYERS`."""
    best = (-1, -1)  # (prefix length, layer): the longest prefix wins
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            below = "." in prefix and name.startswith(prefix + ".")  # "poodle" is its __init__ alone
            if (name == prefix or below) and len(prefix) > best[0]:
                best = (len(prefix), i)
    if best[1] < 0:
        raise KeyError(f"module {name} has no layer: add it to LAYERS in benchmarks/imports.py")
    return best[1]


def climbs(imports: list[Import]) -> list[Import]:
    """The imports from a module of a lower layer to one of a higher layer."""
    return [i for i in imports if layer_of(i.target) > layer_of(i.source)]


@dataclass
class Report:
    modules: list[str]
    imports: list[Import]  # every import of one of poodle's modules by another
    module_components: list[list[str]]  # circles of module-level imports
    deferred_circles: list[Import]  # deferred imports that close a circle
    all_components: list[list[str]]  # circles of both kinds
    climbs: list[Import]


def analyse() -> Report:
    """The graph's circles and climbs (what the test asserts is empty)."""
    known = modules()
    imports = edges(known)
    top = _graph([i for i in imports if not i.deferred], list(known))
    both = _graph(imports, list(known))
    return Report(
        list(known), imports, components(top), closing_deferred(imports, top), components(both), climbs(imports)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-length", type=int, default=8, help="longest circle listed (modules)")
    parser.add_argument("--max-cycles", type=int, default=200, help="circles listed at most")
    args = parser.parse_args()
    report = analyse()
    known, imports = report.modules, report.imports
    deferred = sum(i.deferred for i in imports)
    print(f"{len(known)} modules; imports of poodle's own: {len(imports) - deferred} module-level, {deferred} deferred")
    print(f"\ncircles of module-level imports (strongly connected components): {len(report.module_components)}")
    for part in report.module_components:
        print("  " + " <-> ".join(part))
    print(f"\ndeferred imports that close a circle: {len(report.deferred_circles)}")
    for i in report.deferred_circles:
        print(f"  {i.source}:{i.line} -> {i.target}")
    both = _graph(imports, known)
    listed = cycles(both, args.max_length, args.max_cycles)
    more = " (the first listed)" if len(listed) >= args.max_cycles else ""
    print(f"\nelementary circles of both kinds, at most {args.max_length} modules: {len(listed)}{more}")
    for circle in listed:
        print("  " + " -> ".join([*circle, circle[0]]))
    print(f"\nimports from a lower layer to a higher one: {len(report.climbs)}")
    for i in report.climbs:
        kind = "deferred" if i.deferred else "module-level"
        src, dst = LAYERS[layer_of(i.source)][0], LAYERS[layer_of(i.target)][0]
        print(f"  {i.source}:{i.line} ({src}) -> {i.target} ({dst}), {kind}")


if __name__ == "__main__":
    main()
