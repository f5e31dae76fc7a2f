"""The one sampler draws exactly what torch's per-episode generators draw (tests/_episode_reference.py):
fixed episodes (balanced, Dirichlet, query classes, classes of unequal size, capped classes), negative
indices and generated negatives; the pieces of torch's CPU generator it reproduces; the device path;
the negatives' fallback."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from _episode_reference import imbalanced_counts, reference_episodes

from poodle import _mt19937, sampler
from poodle._mt19937 import MT19937, packed_words, randperm_prefix, standard_gamma, word_at
from poodle.episodes import EpisodeSpec, EpisodeStream, _Draw, sample_episodes
from poodle.errors import EpisodeError
from poodle.negatives import NEG_STREAM, generate, generate_on_device, indices_on_device, sample_indices
from poodle.utils import derive_seed, derive_seeds, generator

FIELDS = ("support", "query", "support_labels", "query_labels", "class_ids", "index")


def _same(a, b) -> None:
    """``a``: an EpisodeSet; ``b``: the reference's tensors by name."""
    assert a.ways is None
    for f in FIELDS:
        assert torch.equal(getattr(a, f), b[f]), f


def _unequal_labels(seed=0, n_classes=30, low=8, high=60, gaps=(3, 11)):
    """Classes of 8..59 images, with some class ids absent (no images)."""
    sizes = np.random.default_rng(seed).integers(low, high, n_classes)
    sizes[list(gaps)] = 0
    return torch.from_numpy(np.repeat(np.arange(n_classes), sizes))


SETTINGS = {
    "balanced 1-shot": (torch.arange(20).repeat_interleave(40), EpisodeSpec(way=5, shot=1, query=15, seed=0)),
    "balanced 5-shot": (torch.arange(20).repeat_interleave(40), EpisodeSpec(way=5, shot=5, query=7, seed=9)),
    "dirichlet 0.3": (torch.arange(12).repeat_interleave(40), EpisodeSpec(way=5, shot=1, query=6, imbalance=0.3)),
    "dirichlet 2": (torch.arange(12).repeat_interleave(40), EpisodeSpec(way=4, shot=2, query=5, imbalance=2.0)),
    "query classes": (torch.arange(9).repeat_interleave(20), EpisodeSpec(way=5, shot=1, query=4, query_classes=2)),
    "query classes dirichlet": (
        torch.arange(9).repeat_interleave(20),
        EpisodeSpec(way=5, shot=1, query=6, imbalance=0.5, query_classes=3, seed=4),
    ),
    "unequal classes": (_unequal_labels(), EpisodeSpec(way=5, shot=2, query=6, seed=1)),
    "unequal classes dirichlet": (_unequal_labels(1), EpisodeSpec(way=6, shot=1, query=6, imbalance=0.7, seed=2)),
    # classes of shot + query images: Dirichlet counts are capped and re-spread almost every episode
    "capped classes": (
        _unequal_labels(2, 15, 7, 9, gaps=()),
        EpisodeSpec(way=5, shot=1, query=6, imbalance=0.4, seed=3),
    ),
    "all classes": (torch.arange(5).repeat_interleave(9), EpisodeSpec(way=5, shot=2, query=3, imbalance=1.0)),
    "2-way": (torch.arange(3).repeat_interleave(4), EpisodeSpec(way=2, shot=1, query=1, seed=5)),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_sampler_draws_the_per_episode_episodes(name):
    labels, spec = SETTINGS[name]
    _same(_Draw(labels, spec)(37, 160), reference_episodes(labels, spec, 37, 160))


def test_episodes_do_not_depend_on_the_block_size(monkeypatch):
    labels, spec = SETTINGS["unequal classes dirichlet"]
    ref = reference_episodes(labels, spec, 5, 60)
    for words in (1, 700, 5000):  # blocks of 1, 2 and 13 episodes
        monkeypatch.setattr(sampler, "_BLOCK_WORDS", words)
        d = _Draw(labels, spec)
        assert sampler._Fixed(spec, d.tables).block == max(1, words // sampler._Fixed(spec, d.tables).guess)
        _same(d(5, 60), ref)
    stream = EpisodeStream(labels, spec, 60, start=5)
    parts = [stream[a:b] for a, b in ((0, 7), (7, 8), (8, 60))]
    assert torch.equal(torch.cat([p.query for p in parts]), ref["query"])


def test_gamma_draws_that_outrun_their_words_are_drawn_again_from_more(monkeypatch):
    # a block holds 7 + 4 x 8 words for the classes and images: four Gamma(0.3) draws (8 words or
    # more each) fit in some episodes and not in others, which are drawn again from more words
    labels, spec = torch.arange(8).repeat_interleave(9), EpisodeSpec(way=4, shot=1, query=2, imbalance=0.3)
    ref = reference_episodes(labels, spec, 0, 80)
    monkeypatch.setattr(sampler, "_GAMMA_WORDS", 0)
    monkeypatch.setattr(sampler, "_GAMMA_SLACK", 0)
    calls = []
    real = sampler.standard_gamma
    monkeypatch.setattr(sampler, "standard_gamma", lambda *a: calls.append(len(a[1])) or real(*a))
    _same(_Draw(labels, spec)(0, 80), ref)
    assert calls[0] == 80 and 0 < calls[1] < 80, calls  # some fitted, some were drawn again


def test_torch_words_are_mt19937s_or_no_episode_is_drawn(monkeypatch):
    sampler.check_words()  # this torch: the reference sequence
    monkeypatch.setattr(sampler, "_WORDS_OK", [False])
    labels, spec = SETTINGS["balanced 1-shot"]
    with pytest.raises(EpisodeError, match="mt19937"):
        sample_episodes(labels, spec, 3)


def test_negatives_fall_back_with_one_warning_when_torch_draws_otherwise(monkeypatch):
    monkeypatch.setattr(_mt19937, "_VERIFIED", {})
    monkeypatch.setattr(_mt19937, "_check", lambda: "randperm(7)")
    labels, spec = SETTINGS["dirichlet 2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # episodes are made of words alone: no warning for them
        _same(_Draw(labels, spec)(0, 20), reference_episodes(labels, spec, 0, 20))
    with pytest.warns(RuntimeWarning, match="randperm"):
        ref = torch.stack([torch.randint(50, (9,), generator=generator(4, i, NEG_STREAM)) for i in (2, 3)])
        assert torch.equal(sample_indices(50, torch.tensor([2, 3]), 9, 4), ref)


def test_the_self_check_passes_with_this_torch():
    assert _mt19937._check() is None
    assert _mt19937._check_device(torch.device("cpu")) is None  # the device generator, run on the CPU


def test_a_device_generator_that_draws_otherwise_keeps_the_host_path(monkeypatch):
    monkeypatch.setattr(_mt19937, "_VERIFIED", {})
    monkeypatch.setattr(_mt19937, "_check_device", lambda device: f"rand on {device.type}")
    with pytest.warns(RuntimeWarning, match="rand on meta"):
        out = generate("random", torch.tensor([1, 2]), 5, 8, seed=3, device="meta")
    assert out.device.type == "meta"  # made on the CPU and moved
    assert _mt19937.verified() and not _mt19937.verified(torch.device("meta"))


def test_the_pinned_episodes_are_drawn():
    # the numbers of test_episodes' pinned stream
    d = _Draw(torch.arange(10).repeat_interleave(30), EpisodeSpec(way=5, shot=1, query=4, seed=3))
    assert d(0, 2).query[:, :6].tolist() == [[81, 70, 76, 61, 144, 127], [54, 58, 40, 53, 182, 194]]


# ------------------------------------------------------------------ torch's generator, piece by piece


def test_packed_words_are_torch_generator_words():
    seeds = [0, 7, 2**40 + 3]
    p = packed_words(seeds, [5, 2, 6])
    for r, (s, n) in enumerate(zip(seeds, [5, 2, 6])):
        g = torch.Generator().manual_seed(s)
        ref = torch.randint(2**27, (n,), generator=g)  # one word per value below 2**28: word % 2**27
        got = word_at(p, np.full(n, r), np.arange(n)) % 2**27
        assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("n", [2, 3, 17, 600, 40_000])
def test_randperm_prefix_equals_torch_randperm(n):
    seeds = derive_seeds(1, range(40))
    length = np.random.default_rng(n).integers(1, min(n, 30) + 1, len(seeds))
    m = int(length.max())
    p = packed_words(seeds, m)
    words = word_at(p, np.arange(len(seeds))[:, None], np.arange(m)[None, :])
    got = randperm_prefix(np.full(len(seeds), n), length, words)
    for r, s in enumerate(seeds):
        ref = torch.randperm(n, generator=torch.Generator().manual_seed(s))
        assert got[r, : length[r]].tolist() == ref[: length[r]].tolist()
        assert (got[r, length[r] :] == -1).all()


def test_randperm_prefix_with_rows_of_many_sizes_in_small_blocks(monkeypatch):
    monkeypatch.setattr(_mt19937, "_PERM_BLOCK", 50)  # a group per few rows, one row wider than a block
    n = np.array([60, 3, 9, 9, 2, 31, 3, 4])
    seeds = derive_seeds(2, range(len(n)))
    p = packed_words(seeds, 8)
    words = word_at(p, np.arange(len(n))[:, None], np.arange(8)[None, :])
    got = randperm_prefix(n, np.minimum(n, 8), words)
    for r, s in enumerate(seeds):
        ref = torch.randperm(int(n[r]), generator=torch.Generator().manual_seed(s))[:8]
        assert got[r, : len(ref)].tolist() == ref.tolist()


@pytest.mark.parametrize("alpha", [0.05, 0.5, 1.0, 2.0, 9.0])
def test_standard_gamma_equals_torch_bit_for_bit(alpha):
    seeds = derive_seeds(3, range(300))
    p = packed_words(seeds, 200)
    rows = np.arange(len(seeds))
    gam, pos, ok = standard_gamma(p, rows, np.zeros(len(seeds), np.int64), np.full(len(seeds), 200), alpha, 6)
    assert ok.all()
    for r, s in enumerate(seeds):
        g = torch.Generator().manual_seed(s)
        ref = torch._standard_gamma(torch.full((6,), alpha, dtype=torch.float64), generator=g)
        assert gam[r].tolist() == ref.tolist()
        if r < 30:  # and leaves the generator where torch's does
            nxt = int(word_at(p, rows[r : r + 1], pos[r : r + 1])[0])
            assert nxt % 2**27 == int(torch.randint(2**27, (1,), generator=g))


def test_standard_gamma_marks_the_rows_that_run_out_of_words():
    seeds = derive_seeds(4, range(100))
    p = packed_words(seeds, 40)
    gam, pos, ok = standard_gamma(p, np.arange(100), np.zeros(100, np.int64), np.full(100, 20), 0.5, 3)
    assert 0 < ok.sum() < 100 and (pos[ok] <= 20).all()
    for r in np.flatnonzero(ok):
        g = torch.Generator().manual_seed(seeds[r])
        ref = torch._standard_gamma(torch.full((3,), 0.5, dtype=torch.float64), generator=g)
        assert gam[r].tolist() == ref.tolist()


def test_batched_imbalanced_counts_equal_the_row_by_row_ones():
    rng = np.random.default_rng(0)
    E, way = 400, 6
    p = torch.from_numpy(rng.dirichlet(np.full(way, 0.4), E))
    p[:20] = torch.tensor([0.25, 0.25, 0.125, 0.125, 0.125, 0.125], dtype=torch.float64)  # ties
    capacity = torch.from_numpy(rng.integers(0, 12, (E, way)))
    capacity[capacity.sum(1) < 30, 0] = 30  # every row can hold its total
    got = sampler.imbalanced_counts(p, 30, capacity)
    for e in range(E):
        assert got[e].tolist() == imbalanced_counts(p[e], 30, capacity[e]).tolist()


def test_mt19937_on_torch_integer_ops_draws_torch_rand():
    seeds = [0, 1, 2**32 + 1, 2**63 - 1]  # the low 32 bits matter, as in torch
    u = MT19937(torch.tensor([s & 0xFFFFFFFF for s in seeds])).uniform_(torch.empty(4, 1500))
    ref = torch.stack([torch.rand(1500, generator=torch.Generator().manual_seed(s)) for s in seeds])
    assert torch.equal(u, ref)


# ------------------------------------------------------------------------------------- negatives


def _reference_generate(kind, index, n_neg, dim, seed):
    out = torch.empty(len(index), n_neg, dim)
    for r, i in enumerate(index):
        draw = torch.rand if kind == "random" else torch.randn
        out[r] = draw(n_neg, dim, generator=generator(seed, i, NEG_STREAM))
    return torch.nn.functional.normalize(out, dim=-1)


@pytest.mark.parametrize("kind", ["random", "sphere"])
@pytest.mark.parametrize("shape", [(40, 64), (7, 13), (3, 5), (1, 16)])
def test_generated_negatives_are_torch_draws_normalised(kind, shape):
    index = [0, 9, 123_456]
    ref = _reference_generate(kind, index, *shape, seed=5)
    assert torch.equal(generate(kind, torch.tensor(index), *shape, seed=5), ref)
    if kind == "sphere" and shape[0] * shape[1] < 16:
        return  # torch draws fewer than 16 normals otherwise; the device path is not used
    dev = generate_on_device(kind, derive_seeds(5, index, NEG_STREAM), *shape, torch.device("cpu"))
    if kind == "random":
        assert torch.equal(dev, ref)  # the same words and the same float conversion
    else:  # the same uniforms; log/sin/cos of the tensor library instead of the C library's
        torch.testing.assert_close(dev, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("pool", [3, 38_400, 2**28 - 1, 2**28, 2**40 + 5])
def test_negative_indices_are_torch_randint(pool):
    index = [4, 0, 77]
    ref = torch.stack([torch.randint(pool, (401,), generator=generator(8, i, NEG_STREAM)) for i in index])
    assert torch.equal(sample_indices(pool, torch.tensor(index), 401, 8), ref)
    if pool < 2**28:
        assert torch.equal(indices_on_device(pool, derive_seeds(8, index, NEG_STREAM), 401, torch.device("cpu")), ref)


def test_device_draws_make_no_host_synchronisation():
    # the meta device has no data: any .item()/bool()/.tolist() on the way would raise
    idx = torch.tensor([1, 2, 3])
    for kind, shape in (("random", (7, 100)), ("sphere", (7, 100)), ("sphere", (7, 13))):  # 2 steps; a tail
        out = generate(kind, idx, *shape, seed=0, device="meta")
        assert out.device.type == "meta" and out.shape == (3, *shape)
    out = sample_indices(100, idx, 9, 0, device="meta")
    assert out.device.type == "meta" and out.shape == (3, 9) and out.dtype == torch.int64


def test_derive_seeds_is_derive_seed():
    assert derive_seeds(7, range(50)) == [derive_seed(7, i) for i in range(50)]
    index = [5, 0, 10**12]
    assert derive_seeds(2**62, index, NEG_STREAM) == [derive_seed(2**62, i, NEG_STREAM) for i in index]


def test_sample_episodes_stays_chunk_independent():
    labels, spec = SETTINGS["query classes dirichlet"]
    whole = sample_episodes(labels, spec, 30)
    halves = [sample_episodes(labels, spec, 15, start=a) for a in (0, 15)]
    assert torch.equal(torch.cat([h.query for h in halves]), whole.query)
    _same(whole, reference_episodes(labels, spec, 0, 30))
