"""Error types. Every error a user can cause is a :class:`PoodleError` whose message names the
culprit (file, row, class, key, shape); the command line prints it on one line and exits 1."""


class PoodleError(Exception):
    """Base class of all errors caused by input (files, options, data), not by bugs.

    ``params`` names the library parameters the message speaks of (``n_neg``), so that a front end
    can say them its own way (the command line writes ``--n-neg``)."""

    def __init__(self, *args: object, params: tuple[str, ...] = ()) -> None:
        super().__init__(*args)
        self.params = tuple(params)


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
