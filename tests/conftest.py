"""Shared fixtures: small synthetic features that behave like a backbone's (clustered by class)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def clustered_features(
    n_classes: int, per_class: int, dim: int, seed: int = 0, spread: float = 0.6
) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalised float32 features ``[n_classes * per_class, dim]`` around random class centres,
    and int64 labels ``[N]`` (class-major). ``spread`` is the noise scale relative to the centres."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_classes, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres.repeat(per_class, 0) + spread * rng.standard_normal((n_classes * per_class, dim)) / np.sqrt(dim) * 4
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    labels = np.arange(n_classes).repeat(per_class)
    return x.astype(np.float32), labels.astype(np.int64)


@pytest.fixture
def make_features():
    """The :func:`clustered_features` factory."""
    return clustered_features


@pytest.fixture
def negatives_checks(monkeypatch):
    """Every check of a method's negatives rule (``SolverInfo.check_negatives``) as ``(method,
    source)``, in order; the rule still applies."""
    from poodle.solvers import base

    seen: list[tuple[str, str | None]] = []
    real = base.SolverInfo.check_negatives

    def counting(self: base.SolverInfo, cfg: object, source: str | None) -> None:
        seen.append((self.name, source))
        real(self, cfg, source)

    monkeypatch.setattr(base.SolverInfo, "check_negatives", counting)
    return seen


@pytest.fixture(autouse=True)
def _few_threads():
    # CI has 2 cores; fixing the thread count keeps timings and float summation order stable.
    torch.set_num_threads(2)
    yield


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """Fail a test that leaves a child process or a non-daemon thread behind: the interpreter's exit
    waits for both (multiprocessing joins its children after sending SIGTERM, which DataLoader
    workers ignore), so one left over hangs the whole run after its last test."""
    import multiprocessing as mp
    import threading

    before = {t.ident for t in threading.enumerate()}
    yield
    left = mp.active_children()  # also reaps the children that have ended
    for p in left:
        p.kill()
        p.join(5)
    threads = [t for t in threading.enumerate() if not t.daemon and t.ident not in before]
    for t in threads:
        t.join(10)  # a read ahead (poodle.prefetch) may still be finishing
    threads = [t.name for t in threads if t.is_alive()]
    if left or threads:
        pytest.fail(f"left running after the test: processes {[p.name for p in left]}, threads {threads}")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda(only=False): compares a device with the CPU (tests/test_cuda.py); runs where CUDA is present, or on "
        "the device POODLE_TEST_DEVICE names (benchmarks/gpu.py --device cpu) unless only=True",
    )


def pytest_collection_modifyitems(config, items):
    """Deselect (not skip) the ``cuda`` tests this machine cannot run: without CUDA they run only on
    the device POODLE_TEST_DEVICE names, and ``cuda(only=True)`` tests need CUDA itself."""
    import os

    has_cuda = torch.cuda.is_available()
    named = bool(os.environ.get("POODLE_TEST_DEVICE"))

    def runnable(item) -> bool:
        mark = item.get_closest_marker("cuda")
        if mark is None or has_cuda:
            return True
        return named and not mark.kwargs.get("only", False)

    keep = [i for i in items if runnable(i)]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if not runnable(i)])
        items[:] = keep
