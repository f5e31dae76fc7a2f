"""What every solver shares: the episode batch it receives, what it returns, and the registry.

A solver is a function over a whole chunk of episodes::

    fn(batch: EpisodeBatch, cfg: <its config dataclass>) -> SolverOutput

with no Python loop over episodes, classes or queries inside: the loop over optimisation steps
(or clustering iterations) is the only loop. ``SolverOutput.log_probs`` is ``[E, Nq, way]``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch
from torch import Tensor

from poodle.errors import ConfigError, mark
from poodle.options import violation

Transductivity = Literal["never", "optional", "always"]


@dataclass
class EpisodeBatch:
    """A chunk of ``E`` episodes, gathered onto one device.

    Episodes of different shapes (Meta-Dataset's protocol: each episode its own number of classes,
    support rows per class and queries) share one chunk padded to its largest episode. The padding
    is invisible to every method: a padded class takes no probability, a padded row no weight in any
    sum, mean, entropy, marginal, graph or decomposition, so an episode's result is the one it gets
    solved alone (:meth:`episode` crops it back to its real size).

    Attributes:
        support: ``[E, Ns, D]`` float, rows L2-normalised, in any order; classes may have unequal
            numbers of support rows (``poodle predict``), so solvers use ``support_labels``, never
            a ``[way, shot]`` reshape (tests/test_ragged_shots.py checks every method). Padded rows
            are zeros.
        support_labels: ``[E, Ns]`` int64 in ``0..ways[e]-1``; ``-1`` marks a padded row.
        query: ``[E, Nq, D]`` float, rows L2-normalised; with imbalance the per-class counts vary.
            Padded rows are zeros.
        negatives: ``[E, M, D]`` float (L2-normalised) or ``None`` when no negatives are used. Every
            episode has all ``M`` (never padded).
        way: the number of classes of the chunk's largest episode (the last axis of the output).
        ways: ``[E]`` int64, each episode's own number of classes (labels ``0..ways[e]-1`` are real,
            the rest padding), or ``None`` when every episode has ``way``.
        support_mask: ``[E, Ns]`` bool, True for a real support row (``support_labels >= 0``), or
            ``None`` when every row is real.
        query_mask: ``[E, Nq]`` bool, True for a real query row, or ``None`` when every row is real.
    """

    support: Tensor
    support_labels: Tensor
    query: Tensor
    negatives: Tensor | None
    way: int
    ways: Tensor | None = None
    support_mask: Tensor | None = None
    query_mask: Tensor | None = None

    @property
    def n_episodes(self) -> int:
        return self.support.shape[0]

    @property
    def shot(self) -> int:
        """Support rows per class when shots are equal (the mean, rounded down, otherwise)."""
        return self.support.shape[1] // self.way

    @property
    def ragged(self) -> bool:
        """Whether any episode is padded (its classes, support or query rows)."""
        return self.ways is not None or self.support_mask is not None or self.query_mask is not None

    @property
    def class_mask(self) -> Tensor | None:
        """``[E, way]`` bool, True for an episode's real classes; ``None`` when all are real."""
        if self.ways is None:
            return None
        return torch.arange(self.way, device=self.ways.device) < self.ways.unsqueeze(1)

    def query_weight(self, dtype: torch.dtype | None = None) -> Tensor | None:
        """``[E, Nq, 1]`` 1.0 for a real query row and 0.0 for padding (``None`` when all are real)."""
        if self.query_mask is None:
            return None
        return self.query_mask.to(dtype or self.query.dtype).unsqueeze(-1)

    def n_query(self) -> Tensor:
        """``[E]`` the number of real query rows of each episode (of the query's dtype)."""
        if self.query_mask is None:
            return torch.full((self.n_episodes,), self.query.shape[1], dtype=self.query.dtype, device=self.query.device)
        return self.query_mask.sum(1).to(self.query.dtype)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> EpisodeBatch:
        def mv(t: Tensor, is_float: bool = True) -> Tensor:
            return t.to(device=device, dtype=dtype if (is_float and dtype is not None) else t.dtype)

        def opt(t: Tensor | None, is_float: bool = False) -> Tensor | None:
            return None if t is None else mv(t, is_float)

        return EpisodeBatch(
            mv(self.support),
            mv(self.support_labels, False),
            mv(self.query),
            opt(self.negatives, True),
            self.way,
            opt(self.ways),
            opt(self.support_mask),
            opt(self.query_mask),
        )

    def episode(self, i: int) -> EpisodeBatch:
        """Episode ``i`` alone, as a batch of one cropped to its real size (its own ``way``, its real
        support and query rows in their order): for per-episode references and debugging."""
        sl = slice(i, i + 1)
        neg = None if self.negatives is None else self.negatives[sl]
        support, labels, query = self.support[sl], self.support_labels[sl], self.query[sl]
        way = self.way if self.ways is None else int(self.ways[i])
        if self.support_mask is not None:
            keep = self.support_mask[i]
            support, labels = support[:, keep], labels[:, keep]
        if self.query_mask is not None:
            query = query[:, self.query_mask[i]]
        return EpisodeBatch(support, labels, query, neg, way)

    @staticmethod
    def stack(episodes: list[EpisodeBatch]) -> EpisodeBatch:
        """One chunk of single (unpadded) episodes of any shapes, padded to the largest: support and
        query rows keep their order and are followed by zero rows (labels ``-1``). The masks and
        ``ways`` are ``None`` where no episode needs them, so equal episodes stack to a plain batch."""
        if not episodes:
            raise ValueError("no episodes to stack")
        way = max(e.way for e in episodes)
        ns = max(e.support.shape[1] for e in episodes)
        nq = max(e.query.shape[1] for e in episodes)
        ref = episodes[0].support

        def pad(t: Tensor, n: int, value: float) -> Tensor:
            extra = n - t.shape[1]
            if extra == 0:
                return t
            fill = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
            return torch.cat([t, fill], 1)

        support = torch.cat([pad(e.support, ns, 0.0) for e in episodes])
        labels = torch.cat([pad(e.support_labels, ns, -1) for e in episodes])
        query = torch.cat([pad(e.query, nq, 0.0) for e in episodes])
        negs = [e.negatives for e in episodes]
        negatives = None if any(n is None for n in negs) else torch.cat(negs)  # type: ignore[arg-type]
        ways_list = [e.way for e in episodes for _ in range(e.n_episodes)]
        ragged_ways = any(w != way for w in ways_list)
        ways = torch.tensor(ways_list, dtype=torch.int64, device=ref.device) if ragged_ways else None
        s_rows = [e.support.shape[1] for e in episodes]
        q_rows = [e.query.shape[1] for e in episodes]
        support_mask = labels >= 0 if any(n != ns for n in s_rows) else None
        query_mask = None
        if any(n != nq for n in q_rows):
            query_mask = torch.cat(
                [(torch.arange(nq, device=ref.device) < e.query.shape[1]).expand(e.n_episodes, nq) for e in episodes]
            )
        return EpisodeBatch(support, labels, query, negatives, way, ways, support_mask, query_mask)


@dataclass
class SolverOutput:
    """What a solver returns.

    Attributes:
        log_probs: ``[E, Nq, way]`` query log-probabilities (argmax is the prediction).
        state: fitted tensors for inspection and tests, e.g. ``{"prototypes": [E, way, D],
            "scale": [E, 1, 1]}``; empty for methods with nothing to expose.
    """

    log_probs: Tensor
    state: dict[str, Tensor] = field(default_factory=dict)


# LAPACK's usual count for a symmetric eigen-decomposition with its vectors, ``9 n^3`` FLOPs, as the
# registered FLOP counts of the methods that decompose count it
def eigh_flops(n: int) -> float:
    """FLOPs counted for ``eigh`` of one ``n x n`` matrix with its eigenvectors."""
    return 9.0 * n**3


@dataclass(frozen=True)
class Floor:
    """What one episode of a method computes, by kind, declared at its ``@register``: the parts of
    its floor (``benchmarks/methods.py`` times each part by a micro-benchmark that is not the
    method's code) and the loops whose length the cost model counts to a chunk's slowest episode.
    Every function takes the registered FLOP count's arguments ``(Ns, Nq, M, D, way, cfg)``.

    Attributes:
        eigh: the order ``n`` of the symmetric matrix the method decomposes once per episode (on
            the host: LAPACK), or ``0``; ``None``: no decomposition. Its ``9 n^3`` FLOPs
            (:func:`eigh_flops`) are part of the registered count and timed at LAPACK's rate, not
            at the matmul rate.
        product: the shape ``(rows, depth, columns)`` of the method's typical batched product (the
            matmul class its registered FLOPs run at); ``None``: ``(Ns + Nq + M, D, way)``, the rows
            against the class centres.
        sweep: the Sinkhorn sweep the method runs on a ``[way, columns]`` plan: ``"balance"``
            (samples to 1, then classes to a fixed mass: PT-MAP, protoLP) or ``"min-size"``
            (samples to 1, then the classes under a minimum mass scaled up to it: PEMnE-BMS).
        sweep_columns: the plan's columns (samples): ``"query"`` (``Nq``) or ``"all"`` (``Ns + Nq``).
        sweeps: ``cfg -> sweeps per episode`` where the count is fixed; ``None``: each episode sweeps
            until it converges (measured).
        loops: the functions, ``"module:function"``, each call of which is one loop that stops per
            episode (on a GPU it runs, masked, to the chunk's slowest episode); an iteration is a
            call of ``should_stop`` in the module that defines the function.
        eigh_dtype: the precision the matrix is decomposed in.
        matmul: the rate the registered FLOPs (less the decomposition's) can run at: ``"batched"``,
            that of a batched product of ``product``'s shape (the better of its two layouts);
            ``"large"``, that of a large square matmul (the fused kernel's steps, which stream the
            rows against weights held in registers, reach it).
        gram: ``(n, d)`` of the Gram matrix ``x x^T`` (``x [n, d]``) the method forms once per episode
            before its decomposition (``2 n^2 d`` FLOPs of its count, timed at a batched product of
            that shape, not at ``product``'s).
        fixed_steps: every step runs the same operations whatever the data (no convergence test,
            no inner loop of data-dependent length): the cost model traces 1 and 2 steps and
            extrapolates (:func:`poodle.costmodel.trace`).
        steps_field: the config field holding the method's iteration count (the cost model's
            :func:`~poodle.costmodel.method_steps`).
        steps_of: ``(cfg, n_query) -> iterations`` where the count depends on the episode's shape
            (CAN-T's ``-1``: ``Nq // step``), else ``None`` (``steps_field``'s value).
    """

    eigh: Callable[..., int] | None = None
    product: Callable[..., tuple[int, int, int]] | None = None
    sweep: Literal["balance", "min-size"] | None = None
    sweep_columns: Literal["query", "all"] = "query"
    sweeps: Callable[[Any], int] | None = None
    loops: tuple[str, ...] = ()
    eigh_dtype: Literal["float32", "float64"] = "float32"
    matmul: Literal["batched", "large"] = "batched"
    gram: Callable[..., tuple[int, int]] | None = None
    fixed_steps: bool = False
    steps_field: str = "steps"
    steps_of: Callable[[Any, int], int] | None = None

    def product_shape(self, Ns: int, Nq: int, M: int, D: int, way: int, cfg: Any) -> tuple[int, int, int]:
        """``(rows, depth, columns)`` of the method's typical product on this shape."""
        return self.product(Ns, Nq, M, D, way, cfg) if self.product else (Ns + Nq + M, D, way)

    def gram_shape(self, Ns: int, Nq: int, M: int, D: int, way: int, cfg: Any) -> tuple[int, int] | None:
        """``(n, d)`` of the Gram matrix formed per episode, or None."""
        return self.gram(Ns, Nq, M, D, way, cfg) if self.gram else None

    def eigh_order(self, Ns: int, Nq: int, M: int, D: int, way: int, cfg: Any) -> int:
        """The order of the matrix decomposed per episode (0: none)."""
        return int(self.eigh(Ns, Nq, M, D, way, cfg)) if self.eigh else 0

    def plan(self, Ns: int, Nq: int, way: int) -> tuple[int, int] | None:
        """``(way, columns)`` of the Sinkhorn plan, or None without one."""
        if self.sweep is None:
            return None
        return way, (Nq if self.sweep_columns == "query" else Ns + Nq)


@dataclass(frozen=True)
class SolverInfo:
    """A registered method.

    Attributes:
        name: the ``--method`` value.
        fn: the batched solver.
        config: its configuration dataclass (defaults are the paper's).
        transductive: ``"never"`` (inductive only), ``"optional"`` (a ``transductive`` config field
            switches it), or ``"always"`` (uses the unlabelled queries by construction).
        uses_negatives: whether the method consumes ``EpisodeBatch.negatives``: a bool, or a function
            of the config (POODLE with ``beta = 0`` needs none); ask :meth:`needs_negatives`.
        flops: optional ``(Ns, Nq, M, D, way, cfg) -> FLOPs per episode``, for roofline reports.
        summary: one line for ``--help`` and listings.
        floor: the cost facts of what the method computes per episode (:class:`Floor`), for the
            per-method floors of ``benchmarks/methods.py`` and the loops of :mod:`poodle.costmodel`.
        triton_step: whether its fits take the Triton step on CUDA under a backend with
            ``cuda_step="triton"`` (:mod:`poodle.solvers._triton_step`; its loss is one the step knows).
        flags: ``{command-line option: config field}``, the method's own names for fields other
            methods give another meaning (POODLE's ``pull_weight`` for ``alpha``); ``poodle solve``
            maps them from here.
    """

    name: str
    fn: Callable[[EpisodeBatch, Any], SolverOutput]
    config: type
    transductive: Transductivity
    uses_negatives: bool | Callable[[Any], bool]
    flops: Callable[..., float] | None
    summary: str
    floor: Floor = field(default_factory=lambda: Floor())
    triton_step: bool = False
    flags: Mapping[str, str] = field(default_factory=dict)

    def needs_negatives(self, cfg: Any) -> bool:
        """Whether this method, configured by ``cfg``, reads ``EpisodeBatch.negatives``."""
        return bool(self.uses_negatives(cfg) if callable(self.uses_negatives) else self.uses_negatives)

    def is_transductive(self, cfg: Any) -> bool:
        """Whether this method, configured by ``cfg``, uses the unlabelled queries."""
        if self.transductive == "optional":
            return bool(cfg.transductive)
        return self.transductive == "always"

    @property
    def can_transduce(self) -> bool:
        """Whether the method can use the unlabelled queries at all: the rule that
        :meth:`check_transductive` applies, and that the command line and a grid's axes read to
        decide which methods take ``transductive``."""
        return self.transductive != "never"

    def check_transductive(self, value: Any) -> None:
        """ConfigError when ``value`` asks this method to use the queries and it cannot: the one
        place the rule is checked, for the command line, grid cells and the library."""
        if coerce_option(self.name, "transductive", value, bool) and not self.can_transduce:
            raise ConfigError(
                f"method {self.name!r} is inductive only; it cannot be {mark('transductive')}",
                param="transductive",
                value=value,
            )

    def check_negatives(self, cfg: Any, source: str | None) -> None:
        """ConfigError when this method, configured by ``cfg``, reads negatives and ``source`` gives
        none (``None`` or ``"none"``): the one place the rule is checked, wherever negatives are chosen."""
        if self.needs_negatives(cfg) and (source is None or source == "none"):
            what = " (with these options)" if callable(self.uses_negatives) else ""
            raise ConfigError(
                f"{mark('negatives')} none: method {self.name!r}{what} reads negative samples; use base, "
                "random, sphere or a pool file FILE[:SPLIT]",
                param="negatives",
                value=source,
            )

    def settings(self) -> tuple[str, ...]:
        """The settings the method can run in: ``("inductive",)``, ``("transductive",)`` or both."""
        return {"never": ("inductive",), "optional": ("inductive", "transductive"), "always": ("transductive",)}[
            self.transductive
        ]

    def options(self) -> tuple[str, ...]:
        """The names of the method's config fields."""
        return tuple(f.name for f in dataclasses.fields(self.config))


_REGISTRY: dict[str, SolverInfo] = {}
# other names a method answers to (``--method tim`` is TIM-GD, as the TIM paper calls it)
_ALIASES: dict[str, str] = {}


def register(
    name: str,
    config: type,
    *,
    transductive: Transductivity = "never",
    uses_negatives: bool | Callable[[Any], bool] = False,
    flops: Callable[..., float] | None = None,
    summary: str = "",
    aliases: tuple[str, ...] = (),
    floor: Floor | Mapping[str, Any] | None = None,
    triton_step: bool = False,
    flags: Mapping[str, str] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator: register a batched solver under ``name`` (and ``aliases``) with its config dataclass
    and, optionally, the cost facts of its floor (a :class:`Floor`, or its fields as a dict, so that
    a solver's file declares them without importing the class)."""
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"config of solver {name!r} must be a dataclass")
    if transductive == "optional" and "transductive" not in {f.name for f in dataclasses.fields(config)}:
        raise TypeError(f"solver {name!r} is optionally transductive but its config has no 'transductive' field")

    facts = floor if isinstance(floor, Floor) else Floor(**(floor or {}))

    def deco(fn: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"solver {name!r} registered twice")
        doc = summary or ((fn.__doc__ or "").strip().splitlines() or [""])[0]
        own = dict(flags or {})
        unknown = sorted(set(own.values()) - {f.name for f in dataclasses.fields(config)})
        if unknown:
            raise TypeError(f"solver {name!r} names flags for fields its config lacks: {', '.join(unknown)}")
        _REGISTRY[name] = SolverInfo(
            name, fn, config, transductive, uses_negatives, flops, doc, facts, triton_step, own
        )
        _ALIASES.update({alias: name for alias in aliases})
        return fn

    return deco


def config_fields(config: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config)}


def config_dict(cfg: Any) -> dict[str, Any]:
    """A config's fields and values (the values used: presets are resolved when it is built)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def build_config(info: SolverInfo, options: Mapping[str, Any], *, strict: bool = False) -> Any:
    """Instantiate ``info.config`` from ``options``; the one way configs are made from user values.

    Keys that are not fields of the config are ignored unless ``strict`` (then they are an error
    naming the method's known options). Every value goes through :func:`coerce_option`; the built
    config then through :func:`validate_config` (presets resolved, bounds checked).
    ``transductive=True`` for a method that is inductive only is an error; for an always-transductive
    method the flag is accepted and ignored.
    """
    fields = config_fields(info.config)
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        if key == "transductive" and info.transductive != "optional":
            info.check_transductive(value)
            continue
        if key not in fields:
            if strict:
                known = ", ".join(sorted(fields)) or "(none)"
                raise ConfigError(
                    f"method {info.name!r} has no option {key!r}; its options are: {known}",
                    params=(key,),
                    param=key,
                    value=value,
                )
            continue
        kwargs[key] = coerce_option(info.name, key, value, _field_types(info.config)[key])
    cfg = info.config(**kwargs)
    # a config class that checks itself in __post_init__ (TIM-GD, LaplacianShot) has done it
    return cfg if is_checked(cfg) else validate_config(cfg, info.name)


# ---------------------------------------------------------------------------------------------
# Field names that mean different things in different methods (``alpha`` is POODLE's pull weight,
# alpha-TIM's alpha-entropy order and PT-MAP's prototype update rate). A config class names what its
# shared fields mean in a ``MEANINGS`` class variable (``{"alpha": "pull weight"}``); one value given
# for such a field to methods with different meanings (one ``--alpha`` for POODLE and alpha-TIM, one
# ``alpha`` list in a grid over both) is refused rather than silently applied to both
# (:func:`poodle.solvers.homonyms`).


def meaning(config: type, name: str) -> str | None:
    """What field ``name`` of ``config`` means when other methods have a field of that name."""
    return getattr(config, "MEANINGS", {}).get(name)


def check_config(method: str, cfg: Any) -> None:
    """ConfigError naming the method and option when a value of ``cfg`` is not finite or outside its
    interval: :func:`validate_config`, for configs built directly in Python (``solvers.run``,
    ``evaluate``), so they get the same check as options from the command line or a grid. A config
    that passed the check already (:func:`is_checked`) is not checked again."""
    if not is_checked(cfg):
        validate_config(cfg, method)


# The frozen configs :func:`validate_config` has checked, by ``id`` while they live (each removed
# by a finalizer when its config is freed, before the id can be reused): their values cannot change,
# so a config built once (a cell's, the command line's) is trusted by every call it is handed to
# (each chunk of a run) instead of being checked again. Kept beside the configs, not on them, so
# that nothing reading a config's attributes (``vars``, ``asdict``, a record) sees the mark.
_CHECKED: set[int] = set()


def _mark_checked(cfg: Any) -> None:
    key = id(cfg)
    if key in _CHECKED:
        return
    try:
        weakref.finalize(cfg, _CHECKED.discard, key)
    except TypeError:  # a config class without weak references (slots) is checked every time
        return
    _CHECKED.add(key)


def is_checked(cfg: Any) -> bool:
    """Whether ``cfg`` is a frozen config that :func:`validate_config` has checked (a config made by
    :func:`build_config`, or one whose class checks itself in ``__post_init__``). A config of a
    mutable class is never trusted: its values may have changed since."""
    return id(cfg) in _CHECKED


_TYPES_CACHE: dict[type, dict[str, Any]] = {}


def _field_types(config: type) -> dict[str, Any]:
    """Field name -> resolved annotation (modules use ``from __future__ import annotations``)."""
    if config not in _TYPES_CACHE:
        _TYPES_CACHE[config] = typing.get_type_hints(config)
    return _TYPES_CACHE[config]


def _union_members(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def coerce_option(method: str, key: str, value: Any, tp: Any) -> Any:
    """``value`` converted to the option's type ``tp`` (``float``, ``int | None``, ``bool``, ``str``,
    a ``Literal``), the one conversion for values from the command line (strings), grid files
    (TOML values) and Python. ``"0.5"`` -> 0.5 for a float, ``"yes"`` -> True for a bool; 2.0 -> 2 for
    an int, but 2.5 is refused. A value that does not convert is a :class:`ConfigError`."""
    members = _union_members(tp)
    if value is None:
        if type(None) in members:
            return None
        raise ConfigError(
            f"option {key!r} of method {method!r} needs a value, got none", params=(key,), param=key, value=value
        )
    kinds = [m for m in members if m is not type(None)]
    for kind in kinds:
        try:
            return _convert(value, kind)
        except (TypeError, ValueError):
            continue
    names = " or ".join(_type_name(k) for k in kinds)
    raise ConfigError(
        f"option {key!r} of method {method!r} expects {names}, got {value!r}", params=(key,), param=key, value=value
    )


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    name = getattr(tp, "__name__", str(tp))
    return ("an " if name[:1] in "aeiou" else "a ") + name


def _convert(value: Any, kind: Any) -> Any:
    if typing.get_origin(kind) is typing.Literal:
        allowed = typing.get_args(kind)
        if value in allowed:
            return value
        raise ValueError(value)
    if kind is bool:
        if isinstance(value, str):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(value, (bool, int)) and value in (0, 1):
            return bool(value)
        raise ValueError(value)
    if kind is int:
        if isinstance(value, bool):
            raise ValueError(value)
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(value, str):
            f = float(value)
            if not f.is_integer():
                raise ValueError(value)
            return int(f)
        return int(value)
    if kind is float:
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    if kind is str:
        if isinstance(value, (dict, list)):
            raise ValueError(value)
        return str(value)
    return value


def validate_config(cfg: Any, method: str = "") -> Any:
    """Check a built config and return it; the one place where option values are checked.

    1. A config with a ``preset`` field and a ``PRESETS`` class attribute: an unknown preset is an
       error, and fields still ``None`` take the preset's value (so the config holds the values used).
    2. Every field's value is converted to its annotated type (:func:`coerce_option`).
    3. Every number must be finite, and inside the bounds declared with its field
       (:func:`poodle.options.option`).

    Config classes call :func:`resolve_preset` in ``__post_init__`` too, so a config constructed
    directly also holds the values used. A frozen config is marked as checked (:func:`is_checked`):
    the calls it is handed to afterwards trust it.
    """
    method = method or type(cfg).__name__
    resolve_preset(cfg, method)
    hints = _field_types(type(cfg))
    for f in dataclasses.fields(cfg):
        value = coerce_option(method, f.name, getattr(cfg, f.name), hints[f.name])
        why = violation(f, value)
        if why is not None:
            raise ConfigError(
                f"method {method!r}: option {f.name!r} {why}, got {value:g}",
                params=(f.name,),
                param=f.name,
                value=value,
            )
        object.__setattr__(cfg, f.name, value)  # also for frozen configs: the value is only normalised
    if _frozen(type(cfg)):
        _mark_checked(cfg)
    return cfg


def _frozen(config: type) -> bool:
    params = getattr(config, "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def resolve_preset(cfg: Any, method: str = "") -> None:
    """Fill the fields of ``cfg`` that are ``None`` from ``type(cfg).PRESETS[cfg.preset]`` (in place).

    A method with presets declares ``preset: str`` and the preset's fields as ``X | None = None``;
    after this every such field holds the value used."""
    presets = getattr(type(cfg), "PRESETS", None)
    if presets is None or not hasattr(cfg, "preset"):
        return
    if cfg.preset not in presets:
        name = method or type(cfg).__name__
        raise ConfigError(
            f"{name}: unknown {mark('preset')} {cfg.preset!r}; known presets: {', '.join(presets)}",
            param="preset",
            value=cfg.preset,
        )
    for key, value in presets[cfg.preset].items():
        if getattr(cfg, key) is None:
            object.__setattr__(cfg, key, value)


# ---------------------------------------------------------------------------------------------
# Tensor helpers every prototype-based method needs.


def mask_classes(logits: Tensor, batch: EpisodeBatch, fill: float = float("-inf")) -> Tensor:
    """``logits [E, N, way]`` with the padded classes of ragged episodes set to ``fill`` (so a
    softmax gives them exactly zero probability); ``logits`` itself when no class is padded."""
    mask = batch.class_mask
    if mask is None:
        return logits
    return logits.masked_fill(~mask.unsqueeze(1), fill)


def one_hot(labels: Tensor, way: int, dtype: torch.dtype) -> Tensor:
    """``[E, N]`` int64 -> ``[E, N, way]`` one-hot of ``dtype``; a padded row (label ``-1``) is all zeros.

    A scatter, not ``F.one_hot``: on the CPU that checks its labels' range with two reductions read
    back to the host (which the GPU cost model would count as syncs a GPU does not make)."""
    out = torch.zeros(*labels.shape, way, dtype=dtype, device=labels.device)
    return out.scatter_(-1, labels.clamp_min(0).unsqueeze(-1), (labels >= 0).unsqueeze(-1).to(dtype))


def class_means(x: Tensor, labels: Tensor, way: int) -> Tensor:
    """Per-class means: ``x [E, N, D]``, ``labels [E, N]`` -> ``[E, way, D]``.

    A class with no member gets the zero vector (never NaN).
    """
    y = one_hot(labels, way, x.dtype)  # [E, N, way]
    counts = y.sum(1).clamp_min(1.0).unsqueeze(-1)  # [E, way, 1]
    return torch.bmm(y.transpose(1, 2), x) / counts


def neg_half_sqdist(x: Tensor, w: Tensor, scale: Tensor | float) -> Tensor:
    """The paper's logits ``-(scale/2) * ||x - w||^2``: ``x [E, N, D]``, ``w [E, K, D]`` -> ``[E, N, K]``.

    ``scale`` is a float or ``[E, 1, 1]``.
    """
    xw = torch.bmm(x, w.transpose(1, 2))
    x2 = (x * x).sum(-1, keepdim=True)
    w2 = (w * w).sum(-1).unsqueeze(1)
    return scale * (xw - 0.5 * x2 - 0.5 * w2)
