"""Ragged chunks (episodes of different ways, shots and queries padded into one batch) for the
methods of the fine-tuning engine and TIM-ADM: in the torch formulation and in the fused C kernel,
each episode's result in a padded chunk is the one it gets solved alone (``assert_same_as_alone``:
the same predictions, probabilities within float rounding, no probability on a padded class), and
it matches the method's plain float64 per-episode reference run on the cropped episode. Step counts
are reduced, as in the other solver tests; the shapes are tests/_ragged.py's (ways 5-50, shots
1-100, queries 1-10 a class)."""

from __future__ import annotations

import pytest
import torch
from _ragged import assert_same_as_alone, ragged_batch
from _references_transductive import REFERENCES
from test_solvers_core import ref_ce, ref_naive_ood, ref_poodle

from poodle import solvers
from poodle.solvers import _native
from poodle.solvers import backend as _backend

# reduced steps; learning rates raised so that the fits move the prototypes in so few steps
FAST = {
    "ce": {"steps": 20, "lr": 1e-2, "label_smoothing": 0.1},
    "poodle": {"steps": 20, "lr": 1e-2, "transductive": True, "stopgrad_push": False},
    "naive-ood": {"steps": 20, "lr": 1e-2},
    "tim-gd": {"preset": "poodle-paper", "steps": 20, "lr": 1e-2},  # the learnt scale
    "alpha-tim": {"steps": 20, "lr": 1e-2},  # the tuned order: 2 at 1 shot, 5 at 2-4, 7 from 5
    "entropy-min": {"steps": 20, "lr": 1e-2},
    "tim-adm": {"steps": 10},
}
METHODS = sorted(FAST)
NEGATIVES = 6


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["native", "torch"])
def formulation(request, monkeypatch):
    if request.param == "native" and not _native.usable(torch.zeros(1)):
        pytest.fail(f"the fused kernel is unavailable here: {_native.status()}")
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=request.param == "native"))
    return request.param


def _cfg(name):
    return solvers.make_config(name, FAST[name], strict=True)


def _batch(name):
    return ragged_batch(n_neg=NEGATIVES if solvers.get(name).needs_negatives(_cfg(name)) else 0)


def _reference(name, ep, cfg):
    """``(log_probs [nq, way], prototypes [way, D])`` of the float64 reference on one cropped episode."""
    s, y, q, way = ep.support[0], ep.support_labels[0], ep.query[0], ep.way
    kw = {k: v for k, v in vars(cfg).items()}
    if name == "ce":
        lp, w, _ = ref_ce(s, y, q, way, steps=cfg.steps, lr=cfg.lr, label_smoothing=cfg.label_smoothing)
    elif name == "poodle":
        lp, w, _ = ref_poodle(s, y, q, ep.negatives[0], way, **kw)
    elif name == "naive-ood":
        lp, w, _ = ref_naive_ood(s, y, q, ep.negatives[0], way, steps=cfg.steps, lr=cfg.lr, scale=cfg.scale)
    else:
        kw = cfg.resolved() if name == "tim-gd" else kw
        lp, st = REFERENCES[name](s, y, q, way, **kw)
        w = st["prototypes"]
    return lp, w


@pytest.mark.parametrize("name", METHODS)
def test_ragged_chunk_is_each_episode_alone_and_matches_reference(name, formulation):
    cfg = _cfg(name)
    batch, episodes = _batch(name)
    assert batch.ragged and batch.ways is not None and batch.query_mask is not None
    out = solvers.run(name, batch, cfg)
    alone = [solvers.run(name, ep, cfg) for ep in episodes]
    assert_same_as_alone(name, out.log_probs, [a.log_probs for a in alone], batch)
    if formulation == "native":
        # the kernel runs each episode's loops over its own sizes: the very bits it computes alone
        for e, a in enumerate(alone):
            assert torch.equal(out.state["prototypes"][e, : episodes[e].way], a.state["prototypes"][0])
    for e, ep in enumerate(episodes):
        lp, w = _reference(name, ep, cfg)
        w0 = ep.support.new_zeros(ep.way, ep.support.shape[-1]).index_add_(0, ep.support_labels[0], ep.support[0])
        assert (w - w0 / torch.bincount(ep.support_labels[0])[:, None]).abs().max() > 1e-3  # the fit moved
        got = out.log_probs[e, batch.query_mask[e], : ep.way]
        assert torch.equal(got.argmax(-1), lp.argmax(-1)), f"{name}: episode {e}'s predictions differ from reference"
        diff = (got.exp() - lp.exp()).abs().max().item()
        assert diff < 1e-6, f"{name}: episode {e} differs from its reference by {diff:.3g}"
        prototypes = out.state["prototypes"][e, : ep.way]
        assert torch.allclose(prototypes, w, atol=1e-6), f"{name}: episode {e}'s prototypes"
        assert torch.all(out.state["prototypes"][e, ep.way :] == 0)  # a padded class never moves
