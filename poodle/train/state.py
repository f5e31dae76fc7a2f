"""Random-number-generator states as plain tensors and lists, so that a checkpoint holding them
loads with ``torch.load(..., weights_only=True)`` (nothing pickled)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from poodle.utils import derive_seed


def capture_rng() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's (CPU and every CUDA device) global generators."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [
            np_kind,
            torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            int(np_pos),
            int(np_has_gauss),
            float(np_gauss),
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng` (CUDA states only where the devices exist)."""
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_kind, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(*parts: int) -> None:
    """Seed Python, NumPy and torch (all devices) from :func:`derive_seed` of ``parts``.

    Called at the start of every epoch with ``(seed, generation, epoch, rank)``, so that the
    augmentation and dropout draws of an epoch do not depend on what ran before it (a resumed run
    therefore replays exactly the same epochs as an uninterrupted one).
    """
    s = derive_seed(*parts)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
