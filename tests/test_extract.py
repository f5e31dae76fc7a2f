"""``poodle extract``: exact features, streaming into a valid cache, resume, refusals, bad input."""

from __future__ import annotations

import contextlib
import shutil

import _images
import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle import backbones, cache
from poodle.cli.extract import extract as extract_cmd
from poodle.data import resolve_dataset
from poodle.data.transforms import eval_transform, load_rgb
from poodle.extract import cache_path, extract
from poodle.utils import file_sha256

SIZE = 32  # conv4 at 32 px: 32 -> 2x2 final map, fast on a CPU


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _images.write_folder(tmp_path_factory.mktemp("data"), {"train": 3, "val": 2, "test": 2}, 5, size=SIZE)


def _checkpoint(path, seed, arch="conv4_64"):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = backbones.build(arch)
        for m in model.modules():  # non-trivial BN statistics, so eval mode matters
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return backbones.save_checkpoint(model, path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ck") / "conv4.pth.tar", seed=1)


@pytest.fixture(scope="module")
def reference(data, ckpt, tmp_path_factory):
    """An uninterrupted extraction of all three splits."""
    root = tmp_path_factory.mktemp("ref")
    return extract(
        "folder",
        "conv4_64",
        data_root=data,
        checkpoint=ckpt,
        image_size=SIZE,
        batch_size=4,
        cache_root=root,
        workers=0,
        device="cpu",
    )


def _cli(*args):
    # without a checkpoint: the untrained network's features (the default would look for a training run)
    weights = [] if "--checkpoint" in map(str, args) else ["--random-weights"]
    result = CliRunner().invoke(extract_cmd, [*map(str, args), *weights])
    return result


def _h5_files(root):
    return sorted(p.name for p in root.rglob("*.h5"))


def test_features_are_the_backbones_exactly(reference, data, ckpt):
    assert reference.name == "conv4_64.h5" and reference.parent.name == "folder"
    summary = cache.validate(reference)
    assert list(summary["splits"]) == ["train", "val", "test"]
    attrs = summary["attrs"]
    assert attrs["checkpoint_sha256"] == file_sha256(ckpt) and attrs["image_size"] == SIZE
    assert attrs["transform"] == eval_transform(SIZE).description and attrs["backbone"] == "conv4_64"
    model = backbones.build("conv4_64")
    backbones.load_checkpoint(model, ckpt)
    model.eval()
    source = resolve_dataset("folder", data)
    tf = eval_transform(SIZE)
    for split in ("train", "test"):
        s = cache.read_split(reference, split)
        samples = source.samples(split)
        with torch.no_grad():
            raw = model.forward_features(torch.stack([tf(load_rgb(data / p)) for p, _ in samples])).double()
        assert s.paths == [p for p, _ in samples]
        assert s.classes == source.classes(split)
        assert s.labels.tolist() == [s.classes.index(c) for _, c in samples]
        torch.testing.assert_close(s.features.double(), raw / raw.norm(dim=1, keepdim=True), rtol=0, atol=1e-6)
        torch.testing.assert_close(s.raw_mean.double(), raw.mean(0), rtol=1e-5, atol=1e-7)
        assert (s.features.double().norm(dim=1) - 1).abs().max() < 1e-6


def test_a_cpu_extraction_runs_the_backbone_channels_last(data, ckpt, tmp_path, monkeypatch):
    # what test_features_are_the_backbones_exactly checks against a channels-first forward is
    # computed on channels-last tensors: the layout that makes CPU extraction 1.7x faster
    seen = []
    build = backbones.build

    def spying_build(*a, **k):
        model = build(*a, **k)
        model.encoder.register_forward_pre_hook(
            lambda m, args: seen.append(
                args[0].is_contiguous(memory_format=torch.channels_last)
                and m[0][0].weight.is_contiguous(memory_format=torch.channels_last)
            )
        )
        return model

    monkeypatch.setattr(backbones, "build", spying_build)
    extract("folder", "conv4_64", data_root=data, checkpoint=ckpt, image_size=SIZE, splits="test",
            cache_root=tmp_path, workers=0, device="cpu")  # fmt: skip
    assert seen and all(seen)


class _Stop(Exception):
    pass


def _interrupt_after(split, batches):
    """A progress factory whose callback raises after ``batches`` batches of ``split`` (like Ctrl-C)."""
    totals = {}

    @contextlib.contextmanager
    def factory(desc, total):
        totals[desc] = total
        count = [0]

        def advance(n):
            count[0] += 1
            if desc == split and count[0] == batches:
                raise _Stop

        yield advance

    return factory, totals


def test_interrupted_run_resumes_to_the_same_cache(reference, data, ckpt, tmp_path, monkeypatch):
    kw = dict(
        data_root=data, checkpoint=ckpt, image_size=SIZE, batch_size=4, cache_root=tmp_path, workers=0, device="cpu"
    )
    factory, _ = _interrupt_after("val", 2)
    with pytest.raises(_Stop):
        extract("folder", "conv4_64", progress_factory=factory, **kw)
    out = cache_path(tmp_path, "folder", "conv4_64")
    assert cache.list_splits(out) == ["train"]  # the cache holds complete splits only
    cache.validate(out)
    assert cache.partial_path(out, "val").exists()
    factory, totals = _interrupt_after("none", 0)
    assert extract("folder", "conv4_64", progress_factory=factory, **kw) == out
    assert totals == {"val (resumed)": 2, "test": 10}  # train skipped, val resumed after 8 of 10 images
    assert not list(tmp_path.rglob("*.partial")) and not list(tmp_path.rglob("*.tmp"))
    for split in ("train", "val", "test"):
        a, b = cache.read_split(out, split), cache.read_split(reference, split)
        assert torch.equal(a.features, b.features) and torch.equal(a.raw_mean, b.raw_mean)
        assert a.paths == b.paths and torch.equal(a.labels, b.labels)
    # complete: a re-run does not even build the model
    monkeypatch.setattr(backbones, "build", lambda *a, **k: pytest.fail("model built for a complete cache"))
    assert extract("folder", "conv4_64", **kw) == out


def test_float16_cache(reference, data, ckpt, tmp_path):
    out = extract(
        "folder",
        "conv4_64",
        data_root=data,
        checkpoint=ckpt,
        image_size=SIZE,
        cache_root=tmp_path,
        workers=0,
        splits="test",
        dtype="float16",
        tag="half",
    )
    assert out.name == "conv4_64-half.h5" and cache.list_splits(out) == ["test"]
    with h5py.File(out) as f:
        assert f["test/features"].dtype == np.float16
    torch.testing.assert_close(
        cache.read_split(out, "test").features, cache.read_split(reference, "test").features, rtol=0, atol=1e-3
    )
    assert cache.validate(out)["splits"]["test"]["dtype"] == "float16"


def _copy_reference(reference, tmp_path):
    dst = tmp_path / "folder" / "conv4_64.h5"
    dst.parent.mkdir(parents=True)
    shutil.copyfile(reference, dst)
    return dst


def test_another_checkpoints_cache_is_refused_without_force(reference, data, tmp_path):
    dst = _copy_reference(reference, tmp_path)
    before = file_sha256(dst)
    other = _checkpoint(tmp_path / "other.pth.tar", seed=2)
    args = [
        "--dataset",
        "folder",
        "--data-root",
        data,
        "--backbone",
        "conv4_64",
        "--checkpoint",
        other,
        "--image-size",
        SIZE,
        "--cache-root",
        tmp_path,
        "--workers",
        0,
        "--splits",
        "test",
    ]
    r = _cli(*args)
    assert r.exit_code == 1
    assert f"error: {dst} holds features made with checkpoint_sha256=" in r.output and "--force" in r.output
    assert file_sha256(dst) == before
    r = _cli(*args, "--force")
    assert r.exit_code == 0, r.output
    assert cache.read_attrs(dst)["checkpoint_sha256"] == file_sha256(other)
    assert cache.list_splits(dst) == ["test"]  # the other checkpoint's splits are gone, not mixed in
    assert str(dst) in r.output and "test" in r.output


@pytest.mark.parametrize(
    "change, message",
    [
        (["--image-size", 36], "image_size="),
        (["--dtype", "float16"], "split 'test' is stored as float32 (this run: --dtype float16)"),
    ],
)
def test_other_settings_are_refused(reference, data, ckpt, tmp_path, change, message):
    _copy_reference(reference, tmp_path)
    args = [
        "--dataset",
        "folder",
        "--data-root",
        data,
        "--backbone",
        "conv4_64",
        "--checkpoint",
        ckpt,
        "--image-size",
        SIZE,
        "--cache-root",
        tmp_path,
        "--workers",
        0,
        "--splits",
        "test",
    ]
    r = _cli(*args, *change)
    assert r.exit_code == 1 and message in r.output and "--force" in r.output


def test_foreign_file_is_refused_then_replaced_with_force(data, tmp_path):
    dst = tmp_path / "folder" / "conv4_64.h5"
    dst.parent.mkdir(parents=True)
    dst.write_text("my notes")
    args = [
        "--dataset",
        "folder",
        "--data-root",
        data,
        "--backbone",
        "conv4_64",
        "--image-size",
        SIZE,
        "--cache-root",
        tmp_path,
        "--workers",
        0,
        "--splits",
        "val",
    ]
    r = _cli(*args)
    assert r.exit_code == 1 and "not a poodle feature cache" in r.output and "--force" in r.output
    assert dst.read_text() == "my notes"
    assert _cli(*args, "--force").exit_code == 0
    assert cache.list_splits(dst) == ["val"] and cache.read_attrs(dst)["checkpoint_sha256"] == "none"


def test_bad_image_stops_or_is_skipped_and_recorded(tmp_path):
    data = _images.write_folder(tmp_path / "data", {"test": 2}, 4, size=SIZE, splits=("test",))
    bad = _images.write_bad_image(data / "test" / "test_c01" / "002.png")
    args = [
        "--dataset",
        "folder",
        "--data-root",
        data,
        "--backbone",
        "conv4_64",
        "--image-size",
        SIZE,
        "--cache-root",
        tmp_path / "cache",
        "--splits",
        "test",
        "--batch-size",
        3,
    ]
    for workers in (0, 1):  # in a DataLoader worker too, the error names the image, without a traceback
        r = _cli(*args, "--workers", workers)
        assert r.exit_code == 1
        assert f"error: cannot decode image {bad}: UnidentifiedImageError" in r.output
        assert "--skip-bad" in r.output and "Traceback" not in r.output and "worker" not in r.output
        assert _h5_files(tmp_path / "cache") == []
    r = _cli(*args, "--workers", 0, "--skip-bad")
    assert r.exit_code == 0, r.output
    out = tmp_path / "cache" / "folder" / "conv4_64.h5"
    s = cache.read_split(out, "test")
    assert len(s) == 7 and "test/test_c01/002.png" not in s.paths
    with h5py.File(out) as f:
        assert list(f["test"].attrs["skipped"]) == ["test/test_c01/002.png"]
    assert "skipped" in r.output


def test_skipping_every_image_of_a_class_is_an_error(tmp_path):
    data = _images.write_folder(tmp_path / "data", {"test": 2}, 2, size=SIZE, splits=("test",))
    for i in range(2):
        _images.write_bad_image(data / "test" / "test_c00" / f"00{i}.png")
    r = _cli(
        "--dataset",
        "folder",
        "--data-root",
        data,
        "--backbone",
        "conv4_64",
        "--image-size",
        SIZE,
        "--cache-root",
        tmp_path / "cache",
        "--splits",
        "test",
        "--workers",
        0,
        "--skip-bad",
    )
    assert r.exit_code == 1 and "class 'test_c00' has no images left" in r.output
    assert _h5_files(tmp_path / "cache") == []


def _bad_inputs(tmp_path, ckpt):
    csv_root = _images.write_csv(tmp_path / "csv", {"train": 2}, 2, size=SIZE, splits=("train",))
    holey = _images.write_csv(tmp_path / "holey", {"train": 2}, 2, size=SIZE, splits=("train",))
    (holey / "images" / "train_n00000001_0001.png").unlink()
    empty = _images.write_folder(tmp_path / "empty", {"train": 2}, 2, size=SIZE, splits=("train",))
    (empty / "train" / "train_c09").mkdir()
    wrong = _checkpoint(tmp_path / "c512.pth.tar", seed=0, arch="conv4_512")
    return [
        (["--dataset", "csv", "--data-root", tmp_path / "absent"], f"data root {tmp_path / 'absent'} does not exist"),
        (
            ["--dataset", "csv", "--data-root", csv_root, "--splits", "train,val"],
            f"split file {csv_root / 'val.csv'} does not exist",
        ),
        (
            ["--dataset", "csv", "--data-root", holey, "--splits", "train"],
            f"{holey / 'train.csv'} line 5: image {holey / 'images' / 'train_n00000001_0001.png'} does not exist",
        ),
        (["--dataset", "folder", "--data-root", empty, "--splits", "train"], "class 'train_c09' has no images"),
        (
            ["--dataset", "csv", "--data-root", csv_root, "--splits", "train", "--backbone", "resnet99"],
            "unknown backbone 'resnet99'; known backbones: conv4_512, conv4_64",
        ),
        (
            ["--dataset", "csv", "--data-root", csv_root, "--splits", "train", "--checkpoint", wrong],
            f"checkpoint {wrong} does not fit conv4_64",
        ),
        (
            ["--dataset", "csv", "--data-root", csv_root, "--splits", "train", "--checkpoint", tmp_path / "nope.pt"],
            f"checkpoint {tmp_path / 'nope.pt'} does not exist",
        ),
        # cheap checks come first: a missing split file is reported before the (bad) checkpoint is read
        (["--dataset", "csv", "--data-root", csv_root, "--splits", "val", "--checkpoint", wrong], "split file"),
    ]


def test_bad_input_gives_one_clean_line_and_writes_nothing(tmp_path, ckpt):
    for args, message in _bad_inputs(tmp_path, ckpt):
        if "--backbone" not in args:
            args = [*args, "--backbone", "conv4_64"]
        r = _cli(*args, "--image-size", SIZE, "--workers", 0, "--cache-root", tmp_path / "cache")
        assert r.exit_code == 1, (args, r.output)
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert lines == [lines[0]] and lines[0].startswith("error: "), r.output
        assert message in " ".join(r.output.split()), (message, r.output)
        assert _h5_files(tmp_path / "cache") == []


def test_options_are_checked_before_the_glyphs_are_generated(tmp_path, ckpt, monkeypatch):
    """The glyphs take minutes to generate on first use: an option extract refuses (--class-split of
    another dataset, a checkpoint that is not there) is said alone, before the note and the work."""
    from poodle.data import glyphs

    generated = []
    monkeypatch.setattr(glyphs, "glyphs_to_generate", lambda cache_root: 100)
    monkeypatch.setattr(glyphs, "ensure_glyphs", lambda *a, **k: generated.append(a))
    base = ["--dataset", "glyphs", "--backbone", "conv4_64", "--cache-root", tmp_path / "cache"]
    for extra, message in (
        (
            ["--class-split", "md-cub", "--checkpoint", ckpt],
            "error: --class-split md-cub is an option of --dataset folder",
        ),
        (["--checkpoint", tmp_path / "nope.pt"], f"error: --checkpoint {tmp_path / 'nope.pt'} does not exist"),
        (["--checkpoint", ckpt, "--image-size", 2], "error: --image-size must be "),
    ):
        r = _cli(*base, *extra)
        assert r.exit_code == 1 and r.output.startswith(message), r.output
        assert "generating the glyphs" not in r.output and generated == []


def test_a_changed_image_list_is_refused(data, tmp_path):
    mine = tmp_path / "data"
    shutil.copytree(data / "test", mine / "test")
    kw = dict(data_root=mine, splits="test", image_size=SIZE, cache_root=tmp_path / "cache", workers=0)
    out = extract("folder", "conv4_64", **kw)
    _images.make_image(0, 99, SIZE).save(mine / "test" / "test_c00" / "new.png")
    with pytest.raises(cache.CacheError, match=r"split 'test' was made from a different image list \(force recomputes"):
        extract("folder", "conv4_64", **kw)
    extract("folder", "conv4_64", force=True, **kw)
    assert len(cache.read_split(out, "test")) == 11
