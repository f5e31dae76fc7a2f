"""What every command shares: the console, one-line errors, progress bars, option types.

Both consoles print text literally (``markup=False``): messages carry paths, class names and option
values that the user wrote, and rich markup would rewrite ``run[bold]1.h5`` or fail on ``[/]``.
Styling is applied with :func:`styled` (a ``rich.text.Text``), never by markup in a string.

Output that goes to a file or a pipe (a batch job's log, CI) is not laid out for a terminal that is
not there: tables take their natural width (or ``COLUMNS`` when it is set), and colours are left
out (rich's rule; ``NO_COLOR`` turns them off on a terminal too).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from poodle import defaults
from poodle.cli._console import console, out
from poodle.errors import Param, PoodleError, parts
from poodle.events import NoticeWarning


class Unpadded:
    """``renderable`` printed without the spaces rich pads its lines with (a table's title and its
    cells fill the table's width): the lines end where their text does, as a log, a diff or a
    pasted copy wants (``poodle info``)."""

    def __init__(self, renderable: Any) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: Any) -> Iterator[Any]:
        from rich.segment import Segment

        for line in console.render_lines(self.renderable, options, pad=False):
            while line and not line[-1].control and not line[-1].text.strip():
                line.pop()
            if line and not line[-1].control:
                line[-1] = Segment(line[-1].text.rstrip(), line[-1].style)
            yield from line
            yield Segment.line()


def styled(label: str, style: str, rest: str = "") -> Text:
    """``label`` in ``style`` followed by ``rest``, both printed literally."""
    return Text.assemble((label, style), rest)


# Library parameters whose command-line option has another name (the one table of such pairs).
PARAM_OPTIONS: dict[str, tuple[str, ...]] = {
    "out": ("results_path", "out_path", "out_dir"),
    "save_episodes_to": ("save_episodes",),
    "methods": ("method",),
    "cache": ("caches",),  # solve takes --cache repeated (several domains)
    "overrides": ("sets",),  # a grid's options given on the command line
    "support": ("support_dir",),
    "query": ("query_dir",),
    "p_threshold": ("p",),
}


def flags_of(command: click.Command | None, params: tuple[str, ...]) -> dict[str, str]:
    """``{library parameter: its flag}`` for the ``params`` that ``command`` has an option for: the
    option of the same name (``n_neg`` -> ``--n-neg``) or of a name in :data:`PARAM_OPTIONS`."""
    if command is None:
        return {}
    options = {p.name: p for p in command.params if isinstance(p, click.Option)}
    out = {}
    for param in params:
        for name in (param, *PARAM_OPTIONS.get(param, ())):
            if name in options:
                out[param] = next(o for o in options[name].opts if o.startswith("--"))
                break
    return out


def as_flags(text: str, flags: dict[str, str]) -> str:
    """``text`` (a library message) with each parameter it marks (:func:`poodle.errors.mark`) written
    as its flag in ``flags`` (as its name when this command has no flag for it); every other word as
    it is: the message is joined from its parts, never searched."""
    return "".join(flags.get(p.name, p.name) if isinstance(p, Param) else p for p in parts(text))


def say_error(error: PoodleError) -> None:
    """``error: <message>`` on stderr, as :func:`error_text` says it."""
    console.print(styled("error:", "bold red", " " + error_text(error)), soft_wrap=True)


def error_text(error: PoodleError) -> str:
    """A library error as the running command says it: the parameters it carries (``params``,
    ``param``) written as this command's flags (:func:`flags_of`, the one mapping), a value that was
    not typed named where it came from (:func:`given_as`)."""
    ctx = click.get_current_context(silent=True)
    command = ctx.command if ctx else None
    flags = flags_of(command, (*error.params, *((error.param,) if error.param and error.reason else ())))
    # values all from the project file: what they need is said as the file's keys (add protocol = ...)
    in_file = bool(flags) and all(_source(ctx, f)[1] == "project" for f in flags.values())
    needs = {} if in_file else flags_of(command, tuple(error.needs))
    return _flag_text(error, flags, given_as(ctx, flags), needs)


def given_as(ctx: click.Context | None, flags: dict[str, str]) -> dict[str, str]:
    """``flags`` ({library parameter: flag}) each said as the user gave its value: typed (or not
    given), the flag; from the project file, the flag and the file, table and key
    (``--way (poodle.toml [solve] way)``); from its environment variable, that variable
    (``POODLE_PROGRESS_INTERVAL (environment variable for --progress-interval)``)."""
    out = {}
    for param, flag in flags.items():
        option, source = _source(ctx, flag)
        if ctx is not None and option is not None and source == "project":
            out[param] = f"{flag} ({ctx.meta[_PROJECT_KEYS][ctx.info_name][option.name]})"
        elif option is not None and source == "environment":
            envvars = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or ())
            var = next((v for v in envvars if os.environ.get(v)), None)
            out[param] = f"{var} (environment variable for {flag})" if var else flag
        else:
            out[param] = flag
    return out


def _source(ctx: click.Context | None, flag: str) -> tuple[click.Option | None, str | None]:
    """The running command's option of ``flag`` and where its value came from: ``"project"`` (the
    project file), ``"environment"`` (its environment variable) or None (typed, or its default)."""
    from click.core import ParameterSource

    if ctx is None:
        return None, None
    option = next((p for p in ctx.command.params if isinstance(p, click.Option) and p.name and flag in p.opts), None)
    if option is None or option.name is None:
        return None, None
    source = ctx.get_parameter_source(option.name)
    keys = ctx.meta.get(_PROJECT_KEYS, {}).get(ctx.info_name, {})
    if source == ParameterSource.DEFAULT_MAP and option.name in keys:
        return option, "project"
    return option, "environment" if source == ParameterSource.ENVIRONMENT else None


def _flag_text(error: PoodleError, flags: dict[str, str], said: dict[str, str], needs: dict[str, str]) -> str:
    """The error's text with its marked parameters as flags (``said``: as the user gave them, see
    :func:`given_as`): an error about one value with a reason (``bad_value``: its parameter, value and
    reason are fields) is said from those fields, the other parameters its reason marks as plain
    flags, whatever its text (a prefix such as ``glyphs:`` is the library's own way); an error whose
    text is free is joined from its parts (:func:`as_flags`). What the error needs (``error.needs``)
    is said as flags to type (``add --protocol meta-dataset``) when this command has them all
    (``needs``: their flags)."""
    from poodle.cli._schema import flag_message

    hint = f" ({as_flags(error.marked_hint, flags)})" if error.marked_hint else ""
    if error.param in flags and error.marked_reason is not None:  # said from its fields, never from its text
        others = {p: f for p, f in flags.items() if p != error.param}
        said_value = flag_message(said[error.param], error, reason=as_flags(error.marked_reason, others))
        if said_value is not None:
            return said_value + hint
    text = as_flags(error.marked_text, said)
    if error.needs and set(needs) == set(error.needs):
        text += ": add " + ", ".join(_typed(needs[k], v) for k, v in error.needs.items())
    elif error.needs:
        text = as_flags(error.marked_message, said)
    return text + hint


def _typed(flag: str, value: object) -> str:
    """How ``flag`` with ``value`` is typed: ``--protocol meta-dataset``; ``--bilevel`` for true."""
    return flag if value is True else f"{flag} {value}"


def check_paths(ctx: click.Context | None) -> None:
    """Every path the command was given (its ``click.Path`` options and arguments) must resolve
    (:func:`poodle.utils.resolve_path`): a symbolic link loop or a file used as a folder is one
    error naming the option, before any work."""
    if ctx is None:
        return
    from poodle.utils import resolve_path

    for p in ctx.command.params:
        value = ctx.params.get(p.name or "")
        if not isinstance(p.type, click.Path) or value is None:
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if v is not None and str(v) != "-":  # an argument has no flag: named as its help shows it
                resolve_path(v, p.name if isinstance(p, click.Option) else None, p.human_readable_name)


@contextlib.contextmanager
def notices_as_notes() -> Iterator[None]:
    """Inside: a :class:`poodle.events.NoticeWarning` (a notice from deep inside the library, such as
    the fused kernel's loader) prints as one ``note:`` line; other warnings as usual."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if isinstance(message, NoticeWarning):
                note(message.notice)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Check the command's paths (:func:`check_paths`), then turn a :class:`PoodleError` into
    ``error: <message>`` on stderr (library parameter names written as flags) and exit code 1;
    library notices raised as warnings print as ``note:`` lines."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            check_paths(click.get_current_context(silent=True))
            with notices_as_notes():
                return fn(*args, **kwargs)
        except PoodleError as e:
            if getattr(e, "quiet", False):  # another rank of a torchrun run failed and printed its error
                sys.exit(1)
            say_error(e)
            sys.exit(1)
        except OSError as e:
            # what the checks up front could not foresee (permissions changed mid-run): one line
            # naming the file, not a traceback from deep inside h5py or PIL
            where = (
                f" {e.filename}" + (f" -> {e.filename2}" if getattr(e, "filename2", None) else "") + ":"
                if getattr(e, "filename", None)
                else ""
            )
            console.print(styled("error:", "bold red", f"{where} {e.strerror or e}".rstrip()), soft_wrap=True)
            sys.exit(1)
        except KeyboardInterrupt as e:
            say_stopped(e)
            sys.exit(int(getattr(e, "exit_code", 130)))

    return wrapper


# What the running command has committed so far, for the line a stop prints: {what: text}, each
# entry replaced by the newer one of its kind ("cells": "3 of 10 cells in g.results.jsonl").
_KEPT: dict[str, str] = {}


def keep(what: str, text: str | None) -> None:
    """Record that ``text`` (e.g. ``epochs 1-3 in run/last.pt``) is committed: the line printed if
    the command is stopped says it (None: forget ``what``)."""
    if text is None:
        _KEPT.pop(what, None)
    else:
        _KEPT[what] = text


def continue_command() -> str:
    """The command line that continues this run: the same one (every long command resumes)."""
    import shlex

    args = shlex.join(sys.argv[1:])
    torchrun = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    return f"the same torchrun command (... poodle {args})" if torchrun else f"poodle {args}"


def say_stopped(e: BaseException) -> None:
    """The one line of a run stopped by SIGINT or SIGTERM (``e``): what is kept, and the command
    that continues it."""
    import signal as _signal

    if int(os.environ.get("RANK", "0") or 0) != 0:
        return  # under torchrun rank 0 speaks for the run
    signum = int(getattr(e, "signum", _signal.SIGINT))
    kept = "; ".join(_KEPT.values()) or "nothing finished yet"
    console.print(
        styled(f"stopped by {_signal.Signals(signum).name}", "yellow", f": kept {kept}; continue with: ")
        + Text(continue_command()),
        soft_wrap=True,
    )


def note(event: Any, prefix: bool = True) -> None:
    """A library :class:`poodle.events.Notice` as one line (its marked parameter names as flags),
    after ``note:`` unless ``prefix`` is false (a step of the command's own work)."""
    ctx = click.get_current_context(silent=True)
    text = as_flags(event.marked_message, flags_of(ctx.command if ctx else None, event.params))
    if prefix:
        console.print(styled("note", "yellow", f": {text}"), soft_wrap=True)
    else:
        console.print(text, highlight=False, markup=False, soft_wrap=True)


def parse_set(item: str, form: str) -> tuple[str, str]:
    """``--set KEY=VALUE`` -> ``(key, value)`` (key stripped, ``-`` read as ``_``); ``form`` is
    what the command accepts, said when ``item`` has no ``=`` or no key."""
    from poodle.errors import ConfigError

    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected {form}")
    return key.strip().replace("-", "_"), value.strip()


def project_default_map(ctx: click.Context, config_file: str | None) -> dict[str, dict[str, Any]] | None:
    """click's ``default_map`` of the project file: ``config_file``, else ``./poodle.toml`` when it
    exists (None without one). Each value is converted by its option's type now, so that a bad one is
    one line naming the file, the table and the key; a relative path is read from the file's folder."""
    from poodle import defaults
    from poodle.errors import ConfigError
    from poodle.project import project_defaults, read_project

    path = Path(config_file) if config_file is not None else Path(defaults.PROJECT_FILE)
    if config_file is None and not os.path.lexists(path):
        return None  # a poodle.toml that is a folder, a dangling link or a loop is read, and refused
    tables = read_project(path)
    group = ctx.command
    assert isinstance(group, click.Group)
    # a key is an option's long name as typed, without the dashes (--data-root: data_root, --out: out)
    options: dict[str, dict[str, click.Option]] = {}
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        for param in command.params if command is not None else ():
            if isinstance(param, click.Option) and param.expose_value and param.name:
                for opt in param.opts:
                    if opt.startswith("--"):
                        options.setdefault(name, {})[opt[2:].replace("-", "_")] = param
    found = project_defaults(path, tables, options)
    base = path.parent
    default_map: dict[str, dict[str, Any]] = {}
    for cmd_name, entries in found.items():
        for name, (table, key, value) in entries.items():
            param = options[cmd_name][name]
            optional_value = not param.is_flag and getattr(param, "_flag_needs_value", False)
            if value is False and optional_value:
                continue  # `pretrained = false`: the option not given
            if value is True and optional_value:
                value = param.flag_value  # `pretrained = true`: the option typed alone (--pretrained)
            if param.multiple and not isinstance(value, list):
                value = [value]
            wrong = _toml_type_error(param, value)
            if wrong:
                raise ConfigError(f"{path}: [{table}] {key} = {_toml_text(value)}: {wrong}")
            if isinstance(param.type, click.Path) and base != Path():
                if isinstance(value, str):
                    value = _from_folder(base, value)
                elif isinstance(value, list) and param.name == "caches":  # solve's [NAME=]PATH items
                    value = [_from_folder(base, v, named=True) if isinstance(v, str) else v for v in value]
                elif isinstance(value, list):
                    value = [_from_folder(base, v) if isinstance(v, str) else v for v in value]
            try:
                param.type_cast_value(ctx, value)
            except click.BadParameter as e:
                raise ConfigError(f"{path}: [{table}] {key} = {_toml_text(value)}: {e.message.rstrip('.')}") from None
            if param.name in default_map.get(cmd_name, {}):
                raise ConfigError(f"{path}: [{table}] {key}: that option is set twice (e.g. out and json)")
            default_map.setdefault(cmd_name, {})[cast(str, param.name)] = value
            # where a value came from, for an error the library raises about it later (say_error)
            ctx.meta.setdefault(_PROJECT_KEYS, {}).setdefault(cmd_name, {})[param.name] = f"{path} [{table}] {key}"
    return default_map


def _from_folder(base: Path, value: str, named: bool = False) -> str:
    """A project file's relative path as read from its folder ``base``; ``named``: ``NAME=PATH``
    keeps its name (``poodle solve``'s domains)."""
    name, sep, rest = value.partition("=")
    if named and sep and not any(c in name for c in "/\\"):
        return f"{name}={_from_folder(base, rest)}"
    return value if os.path.isabs(os.path.expanduser(value)) else str(base / value)


_PROJECT_KEYS = "poodle.project_keys"  # ctx.meta: {command: {option name: "poodle.toml [table] key"}}


def _toml_text(value: Any) -> str:
    """``value`` as the project file writes it (``"many"``, ``true``, ``[1, 2]``), cut short."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = '"' + value + '"'
    elif isinstance(value, list):
        text = "[" + ", ".join(_toml_text(v) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k} = {_toml_text(v)}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _toml_type_error(param: click.Option, value: Any) -> str | None:
    from poodle.cli._schema import ListType

    """What is wrong with the type of a project file's ``value`` for ``param`` (None: nothing). TOML
    has types: a number is not read from a string, nor a string from a number, nor a number from
    ``true`` (click would turn 3.5 into 3 and true into 1)."""
    if param.multiple:
        if not isinstance(value, list):
            return "expected a list"
        return next((w for v in value if (w := _toml_scalar_error(param, v))), None)
    if isinstance(value, list) and isinstance(param.type, ListType):  # a sequence setting: milestones = [60, 80]
        kind = int if param.type.kind is int else (int, float)
        ok = all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
        return None if ok else f"expected a list of {param.type.name}"
    if isinstance(value, list):
        return "expected one value, not a list"
    return _toml_scalar_error(param, value)


def _toml_scalar_error(param: click.Option, value: Any) -> str | None:
    if isinstance(value, dict):
        return "expected a value, not a table"
    if isinstance(value, list):
        return "expected a value, not a list"
    t = param.type
    if param.is_flag or isinstance(t, click.types.BoolParamType):
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(t, click.types.IntParamType):
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "expected an integer"
    if isinstance(t, click.types.FloatParamType):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "expected a number"
    if isinstance(t, (click.types.StringParamType, click.Choice, click.Path)):
        return None if isinstance(value, str) else 'expected a string (in quotes: "...")'
    ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    return None if ok else "expected a string or a number"


def from_project(ctx: click.Context, name: str) -> bool:
    """Whether option ``name`` took its value from the project file (not typed, not built in)."""
    from click.core import ParameterSource

    return ctx.get_parameter_source(name) == ParameterSource.DEFAULT_MAP


def user_set(ctx: click.Context, name: str) -> bool:
    """Whether the user chose option ``name``'s value: typed, in its environment variable or in the
    project file (not the built-in default)."""
    from click.core import ParameterSource

    return ctx.get_parameter_source(name) in (
        ParameterSource.COMMANDLINE,
        ParameterSource.ENVIRONMENT,
        ParameterSource.DEFAULT_MAP,
    )


def say_glyphs_generation(dataset: str, data_root: str | None, cache_root: str) -> None:
    """Generate the embedded glyphs now when the command will read them and they are not there yet
    (first use: minutes), with a line saying so and its progress (``--progress``), rather than
    silently inside the dataset's first listing."""
    if dataset != "glyphs" or data_root is not None:
        return
    from poodle.data.glyphs import ensure_glyphs, glyphs_to_generate

    n = glyphs_to_generate(cache_root)
    if n:
        where = Path(cache_root) / "glyphs"
        console.print(
            styled("note", "yellow", f": generating the glyphs dataset under {where} (first use only, a few minutes)"),
            soft_wrap=True,
        )
        with progress_bar("generating glyphs", n, unit="img") as advance:
            ensure_glyphs(Path(cache_root), progress=advance)


def progress_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What makes a command a long one: ``--progress`` and ``--progress-interval`` (the one
    declaration of both; see :mod:`poodle.cli._progress`), and a stop at a safe point on SIGTERM or
    SIGINT (:mod:`poodle.interrupt`; :func:`friendly_errors` then says what is kept and exits with
    128 + the signal's number). The command itself receives neither option; every display it makes
    (:func:`progress_bar`, :func:`poodle.cli._progress.new_progress`) takes the form chosen."""
    from poodle.cli import _progress
    from poodle.cli._schema import click_option
    from poodle.errors import ConfigError
    from poodle.options import check_group, settings

    @functools.wraps(fn)
    def wrapper(*args: Any, progress: str, progress_interval: float, **kwargs: Any) -> Any:
        from poodle import interrupt

        try:
            check_group(_progress.ProgressOptions(progress, progress_interval), ConfigError)
        except ConfigError as e:
            raise click.UsageError(error_text(e)) from None
        _progress.configure(progress, progress_interval)
        _KEPT.clear()
        # SIGTERM and SIGINT stop the run at its next safe point (poodle.interrupt); torchrun's
        # ranks stop only at points they agree on, never in the middle of a collective
        torchrun = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
        # json: stderr carries the progress objects alone, so the human lines (notes, summaries,
        # errors) go to stdout with the results, and a log parser reads stderr line by line
        human_on_stderr = console.stderr
        console.stderr = progress != "json"
        try:
            with interrupt.stop_on_signals(grace=None if torchrun else interrupt.GRACE):
                return fn(*args, **kwargs)
        finally:
            console.stderr = human_on_stderr

    envvar = {"progress_interval": _progress.INTERVAL_ENV}
    for s in reversed(settings(_progress.ProgressOptions)):
        wrapper = click_option(s, envvar=envvar.get(s.key))(wrapper)
    return wrapper


class Bar:
    """``advance(n)``, the callback the library functions accept, of one progress bar. The bar is
    drawn from :meth:`start` or the first advance on, so that an error found before (the checks up
    front) is printed alone, not under an empty bar."""

    def __init__(self, progress: Any, description: str, total: int | None, unit: str) -> None:
        self.progress, self.description, self.total, self.unit = progress, description, total, unit
        self.task: Any = None

    def start(self) -> None:
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task(self.description, total=self.total, rate="", unit=self.unit)

    def __call__(self, n: int) -> None:
        from poodle import interrupt

        self.start()
        self.progress.advance(self.task, n)
        interrupt.check()  # a safe point: the library calls this between chunks and batches
        speed = self.rate()
        if speed:
            self.progress.update(self.task, rate=f"{speed:,.1f} {self.unit}/s")

    def rate(self) -> float | None:
        """Items a second since the bar started (to its end, once it ended): the rate its bar and its
        plain or json lines show, and that a command's summary repeats (None before any item)."""
        if self.task is None:
            return None
        t = self.progress.tasks[self.task]
        seconds = t.finished_time if t.finished_time is not None else t.elapsed
        done = t.completed - getattr(t, "start_count", 0.0)
        return done / seconds if seconds and done > 0 else None


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, unit: str = "items", lazy: bool = False) -> Iterator[Bar]:
    """A progress bar (or lines, as ``--progress`` says); yields ``advance(n)`` (a :class:`Bar`), the
    callback the library functions accept. ``lazy``: drawn only from ``advance.start()`` or the first
    advance on (give ``start`` to the library as its ``ready`` callback: the checks up front then print
    their error alone)."""
    columns = [
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    from poodle.cli._progress import new_progress

    bar = Bar(new_progress(*columns), description, total, unit)
    if not lazy:
        bar.start()
    ended = False
    try:
        yield bar
        ended = True
    finally:
        if bar.task is not None:
            if ended and total is None:  # a stage of unknown size that ran to its end is complete
                bar.progress.update(bar.task, total=bar.progress.tasks[bar.task].completed)
            bar.progress.stop()


def pretrained_option(help: str) -> Callable[[Any], Any]:
    """extract's and predict's ``--pretrained [WEIGHTS]``: a bare flag means the library's default weights."""
    return click.option(
        "--pretrained", is_flag=False, flag_value=defaults.PRETRAINED, default=None, metavar="[WEIGHTS]", help=help
    )


_LAYOUTS = ("full", "compact", "merged", "long")


def render_table(table: Any, title: str | None = None, width: int | None = None) -> Any:
    """A :class:`poodle.report.Table` as a rich renderable: the one renderer of result tables
    (``report``, ``demo``, ``grid``, ``solve``); bold entries in bold green, and where the console it
    is printed on shows no styles (a file, a pipe, ``TERM=dumb``) with a trailing ``*`` instead,
    said under the table, so that a log or a pasted table still marks them.

    The table is laid out to fit ``width`` columns (default: the terminal's; when the output is no
    terminal, ``COLUMNS`` or else no limit, the table's natural width) without cutting any text:
    the first of these layouts whose natural width fits is used (the last one otherwise):

    - ``full``: boxed, one column per row key;
    - ``compact``: the same columns with a light box and single spaces between columns;
    - ``merged``: the row keys folded into one ``options`` column of ``key=value`` pairs (values that
      are ``–``, i.e. not an option of that row, left out), wrapped within the room the entries leave;
    - ``long``: one line per entry (options, column, accuracy), for tables with too many columns.

    Entries (``76.62 ± 0.48``) are never wrapped; every other text folds rather than being cut.
    """
    return _TableView(table, title, width)


class _TableView:
    """:func:`render_table`'s renderable: laid out when printed, for the console it is printed on."""

    def __init__(self, table: Any, title: str | None, width: int | None) -> None:
        self.table, self.title, self.width = table, title, width

    def __rich_console__(self, console: Console, options: Any) -> Iterator[Any]:
        # no colour system: rich writes no style at all, bold included
        plain = console.color_system is None and any(e.bold for e in self.table.entries.values())
        width = out.width if self.width is None else self.width
        for layout in _LAYOUTS:
            t = _layout_table(self.table, self.title, layout, plain=plain)
            if layout == "long" or _fits(self.table, self.title, layout, t, width, plain):
                yield t
                return


PLAIN_BOLD = "*: the entries a colour terminal prints in bold"


def _natural_width(renderable: Any) -> int:
    """The widest line of ``renderable`` printed with no width limit (rich's own measure of a table
    ignores ``collapse_padding``)."""
    import io

    from rich.cells import cell_len

    c = Console(file=io.StringIO(), width=100_000, markup=False, highlight=False)
    with c.capture() as cap:
        c.print(renderable)
    return max((cell_len(line.rstrip()) for line in cap.get().splitlines()), default=0)


def _fits(table: Any, title: str | None, layout: str, t: Any, width: int, plain: bool = False) -> bool:
    if layout != "merged":
        return _natural_width(t) <= width
    # the options column wraps: the rest must fit with room left for it (its natural width, or 20)
    rest = _natural_width(_layout_table(table, title, layout, options_placeholder=True, plain=plain)) - len("options")
    options_width = max((len(_options_text(table, i)) for i in range(len(table.rows))), default=0)
    return width - rest >= min(options_width, 20)


def _options_text(table: Any, i: int) -> str:
    from poodle.report import key_name

    return ", ".join(f"{key_name(k)}={v}" for k, v in zip(table.row_keys, table.row_labels(i)) if v not in ("–", ""))


_FOLD_AT = 12  # a column label longer than this and than its entries is folded (:func:`_fold`)


def _fold(label: str, room: int) -> str:
    """``label`` with each line longer than ``room`` broken after a ``_``, ``-``, ``/`` or space into
    lines of at most ``room`` characters where it can: a long name (a domain's,
    ``birds_resnet12_features``) heads its column without widening it past its entries."""
    lines = []
    for line in label.split("\n"):
        if len(line) <= room:
            lines.append(line)
            continue
        current = ""
        for part in (p for p in re.findall(r"[^_/ -]*[_/ -]?", line) if p):
            if current and len(current + part.rstrip()) > room:
                lines.append(current.rstrip())
                current = ""
            current += part
        lines.append(current.rstrip())
    return "\n".join(lines)


def _layout_table(
    table: Any, title: str | None, layout: str, options_placeholder: bool = False, plain: bool = False
) -> Any:
    """The rich table of ``table`` in ``layout``; ``plain``: bold entries marked by a trailing ``*``
    (the others by a space, so the numbers stay aligned) and :data:`PLAIN_BOLD` under the table."""
    from rich import box
    from rich.table import Table

    from poodle.report import key_name

    if layout == "full":
        t = Table(show_lines=False, title=title)
    else:
        t = Table(show_lines=False, title=title, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    if plain:
        t.caption, t.caption_justify = PLAIN_BOLD, "left"
    merged = layout in ("merged", "long") and bool(table.row_keys)
    if merged:
        t.add_column("options", overflow="fold", ratio=1)
    else:
        for k in table.row_keys:
            t.add_column(key_name(k), overflow="fold")
    if layout == "long":
        t.add_column("column", overflow="fold")
        t.add_column("accuracy", justify="right", no_wrap=True)
    else:
        for j in range(len(table.cols)):
            room = max([_FOLD_AT, *(len(table.cell_text(i, j)) + plain for i in range(len(table.rows)))])
            t.add_column(_fold(table.col_label(j, sep="\n"), room), justify="right", no_wrap=True)
    for name, _ in table.extra:
        t.add_column(name, justify="right", no_wrap=True)

    def entry(i: int, j: int) -> Text:
        e = table.entries.get((i, j))
        bold = e is not None and e.bold
        mark = ("*" if bold else " ") if plain else ""
        return Text(table.cell_text(i, j) + mark, style="bold green" if bold else "")

    for i in range(len(table.rows)):
        if merged:
            labels = [Text("x" if options_placeholder else _options_text(table, i))]
        else:
            labels = [Text(v) for v in table.row_labels(i)]
        extra = [Text(texts[i]) for _, texts in table.extra]
        if layout != "long":
            t.add_row(*labels, *[entry(i, j) for j in range(len(table.cols))], *extra)
            continue
        present = [j for j in range(len(table.cols)) if (i, j) in table.entries] or [0]
        for n, j in enumerate(present):
            first = n == 0
            t.add_row(
                *(labels if first else [Text("")] * len(labels)),
                Text(table.col_label(j)),
                entry(i, j),
                *(extra if first else [Text("")] * len(extra)),
                end_section=n == len(present) - 1 and i < len(table.rows) - 1,
            )
    return t
