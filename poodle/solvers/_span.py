"""Class centres kept as weighted sums of an episode's own rows (PT-MAP, PEMnE-BMS, PADDLE, protoLP).

These methods only ever move a centre to a weighted mean of the episode's samples (or part of the
way there), so every centre is ``mu_k = sum_n A_kn z_n`` over the ``N = Ns + Nq`` rows ``z`` of its
episode, and all they read from a centre is its inner products with the queries and its norm. Two
ways to hold a centre, chosen per call by arithmetic:

- **explicit**: ``mu [E, K, D]``; a step's scores are ``mu z_q^T`` and its new centres ``W z``,
  two products with a K-row operand (``2 K (Nq + N) D`` FLOPs), which BLAS runs at a fraction of
  its large-GEMM rate;
- **Gram**: the weights ``A [E, K, N]`` and, once per call, the Gram matrix ``G = z z^T [E, N, N]``
  (one well-shaped product, ``2 N^2 D`` FLOPs); a step's scores are ``A G`` (``2 K N^2``) and
  its new centres are weights, with no product at all. With the standard workload (N = 80 rows of
  D = 640) a 21-step PT-MAP does half the arithmetic of the explicit form, in one product that
  runs near the matmul rate instead of 42 narrow ones.

Both compute the same quantities; results agree to float rounding (tests/test_solvers_transductive.py
checks both against the float64 references). Every operation here is linear in the state, so
callers mix, scale and interpolate states with ordinary tensor arithmetic, whichever form they hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from poodle.solvers._transductive import masked_mean, row_sqnorm

# Force one form (tests): None chooses by arithmetic, True the Gram form, False the explicit form.
FORCE_GRAM: bool | None = None


def span_flops(n_s: int, n_q: int, d: int, k: int, scores: int, sums: int, gram: bool) -> float:
    """FLOPs of ``scores`` score evaluations and ``sums`` query-weighted sums in one form, setup and the
    final explicit centres included."""
    n = n_s + n_q
    if gram:
        return 2.0 * n * n * d + scores * 2.0 * k * n * n + 2.0 * k * n * d
    return 2.0 * k * n_s * d + (scores + sums) * 2.0 * k * n_q * d


def use_gram(n_s: int, n_q: int, d: int, k: int, scores: int, sums: int) -> bool:
    """Whether to hold centres in the Gram form: when it does less arithmetic and the Gram matrix is
    smaller than the rows (``N < D``; with more rows than dimensions its entries carry no less
    rounding than the rows, and the measured gain is small)."""
    if FORCE_GRAM is not None:
        return FORCE_GRAM
    gram, explicit = (span_flops(n_s, n_q, d, k, scores, sums, g) for g in (True, False))
    return n_s + n_q < d and gram < explicit


class RowSpan:
    """The rows ``z [E, N, D]`` of a batch of episodes, support first (``n_s`` of them), and the form
    in which centres are held (see the module docstring). A *state* is a ``[E, K, D]`` tensor
    (explicit) or a ``[E, K, N]`` one (Gram); ``scores`` and ``sums`` are the numbers of score
    evaluations and of query-weighted sums the caller will make (they pick the form; ``gram``
    forces one). With ``centre``, the Gram form takes its products relative to the queries' mean
    (for methods that only see differences of squared distances; ``z`` is then changed in place);
    ``query_weight [E, Nq, 1]`` (0/1) marks a ragged chunk's real queries, whose mean that is."""

    def __init__(
        self,
        z: Tensor,
        n_s: int,
        k: int,
        scores: int,
        sums: int,
        gram: bool | None = None,
        centre: bool = False,
        query_weight: Tensor | None = None,
    ) -> None:
        self.z, self.n_s = z, n_s
        self.z_s, self.z_q = z[:, :n_s], z[:, n_s:]
        self.gram = use_gram(n_s, z.shape[1] - n_s, z.shape[2], k, scores, sums) if gram is None else gram
        self.origin: Tensor | None = None
        if self.gram:
            if centre:
                # products relative to the queries' mean (``z`` is centred in place): the Gram
                # entries are then of the size of the spread, not of the offset, and so are their
                # rounding errors
                self.origin = masked_mean(self.z_q, query_weight)
                z.sub_(self.origin)
            self.g = torch.bmm(self.z, self.z.transpose(1, 2))  # [E, N, N]

    def support_sum(self, w_s: Tensor) -> Tensor:
        """The state of ``w_s z_s``: ``w_s [E, K, Ns]``."""
        if self.gram:
            return F.pad(w_s, (0, self.z.shape[1] - self.n_s))
        return torch.bmm(w_s, self.z_s)

    def query_sum(self, w_q: Tensor) -> Tensor:
        """The state of ``w_q z_q``: ``w_q [E, K, Nq]``."""
        if self.gram:
            return F.pad(w_q, (self.n_s, 0))
        return torch.bmm(w_q, self.z_q)

    def mean(self, w_s: Tensor, w_q: Tensor, den: Tensor, support: Tensor | None = None) -> Tensor:
        """The state of ``(w_s z_s + w_q z_q) / den``: ``w_s [E, K, Ns]``, ``w_q [E, K, Nq]``,
        ``den [E, K, 1]``; ``support`` is ``support_sum(w_s)`` when the caller holds it."""
        if self.gram:
            out = w_q.new_empty(*w_q.shape[:2], self.z.shape[1])
            torch.div(w_s, den, out=out[:, :, : self.n_s])
            torch.div(w_q, den, out=out[:, :, self.n_s :])
            return out
        if support is None:
            support = self.support_sum(w_s)
        return torch.bmm(w_q, self.z_q).add_(support).div_(den)

    def sum(self, w: Tensor) -> Tensor:
        """The state of ``w z`` over all rows: ``w [E, K, N]``."""
        return w if self.gram else torch.bmm(w, self.z)

    def scores(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """``(<mu_k, z_q> [E, K, Nq], ||mu_k||^2 [E, K])`` of the centres a state holds."""
        if self.gram:
            ag = torch.bmm(state, self.g)  # [E, K, N]: <mu_k, z_n>
            return ag[:, :, self.n_s :], (ag * state).sum(2)
        return torch.bmm(state, self.z_q.transpose(1, 2)), row_sqnorm(state).squeeze(2)

    def dots(self, state: Tensor) -> Tensor:
        """``<mu_k, z_q> [E, K, Nq]``."""
        if self.gram:
            return torch.bmm(state, self.g[:, :, self.n_s :])
        return torch.bmm(state, self.z_q.transpose(1, 2))

    def sqnorm(self, state: Tensor) -> Tensor:
        """``||mu_k||^2 [E, K]``."""
        if self.gram:
            return (torch.bmm(state, self.g) * state).sum(2)
        return row_sqnorm(state).squeeze(2)

    def normalize(self, state: Tensor) -> Tensor:
        """The state of the unit centres ``mu_k / max(||mu_k||, 1e-12)`` (``F.normalize``)."""
        if self.gram:
            return state / self.sqnorm(state).sqrt_().clamp_min_(1e-12).unsqueeze(2)
        return F.normalize(state, dim=-1)

    def normalize_dots(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """``(normalize(state), dots(normalize(state)))``. In the Gram form from the one product that
        the norms take (``A G``): the unit centres' scores are the centres' divided by their norms
        (float rounding of :meth:`dots` of the unit state, the state itself the same bits)."""
        if not self.gram:
            unit = self.normalize(state)
            return unit, self.dots(unit)
        ag = torch.bmm(state, self.g)
        norm = (ag * state).sum(2).sqrt_().clamp_min_(1e-12).unsqueeze(2)
        return state / norm, ag[:, :, self.n_s :] / norm

    def explicit(self, state: Tensor) -> Tensor:
        """The centres ``[E, K, D]``."""
        if not self.gram:
            return state
        if self.origin is None:
            return torch.bmm(state, self.z)
        return torch.baddbmm(state.sum(2, keepdim=True) * self.origin, state, self.z)
