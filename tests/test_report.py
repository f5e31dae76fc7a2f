"""Reports: significance marking (against a hand-computed paired t-test), table shapes in Markdown
and LaTeX, collisions, and figures written as non-empty PNG and PDF."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from poodle import report as R
from poodle import report_figures as F
from poodle.errors import ConfigError
from poodle.results import FORMAT, VERSION
from poodle.stats import paired_ttest

E = 200


def _cell(label, acc, *, shot=1, transductive=False, method="poodle", seed=0, **options):
    episode = {
        "split": "test",
        "way": 5,
        "shot": shot,
        "query": 15,
        "imbalance": None,
        "seed": seed,
        "episodes": len(acc),
    }
    opts = {"alpha": 1.0, "beta": 0.5, "steps": 250, "transductive": transductive, **options}
    if method != "poodle":
        opts = {}
    key = f"{label}-{shot}-{transductive}-{seed}-{sorted(options.items())}"
    return {
        "kind": "cell",
        "key": key,
        "label": label,
        "cache": "feat.h5",
        "episode": episode,
        "negatives": "base" if method == "poodle" else "none",
        "n_neg": 400 if method == "poodle" else None,
        "method": method,
        "options": opts,
        "transductive": transductive,
        "acc": [float(a) for a in acc],
    }


def _write(path: Path, cells: list[dict]) -> Path:
    header = {"format": FORMAT, "version": VERSION, "kind": "header"}
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for i, c in enumerate(cells):
            f.write(json.dumps({**c, "index": i}) + "\n")
    return path


def _acc(rng, p, n=E):
    """Per-episode accuracies of 75 queries with success probability ``p`` (per episode)."""
    return rng.binomial(75, np.clip(p, 0, 1), size=n) / 75


def _hand_ttest(a, b):
    d = np.asarray(a) - np.asarray(b)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
    return t, 2 * stats.t.sf(abs(t), len(d) - 1)


# ---------------------------------------------------------------------------------------------
# Statistics and bold


def test_paired_ttest_matches_hand_computation():
    rng = np.random.default_rng(0)
    a, b = _acc(rng, 0.7), _acc(rng, 0.69)
    t, p = paired_ttest(a, b)
    t_hand, p_hand = _hand_ttest(a, b)
    assert t == pytest.approx(t_hand, rel=1e-12) and p == pytest.approx(p_hand, rel=1e-10)
    assert paired_ttest(a, a) == (0.0, 1.0)
    assert paired_ttest(a + 0.01, a) == (math.inf, 0.0)


def test_bold_only_when_best_beats_every_other_entry(tmp_path):
    rng = np.random.default_rng(1)
    base = rng.uniform(0.4, 0.9, size=E)  # a shared per-episode difficulty: entries are paired
    a = _acc(rng, base + 0.05)
    b_close = _acc(rng, base + 0.045)  # barely worse than a: not significant
    b_far = _acc(rng, base - 0.02)  # clearly worse
    c = _acc(rng, base)
    p_ab_close = _hand_ttest(a, b_close)[1]
    p_ab_far, p_ac = _hand_ttest(a, b_far)[1], _hand_ttest(a, c)[1]
    assert p_ab_close > 0.05 and p_ab_far <= 0.05 and p_ac <= 0.05  # the scenario is what we think
    assert a.mean() > max(b_close.mean(), b_far.mean(), c.mean())

    def bold_labels(b):
        path = _write(
            tmp_path / "r.jsonl", [_cell("A", a, beta=0.5), _cell("B", b, beta=0.75), _cell("C", c, beta=1.0)]
        )
        table = R.build_table(R.load_results([path]), rows="beta", cols="shot")
        return [table.rows[i][0] for (i, j), e in table.entries.items() if e.bold], table

    bold, table = bold_labels(b_far)
    assert bold == [0.5]
    md = R.to_markdown(table)
    assert f"**{100 * a.mean():.2f} ± {100 * R.Result({}, a, '', 0).ci95:.2f}**" in md
    assert r"\mathbf{" in R.to_latex(table)
    bold, _ = bold_labels(b_close)
    assert bold == []  # a is best but not significantly better than b
    # The paper's other rule (Tables 8 and 10): best vs the weakest entry only.
    path = _write(
        tmp_path / "w.jsonl", [_cell("A", a, beta=0.5), _cell("B", b_close, beta=0.75), _cell("C", c, beta=1.0)]
    )
    t = R.build_table(R.load_results([path]), rows="beta", cols="shot", test="weakest")
    assert [t.rows[i][0] for (i, j), e in t.entries.items() if e.bold] == [0.5]


def test_unpaired_entries_are_not_marked(tmp_path):
    rng = np.random.default_rng(2)
    path = _write(tmp_path / "r.jsonl", [_cell("A", _acc(rng, 0.9), seed=0), _cell("B", _acc(rng, 0.5), seed=1)])
    table = R.build_table(R.load_results([path]), rows="label", cols="shot")
    assert not any(e.bold for e in table.entries.values())
    assert any("Not tested" in n for n in table.notes)


def test_entries_on_different_query_classes_are_not_paired(tmp_path):
    # same seed and counts, but B's queries come from 3 of the 5 classes: other episodes, no t-test
    rng = np.random.default_rng(4)
    b = _cell("B", _acc(rng, 0.5))
    b["episode"]["query_classes"] = 3
    path = _write(tmp_path / "r.jsonl", [_cell("A", _acc(rng, 0.9)), b])
    table = R.build_table(R.load_results([path]), rows="label", cols="shot")
    assert not any(e.bold for e in table.entries.values())
    assert any("Not tested" in n for n in table.notes)


# ---------------------------------------------------------------------------------------------
# Table shapes


def _grid_results(tmp_path):
    rng = np.random.default_rng(3)
    cells = []
    for shot in (1, 5):
        cells.append(_cell("proto", _acc(rng, 0.6), shot=shot, method="proto"))
        for trans in (False, True):
            for beta in (0.0, 0.5, 1.0):
                cells.append(_cell("poodle", _acc(rng, 0.62 + 0.01 * beta), shot=shot, transductive=trans, beta=beta))
    return _write(tmp_path / "grid.jsonl", cells)


def test_table_shapes_markdown_and_latex(tmp_path):
    results = R.load_results([_grid_results(tmp_path)])
    table = R.build_table(results, rows="method,beta", cols="shot,transductive")
    # rows: proto (beta none) + poodle x 3 betas; cols: 1/5-shot x inductive/transductive
    assert table.shape == (4, 4)
    assert table.rows[0] == ("proto", None) and table.cols[1] == (1, True)
    assert (0, 1) not in table.entries  # proto is inductive only: an empty cell
    md = [ln for ln in R.to_markdown(table).splitlines() if ln.startswith("|")]
    assert len(md) == 2 + 4
    assert all(ln.count("|") == 2 + 4 + 1 for ln in md)
    assert md[0].startswith("| method | β | 1-shot, inductive | 1-shot, transductive |")
    tex = R.to_latex(table)
    body = tex.split(r"\midrule")[1].split(r"\bottomrule")[0].strip().splitlines()
    assert len(body) == 4 and all(ln.count("&") == 2 + 4 - 1 for ln in body)
    assert tex.count(r"\multicolumn{2}{c}{1-shot}") == 1 and r"\cmidrule(lr){3-4}" in tex
    assert r"$\beta$" in tex
    # Defaults: columns are shot and transductive, rows the remaining varying key(s).
    default = R.build_table(results)
    assert default.col_keys == ["shot", "transductive"] and default.row_keys == ["label", "beta"]


def test_collision_names_the_distinguishing_key(tmp_path):
    results = R.load_results([_grid_results(tmp_path)])
    with pytest.raises(
        ConfigError,
        match=r"several results fall at method=poodle, shot=1-shot: they differ in "
        r"transductive, beta; add transductive to rows or cols, or pick one with "
        r"where transductive=false",
    ):
        R.build_table(results, rows="method", cols="shot,beta".split(",")[:1])
    table = R.build_table(
        R.filter_results(results, R.parse_where(["transductive=false", "method=poodle"])), rows="beta", cols="shot"
    )
    assert table.shape == (3, 2)
    with pytest.raises(ConfigError, match="unknown key 'gamma_init'"):
        R.build_table(results, rows="gamma_init")


# ---------------------------------------------------------------------------------------------
# Figures


def _is_png(p: Path) -> bool:
    return p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_and_line_figures_are_written(tmp_path):
    rng = np.random.default_rng(4)
    base = rng.uniform(0.4, 0.9, size=E)
    cells = [_cell("proto", _acc(rng, base), method="proto")]
    for alpha in (0.0, 0.5, 1.0):
        for beta in (0.0, 0.5):
            for trans in (False, True):
                cells.append(
                    _cell(
                        "poodle",
                        _acc(rng, base + 0.02 * alpha - 0.01 * beta),
                        transductive=trans,
                        alpha=alpha,
                        beta=beta,
                    )
                )
    for steps in (10, 50, 100):
        cells.append(_cell("poodle", _acc(rng, base + 0.001 * steps), steps=steps, alpha=1.0, beta=0.5))
    path = _write(tmp_path / "r.jsonl", cells)
    results = R.load_results([path])
    heat = R.filter_results(results, R.parse_where(["steps=250"]))
    for baseline in ("zero", "proto"):
        pngpdf = F.heatmap(
            heat + [r for r in results if r.flat["method"] == "proto"],
            tmp_path / f"heat-{baseline}.png",
            baseline=baseline,
        )
        assert [p.suffix for p in pngpdf] == [".png", ".pdf"]
        assert _is_png(pngpdf[0]) and pngpdf[0].stat().st_size > 5000
        assert pngpdf[1].read_bytes()[:5] == b"%PDF-" and pngpdf[1].stat().st_size > 1000
    steps = R.filter_results(results, R.parse_where(["transductive=false", "method=poodle", "beta=0.5", "alpha=1"]))
    out = F.lines(steps + [results[0]], tmp_path / "steps", x="steps", baseline="proto")
    assert _is_png(out[0]) and out[0].stat().st_size > 5000 and out[1].exists()
    with pytest.raises(ConfigError, match="baseline 'nope'"):
        F.heatmap(heat, tmp_path / "x.png", baseline="nope")


def test_csv_is_one_line_per_entry_with_its_numbers(tmp_path):
    import csv

    from click.testing import CliRunner

    from poodle.cli.report import report

    path = _grid_results(tmp_path)
    results = R.load_results([path])
    table = R.build_table(results, rows="method,beta", cols="shot,transductive")
    lines = list(csv.DictReader(R.to_csv(table).splitlines()))
    assert len(lines) == len(table.entries) == 4 * 4 - 2  # proto is inductive only: two empty crossings
    assert list(lines[0]) == ["method", "beta", "shot", "transductive", "accuracy", "ci95", "episodes", "bold"]
    for line in lines:
        (r,) = [
            r
            for r in results
            if r.flat["method"] == line["method"]
            and str(r.flat["shot"]) == line["shot"]
            and str(r.flat["transductive"]).lower() == line["transductive"]
            and ("none" if r.flat.get("beta") is None else f"{r.flat['beta']:g}") == line["beta"]
        ]
        acc = np.asarray(r.acc, dtype=np.float64)  # the entry's numbers, by hand
        assert float(line["accuracy"]) == pytest.approx(100 * acc.mean(), abs=1e-4)
        assert float(line["ci95"]) == pytest.approx(100 * 1.96 * acc.std() / math.sqrt(len(acc)), abs=1e-4)
        assert int(line["episodes"]) == E
    bold = {(i, j) for (i, j), e in table.entries.items() if e.bold}
    assert bold and sum(line["bold"] == "true" for line in lines) == len(bold)
    res = CliRunner().invoke(
        report, [str(path), "--rows", "method,beta", "--format", "csv", "--out", str(tmp_path / "t.csv")]
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "t.csv").read_text() == R.to_csv(table)


def test_report_cli_latex_to_file_and_figure(tmp_path):
    from click.testing import CliRunner

    from poodle.cli.report import report

    path = _grid_results(tmp_path)
    runner = CliRunner()
    res = runner.invoke(
        report,
        [
            str(path),
            "--rows",
            "method,beta",
            "--cols",
            "shot,transductive",
            "--format",
            "latex",
            "--out",
            str(tmp_path / "t.tex"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "t.tex").read_text().count(r"\\") == 2 + 4
    res = runner.invoke(report, [str(path), "--rows", "method"])
    assert res.exit_code == 1 and "error: several results fall at" in res.output
    assert "to --rows or --cols, or pick one with --where" in res.output  # the library's names, as flags
    res = runner.invoke(report, [str(path), "--format", "rich", "--rows", "method,beta"])
    assert res.exit_code == 0 and "1-shot" in res.output
    # the text forms are the library's, by name: a new one is an entry of FORMATS, not a line here
    (fmt,) = [p for p in report.params if p.name == "fmt"]
    assert list(fmt.type.choices) == ["rich", *R.FORMATS] and {"markdown", "latex"} <= set(R.FORMATS)


def test_solve_json_files_are_reported_with_grid_results(tmp_path, make_features):
    from click.testing import CliRunner

    from poodle.cache import write_arrays
    from poodle.cli.solve import solve

    x, y = make_features(8, 20, 16, seed=5)
    cache = write_arrays(
        tmp_path / "f.h5", {"test": (x, y, [f"c{i}" for i in range(8)]), "train": (x, y, [f"c{i}" for i in range(8)])}
    )
    runner = CliRunner()
    for shot in (1, 5):
        res = runner.invoke(
            solve,
            [
                "--cache",
                str(cache),
                "--shot",
                str(shot),
                "--query",
                "5",
                "--episodes",
                "6",
                "--method",
                "proto",
                "--method",
                "ce",
                "--steps",
                "2",
                "--device",
                "cpu",
                "--json",
                str(tmp_path / f"s{shot}.json"),
            ],
        )
        assert res.exit_code == 0, res.output
    results = R.load_results([tmp_path / "s1.json", tmp_path / "s5.json"])
    assert [(r.flat["method"], r.flat["shot"], len(r.acc)) for r in results] == [
        ("proto", 1, 6),
        ("ce", 1, 6),
        ("proto", 5, 6),
        ("ce", 5, 6),
    ]
    table = R.build_table(results)
    assert table.row_keys == ["label"] and table.col_keys == ["shot"] and table.shape == (2, 2)


def test_solve_table_rows_differences_and_markdown():
    # poodle solve's summary goes through the one Table (and so the one renderer)
    from poodle.report import solve_table, to_markdown
    from poodle.results import make_record
    from poodle.stats import paired_difference

    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 40).astype(float)
    b = np.clip(a + rng.integers(0, 2, 40), 0, 1)
    from poodle.results import make_identity

    ep = {"split": "test", "way": 5, "shot": 1, "query": 15, "imbalance": None, "seed": 0, "episodes": 40}

    def ident(method):
        return make_identity(
            cache_id="c", episode=ep, negatives="none", n_neg=None, method=method, options={}, transductive=False
        )

    recs = [
        make_record(ident("proto"), a.tolist(), label="proto", cache="c", seconds=0.5),
        make_record(ident("poodle"), b.tolist(), label="poodle", cache="c", seconds=2.0),
    ]
    t = solve_table(recs)
    assert [r[0] for r in t.rows] == ["proto", "poodle"]
    d, c = paired_difference(torch.from_numpy(b), torch.from_numpy(a))
    assert t.extra[0] == ("diff vs proto", ["", f"{100 * d:+.2f}"])
    assert t.extra[1] == ("95% CI", ["", f"± {100 * c:.2f}"])
    assert t.extra[2] == ("wall s", ["0.5", "2.0"])  # records without the share: their seconds
    md = to_markdown(t)
    assert "| label | accuracy | diff vs proto | 95% CI | wall s |" in md
    assert f"| poodle | {100 * b.mean():.2f} ± " in md and f"{100 * d:+.2f} | ± {100 * c:.2f} | 2.0 |" in md


# ---------------------------------------------------------------------------------------------
# The rich renderer at terminal widths


def _render(table, width: int) -> list[str]:
    import io

    from rich.console import Console

    from poodle.cli._common import render_table

    c = Console(file=io.StringIO(), width=width, markup=False, highlight=False)
    c.print(render_table(table, width=width))
    return [ln.rstrip() for ln in c.file.getvalue().splitlines()]


def _many_keys_results(tmp_path):
    """Like the demo's results: methods with their own options, so many row keys vary."""
    rng = np.random.default_rng(5)
    cells = []
    for shot in (1, 5):
        cells.append(_cell("Proto", _acc(rng, 0.6), shot=shot, method="proto"))
        for trans in (False, True):
            for i, (steps, lr, scale) in enumerate([(250, 0.001, 10.0), (25, 5e-05, 20.0), (1000, 0.0001, 5.0)]):
                cells.append(
                    _cell(
                        f"poodle-variant-{i}",
                        _acc(rng, 0.62 + 0.01 * i),
                        shot=shot,
                        transductive=trans,
                        steps=steps,
                        lr=lr,
                        scale=scale,
                        label_smoothing=0.1 * i,
                        entropy_weight=float(i),
                    )
                )
    return _write(tmp_path / "many.jsonl", cells)


@pytest.mark.parametrize("rows", [None, "label", "method,label"])
def test_rich_table_fits_80_columns_without_losing_text(tmp_path, rows):
    results = R.load_results([_many_keys_results(tmp_path)])
    table = R.build_table(results, rows=rows)
    lines = _render(table, 80)
    text = "\n".join(lines)
    assert max(len(ln) for ln in lines) <= 80, text
    assert "…" not in text  # nothing cut
    for i, j in table.entries:
        # every entry whole, on one line
        assert table.cell_text(i, j) in text, (table.cell_text(i, j), text)
    for i in range(len(table.rows)):
        for label in table.row_labels(i):
            if label != "–":
                assert label in text.replace("\n", " ") or label in text, (label, text)
    if rows == "label":
        # few row keys: still one row per label with its four entries side by side
        line = next(ln for ln in lines if "poodle-variant-0" in ln)
        assert line.count("±") == 4, text


def test_rich_table_keeps_the_boxed_layout_when_it_fits(tmp_path):
    results = R.load_results([_many_keys_results(tmp_path)])
    table = R.build_table(results, rows="label")
    wide = _render(table, 200)
    assert wide[0].startswith("┏") and any("poodle-variant-2" in ln and ln.count("±") == 4 for ln in wide)


def test_one_cell_in_two_files_is_one_entry_but_different_numbers_are_refused(tmp_path):
    rng = np.random.default_rng(3)
    a, b = _acc(rng, 0.7), _acc(rng, 0.6)
    first = _write(tmp_path / "a.jsonl", [_cell("poodle", a), _cell("proto", b, method="proto")])
    again = _write(tmp_path / "b.jsonl", [_cell("poodle", a)])  # the same cell, e.g. a solve --out and a grid
    table = R.build_table(R.load_results([first, again]), rows="label", cols="shot")
    assert table.shape == (2, 1) and sorted(e.result.source for e in table.entries.values()) == sorted(
        [str(first), str(first)]
    )
    other = _write(tmp_path / "c.jsonl", [_cell("poodle", _acc(rng, 0.5))])  # same options, other numbers
    with pytest.raises(ConfigError, match="2 results with identical options at label=poodle"):
        R.build_table(R.load_results([first, other]), rows="label", cols="shot")


def test_default_rows_show_the_negatives_when_cells_use_different_kinds(tmp_path):
    rng = np.random.default_rng(4)
    base = _cell("poodle", _acc(rng, 0.7))
    rand = {**_cell("poodle", _acc(rng, 0.6), transductive=True), "negatives": "random"}
    proto = _cell("proto", _acc(rng, 0.6), method="proto")
    table = R.build_table(R.load_results([_write(tmp_path / "a.jsonl", [base, rand, proto])]))
    assert "negatives" in table.row_keys
    # only "none" beside one kind (beta = 0 or proto cells): the key says nothing and is left out
    table = R.build_table(R.load_results([_write(tmp_path / "b.jsonl", [base, proto])]))
    assert "negatives" not in table.row_keys


def test_labels_that_name_the_negatives_make_the_key_unneeded(tmp_path):
    rng = np.random.default_rng(5)
    b = {**_cell("POODLE-B", _acc(rng, 0.7)), "method": "poodle"}
    r = {**_cell("POODLE-R", _acc(rng, 0.6)), "negatives": "random"}
    table = R.build_table(R.load_results([_write(tmp_path / "a.jsonl", [b, r])]))
    assert "negatives" not in table.row_keys and table.shape[0] == 2


def test_tables_not_on_a_terminal_take_their_natural_width_or_columns(tmp_path, monkeypatch):
    """Output to a file or a pipe (here, pytest's capture): the boxed table at its natural width,
    wider than 80 columns, nothing wrapped, no colour codes; ``COLUMNS`` set, the table fits it."""
    from poodle.cli._common import out, render_table

    table = R.build_table(R.load_results([_many_keys_results(tmp_path)]), rows="label,steps,lr,scale")
    monkeypatch.delenv("COLUMNS", raising=False)
    assert not out.is_terminal
    with out.capture() as cap:
        out.print(render_table(table))
    lines = cap.get().splitlines()
    assert "\x1b[" not in cap.get()
    assert lines[0].startswith("┏") and max(len(ln) for ln in lines) > 80
    body = lines[:-1] if lines[-1].startswith("*: ") else lines  # under it, what a * marks (bold)
    assert all(ln.startswith(("┏", "┃", "┡", "│", "└")) for ln in body)  # one table line per row
    monkeypatch.setenv("COLUMNS", "80")
    with out.capture() as cap:
        out.print(render_table(table))
    lines = cap.get().splitlines()
    assert max(len(ln.rstrip()) for ln in lines) <= 80 and not lines[0].startswith("┏")
