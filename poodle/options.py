"""The settings schema: every option and setting declared once, as a dataclass field with its bounds.

A config dataclass (a method's, the training recipe's) or a settings group (:class:`poodle.episodes.
EpisodeSpec`, :class:`poodle.negatives.NegativeSpec`, :class:`poodle.pipeline.RunOptions` ...)
declares each field as

    lr: float = option(1e-3, min=0, min_open=True)     # (0, inf)
    alpha: float = option(2.0, min=0, exclude={1.0: "the Shannon limit: use tim-gd"})
    way: int = option(5, min=2, why="a 1-way episode is always right", help="Classes per episode.")
    source: str = option("base", key="negatives", metavar="base|random|sphere|none|FILE[:SPLIT]")
    query_classes: int | None = option(None, min=1, when_set=True, none_words=("all",))

and everything else is read from these declarations: the command line's options (name, type, help,
default: ``poodle.cli._schema``), the project file's keys and their type checks, a grid file's axes,
the keys a result identity records (a ``when_set`` field only when it differs from its default, so
that records written before it existed keep their hash), the checks of a value (:func:`check_value`)
and of a whole group (:func:`check_group`), and the docs' option tables (:func:`table`). Nothing
else declares a bound, a type or a default of a setting: a group that passes a setting on to
another stage's takes that declaration with its own default (:func:`option_like`:
``DemoConfig.lr = option_like(TrainConfig, "lr", 0.1)``). A field ``tuple[int, ...]`` is a
sequence setting (``milestones``: each item checked by the bounds; ``60,80`` on the command line).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from poodle.errors import ConfigError


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
    why: str = "",
    key: str | None = None,
    choices: Sequence[str] | None = None,
    when_set: bool = False,
    cli_type: str | None = None,
    metavar: str | None = None,
    none_words: Sequence[str] = (),
    convert: Callable[[Any], Any] | None = None,
    cli: bool = True,
    default_text: str | None = None,
) -> Any:
    """A dataclass field whose value must lie between ``min`` and ``max`` (excluded where open) and
    differ from the keys of ``exclude`` (each mapped to the reason).

    The rest describes the setting for everyone who reads it: ``help`` (the command line's and the
    docs' text), ``why`` (the reason of the bound, said with a refused value), ``key`` (the setting's
    name everywhere outside the class, where it differs from the field's: ``NegativeSpec.source`` is
    ``negatives``), ``choices`` (the strings it may be), ``when_set`` (recorded in a result's identity
    only when it differs from its default), ``cli_type`` (a command-line type beyond the annotation's:
    ``"size"``, a memory size like 2GiB), ``metavar``, ``none_words`` (strings a file may write for
    None besides ``"none"``), ``convert`` (the canonical form of a valid value, e.g. ``power`` ->
    ``power:0.5``; raises :class:`poodle.errors.PoodleError` for a bad one), ``cli`` (False: no
    command-line option is generated for it) and ``default_text`` (how the default reads where help
    and the docs show it, when its value does not read well: ``log(1/2) = -0.693``)."""
    bounds = Bounds(
        -math.inf if min is None else min,
        math.inf if max is None else max,
        min_open,
        max_open,
        dict(exclude or {}),
    )
    metadata = {
        "bounds": bounds,
        "help": help,
        "why": why,
        "key": key,
        "choices": tuple(choices) if choices is not None else None,
        "when_set": when_set,
        "cli_type": cli_type,
        "metavar": metavar,
        "none_words": tuple(none_words),
        "convert": convert,
        "cli": cli,
        "default_text": default_text,
    }
    return field(default=default, metadata=metadata)


_KEEP: Any = object()


def option_like(group: type, key: str, default: Any = _KEEP, **changes: Any) -> Any:
    """A field declared as ``group``'s setting ``key`` is (its bounds, type checks, help, reason),
    with ``default`` and any other :func:`option` argument in ``changes`` (``help``, ``cli`` ...) its
    own: a stage that passes a setting on to another stage's group (``poodle demo`` trains with
    :class:`poodle.train.TrainConfig`) takes its declaration instead of writing a second one.
    ``min``/``max`` cannot be changed here: a bound is its declaration's."""
    assert not {"min", "max", "min_open", "max_open", "exclude"} & set(changes), "a bound is its declaration's"
    f = setting(group, key).field
    meta = dict(f.metadata)
    unknown = set(changes) - set(meta)
    assert not unknown, f"option() takes no {unknown}"
    meta.update({k: tuple(v) if k in ("choices", "none_words") and v is not None else v for k, v in changes.items()})
    return field(default=f.default if default is _KEEP else default, metadata=meta)


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


# ---------------------------------------------------------------------------------------------
# The schema of a settings group, read from its fields


@dataclass(frozen=True)
class Setting:
    """One declared setting: its field in ``owner`` and what :func:`option` said about it."""

    owner: type
    field: dataclasses.Field

    @property
    def name(self) -> str:
        """The field's name (the attribute of the group)."""
        return self.field.name

    @property
    def key(self) -> str:
        """The setting's name outside the class: project-file key, grid axis, identity key, parameter."""
        return self.field.metadata.get("key") or self.field.name

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def default(self) -> Any:
        return None if self.field.default is dataclasses.MISSING else self.field.default

    @property
    def kind(self) -> type:
        """``int``, ``float``, ``str`` or ``bool`` (what the value is when it is not None)."""
        return _value_type(typing.get_type_hints(self.owner)[self.name])[0]

    @property
    def mixed(self) -> bool:
        """Whether the value may be of several types (``str | int``: a size as text or bytes)."""
        real = [m for m in typing.get_args(typing.get_type_hints(self.owner)[self.name]) if m is not type(None)]
        return len(real) > 1

    @property
    def many(self) -> bool:
        """Whether the value is a sequence of ``kind`` (``tuple[int, ...]``: the lr decay's epochs);
        the command line writes it comma-separated (``60,80``)."""
        return _value_type(typing.get_type_hints(self.owner)[self.name])[2]

    @property
    def optional(self) -> bool:
        """Whether None is a value (``int | None``)."""
        return _value_type(typing.get_type_hints(self.owner)[self.name])[1]

    def meta(self, name: str) -> Any:
        return self.field.metadata.get(name)

    @property
    def bounds(self) -> Bounds | None:
        return bounds(self.field)

    def describe(self) -> str:
        """What the values are, as the docs' tables and a refused value say it (``an integer >= 2``)."""
        if self.many:
            return "a comma-separated list, each " + self._describe_one()
        return self._describe_one()

    def _describe_one(self) -> str:
        if self.meta("choices"):
            return "one of " + ", ".join(self.meta("choices"))
        if self.meta("cli_type") == "size":
            return "a size (2GiB, 512MiB) or a number of bytes"
        b = self.bounds
        if self.kind is int:
            if b is None or (b.lo == -math.inf and b.hi == math.inf):
                return "an integer"
            lo = b.lo + 1 if b.lo_open else b.lo
            hi = b.hi - 1 if b.hi_open else b.hi
            if hi == math.inf:
                return "a positive integer" if lo == 1 else f"an integer >= {lo:g}"
            return f"an integer in {lo:g}..{hi:g}" if hi < 1e15 else f"an integer in {lo:g}..{int(hi)}"
        if self.kind is float:
            return "a number" if b is None or str(b) == "(-inf, inf)" else f"a number in {b}"
        if self.kind is bool:
            return "true or false"
        return "a non-empty string"


def _value_type(annotation: Any) -> tuple[type, bool, bool]:
    """``(int, True, False)`` for ``int | None``, ``(float, False, False)`` for ``float``, ``(int,
    False, True)`` for ``tuple[int, ...]`` (a sequence of them); str for anything else."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) is not tuple else ()
    members = members or (annotation,)
    real = [m for m in members if m is not type(None)]
    many = len(real) == 1 and typing.get_origin(real[0]) is tuple
    if many:
        real = [typing.get_args(real[0])[0]]
    kind = real[0] if len(real) == 1 and real[0] in (int, float, str, bool) else str
    if float in real and int in real:
        kind = float
    return kind, type(None) in members, many


def settings(cls: type) -> list[Setting]:
    """The declared settings of a group (every field made by :func:`option`), in field order."""
    return [Setting(cls, f) for f in dataclasses.fields(cls) if "bounds" in f.metadata]


def setting(cls: type, key: str) -> Setting:
    """The setting of ``cls`` called ``key`` (its key or field name); KeyError when none is."""
    for s in settings(cls):
        if key in (s.key, s.name):
            return s
    raise KeyError(key)


def check_value(s: Setting, value: Any, error: type[Exception] | None = None, *, files: bool = False) -> Any:
    """``value`` of setting ``s``, checked and in its canonical form, or ``error.bad_value(key,
    value, reason)`` (a :class:`poodle.errors.ConfigError` by default). ``files``: the value comes from
    a file (TOML has no null and writes 3 for 3.0): ``"none"``, the field's ``none_words`` and (for
    an optional number) ``false`` mean None, an integral float is an integer."""
    err: Any = error or ConfigError
    kind = s.kind
    if (
        files
        and s.optional
        and (
            (value is False and kind is not bool)
            or (isinstance(value, str) and value.lower() in ("none", *s.meta("none_words")))
        )
    ):
        value = None
    if value is None:
        if s.optional:
            return None
        raise err.bad_value(s.key, value, f"must be {s.describe()}")
    if s.many:
        return _check_many(s, value, err, files)
    return _check_one(s, value, err, files)


def _check_many(s: Setting, value: Any, err: Any, files: bool) -> tuple:
    """A sequence setting's value: each item checked as the setting's kind and bounds (said with
    the whole value), the sequence as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise err.bad_value(s.key, value, f"must be {s.describe()}")
    items = []
    for item in value:
        try:
            items.append(_check_one(s, item, ConfigError, files))
        except ConfigError:
            raise err.bad_value(s.key, value, f"must be {s.describe()}") from None
    return tuple(items)


def _check_one(s: Setting, value: Any, err: Any, files: bool) -> Any:
    kind = s.kind
    why = f" ({s.meta('why')})" if s.meta("why") else ""
    if s.mixed:  # its own type checks it where it is used (a size: poodle.utils.parse_size)
        return value
    if kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise err.bad_value(s.key, value, "must be true or false")
        return bool(value)
    if kind is str:
        if not isinstance(value, str) or not value:
            raise err.bad_value(s.key, value, f"must be {s.describe()}")
        if s.meta("choices") and value not in s.meta("choices"):
            raise err.bad_value(s.key, value, f"must be {s.describe()}")
        convert = s.meta("convert")
        return convert(value) if convert else value
    if isinstance(value, bool) or not _is_number(value):
        raise err.bad_value(s.key, value, f"must be {s.describe()}{why}")
    if kind is int:
        if files and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not _is_integer(value):
            raise err.bad_value(s.key, value, f"must be {s.describe()}{why}")
        value = int(value)
    else:
        value = float(value)
    if not math.isfinite(value):
        raise err.bad_value(s.key, value, "must be a finite number")
    b = s.bounds
    if b is not None:
        bad = b.violation(value)
        if bad is not None:
            reason = f"must be {s.describe()}" if bad.startswith("must lie") else bad
            raise err.bad_value(s.key, value, reason + why)
    convert = s.meta("convert")
    return convert(value) if convert else value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating))


def _is_integer(v: Any) -> bool:
    return isinstance(v, (int, np.integer))


def check_group(obj: Any, error: type[Exception] | None = None) -> None:
    """Every declared setting of the group ``obj`` checked (:func:`check_value`); the first bad one
    raises ``error.bad_value`` naming its key."""
    for s in settings(type(obj)):
        check_value(s, getattr(obj, s.name), error)


def build(cls: type, values: Mapping[str, Any], error: type[Exception] | None = None, *, files: bool = False) -> Any:
    """An instance of group ``cls`` from ``{key: value}`` (keys or field names; absent or None: the
    default unless the setting is optional), every value checked. Other keys are ignored."""
    kw = {}
    for s in settings(cls):
        for k in (s.key, s.name):
            if k in values and (values[k] is not None or s.optional):
                kw[s.name] = check_value(s, values[k], error, files=files)
                break
    return cls(**kw)


def recorded(obj: Any) -> dict[str, Any]:
    """``{key: value}`` of the group ``obj`` as a result identity records it: every setting, but a
    ``when_set`` one only when it differs from its default."""
    out = {}
    for s in settings(type(obj)):
        v = getattr(obj, s.name)
        if s.meta("when_set") and v == s.default:
            continue
        out[s.key] = v
    return out


def table(*groups: type) -> str:
    """The groups' settings as a Markdown table (the docs' option tables are these, checked by a test)."""
    rows = ["| setting | flag | default | values | meaning |", "|---|---|---|---|---|"]
    for cls in groups:
        for s in settings(cls):
            d = "none" if s.default is None else str(s.default).lower() if isinstance(s.default, bool) else s.default
            d = ",".join(map(str, d)) if isinstance(d, tuple) else d
            d = s.meta("default_text") or d
            values = s.describe() + (" or none" if s.optional else "")
            why = f" ({s.meta('why')})" if s.meta("why") else ""
            flag = f"`{s.flag}`" if s.meta("cli") else "(none generated)"
            rows.append(f"| `{s.key}` | {flag} | `{d}` | {values}{why} | {s.meta('help').replace('|', '/')} |")
    return "\n".join(rows) + "\n"


__all__ = [
    "Bounds",
    "Setting",
    "bounds",
    "build",
    "check_group",
    "check_value",
    "option",
    "option_like",
    "recorded",
    "setting",
    "settings",
    "table",
    "violation",
]
