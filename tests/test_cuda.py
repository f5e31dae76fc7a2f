"""A device against the CPU, per episode: every method solves the same episodes (through
``poodle.evaluate``: features placed on the device, chunks gathered there) on the device under test
and on the CPU, and every episode's accuracy is identical; the solvers' probabilities agree to float
rounding; the Triton step, compiled for CUDA, agrees with the torch formulation per episode.

The device is ``POODLE_TEST_DEVICE`` (default ``cuda``). The CPU reference runs the CPU's own path
(the fused C kernel where it applies); the device runs what CUDA runs, the torch formulation (and on
CUDA the Triton Sinkhorn loop of PT-MAP, PEMnE-BMS and protoLP), so ``POODLE_TEST_DEVICE=cpu``
(benchmarks/gpu.py --device cpu, in CI) compares the fused kernel with the torch formulation on the
CPU. Marked ``cuda``: deselected where neither CUDA nor ``POODLE_TEST_DEVICE`` is present
(tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import clustered_features

from poodle import solvers
from poodle.cache import read_split, write_arrays
from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.evaluate import evaluate
from poodle.negatives import NegativeSpec
from poodle.run import RunOptions
from poodle.solvers import backend as _backend

pytestmark = pytest.mark.cuda
DEVICE = torch.device(os.environ.get("POODLE_TEST_DEVICE", "cuda"))
N_EPISODES = 12


def _options(method: str) -> dict:
    return {"transductive": True} if solvers.get(method).transductive == "optional" else {}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    xtr, ytr = clustered_features(16, 40, 64, seed=1)
    xte, yte = clustered_features(10, 30, 64, seed=2, spread=1.0)
    path = tmp_path_factory.mktemp("cuda") / "c.h5"
    splits = {"train": (xtr, ytr, [f"b{i}" for i in range(16)]), "test": (xte, yte, [f"t{i}" for i in range(10)])}
    return write_arrays(path, splits)


@pytest.fixture(scope="module")
def accuracies(cache):
    """Per-episode accuracies of every method, ``(cpu, device)``."""
    test = read_split(cache, "test")
    eps = sample_episodes(test.labels, EpisodeSpec(way=5, shot=1, query=6, seed=0), N_EPISODES)
    methods = [(m, m, _options(m)) for m in solvers.available()]
    neg = NegativeSpec("base", 30)
    ref = evaluate(test, eps, methods, negatives=neg, cache_path=cache, run=RunOptions(device="cpu", chunk_size=5))
    # the device runs the torch formulation, as CUDA does
    torch_only = _backend.Backend(native=False)
    dev = evaluate(
        test,
        eps,
        methods,
        negatives=neg,
        cache_path=cache,
        run=RunOptions(device=DEVICE, chunk_size=5),
        backend=torch_only,
    )
    return ref, dev


@pytest.mark.parametrize("method", solvers.available())
def test_every_episode_gets_the_same_accuracy(accuracies, method):
    ref, dev = accuracies
    assert ref[method].shape == (N_EPISODES,)
    same = int((ref[method] == dev[method].cpu()).sum())
    assert same == N_EPISODES, f"{method}: {same}/{N_EPISODES} episodes identical on {DEVICE}"


def _batch(E=6, D=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    c = torch.nn.functional.normalize(torch.randn(E, 5, D, generator=g), dim=-1)

    def around(per):
        x = c.repeat_interleave(per, 1) + 0.25 * torch.randn(E, 5 * per, D, generator=g)
        return torch.nn.functional.normalize(x, dim=-1), torch.arange(5).repeat_interleave(per).expand(E, -1)

    s, ys = around(1)
    q, _ = around(6)
    neg = torch.nn.functional.normalize(torch.randn(E, 30, D, generator=g), dim=-1)
    return solvers.EpisodeBatch(s, ys.contiguous(), q, neg, 5)


@pytest.mark.parametrize("method", ["poodle", "tim-gd", "alpha-tim", "entropy-min", "pt-map", "laplacianshot"])
def test_probabilities_agree_to_float_rounding(method, monkeypatch):
    batch = _batch()
    cfg = solvers.make_config(method, _options(method))
    ref = solvers.run(method, batch, cfg)
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=False))
    out = solvers.run(method, batch.to(DEVICE), cfg)
    diff = (out.log_probs.cpu().exp() - ref.log_probs.exp()).abs().max()
    assert float(diff) < 1e-3, f"{method}: probabilities differ by {float(diff):.2e} on {DEVICE}"
    assert torch.equal(out.log_probs.cpu().argmax(-1), ref.log_probs.argmax(-1))


@pytest.mark.cuda(only=True)
@pytest.mark.parametrize("method", ["poodle", "ce", "naive-ood", "tim-gd", "alpha-tim", "entropy-min"])
def test_triton_step_on_cuda_matches_the_torch_formulation(method):
    batch = _batch(E=64).to(DEVICE)
    cfg = solvers.make_config(method, _options(method))
    ref = solvers.run(method, batch, cfg)
    out = solvers.run(method, batch, cfg, backend=_backend.Backend(cuda_step="triton"))
    assert torch.equal(out.log_probs.argmax(-1), ref.log_probs.argmax(-1))
    assert float((out.log_probs.exp() - ref.log_probs.exp()).abs().max()) < 1e-4


@pytest.mark.cuda(only=True)
@pytest.mark.parametrize("method", ["pt-map", "bms", "proto-lp"])
def test_triton_sinkhorn_on_cuda_matches_the_torch_formulation(method):

    batch = _batch(E=64).to(DEVICE)
    cfg = solvers.make_config(method, _options(method))
    ref = solvers.run(method, batch, cfg, backend=_backend.Backend(cuda_sinkhorn="torch"))
    triton = _backend.Backend(cuda_sinkhorn="triton")
    out = solvers.run(method, batch, cfg, backend=triton)
    assert triton.formulation(method, DEVICE) == "triton sinkhorn"
    assert torch.equal(out.log_probs.argmax(-1), ref.log_probs.argmax(-1))
    assert float((out.log_probs.exp() - ref.log_probs.exp()).abs().max()) < 1e-4
