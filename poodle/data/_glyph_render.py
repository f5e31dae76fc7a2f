"""Rendering of one glyph instance: a character in one face under a seeded "handwriting" distortion.

The glyph is drawn once at twice the output resolution, then one inverse map (affine + smooth
elastic field) resamples it into a fixed frame anchored on the baseline; strokes are thickened,
stray strokes added, patches erased, and the result is averaged down, blurred and made noisy.
Everything random comes from one numpy generator seeded by ``(seed, code point, instance)``, so an
image is a pure function of those three numbers (and of the Pillow/FreeType version).
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from scipy import ndimage

OVERSAMPLE = 2  # glyphs are drawn and warped at this multiple of the output size
EM = 0.70  # font size (em) as a fraction of the frame side
BASELINE = 0.68  # baseline height from the top, as a fraction of the frame side
MARGIN = 2.0  # output pixels kept free at every edge when a glyph must be fitted


@dataclass(frozen=True)
class Distortion:
    """Strength of the seeded handwriting distortion (lengths in output pixels, angles in degrees).

    Defaults are the tuned values (docs/glyphs.md gives the difficulty they produce)."""

    rotation: float = 12.0  # uniform in [-rotation, rotation]
    shear: float = 0.25  # uniform shear factor in [-shear, shear]
    scale: tuple[float, float] = (0.8, 1.15)
    aspect: float = 0.15  # log-uniform x/y stretch in [1/(1+a), 1+a]
    shift: float = 2.0  # uniform translation in [-shift, shift] per axis
    elastic: float = 1.2  # amplitude of the smooth displacement field
    elastic_waves: int = 4  # plane waves summed into that field
    stroke: tuple[float, ...] = (0.45, 0.4, 0.15)  # P(stroke +0 px, +1 px, +2 px)
    stray_p: float = 0.4  # probability of stray strokes
    stray_max: int = 2  # at most this many
    stray_length: tuple[float, float] = (0.1, 0.35)  # as a fraction of the frame
    erase_p: float = 0.35  # probability of erasing patches of ink
    erase_size: tuple[float, float] = (0.10, 0.22)  # patch side as a fraction of the frame
    blur_p: float = 0.5
    blur_sigma: tuple[float, float] = (0.3, 0.9)
    noise: tuple[float, float] = (0.02, 0.08)  # std of additive Gaussian noise (ink units)
    ink: tuple[float, float] = (0.6, 1.0)  # ink darkness
    background: tuple[float, float] = (0.0, 0.15)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


_FONT_CACHE: dict[tuple[str, int], ImageFont.FreeTypeFont] = {}


def _font(path: str | Path, px: int) -> ImageFont.FreeTypeFont:
    key = (str(path), px)
    f = _FONT_CACHE.get(key)
    if f is None:
        # The basic layout engine: no shaping, so a code point always gives the same single glyph.
        f = ImageFont.truetype(str(path), px, layout_engine=ImageFont.Layout.BASIC)
        _FONT_CACHE[key] = f
    return f


def _mask(font: ImageFont.FreeTypeFont, ch: str) -> tuple[np.ndarray, int, int]:
    """The rendered glyph as uint8 [h, w] and the offset of its top-left corner from the point
    (middle of the advance, baseline)."""
    core, (ox, oy) = font.getmask2(ch, mode="L", anchor="ms")
    try:
        arr = np.asarray(Image.Image()._new(core))
    except AttributeError:  # pragma: no cover - Pillow without the private constructor
        w, h = core.size
        img = Image.new("L", (w + 8, h + 8))
        ImageDraw.Draw(img).text((4 - ox, 4 - oy), ch, font=font, fill=255, anchor="ms")
        arr = np.asarray(img)[4 : 4 + h, 4 : 4 + w]
    return arr, ox, oy


def glyph_bitmap(
    path: str | Path, cp: int, size: int, oversample: int = OVERSAMPLE
) -> tuple[np.ndarray, float, float] | None:
    """The clean glyph drawn for an output frame of side ``size`` at ``oversample`` resolution.

    Returns ``(ink [h, w] float32 in [0, 1], anchor_x, anchor_y)``: the bitmap cropped to its ink
    with 2 pixels of padding; the anchor is the middle of the glyph's advance horizontally and
    the baseline vertically, so a glyph keeps its place in the line (a right half block stays on
    the right, ``o`` stays smaller than ``O``). None when the face draws nothing."""
    em = max(4, round(EM * size * oversample))
    arr, ox, oy = _mask(_font(path, em), chr(cp))
    if arr.size == 0:
        return None
    rows = np.flatnonzero(arr.max(axis=1))
    if rows.size == 0:
        return None
    cols = np.flatnonzero(arr.max(axis=0))
    y0, y1, x0, x1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    ink = np.zeros((y1 - y0 + 4, x1 - x0 + 4), dtype=np.float32)
    ink[2:-2, 2:-2] = arr[y0:y1, x0:x1] * np.float32(1 / 255)
    ax = -ox - x0 + 2.0  # the anchor is at (-ox, -oy) in the mask
    ay = -oy - y0 + 2.0
    return ink, ax, ay


def _ink_box(ink: np.ndarray) -> tuple[int, int, int, int]:
    rows = np.flatnonzero(ink.max(axis=1) > 0.1)
    cols = np.flatnonzero(ink.max(axis=0) > 0.1)
    if rows.size == 0:
        return 0, 0, ink.shape[1], ink.shape[0]
    return cols[0], rows[0], cols[-1] + 1, rows[-1] + 1


def place(
    ink: np.ndarray,
    ax: float,
    ay: float,
    side: int,
    fwd: np.ndarray,
    shift: np.ndarray,
    field: tuple[np.ndarray, np.ndarray] | None = None,
    margin: float = 0.0,
    box: tuple[int, int, int, int] | None = None,
) -> np.ndarray:
    """Resample the bitmap into a ``side x side`` frame: the anchor goes to the frame's baseline
    point (+``shift``) and the bitmap is transformed by the 2x2 matrix ``fwd`` (bitmap -> frame).
    A glyph that would leave the frame (minus ``margin``) is shrunk and moved just enough to fit.
    ``field``: optional displacement ``(dy, dx)`` [side, side] added to the source coordinates.
    ``box``: ``_ink_box(ink)`` when the caller already has it."""
    origin = np.array([side / 2.0, BASELINE * side]) + shift  # (x, y) in the frame
    x0, y0, x1, y1 = _ink_box(ink) if box is None else box
    corners = np.array([[x0, y0], [x1, y0], [x0, y1], [x1, y1]], dtype=np.float64) - [ax, ay]
    mapped = corners @ fwd.T
    lo, hi = mapped.min(0), mapped.max(0)
    room = side - 2 * margin
    k = min(1.0, room / max(hi[0] - lo[0], 1e-6), room / max(hi[1] - lo[1], 1e-6))
    fwd = fwd * k
    lo, hi = lo * k + origin, hi * k + origin
    origin = origin + np.maximum(0.0, margin - lo) - np.maximum(0.0, hi - (side - margin))
    inv = np.linalg.inv(fwd)
    t = np.arange(side) + 0.5
    px, py = t - origin[0], t - origin[1]  # frame coordinates along x (columns) and y (rows)
    sx = (inv[0, 0] * px + ax - 0.5)[None, :] + (inv[0, 1] * py)[:, None]
    sy = (inv[1, 0] * px)[None, :] + (inv[1, 1] * py + ay - 0.5)[:, None]
    if field is not None:
        sy = sy + field[0]
        sx = sx + field[1]
    return ndimage.map_coordinates(ink, [sy, sx], order=1, mode="constant", cval=0.0, prefilter=False).astype(
        np.float32
    )


def clean_frame(path: str | Path, cp: int, size: int, oversample: int = OVERSAMPLE) -> np.ndarray | None:
    """The undistorted glyph in its frame, ``[size, size]`` float32 ink in [0, 1] (None if empty).

    Used to find look-alike characters: the same framing as the instances, no randomness."""
    bm = glyph_bitmap(path, cp, size, oversample)
    if bm is None:
        return None
    ink, ax, ay = bm
    side = size * oversample
    m = int(math.ceil(MARGIN * oversample))
    top = int(round(BASELINE * side - ay))
    left = int(round(side / 2.0 - ax))
    h, w = ink.shape
    if top + 2 >= m and left + 2 >= m and top + h - 2 <= side - m and left + w - 2 <= side - m:
        big = np.zeros((side + 8, side + 8), dtype=np.float32)  # fits: paste, no resampling
        big[top + 4 : top + 4 + h, left + 4 : left + 4 + w] = ink
        big = big[4:-4, 4:-4]
    else:
        big = place(ink, ax, ay, side, np.eye(2), np.zeros(2), margin=m)
    if oversample == 1:
        return big
    return big.reshape(size, oversample, size, oversample).sum(axis=(1, 3)) * (1 / oversample**2)


def _elastic(rng: np.random.Generator, side: int, amp: float, waves: int) -> tuple[np.ndarray, np.ndarray]:
    """A smooth random displacement field ``(dy, dx)``, each a sum of ``waves`` plane waves of
    0.5-1.5 cycles per frame. sin(a x + b y + p) = cos(b y + p) sin(a x) + sin(b y + p) cos(a x),
    so each field is two small matrix products of 1-D profiles."""
    theta = rng.uniform(0, 2 * math.pi, size=(2, waves))
    freq = rng.uniform(0.5, 1.5, size=(2, waves))
    phase = rng.uniform(0, 2 * math.pi, size=(2, waves))
    a = rng.normal(size=(2, waves)) * (amp / math.sqrt(waves))
    t = (np.arange(side) + 0.5) / side
    fx = (2 * math.pi * freq * np.cos(theta))[..., None] * t  # [2, waves, side]
    fy = (2 * math.pi * freq * np.sin(theta))[..., None] * t + phase[..., None]
    out = []
    for k in range(2):
        cy, sy = np.cos(fy[k]) * a[k][:, None], np.sin(fy[k]) * a[k][:, None]
        out.append(cy.T @ np.sin(fx[k]) + sy.T @ np.cos(fx[k]))  # [side (y), side (x)]
    return out[0], out[1]


Stroked = tuple[np.ndarray, float, float, tuple[int, int, int, int]]


def _stroked(bitmap: tuple[np.ndarray, float, float], grow: int) -> Stroked:
    """The clean bitmap thickened by ``grow`` output pixels, its anchor and its ink box."""
    ink, ax, ay = bitmap
    # Stroke width: dilate by 0, 1 or 2 output pixels (2 or 4 bitmap pixels in total width).
    if grow:
        k = 2 * grow * OVERSAMPLE // 2 + 1
        ink = np.pad(ink, k)
        ax, ay = ax + k, ay + k
        ink = ndimage.grey_dilation(ink, size=(k, k))
    return ink, ax, ay, _ink_box(ink)


class GlyphCache:
    """The bitmaps of one code point at one size, kept across the instances of a class.

    A face's bitmap, and its thickened versions, are pure functions of (face, code point, size,
    stroke), while a class's 20 instances cycle through only 6-20 faces and 3 stroke widths:
    rendering each once saves about half the FreeType renders and most dilations."""

    def __init__(self, cp: int, size: int) -> None:
        self.cp, self.size = cp, size
        self._bitmaps: dict[str, tuple[np.ndarray, float, float]] = {}
        self._stroked: dict[tuple[str, int], Stroked] = {}

    def stroked(self, path: str | Path, grow: int) -> Stroked:
        key = (str(path), grow)
        got = self._stroked.get(key)
        if got is None:
            bm = self._bitmaps.get(key[0])
            if bm is None:
                bm = glyph_bitmap(path, self.cp, self.size)
                if bm is None:
                    raise ValueError(f"face {path} draws nothing for U+{self.cp:04X}")
                self._bitmaps[key[0]] = bm
            got = self._stroked[key] = _stroked(bm, grow)
        return got


def render_ink(
    path: str | Path,
    cp: int,
    size: int,
    rng: np.random.Generator,
    dist: Distortion,
    cache: GlyphCache | None = None,
) -> np.ndarray:
    """One distorted instance as ink in [0, 1], ``[size, size]`` float32 (1 = full ink).

    ``cache``: a :class:`GlyphCache` for ``(cp, size)`` shared by the calls for one class.
    Raises ValueError when the face draws nothing for ``cp`` (callers choose faces that do)."""
    if cache is None:
        cache = GlyphCache(cp, size)
    elif (cache.cp, cache.size) != (cp, size):
        raise ValueError(
            f"render_ink: a cache for U+{cache.cp:04X} at {cache.size} px given for U+{cp:04X} at {size} px"
        )
    side = size * OVERSAMPLE
    grow = int(rng.choice(len(dist.stroke), p=np.asarray(dist.stroke) / sum(dist.stroke)))
    ink, ax, ay, box = cache.stroked(path, grow)
    # Affine (bitmap -> frame): rotation, shear, anisotropic scale.
    rot = math.radians(rng.uniform(-dist.rotation, dist.rotation))
    sh = rng.uniform(-dist.shear, dist.shear)
    s = rng.uniform(*dist.scale)
    asp = math.exp(rng.uniform(-1, 1) * math.log1p(dist.aspect))
    c, si = math.cos(rot), math.sin(rot)
    fwd = (
        np.array([[c, -si], [si, c]])
        @ np.array([[1.0, sh], [0.0, 1.0]])
        @ np.diag([s * math.sqrt(asp), s / math.sqrt(asp)])
    )
    shift = rng.uniform(-dist.shift, dist.shift, size=2) * OVERSAMPLE
    field = _elastic(rng, side, dist.elastic * OVERSAMPLE, dist.elastic_waves) if dist.elastic > 0 else None
    frame = place(ink, ax, ay, side, fwd, shift, field, margin=MARGIN * OVERSAMPLE, box=box)
    # Stray strokes: short lines or arcs, drawn with the pen width of a thin stroke.
    if rng.random() < dist.stray_p:
        canvas = Image.new("L", (side, side), 0)
        draw = ImageDraw.Draw(canvas)
        for _ in range(int(rng.integers(1, dist.stray_max + 1))):
            width = int(rng.integers(2, 4))
            cx, cy = rng.uniform(0.15, 0.85, size=2) * side
            length = rng.uniform(*dist.stray_length) * side
            if rng.random() < 0.6:
                ang = rng.uniform(0, math.pi)
                dx, dy = math.cos(ang) * length / 2, math.sin(ang) * length / 2
                draw.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=255, width=width)
            else:
                r = length / 2
                start = rng.uniform(0, 360)
                draw.arc([cx - r, cy - r, cx + r, cy + r], start, start + rng.uniform(60, 200), fill=255, width=width)
        frame = np.maximum(frame, np.asarray(canvas, dtype=np.float32) / 255.0)
    # Erased patches: centred on an inked pixel so they remove part of the character.
    if rng.random() < dist.erase_p:
        inked = np.flatnonzero(frame.ravel() > 0.5)
        if inked.size:
            before = float(frame.sum())
            erased = frame.copy()
            for _ in range(int(rng.integers(1, 3))):
                p = inked[int(rng.integers(inked.size))]
                cy, cx = divmod(int(p), side)
                hw, hh = rng.uniform(*dist.erase_size, size=2) * side / 2
                y0, y1 = max(0, int(cy - hh)), min(side, int(cy + hh) + 1)
                x0, x1 = max(0, int(cx - hw)), min(side, int(cx + hw) + 1)
                erased[y0:y1, x0:x1] = 0.0
            # A patch that takes most of a small glyph would leave only the strays: keep it then.
            if erased.sum() >= 0.5 * before:
                frame = erased
    out = frame.reshape(size, OVERSAMPLE, size, OVERSAMPLE).sum(axis=(1, 3)) * (1 / OVERSAMPLE**2)
    if rng.random() < dist.blur_p:
        out = ndimage.gaussian_filter(out, rng.uniform(*dist.blur_sigma), mode="constant")
    return out.astype(np.float32)


def to_image(ink: np.ndarray, rng: np.random.Generator, dist: Distortion) -> np.ndarray:
    """Ink -> uint8 grey pixels (dark ink on a light background) with contrast and noise."""
    lvl = rng.uniform(*dist.ink)
    bg = rng.uniform(*dist.background)
    v = bg + (lvl - bg) * ink + rng.normal(0.0, rng.uniform(*dist.noise), size=ink.shape)
    return np.round(255.0 * (1.0 - np.clip(v, 0.0, 1.0))).astype(np.uint8)


def render_array(path: str | Path, cp: int, size: int, seed_parts: tuple[int, ...], dist: Distortion) -> np.ndarray:
    """uint8 ``[size, size]`` pixels of one instance; ``seed_parts`` seed its generator."""
    rng = np.random.default_rng(np.random.SeedSequence(list(seed_parts)))
    return to_image(render_ink(path, cp, size, rng, dist), rng, dist)


def _chunk(cid: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + cid + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(cid)))


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_ZIP_BLOCK = 65536  # ImageFile.MAXBLOCK: the size of Pillow's encoder calls, one IDAT chunk each


def _png_direct(pixels: np.ndarray) -> bytes:
    """What ``Image.save(format="PNG", compress_level=6)`` writes for an L image, without its
    per-call machinery (format lookup, encoder info, header chunk logic): the same zip encoder,
    called the way ImageFile._save calls it for an in-memory file, between the same chunks.
    Pillow's deflate is zlib-ng's, so Python's zlib cannot stand in for it. tests/test_glyphs.py
    compares the bytes with Image.save on random images."""
    h, w = pixels.shape
    im = Image.frombuffer("L", (w, h), pixels, "raw", "L", 0, 1)
    enc = Image.core.zip_encoder("L", "L", False, 6, -1, b"")  # rawmode, optimize, level, type, dict
    parts = [_PNG_SIGNATURE, _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))]
    try:
        enc.setimage(im.im, (0, 0, w, h))
        while True:
            _, err, data = enc.encode(_ZIP_BLOCK)
            parts.append(_chunk(b"IDAT", data))
            if err:
                break
    finally:
        enc.cleanup()
    if err < 0:
        raise OSError(f"PNG encoder error {err}")
    parts.append(_chunk(b"IEND", b""))
    return b"".join(parts)


def _png_pillow(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def png_bytes(pixels: np.ndarray) -> bytes:
    """Encode grey pixels as an L-mode PNG with fixed settings (same bytes for the same pixels)."""
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    if pixels.ndim == 2 and pixels.size and _DIRECT_PNG:
        return _png_direct(pixels)
    return _png_pillow(pixels)


def _direct_png_works() -> bool:
    """Whether this Pillow has the zip encoder entry point and the direct path matches save()."""
    try:
        probe = (np.arange(6 * 5, dtype=np.uint8) * 37).reshape(6, 5)
        return _png_direct(probe) == _png_pillow(probe)
    except Exception:  # noqa: BLE001 - any change in Pillow's internals: use save()
        return False


_DIRECT_PNG = _direct_png_works()
