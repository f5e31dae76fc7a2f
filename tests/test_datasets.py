"""cifar-fs and fc100 from CIFAR-100's binary files, cub's 140-30-30 split, and `poodle split`."""

from __future__ import annotations

import csv
import json

import _images
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle import backbones, cache
from poodle.cli._common import as_flags
from poodle.cli.split import split as split_cmd
from poodle.data import ImageDataset, resolve_dataset
from poodle.data.cifar import write_cifar100_binary
from poodle.data.sources import split_list
from poodle.data.transforms import IMAGENET_MEAN, IMAGENET_STD, native_eval_transform
from poodle.errors import ConfigError, DataError
from poodle.extract import extract
from poodle.split import make_split

# CIFAR-100's 20 superclasses and their 5 fine classes (the dataset's published label hierarchy)
HIERARCHY = {
    "aquatic_mammals": "beaver dolphin otter seal whale",
    "fish": "aquarium_fish flatfish ray shark trout",
    "flowers": "orchid poppy rose sunflower tulip",
    "food_containers": "bottle bowl can cup plate",
    "fruit_and_vegetables": "apple mushroom orange pear sweet_pepper",
    "household_electrical_devices": "clock keyboard lamp telephone television",
    "household_furniture": "bed chair couch table wardrobe",
    "insects": "bee beetle butterfly caterpillar cockroach",
    "large_carnivores": "bear leopard lion tiger wolf",
    "large_man-made_outdoor_things": "bridge castle house road skyscraper",
    "large_natural_outdoor_scenes": "cloud forest mountain plain sea",
    "large_omnivores_and_herbivores": "camel cattle chimpanzee elephant kangaroo",
    "medium_mammals": "fox porcupine possum raccoon skunk",
    "non-insect_invertebrates": "crab lobster snail spider worm",
    "people": "baby boy girl man woman",
    "reptiles": "crocodile dinosaur lizard snake turtle",
    "small_mammals": "hamster mouse rabbit shrew squirrel",
    "trees": "maple_tree oak_tree palm_tree pine_tree willow_tree",
    "vehicles_1": "bicycle bus motorcycle pickup_truck train",
    "vehicles_2": "lawn_mower rocket streetcar tank tractor",
}
COARSE = sorted(HIERARCHY)
PARENT = {f: c for c, fs in HIERARCHY.items() for f in fs.split()}
FINE = sorted(PARENT)


def test_shipped_lists_are_the_published_partitions():
    fs = {s: split_list("cifar-fs", s) for s in ("train", "val", "test")}
    assert [len(v) for v in fs.values()] == [64, 16, 20]
    assert sorted(sum(fs.values(), [])) == FINE
    fc = {s: split_list("fc100", s) for s in ("train", "val", "test")}
    assert [len(v) for v in fc.values()] == [12, 4, 4] and sorted(sum(fc.values(), [])) == COARSE
    assert set(fc["test"]) == {"aquatic_mammals", "insects", "medium_mammals", "people"}
    cub = {s: split_list("cub-140-30-30", s) for s in ("train", "val", "test")}
    assert [len(v) for v in cub.values()] == [140, 30, 30]
    assert sorted(int(c[:3]) for c in sum(cub.values(), [])) == list(range(1, 201))


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    """A tiny CIFAR-100 binary set: every class has 2 records in train.bin and 1 in test.bin."""
    root = tmp_path_factory.mktemp("cifar")
    d = root / "cifar-100-binary"
    d.mkdir()
    rng = np.random.default_rng(0)
    arrays = {}
    for name, per in (("train.bin", 2), ("test.bin", 1)):
        fine = np.repeat(np.arange(100), per)
        rng.shuffle(fine)  # records are not grouped by class in the real files either
        coarse = np.array([COARSE.index(PARENT[FINE[f]]) for f in fine])
        images = rng.integers(0, 256, (len(fine), 32, 32, 3), dtype=np.uint8)
        write_cifar100_binary(d / name, images, fine, coarse)
        arrays[name] = (images, fine)
    (d / "fine_label_names.txt").write_text("\n".join(FINE) + "\n")
    (d / "coarse_label_names.txt").write_text("\n".join(COARSE) + "\n")
    return root, arrays


def test_cifar_fs_and_fc100_read_the_binary_records(cifar):
    root, arrays = cifar
    src = resolve_dataset("cifar-fs", root)
    test = src.samples("test")
    assert len(test) == 60 and src.classes("test") == sorted(split_list("cifar-fs", "test"))
    # train.bin's records first, each file in record order; labels from the fine label byte
    expect = [
        (f"cifar-100-binary/{name}#{i}", FINE[f])
        for name in ("train.bin", "test.bin")
        for i, f in enumerate(arrays[name][1])
        if FINE[f] in split_list("cifar-fs", "test")
    ]
    assert test == expect
    path, _ = test[-1]
    i = int(path.split("#")[1])
    assert np.array_equal(np.asarray(src.open_image(path)), arrays["test.bin"][0][i])
    fc = resolve_dataset("fc100", root)
    counts = [len(fc.classes(s)) for s in ("train", "val", "test")]
    assert counts == [60, 20, 20]
    assert {PARENT[c] for c in fc.classes("val")} == set(split_list("fc100", "val"))
    assert len(fc.samples("train")) == 180


def test_cifar_extract_feeds_native_32px_images(cifar, tmp_path):
    root, arrays = cifar
    out = extract(
        "cifar-fs",
        "conv4_64",
        data_root=root,
        splits="val",
        cache_root=tmp_path,
        workers=0,
        device="cpu",
        batch_size=16,
    )
    assert out == tmp_path / "cifar-fs" / "conv4_64.h5"
    attrs = cache.read_attrs(out)
    assert attrs["image_size"] == 32 and "native 32x32" in attrs["transform"]
    s = cache.read_split(out, "val")
    torch.manual_seed(0)
    model = backbones.build("conv4_64").eval()
    name, i = s.paths[5].split("/")[-1].split("#")
    x = torch.from_numpy(arrays[name][0][int(i)]).permute(2, 0, 1).float() / 255
    x = (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    with torch.no_grad():
        f = model.forward_features(x[None]).double()[0]
    torch.testing.assert_close(s.features[5].double(), f / f.norm(), rtol=0, atol=1e-6)
    ds = ImageDataset(resolve_dataset("cifar-fs", root), "val", native_eval_transform(32))
    assert ds[0][0].shape == (3, 32, 32)


def test_damaged_cifar_files_are_named(cifar, tmp_path):
    root, _ = cifar
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("train.bin", "test.bin", "fine_label_names.txt", "coarse_label_names.txt"):
        (bad / f).write_bytes((root / "cifar-100-binary" / f).read_bytes())
    (bad / "test.bin").write_bytes((bad / "test.bin").read_bytes()[:-5])
    with pytest.raises(DataError, match=r"test.bin: .* not a whole number of 3074-byte"):
        resolve_dataset("cifar-fs", bad)
    (bad / "test.bin").write_bytes((root / "cifar-100-binary" / "test.bin").read_bytes())
    (bad / "fine_label_names.txt").write_text("\n".join(FINE[:-1]))  # 99 names: label 99 has none
    with pytest.raises(DataError, match=r"train.bin record \d+: fine label 99 but 99 fine label names"):
        resolve_dataset("cifar-fs", bad).samples("test")
    (bad / "fine_label_names.txt").write_text("\n".join(c if c != "whale" else "whales" for c in FINE))
    with pytest.raises(DataError, match="no class 'whale' of the CIFAR-FS test split"):
        resolve_dataset("cifar-fs", bad).samples("test")
    with pytest.raises(DataError, match="no train.bin") as e:
        resolve_dataset("fc100", tmp_path)
    # the library names its parameter, the command line writes it as the flag
    assert str(e.value).startswith("dataset fc100: no train.bin") and e.value.params == ("dataset",)
    assert as_flags(e.value.marked_text, {p: "--" + p.replace("_", "-") for p in e.value.params}).startswith(
        "--dataset fc100: no train.bin"
    )


def test_cub_140_30_30_is_its_own_dataset(tmp_path):
    names = sum((split_list("cub-140-30-30", s) for s in ("train", "val", "test")), [])
    for n in names:
        d = tmp_path / "cub" / "images" / n
        d.mkdir(parents=True)
        _images.make_image(int(n[:3]), 0, size=32).save(d / "a.png")
    src = resolve_dataset("cub", tmp_path / "cub", cub_split="140-30-30")
    assert src.name == "cub-140-30-30"
    assert src.classes("val") == sorted(split_list("cub-140-30-30", "val"))
    assert len(resolve_dataset("cub", tmp_path / "cub").classes("train")) == 100  # the release's rule
    out = extract(
        "cub",
        "conv4_64",
        data_root=tmp_path / "cub",
        cub_split="140-30-30",
        splits="test",
        image_size=32,
        cache_root=tmp_path / "c",
        workers=0,
        device="cpu",
    )
    assert out == tmp_path / "c" / "cub-140-30-30" / "conv4_64.h5"
    assert cache.read_attrs(out)["dataset"] == "cub-140-30-30"
    with pytest.raises(ConfigError, match="cub_split 140-30-30 is an option of dataset cub") as e:
        extract("folder", "conv4_64", data_root=tmp_path, cub_split="140-30-30", cache_root=tmp_path / "c")
    assert "--" not in str(e.value) and e.value.params == ("cub_split", "dataset")
    (tmp_path / "cub" / "images" / names[-1] / "a.png").unlink()
    (tmp_path / "cub" / "images" / names[-1]).rmdir()
    with pytest.raises(DataError, match=f"class folder '{names[-1]}' of its test split") as e:
        resolve_dataset("cub", tmp_path / "cub", cub_split="140-30-30")
    assert str(e.value).startswith("cub_split 140-30-30: ") and e.value.params == ("cub_split",)
    assert as_flags(e.value.marked_text, {p: "--" + p.replace("_", "-") for p in e.value.params}).startswith(
        "--cub-split 140-30-30: class folder"
    )


@pytest.fixture
def domain(tmp_path):
    root = tmp_path / "domain"
    for c in range(6):
        for i in range(5):
            (root / f"class{c}").mkdir(parents=True, exist_ok=True)
            _images.make_image(c, i, size=16).save(root / f"class{c}" / f"{i:02d}.png")
    return root


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.reader(fh))[1:]


def test_noisy_split_is_seeded_and_read_by_the_csv_dataset(domain, tmp_path):
    res = CliRunner().invoke(
        split_cmd, ["--data-root", str(domain), "--out", str(tmp_path / "a"), "--setting", "noisy", "--seed", "3"]
    )
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "a" / "split.json").read_text())
    assert (rec["setting"], rec["seed"], rec["fraction"]) == ("noisy", 3, 0.2)
    pool, test = _rows(tmp_path / "a" / "train.csv"), _rows(tmp_path / "a" / "test.csv")
    # int(0.2 * 5) = 1 image of every class in the pool, the other 4 to test, none in both
    assert len(pool) == 6 and len(test) == 24 and not {r[0] for r in pool} & {r[0] for r in test}
    assert sorted(r[1] for r in pool) == [f"class{c}" for c in range(6)]
    make_split(domain, tmp_path / "b", setting="noisy", seed=3)
    assert (tmp_path / "b" / "train.csv").read_text() == (tmp_path / "a" / "train.csv").read_text()
    make_split(domain, tmp_path / "c", setting="noisy", seed=4)
    assert (tmp_path / "c" / "train.csv").read_text() != (tmp_path / "a" / "train.csv").read_text()
    src = resolve_dataset("csv", tmp_path / "a")
    assert len(src.samples("train")) == 6 and src.samples("test")[0][0].startswith("images/class0/")
    with pytest.raises(ConfigError, match="seed=3") as e:
        make_split(domain, tmp_path / "a", setting="noisy", seed=5)
    assert "--" not in str(e.value) and e.value.params == ("out", "force")
    res = CliRunner().invoke(
        split_cmd, ["--data-root", str(domain), "--out", str(tmp_path / "a"), "--setting", "noisy", "--seed", "5"]
    )
    assert res.exit_code == 1 and f"error: --out {tmp_path / 'a'} holds a split made with" in res.output, res.output
    assert "pass --force to replace it" in res.output


def test_disjoint_split_holds_out_whole_classes(domain, tmp_path):
    rec = make_split(domain, tmp_path / "d", setting="disjoint", seed=0)
    pool, test = _rows(tmp_path / "d" / "train.csv"), _rows(tmp_path / "d" / "test.csv")
    assert rec["fraction"] == 0.5 and rec["pool"] == {"images": 15, "classes": 3}
    assert not {r[1] for r in pool} & {r[1] for r in test} and len(test) == 15
    with pytest.raises(ConfigError, match="fraction 1.0: must be strictly between 0 and 1") as e:
        make_split(domain, tmp_path / "e", setting="disjoint", seed=0, fraction=1.0)
    assert e.value.params == ("fraction",)


def test_noisy_split_that_would_leave_the_pool_empty_is_refused(domain, tmp_path):
    # int(0.1 * 5) = 0 images of each class: an empty pool, which --negatives base cannot use
    res = CliRunner().invoke(
        split_cmd, ["--data-root", str(domain), "--out", str(tmp_path / "z"), "--setting", "noisy", "--fraction", "0.1"]
    )
    assert res.exit_code == 1 and "--fraction 0.1 of at most 5 images per class puts no image in the pool" in res.output
    assert not (tmp_path / "z" / "train.csv").exists()
