"""The GPU cost model (poodle/costmodel.py): its arithmetic on known cases, its traced byte counts
against a count written out by hand, and its extrapolation of fixed-step methods against a full trace."""

from __future__ import annotations

import math

import pytest
import torch

from poodle import costmodel as cm
from poodle.solvers import _optim
from poodle.solvers import backend as _backend
from poodle.solvers._optim import RowTerms


def test_poodle_standard_workload_by_hand():
    # 5 support + 75 queries + 400 negatives = 480 rows of 640 float32: 1.23 MB an episode
    assert cm.row_bytes(480, 640) == 1_228_800
    # the torch formulation reads them twice a step: 250 steps x 10,000 episodes x 2.46 MB = 6.1 TB
    rows_twice = 250 * 10_000 * 2 * cm.row_bytes(480, 640)
    assert rows_twice == pytest.approx(6.144e12)
    assert rows_twice / cm.H100_SXM.bandwidth == pytest.approx(1.834, abs=1e-3)
    assert rows_twice / cm.H100_PCIE.bandwidth == pytest.approx(3.072, abs=1e-3)
    # the rows are 81% of everything a torch step moves; the Triton step moves 45% of it
    step = cm.torch_step_bytes(480, 640, 5)
    assert 2 * cm.row_bytes(480, 640) / step == pytest.approx(0.814, abs=1e-3)
    assert cm.triton_step_bytes(480, 640, 5)["dram"] / step == pytest.approx(0.4456, abs=1e-3)


def _traced_step(n, D, K, free, learn_scale):
    E = 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(E, n, D, generator=g)
    fr = torch.ones(1, 1, n) if free else None
    terms = RowTerms(torch.rand(E, K, n, generator=g), torch.rand(1, 1, n, generator=g), torch.rand(1, 1, n), fr)
    w0 = torch.randn(E, K, D, generator=g)
    moved = []
    with _backend.active(_backend.Backend(native=False)):
        for steps in (1, 2):
            with cm._tracer(E) as mode:
                _optim.fit_weighted_distance(x, terms, w0, steps=steps, learn_scale=learn_scale)
            moved.append(mode.trace.bytes)
    return moved[1] - moved[0]


@pytest.mark.parametrize("free", [False, True])
@pytest.mark.parametrize("learn_scale", [True, False])
def test_traced_step_equals_the_count_by_hand(free, learn_scale):
    for n, D, K in [(37, 27, 7), (480, 640, 5)]:
        assert _traced_step(n, D, K, free, learn_scale) == cm.torch_step_bytes(n, D, K, free, learn_scale)


def test_tracer_counts_syncs_views_and_broadcasts():
    x = torch.ones(3, 4)
    with cm._tracer(1) as mode:
        x.sum().item()  # one reduction, one sync
        bool((x > 0).any())  # a comparison, a reduction, one sync
        x.t().expand(2, 4, 3)  # views: nothing moved
        x[:1].expand(5, 4) + 1.0  # the broadcast row is read once: 16 bytes in, 80 out
    tr = mode.trace
    assert tr.syncs == 2
    assert tr.launches == 4
    assert tr.op_bytes[-1] == 16 + 80
    assert tr.op_bytes[0] == 48 + 4


def test_extrapolated_trace_equals_a_full_trace():
    batch = cm.standard_batch(cm.Workload(dim=32, n_neg=20), episodes=2)
    opts = {"transductive": True, "steps": 6}
    a = cm.trace("poodle", opts, batch)
    b = cm.trace("poodle", opts, batch, extrapolate=False)
    assert sorted(a.op_bytes) == sorted(b.op_bytes) and a.launches == b.launches
    assert (a.syncs, a.matmul_flops) == (b.syncs, b.matmul_flops)
    c = cm.trace("tim-gd", {"steps": 5}, batch)
    d = cm.trace("tim-gd", {"steps": 5}, batch, extrapolate=False)
    assert a.bytes > 0 and sorted(c.op_bytes) == sorted(d.op_bytes) and c.syncs == d.syncs


def test_prediction_by_hand():
    tr = cm.Trace(op_bytes=[1e6, 10.0], syncs=2)
    got = cm.predict(tr, flops=0.0, gpu=cm.H100_SXM, episodes=10_000)
    want = 0.0
    for c in (4096, 4096, 1808):
        device = c * 1e6 / 3.35e12 + max(c * 10.0 / 3.35e12, cm.KERNEL_FLOOR_S)
        want += max(device, 2 * cm.HOST_OP_S) + 2 * cm.SYNC_S
    assert got == pytest.approx(want, rel=1e-12)
    # compute-bound when the FLOPs say so: 1 GFLOP an episode at 67 TFLOP/s
    assert cm.predict(tr, flops=1e9, gpu=cm.H100_SXM) == pytest.approx(1e13 / 67e12 + 6 * cm.SYNC_S, rel=1e-9)
    assert cm.chunks(10_000) == [4096, 4096, 1808]


def test_resident_groups_pay_for_tim_not_for_poodle():
    # TIM-GD's 80 rows of 640 floats and 5 prototypes: 256,000 bytes; half of 50 MiB holds 102
    assert cm.resident_group(80, 640, 5, cm.H100_SXM) == 102
    tim = cm.triton_seconds(80, 640, 5, 1000, 10_000, cm.H100_SXM, n_support=5)
    assert tim["resident"] < tim["stream"]
    # POODLE's 480 rows: 20 episodes fill the share, a seventh of the SMs; streaming wins
    assert cm.resident_group(480, 640, 5, cm.H100_SXM) == 20
    poodle = cm.triton_seconds(480, 640, 5, 250, 10_000, cm.H100_SXM)
    assert poodle["stream"] < poodle["resident"]
    # streaming POODLE is memory-bound: 250 x 10,000 x 1.34 MB at 3.35 TB/s
    assert poodle["stream"] == pytest.approx(250 * 10_000 * 1_344_640 / 3.35e12, rel=1e-12)
    assert math.isclose(poodle["group"], 20)


def test_steps_and_flops_of_the_registered_methods():
    from poodle import solvers

    cfg = solvers.make_config("tim-gd", {})
    assert cm.method_steps("tim-gd", cfg) == 1000
    assert cm.method_steps("kmeans", solvers.make_config("kmeans", {})) == 250
    assert cm.method_steps("can-t", solvers.make_config("can-t", {})) == 2
    pcfg = solvers.make_config("poodle", {"transductive": True})
    assert cm.method_flops("poodle", pcfg, uses_negatives=True) == solvers.get("poodle").flops(5, 75, 400, 640, 5, pcfg)
    rows = cm.table([("entropy-min", {}), ("soft-kmeans", {})], cm.Workload(dim=32), traced_episodes=2)
    assert [r.method for r in rows] == ["entropy-min", "soft-kmeans"]
    for r in rows:
        assert r.bytes > 0 and r.flops > 0 and r.launches > 0 and r.flops_source == "registered"
        assert set(r.seconds) == {"H100 SXM", "H100 PCIe", "H200"}
        assert r.seconds["H100 PCIe"] >= r.seconds["H100 SXM"] >= r.seconds["H200"]
    text = cm.markdown(rows, {"entropy-min": 100.0})
    assert "| entropy-min | 25 |" in text and "100.0" in text


def test_expected_maximum_of_k_iteration_counts():
    # counts 1..m equally likely: E[max of k] = m - sum_{i<m} (i/m)^k, exactly
    m = 10
    for k in (1, 2, 4, 40, 4096):
        assert cm.expected_max(range(1, m + 1), k) == pytest.approx(m - sum((i / m) ** k for i in range(1, m)))
    assert cm.expected_max([3, 5], 1) == pytest.approx(4.0)  # one episode: the mean
    # 99 episodes converge in 100 sweeps, one in 400: a chunk of 40 meets it a third of the time
    counts = [100] * 99 + [400]
    assert cm.expected_max(counts, 40) == pytest.approx(100 + 300 * (1 - 0.99**40))
    # a Monte-Carlo check of the same
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor(counts, dtype=torch.float64)[torch.randint(0, 100, (20_000, 40), generator=g)]
    assert draws.amax(1).mean().item() == pytest.approx(cm.expected_max(counts, 40), rel=0.03)
    with pytest.raises(ValueError):
        cm.expected_max([], 3)


def test_masked_loops_scale_to_the_slowest_episode_of_the_chunk():
    # two loop calls per episode; the trace of 2 episodes ran each to the slower of its 2
    counts = [[10, 1], [20, 1], [30, 1], [40, 1]]
    scale = cm.loop_scale(counts, traced=2)
    base = cm.expected_max([10, 20, 30, 40], 2) + 1
    assert scale(2) == pytest.approx(1.0)
    assert scale(40) == pytest.approx((cm.expected_max([10, 20, 30, 40], 40) + 1) / base)
    assert scale(40) > scale(8) > 1.0 and scale(4096) == pytest.approx(41 / base, rel=1e-9)
    assert cm.loop_scale([], 4)(4096) == 1.0
    # the prediction repeats the loop's operations and syncs: here op 1 and one sync, 3 times over
    tr = cm.Trace(op_bytes=[1e6, 10.0], syncs=2, loop_ops=[1], loop_syncs=1)
    got = cm.predict(tr, flops=0.0, gpu=cm.H100_SXM, episodes=4096, loops=lambda c: 3.0)
    device = 4096 * 1e6 / 3.35e12 + 3 * max(4096 * 10.0 / 3.35e12, cm.KERNEL_FLOOR_S)
    assert got == pytest.approx(max(device, 4 * cm.HOST_OP_S) + 4 * cm.SYNC_S, rel=1e-12)
    # host-side work the device waits for adds per episode
    assert cm.predict(tr, 0.0, cm.H100_SXM, 10_000, host_s=1e-4) == pytest.approx(
        cm.predict(tr, 0.0, cm.H100_SXM, 10_000) + 1.0, rel=1e-12
    )


def test_loop_iterations_measured_batched_are_each_episodes_own(monkeypatch):
    # PT-MAP (2 steps: 3 Sinkhorn loops an episode) on 3 episodes: the batched, masked count of each
    # episode is the number of looks it makes solved alone
    from poodle import solvers
    from poodle.solvers import pt_map

    wl = cm.Workload(dim=32)
    opts = {"steps": 2}
    counts = cm.iteration_counts("pt-map", opts, wl, episodes=3, seed=2)
    assert len(counts) == 3 and all(len(row) == 3 for row in counts)
    batch = cm.standard_batch(wl, 3, seed=2)
    batch = type(batch)(batch.support, batch.support_labels, batch.query, None, batch.way)
    cfg = solvers.make_config("pt-map", opts)
    monkeypatch.setattr(pt_map, "syncs_freely", lambda t: False)  # the masked loop, looking every sweep
    torch_loops = solvers.Backend(native=False)  # the torch loop (the native one counts no looks)
    alone = []
    for e in range(3):
        with cm._watch_loops(solvers.get("pt-map").floor.loops) as records:
            solvers.run("pt-map", batch.episode(e), cfg, backend=torch_loops)  # alone
        alone.append([r["looks"] for r in records])
    # the same, or one sweep apart where a batch's float rounding (against one episode's) moves a
    # convergence test across the tolerance
    diffs = [abs(a - b) for row_a, row_b in zip(counts, alone) for a, b in zip(row_a, row_b)]
    assert max(diffs) <= 1 and diffs.count(0) >= 6
    assert len({c for row in counts for c in row}) > 1  # the episodes differ: the test can tell
    # the trace marks the loops' operations and syncs, and a chunk of 3 runs each loop to its slowest
    monkeypatch.undo()
    tr = cm.trace("pt-map", opts, batch, wl)
    assert 0 < len(tr.loop_ops) < tr.launches and 0 < tr.loop_syncs <= tr.syncs
    assert cm.loop_scale(counts, traced=1)(3) > 1.0


def test_host_side_eigh_in_the_prediction():
    from poodle import solvers

    cfg = solvers.make_config("bayes-kmeans", {})
    order, host = cm.host_seconds("bayes-kmeans", cfg)
    assert order == 80 and 0 < host < 0.1  # 80 x 80 (5 + 75 rows), spread over the host's cores
    assert cm.host_seconds("pt-map", solvers.make_config("pt-map", {})) == (0, 0.0)
    # 30 rows: a 30 x 30 matrix, decomposed on the device (batched_eigh), not on the host
    assert cm.host_seconds("bayes-kmeans", cfg, cm.Workload(query=5)) == (30, 0.0)
    rows = cm.table([("mean-shift", {})], cm.Workload(dim=32), traced_episodes=2, loop_episodes=2)
    assert rows[0].eigh_order == 80 and rows[0].host_s > 0
    assert "(80^2)" in cm.markdown(rows)


def test_the_fused_sinkhorn_loop_is_one_launch_a_call_and_no_sync():
    """PT-MAP traced as the CUDA Triton loop runs it: each Sinkhorn call one launch (its plan read and
    written once), no host sync and no masked loop left; the sweeps per episode those of the C loop
    alone; the prediction by hand: the other launches as before, plus waves of programs as long as
    their slowest episode."""
    from poodle.solvers import _sinkhorn_native

    if _sinkhorn_native.load() is None:
        pytest.skip("no C compiler: the fused loop's sweeps are counted by the C loop")
    wl = cm.Workload(way=3, shot=1, query=4, dim=16)
    batch = cm.standard_batch(wl, episodes=2)
    fused = cm.trace("pt-map", {}, batch, wl, fused_sinkhorn=True)
    calls = [n for n in fused.names if n.startswith("triton_sinkhorn.")]
    assert calls and len(calls) == len(fused.fused_sweeps) and all(n == "triton_sinkhorn.balanced" for n in calls)
    # the torch formulation of the same batch: 106,314 launches, 105,916 of them in its masked loops,
    # 367 syncs; fused, what is outside the loops (398) and about two launches a call
    assert fused.syncs == 0 and not fused.loop_ops and fused.launches <= 398 + 2 * len(calls)
    plan = wl.way * wl.n_query * 4  # an episode's [3, 12] float32 plan, read and written once
    assert fused.op_bytes[fused.names.index(calls[0])] == 2 * plan
    assert all(len(s) == 2 and all(1 <= v <= 1000 for v in s) for s in fused.fused_sweeps)
    tr = cm.Trace(op_bytes=[100.0, 50.0], fused_sweeps=[[10, 30]])
    resident = cm.H100_SXM.sms * cm.FUSED_PROGRAMS_PER_SM
    waves = math.ceil(4096 / resident)
    device = 2 * cm.KERNEL_FLOOR_S + waves * cm.expected_max([10, 30], resident) * cm.FUSED_SWEEP_S
    got = cm.predict(tr, 0.0, cm.H100_SXM, episodes=4096)
    assert got == pytest.approx(max(device, 2 * cm.HOST_OP_S), rel=1e-12)
