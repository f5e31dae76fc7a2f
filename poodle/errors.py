"""Error types. Every error a user can cause is a :class:`PoodleError` whose message names the
culprit (file, row, class, key, shape); the command line prints it on one line and exits 1."""

import json
from typing import TypeVar

E = TypeVar("E", bound="PoodleError")


class PoodleError(Exception):
    """Base class of all errors caused by input (files, options, data), not by bugs.

    ``params`` names the library parameters the message speaks of (``n_neg``), so that a front end
    can say them its own way (the command line writes ``--n-neg``). An error about one value
    (:meth:`bad_value`) also carries the parameter, the value and the reason as fields, for a front
    end that places them itself (a grid file says ``option 'shot'`` at its line). An error whose
    message is free text carries ``param`` and ``value`` too, without a reason (an error about a
    file's content: the argument that named the file and its path), and its text is said as it is.
    ``hint`` is what another parameter would change (``skip_bad leaves unreadable images out``),
    printed after the message in parentheses; a caller that has no such parameter drops it by
    raising ``message``.
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
        self.params = tuple(params)
        self.param, self.value, self.reason, self.hint = param, value, reason, hint
        self.needs = dict(needs or {})

    @property
    def text(self) -> str:
        """The message alone: without what it needs and without the hint."""
        return super().__str__()

    @property
    def message(self) -> str:
        """The message without the hint (with what it needs, as a project file says it)."""
        if not self.needs:
            return self.text
        return f"{self.text}: add " + ", ".join(f"{k} = {_toml(v)}" for k, v in self.needs.items())

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    @classmethod
    def bad_value(cls: type[E], param: str, value: object, reason: str, others: tuple[str, ...] = ()) -> E:
        """The error of one value: ``"<param> <reason>, got <value>"``, with the three as fields;
        ``others`` are the parameters the reason names (``must be at most max_ways_upper_bound=3``)."""
        return cls(f"{param} {reason}, got {value!r}", params=(param, *others), param=param, value=value, reason=reason)


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
