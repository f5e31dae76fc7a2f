"""Cells: one configured method on one episode setting, the unit that every command solves.

A cell is made in one place, :func:`make_cell`, from values as a user gives them (``poodle solve``'s
parameters, one combination of a grid file, a row of the demo's table): every value is checked
there, once, by the rule that owns it (the episode setting:
:meth:`EpisodeSpec.validate`; the negatives: :meth:`NegativeSpec.validate` and
:meth:`SolverInfo.check_negatives`; a method's options: :func:`poodle.solvers.make_config`; the
preprocessing: :func:`poodle.preprocess.parse`).
A cell then holds only resolved values: the method's registry entry and its configuration, built
and checked there (presets resolved; every later call trusts it), the negatives it reads (``"none"``
for a method that reads none) and whether it uses the queries.

Its identity in the results layer (:meth:`Cell.result_identity`) adds the content fingerprints of
the files it reads; :func:`poodle.results.make_identity` is the one function that assembles it.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Mapping, Sequence

from poodle import defaults, solvers
from poodle.defaults import NEGATIVE_KEYWORDS
from poodle.episodes import EpisodeSpec
from poodle.errors import ConfigError, PoodleError, mark
from poodle.negatives import NegativeSpec
from poodle.results import jsonable, make_identity, record_flat
from poodle.settings import EPISODE_KEYS, GENERAL_KEYS, WHEN_SET_EPISODE_KEYS, check_setting, general_defaults
from poodle.solvers import SolverInfo
from poodle.utils import content_hash

# The episode settings of a cell: EpisodeSpec's fields and the number of episodes (poodle.settings).
EPISODE_FIELDS: tuple[str, ...] = EPISODE_KEYS


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


@dataclass(frozen=True, init=False)
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
        cfg: the method's configuration dataclass, built and checked when the cell was made (its
            fields hold the values used; :attr:`options` is them as records write them).
        transductive: whether the method uses the unlabelled queries.
        index: position among the cells of a run (a grid's order).
        preprocess: the feature preprocessing (:mod:`poodle.preprocess`).
        episodes_from: an episode file whose episodes the cell solves (``episode`` is then its
            setting), or ``None`` when they are drawn.
        locations: how ``cache`` and a pool file in ``negatives`` resolve to files.
        solver: the method's registry entry (looked up once, when the cell was made).

    :func:`make_cell` makes a cell from values as a user gives them (each checked there); the
    constructor takes resolved values.
    """

    label: str
    cache: str
    episode: dict[str, Any]
    negatives: str
    n_neg: int | None
    method: str
    cfg: Any
    transductive: bool
    index: int = 0
    preprocess: str = defaults.PREPROCESS
    episodes_from: str | None = None
    locations: Locations = field(default_factory=Locations, compare=False, repr=False)
    solver: SolverInfo = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __init__(
        self,
        label: str,
        cache: str,
        episode: dict[str, Any],
        negatives: str,
        n_neg: int | None,
        method: str,
        cfg: Any = None,
        transductive: bool = False,
        index: int = 0,
        preprocess: str = defaults.PREPROCESS,
        episodes_from: str | None = None,
        locations: Locations | None = None,
        solver: SolverInfo | None = None,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        info = solver if solver is not None else solvers.get(method)
        if options is not None or cfg is None or isinstance(cfg, Mapping):
            # the old form held the options as a dict: the config is built from them here
            warnings.warn(
                "Cell(options=...) is deprecated: give cfg, the method's config (poodle.solvers.make_config), "
                "or make the cell with poodle.cells.make_cell (removed in 0.3.0)",
                DeprecationWarning,
                stacklevel=2,
            )
            given = options if options is not None else cfg
            cfg = solvers.build_config(info, given or {}, strict=True)
        values = dict(
            label=label,
            cache=cache,
            episode=episode,
            negatives=negatives,
            n_neg=n_neg,
            method=method,
            cfg=cfg,
            transductive=transductive,
            index=index,
            preprocess=preprocess,
            episodes_from=episodes_from,
            locations=locations if locations is not None else Locations(),
            solver=info,
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def options(self) -> dict[str, Any]:
        """Every field of the method's configuration with the value used, as records hold them."""
        return jsonable(solvers.config_dict(self.cfg))

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
        """The method's configuration dataclass (:attr:`cfg`, built and checked when the cell was made)."""
        return self.cfg

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
            + tuple(self.episode.get(k) for k in WHEN_SET_EPISODE_KEYS)
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


def check_general(key: str, v: Any) -> Any:
    """Deprecated (0.2.0): :func:`poodle.settings.check_setting`, which this calls."""
    warnings.warn(
        "poodle.cells.check_general is deprecated: use poodle.settings.check_setting (removed in 0.3.0)",
        DeprecationWarning,
        stacklevel=2,
    )
    return check_setting(key, v)


def episode_setting(general: Mapping[str, Any], defaults_: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A cell's ``episode`` from its checked general settings: the keys that are always recorded
    (defaults filled; under Meta-Dataset a ``way``, ``shot`` or ``query`` not given is None, drawn
    per episode, and ``episodes`` defaults to Meta-Dataset's 600 per domain), then each
    ``when_set`` key that differs from its default; under Meta-Dataset every
    rule parameter, with sampling.py's defaults (``bilevel`` only when on), so that a default
    changed later cannot alias two settings. A rule parameter without the protocol is an error."""
    defaults_ = general_defaults() if defaults_ is None else defaults_
    md = general.get("protocol", defaults.PROTOCOL) == "meta-dataset"
    drawn = ("way", "shot", "query") if md else ()
    episode = {k: general.get(k, None if k in drawn else defaults_.get(k)) for k in EPISODE_FIELDS}
    given = [
        k for k in defaults.META_DATASET_KEYS if general.get(k) is not None and not (k == "bilevel" and not general[k])
    ]
    if given and not md:
        raise ConfigError(
            f"{', '.join(map(mark, given))} belong{'s' if len(given) == 1 else ''} to the Meta-Dataset protocol",
            params=tuple(given),
            needs={"protocol": "meta-dataset"},
        )
    # a when_set setting is held only when it differs from its default, as results record it
    episode.update(
        {k: general[k] for k in WHEN_SET_EPISODE_KEYS if general.get(k, defaults_.get(k)) != defaults_.get(k)}
    )
    if md:
        if general.get("episodes") is None:  # Meta-Dataset reports 600 episodes per domain
            episode["episodes"] = defaults.META_DATASET_EPISODES
        rules = EpisodeSpec.meta_dataset()
        for k in defaults.META_DATASET_KEYS:
            if k not in episode and k != "bilevel":
                episode[k] = getattr(rules, k)
        if not episode.get("bilevel", False):
            episode.pop("bilevel", None)
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
    config: Any = None,
    checked: bool = False,
    index: int = 0,
) -> Cell:
    """The cell of one combination of values: general settings (:data:`poodle.settings.GENERAL_KEYS`,
    each checked by its declaration, defaults from it), ``transductive`` and the method's options,
    or, instead of the options, ``config``: the method's config built already (the command line
    builds it to name its flags in an error), used as it is (checked unless it was when built).
    ``checked``: the general settings in ``values`` are each :func:`poodle.settings.check_setting`'s
    result already (a grid file's, checked at its lines as the file was read), not checked again.
    ``index``: the cell's position among the cells of its run.

    Options the method does not have are dropped and ``transductive`` is ignored for a method that
    cannot switch it (the rule of a grid's product: ``alpha`` with ``proto`` is the proto cell),
    except the keys in ``strict`` (given for this method explicitly): those are errors. A method
    that reads no negatives (proto, POODLE with beta = 0) gets ``negatives = "none"`` whatever was
    given, so the negative settings do not multiply its cells.
    """
    defaults_ = general_defaults()
    # the method's name is checked by its lookup in the registry (an unknown name lists the known
    # ones), not again as a setting
    general = {
        k: values[k] if checked else check_setting(k, values[k])
        for k in GENERAL_KEYS
        if k != "method" and values.get(k) is not None
    }
    episode = episode_setting(general, defaults_)
    EpisodeSpec.from_settings(episode).validate()
    if "cache" not in general:
        raise ConfigError(f"no feature {mark('cache')} given", params=("cache",), param="cache", value=None)
    solver, cfg, negatives, n_neg, transductive = _configure(
        values.get("method", defaults_["method"]),
        {k: v for k, v in values.items() if k not in GENERAL_KEYS},
        strict,
        config,
        general.get("negatives", defaults_["negatives"]),
        general.get("n_neg", defaults_["n_neg"]),
    )
    return Cell(
        label=label or solver.name,  # an alias's entry is held by its registered name
        cache=general["cache"],
        episode=episode,
        negatives=negatives,
        n_neg=n_neg,
        method=solver.name,
        cfg=cfg,
        transductive=transductive,
        preprocess=general.get("preprocess", defaults.PREPROCESS),
        index=index,
        episodes_from=episodes_from,
        locations=locations or Locations(),
        solver=solver,
    )


def _configure(
    name: str,
    given: Mapping[str, Any],
    strict: AbstractSet[str],
    config: Any,
    negatives: str,
    n_neg: int | None,
) -> tuple[SolverInfo, Any, str, int | None, bool]:
    """``(registry entry, config, negatives, n_neg, transductive)`` of the method ``name`` from the
    values ``given`` for it (:func:`make_cell`'s rules: options it lacks dropped unless in
    ``strict``, ``transductive`` for a method that cannot switch it ignored unless in ``strict``; or
    ``config``, the caller's, instead of options) and the negatives given (``"none"`` and None for a
    method that reads none)."""
    method = solvers.get(name)
    fields = set(method.options())
    opts: dict[str, Any] = {}
    for k, v in given.items():
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
                param=k,
                value=v,
            )
    if config is None:
        cfg = solvers.build_config(method, opts, strict=True)
    elif opts:
        raise ConfigError(
            f"method {method.name!r}: options {', '.join(map(mark, sorted(opts)))} given beside its config; "
            "set them in the config",
            params=tuple(sorted(opts)),
            param="options",
            value=sorted(opts),
        )
    elif not isinstance(config, method.config):
        raise ConfigError(
            f"method {method.name!r}: config must be a {method.config.__name__}, got {type(config).__name__}",
            params=("options",),
            param="config",
            value=config,
        )
    else:
        cfg = config if solvers.is_checked(config) else solvers.validate_config(config, method.name)
    if method.needs_negatives(cfg):
        method.check_negatives(cfg, negatives)
    else:
        negatives, n_neg = "none", None
    return method, cfg, negatives, n_neg, method.is_transductive(cfg)


def located(where: str, error: PoodleError) -> ConfigError:
    """``error`` said at a place in a file (a grid's path and ``[[cell]]``): the file's keys are not
    command-line flags, so the error names them as the file's options and carries no parameters."""
    if error.reason is not None and error.param is not None:
        return ConfigError(
            f"{where}: option {error.param!r} {error.reason}, got {error.value!r}", param=error.param, value=error.value
        )
    return ConfigError(f"{where}: {error}", param=error.param, value=error.value)


def numbered(cells: Sequence[Cell]) -> list[Cell]:
    """The cells with their positions as ``index``."""
    return [dataclasses.replace(c, index=i) for i, c in enumerate(cells)]


__all__ = ["EPISODE_FIELDS", "Cell", "Locations", "check_general", "format_option", "located", "make_cell", "numbered"]
