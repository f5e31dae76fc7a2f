"""Tables from grid results, shaped like the paper's: chosen option keys on the rows and columns,
mean +- 95% confidence interval, and the best entry of each column in bold when it is significantly
better than every other entry of the column (paired t-test, p <= 0.05).

Entries of a column are paired when they were solved on identical episodes (same cache, split,
way, shot, query, imbalance, seed and number of episodes: the grid guarantees identical episodes
then), so the test is on the per-episode differences. The rule, precisely (``test="all"``):

    best = the entry with the highest mean accuracy in the column;
    best is bold iff the column has at least two entries, all on identical episodes, and for every
    other entry j the two-sided paired t-test of (acc_best - acc_j) over episodes has p <= 0.05.

``test="weakest"`` compares the best only with the weakest entry of the column, the rule that the
captions of the paper's tables ``tab:varying_img_resolution`` and ``tab:varying_finetuning_steps``
state. No correction for multiple comparisons is made (the paper makes none). Figures live in
:mod:`poodle.report_figures`.

:func:`domain_table` is Meta-Dataset's per-domain table: a column per domain (the records'
``cache``), the mean over domains and each method's average rank with a 95% interval; there the
best of each domain is bold together with every entry not significantly different from it, as
Meta-Dataset's papers mark their tables.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from poodle.errors import ConfigError, mark
from poodle.results import read_results, record_flat
from poodle.settings import PAIRING_KEYS
from poodle.stats import (
    RANK_BOOTSTRAP,
    RANK_SEED,
    average_rank_interval,
    descending_ranks,
    mean_ci,
    paired_difference,
    paired_ttest,
)

# PAIRING_KEYS (poodle.settings) identify the episodes a result was solved on: equal keys -> identical episodes.

_PRETTY = {
    "alpha": ("α", r"$\alpha$"),
    "beta": ("β", r"$\beta$"),
    "gamma": ("γ", r"$\gamma$"),
    "n_neg": ("negatives", "negatives"),
    "imbalance": ("κ", r"$\kappa$"),
}


@dataclass
class Result:
    """One cell of a results file: its options (flat namespace) and per-episode accuracies."""

    flat: dict[str, Any]
    acc: np.ndarray  # [E] float64 in [0, 1]
    source: str  # the results file
    order: int  # position across all loaded files (grid order)

    @property
    def mean(self) -> float:
        return float(self.acc.mean())

    @property
    def ci95(self) -> float:
        """1.96 * population std / sqrt(n), as the solver's summary and the authors' code."""
        return mean_ci(self.acc)[1]

    def pairing(self) -> tuple:
        return tuple(_hashable(self.flat.get(k)) for k in PAIRING_KEYS)


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


class Results(list):
    """A list of :class:`Result` that remembers which files were unfinished (``unfinished``: one
    sentence per file whose last line was cut, or with fewer cells than its grid had)."""

    unfinished: list[str]

    def __init__(self, items: Iterable[Result] = (), unfinished: Sequence[str] = ()) -> None:
        super().__init__(items)
        self.unfinished = list(unfinished)


def _unfinished_note(res: Any) -> str | None:
    """One sentence when a results file (:class:`poodle.results.ResultsContent`) is unfinished."""
    n_cells, n_records = res.header.get("n_cells"), len(res.records)
    try:
        cut = res.complete_bytes < Path(res.path).stat().st_size
    except OSError:
        cut = False
    if not cut and (not isinstance(n_cells, int) or n_records >= n_cells):
        return None
    what = f"{n_records} of {n_cells} cells finished" if isinstance(n_cells, int) else f"{n_records} cells read"
    return (
        f"{res.path}: {what}"
        + ("; its last line is cut (an interrupted run), so that cell is missing" if cut else "")
        + "; re-run `poodle grid` to finish it"
    )


def load_results(paths: Sequence[str | Path]) -> Results:
    """Cell results of one or more results files (:mod:`poodle.results`), in file and grid order.
    Files whose last line was cut or that hold fewer cells than their grid are named in
    ``.unfinished`` (and :func:`build_table` then leaves columns with empty entries unbolded)."""
    if not paths:
        raise ConfigError("no results file given", param="paths", value=paths)
    out: list[Result] = []
    unfinished: list[str] = []
    for p in paths:
        res = read_results(p)
        note = _unfinished_note(res)
        if note:
            unfinished.append(note)
        for r in sorted(res.records, key=lambda r: r.get("index", 0)):
            out.append(Result(record_flat(r), np.asarray(r["acc"], dtype=np.float64), str(p), len(out)))
    if not out:
        raise ConfigError(f"{', '.join(map(str, paths))}: no finished cells yet", param="paths", value=paths)
    return Results(out, unfinished)


# ---------------------------------------------------------------------------------------------
# Filtering and keys


def _match(value: Any, text: str) -> bool:
    if isinstance(value, bool) or text.lower() in ("true", "false"):
        return str(value).lower() == text.lower()
    if value is None:
        return text.lower() in ("none", "null", "")
    if isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return str(value) == text


def parse_where(items: Iterable[str]) -> dict[str, list[str]]:
    """``["method=poodle", "shot=1,5"]`` -> ``{"method": ["poodle"], "shot": ["1", "5"]}``."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{mark('where')} {item!r}: expected KEY=VALUE[,VALUE...]", param="where", value=item)
        out.setdefault(key.strip(), []).extend(v.strip() for v in value.split(","))
    return out


def filter_results(results: Sequence[Result], where: Mapping[str, Sequence[str]]) -> Results:
    """Results whose option ``key`` matches one of the given values, for every key."""
    known = set().union(*(r.flat for r in results)) if results else set()
    for key in where:
        if key not in known:
            raise ConfigError(
                f"{mark('where')}: unknown key {key!r}; keys in these results: {', '.join(sorted(known))}",
                param="where",
                value=key,
            )
    kept = [r for r in results if all(any(_match(r.flat.get(k), v) for v in vs) for k, vs in where.items())]
    if not kept:
        raise ConfigError(
            f"{mark('where')}: no result matches "
            + " and ".join(f"{k} in {{{', '.join(v)}}}" for k, v in where.items()),
            param="where",
            value=where,
        )
    return Results(kept, getattr(results, "unfinished", ()))


def varying_keys(results: Sequence[Result]) -> list[str]:
    """Keys whose value differs between results, without keys that split the results exactly like
    an earlier key (``method`` when it always equals ``label``; ``negatives`` when it only
    separates methods with and without negatives)."""
    keys: list[str] = []
    for r in results:
        for k in r.flat:
            if k not in keys:
                keys.append(k)
    out: list[str] = []
    partitions: list[tuple] = []
    for k in keys:
        vals = [_hashable(r.flat.get(k)) for r in results]
        if len(set(vals)) < 2:
            continue
        canon = _partition(vals)
        if canon in partitions:
            continue
        partitions.append(canon)
        out.append(k)
    return out


def drop_derived(results: Sequence[Result], keys: Sequence[str], given: Sequence[str] = ()) -> list[str]:
    """``keys`` without ``negatives``/``n_neg`` when the other keys (and ``given``) already determine
    them: cells that consume no negatives (proto, POODLE with beta = 0) record ``negatives = none``,
    which would otherwise split an alpha x beta grid into a beta = 0 part and the rest. When the
    cells that use negatives use more than one kind (base and random), the other row keys alone
    must determine it (a label POODLE-B / POODLE-R does): a column key does not, or a table would
    show a base-negatives and a random-negatives entry in one row with nothing to tell them apart."""
    keys = list(keys)
    for k in ("n_neg", "negatives"):
        if k not in keys:
            continue
        kinds = len({_hashable(r.flat.get(k)) for r in results} - {None, "none"})
        others = [x for x in keys if x != k] + (list(given) if kinds <= 1 else [])
        seen: dict[tuple, Any] = {}
        if all(
            seen.setdefault(tuple(_hashable(r.flat.get(o)) for o in others), _hashable(r.flat.get(k)))
            == _hashable(r.flat.get(k))
            for r in results
        ):
            keys.remove(k)
    return keys


def _partition(vals: Sequence[Any]) -> tuple:
    first: dict[Any, int] = {}
    return tuple(first.setdefault(v, len(first)) for v in vals)


def _value_order(results: Sequence[Result], key: str) -> dict[Any, tuple]:
    """Sort order for the values of ``key``: None first, booleans False-then-True, numbers
    ascending, strings in order of first appearance."""
    order: dict[Any, tuple] = {}
    for r in results:
        v = _hashable(r.flat.get(key))
        if v in order:
            continue
        if v is None or v == "none":
            order[v] = (0, 0)  # "negatives = none" (no fine-tuning baselines) first, like "w/o OOD"
        elif isinstance(v, bool):
            order[v] = (1, int(v))
        elif isinstance(v, (int, float)):
            order[v] = (2, float(v))
        else:
            order[v] = (3, len(order))
    return order


def format_value(key: str, v: Any, latex: bool = False) -> str:
    """How an option value reads in a table header: ``1-shot``, ``inductive``, ``κ=0.5``, ``N=3``
    (query classes); a ``way``, ``shot`` or ``query`` that Meta-Dataset's protocol draws per episode
    (None): ``ways drawn``."""
    if key in ("way", "shot", "query") and v is None:
        return {"way": "ways", "shot": "shots", "query": "queries"}[key] + " drawn"
    if key == "shot":
        return f"{v}-shot"
    if key == "way":
        return f"{v}-way"
    if key == "transductive":
        return "transductive" if v else "inductive"
    if key == "imbalance":
        return "balanced" if v is None else (rf"$\kappa={_num(v)}$" if latex else f"κ={_num(v)}")
    if key == "query_classes":  # queries from only N of the way classes (None: all of them)
        return f"N={'all' if v is None else _num(v)}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v is None:
        return "–" if not latex else "--"
    if isinstance(v, float):
        return _num(v)
    text = str(v)
    return _latex_escape(text) if latex else text


def _num(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def key_name(key: str, latex: bool = False) -> str:
    if key in _PRETTY:
        return _PRETTY[key][1 if latex else 0]
    return _latex_escape(key) if latex else key


def _where_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "none" if v is None else _num(v)


def _latex_escape(text: str) -> str:
    for a, b in (
        ("\\", r"\textbackslash{}"),
        ("&", r"\&"),
        ("%", r"\%"),
        ("$", r"\$"),
        ("#", r"\#"),
        ("_", r"\_"),
        ("{", r"\{"),
        ("}", r"\}"),
        ("~", r"\textasciitilde{}"),
        ("^", r"\^{}"),
    ):
        text = text.replace(a, b)
    return text


# ---------------------------------------------------------------------------------------------
# Tables


@dataclass
class Entry:
    result: Result
    bold: bool = False
    # domain tables: p of the two-sided paired t-test against the best entry of its domain (None
    # for the best itself and for entries not tested)
    p: float | None = None


@dataclass
class Table:
    """A results table: ``rows`` x ``cols`` option-value tuples and the entry at each crossing.

    Attributes:
        row_keys, col_keys: the option keys on each axis.
        rows, cols: the value tuples, in display order.
        entries: ``(row index, col index) -> Entry``.
        notes: remarks to print under the table (unpaired columns, the significance rule).
    """

    row_keys: list[str]
    col_keys: list[str]
    rows: list[tuple]
    cols: list[tuple]
    entries: dict[tuple[int, int], Entry]
    notes: list[str] = field(default_factory=list)
    show_ci: bool = True
    # further per-row text columns after the entries: (title, one text per row)
    extra: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), len(self.cols)

    def cell_text(self, i: int, j: int, latex: bool = False) -> str:
        e = self.entries.get((i, j))
        if e is None:
            return "--" if latex else "–"
        m, c = 100 * e.result.mean, 100 * e.result.ci95
        if latex:
            body = rf"{m:.2f} \pm {c:.2f}" if self.show_ci else f"{m:.2f}"
            return rf"$\mathbf{{{body}}}$" if e.bold else f"${body}$"
        body = f"{m:.2f} ± {c:.2f}" if self.show_ci else f"{m:.2f}"
        return body

    def col_label(self, j: int, latex: bool = False, sep: str = ", ") -> str:
        return sep.join(format_value(k, v, latex) for k, v in zip(self.col_keys, self.cols[j])) or "accuracy"

    def row_labels(self, i: int, latex: bool = False) -> list[str]:
        return [format_value(k, v, latex) for k, v in zip(self.row_keys, self.rows[i])]


def split_keys(text: str | Sequence[str] | None) -> list[str] | None:
    if text is None:
        return None
    if isinstance(text, str):
        return [k.strip() for k in text.split(",") if k.strip()]
    return list(text)


def _table_keys(results: Sequence[Result], rows: Any, cols: Any) -> tuple[list[str], list[str], list[str]]:
    """``(row keys, column keys, every key)``: the given ones checked, the defaults filled in."""
    known: list[str] = []
    for r in results:
        known += [k for k in r.flat if k not in known]
    vary = varying_keys(results)
    row_keys, col_keys = split_keys(rows), split_keys(cols)
    for k in (row_keys or []) + (col_keys or []):
        if k not in known:
            raise ConfigError(
                f"{mark('rows')}/{mark('cols')}: unknown key {k!r}; keys in these results: {', '.join(known)}",
                param="rows",
                value=k,
            )
    if col_keys is None:
        col_keys = [k for k in ("shot", "transductive") if k in vary and k not in (row_keys or [])]
    if row_keys is None:
        row_keys = drop_derived(results, [k for k in vary if k not in col_keys], col_keys)
    overlap = set(row_keys) & set(col_keys)
    if overlap:
        raise ConfigError(
            f"key {sorted(overlap)[0]!r} is on both {mark('rows')} and {mark('cols')}",
            param="rows",
            value=sorted(overlap)[0],
        )
    return row_keys, col_keys, known


def _one_entry(group: list[Result], known: list[str], where: str) -> Entry:
    """The entry of the results that fall on one row and column: one result (or one cell recorded
    in several files, with the same numbers); a ConfigError naming the keys that tell them apart."""
    if len(group) == 1:
        return Entry(group[0])
    differ = [k for k in known if len({_hashable(r.flat.get(k)) for r in group}) > 1]
    if not differ and all(np.array_equal(r.acc, group[0].acc) for r in group[1:]):
        return Entry(group[0])
    if not differ:
        raise ConfigError(
            f"{len(group)} results with identical options at {where} (from "
            f"{', '.join(sorted({r.source for r in group}))}); report one file or filter with {mark('where')}",
        )
    k0 = differ[0]
    raise ConfigError(
        f"several results fall at {where}: they differ in {', '.join(differ)}; add "
        f"{k0} to {mark('rows')} or {mark('cols')}, or pick one with {mark('where')} "
        f"{k0}={_where_text(group[0].flat.get(k0))}",
    )


def _note_unfinished(table: Table, unfinished: list[str], bold: str) -> None:
    table.notes.extend(unfinished)
    missing = [
        f"{', '.join(table.row_labels(i)) or '(row)'} / {table.col_label(j) or '(column)'}"
        for i in range(len(table.rows))
        for j in range(len(table.cols))
        if (i, j) not in table.entries
    ]
    if missing:
        table.notes.append(
            f"Empty entries ({len(missing)}), possibly cells not run yet: "
            f"{'; '.join(missing[:8])}{'; ...' if len(missing) > 8 else ''}. A "
            f"{'column' if bold == 'col' else 'row'} with an empty entry gets no bold."
        )


def build_table(
    results: Sequence[Result],
    rows: str | Sequence[str] | None = None,
    cols: str | Sequence[str] | None = None,
    *,
    bold: str = "col",
    test: str = "all",
    p_threshold: float = 0.05,
    show_ci: bool = True,
) -> Table:
    """Arrange results into a table (see the module docstring for the bold rule).

    Args:
        results: from :func:`load_results` (filtered as wanted).
        rows, cols: option keys (``"method,beta"`` or a list). Defaults: ``cols`` = those of
            shot/transductive that vary, ``rows`` = the other varying keys.
        bold: ``"col"`` (best of each column), ``"row"`` (best of each row) or ``"none"``.
        test: ``"all"`` (best vs every other entry) or ``"weakest"`` (best vs the weakest).
        p_threshold: significance level of the two-sided paired t-test.

    Raises:
        ConfigError: an unknown key, or two results that fall on the same row and column (the
            message names the keys that tell them apart).
    """
    if bold not in ("col", "row", "none"):
        raise ConfigError.bad_value("bold", bold, "must be col, row or none")
    if test not in ("all", "weakest"):
        raise ConfigError.bad_value("test", test, "must be all or weakest")
    check_p(p_threshold)
    unfinished = list(getattr(results, "unfinished", ()))
    results = list(results)
    row_keys, col_keys, known = _table_keys(results, rows, cols)
    orders = {k: _value_order(results, k) for k in row_keys + col_keys}

    def tup(r: Result, keys: list[str]) -> tuple:
        return tuple(_hashable(r.flat.get(k)) for k in keys)

    def values(keys: list[str]) -> list[tuple]:
        return sorted({tup(r, keys) for r in results}, key=lambda t: tuple(orders[k][v] for k, v in zip(keys, t)))

    row_vals, col_vals = values(row_keys), values(col_keys)
    ri, ci = {t: i for i, t in enumerate(row_vals)}, {t: j for j, t in enumerate(col_vals)}
    groups: dict[tuple[int, int], list[Result]] = {}
    for r in results:
        groups.setdefault((ri[tup(r, row_keys)], ci[tup(r, col_keys)]), []).append(r)
    entries = {}
    for (i, j), group in groups.items():
        at = zip(row_keys + col_keys, row_vals[i] + col_vals[j])
        entries[i, j] = _one_entry(group, known, ", ".join(f"{k}={format_value(k, v)}" for k, v in at) or "the table")
    table = Table(row_keys, col_keys, row_vals, col_vals, entries, show_ci=show_ci)
    if bold != "none":
        _mark_significance(table, bold, test, p_threshold, incomplete=bool(unfinished))
    if unfinished:
        _note_unfinished(table, unfinished, bold)
    return table


def solve_table(records: Sequence[Mapping[str, Any]], seconds: bool = True) -> Table:
    """The summary of one ``poodle solve`` run: a row per method (its label), the accuracy, and the
    paired difference of every other method from the first (mean and 95% CI over the same
    episodes) and, with ``seconds``, each method's share of the wall time (``wall s``, see
    :func:`timing_note`). ``records``: results-layer cell
    records of one episode set (:func:`poodle.results.make_record`)."""
    results = [
        Result(record_flat(r), np.asarray(r["acc"], dtype=np.float64), "solve", i) for i, r in enumerate(records)
    ]
    table = build_table(results, rows=["label"], cols=[], bold="none")
    by_label = {r.flat["label"]: r for r in results}
    first = results[0]
    diffs, cis = [], []
    for (label,) in table.rows:
        if label == first.flat["label"]:
            diffs.append("")
            cis.append("")
            continue
        d, c = paired_difference(by_label[label].acc, first.acc)
        diffs.append(f"{100 * d:+.2f}")
        cis.append(f"± {100 * c:.2f}")
    table.extra = [(f"diff vs {first.flat['label']}", diffs), ("95% CI", cis)]
    if seconds:
        # the share of the wall time (records from before it existed: the summed solve time, as then)
        secs = {r["label"]: r.get("wall_seconds_share", r.get("seconds", float("nan"))) for r in records}
        table.extra.append(("wall s", [f"{secs[label]:.1f}" for (label,) in table.rows]))
    return table


@dataclass
class DomainTable(Table):
    """A :class:`Table` of methods (rows) x domains (columns, the ``cache`` key) with, in ``extra``,
    the mean over domains and the average rank; the numbers behind those two columns as arrays.

    Attributes:
        best: column (domain) index -> row index of its best entry, for the domains marked.
        ranks: ``[M, D]`` rank of each method in each domain (1 = best, ties averaged), NaN for a
            method not ranked (missing in some domain).
        mean, mean_ci: ``[M]`` mean over domains of the per-domain mean accuracies and the 95%
            half-width, in [0, 1]; NaN for a method missing in some domain.
        rank, rank_low, rank_high: ``[M]`` average rank over domains and its 95% interval; NaN as above.
    """

    best: dict[int, int] = field(default_factory=dict)
    ranks: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    mean_ci: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rank: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rank_low: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rank_high: np.ndarray = field(default_factory=lambda: np.zeros(0))
    caches: list[str] = field(default_factory=list)

    @property
    def domains(self) -> list[str]:
        """Each column's domain as its results name it (their ``cache``: a domain's name, or the path
        of a cache solved alone); ``cols`` hold the names the columns show (:func:`domain_labels`)."""
        return list(self.caches) if self.caches else [str(c[0]) for c in self.cols]


DOMAIN_KEY = "cache"


def domain_labels(domains: Sequence[str]) -> list[str]:
    """The column names of ``domains`` (results' ``cache``): a path by its file's stem, as ``poodle
    solve --cache`` names a bare path (``features/birds.h5`` -> ``birds``), with as many of its last
    folders as tell paths of one stem apart (``mini/resnet12``, ``cub/resnet12``); a domain's name
    (a grid's ``[caches]`` name, ``NAME=PATH``) as it is. The names as given if those would collide."""
    paths = [any(c in d for c in "/\\") or d.endswith((".h5", ".hdf5")) for d in domains]
    parts = [PurePath(d).with_suffix("").parts if p else (d,) for d, p in zip(domains, paths)]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        short = ["/".join(p[-depth:]) for p in parts]
        if len(set(short)) == len(short):
            return short
    return list(domains)


def domain_table(
    results: Sequence[Result | Mapping[str, Any]],
    methods: str | Sequence[str] | None = None,
    *,
    p_threshold: float = 0.05,
    show_ci: bool = True,
    n_boot: int = RANK_BOOTSTRAP,
    seed: int = RANK_SEED,
) -> DomainTable:
    """Meta-Dataset's per-domain table: one column per domain (the ``cache`` of each result, i.e. a
    grid's ``[caches]`` name or ``poodle solve``'s cache), one row per method, then the mean over
    domains and each method's average rank.

    - Entries: mean accuracy ± 95% CI over the domain's episodes (as every table). In each domain
      the best entry (highest mean) is bold, and so is every other entry whose two-sided paired
      t-test against the best over the domain's episodes gives p > ``p_threshold`` (not
      significantly different from it; ``Entry.p`` keeps that p). Nothing is marked in a domain
      with fewer than two entries, with entries not on identical episodes (listed under the table),
      or, for unfinished results files, with an empty entry.
    - ``mean over domains``: the mean of the D per-domain means, ± ``sqrt(sum_d ci_d^2) / D`` (the
      domains' episodes are independent, so the variances of their means add).
    - ``average rank``: in each domain the methods are ranked by mean accuracy (1 = best; means
      within 1e-9 tie and share the mean of their positions), and the ranks averaged over domains;
      ``[low, high]`` is a 95% bootstrap interval over the episodes within each domain (``n_boot``
      resamples, paired across the methods of a domain, seeded by ``seed``; the domains themselves
      are not resampled): :func:`poodle.stats.average_rank_interval` says exactly how.

    A method missing in some domain gets ``–`` for both and is left out of every domain's ranking
    (named under the table).

    Args:
        results: :class:`Result` objects (:func:`load_results`, filtered as wanted) or results
            records (:func:`poodle.results.make_record`, e.g. those of one ``poodle solve`` run).
        methods: the keys that tell methods apart (``"label"``, ``"method,beta"``). Default:
            ``label``, and while two results of one domain share their keys, each key varying
            within a domain that separates more of them (``label,beta`` for a beta sweep).
        p_threshold: significance level of the paired t-test.

    Raises:
        ConfigError: no results, an unknown key, ``cache`` among ``methods``, or two results on
            the same method and domain (the message names the keys that tell them apart).
    """
    check_p(p_threshold)
    unfinished = list(getattr(results, "unfinished", ()))
    res = [
        r if isinstance(r, Result) else Result(record_flat(r), np.asarray(r["acc"], dtype=np.float64), "records", i)
        for i, r in enumerate(results)
    ]
    if not res:
        raise ConfigError("a per-domain table needs results; none given", param="results", value=results)
    keys = split_keys(methods)
    if keys is None:
        keys = _method_keys(res)
    if DOMAIN_KEY in keys:
        raise ConfigError(
            f"{DOMAIN_KEY!r} names the domains (the columns); it cannot tell methods apart",
            param="methods",
            value=methods,
        )
    base = build_table(res, rows=keys, cols=[DOMAIN_KEY], bold="none", show_ci=show_ci)
    caches = [str(c[0]) for c in base.cols]
    labels = domain_labels(caches)
    cols = [(n,) for n in labels]
    table = DomainTable(base.row_keys, base.col_keys, base.rows, cols, base.entries, show_ci=show_ci, caches=caches)
    n_methods, n_domains = table.shape
    _mark_domains(table, p_threshold, incomplete=bool(unfinished))

    complete = [i for i in range(n_methods) if all((i, j) in table.entries for j in range(n_domains))]
    nan = np.full(n_methods, np.nan)
    table.mean, table.mean_ci = nan.copy(), nan.copy()
    table.rank, table.rank_low, table.rank_high = nan.copy(), nan.copy(), nan.copy()
    table.ranks = np.full((n_methods, n_domains), np.nan)
    for i in complete:
        cell = [table.entries[i, j].result for j in range(n_domains)]
        table.mean[i] = np.mean([r.mean for r in cell])
        table.mean_ci[i] = math.sqrt(sum(r.ci95**2 for r in cell)) / n_domains
    if complete:
        accs = [[table.entries[i, j].result.acc for i in complete] for j in range(n_domains)]
        point, low, high = average_rank_interval(accs, n_boot=n_boot, seed=seed)
        table.rank[complete], table.rank_low[complete], table.rank_high[complete] = point, low, high
        for j in range(n_domains):
            table.ranks[complete, j] = descending_ranks([table.entries[i, j].result.mean for i in complete])

    def mean_text(i: int) -> str:
        if i not in complete:
            return "–"
        m, c = 100 * table.mean[i], 100 * table.mean_ci[i]
        return f"{m:.2f} ± {c:.2f}" if show_ci else f"{m:.2f}"

    def rank_text(i: int) -> str:
        if i not in complete:
            return "–"
        return f"{table.rank[i]:.2f} [{table.rank_low[i]:.2f}, {table.rank_high[i]:.2f}]"

    table.extra = [
        ("mean over domains", [mean_text(i) for i in range(n_methods)]),
        ("average rank [95%]", [rank_text(i) for i in range(n_methods)]),
    ]
    table.notes.append(
        f"Mean over domains: the mean of the {n_domains} per-domain means ± 1.96 sqrt(sum of the domains' "
        "squared standard errors) / domains. Average rank: each domain ranks the methods by mean accuracy "
        "(1 = best, ties share their mean position), averaged over domains; [low, high] is a 95% bootstrap "
        f"interval from {n_boot} resamples of the episodes within each domain (paired across methods, seed {seed})."
    )
    missing = [", ".join(table.row_labels(i)) for i in range(n_methods) if i not in complete]
    if missing:
        table.notes.append(f"Not ranked (missing in some domain): {'; '.join(missing)}.")
    named = [f"{n} = {c}" for n, c in zip(labels, caches) if n != c]
    if named:
        table.notes.append(f"Domains: {', '.join(named)}.")
    if unfinished:
        _note_unfinished(table, unfinished, "col")
    return table


def _method_keys(results: Sequence[Result]) -> list[str]:
    """The keys that tell the methods of each domain apart: ``label``, then, while two results of
    one domain still share them, each key that varies within a domain and separates more of them
    (in order of first appearance)."""
    groups: dict[Any, list[Result]] = {}
    for r in results:
        groups.setdefault(_hashable(r.flat.get(DOMAIN_KEY)), []).append(r)

    def collisions(keys: list[str]) -> int:
        return sum(len(g) - len({tuple(_hashable(r.flat.get(k)) for k in keys) for r in g}) for g in groups.values())

    keys = ["label"]
    for group in groups.values():
        for k in varying_keys(group):
            n = collisions(keys)
            if n == 0:
                return keys
            if k not in keys and k != DOMAIN_KEY and collisions(keys + [k]) < n:
                keys.append(k)
    return keys


def _mark_domains(table: DomainTable, p_threshold: float, incomplete: bool) -> None:
    """Bold the best entry of each column (domain) and every entry not significantly different
    from it (two-sided paired t-test against the best, p > ``p_threshold``)."""
    n_rows, n_cols = table.shape
    unpaired = []
    for j in range(n_cols):
        present = [i for i in range(n_rows) if (i, j) in table.entries]
        if len(present) < 2 or (incomplete and len(present) < n_rows):
            continue
        group = [table.entries[i, j].result for i in present]
        if len({r.pairing() for r in group}) > 1 or len({len(r.acc) for r in group}) > 1:
            unpaired.append(table.col_label(j))
            continue
        best = present[int(np.argmax([r.mean for r in group]))]
        table.best[j] = best
        table.entries[best, j].bold = True
        for i in present:
            if i != best:
                _, p = paired_ttest(table.entries[best, j].result.acc, table.entries[i, j].result.acc)
                table.entries[i, j].p = p
                table.entries[i, j].bold = p > p_threshold
    table.notes.append(
        "Accuracy (%) mean ± 95% CI over episodes. Bold: best of its domain, and every entry of the "
        "domain not significantly different from it (two-sided paired t-test over episodes against the "
        f"best, p > {p_threshold:g})."
    )
    if unpaired:
        table.notes.append(f"Not tested (entries not on identical episodes): {'; '.join(unpaired)}.")


def timing_note(records: Sequence[Mapping[str, Any]]) -> str | None:
    """What the ``wall s`` column of :func:`solve_table` is, in one line, when the methods shared
    one call (None for one method, or records without the fields): their shares of the call's wall
    time, split by each method's solve time summed over the chunk workers (thread time)."""
    calls = {(r.get("call_seconds"), r.get("call_cells")) for r in records}
    if len(records) < 2 or any(r.get("wall_seconds_share") is None for r in records) or len(calls) != 1:
        return None
    wall, cells = next(iter(calls))
    workers = records[0].get("workers") or 1
    summed = sum(float(r.get("worker_seconds", 0.0)) for r in records)
    threads = f", {summed:.1f} s summed over {workers} worker threads" if workers > 1 else ""
    return (
        f"wall s: each method's share of the {wall:.1f} s wall time of the one call that solved all "
        f"{cells} methods on the same chunks (split by each one's solve time{threads})"
    )


def check_p(p_threshold: float) -> float:
    """ConfigError unless the significance level lies in (0, 1)."""
    if isinstance(p_threshold, bool) or not isinstance(p_threshold, (int, float)) or not 0 < p_threshold < 1:
        raise ConfigError.bad_value(
            "p_threshold", p_threshold, "(the significance level) must lie in (0, 1), e.g. 0.05"
        )
    return float(p_threshold)


def significant_best(
    results: Sequence[Result], test: str = "all", p_threshold: float = 0.05
) -> tuple[int | None, str | None]:
    """Index of the entry to bold among ``results`` (one column), or ``None`` and why not."""
    if len(results) < 2:
        return None, None
    if len({r.pairing() for r in results}) > 1 or len({len(r.acc) for r in results}) > 1:
        return None, "unpaired"
    means = [r.mean for r in results]
    best = int(np.argmax(means))
    others = [j for j in range(len(results)) if j != best]
    if test == "weakest":
        others = [int(np.argmin(means))]
    for j in others:
        _, p = paired_ttest(results[best].acc, results[j].acc)
        if not p <= p_threshold:
            return None, None
    return best, None


def _mark_significance(table: Table, bold: str, test: str, p_threshold: float, incomplete: bool = False) -> None:
    """Bold the significant best of each column (row). With ``incomplete`` results (unfinished
    files), a column with an empty entry is left unmarked: the missing cell might have won."""
    n_rows, n_cols = table.shape
    groups = (
        [[(i, j) for i in range(n_rows)] for j in range(n_cols)]
        if bold == "col"
        else [[(i, j) for j in range(n_cols)] for i in range(n_rows)]
    )
    unpaired = []
    for g, positions in enumerate(groups):
        present = [p for p in positions if p in table.entries]
        if incomplete and len(present) < len(positions):
            continue
        best, why = significant_best([table.entries[p].result for p in present], test, p_threshold)
        if best is not None:
            table.entries[present[best]].bold = True
        if why == "unpaired":
            unpaired.append(table.col_label(g) if bold == "col" else ", ".join(table.row_labels(g)))
    axis = "column" if bold == "col" else "row"
    versus = "every other entry" if test == "all" else "the weakest entry"
    table.notes.append(
        f"Accuracy (%) mean ± 95% CI over episodes. Bold: best of its {axis}, better than "
        f"{versus} of the {axis} by a two-sided paired t-test over episodes, p ≤ {p_threshold:g}."
    )
    if unpaired:
        table.notes.append(f"Not tested (entries not on identical episodes): {'; '.join(unpaired)}.")


# ---------------------------------------------------------------------------------------------
# Output formats


def to_markdown(table: Table) -> str:
    """A GitHub-flavoured Markdown table (one header row; column keys joined by ", ")."""
    head = [key_name(k) for k in table.row_keys] + [table.col_label(j) for j in range(len(table.cols))]
    head += [title for title, _ in table.extra]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join([":--"] * len(table.row_keys) + ["--:"] * (len(table.cols) + len(table.extra))) + "|",
    ]
    for i in range(len(table.rows)):
        cells = table.row_labels(i)
        for j in range(len(table.cols)):
            text = table.cell_text(i, j)
            e = table.entries.get((i, j))
            cells.append(f"**{text}**" if e is not None and e.bold else text)
        cells += [texts[i] for _, texts in table.extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in table.notes)


def to_latex(table: Table, caption: str | None = None, label: str | None = None) -> str:
    """A booktabs ``tabular`` with one header row per column key (equal neighbours merged with
    ``\\multicolumn`` as in the paper's tables); entries as ``$mean \\pm ci$``, bold via ``\\mathbf``;
    the table's further text columns (``extra``: differences, mean over domains, ranks) last."""
    nr, nc, nx = len(table.row_keys), len(table.cols), len(table.extra)
    spec = "l" * nr + "c" * (nc + nx)
    out = [r"\begin{table}[t]", r"\centering"]
    if caption:
        out.append(rf"\caption{{{caption}}}")
    out += [rf"\begin{{tabular}}{{{spec}}}", r"\toprule"]
    for level, key in enumerate(table.col_keys):
        last = level == len(table.col_keys) - 1
        cells = [""] * nr
        if last:
            cells = [key_name(k, True) for k in table.row_keys]
        rules = []
        j = 0
        while j < nc:
            k = j
            prefix = table.cols[j][: level + 1]
            while k + 1 < nc and table.cols[k + 1][: level + 1] == prefix:
                k += 1
            text = format_value(key, table.cols[j][level], True)
            span = k - j + 1
            cells.append(text if span == 1 else rf"\multicolumn{{{span}}}{{c}}{{{text}}}")
            if level < len(table.col_keys) - 1:
                rules.append(rf"\cmidrule(lr){{{nr + j + 1}-{nr + k + 1}}}")
            j = k + 1
        cells += [_latex_text(title) if last else "" for title, _ in table.extra]
        out.append(" & ".join(cells) + r" \\")
        if rules:
            out.append(" ".join(rules))
    if not table.col_keys:
        head = [key_name(k, True) for k in table.row_keys] + ["accuracy"]
        out.append(" & ".join(head + [_latex_text(title) for title, _ in table.extra]) + r" \\")
    out.append(r"\midrule")
    for i in range(len(table.rows)):
        cells = table.row_labels(i, latex=True) + [table.cell_text(i, j, latex=True) for j in range(nc)]
        cells += [_latex_text(texts[i]) for _, texts in table.extra]
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    if label:
        out.append(rf"\label{{{label}}}")
    out.append(r"\end{table}")
    notes = "".join(f"% {n}\n" for n in table.notes)
    return notes + "\n".join(out) + "\n"


def to_csv(table: Table) -> str:
    """The table as comma-separated values, one line per entry (a long table, for a spreadsheet or
    pandas): the values of the row and column keys as ``--where`` writes them (``none``, ``true``),
    the mean accuracy and its 95% half-width in percent, the number of episodes and whether the
    entry is bold; then the table's further columns (``extra``: the differences, a domain table's
    mean over domains and rank) of its row. Empty crossings and the notes are left out."""
    buf = io.StringIO()
    out = csv.writer(buf, lineterminator="\n")
    extra = [title for title, _ in table.extra]
    out.writerow([*table.row_keys, *table.col_keys, "accuracy", "ci95", "episodes", "bold", *extra])
    for (i, j), e in sorted(table.entries.items()):
        keys = [_where_text(v) for v in (*table.rows[i], *table.cols[j])]
        numbers = [f"{100 * e.result.mean:.4f}", f"{100 * e.result.ci95:.4f}", len(e.result.acc)]
        out.writerow([*keys, *numbers, "true" if e.bold else "false", *(texts[i] for _, texts in table.extra)])
    return buf.getvalue()


def _latex_text(text: str) -> str:
    """A plain-text cell (an ``extra`` column's) in LaTeX: escaped, ``±`` as ``$\\pm$``, ``–`` as ``--``."""
    return _latex_escape(text).replace("±", r"$\pm$").replace("–", "--")


# The text forms of a table by name, each ``(table, caption) -> text``: ``poodle report --format``
# takes these (and ``rich``, the terminal's table, which the command line draws itself).
FORMATS: dict[str, Callable[[Table, str | None], str]] = {
    "markdown": lambda table, caption: to_markdown(table),
    "latex": lambda table, caption: to_latex(table, caption=caption),
    "csv": lambda table, caption: to_csv(table),
}


def formats_line() -> str:
    """The line of docs/grid.md that names the formats of ``poodle report --format``, made from
    :data:`FORMATS` (a test checks that the page holds it; ``python -m poodle.report`` prints it):
    a new format is its function and its entry, and this line regenerated."""
    names = [f"`{name}`" for name in FORMATS]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return (
        f"FORMAT is `rich` (the default: the terminal's table, below) or a text format of "
        f"`poodle.report.FORMATS`: {listed} (this line is made from them, `python -m poodle.report`).\n"
    )


if __name__ == "__main__":
    print(formats_line(), end="")
