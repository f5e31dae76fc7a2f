"""The fused CPU kernel of the fine-tuning solvers (poodle/solvers/_fit_kernel.c): it computes what
the torch formulation computes, on shapes that exercise every tail and padding path and on strided
and shared inputs, gives an episode the same bits whatever chunk it comes in, is loaded only from a
private directory and only when it says this source and interface, and falls back cleanly (one
notice, the torch formulation) where it cannot be had."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from poodle.events import NoticeWarning
from poodle.solvers import _native, _optim
from poodle.solvers import backend as _backend
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
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=native))
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
    """The loader as in a new process, its library cache in ``tmp_path / "native"``."""
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_state", None)
    monkeypatch.setenv("POODLE_NATIVE_DIR", str(tmp_path / "native"))
    return tmp_path / "native"


def _notices(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, NoticeWarning)]


def test_no_compiler_falls_back_with_one_notice(fresh_loader, monkeypatch):
    monkeypatch.setattr(_native, "_compiler", lambda: None)
    with pytest.warns(NoticeWarning) as record:
        assert _native.load() is None and _native.load() is None
    (notice,) = _notices(record)
    assert notice.startswith("no C compiler") and "torch formulation" in notice
    assert record[0].message.notice.code == "native-kernel"
    assert not _native.usable(torch.zeros(1))
    assert _native.status().startswith("torch formulation (no C compiler")
    # and the solvers still run (torch formulation)
    x, terms, w0 = _problem(E=1, n=12, D=8, K=3)
    w, _ = fit_weighted_distance(x, terms, w0, steps=3)
    assert w.shape == w0.shape


def test_a_compiler_that_fails_falls_back(fresh_loader, monkeypatch, tmp_path):
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\necho 'badcc: internal error' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with pytest.warns(NoticeWarning) as record:
        assert _native.load() is None
    (notice,) = _notices(record)
    assert "the fused kernel did not build" in notice and "badcc: internal error" in notice
    assert not list(fresh_loader.glob("*.so")) and not list(fresh_loader.glob("*.so.*"))


def test_disabled_by_environment(fresh_loader, monkeypatch, recwarn):
    monkeypatch.setenv("POODLE_NATIVE", "0")
    assert _native.load() is None
    assert not _notices(recwarn)
    assert "POODLE_NATIVE=0" in _native.status()


needs_compiler = pytest.mark.skipif(_native._compiler() is None, reason="no C compiler on this machine")
is_root = hasattr(os, "geteuid") and os.geteuid() == 0


@needs_compiler
def test_library_built_once_into_a_private_directory_and_reused(fresh_loader, monkeypatch):
    assert _native.load() is not None
    assert stat.S_IMODE(fresh_loader.stat().st_mode) == 0o700
    (lib,) = fresh_loader.glob("fit_kernel-*.so")
    assert not lib.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    st = _native.state()
    assert st.loaded and st.library == str(lib) and st.directory == str(fresh_loader)
    assert st.source_hash == hashlib.sha256(_native._SOURCE.read_bytes()).hexdigest()
    stamp = os.stat(lib).st_mtime_ns
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_state", None)
    assert _native.load() is not None
    assert [p.name for p in fresh_loader.iterdir()] == [lib.name]  # no temporary left, no second build
    assert os.stat(lib).st_mtime_ns == stamp


def _refused_then_same_as_torch(monkeypatch, what: str) -> None:
    """The kernel is refused with one notice naming ``what``, and the fits equal the torch formulation's."""
    with pytest.warns(NoticeWarning) as record:
        assert _native.load() is None
    (notice,) = _notices(record)
    assert "not loaded" in notice and what in notice and "torch formulation" in notice
    assert not _native.state().loaded
    x, terms, w0 = _problem(E=2, n=15, D=9, K=3)
    w, g = fit_weighted_distance(x, terms, w0, steps=20, lr=1e-2)
    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=False))
    wt, gt = fit_weighted_distance(x, terms, w0, steps=20, lr=1e-2)
    assert torch.equal(w, wt) and torch.equal(g, gt)


@needs_compiler
def test_a_group_writable_directory_is_refused(fresh_loader, monkeypatch):
    fresh_loader.mkdir()
    fresh_loader.chmod(0o775)
    _refused_then_same_as_torch(monkeypatch, "writable by group or others (mode 0775)")
    assert not list(fresh_loader.iterdir())  # nothing built there


@needs_compiler
@pytest.mark.skipif(not is_root, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(fresh_loader, monkeypatch):
    fresh_loader.mkdir(mode=0o700)
    os.chown(fresh_loader, 54321, 54321)
    _refused_then_same_as_torch(monkeypatch, "owned by uid 54321")


@needs_compiler
@pytest.mark.parametrize("how", ["group-writable", "other user"])
def test_a_library_file_others_could_write_is_refused(fresh_loader, monkeypatch, how):
    if how == "other user" and not is_root:
        pytest.skip("giving a file to another user needs root")
    assert _native.load() is not None  # built and loaded once: the file is ours
    (lib,) = fresh_loader.glob("fit_kernel-*.so")
    if how == "group-writable":
        lib.chmod(0o770)
    else:
        os.chown(lib, 54321, 54321)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_state", None)
    _refused_then_same_as_torch(monkeypatch, f"library {lib}")


@needs_compiler
def test_no_private_cache_directory_builds_into_a_fresh_temporary_one(fresh_loader, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("POODLE_NATIVE_DIR", str(blocker / "native"))
    assert _native.load() is not None
    where = Path(_native.state().directory)
    assert where.parent == Path(tempfile.gettempdir()) and where.name.startswith("poodle-native-")
    assert where.name != f"poodle-native-{os.getuid()}"  # not the predictable name of before
    assert stat.S_IMODE(where.stat().st_mode) == 0o700 and where.stat().st_uid == os.getuid()
    assert list(where.glob("fit_kernel-*.so"))


@needs_compiler
def test_a_library_of_another_source_is_rebuilt_never_called(fresh_loader, monkeypatch):
    real = _native._compile
    calls = []

    def wrong_source(cc, flags, path, source_hash):
        calls.append(path)
        return real(cc, flags, path, "0" * 64)  # as if built from another version of the source

    monkeypatch.setattr(_native, "_compile", wrong_source)
    with pytest.warns(NoticeWarning) as record:
        assert _native.load() is None  # just built, and still not what this module expects: not called
    assert (
        f"was just built but it says interface {_native.FIT_INTERFACE} and source 000000000000" in _notices(record)[0]
    )
    assert len(list(fresh_loader.glob("fit_kernel-*.so"))) == 1
    # a later process finds that library: it is rebuilt, then loaded
    rebuilt = []
    monkeypatch.setattr(_native, "_compile", lambda *a: rebuilt.append(a[2]) or real(*a))
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_state", None)
    loaded = _native.load()
    assert loaded is not None and rebuilt == calls
    assert loaded.poodle_kernel_source().decode() == _native.state().source_hash


@needs_compiler
def test_a_library_of_another_interface_is_not_called(fresh_loader, monkeypatch):
    monkeypatch.setattr(_native, "FIT_INTERFACE", _native.FIT_INTERFACE + 1)
    with pytest.warns(NoticeWarning) as record:
        assert _native.load() is None
    assert f"it says interface {_native.FIT_INTERFACE - 1}" in _notices(record)[0]


@needs_kernel
def test_the_c_side_checks_the_struct_version_and_size():
    lib = _native.load()
    x, terms, w0 = _problem(E=1, n=6, D=4, K=2)
    args = _native.FitArgs(version=_native.FIT_INTERFACE + 1, size=ctypes.sizeof(_native.FitArgs))
    assert lib.poodle_fit(ctypes.byref(args)) == -2
    args = _native.FitArgs(version=_native.FIT_INTERFACE, size=ctypes.sizeof(_native.FitArgs) - 8)
    assert lib.poodle_fit(ctypes.byref(args)) == -2
    args = _native.FitArgs(version=_native.FIT_INTERFACE, size=ctypes.sizeof(_native.FitArgs), dtype=7)
    assert lib.poodle_fit(ctypes.byref(args)) == -3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_strided_and_shared_inputs_give_the_same_bits(dtype):
    """Rows every other row of a larger tensor, episodes every other episode, targets shared by all
    episodes (stride 0): the struct's strides address them; the bits equal contiguous inputs'."""
    E, n, D, K = 3, 13, 11, 4
    x, terms, w0 = _problem(E=E, n=n, D=D, K=K, dtype=dtype, free=True)
    shared = RowTerms(terms.targets[:1], terms.ce, terms.coef, terms.free)
    big = torch.zeros(2 * E, 2 * n, D, dtype=dtype)
    big[::2, ::2] = x
    strided = big[::2, ::2]
    assert strided.stride() == (4 * n * D, 2 * D, 1)
    opts = _optim.FitOptions(steps=25, lr=1e-2)
    ref = _native.fit(
        x,
        w0,
        _optim.WeightedDistance(
            x, RowTerms(terms.targets[:1].expand(E, K, n).contiguous(), terms.ce, terms.coef, terms.free)
        ).kernel(),
        opts,
    )
    out = _native.fit(strided, w0, _optim.WeightedDistance(strided, shared).kernel(), opts)
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
    # a logit loss, its one-hot targets shared
    y = torch.eye(K, dtype=dtype)[:, :K].unsqueeze(0)
    loss = _native.KernelTerms("tim", y, n_support=K, weights=(1.0, 1.0, 0.1))
    ref = _native.fit(x, w0, dataclasses.replace(loss, targets=y.expand(E, K, K).contiguous()), opts)
    out = _native.fit(strided, w0, loss, opts)
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])


def test_formulation_says_which_arithmetic_ran(monkeypatch):
    from poodle import solvers

    batch = _episodes(E=2, Ns=5, Nq=10, D=8, K=5)
    be = _backend.Backend()  # one run's backend: what it ran is its report
    for name, over in (("poodle", dict(steps=3, beta=0.0)), ("alpha-tim", dict(steps=3)), ("proto", {})):
        solvers.run(name, batch, solvers.make_config(name, over, strict=True), backend=be)
    kernel = f"kernel {_native.state().source_hash[:12]}"
    assert be.formulation("poodle", "cpu") == (
        kernel if _native.state().loaded else f"torch ({_native.state().reason})"
    )
    assert be.formulation("alpha-tim", "cpu") == be.formulation("poodle", "cpu")  # its loss is in the kernel
    with _backend.active(be, "a-loss-of-its-own"):  # a logit loss without a NativeLoss runs torch
        x = torch.cat([batch.support, batch.query], 1)
        w0 = batch.support[:, :5]
        _optim.fit_logit_loss(x, w0, lambda P, L, G: G.zero_(), scale0=1.0, steps=1, lr=1e-3, learn_scale=False)
    assert be.formulation("a-loss-of-its-own", "cpu") == "torch (no fused kernel for this loss)"
    assert be.formulation("proto", "cpu") == "torch"  # no fit of this engine
    assert be.formulation("poodle", "cuda") == "torch"
    assert _backend.Backend().formulation("poodle", "cpu") == "torch"  # another run's report is its own
    off = _backend.Backend(native=False)
    solvers.run("poodle", batch, solvers.make_config("poodle", dict(steps=3, beta=0.0), strict=True), backend=off)
    assert off.formulation("poodle", "cpu") == "torch (the fused kernel switched off)"
    assert be.formulation("poodle", "cpu") != off.formulation("poodle", "cpu")


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

    monkeypatch.setattr(_backend, "default", lambda: _backend.Backend(native=native))
    return solvers.run(name, batch, solvers.make_config(name, over, strict=True))


@needs_kernel
@pytest.mark.parametrize(
    "name,over",
    [
        ("tim-gd", dict(steps=60, lr=1e-2)),
        ("tim-gd", dict(preset="poodle-paper", steps=60, lr=1e-2)),  # the learnt scale
        ("tim-gd", dict(steps=30, lr=1e-2, temperature=60.0)),  # sharp: marginal and p near 0
        ("entropy-min", dict(steps=60, lr=1e-2)),
        ("alpha-tim", dict(steps=60, lr=1e-2, alpha=7.0)),  # an integer power (by products)
        ("alpha-tim", dict(steps=60, lr=1e-2, alpha=2.5)),  # any other order
        ("tim-adm", dict(steps=30)),  # closed-form updates, not Adam
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
@pytest.mark.parametrize(
    "name,alpha", [("tim-gd", None), ("entropy-min", None), ("alpha-tim", 2.0), ("alpha-tim", 3.5), ("tim-adm", None)]
)
def test_logit_kernel_float32_close_and_chunk_independent(monkeypatch, name, alpha):
    batch = _episodes(E=5, Ns=5, Nq=75, D=64, K=5)
    over = dict(steps=100) | ({} if name == "tim-adm" else dict(lr=1e-3)) | ({} if alpha is None else dict(alpha=alpha))
    ref = _solve(False, monkeypatch, name, batch, **over)
    b32 = batch.to("cpu", torch.float32)
    whole = _solve(True, monkeypatch, name, b32, **over)
    assert whole.log_probs.dtype == torch.float32
    assert torch.allclose(whole.state["prototypes"].double(), ref.state["prototypes"], atol=1e-5, rtol=0)
    for e in range(5):
        one = _solve(True, monkeypatch, name, b32.episode(e), **over)
        assert torch.equal(one.state["prototypes"][0], whole.state["prototypes"][e])
