"""Error types. Every error a user can cause is a :class:`PoodleError` whose message names the
culprit (file, row, class, key, shape); the command line prints it on one line and exits 1.

A message names a library parameter through :func:`mark` (``f"{mark('n_neg')} must be >= 1"``): the
name is wrapped in two private characters that every text a person reads leaves out (``str(error)``,
``error.text``, ``error.hint``, a :class:`poodle.events.Notice`'s ``message``), so a Python caller and
a log see ``n_neg must be >= 1``; a front end splits the marked text with :func:`parts` and writes each
marked name its own way (the command line: ``--n-neg must be >= 1``), never searching the words."""

import json
from dataclasses import dataclass
from typing import TypeVar

E = TypeVar("E", bound="PoodleError")

# Unicode's private use area: no text a user writes or a file holds carries them, and one that leaked
# to a terminal would show (a box) rather than act (a C0 control such as SO switches the character set).
_OPEN, _CLOSE = "\ue000", "\ue001"


def mark(param: str) -> str:
    """``param`` (a library parameter's name, ``n_neg``) marked in a message: said as the name in the
    message's text, as its flag by the command line (:func:`parts`). An error or a notice whose text
    holds a marked name speaks of that parameter (it joins ``params``)."""
    return f"{_OPEN}{param}{_CLOSE}"


@dataclass(frozen=True)
class Param:
    """A marked parameter name in a message's :func:`parts`."""

    name: str


def parts(text: str) -> list["str | Param"]:
    """``text`` (a message, its parameter names marked by :func:`mark`) as its plain pieces and its
    marked names, in order: ``["", Param("n_neg"), " must be >= 1"]`` joined back by a front end."""
    out: list[str | Param] = []
    rest = text
    while True:
        start = rest.find(_OPEN)
        end = rest.find(_CLOSE, start + 1) if start >= 0 else -1
        if end < 0:
            out.append(rest)
            return out
        out += [rest[:start], Param(rest[start + 1 : end])]
        rest = rest[end + 1 :]


def plain(text: str) -> str:
    """``text`` with its marked names written as the names themselves: what a person reads."""
    return text.replace(_OPEN, "").replace(_CLOSE, "")


def marked_params(*texts: "str | None") -> tuple[str, ...]:
    """The parameter names marked in ``texts``, each once, in order."""
    found = (p.name for t in texts if t for p in parts(t) if isinstance(p, Param))
    return tuple(dict.fromkeys(found))


class PoodleError(Exception):
    """Base class of all errors caused by input (files, options, data), not by bugs.

    ``params`` names the library parameters the message speaks of (``n_neg``), so that a front end
    can say them its own way (the command line writes ``--n-neg``): each name marked in the message,
    its hint or its reason (:func:`mark`), and those given as ``params=`` (a parameter the text does
    not name, such as the option that would change it). The text, the hint and the reason are read
    plain (``text``, ``message``, ``hint``, ``reason``, ``str(error)``: the names as they are);
    ``marked_text``, ``marked_message``, ``marked_hint`` and ``marked_reason`` keep the marks, for a
    front end (:func:`parts`) and for an error raised again with context (``f"{where}:
    {e.marked_text}"``, ``hint=e.marked_hint``: the new error keeps the marks). An error about one value
    (:meth:`bad_value`) also carries the parameter, the value and the reason as fields, for a front
    end that places them itself (a grid file says ``option 'shot'`` at its line). An error whose
    message is free text carries ``param`` and ``value`` too, without a reason (an error about a
    file's content: the argument that named the file and its path), and its text is said as it is
    (its marked names as the front end writes them).
    ``hint`` is what another parameter would change (``skip_bad leaves unreadable images out``),
    printed after the message in parentheses; a caller that has no such parameter drops it by
    raising ``marked_message``.
    ``needs`` are the settings that would make the input valid (``{"protocol": "meta-dataset"}``):
    the text adds ``: add protocol = "meta-dataset"`` as a project file or grid writes it, and a front
    end says them its own way (the command line: ``add --protocol meta-dataset``), from ``text``."""

    def __init__(
        self,
        *args: object,
        params: tuple[str, ...] = (),
        param: str | None = None,
        value: object = None,
        reason: str | None = None,
        hint: str | None = None,
        needs: dict[str, object] | None = None,
    ) -> None:
        super().__init__(*args)
        self.marked_text, self.marked_hint, self.marked_reason = super().__str__(), hint, reason
        self.params = tuple(dict.fromkeys((*params, *marked_params(self.marked_text, hint, reason))))
        self.param, self.value = param, value
        self.needs = dict(needs or {})

    @property
    def text(self) -> str:
        """The message alone: without what it needs and without the hint."""
        return plain(self.marked_text)

    @property
    def hint(self) -> str | None:
        """What another parameter would change, or None."""
        return None if self.marked_hint is None else plain(self.marked_hint)

    @property
    def reason(self) -> str | None:
        """Why the value of an error about one value (:meth:`bad_value`) is refused, or None."""
        return None if self.marked_reason is None else plain(self.marked_reason)

    @property
    def message(self) -> str:
        """The message without the hint (with what it needs, as a project file says it)."""
        return plain(self.marked_message)

    @property
    def marked_message(self) -> str:
        """:attr:`message` with its parameter names marked."""
        if not self.needs:
            return self.marked_text
        return f"{self.marked_text}: add " + ", ".join(f"{k} = {_toml(v)}" for k, v in self.needs.items())

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    @classmethod
    def bad_value(cls: type[E], param: str, value: object, reason: str, others: tuple[str, ...] = ()) -> E:
        """The error of one value: ``"<param> <reason>, got <value>"``, with the three as fields and
        ``param`` marked; the parameters the reason names are marked in it (``must be at most
        {mark('max_ways_upper_bound')}=3``), or given as ``others``."""
        return cls(
            f"{mark(param)} {reason}, got {value!r}", params=(param, *others), param=param, value=value, reason=reason
        )


def _toml(value: object) -> str:
    """``value`` as TOML writes it, to paste into a project file or a grid: a string quoted, a flag
    ``true``/``false``, a number as it is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else str(value)


class DataError(PoodleError):
    """A dataset root, split file, row or image is missing or malformed."""


class CacheError(PoodleError):
    """A feature cache is missing, foreign, incomplete or inconsistent."""


class CheckpointError(PoodleError):
    """A checkpoint does not fit the backbone it is loaded into."""


class EpisodeError(PoodleError):
    """Episode settings that the data cannot satisfy (too few classes or images)."""


class ConfigError(PoodleError):
    """An unknown option, a value of the wrong type, or an impossible combination."""


class WriteError(PoodleError):
    """A file could not be written to the end (a full disk, a quota, a file-size limit, a folder
    that became read-only): ``path`` is the file as the caller named it, ``errno`` the system's
    code. Whoever raises it has left every file that existed before as it was (a temporary is
    removed, an append is cut back)."""

    def __init__(self, *args: object, path: str = "", errno: int | None = None) -> None:
        super().__init__(*args)
        self.path, self.errno = path, errno
