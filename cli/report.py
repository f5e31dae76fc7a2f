"""``poodle report RESULTS...``: tables (rich, or a text format of ``poodle.report.FORMATS``) and figures
from grid results."""

from __future__ import annotations

from pathlib import Path

import click

from poodle.cli._common import console, friendly_errors, render_table
from poodle.cli._common import out as stdout
from poodle.report import FORMATS


@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--rows",
    default=None,
    help="Option keys on the rows, e.g. method,beta (default: the varying keys not on the columns).",
)
@click.option(
    "--cols",
    default=None,
    help="Option keys on the columns, e.g. shot,transductive (default: those of shot, transductive that vary).",
)
@click.option(
    "--where", multiple=True, metavar="KEY=V[,V...]", help="Keep results whose KEY is one of the values. Repeatable."
)
@click.option("--format", "fmt", type=click.Choice(["rich", *FORMATS]), default="rich", show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the table (or figure: FILE.png and FILE.pdf) here instead of the terminal.",
)
@click.option(
    "--bold",
    type=click.Choice(["col", "row", "none"]),
    default="col",
    show_default=True,
    help="Mark the significantly best entry of each column or row.",
)
@click.option(
    "--test",
    type=click.Choice(["all", "weakest"]),
    default="all",
    show_default=True,
    help="Bold when the best beats every other entry (all) or the weakest one (paired t-test).",
)
@click.option("--p", "p_threshold", type=float, default=0.05, show_default=True, help="Significance level.")
@click.option("--no-ci", is_flag=True, help="Print means only.")
@click.option("--caption", default=None, help="LaTeX caption.")
@click.option(
    "--domains",
    is_flag=True,
    help="Meta-Dataset's per-domain table: a column per cache, then each method's mean over domains and "
    "average rank with its 95% interval (--rows: the keys that tell methods apart).",
)
@click.option(
    "--figure",
    type=click.Choice(["heatmap", "steps", "negatives"]),
    default=None,
    help="Draw a figure instead of a table.",
)
@click.option(
    "--baseline",
    default=None,
    help="heatmap: 'zero' (alpha=beta=0 cell, default) or a method/label (e.g. proto); "
    "steps/negatives: a method/label drawn as a dashed line.",
)
@click.option(
    "--panels",
    default=None,
    help="Figure: keys that split panels (default: the other varying keys for the heatmap, shot for line figures).",
)
@friendly_errors
def report(
    results: tuple[Path, ...],
    rows: str | None,
    cols: str | None,
    where: tuple[str, ...],
    fmt: str,
    out: Path | None,
    bold: str,
    test: str,
    p_threshold: float,
    no_ci: bool,
    caption: str | None,
    domains: bool,
    figure: str | None,
    baseline: str | None,
    panels: str | None,
) -> None:
    """Tables shaped like the paper's (mean ± 95% CI, significant best in bold) and figures."""
    from poodle import report as R

    R.check_p(p_threshold)
    if out is not None:
        from poodle.errors import ConfigError

        for r in results:
            if out.exists() and r.exists() and out.samefile(r):
                raise ConfigError(f"--out {out} is the results file being reported; choose another name")
    res = R.load_results(list(results))
    res = R.filter_results(res, R.parse_where(where))
    if figure is not None:
        from poodle import report_figures as F

        panel_keys = R.split_keys(panels)
        target = out or results[0].with_name(
            results[0].name.removesuffix(".jsonl").removesuffix(".results") + f".{figure}.png"
        )
        if figure == "heatmap":
            paths = F.heatmap(res, target, baseline=baseline or "zero", panels=panel_keys, p_threshold=p_threshold)
        else:
            paths = F.lines(
                res, target, x="steps" if figure == "steps" else "n_neg", panels=panel_keys, baseline=baseline
            )
        console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
        return
    table: R.Table
    if domains:
        if cols is not None:
            from poodle.errors import ConfigError

            raise ConfigError("--domains puts the domains (caches) on the columns; leave out --cols")
        for flag, value, default in (("--bold", bold, "col"), ("--test", test, "all")):
            if value != default:
                from poodle.errors import ConfigError

                raise ConfigError(
                    f"--domains marks each domain's best its own way (with --p); leave out {flag} {value}"
                )
        table = R.domain_table(res, rows, p_threshold=p_threshold, show_ci=not no_ci)
    else:
        table = R.build_table(res, rows, cols, bold=bold, test=test, p_threshold=p_threshold, show_ci=not no_ci)
    if fmt in FORMATS:
        text = FORMATS[fmt](table, caption)
        if out is not None:
            from poodle.utils import atomic_write

            atomic_write(out, text)
            console.print(f"wrote {out}", highlight=False)
        else:
            click.echo(text, nl=not text.endswith("\n"))
        return
    if out is not None:
        import io

        from rich.console import Console

        from poodle.utils import atomic_write

        buf = io.StringIO()  # written whole under a temporary name: an old report is replaced or kept
        c = Console(file=buf, width=200, markup=False, highlight=False)
        c.print(render_table(table, width=200))
        for note in table.notes:
            c.print(note, highlight=False)
        atomic_write(out, buf.getvalue())
        console.print(f"wrote {out}", highlight=False)
    else:
        stdout.print(render_table(table))
        for note in table.notes:
            stdout.print(note, highlight=False, style="dim")
