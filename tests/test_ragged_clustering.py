"""Ragged chunks for the prototype and clustering methods (proto, bd-cspn, can-t, kmeans,
bayes-kmeans, soft-kmeans, mean-shift, paddle, laplacianshot): on Meta-Dataset-shaped chunks
(tests/_ragged.py: ways 5-50, shots 1-100, queries 1-10 a class) each episode's result in the padded
chunk is the one it gets alone, and it matches the method's float64 per-episode reference on the
cropped episode. Fixed chunks keep their bits (tests/test_chunk_bits.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _ragged import assert_same_as_alone, ragged_episodes
from _references_transductive import REFERENCES
from test_solvers_core import ref_proto

from poodle import solvers
from poodle.solvers import EpisodeBatch
from poodle.solvers.laplacianshot import knn_graph

# Reduced iteration counts, as tests/test_solvers_transductive.py's FAST; can-t adds 10 queries per
# iteration so that its number of iterations (Nq // step) differs between the episodes (2 to 7).
FAST = {
    "kmeans": {"max_iter": 30},
    "bayes-kmeans": {"max_iter": 30},
    "paddle": {"steps": 30, "lmd": 0.0},
    "can-t": {"step": 10},
}

CASES = [
    ("proto", {}),
    ("bd-cspn", {}),
    ("bd-cspn", {"shift": False}),
    ("can-t", {}),
    ("kmeans", {}),
    ("kmeans", {"fix_support": False}),
    ("bayes-kmeans", {}),
    ("soft-kmeans", {}),
    ("soft-kmeans", {"steps": 3, "fix_support": False}),
    ("mean-shift", {}),
    ("paddle", {}),
    ("paddle", {"lmd": 75.0}),  # the coefficient lambda / Nq is each episode's own
    ("laplacianshot", {}),
    ("laplacianshot", {"preset": "official"}),
    ("laplacianshot", {"rectify": False, "knn": 40}),  # more neighbours than some episodes have queries
]


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(name: str, over: dict):
    return solvers.make_config(name, {**FAST.get(name, {}), **over}, strict=True)


def _reference(name: str, ep: EpisodeBatch, cfg) -> torch.Tensor:
    """The float64 per-episode reference's log-probabilities ``[Nq, way]`` on one cropped episode."""
    s, y, q = ep.support[0], ep.support_labels[0], ep.query[0]
    if name == "proto":
        return ref_proto(s, y, q, ep.way, cfg.scale)[0]
    return REFERENCES[name](s, y, q, ep.way, **dataclasses.asdict(cfg))[0]


@pytest.mark.parametrize(("name", "over"), CASES, ids=[f"{n}{'-' + '-'.join(o) if o else ''}" for n, o in CASES])
def test_ragged_chunk_is_each_episode_alone_and_matches_reference(name, over):
    episodes, _ = ragged_episodes(seed=1)
    batch = EpisodeBatch.stack(episodes)
    assert batch.ragged and batch.ways is not None
    cfg = _config(name, over)
    padded = solvers.run(name, batch, cfg).log_probs
    assert padded.shape == (batch.n_episodes, batch.query.shape[1], batch.way)
    alone = [solvers.run(name, ep, cfg).log_probs for ep in episodes]
    assert_same_as_alone(name, padded, alone, batch)
    for e, ep in enumerate(episodes):
        real = padded[e, batch.query_mask[e], : ep.way]
        assert torch.isfinite(real).all(), f"{name}: episode {e} has a non-finite log-probability"
        ref = _reference(name, ep, cfg)
        assert torch.equal(real.argmax(-1), ref.argmax(-1)), f"{name}: episode {e}'s predictions differ from reference"
        diff = (real.exp() - ref.exp()).abs().max().item()
        assert diff <= 1e-6, f"{name}: episode {e}'s probabilities differ from the reference by {diff:.3g}"


def test_padding_moves_nothing_in_a_chunk_of_equal_ways():
    # the same episodes padded next to a bigger one, once with and once without its padded classes:
    # only the masks make the difference, and they must make none
    episodes, _ = ragged_episodes(seed=2, shapes=[([2] * 6, [3] * 6), ([1] * 6, [1, 2, 3, 4, 5, 6])])
    batch = EpisodeBatch.stack(episodes)
    assert batch.ways is None and batch.support_mask is not None and batch.query_mask is not None
    for name, over in (("kmeans", {}), ("laplacianshot", {}), ("mean-shift", {}), ("paddle", {})):
        cfg = _config(name, over)
        alone = [solvers.run(name, ep, cfg).log_probs for ep in episodes]
        assert_same_as_alone(name, solvers.run(name, batch, cfg).log_probs, alone, batch)


def test_knn_graph_links_no_padded_query():
    episodes, _ = ragged_episodes(seed=3, shapes=[([1] * 5, [1, 1, 1, 0, 0]), ([1] * 5, [3] * 5)])
    batch = EpisodeBatch.stack(episodes)
    w = knn_graph(batch.query, 3, query_mask=batch.query_mask)
    mask = batch.query_mask
    assert torch.all(w[~mask] == 0), "a padded query has neighbours"
    assert torch.all(w.transpose(1, 2)[~mask] == 0), "a padded query is someone's neighbour"
    # the 3-query episode links each query to its 2 others, as alone (k clipped to Nq - 1)
    assert w[0].sum(1)[:3].tolist() == [2.0, 2.0, 2.0]
    alone = knn_graph(episodes[0].query, 3)
    assert torch.equal(w[0, :3, :3], alone[0])
