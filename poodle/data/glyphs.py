"""``glyphs``: an Omniglot-like few-shot dataset rendered from the fonts matplotlib installs.

One class per character; its instances are the character drawn in the DejaVu, STIX and Computer
Modern faces under a seeded "handwriting" distortion (affine, stroke width, elastic warp, stray
strokes, erased patches, blur, noise), 28 x 28 grey by default. Characters are grouped into
alphabets by script or Unicode block, and train/val/test take disjoint alphabets (about 60/20/20
of the classes). Look-alikes across scripts (Latin A, Greek Alpha, Cyrillic A) are kept once.

The set is written once as an image folder, ``<cache_root>/glyphs/images/<split>/<class>/<i>.png``,
with ``manifest.json`` beside the splits (seed, size, counts, classes, fonts, versions and a
checksum over the images), and is then read like any other folder dataset. See docs/glyphs.md.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import PIL
import scipy
from PIL import Image, ImageDraw, ImageFont, features

from poodle.data._glyph_fonts import (
    ALPHABETS,
    SPLITS,
    Face,
    GlyphClass,
    build_classes,
    cores,
    faces,
    fonts_digest,
)
from poodle.data._glyph_render import (
    Distortion,
    GlyphCache,
    clean_frame,
    png_bytes,
    render_array,
    render_ink,
    to_image,
)
from poodle.errors import ConfigError, DataError
from poodle.interrupt import critical, quiet_worker
from poodle.options import check_group, option

__all__ = [
    "ALPHABETS",
    "SPLITS",
    "Distortion",
    "GlyphClass",
    "DEFAULT_INSTANCES",
    "ensure_glyphs",
    "generate_glyphs",
    "glyph_alphabets",
    "glyph_classes",
    "render_glyph",
    "sample_grid",
    "verify_glyphs",
]

FORMAT = 1  # bump when the rendering changes, so old sets are not taken as current
DEFAULT_INSTANCES = 20  # images per class, as in Omniglot
MANIFEST = "manifest.json"
_TAG_FACES, _TAG_INSTANCE = 1, 2  # first seed word: keeps the two random streams apart

Progress = Callable[[int], None] | None


# ----------------------------------------------------------------------------- classes


def glyph_classes(alphabets: Sequence[str] | None = None, max_per_alphabet: int | None = None) -> list[GlyphClass]:
    """The classes (characters) of the dataset, in alphabet order then code point order.

    ``alphabets``: only these (look-alikes are then removed among them only);
    ``max_per_alphabet``: keep the first n classes of each alphabet (reduced sets for tests)."""
    classes, _ = build_classes(None, tuple(alphabets) if alphabets is not None else None)
    out = list(classes)
    if max_per_alphabet is not None:
        if max_per_alphabet < 1:
            raise ConfigError(
                f"glyphs: max_per_alphabet must be >= 1, got {max_per_alphabet}",
                param="max_per_alphabet",
                value=max_per_alphabet,
            )
        seen: dict[str, int] = {}
        kept = []
        for c in out:
            seen[c.alphabet] = seen.get(c.alphabet, 0) + 1
            if seen[c.alphabet] <= max_per_alphabet:
                kept.append(c)
        out = kept
    return out


def removed_lookalikes(alphabets: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``(character dropped, character kept)`` for every look-alike removed by pixel comparison."""
    _, removed = build_classes(None, tuple(alphabets) if alphabets is not None else None)
    return [(chr(a), chr(b)) for a, b in removed]


def glyph_alphabets() -> dict[str, dict]:
    """``{alphabet: {"description", "split", "classes": n}}`` for the full dataset."""
    counts: dict[str, int] = {}
    for c in glyph_classes():
        counts[c.alphabet] = counts.get(c.alphabet, 0) + 1
    return {
        name: {"description": desc, "split": split, "classes": counts.get(name, 0)}
        for name, (desc, split, _) in ALPHABETS.items()
    }


def _find_class(cls: GlyphClass | str | int) -> GlyphClass:
    if isinstance(cls, GlyphClass):
        return cls
    for c in glyph_classes():
        if (isinstance(cls, int) and c.codepoint == cls) or c.name == cls or c.char == cls:
            return c
    raise DataError(
        f"glyphs: no class {cls!r} (give a GlyphClass, a class name such as 'latin_0041', a character or a code point)",
        param="cls",
        value=cls,
    )


# ----------------------------------------------------------------------------- rendering


def _check_seed(seed: int) -> None:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"glyphs: seed must be a non-negative integer, got {seed!r}", param="seed", value=seed)


def face_order(cls: GlyphClass, seed: int) -> list[str]:
    """The class's faces in the (seeded) order its instances cycle through them."""
    rng = np.random.default_rng(np.random.SeedSequence([_TAG_FACES, int(seed), cls.codepoint]))
    return [cls.faces[int(k)] for k in rng.permutation(len(cls.faces))]


def render_glyph(
    cls: GlyphClass | str | int, index: int, seed: int = 0, image_size: int = 28, distortion: Distortion | None = None
) -> np.ndarray:
    """Instance ``index`` of a class: uint8 grey pixels ``[image_size, image_size]`` (dark ink on
    a light background). A pure function of (class, index, seed, size, distortion) for a given
    Pillow/FreeType build: instance i uses face ``face_order(cls, seed)[i % n_faces]``."""
    _check_seed(seed)
    c = _find_class(cls)
    name = face_order(c, seed)[index % len(c.faces)]
    path = {f.name: f.path for f in faces()}[name]
    return render_array(
        path, c.codepoint, image_size, (_TAG_INSTANCE, int(seed), c.codepoint, int(index)), distortion or Distortion()
    )


def _render_class(task: tuple) -> tuple[str, list[tuple[str, str]], float]:
    """Worker: render and write every instance of one class. Returns (class name,
    [(relative path, sha256)], the faintest instance's peak ink in [0, 1])."""
    out_dir, split, name, cp, paths, seed, size, n, dist = task
    folder = Path(out_dir) / split / name
    folder.mkdir(parents=True, exist_ok=True)
    files, faintest = [], 1.0
    bitmaps = GlyphCache(cp, size)
    for i in range(n):
        # Same steps as render_array, keeping the ink to check that something was drawn.
        rng = np.random.default_rng(np.random.SeedSequence([_TAG_INSTANCE, seed, cp, i]))
        ink = render_ink(paths[i % len(paths)], cp, size, rng, dist, bitmaps)
        faintest = min(faintest, float(ink.max()))
        data = png_bytes(to_image(ink, rng, dist))
        rel = f"{split}/{name}/{i:03d}.png"
        (folder / f"{i:03d}.png").write_bytes(data)
        files.append((rel, hashlib.sha256(data).hexdigest()))
    return name, files, faintest


def _checksum(files: Sequence[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, sha in sorted(files):
        h.update(f"{rel} {sha}\n".encode())
    return h.hexdigest()


def _versions() -> dict[str, str]:
    return {
        "pillow": PIL.__version__,
        "freetype": str(features.version("freetype2")),
        "matplotlib": matplotlib.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "python": platform.python_version(),
    }


@dataclass(frozen=True)
class _Settings:
    """What defines a generated set (the manifest's settings, and its folder's name)."""

    seed: int = 0
    image_size: int = option(28, min=8, why="the strokes need 8 pixels")
    instances: int = option(DEFAULT_INSTANCES, min=1)
    alphabets: Sequence[str] | None = None
    max_per_alphabet: int | None = None
    distortion: Distortion = field(default_factory=Distortion)

    def check(self) -> None:
        _check_seed(self.seed)
        try:
            check_group(self, ConfigError)
        except ConfigError as e:
            raise ConfigError(
                f"glyphs: {e.marked_text}", params=e.params, param=e.param, value=e.value, reason=e.marked_reason
            ) from None

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "seed": int(self.seed),
            "image_size": int(self.image_size),
            "instances": int(self.instances),
            "selected_alphabets": list(self.alphabets) if self.alphabets is not None else None,
            "max_per_alphabet": self.max_per_alphabet,
            "distortion": self.distortion.to_dict(),
        }

    def folder_name(self) -> str:
        """``images`` for the default set; other settings get their own folder, never a rewrite."""
        key = (self.seed, self.image_size, self.instances, self.alphabets, self.max_per_alphabet)
        if key == (0, 28, DEFAULT_INSTANCES, None, None):
            return "images"
        name = f"images-seed{self.seed}-{self.image_size}px"
        if self.instances != DEFAULT_INSTANCES:
            name += f"-n{self.instances}"
        if self.alphabets is not None or self.max_per_alphabet is not None:
            sub = json.dumps([list(self.alphabets) if self.alphabets is not None else None, self.max_per_alphabet])
            name += "-sub" + hashlib.sha256(sub.encode()).hexdigest()[:8]
        return name


def generate_glyphs(
    out_dir: str | Path,
    *,
    seed: int = 0,
    image_size: int = 28,
    instances: int = DEFAULT_INSTANCES,
    alphabets: Sequence[str] | None = None,
    max_per_alphabet: int | None = None,
    distortion: Distortion | None = None,
    workers: int | None = None,
    progress: Progress = None,
) -> dict:
    """Render the dataset into the empty or missing folder ``out_dir`` and write its manifest.

    Not atomic by itself (:func:`ensure_glyphs` generates into a temporary folder and renames).
    ``workers``: processes (None: one per core, at most 8; 0 or 1: in this process); the images
    do not depend on it. Returns the manifest."""
    settings = _Settings(seed, image_size, instances, alphabets, max_per_alphabet, distortion or Distortion())
    settings.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fs = faces()
    classes = glyph_classes(alphabets, max_per_alphabet)
    if not classes:
        raise DataError(
            "glyphs: no class survives the selection; choose other alphabets", param="alphabets", value=alphabets
        )
    files = _render_classes(out, classes, settings, {f.name: str(f.path) for f in fs}, workers, progress)
    manifest = _manifest(classes, settings, fs, files)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest


def _render_classes(
    out: Path,
    classes: Sequence[GlyphClass],
    settings: _Settings,
    font_paths: dict[str, str],
    workers: int | None,
    progress: Progress,
) -> list[tuple[str, str]]:
    """Render every class into ``out`` (in ``workers`` processes); ``[(relative path, sha256)]`` of
    the images written. DataError when a class rendered an image without ink."""
    tasks = [
        (
            str(out),
            c.split,
            c.name,
            c.codepoint,
            [font_paths[n] for n in face_order(c, settings.seed)],
            int(settings.seed),
            int(settings.image_size),
            int(settings.instances),
            settings.distortion,
        )
        for c in classes
    ]
    n_workers = min(8, cores()) if workers is None else max(1, int(workers))
    files: list[tuple[str, str]] = []
    faint: list[str] = []

    def collect(result: tuple[str, list[tuple[str, str]], float]) -> None:
        name, fl, faintest = result
        files.extend(fl)
        if faintest < 0.05:
            faint.append(name)
        if progress is not None:
            progress(len(fl))

    if n_workers <= 1 or len(tasks) < 4:
        for t in tasks:
            collect(_render_class(t))
    else:
        # fork: workers inherit the loaded fonts and modules; spawn elsewhere.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        # Small chunks (~30 classes, about a second each) so that no worker idles long at the end
        # while another finishes a big last chunk; the files do not depend on the chunking.
        chunk = max(1, len(tasks) // (32 * n_workers))
        # the workers ignore SIGINT/SIGTERM (a scheduler signals the whole group): the parent stops at
        # its next safe point and shuts them down; a worker killed inside a task broke the pool,
        # whose shutdown could then hang
        with ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=quiet_worker, initargs=(0,)) as pool:
            # a future a chunk, as pool.map makes them, kept here so that none is cancelled on the
            # way out: a broken pool's manager fails on a cancelled one (a traceback on stderr)
            futures = [pool.submit(_render_chunk, tasks[i : i + chunk]) for i in range(0, len(tasks), chunk)]
            try:
                for f in futures:
                    for r in f.result():
                        collect(r)
            except BaseException:
                # a stop (the progress callback is a safe point) or a failure: the folder is about to
                # be deleted, so the chunks under way go with their workers. Killed, not asked: they
                # ignore SIGTERM, which is all a broken pool's shutdown sends them before it waits
                # for them (forever once one is blocked handing back a result no one reads), and a
                # worker left running would write on into the folder after it was deleted
                with critical():  # not cut short by the hard stop: no worker is left running
                    _kill_workers(pool)
                raise
    if faint:
        # not a caller's value: the fonts of this system lack a glyph
        raise DataError(
            f"glyphs: class(es) {', '.join(faint[:5])} rendered an image without ink (a font that lacks the glyph?)"
        )
    return files


def _render_chunk(tasks: Sequence[tuple]) -> list[tuple[str, list[tuple[str, str]], float]]:
    return [_render_class(t) for t in tasks]


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL the pool's worker processes and reap them."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    for p in workers:
        if p.is_alive():
            p.kill()
    for p in workers:
        p.join(10)


def _manifest(
    classes: Sequence[GlyphClass], settings: _Settings, fs: tuple[Face, ...], files: Sequence[tuple[str, str]]
) -> dict:
    """The manifest of a set: settings, splits, alphabets, classes, fonts, versions, checksum."""
    by_split = {s: [c for c in classes if c.split == s] for s in SPLITS}
    digests = fonts_digest(fs)
    return {
        "dataset": "glyphs",
        **settings.config(),
        "splits": {
            s: {
                "classes": len(cs),
                "images": len(cs) * settings.instances,
                "alphabets": sorted({c.alphabet for c in cs}, key=list(ALPHABETS).index),
            }
            for s, cs in by_split.items()
        },
        "alphabets": {
            a: {
                "description": ALPHABETS[a][0],
                "split": ALPHABETS[a][1],
                "classes": sum(c.alphabet == a for c in classes),
            }
            for a in ALPHABETS
            if any(c.alphabet == a for c in classes)
        },
        "classes": {
            c.name: {
                "char": c.char,
                "codepoint": f"U+{c.codepoint:04X}",
                "alphabet": c.alphabet,
                "split": c.split,
                "faces": face_order(c, settings.seed),
            }
            for c in classes
        },
        "fonts": {f.name: {"file": f.path.name, "sha256": digests[f.name]} for f in fs},
        "removed_lookalikes": [
            f"{a} U+{ord(a):04X} -> {b} U+{ord(b):04X}" for a, b in removed_lookalikes(settings.alphabets)
        ],
        "versions": _versions(),
        "checksum": _checksum(files),
        "n_images": len(files),
    }


# ----------------------------------------------------------------------------- cache folder


def verify_glyphs(root: str | Path, *, checksum: bool = False) -> dict:
    """Check a generated set and return its manifest; DataError naming the first problem.

    The cheap check (default) reads the manifest and checks that every class folder holds its
    images; ``checksum=True`` also re-hashes every image against the recorded checksum."""
    root = Path(root)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise DataError(
            f"glyphs: {root} has no {MANIFEST}; it was not made by ensure_glyphs or "
            f"its generation did not finish (delete the folder, or pass force=True)",
            param="root",
            value=root,
        )
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
        classes, n = m["classes"], int(m["instances"])
        recorded = m["checksum"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"glyphs: {mpath} is unreadable or incomplete ({e}); delete {root} or pass force=True to regenerate",
            param="root",
            value=root,
        ) from e
    if m.get("format") != FORMAT:
        raise DataError(
            f"glyphs: {root} was made by format {m.get('format')}, this poodle writes "
            f"format {FORMAT}; delete it or pass force=True to regenerate",
            param="root",
            value=root,
        )
    files: list[tuple[str, str]] = []
    for name, info in classes.items():
        folder = root / info["split"] / name
        try:
            pngs = sorted(e.name for e in os.scandir(folder) if e.name.endswith(".png"))
        except FileNotFoundError:
            raise DataError(
                f"glyphs: class folder {folder} is missing; delete {root} or pass force=True to regenerate",
                param="root",
                value=root,
            ) from None
        if pngs != [f"{i:03d}.png" for i in range(n)]:
            raise DataError(
                f"glyphs: {folder} holds {len(pngs)} images, the manifest says {n}; "
                f"delete {root} or pass force=True to regenerate",
                param="root",
                value=root,
            )
        if checksum:
            for p in pngs:
                data = (folder / p).read_bytes()
                files.append((f"{info['split']}/{name}/{p}", hashlib.sha256(data).hexdigest()))
    if checksum and _checksum(files) != recorded:
        raise DataError(
            f"glyphs: the images under {root} do not match the checksum in its "
            f"manifest (modified files?); delete it or pass force=True to regenerate",
            param="root",
            value=root,
        )
    return m


def glyphs_generated(cache_root: str | Path) -> bool:
    """Whether the default glyph set is already under ``cache_root`` (so using it costs no generation)."""
    return (Path(cache_root) / "glyphs" / _Settings().folder_name() / MANIFEST).is_file()


def glyphs_to_generate(
    cache_root: str | Path,
    *,
    seed: int = 0,
    image_size: int = 28,
    instances: int = DEFAULT_INSTANCES,
    alphabets: Sequence[str] | None = None,
    max_per_alphabet: int | None = None,
) -> int:
    """How many images :func:`ensure_glyphs` with these settings would write: 0 when the set is
    already under ``cache_root``, else the total its ``progress`` callback counts up to."""
    settings = _Settings(seed, image_size, instances, alphabets, max_per_alphabet)
    if (Path(cache_root) / "glyphs" / settings.folder_name() / MANIFEST).is_file():
        return 0
    return len(glyph_classes(alphabets, max_per_alphabet)) * int(instances)


def ensure_glyphs(
    cache_root: str | Path,
    *,
    seed: int = 0,
    image_size: int = 28,
    progress: Progress = None,
    instances: int = DEFAULT_INSTANCES,
    alphabets: Sequence[str] | None = None,
    max_per_alphabet: int | None = None,
    workers: int | None = None,
    force: bool = False,
    verify: bool = False,
) -> Path:
    """The folder-layout root of the glyphs dataset, generated on first use.

    The default set lives in ``<cache_root>/glyphs/images``; any other seed, size or selection
    gets its own sibling folder (``images-seed1-32px`` ...), so a set is never overwritten by
    different settings. Generation writes into a temporary sibling folder and renames it when
    complete, so an interrupted run leaves nothing under the final name. On reuse the manifest is
    checked cheaply (``verify=True`` re-hashes every image). A folder without a valid manifest or
    with missing images is refused with DataError unless ``force=True``, which regenerates it.
    ``progress`` is called with the number of images just written."""
    _check_seed(seed)
    settings = _Settings(seed, image_size, instances, alphabets, max_per_alphabet)
    base = Path(cache_root) / "glyphs"
    root = base / settings.folder_name()
    want = settings.config()
    if root.exists() and not force:
        m = verify_glyphs(root, checksum=verify)
        got = {k: m.get(k) for k in want}
        if got != want:
            diff = ", ".join(f"{k}={got[k]!r} (wanted {want[k]!r})" for k in want if got[k] != want[k])
            raise DataError(
                f"glyphs: {root} was generated with other settings: {diff}; delete it or pass force=True to regenerate",
                param="root",
                value=root,
            )
        return root
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(f".{root.name}.tmp-*"):
        # Left by an interrupted run of this process's pid namespace or another; only ours use
        # the .tmp- prefix, and a live concurrent run would re-create its own on retry.
        if stale.is_dir() and not _alive(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = base / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        generate_glyphs(
            tmp,
            seed=seed,
            image_size=image_size,
            instances=instances,
            alphabets=alphabets,
            max_per_alphabet=max_per_alphabet,
            workers=workers,
            progress=progress,
        )
        if force and root.exists():
            old = base / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(root, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / MANIFEST).is_file():
                raise
            # Another process finished the same set first: use theirs.
            shutil.rmtree(tmp, ignore_errors=True)
            verify_glyphs(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _alive(tmp: Path) -> bool:
    """Whether the process that owns a temporary folder (pid in its name) still runs."""
    try:
        pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


# ----------------------------------------------------------------------------- samples


def sample_grid(
    root: str | Path, out_png: str | Path, *, per_alphabet: int = 2, columns: int = 10, scale: int = 2
) -> Path:
    """A PNG of samples from a generated set: one row per class (``per_alphabet`` classes from
    every alphabet, labelled with the alphabet and split), a clean reference rendering of the
    character, then ``columns`` instances. Returns ``out_png``."""
    root = Path(root)
    m = verify_glyphs(root)
    size, n = int(m["image_size"]), int(m["instances"])
    columns = min(columns, n)
    rows: list[tuple[str, dict]] = []
    for a in m["alphabets"]:
        names = [k for k, v in m["classes"].items() if v["alphabet"] == a]
        picks = np.linspace(0, len(names) - 1, num=min(per_alphabet, len(names))).round().astype(int)
        rows += [(names[i], m["classes"][names[i]]) for i in sorted(set(picks.tolist()))]
    cell, gap, label_w = size * scale, 2, 196
    width = label_w + (columns + 1) * (cell + gap) + 2 * gap
    height = len(rows) * (cell + gap) + gap
    sheet = Image.new("L", (width, height), 255)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.truetype(str(faces()[0].path), 12)
    path = {f.name: f.path for f in faces()}
    for r, (name, info) in enumerate(rows):
        y = gap + r * (cell + gap)
        draw.text((4, y + cell // 2), f"{info['alphabet']} ({info['split']})", fill=0, font=font, anchor="lm")
        draw.text((label_w - 8, y + cell // 2), info["codepoint"], fill=96, font=font, anchor="rm")
        clean = clean_frame(path[info["faces"][0]], int(info["codepoint"][2:], 16), size)
        assert clean is not None  # the class was kept because its glyph renders
        ref = Image.fromarray(np.round(255 * (1 - clean)).astype(np.uint8))
        sheet.paste(ref.resize((cell, cell), Image.Resampling.NEAREST), (label_w, y))
        for k in range(columns):
            with Image.open(root / info["split"] / name / f"{k:03d}.png") as im:
                tile = im.convert("L").resize((cell, cell), Image.Resampling.NEAREST)
            sheet.paste(tile, (label_w + (k + 1) * (cell + gap) + gap, y))
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    sheet.save(tmp, format="PNG")
    os.replace(tmp, out)
    return out
