"""The Triton step (poodle/solvers/_triton_step.py) computes what the torch formulation of
poodle/solvers/_optim.py computes: run on CPU in Triton's interpreter (a fresh interpreter with
TRITON_INTERPRET=1, tests/_triton_interp.py), on sizes that leave partial blocks (37 and 45 rows,
D = 64 and 100, 5 and 20 classes, 3 episodes). float64 fits agree to 1e-10 (the same arithmetic in
another summation order); float32 episodes get identical accuracies and probabilities within float
rounding; launches of an episode group give each episode the same bits as one launch of all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poodle import solvers
from poodle.costmodel import torch_step_bytes, triton_step_bytes
from poodle.errors import ConfigError
from poodle.solvers import _triton_step
from poodle.solvers import backend as _backend

SCRIPT = Path(__file__).with_name("_triton_interp.py")
needs_triton = pytest.mark.skipif(not _triton_step.available()[0], reason="Triton not installed")


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("case", ["wd_free_learn_K5_D100", "wd_fixed_K20_D64_groups"])
def test_weighted_distance_fit_matches_torch_float64(results, case):
    r = results[case]
    assert r["moved"] > 0.05  # the fit moved the prototypes: the comparison means something
    assert r["w_diff"] < 1e-10 and r["scale_diff"] < 1e-10
    if "learn" in case:
        assert r["scale_moved"] > 1e-3
    else:
        assert r["scale_moved"] == 0.0
    if "groups" in case:
        assert r["groups_same_bits"] is True


@needs_triton
@pytest.mark.parametrize(
    "case", ["tim_paper_K5_D100", "entropy_K20_D64", "alpha2_K5_D64", "alpha2.5_K20_D100", "f32_poodle_K5_D100"]
)
def test_solvers_on_the_triton_step_match_per_episode(results, case):
    r = results[case]
    assert r["formulation"] == "triton"  # a backend with cuda_step="triton" sent the fit to the kernel
    assert r["moved"] > 5e-3
    assert r["acc_triton"] == r["acc_ref"]  # every episode's accuracy identical
    f32 = case.startswith("f32")
    assert r["prob_diff"] < (1e-5 if f32 else 1e-12)
    assert r["w_diff"] < (1e-6 if f32 else 1e-10)


@needs_triton
@pytest.mark.parametrize("case", ["ragged_alpha_tim", "ragged_poodle"])
def test_ragged_chunk_on_the_triton_step_is_each_episode_alone(results, case):
    """Episodes of 5, 7 and 12 ways, 1 to 8 shots and 1 to 10 queries a class in one padded chunk:
    the Triton step (each episode's own sizes) gives each what the torch formulation gives it alone."""
    r = results[case]
    assert r["formulation"] == "triton" and r["ways"] == [5, 7, 12]
    assert r["same_predictions"] is True
    assert r["prob_diff"] < 1e-12
    assert r["padded_prob"] == 0.0


def test_cuda_step_is_checked_and_leaves_cpu_fits_alone():
    with pytest.raises(ConfigError, match="cuda_step must be one of torch, triton") as e:
        _backend.Backend(cuda_step="cutlass")
    assert (e.value.param, e.value.value) == ("cuda_step", "cutlass")
    from poodle.pipeline import RunOptions

    with pytest.raises(ConfigError, match="cuda_step must be one of"):
        RunOptions(cuda_step="cutlass")  # refused when made, before any file is read
    from poodle.solvers.base import EpisodeBatch

    g = torch.Generator().manual_seed(0)
    batch = EpisodeBatch(
        torch.randn(2, 5, 16, generator=g), torch.arange(5).repeat(2, 1), torch.randn(2, 10, 16, generator=g), None, 5
    )
    cfg = solvers.make_config("tim-gd", {"steps": 3})
    ref = solvers.run("tim-gd", batch, cfg)
    triton = _backend.Backend(cuda_step="triton")
    out = solvers.run("tim-gd", batch, cfg, backend=triton)  # CPU tensors: the CPU's arithmetic, bit for bit
    assert torch.equal(out.log_probs, ref.log_probs)
    assert triton.formulation("tim-gd", "cpu") != "triton"


def test_triton_step_reads_the_rows_once():
    """The cost model's bytes per step: the standard POODLE episode (480 rows, D = 640, 5 classes)
    moves 3.02 MB a step in the torch formulation (rows twice) and 1.34 MB in the Triton step."""
    torch_b = torch_step_bytes(480, 640, 5)
    tri = triton_step_bytes(480, 640, 5)
    assert torch_b == 3_017_640
    assert tri["dram"] == 4 * (480 * 640 + 8 * 5 * 640 + 7 * 480) == 1_344_640
    assert tri["resident"] == tri["dram"] - 4 * 480 * 640
    assert 2.2 < torch_b / tri["dram"] < 2.3


def test_resident_groups_where_the_cost_model_says_they_pay():
    from poodle.costmodel import H100_SXM, launch_plan, resident_plan
    from poodle.evaluate import backend_for
    from poodle.run import RunOptions

    # TIM-GD (80 rows, 1000 steps): groups of 102 episodes, rows in L2; POODLE (480 rows): streamed
    assert resident_plan(10_000, 80, 640, 5, 1000, 5, H100_SXM) == 102
    assert resident_plan(10_000, 480, 640, 5, 250, None, H100_SXM) is None
    assert resident_plan(50, 80, 640, 5, 1000, 5, H100_SXM) is None  # one group anyway
    # a run's backend carries the cost model's sizing down to the step (which imports no cost model)
    be = backend_for(RunOptions(cuda_step="triton"))
    assert be.cuda_step == "triton" and be.launch_plan is launch_plan
    assert _backend.Backend().launch_plan is None  # a library default: one launch


@needs_triton
def test_refuses_what_it_cannot_run():
    x = torch.zeros(2, 7, 16)
    w0 = torch.zeros(2, 3, 16)
    with pytest.raises(ConfigError, match="float32 or float64"):
        _triton_step.fit_weighted_distance(x.half(), None, w0.half())
    with pytest.raises(ConfigError, match=r"\[E, n, D\]"):
        _triton_step.fit_weighted_distance(x[0], None, w0)
    loss = _triton_step.LogitLoss("nope", 2, torch.zeros(2, 3, 2), (1.0, 1.0, 1.0))
    with pytest.raises(ConfigError, match="knows the losses"):
        _triton_step.fit_logit_loss(x, w0, loss, scale0=10.0, steps=1, lr=1e-3, learn_scale=False)
    if not _triton_step.INTERPRETED:
        with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
            _triton_step.fit_weighted_distance(x, _rows(x, 3), w0, steps=1)


@needs_triton
@pytest.mark.parametrize(
    "kind,learn_scale,free,ragged", [(0, True, False, False), (1, False, False, False), (3, False, False, True)]
)
def test_compiles_for_hopper_without_a_gpu(kind, learn_scale, free, ragged, monkeypatch, tmp_path):
    """The kernel goes through Triton's whole CUDA pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) for sm_90:
    what the interpreter cannot check (types, layouts, constexpr use) holds for a real GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    names = ["X", "W", "M", "V", "GAM", "MG", "VG", "GX", "KE", "NE", "NSE", "PZ", "TGT", "R", "FREE", "C0", "HP", "SC"]
    sig = {name: "*i32" if name in ("KE", "NE", "NSE") else "*fp32" for name in names}
    sig |= {k: "i32" for k in ("n", "D", "K", "steps", "ns")}
    const = dict(KIND=kind, LEARN_SCALE=learn_scale, HAS_FREE=free, POW_INT=0, LERP_LOW=True, RAGGED=ragged)
    const |= dict(BN=_triton_step.BLOCK_ROWS, BD=_triton_step.BLOCK_D, BK=16)
    sig |= {k: "constexpr" for k in const}
    src = ASTSource(fn=_triton_step._fit_kernel, signature=sig, constexprs=const)
    kernel = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": _triton_step.NUM_WARPS})
    assert b"_fit_kernel" in kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]


def _rows(x, K):
    from poodle.solvers._optim import RowTerms

    E, n, _ = x.shape
    return RowTerms(torch.zeros(E, K, n), torch.zeros(1, 1, n), torch.zeros(1, 1, n))
