"""Rules of the code base, checked on its source: the library speaks in parameters (never in the
command line's flags), imports neither click nor rich, and keeps its functions short."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = sorted((ROOT / "poodle").rglob("*.py"))
COMMANDS = sorted((ROOT / "cli").glob("*.py"))
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


def _strings(node: ast.AST) -> list[str]:
    """The literal text of every string (f-string parts included) under ``node``."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _said(tree: ast.AST) -> list[ast.AST]:
    """What a module raises, and the events and notices it builds: the text its callers see."""
    out: list[ast.AST] = [n for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None]
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            if name.endswith(("Error", "Notice", "bad_value")) or name in ("warn", "say", "tell"):
                out.append(n)
    return out


def test_library_messages_name_parameters_never_command_line_flags():
    found = []
    for path in LIBRARY:
        tree = ast.parse(path.read_text(), str(path))
        for node in _said(tree):
            for text in _strings(node):
                if FLAG.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text.strip()[:70]}")
    assert not found, "\n".join(found)


def test_the_flag_check_finds_flag_text():
    # the check above must be able to fail
    tree = ast.parse('raise ConfigError(f"use --force to {x}")\nNotice("c", "pass --tag NAME")\n')
    assert {t for n in _said(tree) for t in _strings(n) if FLAG.search(t)} == {"use --force to ", "pass --tag NAME"}


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_imports_neither_click_nor_rich(path):
    tree = ast.parse(path.read_text(), str(path))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("click", "rich")]


def test_no_function_is_over_120_lines():
    long = []
    for path in LIBRARY + COMMANDS:
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 120:
                long.append(f"{path.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert not long, "\n".join(long)


def test_an_extract_error_reaches_the_command_line_as_its_flags(tmp_path):
    """The library says ``force`` and ``tag``; ``poodle extract`` says ``--force`` and ``--tag``."""
    import _images

    from poodle.cli.extract import extract as extract_cmd
    from poodle.errors import CacheError
    from poodle.extract import extract

    data = _images.write_folder(tmp_path / "data", {"test": 2}, 2, size=16)
    (tmp_path / "c" / "folder").mkdir(parents=True)
    (tmp_path / "c" / "folder" / "conv4_64.h5").write_text("not a cache")
    kw = dict(data_root=data, splits="test", image_size=16, cache_root=tmp_path / "c", workers=0)
    with pytest.raises(CacheError) as e:
        extract("folder", "conv4_64", **kw)
    assert "--" not in str(e.value) and e.value.params == ("force", "tag")
    assert str(e.value).endswith("(force replaces it; a tag writes another file)")
    args = ["--dataset", "folder", "--data-root", str(data), "--backbone", "conv4_64", "--splits", "test"]
    r = CliRunner().invoke(extract_cmd, [*args, "--image-size", "16", "--cache-root", str(tmp_path / "c")])
    assert r.exit_code == 1 and "(--force replaces it; a --tag writes another file)" in r.output, r.output


def test_bounds_live_next_to_their_fields_only():
    import dataclasses

    from poodle import solvers
    from poodle.errors import ConfigError
    from poodle.options import bounds
    from poodle.train.config import TrainConfig

    configs = [solvers.get(m).config for m in solvers.available()] + [TrainConfig]
    assert not [c.__name__ for c in configs if hasattr(c, "BOUNDS")]
    assert not hasattr(solvers.base, "COMMON_BOUNDS")
    declared = {f.name: str(bounds(f)) for f in dataclasses.fields(solvers.get("ce").config) if bounds(f)}
    assert declared == {"steps": "[0, inf)", "lr": "(0, inf)", "scale": "(0, inf)", "label_smoothing": "[0, 1)"}
    with pytest.raises(ConfigError, match=r"option 'alpha' cannot be 1 \(the Shannon limit: use tim-gd\)") as e:
        solvers.make_config("alpha-tim", {"alpha": 1})
    assert e.value.params == ("alpha",)
    assert solvers.make_config("alpha-tim", {"alpha": 0.5}).alpha == 0.5
