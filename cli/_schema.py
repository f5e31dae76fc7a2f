"""The command line's options of the settings schema: made from the declarations, never written here.

A settings group (:class:`poodle.episodes.EpisodeSpec`, :class:`poodle.negatives.NegativeSpec`,
:class:`poodle.pipeline.RunOptions` ...) declares each setting once with
:func:`poodle.options.option`; :func:`schema_options` turns its fields into click options (flag,
type, default, help, metavar), so that a new field is a new option of every command that takes its
group, and a key of the project file (whose keys are the options' names). Bounds are not click's:
the library checks every value by its declaration and says it with the parameter and the value,
which :func:`flag_message` writes with the flag (one rule, one message, on every command).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import click

from poodle.errors import PoodleError
from poodle.options import Setting, settings


class SizeType(click.ParamType):
    """A memory size like 4GiB or 512MiB, converted to bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from poodle.utils import parse_size

        try:
            return parse_size(value)
        except PoodleError as e:
            self.fail(str(e), param, ctx)


class ListType(click.ParamType):
    """A comma-separated list (``60,80``) of a sequence setting's items, as a tuple; a word of the
    setting's ``none_words`` (``auto``) is None. Each item's bound is the library's check."""

    def __init__(self, kind: type, none_words: tuple[str, ...]) -> None:
        self.kind, self.none_words = kind, none_words
        self.name = {int: "integers", float: "numbers"}.get(kind, "list")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None:
            return value
        if isinstance(value, (list, tuple)):  # a project file's list, or a default
            return tuple(value)
        if str(value).strip().lower() in self.none_words:
            return None
        try:
            return tuple(self.kind(v) for v in str(value).split(",") if v.strip())
        except ValueError:
            self.fail(f"expected comma-separated {self.name} like 60,80, got {value!r}", param, ctx)


class SettingOption(click.Option):
    """A click option made from a declared setting (:func:`click_option`): ``setting`` is the
    declaration (tests/test_code_rules.py tells it from an option written by hand). Its help ends
    as click ends a ranged option's: ``[default: 5; x>=2]``, the default as the declaration says it
    (``default_text``) and the range its bounds (:func:`range_text`), on every command alike."""

    def __init__(self, *args: Any, setting: Setting, default_text: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setting = setting
        self.default_text = default_text

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        if self.default_text is not None:
            extra["default"] = self.default_text
        described = range_text(self.setting)
        if described:
            extra["range"] = described
        return extra


def range_text(s: Setting) -> str | None:
    """The bounds of setting ``s`` as click writes a range (``x>=2``, ``x>0``, ``0<=x<1``; a list's:
    ``each x>=1``); None for a setting without bounds."""
    b = s.bounds
    if b is None or s.meta("choices") or s.kind not in (int, float):
        return None
    lo, hi, lo_open, hi_open = b.lo, b.hi, b.lo_open, b.hi_open
    if s.kind is int:  # an integer's open bound is the closed one next to it (as the docs say it)
        lo, hi = (lo + 1 if lo_open else lo), (hi - 1 if hi_open else hi)
        lo_open = hi_open = False

    def num(x: float) -> str:
        return f"{x:g}"

    # a seed's int64 limit is no limit to say
    low = None if lo <= -(2**53) else (f"{num(lo)}<" if lo_open else f"{num(lo)}<=")
    high = None if hi >= 2**53 else (f"<{num(hi)}" if hi_open else f"<={num(hi)}")
    if low is None and high is None:
        return None
    if high is None:
        text = f"x>{num(lo)}" if lo_open else f"x>={num(lo)}"
    else:
        text = f"{low or ''}x{high}"
    return f"each {text}" if s.many else text


def _click_type(s: Setting) -> Any:
    if s.many:
        return ListType(s.kind, s.meta("none_words"))
    if s.meta("cli_type") == "size":
        return SizeType()
    if s.meta("choices"):
        return click.Choice(s.meta("choices"))
    return {int: click.INT, float: click.FLOAT, bool: click.BOOL}.get(s.kind, click.STRING)


def click_option(s: Setting, **given: Any) -> Callable[[Any], Any]:
    """The click option of setting ``s``: ``--key`` (dashes for underscores), named ``key``; ``given``
    (``default``, ``help``, ``metavar``, ``envvar``) replaces the declaration's where a command
    differs (``poodle predict`` decodes its few images in-process: ``workers`` 0)."""
    default = given.get("default", s.default)
    text = given.get("help", s.meta("help"))
    shown = default is not None and not s.meta("cli_type")
    # said as click writes a default (click would put a text of ours in parentheses): SettingOption
    default_text = s.meta("default_text") if "default" not in given else None
    if s.kind is bool and not s.many:
        # said both ways (--amp/--no-amp): a flag typed overrides a project file's value either way,
        # and an optional one (None: the library decides) can be said on or off
        return click.option(
            f"{s.flag}/--no-{s.flag[2:]}",
            s.key,
            cls=SettingOption,
            setting=s,
            default_text=default_text,
            default=default,
            show_default=shown,
            help=text,
        )
    return click.option(
        s.flag,
        s.key,
        cls=SettingOption,
        setting=s,
        default_text=default_text,
        type=_click_type(s),
        default=default,
        show_default=shown,
        metavar=given.get("metavar", s.meta("metavar")),
        envvar=given.get("envvar"),
        show_envvar=given.get("envvar") is not None,
        help=text,
    )


def schema_options(
    *groups: type,
    only: Iterable[str] | None = None,
    but: Iterable[str] = (),
    changed: dict[str, dict[str, Any]] | None = None,
) -> Callable[[Any], Any]:
    """A decorator adding the options of ``groups``' settings (those with a command-line option; of
    them only the keys in ``only`` when given, and never those in ``but``), in declaration order;
    ``changed`` gives a command's own ``default`` or ``help`` of a key. A command that takes a
    group's options but a few names those few in ``but``: a setting added to the group is then an
    option of the command without another line here."""
    keep, leave = None if only is None else set(only), set(but)
    offered = [s for g in groups for s in settings(g) if s.meta("cli")]
    missing = ((keep or set()) | leave) - {s.key for s in offered}
    assert not missing, f"no such settings: {missing}"
    chosen = [s for s in offered if (keep is None or s.key in keep) and s.key not in leave]

    def decorate(fn: Any) -> Any:
        for s in reversed(chosen):
            fn = click_option(s, **(changed or {}).get(s.key, {}))(fn)
        return fn

    return decorate


def run_options(params: dict[str, Any], cls: type) -> Any:
    """An instance of group ``cls`` from a command's parameters (those it has an option for)."""
    return cls(**{s.name: params[s.key] for s in settings(cls) if s.key in params})


def given(ctx: click.Context, params: dict[str, Any]) -> dict[str, Any]:
    """Of a command's ``params``, those given (typed, from the project file or an environment
    variable), not left at their option's default: what a command passes on when the library's
    default depends on other settings (``poodle demo --quick`` takes 1 epoch unless one is given)."""
    from click.core import ParameterSource

    return {k: v for k, v in params.items() if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}


def flag_message(flag: str, error: Any, reason: str | None = None) -> str | None:
    """An error about one value (``param``, ``value``, ``reason``: :meth:`PoodleError.bad_value`) said
    with its flag: ``--way must be an integer >= 2, got 1``; None for an error that is not one.
    ``reason`` replaces the error's (the same with the other parameters it names as flags)."""
    if getattr(error, "param", None) is None or getattr(error, "reason", None) is None:
        return None
    return f"{flag} {error.reason if reason is None else reason}, got {error.value!r}"


__all__ = [
    "ListType",
    "SettingOption",
    "click_option",
    "flag_message",
    "range_text",
    "given",
    "run_options",
    "schema_options",
]
