"""--preprocess l2n|cl2n|power[:BETA]: the transforms against float64 formulas on the raw features,
the fallback on caches without norms, the negative pool, and the solve hook (recorded in results)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle.cache import read_split, validate, write_arrays
from poodle.cli.solve import solve
from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.errors import ConfigError, DataError
from poodle.evaluate import evaluate
from poodle.negatives import NegativeSpec
from poodle.preprocess import Preprocess, Preprocessor, parse
from poodle.results import IDENTITY_FIELDS, identity_key, read_results, record_flat
from poodle.run import RunOptions


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture
def raw():
    """Raw non-negative (ReLU-like) features of a train and a test split, float64, and their labels."""
    rng = np.random.default_rng(0)
    centres = np.abs(rng.standard_normal((10, 16))) * 2
    y_tr, y_te = np.repeat(np.arange(6), 8), np.repeat(np.arange(4), 20)
    tr = np.maximum(centres[y_tr] + rng.standard_normal((48, 16)), 0) * rng.uniform(0.5, 3, (48, 1))
    te = np.maximum(centres[6 + y_te] + rng.standard_normal((80, 16)), 0) * rng.uniform(0.5, 3, (80, 1))
    return tr, y_tr, te, y_te


@pytest.fixture
def cache(raw, tmp_path):
    tr, y_tr, te, y_te = raw
    return write_arrays(
        tmp_path / "c.h5",
        {"train": (tr, y_tr, [f"b{i}" for i in range(6)]), "test": (te, y_te, [f"n{i}" for i in range(4)])},
    )


def test_parse_and_keys():
    assert parse(None) == Preprocess("l2n") and parse("cl2n").key == "cl2n"
    assert parse("power") == Preprocess("power", 0.5) and parse("power:0.25").key == "power:0.25"
    for bad, msg in (
        ("zca", "use l2n, cl2n or power"),
        ("power:x", "must be a number"),
        ("power:-1", "must be positive"),
        ("l2n:2", "takes no argument"),
    ):
        with pytest.raises(ConfigError, match=msg):
            parse(bad)


def test_cache_stores_raw_norms_and_version_2(raw, cache):
    tr = raw[0]
    s = read_split(cache, "train")
    assert np.allclose(s.norms.numpy(), np.linalg.norm(tr, axis=1), rtol=1e-6)
    assert validate(cache)["attrs"]["version"] == 2 and validate(cache)["splits"]["train"]["has_norms"]


def test_cl2n_centres_the_raw_features_on_the_base_mean(raw, cache):
    tr, _, te, _ = raw
    pre = Preprocessor.from_cache("cl2n", cache)
    got = pre.split(read_split(cache, "test")).features.double().numpy()
    want = _unit(te - tr.mean(0))
    assert np.abs(got - want).max() < 1e-5
    # the base split's own rows, as a negative pool, get the same centring
    pool = pre.pool("base", cache, dim=16).double().numpy()
    assert np.abs(pool - _unit(tr - tr.mean(0))).max() < 1e-5
    # and centring is not a no-op here
    assert np.abs(got - _unit(te)).max() > 0.1


def test_cl2n_without_norms_centres_the_normalised_rows_and_says_so(raw, tmp_path):
    tr, y_tr, te, y_te = raw
    old = write_arrays(
        tmp_path / "old.h5",
        {
            "train": (_unit(tr), y_tr, [f"b{i}" for i in range(6)]),
            "test": (_unit(te), y_te, [f"n{i}" for i in range(4)]),
        },
        normalise=False,
    )
    assert read_split(old, "test").norms is None
    said = []
    pre = Preprocessor.from_cache("cl2n", old, log=said.append)
    got = pre.split(read_split(old, "test")).features.double().numpy()
    assert np.abs(got - _unit(_unit(te) - _unit(tr).mean(0))).max() < 1e-5
    assert len(said) == 1 and "no stored raw norms" in said[0] and "normalised rows" in said[0]


def test_power_transform_matches_pt_map_and_refuses_negative_features(raw, cache, tmp_path):
    _, _, te, y_te = raw
    pre = Preprocessor.from_cache("power:0.5", cache)
    got = pre.split(read_split(cache, "test")).features.double().numpy()
    # a row's norm is a positive factor: normalise(raw ** beta) == normalise(normalise(raw) ** beta)
    assert np.abs(got - _unit(np.sqrt(te))).max() < 1e-5
    signed = te - te.mean(0)
    neg = write_arrays(tmp_path / "neg.h5", {"test": (signed, y_te, [f"n{i}" for i in range(4)])})
    row = int(np.flatnonzero((signed < 0).any(1))[0])
    with pytest.raises(DataError, match=f"split 'test' row {row} has a negative value.*use l2n or cl2n"):
        Preprocessor.from_cache("power", neg).split(read_split(neg, "test"))


@pytest.mark.parametrize("kind", ["cl2n", "power:0.5"])
def test_evaluate_with_preprocessing_equals_solving_pre_transformed_features(raw, cache, tmp_path, kind):
    """The split AND the base negative pool are transformed: solving a cache that already holds the
    transformed rows (with l2n) gives the same per-episode accuracies."""
    pre = Preprocessor.from_cache(kind, cache)
    te = pre.split(read_split(cache, "test"))
    tr = pre.split(read_split(cache, "train"))
    done = write_arrays(
        tmp_path / "done.h5",
        {
            "train": (tr.features.numpy(), tr.labels.numpy(), tr.classes),
            "test": (te.features.numpy(), te.labels.numpy(), te.classes),
        },
        normalise=False,
    )
    eps = sample_episodes(te.labels, EpisodeSpec(way=4, shot=1, query=5, seed=1), 6)
    methods = [("poodle", "poodle", {"steps": 20})]
    neg = NegativeSpec("base", 50)
    a = evaluate(te, eps, methods, negatives=neg, cache_path=cache, run=RunOptions(device="cpu"), preprocess=pre)
    b = evaluate(read_split(done, "test"), eps, methods, negatives=neg, cache_path=done, run=RunOptions(device="cpu"))
    assert torch.equal(a["poodle"], b["poodle"])
    # without the pool hook the negatives would differ (and so, here, would the accuracies' inputs)
    assert not torch.allclose(pre.pool("base", cache), read_split(cache, "train").features)


def test_solve_records_the_preprocessing(cache, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(
        solve,
        [
            "--cache",
            str(cache),
            "--way",
            "4",
            "--shot",
            "1",
            "--query",
            "5",
            "--episodes",
            "20",
            "--method",
            "proto",
            "--preprocess",
            "cl2n",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "preprocess cl2n" in " ".join(r.output.split())
    rec = read_results(out).records[0]
    assert rec["preprocess"] == "cl2n" and record_flat(rec)["preprocess"] == "cl2n"
    # the default is left out of the identity, so records made before the option keep their keys
    r = CliRunner().invoke(
        solve,
        [
            "--cache",
            str(cache),
            "--way",
            "4",
            "--shot",
            "1",
            "--query",
            "5",
            "--episodes",
            "20",
            "--method",
            "proto",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    recs = read_results(out).records
    assert len(recs) == 2 and "preprocess" not in recs[1] and record_flat(recs[1])["preprocess"] == "l2n"
    assert recs[0]["key"] != recs[1]["key"]
    ident = {k: recs[1][k] for k in IDENTITY_FIELDS if k != "preprocess"}
    assert identity_key(ident) == recs[1]["key"]
    r = CliRunner().invoke(
        solve,
        [
            "--cache",
            str(cache),
            "--way",
            "4",
            "--episodes",
            "5",
            "--query",
            "5",
            "--method",
            "proto",
            "--preprocess",
            "zca",
        ],
    )
    assert r.exit_code == 1 and "use l2n, cl2n or power" in r.output
