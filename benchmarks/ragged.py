"""Ragged episodes, batched against one at a time: Meta-Dataset-style episodes at D = 640.

The workload: a synthetic split of clustered, L2-normalised features at D = 640 (100 classes of 20
to 600 images each, sizes drawn at random) and ``--episodes`` episodes of Meta-Dataset's shapes
drawn from it: by the project's sampler when :class:`~poodle.episodes.EpisodeSpec` has the
``protocol`` field (``protocol="meta-dataset"``), else by a local draw of the same published rules
(meta_dataset/data/sampling.py): ways uniform in [5, min(50, classes)]; q = min(10, min_c
floor(n_c / 2)) queries per class; support size S = min(500, sum_c floor(beta * min(100, n_c - q)
+ 1)) with beta ~ U[0, 1); per-class shots from weights n_c * exp(U[log 0.5, log 2]), each
floor(share * (S - ways)) + 1, at most n_c - q; images drawn at random within each class.

Every registered method that accepts ragged chunks is solved, one thread, through
:func:`poodle.evaluate.evaluate` three ways: batched on every episode with the default chunking in
buckets of similar size (what ``evaluate`` picks), batched in episode order (the plan without
buckets), and one episode at a time (``chunk_size=1``: each chunk cropped to its one episode, the
same code and configs) on an evenly spaced sample of ``--alone`` episodes, whose accuracies are
compared with the batched ones episode by episode. A method accepts ragged chunks when, on a small
padded chunk, each episode's result equals the one it gets alone (same predictions, probabilities
within 1e-6 in float64, no probability on a padded class); the others are listed as not ragged yet,
with what failed. The padding overhead (padded rows / real rows, support and query) is the plan's,
in episode order and in buckets, for this run on CPU and, as a plan only (nothing solved), for a
GPU chunking (``--gpu-memory``).

Methods read their default (the papers') options; the two that read negatives get ``--n-neg``
random ones. Episodes/s are of the whole ``evaluate`` call (planning, gathering, solving) in CPU
time (``time.process_time``, one thread: what a shared machine's load inflates far less than wall
time; the progress lines give wall time too).

    python benchmarks/ragged.py                          # 10,000 episodes, every method (hours on CPU)
    python benchmarks/ragged.py --episodes 1000 --alone 50 --methods proto,kmeans,paddle
    python benchmarks/ragged.py --plan-only              # the 10,000 episodes' padding plans only
    python benchmarks/ragged.py --quick                  # a tiny workload, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from poodle import evaluate as ev
from poodle import solvers
from poodle.cache import SplitFeatures
from poodle.episodes import EpisodeSet, EpisodeSpec
from poodle.negatives import NegativeSpec
from poodle.run import RunOptions
from poodle.solvers import EpisodeBatch
from poodle.utils import atomic_write

SPLIT = "test"
GOAL_SPEEDUP = 5.0
GOAL_PADDING = 1.5
# methods with no iteration (one closed-form pass): the 5x goal is for the iterative ones
NON_ITERATIVE = {"proto", "bd-cspn"}


# ---------------------------------------------------------------------------------------------
# The workload


def synthetic_split(n_classes: int, low: int, high: int, dim: int, seed: int, spread: float) -> SplitFeatures:
    """Clustered unit rows ``[N, dim]``: class ``c`` has a size drawn uniformly in ``low..high`` and
    its rows are its centre plus Gaussian noise of relative scale ``spread``, normalised."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(low, high + 1, n_classes)
    centres = rng.standard_normal((n_classes, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = np.repeat(np.arange(n_classes), sizes)
    x = centres[labels] + spread * rng.standard_normal((len(labels), dim)) / math.sqrt(dim) * 4
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return SplitFeatures(
        SPLIT,
        torch.from_numpy(x.astype(np.float32)),
        torch.from_numpy(labels.astype(np.int64)),
        [f"class{c:03d}" for c in range(n_classes)],
    )


def has_protocol() -> bool:
    """Whether the project's sampler draws Meta-Dataset episodes (``EpisodeSpec.protocol``)."""
    return "protocol" in {f.name for f in dataclasses.fields(EpisodeSpec)}


def project_draw(split: SplitFeatures, n_episodes: int, seed: int) -> EpisodeSet:
    """The project's sampler under ``protocol="meta-dataset"`` (its defaults are sampling.py's)."""
    from poodle.episodes import sample_episodes

    spec = EpisodeSpec(split=SPLIT, way=None, shot=None, query=None, seed=seed, protocol="meta-dataset")  # type: ignore[call-arg,arg-type]
    return sample_episodes(split.labels, spec, n_episodes, classes=split.classes)


def local_draw(split: SplitFeatures, n_episodes: int, seed: int) -> EpisodeSet:
    """Meta-Dataset's rules (module docstring), drawn here one episode at a time with numpy; rows
    class-major within an episode, index tensors padded with -1 to the largest episode."""
    rng = np.random.default_rng(seed)
    labels = split.labels.numpy()
    members = [np.flatnonzero(labels == c) for c in range(len(split.classes))]
    n_img = np.array([len(m) for m in members])
    C = len(members)
    eps = []
    for _ in range(n_episodes):
        ways = int(rng.integers(5, min(50, C) + 1))
        classes = rng.choice(C, ways, replace=False)
        n = n_img[classes]
        q = int(min(10, (n // 2).min()))
        rest = n - q
        beta = rng.random()
        size = int(min(500, np.floor(beta * np.minimum(100, rest) + 1).sum()))
        w = n * np.exp(rng.uniform(math.log(0.5), math.log(2.0), ways))
        shots = np.minimum(np.floor(w / w.sum() * (size - ways)).astype(np.int64) + 1, rest)
        s, ys, qr, yq = [], [], [], []
        for k, c in enumerate(classes):
            rows = rng.permutation(members[c])[: shots[k] + q]
            s.append(rows[: shots[k]])
            qr.append(rows[shots[k] :])
            ys.append(np.full(shots[k], k))
            yq.append(np.full(q, k))
        eps.append((np.concatenate(s), np.concatenate(ys), np.concatenate(qr), np.concatenate(yq), classes, ways))

    def pad(arrays: list[np.ndarray]) -> torch.Tensor:
        out = np.full((len(arrays), max(len(a) for a in arrays)), -1, dtype=np.int64)
        for i, a in enumerate(arrays):
            out[i, : len(a)] = a
        return torch.from_numpy(out)

    return EpisodeSet(
        pad([e[0] for e in eps]),
        pad([e[2] for e in eps]),
        pad([e[1] for e in eps]),
        pad([e[3] for e in eps]),
        None,
        EpisodeSpec(split=SPLIT, way=5, shot=1, query=1, seed=seed),  # the shapes are per episode (ways)
        class_ids=pad([e[4] for e in eps]),
        ways=torch.tensor([e[5] for e in eps], dtype=torch.int64),
    )


def take(eps: EpisodeSet, rows: torch.Tensor) -> EpisodeSet:
    """The episodes ``rows`` of ``eps`` (their episode numbers kept, so their negatives too),
    cropped to their largest."""
    fields = ("support", "query", "support_labels", "query_labels", "negatives", "index", "class_ids", "ways")
    sub = dataclasses.replace(eps, **{f: None if getattr(eps, f) is None else getattr(eps, f)[rows] for f in fields})
    return ev.crop_ragged(sub)[0]


def shape_summary(eps: EpisodeSet) -> dict[str, tuple[float, float, float]]:
    """min / mean / max of the support rows, query rows and ways per episode."""
    s = ev.episode_shapes(eps).double()  # [E, 3]: support rows, query rows, ways
    names = ("support rows", "query rows", "ways")
    return {k: (s[:, i].min().item(), s[:, i].mean().item(), s[:, i].max().item()) for i, k in enumerate(names)}


# ---------------------------------------------------------------------------------------------
# Which methods accept ragged chunks


def probe_batch(split: SplitFeatures, n_neg: int, seed: int) -> EpisodeBatch:
    """A small float64 chunk of four episodes of different ways, shots and queries, padded."""
    g = torch.Generator().manual_seed(seed)
    x, lab = split.features.double(), split.labels
    shapes = [
        ([3, 1, 2], [2, 1, 3]),
        ([1, 4, 2, 1, 3], [1, 2, 2, 1, 1]),
        ([2, 2], [3, 1]),
        ([1, 1, 5, 2], [2, 3, 1, 1]),
    ]
    out = []
    for shots, queries in shapes:
        classes = torch.randperm(int(lab.max()) + 1, generator=g)[: len(shots)]
        s, ys, q = [], [], []
        for k, c in enumerate(classes.tolist()):
            rows = torch.nonzero(lab == c).flatten()
            rows = rows[torch.randperm(len(rows), generator=g)[: shots[k] + queries[k]]]
            s.append(x[rows[: shots[k]]])
            ys += [k] * shots[k]
            q.append(x[rows[shots[k] :]])
        neg = torch.nn.functional.normalize(torch.randn(1, n_neg, x.shape[1], generator=g, dtype=torch.float64), dim=-1)
        out.append(EpisodeBatch(torch.cat(s)[None], torch.tensor(ys)[None], torch.cat(q)[None], neg, len(shots)))
    return EpisodeBatch.stack(out)


def ragged_reason(method: str, batch: EpisodeBatch, tol: float = 1e-6) -> str | None:
    """``None`` when ``method`` (default options) gives each episode of the padded ``batch`` the
    result it gets alone; else what went wrong."""
    cfg = solvers.make_config(method, {})
    try:
        padded = ev.solve_batch(batch, method, cfg)
    except Exception as e:  # noqa: BLE001 - any failure on a padded chunk is the reason to report
        return f"fails on a padded chunk: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if padded.shape[:2] != batch.query.shape[:2] or padded.shape[2] != batch.way:
        want = (*batch.query.shape[:2], batch.way)
        return f"returns log-probabilities of shape {tuple(padded.shape)} on a padded chunk, not {want}"
    for e in range(batch.n_episodes):
        alone = ev.solve_batch(batch.episode(e), method, cfg)[0]
        rows = batch.query_mask[e] if batch.query_mask is not None else slice(None)
        got = padded[e, rows]
        way = alone.shape[1]
        if bool((got[:, way:].exp() > 0).any()):
            return f"puts probability on a padded class (episode {e} of a padded chunk)"
        if not torch.equal(got[:, :way].argmax(-1), alone.argmax(-1)):
            return f"predicts differently in a padded chunk than alone (episode {e})"
        diff = (got[:, :way].exp() - alone.exp()).abs().max().item()
        if not diff <= tol:
            return f"probabilities in a padded chunk differ from alone by {diff:.2g} (episode {e})"
    return None


# ---------------------------------------------------------------------------------------------
# Solving


@contextmanager
def episode_order() -> Iterator[None]:
    """``evaluate`` planning ragged chunks in episode order: :func:`poodle.evaluate.plan_ragged`'s
    plan without buckets (its first candidate) stands in for the plan it picks, for the block."""
    picked = ev.plan_ragged

    def plain(episodes: EpisodeSet, n_neg: int, dim: int, device: torch.device, **kw: Any) -> ev.ChunkPlan:
        shapes = ev.episode_shapes(episodes)
        n_rows = int((shapes[:, 0] + shapes[:, 1]).max()) + n_neg
        return ev.plan_chunks(len(episodes), n_rows, dim, int(shapes[:, 2].max()), device, shapes=shapes, **kw)

    ev.plan_ragged = plain  # type: ignore[assignment]
    try:
        yield
    finally:
        ev.plan_ragged = picked  # type: ignore[assignment]


def solve(split: SplitFeatures, eps: EpisodeSet, method: str, negatives: NegativeSpec, **kw: Any) -> dict[str, Any]:
    """One :func:`evaluate` call of ``method`` (default options) on one thread (``kw``: more of its
    :class:`~poodle.run.RunOptions`, ``chunk_size``): accuracies, CPU and wall seconds, the plan's rows
    and chunks."""
    plans: list[ev.ChunkPlan] = []
    t, c = time.perf_counter(), time.process_time()
    acc = ev.evaluate(
        split,
        eps,
        [(method, method, None)],
        negatives=negatives,
        run=RunOptions(device="cpu", workers=1, **kw),
        hooks=ev.Hooks(planned=plans.append),
    )[method]
    cpu, wall = time.process_time() - c, time.perf_counter() - t
    plan = plans[0]
    return {
        "acc": acc, "seconds": cpu, "wall": wall, "real": plan.real_rows, "padded": plan.padded_rows,
        "chunks": len(plan.bounds), "chunk": plan.chunk,
    }  # fmt: skip


def padding_plans(eps: EpisodeSet, dim: int, n_neg: int, gpu_memory: str) -> dict[str, dict[str, float]]:
    """Padded rows / real rows of the plans (nothing solved): on CPU at the default memory bound and
    on a GPU bound of ``gpu_memory``, each in episode order and in buckets; ``n_neg`` negatives
    count in each chunk's memory."""
    out = {}
    for where, device, kw in (
        ("cpu", torch.device("cpu"), {"workers": 1}),
        ("gpu", torch.device("cuda"), {"max_memory": gpu_memory}),
    ):
        with episode_order():
            plain = ev.plan_ragged(eps, n_neg, dim, device, **kw)
        picked = ev.plan_ragged(eps, n_neg, dim, device, **kw)
        out[where] = {
            "episode_order": plain.padded_rows / plain.real_rows,
            "episode_order_chunks": len(plain.bounds),
            "buckets": picked.padded_rows / picked.real_rows,
            "buckets_chunks": len(picked.bounds),
            "bucketed": picked.order is not None,
        }  # fmt: skip
    return out


def run_method(
    split: SplitFeatures,
    eps: EpisodeSet,
    sample: torch.Tensor,
    method: str,
    negatives: NegativeSpec,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """The three timings of one method and the episode-by-episode agreement on the sample
    (``chunk_size``: the batched calls' chunks, ``None`` for the planned ones)."""
    n_neg = negatives.n_neg if solvers.get(method).needs_negatives(solvers.make_config(method, {})) else 0
    buckets = solve(split, eps, method, negatives, chunk_size=chunk_size)
    with episode_order():
        plain = solve(split, eps, method, negatives, chunk_size=chunk_size)
    alone = solve(split, take(eps, sample), method, negatives, chunk_size=1)
    E, K = len(eps), len(sample)
    agree = int((alone["acc"] == buckets["acc"][sample]).sum())
    agree_plain = int((plain["acc"] == buckets["acc"]).sum())
    # the episodes whose accuracy is not the same in all three runs (one at a time: the sample only)
    differ = (plain["acc"] != buckets["acc"]).clone()
    differ[sample] |= (alone["acc"] != buckets["acc"][sample]) | (alone["acc"] != plain["acc"][sample])
    eps_b, eps_p, eps_a = E / buckets["seconds"], E / plain["seconds"], K / alone["seconds"]
    return {
        "method": method,
        "iterative": method not in NON_ITERATIVE,
        "n_neg": n_neg,
        "episodes": E,
        "alone_episodes": K,
        "eps_buckets": eps_b,
        "eps_episode_order": eps_p,
        "eps_alone": eps_a,
        "wall_eps_buckets": E / buckets["wall"],
        "wall_eps_alone": K / alone["wall"],
        "chunk_buckets": buckets["chunk"],
        "speedup": eps_b / eps_a,
        "speedup_episode_order": eps_p / eps_a,
        "agree": agree,
        "agree_episode_order": agree_plain,
        "differ": torch.nonzero(differ).flatten().tolist(),
        "padding_buckets": buckets["padded"] / buckets["real"],
        "padding_episode_order": plain["padded"] / plain["real"],
        "chunks_buckets": buckets["chunks"],
        "chunks_episode_order": plain["chunks"],
        "accuracy": float(buckets["acc"].mean()),
    }


def profile(split: SplitFeatures, eps: EpisodeSet, method: str, negatives: NegativeSpec, **kw: Any) -> dict[str, Any]:
    """Where one :func:`evaluate` call of ``method`` spends its CPU time (``torch.profiler``): the
    operations per episode, their mean self time, and the three largest shares by operation."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        solve(split, eps, method, negatives, **kw)
    ops = [o for o in prof.key_averages() if o.key.startswith("aten::")]
    total = sum(o.self_cpu_time_total for o in ops) or 1.0
    count = sum(o.count for o in ops)
    top = sorted(ops, key=lambda o: -o.self_cpu_time_total)[:3]
    return {
        "ops_per_episode": count / len(eps),
        "us_per_op": total / max(count, 1),
        "top": [(o.key, o.self_cpu_time_total / total) for o in top],
    }


def op_cost_us(n: int = 20000) -> float:
    """The CPU time of one tiny torch operation (a one-element add): what batching saves per
    operation it does once for a chunk instead of once per episode."""
    x = torch.zeros(1)
    t = time.process_time()
    for _ in range(n):
        torch.add(x, x)
    return (time.process_time() - t) / n * 1e6


def batching_bound(r: dict[str, Any], op_us: float) -> tuple[float, float]:
    """``(share, bound)``: the share of a one-at-a-time episode's CPU time that its operations'
    fixed cost explains (operations per episode x :func:`op_cost_us`), and the speedup batching
    would reach if it removed all of that fixed cost and nothing else (``1 / (1 - share)``)."""
    share = min(1.0, r["profile_alone"]["ops_per_episode"] * op_us / (1e6 / r["eps_alone"]))
    return share, (math.inf if share >= 1.0 else 1.0 / (1.0 - share))


def profile_line(label: str, p: dict[str, Any]) -> str:
    top = ", ".join(f"{k} {100 * share:.0f}%" for k, share in p["top"])
    return f"{label}: {p['ops_per_episode']:,.0f} ops/episode at {p['us_per_op']:.1f} us self time each; {top}"


# ---------------------------------------------------------------------------------------------
# The report


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | ep/s batched (buckets) | ep/s batched (episode order) | ep/s one at a time | speedup "
        "| agree (one at a time) | agree (episode order) | padding order / buckets | accuracy |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        mark = "" if not r["iterative"] or r["speedup"] >= GOAL_SPEEDUP else " (below 5x)"
        lines.append(
            f"| {r['method']} | {r['eps_buckets']:.1f} | {r['eps_episode_order']:.1f} | {r['eps_alone']:.1f} "
            f"| {r['speedup']:.1f}x{mark} | {r['agree']}/{r['alone_episodes']} "
            f"| {r['agree_episode_order']}/{r['episodes']} "
            f"| {r['padding_episode_order']:.2f}x / {r['padding_buckets']:.2f}x | {100 * r['accuracy']:.1f}% |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=10000, help="episodes solved batched (default 10000)")
    p.add_argument("--alone", type=int, default=200, help="episodes solved one at a time: an evenly spaced sample")
    p.add_argument("--methods", default="all", help="comma-separated method names (default: every registered one)")
    p.add_argument("--dim", type=int, default=640)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--images", default="20-600", help="images per class, LOW-HIGH (drawn per class)")
    p.add_argument("--spread", type=float, default=1.0, help="noise scale of the clusters (accuracy)")
    p.add_argument("--n-neg", type=int, default=400, help="random negatives, for the methods that read them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory", default="40GiB", help="the memory bound of the GPU padding plan")
    p.add_argument("--local-draw", action="store_true", help="draw by the local rules even when the sampler has them")
    p.add_argument("--chunk-size", type=int, help="episodes per batched chunk (default: evaluate's plan)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="profile each method on this many of the sample's episodes, batched and one at a time",
    )
    p.add_argument("--plan-only", action="store_true", help="the workload and its padding plans only, nothing solved")
    p.add_argument("--json", help="also write the results here (JSON)")
    p.add_argument("--quick", action="store_true", help="a tiny workload (40 episodes, D=64, 20 classes) for tests")
    a = p.parse_args(argv)
    if a.quick:
        a.episodes, a.alone, a.dim, a.classes, a.images, a.n_neg = 40, 10, 64, 20, "20-120", 20
    a.alone = min(a.alone, a.episodes)
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    torch.set_num_threads(1)
    low, high = (int(v) for v in a.images.split("-"))
    split = synthetic_split(a.classes, low, high, a.dim, a.seed, a.spread)
    t = time.perf_counter()
    project = has_protocol() and not a.local_draw
    eps = project_draw(split, a.episodes, a.seed) if project else local_draw(split, a.episodes, a.seed)
    draw_s = time.perf_counter() - t
    sample = torch.linspace(0, a.episodes - 1, a.alone).round().long().unique()
    names = solvers.available() if a.methods == "all" else [solvers.get(m).name for m in a.methods.split(",")]
    negatives = NegativeSpec("random", a.n_neg)

    shapes = shape_summary(eps)
    print(
        f"{a.episodes} episodes ({'the project sampler' if project else 'local draw'}, Meta-Dataset rules, drawn in "
        f"{draw_s:.1f} s) from {a.classes} classes of {low}-{high} images at D={a.dim}; one thread; "
        f"one at a time on {len(sample)} evenly spaced episodes"
    )
    for k, (lo, mean, hi) in shapes.items():
        print(f"  {k} per episode: {lo:.0f} / {mean:.1f} / {hi:.0f} (min / mean / max)")
    plans = padding_plans(eps, a.dim, 0, a.gpu_memory)
    for where, p in plans.items():
        what = "CPU, one worker" if where == "cpu" else f"GPU plan at {a.gpu_memory}"
        print(
            f"padding (padded rows / real rows), {what}, no negatives: episode order {p['episode_order']:.2f}x "
            f"({p['episode_order_chunks']} chunks), buckets {p['buckets']:.2f}x ({p['buckets_chunks']} chunks)"
        )

    if a.plan_only:
        return {"episodes": a.episodes, "dim": a.dim, "shapes": shapes, "padding_plans": plans}
    probe = probe_batch(split, 8, a.seed)
    ragged, not_ragged = [], {}
    for m in names:
        why = ragged_reason(m, probe)
        if why is None:
            ragged.append(m)
        else:
            not_ragged[m] = why
    rows = []
    for m in ragged:
        rows.append(run_method(split, eps, sample, m, negatives, a.chunk_size))
        r = rows[-1]
        print(
            f"  {m}: {r['eps_buckets']:.1f} ep/s batched, {r['eps_alone']:.1f} one at a time "
            f"({r['speedup']:.1f}x; wall {r['wall_eps_buckets']:.1f} and {r['wall_eps_alone']:.1f}); "
            f"largest chunk {r['chunk_buckets']}; agree {r['agree']}/{r['alone_episodes']}"
            + (f"; episodes whose accuracy differs between the runs: {r['differ'][:10]}" if r["differ"] else ""),
            flush=True,
        )
    if a.profile:
        few = take(eps, sample[: a.profile])
        op_us = op_cost_us()
        print(f"  one tiny torch operation costs {op_us:.1f} us of CPU time here")
        for r in rows:
            m = r["method"]
            r["profile_batched"] = profile(split, few, m, negatives, chunk_size=a.chunk_size)
            r["profile_alone"] = profile(split, few, m, negatives, chunk_size=1)
            print(profile_line(f"  profile {m}, batched", r["profile_batched"]))
            print(profile_line(f"  profile {m}, one at a time", r["profile_alone"]), flush=True)
            r["op_share"], r["batching_bound"] = batching_bound(r, op_us)
            print(
                f"  {m}: the fixed cost of its operations is {100 * r['op_share']:.1f}% of an episode solved alone: "
                f"batching that removed all of it would be {r['batching_bound']:.2f}x faster",
                flush=True,
            )
    print()
    print(table(rows))
    for m, why in not_ragged.items():
        print(f"not ragged yet: {m}: {why}")
    short = [r["method"] for r in rows if r["iterative"] and r["speedup"] < GOAL_SPEEDUP]
    print(f"iterative methods below {GOAL_SPEEDUP:.0f}x batched: {', '.join(short) or 'none'}")
    result = {
        "episodes": a.episodes,
        "alone": len(sample),
        "dim": a.dim,
        "sampler": "project" if project else "local",
        "shapes": shapes,
        "padding_plans": plans,
        "rows": rows,
        "not_ragged": not_ragged,
        "below_goal": short,
    }
    if a.json:
        atomic_write(a.json, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
