"""The fused CPU kernel of the weighted-distance solvers (poodle/solvers/_wd_kernel.c): it computes
what the torch formulation computes, on shapes that exercise every tail and padding path, gives an
episode the same bits whatever chunk it comes in, and falls back cleanly where it cannot be built."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from poodle.solvers import _native, _optim
from poodle.solvers._optim import RowTerms, fit_weighted_distance

needs_kernel = pytest.mark.skipif(
    not _native.usable(torch.zeros(1)), reason=f"fused kernel unavailable: {_native.status()}"
)


def _problem(E=3, n=37, D=27, K=7, dtype=torch.float64, free=False, seed=0):
    """Random rows, a CE block on the first K rows, pull on the next, push on the rest."""
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(E, n, D, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    n_s, n_pos = K, n // 2
    ce = torch.zeros(1, 1, n, dtype=dtype)
    ce[..., :n_s] = 1.0 / n_s
    coef = torch.zeros(1, 1, n, dtype=dtype)
    coef[..., :n_pos] = -0.8 / n_pos
    coef[..., n_pos:] = 0.6 / (n - n_pos)
    t = torch.zeros(E, K, n, dtype=dtype)
    for k in range(K):
        t[:, k, k] = 1.0 / n_s
    fr = None
    if free:
        fr = torch.zeros_like(coef)
        fr[..., n_pos:] = coef[..., n_pos:]
    w0 = x[:, :K].clone() + 0.05 * torch.randn(E, K, D, generator=g, dtype=torch.float64).to(dtype)
    return x, RowTerms(t, ce, coef, fr), w0


def _fit(native, monkeypatch, *args, **kw):
    monkeypatch.setattr(_optim, "USE_NATIVE", native)
    return fit_weighted_distance(*args, **kw)


@needs_kernel
@pytest.mark.parametrize("free", [False, True])
@pytest.mark.parametrize("learn_scale", [True, False])
# D <= 256 takes the transposed-rows dot products, larger D the row-major ones (SMALL_D in the C file)
@pytest.mark.parametrize("shape", [(37, 27, 7), (16, 8, 5), (9, 64, 2), (50, 5, 11), (21, 300, 6), (13, 257, 5)])
def test_kernel_matches_torch_formulation_float64(monkeypatch, free, learn_scale, shape):
    n, D, K = shape
    x, terms, w0 = _problem(n=n, D=D, K=K, free=free)
    kw = dict(scale0=10.0, steps=60, lr=1e-2, learn_scale=learn_scale)
    wn, gn = _fit(True, monkeypatch, x, terms, w0, **kw)
    wt, gt = _fit(False, monkeypatch, x, terms, w0, **kw)
    assert (wn - w0).abs().max() > 1e-2  # the fit moved the prototypes: the comparison means something
    assert torch.allclose(wn, wt, atol=1e-10, rtol=0)
    assert torch.allclose(gn, gt, atol=1e-10, rtol=0)
    if not learn_scale:
        assert torch.equal(gn, torch.full_like(gn, 10.0))


@needs_kernel
def test_kernel_float32_close_to_float64(monkeypatch):
    x, terms, w0 = _problem(E=4, n=101, D=40, K=5, free=True)
    kw = dict(scale0=10.0, steps=250, lr=1e-3)
    w64, g64 = _fit(False, monkeypatch, x, terms, w0, **kw)
    t32 = RowTerms(*(None if t is None else t.float() for t in (terms.targets, terms.ce, terms.coef, terms.free)))
    w32, g32 = _fit(True, monkeypatch, x.float(), t32, w0.float(), **kw)
    assert w32.dtype == torch.float32
    assert torch.allclose(w32.double(), w64, atol=1e-5, rtol=0)
    assert torch.allclose(g32.double(), g64, atol=1e-4, rtol=0)


@needs_kernel
def test_an_episode_gets_the_same_bits_in_any_chunk(monkeypatch):
    x, terms, w0 = _problem(E=6, n=45, D=32, K=5, dtype=torch.float32)
    terms = RowTerms(terms.targets, terms.ce, terms.coef)
    whole_w, whole_g = _fit(True, monkeypatch, x, terms, w0, steps=40)
    for e in range(6):
        part = RowTerms(terms.targets[e : e + 1], terms.ce, terms.coef)
        w, g = _fit(True, monkeypatch, x[e : e + 1], part, w0[e : e + 1], steps=40)
        assert torch.equal(w[0], whole_w[e]) and torch.equal(g[0], whole_g[e])


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as in a new process, its library cache in ``tmp_path``."""
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_reason", "")
    monkeypatch.setenv("POODLE_NATIVE_DIR", str(tmp_path / "native"))
    return tmp_path / "native"


def test_no_compiler_falls_back_with_one_notice(fresh_loader, monkeypatch, capsys):
    monkeypatch.setattr(_native, "_compiler", lambda: None)
    assert _native.load() is None and _native.load() is None
    err = capsys.readouterr().err
    assert err.count("poodle: no C compiler") == 1 and "torch formulation" in err
    assert not _native.usable(torch.zeros(1))
    assert _native.status().startswith("torch formulation (no C compiler")
    # and the solvers still run (torch formulation)
    x, terms, w0 = _problem(E=1, n=12, D=8, K=3)
    w, _ = fit_weighted_distance(x, terms, w0, steps=3)
    assert w.shape == w0.shape


def test_a_compiler_that_fails_falls_back(fresh_loader, monkeypatch, tmp_path, capsys):
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\necho 'badcc: internal error' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    assert _native.load() is None
    err = capsys.readouterr().err
    assert "the fused kernel did not build" in err and "badcc: internal error" in err
    assert not list(fresh_loader.glob("*.so")) and not list(fresh_loader.glob("*.so.*"))


def test_disabled_by_environment(fresh_loader, monkeypatch, capsys):
    monkeypatch.setenv("POODLE_NATIVE", "0")
    assert _native.load() is None
    assert capsys.readouterr().err == ""
    assert "POODLE_NATIVE=0" in _native.status()


@pytest.mark.skipif(_native._compiler() is None, reason="no C compiler on this machine")
def test_library_built_once_and_reused(fresh_loader, monkeypatch):
    assert _native.load() is not None
    (lib,) = fresh_loader.glob("wd_kernel-*.so")
    stamp = os.stat(lib).st_mtime_ns
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_tried", False)
    assert _native.load() is not None
    assert [p.name for p in fresh_loader.iterdir()] == [lib.name]  # no temporary left, no second build
    assert os.stat(lib).st_mtime_ns == stamp


def _episodes(E=3, Ns=7, Nq=29, D=27, K=5, dtype=torch.float64, seed=0):
    """Random normalised rows as a batch of episodes, support labels in class order with one or more
    rows per class (Ns >= K)."""
    from poodle.solvers import EpisodeBatch

    g = torch.Generator().manual_seed(seed)
    s = F.normalize(torch.randn(E, Ns, D, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    q = F.normalize(torch.randn(E, Nq, D, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    labels = (torch.arange(Ns) % K).expand(E, Ns).clone()
    return EpisodeBatch(s, labels, q, None, K)


def _solve(native, monkeypatch, name, batch, **over):
    from poodle import solvers

    monkeypatch.setattr(_optim, "USE_NATIVE", native)
    return solvers.run(name, batch, solvers.make_config(name, over, strict=True))


@needs_kernel
@pytest.mark.parametrize(
    "name,over",
    [
        ("tim-gd", dict(steps=60, lr=1e-2)),
        ("tim-gd", dict(preset="poodle-paper", steps=60, lr=1e-2)),  # the learnt scale
        ("tim-gd", dict(steps=30, lr=1e-2, temperature=60.0)),  # sharp: marginal and p near 0
        ("entropy-min", dict(steps=60, lr=1e-2)),
    ],
)
# rows not a multiple of the kernel's vector width, classes not a multiple of its class block, odd D
@pytest.mark.parametrize("shape", [(7, 29, 27, 5), (5, 75, 64, 5), (4, 13, 8, 2), (14, 17, 33, 7), (11, 20, 300, 11)])
def test_logit_kernel_matches_torch_formulation_float64(monkeypatch, name, over, shape):
    Ns, Nq, D, K = shape
    batch = _episodes(Ns=Ns, Nq=Nq, D=D, K=K)
    nat = _solve(True, monkeypatch, name, batch, **over)
    ref = _solve(False, monkeypatch, name, batch, **over)
    from poodle.solvers.base import class_means

    w0 = class_means(batch.support, batch.support_labels, K)
    assert (ref.state["prototypes"] - w0).abs().max() > 1e-2  # the fit moved: the comparison means something
    assert torch.allclose(nat.state["prototypes"], ref.state["prototypes"], atol=1e-10, rtol=0)
    assert torch.allclose(nat.log_probs, ref.log_probs, atol=1e-9, rtol=0)
    if "scale" in ref.state:
        assert torch.allclose(nat.state["scale"], ref.state["scale"], atol=1e-10, rtol=0)


@needs_kernel
@pytest.mark.parametrize("name", ["tim-gd", "entropy-min"])
def test_logit_kernel_float32_close_and_chunk_independent(monkeypatch, name):
    batch = _episodes(E=5, Ns=5, Nq=75, D=64, K=5)
    over = dict(steps=100, lr=1e-3)
    ref = _solve(False, monkeypatch, name, batch, **over)
    b32 = batch.to("cpu", torch.float32)
    whole = _solve(True, monkeypatch, name, b32, **over)
    assert whole.log_probs.dtype == torch.float32
    assert torch.allclose(whole.state["prototypes"].double(), ref.state["prototypes"], atol=1e-5, rtol=0)
    for e in range(5):
        one = _solve(True, monkeypatch, name, b32.episode(e), **over)
        assert torch.equal(one.state["prototypes"][0], whole.state["prototypes"][e])
