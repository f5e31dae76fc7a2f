"""Ablation grids: many solver configurations over one cache and one episode set, as paired cells.

A grid file (TOML) gives values for ``poodle solve`` options; every option may be a list, and the
grid is the product of the lists, plus explicit ``[[cell]]`` entries. Every cell with the same
episode settings (cache, split, way, shot, query, imbalance, seed, episodes) runs on identical
episodes and, with the same ``negatives``/``n_neg``, identical negatives, so differences between
cells are paired. The cache is read (and normalised) once per run and the episodes are sampled once
per episode setting; each cell is then one call of :func:`poodle.evaluate.evaluate`.

Results go to one JSON Lines file: a header line that identifies the grid, then one line per
finished cell (configuration, per-episode accuracies, summary, timing), appended and fsynced one at
a time, so an interrupted run resumes where it stopped. See docs/grid.md for the file format.

Method-specific options: an option applies only to the methods whose configuration has it. In the
product, a combination that sets an option its method does not have is the same cell as the one
without it (``alpha`` with ``method = "proto"``), so it is run once, not once per value. The same
holds for ``transductive`` with an inductive-only method (recorded as inductive), and for
``negatives``/``n_neg`` with a method that uses no negatives (recorded as ``negatives = "none"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from poodle.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

RESULTS_FORMAT = "poodle-grid-results"
RESULTS_VERSION = 1

# Options that choose the episodes; cells that agree on all of them share one episode set.
EPISODE_KEYS: tuple[str, ...] = ("cache", "split", "way", "shot", "query", "imbalance", "seed", "episodes")
# Episode options a cell records only when set (so that cells written before they existed keep their keys).
OPTIONAL_EPISODE_KEYS: tuple[str, ...] = ("query_classes",)
NEGATIVE_KEYS: tuple[str, ...] = ("negatives", "n_neg")
GENERAL_KEYS: tuple[str, ...] = EPISODE_KEYS + OPTIONAL_EPISODE_KEYS + NEGATIVE_KEYS + ("method",)
NEGATIVE_KEYWORDS = ("base", "random", "sphere", "none")

# Defaults are those of `poodle solve` (design.md), which are the paper's main protocol: 5-way,
# 15 queries per class, 2,000 episodes (Tables 1-3), n_neg as NegativeSpec's default.
DEFAULTS: dict[str, Any] = {
    "split": "test", "way": 5, "shot": 1, "query": 15, "imbalance": None, "seed": 0,
    "episodes": 2000, "negatives": "base", "n_neg": 400, "method": "poodle",
}
SECTIONS = ("episodes", "negatives", "solver")
TOP_LEVEL_ONLY = ("name", "description", "product", "caches", "cell")


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"grid file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


# ---------------------------------------------------------------------------------------------
# Parsing and value checks


def _check_int(where: str, key: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ConfigError(f"{where}: option {key!r} expects an integer, got {v!r}")
    if v < minimum:
        raise ConfigError(f"{where}: option {key!r} must be at least {minimum}, got {v}")
    return v


def _check_general(where: str, key: str, v: Any) -> Any:
    """Type-check and normalise a value of a general (non-solver) option."""
    if key in ("cache", "split", "method"):
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{where}: option {key!r} expects a non-empty string, got {v!r}")
        return v
    if key == "negatives":
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{where}: option 'negatives' expects base, random, sphere, none, a cache "
                              f"name from [caches] or FILE[:SPLIT], got {v!r}")
        return v
    if key == "way":
        return _check_int(where, key, v, 2)
    if key in ("shot", "query", "episodes", "n_neg"):
        return _check_int(where, key, v, 1)
    if key == "seed":
        return _check_int(where, key, v, 0)
    if key == "query_classes":
        if isinstance(v, str) and v.lower() in ("none", "all"):
            return None
        return _check_int(where, key, v, 1)
    if key == "imbalance":
        # TOML has no null: "none"/"balanced"/false mean balanced queries.
        if v is False or (isinstance(v, str) and v.lower() in ("none", "balanced")):
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{where}: option 'imbalance' expects a Dirichlet concentration > 0 or "
                              f"\"none\", got {v!r}")
        return float(v)
    raise AssertionError(key)


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else [v]


def _solver_fields() -> dict[str, set[str]]:
    from poodle import solvers

    return {name: {f.name for f in dataclasses.fields(solvers.get(name).config)}
            for name in solvers.available()}


@dataclass
class GridSpec:
    """A parsed grid file.

    Attributes:
        path: the grid file (relative paths inside it resolve against its folder).
        name: a free name for the grid (defaults to the file's stem).
        caches: named caches ``{name: path as written}`` from ``[caches]``.
        axes: option -> list of values; scalars are one-value lists. Defaults fill the rest.
        cells: explicit ``[[cell]]`` entries (option -> value or list of values).
        product: whether the product of ``axes`` is part of the grid (``product = false`` runs only
            the explicit cells, with ``axes`` as their defaults).
    """

    path: Path
    name: str
    caches: dict[str, str]
    axes: dict[str, list[Any]]
    cells: list[dict[str, Any]]
    product: bool = True
    description: str = ""

    @property
    def base_dir(self) -> Path:
        return self.path.parent


def parse_grid(data: Mapping[str, Any], path: Path, overrides: Mapping[str, Any] | None = None) -> GridSpec:
    """Check a grid's TOML content and normalise it (see :func:`load_grid`)."""
    where = str(path)
    flat: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{key}] must be a table of options")
            for k, v in value.items():
                if isinstance(v, dict):
                    raise ConfigError(f"{where}: [{key}].{k} is a table; options take a value or a list")
                if k in flat:
                    raise ConfigError(f"{where}: option {k!r} is given twice ({origin[k]} and [{key}])")
                flat[k], origin[k] = v, f"[{key}]"
        elif key in TOP_LEVEL_ONLY:
            continue
        else:
            if isinstance(value, dict):
                raise ConfigError(f"{where}: unknown section [{key}]; sections are "
                                  f"{', '.join('[' + s + ']' for s in SECTIONS)}, [caches] and [[cell]]")
            if key in flat:
                raise ConfigError(f"{where}: option {key!r} is given twice")
            flat[key], origin[key] = value, "top level"
    for k, v in (overrides or {}).items():
        flat[k] = v

    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise ConfigError(f"{where}: 'name' must be a string")
    description = data.get("description", "")
    product = data.get("product", True)
    if not isinstance(product, bool):
        raise ConfigError(f"{where}: 'product' must be true or false, got {product!r}")

    caches = data.get("caches", {})
    if not isinstance(caches, dict) or not all(isinstance(v, str) for v in caches.values()):
        raise ConfigError(f"{where}: [caches] must map names to cache file paths (strings)")
    for cname in caches:
        if cname in NEGATIVE_KEYWORDS:
            raise ConfigError(f"{where}: cache name {cname!r} is reserved (negatives keyword); rename it")

    raw_cells = data.get("cell", [])
    if not isinstance(raw_cells, list) or not all(isinstance(c, dict) for c in raw_cells):
        raise ConfigError(f"{where}: 'cell' must be written as [[cell]] tables")

    fields_by_method = _solver_fields()
    axes = {k: _normalise_values(where, k, v) for k, v in flat.items()}
    cells = []
    for i, c in enumerate(raw_cells):
        cw = f"{where}: [[cell]] #{i + 1}"
        cell = {}
        for k, v in c.items():
            if isinstance(v, dict):
                raise ConfigError(f"{cw}: {k!r} is a table; options take a value or a list")
            if k == "label":
                if not isinstance(v, str) or not v:
                    raise ConfigError(f"{cw}: 'label' must be a non-empty string, got {v!r}")
                cell[k] = v
            else:
                cell[k] = _normalise_values(cw, k, v)
        cells.append(cell)

    if "cache" not in axes and (product or not all("cache" in c for c in cells)):
        raise ConfigError(f"{where}: no cache given: set cache = \"FILE.h5\" (or a name from [caches]), "
                          f"or pass --cache")
    if "label" in axes:
        raise ConfigError(f"{where}: 'label' names one explicit cell; set it inside a [[cell]]")
    if not product and not cells:
        raise ConfigError(f"{where}: product = false but there is no [[cell]]: the grid is empty")

    spec = GridSpec(path=path, name=name, caches=dict(caches), axes=axes, cells=cells,
                    product=product, description=str(description))
    _check_option_names(spec, fields_by_method)
    return spec


def _normalise_values(where: str, key: str, value: Any) -> list[Any]:
    values = _as_list(value)
    if not values:
        raise ConfigError(f"{where}: option {key!r} has an empty list of values")
    if key in GENERAL_KEYS:
        values = [_check_general(where, key, v) for v in values]
    else:
        for v in values:
            if isinstance(v, (list, dict)):
                raise ConfigError(f"{where}: option {key!r} has a nested value {v!r}")
    return values


def _check_option_names(spec: GridSpec, fields_by_method: Mapping[str, set[str]]) -> None:
    """Every option must be a general one or belong to at least one method it is combined with."""
    from poodle import solvers

    where = str(spec.path)
    base_methods = spec.axes.get("method", [DEFAULTS["method"]])
    all_methods = set(base_methods)
    for c in spec.cells:
        all_methods.update(c.get("method", base_methods))
    for m in sorted(all_methods):
        try:
            solvers.get(m)
        except ConfigError as e:  # unknown method: the message lists the known ones
            raise ConfigError(f"{where}: {e}") from None

    def known(methods: Iterable[str]) -> set[str]:
        names = set(GENERAL_KEYS) | {"transductive"}
        for m in methods:
            names |= fields_by_method[m]
        return names

    def complain(w: str, key: str, methods: Iterable[str]) -> None:
        methods = sorted(set(methods))
        owners = sorted(m for m, f in fields_by_method.items() if key in f)
        hint = f" (it is an option of {', '.join(owners)})" if owners else ""
        opts = sorted(known(methods) - set(GENERAL_KEYS))
        raise ConfigError(f"{w}: unknown option {key!r} for method {', '.join(methods)}{hint}; known options: "
                          f"{', '.join(GENERAL_KEYS)}; solver options: {', '.join(opts)}")

    k_all = known(all_methods)
    for key in spec.axes:
        if key not in k_all:
            complain(where, key, all_methods)
    for i, c in enumerate(spec.cells):
        methods = c.get("method", base_methods)
        k_cell = known(methods)
        for key in c:
            if key != "label" and key not in k_cell:
                complain(f"{where}: [[cell]] #{i + 1}", key, methods)


def load_grid(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> GridSpec:
    """Read and check a grid file.

    ``overrides`` replace (or add) top-level options, e.g. ``{"cache": "/abs/feat.h5",
    "episodes": 200}``; like values in the file, relative paths in them resolve against the grid
    file's folder (the CLI's ``--cache`` makes its path absolute first). Raises
    :class:`ConfigError` naming the file and the option.
    """
    path = Path(path)
    return parse_grid(_load_toml(path), path, overrides)


# ---------------------------------------------------------------------------------------------
# Expansion into cells


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid.

    Attributes:
        label: display name (``[[cell]] label``, else the method name).
        cache: the cache as written in the grid (a path or a ``[caches]`` name).
        episode: ``{split, way, shot, query, imbalance, seed, episodes}``.
        negatives: negative source as written (``"none"`` for a method that uses no negatives).
        n_neg: negatives per episode (``None`` without negatives).
        method: registered solver name.
        options: the method's full configuration (dataclass fields, defaults filled in).
        transductive: whether the method uses the unlabelled queries in this cell.
        index: position in the grid (product first, then explicit cells).
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

    def identity(self) -> dict[str, Any]:
        return {"label": self.label, "cache": self.cache, "episode": self.episode,
                "negatives": self.negatives, "n_neg": self.n_neg, "method": self.method,
                "options": self.options, "transductive": self.transductive}

    @property
    def key(self) -> str:
        """Stable hash of everything that determines this cell's accuracies (and its label)."""
        return _hash(self.identity())[:16]

    def episode_key(self) -> tuple:
        return (self.cache,) + tuple(self.episode.get(k) for k in EPISODE_KEYS[1:] + OPTIONAL_EPISODE_KEYS)

    def negative_key(self) -> tuple:
        return (self.negatives, self.n_neg)

    def flat(self) -> dict[str, Any]:
        """One namespace for reports: episode options, negatives, method and solver options."""
        return record_flat(self.identity())

    def describe(self, keys: Sequence[str] | None = None) -> str:
        flat = self.flat()
        keys = keys if keys is not None else [k for k in ("shot", "transductive") if k in flat]
        parts = [self.label] + [f"{k}={_fmt(flat[k])}" for k in keys if k != "label" and k in flat]
        return " ".join(parts)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, float) and v.is_integer():
        return str(int(v)) if abs(v) < 1e15 else repr(v)
    return str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _make_cell(combo: Mapping[str, Any], label: str | None, strict_keys: set[str], where: str) -> Cell:
    """A cell from one combination of option values. Solver options the method lacks are dropped
    (the product's rule), except those in ``strict_keys`` (named by an explicit cell): an error."""
    from poodle import solvers

    method = combo.get("method", DEFAULTS["method"])
    info = solvers.get(method)
    fields = {f.name for f in dataclasses.fields(info.config)}
    opts: dict[str, Any] = {}
    for k, v in combo.items():
        if k in GENERAL_KEYS:
            continue
        if k == "transductive" and info.transductive != "optional":
            if not isinstance(v, bool):
                raise ConfigError(f"{where}: option 'transductive' expects true or false, got {v!r}")
            if v and info.transductive == "never" and k in strict_keys:
                raise ConfigError(f"{where}: method {method!r} is inductive only; drop transductive = true")
            continue
        if k in fields:
            opts[k] = v
        elif k in strict_keys:
            raise ConfigError(f"{where}: method {method!r} has no option {k!r}; its options are: "
                              f"{', '.join(sorted(fields))}")
    for k, v in opts.items():
        _check_annotated(where, method, k, v, next(f for f in dataclasses.fields(info.config) if f.name == k))
    try:
        cfg = solvers.make_config(method, opts, strict=True)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    options = _jsonable(dataclasses.asdict(cfg))
    if info.transductive == "optional":
        transductive = bool(options.get("transductive", False))
    else:
        transductive = info.transductive == "always"
    episode = {k: combo.get(k, DEFAULTS.get(k)) for k in EPISODE_KEYS[1:]}
    episode.update({k: combo[k] for k in OPTIONAL_EPISODE_KEYS if combo.get(k) is not None})
    from poodle.evaluate import needs_negatives

    if needs_negatives(method, cfg):
        negatives, n_neg = combo.get("negatives", DEFAULTS["negatives"]), combo.get("n_neg", DEFAULTS["n_neg"])
        if negatives == "none":
            raise ConfigError(f"{where}: method {method!r} with these options needs negatives, but negatives = "
                              f"\"none\" (use base, random, sphere, a [caches] name or FILE[:SPLIT])")
    else:
        # No negatives consumed (a method without them, or POODLE with beta = 0): the cell does not
        # depend on negatives/n_neg, so their lists do not multiply it.
        negatives, n_neg = "none", None
    cache = combo.get("cache")
    if cache is None:
        raise ConfigError(f"{where}: no cache given (set cache = \"FILE.h5\" or pass --cache)")
    return Cell(label=label or method, cache=cache, episode=episode, negatives=negatives, n_neg=n_neg,
                method=method, options=options, transductive=transductive)


def _product(axes: Mapping[str, list[Any]]) -> Iterable[dict[str, Any]]:
    # General options outermost, in a fixed order, so that cells sharing episodes are adjacent;
    # solver options follow in the order the file gives them.
    order = [k for k in GENERAL_KEYS if k in axes] + [k for k in axes if k not in GENERAL_KEYS]
    for values in itertools.product(*(axes[k] for k in order)):
        yield dict(zip(order, values))


def expand(spec: GridSpec) -> list[Cell]:
    """All cells of the grid: the product of the option lists (if ``product``), then the explicit
    cells (each itself a small product over its own lists, with the grid's values as defaults).

    Cells with the same configuration and label are kept once (first occurrence)."""
    out: dict[str, Cell] = {}
    where = str(spec.path)
    if spec.product:
        for combo in _product(spec.axes):
            c = _make_cell(combo, None, set(), where)
            out.setdefault(c.key, c)
    for i, entry in enumerate(spec.cells):
        cw = f"{where}: [[cell]] #{i + 1}"
        own = set(entry) - {"label"}
        named = "method" in entry and len(entry["method"]) == 1
        axes = {**spec.axes, **{k: v for k, v in entry.items() if k != "label"}}
        for combo in _product(axes):
            if not named and not _fits(combo, own):
                continue  # e.g. alpha = 0 in a cell that inherits method = ["proto", "poodle"]: poodle only
            c = _make_cell(combo, entry.get("label"), own, cw)
            out.setdefault(c.key, c)
    cells = [dataclasses.replace(c, index=i) for i, c in enumerate(out.values())]
    if not cells:
        raise ConfigError(f"{where}: the grid has no cells")
    return cells


def _check_annotated(where: str, method: str, key: str, value: Any, f: dataclasses.Field) -> None:
    """Type-check a value for a field whose default is ``None`` (``int | None`` and the like), which
    the registry's coercion leaves alone: the grid file is typed, so its values must fit."""
    if f.default is not None or value is None:
        return
    ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kinds = {t.strip() for t in ann.replace("Optional[", "").replace("]", "").split("|")} - {"None"}
    ok = {"bool": lambda v: isinstance(v, bool),
          "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str)}
    checks = [ok[k] for k in kinds if k in ok]
    if checks and len(checks) == len(kinds) and not any(c(value) for c in checks):
        raise ConfigError(f"{where}: option {key!r} of method {method!r} expects {' or '.join(sorted(kinds))}, "
                          f"got {value!r}")


def _fits(combo: Mapping[str, Any], own: set[str]) -> bool:
    """Whether the combination's method has every solver option in ``own`` (and can be
    transductive if ``own`` asks for it)."""
    from poodle import solvers

    info = solvers.get(combo.get("method", DEFAULTS["method"]))
    fields = {f.name for f in dataclasses.fields(info.config)}
    for k in own - set(GENERAL_KEYS):
        if k == "transductive":
            if combo[k] and info.transductive == "never":
                return False
        elif k not in fields:
            return False
    return True


def grid_hash(cells: Sequence[Cell]) -> str:
    """Identity of a grid: the set of its cells' keys. Comments, key order, ``1`` vs ``1.0`` and
    the grid file's name do not change it; adding or changing any cell does."""
    return _hash(sorted(c.key for c in cells))[:16]


# ---------------------------------------------------------------------------------------------
# Paths


def resolve_cache(spec: GridSpec, cache: str) -> Path:
    """A cell's ``cache`` (a [caches] name or a path) as a file path; relative paths resolve
    against the grid file's folder."""
    p = spec.caches.get(cache, cache)
    path = Path(p).expanduser()
    return path if path.is_absolute() else spec.base_dir / path


def resolve_negatives(spec: GridSpec, source: str) -> tuple[str, Path | None]:
    """``base|random|sphere|none`` unchanged; a [caches] name ``NAME[:SPLIT]`` becomes
    ``FILE:SPLIT`` (split ``train`` by default: the OOD pool of the paper's Table 5 is the train
    split of the other dataset); ``FILE[:SPLIT]`` resolves FILE against the grid file's folder."""
    if source in NEGATIVE_KEYWORDS:
        return source, None
    name, _, split = source.partition(":")
    if name in spec.caches:
        path = resolve_cache(spec, name)
        return f"{path}:{split or 'train'}", path
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = spec.base_dir / path
    return (f"{path}:{split}" if split else str(path)), path


def default_results_path(grid_path: str | os.PathLike) -> Path:
    """``alpha_beta.toml`` -> ``alpha_beta.results.jsonl`` next to it."""
    p = Path(grid_path)
    return p.with_name(p.stem + ".results.jsonl")


# ---------------------------------------------------------------------------------------------
# The results file


def read_results(path: str | os.PathLike, *, repair: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a grid results file: ``(header, cell records)``.

    A truncated last line (a run killed mid-write) is ignored, and with ``repair`` it is cut off
    the file; a malformed line elsewhere is a :class:`ConfigError` naming the line. When a cell was
    recorded twice (``--force`` on a part of it) the last record wins.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"results file {path} does not exist") from None
    lines = raw.split(b"\n")
    complete_len = 0
    header = None
    records: dict[str, dict[str, Any]] = {}
    offset = 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        end = offset + len(line) + (0 if last else 1)
        if not line.strip():
            offset = end
            if not last:
                complete_len = end
            continue
        try:
            obj = json.loads(line)
            if last:
                # JSON without its newline may still be cut short (e.g. a number); only a line
                # that ended with "\n" was surely written whole.
                raise ValueError("no newline")
        except ValueError:
            if last:
                break
            raise ConfigError(f"{path}: line {i + 1} is not valid JSON; the file is damaged") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}: line {i + 1} is not a JSON object")
        if header is None:
            if obj.get("format") != RESULTS_FORMAT:
                raise ConfigError(f"{path} is not a poodle grid results file (its first line has no "
                                  f"format={RESULTS_FORMAT!r})")
            if obj.get("version") != RESULTS_VERSION:
                raise ConfigError(f"{path}: results format version {obj.get('version')} is not supported "
                                  f"(this poodle reads version {RESULTS_VERSION})")
            header = obj
        elif obj.get("kind") == "cell":
            if "key" not in obj or "acc" not in obj:
                raise ConfigError(f"{path}: line {i + 1} is a cell record without key or acc")
            records[obj["key"]] = obj
        complete_len = end
        offset = end
    if header is None:
        raise ConfigError(f"{path} is empty or has no header line; delete it or use --force")
    if repair and complete_len < len(raw):
        with open(path, "r+b") as f:
            f.truncate(complete_len)
            f.flush()
            os.fsync(f.fileno())
    return header, list(records.values())


def _append_line(path: Path, obj: Mapping[str, Any]) -> None:
    data = (json.dumps(obj, separators=(",", ":"), allow_nan=True) + "\n").encode()
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_header(path: Path, header: Mapping[str, Any]) -> None:
    from poodle.utils import atomic_path

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write((json.dumps(header, separators=(",", ":")) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class CellEvent:
    """What the progress callbacks receive.

    ``kind`` is ``"start"`` (``cells`` are about to be solved together; ``cell`` is the first),
    ``"done"`` (``cell`` finished and written, ``record`` is its line) or ``"skip"`` (already in the
    results file). ``done``/``total`` count cells of the grid.
    """

    kind: str
    cell: Cell
    done: int
    total: int
    record: dict[str, Any] | None = None
    cells: list[Cell] = field(default_factory=list)


@dataclass
class GridRun:
    """Outcome of :func:`run_grid`: the header and every cell's record, in grid order."""

    path: Path
    header: dict[str, Any]
    records: list[dict[str, Any]]
    computed: int
    skipped: int
    seconds: float
    load_seconds: float = 0.0
    sample_seconds: float = 0.0


def _fingerprints(spec: GridSpec, cells: Sequence[Cell]) -> dict[str, str]:
    from poodle.utils import file_sha256

    files: dict[str, Path] = {}
    for c in cells:
        files[c.cache] = resolve_cache(spec, c.cache)
        if c.negatives not in NEGATIVE_KEYWORDS:
            _, p = resolve_negatives(spec, c.negatives)
            if p is not None:
                files[c.negatives.partition(":")[0]] = p
    out = {}
    for name, p in sorted(files.items()):
        if not p.exists():
            raise ConfigError(f"{spec.path}: cache {name!r} -> {p} does not exist")
        out[name] = file_sha256(p)
    return out


def run_grid(spec: GridSpec, out: str | os.PathLike | None = None, *, force: bool = False,
             device: str = "auto", max_memory: str | int = "2GiB",
             on_cell: Callable[[CellEvent], None] | None = None,
             progress: Callable[[int], None] | None = None,
             cells: Sequence[Cell] | None = None, cells_per_call: int = 4) -> GridRun:
    """Run every cell of ``spec`` that the results file ``out`` does not hold yet.

    Args:
        spec: the parsed grid (:func:`load_grid`).
        out: the JSON Lines results file (default: next to the grid file, see
            :func:`default_results_path`).
        force: start the results file afresh (also when it belongs to another grid).
        device, max_memory: passed to :func:`poodle.evaluate.evaluate`.
        on_cell: called with a :class:`CellEvent` before and after each cell (and for skipped ones).
        progress: called with the number of episodes just solved (for an episodes/s display).
        cells: the expanded cells, when the caller already has them.
        cells_per_call: cells on the same episodes and negatives are solved by one call of
            ``evaluate`` (up to this many): each chunk of episodes is then gathered, and its negatives
            drawn, once for all of them. Results are written after each call, so an interruption
            loses at most one call's cells.

    Returns:
        a :class:`GridRun`; its ``records`` are the parsed result lines of all cells, in grid order.

    Raises:
        ConfigError: ``out`` belongs to another grid, or a cache changed since it was started.
    """
    from poodle import __version__
    from poodle.cache import read_split
    from poodle.episodes import EpisodeSpec, sample_episodes
    from poodle.evaluate import evaluate, summarize
    from poodle.negatives import NegativeSpec
    from poodle import solvers

    t_start = time.perf_counter()
    cells = list(cells) if cells is not None else expand(spec)
    out = Path(out) if out is not None else default_results_path(spec.path)
    ghash = grid_hash(cells)
    fingerprints = _fingerprints(spec, cells)
    header = {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, "kind": "header", "grid_hash": ghash,
              "name": spec.name, "grid_file": str(spec.path), "n_cells": len(cells),
              "caches": fingerprints, "poodle_version": __version__,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    done: dict[str, dict[str, Any]] = {}
    if out.exists() and not force:
        old_header, records = read_results(out, repair=True)
        if old_header.get("grid_hash") != ghash:
            raise ConfigError(
                f"{out} holds results of another grid (grid hash {old_header.get('grid_hash')}, this grid "
                f"{ghash}: the cells differ); use --out for a new file or --force to overwrite it")
        for name, sha in fingerprints.items():
            old = old_header.get("caches", {}).get(name)
            if old is not None and old != sha:
                raise ConfigError(f"cache {name!r} changed since {out} was started (sha256 {old[:12]} -> "
                                  f"{sha[:12]}); use --force to recompute the grid")
        header = old_header
        keys = {c.key for c in cells}
        done = {r["key"]: r for r in records if r["key"] in keys}
    else:
        _write_header(out, header)

    total = len(cells)
    n_done = 0
    for c in cells:
        if c.key in done:
            n_done += 1
            if on_cell:
                on_cell(CellEvent("skip", c, n_done, total, done[c.key]))
    pending = [c for c in cells if c.key not in done]

    # Group so that each cache is read once and each episode set sampled once: caches in order of
    # first appearance, then episode settings, then the grid order.
    cache_order = {k: i for i, k in reversed(list(enumerate(c.cache for c in cells)))}
    ep_order = {k: i for i, k in reversed(list(enumerate(c.episode_key() for c in cells)))}
    neg_order = {k: i for i, k in reversed(list(enumerate(c.negative_key() for c in cells)))}
    pending.sort(key=lambda c: (cache_order[c.cache], ep_order[c.episode_key()], neg_order[c.negative_key()],
                                c.index))

    computed = 0
    load_s = sample_s = 0.0
    features = None
    features_key = None
    episode_sets: dict[tuple, Any] = {}
    prepared: dict[tuple, Any] = {}
    try:
        from poodle.evaluate import prepare_negatives
    except ImportError:  # an evaluate without it draws the negatives itself, identically
        prepare_negatives = None
    for batch in _batches(pending, cells_per_call):
        c0 = batch[0]
        cache_path = resolve_cache(spec, c0.cache)
        split = c0.episode["split"]
        if features_key != (c0.cache, split):
            t0 = time.perf_counter()
            features = None  # free the previous cache's features before reading the next
            features = read_split(cache_path, split)
            features_key = (c0.cache, split)
            episode_sets = {}
            load_s += time.perf_counter() - t0
        ek = c0.episode_key()
        if ek not in episode_sets:
            t0 = time.perf_counter()
            e = c0.episode
            es = EpisodeSpec(split=split, way=e["way"], shot=e["shot"], query=e["query"],
                             imbalance=e["imbalance"], seed=e["seed"], query_classes=e.get("query_classes"))
            episode_sets[ek] = sample_episodes(features.labels, es, e["episodes"], classes=features.classes)
            sample_s += time.perf_counter() - t0
        episodes = episode_sets[ek]
        negatives = None
        if c0.negatives != "none":
            source, _ = resolve_negatives(spec, c0.negatives)
            negatives = NegativeSpec(source=source, n_neg=c0.n_neg)
            if prepare_negatives is not None:
                # Draw the pool rows once per (episodes, source, n_neg), not once per call.
                nk = (ek, source, c0.n_neg)
                if nk not in prepared:
                    prepared.clear()
                    prepared[nk] = prepare_negatives(episodes, negatives, cache_path, features.features.shape[1])[0]
                episodes = prepared[nk]
        methods = [(c.key, c.method, solvers.make_config(c.method, dict(c.options), strict=True)) for c in batch]
        if on_cell:
            on_cell(CellEvent("start", c0, n_done, total, cells=list(batch)))
        # evaluate reports episodes per chunk for all the methods of the call: count cell-episodes
        call_progress = None if progress is None else (lambda n, k=len(batch): progress(n * k))
        stats: dict[str, Any] = {}
        t0 = time.perf_counter()
        accs = evaluate(features, episodes, methods, negatives=negatives, cache_path=cache_path,
                        device=device, max_memory=max_memory, progress=call_progress, stats=stats)
        call_seconds = time.perf_counter() - t0
        for c in batch:
            acc = accs[c.key].double().cpu()
            seconds = float(stats.get("seconds", {}).get(c.key, call_seconds / len(batch)))
            mean, ci = summarize(acc)
            record = {"kind": "cell", "key": c.key, "index": c.index, "label": c.label, "cache": c.cache,
                      "episode": c.episode, "negatives": c.negatives, "n_neg": c.n_neg, "method": c.method,
                      "options": c.options, "transductive": c.transductive,
                      "mean": float(mean), "ci95": float(ci), "n": int(acc.numel()),
                      "seconds": round(seconds, 4),
                      "episodes_per_s": round(acc.numel() / seconds, 2) if seconds > 0 else None,
                      "call_seconds": round(call_seconds, 4), "call_cells": len(batch),
                      "device": str(stats.get("device", device)), "chunk_size": stats.get("chunk_size"),
                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "acc": [float(a) for a in acc.tolist()]}
            _append_line(out, record)
            done[c.key] = record
            computed += 1
            n_done += 1
            if on_cell:
                on_cell(CellEvent("done", c, n_done, total, record))

    records = [done[c.key] for c in cells]
    return GridRun(path=out, header=header, records=records, computed=computed,
                   skipped=total - computed, seconds=time.perf_counter() - t_start,
                   load_seconds=load_s, sample_seconds=sample_s)


def _batches(pending: Sequence[Cell], size: int) -> Iterable[list[Cell]]:
    """Consecutive runs of cells that share episodes and negatives, at most ``size`` long."""
    size = max(1, int(size))
    batch: list[Cell] = []
    for c in pending:
        if batch and (len(batch) >= size or (c.episode_key(), c.negative_key()) !=
                      (batch[0].episode_key(), batch[0].negative_key())):
            yield batch
            batch = []
        batch.append(c)
    if batch:
        yield batch


def record_flat(record: Mapping[str, Any]) -> dict[str, Any]:
    """A results-file cell record as one namespace (like :meth:`Cell.flat`), for reports."""
    d = {"label": record["label"], "cache": record["cache"], **record["episode"],
         "negatives": record["negatives"], "n_neg": record["n_neg"], "method": record["method"]}
    for k, v in record.get("options", {}).items():
        d.setdefault(k, v)
    d["transductive"] = record.get("transductive", False)
    return d
