"""Run by tests/test_triton_sinkhorn.py in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton
must see it before it is first imported): the Triton Sinkhorn loop on CPU tensors, in Triton's
interpreter, against a plain float64 Sinkhorn written per episode (plans and sweep counts), against
the fused C loop, and the Sinkhorn family's predictions through it against the torch formulation on
a small ragged chunk. Prints one JSON object: case name -> measurements."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ragged import ragged_batch  # noqa: E402

from poodle import solvers  # noqa: E402
from poodle.solvers import _sinkhorn_native, _triton_sinkhorn  # noqa: E402
from poodle.solvers import backend as _backend  # noqa: E402

# four episodes of their own sizes in one [4, 7, 37] plan (blocks of 8 x 64: every axis partial)
WAYS, COLS = [5, 3, 7, 1], [37, 9, 30, 17]
K, N, NS = 7, 37, 4


def plain_balanced(p, mass, tol, max_iter, reset=None, normalise=False):
    """One episode ``p [k, n]`` (float64), as pt_map.balance documents it: the plan and its sweeps."""
    p = p.clone()
    if normalise:
        p = p / p.sum()
    u = torch.zeros(p.shape[1], dtype=p.dtype)
    sweeps = 0
    for _ in range(max_iter):
        rows = p.sum(0)
        if (u - rows).abs().max() <= tol:
            break
        u = rows
        p = p / rows.clamp_min(1e-30)
        p = p * (mass / p.sum(1).clamp_min(1e-30))[:, None]
        if reset is not None:
            p[:, : reset.shape[1]] = reset
        sweeps += 1
    return p, sweeps


def plain_min_size(p, target, n_iter):
    """The authors' min-size Sinkhorn of one episode ``p [k, n]`` (bms.min_size_sinkhorn)."""
    p = p.clone()
    for _ in range(n_iter):
        p = p / p.sum(0)
        for k in range(len(p)):
            if p[k].sum() < target:
                p[k] = p[k] / ((p[k] + 1e-20).sum() / target)
    return p, n_iter


def loop_case(mode: str, dtype: torch.dtype) -> dict:
    """The Triton loop on a padded chunk (garbage outside each episode's sizes) against the plain
    float64 Sinkhorn of each cropped episode, the C loop, and each episode alone."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.full((4, K, N), -3.0, dtype=torch.float64)
    for e, (k, n) in enumerate(zip(WAYS, COLS)):
        p0[e, :k, :n] = torch.rand(k, n, generator=g, dtype=torch.float64) ** 3 + 1e-3
    p0 = p0.to(dtype)
    ways, cols = torch.tensor(WAYS), torch.tensor(COLS)
    reset = None
    if mode == "min-size":
        target = torch.tensor([6.0, 2.0, 3.5, 17.0], dtype=torch.float64)
        kw: dict = {}
        max_iter, tol, normalise = 15, 0.0, False
    else:
        target = torch.tensor([n / k for k, n in zip(WAYS, COLS)], dtype=torch.float64)
        max_iter, tol, normalise = 500, 1e-9 if dtype == torch.float64 else 1e-6, mode == "balanced"
        if mode == "reset":
            reset = torch.zeros(4, K, NS, dtype=dtype)
            for e, k in enumerate(WAYS):
                reset[e, torch.arange(NS) % k, torch.arange(NS)] = 1.0
        kw = dict(tol=tol, reset=reset, normalise=normalise)
        mode = "balanced"
    iters = torch.zeros(4, dtype=torch.int32)
    t = time.perf_counter()
    got = _triton_sinkhorn.run(mode, p0.clone(), target, max_iter, ways=ways, cols=cols, iters=iters, **kw)
    secs = time.perf_counter() - t
    c_loop = _sinkhorn_native.run(mode, p0.clone(), target, max_iter, ways=ways, cols=cols, **kw)
    ref_diff, c_diff, alone_diff, sweeps, outside_kept = 0.0, 0.0, 0.0, [], True
    for e, (k, n) in enumerate(zip(WAYS, COLS)):
        start = p0[e, :k, :n].double()
        if mode == "min-size":
            want, n_sweeps = plain_min_size(start, float(target[e]), max_iter)
        else:
            r = None if reset is None else reset[e, :k].double()
            want, n_sweeps = plain_balanced(start, float(target[e]), tol, max_iter, r, normalise)
        sweeps.append(n_sweeps)
        ref_diff = max(ref_diff, float((got[e, :k, :n].double() - want).abs().max()))
        c_diff = max(c_diff, float((got[e, :k, :n] - c_loop[e, :k, :n]).abs().max()))
        outside = torch.ones(K, N, dtype=torch.bool)
        outside[:k, :n] = False
        outside_kept &= bool(torch.all(got[e][outside] == -3))
        # the episode alone, at its own size, with a number for its target
        r1 = None if reset is None else reset[e : e + 1, :k].contiguous()
        kw1 = {**kw, "reset": r1} if mode == "balanced" else kw
        alone = _triton_sinkhorn.run(mode, p0[e : e + 1, :k, :n].contiguous(), float(target[e]), max_iter, **kw1)
        alone_diff = max(alone_diff, float((got[e, :k, :n] - alone[0]).abs().max()))
    return {
        "ref_diff": ref_diff,
        "c_diff": c_diff,
        "alone_diff": alone_diff,
        "iters": iters.tolist(),
        "ref_iters": sweeps,
        "outside_kept": outside_kept,
        "seconds": secs,
    }


# episodes small enough for the interpreter: ways 5, 3 and 7, 1 to 3 shots, 1 to 3 queries a class
SHAPES = [([1] * 5, [1, 2, 1, 3, 2]), ([2, 1, 3], [1, 2, 2]), ([1, 2, 1, 1, 3, 1, 2], [1] * 7)]


def method_case(name: str, options: dict) -> dict:
    """A ragged chunk through the Triton loop against the torch formulation (the C loop off)."""
    batch, _ = ragged_batch(seed=2, shapes=SHAPES)
    cfg = solvers.make_config(name, options, strict=True)
    ref = solvers.run(name, batch, cfg)
    t = time.perf_counter()
    triton = _backend.Backend(native=False, cuda_sinkhorn="triton", sinkhorn_devices=("cpu",))
    out = solvers.run(name, batch, cfg, backend=triton)
    secs = time.perf_counter() - t
    real = batch.query_mask
    padded_class = batch.class_mask is not None and bool(
        torch.all(out.log_probs.masked_select(~batch.class_mask.unsqueeze(1).expand_as(out.log_probs)) == -torch.inf)
    )
    return {
        "same_predictions": bool(torch.equal(out.log_probs.argmax(-1)[real], ref.log_probs.argmax(-1)[real])),
        "prob_diff": float((out.log_probs.exp() - ref.log_probs.exp())[real].abs().max()),
        "padded_class_zero": padded_class,
        "formulation": triton.formulation(name, "cpu"),
        "seconds": secs,
    }


def main() -> None:
    torch.set_num_threads(1)
    res: dict[str, dict] = {}
    for mode in ("balanced", "reset", "min-size"):
        for dtype in (torch.float64, torch.float32):
            res[f"{mode}_{str(dtype)[6:]}"] = loop_case(mode, dtype)
    with _backend.active(_backend.Backend(native=False)):  # the torch formulation is the reference of the methods
        res["pt-map"] = method_case("pt-map", {"steps": 2, "sinkhorn_tol": 1e-4})
        res["bms"] = method_case("bms", {"steps": 3, "sinkhorn_iter": 20})
        res["proto-lp"] = method_case("proto-lp", {"steps": 2, "reduced_dim": 8})
        print(json.dumps(res))


if __name__ == "__main__":
    main()
