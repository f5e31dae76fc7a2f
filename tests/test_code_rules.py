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


def _old_forms(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a module uses an API deprecated in 0.2.0 outside a ``pytest.warns`` / ``deprecated_call``
    block: evaluate's 0.1 keywords, ``check_general``, the key tables moved out of ``defaults``.
    (Keywords passed through a ``**`` dict are not seen here; the suite's warning filter sees them.)"""
    from poodle import defaults
    from poodle import evaluate as ev

    old_keywords = set(ev._RUN_KEYWORDS + ev._HOOK_KEYWORDS)
    warns = ("pytest.warns", "pytest.deprecated_call")
    caught = {
        id(inner)
        for n in ast.walk(tree)
        if isinstance(n, ast.With)
        and any(isinstance(i.context_expr, ast.Call) and ast.unparse(i.context_expr.func) in warns for i in n.items)
        for inner in ast.walk(n)
    }
    found = []
    for n in ast.walk(tree):
        if id(n) in caught:
            continue
        if isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            if name == "evaluate" and (old := [k.arg for k in n.keywords if k.arg in old_keywords]):
                found.append((n.lineno, f"evaluate({', '.join(f'{k}=' for k in old)})"))
            elif name == "check_general":
                found.append((n.lineno, "check_general"))
        elif isinstance(n, ast.Attribute) and n.attr in defaults._MOVED and ast.unparse(n.value).endswith("defaults"):
            found.append((n.lineno, f"defaults.{n.attr}"))
        elif isinstance(n, ast.ImportFrom) and n.module == "poodle.defaults":
            found += [(n.lineno, f"defaults.{a.name}") for a in n.names if a.name in defaults._MOVED]
    return sorted(found)


def test_nothing_uses_the_api_deprecated_in_0_2_but_the_tests_of_its_shims():
    """Also the code paths the suite does not run (a benchmark's CUDA sections); what runs, the
    warning filter of pyproject.toml catches too."""
    paths = LIBRARY + COMMANDS + sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in paths
        for line, what in _old_forms(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, "\n".join(found)


def test_the_deprecation_check_finds_the_old_forms():
    # the check above must be able to fail
    code = (
        "evaluate(f, e, m, device='cpu', stats=s)\nevaluate(f, e, m, run=r)\nx = defaults.GENERAL_KEYS\n"
        "from poodle.defaults import EPISODE_KEYS, METHOD\ncheck_general('way', 3)\n"
        "with pytest.warns(DeprecationWarning):\n    evaluate(f, e, m, workers=2)\n"
    )
    assert _old_forms(ast.parse(code)) == [
        (1, "evaluate(device=, stats=)"),
        (3, "defaults.GENERAL_KEYS"),
        (4, "defaults.EPISODE_KEYS"),
        (5, "check_general"),
    ]


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
    args = [
        "--dataset",
        "folder",
        "--data-root",
        str(data),
        "--backbone",
        "conv4_64",
        "--splits",
        "test",
        "--random-weights",
    ]
    r = CliRunner().invoke(extract_cmd, [*args, "--image-size", "16", "--cache-root", str(tmp_path / "c")])
    assert r.exit_code == 1 and "(--force replaces it; a --tag writes another file)" in r.output, r.output


def test_the_command_line_says_an_error_from_its_fields_never_from_its_text():
    """A flag comes from the error's parameter fields through one mapping (``flags_of``): an error
    about one value with a reason is said from its fields whatever its text; one that carries a
    parameter and a value but no reason keeps its text (the file it names stays as written)."""
    import click

    from poodle.cli._common import error_text, friendly_errors
    from poodle.errors import CacheError, ConfigError, mark

    raised: list[Exception] = []

    @click.command()
    @click.option("--n-neg", "n_neg", type=int, default=1)
    @click.option("--cache", "cache", default="x.h5")
    @friendly_errors
    def cmd(n_neg: int, cache: str) -> None:
        raise raised[0]

    said = []
    for error in (
        ConfigError("negatives: n_neg must be >= 1", params=("n_neg",), param="n_neg", value=0, reason="must be >= 1"),
        CacheError("x.h5: not a poodle feature cache", param="cache", value="x.h5"),
        ConfigError(f"{mark('n_neg')} must be >= 1, got 0"),
        # only a marked name is the parameter: the words 'cache' and 'n_neg' before it stay words
        ConfigError(f"no cache: n_neg of {mark('cache')} is 0 (raise {mark('n_neg')})", params=("cache",)),
    ):
        raised[:] = [error]
        r = CliRunner().invoke(cmd, ["--n-neg", "0"])
        assert r.exit_code == 1
        said.append(r.output.strip())
    assert said == [
        "error: --n-neg must be >= 1, got 0",
        "error: x.h5: not a poodle feature cache",  # 'cache' in the text is not its parameter
        "error: --n-neg must be >= 1, got 0",  # free text: the parameters it marks, as flags
        "error: no cache: n_neg of --cache is 0 (raise --n-neg)",
    ]
    with click.Context(cmd):
        assert error_text(ConfigError("no cache", param="n_neg", value=0)) == "no cache"


def test_a_marked_name_reads_plain_and_is_said_as_its_flag():
    """A message marks its parameters (``mark``): Python and logs read the plain name, the error
    and the notice carry it in ``params``, a re-raise with the marked text keeps it, and the
    command line writes each marked name as its flag (or as the project file gave it)."""
    import click

    from poodle.cli._common import as_flags, error_text, note
    from poodle.errors import ConfigError, EpisodeError, Param, mark, parts, plain
    from poodle.events import Notice

    text = f"{mark('way')} 3 is below the way of {mark('min_ways')}"
    assert plain(text) == "way 3 is below the way of min_ways"
    assert parts(text) == ["", Param("way"), " 3 is below the way of ", Param("min_ways"), ""]
    assert as_flags(text, {"way": "--way"}) == "--way 3 is below the way of min_ways"
    e = ConfigError(text, params=("seed",), hint=f"lower {mark('shot')}")
    assert str(e) == "way 3 is below the way of min_ways (lower shot)" and e.text == plain(text)
    assert (e.hint, e.marked_hint, e.params) == (
        "lower shot",
        f"lower {mark('shot')}",
        ("seed", "way", "min_ways", "shot"),
    )
    again = EpisodeError(f"domain 'a': {e.marked_text}", params=e.params, hint=e.marked_hint)
    assert str(again) == "domain 'a': " + str(e) and again.marked_text.endswith(e.marked_text)
    bad = ConfigError.bad_value("max_ways", 2, f"must be at least {mark('min_ways')}=5")
    assert (str(bad), bad.reason, bad.params) == (
        "max_ways must be at least min_ways=5, got 2",
        "must be at least min_ways=5",
        ("max_ways", "min_ways"),
    )
    n = Notice("c", f"replacing it ({mark('force')})", ("tag",))
    assert (n.message, n.params, n.marked_message) == (
        "replacing it (force)",
        ("tag", "force"),
        f"replacing it ({mark('force')})",
    )

    @click.command()
    @click.option("--way", type=int)
    @click.option("--max-ways", "max_ways", type=int)
    @click.option("--min-ways", "min_ways", type=int)
    @click.option("--force", is_flag=True)
    def cmd(way: int, max_ways: int, min_ways: int, force: bool) -> None:
        assert error_text(e) == "--way 3 is below the way of --min-ways (lower shot)"
        assert error_text(bad) == "--max-ways must be at least --min-ways=5, got 2"
        note(n)

    r = CliRunner().invoke(cmd, [])
    assert r.exit_code == 0 and r.output.strip() == "note: replacing it (--force)", r.output


def _regex_users(source: str) -> set[str]:
    """The functions of ``source`` (a cli/ module) that call the ``re`` module."""
    found = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "re":
                    found.add(fn.name)
    return found


# the only regular expressions of the command line, none on a library message: a table's column
# label folded at its separators, a progress field that is a rate
CLI_REGEX = {"_common.py": {"_fold"}, "_progress.py": {"_emit"}}


def test_the_command_line_reads_no_message_with_a_regular_expression():
    """The command line says a library message by joining its parts (``poodle.errors.parts``), each
    marked name as its flag: no regular expression (nor a search) looks for words in an error's
    or a notice's text."""
    found = {p.name: _regex_users(p.read_text()) for p in COMMANDS}
    assert {k: v for k, v in found.items() if v} == CLI_REGEX
    for path in COMMANDS:
        text = path.read_text()
        for attr in ("text", "message", "hint", "reason", "marked_text", "marked_message", "marked_hint"):
            assert not re.search(rf"\.{attr}\b[^\n]*\.(find|index|split|replace|partition)\(", text), (path, attr)
    # the rule sees the old way: the flags put into the text by a substitution
    old = 'def as_flags(message, flags):\n    return re.sub(rf"\\b{p}\\b", flag, message, count=1)\n'
    assert _regex_users(old) == {"as_flags"}


def test_an_error_that_names_its_parameter_marks_it():
    """An error (or a notice) that lists a parameter literally and writes it bare in its literal text
    is found (benchmarks/raises.py ``unmarked``): the command line would print the name there."""
    bench = _raises_module()
    assert bench.scan_unmarked(ROOT) == []
    classes = {"PoodleError", "ConfigError"}
    source = (
        "def f(x):\n"
        "    raise ConfigError(f'n_neg {x} is bad', params=('n_neg',))\n"  # 2: bare
        "    raise ConfigError(f'{mark(\"n_neg\")} {x} is bad; n_neg again', params=('n_neg',))\n"  # marked once
        "    raise ConfigError('bad', params=('force',), hint='pass force')\n"  # 4: bare in the hint
        "    raise ConfigError('a negative count', params=('n_neg',))\n"  # names it nowhere
        "    raise ConfigError.bad_value('way', x, 'must be below max_ways', others=('max_ways',))\n"  # 6
        "    Notice('c', 'replacing it (force)', ('force',))\n"  # 7
        "    Notice('c', f'replacing it ({mark(\"force\")})', ('force',))\n"
    )
    assert bench.unmarked(source, "m.py", classes) == [
        ("m.py", 2, "n_neg"),
        ("m.py", 4, "force"),
        ("m.py", 6, "max_ways"),
        ("m.py", 7, "force"),
    ]


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


# ------------------------------------------------------------------------------------------------
# The settings schema: every bound and every setting declared once (poodle.options.option)

# The functions that check settings: a bound compared there is a bound written twice.
CHECKS = ("validate", "check", "__post_init__")
SCHEMA = ROOT / "poodle" / "options.py"  # the schema's machinery: it compares values with their bounds


def _schema_groups():
    """The settings groups the command line's options are generated from (cli/_schema.py)."""
    from poodle import settings
    from poodle.demo_settings import DemoConfig
    from poodle.extract import ExtractOptions
    from poodle.pipeline import RunOptions
    from poodle.train import TrainConfig

    return (*settings.GROUPS, RunOptions, ExtractOptions, TrainConfig, DemoConfig)


def _setting_names() -> frozenset[str]:
    """The field names of every declared setting: of the groups above and of every method's config."""
    from poodle import solvers
    from poodle.options import settings

    groups = (*_schema_groups(), *(solvers.get(m).config for m in solvers.available()))
    return frozenset(s.name for g in groups for s in settings(g))


def _is_check(fn: ast.AST) -> bool:
    return isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
        fn.name in CHECKS or fn.name.startswith("check_")
    )


def _literal_bounds(tree: ast.AST, names: frozenset[str] = frozenset()) -> list[int]:
    """Lines where a check (validate, check, __post_init__, check_*) compares a setting with a number
    written there: one of its object's (``self.n_neg < 1``) or, by its name, one of another object
    (``opts.workers < 0``, ``names``): a bound that belongs in the field's declaration."""
    found = []
    for fn in ast.walk(tree):
        if not _is_check(fn):
            continue
        for n in ast.walk(fn):
            if not isinstance(n, ast.Compare):
                continue
            sides = [n.left, *n.comparators]
            setting = any(
                isinstance(s, ast.Attribute)
                and ((isinstance(s.value, ast.Name) and s.value.id == "self") or s.attr in names)
                for s in sides
            )
            number = any(
                isinstance(s, ast.Constant) and isinstance(s.value, (int, float)) and not isinstance(s.value, bool)
                for s in sides
            )
            if setting and number:
                found.append(n.lineno)
    return found


def _click_ranges(tree: ast.AST) -> list[int]:
    """Lines of click ranges with limits (``click.IntRange(min=1)``): the bound of a setting is its
    declaration's, checked and said by the library the same way on every command."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) in ("IntRange", "FloatRange")
    ]


def _hand_flags(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, flag)`` of each option written by hand (``click.option("--n-neg", ...)``)."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "option":
            out += [
                (n.lineno, a.value) for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")
            ]
    return out


def test_no_bound_is_written_outside_the_schema():
    names = _setting_names()
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in LIBRARY
        if p != SCHEMA
        for line in _literal_bounds(ast.parse(p.read_text()), names)
    ]
    found += [f"{p.relative_to(ROOT)}:{line}" for p in COMMANDS for line in _click_ranges(ast.parse(p.read_text()))]
    assert not found, "bounds outside their fields' declarations:\n" + "\n".join(found)


def test_no_setting_is_declared_twice():
    """A setting of the schema groups is declared once: in one group only among those a command
    combines (a cell's groups and the run options), and never again as a command's hand-written
    option (the command line generates it from the declaration)."""
    from poodle import settings as S
    from poodle.extract import ExtractOptions
    from poodle.options import settings
    from poodle.pipeline import RunOptions

    twice = []
    for groups in ((*S.GROUPS, RunOptions), (*S.GROUPS, ExtractOptions)):
        owner: dict[str, str] = {}
        for group in groups:
            for s in settings(group):
                if s.key in owner:
                    twice.append(f"{s.key}: {owner[s.key]} and {group.__name__}")
                owner[s.key] = group.__name__
    flags = {s.flag: f"{s.owner.__name__}.{s.name}" for g in _schema_groups() for s in settings(g) if s.meta("cli")}
    for path in COMMANDS:
        for line, flag in _hand_flags(ast.parse(path.read_text())):
            if flag in flags and path.stem not in UNCONVERTED_COMMANDS and (path.stem, flag) not in HOMONYMS:
                twice.append(f"{path.relative_to(ROOT)}:{line}: {flag} is {flags[flag]}'s")
    assert not twice, "\n".join(twice)


# Commands whose options are not generated from a settings group yet: split's are its own.
UNCONVERTED_COMMANDS = ("split",)
# A command's own option that shares a setting's name but not its meaning.
HOMONYMS = {
    ("predict", "--query"): "the folder of the query images",
    ("solve", "--lr"): "the method's Adam learning rate (a shortcut for --set lr=), not training's SGD one",
    ("solve", "--label-smoothing"): "the method's (ce) label smoothing, not training's",
}


def _commands():
    """Every command of ``poodle`` (its click command objects, each module imported)."""
    import click

    from poodle.cli.main import cli

    ctx = click.Context(cli)
    return {name: cli.get_command(ctx, name) for name in cli.list_commands(ctx)}


def _twice_in(command) -> list[str]:
    """A command's settings declared twice: two options of one name or flag (two groups that share a
    setting, or a group's setting and an option written by hand), and an option written by hand for
    a setting of a group whose options the command takes (``--milestones`` by hand beside
    TrainConfig's options, even where the declaration has no option: ``cli=False``)."""
    import click

    from poodle.cli._schema import SettingOption
    from poodle.options import settings

    options = [p for p in command.params if isinstance(p, click.Option)]
    out, seen, flags = [], {}, {}
    for p in options:
        where = f"{p.setting.owner.__name__}.{p.setting.name}" if isinstance(p, SettingOption) else "by hand"
        if p.name in seen:
            out.append(f"{p.name}: {seen[p.name]} and {where}")
        seen[p.name] = where
        for flag in (*p.opts, *p.secondary_opts):
            if flag in flags and flags[flag] != p.name:
                out.append(f"{flag}: options {flags[flag]} and {p.name}")
            flags[flag] = p.name
    groups = {p.setting.owner for p in options if isinstance(p, SettingOption)}
    keys = {s.key: f"{g.__name__}.{s.name}" for g in groups for s in settings(g)}
    out += [
        f"{p.opts[0]} by hand is {keys[p.name]}" for p in options if not isinstance(p, SettingOption) and p.name in keys
    ]
    return out


def test_no_command_declares_a_setting_twice():
    twice = [f"poodle {name}: {t}" for name, command in _commands().items() for t in _twice_in(command)]
    assert not twice, "\n".join(twice)
    generated = {
        name: {p.setting.owner.__name__ for p in c.params if hasattr(p, "setting")} for name, c in _commands().items()
    }
    assert {"TrainConfig"} <= generated["train"] and {"DemoConfig"} <= generated["demo"]


def test_the_command_rule_finds_a_setting_declared_twice():
    # the rule above must be able to fail: a hand-written option beside the group's, and two groups
    # that share a setting, and an option by hand for a declaration with no option of its own
    import click

    from poodle.cli._schema import schema_options
    from poodle.demo_settings import DemoConfig
    from poodle.train import TrainConfig

    def command(*decorators):
        fn = lambda **kw: None  # noqa: E731
        for d in decorators:
            fn = d(fn)
        return click.command()(fn)

    hand = command(schema_options(TrainConfig), click.option("--lr", type=float))
    assert _twice_in(hand) == ["lr: by hand and TrainConfig.lr", "--lr by hand is TrainConfig.lr"]
    renamed = command(schema_options(TrainConfig, only=("lr",)), click.option("--lr", "rate", type=float))
    assert _twice_in(renamed) == ["--lr: options rate and lr"]
    both = command(schema_options(TrainConfig, only=("seed",)), schema_options(DemoConfig, only=("seed",)))
    assert _twice_in(both)[0] == "seed: DemoConfig.seed and TrainConfig.seed"
    hidden = command(schema_options(TrainConfig, only=("lr",)), click.option("--val-split"))
    assert _twice_in(hidden) == ["--val-split by hand is TrainConfig.val_split"]
    assert _twice_in(command(schema_options(TrainConfig))) == []


def test_the_schema_rules_find_what_they_forbid():
    # the rules above must be able to fail
    validate = "class S:\n    def validate(self):\n        if self.n_neg < 1 or 2 > self.way:\n            pass\n"
    assert _literal_bounds(ast.parse(validate)) == [3, 3]
    fine = "class S:\n    def validate(self):\n        if self.query_classes > self.way:\n            pass\n"
    assert _literal_bounds(ast.parse(fine)) == []
    # a check_* function, a setting of another object named as declared (workers), not another name
    other = "def check_options(opts, n):\n    if opts.workers < 0 or n < 0 or opts.count < 0:\n        pass\n"
    assert _literal_bounds(ast.parse(other), frozenset({"workers"})) == [2]
    assert _literal_bounds(ast.parse(other.replace("check_options", "options")), frozenset({"workers"})) == []
    assert {"lr", "epochs", "image_size", "workers", "n_neg", "threads"} <= _setting_names()
    ranges = 'click.option("--n-neg", type=click.IntRange(min=1))\nclick.option("--x", type=FloatRange(0, 1))\n'
    assert _click_ranges(ast.parse(ranges)) == [1, 2]
    assert _hand_flags(ast.parse(ranges)) == [(1, "--n-neg"), (2, "--x")]


def test_a_new_episode_field_is_a_flag_a_project_key_a_grid_axis_and_an_identity_key_only_when_set():
    """What it takes to add a setting: one field of its group. Made here on a copy of EpisodeSpec
    with one more field, through the same functions the command line, the grid and the results use."""
    import dataclasses

    import click

    from poodle.cli._schema import schema_options
    from poodle.episodes import EpisodeSpec
    from poodle.errors import EpisodeError
    from poodle.options import check_value, option, recorded, setting

    Spec = dataclasses.make_dataclass(
        "Spec",
        [("max_ways", "int | None", option(None, min=5, when_set=True, help="At most this many ways."))],
        bases=(EpisodeSpec,),
        frozen=True,
        namespace={"__annotations__": {**EpisodeSpec.__annotations__, "max_ways": "int | None"}},
    )
    cmd = schema_options(Spec)(click.command()(lambda **kw: None))
    flag = next(p for p in cmd.params if p.name == "max_ways")
    assert flag.opts == ["--max-ways"] and flag.default is None and flag.help == "At most this many ways."
    s = setting(Spec, "max_ways")
    assert check_value(s, "none", files=True) is None and check_value(s, 7.0, files=True) == 7
    with pytest.raises(EpisodeError, match=r"max_ways must be an integer >= 5, got 4") as e:
        check_value(s, 4, EpisodeError)
    assert (e.value.param, e.value.value) == ("max_ways", 4)
    assert "max_ways" not in recorded(Spec()) and recorded(Spec(max_ways=8))["max_ways"] == 8
    assert recorded(Spec()) == recorded(EpisodeSpec())  # the identity of every older record is kept


def _bench_module(stem: str):
    """benchmarks/<stem>.py (stdlib only: no poodle import), loaded once."""
    import importlib.util
    import sys

    name = f"poodle_bench_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _imports_module():
    """benchmarks/imports.py, the analysis of the import graph."""
    return _bench_module("imports")


# The one import that reaches up and closes a circle, and why it may: poodle.defaults' module
# __getattr__ serves the key tables that moved to poodle.settings, with a DeprecationWarning, until
# they are removed in 0.3.0 (CHANGELOG). An entry here may not outlive that release.
DEPRECATED_ALIASES = {("poodle.defaults", "poodle.settings"): (0, 3, 0)}


def test_no_import_circle_and_no_import_climbs_a_layer():
    """No module imports, directly or through others, a module that imports it back: neither at
    module level nor by an import put off into a function (an import deferred only so as to break a
    circle is the circle still); and no module imports one of a higher layer (the layers of
    docs/architecture.md, benchmarks/imports.py's LAYERS)."""
    import poodle

    bench = _imports_module()
    report = bench.analyse()
    assert report.module_components == []
    version = tuple(int(x) for x in poodle.__version__.split(".")[:3])
    allowed = {k for k, until in DEPRECATED_ALIASES.items() if version < until}
    assert allowed == set(DEPRECATED_ALIASES), "the deprecated aliases are due for removal: remove them"
    closing = [
        f"{i.source}:{i.line} -> {i.target}" for i in report.deferred_circles if (i.source, i.target) not in allowed
    ]
    assert closing == []
    # without the deprecated aliases' import, no circle is left of any kind of import
    kept = [i for i in report.imports if (i.source, i.target) not in allowed]
    assert bench.components(bench._graph(kept, report.modules)) == []
    climbs = [f"{i.source}:{i.line} -> {i.target}" for i in report.climbs if (i.source, i.target) not in allowed]
    assert climbs == []


def test_the_import_rules_find_what_they_forbid():
    bench = _imports_module()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert bench.components(graph) == [["a", "b", "c"]]
    assert bench.cycles(graph, 8, 10) == [["a", "b", "c"]]
    assert bench.cycles(graph, 2, 10) == []
    top = {"a": {"b"}, "b": set(), "c": set(), "d": set(), "e": set()}
    imports = [bench.Import("b", "a", 3, True), bench.Import("c", "a", 4, True)]
    assert [(i.source, i.target) for i in bench.closing_deferred(imports, top)] == [("b", "a")]
    up = bench.Import("poodle.episodes", "poodle.settings", 1, True)
    down = bench.Import("poodle.settings", "poodle.episodes", 1, False)
    assert bench.climbs([up, down]) == [up]
    # an import is read where it runs: in a function (deferred), at module level, never for typing
    source = (
        "from typing import TYPE_CHECKING\nimport poodle.x\nif TYPE_CHECKING:\n    import poodle.y\n"
        "def f():\n    from poodle import z\n"
    )
    found = [(n.lineno, deferred) for n, deferred in bench._imports(ast.parse(source))]
    assert found == [(1, False), (2, False), (6, True)]


def test_a_command_takes_every_setting_of_its_groups_but_those_it_names():
    """A setting added to a group is an option of each command that takes the group (``but``: the
    few it leaves out), with no line of the command to change."""
    from poodle.cli._schema import schema_options
    from poodle.cli.extract import extract
    from poodle.cli.grid import grid
    from poodle.cli.predict import predict
    from poodle.cli.solve import solve
    from poodle.extract import ExtractOptions
    from poodle.options import settings
    from poodle.run import RunOptions

    def flags(command) -> set[str]:
        return {o for p in command.params for o in p.opts}

    def group(cls, *but: str) -> set[str]:
        return {s.flag for s in settings(cls) if s.meta("cli") and s.key not in but}

    assert group(ExtractOptions) <= flags(extract)
    assert group(ExtractOptions, "dtype") <= flags(predict) and "--dtype" not in flags(predict)
    assert group(RunOptions, "cells_per_call") <= flags(solve) and "--cells-per-call" not in flags(solve)
    assert group(RunOptions, "workers") <= flags(grid) and "--workers" not in flags(grid)
    from poodle.cli.demo import demo
    from poodle.cli.train import train
    from poodle.demo_settings import DemoConfig
    from poodle.train import TrainConfig

    assert group(TrainConfig) <= flags(train) and group(DemoConfig) <= flags(demo)
    assert "--no-channels-last" in {o for p in train.params for o in p.secondary_opts}
    assert "--val-split" not in flags(train)  # declared with cli=False
    with pytest.raises(AssertionError, match="no such settings"):
        schema_options(RunOptions, but=("no_such_setting",))


def test_a_sequence_setting_checks_each_item_and_a_shared_one_keeps_its_bounds():
    """``tuple[int, ...]`` (milestones): each item by the bounds, the value as a tuple; option_like
    takes another group's declaration with a default of its own, never another bound."""
    from poodle.errors import ConfigError
    from poodle.options import check_value, option_like, setting
    from poodle.train import TrainConfig

    s = setting(TrainConfig, "milestones")
    assert s.many and s.kind is int and s.optional
    assert check_value(s, [3, 5.0], files=True) == (3, 5) and check_value(s, "auto", files=True) is None
    for bad in ([0, 5], [3, 2.5], "3,5", 3):
        with pytest.raises(ConfigError, match=r"^milestones must be a comma-separated list, each a positive integer"):
            check_value(s, bad)
    with pytest.raises(AssertionError, match="a bound is its declaration's"):
        option_like(TrainConfig, "lr", 0.1, min=1)
    with pytest.raises(AssertionError, match="takes no"):
        option_like(TrainConfig, "lr", 0.1, maximum=1)


def _raises_module():
    """benchmarks/raises.py, the census of the library's user errors."""
    return _bench_module("raises")


def test_every_user_error_carries_its_parameter_or_says_why_not():
    """Every error a caller can cause names the parameter it is about (``bad_value``, ``param=`` and
    ``value=``, or at least ``params=``), so that a front end says it its own way without reading the
    text; the few about no caller's value (torchrun's environment, files poodle wrote itself) say so
    with ``# not a caller's value: <why>`` (benchmarks/raises.py)."""
    found = _raises_module().scan(ROOT)
    bare = [f"{r.path}:{r.line}" for r in found if r.kind == "neither"]
    assert bare == []
    assert sum(r.kind == "value" for r in found) > 250  # the scan sees the library's errors


def test_an_error_about_a_file_carries_the_argument_that_named_it_and_the_path(tmp_path):
    from poodle.backbones.checkpoint import read_checkpoint
    from poodle.cache import read_split
    from poodle.episodes import load_episodes
    from poodle.errors import PoodleError

    missing, foreign = tmp_path / "none.h5", tmp_path / "text.h5"
    foreign.write_text("not a cache")
    readers = {"cache": lambda p: read_split(p, "test"), "episodes_from": load_episodes, "checkpoint": read_checkpoint}
    for param, read in readers.items():
        for path in (missing, foreign):
            with pytest.raises(PoodleError) as e:
                read(path)
            assert (e.value.param, e.value.value, e.value.reason) == (param, path, None), e.value
            assert str(path) in str(e.value)  # the text names the file, as before


def test_the_error_census_tells_the_kinds_apart():
    bench = _raises_module()
    errors = "class PoodleError(Exception): ...\nclass MyError(PoodleError): ...\nclass WriteError(PoodleError): ..."
    classes = bench.error_classes({"m": ast.parse(errors)})
    assert classes == {"PoodleError", "MyError"}
    source = (
        "def f(x, err):\n"
        "    raise MyError(f'{x} is bad')\n"  # 2: neither
        "    raise MyError(f'{x} is bad', params=('x',))\n"  # 3: params
        "    raise MyError(f'{x} is bad', param='x', value=x)\n"  # 4: value
        "    raise MyError.bad_value('x', x, 'must be odd')\n"  # 5: value
        "    raise err.bad_value('x', x, 'must be odd')\n"  # 6: value (only an error has bad_value)
        "    # not a caller's value: two files we wrote disagree\n"
        "    raise MyError('the files disagree')\n"  # 8: marked
        "    raise MyError(\n        'the files disagree'\n    )  # not a caller's value: ours\n"  # 9: marked
        "    raise WriteError('disk full', path='x')\n"  # carries its file as path=: left out
        "    raise ValueError(x)\n"
        "    raise MyError(f'{mark(\"x\")} is bad')\n"  # 14: params (a marked name is one)
    )
    found = [(r.line, r.kind) for r in bench.classify(source, "m.py", classes)]
    assert sorted(found) == [
        (2, "neither"),
        (3, "params"),
        (4, "value"),
        (5, "value"),
        (6, "value"),
        (8, "marked"),
        (9, "marked"),
        (14, "params"),
    ]
