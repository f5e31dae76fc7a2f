"""A ragged episode set (each episode its own way, shots and queries; indices padded with -1, and
``ways``) through :func:`poodle.evaluate.evaluate`: each chunk is padded to its largest episode, the
accuracy counts each episode's real queries only, memory planning counts the padded shapes, and the
accuracies are each episode's own whatever the chunking (1, 2, 3 or 7 at a time, the planned chunks
in buckets of similar size, two workers, the pipelined stream) and equal to solving it alone."""

from __future__ import annotations

import pytest
import torch
from conftest import clustered_features

from poodle import solvers
from poodle.cache import SplitFeatures
from poodle.episodes import EpisodeSet, EpisodeSpec
from poodle.errors import ConfigError, EpisodeError
from poodle.evaluate import (
    BUCKET_LEAST,
    BUCKET_WASTE,
    Gatherer,
    Hooks,
    _Negatives,
    choose_chunk,
    episode_bytes,
    episode_shapes,
    evaluate,
    plan_chunks,
    plan_ragged,
)
from poodle.negatives import NegativeSpec
from poodle.run import RunOptions
from poodle.solvers import EpisodeBatch

N_CLASSES, PER_CLASS, DIM = 60, 40, 24
# Every registered method runs (a new one with its defaults, needing no entry here); these are the
# smaller runs of the slower ones that keep the suite fast, and POODLE without negatives
QUICK: dict[str, dict] = {
    "can-t": {"step": 10},
    "kmeans": {"max_iter": 20},
    "bayes-kmeans": {"max_iter": 20},
    "paddle": {"steps": 20, "lmd": 5.0},
    "poodle": {"steps": 30, "beta": 0.0, "transductive": True},
    "ce": {"steps": 30},
    "tim-gd": {"steps": 30},
    "alpha-tim": {"steps": 30},
    "entropy-min": {"steps": 15},
    "tim-adm": {"steps": 20},
    "pt-map": {"steps": 8},
    "proto-lp": {"steps": 10},
    "naive-ood": {"steps": 30},
}


def _reads_negatives(name: str, options: dict) -> bool:
    """What the method declares at its ``@register`` (``uses_negatives``), for these options."""
    return solvers.get(name).needs_negatives(solvers.make_config(name, options, strict=True))


CASES = [(name, name, QUICK.get(name, {})) for name in solvers.available()]
METHODS = [c for c in CASES if not _reads_negatives(c[1], c[2])]
# the methods that read negatives, on random ones (each episode's own, whatever its chunk), and
# POODLE with them as well
WITH_NEGATIVES = [c for c in CASES if _reads_negatives(c[1], c[2])] + [("poodle-neg", "poodle", {"steps": 30})]


def _features(seed: int = 0) -> SplitFeatures:
    x, y = clustered_features(N_CLASSES, PER_CLASS, DIM, seed=seed, spread=0.6)
    return SplitFeatures("test", torch.from_numpy(x), torch.from_numpy(y), [f"c{i}" for i in range(N_CLASSES)])


def ragged_set(labels: torch.Tensor, n_episodes: int, seed: int = 0) -> EpisodeSet:
    """Episodes of Meta-Dataset's shapes drawn by hand: 5 to 20 ways, 1 to 8 shots and 1 to 10
    queries per class, rows shuffled within the episode, padded with -1 to the largest."""
    g = torch.Generator().manual_seed(seed)
    members = [torch.nonzero(labels == c).flatten() for c in range(N_CLASSES)]
    eps = []
    for _ in range(n_episodes):
        way = int(torch.randint(5, 21, (1,), generator=g))
        classes = torch.randperm(N_CLASSES, generator=g)[:way]
        s, ys, q, yq = [], [], [], []
        for k, c in enumerate(classes.tolist()):
            shot = int(torch.randint(1, 9, (1,), generator=g))
            query = int(torch.randint(1, 11, (1,), generator=g))
            rows = members[c][torch.randperm(PER_CLASS, generator=g)[: shot + query]]
            s.append(rows[:shot])
            q.append(rows[shot:])
            ys += [k] * shot
            yq += [k] * query
        s_t, q_t = torch.cat(s), torch.cat(q)
        ps, pq = torch.randperm(len(s_t), generator=g), torch.randperm(len(q_t), generator=g)
        eps.append((s_t[ps], torch.tensor(ys)[ps], q_t[pq], torch.tensor(yq)[pq], classes, way))
    ns, nq, wmax = max(len(e[0]) for e in eps), max(len(e[2]) for e in eps), max(e[5] for e in eps)

    def pad(ts: list[torch.Tensor], n: int) -> torch.Tensor:
        return torch.stack([torch.cat([t, torch.full((n - len(t),), -1, dtype=torch.int64)]) for t in ts])

    return EpisodeSet(
        pad([e[0] for e in eps], ns),
        pad([e[2] for e in eps], nq),
        pad([e[1] for e in eps], ns),
        pad([e[3] for e in eps], nq),
        None,
        EpisodeSpec(split="test", way=5, shot=1, query=1, seed=seed),
        class_ids=pad([e[4] for e in eps], wmax),
        ways=torch.tensor([e[5] for e in eps]),
    )


def _alone(features: SplitFeatures, eps: EpisodeSet, method: str, options: dict) -> torch.Tensor:
    """Each episode solved alone, at its own size, as a batch of one: its accuracy ``[E]``."""
    cfg = solvers.make_config(method, options, strict=True)
    acc = []
    for e in range(len(eps)):
        s, q = eps.support[e], eps.query[e]
        s_lab, q_lab = eps.support_labels[e][s >= 0], eps.query_labels[e][q >= 0]
        x = features.features
        batch = EpisodeBatch(x[s[s >= 0]][None], s_lab[None], x[q[q >= 0]][None], None, int(eps.ways[e]))
        pred = solvers.run(method, batch, cfg).log_probs[0].argmax(-1)
        acc.append((pred == q_lab).double().mean())
    return torch.stack(acc)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_ragged_set_gets_the_same_accuracies_in_any_chunking():
    features = _features()
    eps = ragged_set(features.labels, 10)
    assert eps.ways is not None and int(eps.ways.min()) < int(eps.ways.max())
    runs = {}
    for size in (1, 2, 3, 7, 10):
        stats: dict = {}
        runs[size] = evaluate(
            features, eps, METHODS, run=RunOptions(device="cpu", chunk_size=size, workers=1), hooks=Hooks(stats=stats)
        )
        assert stats["n_chunks"] == -(-10 // size) and stats["padded_rows"] >= stats["rows"]
    stats = {}
    runs["planned"] = evaluate(
        features, eps, METHODS, run=RunOptions(device="cpu", workers=1, max_memory="2MiB"), hooks=Hooks(stats=stats)
    )
    assert stats["bucketed"] and stats["n_chunks"] > 1
    runs["workers"] = evaluate(features, eps, METHODS, run=RunOptions(device="cpu", chunk_size=3, workers=2))
    runs["pipelined"] = evaluate(
        features, eps, METHODS, run=RunOptions(device="cpu", chunk_size=4, workers=1, overlap=True)
    )
    for label, method, options in METHODS:
        want = _alone(features, eps, method, options)
        for how, res in runs.items():
            got = res[label]
            assert got.dtype == torch.float64 and got.shape == (10,)
            bad = torch.nonzero(got != want).flatten().tolist()
            assert not bad, f"{label} ({how}): episodes {bad} differ from solved alone: {got[bad]} != {want[bad]}"
        assert 0.2 < float(want.mean()) < 1.0, f"{label}: {float(want.mean()):.2f} mean accuracy"


def test_the_quick_options_are_of_registered_methods():
    # a renamed method or option would otherwise leave its quick run behind (and run its defaults)
    for name, options in QUICK.items():
        info = solvers.get(name)
        assert info.name == name and set(options) <= set(info.options()) | {"transductive"}, name
    assert {m for _, m, _ in METHODS + WITH_NEGATIVES} == set(solvers.available())
    assert all(_reads_negatives(m, o) for _, m, o in WITH_NEGATIVES)


def test_methods_with_negatives_get_the_same_accuracies_in_any_chunking():
    features = _features(1)
    eps = ragged_set(features.labels, 7, seed=1)
    neg = NegativeSpec("random", 16)
    runs = {
        size: evaluate(
            features, eps, WITH_NEGATIVES, negatives=neg, run=RunOptions(device="cpu", chunk_size=size, workers=1)
        )
        for size in (1, 2, 3, 7)
    }
    for label, _, _ in WITH_NEGATIVES:
        for size, res in runs.items():
            assert torch.equal(res[label], runs[1][label]), f"{label}: chunks of {size} differ from one at a time"
        assert 0.2 < float(runs[1][label].mean()) < 1.0


def test_planning_counts_each_chunks_padded_shape():
    features = _features()
    eps = ragged_set(features.labels, 40, seed=1)
    shapes = episode_shapes(eps)
    real = eps.support >= 0
    assert shapes[:, 0].tolist() == real.sum(1).tolist() and shapes[:, 2].tolist() == eps.ways.tolist()
    budget = 1 << 20
    plan = plan_ragged(eps, 0, DIM, torch.device("cpu"), max_memory=budget, workers=1)
    # buckets: every episode once, and fewer padded rows than the chunks cut in episode order
    assert plan.order is not None and sorted(plan.order.tolist()) == list(range(40))
    plain = plan_chunks(
        40,
        int((shapes[:, 0] + shapes[:, 1]).max()),
        DIM,
        int(shapes[:, 2].max()),
        torch.device("cpu"),
        max_memory=budget,
        workers=1,
        shapes=shapes,
    )
    assert plan.padded_rows < plain.padded_rows and plan.real_rows == plain.real_rows
    assert plan.real_rows == int((shapes[:, 0] + shapes[:, 1]).sum())
    for p, sh in ((plan, shapes[plan.order]), (plain, shapes)):
        assert p.bounds[0][0] == 0 and p.bounds[-1][1] == 40
        assert all(b == c for (_, b), (c, _) in zip(p.bounds, p.bounds[1:]))
        for a, b in p.bounds:
            rows = int(sh[a:b, 0].max() + sh[a:b, 1].max())
            way = int(sh[a:b, 2].max())
            # the chunk at its padded shape fits the bound; one more episode would not (or none is left)
            assert b - a == 1 or (b - a) <= choose_chunk(rows, DIM, way, torch.device("cpu"), budget)
            assert b - a == 1 or (b - a) * episode_bytes(rows, DIM, way) <= budget
    # with room for many episodes a chunk, a bucket of more than a few pads at most BUCKET_WASTE
    # times its real rows
    roomy = plan_ragged(eps, 0, DIM, torch.device("cpu"), max_memory=1 << 28, workers=1)
    sh = shapes[roomy.order]
    assert any(b - a > BUCKET_LEAST["cpu"] for a, b in roomy.bounds)
    for a, b in roomy.bounds:
        if b - a > BUCKET_LEAST["cpu"]:
            assert (b - a) * int(sh[a:b, 0].max() + sh[a:b, 1].max()) <= BUCKET_WASTE * int(sh[a:b, :2].sum())
    # small episodes share bigger chunks than large ones
    sizes = [b - a for a, b in plan.bounds]
    assert max(sizes) > min(sizes)
    # the largest episode must fit on its own
    with pytest.raises(ConfigError, match="one episode"):
        plan_ragged(eps, 0, DIM, torch.device("cpu"), max_memory=1000, workers=1)


def test_a_ragged_set_is_checked_before_solving():
    features = _features()
    eps = ragged_set(features.labels, 4, seed=2)
    method = [("proto", "proto", {})]

    def broken(**change) -> EpisodeSet:
        fields = {k: v.clone() for k, v in change.items()}
        return EpisodeSet(**{**eps.__dict__, **fields})

    lab = eps.query_labels.clone()
    lab[1, 0] = int(eps.ways[1])  # a label past the episode's classes
    with pytest.raises(EpisodeError, match="episode 1 query entry 0"):
        evaluate(features, broken(query_labels=lab), method, run=RunOptions(device="cpu"))
    sup = eps.support.clone()
    other = int(torch.nonzero(features.labels != features.labels[sup[2, 0]])[0, 0])
    row = int(torch.nonzero(eps.support_labels[2] == eps.support_labels[2, 0])[-1, 0])
    if row == 0:  # the class has one shot: mix it through a query of the same label instead
        q = eps.query.clone()
        q[2, int(torch.nonzero(eps.query_labels[2] == eps.support_labels[2, 0])[0, 0])] = other
        bad = broken(query=q)
    else:
        sup[2, row] = other
        bad = broken(support=sup)
    with pytest.raises(EpisodeError, match="episode 2 label .* mixes classes"):
        evaluate(features, bad, method, run=RunOptions(device="cpu"))
    sup = eps.support.clone()
    sup[3, 0] = -1  # padding with a real label
    with pytest.raises(EpisodeError, match="episode 3 support entry 0"):
        evaluate(features, broken(support=sup), method, run=RunOptions(device="cpu"))


@pytest.mark.parametrize("source", ["sphere", "pool"])
def test_a_bucketed_chunk_holds_each_episodes_own_rows_and_negatives(source):
    features = _features()
    eps = ragged_set(features.labels, 9, seed=3)
    pool = torch.nn.functional.normalize(torch.randn(50, DIM, generator=torch.Generator().manual_seed(0)), dim=-1)
    spec = NegativeSpec("sphere" if source == "sphere" else "base", 4)
    neg = _Negatives(spec, None if source == "sphere" else pool, False, 4)
    cpu = torch.device("cpu")
    plain = Gatherer(features.features, eps, neg, cpu, torch.float32)
    ref = plain.gather(plain.prepare(0, 9))
    order = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    bucketed = Gatherer(features.features, eps, neg, cpu, torch.float32)
    bucketed.reorder(order)
    for a, b in ((0, 4), (4, 9)):
        chunk = bucketed.gather(bucketed.prepare(a, b))
        for i, e in enumerate(order[a:b].tolist()):
            assert torch.equal(chunk.negatives[i], ref.negatives[e])
            real_s, real_q = eps.support[e] >= 0, eps.query[e] >= 0
            ns, nq = int(real_s.sum()), int(real_q.sum())
            # the episode's rows first, then zero rows labelled -1 up to the chunk's largest
            assert torch.equal(chunk.support[i, :ns], features.features[eps.support[e, :ns]])
            assert torch.equal(chunk.query_labels[i, :nq], eps.query_labels[e, :nq])
            assert torch.all(chunk.support[i, ns:] == 0) and torch.all(chunk.support_labels[i, ns:] == -1)
            assert torch.all(chunk.query[i, nq:] == 0) and torch.all(chunk.query_labels[i, nq:] == -1)
        assert chunk.way == int(eps.ways[order[a:b]].max())
        assert chunk.support.shape[1] == int((eps.support[order[a:b]] >= 0).sum(1).max())
