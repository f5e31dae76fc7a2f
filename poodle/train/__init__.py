"""Pre-training of backbones on the base classes: the three baselines of POODLE's appendix A.

Le et al., "POODLE: Improving Few-shot Learning via Penalizing Out-of-Distribution Samples",
NeurIPS 2021, arXiv:2206.04679, appendix A:

- ``simple``: cross-entropy over the base classes (label smoothing 0.1 as in the authors' release);
- ``rot``: plus a 4-way rotation-prediction head on all four rotations of every image (Gidaris et
  al., ICCV 2019, arXiv:1906.05186), lambda = 1;
- ``rot-kd``: ``rot``, then born-again distillation (Furlanello et al., ICML 2018,
  arXiv:1805.04770) for two generations at temperature 4, each student taught by the previous
  generation (Tian et al., ECCV 2020, arXiv:2003.11539).

:func:`train` runs a :class:`TrainConfig`; checkpoints use the release's key layout and load in
``poodle extract --checkpoint`` unchanged.
"""

from poodle.train.config import RECIPES, TrainConfig
from poodle.train.loop import TrainEvent, TrainResult, train

__all__ = ["RECIPES", "TrainConfig", "TrainEvent", "TrainResult", "train"]
