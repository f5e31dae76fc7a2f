"""Batched few-shot solvers, one file per method; each file registers itself.

Use :func:`get` to look a method up by its ``--method`` name, :func:`available` to list them, and
:func:`run` to solve a batch of episodes with options given by name.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Iterable, Mapping

from poodle.errors import ConfigError
from poodle.solvers import backend as _backend
from poodle.solvers import base as _base
from poodle.solvers.backend import Backend
from poodle.solvers.base import (
    EpisodeBatch,
    SolverInfo,
    SolverOutput,
    build_config,
    class_means,
    coerce_option,
    config_dict,
    is_checked,
    neg_half_sqdist,
    one_hot,
    register,
    validate_config,
)

__all__ = [
    "Backend",
    "EpisodeBatch",
    "SolverInfo",
    "SolverOutput",
    "available",
    "call",
    "get",
    "homonyms",
    "make_config",
    "run",
    "register",
    "class_means",
    "neg_half_sqdist",
    "one_hot",
    "build_config",
    "coerce_option",
    "config_dict",
    "is_checked",
    "validate_config",
]

_LOADED = False


def _load_all() -> None:
    """Import every module of this package so that each registers its method."""
    global _LOADED
    if _LOADED:
        return
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in ("base", "backend") and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    _LOADED = True


def available() -> list[str]:
    """Names of all registered methods, sorted."""
    _load_all()
    return sorted(_base._REGISTRY)


def get(name: str) -> SolverInfo:
    """The registered method ``name``; an unknown name is a :class:`ConfigError` listing the known ones
    (and the closest, where one is close: a typo)."""
    _load_all()
    try:
        return _base._REGISTRY[_base._ALIASES.get(name, name)]
    except KeyError:
        close = difflib.get_close_matches(str(name), available(), n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown method {name!r}{guess}; known methods: {', '.join(available())}", param="method", value=name
        ) from None


def make_config(name: str, options: Mapping[str, Any] | None = None, *, strict: bool = False) -> Any:
    """The config dataclass of ``name`` built from ``options`` (see :func:`base.build_config`)."""
    return build_config(get(name), options or {}, strict=strict)


def homonyms(methods: Iterable[str], name: str) -> dict[str, list[str]]:
    """``{meaning: [methods]}`` for option ``name`` among ``methods`` that have it, when they give it
    more than one meaning (``alpha``: POODLE's pull weight, alpha-TIM's alpha-entropy order); ``{}``
    when it means one thing for all of them. Meanings come from the configs' ``MEANINGS``."""
    by_meaning: dict[str, list[str]] = {}
    for m in methods:
        info = get(m)
        if name in info.options():
            names = by_meaning.setdefault(_base.meaning(info.config, name) or name, [])
            if info.name not in names:
                names.append(info.name)
    return by_meaning if len(by_meaning) > 1 else {}


def run(
    name: str, batch: EpisodeBatch, config: Any = None, *, backend: Backend | None = None, **options: Any
) -> SolverOutput:
    """Solve ``batch`` with method ``name``; ``config`` or keyword options (not both). ``backend``
    (:class:`~poodle.solvers.backend.Backend`) says which arithmetic runs, and its report says
    afterwards what did (``backend.formulation``); ``None``: the backend of the call this one is
    inside, else :func:`~poodle.solvers.backend.default`.

    The public entry: the options or a config made in Python are checked (a config the library
    built, :func:`make_config`, was checked then and is trusted), and the negatives rule against
    the batch's. A caller that has resolved the method and checked its config and negatives once
    for many batches calls :func:`call` per batch."""
    info = get(name)
    if config is None:
        config = build_config(info, options, strict=True)
    elif options:
        raise TypeError("give either a config or keyword options, not both")
    elif not is_checked(config):
        _base.check_config(info.name, config)
    info.check_negatives(config, None if batch.negatives is None else "given")
    return call(info, batch, config, backend=backend)


def call(info: SolverInfo, batch: EpisodeBatch, config: Any, *, backend: Backend | None = None) -> SolverOutput:
    """The method ``info`` (a registry entry, :func:`get`) on ``batch`` with ``config`` as given:
    nothing is looked up or checked, the caller did that once (``poodle.evaluate`` per call, not per
    chunk: the config checked where it was built, the negatives rule before the first chunk).
    ``backend``: as :func:`run`."""
    return _backend.for_call(backend).solve(info, batch, config)
