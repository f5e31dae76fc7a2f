"""The Meta-Dataset protocol: every rule of meta_dataset/data/sampling.py against a plain
per-episode reimplementation of its formulas (the same words, read one episode at a time), the
distributions over many draws, and ragged episode sets: slicing, streams, files, checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from poodle._mt19937 import packed_words, word_at
from poodle.episodes import (
    EpisodeSpec,
    EpisodeStream,
    describe_episodes,
    load_episodes,
    sample_episodes,
    save_episodes,
    superclass_names,
)
from poodle.errors import EpisodeError
from poodle.utils import derive_seed

# ----------------------------------------------------------------------------- the reference


def _words(seed: int, i: int, n: int) -> list[int]:
    return [int(w) for w in word_at(packed_words([derive_seed(seed, i)], n), np.zeros(n, np.int64), np.arange(n))]


def _uniform(w: list[int], at: int) -> float:
    return float(((w[at] & 0x1FFFFF) << 32) | w[at + 1]) * 2.0**-53


def _shuffle_prefix(n: int, take: int, words: list[int]) -> list[int]:
    perm = list(range(n))
    for t in range(take):
        if t < n - 1:
            j = t + words[t] % (n - t)
            perm[t], perm[j] = perm[j], perm[t]
    return perm[:take]


def _plain_sum(xs) -> float:
    total = 0.0
    for x in xs:
        total += x
    return total


def reference(labels: torch.Tensor, spec: EpisodeSpec, i: int, superclass: list[str] | None = None) -> dict:
    """Episode ``i`` by the formulas of the module docstring of poodle.sampler.draw_meta_dataset."""
    size = torch.bincount(labels).tolist()
    eligible = [c for c, n in enumerate(size) if n > 0]
    members = {c: (labels == c).nonzero().flatten().tolist() for c in eligible}
    if spec.way is not None:
        W = spec.way
    elif spec.bilevel:
        per = {}
        for c in eligible:
            per[superclass[c]] = per.get(superclass[c], 0) + 1
        W = min(spec.max_ways_upper_bound, max(per.values()))
    else:
        W = min(spec.max_ways_upper_bound, len(eligible))
    header = 2 + W + 2 + 2 * W
    w = _words(spec.seed, i, header + 2000)
    cand = eligible
    if spec.bilevel:
        supers = sorted({superclass[c] for c in eligible})
        chosen = supers[w[0] % len(supers)]
        cand = [c for c in eligible if superclass[c] == chosen]
    if spec.way is not None:
        ways = spec.way
    else:
        hi = min(spec.max_ways_upper_bound, len(cand))
        ways = spec.min_ways + w[1] % (hi - spec.min_ways + 1)
    classes = [cand[j] for j in _shuffle_prefix(len(cand), ways, w[2 : 2 + W])]
    n = [size[c] for c in classes]
    if spec.query is not None:
        q = spec.query
    elif spec.shot is not None:
        q = min(spec.max_num_query, min(n) - spec.shot)
    else:
        q = min(spec.max_num_query, min(x // 2 for x in n))
    if spec.shot is not None:
        shots = [spec.shot] * ways
    else:
        beta = _uniform(w, 2 + W)
        rem = [x - q for x in n]
        S = min(
            spec.max_support_set_size,
            int(_plain_sum(math.floor(beta * min(spec.max_support_size_contrib_per_class, r) + 1) for r in rem)),
        )
        weights = []
        for k in range(ways):
            u = _uniform(w, 2 + W + 2 + 2 * k)
            weights.append(n[k] * math.exp(spec.min_log_weight + (spec.max_log_weight - spec.min_log_weight) * u))
        total = _plain_sum(weights)
        shots = [min(math.floor(wk / total * (S - ways)) + 1, r) for wk, r in zip(weights, rem)]
    support, query, slab, qlab = [], [], [], []
    at = header
    for k, c in enumerate(classes):
        take = shots[k] + q
        picked = [members[c][j] for j in _shuffle_prefix(size[c], take, w[at : at + take])]
        at += take
        support += picked[: shots[k]]
        query += picked[shots[k] :]
        slab += [k] * shots[k]
        qlab += [k] * q
    return {"ways": ways, "classes": classes, "support": support, "query": query, "slab": slab, "qlab": qlab}


def _unequal(seed=0, n_classes=40, low=4, high=160):
    sizes = np.random.default_rng(seed).integers(low, high, n_classes)
    sizes[[5, 17]] = 0  # absent class ids
    return torch.from_numpy(np.repeat(np.arange(n_classes), sizes))


def _alphabets():
    """12 superclasses of 5 to 9 classes named SUPER_NNNN, 6 to 30 images each."""
    rng = np.random.default_rng(3)
    names, sizes = [], []
    for a in range(12):
        for c in range(int(rng.integers(5, 10))):
            names.append(f"script{a:02d}_{c:04X}")
            sizes.append(int(rng.integers(6, 31)))
    return torch.from_numpy(np.repeat(np.arange(len(names)), sizes)), names


CASES = {
    "defaults": (_unequal(), EpisodeSpec.meta_dataset(seed=1)),
    "small support cap": (_unequal(1), EpisodeSpec.meta_dataset(max_support_set_size=60, max_ways_upper_bound=12)),
    "fixed way": (_unequal(2), EpisodeSpec.meta_dataset(way=7, seed=2)),
    "5-way 1-shot": (_unequal(3), EpisodeSpec.meta_dataset(way=5, shot=1, seed=3)),
    "fixed shot and query": (_unequal(4, low=20), EpisodeSpec.meta_dataset(shot=3, query=4)),
    "fixed query": (_unequal(5), EpisodeSpec.meta_dataset(query=2, min_ways=3, max_ways_upper_bound=9)),
    "log weights": (_unequal(6), EpisodeSpec.meta_dataset(min_log_weight=-2.0, max_log_weight=0.5, max_num_query=3)),
    "contribution cap": (_unequal(7), EpisodeSpec.meta_dataset(max_support_size_contrib_per_class=7)),
}


def _episode(eps, e: int) -> dict:
    ways = int(eps.ways[e])
    sl, ql = eps.support_labels[e], eps.query_labels[e]
    return {
        "ways": ways,
        "classes": eps.class_ids[e, :ways].tolist(),
        "support": eps.support[e][sl >= 0].tolist(),
        "query": eps.query[e][ql >= 0].tolist(),
        "slab": sl[sl >= 0].tolist(),
        "qlab": ql[ql >= 0].tolist(),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_each_episode_follows_the_rules(name):
    labels, spec = CASES[name]
    eps = sample_episodes(labels, spec, 25, start=11)
    assert eps.ragged and eps.index.tolist() == list(range(11, 36))
    for e in range(len(eps)):
        assert _episode(eps, e) == reference(labels, spec, 11 + e), e
    assert (eps.class_ids[torch.arange(eps.way) >= eps.ways.unsqueeze(1)] == -1).all()
    eps.check_against(labels)


def test_bilevel_draws_the_classes_of_one_superclass():
    labels, names = _alphabets()
    spec = EpisodeSpec.meta_dataset(bilevel=True, seed=4)
    eps = sample_episodes(labels, spec, 40, classes=names)
    supers = superclass_names(names)
    for e in range(len(eps)):
        got = _episode(eps, e)
        assert got == reference(labels, spec, e, supers)
        assert len({supers[c] for c in got["classes"]}) == 1
    assert len({supers[int(eps.class_ids[e, 0])] for e in range(len(eps))}) > 4  # many superclasses


def test_superclasses_come_from_names_or_are_given():
    assert superclass_names(["Latin/a", "Latin/b", "Greek/c"]) == ["Latin", "Latin", "Greek"]
    assert superclass_names(["latin_0041", "greek_03B1"]) == ["latin", "greek"]
    with pytest.raises(EpisodeError, match="SUPER/NAME"):
        superclass_names(["a", "b_c"])
    labels = torch.arange(10).repeat_interleave(4)
    given = ["x"] * 5 + ["y"] * 5
    eps = sample_episodes(labels, EpisodeSpec.meta_dataset(bilevel=True), 20, superclasses=given)
    assert all(len({given[int(c)] for c in eps.class_ids[e, : eps.ways[e]]}) == 1 for e in range(20))
    with pytest.raises(EpisodeError, match=r"at least min_ways = 5 classes.*y \(4\)"):
        sample_episodes(labels, EpisodeSpec.meta_dataset(bilevel=True), 2, superclasses=["x"] * 6 + ["y"] * 4)


def test_episodes_do_not_depend_on_the_chunk():
    labels, spec = CASES["defaults"]
    whole = sample_episodes(labels, spec, 30)
    stream = EpisodeStream(labels, spec, 30)
    assert stream.ragged
    parts = [stream[a:b] for a, b in ((0, 1), (1, 8), (8, 30))]
    for p, (a, b) in zip(parts, ((0, 1), (1, 8), (8, 30))):
        ref = whole[a:b]
        for f in ("support", "query", "support_labels", "query_labels", "class_ids", "ways", "index"):
            assert torch.equal(getattr(p, f), getattr(ref, f)), f
        assert p.support.shape[1] == int((p.support_labels >= 0).sum(1).max())  # cropped to its largest


def test_a_ragged_set_from_another_split_is_refused():
    labels, spec = CASES["fixed way"]
    eps = sample_episodes(labels, spec, 6)
    eps.check_against(labels)
    other = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    with pytest.raises(EpisodeError, match="a label mixes classes"):
        eps.check_against(other)
    with pytest.raises(EpisodeError, match="split has 10 rows"):
        eps.check_against(labels[:10])


# ----------------------------------------------------------------------------- distributions


def test_ways_are_uniform_and_support_sizes_follow_beta():
    # 20 classes of 12 images: q = 6, each class adds floor(6 beta) + 1, so S = ways * (floor(6 beta) + 1);
    # with equal log-weights each class's share is 1 / ways and its shots S / ways exactly
    labels = torch.arange(20).repeat_interleave(12)
    eps = sample_episodes(labels, EpisodeSpec.meta_dataset(seed=9, min_log_weight=0.0, max_log_weight=0.0), 3000)
    ways = eps.ways.numpy()
    counts = np.bincount(ways, minlength=21)[5:]
    assert counts.min() > 0 and ways.min() == 5 and ways.max() == 20
    expected = len(ways) / 16
    assert ((counts - expected) ** 2 / expected).sum() < 40  # chi-square, 15 dof: p ~ 5e-4
    q = eps.query_counts()
    assert (q[torch.arange(eps.way) < eps.ways.unsqueeze(1)] == 6).all()
    S = eps.support_counts().sum(1).numpy()
    assert (S % ways == 0).all()
    level = np.bincount(S // ways - 1, minlength=6)
    assert level.size == 6 and ((level - 500) ** 2 / 500).sum() < 25  # uniform over 0..5


def test_shot_proportions_follow_class_sizes_and_log_weights():
    # halves of 30 and of 90 images: a class's share of S - ways is n exp(U) / sum over the episode
    labels = torch.from_numpy(np.repeat(np.arange(24), [30, 90] * 12))
    spec = EpisodeSpec.meta_dataset(seed=5, max_ways_upper_bound=10)
    eps = sample_episodes(labels, spec, 2000)
    shots = eps.support_counts().double()
    big = (torch.bincount(labels)[eps.class_ids.clamp(min=0)] == 90) & (eps.class_ids >= 0)
    small = (eps.class_ids >= 0) & ~big
    ratio = float(shots[big].mean() / shots[small].mean())
    # the same quantity from the formulas with numpy's generator
    rng = np.random.default_rng(0)
    b, s_ = [], []
    for _ in range(4000):
        w = int(rng.integers(5, 11))
        n = rng.choice([30, 90], w)
        if len(set(n.tolist())) == 1:
            n[0] = 120 - n[0]
        q = min(10, int((n // 2).min()))
        S = min(500, int(np.floor(rng.uniform() * np.minimum(100, n - q) + 1).sum()))
        wt = n * np.exp(rng.uniform(np.log(0.5), np.log(2), w))
        k = np.minimum(np.floor(wt / wt.sum() * (S - w)).astype(int) + 1, n - q)
        b += k[n == 90].tolist()
        s_ += k[n == 30].tolist()
    expected = np.mean(b) / np.mean(s_)
    assert abs(ratio - expected) < 0.08 * expected, (ratio, expected)
    assert ratio > 1.8  # the larger classes get about twice the support


# ----------------------------------------------------------------------------- setting checks


def test_the_setting_is_checked_before_drawing():
    labels = torch.arange(6).repeat_interleave(3)
    with pytest.raises(EpisodeError, match="min_ways = 7"):
        sample_episodes(labels, EpisodeSpec.meta_dataset(min_ways=7), 1)
    short = torch.cat([torch.arange(6).repeat_interleave(3), torch.tensor([6])])
    with pytest.raises(EpisodeError, match=r"fewer than 2 .*6 \(1\)"):
        sample_episodes(short, EpisodeSpec.meta_dataset(), 1)
    with pytest.raises(EpisodeError, match=r"shot \+ query = 5"):
        sample_episodes(labels, EpisodeSpec.meta_dataset(shot=1, query=4), 1)
    with pytest.raises(EpisodeError, match="max_support_set_size"):
        sample_episodes(labels, EpisodeSpec.meta_dataset(max_support_set_size=5), 1)
    for bad, match in (
        ({"min_ways": 1}, "min_ways"),
        ({"min_ways": 9, "max_ways_upper_bound": 8}, "max_ways_upper_bound=8"),
        ({"min_log_weight": 1.0, "max_log_weight": 0.0}, "max_log_weight"),
        ({"imbalance": 1.0}, "fixed protocol"),
        ({"bilevel": True, "way": 5}, "bilevel"),
        ({"max_num_query": 0}, "max_num_query"),
        ({"protocol": "mixed"}, "protocol"),
    ):
        with pytest.raises(EpisodeError, match=match):
            EpisodeSpec.meta_dataset(**bad).validate()


def test_a_fixed_spec_keeps_its_settings_keys():
    assert set(EpisodeSpec().settings()) == {"split", "way", "shot", "query", "imbalance", "seed", "query_classes"}
    md = EpisodeSpec.meta_dataset(way=5).settings()
    assert md["protocol"] == "meta-dataset" and md["way"] == 5 and md["shot"] is None and "bilevel" not in md
    assert EpisodeSpec.from_settings(md) == EpisodeSpec.meta_dataset(way=5)
    assert EpisodeSpec.from_settings(EpisodeSpec().settings()) == EpisodeSpec()


# ----------------------------------------------------------------------------- files


def test_ragged_files_round_trip_and_summarise(tmp_path):
    labels, spec = CASES["defaults"]
    eps = sample_episodes(labels, spec, 12)
    path = save_episodes(tmp_path / "md.h5", eps, cache="c.h5")
    back = load_episodes(path, labels=labels)
    assert back.spec == spec and back.ragged
    for f in ("support", "query", "support_labels", "query_labels", "class_ids", "ways", "index"):
        assert torch.equal(getattr(back, f), getattr(eps, f)), f
    import h5py

    with h5py.File(path) as f:
        assert f.attrs["version"] == 2 and f.attrs["way"] == 0 and f.attrs["protocol"] == "meta-dataset"
        assert (f["shots"][()] == eps.support_counts().numpy()).all()
        assert (f["queries"][()] == eps.query_counts().numpy()).all()
    d = describe_episodes(back)
    shots = eps.support_counts()[torch.arange(eps.way) < eps.ways.unsqueeze(1)]
    assert d["ways"] == (float(eps.ways.min()), float(eps.ways.double().mean()), float(eps.ways.max()))
    assert d["shots per class"] == (float(shots.min()), float(shots.double().mean()), float(shots.max()))


def test_fixed_files_keep_their_layout(tmp_path):
    import h5py

    eps = sample_episodes(torch.arange(8).repeat_interleave(20), EpisodeSpec(way=5, shot=1, query=3), 4)
    path = save_episodes(tmp_path / "f.h5", eps)
    with h5py.File(path) as f:
        assert sorted(f) == ["class_ids", "index", "query", "query_labels", "support", "support_labels"]
        assert f.attrs["version"] == 1 and "protocol" not in f.attrs and "min_ways" not in f.attrs


def test_a_broken_ragged_file_is_refused_by_name(tmp_path):
    import h5py

    labels, spec = CASES["5-way 1-shot"]
    path = save_episodes(tmp_path / "md.h5", sample_episodes(labels, spec, 3))
    with h5py.File(path, "a") as f:
        lab = f["support_labels"][()]
        lab[1, 0] = 9
        f["support_labels"][...] = lab
    with pytest.raises(EpisodeError, match=r"/support_labels\[1, 0\] = 9"):
        load_episodes(path)
    with h5py.File(path, "a") as f:
        lab[1, 0] = 0
        f["support_labels"][...] = lab
        del f["ways"]
    with pytest.raises(EpisodeError, match="needs /ways"):
        load_episodes(path)


# ----------------------------------------------------------------------------- settings and the command line


def test_cells_record_the_protocol_only_when_it_is_meta_dataset():
    from poodle.cells import make_cell
    from poodle.errors import ConfigError

    fixed = make_cell({"cache": "c.h5", "method": "proto", "protocol": "fixed"})
    plain = make_cell({"cache": "c.h5", "method": "proto"})
    assert fixed.episode == plain.episode and "protocol" not in fixed.episode  # old identities keep their key
    assert fixed.result_identity("x") == plain.result_identity("x")
    md = make_cell({"cache": "c.h5", "method": "proto", "protocol": "meta-dataset", "shot": 1, "max_num_query": 5})
    assert md.episode["protocol"] == "meta-dataset" and md.episode["way"] is None and md.episode["shot"] == 1
    assert md.episode["max_num_query"] == 5 and md.episode["max_support_set_size"] == 500
    assert "bilevel" not in md.episode
    assert md.spec == EpisodeSpec.meta_dataset(shot=1, max_num_query=5)
    assert md.result_identity("x") != plain.result_identity("x")
    on = make_cell({"cache": "c.h5", "method": "proto", "protocol": "meta-dataset", "bilevel": True})
    assert on.spec.bilevel and on.key != make_cell({"cache": "c.h5", "method": "proto", "protocol": "meta-dataset"}).key
    with pytest.raises(ConfigError, match='add protocol = "meta-dataset"'):
        make_cell({"cache": "c.h5", "method": "proto", "min_ways": 3})
    with pytest.raises(EpisodeError, match="min_ways"):
        make_cell({"cache": "c.h5", "method": "proto", "protocol": "meta-dataset", "min_ways": 1})
    with pytest.raises(EpisodeError, match="max_ways_upper_bound=50"):
        make_cell({"cache": "c.h5", "method": "proto", "protocol": "meta-dataset", "min_ways": 60})


def test_command_line_errors_name_the_flags_typed(tmp_path, monkeypatch):
    """The command line says a rule's parameters as the flags the user typed (and how to type what
    is missing); a project file's value names its key, an environment variable its name."""
    from click.testing import CliRunner

    from poodle.cli.main import cli

    def err(*args, env=None):
        r = CliRunner().invoke(cli, [str(a) for a in args], env=env)
        assert r.exit_code != 0
        return r.output.strip().splitlines()[-1]

    cache = tmp_path / "missing.h5"  # the settings are checked before the cache is read
    assert err("solve", "--cache", cache, "--protocol", "meta-dataset", "--max-ways-upper-bound", 3) == (
        "error: --max-ways-upper-bound must be at least --min-ways=5, got 3"
    )  # the one typed is blamed; both typed: --min-ways
    assert err(
        "solve", "--cache", cache, "--protocol", "meta-dataset", "--min-ways", 9, "--max-ways-upper-bound", 8
    ) == ("error: --min-ways must be at most --max-ways-upper-bound=8, got 9")
    assert err("solve", "--cache", cache, "--max-num-query", 3, "--bilevel") == (
        "error: --max-num-query, --bilevel belong to the Meta-Dataset protocol: add --protocol meta-dataset"
    )
    assert err("solve", "--cache", cache, "--protocol", "meta-dataset", "--imbalance", 2) == (
        "error: --imbalance belongs to the fixed protocol; the Meta-Dataset protocol draws its own per-class counts"
    )
    assert err("solve", "--cache", cache, "--way", 3, "--query-classes", 4) == (
        "error: --query-classes must be an integer from 1 to --way=3, got 4"
    )
    # a project file's value: its file, table and key, and the fix as the file writes it
    (tmp_path / "p.toml").write_text("[solve]\nmax_num_query = 3\n")
    assert err("--config", tmp_path / "p.toml", "solve", "--cache", cache) == (
        f"error: --max-num-query ({tmp_path / 'p.toml'} [solve] max_num_query) belongs to the Meta-Dataset "
        'protocol: add protocol = "meta-dataset"'
    )
    said = err("solve", "--cache", cache, "--progress", "plain", env={"POODLE_PROGRESS_INTERVAL": "-1"})
    assert said.startswith(
        "error: POODLE_PROGRESS_INTERVAL (environment variable for --progress-interval) must be a number in "
        "(0, inf), got -1.0"
    )


def test_info_summarises_an_episode_file(tmp_path):
    from click.testing import CliRunner

    from poodle.cli.info import info

    labels, spec = CASES["fixed way"]
    eps = sample_episodes(labels, spec, 8)
    path = save_episodes(tmp_path / "e.h5", eps)
    r = CliRunner().invoke(info, [str(path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    real = torch.arange(eps.way) < eps.ways.unsqueeze(1)
    assert "ways: min 7 / mean 7.00 / max 7" in lines
    for label, counts in (("shots", eps.support_counts()[real]), ("queries", eps.query_counts()[real])):
        lo, mean, hi = int(counts.min()), float(counts.double().mean()), int(counts.max())
        assert lo < hi and f"{label} per class: min {lo} / mean {mean:.2f} / max {hi}" in lines
    assert "8 episodes, meta-dataset protocol" in r.output.replace("\n", " ")


def test_solve_protocol_reaches_the_episodes(tmp_path, make_features):
    from poodle.cache import write_arrays
    from poodle.solve import make_cells

    cells = make_cells("c.h5", ["proto", "tim-gd"], {}, {"protocol": "meta-dataset", "episodes": 20})
    assert all(c.spec == EpisodeSpec.meta_dataset() for c in cells)
    x, y = make_features(12, 30, 16, seed=2)
    cache = write_arrays(tmp_path / "c.h5", {"test": (x, y, [f"t{i}" for i in range(12)])})
    ep = tmp_path / "e.h5"
    from click.testing import CliRunner

    from poodle.cli.solve import solve

    args = ["--cache", cache, "--episodes", 6, "--method", "proto", "--protocol", "meta-dataset"]
    CliRunner().invoke(solve, [str(a) for a in [*args, "--save-episodes", ep]])
    eps = load_episodes(ep)  # written before solving
    assert eps.spec == EpisodeSpec.meta_dataset() and len(eps) == 6 and eps.ragged
    ref = sample_episodes(torch.from_numpy(y), EpisodeSpec.meta_dataset(), 6)
    assert torch.equal(eps.query, ref.query) and torch.equal(eps.ways, ref.ways)


def test_the_summary_and_headers_say_what_the_protocol_draws(tmp_path, make_features):
    """Under Meta-Dataset's protocol no --way/--shot/--query default is shown as if it held: the
    summary says the protocol's rules (and what the user fixed), a report's header ``shots drawn``."""
    from click.testing import CliRunner

    from poodle.cache import write_arrays
    from poodle.cli.report import report
    from poodle.cli.solve import solve

    assert EpisodeSpec().describe() == "5-way 1-shot, 15 queries/class"
    assert EpisodeSpec.meta_dataset(min_ways=3, max_num_query=4, bilevel=True).describe() == (
        "Meta-Dataset protocol (3-50 ways, shots drawn: at most 500 support images, at most 4 queries/class, bilevel)"
    )
    x, y = make_features(12, 30, 16, seed=2)
    cache = write_arrays(tmp_path / "c.h5", {"test": (x, y, [f"t{i}" for i in range(12)])})
    base = ["--cache", cache, "--episodes", 4, "--method", "proto", "--protocol", "meta-dataset", "--progress", "none"]
    drawn = CliRunner().invoke(solve, [str(a) for a in [*base, "--json", tmp_path / "a.json"]])
    assert drawn.exit_code == 0, drawn.output
    text = " ".join(drawn.output.split())
    assert "4 episodes: Meta-Dataset protocol (5-50 ways, shots drawn: at most 500 support images, at most 10 " in text
    assert "-way" not in text and "-shot" not in text
    fixed = CliRunner().invoke(solve, [str(a) for a in [*base, "--shot", 2, "--json", tmp_path / "b.json"]])
    assert "Meta-Dataset protocol (5-50 ways, 2-shot, at most 10 queries/class)" in " ".join(fixed.output.split())
    r = CliRunner().invoke(report, [str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--no-ci"])
    assert r.exit_code == 0, r.output
    header = next(line for line in r.output.splitlines() if line.startswith("┃"))
    assert "shots drawn" in header and "2-shot" in header and "None" not in r.output


def test_an_episode_file_gives_its_cells_its_setting(tmp_path):
    from poodle.errors import ConfigError
    from poodle.solve import _from_file, make_cells

    labels, spec = CASES["log weights"]
    path = save_episodes(tmp_path / "e.h5", sample_episodes(labels, spec, 4))
    eps, implied = _from_file(path, {})
    (cell,) = make_cells("c.h5", ["proto"], {}, implied, eps, str(path))
    assert cell.spec == spec and cell.n_episodes == 4
    # the file's own setting given again is what the file says: solved (the command repeated)
    assert _from_file(path, {"protocol": "meta-dataset", "episodes": 4})[1] == implied
    clash = r"protocol='fixed' cannot be combined with episodes_from .*'meta-dataset' there"
    with pytest.raises(ConfigError, match=clash):
        _from_file(path, {"protocol": "fixed"})
    fixed = save_episodes(tmp_path / "f.h5", sample_episodes(torch.arange(8).repeat_interleave(16), EpisodeSpec(), 2))
    eps, implied = _from_file(fixed, {})
    assert "protocol" not in make_cells("c.h5", ["proto"], {}, implied, eps, str(fixed))[0].episode


def test_the_pipeline_draws_ragged_episodes_up_front(tmp_path, make_features):
    from poodle.cache import write_arrays
    from poodle.episodes import EpisodeSet
    from poodle.pipeline import Inputs
    from poodle.solve import make_cells

    x, y = make_features(12, 30, 16, seed=2)
    cache = write_arrays(tmp_path / "c.h5", {"test": (x, y, [f"t{i}" for i in range(12)])})
    md, fixed = (
        make_cells(cache, ["proto"], {}, {**extra, "episodes": 5})[0] for extra in ({"protocol": "meta-dataset"}, {})
    )
    inputs = Inputs()
    eps = inputs.episodes(md)
    assert isinstance(eps, EpisodeSet) and eps.ragged and len(eps) == 5
    assert isinstance(inputs.episodes(fixed), EpisodeStream)  # fixed ones stay drawn chunk by chunk


def test_a_grid_sweeps_the_protocol_and_its_rules(tmp_path):
    from poodle import grid as G
    from poodle.errors import ConfigError

    p = tmp_path / "g.toml"
    p.write_text(
        'cache = "feat.h5"\n[episodes]\nepisodes = 4\nprotocol = ["fixed", "meta-dataset"]\n'
        'max_num_query = 5\n[solver]\nmethod = "proto"\n'
    )
    with pytest.raises(ConfigError, match='add protocol = "meta-dataset"'):
        G.expand(G.load_grid(p))  # max_num_query on the fixed cell
    p.write_text(
        'cache = "feat.h5"\n[episodes]\nepisodes = 4\nprotocol = ["fixed", "meta-dataset"]\n'
        '[solver]\nmethod = "proto"\n'
    )
    fixed, md = G.expand(G.load_grid(p))
    assert "protocol" not in fixed.episode and fixed.spec == EpisodeSpec()
    assert md.spec == EpisodeSpec.meta_dataset() and md.episode["max_num_query"] == 10
