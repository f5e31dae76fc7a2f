"""The statistics every table and record uses, in one place.

- :func:`mean_ci`: mean accuracy and the half-width of its 95% confidence interval,
  ``1.96 * std / sqrt(n)`` with the population standard deviation (ddof = 0), as the authors'
  evaluation code computes it;
- :func:`paired_difference`: the same over the per-episode differences of two results solved on
  identical episodes;
- :func:`paired_ttest`: the two-sided paired t-test of such a difference (which entry of a table
  is bold);
- :func:`wilson_interval`: the 95% Wilson score interval of one proportion (``poodle predict``'s
  accuracy over the queries of one task, where a normal interval is poor);
- :func:`descending_ranks`, :func:`average_rank_interval`: methods ranked by mean accuracy in each
  domain, their average rank over domains and its 95% bootstrap interval (the per-domain table of
  :func:`poodle.report.domain_table`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

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
        raise ConfigError(
            f"a paired difference needs equal lengths, got {x.shape[0]} and {y.shape[0]}", param="b", value=b
        )
    return mean_ci(x - y)


def paired_ttest(a: Any, b: Any) -> tuple[float, float]:
    """Two-sided paired t-test of ``a - b`` (both ``[E]``, same episodes): ``(t, p)``.

    t = mean(d) / (std(d, ddof=1) / sqrt(E)), p = 2 * P(T_{E-1} > |t|). Identical inputs give
    ``(0, 1)``; a constant non-zero difference gives ``(+-inf, 0)``.
    """
    x, y = _vector(a), _vector(b)
    if x.shape != y.shape:
        raise ConfigError(
            f"a paired t-test needs two equal-length vectors, got {x.shape[0]} and {y.shape[0]}", param="b", value=b
        )
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


TIE_TOL = 1e-9  # means closer than this are equal when ranking (far below 1 query in 1e8)
RANK_BOOTSTRAP = 1000  # bootstrap replicates of the average rank's interval
RANK_SEED = 0


def descending_ranks(values: Any, tol: float = TIE_TOL) -> np.ndarray:
    """Ranks along the last axis of ``values [..., M]``, 1 for the largest; values within ``tol``
    of each other are ties and share the mean of the positions they occupy (``[0.7, 0.7, 0.6]``
    -> ``[1.5, 1.5, 3]``): ``1 + #{j: v_j > v_i + tol} + #{j != i: |v_j - v_i| <= tol} / 2``."""
    v = np.asarray(values, dtype=np.float64)
    diff = v[..., None, :] - v[..., :, None]  # [..., i, j] = v_j - v_i
    greater = (diff > tol).sum(-1)
    equal = (np.abs(diff) <= tol).sum(-1) - 1
    return 1.0 + greater + equal / 2.0


def average_rank_interval(
    domains: Sequence[Sequence[Any]],
    *,
    n_boot: int = RANK_BOOTSTRAP,
    seed: int = RANK_SEED,
    level: float = 0.95,
    tol: float = TIE_TOL,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Average rank over domains of M methods and its bootstrap interval over episodes.

    ``domains[d][m]`` holds method m's per-episode accuracies ``[E_d]`` in domain d (every method in
    every domain). In each domain the methods are ranked by mean accuracy (:func:`descending_ranks`,
    1 = best, ties averaged); the average rank of a method is the mean of its ranks over domains.

    The interval resamples episodes, not domains: the domains are the fixed set being reported (a
    bootstrap over 3 to 10 domains says little), while each domain's means carry the sampling error
    of its episodes. Replicate b draws, in each domain independently, ``E_d`` episode numbers with
    replacement, ``rng.integers(0, E_d, size=(n_boot, E_d))`` with
    ``rng = np.random.default_rng([seed, d])`` (so a domain's draws do not depend on the others),
    and recomputes every method's mean on them, the ranks and the average rank. When the methods of
    a domain have the same number of episodes they share the drawn numbers (paired: methods solved
    on identical episodes are resampled together, as the paired t-test compares them); otherwise
    each method draws its own, from the same generator in method order. With the ``n_boot``
    replicate average ranks sorted, the interval is the ones at positions
    ``floor((n_boot - 1) * a)`` and ``ceil((n_boot - 1) * (1 - a))``, ``a = (1 - level) / 2``
    (numpy's quantile methods ``lower`` and ``higher``: both ends are average ranks some replicate
    reached). Deterministic: the same accuracies and seed give the same interval.

    Returns:
        ``(average rank [M], low [M], high [M])``.
    """
    if not domains:
        raise ConfigError("an average rank needs at least one domain", param="domains", value=domains)
    n_methods = len(domains[0])
    if any(len(d) != n_methods for d in domains):
        raise ConfigError(
            f"every domain needs all {n_methods} methods, got {[len(d) for d in domains]}",
            param="domains",
            value=domains,
        )
    if not 0 < level < 1:
        raise ConfigError.bad_value("level", level, "must lie in (0, 1)")
    if n_boot < 1:
        raise ConfigError.bad_value("n_boot", n_boot, "must be at least 1")
    point = np.zeros(n_methods)
    boot = np.zeros((n_boot, n_methods))
    for d, accs in enumerate(domains):
        vecs = [_vector(a) for a in accs]
        if any(v.shape[0] == 0 for v in vecs):
            raise ConfigError(f"domain {d}: a method has no episodes", param="domains", value=d)
        point += descending_ranks(np.array([v.mean() for v in vecs]), tol)
        rng = np.random.default_rng([seed, d])
        if len({v.shape[0] for v in vecs}) == 1:
            means = _resampled_means(np.stack(vecs), rng, n_boot)  # [n_boot, M]
        else:
            means = np.stack([_resampled_means(v[None], rng, n_boot)[:, 0] for v in vecs], axis=1)
        boot += descending_ranks(means, tol)
    point /= len(domains)
    boot /= len(domains)
    tail = (1 - level) / 2
    low = np.quantile(boot, tail, axis=0, method="lower")
    high = np.quantile(boot, 1 - tail, axis=0, method="higher")
    return point, low, high


def _resampled_means(acc: np.ndarray, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Means of ``acc [M, E]`` over ``n_boot`` resamples of its E episodes: ``[n_boot, M]``. The
    episode numbers of a replicate are one row of ``rng.integers(0, E, size=(n_boot, E))``, drawn
    a block of rows at a time (the same numbers as one call) to bound the memory."""
    n = acc.shape[1]
    out = np.empty((n_boot, acc.shape[0]))
    block = max(1, (1 << 20) // n)
    for start in range(0, n_boot, block):
        b = min(block, n_boot - start)
        idx = rng.integers(0, n, size=(b, n))
        counts = np.bincount((idx + n * np.arange(b)[:, None]).ravel(), minlength=b * n).reshape(b, n)
        out[start : start + b] = counts @ acc.T / n
    return out


__all__ = [
    "CI_Z",
    "RANK_BOOTSTRAP",
    "RANK_SEED",
    "TIE_TOL",
    "Z95",
    "average_rank_interval",
    "descending_ranks",
    "mean_ci",
    "paired_difference",
    "paired_ttest",
    "wilson_interval",
]
