"""Every registered method gives each episode the same bits whatever episodes share its batch: one
at a time, three at a time or all together (float32, one thread, as `poodle solve` runs a chunk).
Elementwise transcendental kernels on CPU compute a tensor's last few elements on a scalar path
whose rounding differs from the vector path's, so an episode's result could depend on where in the
chunk it sits; for the methods whose iterations amplify rounding (TIM-ADM on near-chance episodes)
that changes predictions with --max-memory."""

from __future__ import annotations

import pytest
import torch

from poodle import solvers
from poodle.solvers.base import EpisodeBatch

E, WAY, SHOT, Q, D, M = 11, 5, 1, 15, 100, 20


def _batch() -> EpisodeBatch:
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(E, WAY, D, generator=g)
    ys = torch.arange(WAY).repeat_interleave(SHOT).expand(E, -1).contiguous()
    yq = torch.arange(WAY).repeat_interleave(Q).expand(E, -1)
    s = torch.gather(centres, 1, ys.unsqueeze(-1).expand(-1, -1, D)) + 0.9 * torch.randn(E, WAY * SHOT, D, generator=g)
    q = torch.gather(centres, 1, yq.unsqueeze(-1).expand(-1, -1, D)) + 0.9 * torch.randn(E, WAY * Q, D, generator=g)
    neg = torch.randn(E, M, D, generator=g)
    norm = torch.nn.functional.normalize
    return EpisodeBatch(norm(s, dim=-1), ys, norm(q, dim=-1), norm(neg, dim=-1), WAY)


def _options(name: str) -> dict:
    info = solvers.get(name)
    return {"transductive": True} if info.transductive == "optional" else {}


def _part(b: EpisodeBatch, sl: slice) -> EpisodeBatch:
    # fresh tensors, as `poodle solve` gathers each chunk into new buffers: an episode's rows then
    # start at another alignment than in the whole batch (D = 100: 400-byte rows)
    neg = None if b.negatives is None else b.negatives[sl].clone()
    return EpisodeBatch(b.support[sl].clone(), b.support_labels[sl].clone(), b.query[sl].clone(), neg, b.way)


@pytest.mark.parametrize("name", solvers.available())
def test_an_episode_gets_the_same_bits_in_any_batch(name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = _batch()
        if not solvers.get(name).uses_negatives:
            b = EpisodeBatch(b.support, b.support_labels, b.query, None, WAY)
        opts = _options(name)
        whole = solvers.run(name, b, **opts).log_probs
        for size in (1, 2, 3, 4, 5):
            parts = torch.cat(
                [solvers.run(name, _part(b, slice(i, i + size)), **opts).log_probs for i in range(0, E, size)]
            )
            bad = torch.nonzero((parts != whole).flatten(1).any(1)).flatten().tolist()
            assert not bad, f"{name}: episodes {bad} differ when solved {size} at a time"
    finally:
        torch.set_num_threads(threads)
