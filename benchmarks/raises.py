"""The user errors poodle raises, and whether each carries the parameter and the value it is about.

    python benchmarks/raises.py [--list]

Reads every module of ``poodle/`` with :mod:`ast`, never imports it, and finds each error a caller
can cause: a call of :class:`poodle.errors.PoodleError` or of one of its subclasses (``ConfigError``,
``DataError`` ... and any class of ``poodle/`` derived from them), ``bad_value`` included, wherever it
is built (nearly always in a ``raise``). ``WriteError`` is left out: it carries the file it could not
write as its ``path``. Each is one of

- ``value``: ``bad_value(param, value, reason)``, or ``param=`` and ``value=`` given: a front end says
  the parameter its own way and the value as the caller gave it;
- ``params``: ``params=`` alone, or parameter names marked in its text (``poodle.errors.mark``,
  which puts them in ``params``): the parameters are known, the value only in the text;
- ``marked``: neither, with a comment ``# not a caller's value: <why>`` on one of its lines or on
  the line above (an error between two files poodle wrote itself, a state the caller does not
  choose);
- ``neither``: neither, unmarked.

It prints the counts; ``--list`` adds every ``params``, ``marked`` and ``neither`` one as ``file:line``.

A message names a parameter through ``poodle.errors.mark`` (the command line writes it as the flag;
the text a person reads shows the name). An error or a ``Notice`` that gives its parameters as a
literal ``params=`` (or ``bad_value``'s ``others=``) and writes one of them bare in the literal text
of its message, hint or reason is listed as ``unmarked`` (``--list``: ``file:line: name``): the
command line would print the name where the flag belongs.
``tests/test_code_rules.py`` imports this module and fails on any ``neither`` and any ``unmarked``.
"""

from __future__ import annotations

import argparse
import ast
import re
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
            named = "params" in keys or any(_marks(a) for a in (*node.args, *node.keywords))
            kind = "marked" if marked else "params" if named else "neither"
        out.append(Raise(path, node.lineno, kind))
    return out


def _literal_text(node: ast.AST | None) -> list[str]:
    """The literal pieces of a message expression: a string, an f-string's text (not what its
    fields compute), both sides of ``+``, both branches of ``a if c else b``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_text(node.left) + _literal_text(node.right)
    if isinstance(node, ast.IfExp):
        return _literal_text(node.body) + _literal_text(node.orelse)
    return []


def _literal_names(node: ast.AST | None) -> tuple[str, ...]:
    """The names of a literal tuple or list of strings (``params=("force", "tag")``); () otherwise."""
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return ()


def _marks(node: ast.AST) -> set[str]:
    """The names ``node`` marks: each ``mark("name")`` call in it."""
    return {
        c.args[0].value
        for c in ast.walk(node)
        if isinstance(c, ast.Call)
        and (getattr(c.func, "id", None) == "mark" or getattr(c.func, "attr", None) == "mark")
        and c.args
        and isinstance(c.args[0], ast.Constant)
    }


def unmarked(source: str, path: str, classes: set[str]) -> list[tuple[str, int, str]]:
    """``(path, line, name)`` for each parameter an error or a notice of ``source`` lists literally
    (``params=``, a ``Notice``'s third argument, ``bad_value``'s ``others=``) and writes bare, as a
    whole word, in the literal text of its message, ``hint=`` or reason, marking it nowhere there."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if not isinstance(node, ast.Call):
            continue
        name, bad_value = _callee(node)
        kw = {k.arg: k.value for k in node.keywords}
        if name == "Notice":
            names = _literal_names(node.args[2] if len(node.args) > 2 else kw.get("params"))
            said = [node.args[1] if len(node.args) > 1 else kw.get("message")]
        elif bad_value:
            names = _literal_names(kw.get("others"))
            said = [node.args[2] if len(node.args) > 2 else kw.get("reason")]
        elif name in classes:
            names = _literal_names(kw.get("params"))
            said = [node.args[0] if node.args else None, kw.get("hint")]
        else:
            continue
        texts = [t for s in said for t in _literal_text(s)]
        marks = {n for s in said if s is not None for n in _marks(s)}
        for p in names:
            if p in marks:  # marked where it means the parameter; a later bare word is the word
                continue
            if any(re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", t) for t in texts):
                out.append((path, node.lineno, p))
    return out


def _sources(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted((root / "poodle").rglob("*.py"))}


def scan_unmarked(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """:func:`unmarked` over every module of ``root/poodle``."""
    sources = _sources(root)
    classes = error_classes({p: ast.parse(s, p) for p, s in sources.items()})
    return sorted(u for p, s in sources.items() for u in unmarked(s, p, classes))


def scan(root: Path = ROOT) -> list[Raise]:
    """The user errors of every module of ``root/poodle``, in file and line order."""
    sources = _sources(root)
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
    bare = scan_unmarked()
    print(f"parameters named unmarked: {len(bare)}")
    if args.list:
        for k in ("params", "marked", "neither"):
            for r in found:
                if r.kind == k:
                    print(f"{k} {r.path}:{r.line}")
        for path, line, name in bare:
            print(f"unmarked {path}:{line}: {name}")


if __name__ == "__main__":
    main()
