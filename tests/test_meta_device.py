"""Every registered method runs on torch's ``meta`` device (a CUDA run without the arithmetic) and
makes at most one host sync per 150 device operations (or one in all); checking convergence seldom
(as on a GPU) leaves every episode's result as checking it every iteration (as on the CPU).

On the meta device a tensor has a shape and no values, so every read of a value on the host
(``.item()``, ``bool(t)``, ``.tolist()``: ``aten._local_scalar_dense``) would fail; the cost
model's tracer (``poodle.costmodel._tracer``) answers each one with a fixed value and counts it,
counts the decompositions whose CUDA kernels read their error codes back (``eigh``, ``svd``), and
counts every other operation that moves data (a kernel launch on a GPU). Answered False, every
convergence loop stops at its first look (``bool(active.any())`` False: all converged) and every
guarded fallback (protoLP's ``bad.any()``) is skipped; answered True, every loop runs to its cap
and every fallback is taken.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from poodle import costmodel as cm
from poodle import solvers
from poodle.solvers import _transductive as tr
from poodle.solvers import backend as _backend

OPS_PER_SYNC = 150


def _few_syncs(trace: cm.Trace) -> bool:
    """At most one sync per OPS_PER_SYNC operations, or one in all: every chunk is read back once
    anyway (its accuracies), so one sync per call costs nothing more (mean-shift's 134 operations
    hold one eigen-decomposition, whose CUDA error check, or copy to the host, is a sync)."""
    return trace.syncs <= max(1, trace.launches // OPS_PER_SYNC)


META_BATCH = cm.standard_batch(cm.Workload(n_neg=40), episodes=3).to("meta")

# caps that keep the answered-True runs (every loop to its cap) short on the meta device
CAPPED = {
    "kmeans": {"max_iter": 40},
    "bayes-kmeans": {"max_iter": 40},
    "pt-map": {"steps": 2, "sinkhorn_max_iter": 48},
    "proto-lp": {"steps": 2, "sinkhorn_max_iter": 48},
    "laplacianshot": {"steps": 24},
}


def _config(name: str, **options):
    info = solvers.get(name)
    if info.transductive == "optional":
        options.setdefault("transductive", True)
    return solvers.make_config(name, options, strict=True)


def _meta_run(name: str, cfg, answer: bool) -> tuple[cm.Trace, solvers.SolverOutput]:
    info = solvers.get(name)
    batch = META_BATCH if info.needs_negatives(cfg) else dataclasses.replace(META_BATCH, negatives=None)
    with cm._tracer(batch.n_episodes, answer=answer) as mode:
        out = solvers.run(name, batch, cfg)
    return mode.trace, out


STEP_CAP = 6  # every step of a method repeats the same operations: 6 show the ratio as 1,000 would


def _default_config(name: str):
    """The method's defaults, its step count capped at STEP_CAP (the test's time)."""
    fields = solvers.get(name).options()
    cfg = _config(name)
    return _config(name, steps=min(cfg.steps, STEP_CAP)) if "steps" in fields else cfg


@pytest.mark.parametrize("name", solvers.available())
def test_every_method_runs_on_meta_with_few_syncs(name):
    trace, out = _meta_run(name, _default_config(name), answer=False)
    E, Nq, way = META_BATCH.n_episodes, META_BATCH.query.shape[1], META_BATCH.way
    assert out.log_probs.device.type == "meta" and out.log_probs.shape == (E, Nq, way)
    assert trace.launches > 0
    assert _few_syncs(trace), (name, trace.launches, trace.syncs)


@pytest.mark.parametrize("name", sorted(CAPPED))
def test_loops_to_their_caps_sync_once_per_150_operations(name):
    trace, out = _meta_run(name, _config(name, **CAPPED[name]), answer=True)
    assert out.log_probs.device.type == "meta"
    assert trace.syncs >= 2  # the loops did look, more than once
    assert _few_syncs(trace), (name, trace.launches, trace.syncs)


def test_loops_look_once_per_eight_iterations_off_the_cpu():
    # k-means to its cap of 40 iterations: 5 looks, not 40
    trace, _ = _meta_run("kmeans", _config("kmeans", max_iter=40), answer=True)
    assert trace.syncs == 40 // tr.CHECK_EVERY
    # LaplacianShot's 24 bound iterations: 3 looks
    trace, _ = _meta_run("laplacianshot", _config("laplacianshot", steps=24), answer=True)
    assert trace.syncs == 24 // tr.CHECK_EVERY


def test_should_stop_schedule():
    cpu_active = torch.tensor([True, False])
    done = torch.tensor([False, False])
    # the CPU looks every iteration
    assert not tr.should_stop(cpu_active, 0) and tr.should_stop(done, 0)
    with _backend.active(_backend.Backend(device_schedule=True)):
        # a GPU's schedule: only after iterations 7, 15, ... (0-based)
        assert [tr.should_stop(done, it) for it in range(17)] == [it in (7, 15) for it in range(17)]
        assert not tr.should_stop(cpu_active, 7)
        assert tr.should_stop(done, 15, every=16) and not tr.should_stop(done, 7, every=16)
    assert tr.should_stop(done, 3)  # the schedule is restored


# every method with a convergence loop (or a guarded fallback), with options that make the loops
# stop at different iterations in different episodes
SCHEDULED = [
    ("kmeans", {}),
    ("kmeans", {"fix_support": False}),
    ("bayes-kmeans", {}),
    ("laplacianshot", {}),
    ("laplacianshot", {"preset": "official"}),
    ("laplacianshot", {"tol": 0.0, "steps": 13}),
    ("pt-map", {"steps": 3}),
    ("pt-map", {"steps": 2, "sinkhorn_tol": 1e-9, "sinkhorn_max_iter": 37}),
    ("proto-lp", {"steps": 3}),
    ("proto-lp", {"steps": 2, "balanced": False}),
]


def _random_batch(E: int, dtype: torch.dtype, seed: int) -> solvers.EpisodeBatch:
    """Episodes of 5 classes, 1-3 shots, 10 queries each, D = 24, centres close enough that the
    loops take different numbers of iterations in different episodes."""
    g = torch.Generator().manual_seed(seed)
    way, shot, query, D = 5, 1 + seed % 3, 10, 24
    centres = torch.randn(E, way, D, generator=g, dtype=torch.float64)

    def around(per: int) -> torch.Tensor:
        x = centres.repeat_interleave(per, 1) + 0.9 * torch.randn(E, way * per, D, generator=g, dtype=torch.float64)
        return torch.nn.functional.normalize(x, dim=-1).to(dtype)

    labels = torch.arange(way).repeat_interleave(shot).expand(E, -1).contiguous()
    return solvers.EpisodeBatch(around(shot), labels, around(query), None, way)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,options", SCHEDULED)
def test_checking_seldom_changes_no_episode(name, options, dtype, monkeypatch):
    # the torch formulation on both schedules (on the CPU the Sinkhorn methods' own schedule is
    # otherwise the fused C loop, whose bits are its own: tests/test_sinkhorn_family.py)
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=False))
    batch = _random_batch(12, dtype, seed=len(options) + len(name))
    cfg = _config(name, **options)
    every = solvers.run(name, batch, cfg)  # the CPU's own schedule: a look every iteration
    seldom = solvers.run(name, batch, cfg, backend=_backend.Backend(native=False, device_schedule=True))
    assert torch.equal(every.log_probs, seldom.log_probs)
    assert every.state.keys() == seldom.state.keys()
    for key, value in every.state.items():
        assert torch.equal(value, seldom.state[key]), key
    iters = every.state.get("iterations")
    if iters is not None and name != "laplacianshot":
        assert iters.unique().numel() > 1  # episodes did stop at different iterations


def test_batched_eigh_is_lapack_per_matrix():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(130, 12, 7, generator=g)
    a = x @ x.mT
    w, v = tr.batched_eigh(a)
    for i in (0, 64, 129):
        wi, vi = torch.linalg.eigh(a[i])
        assert torch.equal(w[i], wi) and torch.equal(v[i], vi)
    # split over host threads: the same numbers
    w2, v2 = tr._host_map(torch.linalg.eigh, a, 2)
    assert torch.equal(w, w2) and torch.equal(v, v2)
    u, s, vh = tr.batched_svd(x)
    u1, s1, vh1 = torch.linalg.svd(x[5], full_matrices=False)
    assert torch.equal(s[5], s1) and torch.equal(vh[5], vh1) and torch.equal(u[5], u1)
    assert torch.get_num_threads() >= 1


def test_decompositions_leave_cuda_batches_above_32_to_the_host():
    class Cuda:  # what _on_host reads of a CUDA tensor
        def __init__(self, *shape: int) -> None:
            self.shape, self.device = shape, torch.device("cuda")

        def dim(self) -> int:
            return len(self.shape)

    assert tr._on_host(Cuda(4096, 80, 80))  # Bayes k-means' and mean-shift's Gram matrices
    assert tr._on_host(Cuda(4096, 80, 640))  # protoLP's SVD
    assert not tr._on_host(Cuda(4096, 32, 32))  # the batched cuSOLVER routines take these
    assert not tr._on_host(Cuda(80, 80))  # one matrix: the device's own solver
    assert not tr._on_host(torch.zeros(3, 80, 80, device="meta"))


def test_flops_of_stopping_methods_are_linear_in_their_iterations():
    # benchmarks/solver.py --methods counts them at the measured mean iterations by interpolation
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_solver", Path(__file__).resolve().parents[1] / "benchmarks" / "solver.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, field in bench._ITER_FIELDS.items():
        info = solvers.get(name)
        f = [info.flops(5, 75, 0, 640, 5, _config(name, **{field: k})) for k in (0, 1, 2, 7)]
        assert f[2] - f[1] == pytest.approx(f[1] - f[0]) and f[3] == pytest.approx(f[0] + 7 * (f[1] - f[0]))
        assert bench.episode_flops(name, _config(name), 2.5) == pytest.approx(f[0] + 2.5 * (f[1] - f[0]))
    # k-means, 1 update: the support means, 2 assignment passes over the queries, 1 update over all
    # rows, the final logits
    km = bench.episode_flops("kmeans", _config("kmeans"), 1.0)
    assert km == 2 * 640 * 5 * (5 + 2 * 75 + 80 + 75)
