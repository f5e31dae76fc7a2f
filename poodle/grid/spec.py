"""Grid files: parsing, value checks and expansion into cells (see docs/grid.md).

A grid file (TOML) gives values for ``poodle solve`` options; every option may be a list, and the
grid is the product of the lists, plus explicit ``[[cell]]`` entries. Every cell with the same
episode settings (cache, split, way, shot, query, imbalance, seed, episodes) runs on identical
episodes and, with the same ``negatives``/``n_neg``, identical negatives, so differences between
cells are paired.

Method-specific options: an option applies only to the methods whose configuration has it. In the
product, a combination that sets an option its method does not have is the same cell as the one
without it (``alpha`` with ``method = "proto"``), so it is run once, not once per value. The same
holds for ``transductive`` with an inductive-only method (recorded as inductive), and for
``negatives``/``n_neg`` with a method that uses no negatives (recorded as ``negatives = "none"``).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from poodle import solvers
from poodle.cells import Cell, Locations, located, make_cell, numbered
from poodle.defaults import NEGATIVE_KEYWORDS
from poodle.errors import ConfigError, PoodleError, mark
from poodle.settings import GENERAL_KEYS, check_setting, general_defaults
from poodle.utils import content_hash, resolve_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# Defaults are those of `poodle solve`: the settings' declared defaults (poodle.settings).
DEFAULTS: dict[str, Any] = general_defaults()
SECTIONS = ("episodes", "negatives", "solver")
TOP_LEVEL_ONLY = ("name", "description", "product", "caches", "cell")


def _load_toml(path: Path) -> dict[str, Any]:
    resolve_path(path, what="grid file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"grid file {path} does not exist", param="path", value=path) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}", param="path", value=path) from None
    except UnicodeDecodeError as e:
        line = raw_line(path, e.start)
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}, line "
            f"{line}); TOML files must be UTF-8",
            param="path",
            value=path,
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"grid file {path} is a directory", param="path", value=path) from None


_TABLE = re.compile(r"\s*\[(\[)?\s*([\w.-]+)\s*\]")  # [episodes], [[cell]]
_KEY = re.compile(r"""\s*(?:"([^"]+)"|'([^']+)'|([\w-]+))\s*=""")  # way =, "way" =
_STRINGS = re.compile(r""""(?:\\.|[^"\\])*"|'[^']*'|#.*""")  # strings and a comment: no brackets of an array


def key_lines(path: Path) -> dict[tuple[int, str], int]:
    """The 1-based line on which each option of grid file ``path`` is written, by ``(cell, key)``:
    cell 0 outside the ``[[cell]]`` tables, ``i`` in the i-th; empty when the file cannot be read.
    The lines of a multi-line array or string are not taken for keys."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError):
        return {}
    out: dict[tuple[int, str], int] = {}
    cell, depth, in_string = 0, 0, False  # depth: brackets a multi-line array left open
    for n, line in enumerate(text.splitlines(), 1):
        if line.count('"""') % 2 or line.count("'''") % 2:
            in_string = not in_string
            continue
        if in_string:
            continue
        table = _TABLE.match(line) if depth == 0 else None
        if table:
            cell = cell + 1 if table.group(1) and table.group(2) == "cell" else 0
            continue
        key = _KEY.match(line) if depth == 0 else None
        if key:
            out.setdefault((cell, next(g for g in key.groups() if g)), n)
        code = _STRINGS.sub("", line)
        depth = max(0, depth + code.count("[") - code.count("]"))
    return out


def _at(where: str, lines: Mapping[tuple[int, str], int], key: str | None, cell: int = 0) -> str:
    """``where`` (the file, a ``[[cell]]``) with the line that sets option ``key`` (in the ``cell``-th
    ``[[cell]]``, else outside them; ``lines``: :func:`key_lines`), when the file has one."""
    line = lines.get((cell, key or ""), lines.get((0, key or "")))
    return where if line is None else f"{where}, line {line}"


def _overridden(where: str, key: str) -> str:
    """``where`` (the grid file) with the override that sets option ``key``: its value is in no line."""
    return f"{where}, {mark('overrides')} {key}"


def raw_line(path: Path, offset: int) -> int:
    """1-based line number of byte ``offset`` in ``path``."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


# ---------------------------------------------------------------------------------------------
# Parsing and value checks


def _check_general(where: str, key: str, v: Any) -> Any:
    """A general option's value, checked by its declaration (:func:`poodle.settings.check_setting`)."""
    try:
        return check_setting(key, v)
    except PoodleError as e:
        raise located(where, e) from None


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else [v]


def _solver_fields() -> dict[str, set[str]]:
    return {name: set(solvers.get(name).options()) for name in solvers.available()}


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
    cache_defaulted: bool = False  # the cache is the caller's default_cache: the file names none
    # where each option is written: {(0, key) outside the [[cell]] tables, (i, key) in the i-th}: line
    lines: dict[tuple[int, str], int] = field(default_factory=dict)
    overridden: tuple[str, ...] = ()  # the options the caller's overrides set (the command line's --set)

    def where(self, where: str, key: str | None, cell: int = 0) -> str:
        """``where`` with the line that sets option ``key`` (:func:`_at`), or the override that does."""
        if key in self.overridden and (cell, key) not in self.lines:
            return _overridden(where, key)
        return _at(where, self.lines, key, cell)

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    @property
    def locations(self) -> Locations:
        """Relative paths resolve against the grid file's folder; ``[caches]`` names to their files."""
        return Locations(self.base_dir, dict(self.caches))


def parse_grid(
    data: Mapping[str, Any],
    path: Path,
    overrides: Mapping[str, Any] | None = None,
    default_cache: str | None = None,
) -> GridSpec:
    """Check a grid's TOML content and normalise it (see :func:`load_grid`)."""
    where = str(path)
    flat = _flatten(data, where)
    for k, v in (overrides or {}).items():
        flat[k] = v

    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise ConfigError(f"{where}: 'name' must be a string", param="name", value=name)
    description = data.get("description", "")
    product = data.get("product", True)
    if not isinstance(product, bool):
        raise ConfigError(f"{where}: 'product' must be true or false, got {product!r}", param="product", value=product)

    caches = data.get("caches", {})
    if not isinstance(caches, dict) or not all(isinstance(v, str) for v in caches.values()):
        raise ConfigError(
            f"{where}: [caches] must map names to cache file paths (strings)", param="caches", value=caches
        )
    for cname in caches:
        if cname in NEGATIVE_KEYWORDS:
            raise ConfigError(
                f"{where}: cache name {cname!r} is reserved (negatives keyword); rename it", param="caches", value=cname
            )

    raw_cells = data.get("cell", [])
    if not isinstance(raw_cells, list) or not all(isinstance(c, dict) for c in raw_cells):
        raise ConfigError(f"{where}: 'cell' must be written as [[cell]] tables", param="cell", value=raw_cells)

    fields_by_method = _solver_fields()
    # an error about a value names its line (an override has none: it is not in the file)
    lines = {(c, k): n for (c, k), n in key_lines(path).items() if c or k not in (overrides or {})}
    # an override's value is said as the override (the command line's --set), not as the file's
    said = {k: _overridden(where, k) for k in overrides or {}}
    axes = {k: _normalise_values(said.get(k) or _at(where, lines, k), k, v) for k, v in flat.items()}
    cells = [_read_cell(f"{where}: [[cell]] #{i + 1}", c, lines, i + 1) for i, c in enumerate(raw_cells)]

    defaulted = False
    if "cache" not in axes and (product or not all("cache" in c for c in cells)) and default_cache is not None:
        axes["cache"], defaulted = [_check_general(where, "cache", default_cache)], True
    if "cache" not in axes and (product or not all("cache" in c for c in cells)):
        raise ConfigError(
            f'{where}: no cache given: set cache = "FILE.h5" (or a name from [caches])', param="cache", value=None
        )
    if "label" in axes:
        raise ConfigError(
            f"{where}: 'label' names one explicit cell; set it inside a [[cell]]", param="label", value=axes["label"]
        )
    if not product and not cells:
        raise ConfigError(
            f"{where}: product = false but there is no [[cell]]: the grid is empty", param="product", value=product
        )

    spec = GridSpec(
        path=path,
        name=name,
        caches=dict(caches),
        axes=axes,
        cells=cells,
        product=product,
        description=str(description),
        cache_defaulted=defaulted,
        lines=lines,
        overridden=tuple(overrides or ()),
    )
    _check_option_names(spec, fields_by_method)
    return spec


def _flatten(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The options of the top level and of the section tables, as one mapping (each given once)."""
    flat: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in data.items():
        # "episodes" and "negatives" are both section names and options: a plain value is the option
        if key in SECTIONS and (isinstance(value, dict) or key not in GENERAL_KEYS):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{key}] must be a table of options", param=key, value=value)
            for k, v in value.items():
                if isinstance(v, dict):
                    raise ConfigError(
                        f"{where}: [{key}].{k} is a table; options take a value or a list", param=k, value=v
                    )
                if k in flat:
                    raise ConfigError(
                        f"{where}: option {k!r} is given twice ({origin[k]} and [{key}])", param=k, value=v
                    )
                flat[k], origin[k] = v, f"[{key}]"
        elif key in TOP_LEVEL_ONLY:
            continue
        else:
            if isinstance(value, dict):
                raise ConfigError(
                    f"{where}: unknown section [{key}]; sections are "
                    f"{', '.join('[' + s + ']' for s in SECTIONS)}, [caches] and [[cell]]",
                    param="path",
                    value=where,
                )
            if key in flat:
                raise ConfigError(f"{where}: option {key!r} is given twice", param=key, value=value)
            flat[key], origin[key] = value, "top level"
    return flat


def _read_cell(cw: str, c: Mapping[str, Any], lines: Mapping[tuple[int, str], int], i: int) -> dict[str, Any]:
    """The ``i``-th ``[[cell]]`` table: its label and its options' values as lists."""
    cell: dict[str, Any] = {}
    for k, v in c.items():
        if isinstance(v, dict):
            raise ConfigError(f"{cw}: {k!r} is a table; options take a value or a list", param=k, value=v)
        if k == "label":
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{cw}: 'label' must be a non-empty string, got {v!r}", param="label", value=v)
            cell[k] = v
        else:
            cell[k] = _normalise_values(_at(cw, lines, k, i), k, v)
    return cell


def _normalise_values(where: str, key: str, value: Any) -> list[Any]:
    values = _as_list(value)
    if not values:
        raise ConfigError(f"{where}: option {key!r} has an empty list of values", param=key, value=value)
    if key in GENERAL_KEYS:
        values = [_check_general(where, key, v) for v in values]
    else:
        for v in values:
            if isinstance(v, (list, dict)):
                raise ConfigError(f"{where}: option {key!r} has a nested value {v!r}", param=key, value=v)
    return values


def _check_option_names(spec: GridSpec, fields_by_method: Mapping[str, set[str]]) -> None:
    """Every option must be a general one or belong to at least one method it is combined with."""
    where = str(spec.path)
    base_methods = spec.axes.get("method", [DEFAULTS["method"]])
    all_methods = set(base_methods)
    for c in spec.cells:
        all_methods.update(c.get("method", base_methods))
    for m in sorted(all_methods):
        try:
            solvers.get(m)
        except ConfigError as e:  # unknown method: the message lists the known ones
            raise ConfigError(f"{where}: {e}", param="method", value=m) from None

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
        raise ConfigError(
            f"{w}: unknown option {key!r} for method {', '.join(methods)}{hint}; known options: "
            f"{', '.join(GENERAL_KEYS)}; solver options: {', '.join(opts)}",
            param=key,
            value=w,
        )

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
    # One value for an option name that the methods receiving it read with different meanings
    # (alpha: POODLE's pull weight, alpha-TIM's alpha-entropy order) would sweep both at once.
    for key in spec.axes:
        if key in GENERAL_KEYS or key == "transductive":
            continue
        receivers = list(base_methods) if spec.product else []
        for c in spec.cells:
            if key not in c:  # a [[cell]] inherits the grid's values of the options it does not set
                receivers += c.get("method", base_methods)
        ambiguous(
            where, key, receivers, "the methods that get it (the grid's, and those of [[cell]]s without their own)"
        )
    for i, c in enumerate(spec.cells):
        for key in c:
            if key not in ("label", "method", "transductive") and key not in GENERAL_KEYS:
                ambiguous(f"{where}: [[cell]] #{i + 1}", key, c.get("method", base_methods), "this cell's methods")


def ambiguous(where: str, key: str, methods: Iterable[str], whose: str) -> None:
    """ConfigError when option ``key`` means different things for the ``methods`` that would get it."""
    clash = solvers.homonyms(methods, key)
    if clash:
        what = "; ".join(f"{' and '.join(ms)}'s {meaning}" for meaning, ms in clash.items())
        raise ConfigError(
            f"{where}: option {key!r} would set different parameters of {whose}: {what}. Give each "
            f"method its own value: set {key} inside a [[cell]] with that method (a cell's own values "
            f"are not shared)",
            param="path",
            value=where,
        )


def load_grid(
    path: str | os.PathLike, overrides: Mapping[str, Any] | None = None, default_cache: str | None = None
) -> GridSpec:
    """Read and check a grid file.

    ``overrides`` replace (or add) top-level options, e.g. ``{"cache": "/abs/feat.h5",
    "episodes": 200}``; like values in the file, relative paths in them resolve against the grid
    file's folder (the CLI's ``--cache`` makes its path absolute first). ``default_cache`` is the
    cache of a grid that names none (``poodle grid`` passes the one extract wrote last; the spec's
    ``cache_defaulted`` says it was taken). Raises :class:`ConfigError` naming the file and the option.
    """
    path = Path(path)
    return parse_grid(_load_toml(path), path, overrides, default_cache)


# ---------------------------------------------------------------------------------------------
# Expansion into cells


def _make_cell(
    spec: GridSpec, combo: Mapping[str, Any], label: str | None, strict: set[str], where: str, cell: int = 0
) -> Cell:
    """A cell from one combination of option values (:func:`poodle.cells.make_cell`); an error is said
    at ``where`` in the grid file (the ``cell``-th ``[[cell]]``; 0: the product), on its line. Its
    general settings were checked as the file was read (:func:`parse_grid`): the cell takes them as
    they are."""
    if combo.get("cache") is None:
        raise ConfigError(f'{where}: no cache given (set cache = "FILE.h5")', param="cache", value=None)
    try:
        return make_cell(combo, label=label, strict=strict, locations=spec.locations, checked=True)
    except PoodleError as e:
        raise located(spec.where(where, e.param, cell), e) from None


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
            c = _make_cell(spec, combo, None, set(), where)
            out.setdefault(c.key, c)
    for i, entry in enumerate(spec.cells):
        cw = f"{where}: [[cell]] #{i + 1}"
        own = set(entry) - {"label"}
        named = "method" in entry and len(entry["method"]) == 1
        axes = {**spec.axes, **{k: v for k, v in entry.items() if k != "label"}}
        for combo in _product(axes):
            if not named and not _fits(combo, own):
                continue  # e.g. alpha = 0 in a cell that inherits method = ["proto", "poodle"]: poodle only
            c = _make_cell(spec, combo, entry.get("label"), own, cw, i + 1)
            out.setdefault(c.key, c)
    cells = numbered(list(out.values()))
    if not cells:
        raise ConfigError(f"{where}: the grid has no cells", param="path", value=where)
    return cells


def _fits(combo: Mapping[str, Any], own: set[str]) -> bool:
    """Whether the combination's method has every solver option in ``own`` (and can be
    transductive if ``own`` asks for it)."""
    info = solvers.get(combo.get("method", DEFAULTS["method"]))
    fields = set(info.options())
    for k in own - set(GENERAL_KEYS):
        if k == "transductive":
            if combo[k] and not info.can_transduce:
                return False
        elif k not in fields:
            return False
    return True


def grid_hash(cells: Sequence[Cell]) -> str:
    """Identity of a grid: the set of its cells' keys. Comments, key order, ``1`` vs ``1.0`` and
    the grid file's name do not change it; adding or changing any cell does."""
    return content_hash(sorted(c.key for c in cells))[:20]


def resolve_cache(spec: GridSpec, cache: str) -> Path:
    """A cell's ``cache`` (a [caches] name or a path) as a file path (:meth:`poodle.cells.Locations.cache_file`)."""
    return spec.locations.cache_file(cache)


def default_results_path(grid_path: str | os.PathLike) -> Path:
    """``alpha_beta.toml`` -> ``alpha_beta.results.jsonl`` next to it."""
    p = Path(grid_path)
    return p.with_name(p.stem + ".results.jsonl")
