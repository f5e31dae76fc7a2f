"""Feature preprocessing before solving: ``l2n``, ``cl2n`` and ``power[:BETA]``.

- ``l2n`` (default): the cached rows as they are, L2-normalised (what every table of the POODLE
  paper uses).
- ``cl2n``: SimpleShot's centring (Wang, Chao, Weinberger, van der Maaten, "SimpleShot: Revisiting
  Nearest-Neighbor Classification for Few-Shot Learning", arXiv:1911.04623, 2019): subtract the
  mean feature of the base (``train``) split, then L2-normalise. SimpleShot centres the backbone's
  raw outputs; a cache stores normalised rows, so the raw row is rebuilt as ``row * norm`` from
  the split's ``norms`` dataset (cache version 2) and the centre is the mean of the base split's
  raw rows. On a cache without norms (version 1) the normalised rows are centred on the mean of
  the normalised base rows instead, and :class:`Preprocessor` says so through its ``log``.
- ``power[:BETA]``: the power transform of PT-MAP (Hu, Gripon, Pateux, "Leveraging the Feature
  Distribution in Transfer-based Few-Shot Learning", ICANN 2021, arXiv:2006.03806): ``x ** BETA``
  per coordinate (default 0.5), then L2-normalise. It is defined for non-negative features (the
  ReLU-then-pool outputs of CNNs, such as every backbone of the POODLE release); a row with a
  negative coordinate (ViT or CLIP features, or rows centred elsewhere) is an error naming the
  split and row, since a fractional power of a negative number is not real. A row's norm is a
  positive factor that the final normalisation removes, so the transform needs no stored norms.
  PT-MAP adds 1e-6 before the power; we do not (``0 ** BETA = 0`` is finite for ``BETA > 0``).

The same transform applies to the episodes' split and to a negative pool read from a cache
(``base`` or ``FILE``); generated negatives (``random``, ``sphere``) are drawn as they are, in the
space of the transformed features.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from poodle import defaults
from poodle.cache import list_splits, read_split
from poodle.errors import CacheError, ConfigError, DataError, mark
from poodle.negatives import GENERATED, load_pool, pool_file, pool_location
from poodle.options import option

KINDS = ("l2n", "cl2n", "power")
DEFAULT_BETA = 0.5  # PT-MAP's default
BASE_SPLIT = "train"


@dataclass(frozen=True)
class Preprocess:
    """A preprocessing choice: ``kind`` in :data:`KINDS`; ``beta`` the power (``power`` only)."""

    kind: str = "l2n"
    beta: float = DEFAULT_BETA

    @property
    def key(self) -> str:
        """The canonical text: ``l2n``, ``cl2n`` or ``power:BETA`` (what results record)."""
        return f"power:{self.beta:g}" if self.kind == "power" else self.kind

    @property
    def needs_base(self) -> bool:
        return self.kind == "cl2n"

    def __str__(self) -> str:
        return self.key


@dataclass(frozen=True)
class PreprocessSpec:
    """The preprocessing setting as a user gives it (its canonical text is what results record)."""

    preprocess: str = option(
        defaults.PREPROCESS,
        convert=lambda text: parse(text).key,
        metavar="l2n|cl2n|power[:BETA]",
        help="Feature preprocessing: the cached rows, SimpleShot centring on the train split's mean, or "
        "PT-MAP's power transform (default BETA 0.5); applied to the split and the negative pool.",
    )


def parse(text: str | Preprocess | None) -> Preprocess:
    """``"l2n"``, ``"cl2n"``, ``"power"``, ``"power:0.4"`` -> :class:`Preprocess` (None: l2n)."""
    if text is None:
        return Preprocess()
    if isinstance(text, Preprocess):
        return text
    kind, sep, arg = str(text).strip().partition(":")
    if kind not in KINDS:
        raise ConfigError(
            f"{mark('preprocess')} {text!r}: use l2n, cl2n or power[:BETA]",
            param="preprocess",
            value=text,
        )
    if kind != "power":
        if sep:
            raise ConfigError(
                f"{mark('preprocess')} {text!r}: {kind} takes no argument",
                param="preprocess",
                value=text,
            )
        return Preprocess(kind)
    if not sep:
        return Preprocess("power", DEFAULT_BETA)
    try:
        beta = float(arg)
    except ValueError:
        raise ConfigError(
            f"{mark('preprocess')} {text!r}: BETA must be a number, e.g. power:0.5",
            param="preprocess",
            value=text,
        ) from None
    if not (math.isfinite(beta) and beta > 0):
        raise ConfigError(
            f"{mark('preprocess')} {text!r}: BETA must be positive",
            param="preprocess",
            value=text,
        )
    return Preprocess("power", beta)


def _normalise_(x: Tensor) -> Tensor:
    """``x`` divided by its row norms, in place (rows of zeros stay zero)."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x.div_(torch.where(n > 0, n, torch.ones_like(n)))


def _float64_copy(x: Tensor) -> Tensor:
    # the one working copy of a transform: the operations after it run in place on it, so a
    # transform holds one float64 copy of the rows at a time (same values as out-of-place)
    return x.to(torch.float64, copy=True)


def power_transform(x: Tensor, beta: float, where: str = "features") -> Tensor:
    """``normalise(x ** beta)`` row-wise, ``x [N, D]`` non-negative; DataError naming the first
    negative row."""
    neg = x < 0
    if bool(neg.any()):
        row = int(neg.any(-1).nonzero()[0, 0])
        raise DataError(
            f"{mark('preprocess')} power: {where} row {row} has a negative value ({float(x[row].min()):.3g}); "
            f"the power transform needs non-negative (ReLU) features: use l2n or cl2n",
            param="preprocess",
            value=where,
        )
    return _normalise_(_float64_copy(x).pow_(beta)).to(x.dtype)


def centre_transform(x: Tensor, centre: Tensor, norms: Tensor | None = None) -> Tensor:
    """``normalise(x * norms - centre)``: ``x [N, D]`` normalised rows, ``norms [N]`` (None: centre
    the normalised rows), ``centre [D]``."""
    raw = _float64_copy(x)
    if norms is not None:
        raw.mul_(norms.double().unsqueeze(-1))
    return _normalise_(raw.sub_(centre.double())).to(x.dtype)


class Preprocessor:
    """A :class:`Preprocess` fitted to a base split: apply it to any split or pool of the same backbone.

    ``base`` is the base split (a ``SplitFeatures``; only needed for ``cl2n``). ``log`` receives
    one line when a fallback applies (centring normalised rows for lack of stored norms).
    """

    def __init__(self, spec: str | Preprocess | None, base=None, log: Callable[[str], None] | None = None) -> None:
        self.spec = parse(spec)
        self.log = log or (lambda msg: None)
        self._said: set[str] = set()
        self._pools: dict[tuple[str, str], Tensor] = {}
        # the most bytes a transform needed beyond its input and output: its float64 working copy
        # of the rows, and a pool's rows as read (freed once transformed)
        self.working_bytes = 0
        self.centre_raw: Tensor | None = None
        self.centre_normalised: Tensor | None = None
        if self.spec.needs_base:
            if base is None:
                raise ConfigError(
                    f"{mark('preprocess')} cl2n needs a base split (the cache's train split) to centre on",
                    param="preprocess",
                    value=spec,
                )
            x = _float64_copy(base.features)
            self._working(x.numel() * 8)
            self.centre_normalised = x.mean(0)
            if base.norms is not None:
                self.centre_raw = x.mul_(base.norms.double().unsqueeze(-1)).mean(0)
            self.base_where = f"split {base.name!r}"

    @classmethod
    def from_cache(
        cls,
        spec: str | Preprocess | None,
        cache_path: str | os.PathLike | None,
        log: Callable[[str], None] | None = None,
    ) -> Preprocessor:
        """Fitted to the ``train`` split of ``cache_path`` (read only when ``spec`` needs it)."""
        p = parse(spec)
        base = None
        if p.needs_base:
            if cache_path is None:
                raise ConfigError(
                    f"{mark('preprocess')} cl2n needs a cache with a train split (the base classes)",
                    param="preprocess",
                    value=spec,
                )
            if BASE_SPLIT not in list_splits(cache_path):
                raise ConfigError(
                    f"{mark('preprocess')} cl2n centres on the base split, but {cache_path} has no complete "
                    f"{BASE_SPLIT!r} split",
                    param="preprocess",
                    value=spec,
                )
            base = read_split(cache_path, BASE_SPLIT)
        return cls(p, base, log)

    @property
    def is_identity(self) -> bool:
        return self.spec.kind == "l2n"

    def _working(self, n: int) -> None:
        self.working_bytes = max(self.working_bytes, int(n))

    def _say(self, msg: str) -> None:
        if msg not in self._said:
            self._said.add(msg)
            self.log(msg)

    def rows(self, x: Tensor, norms: Tensor | None = None, where: str = "features") -> Tensor:
        """The transformed rows ``[N, D]`` of normalised rows ``x [N, D]`` (``norms [N]``: their
        norms before normalisation, when the cache has them)."""
        kind = self.spec.kind
        if kind == "l2n":
            return x
        self._working(x.numel() * 8)
        if kind == "power":
            return power_transform(x, self.spec.beta, where)
        if self.centre_raw is not None and norms is not None:
            return centre_transform(x, self.centre_raw, norms)
        missing = "the base split" if self.centre_raw is None else where
        self._say(
            f"{mark('preprocess')} cl2n: {missing} has no stored raw norms (a cache written before version 2); "
            f"centring the normalised rows instead of the raw features"
        )
        assert self.centre_normalised is not None  # set in __init__ for cl2n
        return centre_transform(x, self.centre_normalised)

    def split(self, split):
        """A copy of a ``SplitFeatures`` with transformed ``features`` (``norms`` dropped: the rows
        are no longer the backbone's outputs scaled)."""
        if self.is_identity:
            return split
        feats = self.rows(split.features, split.norms, where=f"split {split.name!r}")
        return replace(split, features=feats, norms=None)

    def pool(self, source: str, cache_path: str | Path | None, dim: int | None = None) -> Tensor | None:
        """The transformed negative pool of ``source`` (``base`` or ``FILE[:SPLIT]``), or None for
        generated negatives and ``none``."""
        if source in GENERATED or source == "none":
            return None
        if self.is_identity:
            return load_pool(source, cache_path, dim)
        path, split = pool_file(source, cache_path), pool_location(source, cache_path)[1]
        key = (str(path.resolve()), split)
        if key not in self._pools:
            try:
                s = read_split(path, split)
            except CacheError as e:
                raise CacheError(
                    f"negative pool ({mark('negatives')} {source!r}): {e}", param="negatives", value=source
                ) from None
            self._pools = {key: self.rows(s.features, s.norms, where=f"negative pool {source!r}")}
            self._working(s.features.numel() * (8 + s.features.element_size()))
        pool = self._pools[key]
        if pool.shape[0] == 0:
            raise CacheError(
                f"negative pool ({mark('negatives')} {source!r}) ({path}:{split}) has no rows",
                param="negatives",
                value=source,
            )
        if dim is not None and pool.shape[1] != dim:
            raise ConfigError(
                f"negative pool ({mark('negatives')} {source!r}) ({path}:{split}) has feature dimension "
                f"{pool.shape[1]}, but the episodes' features have {dim}",
                param="negatives",
                value=source,
            )
        return pool


__all__ = ["KINDS", "Preprocess", "Preprocessor", "centre_transform", "parse", "power_transform"]
