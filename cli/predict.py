"""``poodle predict``: classify a folder of images from a few labelled images per class."""

from __future__ import annotations

from typing import Any, cast

import click

from poodle import defaults
from poodle.cli._common import console, friendly_errors, note, out, parse_set, pretrained_option, progress_bar
from poodle.cli._schema import schema_options
from poodle.extract import ExtractOptions
from poodle.negatives import NegativeSpec
from poodle.preprocess import PreprocessSpec
from poodle.run import RunOptions


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--support",
    "support_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder with one sub-folder of images per class.",
)
@click.option(
    "--support-csv",
    type=click.Path(dir_okay=False),
    default=None,
    help="CSV with a path,label header (paths relative to the CSV), instead of --support.",
)
@click.option(
    "--query",
    "query_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of images to classify (searched recursively).",
)
@click.option(
    "--query-csv",
    type=click.Path(dir_okay=False),
    default=None,
    help="CSV with a path[,label] header, instead of --query; labels turn on accuracy reporting.",
)
@click.option("--backbone", required=True, help="Backbone: a release name, torchvision:NAME or timm:NAME.")
@click.option(
    "--checkpoint",
    type=click.Path(dir_okay=False),
    default=None,
    help="Weights (torch state dict or .safetensors), loaded strictly [default: random weights].",
)
@pretrained_option("timm:/torchvision: backbones: the library's own pretrained weights, as for `poodle extract`.")
@click.option("--method", default=defaults.METHOD, show_default=True, help="Any method of `poodle solve`.")
@click.option("--transductive", is_flag=True, help="Use the query images too (methods that can).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="A config field of the method (repeatable).")
@schema_options(
    NegativeSpec,
    only=("negatives",),
    changed={
        "negatives": {
            "default": None,
            "metavar": "base|random|sphere|none",
            "help": "Negatives for methods that use them: base (the train split of --negatives-from), random, "
            "sphere or none [default: base with --negatives-from, else random].",
        }
    },
)
@click.option(
    "--negatives-from",
    type=click.Path(dir_okay=False),
    default=None,
    help="A feature cache of the same backbone and checkpoint: its train split is the base pool "
    "(and the centre of --preprocess cl2n).",
)
@schema_options(NegativeSpec, PreprocessSpec, only=("n_neg", "preprocess"))
@click.option(
    "--out",
    "out_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="CSV to write: path,prediction,confidence and one prob_<class> column per class.",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the extracted features here for the next call [default: a temporary folder].",
)
@schema_options(
    ExtractOptions,
    but=("dtype",),  # the features of a predict call stay float32
    changed={"workers": {"default": defaults.PREDICT_WORKERS, "help": "Worker processes decoding the images."}},
)
@schema_options(RunOptions, only=("device",))
@friendly_errors
def predict(
    support_dir: str | None,
    support_csv: str | None,
    query_dir: str | None,
    query_csv: str | None,
    backbone: str,
    method: str,
    transductive: bool,
    sets: tuple[str, ...],
    negatives_from: str | None,
    out_path: str,
    cache_dir: str | None,
    **options: Any,
) -> None:
    """Label a few images per class (--support), classify the rest (--query), write a CSV."""
    from poodle import predict as P
    from poodle.errors import ConfigError

    if (support_dir is None) == (support_csv is None):
        raise ConfigError("give exactly one of --support DIR and --support-csv FILE")
    if (query_dir is None) == (query_csv is None):
        raise ConfigError("give exactly one of --query DIR and --query-csv FILE")
    given = dict(options)
    config: dict[str, Any] = dict(parse_set(item, "KEY=VALUE") for item in sets)
    if transductive:
        config["transductive"] = True
    support = P.support_from_folder(support_dir) if support_dir else P.support_from_csv(cast(str, support_csv))
    query = P.query_from_folder(query_dir) if query_dir else P.query_from_csv(cast(str, query_csv))
    # the rest: the negatives' and the preprocessing's settings, and ExtractOptions' fields by name
    negatives, n_neg, preprocess = (given.pop(k) for k in ("negatives", "n_neg", "preprocess"))
    extraction = ExtractOptions(**given)
    settings = P.PredictOptions(method, config, negatives, negatives_from, n_neg, preprocess, cache_dir, extraction)
    res = P.predict(
        support,
        query,
        backbone,
        settings,
        on_event=_say,
        progress_factory=lambda desc, total: progress_bar(desc, total, unit="img"),
    )
    P.write_csv(res, out_path)
    _print_result(res)
    if res.cache:
        console.print(f"features kept in {res.cache} for the next call", highlight=False, soft_wrap=True)
    else:
        console.print("features not kept (--cache-dir DIR keeps them for the next call)", highlight=False)
    console.print(f"predictions written to {out_path}", highlight=False, soft_wrap=True)


def _say(event: Any) -> None:
    # predict reports only Notices: its own steps ("features") plainly, the rest as notes
    note(event, prefix=event.code != "features")


def _print_result(res: Any) -> None:
    """The per-class table and, with labelled queries, the accuracy with its Wilson interval."""
    from rich import box
    from rich.table import Table

    from poodle.utils import count

    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"{res.method}: {count(len(res.paths), 'query', 'queries')}, {count(len(res.classes), 'class')}",
        title_justify="left",
    )
    cols = ["class", "support", "predicted"] + (["queries", "correct", "accuracy %"] if res.labels else [])
    for c in cols:
        table.add_column(c, justify="left" if c == "class" else "right")
    for row in res.per_class():
        cells = [row["class"], str(row["support"]), str(row["predicted"])]
        if res.labels:
            acc = f"{100 * row['correct'] / row['queries']:.1f}" if row["queries"] else "-"
            cells += [str(row["queries"]), str(row["correct"]), acc]
        table.add_row(*cells)
    out.print(table)
    if res.accuracy is not None and res.ci95 is not None:
        lo, hi = res.ci95
        out.print(
            f"accuracy {100 * res.accuracy:.2f}% (95% CI {100 * lo:.1f}-{100 * hi:.1f}%, Wilson, "
            f"{count(len(res.paths), 'query', 'queries')})",
            highlight=False,
        )
