"""The transductive competitors: each batched solver matches a plain float64 per-episode reference
(tests/_references_transductive.py), on balanced and imbalanced queries, 1 and 5 shots, batches of
one and several episodes; none produces a NaN on degenerate episodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _references_transductive import REFERENCES

from poodle import solvers
from poodle.errors import ConfigError
from poodle.solvers import EpisodeBatch

METHODS = sorted(REFERENCES)
WAY = 5
DIM = 32

# Reduced iteration counts keep the suite fast; test_default_config_matches_reference runs the
# papers' defaults on two episodes.
FAST = {
    "tim-gd": {"steps": 40, "lr": 1e-3},
    "tim-adm": {"steps": 25},
    "entropy-min": {"steps": 15, "lr": 1e-3},
    "pt-map": {"steps": 8},
    "kmeans": {"max_iter": 30},
    "alpha-tim": {"steps": 40, "lr": 1e-3},
    "paddle": {"steps": 30, "lmd": 0.0},  # lambda = Nq: the authors' 75 collapses these 32-d features
    "proto-lp": {"steps": 10},
    "bayes-kmeans": {"max_iter": 30},
}

# methods whose state lives in a per-episode PCA sub-space
PROJECTED = ("bayes-kmeans", "mean-shift", "proto-lp")

# query counts per class for each of three episodes (same total Nq = 30; zeros included)
BALANCED = [[6] * 5] * 3
IMBALANCED = [[1, 2, 3, 9, 15], [0, 10, 5, 15, 0], [12, 0, 1, 0, 17]]


@pytest.fixture(autouse=True)
def _one_thread():
    # These solvers run thousands of tiny ops; on a shared, oversubscribed machine two intra-op
    # threads make each op up to 30x slower (measured), one thread does not. Restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_batch(
    make_features, shot: int, counts: list[list[int]], seed: int = 0, spread: float = 0.9
) -> tuple[EpisodeBatch, torch.Tensor]:
    """Episodes from clustered features: each episode draws 5 of 8 classes, ``shot`` support
    points and ``counts[e][k]`` queries of class ``k`` (queries shuffled). Returns the batch
    (float64) and the query labels ``[E, Nq]``."""
    x, lab = make_features(8, 40, DIM, seed=seed, spread=spread)
    x = torch.from_numpy(x).double()
    lab = torch.from_numpy(lab)
    g = torch.Generator().manual_seed(seed)
    sup, qry, qlab = [], [], []
    for cnt in counts:
        classes = torch.randperm(8, generator=g)[:WAY]
        s, q, ql = [], [], []
        for k, c in enumerate(classes.tolist()):
            rows = torch.nonzero(lab == c).flatten()
            rows = rows[torch.randperm(len(rows), generator=g)]
            s.append(x[rows[:shot]])
            q.append(x[rows[shot : shot + cnt[k]]])
            ql += [k] * cnt[k]
        q = torch.cat(q)
        perm = torch.randperm(len(q), generator=g)
        sup.append(torch.cat(s))
        qry.append(q[perm])
        qlab.append(torch.tensor(ql)[perm])
    E = len(counts)
    y_s = torch.arange(WAY).repeat_interleave(shot).expand(E, -1).clone()
    return EpisodeBatch(torch.stack(sup), y_s, torch.stack(qry), None, WAY), torch.stack(qlab)


def config(name: str, **over):
    return solvers.make_config(name, {**FAST.get(name, {}), **over}, strict=True)


def reference_kwargs(name: str, cfg) -> dict:
    if name == "tim-gd":
        return cfg.resolved()
    return dataclasses.asdict(cfg)


def run_reference(name: str, batch: EpisodeBatch, cfg) -> tuple[list[torch.Tensor], list[dict]]:
    fn = REFERENCES[name]
    outs, states = [], []
    for e in range(batch.n_episodes):
        lp, st = fn(batch.support[e], batch.support_labels[e], batch.query[e], batch.way, **reference_kwargs(name, cfg))
        outs.append(lp)
        states.append(st)
    return outs, states


def assert_matches(name: str, out, ref_lp, ref_states, tol: float = 1e-4) -> None:
    lp = out.log_probs
    for e, (r, st) in enumerate(zip(ref_lp, ref_states)):
        assert torch.equal(lp[e].argmax(-1), r.argmax(-1)), f"{name}: predictions differ in episode {e}"
        assert torch.allclose(lp[e].exp(), r.exp(), atol=tol), f"{name}: probabilities differ in episode {e}"
        for key in ("prototypes", "assignments", "centres", "iterations", "clusters"):
            if key in st:
                got = out.state[key][e]
                want = st[key].to(got.dtype)
                assert got.shape == want.shape, f"{name}: state {key} shape {got.shape} != {want.shape}"
                if name in PROJECTED and key in ("prototypes", "centres"):
                    # the PCA basis is defined up to signs/rotation: compare Gram matrices
                    got, want = got @ got.T, want @ want.T
                assert torch.allclose(got, want, atol=tol), f"{name}: state {key} differs in episode {e}"


@pytest.mark.parametrize("counts", [BALANCED, IMBALANCED], ids=["balanced", "imbalanced"])
@pytest.mark.parametrize("shot", [1, 5])
@pytest.mark.parametrize("name", METHODS)
def test_batched_matches_reference(make_features, name, shot, counts):
    batch, _ = build_batch(make_features, shot, counts, seed=shot)
    cfg = config(name)
    ref_lp, ref_st = run_reference(name, batch, cfg)
    assert_matches(name, solvers.run(name, batch, cfg), ref_lp, ref_st)
    # a batch of one gives the same as the episode inside a larger batch
    one = solvers.run(name, batch.episode(1), cfg)
    assert_matches(name, one, ref_lp[1:2], ref_st[1:2])


@pytest.mark.parametrize("name", METHODS)
def test_float32_predictions_agree_with_reference(make_features, name):
    batch, q_lab = build_batch(make_features, 1, IMBALANCED, seed=3, spread=0.3)
    cfg = config(name)
    ref_lp, _ = run_reference(name, batch, cfg)
    out = solvers.run(name, batch.to("cpu", torch.float32), cfg)
    assert out.log_probs.dtype == torch.float32
    agree = (out.log_probs.argmax(-1) == torch.stack(ref_lp).argmax(-1)).double().mean()
    assert agree >= 0.97, f"{name}: float32 agrees with the float64 reference on {agree:.1%} of queries"
    # the methods classify clustered features well above chance (1/5)
    acc = (out.log_probs.argmax(-1) == q_lab).double().mean()
    assert acc > 0.5, f"{name}: accuracy {acc:.2f}"


@pytest.mark.parametrize("name", METHODS)
def test_default_config_matches_reference(make_features, name):
    batch, _ = build_batch(make_features, 5, [[6] * 5, [2, 3, 10, 5, 10]], seed=7)
    cfg = solvers.make_config(name, {})
    ref_lp, ref_st = run_reference(name, batch, cfg)
    assert_matches(name, solvers.run(name, batch, cfg), ref_lp, ref_st)


def _degenerate_batches(make_features):
    x, _ = make_features(3, 10, DIM, seed=11)
    x = torch.from_numpy(x)
    v = x[0]
    # 1. every feature identical
    same = EpisodeBatch(
        v.expand(2, 10, DIM).clone(),
        torch.arange(WAY).repeat_interleave(2).expand(2, -1).clone(),
        v.expand(2, 30, DIM).clone(),
        None,
        WAY,
    )
    # 2. all queries from one class, two classes with the same support point (an empty cluster
    #    for unsupervised k-means, classes with no confident query for the pseudo-labellers)
    sup = torch.stack([x[0], x[0], x[10], x[20], x[20]]).expand(2, WAY, DIM).clone()
    one_class = EpisodeBatch(
        sup, torch.arange(WAY).expand(2, -1).clone(), x[1:10].repeat(2, 1).expand(2, 18, DIM).clone(), None, WAY
    )
    # 3. tiny query sets: one and two queries (kNN with k > Nq - 1, a top-k larger than Nq)
    tiny1 = EpisodeBatch(
        x[[0, 10, 20, 5, 15]].expand(2, WAY, DIM).clone(),
        torch.arange(WAY).expand(2, -1).clone(),
        x[[1]].expand(2, 1, DIM).clone(),
        None,
        WAY,
    )
    tiny2 = EpisodeBatch(
        x[[0, 10, 20, 5, 15]].expand(2, WAY, DIM).clone(),
        torch.arange(WAY).expand(2, -1).clone(),
        x[[1, 11]].expand(2, 2, DIM).clone(),
        None,
        WAY,
    )
    # 4. features with large negative coordinates (pt-map's power transform)
    neg = EpisodeBatch(
        -x[[0, 10, 20, 5, 15]].abs().expand(1, WAY, DIM).clone(),
        torch.arange(WAY).view(1, -1),
        -x[1:9].abs().unsqueeze(0),
        None,
        WAY,
    )
    return {
        "all-equal": same,
        "one-class-queries": one_class,
        "one-query": tiny1,
        "two-queries": tiny2,
        "negative": neg,
    }


@pytest.mark.parametrize("name", METHODS)
def test_degenerate_episodes_give_no_nan(make_features, name):
    for label, batch in _degenerate_batches(make_features).items():
        out = solvers.run(name, batch, config(name))
        assert out.log_probs.shape == (batch.n_episodes, batch.query.shape[1], WAY)
        assert torch.isfinite(out.log_probs).all(), f"{name} on {label}: non-finite log-probabilities"
        probs = out.log_probs.exp().sum(-1)
        assert torch.allclose(probs, torch.ones_like(probs), atol=1e-4), f"{name} on {label}: not normalised"
        for key, t in out.state.items():
            assert torch.isfinite(t.double()).all(), f"{name} on {label}: non-finite state {key}"


def test_every_method_is_registered_transductive_with_flops():
    for name in METHODS:
        info = solvers.get(name)
        assert info.transductive == "always"
        assert not info.uses_negatives
        assert info.flops is not None and info.flops(25, 75, 0, 640, 5, info.config()) > 0
        assert info.summary


def test_solvers_accept_inference_mode_inputs(make_features):
    batch, _ = build_batch(make_features, 1, BALANCED[:2])
    with torch.inference_mode():
        b = EpisodeBatch(batch.support.clone(), batch.support_labels.clone(), batch.query.clone(), None, WAY)
    for name in ("tim-gd", "entropy-min"):
        out = solvers.run(name, b, config(name, steps=3))
        assert torch.isfinite(out.log_probs).all()


def test_tim_gd_presets_and_overrides():
    cfg = solvers.make_config("tim-gd", {})
    assert cfg.resolved() == dict(
        ce_weight=0.1,
        marginal_weight=1.0,
        conditional_weight=0.1,
        temperature=15.0,
        learn_temperature=False,
        lr=1e-4,
        steps=1000,
    )
    paper = solvers.make_config("tim-gd", {"preset": "poodle-paper"}).resolved()
    assert (paper["ce_weight"], paper["marginal_weight"], paper["conditional_weight"]) == (1.0, 10.0, 1.0)
    assert (paper["temperature"], paper["learn_temperature"], paper["lr"], paper["steps"]) == (10.0, True, 1e-3, 250)
    over = solvers.make_config("tim-gd", {"preset": "poodle-paper", "steps": "7", "lr": "0.5"}).resolved()
    assert over["steps"] == 7 and over["lr"] == 0.5 and over["marginal_weight"] == 10.0
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        solvers.make_config("tim-gd", {"preset": "nope"}).resolved()
    with pytest.raises(ConfigError, match="'steps' of method 'tim-gd'"):
        solvers.make_config("tim-gd", {"steps": "many"}).resolved()


def test_tim_gd_learns_the_scale_only_in_the_poodle_preset(make_features):
    batch, _ = build_batch(make_features, 1, BALANCED[:2])
    fixed = solvers.run("tim-gd", batch, config("tim-gd", steps=5))
    learnt = solvers.run("tim-gd", batch, config("tim-gd", preset="poodle-paper", steps=5))
    assert torch.equal(fixed.state["scale"], torch.full_like(fixed.state["scale"], 15.0))
    assert not torch.equal(learnt.state["scale"], torch.full_like(learnt.state["scale"], 10.0))


def test_kmeans_stops_each_episode_on_its_own(make_features):
    batch, _ = build_batch(make_features, 1, IMBALANCED, seed=5)
    out = solvers.run("kmeans", batch, config("kmeans", max_iter=100))
    iters = out.state["iterations"]
    assert (iters < 100).all()
    # a frozen episode is a fixed point: one more iteration from its centres changes nothing
    again = solvers.run("kmeans", batch, config("kmeans", max_iter=int(iters.max()) + 5))
    assert torch.allclose(again.state["prototypes"], out.state["prototypes"])


@pytest.mark.parametrize("fix_support", [True, False])
def test_kmeans_converged_centres_are_means_of_their_members(make_features, fix_support):
    batch, _ = build_batch(make_features, 5, IMBALANCED, seed=2)
    out = solvers.run("kmeans", batch, config("kmeans", max_iter=200, fix_support=fix_support))
    c = out.state["prototypes"]
    lab_q = torch.cdist(batch.query, c).argmin(-1)
    # constrained: support points belong to their labelled class; unconstrained: to the nearest centre
    lab_s = batch.support_labels if fix_support else torch.cdist(batch.support, c).argmin(-1)
    for e in range(batch.n_episodes):
        for k in range(WAY):
            members = torch.cat([batch.support[e][lab_s[e] == k], batch.query[e][lab_q[e] == k]])
            if len(members):
                assert torch.allclose(c[e, k], members.mean(0), atol=1e-10)


def test_pt_map_plan_has_the_method_marginals(make_features):
    batch, _ = build_batch(make_features, 1, IMBALANCED)
    out = solvers.run("pt-map", batch, config("pt-map"))
    plan = out.state["assignments"]
    nq = batch.query.shape[1]
    assert torch.allclose(plan.sum(1), torch.full((3, WAY), nq / WAY, dtype=plan.dtype), atol=1e-5)
    assert torch.allclose(plan.sum(2), torch.ones(3, nq, dtype=plan.dtype), atol=1e-4)


def test_can_t_handles_any_query_count(make_features):
    # 17 queries: not the authors' hard-coded 75; iterations = 17 // 5 = 3
    batch, _ = build_batch(make_features, 1, [[3, 4, 2, 5, 3]] * 2)
    cfg = config("can-t", step=5)
    ref_lp, ref_st = run_reference("can-t", batch, cfg)
    assert_matches("can-t", solvers.run("can-t", batch, cfg), ref_lp, ref_st)


def test_laplacianshot_knn_graph_is_batched_knn(make_features):
    from poodle.solvers.laplacianshot import knn_graph

    batch, _ = build_batch(make_features, 1, IMBALANCED)
    w = knn_graph(batch.query, 3)
    assert torch.equal(w.sum(-1), torch.full(w.shape[:2], 3.0, dtype=w.dtype))
    assert torch.equal(torch.diagonal(w, dim1=1, dim2=2), torch.zeros(3, 30, dtype=w.dtype))
    d = torch.cdist(batch.query[2], batch.query[2])
    d.fill_diagonal_(float("inf"))
    assert torch.equal(w[2].nonzero()[:, 1].view(30, 3).sort(1).values, d.topk(3, largest=False).indices.sort(1).values)


@pytest.mark.parametrize("fix_support", [True, False])
@pytest.mark.parametrize("name", ["kmeans", "soft-kmeans"])
def test_support_labels_are_enforced_only_when_asked(name, fix_support):
    # class 0's third support point sits on class 1: constrained clustering keeps it in class 0,
    # the POODLE authors' unconstrained variant moves it to class 1
    e = torch.eye(4, dtype=torch.float64)
    a, b = e[0], e[1]
    sup = torch.stack([a, a, b, b, b, b]).unsqueeze(0)
    labels = torch.tensor([[0, 0, 0, 1, 1, 1]])
    qry = torch.stack([0.9 * a + 0.1 * e[2], 0.9 * b + 0.1 * e[3]]).unsqueeze(0)
    batch = EpisodeBatch(sup, labels, qry, None, 2)
    cfg = config(name, fix_support=fix_support)
    out = solvers.run(name, batch, cfg)
    ref_lp, ref_st = run_reference(name, batch, cfg)
    assert_matches(name, out, ref_lp, ref_st)
    c0 = out.state["prototypes"][0, 0]
    # with labels enforced, class 0's centre is pulled towards b by its third support point
    assert (c0[1] > 0.2) == fix_support


@pytest.mark.parametrize(
    "name, over",
    [
        ("laplacianshot", {"preset": "official"}),
        ("laplacianshot", {"preset": "official", "rectify": False}),
        ("laplacianshot", {"shifted_unary": True}),
        ("laplacianshot", {"preset": "official", "released_rectification": False, "self_neighbour": False}),
        ("bms", {"epochs": 5}),
        ("proto-lp", {"balanced": False}),
        ("alpha-tim", {"alpha": 3.0}),
        ("paddle", {"lmd": 10.0, "scale_features": False}),
        ("paddle", {"lmd": 75.0}),
    ],
)
@pytest.mark.parametrize("shot", [1, 5])
def test_variants_match_reference(make_features, name, over, shot):
    batch, _ = build_batch(make_features, shot, IMBALANCED, seed=shot + 10)
    cfg = config(name, **over)
    ref_lp, ref_st = run_reference(name, batch, cfg)
    assert_matches(name, solvers.run(name, batch, cfg), ref_lp, ref_st)


def test_laplacianshot_official_drops_an_empty_class_and_shifts_labels():
    # class 1's support points sit next to classes 0 and 2, no query is near class 1: the released
    # code drops class 1 and class 2 then answers with label 1
    e = torch.eye(4, dtype=torch.float64)
    sup = torch.stack([e[0], e[0], e[0] + 0.2 * e[1], e[2] + 0.2 * e[1], e[2], e[2]])
    sup = torch.nn.functional.normalize(sup, dim=-1)
    qry = torch.nn.functional.normalize(torch.stack([e[0], e[2], e[2] + 0.1 * e[3], e[0] + 0.05 * e[3]]), dim=-1)
    batch = EpisodeBatch(sup[None], torch.tensor([[0, 0, 1, 1, 2, 2]]), qry[None], None, 3)
    cfg = solvers.make_config("laplacianshot", {"preset": "official", "lmd": 0.0})
    out = solvers.run("laplacianshot", batch, cfg)
    ref_lp, _ = run_reference("laplacianshot", batch, cfg)
    assert out.log_probs[0].argmax(-1).tolist() == ref_lp[0].argmax(-1).tolist() == [0, 1, 1, 0]
    assert torch.isfinite(out.log_probs).all()
    # the default variant keeps class 1 and answers 2 for the queries near class 2
    default = solvers.run("laplacianshot", batch, solvers.make_config("laplacianshot", {"lmd": 0.0}))
    assert default.log_probs[0].argmax(-1).tolist() == [0, 2, 2, 0]


def test_laplacianshot_variant_switches_follow_the_preset():
    assert solvers.make_config("laplacianshot", {}).resolved() == (False, False, False)
    assert solvers.make_config("laplacianshot", {"preset": "official"}).resolved() == (True, True, True)
    # lambda: the paper's validated 0.7 by default, the release's 1.0 (run.sh, --lmd) officially;
    # an explicit value wins over either preset
    assert solvers.make_config("laplacianshot", {}).lmd == 0.7
    assert solvers.make_config("laplacianshot", {"preset": "official"}).lmd == 1.0
    assert solvers.make_config("laplacianshot", {"preset": "official", "lmd": "0.7"}).lmd == 0.7
    cfg = solvers.make_config("laplacianshot", {"preset": "official", "self_neighbour": "false"})
    assert cfg.resolved() == (False, True, True)
    with pytest.raises(ConfigError, match="unknown preset 'paper'"):
        solvers.make_config("laplacianshot", {"preset": "paper"})
    with pytest.raises(ConfigError, match="shifted_unary"):
        solvers.make_config("laplacianshot", {"shifted_unary": "maybe"})


def test_alpha_tim_uses_the_authors_tuned_alpha(make_features):
    from poodle.solvers.alpha_tim import tuned_alpha

    assert [tuned_alpha(s) for s in (1, 2, 4, 5, 10)] == [2.0, 5.0, 5.0, 7.0, 7.0]
    batch, _ = build_batch(make_features, 1, BALANCED[:1])
    auto = solvers.run("alpha-tim", batch, config("alpha-tim"))
    two = solvers.run("alpha-tim", batch, config("alpha-tim", alpha=2.0))
    seven = solvers.run("alpha-tim", batch, config("alpha-tim", alpha=7.0))
    assert torch.equal(auto.log_probs, two.log_probs) and not torch.allclose(auto.log_probs, seven.log_probs)


def test_paddle_empties_classes_absent_from_the_queries(make_features):
    # queries from 2 of the 5 classes only: PADDLE's MDL term empties the absent classes. Its data
    # term has no temperature, so it needs distances of a few units (features x 3 here); on unit
    # features of this spread it collapses everything into one class (docs/transductive.md)
    batch, q_lab = build_batch(make_features, 5, [[15, 0, 0, 15, 0]] * 2, seed=4, spread=0.3)
    big = EpisodeBatch(3 * batch.support, batch.support_labels, 3 * batch.query, None, WAY)
    out = solvers.run("paddle", big, config("paddle", steps=100, lmd=0.0, scale_features=False))
    mass = out.state["assignments"].sum(1)  # [E, way]
    assert (mass[:, [1, 2, 4]] < 0.5).all(), mass
    assert (out.log_probs.argmax(-1) == q_lab).all()
    soft = solvers.run("pt-map", batch, config("pt-map"))  # balanced by construction
    assert (soft.log_probs.argmax(-1) == q_lab).double().mean() < 0.9


def test_bms_min_size_is_respected(make_features):
    from poodle.solvers.bms import min_size_sinkhorn

    p = torch.softmax(torch.randn(3, 4, 20, dtype=torch.float64) * 3, 1)  # [E, K, Nq]
    q = min_size_sinkhorn(p, torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64), 50)
    assert (q.sum(2) >= torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64)[:, None] - 1e-9).all()


@pytest.mark.parametrize("counts", [BALANCED, IMBALANCED], ids=["balanced", "imbalanced"])
def test_tim_gd_poodle_paper_preset_matches_reference(make_features, counts):
    # the learnable temperature: the analytic dL/dgamma against the plain autograd reference
    batch, _ = build_batch(make_features, 1, counts, seed=7)
    cfg = config("tim-gd", preset="poodle-paper", steps=40)
    ref_lp, ref_st = run_reference("tim-gd", batch, cfg)
    out = solvers.run("tim-gd", batch, cfg)
    assert_matches("tim-gd", out, ref_lp, ref_st)
    for e, st in enumerate(ref_st):
        assert abs(float(out.state["scale"][e]) - float(st["scale"])) < 1e-6


@pytest.mark.parametrize("name", ["tim-gd", "alpha-tim"])
def test_analytic_gradient_is_autograd_of_the_loss(make_features, name):
    # the engine's dL/dW and dL/dgamma at random prototypes far from the means (so that every term
    # of the loss is active) against autograd of the loss as written (tim_loss, alpha_tim_loss)
    import poodle.solvers.alpha_tim as at
    import poodle.solvers.tim_gd as tg
    from poodle.solvers._transductive import softmax_logits
    from poodle.solvers.base import one_hot

    batch, _ = build_batch(make_features, 1, IMBALANCED, seed=11)
    g = torch.Generator().manual_seed(0)
    E, K = batch.n_episodes, batch.way
    w = torch.randn(E, K, batch.support.shape[-1], generator=g, dtype=torch.float64).requires_grad_(True)
    t = torch.full((E, 1, 1), 7.0, dtype=torch.float64, requires_grad=True)
    y = one_hot(batch.support_labels, K, torch.float64)
    ls, lq = softmax_logits(batch.support, w, t), softmax_logits(batch.query, w, t)
    if name == "tim-gd":
        mod, loss = tg, tg.tim_loss(ls, y, lq, 0.3, 2.0, 0.7).sum()
        cfg = config(name, ce_weight=0.3, marginal_weight=2.0, conditional_weight=0.7, temperature=7.0, steps=1)
    else:
        mod, loss = at, at.alpha_tim_loss(ls, y, lq, 3.0, 0.3, 2.0, 0.7).sum()
        cfg = config(
            name, alpha=3.0, ce_weight=0.3, marginal_weight=2.0, conditional_weight=0.7, temperature=7.0, steps=1
        )
    gw, gt = torch.autograd.grad(loss, [w, t])
    seen = {}
    real_fit, real_means = mod.fit_logit_loss, mod.class_means

    def capture(x, w0, grad_logits, **kw):
        Z = torch.bmm(w0, x.transpose(1, 2)) - 0.5 * (w0 * w0).sum(-1, keepdim=True)
        P = torch.softmax(kw["scale0"] * Z, 1)
        G = torch.empty_like(P)
        grad_logits(P, kw["scale0"] * Z, G)
        seen["gW"] = kw["scale0"] * (torch.bmm(G, x) - G.sum(2, keepdim=True) * w0)
        seen["gt"] = (G * Z).sum((1, 2))
        seen["rowsum"] = G.sum(1)
        return real_fit(x, w0, grad_logits, **kw)

    try:
        mod.fit_logit_loss, mod.class_means = capture, lambda *a: w.detach()
        solvers.run(name, batch, cfg)
    finally:
        mod.fit_logit_loss, mod.class_means = real_fit, real_means
    assert torch.allclose(seen["gW"], gw, atol=1e-10, rtol=0)
    assert torch.allclose(seen["gt"], gt.view(-1), atol=1e-10, rtol=0)
    assert seen["rowsum"].abs().max() < 1e-12  # why |x|^2 drops out of dL/dgamma


# ------------------------------------------------------------------ PT-MAP / BMS / protoLP / PADDLE internals
SPAN_METHODS = {"pt-map": {}, "bms": {}, "proto-lp": {"reduced_dim": 0}, "paddle": {}}


@pytest.mark.parametrize("gram", [True, False], ids=["gram", "explicit"])
@pytest.mark.parametrize("name", sorted(SPAN_METHODS))
def test_both_forms_of_the_centres_match_reference(make_features, monkeypatch, name, gram):
    # centres held as weights over the episode's rows (Gram form) or explicitly: the same method
    from poodle.solvers import _span

    monkeypatch.setattr(_span, "FORCE_GRAM", gram)
    batch, _ = build_batch(make_features, 2, IMBALANCED, seed=11)
    cfg = config(name, **SPAN_METHODS[name])
    ref_lp, ref_st = run_reference(name, batch, cfg)
    assert_matches(name, solvers.run(name, batch, cfg), ref_lp, ref_st)


def test_gram_form_is_chosen_by_arithmetic():
    from poodle.solvers._span import span_flops, use_gram

    assert use_gram(5, 75, 640, 5, 21, 20)  # the standard workload: half the FLOPs
    assert span_flops(5, 75, 640, 5, 21, 20, True) < 0.6 * span_flops(5, 75, 640, 5, 21, 20, False)
    assert not use_gram(5, 75, 64, 5, 21, 20)  # more rows than dimensions
    assert not use_gram(5, 600, 640, 5, 2, 1)  # few steps over many rows


@pytest.mark.parametrize("reset", [False, True], ids=["plain", "support-reset"])
def test_sinkhorn_dropping_finished_episodes_matches_the_masked_schedule(reset, monkeypatch):
    # the torch formulation: the CPU drops converged episodes from the batch; other devices mask
    # them and look every 16 sweeps: the same plan, episode by episode (tolerances that stop them at
    # different sweeps)
    from poodle.solvers import backend as _backend
    from poodle.solvers import pt_map

    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=False))

    g = torch.Generator().manual_seed(0)
    cost = (
        torch.rand(9, 5, 30, generator=g, dtype=torch.float64)
        * torch.linspace(0.2, 3, 9, dtype=torch.float64)[:, None, None]
    )
    y = torch.eye(5, dtype=torch.float64)[torch.arange(10) % 5].T.expand(9, 5, 10) if reset else None
    p0 = torch.exp(-10 * cost)
    dropped = pt_map.balance(p0.clone(), 6.0, 1e-9, 300, y)
    with _backend.active(_backend.Backend(native=False, device_schedule=True)):
        masked = pt_map.balance(p0.clone(), 6.0, 1e-9, 300, y)
    assert torch.equal(dropped, masked)
    assert torch.allclose(dropped.sum(1), torch.ones(9, 30, dtype=torch.float64), atol=1e-6)
    if reset:
        assert torch.equal(dropped[:, :, :10], y)


def test_power_transform_in_place_matches_the_formula():
    from poodle.solvers.pt_map import power_transform

    x = torch.tensor([[0.0, -0.0, 1e-8, 0.3, -0.3, 2.5, -7.0]])
    x64 = x.double()
    for beta in (0.5, 0.3, 1.0):
        base = (x.abs() + 1e-6).double()  # the float32 sum the transform raises
        want = torch.sign(x64) * base**beta + (x64 == 0).double() * (1e-6**beta)
        got = power_transform(x, beta)
        # within one float32 rounding of the formula (the vectorised pow, not std::pow: see pow_anywhere)
        assert torch.allclose(got.double(), want, rtol=1.8e-7, atol=0) and got.dtype == x.dtype
        assert bool((got[0, :2] == torch.tensor(1e-6**beta, dtype=x.dtype)).all())  # either zero: 1e-6^beta
        out = torch.empty_like(x)
        assert power_transform(x, beta, out=out) is out and torch.equal(out, got)


@pytest.mark.parametrize("n, d", [(12, 30), (30, 12)], ids=["rows<dims", "rows>dims"])
def test_proto_lp_projection_is_the_svd_projection(n, d):
    from poodle.solvers.proto_lp import svd_project

    x = torch.rand(3, n, d, generator=torch.Generator().manual_seed(1))
    got = svd_project(x, 7)
    vh = torch.linalg.svd(x.double(), full_matrices=False).Vh[:, :7]
    want = torch.bmm(x.double(), vh.transpose(1, 2))
    assert got.shape == (3, n, 7) and got.dtype == x.dtype
    # coordinates up to a sign per direction: the same distances, the same Gram matrix
    assert torch.allclose(
        torch.bmm(got, got.transpose(1, 2)).double(), torch.bmm(want, want.transpose(1, 2)), atol=1e-5
    )
    assert torch.allclose(got.double().abs(), want.abs(), atol=1e-5)


def test_bms_min_size_sinkhorn_skips_its_guard_only_where_it_changes_nothing(monkeypatch):
    from poodle.solvers import backend as _backend
    from poodle.solvers.bms import min_size_sinkhorn

    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=False))  # the torch formulation's shortcut

    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(6, 5, 40, generator=g) * 4, 1)  # float32, entries far above 1e-13
    p[0, 2] = 0.0  # an empty class: the guard's sum must be taken there
    target = torch.tensor([3.0, 8.0, 1.0, 5.0, 7.0, 2.0])

    want = p.clone()  # the authors' sweep, the guard always summed
    for _ in range(30):
        want = want / want.sum(1, keepdim=True)
        small = want.sum(2, keepdim=True) < target[:, None, None]
        want = torch.where(small, want / ((want + 1e-20).sum(2, keepdim=True) / target[:, None, None]), want)
    assert torch.equal(min_size_sinkhorn(p.clone(), target, 30), want)
    assert torch.equal(min_size_sinkhorn(p[1:].clone(), target[1:], 30), want[1:])
