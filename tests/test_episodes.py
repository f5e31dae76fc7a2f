"""Episodes, negatives and evaluate(): seeded and chunk-independent sampling, Dirichlet imbalance,
HDF5 round trip, negative sources, chunked evaluation, confidence intervals, and bad input."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from poodle.cache import read_split, write_arrays
from poodle.episodes import EpisodeSpec, EpisodeStream, imbalanced_counts, load_episodes, sample_episodes, save_episodes
from poodle.errors import ConfigError, EpisodeError, PoodleError
from poodle.evaluate import Hooks, evaluate
from poodle.negatives import NegativeSpec, generate, sample_indices
from poodle.run import RunOptions
from poodle.stats import mean_ci, paired_difference


def _labels(n_classes=10, per_class=30):
    return torch.arange(n_classes).repeat_interleave(per_class)


@pytest.fixture
def cache(tmp_path, make_features):
    xtr, ytr = make_features(12, 25, 16, seed=1)
    xte, yte = make_features(8, 25, 16, seed=2, spread=0.5)
    xo, yo = make_features(3, 10, 16, seed=3)
    xw, yw = make_features(3, 10, 12, seed=4)
    write_arrays(tmp_path / "other.h5", {"pool": (xo, yo, ["o0", "o1", "o2"]), "wide": (xw, yw, ["w0", "w1", "w2"])})
    return write_arrays(
        tmp_path / "c.h5",
        {"train": (xtr, ytr, [f"b{i}" for i in range(12)]), "test": (xte, yte, [f"t{i}" for i in range(8)])},
    )


# ------------------------------------------------------------------------- sampling


def test_episode_structure_class_major_and_labels():
    labels = _labels()
    eps = sample_episodes(labels, EpisodeSpec(way=5, shot=2, query=3, seed=4), 20)
    assert eps.support.shape == (20, 10) and eps.query.shape == (20, 15)
    assert torch.equal(eps.support_labels[0], torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4]))
    assert torch.equal(eps.query_labels[0], torch.arange(5).repeat_interleave(3))
    for e in range(20):
        rows = torch.cat([eps.support[e], eps.query[e]])
        assert rows.unique().numel() == rows.numel()  # images without replacement
        assert torch.equal(labels[eps.support[e]].view(5, 2)[:, 0], eps.class_ids[e])
        assert torch.equal(labels[eps.query[e]], eps.class_ids[e][eps.query_labels[e]])
        assert eps.class_ids[e].unique().numel() == 5  # classes without replacement


def test_episodes_are_deterministic_and_independent_of_how_many_are_drawn():
    labels, spec = _labels(), EpisodeSpec(way=5, shot=1, query=4, imbalance=1.0, seed=7)
    a = sample_episodes(labels, spec, 12)
    b = sample_episodes(labels, spec, 12)
    c = sample_episodes(labels, spec, 5, start=7)  # a later chunk alone
    assert torch.equal(a.support, b.support) and torch.equal(a.query, b.query)
    assert torch.equal(a.support[7:], c.support) and torch.equal(a.query[7:], c.query)
    assert torch.equal(a[7:].query_labels, c.query_labels) and torch.equal(a[7:].index, c.index)
    other = sample_episodes(labels, EpisodeSpec(way=5, shot=1, query=4, imbalance=1.0, seed=8), 12)
    assert not torch.equal(a.support, other.support)


def test_the_episode_stream_without_query_classes_is_pinned():
    # README tables depend on these draws: a change to the sampler must not move them
    labels = _labels()
    bal = sample_episodes(labels, EpisodeSpec(way=5, shot=1, query=4, seed=3), 4)
    assert bal.query[:, :6].tolist() == [
        [81, 70, 76, 61, 144, 127],
        [54, 58, 40, 53, 182, 194],
        [100, 91, 90, 107, 261, 252],
        [1, 2, 26, 16, 139, 120],
    ]
    imb = sample_episodes(labels, EpisodeSpec(way=5, shot=2, query=4, imbalance=2.0, seed=3), 4)
    assert imb.query[:, :6].tolist() == [
        [72, 79, 89, 69, 88, 87],
        [34, 44, 46, 197, 256, 265],
        [112, 101, 267, 255, 265, 251],
        [26, 11, 0, 13, 16, 3],
    ]
    assert imb.query_labels.sum(1).tolist() == [29, 49, 50, 36]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_query_classes_balanced(n):
    labels = _labels()
    full = sample_episodes(labels, EpisodeSpec(way=5, shot=2, query=3, seed=5), 40)
    eps = sample_episodes(labels, EpisodeSpec(way=5, shot=2, query=3, seed=5, query_classes=n), 40)
    assert eps.query.shape == (40, 3 * n) and eps.spec.n_query == 3 * n
    assert torch.equal(eps.class_ids, full.class_ids)  # classes drawn first, unchanged
    assert torch.equal(eps.support_labels, full.support_labels)
    chosen = set()
    for e in range(40):
        present, counts = eps.query_labels[e].unique(return_counts=True)
        assert len(present) == n and (counts == 3).all()
        chosen.add(tuple(present.tolist()))
        assert torch.equal(labels[eps.query[e]], eps.class_ids[e][eps.query_labels[e]])
        rows = torch.cat([eps.support[e], eps.query[e]])
        assert rows.unique().numel() == rows.numel()
    assert len(chosen) > (1 if n in (1, 4) else 5)  # chosen afresh per episode


def test_query_classes_dirichlet_stays_within_the_chosen_classes():
    labels = _labels(per_class=8)  # capacity 7 per class at 1 shot
    eps = sample_episodes(labels, EpisodeSpec(way=5, shot=1, query=6, imbalance=0.5, seed=2, query_classes=2), 60)
    assert eps.query.shape == (60, 12)
    sizes = set()
    for e in range(60):
        present, counts = eps.query_labels[e].unique(return_counts=True)
        assert len(present) <= 2 and counts.sum() == 12 and (counts <= 7).all()
        sizes.add(tuple(sorted(counts.tolist())))
    assert len(sizes) > 1  # imbalanced, capped at 7


def test_query_classes_is_validated_and_saved(tmp_path):
    with pytest.raises(EpisodeError, match="query_classes"):
        EpisodeSpec(way=5, query_classes=6).validate()
    with pytest.raises(EpisodeError, match="query_classes"):
        EpisodeSpec(way=5, query_classes=0).validate()
    eps = sample_episodes(_labels(), EpisodeSpec(way=5, shot=1, query=3, seed=1, query_classes=3), 5)
    back = load_episodes(save_episodes(tmp_path / "e.h5", eps))
    assert back.spec == eps.spec and torch.equal(back.query, eps.query)
    plain = load_episodes(save_episodes(tmp_path / "p.h5", sample_episodes(_labels(), EpisodeSpec(), 2)))
    assert plain.spec.query_classes is None


def test_shot_settings_are_nested_for_paired_ablations():
    labels = _labels()
    one = sample_episodes(labels, EpisodeSpec(shot=1, query=5), 6)
    five = sample_episodes(labels, EpisodeSpec(shot=5, query=5), 6)
    assert torch.equal(one.class_ids, five.class_ids)
    assert torch.equal(one.support, five.support.view(6, 5, 5)[:, :, 0])


def test_imbalanced_counts_vary_and_sum_exactly():
    labels = _labels(10, 40)
    eps = sample_episodes(labels, EpisodeSpec(way=5, shot=1, query=6, imbalance=0.5, seed=1), 200)
    counts = torch.stack([torch.bincount(q, minlength=5) for q in eps.query_labels])
    assert (counts.sum(1) == 30).all()
    assert counts.max() > 12 and (counts == 0).any()  # kappa 0.5 is very skewed
    assert (eps.query_labels.diff(dim=1) >= 0).all()  # class-major
    bal = sample_episodes(labels, EpisodeSpec(way=5, shot=1, query=6, imbalance=100.0, seed=1), 200)
    cb = torch.stack([torch.bincount(q, minlength=5) for q in bal.query_labels])
    assert cb.float().std() < counts.float().std() / 2  # kappa large: near balanced


def test_largest_remainder_rounding_and_capacity():
    p = torch.tensor([0.52, 0.27, 0.21], dtype=torch.float64)
    # 10 * p = 5.2, 2.7, 2.1: floors 5, 2, 2 and the one left goes to the largest remainder (0.7)
    assert imbalanced_counts(p, 10, torch.tensor([99, 99, 99])).tolist() == [5, 3, 2]
    # ties go to the lower label
    assert imbalanced_counts(torch.full((4,), 0.25, dtype=torch.float64), 6, torch.tensor([9] * 4)).tolist() == [
        2,
        2,
        1,
        1,
    ]
    # a class without enough images keeps all it has; the rest is spread by the others' shares
    assert imbalanced_counts(
        torch.tensor([0.9, 0.06, 0.04], dtype=torch.float64), 30, torch.tensor([10, 100, 100])
    ).tolist() == [10, 12, 8]


@pytest.mark.parametrize(
    "spec,match",
    [
        (EpisodeSpec(way=11), "has 10 classes"),
        (EpisodeSpec(way=0), "way must be an integer >= 2"),
        (EpisodeSpec(shot=0), "shot must be a positive integer"),
        (EpisodeSpec(query=-1), "query must be a positive integer"),
        (EpisodeSpec(imbalance=0.0), "imbalance"),
    ],
)
def test_impossible_settings_are_rejected(spec, match):
    with pytest.raises(EpisodeError, match=match):
        sample_episodes(_labels(), spec, 3)


def test_short_classes_are_named():
    labels = torch.cat([_labels(6, 20), torch.full((5,), 6), torch.full((3,), 7)])
    names = [f"n{i:02d}" for i in range(8)]
    with pytest.raises(
        EpisodeError, match=r"2 class\(es\) have fewer than shot \+ query = 16 images: n06 \(5\), n07 \(3\)"
    ):
        sample_episodes(labels, EpisodeSpec(shot=1, query=15), 3, classes=names)
    with pytest.raises(EpisodeError, match="positive integer"):
        sample_episodes(_labels(), EpisodeSpec(), 0)


# ------------------------------------------------------------------------- files


def test_save_load_round_trip_with_negatives(tmp_path):
    labels = _labels()
    eps = sample_episodes(labels, EpisodeSpec(way=4, shot=2, query=3, imbalance=2.0, seed=3), 9)
    eps = eps.with_negatives(sample_indices(100, eps.index, 7, 3), "base")
    path = save_episodes(tmp_path / "e.h5", eps)
    back = load_episodes(path, labels=labels, pool_size=100)
    for name in ("support", "query", "support_labels", "query_labels", "negatives", "index", "class_ids"):
        assert torch.equal(getattr(back, name), getattr(eps, name)), name
    assert back.spec == eps.spec and back.negative_source == "base"
    with h5py.File(path) as f:
        assert f["negatives"].shape == (9, 7) and f.attrs["split"] == "test" and f.attrs["way"] == 4
    bal = save_episodes(tmp_path / "b.h5", sample_episodes(labels, EpisodeSpec(), 2))
    assert load_episodes(bal).spec.imbalance is None and load_episodes(bal).negatives is None


def test_loading_rejects_files_that_do_not_fit(tmp_path):
    labels = _labels()
    eps = sample_episodes(labels, EpisodeSpec(way=5, shot=1, query=3), 4).with_negatives(
        sample_indices(50, torch.arange(4), 5, 0), "base"
    )
    path = save_episodes(tmp_path / "e.h5", eps)
    with pytest.raises(EpisodeError, match="split has 40 rows"):
        load_episodes(path, labels=labels[:40])
    with pytest.raises(EpisodeError, match="mixes classes"):
        load_episodes(path, labels=labels[torch.randperm(300, generator=torch.Generator().manual_seed(0))])
    with pytest.raises(EpisodeError, match="pool 'base' has 10 rows"):
        load_episodes(path, labels=labels, pool_size=10)
    with h5py.File(path, "a") as f:
        del f["query"]
        f["query"] = np.zeros((4, 7), dtype=np.int64)
    with pytest.raises(EpisodeError, match=r"/query has shape \(4, 7\), expected \(4, 15\)"):
        load_episodes(path)
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(EpisodeError, match="not an HDF5 file"):
        load_episodes(tmp_path / "junk.h5")
    with pytest.raises(EpisodeError, match="no such episodes file"):
        load_episodes(tmp_path / "missing.h5")


# ------------------------------------------------------------------------- negatives


def test_generated_negatives_are_normalised_and_per_episode():
    r = generate("random", torch.tensor([3, 4]), 50, 64, seed=1)
    assert r.shape == (2, 50, 64) and torch.allclose(r.norm(dim=-1), torch.ones(2, 50), atol=1e-5)
    assert (r >= 0).all()  # the authors' positive orthant
    diag = torch.full((64,), 1 / 8.0)
    assert abs(float((r @ diag).mean()) - math.sqrt(3) / 2) < 0.02
    s = generate("sphere", torch.tensor([3, 4]), 50, 64, seed=1)
    assert abs(float((s @ diag).mean())) < 0.05 and (s < 0).any()
    assert torch.equal(generate("random", torch.tensor([4]), 50, 64, seed=1)[0], r[1])  # chunk independent
    assert torch.equal(
        sample_indices(100, torch.tensor([5, 6]), 9, 2)[1], sample_indices(100, torch.tensor([6]), 9, 2)[0]
    )


# ------------------------------------------------------------------------- evaluate


def test_evaluate_identical_for_any_chunk_size(cache):
    test = read_split(cache, "test")
    eps = sample_episodes(test.labels, EpisodeSpec(way=5, shot=1, query=5, seed=2), 15)
    methods = [("p", "proto", None), ("po", "poodle", {"steps": 20, "transductive": True})]
    runs = [
        evaluate(
            test,
            eps,
            methods,
            negatives=NegativeSpec("base", 20),
            cache_path=cache,
            run=RunOptions(chunk_size=c),
            dtype=torch.float64,
        )
        for c in (1, 7, 15)
    ]
    for r in runs[1:]:
        for k in ("p", "po"):
            assert torch.equal(r[k], runs[0][k]) and r[k].dtype == torch.float64
    auto_stats: dict = {}
    auto = evaluate(
        test,
        eps,
        methods,
        negatives=NegativeSpec("base", 20),
        cache_path=cache,
        run=RunOptions(max_memory=100_000),
        hooks=Hooks(stats=auto_stats),
    )
    assert 1 <= auto_stats["chunk_size"] < 15  # the memory bound sets the chunk
    assert torch.equal(auto["p"], runs[0]["p"])


def test_evaluate_identical_for_any_number_of_workers(cache):
    test = read_split(cache, "test")
    eps = sample_episodes(test.labels, EpisodeSpec(way=5, shot=1, query=5, seed=3), 13)
    methods = [("po", "poodle", {"steps": 15, "transductive": True})]
    stats: list[dict] = [{}, {}, {}]
    runs = [
        evaluate(
            test,
            eps,
            methods,
            negatives=NegativeSpec("base", 20),
            cache_path=cache,
            run=RunOptions(chunk_size=2, workers=w),
            hooks=Hooks(stats=st),
        )
        for w, st in zip((1, 2, 3), stats)
    ]
    assert [st["workers"] for st in stats] == [1, 2, 3]
    assert torch.equal(runs[1]["po"], runs[0]["po"]) and torch.equal(runs[2]["po"], runs[0]["po"])
    before = torch.get_num_threads()
    evaluate(
        test,
        eps[:4],
        methods,
        negatives=NegativeSpec("base", 20),
        cache_path=cache,
        run=RunOptions(chunk_size=1, workers=2),
    )
    assert torch.get_num_threads() == before  # the thread setting is restored
    with pytest.raises(ConfigError, match="workers must be a positive integer, got 0"):
        evaluate(test, eps, methods, negatives=NegativeSpec("base", 20), cache_path=cache, run=RunOptions(workers=0))


@pytest.mark.parametrize("source", ["random", "sphere", "OTHER:pool"])
def test_evaluate_negative_sources(cache, source):
    test = read_split(cache, "test")
    source = source.replace("OTHER", str(cache.parent / "other.h5"))
    eps = sample_episodes(test.labels, EpisodeSpec(way=3, shot=1, query=3), 4)
    r1, r2 = (
        evaluate(
            test,
            eps,
            [("n", "naive-ood", {"steps": 5})],
            negatives=NegativeSpec(source, 8),
            cache_path=cache,
            run=RunOptions(chunk_size=size),
        )
        for size in (1, 4)
    )
    assert torch.equal(r1["n"], r2["n"])


def test_evaluate_bad_negatives(cache):
    test = read_split(cache, "test")
    eps = sample_episodes(test.labels, EpisodeSpec(way=3, shot=1, query=3), 2)
    m = [("po", "poodle", None)]
    with pytest.raises(ConfigError, match="feature dimension 12, but the episodes' features have 16"):
        evaluate(test, eps, m, negatives=NegativeSpec(f"{cache.parent / 'other.h5'}:wide", 5), cache_path=cache)
    with pytest.raises(ConfigError, match="reads negative samples"):
        evaluate(test, eps, m, negatives=None, cache_path=cache)
    with pytest.raises(ConfigError, match="no such cache file"):
        evaluate(test, eps, m, negatives=NegativeSpec("missing.h5", 5), cache_path=cache)
    with pytest.raises(PoodleError, match="no split 'nope'"):
        evaluate(test, eps, m, negatives=NegativeSpec(f"{cache.parent / 'other.h5'}:nope", 5), cache_path=cache)
    with pytest.raises(ConfigError, match="n_neg must be a positive integer"):
        evaluate(test, eps, m, negatives=NegativeSpec("base", 0), cache_path=cache)
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        evaluate(test, eps, [("x", "nope", None)], cache_path=cache)
    train = read_split(cache, "train")
    with pytest.raises(EpisodeError, match="drawn from split 'test'"):
        evaluate(train, eps, [("p", "proto", None)])


def test_episode_stream_draws_the_same_episodes_slice_by_slice():
    labels = _labels(10, 30)
    for spec in (EpisodeSpec(way=4, shot=2, query=3, seed=5), EpisodeSpec(way=3, shot=1, query=4, imbalance=0.7)):
        full = sample_episodes(labels, spec, 12, start=3)
        stream = EpisodeStream(labels, spec, 12, start=3)
        assert len(stream) == 12 and torch.equal(stream.index, full.index)
        for a, b in ((0, 12), (5, 9), (11, 12)):
            part = stream[a:b]
            for f in ("support", "query", "support_labels", "query_labels", "index", "class_ids"):
                assert torch.equal(getattr(part, f), getattr(full, f)[a:b]), f
    with pytest.raises(EpisodeError, match="cannot draw 11-way"):
        EpisodeStream(labels, EpisodeSpec(way=11), 3)
    with pytest.raises(EpisodeError, match="positive integer"):
        EpisodeStream(labels, EpisodeSpec(), 0)
    with pytest.raises(TypeError, match="contiguous"):
        EpisodeStream(labels, EpisodeSpec(way=3, query=2), 6)[::2]


def test_evaluate_on_a_stream_equals_the_drawn_set(cache):
    """Episodes and negatives drawn chunk by chunk in the workers are those drawn up front."""
    test = read_split(cache, "test")
    spec = EpisodeSpec(way=5, shot=1, query=5, seed=4)
    methods = [("p", "proto", None), ("po", "poodle", {"steps": 10, "transductive": True})]
    neg = NegativeSpec("base", 20)
    ref = evaluate(
        test,
        sample_episodes(test.labels, spec, 11),
        methods,
        negatives=neg,
        cache_path=cache,
        run=RunOptions(chunk_size=11, workers=1),
    )
    stats: dict = {}
    got = evaluate(
        test,
        EpisodeStream(test.labels, spec, 11),
        methods,
        negatives=neg,
        cache_path=cache,
        run=RunOptions(chunk_size=3, workers=2),
        hooks=Hooks(stats=stats),
    )
    for k in ("p", "po"):
        assert torch.equal(got[k], ref[k])
    assert stats["n_chunks"] == 4 and stats["first_chunk_s"] > 0
    gen = [
        evaluate(
            test,
            e,
            [("n", "naive-ood", {"steps": 3})],
            negatives=NegativeSpec("sphere", 6),
            run=RunOptions(chunk_size=c),
        )
        for e, c in ((sample_episodes(test.labels, spec, 5), 5), (EpisodeStream(test.labels, spec, 5), 2))
    ]
    assert torch.equal(gen[0]["n"], gen[1]["n"])


def test_evaluate_ramps_up_its_first_chunks_without_changing_results(cache):
    test = read_split(cache, "test")
    stream = EpisodeStream(test.labels, EpisodeSpec(way=5, shot=1, query=5, seed=6), 40)
    methods = [("po", "poodle", {"steps": 5, "transductive": True})]
    stats: dict = {}
    ramped = evaluate(
        test,
        stream,
        methods,
        negatives=NegativeSpec("base", 20),
        cache_path=cache,
        run=RunOptions(chunk_size=4, workers=2),
        hooks=Hooks(stats=stats),
    )
    assert stats["chunk_size"] == 4 and stats["n_chunks"] == 12  # 1, 2, then 4 + ... + 4 + 1
    whole = evaluate(
        test, stream, methods, negatives=NegativeSpec("base", 20), cache_path=cache, run=RunOptions(chunk_size=40)
    )
    assert torch.equal(ramped["po"], whole["po"])


_RSS_SCRIPT = r"""
import sys
from pathlib import Path
import torch
from poodle.cache import SplitFeatures
from poodle.episodes import EpisodeSpec, EpisodeStream
from poodle.evaluate import evaluate
from poodle.negatives import NegativeSpec
from poodle.run import RunOptions

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
x = torch.nn.functional.normalize(torch.randn(8 * 40, 64), dim=-1)
f = SplitFeatures("test", x, torch.arange(8).repeat_interleave(40), [f"c{i}" for i in range(8)])
methods = [("po", "poodle", {"steps": 2, "transductive": True})]
peaks = []
for n in (300, 3000):
    Path("/proc/self/clear_refs").write_text("5")    # reset the peak resident size
    evaluate(f, EpisodeStream(f.labels, EpisodeSpec(way=5, shot=1, query=3), n), methods,
             negatives=NegativeSpec("sphere", 64), run=RunOptions(device="cpu", chunk_size=8, workers=2))
    peaks.append(status("VmHWM"))
print(peaks[0], peaks[1])
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak RSS")
def test_memory_does_not_grow_with_the_number_of_episodes(tmp_path):
    """10x the episodes (375 chunks of generated negatives, two workers) adds almost nothing to the
    process's peak resident size: nothing per chunk or per episode is kept beyond its accuracy."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True, check=True)
    small, large = (int(v) for v in out.stdout.split())
    # keeping each chunk's gathered rows would add 3000 x 84 x 64 x 4 B = 64 MiB
    assert large - small < 16 * 2**20, (small, large)


def test_mean_ci_and_paired_difference_numbers():
    acc = torch.tensor([0.5, 0.7, 0.9, 0.7], dtype=torch.float64)
    mean, ci = mean_ci(acc)
    assert mean == pytest.approx(0.7)
    assert ci == pytest.approx(1.96 * math.sqrt(0.02) / 2)  # population std 0.1414, n = 4
    d, dci = paired_difference(acc, acc - torch.tensor([0.1, 0.1, 0.2, 0.0], dtype=torch.float64))
    assert d == pytest.approx(0.1) and dci == pytest.approx(1.96 * math.sqrt(0.005) / 2)
