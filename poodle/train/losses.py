"""Training losses of the three recipes.

- Label-smoothed cross-entropy as the authors' release computes it (SmoothCrossEntropy): the target
  puts ``1 - eps`` on the true class and ``eps / (C - 1)`` on each other class (the paper's section 6
  describes the same "0.9 and uniformly distribute 0.1 to the rest"), and the loss is the KL
  divergence to it, averaged over the batch. KL and soft-target CE differ by the target's entropy,
  a constant, so the gradients are those of CE; the KL form is reported because it reaches 0.
- Rotation self-supervision (Gidaris et al., "Boosting few-shot visual learning with
  self-supervision", ICCV 2019, arXiv:1906.05186): every image in all four rotations.
- Distillation (Hinton et al., "Distilling the knowledge in a neural network", arXiv:1503.02531) in
  the born-again setting (Furlanello et al., "Born again neural networks", ICML 2018,
  arXiv:1805.04770): KL(teacher_T || student_T) * T^2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def smooth_cross_entropy(logits: Tensor, target: Tensor, eps: float = 0.1) -> Tensor:
    """KL(q || softmax(logits)) averaged over the batch, q the smoothed one-hot target.

    Args:
        logits: ``[B, C]`` class scores (computed in float32 whatever the autocast dtype).
        target: ``[B]`` int64 class indices.
        eps: smoothing; 0 gives the plain cross-entropy.
    Returns:
        scalar loss.
    """
    logits = logits.float()
    log_p = F.log_softmax(logits, dim=1)
    if eps == 0.0:
        return F.nll_loss(log_p, target)
    c = logits.shape[1]
    q = torch.full_like(log_p, eps / (c - 1))
    q.scatter_(1, target.unsqueeze(1), 1.0 - eps)
    return (torch.xlogy(q, q) - q * log_p).sum(1).mean()


def distill_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """``T^2 * KL(softmax(t/T) || softmax(s/T))``, summed over classes, averaged over the batch.

    Args:
        student_logits, teacher_logits: ``[B, C]``.
        temperature: tau of appendix A (4).
    """
    t = temperature
    log_s = F.log_softmax(student_logits.float() / t, dim=1)
    log_t = F.log_softmax(teacher_logits.float() / t, dim=1)
    return (log_t.exp() * (log_t - log_s)).sum(1).mean() * (t * t)


def rotate_all(images: Tensor) -> tuple[Tensor, Tensor]:
    """All four rotations of every image, rotation-major (the release's order).

    Args:
        images: ``[B, C, H, W]``.
    Returns:
        ``([4B, C, H, W], rotation labels [4B])`` with images ``0..B-1`` unrotated (label 0), then
        all rotated by 90 degrees (label 1), 180 (2), 270 (3).
    """
    b = images.shape[0]
    rotated = torch.cat([torch.rot90(images, k, dims=(2, 3)) for k in range(4)], dim=0)
    labels = torch.arange(4, device=images.device).repeat_interleave(b)
    return rotated, labels
