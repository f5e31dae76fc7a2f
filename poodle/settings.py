"""The settings of a cell, declared once: the groups whose fields every command, file and record reads.

A cell (:mod:`poodle.cells`) is one method on one episode setting. Its settings are the fields of
four groups, each declared with :func:`poodle.options.option` in the module that uses them:

- :class:`poodle.episodes.EpisodeSpec`: how the episodes are drawn (``way``, ``shot`` ...);
- :class:`poodle.episodes.CellSpec`: the cache, the method and the number of episodes (beside
  EpisodeSpec: the sampler checks the number of episodes by it);
- :class:`poodle.negatives.NegativeSpec`: ``negatives`` and ``n_neg``;
- :class:`poodle.preprocess.PreprocessSpec`: ``preprocess``.

Everything else is derived from them here: the keys a grid file and ``poodle solve`` take
(:data:`GENERAL_KEYS`), their defaults (:func:`general_defaults`), the check of one value as a file
writes it (:func:`check_setting`), the keys of a result identity's ``episode`` (:data:`EPISODE_KEYS`,
:data:`WHEN_SET_EPISODE_KEYS`) and the keys that pair results (:data:`PAIRING_KEYS`). A new setting
is a new field of its group; nothing here names one.
"""

from __future__ import annotations

from typing import Any

from poodle.episodes import CellSpec, EpisodeSpec
from poodle.errors import ConfigError, EpisodeError
from poodle.negatives import NegativeSpec
from poodle.options import Setting, check_value, settings, table
from poodle.preprocess import PreprocessSpec
from poodle.run import RunOptions

# The groups of a cell's settings.
GROUPS: tuple[type, ...] = (EpisodeSpec, NegativeSpec, PreprocessSpec, CellSpec)
SETTINGS: dict[str, Setting] = {s.key: s for g in GROUPS for s in settings(g)}

# The episode setting as a result identity records it: EpisodeSpec's fields and ``episodes`` (always),
# then the ``when_set`` fields (only when they differ from their default, so that results written
# before such a field existed keep their keys and hashes).
EPISODE_KEYS: tuple[str, ...] = tuple(s.key for s in settings(EpisodeSpec) if not s.meta("when_set")) + ("episodes",)
WHEN_SET_EPISODE_KEYS: tuple[str, ...] = tuple(s.key for s in settings(EpisodeSpec) if s.meta("when_set"))
# Results that agree on these were solved on identical episodes (so they are paired).
PAIRING_KEYS: tuple[str, ...] = ("cache",) + EPISODE_KEYS + WHEN_SET_EPISODE_KEYS
# Every setting of a cell besides the method's options (grid axes, ``poodle solve``'s settings): those
# that choose the episodes first (a grid's product keeps cells on the same episodes adjacent), then
# the negatives, the preprocessing and the method.
GENERAL_KEYS: tuple[str, ...] = PAIRING_KEYS + tuple(k for k in SETTINGS if k not in PAIRING_KEYS)


def general_defaults() -> dict[str, Any]:
    """``{key: default}`` of every general setting (``cache`` has none)."""
    return {k: s.default for k, s in SETTINGS.items() if s.default is not None}


def error_of(key: str) -> type[Exception]:
    """The error class of a setting's group: EpisodeError for the episode setting, else ConfigError."""
    return EpisodeError if SETTINGS[key].owner in (EpisodeSpec, CellSpec) else ConfigError


def check_setting(key: str, value: Any) -> Any:
    """The value of general setting ``key`` as a file or a caller wrote it, checked by its declaration
    and in its canonical form (``power`` -> ``power:0.5``; ``"none"`` for an optional one -> None); a
    :class:`poodle.errors.PoodleError` carrying the key and the value otherwise. Rules between
    settings (``query_classes <= way``) are the group's, checked when the cell's whole setting is."""
    if key not in SETTINGS:
        raise ConfigError(f"unknown setting {key!r}", params=(key,), param=key, value=value)
    return check_value(SETTINGS[key], value, error_of(key), files=True)


def episode_record(values: dict[str, Any]) -> dict[str, Any]:
    """The ``episode`` of a result identity from a mapping holding every episode setting: the keys of
    :data:`EPISODE_KEYS`, then each of :data:`WHEN_SET_EPISODE_KEYS` that differs from its default."""
    out = {k: values[k] for k in EPISODE_KEYS}
    for k in WHEN_SET_EPISODE_KEYS:
        if values.get(k, SETTINGS[k].default) != SETTINGS[k].default:
            out[k] = values[k]
    return out


def markdown_tables() -> str:
    """The option tables of docs/settings.md, generated from the declarations (a test checks that the
    page holds them; ``python -m poodle.settings`` prints them)."""
    # imported here: they load the backbones and the training loop, which results readers need not
    from poodle.demo_settings import DemoConfig
    from poodle.extract import ExtractOptions
    from poodle.train import TrainConfig

    parts = [
        ("A cell's settings (`poodle solve` options, grid and project-file keys, results identity)", GROUPS),
        (
            "How cells are solved (`poodle solve`, `poodle grid`: `RunOptions`; nothing here changes a result)",
            (RunOptions,),
        ),
        ("How features are extracted (`poodle extract`, `poodle predict`: `ExtractOptions`)", (ExtractOptions,)),
        ("How a backbone is trained (`poodle train`: `TrainConfig`)", (TrainConfig,)),
        (
            "The demo (`poodle demo`: `DemoConfig`; a setting it passes on is declared by the stage it is "
            "passed to, with the demo's default)",
            (DemoConfig,),
        ),
    ]
    return "\n".join(f"### {title}\n\n{table(*groups)}" for title, groups in parts)


if __name__ == "__main__":
    print(markdown_tables(), end="")


__all__ = [
    "EPISODE_KEYS",
    "GENERAL_KEYS",
    "GROUPS",
    "PAIRING_KEYS",
    "SETTINGS",
    "WHEN_SET_EPISODE_KEYS",
    "CellSpec",
    "check_setting",
    "episode_record",
    "error_of",
    "general_defaults",
    "markdown_tables",
]
