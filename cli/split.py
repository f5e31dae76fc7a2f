"""``poodle split``: seeded cross-domain negative pools (noisy / disjoint) as csv split files."""

from __future__ import annotations

import click

from poodle.cli._common import console, friendly_errors, out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--data-root",
    required=True,
    type=click.Path(file_okay=False),
    help="A folder of class folders: <root>/<class>/<image>.",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Where train.csv (the pool), test.csv, split.json and the images link go.",
)
@click.option(
    "--setting",
    required=True,
    type=click.Choice(["noisy", "disjoint"]),
    help="noisy: a fraction of every class's images is the unlabelled pool; disjoint: a fraction of the classes is.",
)
@click.option(
    "--fraction",
    type=float,
    default=None,
    help="Share of the images (noisy) or classes (disjoint) in the pool [default: 0.2 noisy, 0.5 disjoint].",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--force", is_flag=True, help="Replace a split folder made with other settings.")
@friendly_errors
def split(data_root: str, out_dir: str, setting: str, fraction: float | None, seed: int, force: bool) -> None:
    """Make the paper's cross-domain pools reproducible (Table 5's noisy and disjoint settings).

    Then: `poodle extract --dataset csv --data-root OUT --splits train,test ...` and
    `poodle solve --dataset csv ... --negatives base` draws the negatives from the pool.
    """
    from poodle.split import make_split

    rec = make_split(data_root, out_dir, setting=setting, seed=seed, fraction=fraction, force=force)
    console.print(
        f"{setting} split (seed {rec['seed']}, fraction {rec['fraction']:g}) of {rec['n_classes']} classes: "
        f"pool {rec['pool']['images']} images of {rec['pool']['classes']} classes, test "
        f"{rec['test']['images']} images of {rec['test']['classes']} classes",
        highlight=False,
    )
    out.print(out_dir, highlight=False, soft_wrap=True)
