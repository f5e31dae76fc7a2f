"""The cost model's view of the Triton Sinkhorn loop (poodle/solvers/_triton_sinkhorn.py): kernel
launches, host syncs, MB per episode and the predicted seconds of 10,000 episodes for PT-MAP,
PEMnE-BMS and protoLP on the standard workload, first as ``poodle.costmodel.trace`` counts them (the
torch formulation of the Sinkhorn loop), then with each Sinkhorn call counted as the Triton loop's
one launch (the plan read and written once; the rest of each method unchanged).

The cost model's tracer sees torch operations only, so the Triton launch is stood in for here: the
plan is computed by the torch formulation outside the trace and copied in by one traced operation.
The loop's own latency (an episode's sweeps one after the other inside its program) is not in the
model. Run: ``python benchmarks/triton_sinkhorn_launches.py`` (CPU only, a minute)."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from poodle import costmodel, solvers
from poodle.solvers import _triton_sinkhorn, bms, pt_map

_state = {"on": False, "calls": 0}


def _usable(p: Tensor) -> bool:
    return _state["on"]


def _one_launch(mode: str, p: Tensor, target: Any, max_iter: int, **kw: Any) -> Tensor:
    """The plan the torch formulation computes, outside the trace, then one traced launch."""
    _state["on"] = False
    try:
        with _disable_current_modes():
            q = p.clone()
            if mode == "balanced":
                pt_map.balance(
                    q, target, kw["tol"], max_iter, reset=kw.get("reset"), normalise=kw.get("normalise", False)
                )
            else:
                bms.min_size_sinkhorn(q, target, max_iter)
    finally:
        _state["on"] = True
    _state["calls"] += 1
    return p.copy_(q)


def main() -> None:
    for method in ("pt-map", "bms", "proto-lp"):
        before = costmodel.trace(method)
        real = _triton_sinkhorn.usable, _triton_sinkhorn.run
        _state.update(on=True, calls=0)
        _triton_sinkhorn.usable, _triton_sinkhorn.run = _usable, _one_launch  # type: ignore[assignment]
        try:
            after = costmodel.trace(method)
        finally:
            _triton_sinkhorn.usable, _triton_sinkhorn.run = real  # type: ignore[assignment]
            _state["on"] = False
        flops = costmodel.method_flops(method, solvers.make_config(method, {}, strict=True)) or 0.0
        print(
            f"{method}: launches {before.launches:,} -> {after.launches:,} ({_state['calls']} Triton loop calls), "
            f"syncs {before.syncs} -> {after.syncs}, MB/episode {before.bytes / 1e6:.2f} -> {after.bytes / 1e6:.2f}"
        )
        for gpu in costmodel.GPUS:
            t0, t1 = costmodel.predict(before, flops, gpu), costmodel.predict(after, flops, gpu)
            print(f"    {gpu.name}: {t0:.3f} -> {t1:.3f} s per 10,000 episodes")


if __name__ == "__main__":
    main()
