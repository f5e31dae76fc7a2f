"""Dataset layouts, presets and transforms."""

from __future__ import annotations

import sys
import types

import _images
import numpy as np
import pytest
import torch
from PIL import Image, ImageEnhance
from torch.utils.data import DataLoader

from poodle.data import ImageDataset, checked, resolve_dataset
from poodle.data.transforms import IMAGENET_MEAN, IMAGENET_STD, ImageJitter, eval_transform, train_transform
from poodle.errors import ConfigError, DataError

# --------------------------------------------------------------------------------------- transforms


def test_eval_transform_is_resize_96_then_centre_crop_84():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (120, 200, 3), dtype=np.uint8))  # 200 wide, 120 high
    x = eval_transform(84)(img)
    assert x.shape == (3, 84, 84) and x.dtype == torch.float32
    # by hand: shorter side 120 -> 96, so 200 -> 160; crop the centre 84x84; ImageNet normalisation
    small = np.asarray(img.resize((160, 96), Image.BILINEAR), dtype=np.float32) / 255
    top, left = (96 - 84) // 2, (160 - 84) // 2
    crop = small[top : top + 84, left : left + 84]
    ref = (crop - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(x.permute(1, 2, 0).numpy(), ref, rtol=0, atol=1e-5)
    assert "resize shorter side to 96" in eval_transform(84).description
    assert "center crop 84" in eval_transform(84).description


def test_images_are_decoded_to_rgb(tmp_path):
    for mode in ("L", "RGBA", "P"):
        d = tmp_path / "test" / f"c_{mode}"
        d.mkdir(parents=True)
        Image.new(mode, (30, 20)).save(d / "0.png")
    ds = ImageDataset(resolve_dataset("folder", tmp_path), "test", eval_transform(16))
    assert all(ds[i][0].shape == (3, 16, 16) for i in range(len(ds)))


def test_train_transform_jitters_brightness_contrast_colour_in_order():
    img = _images.make_image(3, 0, size=32)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        u = torch.rand(3).tolist()
        torch.manual_seed(5)
        out = ImageJitter()(img)
    ref = img
    for enhancer, ui in zip((ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color), u):
        ref = enhancer(ref).enhance(1 + 0.4 * (2 * ui - 1))
    assert np.array_equal(np.asarray(out), np.asarray(ref))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        x = train_transform(28)(img)
        y = train_transform(28)(img)
    assert x.shape == (3, 28, 28) and not torch.equal(x, y)  # augmented: two draws differ


# ------------------------------------------------------------------------------------------ layouts


def test_folder_layout(tmp_path):
    _images.write_folder(tmp_path, {"train": 3, "test": 2}, 4, splits=("train", "test"))
    src = resolve_dataset("folder", tmp_path)
    assert src.splits() == ["train", "test"]
    s = src.samples("train")
    assert len(s) == 12 and s[0] == ("train/train_c00/000.png", "train_c00")
    assert src.classes("train") == ["train_c00", "train_c01", "train_c02"]
    ds = ImageDataset(src, "train", eval_transform(16))
    x, y = ds[5]
    assert x.shape == (3, 16, 16) and y == 1 and ds.targets == [0] * 4 + [1] * 4 + [2] * 4
    with pytest.raises(DataError, match=r"no split folder .*val \(found: train, test"):
        src.samples("val")


def test_folder_class_without_images_is_an_error(tmp_path):
    _images.write_folder(tmp_path, 2, 2, splits=("train",))
    (tmp_path / "train" / "train_c05").mkdir()
    (tmp_path / "train" / "train_c05" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="class 'train_c05' has no images"):
        resolve_dataset("folder", tmp_path).samples("train")


@pytest.mark.parametrize("header", [True, False])
def test_csv_with_and_without_header(tmp_path, header):
    _images.write_csv(tmp_path, {"train": 2, "val": 1, "test": 2}, 3, header=header)
    src = resolve_dataset("csv", tmp_path)
    s = src.samples("train")
    # a header-less first row is data: the authors' loader would have dropped it
    assert len(s) == 6 and s[0] == ("images/train_n00000000_0000.png", "n00000000")
    assert src.classes("test") == ["n00000003", "n00000004"]
    assert src.splits() == ["train", "val", "test"]
    assert (src.root / s[0][0]).is_file()


def test_csv_labels_sort_as_strings(tmp_path):
    _images.write_csv(tmp_path, {"train": 11}, 1, numeric_labels=True, splits=("train",))
    assert resolve_dataset("csv", tmp_path).classes("train")[:3] == ["0", "1", "10"]


def test_csv_errors_name_file_and_line(tmp_path):
    _images.write_csv(tmp_path, {"train": 2}, 2, splits=("train",))
    src = resolve_dataset("csv", tmp_path)
    with pytest.raises(DataError, match=r"split file .*val.csv does not exist \(found: train.csv\)"):
        src.samples("val")
    (tmp_path / "images" / "train_n00000001_0000.png").unlink()
    with pytest.raises(DataError, match=r"train.csv line 4: image .*train_n00000001_0000.png does not exist"):
        resolve_dataset("csv", tmp_path).samples("train")
    (tmp_path / "train.csv").write_text("filename,label\na.png\n")
    with pytest.raises(DataError, match=r"train.csv line 2: expected 'filename,label'"):
        resolve_dataset("csv", tmp_path).samples("train")
    (tmp_path / "train.csv").write_text("filename,label\n")
    with pytest.raises(DataError, match="lists no images"):
        resolve_dataset("csv", tmp_path).samples("train")
    # a first row naming a missing image is not silently taken for a header
    (tmp_path / "train.csv").write_text("gone.png,n1\ntrain_n00000000_0000.png,n0\n")
    with pytest.raises(DataError, match="line 1: image .*gone.png does not exist"):
        resolve_dataset("csv", tmp_path).samples("train")


def test_missing_data_root_and_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match=f"data root {tmp_path / 'nope'} does not exist"):
        resolve_dataset("csv", tmp_path / "nope")
    with pytest.raises(ConfigError, match="needs a data_root folder"):
        resolve_dataset("folder", None)
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'; known: csv, folder"):
        resolve_dataset("imagenet", tmp_path)


def test_cub_split_rule_on_sorted_class_folders(tmp_path):
    _images.write_cub(tmp_path, n_classes=8, images_per_class=2)
    src = resolve_dataset("cub", tmp_path)
    names = [f"{i + 1:03d}.Class_{i}" for i in range(8)]
    assert src.classes("train") == [names[i] for i in (0, 2, 4, 6)]
    assert src.classes("val") == [names[i] for i in (1, 5)]
    assert src.classes("test") == [names[i] for i in (3, 7)]
    assert src.samples("val")[0] == ("images/002.Class_1/Class_1_0000.jpg", "002.Class_1")
    # pointing --data-root at the images folder itself works too
    assert resolve_dataset("cub", tmp_path / "images").classes("test") == src.classes("test")


def test_mini_and_tiered_presets(tmp_path):
    mini = _images.write_csv(tmp_path / "mini", {"train": 2, "test": 1}, 2, splits=("train", "test"))
    assert resolve_dataset("mini", mini).samples("test")[0][0].startswith("images/")
    # tiered as the release's split script writes it: header-less rows, specific label, PNGs in data/
    tiered = _images.write_csv(
        tmp_path / "tiered",
        {"train": 2, "test": 2},
        2,
        header=False,
        image_dir="data",
        numeric_labels=True,
        splits=("train", "test"),
    )
    src = resolve_dataset("tiered", tiered)
    assert len(src.samples("train")) == 4 and src.samples("train")[0][0].startswith("data/")
    assert src.classes("test") == ["2", "3"]
    # the release's own tree, with --data-root at its data/ folder
    rel = _images.write_csv(
        tmp_path / "release",
        {"train": 1},
        2,
        header=False,
        image_dir="tiered-imagenet/data",
        csv_dir="split/tiered",
        splits=("train",),
    )
    assert resolve_dataset("tiered", rel).samples("train")[1][0].startswith("tiered-imagenet/data/")
    with pytest.raises(DataError, match="dataset mini: no split files"):
        resolve_dataset("mini", tmp_path / "release")


def test_glyphs_resolves_lazily_through_ensure_glyphs(tmp_path, monkeypatch):
    root = _images.write_folder(tmp_path / "glyphs" / "images", 2, 2)
    calls = []
    fake = types.ModuleType("poodle.data.glyphs")
    fake.ensure_glyphs = lambda cache_root, **kw: calls.append(cache_root) or root
    fake.verify_glyphs = lambda root, **kw: {}
    monkeypatch.setitem(sys.modules, "poodle.data.glyphs", fake)
    src = resolve_dataset("glyphs", None, cache_root=tmp_path)
    assert calls == [tmp_path] and src.name == "glyphs" and len(src.samples("val")) == 4


# ------------------------------------------------------------------------------------- bad images


def test_bad_image_in_main_process_and_in_a_worker(tmp_path):
    _images.write_folder(tmp_path, {"train": 2}, 3, splits=("train",))
    bad = _images.write_bad_image(tmp_path / "train" / "train_c01" / "001.png")
    ds = ImageDataset(resolve_dataset("folder", tmp_path), "train", eval_transform(16))
    with pytest.raises(DataError, match=f"cannot decode image {bad}"):
        ds[4]
    loader = DataLoader(ds, batch_size=2, num_workers=1)
    with pytest.raises(DataError, match=f"cannot decode image {bad}: UnidentifiedImageError") as e:
        list(checked(loader, ds))
    assert "Traceback" not in str(e.value) and "worker" not in str(e.value)
    sentinel = ImageDataset(ds.source, "train", eval_transform(16), on_error="sentinel")
    x, y = sentinel[4]
    assert y == -5 and x.shape == (3, 16, 16) and ImageDataset.bad_indices(torch.tensor([0, -5])) == [4]
