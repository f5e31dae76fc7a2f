"""Small helpers shared across the library: sizes, devices, seeds and atomic file writes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Iterator

import torch

from poodle.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Parse a memory size such as ``"4GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``1048576`` into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read memory size {text!r}: use a number with MiB or GiB, e.g. 4GiB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"memory size must be positive, got {text!r}")
    return n


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cpu``/``cuda``/``cuda:N`` as given."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine (use cpu or auto)")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from e


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of integer ``parts`` (e.g. ``(seed, episode)``).

    Hashing rather than ``seed * K + i`` keeps neighbouring (seed, i) pairs statistically unrelated.
    """
    h = hashlib.blake2b(b",".join(str(int(p)).encode() for p in parts), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def generator(*parts: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded with :func:`derive_seed` of ``parts``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".partial") -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto ``path`` only if the block completes.

    An interrupted write therefore never leaves a file under the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + suffix)
    if tmp.exists():
        tmp.unlink()
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
