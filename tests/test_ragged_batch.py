"""The padded chunk of episodes of different shapes (``EpisodeBatch.stack``) and its way back
(``EpisodeBatch.episode``): the layout every solver's ragged test builds on."""

from __future__ import annotations

import torch
from _ragged import SHAPES, ragged_batch

from poodle.solvers import EpisodeBatch, one_hot
from poodle.solvers.base import class_means, mask_classes


def test_stack_pads_and_episode_crops_back():
    batch, episodes = ragged_batch(n_neg=7)
    E = len(SHAPES)
    assert batch.n_episodes == E and batch.way == 50 and batch.ragged
    assert batch.ways.tolist() == [len(s) for s, _ in SHAPES]
    assert batch.support.shape[1] == max(sum(s) for s, _ in SHAPES)
    assert batch.query_mask.sum(1).tolist() == [sum(q) for _, q in SHAPES]
    assert batch.n_query().tolist() == [float(sum(q)) for _, q in SHAPES]
    assert torch.equal(batch.support_mask, batch.support_labels >= 0)
    for e, ep in enumerate(episodes):
        back = batch.episode(e)
        assert back.way == ep.way and not back.ragged
        for a, b in ((back.support, ep.support), (back.support_labels, ep.support_labels), (back.query, ep.query)):
            assert torch.equal(a, b)
        assert torch.equal(back.negatives, ep.negatives)
    # padded rows are zeros with label -1
    pad = ~batch.support_mask
    assert torch.all(batch.support[pad] == 0) and torch.all(batch.support_labels[pad] == -1)
    assert torch.all(batch.query[~batch.query_mask] == 0)


def test_equal_episodes_stack_to_a_plain_batch():
    _, episodes = ragged_batch(shapes=[([2, 2, 2], [3, 3, 3])] * 3)
    batch = EpisodeBatch.stack(episodes)
    assert not batch.ragged and batch.ways is None and batch.way == 3


def test_padding_takes_no_weight_in_the_shared_helpers():
    batch, episodes = ragged_batch()
    y = one_hot(batch.support_labels, batch.way, batch.support.dtype)
    assert torch.all(y[~batch.support_mask] == 0)
    means = class_means(batch.support, batch.support_labels, batch.way)
    for e, ep in enumerate(episodes):
        alone = class_means(ep.support, ep.support_labels, ep.way)
        assert torch.allclose(means[e, : ep.way], alone[0], atol=1e-15)
        assert torch.all(means[e, ep.way :] == 0)
    logits = torch.zeros(batch.n_episodes, 4, batch.way, dtype=torch.float64)
    p = mask_classes(logits, batch).softmax(-1)
    for e, ep in enumerate(episodes):
        assert torch.allclose(p[e, :, : ep.way].sum(-1), torch.ones(4, dtype=torch.float64))
        assert torch.all(p[e, :, ep.way :] == 0)
