"""The embedded glyphs dataset: classes, rendering, generation, the cache folder and its manifest.

A reduced configuration keeps this fast: five alphabets (three train scripts for the look-alike
check, one val, one test), a few classes per alphabet and a few instances per class.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from poodle.data import _glyph_render as render
from poodle.data import glyphs as g
from poodle.data._glyph_fonts import ALPHABETS, CM_FACES, EXCLUDED_FACES, SPLITS, face_covers, faces
from poodle.data._glyph_render import GlyphCache, clean_frame, render_ink
from poodle.errors import ConfigError, DataError

SUBSET = ("latin", "greek", "cyrillic", "lao", "armenian")
SMALL = dict(alphabets=SUBSET, max_per_alphabet=4, instances=3, workers=1)


@pytest.fixture(scope="module")
def classes():
    return g.glyph_classes(SUBSET)


def _by_char(classes, ch):
    return next(c for c in classes if c.char == ch)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.png"))}


def test_render_glyph_is_a_pure_function_of_class_index_and_seed(classes):
    a = _by_char(classes, "A")
    first = g.render_glyph(a, 3, seed=0)
    assert first.shape == (28, 28) and first.dtype == np.uint8
    assert np.array_equal(first, g.render_glyph(a, 3, seed=0))
    assert not np.array_equal(first, g.render_glyph(a, 3, seed=1))
    assert not np.array_equal(first, g.render_glyph(a, 4, seed=0))
    assert g.render_glyph(a, 0, seed=0, image_size=40).shape == (40, 40)
    with pytest.raises(ConfigError, match="seed"):
        g.render_glyph(a, 0, seed=-1)


def test_direct_png_encoding_gives_the_bytes_of_pillow_save():
    # png_bytes calls Pillow's zip encoder without Image.save; the files must not change.
    assert render._DIRECT_PNG, "the direct encoder is off: the generation takes the slower Image.save"
    rng = np.random.default_rng(0)
    for k in range(300):
        h, w = (int(v) for v in rng.integers(1, 90, size=2))
        if k % 3 == 0:
            px = rng.integers(0, 256, size=(h, w), dtype=np.uint8)  # incompressible
        elif k % 3 == 1:
            px = (rng.integers(0, 4, size=(h, w)) * 85).astype(np.uint8)  # few levels, runs
        else:
            px = g.render_glyph("A", k, seed=3, image_size=28)
        assert render._png_direct(px) == render._png_pillow(px), (k, px.shape)


def test_cached_bitmaps_render_the_same_instances(classes):
    # _render_class shares one GlyphCache over a class's instances; each must equal a fresh render.
    path = {f.name: f.path for f in faces()}
    for c in classes[:6]:
        cache = GlyphCache(c.codepoint, 28)
        for i in range(12):
            face = path[c.faces[i % 3]]
            a = render_ink(face, c.codepoint, 28, np.random.default_rng(i), g.Distortion(), cache)
            b = render_ink(face, c.codepoint, 28, np.random.default_rng(i), g.Distortion())
            assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="cache"):
        render_ink(path[classes[0].faces[0]], classes[1].codepoint, 28, np.random.default_rng(0), g.Distortion(), cache)


def test_instances_cycle_through_every_face_of_the_class(classes):
    a = _by_char(classes, "A")
    order = g.face_order(a, seed=0)
    assert sorted(order) == sorted(a.faces) and len(order) >= 6
    assert order != g.face_order(a, seed=1) or len(order) == 1


def test_generation_is_deterministic_for_any_worker_count(tmp_path):
    m1 = g.generate_glyphs(tmp_path / "a", seed=0, alphabets=SUBSET, max_per_alphabet=4, instances=3, workers=1)
    m2 = g.generate_glyphs(tmp_path / "b", seed=0, alphabets=SUBSET, max_per_alphabet=4, instances=3, workers=2)
    m3 = g.generate_glyphs(tmp_path / "c", seed=1, alphabets=SUBSET, max_per_alphabet=4, instances=3, workers=1)
    a, b, c = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(tmp_path / "c")
    assert len(a) == 5 * 4 * 3 == m1["n_images"]
    assert a == b and m1["checksum"] == m2["checksum"]
    assert a.keys() == c.keys() and m3["checksum"] != m1["checksum"]
    assert sum(a[k] != c[k] for k in a) == len(a)  # every image changes with the seed


def test_splits_are_disjoint_in_classes_and_alphabets(tmp_path):
    root = g.ensure_glyphs(tmp_path, **SMALL)
    m = json.loads((root / "manifest.json").read_text())
    on_disk = {s: {p.name for p in (root / s).iterdir()} for s in SPLITS}
    assert on_disk["train"] and on_disk["val"] and on_disk["test"]
    for s, t in [("train", "val"), ("train", "test"), ("val", "test")]:
        assert not on_disk[s] & on_disk[t]
        assert not set(m["splits"][s]["alphabets"]) & set(m["splits"][t]["alphabets"])
    for name, info in m["classes"].items():
        assert name in on_disk[info["split"]] and ALPHABETS[info["alphabet"]][1] == info["split"]
    # The full table: every alphabet in exactly one split, about 60/20/20 by alphabet design.
    assert {split for _, split, _ in ALPHABETS.values()} == set(SPLITS)


def test_images_are_grey_28px_pngs_and_no_class_is_blank(tmp_path, classes):
    root = g.ensure_glyphs(tmp_path, **SMALL)
    for p in root.rglob("*.png"):
        with Image.open(p) as im:
            assert im.mode == "L" and im.size == (28, 28)
    paths = {f.name: f.path for f in faces()}
    for c in classes[::7]:
        for name in c.faces:  # every face listed for a class really draws it (no empty box)
            assert clean_frame(paths[name], c.codepoint, 28).max() > 0.5, (c.name, name)
        rng = np.random.default_rng(0)
        assert render_ink(paths[c.faces[0]], c.codepoint, 28, rng, g.Distortion()).max() > 0.2


def test_faces_come_from_matplotlib_and_skip_missing_glyphs(classes):
    names = {f.name for f in faces()}
    assert len(names) == 22 and all("LastResort" not in n for n in names)
    assert all(not str(f.path).endswith(EXCLUDED_FACES) for f in faces())
    cm = {n for n, _, _ in CM_FACES}
    by_name = {f.name: f for f in faces()}
    for c in classes:
        assert len(c.faces) >= 6
        for name in c.faces:
            assert c.codepoint in face_covers(by_name[name])
        if set(c.faces) & cm:  # Computer Modern only draws ASCII letters and digits
            assert c.char.isascii() and c.char.isalnum()
    armenian = [c for c in classes if c.alphabet == "armenian"]
    assert armenian and all(not any(f.startswith("STIX") for f in c.faces) for c in armenian)


def test_lookalikes_across_scripts_are_kept_once(classes):
    chars = {c.char for c in classes}
    assert "A" in chars and "\u0391" not in chars and "\u0410" not in chars  # Latin/Greek/Cyrillic A
    assert "\u03b1" in chars and "\u0436" in chars  # alpha, zhe stay
    removed = dict(g.removed_lookalikes(SUBSET))
    assert removed["\u0391"] == "A" and removed["\u0410"] == "A"
    # No accented or compatibility forms.
    assert "\u00e9" not in chars and "\u00c5" not in chars and "\u0439" not in chars


def test_manifest_records_the_set_and_verification_catches_changes(tmp_path):
    root = g.ensure_glyphs(tmp_path, seed=3, **SMALL)
    m = g.verify_glyphs(root, checksum=True)
    assert m["seed"] == 3 and m["image_size"] == 28 and m["instances"] == 3
    assert m["n_images"] == sum(s["images"] for s in m["splits"].values()) == 60
    assert {"pillow", "matplotlib", "numpy", "freetype"} <= set(m["versions"])
    assert len(m["fonts"]) == 22 and all(len(f["sha256"]) == 64 for f in m["fonts"].values())
    zero = m["classes"]["latin_0030"]
    assert zero["char"] == "0" and zero["codepoint"] == "U+0030" and zero["split"] == "train"
    assert sorted(zero["faces"]) == sorted(g.face_order(g.glyph_classes(SUBSET)[0], 3))
    victim = next(root.rglob("001.png"))
    victim.write_bytes(victim.read_bytes()[:-8] + b"\0" * 8)
    g.verify_glyphs(root)  # the cheap check sees the file, not its bytes
    with pytest.raises(DataError, match="checksum"):
        g.verify_glyphs(root, checksum=True)
    with pytest.raises(DataError, match="checksum"):
        g.ensure_glyphs(tmp_path, seed=3, verify=True, **SMALL)
    victim.unlink()
    with pytest.raises(DataError, match=r"holds 2 images"):
        g.ensure_glyphs(tmp_path, seed=3, **SMALL)
    fixed = g.ensure_glyphs(tmp_path, seed=3, force=True, **SMALL)
    assert fixed == root and g.verify_glyphs(root, checksum=True)["n_images"] == 60


def test_ensure_reuses_an_existing_set_without_regenerating(tmp_path, monkeypatch):
    calls = []
    root = g.ensure_glyphs(tmp_path, progress=calls.append, **SMALL)
    assert sum(calls) == 60
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}

    def boom(*a, **k):
        raise AssertionError("regenerated")

    monkeypatch.setattr(g, "generate_glyphs", boom)
    assert g.ensure_glyphs(tmp_path, **SMALL) == root
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_other_settings_go_to_their_own_folder(tmp_path):
    a = g.ensure_glyphs(tmp_path, seed=0, **SMALL)
    b = g.ensure_glyphs(tmp_path, seed=1, **SMALL)
    c = g.ensure_glyphs(tmp_path, seed=0, image_size=20, **SMALL)
    assert len({a, b, c}) == 3 and all(p.parent == tmp_path / "glyphs" for p in (a, b, c))
    with Image.open(next(c.rglob("*.png"))) as im:
        assert im.size == (20, 20)
    assert g._Settings(0, 28, g.DEFAULT_INSTANCES, None, None).folder_name() == "images"


def test_folder_without_manifest_is_refused_then_regenerated_with_force(tmp_path):
    root = tmp_path / "glyphs" / g._Settings(0, 28, 3, SUBSET, 4).folder_name()
    (root / "train" / "junk").mkdir(parents=True)
    with pytest.raises(DataError, match="no manifest.json"):
        g.ensure_glyphs(tmp_path, **SMALL)
    assert g.ensure_glyphs(tmp_path, force=True, **SMALL) == root
    assert not (root / "train" / "junk").exists() and (root / "manifest.json").is_file()


def test_interrupted_generation_leaves_no_folder(tmp_path):
    def interrupt(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        g.ensure_glyphs(tmp_path, progress=interrupt, **SMALL)
    assert list((tmp_path / "glyphs").iterdir()) == []
    root = g.ensure_glyphs(tmp_path, **SMALL)
    assert g.verify_glyphs(root)["n_images"] == 60


def test_sample_grid_writes_a_png(tmp_path):
    root = g.ensure_glyphs(tmp_path, **SMALL)
    out = g.sample_grid(root, tmp_path / "grid.png", per_alphabet=1, columns=3)
    with Image.open(out) as im:
        assert im.size[1] == 5 * (28 * 2 + 2) + 2  # one row per alphabet
        assert np.asarray(im.convert("L")).min() < 64


def test_dataset_glyphs_reads_a_set_generated_elsewhere_through_data_root(tmp_path):
    from poodle.data import resolve_dataset
    from poodle.errors import DataError

    root = g.ensure_glyphs(tmp_path / "elsewhere", seed=5, **SMALL)
    src = resolve_dataset("glyphs", root, cache_root=tmp_path / "unused")
    assert src.root == root and not (tmp_path / "unused").exists()
    assert sorted(src.splits()) == ["test", "train", "val"] and src.samples("test")
    (tmp_path / "plain" / "train").mkdir(parents=True)
    with pytest.raises(DataError):
        resolve_dataset("glyphs", tmp_path / "plain", cache_root=tmp_path)


def test_the_rendering_workers_ignore_a_signal_to_the_whole_group(tmp_path):
    # a scheduler signals every process of the group: the workers keep rendering (the parent stops
    # at its next safe point and shuts them down); a worker killed by it broke the pool, whose
    # shutdown could then hang
    import multiprocessing
    import os
    import signal

    sent: list[int] = []

    def progress(n: int) -> None:
        if not sent:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGTERM)
                sent.append(child.pid)

    m = g.generate_glyphs(tmp_path / "a", seed=0, alphabets=SUBSET, max_per_alphabet=4, instances=3, workers=2,
                          progress=progress)  # fmt: skip
    assert sent and m == json.loads((tmp_path / "a" / "manifest.json").read_text())


_STOPPED_IN_A_BROKEN_POOL = """
import multiprocessing, os, signal, sys
from pathlib import Path
from poodle.data import glyphs as g

def progress(n):
    # a worker gone under the pool (the pool is broken), then a stop: the other worker, which
    # ignores SIGTERM, is busy with a class whose result (800 files) fills the pipe to the parent
    os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
    raise KeyboardInterrupt

try:
    g.ensure_glyphs(Path(sys.argv[1]), progress=progress, alphabets=("latin", "greek"), max_per_alphabet=3,
                    instances=800, workers=2)
except KeyboardInterrupt:
    print("stopped", sorted(p.name for p in (Path(sys.argv[1]) / "glyphs").iterdir()), flush=True)
"""


def test_a_generation_stopped_in_a_broken_pool_ends_and_leaves_no_folder(tmp_path):
    """On the way out the workers are stopped for good (they ignore SIGTERM): the process ends, and
    no worker writes on into the temporary folder after it was deleted."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_IN_A_BROKEN_POOL, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its workers too can be killed should it hang
    )
    try:
        out, _ = run.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate()
        pytest.fail(f"the stopped generation did not end: {out}")
    time.sleep(1)  # a worker left running would write on
    assert run.returncode == 0 and out.strip() == "stopped []", out
    assert list((tmp_path / "glyphs").iterdir()) == []
