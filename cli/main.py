"""Entry point of the ``poodle`` console script: a click group whose commands load lazily, so that
``poodle info`` does not pay for importing what ``poodle train`` needs."""

from __future__ import annotations

import importlib
from typing import Any

import click

# command name -> (module under poodle.cli, attribute, one-line help shown by `poodle --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "extract": ("extract", "extract", "Write L2-normalised features of every split to one HDF5 cache."),
    "split": ("split", "split", "Seeded cross-domain negative pools (noisy / disjoint) as csv split files."),
    "info": ("info", "info", "Validate a feature cache and summarise it."),
    "solve": ("solve", "solve", "Sample episodes from a cache and solve them all at once."),
    "train": ("train", "train", "Pre-train a backbone (simple, rot, rot-kd)."),
    "grid": ("grid", "grid", "Run an ablation grid over one cache and one episode set."),
    "report": ("report", "report", "Turn grid or solve results into tables and figures."),
    "predict": ("predict", "predict", "Classify a folder of images from a few labelled ones per class."),
    "demo": ("demo", "demo", "The whole pipeline on the embedded glyphs dataset, on CPU, in minutes."),
}


class OneLineUsageError(click.UsageError):
    """click's usage error (a bad value, a missing option, an unknown command) said on one line like
    every other error (``error: ...``), pointing at ``--help`` instead of printing the usage block."""

    def __init__(self, error: click.UsageError) -> None:
        super().__init__(error.format_message(), error.ctx)  # exit code 2, as click's

    def show(self, file: object = None) -> None:
        from poodle.cli._common import console, styled

        where = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        console.print(styled("error:", "bold red", f" {self.format_message().rstrip('.')}{where}"), soft_wrap=True)


class LazyGroup(click.Group):
    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            raise OneLineUsageError(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OneLineUsageError:
            raise
        except click.UsageError as e:  # a command's options, parsed here
            raise OneLineUsageError(e) from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(f"poodle.cli.{module}"), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, _, help_) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(),  # a folder given is refused by the project file's reader, in one line
    default=None,
    help='Project file of option defaults: a table per command ([extract] dataset = "mini") and '
    "[defaults] for keys several commands share; typed options win [default: ./poodle.toml if present].",
)
@click.version_option(package_name="poodle")
@click.pass_context
def cli(ctx: click.Context, config_file: str | None) -> None:
    """poodle: few-shot classification with POODLE, from cached features, batched over episodes."""
    from poodle.cli._common import friendly_errors, project_default_map

    ctx.default_map = friendly_errors(project_default_map)(ctx, config_file)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
