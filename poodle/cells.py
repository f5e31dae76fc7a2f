"""Cells: one configured method on one episode setting, the unit that every command solves.

A cell is made in one place, :func:`make_cell`, from values as a user gives them (``poodle solve``'s
parameters, one combination of a grid file, a row of the demo's table): every value is checked
there, once, by the rule that owns it (the episode setting: :meth:`EpisodeSpec.validate`; the
negatives: :meth:`NegativeSpec.validate` and :meth:`SolverInfo.check_negatives`; a method's
options: :func:`poodle.solvers.make_config`; the preprocessing: :func:`poodle.preprocess.parse`).
A cell then holds only resolved values: the method's whole configuration (presets resolved), the
negatives it reads (``"none"`` for a method that reads none) and whether it uses the queries.

Its identity in the results layer (:meth:`Cell.result_identity`) adds the content fingerprints of
the files it reads; :func:`poodle.results.make_identity` is the one function that assembles it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from poodle import defaults, solvers
from poodle.defaults import EPISODE_KEYS, GENERAL_DEFAULTS, GENERAL_KEYS, NEGATIVE_KEYWORDS, OPTIONAL_EPISODE_KEYS
from poodle.episodes import EpisodeSpec, check_count
from poodle.errors import ConfigError, PoodleError
from poodle.negatives import NegativeSpec
from poodle.options import violation
from poodle.preprocess import parse
from poodle.results import jsonable, make_identity, record_flat
from poodle.utils import content_hash

# The episode settings of a cell: EpisodeSpec's fields and the number of episodes.
EPISODE_FIELDS: tuple[str, ...] = EPISODE_KEYS[1:]


@dataclass(frozen=True)
class Locations:
    """Where the files a cell names are: ``[caches]`` names of a grid file and the folder that
    relative paths resolve against (a grid file's folder; the working directory otherwise)."""

    base_dir: Path | None = None
    caches: Mapping[str, str] = field(default_factory=dict)

    def cache_file(self, cache: str) -> Path:
        """A cell's ``cache`` (a ``[caches]`` name or a path) as a file path."""
        path = Path(self.caches.get(cache, cache)).expanduser()
        return path if path.is_absolute() or self.base_dir is None else self.base_dir / path

    def negatives(self, source: str) -> tuple[str, Path | None]:
        """``(source as the negatives module reads it, pool file or None)``: keywords unchanged; a
        ``[caches]`` name ``NAME[:SPLIT]`` becomes ``FILE:SPLIT`` (split ``train`` by default: the
        out-of-distribution pool of the paper's Table 5 is the train split of another dataset)."""
        if source in NEGATIVE_KEYWORDS:
            return source, None
        name, _, split = source.partition(":")
        if name in self.caches:
            path = self.cache_file(name)
            return f"{path}:{split or 'train'}", path
        path = Path(name).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        return (f"{path}:{split}" if split else str(path)), path


@dataclass(frozen=True)
class Cell:
    """One method, fully configured, on one episode setting.

    Attributes:
        label: display name (a grid's ``[[cell]] label``, else the method name).
        cache: the feature cache as written (a path or a grid's ``[caches]`` name).
        episode: ``{split, way, shot, query, imbalance, seed, episodes}`` and ``query_classes``
            when set; under the Meta-Dataset protocol also ``protocol`` and its rule parameters
            (a ``way``, ``shot`` or ``query`` drawn per episode is None).
        negatives: the negative source as written (``"none"`` for a method that reads none).
        n_neg: negatives per episode (``None`` without negatives).
        method: the registered method name.
        options: every field of the method's configuration, with the values used.
        transductive: whether the method uses the unlabelled queries.
        index: position among the cells of a run (a grid's order).
        preprocess: the feature preprocessing (:mod:`poodle.preprocess`).
        episodes_from: an episode file whose episodes the cell solves (``episode`` is then its
            setting), or ``None`` when they are drawn.
        locations: how ``cache`` and a pool file in ``negatives`` resolve to files.
    """

    label: str
    cache: str
    episode: dict[str, Any]
    negatives: str
    n_neg: int | None
    method: str
    options: dict[str, Any]
    transductive: bool
    index: int = 0
    preprocess: str = defaults.PREPROCESS
    episodes_from: str | None = None
    locations: Locations = field(default_factory=Locations, compare=False, repr=False)

    @property
    def cache_file(self) -> Path:
        return self.locations.cache_file(self.cache)

    @property
    def spec(self) -> EpisodeSpec:
        return EpisodeSpec.from_settings(self.episode)

    @property
    def n_episodes(self) -> int:
        return int(self.episode["episodes"])

    def negative_spec(self) -> NegativeSpec | None:
        """The negatives the method reads (the source resolved to a file where it names one)."""
        if self.negatives == "none":
            return None
        return NegativeSpec(self.locations.negatives(self.negatives)[0], int(self.n_neg or 0))

    def config(self) -> Any:
        """The method's configuration dataclass."""
        return solvers.make_config(self.method, self.options, strict=True)

    def written(self) -> dict[str, Any]:
        """The cell as a grid writes it: its configuration, the cache as written and its label."""
        out = {
            "label": self.label,
            "cache": self.cache,
            "episode": self.episode,
            "negatives": self.negatives,
            "n_neg": self.n_neg,
            "method": self.method,
            "options": self.options,
            "transductive": self.transductive,
        }
        if self.preprocess != defaults.PREPROCESS:  # absent by default: older grids keep their keys
            out["preprocess"] = self.preprocess
        return out

    @property
    def key(self) -> str:
        """Hash of :meth:`written`; two cells with the same key are the same cell of a grid."""
        return content_hash(self.written())[:20]

    def result_identity(self, cache_id: str, negatives_id: str | None = None) -> dict[str, Any]:
        """The cell's identity in the results layer, given the fingerprints of its cache and of its
        negative pool file (:func:`poodle.results.make_identity`)."""
        return make_identity(
            cache_id=cache_id,
            episode=self.episode,
            negatives=self.negatives,
            n_neg=self.n_neg,
            method=self.method,
            options=self.options,
            transductive=self.transductive,
            negatives_id=negatives_id,
            preprocess=self.preprocess,
        )

    def episode_key(self) -> tuple:
        """Cells with equal episode keys are solved on identical episodes."""
        return (
            (self.cache, self.episodes_from)
            + tuple(self.episode.get(k) for k in EPISODE_FIELDS)
            + tuple(self.episode.get(k) for k in OPTIONAL_EPISODE_KEYS)
        )

    def negative_key(self) -> tuple:
        """Negatives and preprocessing: cells that agree on them (and on the episodes) are solved together."""
        return (self.negatives, self.n_neg, self.preprocess)

    def flat(self) -> dict[str, Any]:
        """One namespace for reports: episode options, negatives, method and the method's options."""
        return record_flat(self.written())

    def describe(self, keys: Sequence[str] | None = None) -> str:
        flat = self.flat()
        keys = keys if keys is not None else [k for k in ("shot", "transductive") if k in flat]
        return " ".join([self.label] + [f"{k}={format_option(flat[k])}" for k in keys if k != "label" and k in flat])


def format_option(v: Any) -> str:
    """An option value as a grid file would write it (``true``, ``none``, ``2`` for 2.0)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, float) and v.is_integer():
        return str(int(v)) if abs(v) < 1e15 else repr(v)
    return str(v)


# ---------------------------------------------------------------------------------------------
# Values


def _value_type(annotation: Any) -> Any:
    """``int`` for ``int`` and ``int | None``, ``float`` for ``float | None``, else the annotation."""
    members = [m for m in typing.get_args(annotation) if m is not type(None)] or [annotation]
    return members[0] if len(members) == 1 else annotation


# The type of every episode setting, from EpisodeSpec's fields: a new field is a new setting here.
_SPEC_TYPES: dict[str, Any] = {k: _value_type(t) for k, t in typing.get_type_hints(EpisodeSpec).items()}


def _integer(key: str, v: Any) -> int:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError.bad_value(key, v, "expects an integer")
    return v


def check_general(key: str, v: Any) -> Any:
    """The value of a general (non-method) setting, type-checked and normalised by the rule that owns
    it; a :class:`ConfigError` naming ``key`` otherwise. TOML has no null: ``"none"``, ``"balanced"``
    and ``false`` mean balanced queries, ``"none"``/``"all"`` all query classes."""
    if key in ("cache", "split", "method", "negatives"):
        if not isinstance(v, str) or not v:
            raise ConfigError.bad_value(key, v, "expects a non-empty string")
        if key == "negatives":
            NegativeSpec(v).validate()
        return v
    if key == "preprocess":
        if not isinstance(v, str):
            raise ConfigError.bad_value(key, v, "expects l2n, cl2n or power[:BETA]")
        return parse(v).key
    if key == "imbalance" and (v is False or (isinstance(v, str) and v.lower() in ("none", "balanced"))):
        v = None
    if key == "query_classes" and isinstance(v, str) and v.lower() in ("none", "all"):
        v = None
    if v is None and key in ("imbalance", "query_classes"):
        return None
    if key == "protocol":
        if v not in defaults.PROTOCOLS:
            raise ConfigError.bad_value(key, v, f"expects one of {', '.join(defaults.PROTOCOLS)}")
        return None if v == defaults.PROTOCOL else v  # fixed: recorded by its absence (older identities)
    if key in defaults.META_DATASET_KEYS:
        return _meta_dataset_value(key, v)
    if key == "episodes":
        check_count(_integer(key, v))
        return _integer(key, v)
    if key == "n_neg":
        NegativeSpec("base", _integer(key, v)).validate()
        return _integer(key, v)
    kind = _SPEC_TYPES.get(key)
    if kind is int:
        v = _integer(key, v)
    elif kind is float and not isinstance(v, bool) and isinstance(v, (int, float)):
        v = float(v)
    if key in _SPEC_TYPES:
        # the episode setting's own rule, one value at a time (query_classes <= way is checked when
        # the cell's whole setting is, in make_cell)
        alone = {key: v, "way": max(2, v)} if key == "query_classes" else {key: v}
        EpisodeSpec(**alone).validate()
        return v
    raise ConfigError(f"unknown setting {key!r}", params=(key,))


def _meta_dataset_value(key: str, v: Any) -> Any:
    """A Meta-Dataset rule parameter alone: its type and its field's bounds (the relations between
    them, ``min_ways <= max_ways_upper_bound``, are checked with the whole setting)."""
    f = next(f for f in dataclasses.fields(EpisodeSpec) if f.name == key)
    kind = _SPEC_TYPES[key]
    if kind is bool:
        if not isinstance(v, bool):
            raise ConfigError.bad_value(key, v, "expects true or false")
        return v
    if kind is int:
        v = _integer(key, v)
    elif isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError.bad_value(key, v, "expects a number")
    else:
        v = float(v)
    why = violation(f, v)
    if why is not None:
        raise ConfigError.bad_value(key, v, why)
    return v


def _episode_setting(general: Mapping[str, Any]) -> dict[str, Any]:
    """A cell's ``episode``: the fixed protocol's keys (defaults filled; under Meta-Dataset a
    ``way``, ``shot`` or ``query`` not given is None, drawn per episode), then the optional keys
    that are set; under Meta-Dataset every rule parameter, with sampling.py's defaults
    (``bilevel`` only when on), so that a default changed later cannot alias two settings."""
    md = general.get("protocol") == "meta-dataset"
    drawn = ("way", "shot", "query") if md else ()
    episode = {k: general.get(k, None if k in drawn else GENERAL_DEFAULTS.get(k)) for k in EPISODE_FIELDS}
    given = [k for k in defaults.META_DATASET_KEYS if general.get(k) is not None]
    if given and not md:
        raise ConfigError(
            f"{', '.join(given)} belong{'s' if len(given) == 1 else ''} to the Meta-Dataset protocol: "
            "add protocol = meta-dataset",
            params=(*given, "protocol"),
        )
    episode.update({k: general[k] for k in OPTIONAL_EPISODE_KEYS if general.get(k) is not None})
    if md:
        rules = EpisodeSpec.meta_dataset()
        for k in defaults.META_DATASET_KEYS:
            if k not in episode and k != "bilevel":
                episode[k] = getattr(rules, k)
        if episode.get("bilevel") is False:
            del episode["bilevel"]
    return episode


# ---------------------------------------------------------------------------------------------
# Making a cell


def make_cell(
    values: Mapping[str, Any],
    *,
    label: str | None = None,
    strict: frozenset[str] | set[str] = frozenset(),
    locations: Locations | None = None,
    episodes_from: str | None = None,
) -> Cell:
    """The cell of one combination of values: general settings (:data:`poodle.defaults.GENERAL_KEYS`,
    defaults from :data:`poodle.defaults.GENERAL_DEFAULTS`), ``transductive`` and the method's options.

    Options the method does not have are dropped and ``transductive`` is ignored for a method that
    cannot switch it (the rule of a grid's product: ``alpha`` with ``proto`` is the proto cell),
    except the keys in ``strict`` (given for this method explicitly): those are errors. A method
    that reads no negatives (proto, POODLE with beta = 0) gets ``negatives = "none"`` whatever was
    given, so the negative settings do not multiply its cells.
    """
    method = solvers.get(values.get("method", GENERAL_DEFAULTS["method"]))
    fields = set(method.options())
    opts: dict[str, Any] = {}
    for k, v in values.items():
        if k in GENERAL_KEYS:
            continue
        if k == "transductive" and method.transductive != "optional":
            if k in strict:
                method.check_transductive(v)
            continue
        if k in fields:
            opts[k] = v
        elif k in strict:
            raise ConfigError(
                f"method {method.name!r} has no option {k!r}; its options are: {', '.join(sorted(fields))}",
                params=(k,),
            )
    cfg = solvers.make_config(method.name, opts, strict=True)
    general = {k: check_general(k, values[k]) for k in GENERAL_KEYS if values.get(k) is not None}
    episode = _episode_setting(general)
    EpisodeSpec.from_settings(episode).validate()
    negatives, n_neg = "none", None
    if method.needs_negatives(cfg):
        negatives = general.get("negatives", GENERAL_DEFAULTS["negatives"])
        n_neg = general.get("n_neg", GENERAL_DEFAULTS["n_neg"])
        method.check_negatives(cfg, negatives)
    if "cache" not in general:
        raise ConfigError("no feature cache given", params=("cache",))
    return Cell(
        label=label or method.name,
        cache=general["cache"],
        episode=episode,
        negatives=negatives,
        n_neg=n_neg,
        method=method.name,
        options=jsonable(solvers.config_dict(cfg)),
        transductive=method.is_transductive(cfg),
        preprocess=general.get("preprocess", defaults.PREPROCESS),
        episodes_from=episodes_from,
        locations=locations or Locations(),
    )


def located(where: str, error: PoodleError) -> ConfigError:
    """``error`` said at a place in a file (a grid's path and ``[[cell]]``): the file's keys are not
    command-line flags, so the error names them as the file's options and carries no parameters."""
    if error.reason is not None and error.param is not None:
        return ConfigError(f"{where}: option {error.param!r} {error.reason}, got {error.value!r}")
    return ConfigError(f"{where}: {error}")


def numbered(cells: Sequence[Cell]) -> list[Cell]:
    """The cells with their positions as ``index``."""
    return [dataclasses.replace(c, index=i) for i, c in enumerate(cells)]


__all__ = ["EPISODE_FIELDS", "Cell", "Locations", "check_general", "format_option", "located", "make_cell", "numbered"]
