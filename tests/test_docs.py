"""The docs hold no stale copies of the README's result tables, and their links into the README resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a Markdown table row with at least two accuracy entries ("84.83" or "84.83 ± 0.96", maybe bold)
ACCURACY_ROW = re.compile(r"^\|[^|]*\|(\s*(\*\*)?\d{1,3}\.\d\d( ± \d+\.\d\d)?(\*\*)?\s*\|){2,}")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_transductive_doc_points_to_the_readme_tables_instead_of_copying_old_ones():
    text = (ROOT / "docs" / "transductive.md").read_text(encoding="utf-8")
    rows = [ln for ln in text.splitlines() if ACCURACY_ROW.match(ln)]
    assert not rows, f"accuracy tables in docs/transductive.md (the README's tables are the current ones): {rows[:3]}"
    assert "100 episodes per setting)" not in text


def test_links_into_the_readme_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    anchors = {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", readme, flags=re.M)}
    for doc in (ROOT / "docs").glob("*.md"):
        for anchor in re.findall(r"\(\.\./README\.md#([^)]+)\)", doc.read_text(encoding="utf-8")):
            assert anchor in anchors, f"{doc.name}: README.md#{anchor} is not a heading of the README"


def _first_hour_commands() -> list[list[str]]:
    """The ``poodle`` commands of the README's "The first hour", as a shell would split them."""
    import shlex

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The first hour\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"(?:^    .*\n)+", section, flags=re.M)
    text = "".join(blocks).replace("\\\n", " ")
    return [shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith("poodle ")]


def test_the_first_hours_commands_parse_as_typed(tmp_path, monkeypatch):
    import click

    from poodle.cli.main import cli

    monkeypatch.chdir(tmp_path)  # no project file: the commands' own defaults
    commands = _first_hour_commands()
    assert [c[1] for c in commands] == ["extract", "solve", "train", "extract", "solve", "predict", "predict"]
    for argv in commands:
        ctx = cli.make_context("poodle", argv[1:])
        name, command, rest = cli.resolve_command(ctx, argv[1:])  # (no group options in them)
        assert command is not None, argv
        try:
            command.make_context(name, rest, parent=ctx)  # options and values checked, nothing run
        except click.ClickException as e:
            raise AssertionError(f"{' '.join(argv)}: {e.format_message()}") from None


def test_the_settings_tables_are_the_declarations():
    """docs/settings.md holds the option tables made from the settings' declarations (regenerate
    with ``python -m poodle.settings``): a setting added, renamed or re-bounded shows there."""
    from poodle.settings import markdown_tables

    text = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text()
    block = text.split("<!-- generated tables: begin -->\n")[1].split("<!-- generated tables: end -->")[0]
    assert block == markdown_tables()
    assert "| `way` | `--way` | `5` | an integer >= 2 or none (a 1-way episode is always right) |" in block
    assert "| `n_neg` | `--n-neg` | `400` | a positive integer |" in block


def test_the_report_formats_line_is_the_formats():
    """docs/grid.md names the formats of ``poodle report --format`` by a line made from
    ``poodle.report.FORMATS`` (regenerate with ``python -m poodle.report``): a format added there
    shows on the page, and the page names no other."""
    from poodle.report import FORMATS, formats_line

    text = (ROOT / "docs" / "grid.md").read_text(encoding="utf-8")
    block = text.split("<!-- generated formats: begin -->\n")[1].split("<!-- generated formats: end -->")[0]
    assert block == formats_line()
    assert all(f"`{name}`" in block for name in FORMATS) and {"markdown", "latex"} <= set(FORMATS)
    assert "[--format FORMAT]" in text and "--format rich|" not in text
