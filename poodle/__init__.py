"""poodle: few-shot classification with POODLE (Le et al., NeurIPS 2021).

Two stages: :mod:`poodle.extract` writes L2-normalised features of every split of a dataset
to one HDF5 cache (:mod:`poodle.cache`); :mod:`poodle.evaluate` samples episodes
(:mod:`poodle.episodes`) from it and solves thousands of them at once with the batched
methods in :mod:`poodle.solvers`.
"""

from poodle.errors import PoodleError

__version__ = "0.2.0"

__all__ = ["PoodleError", "__version__"]
