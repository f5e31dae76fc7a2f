"""`poodle solve` end to end on a small cache: table, paired differences, JSON, episodes files,
explicit-only options, and one-line errors for bad input."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from poodle.cache import write_arrays
from poodle.cli.solve import solve
from poodle.episodes import load_episodes
from poodle.results import read_results
from poodle.utils import file_sha256


@pytest.fixture
def cache(tmp_path, make_features):
    xtr, ytr = make_features(10, 20, 16, seed=1)
    xte, yte = make_features(6, 20, 16, seed=2, spread=0.4)
    xs, ys = make_features(6, 3, 16, seed=3)
    xw, yw = make_features(3, 10, 8, seed=4)
    write_arrays(tmp_path / "wide.h5", {"train": (xw, yw, ["a", "b", "c"])})
    return write_arrays(
        tmp_path / "c.h5",
        {
            "train": (xtr, ytr, [f"b{i}" for i in range(10)]),
            "test": (xte, yte, [f"t{i}" for i in range(6)]),
            "small": (xs, ys, [f"s{i}" for i in range(6)]),
        },
    )


def _run(args):
    return CliRunner().invoke(solve, [str(a) for a in args])


def test_solve_several_methods_table_json_and_episodes(tmp_path, cache):
    js, ep = tmp_path / "r.json", tmp_path / "e.h5"
    r = _run(
        [
            "--cache",
            cache,
            "--episodes",
            12,
            "--query",
            5,
            "--method",
            "proto",
            "--method",
            "poodle",
            "--method",
            "ce",
            "--transductive",
            "--steps",
            15,
            "--n-neg",
            10,
            "--json",
            js,
            "--save-episodes",
            ep,
        ]
    )
    assert r.exit_code == 0, r.output
    assert "diff vs proto" in r.output and "poodle" in r.output and "episodes/s" in r.output
    res = read_results(js)
    d = {r["label"]: r for r in res.records}
    assert list(d) == ["proto", "poodle", "ce"] and all(r["episode"]["episodes"] == 12 for r in d.values())
    # only explicit options reach the methods: proto gets nothing, ce no --transductive; records hold
    # every option value used
    assert "steps" not in d["proto"]["options"] and d["proto"]["negatives"] == "none" and d["proto"]["n_neg"] is None
    assert d["poodle"]["options"]["transductive"] is True and d["poodle"]["transductive"] is True
    assert d["poodle"]["options"]["alpha"] == 1.0 and d["poodle"]["options"]["steps"] == 15
    assert d["poodle"]["negatives"] == "base" and d["poodle"]["n_neg"] == 10
    assert d["ce"]["options"]["steps"] == 15 and d["ce"]["transductive"] is False
    # the setting's line says which methods used the queries, as the records do
    assert "preprocess l2n; transductive: poodle; inductive: proto, ce; device " in " ".join(r.output.split())
    for m in ("proto", "poodle", "ce"):
        acc = torch.tensor(d[m]["acc"], dtype=torch.float64)
        assert acc.shape == (12,) and d[m]["mean"] == pytest.approx(float(acc.mean()))
        assert d[m]["cache_id"] == file_sha256(cache)
    diff = torch.tensor(d["poodle"]["acc"], dtype=torch.float64) - torch.tensor(d["proto"]["acc"], dtype=torch.float64)
    assert f"{100 * float(diff.mean()):+.2f}" in r.output
    assert set(d["poodle"]["versions"]) == {"poodle", "torch", "python"} and d["poodle"]["seconds"] >= 0
    eps = load_episodes(ep)
    assert len(eps) == 12 and eps.negatives.shape == (12, 10) and eps.negative_source == "base"

    # the same episodes and negatives from the file give the same numbers
    js2 = tmp_path / "r2.json"
    r2 = _run(
        ["--cache", cache, "--episodes-from", ep, "--method", "poodle", "--transductive", "--steps", 15, "--json", js2]
    )
    assert r2.exit_code == 0, r2.output
    again = read_results(js2).records[0]
    assert "preprocess l2n; transductive; device " in " ".join(r2.output.split())
    assert again["acc"] == d["poodle"]["acc"] and again["key"] == d["poodle"]["key"]

    # replaying POODLE's episode file with a method that uses no negatives needs no --negatives none
    js3 = tmp_path / "r3.json"
    r3 = _run(["--cache", cache, "--episodes-from", ep, "--method", "proto", "--json", js3])
    assert r3.exit_code == 0, r3.output
    assert read_results(js3).records[0]["acc"] == d["proto"]["acc"]
    assert "preprocess l2n; inductive; device " in " ".join(r3.output.split())


def test_solve_imbalanced_random_negatives(tmp_path, cache):
    js = tmp_path / "r.json"
    r = _run(
        [
            "--cache",
            cache,
            "--episodes",
            6,
            "--query",
            4,
            "--imbalance",
            0.5,
            "--negatives",
            "random",
            "--n-neg",
            7,
            "--steps",
            5,
            "--method",
            "poodle",
            "--method",
            "naive-ood",
            "--json",
            js,
        ]
    )
    assert r.exit_code == 0, r.output
    d = {r["label"]: r for r in read_results(js).records}
    assert d["poodle"]["episode"]["imbalance"] == 0.5 and d["poodle"]["negatives"] == "random"
    assert d["naive-ood"]["n_neg"] == 7


@pytest.mark.parametrize(
    "args,message",
    [
        (["--way", 7], "has 6 classes"),
        (["--split", "small", "--query", 5], "fewer than shot + query = 6 images: s0 (3)"),
        (["--shot", 0], "shot must be a positive integer"),
        (["--episodes", 0], "--episodes must be a positive integer (the number of episodes), got 0"),
        (["--method", "nope"], "unknown method 'nope'"),
        (["--method", "proto", "--alpha", 2], "option --alpha is not an option of the chosen method(s) proto"),
        (["--method", "proto", "--transductive"], "option --transductive"),
        (["--set", "gamma=3"], "option --set gamma"),
        (["--set", "steps"], "expected KEY=VALUE"),
        (["--negatives", "WIDE"], "has feature dimension 8, but the episodes' features have 16"),
        (["--negatives", "none"], "--negatives none: method 'poodle' (with these options) reads negative samples"),
        (["--method", "proto", "--negatives", "random"], "none of the chosen methods"),
        (["--split", "val"], "no split 'val'"),
        (
            ["--way", 100],
            "split 'test' has 6 classes with images; cannot draw 100-way episodes (lower --way to at most 6)",
        ),
        (["--steps", "x"], "is not a valid integer"),
        (["--negatives", "MISSING"], "no such cache file"),
        (
            ["--negatives", "bse"],
            "--negatives bse: no such cache file 'bse' (the keywords are base, random, sphere and none",
        ),
        (["--n-neg", 0], "--n-neg must be a positive integer"),
        (["--max-memory", "1B"], "cannot be met"),
        (["--cuda-step", "cutlass"], "'cutlass' is not one of 'torch', 'triton'"),
        (["--method", "poodle", "--alpha", -1], "--alpha: method 'poodle': option 'alpha' must lie in [0, inf)"),
    ],
)
def test_solve_bad_input_one_line_errors(tmp_path, cache, args, message):
    args = [str(a).replace("WIDE", str(tmp_path / "wide.h5")).replace("MISSING", str(tmp_path / "no.h5")) for a in args]
    r = _run(["--cache", cache, "--episodes", 3, *args])
    assert r.exit_code != 0
    assert message in r.output.replace("\n", " "), r.output
    # checked before the progress display starts: the error comes alone, under no empty bar
    assert "solving" not in r.output and "0/3" not in r.output, r.output


def test_homonym_options_have_their_own_flags(tmp_path, cache):
    """--alpha is POODLE's pull weight and alpha-TIM's alpha-entropy order: one value for both is an
    error naming the per-method flags, which set one method each."""
    base = ["--cache", cache, "--episodes", 3, "--query", 5, "--n-neg", 10, "--steps", 2]
    both = ["--method", "poodle", "--method", "alpha-tim"]
    r = _run([*base, *both, "--alpha", 2])
    msg = r.output.replace("\n", " ")
    assert r.exit_code == 1 and "--alpha is ambiguous" in msg, r.output
    assert "pull weight (--pull-weight)" in msg and "alpha-entropy order (--entropy-alpha)" in msg
    assert "solving" not in r.output
    r = _run([*base, *both, "--set", "beta=2", "--method", "pt-map"])
    assert r.exit_code == 1 and "--push-weight" in r.output and "--set pt-map.beta=V" in r.output, r.output

    js = tmp_path / "r.jsonl"
    r = _run([*base, *both, "--pull-weight", 0.5, "--entropy-alpha", 3, "--push-weight", 0.25, "--out", js])
    assert r.exit_code == 0, r.output
    d = {x["method"]: x["options"] for x in read_results(js).records}
    assert (d["poodle"]["alpha"], d["poodle"]["beta"], d["alpha-tim"]["alpha"]) == (0.5, 0.25, 3.0)
    # the old spelling where it is unambiguous, and --set METHOD.KEY=V for one method
    js2 = tmp_path / "r2.jsonl"
    r = _run([*base, "--method", "poodle", "--alpha", 2, "--out", js2])
    assert r.exit_code == 0 and read_results(js2).records[0]["options"]["alpha"] == 2.0, r.output
    js3 = tmp_path / "r3.jsonl"
    r = _run([*base, *both, "--set", "alpha-tim.alpha=5", "--out", js3])
    d = {x["method"]: x["options"] for x in read_results(js3).records}
    assert r.exit_code == 0 and d["alpha-tim"]["alpha"] == 5.0 and d["poodle"]["alpha"] == 1.0, r.output

    for args, message in [
        (["--entropy-alpha", 2], "--entropy-alpha is for method alpha-tim, which is not among the chosen"),
        (["--alpha", 1, "--pull-weight", 2], "options --pull-weight and --alpha both set 'alpha' of method poodle"),
        (["--pull-weight", -1], "--pull-weight: method 'poodle': option 'alpha' must lie in [0, inf)"),
        (["--set", "nope.alpha=1"], "--set 'nope.alpha=1': unknown method 'nope'"),
    ]:
        r = _run([*base, "--method", "poodle", *args])
        assert r.exit_code == 1 and message in r.output.replace("\n", " "), (args, r.output)


def test_solve_cache_resolution_and_episode_file_mismatch(tmp_path, cache, make_features):
    r = _run(["--dataset", "mini", "--backbone", "resnet12", "--cache-root", tmp_path])
    assert r.exit_code == 1 and "no feature cache at" in r.output and "beside it" not in r.output
    (tmp_path / "mini").mkdir(exist_ok=True)
    (tmp_path / "mini" / "resnet12-demo-abc.h5").write_bytes(b"")  # a tagged cache, as the demo writes
    r = _run(["--dataset", "mini", "--backbone", "resnet12", "--cache-root", tmp_path])
    assert r.exit_code == 1 and "beside it: resnet12-demo-abc.h5 (--tag picks one)" in r.output.replace("\n", " ")
    r = _run(["--cache-root", tmp_path])  # no cache named, and extract recorded none there
    assert r.exit_code == 1 and "no feature cache written by poodle extract under" in r.output
    ep = tmp_path / "e.h5"
    assert _run(["--cache", cache, "--episodes", 3, "--method", "proto", "--save-episodes", ep]).exit_code == 0
    x, y = make_features(6, 5, 16, seed=9)
    other = write_arrays(tmp_path / "o.h5", {"test": (x, y, [f"t{i}" for i in range(6)])})
    r = _run(["--cache", other, "--episodes-from", ep, "--method", "proto"])
    assert r.exit_code == 1 and "its episodes were drawn from the cache" in " ".join(r.output.split())
    r = _run(["--cache", cache, "--episodes-from", ep, "--shot", 5])
    assert r.exit_code == 1 and "--shot=5 cannot be combined with --episodes-from" in r.output
    assert "its episodes have 1 there" in " ".join(r.output.split())
    r = _run(["--cache", cache, "--episodes-from", ep, "--shot", 1, "--episodes", 3, "--method", "proto"])
    assert r.exit_code == 0, r.output  # the file's own setting, repeated: solved


def test_solve_query_classes_recorded_in_json_and_episodes(tmp_path, cache):
    js, ep = tmp_path / "r.jsonl", tmp_path / "e.h5"
    r = _run(
        [
            "--cache",
            cache,
            "--episodes",
            5,
            "--query",
            4,
            "--query-classes",
            2,
            "--method",
            "paddle",
            "--method",
            "alpha-tim",
            "--steps",
            5,
            "--out",
            js,
            "--save-episodes",
            ep,
        ]
    )
    assert r.exit_code == 0, r.output
    assert "queries from 2 of the 5 classes" in r.output
    recs = read_results(js).records
    assert [rec["episode"]["query_classes"] for rec in recs] == [2, 2]
    # without the option the record's episode settings stay as they were (no query_classes key)
    js2 = tmp_path / "r2.jsonl"
    assert _run(["--cache", cache, "--episodes", 2, "--method", "proto", "--out", js2]).exit_code == 0
    assert "query_classes" not in read_results(js2).records[0]["episode"]
    eps = load_episodes(ep)
    assert eps.spec.query_classes == 2 and eps.query.shape == (5, 8)
    assert all(len(eps.query_labels[e].unique()) == 2 for e in range(5))
    bad = _run(["--cache", cache, "--query-classes", 6])
    assert bad.exit_code != 0 and "error: --query-classes must be an integer from 1 to --way=5, got 6" in bad.output


def test_solve_help_lists_the_methods():
    r = CliRunner().invoke(solve, ["--help"])
    assert r.exit_code == 0
    for name in ("alpha-tim", "paddle", "bms", "proto-lp", "laplacianshot", "poodle"):
        assert f"  {name} " in r.output
    # an episode file per domain: the help says how
    text = " ".join(r.output.split())
    assert "Write the episodes (HDF5); with several --cache, one file a domain: {domain} in the name." in text
    assert "Solve the episodes of this file; with several --cache, one a domain: {domain} in the name." in text


def test_solve_help_says_the_meta_dataset_options_briefly():
    """Each Meta-Dataset option's help is its own short sentence (sampling.py's names are said once,
    at --protocol); the log-weights' defaults read as logarithms, not as 16-digit floats; --bilevel
    says how a superclass is read from the class names, not the library function that does it."""
    from poodle import defaults
    from poodle.episodes import EpisodeSpec
    from poodle.options import settings

    r = CliRunner().invoke(solve, ["--help"])
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "[default: log(1/2) = -0.693]" in text and "[default: log(2) = 0.693]" in text
    # --episodes says both its defaults, as `poodle demo --help` does
    assert "Episodes drawn. [default: 2000; 600 under --protocol meta-dataset; x>=1]" in text
    assert "0.6931471805599453" not in text and "superclass_names" not in text
    assert text.count("sampling.py") == 1 and "before the first '/'" in text
    helps = {s.key: s.meta("help") for s in settings(EpisodeSpec) if s.key in defaults.META_DATASET_KEYS}
    assert len(helps) == 8 and len(set(helps.values())) == 8
    assert all(h.startswith("Meta-Dataset: ") for h in helps.values())
    assert all(len(h) <= 90 for k, h in helps.items() if k != "bilevel")


def _copy_cache(src, dst, split, row, how):
    """A copy of cache ``src`` whose ``split`` has row ``row`` NaN, infinite or of norm 1.5."""
    import shutil

    import h5py
    import numpy as np

    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        x = f[f"{split}/features"]
        if how == "unnormalised":
            x[row] = x[row] * 1.5
        else:
            x[row, 0] = np.nan if how == "nan" else np.inf
    return dst


@pytest.mark.parametrize(
    "split, how, message",
    [
        ("test", "nan", "split 'test': features row 2 is not finite"),
        ("test", "inf", "split 'test': features row 2 is not finite"),
        ("test", "unnormalised", "split 'test': features row 2 has L2 norm 1.5"),
        ("train", "nan", "negative pool (--negatives 'base'): "),
        ("train", "unnormalised", "split 'train': features row 2 has L2 norm 1.5"),
    ],
)
def test_a_bad_row_is_said_and_no_results_file_is_written(tmp_path, cache, split, how, message):
    """Nothing is written before the inputs are checked: a bad row of the split or of the base pool
    is one line naming the file, and the results file never appears (it was left holding a header)."""
    bad = _copy_cache(cache, tmp_path / "bad.h5", split, 2, how)
    out, eps = tmp_path / "r.json", tmp_path / "e.h5"
    r = _run(["--cache", bad, "--episodes", 3, "--steps", 2, "--json", out, "--save-episodes", eps])
    assert r.exit_code == 1 and message in r.output and str(bad) in r.output, r.output
    assert not out.exists() and not eps.exists()
    # one file a domain ({domain} filled with the cache's name): neither appears either
    r = _run(
        [
            "--cache",
            f"d={bad}",
            "--episodes",
            3,
            "--steps",
            2,
            "--out",
            out,
            "--save-episodes",
            tmp_path / "e-{domain}.h5",
        ]
    )
    assert r.exit_code == 1 and str(bad) in r.output and not out.exists() and not list(tmp_path.glob("e-*")), r.output
    good = _run(["--cache", cache, "--episodes", 3, "--steps", 2, "--json", out])
    assert good.exit_code == 0 and len(read_results(out).records) == 1  # created with its first record


def test_an_episodes_file_of_another_cache_or_with_negative_indices_is_named(tmp_path, cache, make_features):
    import h5py

    from poodle.cache import write_arrays

    eps_file, out = tmp_path / "e.h5", tmp_path / "r.json"
    assert _run(["--cache", cache, "--episodes", 3, "--save-episodes", eps_file]).exit_code == 0
    xs, ys = make_features(6, 4, 16, seed=7)  # 24 rows: the file's indices reach past them
    other = write_arrays(tmp_path / "other.h5", {"test": (xs, ys, [f"t{i}" for i in range(6)])})
    r = _run(["--cache", other, "--episodes-from", eps_file, "--json", out])
    assert r.exit_code == 1 and f"error: --episodes-from {eps_file}: " in r.output, r.output
    assert "its episodes were drawn from the cache" in " ".join(r.output.split()) and not out.exists()
    with h5py.File(eps_file, "a") as f:  # a file that records no cache (before 0.2.0, another tool)
        del f.attrs["cache_id"]
    r = _run(["--cache", other, "--episodes-from", eps_file, "--json", out])
    assert r.exit_code == 1 and f"error: --episodes-from {eps_file}: " in r.output, r.output
    assert "the episodes were drawn from another cache or split" in r.output and not out.exists()
    with h5py.File(eps_file, "a") as f:
        s = f["support"][()]
        s[1, 0] = -4
        f["support"][...] = s
    r = _run(["--cache", cache, "--episodes-from", eps_file, "--json", out])
    assert r.exit_code == 1 and not out.exists(), r.output
    assert f"error: --episodes-from {eps_file}: support index -4 (episode 1) is negative" in r.output.replace("\n", "")


def test_a_file_that_is_no_episodes_file_is_said_with_the_flag(tmp_path, cache):
    """--episodes-from naming a file that is not one: the flag, the file, and what it lacks (the
    attribute ``query`` and the dataset ``/query`` apart), before anything is solved or written."""
    import h5py

    out, plain, missing = tmp_path / "r.json", tmp_path / "p.h5", tmp_path / "none.h5"
    with h5py.File(plain, "w") as f:
        f["support"] = [[1]]
    for path, said in [
        (
            plain,
            "not an episodes file (missing attributes split, way, shot, query, seed; datasets /query, "
            "/support_labels, /query_labels)",
        ),
        (cache, "not an episodes file (missing attributes split, way, shot, query, seed; datasets /support, /query"),
        (missing, "no such episodes file"),
    ]:
        for more in ([], ["--shot", 1]):  # the file read to compare its setting, or to solve it
            r = _run(["--cache", cache, "--episodes-from", path, "--json", out, *more])
            assert r.exit_code == 1 and not out.exists(), r.output
            assert f"error: --episodes-from {path}: {said}" in r.output.replace("\n", ""), r.output
            assert "solving" not in r.output


def test_an_episodes_file_is_solved_only_on_the_cache_it_was_drawn_from(tmp_path, cache, make_features):
    """A cache of the same shape (same classes and rows, other features) takes the file's indices
    without complaint, so the file's record of its cache's content decides: refused, naming both."""
    from poodle.cache import read_split
    from poodle.episodes import episodes_source
    from poodle.results import cache_identity

    eps_file, out = tmp_path / "e.h5", tmp_path / "r.json"
    assert _run(["--cache", cache, "--episodes", 3, "--method", "proto", "--save-episodes", eps_file]).exit_code == 0
    assert episodes_source(eps_file) == (str(cache), cache_identity(cache))
    test = read_split(cache, "test")
    twin = write_arrays(
        tmp_path / "twin.h5", {"test": (-test.features.numpy(), test.labels.numpy(), list(test.classes))}
    )
    r = _run(["--cache", twin, "--episodes-from", eps_file, "--method", "proto", "--json", out])
    assert r.exit_code == 1 and not out.exists(), r.output
    text = r.output.replace("\n", "")
    assert f"--episodes-from {eps_file}: its episodes were drawn from the cache {cache}" in text
    assert f"not from {twin}" in text
    assert _run(["--cache", cache, "--episodes-from", eps_file, "--method", "proto"]).exit_code == 0


def test_a_second_run_reads_back_the_methods_its_out_file_holds(tmp_path, cache):
    """``--out`` holding a method's record (the same cache, episodes and options) is not solved
    again: the record is read back, the table is the first run's, nothing is appended; a method new
    to the file is solved and appended; ``--force`` solves again and the new record supersedes."""
    out = tmp_path / "r.jsonl"
    base = ["--cache", cache, "--episodes", 6, "--query", 3, "--device", "cpu", "--out", out]
    first = _run([*base, "--method", "proto", "--method", "tim-gd", "--steps", 2])
    assert first.exit_code == 0, first.output
    held = {r["method"]: r for r in read_results(out).records}
    again = _run([*base, "--method", "proto", "--method", "tim-gd", "--steps", 2])
    assert again.exit_code == 0, again.output
    assert "proto, tim-gd: read back from" in again.output.replace("\n", "")
    assert "results appended" not in again.output and "episodes/s" not in again.output
    assert [(r["method"], r["key"]) for r in read_results(out).records] == [(m, held[m]["key"]) for m in held]
    # the table of the first run: its accuracies and paired difference, from the records read back
    table = [ln for ln in again.output.splitlines() if "tim-gd" in ln and "±" in ln]
    assert table and table[0] in first.output, again.output
    more = _run([*base, "--method", "proto", "--method", "tim-gd", "--method", "ce", "--steps", 2])
    assert more.exit_code == 0 and "results appended" in more.output, more.output
    records = read_results(out).records
    assert [r["method"] for r in records] == ["proto", "tim-gd", "ce"]
    assert all(r["acc"] == held[r["method"]]["acc"] for r in records[:2])
    forced = _run([*base, "--method", "proto", "--force"])
    assert forced.exit_code == 0 and "read back" not in forced.output, forced.output
    assert len(out.read_text().splitlines()) == 1 + 4  # the header, 3 records, proto's new one
    records = read_results(out).records  # a key's last record supersedes the ones before
    assert [r["method"] for r in records] == ["tim-gd", "ce", "proto"]
    assert records[-1]["key"] == held["proto"]["key"] and records[-1]["acc"] == held["proto"]["acc"]
    # a bad input beside the file: the error names the cache, the file is as it was, nothing else is written
    before, eps = out.read_bytes(), tmp_path / "e.h5"
    bad = _run(["--cache", tmp_path / "nope.h5", "--method", "proto", "--out", out, "--save-episodes", eps])
    assert bad.exit_code == 1 and "nope.h5" in bad.output, bad.output
    assert out.read_bytes() == before and not eps.exists()
