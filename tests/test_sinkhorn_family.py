"""The fused Sinkhorn loop (``_sinkhorn_kernel.c``) against a plain float64 Sinkhorn written per
episode, and the Sinkhorn family (PT-MAP, PEMnE-BMS, protoLP) on ragged chunks: each episode of a
padded chunk gets what it gets alone and what its float64 reference gives on the cropped episode,
through the C loop and through the torch formulation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from _ragged import assert_same_as_alone, ragged_batch
from _references_transductive import REFERENCES

from poodle import solvers
from poodle.solvers import _sinkhorn_native
from poodle.solvers import backend as _backend

needs_loop = pytest.mark.skipif(
    _sinkhorn_native.load() is None, reason=f"fused Sinkhorn loop unavailable: {_sinkhorn_native.state().reason}"
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- the C loop alone
def plain_balanced(p, mass, tol, max_iter, reset=None, normalise=False):
    """The balanced Sinkhorn of one episode ``p [K, N]``, as pt_map.balance documents it."""
    p = p.clone()
    if normalise:
        p = p / p.sum()
    u = torch.zeros(p.shape[1], dtype=p.dtype)
    for _ in range(max_iter):
        rows = p.sum(0)
        if (u - rows).abs().max() <= tol:
            break
        u = rows
        p = p / rows.clamp_min(1e-30)
        p = p * (mass / p.sum(1).clamp_min(1e-30))[:, None]
        if reset is not None:
            p[:, : reset.shape[1]] = reset
    return p


def plain_min_size(p, target, n_iter):
    """The authors' min-size Sinkhorn of one episode ``p [K, N]`` (bms.min_size_sinkhorn)."""
    p = p.clone()
    for _ in range(n_iter):
        p = p / p.sum(0)
        for k in range(len(p)):
            if p[k].sum() < target:
                p[k] = p[k] / ((p[k] + 1e-20).sum() / target)
    return p


WAYS, COLS = [5, 3, 7, 1], [40, 9, 33, 17]


def padded_plans(dtype, seed=0):
    """Four plans of their own sizes in one ``[4, 7, 40]`` tensor, garbage (-3) outside them."""
    g = torch.Generator().manual_seed(seed)
    p = torch.full((4, 7, 40), -3.0, dtype=torch.float64)
    for e, (k, n) in enumerate(zip(WAYS, COLS)):
        p[e, :k, :n] = torch.rand(k, n, generator=g, dtype=torch.float64) ** 3 + 1e-3
    return p.to(dtype)


@needs_loop
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["balanced", "reset", "min-size"])
def test_loop_matches_a_plain_float64_sinkhorn_per_episode(mode, dtype):
    p0 = padded_plans(dtype)
    ways, cols = torch.tensor(WAYS), torch.tensor(COLS)
    mass = torch.tensor([n / k for k, n in zip(WAYS, COLS)], dtype=torch.float64)
    reset = None
    if mode == "reset":
        reset = torch.zeros(4, 7, 4, dtype=dtype)
        for e, k in enumerate(WAYS):
            reset[e, torch.arange(4) % k, torch.arange(4)] = 1.0
    if mode == "min-size":
        target = torch.tensor([6.0, 2.0, 5.5, 17.0], dtype=torch.float64)
        got = _sinkhorn_native.run("min-size", p0.clone(), target, 30, ways=ways, cols=cols)
    else:
        target = mass
        got = _sinkhorn_native.run(
            "balanced", p0.clone(), mass, 500, tol=1e-9, reset=reset, normalise=mode == "balanced", ways=ways, cols=cols
        )
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for e, (k, n) in enumerate(zip(WAYS, COLS)):
        start = p0[e, :k, :n].double()
        if mode == "min-size":
            want = plain_min_size(start, float(target[e]), 30)
        else:
            r = None if reset is None else reset[e, :k].double()
            want = plain_balanced(start, float(mass[e]), 1e-9, 500, r, normalise=mode == "balanced")
        assert torch.allclose(got[e, :k, :n].double(), want, rtol=tol, atol=tol), f"episode {e}"
        outside = torch.ones(7, 40, dtype=torch.bool)
        outside[:k, :n] = False
        assert torch.all(got[e][outside] == -3), f"episode {e}: the loop wrote outside its sizes"
        # the same bits as the episode alone, at its own size
        alone = p0[e : e + 1, :k, :n].contiguous()
        if mode == "min-size":
            alone = _sinkhorn_native.run("min-size", alone, target[e : e + 1], 30)
        else:
            r = None if reset is None else reset[e : e + 1, :k].contiguous()
            alone = _sinkhorn_native.run(
                "balanced", alone, mass[e : e + 1], 500, tol=1e-9, reset=r, normalise=mode == "balanced"
            )
        assert torch.equal(got[e, :k, :n], alone[0]), f"episode {e}: padded bits differ from alone"


@needs_loop
def test_loop_matches_the_torch_formulation():
    from poodle.solvers import bms, pt_map

    g = torch.Generator().manual_seed(1)
    cost = torch.rand(6, 5, 30, generator=g, dtype=torch.float64)
    want = pt_map.sinkhorn(cost.clone(), 10.0, 6.0, 1e-9, 1000)  # the C loop
    with _backend.active(_backend.Backend(native=False)):
        torch_plan = pt_map.sinkhorn(cost.clone(), 10.0, 6.0, 1e-9, 1000)
        q = torch.softmax(torch.randn(6, 5, 30, generator=g, dtype=torch.float64) * 4, 1)
        target = torch.full((6,), 6.0, dtype=torch.float64)
        torch_q = bms.min_size_sinkhorn(q.clone(), target, 40)
    assert torch.allclose(want, torch_plan, atol=1e-13)
    assert torch.allclose(bms.min_size_sinkhorn(q.clone(), target, 40), torch_q, atol=1e-13)


# ------------------------------------------------------------------- the methods on ragged chunks
# episodes with fewer rows than dimensions: protoLP projects them from the rows' Gram matrix, padded
# rows included, where the larger ones use the dimensions' (both must leave the padding out)
SMALL = [([1] * 5, [1, 2, 1, 1, 2]), ([2, 1, 1], [1, 2, 1]), ([1] * 7, [1] * 7)]
CASES = {
    "pt-map": ("pt-map", {"steps": 4}, None),
    "bms": ("bms", {"steps": 4, "sinkhorn_iter": 20}, None),
    "bms-sgd": ("bms", {"steps": 2, "sinkhorn_iter": 10, "epochs": 3}, None),
    "proto-lp": ("proto-lp", {"steps": 4, "reduced_dim": 8}, None),
    "proto-lp-small": ("proto-lp", {"steps": 4, "reduced_dim": 8}, SMALL),
    "proto-lp-unbalanced": ("proto-lp", {"steps": 3, "reduced_dim": 8, "balanced": False}, None),
}


@pytest.mark.parametrize("path", ["c-loop", "torch", "device-schedule"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ragged_chunk_is_each_episode_alone_and_its_reference(case, path, monkeypatch):
    if path == "c-loop" and _sinkhorn_native.load() is None:
        pytest.skip("fused Sinkhorn loop unavailable")
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=path == "c-loop"))
    name, options, shapes = CASES[case]
    cfg = solvers.make_config(name, options, strict=True)
    batch, episodes = ragged_batch(seed=2, shapes=shapes)
    # device-schedule: the padded chunk through what a GPU runs (masked episodes, seldom looks)
    schedule = _backend.Backend(native=path == "c-loop", device_schedule=path == "device-schedule")
    out = solvers.run(name, batch, cfg, backend=schedule)
    alone = [solvers.run(name, ep, cfg).log_probs for ep in episodes]
    assert_same_as_alone(name, out.log_probs, alone, batch)
    ref = REFERENCES[name]
    kwargs = dataclasses.asdict(cfg)
    for e, ep in enumerate(episodes):
        want, _ = ref(ep.support[0], ep.support_labels[0], ep.query[0], ep.way, **kwargs)
        rows = batch.query_mask[e] if batch.query_mask is not None else slice(None)
        got = out.log_probs[e, rows, : ep.way]
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{name}: episode {e}'s predictions differ from reference"
        diff = (got.exp() - want.exp()).abs().max().item()
        assert diff <= 1e-4, f"{name}: episode {e} differs from its reference by {diff:.3g}"


@needs_loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_pass_power_transform_is_the_formula(dtype, monkeypatch):
    from poodle.solvers.pt_map import power_transform

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 45, generator=g, dtype=torch.float64).to(dtype)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-8, -1e-8], dtype=dtype)
    out = torch.full((3, 10, 45), 5.0, dtype=dtype)
    got = power_transform(x, 0.5, out=out[:, 2:9])  # the C pass, into a block of a larger tensor
    base = (x.abs() + 1e-6).double()  # the sum the transform takes the root of, in x's precision
    # numpy's sqrt is the hardware's, correctly rounded (torch's vectorised one is not always)
    want = torch.sign(x.double()) * torch.from_numpy(np.sqrt(base.numpy())) + (x == 0).double() * 1e-3
    # correctly rounded: within half a unit in the last place of the formula
    assert torch.allclose(got.double(), want, rtol=0.6 * torch.finfo(dtype).eps, atol=0)
    assert torch.all(got[0, 0, :2] == torch.tensor(1e-3, dtype=dtype))  # either zero: 1e-6^(1/2)
    assert torch.all(out[:, :2] == 5) and torch.all(out[:, 9:] == 5)
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=False))
    assert torch.allclose(power_transform(x, 0.5), got, rtol=1.2 * torch.finfo(dtype).eps, atol=0)


# ------------------------------------------------ the feature pipeline and protoLP's propagation
@needs_loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ragged", [False, True])
def test_fused_feature_transforms_are_the_torch_formulation(dtype, ragged):
    from poodle.solvers import bms, proto_lp, pt_map

    g = torch.Generator().manual_seed(4)
    z_s = torch.randn(3, 4, 37, generator=g, dtype=torch.float64).to(dtype)
    z_q = torch.randn(3, 9, 37, generator=g, dtype=torch.float64).to(dtype)
    z_s[0, 0, :3] = torch.tensor([0.0, -0.0, 1e-9], dtype=dtype)  # the power transform's zeros
    s_mask = q_mask = None
    if ragged:  # padded rows are zero features
        s_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
        q_mask = torch.ones(3, 9, dtype=torch.bool)
        q_mask[1, 5:] = q_mask[2, 2:] = False
        z_s.mul_(s_mask.unsqueeze(2))
        z_q.mul_(q_mask.unsqueeze(2))
    rows = None if not ragged else torch.cat([s_mask, q_mask], 1)
    got = {
        "pt-map": pt_map.preprocess(z_s, z_q, 0.5, s_mask, q_mask),
        "bms": bms.peme([z_s, z_q], 0.5, rows),
        "proto-lp": proto_lp.preprocess([z_s, z_q], 0.5, 0, rows),
    }
    with _backend.active(_backend.Backend(native=False)):
        want = {
            "pt-map": pt_map.preprocess(z_s, z_q, 0.5, s_mask, q_mask),
            "bms": bms.peme([z_s, z_q], 0.5, rows),
            "proto-lp": proto_lp.preprocess([z_s, z_q], 0.5, 0, rows),
        }
    eps = torch.finfo(dtype).eps
    for name in got:
        assert got[name].shape == (3, 13, 37)
        assert torch.allclose(got[name], want[name], rtol=0, atol=16 * eps), name
        if ragged:  # padded rows stay exactly zero
            assert torch.all(got[name][~rows] == 0), name
    # every row of the fused pipeline is unit
    fused = _sinkhorn_native.pemne([z_s, z_q], "parts", None, 1e-3)
    assert torch.allclose(fused.norm(dim=-1), torch.ones(3, 13, dtype=dtype), atol=8 * eps)


@needs_loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_propagation_is_the_torch_formulation(dtype):
    from poodle.solvers import proto_lp, pt_map

    g = torch.Generator().manual_seed(5)
    y = torch.eye(5, dtype=torch.float64).repeat(4, 1, 2)  # [4, 5, 10]: two support samples a class
    q = torch.softmax(3 * torch.randn(4, 5, 30, generator=g, dtype=torch.float64), 1)
    z = torch.cat([y, q], 2).to(dtype)
    yty = torch.bmm(z[:, :, :10], z[:, :, :10].transpose(1, 2))
    gamma = torch.tensor([1.0, 1.0, 1.0, -50.0])  # the last episode's system is not positive definite
    got = torch.cat([proto_lp.propagate(z[e : e + 1], yty[e : e + 1], float(gamma[e])) for e in range(4)])
    with _backend.active(_backend.Backend(native=False)):
        want = torch.cat([proto_lp.propagate(z[e : e + 1], yty[e : e + 1], float(gamma[e])) for e in range(4)])
    _, bad = _sinkhorn_native.propagate(z[3:], yty[3:], -50.0)
    assert bad.tolist() == [True]  # the C pass refused it; the pseudo-inverse gave it
    scale = want.abs().amax((1, 2), keepdim=True)
    assert torch.allclose(got / scale, want / scale, rtol=0, atol=64 * torch.finfo(dtype).eps)
    # a chunk gives each episode what it gets alone (the same C pass per episode)
    chunk = proto_lp.propagate(z[:3], yty[:3], 1.0)
    assert torch.equal(chunk, got[:3])
    # protoLP's whole step from its assignments' kernel (their sweeps, the propagation, the sweeps
    # with the support reset, the mix): episode 1's system is not positive definite (its z is
    # still formed; the caller takes the torch formulation for it)
    yty_bad = yty.clone()
    yty_bad[1] *= -10
    cfg = proto_lp.ProtoLPConfig()
    y_t = z[:, :, :10]
    kernel = torch.exp(-10 * torch.rand(4, 5, 30, generator=g, dtype=torch.float64)).to(dtype)
    step = _sinkhorn_native.LPStep(yty_bad, y_t, 30, 1.0, 0.6, 6.0, 1e-3, 8.0, 0.01, 1000)
    mask, zz, bad = step(kernel.clone())
    assert bad is not None and bad.tolist() == [False, True, False, False]
    with _backend.active(_backend.Backend(native=False)):
        plan = pt_map.balance(kernel.clone(), 6.0, 1e-3, 1000, normalise=True)
        want_zz = torch.cat([y_t, plan], 2)
        want_mask = proto_lp.lp_mask(want_zz, yty_bad, y_t, cfg, 8.0, None)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(zz, want_zz, rtol=0, atol=64 * eps)
    good = torch.tensor([0, 2, 3])
    assert torch.all((mask[good] >= 0) & (mask[good] <= 1))
    assert torch.allclose(mask[good], want_mask[good], rtol=0, atol=1e3 * eps)
    # the sweeps it counts (the floor model's): the plan's, as the plain loop counts them, plus the
    # propagated plan's where the system was solved (not episode 1's)
    plan_sweeps = torch.zeros(4, dtype=torch.int32)
    _sinkhorn_native.run("balanced", kernel.clone(), 6.0, 1000, tol=1e-3, normalise=True, iters=plan_sweeps)
    assert step.sweeps[1] == plan_sweeps[1] > 0
    assert torch.all(step.sweeps[good] > plan_sweeps[good])
    first = step.sweeps.clone()
    step(kernel.clone())
    assert torch.equal(step.sweeps, 2 * first)  # the same call again: the counts add up
