"""Meta-validation during training: nearest-prototype accuracy on episodes of the val split.

As the authors' release (``meta_val``): every few epochs, 500 episodes of 5-way 1-shot with 15
queries per class; features are computed in memory with the evaluation transform and L2-normalised
(nearest prototype on unit vectors ranks as the release's cosine metric); the model with the best
mean accuracy is kept. The episodes are drawn once per run, so successive validations are paired.
"""

from __future__ import annotations

from typing import Callable, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from poodle.episodes import EpisodeSpec, sample_episodes
from poodle.solvers import EpisodeBatch
from poodle.solvers import run as run_solver


@torch.no_grad()
def embed(
    model: torch.nn.Module,
    dataset: Dataset,
    *,
    batch_size: int,
    device: torch.device,
    workers: int = 0,
    amp: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Tensor:
    """L2-normalised ``forward_features`` of every image of ``dataset``, in order: ``[N, D]`` float32 on CPU.

    A dataset with a ``finish`` attribute (:class:`poodle.data.ImageDataset`) has each collated batch
    passed through it first (uint8 ``[B, 3, H, W]`` -> float32).

    The model is put in eval mode and restored to its previous mode afterwards.
    """
    was_training = model.training
    model.eval()
    from poodle.interrupt import loader_batches, quiet_worker

    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        worker_init_fn=quiet_worker if workers else None,
    )
    chunks = []
    # uint8 batches from an ImageDataset: its ToTensor scaling and normalisation, once per batch
    finish = getattr(dataset, "finish", None)
    try:
        with loader_batches(loader) as batches:
            for images, labels in batches:
                if workers > 0 and hasattr(dataset, "check"):
                    dataset.check(labels)  # a bad image in a worker arrives as a sentinel label
                images = images.to(device, non_blocking=True)
                if finish is not None:
                    images = finish(images)  # on the device: the uint8 batch is what is copied
                with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                    forward_features = cast(Callable[[Tensor], Tensor], model.forward_features)
                    f = forward_features(images)
                chunks.append(F.normalize(f.float(), dim=1).cpu())
                if progress is not None:
                    progress(images.shape[0])
    finally:
        model.train(was_training)
    return torch.cat(chunks)


def episode_accuracy(features: Tensor, episodes, method: str = "proto", chunk: int = 250) -> Tensor:
    """Per-episode accuracy ``[E]`` float64 of ``method`` on ``episodes`` (a
    :class:`poodle.episodes.EpisodeSet` indexing rows of ``features [N, D]``)."""
    accs = []
    for a in range(0, len(episodes), chunk):
        eps = episodes[a : a + chunk]
        batch = EpisodeBatch(features[eps.support], eps.support_labels, features[eps.query], None, eps.spec.way)
        pred = run_solver(method, batch).log_probs.argmax(-1)
        accs.append((pred == eps.query_labels).double().mean(1))
    return torch.cat(accs)


class Validator:
    """Holds the val dataset and its fixed episodes; :meth:`__call__` scores a model.

    Args:
        dataset: the val split with the evaluation transform (yields ``(image, label)``).
        labels: ``[N]`` int64 labels of ``dataset`` in order.
        way, shot, query, n_episodes, seed: the episode setting (release: 5, 1, 15, 500).
    """

    def __init__(
        self,
        dataset: Dataset,
        labels: Tensor,
        classes: list[str] | None,
        *,
        way: int,
        shot: int,
        query: int,
        n_episodes: int,
        seed: int,
        split: str = "val",
    ) -> None:
        self.dataset = dataset
        spec = EpisodeSpec(split=split, way=way, shot=shot, query=query, seed=seed)
        self.episodes = sample_episodes(labels, spec, n_episodes, classes=classes)

    def __call__(
        self,
        model: torch.nn.Module,
        *,
        batch_size: int,
        device: torch.device,
        workers: int = 0,
        amp: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> float:
        """Mean nearest-prototype accuracy (a fraction in [0, 1])."""
        feats = embed(
            model, self.dataset, batch_size=batch_size, device=device, workers=workers, amp=amp, progress=progress
        )
        return float(episode_accuracy(feats, self.episodes).mean())
