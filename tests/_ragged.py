"""Ragged chunks for the solver tests: episodes of Meta-Dataset's shapes (each its own number of
ways, 1 to 100 support rows per class, 1 to 10 queries per class) padded into one
:class:`EpisodeBatch`, and the check every method must pass on them: each episode's result in the
padded chunk is the one it gets solved alone (the same predictions, probabilities within float
rounding, no probability on a padded class)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from conftest import clustered_features

from poodle.solvers import EpisodeBatch

# A method's plain float64 per-episode reference, registered where it is written, in the method's
# own test: ``@reference("name", **options)`` on ``fn(support [Ns, D], support_labels [Ns], query
# [Nq, D], way, negatives [M, D] or None, cfg) -> log_probs [Nq, way]`` (``options``: the method's
# options for the shared checks, fewer steps keeping the suite fast). tests/test_ragged_shots.py
# checks every registered method against its reference; :func:`references` finds them, so a new
# method's test is all it takes.
_REFERENCES: dict[str, tuple[Callable[..., torch.Tensor], dict[str, Any]]] = {}
_MARK = "@reference("


def reference(name: str, **options: Any) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Register ``fn`` as the reference of method ``name`` (see above)."""

    def deco(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        _REFERENCES[name] = (fn, dict(options))
        return fn

    return deco


def references() -> dict[str, tuple[Callable[..., torch.Tensor], dict[str, Any]]]:
    """``{method: (reference, options)}`` of every test module that registers one (imported here)."""
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.stem not in sys.modules and _MARK in path.read_text(encoding="utf-8"):
            importlib.import_module(path.stem)
    return dict(_REFERENCES)


DIM = 16
# (shots per class, queries per class) of each episode: ways 5 to 50, shots 1 to 100, queries 1 to 10
SHAPES: list[tuple[list[int], list[int]]] = [
    ([1, 1, 1, 1, 1], [10, 1, 5, 3, 7]),
    ([3, 1, 8, 2, 5, 1, 4, 2, 6, 1, 2, 3], [4, 2, 1, 10, 3, 5, 2, 1, 6, 2, 3, 4]),
    ([1] * 50, [1, 2] * 25),
    ([100, 1, 3, 20, 2, 5], [10, 10, 2, 1, 4, 6]),
    ([5] * 7, [3] * 7),
]


def ragged_episodes(
    seed: int = 0, shapes: list[tuple[list[int], list[int]]] | None = None, n_neg: int = 0, spread: float = 0.9
) -> tuple[list[EpisodeBatch], list[torch.Tensor]]:
    """float64 episodes, each a batch of one at its own size, of the classes of clustered features
    (support rows and queries shuffled within the episode), and each one's query labels ``[1, Nq]``.
    With ``n_neg``, every episode gets that many random unit negatives."""
    shapes = SHAPES if shapes is None else shapes
    x, lab = clustered_features(60, 112, DIM, seed=seed, spread=spread)
    x, lab = torch.from_numpy(x).double(), torch.from_numpy(lab)
    g = torch.Generator().manual_seed(seed)
    episodes, labels = [], []
    for shots, queries in shapes:
        way = len(shots)
        classes = torch.randperm(60, generator=g)[:way]
        s, ys, q, yq = [], [], [], []
        for k, c in enumerate(classes.tolist()):
            rows = torch.nonzero(lab == c).flatten()
            rows = rows[torch.randperm(len(rows), generator=g)]
            s.append(x[rows[: shots[k]]])
            ys += [k] * shots[k]
            q.append(x[rows[shots[k] : shots[k] + queries[k]]])
            yq += [k] * queries[k]
        s_t, q_t = torch.cat(s), torch.cat(q)
        ps, pq = torch.randperm(len(s_t), generator=g), torch.randperm(len(q_t), generator=g)
        neg = None
        if n_neg:
            neg = F.normalize(torch.randn(1, n_neg, DIM, generator=g, dtype=torch.float64), dim=-1)
        episodes.append(EpisodeBatch(s_t[ps][None], torch.tensor(ys)[ps][None], q_t[pq][None], neg, way))
        labels.append(torch.tensor(yq)[pq][None])
    return episodes, labels


def ragged_batch(seed: int = 0, n_neg: int = 0, **kw) -> tuple[EpisodeBatch, list[EpisodeBatch]]:
    """The padded chunk of :func:`ragged_episodes` and the episodes it holds."""
    episodes, _ = ragged_episodes(seed, n_neg=n_neg, **kw)
    return EpisodeBatch.stack(episodes), episodes


def assert_same_as_alone(
    name: str, padded_lp: torch.Tensor, alone_lp: list[torch.Tensor], batch: EpisodeBatch, tol: float = 1e-9
) -> None:
    """``padded_lp [E, Nq, way]`` (a ragged chunk's output) holds, for each episode, ``alone_lp[e]
    [1, nq_e, way_e]``: the same predictions and probabilities within ``tol`` on its real rows and
    classes, and exactly zero probability on its padded classes."""
    for e, want in enumerate(alone_lp):
        nq, way = want.shape[1], want.shape[2]
        rows = (
            torch.arange(padded_lp.shape[1]) if batch.query_mask is None else torch.nonzero(batch.query_mask[e])[:, 0]
        )
        got = padded_lp[e, rows]
        assert got.shape[0] == nq, f"{name}: episode {e} has {got.shape[0]} real queries, alone {nq}"
        assert torch.all(got[:, way:].exp() == 0), f"{name}: episode {e} puts probability on a padded class"
        got = got[:, :way]
        assert torch.equal(got.argmax(-1), want[0].argmax(-1)), f"{name}: episode {e}'s predictions differ from alone"
        diff = (got.exp() - want[0].exp()).abs().max().item()
        assert diff <= tol, f"{name}: episode {e}'s probabilities differ from alone by {diff:.3g} (> {tol:g})"
