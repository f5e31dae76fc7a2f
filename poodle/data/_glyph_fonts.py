"""Fonts, alphabets and the class list of the embedded ``glyphs`` dataset.

Everything here is derived from the fonts that the installed matplotlib ships (DejaVu, STIX and
the BaKoMa Computer Modern TrueType files); no font file is part of poodle. The class list is a
pure function of those files: the characters of each alphabet that at least ``min_fonts`` faces
draw (character map entry and a non-empty outline), minus accented/compatibility forms, minus
characters that render like a character kept earlier (pixel comparison, not Unicode data).
"""

from __future__ import annotations

import functools
import hashlib
import math
import multiprocessing as mp
import os
import unicodedata
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from fontTools.ttLib import TTFont
from scipy import ndimage

from poodle.data._glyph_render import clean_frame
from poodle.errors import DataError

# Alphabets in priority order: when two characters render alike, the one from the earlier
# alphabet keeps the class (so Latin A stays, Greek Alpha and Cyrillic A go).
# Each entry: name -> (description, split, code point ranges inclusive).
# The split assignment is fixed by hand so that whole alphabets land in one split and the class
# counts come out near 60/20/20 with the matplotlib 3.x fonts (see docs/glyphs.md for the counts).
ALPHABETS: dict[str, tuple[str, str, tuple[tuple[int, int], ...]]] = {
    "latin": ("Latin letters and digits (ASCII, Latin-1)", "train",
              ((0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A), (0xC0, 0xFF))),
    "greek": ("Greek and Coptic", "train", ((0x370, 0x3FF),)),
    "cyrillic": ("Cyrillic, Cyrillic Supplement and Extended-B", "train",
                 ((0x400, 0x52F), (0xA640, 0xA69F))),
    "latin_ext": ("Latin Extended-A/B/C/D and Additional", "train",
                  ((0x100, 0x24F), (0x1E00, 0x1EFF), (0x2C60, 0x2C7F), (0xA720, 0xA7FF))),
    "ipa": ("IPA, phonetic extensions and spacing modifier letters", "val",
            ((0x250, 0x2FF), (0x1D00, 0x1DBF))),
    "armenian": ("Armenian", "test", ((0x530, 0x58F),)),
    "georgian": ("Georgian and Georgian Supplement", "test", ((0x10A0, 0x10FF), (0x2D00, 0x2D2F))),
    "lao": ("Lao", "val", ((0xE80, 0xEFF),)),
    "punctuation": ("Punctuation, currency, letterlike symbols and number forms", "train",
                    ((0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7E), (0xA1, 0xBF),
                     (0x2000, 0x206F), (0x20A0, 0x20CF), (0x2100, 0x218F), (0x2E00, 0x2E7F))),
    "math": ("Mathematical operators and symbols", "train",
             ((0x2200, 0x22FF), (0x27C0, 0x27EF), (0x2980, 0x29FF), (0x2A00, 0x2AFF))),
    "arrows": ("Arrows and supplemental arrows", "val",
               ((0x2190, 0x21FF), (0x27F0, 0x27FF), (0x2900, 0x297F))),
    "technical": ("Miscellaneous technical", "test", ((0x2300, 0x23FF),)),
    "box": ("Box drawing and block elements", "train", ((0x2500, 0x259F),)),
    "geometric": ("Geometric shapes and miscellaneous symbols and arrows", "test",
                  ((0x25A0, 0x25FF), (0x2B00, 0x2BFF))),
    "symbols": ("Miscellaneous symbols", "train", ((0x2600, 0x26FF),)),
    "dingbats": ("Dingbats", "train", ((0x2700, 0x27BF),)),
    "braille": ("Six-dot Braille patterns", "val", ((0x2801, 0x283F),)),
}

SPLITS = ("train", "val", "test")

# The 16 Unicode faces (4 styles of 4 families). LastResortHE is never used: it maps every code
# point to a per-block placeholder, so it would "cover" everything with boxes.
UNICODE_FACES: tuple[tuple[str, str], ...] = (
    ("DejaVuSans", "DejaVuSans.ttf"), ("DejaVuSans-Bold", "DejaVuSans-Bold.ttf"),
    ("DejaVuSans-Oblique", "DejaVuSans-Oblique.ttf"),
    ("DejaVuSans-BoldOblique", "DejaVuSans-BoldOblique.ttf"),
    ("DejaVuSansMono", "DejaVuSansMono.ttf"), ("DejaVuSansMono-Bold", "DejaVuSansMono-Bold.ttf"),
    ("DejaVuSansMono-Oblique", "DejaVuSansMono-Oblique.ttf"),
    ("DejaVuSansMono-BoldOblique", "DejaVuSansMono-BoldOblique.ttf"),
    ("DejaVuSerif", "DejaVuSerif.ttf"), ("DejaVuSerif-Bold", "DejaVuSerif-Bold.ttf"),
    ("DejaVuSerif-Italic", "DejaVuSerif-Italic.ttf"),
    ("DejaVuSerif-BoldItalic", "DejaVuSerif-BoldItalic.ttf"),
    ("STIXGeneral", "STIXGeneral.ttf"), ("STIXGeneral-Bold", "STIXGeneralBol.ttf"),
    ("STIXGeneral-Italic", "STIXGeneralItalic.ttf"),
    ("STIXGeneral-BoldItalic", "STIXGeneralBolIta.ttf"),
)
_DIGITS = frozenset(range(0x30, 0x3A))
_ASCII_LETTERS = frozenset(list(range(0x41, 0x5B)) + list(range(0x61, 0x7B)))
# Computer Modern files use TeX encodings at ASCII code points: only letters and digits are the
# character they claim to be (cmr10 '<' is an inverted exclamation mark, cmsy10 'A' is a
# calligraphic A, cmmi10 digits are old-style), so each face lists the code points it may draw.
CM_FACES: tuple[tuple[str, str, frozenset[int]], ...] = (
    ("cmr10", "cmr10.ttf", _DIGITS | _ASCII_LETTERS),
    ("cmb10", "cmb10.ttf", _DIGITS | _ASCII_LETTERS),
    ("cmti10", "cmti10.ttf", _DIGITS | _ASCII_LETTERS),
    ("cmss10", "cmss10.ttf", _DIGITS | _ASCII_LETTERS),
    ("cmtt10", "cmtt10.ttf", _DIGITS | _ASCII_LETTERS),
    ("cmmi10", "cmmi10.ttf", _ASCII_LETTERS),
)
EXCLUDED_FACES = ("LastResortHE-Regular.ttf",)

MIN_FONTS = 6          # a class needs this many faces, so its instances differ in style
DEDUP_SIZE = 24        # side of the clean renders compared for look-alikes
DEDUP_COARSE = 0.12    # outline distance under which two characters are compared closely
DEDUP_THRESHOLD = 0.2  # mean largest local difference under which two characters are one
MIN_INK = 0.015        # mean ink per frame pixel below which a glyph is a dot or an accent


@dataclass(frozen=True)
class Face:
    """One font face: ``name`` (stable id used in manifests), ``path`` to the TrueType file."""

    name: str
    path: Path
    allowed: frozenset[int] | None = None   # code points this face may draw (None: its cmap)


@dataclass(frozen=True)
class GlyphClass:
    """One class of the dataset: a character, its alphabet and split, and the faces that draw it."""

    name: str                 # folder name, e.g. "latin_0041"
    codepoint: int
    alphabet: str
    split: str
    faces: tuple[str, ...]    # face names, in the fixed order of UNICODE_FACES + CM_FACES

    @property
    def char(self) -> str:
        return chr(self.codepoint)


def font_dir() -> Path:
    """The folder of TrueType files shipped by the installed matplotlib."""
    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


@functools.lru_cache(maxsize=4)
def faces(directory: str | None = None) -> tuple[Face, ...]:
    """All faces used for rendering, in a fixed order; DataError naming the missing file."""
    d = Path(directory) if directory else font_dir()
    out = [Face(n, d / f) for n, f in UNICODE_FACES]
    out += [Face(n, d / f, allowed) for n, f, allowed in CM_FACES]
    missing = [str(f.path) for f in out if not f.path.is_file()]
    if missing:
        # not a caller's value: matplotlib's fonts are missing from this system
        raise DataError(f"glyphs: matplotlib font file(s) not found: {', '.join(missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''} (is matplotlib installed completely?)")
    return tuple(out)


def fonts_digest(fs: tuple[Face, ...]) -> dict[str, str]:
    """sha256 of every face file, keyed by face name (recorded in the manifest)."""
    out = {}
    for f in fs:
        out[f.name] = hashlib.sha256(f.path.read_bytes()).hexdigest()
    return out


@functools.lru_cache(maxsize=64)
def _cmap(path: str) -> frozenset[int]:
    try:
        with TTFont(path, lazy=True) as font:  # closed here: a lazy font keeps its file open until closed
            cmap = font.getBestCmap() or {}
    except Exception as e:  # noqa: BLE001 - any parse failure is a broken font file
        # not a caller's value: a font file of this system is broken
        raise DataError(f"glyphs: cannot read the character map of {path}: {e}") from e
    return frozenset(cmap)


def face_covers(face: Face) -> frozenset[int]:
    """Code points the face claims (character map), restricted to its allowed set."""
    cov = _cmap(str(face.path))
    return cov & face.allowed if face.allowed is not None else cov


def is_plain_character(cp: int) -> bool:
    """A letter, digit, punctuation mark or symbol that is not an accented or compatibility form."""
    ch = chr(cp)
    if unicodedata.category(ch)[0] not in "LNPS":
        return False  # marks, separators, controls, unassigned
    if unicodedata.decomposition(ch):
        return False  # canonical (accented) or compatibility (<font>, <super>, ...) forms
    return True


def alphabet_of(cp: int) -> str | None:
    for name, (_, _, ranges) in ALPHABETS.items():
        if any(a <= cp <= b for a, b in ranges):
            return name
    return None


def candidates(fs: tuple[Face, ...]) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(code point, alphabet, faces claiming it)`` for every plain character of every alphabet
    that at least MIN_FONTS faces claim, in alphabet priority order then code point order."""
    cover = {f.name: face_covers(f) for f in fs}
    out = []
    seen: set[int] = set()
    for name, (_, _, ranges) in ALPHABETS.items():
        for a, b in ranges:
            for cp in range(a, b + 1):
                if cp in seen or not is_plain_character(cp):
                    continue
                seen.add(cp)
                have = tuple(f.name for f in fs if cp in cover[f.name])
                if len(have) >= MIN_FONTS:
                    out.append((cp, name, have))
    return out


def _outlines(imgs: np.ndarray) -> np.ndarray:
    """Gradient magnitude of lightly smoothed renders, ``[n, S, S]`` -> ``[n, S, S]``."""
    smooth = ndimage.gaussian_filter(imgs, (0, 0.6, 0.6))
    # Sobel along rows and columns only (ndimage.sobel would also smooth across the batch).
    diff, tri = [-1.0, 0.0, 1.0], [1.0, 2.0, 1.0]
    gy = ndimage.correlate1d(ndimage.correlate1d(smooth, diff, axis=1), tri, axis=2)
    gx = ndimage.correlate1d(ndimage.correlate1d(smooth, diff, axis=2), tri, axis=1)
    return np.hypot(gy, gx).astype(np.float32)


def _clean_one(task: tuple[int, tuple[tuple[str, str], ...]]) -> dict[str, np.ndarray]:
    cp, faces_paths = task
    imgs = {}
    for name, path in faces_paths:
        img = clean_frame(path, cp, DEDUP_SIZE, 1)
        if img is not None and img.max() >= 0.25:
            imgs[name] = img
    return imgs


def cores() -> int:
    """The cores this process may use (its CPU affinity); 1 inside a daemonic process (a DataLoader
    worker), which may not start children."""
    if mp.current_process().daemon:
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def clean_renders(cands, fs: tuple[Face, ...]) -> list[dict[str, np.ndarray]]:
    """Clean DEDUP_SIZE renders ``{face: [S, S] ink}`` of every candidate, leaving out the faces
    whose outline is empty although their character map claims the code point.

    The full set's ~25,000 renders are split over one process per core (at most 8): each render is a
    pure function of its face and code point, so the result does not depend on the split."""
    path = {f.name: str(f.path) for f in fs}
    tasks = [(cp, tuple((name, path[name]) for name in have)) for cp, _, have in cands]
    n = min(8, cores())
    if n <= 1 or len(tasks) < 500 or "fork" not in mp.get_all_start_methods():
        return [_clean_one(t) for t in tasks]
    # fork: the workers inherit the loaded modules (no import cost), as generate_glyphs's pool does
    with ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("fork")) as pool:
        return list(pool.map(_clean_one, tasks, chunksize=max(1, len(tasks) // (16 * n))))


def outline_distance(renders: list[dict[str, np.ndarray]], fs: tuple[Face, ...]) -> np.ndarray:
    """Mean over common faces of ``|a - b|^2 / (|a|^2 + |b|^2)`` between outline maps, ``[N, N]``
    (0 for identical glyphs, about 1 for glyphs that share no outline; inf without a common face).

    Outlines, not ink: on filled shapes (black arrows, dice) a difference in shape is a small
    fraction of the ink but a large fraction of the outline. Only a coarse filter (see
    :func:`local_difference`)."""
    n = len(renders)
    total = np.zeros((n, n), dtype=np.float32)
    count = np.zeros((n, n), dtype=np.float32)
    for f in fs:
        idx = [i for i, r in enumerate(renders) if f.name in r]
        if not idx:
            continue
        x = _outlines(np.stack([renders[i][f.name] for i in idx])).reshape(len(idx), -1)
        sq = np.einsum("ij,ij->i", x, x)
        den = sq[:, None] + sq[None, :]
        d = den - 2 * (x @ x.T)
        np.maximum(d, 0, out=d)
        d /= np.maximum(den, 1e-6)
        ix = np.ix_(idx, idx)
        total[ix] += d
        count[ix] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.inf)


def local_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Mean over common faces of the largest blurred pixel difference: near 0 when two glyphs
    are the same drawing, large when some part (an arrow head, a bar, a tail) exists in only one,
    however small that part is relative to the whole glyph."""
    common = [f for f in a if f in b]
    if not common:
        return math.inf
    diff = np.abs(np.stack([a[f] for f in common]) - np.stack([b[f] for f in common]))
    return float(ndimage.gaussian_filter(diff, (0, 1.0, 1.0)).max(axis=(1, 2)).mean())


@functools.lru_cache(maxsize=4)
def build_classes(directory: str | None = None, alphabets: tuple[str, ...] | None = None
                  ) -> tuple[tuple[GlyphClass, ...], tuple[tuple[int, int], ...]]:
    """The classes of the dataset (alphabet priority order) and the removed look-alikes.

    ``alphabets``: restrict to these (look-alikes are then searched among them only). Returns
    ``(classes, removed)`` where ``removed`` holds ``(code point dropped, code point kept)``
    pairs. A pure function of the font files."""
    fs = faces(directory)
    cands = candidates(fs)
    if alphabets is not None:
        unknown = sorted(set(alphabets) - set(ALPHABETS))
        if unknown:
            raise DataError(f"glyphs: unknown alphabet(s) {', '.join(unknown)}; "
                            f"known: {', '.join(ALPHABETS)}", param="alphabets", value=alphabets)
        cands = [c for c in cands if c[1] in alphabets]
    renders = clean_renders(cands, fs)
    coarse = outline_distance(renders, fs)
    kept: list[int] = []
    removed: list[tuple[int, int]] = []
    for i, (cp, _, _) in enumerate(cands):
        r = renders[i]
        if len(r) < MIN_FONTS:
            continue
        if np.mean([img.mean() for img in r.values()]) < MIN_INK:
            continue  # a dot or an accent: only its position would tell it apart
        if kept:
            ks = np.asarray(kept)
            near = ks[coarse[i, ks] < DEDUP_COARSE]
            near = near[np.argsort(coarse[i, near], kind="stable")]
            twin = next((int(j) for j in near if local_difference(r, renders[j]) < DEDUP_THRESHOLD),
                        None)
            if twin is not None:
                removed.append((cp, cands[twin][0]))
                continue
        kept.append(i)
    classes = tuple(
        GlyphClass(f"{cands[i][1]}_{cands[i][0]:04X}", cands[i][0], cands[i][1],
                   ALPHABETS[cands[i][1]][1], tuple(f.name for f in fs if f.name in renders[i]))
        for i in kept)
    return classes, tuple(removed)
