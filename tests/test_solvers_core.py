"""proto, ce, poodle and naive-ood: the batched solvers match plain float64 per-episode references
(one episode at a time, autograd + torch.optim.Adam, the loss written exactly as the formulas)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from poodle import solvers
from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.errors import ConfigError
from poodle.solvers import _native
from poodle.solvers import backend as _backend
from poodle.solvers.base import EpisodeBatch

WAY = 5


# ------------------------------------------------------------------------- plain references


def _sqd(x, w):
    """||x - w||^2 for x [N, D], w [K, D] -> [N, K], written directly."""
    return ((x[:, None, :] - w[None, :, :]) ** 2).sum(-1)


def _init(s, ys, way):
    return torch.stack([s[ys == k].mean(0) for k in range(way)])


def ref_proto(s, ys, q, way=WAY, scale=10.0):
    w = _init(s, ys, way)
    return torch.log_softmax(-(scale / 2) * _sqd(q, w), -1), w, torch.tensor(scale, dtype=s.dtype)


def _adam_fit(w, g, loss_fn, steps, lr):
    w = w.clone().requires_grad_(True)
    g = g.clone().requires_grad_(True)
    opt = torch.optim.Adam([w, g], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(w, g).backward()
        opt.step()
    return w.detach(), g.detach()


def ref_ce(s, ys, q, way=WAY, steps=40, lr=1e-3, label_smoothing=0.0, scale=10.0):
    t = F.one_hot(ys, way).to(s.dtype)
    if label_smoothing:
        t = t * (1 - label_smoothing) + (1 - t) * label_smoothing / (way - 1)

    def loss(w, g):
        return -(t * torch.log_softmax(-(g / 2) * _sqd(s, w), -1)).sum(-1).mean()

    w, g = _adam_fit(_init(s, ys, way), torch.tensor(scale, dtype=s.dtype), loss, steps, lr)
    return torch.log_softmax(-(g / 2) * _sqd(q, w), -1), w, g


def ref_poodle(
    s,
    ys,
    q,
    neg,
    way=WAY,
    steps=40,
    lr=1e-3,
    alpha=1.0,
    beta=0.5,
    transductive=False,
    stopgrad_pull=True,
    stopgrad_push=True,
    scale=10.0,
):
    pos = torch.cat([s, q]) if transductive else s

    def loss(w, g):
        ce = F.cross_entropy(-(g / 2) * _sqd(s, w), ys)  # mean over support
        lp = -(g / 2) * _sqd(pos, w)
        pp = lp.softmax(-1)
        pull = (-lp * (pp.detach() if stopgrad_pull else pp)).sum(-1).mean()
        ln = -(g / 2) * _sqd(neg, w)
        pn = ln.softmax(-1)
        push = (-ln * (pn.detach() if stopgrad_push else pn)).sum(-1).mean()
        return ce + alpha * pull - beta * push

    w, g = _adam_fit(_init(s, ys, way), torch.tensor(scale, dtype=s.dtype), loss, steps, lr)
    return torch.log_softmax(-(g / 2) * _sqd(q, w), -1), w, g


def ref_naive_ood(s, ys, q, neg, way=WAY, steps=40, lr=1e-3, scale=10.0):
    w0 = torch.cat([_init(s, ys, way), neg.mean(0, keepdim=True)])
    y_ood = torch.full((neg.shape[0],), way)

    def loss(w, g):
        return F.cross_entropy(-(g / 2) * _sqd(s, w), ys) + F.cross_entropy(-(g / 2) * _sqd(neg, w), y_ood)

    w, g = _adam_fit(w0, torch.tensor(scale, dtype=s.dtype), loss, steps, lr)
    return torch.log_softmax(-(g / 2) * _sqd(q, w[:way]), -1), w[:way], g


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, params=["native", "torch"])
def formulation(request, monkeypatch):
    """Every test runs on both CPU formulations of the fine-tuning solvers: the fused C kernel and
    the torch one it falls back to."""
    if request.param == "native" and not _native.usable(torch.zeros(1)):
        pytest.skip(f"fused kernel unavailable here: {_native.status()}")
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=request.param == "native"))
    return request.param


def _batch(
    make_features, *, shot=1, imbalance=None, n_episodes=4, dim=24, n_neg=30, query=4, seed=0, dtype=torch.float64
):
    x, y = make_features(10, 30, dim, seed=seed, spread=1.0)
    x = torch.from_numpy(x)
    eps = sample_episodes(
        torch.from_numpy(y), EpisodeSpec(way=WAY, shot=shot, query=query, imbalance=imbalance, seed=seed), n_episodes
    )
    g = torch.Generator().manual_seed(seed + 100)
    neg = F.normalize(torch.randn(n_episodes, n_neg, dim, generator=g), dim=-1)
    batch = EpisodeBatch(x[eps.support], eps.support_labels, x[eps.query], neg, WAY).to("cpu", dtype)
    return batch, eps


def _compare(batch, out, ref_fn, **kw):
    """Every episode of ``out`` matches ``ref_fn`` run on that episode alone."""
    takes_neg = ref_fn in (ref_poodle, ref_naive_ood)
    for e in range(batch.n_episodes):
        neg = (batch.negatives[e],) if takes_neg else ()
        lp, w, g = ref_fn(batch.support[e], batch.support_labels[e], batch.query[e], *neg, **kw)
        assert torch.equal(out.log_probs[e].argmax(-1), lp.argmax(-1)), f"episode {e}: predictions differ"
        assert torch.allclose(out.state["prototypes"][e], w, atol=1e-4, rtol=0), f"episode {e}: prototypes"
        assert abs(float(out.state["scale"][e]) - float(g)) < 1e-4
        assert torch.allclose(out.log_probs[e], lp, atol=1e-4)


# ------------------------------------------------------------------------- tests


def test_proto_matches_reference(make_features):
    batch, _ = _batch(make_features, shot=5)
    _compare(batch, solvers.run("proto", batch), ref_proto)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_batched_ce_matches_reference(make_features, label_smoothing):
    batch, _ = _batch(make_features, shot=5)
    out = solvers.run("ce", batch, steps=40, label_smoothing=label_smoothing)
    _compare(batch, out, ref_ce, steps=40, label_smoothing=label_smoothing)


@pytest.mark.parametrize("shot", [1, 5])
@pytest.mark.parametrize("transductive", [False, True])
@pytest.mark.parametrize("imbalance", [None, 0.5])
def test_batched_poodle_matches_reference(make_features, shot, transductive, imbalance):
    batch, _ = _batch(make_features, shot=shot, imbalance=imbalance)
    out = solvers.run("poodle", batch, steps=40, transductive=transductive)
    _compare(batch, out, ref_poodle, steps=40, transductive=transductive)


@pytest.mark.parametrize("pull,push", [(False, True), (True, False), (False, False)])
def test_poodle_without_stopgrad_matches_reference(make_features, pull, push):
    batch, _ = _batch(make_features, shot=1, n_episodes=4)
    out = solvers.run(
        "poodle", batch, steps=40, transductive=True, stopgrad_pull=pull, stopgrad_push=push, alpha=1.0, beta=0.75
    )
    _compare(batch, out, ref_poodle, steps=40, transductive=True, stopgrad_pull=pull, stopgrad_push=push, beta=0.75)


def test_poodle_beta_zero_ignores_negatives_and_is_ce_plus_pull(make_features):
    batch, _ = _batch(make_features, shot=1, n_episodes=4)
    with_neg = solvers.run("poodle", batch, steps=30, beta=0.0, transductive=True)
    no_neg = solvers.get("poodle").fn(
        EpisodeBatch(batch.support, batch.support_labels, batch.query, None, WAY),
        solvers.make_config("poodle", {"steps": 30, "beta": 0.0, "transductive": True}),
    )
    assert torch.equal(with_neg.state["prototypes"], no_neg.state["prototypes"])
    _compare(batch, with_neg, ref_poodle, steps=30, beta=0.0, transductive=True)


def test_batched_naive_ood_matches_reference(make_features):
    batch, _ = _batch(make_features, shot=5, n_episodes=5)
    out = solvers.run("naive-ood", batch, steps=40)
    _compare(batch, out, ref_naive_ood, steps=40)
    assert out.state["ood_prototype"].shape == (5, 1, 24)


def test_poodle_default_250_steps_float32_close_to_float64_reference(make_features):
    batch, _ = _batch(make_features, shot=1, n_episodes=2, dim=64, n_neg=100, query=15)
    cfg = solvers.make_config("poodle", {"transductive": True})
    assert (cfg.steps, cfg.lr, cfg.alpha, cfg.beta, cfg.scale) == (250, 1e-3, 1.0, 0.5, 10.0)
    out64 = solvers.run("poodle", batch, cfg)
    _compare(batch, out64, ref_poodle, steps=250, transductive=True)
    out32 = solvers.run("poodle", batch.to("cpu", torch.float32), cfg)
    assert torch.allclose(out32.state["prototypes"].double(), out64.state["prototypes"], atol=2e-4)
    assert torch.equal(out32.log_probs.argmax(-1), out64.log_probs.argmax(-1))


def test_fine_tuning_moves_prototypes_and_changes_predictions(make_features):
    # a test that could not fail would be worthless: the references must actually do something
    batch, _ = _batch(make_features, shot=1, n_episodes=9)
    p0 = solvers.run("proto", batch)
    p1 = solvers.run("poodle", batch, steps=250, transductive=True, beta=1.0)
    assert (p1.state["prototypes"] - p0.state["prototypes"]).abs().max() > 1e-2
    assert not torch.equal(p0.log_probs.argmax(-1), p1.log_probs.argmax(-1))


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_solving_equals_one_batch(make_features, chunk):
    batch, _ = _batch(make_features, shot=1, n_episodes=9)
    whole = solvers.run("poodle", batch, steps=30, transductive=True)
    for a in range(0, 9, chunk):
        sl = slice(a, a + chunk)
        part = solvers.run(
            "poodle",
            EpisodeBatch(batch.support[sl], batch.support_labels[sl], batch.query[sl], batch.negatives[sl], WAY),
            steps=30,
            transductive=True,
        )
        assert torch.allclose(part.state["prototypes"], whole.state["prototypes"][sl], atol=1e-12)


def test_registry_entries_and_flops():
    for name, trans in (("proto", "never"), ("ce", "never"), ("poodle", "optional"), ("naive-ood", "never")):
        info = solvers.get(name)
        assert info.transductive == trans
        assert info.flops(5, 75, 400, 640, 5, solvers.make_config(name, {})) > 0
    cfg = solvers.make_config("poodle", {"transductive": True})
    # the standard workload: two 480 x 640 x 5 matmuls per step dominate
    assert solvers.get("poodle").flops(5, 75, 400, 640, 5, cfg) == pytest.approx(250 * 4 * 480 * 640 * 5, rel=0.02)
    assert not solvers.get("ce").uses_negatives and solvers.get("poodle").uses_negatives


def test_solver_config_errors(make_features):
    batch, _ = _batch(make_features, n_episodes=2)
    with pytest.raises(ConfigError, match="inductive only"):
        solvers.make_config("ce", {"transductive": True})
    with pytest.raises(ConfigError, match="label_smoothing"):
        solvers.run("ce", batch, label_smoothing=1.5)
    with pytest.raises(ConfigError, match="reads negative samples"):
        solvers.run("poodle", EpisodeBatch(batch.support, batch.support_labels, batch.query, None, WAY))
    with pytest.raises(ConfigError, match="option .lr. must lie in"):
        solvers.run("poodle", batch, lr=0.0)
