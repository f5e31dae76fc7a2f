"""Meta-Dataset's class splits (``poodle/data/splits/md-*``) and ``--dataset folder --class-split``."""

from __future__ import annotations

import re

import _images
import numpy as np
import pytest
from click.testing import CliRunner

from poodle import cache
from poodle.cli.extract import extract as extract_cmd
from poodle.data import resolve_dataset
from poodle.data.sources import CLASS_SPLITS, split_list
from poodle.errors import ConfigError, DataError
from poodle.extract import extract

SPLITS = ("train", "val", "test")
# train / val / test classes, as google-research/meta-dataset's conversion code counts them (its
# NUM_*_CLASSES, the 70/15/15% rule of QuickDraw over 345 classes, Omniglot's alphabets, ILSVRC's graph)
PUBLISHED = {
    "md-ilsvrc": (712, 158, 130),
    "md-omniglot": (883, 81, 659),
    "md-aircraft": (70, 15, 15),
    "md-cub": (140, 30, 30),
    "md-dtd": (33, 7, 7),
    "md-quickdraw": (241, 52, 52),
    "md-fungi": (994, 200, 200),
    "md-vgg-flower": (71, 15, 16),
    "md-traffic-sign": (0, 0, 43),
    "md-mscoco": (0, 40, 40),
}
# MSCOCO's 80 categories in the order of their ids (instances_train2017.json), the order the seeded
# rule indexes
COCO = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "mouse",
    "remote",
    "keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)


def lists(name):
    return {s: split_list(name, s) for s in SPLITS}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_list_has_the_published_counts_and_the_splits_are_disjoint(name):
    got = lists(name)
    assert tuple(len(got[s]) for s in SPLITS) == PUBLISHED[name]
    every = sum(got.values(), [])
    assert len(set(every)) == len(every)  # no class twice, within or across splits
    assert all(c == c.strip() and c and not c.startswith("/") and ".." not in c for c in every)


def test_the_shipped_names_are_the_meta_dataset_splits():
    assert set(CLASS_SPLITS) == set(PUBLISHED)
    ilsvrc = sum(lists("md-ilsvrc").values(), [])
    assert len(ilsvrc) == 1000 and all(re.fullmatch(r"n\d{8}", c) for c in ilsvrc)
    # Omniglot: by alphabet, 25 / 5 / 20; train and val from images_background, test from images_evaluation
    om = lists("md-omniglot")
    alphabets = {s: {c.split("/")[1] for c in om[s]} for s in SPLITS}
    assert [len(alphabets[s]) for s in SPLITS] == [25, 5, 20]
    assert alphabets["val"] == {
        "Blackfoot_(Canadian_Aboriginal_Syllabics)",
        "Ojibwe_(Canadian_Aboriginal_Syllabics)",
        "Inuktitut_(Canadian_Aboriginal_Syllabics)",
        "Tagalog",
        "Alphabet_of_the_Magi",
    }
    assert {c.split("/")[0] for c in om["train"] + om["val"]} == {"images_background"}
    assert {c.split("/")[0] for c in om["test"]} == {"images_evaluation"}
    assert all(re.fullmatch(r"character\d\d", c.split("/")[2]) for c in sum(om.values(), []))
    # the same 140 / 30 / 30 CUB classes as cub-140-30-30
    assert {s: set(v) for s, v in lists("md-cub").items()} == {s: set(split_list("cub-140-30-30", s)) for s in SPLITS}
    assert split_list("md-traffic-sign", "test") == [f"{i:05d}" for i in range(43)]  # GTSRB's class folders
    vgg = sum(lists("md-vgg-flower").values(), [])
    assert sorted(int(c[:3]) for c in vgg) == list(range(1, 103))
    fungi = sum(lists("md-fungi").values(), [])
    assert sorted(int(c[:4]) for c in fungi) == list(range(1394))
    assert set(sum(lists("md-mscoco").values(), [])) == set(COCO)


def seeded_split(names, n_train, n_val, n_test, seed=22):
    """Meta-Dataset's rule, written out: numpy's global generator seeded with 22, then n_train + n_val
    of the indices drawn without replacement (the rest, sorted, is test), then n_train of those (the
    rest, sorted, is val); train stays in draw order."""
    rng = np.random.RandomState(seed)
    n = n_train + n_val + n_test
    trainval = rng.choice(n, n_train + n_val, replace=False)
    test = [i for i in range(n) if i not in set(trainval.tolist())]
    train = rng.choice(trainval, n_train, replace=False)
    val = sorted(set(trainval.tolist()) - set(train.tolist()))
    return {"train": [names[i] for i in train], "val": [names[i] for i in val], "test": [names[i] for i in test]}


@pytest.mark.parametrize("name", ["md-aircraft", "md-cub", "md-dtd", "md-quickdraw", "md-fungi", "md-vgg-flower"])
def test_the_seeded_lists_are_the_rule_on_the_sorted_class_names(name):
    got = lists(name)
    assert seeded_split(sorted(sum(got.values(), [])), *PUBLISHED[name]) == got


def test_mscoco_is_the_rule_on_cocos_category_order():
    assert len(COCO) == 80 and seeded_split(COCO, 0, 40, 40) == lists("md-mscoco")


def _placeholders(root, classes):
    # listing checks names only (nothing is decoded): an empty .png per class keeps this fast
    for c in classes:
        (root / c).mkdir(parents=True)
        (root / c / "0.png").touch()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_folder_of_the_listed_classes_gives_each_split(tmp_path, name):
    want = lists(name)
    _placeholders(tmp_path, sum(want.values(), []))
    (tmp_path / "not-listed").mkdir()  # other folders under the root are left alone
    (tmp_path / "not-listed" / "x.png").touch()
    src = resolve_dataset("folder", tmp_path, class_split=name)
    assert src.name == name and src.splits() == [s for s in SPLITS if want[s]]
    for s in src.splits():
        assert src.classes(s) == sorted(want[s])
        assert [p for p, _ in src.samples(s)] == [f"{c}/0.png" for c in sorted(want[s])]
    for s in set(SPLITS) - set(src.splits()):
        with pytest.raises(DataError, match=f"class_split {name} has no {s} classes") as e:
            src.samples(s)
        assert str(e.value).endswith(f"with splits {','.join(src.splits())}")


def test_extract_with_a_class_split(tmp_path):
    dtd = lists("md-dtd")
    for i, c in enumerate(sorted(dtd["val"] + dtd["test"])):  # only the extracted splits need be on disk
        (tmp_path / "dtd" / "images" / c).mkdir(parents=True)
        _images.make_image(i, 0, size=16).save(tmp_path / "dtd" / "images" / c / "a.jpg")
    args = ["--dataset", "folder", "--class-split", "md-dtd", "--data-root", tmp_path / "dtd" / "images"]
    args += ["--backbone", "conv4_64", "--random-weights", "--splits", "val,test", "--image-size", "16"]
    args += ["--cache-root", tmp_path / "c", "--workers", "0", "--device", "cpu"]
    result = CliRunner().invoke(extract_cmd, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    out = tmp_path / "c" / "md-dtd" / "conv4_64.h5"
    assert cache.read_attrs(out)["dataset"] == "md-dtd" and cache.list_splits(out) == ["val", "test"]
    test = cache.read_split(out, "test")
    assert test.classes == sorted(dtd["test"]) and test.features.shape[0] == 7
    # train's classes are not on disk: the error names the first missing folder
    args[args.index("val,test")] = "train"
    result = CliRunner().invoke(extract_cmd, [str(a) for a in args])
    assert result.exit_code == 1
    assert f"--class-split md-dtd: class folder '{sorted(dtd['train'])[0]}' of its train split" in result.output


def test_class_split_errors(tmp_path):
    _images.write_folder(tmp_path / "f")
    with pytest.raises(ConfigError, match="class_split md-cub is an option of dataset folder, not cub") as e:
        extract("cub", "conv4_64", data_root=tmp_path, class_split="md-cub", cache_root=tmp_path / "c")
    assert e.value.params == ("class_split", "dataset")
    with pytest.raises(ConfigError, match="class_split 'md-nope' is neither a shipped split"):
        resolve_dataset("folder", tmp_path / "f", class_split="md-nope")
    own = tmp_path / "my-split"
    own.mkdir()
    with pytest.raises(DataError, match="no class list in"):
        resolve_dataset("folder", tmp_path / "f", class_split=str(own))
    (own / "train.txt").write_text("a\nb\n")
    (own / "test.txt").write_text("c\nb\n")
    with pytest.raises(DataError, match="class 'b' is listed in train.txt and test.txt"):
        resolve_dataset("folder", tmp_path / "f", class_split=str(own))
    (own / "test.txt").write_text("c\n../d\n")
    with pytest.raises(DataError, match=r"class '../d' of test.txt must be a folder path under the data root"):
        resolve_dataset("folder", tmp_path / "f", class_split=str(own))
    # a folder of one's own lists: named after the folder, its absent val split absent
    (own / "test.txt").write_text("c\n")
    _placeholders(tmp_path / "pool", ["a", "b", "c"])
    src = resolve_dataset("folder", tmp_path / "pool", class_split=str(own))
    assert src.name == "my-split" and src.splits() == ["train", "test"] and src.classes("train") == ["a", "b"]
