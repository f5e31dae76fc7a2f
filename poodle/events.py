"""What the library tells its caller while it works, as typed events rather than text.

Long-running functions (:func:`poodle.pipeline.run_cells` and the commands built on it,
:func:`poodle.extract.extract`) take one
callback, ``on_event(event)``, and call it with these; the command line turns them into progress bars
and lines. No component parses another's messages: whatever a caller may need to act on is a field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from poodle.errors import marked_params, plain


@dataclass(frozen=True)
class Ready:
    """Every check up front has passed (options, files, episodes, negatives, the memory bound);
    solving starts now. A caller starts its progress display here, so an error found before is
    reported alone."""


@dataclass(frozen=True)
class CellsStarted:
    """``cells`` (sharing episodes and negatives) are about to be solved together; ``done`` of
    ``total`` cells of the run are finished."""

    cells: tuple[Any, ...]
    done: int
    total: int


@dataclass(frozen=True)
class CellFinished:
    """``cell`` is finished: solved now and written (``skipped=False``), or found in the results file
    (``skipped=True``); ``record`` is its results record."""

    cell: Any
    record: dict[str, Any]
    done: int
    total: int
    skipped: bool = False


@dataclass(frozen=True)
class EpisodesSolved:
    """``episodes`` more episodes were solved by each of ``cells`` cells (one chunk)."""

    episodes: int
    cells: int = 1


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not an error. ``code`` names the kind
    (``preprocess-fallback``, ``other-records``, ...); ``params`` the parameters it speaks of: those
    given and each marked in the message (:func:`poodle.errors.mark`). ``message`` reads plain (the
    names as they are); ``marked_message`` keeps the marks, for a front end to write each its own way
    (:func:`poodle.errors.parts`)."""

    code: str
    message: str
    params: tuple[str, ...] = field(default=())
    marked_message: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # frozen: the plain text and the parameters are set once here, from the message as given
        marked = self.message
        object.__setattr__(self, "marked_message", marked)
        object.__setattr__(self, "message", plain(marked))
        object.__setattr__(self, "params", tuple(dict.fromkeys((*self.params, *marked_params(marked)))))


class NoticeWarning(UserWarning):
    """A :class:`Notice` from where no ``on_event`` callback reaches (the fused kernel's loader, deep
    inside a solver), raised with :func:`warnings.warn` once per process; the command line prints
    it as one note line, a library user sees a warning of this class."""

    def __init__(self, notice: Notice) -> None:
        super().__init__(notice.message)
        self.notice = notice


@dataclass(frozen=True)
class SplitWritten:
    """Split ``split`` is complete in the feature cache ``path``: ``images`` rows of ``classes``
    classes, ``skipped`` unreadable images left out, written by ``processes`` processes."""

    split: str
    path: Path
    images: int
    classes: int
    skipped: int = 0
    processes: int = 1


@dataclass(frozen=True)
class SplitReused:
    """Split ``split`` was already complete in ``path``, made from the same images: not recomputed."""

    split: str
    path: Path


@dataclass(frozen=True)
class SplitResumed:
    """Split ``split`` resumes an interrupted run: ``done`` of ``total`` images were already
    written, in the split's staging file (``shares=None``) or in ``shares`` staged shares of a
    torchrun run."""

    split: str
    done: int
    total: int
    shares: int | None = None


Event = Ready | CellsStarted | CellFinished | EpisodesSolved | Notice | SplitWritten | SplitReused | SplitResumed
OnEvent = Callable[[Event], None]


def ignore(event: Event) -> None:
    """The callback of a caller that listens to nothing."""


__all__ = [
    "CellFinished",
    "CellsStarted",
    "EpisodesSolved",
    "Event",
    "Notice",
    "NoticeWarning",
    "OnEvent",
    "Ready",
    "SplitResumed",
    "SplitReused",
    "SplitWritten",
    "ignore",
]
