"""Torch's CPU random streams reproduced in bulk: words, ``randperm``, ``_standard_gamma``, ``rand``.

Every episode draws from its own ``torch.Generator`` (:func:`poodle.utils.generator`), an mt19937
seeded with the low 32 bits of the seed. Torch's own samplers cost a call (and Python around it)
per draw; this module draws the same numbers for thousands of episodes at once:

- The generator's 32-bit words come from torch itself, one call per episode:
  ``Tensor.random_(-2**63, None)`` returns torch's ``random64()``, the first word in the high half
  and the second in the low half (:func:`packed_words`).
- What torch's CPU kernels (torch 2.x, ``aten/src/ATen/native``) make of those words is redone with
  numpy over all episodes at once:

  - ``randperm(n)`` (for ``n < 2**32 / 20``) is a Fisher-Yates loop that, for ``i < n - 1``, swaps
    positions ``i`` and ``i + word % (n - i)``: the first ``m`` entries are final after ``m`` steps,
    while the permutation consumes ``n - 1`` words (:func:`randperm_prefix`);
  - ``randint(n)`` is ``word % n``, or ``random64() % n`` from ``n >= 2**28``;
  - a float32 uniform is ``(word & 0xFFFFFF) / 2**24``, a float64 one
    ``(random64() & (2**53 - 1)) / 2**53``;
  - ``_standard_gamma`` (float64) is Marsaglia and Tsang's method over Box-Muller normals, each
    Box-Muller pair giving one normal now and caching the other in the generator (:func:`standard_gamma`);
    its ``log``, ``log1p``, ``sin``, ``cos`` and ``pow`` are taken from the C library torch calls,
    through :mod:`math`, and its arithmetic is IEEE double in the same order, so the draws are
    bit-identical.
- :class:`MT19937` runs the generator itself (seeding, twist, tempering) with torch integer ops
  vectorised over episodes, on any device: a GPU draws each episode's uniforms where they are used,
  the same words as torch's CPU generator.

:func:`verified` compares all of this with torch's own generator on a few seeds, once per process
(and :class:`MT19937` once per device type, on that device).
The callers keep torch's per-episode path and use it (with one warning) if it ever disagrees, e.g.
under a torch version whose CPU samplers draw differently.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import warnings
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

M32 = 0xFFFFFFFF
# constants of torch's sample_gamma: float literals promoted to double
_THIRD = float(np.float32(1.0) / np.float32(3.0))
_C0331 = float(np.float32(0.0331))
_DBL_MIN = sys.float_info.min
RANGE64 = 1 << 28  # randint's range from which torch draws random64() instead of random()


# ------------------------------------------------------------------------------- host: raw words


def packed_words(seeds: Sequence[int], n_words: int | Sequence[int]) -> np.ndarray:
    """The first words of ``torch.Generator().manual_seed(s)`` for each ``s`` in ``seeds``.

    Returns uint64 ``[E, H]``, ``H = ceil(max(n_words) / 2)``: element ``h`` of row ``r`` holds words
    ``2h`` (high half) and ``2h + 1`` (low half), as torch's ``random64()``. ``n_words``: one count for
    every row, or one per row (a row's elements past its own count are undefined).
    """
    E = len(seeds)
    per_row = [int(n_words)] * E if isinstance(n_words, (int, np.integer)) else [int(n) for n in n_words]
    halves = [(n + 1) // 2 for n in per_row]
    H = max(halves, default=0)
    buf = torch.empty(E, H, dtype=torch.int64)
    g = torch.Generator()
    for row, s, h in zip(buf.unbind(0), seeds, halves):
        g.manual_seed(s)
        if h:
            (row if h == H else row[:h]).random_(-(2**63), None, generator=g)
    return buf.numpy().view(np.uint64)


def word_at(packed: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """int64 words number ``pos`` of rows ``rows`` of :func:`packed_words` (arrays of one shape)."""
    v = packed[rows, pos >> 1]
    shift = ((pos & 1) ^ 1).astype(np.uint64) << np.uint64(5)  # even words in the high half
    return ((v >> shift) & np.uint64(M32)).view(np.int64)


def random64_at(packed: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """uint64 ``random64()`` made of words ``pos`` and ``pos + 1``."""
    hi = word_at(packed, rows, pos).astype(np.uint64)
    return (hi << np.uint64(32)) | word_at(packed, rows, pos + 1).astype(np.uint64)


def uniform64_at(packed: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """float64 in [0, 1) as torch's ``uniform_real_distribution<double>`` from words ``pos, pos + 1``."""
    hi = word_at(packed, rows, pos) & 0x1FFFFF
    return ((hi << 32) | word_at(packed, rows, pos + 1)).astype(np.float64) * 2.0**-53


# ------------------------------------------------------------------------------------- randperm

_PERM_BLOCK = 1 << 22  # entries of the permutations held at once


def randperm_prefix(n: np.ndarray, length: np.ndarray, words: np.ndarray) -> np.ndarray:
    """The first ``length[r]`` entries of torch's CPU ``randperm(n[r])`` for each row ``r``, int64
    ``[R, m]`` (-1 past a row's length; ``length <= n``).

    ``words [R, m]`` (``m >= max(length)``): row ``r``'s first words of the permutation (it consumes
    ``n - 1``; words at ``t >= min(length, n - 1)`` are ignored). Rows are shuffled in groups of
    similar ``n``, so that a few very large ``n`` do not set every row's width.
    """
    R, m = words.shape
    out = np.full((R, m), -1, dtype=np.int64)
    order = np.argsort(n, kind="stable")
    ns = n[order]
    i = 0
    while i < R:
        # the most rows from i whose dense permutations fit the block (n sorted ascending)
        fits = np.arange(1, R - i + 1) * ns[i:] <= _PERM_BLOCK
        c = R - i if fits.all() else max(1, int(fits.argmin()))
        rows = order[i : i + c]
        rows = rows[np.argsort(-length[rows], kind="stable")]  # longest first: active rows are a prefix
        out[rows] = _randperm_dense(n[rows], length[rows], words[rows])
        i += c
    return out


def _randperm_dense(n: np.ndarray, length: np.ndarray, words: np.ndarray) -> np.ndarray:
    c, m = words.shape
    words = np.ascontiguousarray(words.T)  # [m, c]: step t reads a contiguous row
    out = np.full((m, c), -1, dtype=np.int64)
    width = int(n.max())
    dtype = np.int16 if width < 2**15 else np.int32 if width < 2**31 else np.int64
    flat = np.tile(np.arange(width, dtype=dtype), c)  # the permutations in progress, row after row
    base = np.arange(c, dtype=np.int64) * width
    neg, n_min = -length, int(n.min())
    for t in range(int(length[0]) if c else 0):
        k = int(np.searchsorted(neg, -t, side="left"))  # rows with length > t
        nk = n[:k]
        if t < n_min - 1:
            j = words[t, :k] % (nk - t)
        else:  # the last position of a permutation draws no word and stays
            j = np.where(t < nk - 1, words[t, :k] % np.maximum(nk - t, 1), 0)
        j += base[:k] + t
        i = base[:k] + t
        a = flat[i]
        out[t, :k] = flat[j]
        flat[j] = a  # position t is final and never read again
    return out.T


# ---------------------------------------------------------------------------------------- gamma


def _map(f: Callable[[float], float], x: np.ndarray) -> np.ndarray:
    # the C library's function, as torch's kernel calls it (numpy's SIMD versions may round otherwise)
    return np.fromiter(map(f, x.tolist()), dtype=np.float64, count=x.size)


class _Normals:
    """torch's ``normal_distribution<double>`` over rows of packed words: Box-Muller, each pair
    giving one normal now (``r cos``) and caching the other (``r sin``) in the generator."""

    def __init__(self, packed: np.ndarray, rows: np.ndarray, pos: np.ndarray, limit: np.ndarray) -> None:
        self.packed, self.rows, self.pos, self.limit = packed, rows, pos, limit
        self.ok = np.ones(len(rows), dtype=bool)  # False: the row ran out of words
        self.cached = np.zeros(len(rows), dtype=bool)
        self.cache = np.zeros(len(rows))

    def room(self, idx: np.ndarray, words: int) -> np.ndarray:
        """Which of rows ``idx`` have ``words`` more words left; the others are marked spent."""
        ok = self.ok[idx] & (self.pos[idx] + words <= self.limit[idx])
        self.ok[idx[~ok]] = False
        return ok

    def uniform(self, idx: np.ndarray) -> np.ndarray:
        u = uniform64_at(self.packed, self.rows[idx], self.pos[idx])
        self.pos[idx] += 2
        return u

    def normal(self, idx: np.ndarray) -> np.ndarray:
        """One normal for each of rows ``idx`` (rows must have 4 words left)."""
        x = np.empty(len(idx))
        hit = self.cached[idx]
        x[hit] = self.cache[idx[hit]]
        self.cached[idx[hit]] = False
        new = idx[~hit]
        u1 = self.uniform(new)
        u2 = self.uniform(new)
        r = np.sqrt(-2.0 * _map(math.log1p, -u2))
        theta = 2.0 * math.pi * u1
        self.cache[new] = r * _map(math.sin, theta)
        self.cached[new] = True
        x[~hit] = r * _map(math.cos, theta)
        return x


def standard_gamma(
    packed: np.ndarray, rows: np.ndarray, pos: np.ndarray, limit: np.ndarray, alpha: float, count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``torch._standard_gamma(torch.full((count,), alpha, dtype=torch.float64), generator=g)`` for
    the generator of each row, drawn from its words ``pos .. limit - 1`` (a fresh generator: no
    cached normal). Returns ``(gamma [R, count], next word [R], ok [R])``; ``ok`` is False where a
    row would have needed words past ``limit`` (its draws are then meaningless)."""
    st = _Normals(packed, rows, pos.astype(np.int64).copy(), limit)
    out = np.zeros((len(rows), count))
    boost = alpha < 1.0  # torch draws Gamma(alpha + 1) and scales by U^(1/alpha)
    a = alpha + 1.0 if boost else alpha
    d = a - _THIRD
    c = 1.0 / math.sqrt(9.0 * d)
    inv = 1.0 / alpha
    for k in range(count):
        scale = np.ones(len(rows))
        if boost:
            idx = np.flatnonzero(st.ok)
            idx = idx[st.room(idx, 2)]
            base = (1 - st.uniform(idx)).tolist()
            scale[idx] = np.fromiter(map(math.pow, base, itertools.repeat(inv, len(base))), np.float64, len(base))
        todo = np.flatnonzero(st.ok)
        while todo.size:
            x, y = np.zeros(len(todo)), np.zeros(len(todo))
            seek = np.arange(len(todo))  # do { x = normal; y = 1 + c x } while (y <= 0)
            while seek.size:
                seek = seek[st.room(todo[seek], 4)]
                x[seek] = st.normal(todo[seek])
                y[seek] = 1.0 + c * x[seek]
                seek = seek[y[seek] <= 0]
            keep = st.room(todo, 2)
            todo, x, y = todo[keep], x[keep], y[keep]
            v = y * y * y
            u = 1 - st.uniform(todo)
            xx = x * x
            acc = u < 1.0 - _C0331 * xx * xx
            rest = np.flatnonzero(~acc)
            if rest.size:
                lu, lv = _map(math.log, u[rest]), _map(math.log, v[rest])
                acc[rest] = lu < 0.5 * xx[rest] + d * (1.0 - v[rest] + lv)
            out[todo[acc], k] = np.maximum(scale[todo[acc]] * d * v[acc], _DBL_MIN)
            todo = todo[~acc]
    return out, st.pos, st.ok


# ------------------------------------------------------------------------ device: the generator


class MT19937:
    """``E`` mt19937 generators seeded as torch's CPU generator and stepped together with torch
    integer ops (int64 holding 32-bit words) on the device of ``seeds``: the same words as
    ``torch.Generator().manual_seed(s)`` for each seed, drawn where they are used.

    ``seeds``: int64 ``[E]`` (only the low 32 bits matter, as in torch). Draws ``624`` words per
    generator per step; no host synchronisation.
    """

    N, M = 624, 397

    def __init__(self, seeds: Tensor) -> None:
        s = seeds.to(torch.int64) & M32
        cols = [s]
        for j in range(1, self.N):
            s = (1812433253 * (s ^ (s >> 30)) + j) & M32
            cols.append(s)
        self.state = torch.stack(cols, 1)  # [E, 624]

    def _twist(self) -> None:
        s, N, M = self.state, self.N, self.M
        y = (s[:, :-1] & 0x80000000) | (s[:, 1:] & 0x7FFFFFFF)
        t = (y >> 1) ^ ((y & 1) * 0x9908B0DF)
        new = torch.empty_like(s)
        k = N - M  # 227
        torch.bitwise_xor(s[:, M:], t[:, :k], out=new[:, :k])
        torch.bitwise_xor(new[:, :k], t[:, k : 2 * k], out=new[:, k : 2 * k])
        torch.bitwise_xor(new[:, k : N - 1 - k], t[:, 2 * k :], out=new[:, 2 * k : N - 1])
        y = (s[:, N - 1] & 0x80000000) | (new[:, 0] & 0x7FFFFFFF)
        new[:, N - 1] = new[:, M - 1] ^ (y >> 1) ^ ((y & 1) * 0x9908B0DF)
        self.state = new

    def block(self) -> Tensor:
        """The next 624 words of every generator, int64 ``[E, 624]`` (torch twists before its first word)."""
        self._twist()
        y = self.state
        y = y ^ (y >> 11)
        y = y ^ ((y << 7) & 0x9D2C5680)
        y = y ^ ((y << 15) & 0xEFC60000)
        return y ^ (y >> 18)

    def uniform_(self, out: Tensor) -> Tensor:
        """Fill float32 ``out [E, n]`` with the next ``n`` words as torch's CPU ``rand`` makes them."""
        n = out.shape[1]
        for a in range(0, n, self.N):
            w = self.block()[:, : min(self.N, n - a)]
            torch.mul((w & 0xFFFFFF).to(torch.float32), 2.0**-24, out=out[:, a : a + w.shape[1]])
        return out


def normal_fill_(u: Tensor, tail: Tensor | None = None) -> Tensor:
    """Torch's CPU ``normal_`` (float32, 16 or more contiguous values, mean 0, std 1) applied in
    place to uniforms ``u [E, n]`` (the first ``n`` words, as :meth:`MT19937.uniform_` makes them).

    Box-Muller on groups of 16: ``u1 = 1 - u[j]``, ``u2 = u[j + 8]``, ``radius = sqrt(-2 log u1)``,
    ``theta = float(2 pi (double) u2)``, outputs ``radius cos theta`` and ``radius sin theta``. When
    ``n % 16 != 0`` torch draws 16 more uniforms (``tail [E, 16]``, words ``n .. n + 15``) and
    redoes the last 16 values from them. ``log``, ``cos`` and ``sin`` are the device's float32 ones:
    within a few units in the last place of the C library's that torch's scalar CPU path calls.
    """
    E, n = u.shape
    full = n // 16 * 16
    _box_muller_(u[:, :full].view(E, -1, 2, 8))
    if full != n:
        if tail is None:
            raise ValueError(f"{n} values are not a multiple of 16: the 16 tail uniforms are needed")
        t = tail.clone()
        _box_muller_(t.view(E, 1, 2, 8))
        u[:, n - 16 :] = t
    return u


def _box_muller_(g: Tensor) -> None:
    # g [E, G, 2, 8]: per group of 16, u1 = 1 - first 8, u2 = last 8
    radius = torch.sqrt(-2 * torch.log(1 - g[:, :, 0]))
    theta = (g[:, :, 1].to(torch.float64) * (2.0 * math.pi)).to(torch.float32)
    g[:, :, 0] = radius * torch.cos(theta) + 0.0  # torch's fma(., std=1, mean=0) makes -0 into +0
    g[:, :, 1] = radius * torch.sin(theta) + 0.0


# ---------------------------------------------------------------------------------- self-check

_VERIFIED: dict[str | None, bool] = {}  # None: the host pieces; a device type: MT19937 there
_LOCK = threading.Lock()


def _check() -> str | None:
    """None when this module draws what torch's own generator draws on a few seeds, else what differs."""
    seeds = [0, 1, 12345, 2**40 + 7]
    packed = packed_words(seeds, 700)
    rows = np.arange(len(seeds))
    for r, s in enumerate(seeds):
        g = torch.Generator().manual_seed(s)
        ref = torch.empty(350, dtype=torch.int64).random_(-(2**63), None, generator=g)
        if not np.array_equal(packed[r], ref.numpy().view(np.uint64)):
            return "raw words"
    for n in (2, 7, 600):
        m = min(5, n)
        words = word_at(packed, rows[:, None], np.arange(m)[None, :])
        got = randperm_prefix(np.full(len(seeds), n), np.full(len(seeds), m), words)
        ref_p = [torch.randperm(n, generator=torch.Generator().manual_seed(s))[:m].tolist() for s in seeds]
        if got.tolist() != ref_p:
            return f"randperm({n})"
    for alpha in (0.5, 2.0):
        gam, _, ok = standard_gamma(packed, rows, np.zeros(len(seeds), np.int64), np.full(len(seeds), 700), alpha, 5)
        ref_g = [
            torch._standard_gamma(
                torch.full((5,), alpha, dtype=torch.float64), generator=torch.Generator().manual_seed(s)
            ).numpy()
            for s in seeds
        ]
        if not ok.all() or not np.array_equal(gam, np.stack(ref_g)):
            return f"standard_gamma({alpha})"
    # the Dirichlet shares and their rounding sum rows of [E, way] at once, where torch sums one [way]
    x = torch.rand(4, 1100, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for n in [*range(2, 70), 100, 256, 1000]:
        if not torch.equal(x[:, :n].sum(1), torch.stack([r[:n].sum() for r in x])):
            return f"sums of {n} values"
    return None


def _check_device(device: torch.device) -> str | None:
    """None when :class:`MT19937` on ``device`` draws torch's CPU ``rand`` on a few seeds."""
    seeds = [0, 1, 12345, 2**40 + 7]
    mt = MT19937(torch.tensor([s & M32 for s in seeds], device=device))
    u = mt.uniform_(torch.empty(len(seeds), 700, device=device))
    ref = torch.stack([torch.rand(700, generator=torch.Generator().manual_seed(s)) for s in seeds])
    return None if device.type == "meta" or torch.equal(u.cpu(), ref) else f"rand on {device.type}"


def verified(device: torch.device | None = None) -> bool:
    """Whether the bulk draws match torch's own generator here (checked once per process, and once
    per device type for :class:`MT19937` on ``device``; a mismatch is reported once, as a warning,
    and the callers keep torch's per-episode path)."""
    with _LOCK:  # chunks may be drawn by several threads at once
        if None not in _VERIFIED:
            _VERIFIED[None] = _verify(_check())
        if device is None or device.type == "cpu":
            return _VERIFIED[None]
        if device.type not in _VERIFIED:
            _VERIFIED[device.type] = _VERIFIED[None] and _verify(_check_device(device))
        return _VERIFIED[device.type]


def _verify(what: str | None) -> bool:
    if what is not None:
        warnings.warn(
            f"torch {torch.__version__} draws {what} differently from poodle's bulk sampler; "
            "episodes and negatives are drawn one by one (same numbers, slower)",
            RuntimeWarning,
            stacklevel=4,
        )
    return what is None


__all__ = [
    "MT19937",
    "packed_words",
    "word_at",
    "random64_at",
    "uniform64_at",
    "randperm_prefix",
    "standard_gamma",
    "normal_fill_",
    "verified",
]
