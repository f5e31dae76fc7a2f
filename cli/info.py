"""``poodle info FILE``: validate a feature cache and summarise its splits and attributes, or an
episode file and its episodes' shapes;
``poodle info --system``: what a bug report needs (versions, BLAS, threads, devices, the fused
kernel's state)."""

from __future__ import annotations

import click

from poodle.cli._common import Unpadded, console, friendly_errors, out, styled


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option(
    "--system",
    is_flag=True,
    help="Print what a bug report needs instead: versions of poodle, Python, torch, numpy and h5py, the "
    "BLAS, thread and worker counts, devices, and the fused CPU kernel's state (compiler, flags, "
    "directory, loaded or why not).",
)
@friendly_errors
def info(file: str | None, system: bool) -> None:
    """Validate a feature cache (schema, dtypes, row norms, completeness) or an episode file and
    summarise it."""
    if system:
        _system()
        if file is None:
            return
    elif file is None:
        raise click.UsageError("give a feature cache FILE, or --system")
    from poodle.utils import file_kind

    if file_kind(file) == "episodes":
        _episodes(file)
    else:
        _cache(file)


def _episodes(file: str) -> None:
    from poodle.episodes import describe_episodes, load_episodes

    eps = load_episodes(file)
    spec = eps.spec
    shape = "" if spec.ragged else f", {spec.way}-way {spec.shot}-shot, {spec.query} queries/class"
    # plain lines, never folded: each starts with its label, for the eye and for scripts
    head = f"{file}: {len(eps):,} episodes, {spec.protocol} protocol{shape}, split {spec.split!r}, seed {spec.seed}"
    out.print(head, soft_wrap=True, highlight=False)
    for label, (lo, mean, hi) in describe_episodes(eps).items():
        out.print(f"{label}: min {lo:g} / mean {mean:.2f} / max {hi:g}", soft_wrap=True, highlight=False)
    out.print(styled("valid", "green"))


def _system() -> None:
    from poodle.system import system_info

    # plain lines, never folded: they are pasted into bug reports
    for section, items in system_info().items():
        out.print(section, soft_wrap=True)
        for k, v in items.items():
            out.print(f"  {k}: {v}", soft_wrap=True)


def _cache(file: str) -> None:
    from rich import box
    from rich.table import Table

    from poodle.cache import validate

    summary = validate(file)
    table = Table(title=f"{file}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col, just in (
        ("split", "left"),
        ("images", "right"),
        ("classes", "right"),
        ("D", "right"),
        ("dtype", "left"),
        ("complete", "left"),
        ("norm err", "right"),
        ("paths", "left"),
        ("raw norms", "left"),
        ("skipped", "right"),
    ):
        table.add_column(col, justify="right" if just == "right" else "left")
    for name, s in summary["splits"].items():
        dev = max(abs(s["norm_min"] - 1.0), abs(s["norm_max"] - 1.0)) if s["n_images"] > s["zero_rows"] else 0.0
        norms = f"{dev:.1e}"
        if s["zero_rows"]:
            norms += f" ({s['zero_rows']} zero)"
        table.add_row(
            name,
            f"{s['n_images']:,}",
            str(s["n_classes"]),
            str(s["feature_dim"]),
            s["dtype"],
            "yes" if s["complete"] else "no",
            norms,
            "yes" if s["has_paths"] else "no",
            "yes" if s.get("has_norms") else "no",
            str(s["n_skipped"]),
        )
    out.print(Unpadded(table))  # no trailing spaces: the lines are pasted and diffed
    if not all(s.get("has_norms") for s in summary["splits"].values()):
        out.print(
            styled(
                "raw norms: a split without them was written before cache version 2; "
                "--preprocess cl2n then centres the normalised rows",
                "dim",
            )
        )
    attrs = Table(show_header=False, box=None, padding=(0, 2))
    attrs.add_column(style="bold")
    attrs.add_column(overflow="fold")
    for k, v in summary["attrs"].items():
        attrs.add_row(k, str(v))
    out.print(Unpadded(attrs))
    for name, s in summary["splits"].items():
        if s["zero_rows"]:
            console.print(
                styled(
                    "warning",
                    "yellow",
                    f": split {name!r} has {s['zero_rows']} all-zero feature "
                    f"row(s) of {s['n_images']} (the backbone gave zeros for those images)",
                )
            )
    out.print(styled("valid", "green"))
