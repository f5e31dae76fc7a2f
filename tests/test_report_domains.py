"""Meta-Dataset's per-domain table (``report.domain_table``, ``poodle report --domains``): block
means, the mean over domains, ranks with ties, the bootstrap interval on the average rank (against
a plain loop over replicates), which entries are bold, and the command line."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from poodle import report as R
from poodle.errors import ConfigError
from poodle.results import FORMAT, VERSION, make_record
from poodle.stats import descending_ranks

E = 40
# (domain, method) -> mean accuracy; in A, m2 and m3 tie on the mean (with different episodes'
# accuracies); in B, m2 beats m1 by 1 point (not significant over 40 episodes) and m3 by 21.
MEANS = {
    "A": {"m1": 0.80, "m2": 0.60, "m3": 0.60},
    "B": {"m1": 0.70, "m2": 0.71, "m3": 0.50},
    "C": {"m1": 0.70, "m2": 0.60, "m3": 0.90},
}
EXPECTED_RANKS = {"m1": [1, 2, 2], "m2": [2.5, 1, 3], "m3": [2.5, 3, 1]}
EXPECTED_BOLD = {"A": {"m1"}, "B": {"m1", "m2"}, "C": {"m3"}}  # best, and not significantly worse


def _acc(mean: float, seed: int) -> np.ndarray:
    """Per-episode accuracies ``[E]`` whose mean is ``mean`` (up to rounding): a zero-mean noise of
    spread 0.1 around it."""
    z = np.random.default_rng(seed).standard_normal(E)
    z = (z - z.mean()) / z.std()
    return mean + 0.1 * z


def _record(domain: str, label: str, acc: np.ndarray, index: int) -> dict:
    identity = {
        "cache_id": f"fingerprint-{domain}",
        "episode": {"split": "test", "way": 5, "shot": 1, "query": 15, "imbalance": None, "seed": 0, "episodes": E},
        "negatives": "none",
        "n_neg": None,
        "method": label,
        "options": {},
        "transductive": False,
    }
    return make_record(identity, acc, label=label, cache=domain, index=index)


def _records(extra: dict | None = None) -> list[dict]:
    means = {d: {**m, **((extra or {}).get(d, {}))} for d, m in MEANS.items()}
    out = []
    for d, (domain, by_method) in enumerate(means.items()):
        for m, (label, mean) in enumerate(by_method.items()):
            out.append(_record(domain, label, _acc(mean, 10 * d + m), len(out)))
    return out


def _reference_interval(accs: list[list[np.ndarray]], n_boot: int = 1000, seed: int = 0) -> tuple:
    """The documented bootstrap, written plainly: per replicate and domain, the shared episode
    numbers, each method's mean on them, scipy's average ranks, averaged over domains."""
    idx = [
        np.random.default_rng([seed, d]).integers(0, len(a[0]), size=(n_boot, len(a[0]))) for d, a in enumerate(accs)
    ]
    avg = np.zeros((n_boot, len(accs[0])))
    for b in range(n_boot):
        for d, methods in enumerate(accs):
            means = [float(np.mean(acc[idx[d][b]])) for acc in methods]
            avg[b] += stats.rankdata([-m for m in means], method="average")
    avg /= len(accs)
    s = np.sort(avg, axis=0)
    return s[math.floor((n_boot - 1) * 0.025)], s[math.ceil((n_boot - 1) * 0.975)]


def test_domain_table_means_ranks_interval_and_bold():
    records = _records()
    table = R.domain_table(records)
    methods = ["m1", "m2", "m3"]
    assert table.row_keys == ["label"] and [r[0] for r in table.rows] == methods
    assert table.domains == ["A", "B", "C"]
    by = {r["cache"] + r["label"]: np.asarray(r["acc"]) for r in records}

    # blocks: each domain's entry is the mean of its episodes, as set
    for j, domain in enumerate(table.domains):
        for i, label in enumerate(methods):
            e = table.entries[i, j]
            assert e.result.mean == pytest.approx(MEANS[domain][label], abs=1e-12)
            assert e.result.ci95 == pytest.approx(1.96 * by[domain + label].std() / math.sqrt(E))

    # mean over domains and its half-width
    for i, label in enumerate(methods):
        assert table.mean[i] == pytest.approx(np.mean([MEANS[d][label] for d in "ABC"]), abs=1e-12)
        cis = [1.96 * by[d + label].std() / math.sqrt(E) for d in "ABC"]
        assert table.mean_ci[i] == pytest.approx(math.sqrt(sum(c * c for c in cis)) / 3)

    # ranks: the tie in A (equal means from different episodes' accuracies) shares 2.5
    assert table.ranks.tolist() == [EXPECTED_RANKS[m] for m in methods]
    np.testing.assert_allclose(table.rank, [np.mean(EXPECTED_RANKS[m]) for m in methods], rtol=0, atol=1e-12)

    # the interval, against the documented procedure written plainly
    accs = [[by[d + m] for m in methods] for d in "ABC"]
    low, high = _reference_interval(accs)
    np.testing.assert_allclose(table.rank_low, low, rtol=0, atol=1e-12)
    np.testing.assert_allclose(table.rank_high, high, rtol=0, atol=1e-12)
    assert np.all(table.rank_low <= table.rank) and np.all(table.rank <= table.rank_high)
    assert table.rank_low[0] < table.rank_high[0]  # m1's rank in B is uncertain (1 point over 40 episodes)
    again = R.domain_table(records)
    assert again.rank_low.tolist() == table.rank_low.tolist() and again.rank_high.tolist() == table.rank_high.tolist()

    # bold: the best of each domain and those whose paired t-test against it has p > 0.05
    for j, domain in enumerate(table.domains):
        best = max(methods, key=lambda m: MEANS[domain][m])
        assert table.best[j] == methods.index(best)
        assert {methods[i] for i in range(3) if table.entries[i, j].bold} == EXPECTED_BOLD[domain]
        for i, label in enumerate(methods):
            e = table.entries[i, j]
            if label == best:
                assert e.p is None
                continue
            p = stats.ttest_rel(by[domain + best], by[domain + label]).pvalue
            assert e.p == pytest.approx(p, rel=1e-9)
            assert (p > 0.3) if label in EXPECTED_BOLD[domain] else (p < 1e-3)  # the design, far from 0.05

    # text and output formats
    text = R.to_markdown(table)
    assert "| label | A | B | C | mean over domains | average rank [95%] |" in text
    m1 = next(line for line in text.splitlines() if line.startswith("| m1 |"))
    e = table.entries[0, 0]
    assert f"**{100 * e.result.mean:.2f} ± {100 * e.result.ci95:.2f}**" in m1
    assert m1.endswith(f"| {table.rank[0]:.2f} [{table.rank_low[0]:.2f}, {table.rank_high[0]:.2f}] |")
    assert f"{100 * table.mean[0]:.2f} ± {100 * table.mean_ci[0]:.2f}" in m1
    tex = R.to_latex(table)
    assert r"label & A & B & C & mean over domains & average rank [95\%] \\" in tex
    assert tex.count(r"\mathbf") == sum(len(v) for v in EXPECTED_BOLD.values())
    assert f"{100 * table.mean[0]:.2f} $\\pm$ {100 * table.mean_ci[0]:.2f}" in tex
    rows = list(csv.DictReader(R.to_csv(table).splitlines()))  # a line per method and domain, then its row's columns
    assert len(rows) == 3 * 3 and list(rows[0]) == [
        "label",
        "cache",
        "accuracy",
        "ci95",
        "episodes",
        "bold",
        "mean over domains",
        "average rank [95%]",
    ]
    assert [r["bold"] == "true" for r in rows] == [table.entries[i, j].bold for i in range(3) for j in range(3)]
    assert float(rows[0]["accuracy"]) == pytest.approx(100 * e.result.mean, abs=1e-4)
    assert rows[0]["average rank [95%]"] == f"{table.rank[0]:.2f} [{table.rank_low[0]:.2f}, {table.rank_high[0]:.2f}]"


def test_a_method_missing_a_domain_is_not_ranked_and_the_others_keep_their_ranks():
    full = R.domain_table(_records())
    part = R.domain_table(_records(extra={"A": {"m4": 0.95}}))
    assert [r[0] for r in part.rows] == ["m1", "m2", "m3", "m4"]
    assert part.ranks[:3].tolist() == full.ranks.tolist() and np.isnan(part.ranks[3]).all()
    assert part.rank_low[:3].tolist() == full.rank_low.tolist() and math.isnan(part.rank[3])
    assert part.extra[0][1][3] == "–" and part.extra[1][1][3] == "–"
    assert any("Not ranked (missing in some domain): m4." in n for n in part.notes)
    assert part.best[0] == 3 and part.entries[3, 0].bold and not part.entries[0, 0].bold  # m4 still wins A


def test_descending_ranks_ties_and_bad_input():
    assert descending_ranks([0.7, 0.7, 0.6, 0.9]).tolist() == [2.5, 2.5, 4, 1]
    assert descending_ranks([0.5, 0.5 + 1e-12, 0.5]).tolist() == [2, 2, 2]  # within the tolerance
    assert descending_ranks([[1, 2], [2, 1]]).tolist() == [[2, 1], [1, 2]]  # along the last axis
    with pytest.raises(ConfigError, match="names the domains"):
        R.domain_table(_records(), methods="label,cache")


def _write(path: Path, records: list[dict]) -> Path:
    with open(path, "w") as f:
        f.write(json.dumps({"format": FORMAT, "version": VERSION, "kind": "header"}) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def test_report_cli_domains(tmp_path):
    from click.testing import CliRunner

    from poodle.cli.report import report

    path = _write(tmp_path / "md.results.jsonl", _records())
    runner = CliRunner()
    res = runner.invoke(report, [str(path), "--domains", "--format", "markdown"])
    assert res.exit_code == 0, res.output
    assert res.output == R.to_markdown(R.domain_table(R.load_results([path])))
    assert "**" in res.output and "| m3 | 60.00 ± " in res.output
    res = runner.invoke(report, [str(path), "--domains", "--where", "label=m1,m2"])
    assert res.exit_code == 0, res.output
    assert "m1" in res.output and "m3" not in res.output and "1.33 [" in res.output  # m1: ranks 1, 2, 1
    res = runner.invoke(report, [str(path), "--domains", "--cols", "shot"])
    assert res.exit_code == 1 and "--domains puts the domains (caches) on the columns" in res.output
    # the domain table's own marking: a --bold or --test it would ignore is refused, naming it
    for flag, value in (("--bold", "row"), ("--bold", "none"), ("--test", "weakest")):
        res = runner.invoke(report, [str(path), "--domains", flag, value])
        assert res.exit_code == 1 and f"its own way (with --p); leave out {flag} {value}\n" in res.output
    res = runner.invoke(report, [str(path), "--domains", "--bold", "col", "--test", "all", "--format", "markdown"])
    assert res.exit_code == 0 and res.output == R.to_markdown(R.domain_table(R.load_results([path])))


def test_methods_are_told_apart_by_label_then_by_the_options_that_separate_them():
    records = []
    for domain in ("A", "B"):
        for label, beta, mean in (("proto", None, 0.5), ("poodle", 0.0, 0.6), ("poodle", 0.5, 0.7)):
            r = _record(domain, label, _acc(mean, len(records)), len(records))
            r["options"] = {} if beta is None else {"beta": beta, "steps": 100}
            r["key"] += f"-{beta}"
            records.append(r)
    table = R.domain_table(records)
    assert table.row_keys == ["label", "beta"]  # steps does not separate anything more
    assert table.rows == [("proto", None), ("poodle", 0.0), ("poodle", 0.5)]
    assert table.rank.tolist() == [3, 2, 1]
    assert R.domain_table(records, "method,beta").row_keys == ["method", "beta"]
    with pytest.raises(ConfigError, match="several results fall at"):
        R.domain_table(records, "label")


def test_an_unfinished_file_leaves_a_domain_with_an_empty_entry_unmarked(tmp_path):
    records = [r for r in _records() if not (r["cache"] == "C" and r["label"] == "m3")]
    path = tmp_path / "part.results.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"format": FORMAT, "version": VERSION, "kind": "header", "n_cells": 9}) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")
    table = R.domain_table(R.load_results([path]))
    assert sorted(table.best) == [0, 1] and not any(table.entries[i, 2].bold for i in range(2))
    assert np.isnan(table.rank[2]) and table.ranks[:2].tolist() == [[1, 2, 1], [2, 1, 2]]
    assert any("8 of 9 cells finished" in n for n in table.notes)


def test_bold_entries_are_marked_in_plain_text_and_bold_on_a_colour_terminal(tmp_path):
    """Piped (no styles), a bold entry carries a trailing ``*``, said under the table; a colour
    terminal prints it bold and needs no mark."""
    import io

    from click.testing import CliRunner
    from rich.console import Console

    from poodle.cli._common import PLAIN_BOLD, render_table
    from poodle.cli.report import report

    path = _write(tmp_path / "md.results.jsonl", _records())
    res = CliRunner().invoke(report, [str(path), "--domains"])
    assert res.exit_code == 0, res.output
    table = R.domain_table(R.load_results([path]))
    rows = {line.split("│")[1].strip(): line.split("│")[2:5] for line in res.output.splitlines() if "│ m" in line}
    for i, (label,) in enumerate(table.rows):
        for j, domain in enumerate("ABC"):
            cell = rows[label][j].strip()
            assert cell.endswith("*") == (label in EXPECTED_BOLD[domain]), (label, domain, cell)
            assert cell.rstrip("*") == table.cell_text(i, j)
    assert PLAIN_BOLD in res.output and PLAIN_BOLD.startswith("*: ")
    colour = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=200)
    colour.print(render_table(table))
    text = colour.file.getvalue()
    assert "\x1b[1;32m" in text and "*" not in text and PLAIN_BOLD not in text
