"""Unequal numbers of support images per class (``poodle predict``'s episodes): every registered
method, batched, matches its plain float64 per-episode reference on episodes whose classes have
1, 3, 2, 5 and 1 support images, in shuffled (not class-major) order.

The methods are the registry's: a method's reference is test_solvers_core's (``CORE``), the
transductive competitors' (tests/_references_transductive.py), or one its own test registers
(``tests/_ragged.reference``); a method without one fails here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ragged import references
from _references_transductive import REFERENCES
from test_solvers_core import _compare, ref_ce, ref_naive_ood, ref_poodle, ref_proto
from test_solvers_transductive import assert_matches, config, run_reference

from poodle import solvers
from poodle.solvers import EpisodeBatch

WAY = 5
DIM = 32
SHOTS = [1, 3, 2, 5, 1]
CORE = {
    "proto": (ref_proto, {}),
    "ce": (ref_ce, {"steps": 40}),
    "poodle": (ref_poodle, {"steps": 40}),
    "naive-ood": (ref_naive_ood, {"steps": 40}),
}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ragged_batch(make_features, n_episodes: int = 3, seed: int = 0, n_neg: int = 30) -> EpisodeBatch:
    """float64 episodes: 5 of 8 clustered classes, ``SHOTS[k]`` support rows of class k (shuffled),
    6 queries per class (shuffled), 30 random negatives."""
    x, lab = make_features(8, 30, DIM, seed=seed, spread=0.9)
    x, lab = torch.from_numpy(x).double(), torch.from_numpy(lab)
    g = torch.Generator().manual_seed(seed)
    sup, ys, qry = [], [], []
    for _ in range(n_episodes):
        classes = torch.randperm(8, generator=g)[:WAY]
        s, y, q = [], [], []
        for k, c in enumerate(classes.tolist()):
            rows = torch.nonzero(lab == c).flatten()
            rows = rows[torch.randperm(len(rows), generator=g)]
            s.append(x[rows[: SHOTS[k]]])
            y += [k] * SHOTS[k]
            q.append(x[rows[SHOTS[k] : SHOTS[k] + 6]])
        s, y, q = torch.cat(s), torch.tensor(y), torch.cat(q)
        ps, pq = torch.randperm(len(s), generator=g), torch.randperm(len(q), generator=g)
        sup.append(s[ps])
        ys.append(y[ps])
        qry.append(q[pq])
    neg = F.normalize(torch.randn(n_episodes, n_neg, DIM, generator=g, dtype=torch.float64), dim=-1)
    return EpisodeBatch(torch.stack(sup), torch.stack(ys), torch.stack(qry), neg, WAY)


@pytest.mark.parametrize("name", solvers.available())
def test_every_method_matches_its_reference_with_unequal_shots(make_features, name):
    if name in CORE:
        _core(make_features, name)
    elif name in REFERENCES:
        _transductive(make_features, name)
    else:
        own = references()
        assert name in own, f"method {name} has no float64 reference with unequal shots (tests/_ragged.reference)"
        _registered(make_features, name, *own[name])


def _core(make_features, name):
    batch = ragged_batch(make_features)
    assert not torch.equal(batch.support_labels[0], batch.support_labels[0].sort().values)  # not class-major
    ref, kw = CORE[name]
    opts = dict(kw)
    if name == "poodle":
        for transductive in (False, True):
            out = solvers.run(name, batch, steps=40, transductive=transductive)
            _compare(batch, out, ref, steps=40, transductive=transductive)
        return
    out = solvers.run(name, batch if name == "naive-ood" else _without_negatives(batch), **opts)
    _compare(batch, out, ref, **opts)
    # prototypes start at the true class means, whatever the number of shots
    if name == "proto":
        for e in range(batch.n_episodes):
            for k in range(WAY):
                mean = batch.support[e][batch.support_labels[e] == k].mean(0)
                assert torch.allclose(out.state["prototypes"][e, k], mean, atol=1e-12)


def _transductive(make_features, name):
    batch = _without_negatives(ragged_batch(make_features, seed=1))
    cfg = config(name)
    ref_lp, ref_st = run_reference(name, batch, cfg)
    assert_matches(name, solvers.run(name, batch, cfg), ref_lp, ref_st)


def _registered(make_features, name, ref, options):
    """A method's own reference (:func:`_ragged.reference`), each episode alone, against the batch."""
    batch = ragged_batch(make_features, seed=2)
    info = solvers.get(name)
    cfg = solvers.make_config(name, options, strict=True)
    if not info.needs_negatives(cfg):
        batch = _without_negatives(batch)
    out = solvers.run(name, batch, cfg).log_probs
    for e in range(batch.n_episodes):
        neg = None if batch.negatives is None else batch.negatives[e]
        want = ref(batch.support[e], batch.support_labels[e], batch.query[e], WAY, neg, cfg)
        assert torch.equal(out[e].argmax(-1), want.argmax(-1)), f"{name}: predictions differ in episode {e}"
        assert torch.allclose(out[e].exp(), want.exp(), atol=1e-4), f"{name}: probabilities differ in episode {e}"


def _without_negatives(batch: EpisodeBatch) -> EpisodeBatch:
    return EpisodeBatch(batch.support, batch.support_labels, batch.query, None, batch.way)
