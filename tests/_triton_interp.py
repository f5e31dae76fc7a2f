"""Run by tests/test_triton_step.py in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton must
see it before it is first imported): the Triton step against the torch formulation on CPU, in
Triton's interpreter, on odd sizes. Prints one JSON object: case name -> measurements."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from poodle import solvers  # noqa: E402
from poodle.solvers import EpisodeBatch, _optim, _triton_step  # noqa: E402
from poodle.solvers import backend as _backend  # noqa: E402
from poodle.solvers._optim import RowTerms  # noqa: E402

E = 3


def rows_problem(n: int, D: int, K: int, free: bool, seed: int = 0):
    """Random rows, a CE block on the first K rows, pull on the next, push on the rest (float64)."""
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(E, n, D, generator=g, dtype=torch.float64), dim=-1)
    n_pos = n // 2
    ce = torch.zeros(1, 1, n, dtype=torch.float64)
    ce[..., :K] = 1.0 / K
    coef = torch.zeros(1, 1, n, dtype=torch.float64)
    coef[..., :n_pos] = -0.8 / n_pos
    coef[..., n_pos:] = 0.6 / (n - n_pos)
    t = torch.zeros(E, K, n, dtype=torch.float64)
    for k in range(K):
        t[:, k, k] = 1.0 / K
    fr = None
    if free:
        fr = torch.zeros_like(coef)
        fr[..., n_pos:] = coef[..., n_pos:]
    w0 = x[:, :K].clone() + 0.05 * torch.randn(E, K, D, generator=g, dtype=torch.float64)
    return x, RowTerms(t, ce, coef, fr), w0


def episodes(shot: int, Nq_per: int, D: int, K: int, M: int, dtype: torch.dtype, seed: int = 0):
    """Clustered episodes (labels known) of ``K`` classes: a batch and the query labels."""
    g = torch.Generator().manual_seed(seed)
    c = F.normalize(torch.randn(E, K, D, generator=g, dtype=torch.float64), dim=-1)

    def around(per: int):
        x = c.repeat_interleave(per, 1) + 2.5 / D**0.5 * torch.randn(E, K * per, D, generator=g, dtype=torch.float64)
        return F.normalize(x, dim=-1).to(dtype), torch.arange(K).repeat_interleave(per).expand(E, -1).contiguous()

    s, ys = around(shot)
    q, yq = around(Nq_per)
    neg = F.normalize(torch.randn(E, M, D, generator=g, dtype=torch.float64), dim=-1).to(dtype) if M else None
    return EpisodeBatch(s, ys, q, neg, K), yq


def fit_case(n: int, D: int, K: int, free: bool, learn_scale: bool, steps: int, group: int | None = None) -> dict:
    """The weighted-distance fit against the torch formulation; with ``group``, also launches of
    ``group`` episodes against one launch of all (the same bits)."""
    x, terms, w0 = rows_problem(n, D, K, free)
    kw = dict(scale0=10.0, steps=steps, lr=2e-2, learn_scale=learn_scale)
    t = time.perf_counter()
    wt, gt = _triton_step.fit_weighted_distance(x, terms, w0, **kw)
    secs = time.perf_counter() - t
    wr, gr = _optim.fit_weighted_distance(x, terms, w0, **kw)
    same = None
    if group is not None:
        wg, gg = _triton_step.fit_weighted_distance(x, terms, w0, group=group, **kw)
        same = bool(torch.equal(wg, wt) and torch.equal(gg, gt))
    return {
        "groups_same_bits": same,
        "w_diff": float((wt - wr).abs().max()),
        "scale_diff": float((gt - gr).abs().max()),
        "moved": float((wr - w0).abs().max()),
        "scale_moved": float((gr - 10.0).abs().max()),
        "seconds": secs,
    }


def solver_case(name: str, over: dict, shot: int, Nq_per: int, D: int, K: int, M: int, dtype: torch.dtype) -> dict:
    batch, yq = episodes(shot, Nq_per, D, K, M, dtype)
    cfg = solvers.make_config(name, over, strict=True)
    ref = solvers.run(name, batch, cfg)
    t = time.perf_counter()
    triton = _backend.Backend(native=False, cuda_step="triton", step_devices=("cpu",))
    out = solvers.run(name, batch, cfg, backend=triton)
    secs = time.perf_counter() - t
    acc_r = (ref.log_probs.argmax(-1) == yq).double().mean(1)
    acc_t = (out.log_probs.argmax(-1) == yq).double().mean(1)
    w0 = solvers.class_means(batch.support, batch.support_labels, K)
    return {
        "acc_ref": acc_r.tolist(),
        "acc_triton": acc_t.tolist(),
        "prob_diff": float((out.log_probs.exp() - ref.log_probs.exp()).abs().max()),
        "logp_diff": float((out.log_probs - ref.log_probs).abs().max()),
        "w_diff": float((out.state["prototypes"] - ref.state["prototypes"]).abs().max()),
        "moved": float((ref.state["prototypes"] - w0).abs().max()),
        "seconds": secs,
        # which arithmetic the dispatch ran (the records' "formulation")
        "formulation": triton.formulation(name, "cpu"),
    }


def ragged_case(name: str, over: dict, n_neg: int = 0) -> dict:
    """A ragged chunk (tests/_ragged.py's shapes, three of them: 5, 7 and 12 ways, 1 to 8 shots, 1 to
    10 queries a class) on the Triton step against each episode solved alone by the torch
    formulation."""
    from _ragged import SHAPES, ragged_episodes

    episodes, _ = ragged_episodes(shapes=[SHAPES[0], SHAPES[4], SHAPES[1]], n_neg=n_neg)
    batch = EpisodeBatch.stack(episodes)
    cfg = solvers.make_config(name, over, strict=True)
    triton = _backend.Backend(native=False, cuda_step="triton", step_devices=("cpu",))
    out = solvers.run(name, batch, cfg, backend=triton)
    what = triton.formulation(name, "cpu")
    same, diff, padded = True, 0.0, 0.0
    for e, ep in enumerate(episodes):
        want = solvers.run(name, ep, cfg).log_probs[0]
        got = out.log_probs[e, batch.query_mask[e]]
        padded = max(padded, float(got[:, ep.way :].exp().max()) if ep.way < batch.way else 0.0)
        same = same and bool(torch.equal(got[:, : ep.way].argmax(-1), want.argmax(-1)))
        diff = max(diff, float((got[:, : ep.way].exp() - want.exp()).abs().max()))
    return {"formulation": what, "same_predictions": same, "prob_diff": diff,
            "padded_prob": padded, "ways": [ep.way for ep in episodes]}  # fmt: skip


def main() -> None:
    with _backend.active(_backend.Backend(native=False)):  # the torch formulation is the reference
        res: dict[str, dict] = {}
        # D = 100 is 2 chunks of 64 (the second of 36 columns), 37 rows 2 blocks of 32 (the second of 5)
        assert (_triton_step.BLOCK_ROWS, _triton_step.BLOCK_D) == (32, 64)
        res["wd_free_learn_K5_D100"] = fit_case(37, 100, 5, free=True, learn_scale=True, steps=3)
        res["wd_fixed_K20_D64_groups"] = fit_case(45, 64, 20, free=False, learn_scale=False, steps=3, group=2)
        f64, f32 = torch.float64, torch.float32
        res["tim_paper_K5_D100"] = solver_case(
            "tim-gd", dict(preset="poodle-paper", steps=3, lr=2e-2), 1, 6, 100, 5, 0, f64
        )
        res["entropy_K20_D64"] = solver_case("entropy-min", dict(steps=3, lr=2e-2), 1, 2, 64, 20, 0, f64)
        res["alpha2_K5_D64"] = solver_case("alpha-tim", dict(steps=3, lr=2e-2), 1, 7, 64, 5, 0, f64)
        res["alpha2.5_K20_D100"] = solver_case("alpha-tim", dict(steps=3, lr=2e-2, alpha=2.5), 1, 2, 100, 20, 0, f64)
        res["f32_poodle_K5_D100"] = solver_case("poodle", dict(transductive=True, steps=6), 1, 9, 100, 5, 21, f32)
        # ragged chunks: each episode's own classes and rows (the tuned alpha-TIM orders 2, 5 and 7)
        res["ragged_alpha_tim"] = ragged_case("alpha-tim", dict(steps=3, lr=2e-2))
        res["ragged_poodle"] = ragged_case("poodle", dict(transductive=True, steps=3, lr=2e-2), n_neg=5)
        print(json.dumps(res))


if __name__ == "__main__":
    main()
