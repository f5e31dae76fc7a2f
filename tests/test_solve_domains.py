"""`poodle solve` on several caches (Meta-Dataset's per-domain evaluation): each domain's own episode
stream, its results equal to solving the cache alone with its seed, the per-domain table (also from
`poodle report --domains`), episode files one per domain, one negative pool for every domain, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from poodle.cache import read_split, write_arrays
from poodle.cli.report import report
from poodle.cli.solve import solve as solve_cmd
from poodle.episodes import load_episodes, sample_episodes
from poodle.errors import ConfigError
from poodle.report import domain_table
from poodle.results import read_results
from poodle.solve import domain_caches, domain_file, domain_seed, solve, solve_domains


@pytest.fixture
def caches(tmp_path, make_features):
    out = {}
    for i, name in enumerate(("birds", "fungi", "signs")):
        x, y = make_features(12, 24, 16, seed=10 + i, spread=0.5 + 0.1 * i)
        xb, yb = make_features(8, 10, 16, seed=20 + i)
        out[name] = write_arrays(
            tmp_path / f"{name}.h5",
            {"test": (x, y, [f"t{j}" for j in range(12)]), "train": (xb, yb, [f"b{j}" for j in range(8)])},
        )
    return out


def _run(args):
    return CliRunner().invoke(solve_cmd, [str(a) for a in args])


def test_domain_names_and_seeds(tmp_path):
    assert domain_caches(["a=x/one.h5", "y/two.h5"]) == {"a": Path("x/one.h5"), "two": Path("y/two.h5")}
    with pytest.raises(ConfigError, match="domain 'two' given twice"):
        domain_caches(["x/two.h5", "y/two.h5"])
    with pytest.raises(ConfigError, match="expected NAME=PATH"):
        domain_caches(["a="])
    with pytest.raises(ConfigError, match="may hold letters"):
        domain_caches(["my domain=x.h5"])
    # 63 bits, a function of both, not of the other domains
    s = {domain_seed(0, d) for d in ("a", "b")} | {domain_seed(1, "a")}
    assert len(s) == 3 and all(0 <= v < 2**63 for v in s) and domain_seed(0, "a") == domain_seed(0, "a")
    assert domain_file("ep-{domain}.h5", "a", "save_episodes_to").name == "ep-a.h5"
    with pytest.raises(ConfigError, match=r"one file per domain, a name holding \{domain\}"):
        domain_file("ep.h5", "a", "save_episodes_to")


@pytest.mark.parametrize("protocol", ["fixed", "meta-dataset"])
def test_each_domain_is_that_cache_solved_alone_with_its_seed(tmp_path, caches, protocol):
    extra = {"protocol": protocol} if protocol == "meta-dataset" else {"way": 3, "shot": 2, "query": 4}
    res = solve_domains(caches, ["proto", "tim-gd"], options={"tim-gd": {"steps": 5}}, episodes=6, seed=3, **extra)
    assert list(res.domains) == list(caches) and len(res.records) == 6
    seeds = set()
    for name, path in caches.items():
        dom = res.domains[name]
        assert [r["cache"] for r in dom.records] == [name, name]
        seed = domain_seed(3, name)
        assert all(r["episode"]["seed"] == seed for r in dom.records)
        seeds.add(seed)
        alone = solve(path, ["proto", "tim-gd"], options={"tim-gd": {"steps": 5}}, episodes=6, seed=seed, **extra)
        for m in ("proto", "tim-gd"):
            assert torch.equal(dom.accs[m], alone.accs[m])
        # the identities differ per domain (the seed decides the episodes)
    assert len(seeds) == 3 and len({r["key"] for r in res.records}) == 6
    assert all(r["episode"].get("protocol", "fixed") == protocol for r in res.records)


def test_meta_dataset_defaults_to_600_episodes_per_domain(caches):
    from poodle.solve import make_cells

    (md,) = make_cells(caches["birds"], ["proto"], {}, {"protocol": "meta-dataset"})
    (fixed,) = make_cells(caches["birds"], ["proto"], {}, {})
    assert md.n_episodes == 600 and fixed.n_episodes == 2000


def test_cli_table_report_episode_files_and_pool(tmp_path, caches):
    js, ep = tmp_path / "r.jsonl", tmp_path / "ep-{domain}.h5"
    pool = caches["signs"]
    args = [
        *("--cache", f"b={caches['birds']}", "--cache", caches["fungi"]),
        *("--protocol", "meta-dataset", "--episodes", 5, "--method", "proto", "--method", "poodle"),
        *("--steps", 5, "--n-neg", 6, "--negatives", f"{pool}:train", "--out", js, "--save-episodes", ep),
    ]
    r = _run(args)
    assert r.exit_code == 0, r.output
    assert "2 domains, 5 episodes each" in r.output and "average rank" in r.output and "mean over" in r.output
    assert f"negatives: {pool}:train x 6; inductive; device " in " ".join(r.output.split()), r.output
    records = read_results(js).records
    assert [x["cache"] for x in records] == ["b", "b", "fungi", "fungi"]
    assert all(x["negatives"] == f"{pool}:train" for x in records if x["method"] == "poodle")
    # one file per domain, with the domain's own episodes (its seed) and the pool's negatives
    for name, path in (("b", caches["birds"]), ("fungi", caches["fungi"])):
        eps = load_episodes(tmp_path / f"ep-{name}.h5")
        assert eps.spec.seed == domain_seed(0, name) and eps.ragged
        ref = sample_episodes(read_split(path, "test").labels, eps.spec, 5)
        assert len(eps) == 5 and torch.equal(eps.query, ref.query) and eps.negatives.shape[1] == 6
    # the table: a column per domain, a row per method; report --domains renders the same
    table = domain_table(records)
    assert table.domains == ["b", "fungi"] and [str(x[0]) for x in table.rows] == ["proto", "poodle"]
    rep = CliRunner().invoke(report, [str(js), "--domains"])
    assert rep.exit_code == 0, rep.output
    rows = [line.strip() for line in rep.output.splitlines() if line.strip().startswith(("│ proto", "│ poodle"))]
    assert len(rows) == 2 and all(row in r.output for row in rows)
    # solving the saved episodes again gives the same accuracies, domain by domain
    js2 = tmp_path / "r2.jsonl"
    again = _run(
        [
            *("--cache", f"b={caches['birds']}", "--cache", caches["fungi"], "--episodes-from", ep),
            *("--method", "proto", "--method", "poodle", "--steps", 5, "--out", js2),
        ]
    )
    assert again.exit_code == 0, again.output
    rec2 = read_results(js2).records
    assert [x["acc"] for x in rec2] == [x["acc"] for x in records]


def test_domains_are_named_short_and_their_table_fits_100_columns(tmp_path, make_features):
    """Bare paths name their domains by their files' stems (poodle solve) and so does the table of
    caches solved alone (whose results name them by path, report --domains); long names fold in
    their column's header, and the table of 3 domains stays a table in 100 columns."""
    from poodle.report import domain_labels

    assert domain_labels(["x/mini/resnet12.h5", "x/cub/resnet12.h5"]) == ["mini/resnet12", "cub/resnet12"]
    assert domain_labels(["b", "y/fungi.h5"]) == ["b", "fungi"] and domain_labels(["a/b.h5", "b"]) == ["a/b", "b"]
    deep = tmp_path / "features" / "resnet12-run-3" / "caches"
    deep.mkdir(parents=True)
    paths = []
    for i, name in enumerate(("birds", "fungi", "signs")):
        x, y = make_features(12, 24, 16, seed=10 + i)
        path = deep / f"{name}_resnet12_features.h5"
        paths.append(write_arrays(path, {"test": (x, y, [f"t{j}" for j in range(12)])}))
    common = ["--protocol", "meta-dataset", "--episodes", 4, "--method", "proto", "--method", "kmeans"]

    def table_lines(output):
        """The table's lines, from its header (the first line naming a domain without ``=``, which
        the setting's line and the note under the table use) to its last row."""
        lines = output.splitlines()
        rows = [line for line in lines if line.replace("│", " ").split()[:1] in (["proto"], ["kmeans"])]
        assert len(rows) == 2 and all(row.count("±") == 4 for row in rows), output  # 3 domains, their mean
        start = next(i for i, line in enumerate(lines) if "birds_" in line and "=" not in line)
        return lines[start : lines.index(rows[-1]) + 1]

    cli_args = [str(a) for a in [*(a for p in paths for a in ("--cache", p)), *common]]
    r = CliRunner().invoke(solve_cmd, cli_args, env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    lines = table_lines(r.output)
    assert max(len(line) for line in lines) <= 100 and "birds_" in "".join(lines)
    assert not any("resnet12-run-3" in line for line in lines)
    # each cache solved alone: its results name it by path; report --domains names it by its stem
    js = tmp_path / "alone.jsonl"
    for p in paths:
        assert _run(["--cache", p, *common, "--out", js]).exit_code == 0
    rep = CliRunner().invoke(report, [str(js), "--domains"], env={"COLUMNS": "100"})
    assert rep.exit_code == 0, rep.output
    lines = table_lines(rep.output)
    assert max(len(line) for line in lines) <= 100 and not any("resnet12-run-3" in line for line in lines)
    assert "Domains: birds_resnet12_features = " in " ".join(rep.output.split())
    table = domain_table(read_results(js).records)
    assert table.domains == [str(p) for p in paths] and [c[0] for c in table.cols][0] == "birds_resnet12_features"
    assert f"Domains: birds_resnet12_features = {paths[0]}, fungi_resnet12_features = " in table.notes[-1]


def test_cli_errors_name_the_domain_and_file(tmp_path, caches):
    both = ("--cache", caches["birds"], "--cache", caches["fungi"])
    r = _run([*both, "--save-episodes", tmp_path / "e.h5", "--episodes", 2])
    assert r.exit_code != 0 and "{domain}" in r.output and "--save-episodes" in r.output
    r = _run([*both, "--episodes-from", tmp_path / "none-{domain}.h5"])
    assert r.exit_code != 0 and "none-birds.h5" in r.output and "'birds'" in r.output
    r = _run(["--cache", caches["birds"], "--cache", f"x/{caches['birds'].name}"])
    assert r.exit_code != 0 and "given twice" in r.output
    r = _run([*both, "--cache", "=x.h5"])
    assert r.exit_code != 0 and "NAME=PATH" in r.output
    r = _run([*both, "--way", 30, "--episodes", 2])  # 12 classes: the domain is named
    assert r.exit_code != 0 and "domain 'birds'" in r.output
    # a missing cache is found before the first domain is solved: nothing written, nothing solved
    out = tmp_path / "r.jsonl"
    r = _run([*both, "--cache", f"gone={tmp_path / 'gone.h5'}", "--episodes", 2, "--out", out])
    assert r.exit_code != 0 and "domain 'gone'" in r.output and "gone.h5 does not exist" in r.output
    assert "solving" not in r.output and not out.exists()


def test_project_file_lists_domains_read_from_its_folder(tmp_path, caches, monkeypatch):
    from poodle.cli.main import cli

    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "p.toml").write_text(
        '[solve]\ncache = ["b=../birds.h5", "../fungi.h5"]\nepisodes = 3\nway = 3\nmethod = "proto"\n'
    )
    js = tmp_path / "r.jsonl"
    monkeypatch.chdir(tmp_path / "proj")
    r = CliRunner().invoke(cli, ["--config", "p.toml", "solve", "--out", str(js)])
    assert r.exit_code == 0, r.output
    assert [x["cache"] for x in read_results(js).records] == ["b", "fungi"]


def test_one_named_cache_keeps_todays_episodes(tmp_path, caches):
    args = ["--episodes", 4, "--way", 3, "--method", "proto", "--out"]
    assert _run(["--cache", caches["birds"], *args, tmp_path / "a.jsonl"]).exit_code == 0
    r = _run(["--cache", f"b={caches['birds']}", *args, tmp_path / "b.jsonl"])
    assert r.exit_code == 0, r.output
    ((plain,), (named,)) = (read_results(tmp_path / f"{x}.jsonl").records for x in "ab")
    assert plain["cache"] == str(caches["birds"]) and named["cache"] == "b"
    # the same identity: a name alone does not change what is solved
    assert named["key"] == plain["key"] and named["episode"]["seed"] == 0 and named["acc"] == plain["acc"]


def test_one_cache_fills_domain_in_episode_file_names(tmp_path, caches):
    """A script that loops over domains one cache at a time writes and reads the domain's own file."""
    args = ["--episodes", 3, "--way", 3, "--method", "proto"]
    r = _run(["--cache", f"b={caches['birds']}", *args, "--save-episodes", tmp_path / "e-{domain}.h5"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "e-b.h5").is_file() and not list(tmp_path.glob("*{domain}*"))
    r = _run(["--cache", caches["birds"], *args, "--save-episodes", tmp_path / "f-{domain}.h5"])
    assert r.exit_code == 0 and (tmp_path / "f-birds.h5").is_file(), r.output
    r = _run(["--cache", f"b={caches['birds']}", "--method", "proto", "--episodes-from", tmp_path / "e-{domain}.h5"])
    assert r.exit_code == 0, r.output
