"""The user errors poodle raises, and whether each carries the parameter and the value it is about.

    python benchmarks/raises.py [--list]

Reads every module of ``poodle/`` with :mod:`ast`, never imports it, and finds each error a caller
can cause: a call of :class:`poodle.errors.PoodleError` or of one of its subclasses (``ConfigError``,
``DataError`` ... and any class of ``poodle/`` derived from them), ``bad_value`` included, wherever it
is built (nearly always in a ``raise``). ``WriteError`` is left out: it carries the file it could not
write as its ``path``. Each is one of

- ``value``: ``bad_value(param, value, reason)``, or ``param=`` and ``value=`` given: a front end says
  the parameter its own way and the value as the caller gave it;
- ``params``: ``params=`` alone: the parameters are known, the value only in the text;
- ``marked``: neither, with a comment ``# not a caller's value: <why>`` on one of its lines or on
  the line above (an error between two files poodle wrote itself, a state the caller does not
  choose);
- ``neither``: neither, unmarked.

It prints the counts; ``--list`` adds every ``params``, ``marked`` and ``neither`` one as ``file:line``.
``tests/test_code_rules.py`` imports this module and fails on any ``neither``.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "# not a caller's value:"
BASE = "PoodleError"
LEFT_OUT = {"WriteError"}  # carries path= (the file it could not write), not a parameter
KINDS = ("value", "params", "marked", "neither")


@dataclass(frozen=True)
class Raise:
    path: str  # relative to the repository root
    line: int
    kind: str  # one of KINDS


def error_classes(trees: dict[str, ast.Module]) -> set[str]:
    """The names of ``PoodleError`` and of every class of ``trees`` derived from it (by name)."""
    bases: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
    found = {BASE}
    grew = True
    while grew:
        new = {c for c, bs in bases.items() if c not in found and bs & found}
        found |= new
        grew = bool(new)
    return found - LEFT_OUT


def _callee(call: ast.Call) -> tuple[str, bool]:
    """The error class a call builds and whether it is ``bad_value`` (``ConfigError.bad_value``)."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "bad_value":
        inner = f.value
        return (inner.id if isinstance(inner, ast.Name) else getattr(inner, "attr", "")), True
    return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "") if isinstance(f, ast.Attribute) else ""), False


def classify(source: str, path: str, classes: set[str]) -> list[Raise]:
    """Every error of ``classes`` built in ``source`` (the text of the module at ``path``)."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if not isinstance(node, ast.Call):
            continue
        name, bad_value = _callee(node)
        if name not in classes and not bad_value:  # err.bad_value(...): only a PoodleError has one
            continue
        keys = {k.arg for k in node.keywords}
        if bad_value or {"param", "value"} <= keys:
            kind = "value"
        else:
            end = node.end_lineno or node.lineno
            marked = any(MARKER in line for line in lines[max(node.lineno - 2, 0) : end])
            kind = "marked" if marked else "params" if "params" in keys else "neither"
        out.append(Raise(path, node.lineno, kind))
    return out


def scan(root: Path = ROOT) -> list[Raise]:
    """The user errors of every module of ``root/poodle``, in file and line order."""
    files = sorted((root / "poodle").rglob("*.py"))
    sources = {str(p.relative_to(root)): p.read_text() for p in files}
    trees = {p: ast.parse(s, p) for p, s in sources.items()}
    classes = error_classes(trees)
    found = [r for p, s in sources.items() for r in classify(s, p, classes)]
    return sorted(found, key=lambda r: (r.path, r.line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list every params, marked and neither error as file:line")
    args = parser.parse_args()
    found = scan()
    counts = {k: sum(r.kind == k for r in found) for k in KINDS}
    print(f"user errors in poodle/: {len(found)}")
    for k in KINDS:
        print(f"  {k:8s} {counts[k]}")
    if args.list:
        for k in ("params", "marked", "neither"):
            for r in found:
                if r.kind == k:
                    print(f"{k} {r.path}:{r.line}")


if __name__ == "__main__":
    main()
