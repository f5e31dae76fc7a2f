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


@pytest.fixture(autouse=True)
def _few_threads():
    # CI has 2 cores; fixing the thread count keeps timings and float summation order stable.
    torch.set_num_threads(2)
    yield
