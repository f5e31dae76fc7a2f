"""The Triton Sinkhorn loop (poodle/solvers/_triton_sinkhorn.py) computes what the C loop and a
plain float64 Sinkhorn per episode compute: run on CPU in Triton's interpreter (a fresh interpreter
with TRITON_INTERPRET=1, tests/_triton_sinkhorn_interp.py) on a ragged chunk of odd sizes (4
episodes of 1 to 7 classes and 9 to 37 samples in a [4, 7, 37] plan, garbage outside them). Plans
agree within float rounding, every episode runs the reference's number of sweeps, nothing outside an
episode's sizes is touched, and an episode padded into a chunk gets the bits it gets alone. PT-MAP,
PEMnE-BMS and protoLP on a small ragged chunk through the loop predict what the torch formulation
predicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poodle import solvers
from poodle.errors import ConfigError
from poodle.solvers import _triton_sinkhorn
from poodle.solvers import backend as _backend

SCRIPT = Path(__file__).with_name("_triton_sinkhorn_interp.py")
needs_triton = pytest.mark.skipif(not _triton_sinkhorn.available()[0], reason="Triton not installed")


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("mode", ["balanced", "reset", "min-size"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_loop_matches_plain_float64_sinkhorn_and_the_c_loop(results, mode, dtype):
    r = results[f"{mode}_{dtype}"]
    tol = 1e-14 if dtype == "float64" else 1e-6
    assert r["ref_diff"] < tol and r["c_diff"] < tol
    assert r["iters"] == r["ref_iters"]  # each episode stops at its own sweep, the reference's
    if mode != "min-size":
        assert len(set(r["iters"])) > 2  # the episodes did stop at different sweeps
    assert r["outside_kept"]  # nothing outside an episode's classes and samples was written
    assert r["alone_diff"] == 0.0  # padded into the chunk: the bits of the episode alone


@needs_triton
@pytest.mark.parametrize("name", ["pt-map", "bms", "proto-lp"])
def test_methods_on_the_triton_loop_predict_what_torch_predicts(results, name):
    r = results[name]
    assert r["formulation"] == "triton sinkhorn"  # a backend with cuda_sinkhorn="triton" sent the sweeps there
    assert r["same_predictions"]
    assert r["prob_diff"] < 1e-12
    assert r["padded_class_zero"]


def test_cuda_loop_is_checked_and_leaves_cpu_plans_alone(monkeypatch):
    with pytest.raises(ConfigError, match="must be one of torch, triton") as e:
        _backend.Backend(cuda_sinkhorn="cutlass")
    assert (e.value.param, e.value.value) == ("cuda_sinkhorn", "cutlass")
    p = torch.rand(2, 5, 15, dtype=torch.float64)
    assert not _triton_sinkhorn.usable(p)  # CPU plans: the C loop or torch, as before
    with monkeypatch.context() as m:  # a misspelt POODLE_CUDA_SINKHORN is refused, not ignored
        m.setenv("POODLE_CUDA_SINKHORN", "trition")
        with pytest.raises(ConfigError, match="POODLE_CUDA_SINKHORN must be one of torch, triton, not 'trition'"):
            _backend.Backend()
    on_cpu = _backend.Backend(cuda_sinkhorn="triton", sinkhorn_devices=("cpu",))
    with _backend.active(on_cpu.with_(device_schedule=True)):  # what the cost model traces: torch
        assert not _triton_sinkhorn.usable(p)
    with _backend.active(on_cpu.with_(cuda_sinkhorn="torch")):
        assert not _triton_sinkhorn.usable(p)
    with _backend.active(on_cpu):
        assert not _triton_sinkhorn.usable(p.half())
        assert not _triton_sinkhorn.usable(torch.rand(1, 65, 600, dtype=torch.float64))  # 128 x 1024 > MAX_BLOCK
        assert _triton_sinkhorn.usable(p) == _triton_sinkhorn.available()[0]
    g = torch.Generator().manual_seed(0)
    batch = solvers.EpisodeBatch(
        torch.randn(2, 5, 16, generator=g), torch.arange(5).repeat(2, 1), torch.randn(2, 10, 16, generator=g), None, 5
    )
    cfg = solvers.make_config("pt-map", {"steps": 2})
    ref = solvers.run("pt-map", batch, cfg)
    triton = _backend.Backend(cuda_sinkhorn="triton")
    out = solvers.run("pt-map", batch, cfg, backend=triton)  # CPU tensors: the CPU's arithmetic, bit for bit
    assert torch.equal(out.log_probs, ref.log_probs)
    assert triton.formulation("pt-map", "cpu") != "triton sinkhorn"


@needs_triton
@pytest.mark.parametrize(
    "mode,dtype,ragged,blocks",
    [
        (0, "fp32", True, (8, 128)),
        (0, "fp64", False, (8, 128)),
        (1, "fp32", True, (64, 1024)),
        (1, "fp64", False, (8, 128)),
    ],
)
def test_compiles_for_hopper_without_a_gpu(mode, dtype, ragged, blocks, monkeypatch, tmp_path):
    """The loop goes through Triton's whole CUDA pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) for sm_90:
    what the interpreter cannot check (the while loop's carried types, constexpr branches, scalar
    loads) holds for a real GPU, at PT-MAP's standard block and at the largest one."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    sig = {"P": f"*{dtype}", "R": f"*{dtype}", "WAYS": "*i64", "COLS": "*i64", "TARGET": "*fp64", "ITERS": "*i32"}
    sig |= {k: "i64" for k in ("p_es", "r_es", "r_ks", "t_es")} | {k: "i32" for k in ("K", "N", "n_reset", "max_iter")}
    const = dict(MODE=mode, NORMALISE=mode == 0, HAS_RESET=mode == 0 and ragged, HAS_WAYS=ragged, HAS_COLS=ragged)
    const |= dict(HAS_ITERS=False, TARGET_PER_EPISODE=ragged, TARGET_VALUE=15.0, TOL=1e-6, BK=blocks[0], BN=blocks[1])
    sig |= {k: "constexpr" for k in const}
    src = ASTSource(fn=_triton_sinkhorn._sinkhorn, signature=sig, constexprs=const)
    warps = _triton_sinkhorn.warps(*blocks)
    kernel = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert b"_sinkhorn" in kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]
