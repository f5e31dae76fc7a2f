"""The statistics every table and record uses, in one place.

- :func:`mean_ci`: mean accuracy and the half-width of its 95% confidence interval,
  ``1.96 * std / sqrt(n)`` with the population standard deviation (ddof = 0), as the authors'
  evaluation code computes it;
- :func:`paired_difference`: the same over the per-episode differences of two results solved on
  identical episodes;
- :func:`paired_ttest`: the two-sided paired t-test of such a difference (which entry of a table
  is bold);
- :func:`wilson_interval`: the 95% Wilson score interval of one proportion (``poodle predict``'s
  accuracy over the queries of one task, where a normal interval is poor).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from poodle.errors import ConfigError

Z95 = 1.959964  # the two-sided 95% quantile of the normal distribution
CI_Z = 1.96  # the rounded one of the authors' evaluation code, kept for the records' ci95


def _vector(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64).reshape(-1)


def mean_ci(values: Any) -> tuple[float, float]:
    """``(mean, 1.96 * population std / sqrt(n))`` of per-episode values ``[E]`` (a sequence, a
    numpy array or a tensor), in their units; ``(nan, nan)`` when empty."""
    a = _vector(values)
    n = a.shape[0]
    if n == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(CI_Z * a.std() / math.sqrt(n))


def paired_difference(a: Any, b: Any) -> tuple[float, float]:
    """Mean of ``a - b`` over paired episodes (both ``[E]``) and its 95% half-width."""
    x, y = _vector(a), _vector(b)
    if x.shape != y.shape:
        raise ConfigError(f"a paired difference needs equal lengths, got {x.shape[0]} and {y.shape[0]}")
    return mean_ci(x - y)


def paired_ttest(a: Any, b: Any) -> tuple[float, float]:
    """Two-sided paired t-test of ``a - b`` (both ``[E]``, same episodes): ``(t, p)``.

    t = mean(d) / (std(d, ddof=1) / sqrt(E)), p = 2 * P(T_{E-1} > |t|). Identical inputs give
    ``(0, 1)``; a constant non-zero difference gives ``(+-inf, 0)``.
    """
    x, y = _vector(a), _vector(b)
    if x.shape != y.shape:
        raise ConfigError(f"a paired t-test needs two equal-length vectors, got {x.shape[0]} and {y.shape[0]}")
    n = x.shape[0]
    if n < 2:
        return float("nan"), 1.0
    d = x - y
    mean = d.mean()
    sd = d.std(ddof=1)
    if sd == 0:
        return (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / (sd / math.sqrt(n))
    # here, not at the top: solving and recording need no scipy (a bare GPU machine may lack it);
    # scipy.special, not scipy.stats: 0.2 s to import against 0.9 s
    from scipy import special

    return float(t), float(2 * special.stdtr(n - 1, -abs(t)))  # = 2 * scipy.stats.t.sf(|t|, n - 1)


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval ``(low, high)`` of a proportion ``correct / n`` (n > 0)."""
    p = correct / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


__all__ = ["CI_Z", "Z95", "mean_ci", "paired_difference", "paired_ttest", "wilson_interval"]
