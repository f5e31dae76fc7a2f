"""The faster input pipeline gives the same tensors: uint8 items finished per batch, and the decoded-image cache."""

from __future__ import annotations

import _images
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T

from poodle.data import ImageDataset, PixelCache, checked, resolve_dataset
from poodle.data.transforms import (
    BatchFinish,
    RandomResizedCrop,
    ToUint8Tensor,
    eval_transform,
    native_eval_transform,
    transform_stages,
)
from poodle.errors import DataError
from poodle.train import TrainConfig, loop, train
from poodle.train.augment import train_transform

SIZE = 16


def _every_byte_image(seed: int = 0) -> Image.Image:
    """16 x 16 RGB holding each of the 256 byte values once per channel (in a different order per channel)."""
    rng = np.random.default_rng(seed)
    a = np.stack([rng.permutation(256).astype(np.uint8).reshape(16, 16) for _ in range(3)], axis=-1)
    return Image.fromarray(a)


@pytest.mark.parametrize(
    "tf",
    [
        native_eval_transform(SIZE),  # ToTensor, ImageNet Normalize
        T.Compose([T.ToTensor()]),  # no Normalize
        T.Compose([T.ToTensor(), T.Normalize((0.5, 0.25, 0.1), (0.3, 0.7, 0.123))]),  # another Normalize
    ],
)
def test_the_batch_finish_equals_the_per_image_transform_for_every_byte_and_channel(tf):
    # every value a uint8 item can hold, in every channel: the finish is checked exhaustively
    imgs = [_every_byte_image(s) for s in range(4)]
    st = transform_stages(tf)
    assert st.rest_uint8 is not None and st.finish is not None
    items = [st.rest_uint8(st.fixed(im)) for im in imgs]
    assert all(x.dtype == torch.uint8 and x.shape == (3, SIZE, SIZE) and x.is_contiguous() for x in items)
    want = torch.stack([tf(im) for im in imgs])
    got = st.finish(torch.stack(items))
    assert got.dtype == want.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, want)


def test_the_device_lookup_equals_the_cpu_lookup():
    # what a GPU batch goes through, run here on the CPU: the same table, gathered by torch
    finish = BatchFinish(T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
    x = torch.stack([ToUint8Tensor()(_every_byte_image(s)) for s in range(3)])
    got = finish._lookup_torch(x)
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, finish(x))
    with pytest.raises(TypeError, match="uint8"):
        finish(x.float())


CROPS = [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 1.0), (0.9, 1.1)), ((0.9, 1.0), (5.0, 6.0))]


@pytest.mark.parametrize("scale,ratio", CROPS)
def test_our_random_resized_crop_draws_and_crops_as_torchvisions(scale, ratio):
    ours, theirs = RandomResizedCrop(12, scale=scale, ratio=ratio), T.RandomResizedCrop(12, scale=scale, ratio=ratio)
    rng = np.random.default_rng(0)
    for k in range(600):
        w, h = (int(v) for v in rng.integers(1, 60, 2))
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3) if k % 3 else (h, w), dtype=np.uint8))  # RGB and L
        torch.manual_seed(k)
        want = theirs.get_params(img, theirs.scale, theirs.ratio)
        state = torch.get_rng_state()
        torch.manual_seed(k)
        got = ours._params(img)
        assert got == want and torch.equal(torch.get_rng_state(), state)  # the same draws, the same crop
        if min(got[2:]) > 0:
            torch.manual_seed(k)
            a = np.asarray(theirs(img))
            torch.manual_seed(k)
            assert np.array_equal(np.asarray(ours(img)), a)
    # 50 x 1: every draw asks for a crop at least 2 px high (area >= 4, aspect <= 6), so all 10 fail and
    # torchvision's central-crop fallback decides
    thin = Image.new("RGB", (50, 1))
    torch.manual_seed(0)
    want = theirs.get_params(thin, theirs.scale, theirs.ratio)
    torch.manual_seed(0)
    assert ours._params(thin) == want and want[0] == 0 and want[2] == 1


def test_a_grey_image_gives_one_channel_and_the_same_values():
    img = _every_byte_image().convert("L")
    x = ToUint8Tensor()(img)
    assert x.shape == (1, SIZE, SIZE)
    assert torch.equal(BatchFinish()(x[None]), T.ToTensor()(img)[None])


def test_the_stages_split_where_randomness_starts():
    ev = transform_stages(eval_transform(84))
    assert [type(s) for s in ev.fixed.transforms] == [T.Resize, T.CenterCrop]
    crop = transform_stages(train_transform("crop", 28))
    assert type(crop.fixed).__name__ == "_ToRGB"  # then the random crop
    paper = transform_stages(train_transform("paper", 28))
    assert type(paper.fixed).__name__ == "Identity"  # random from the first step
    opaque = transform_stages(lambda img: torch.zeros(3))
    assert opaque.rest_uint8 is None and opaque.finish is None


def _loader_batches(ds: ImageDataset, seed: int, workers: int = 0, epochs: int = 2) -> list[torch.Tensor]:
    out = []
    for epoch in range(epochs):
        torch.manual_seed(seed + epoch)  # as the training loop re-seeds every epoch
        loader = DataLoader(ds, batch_size=5, shuffle=False, num_workers=workers)
        out += [ds.finish(x) for x, _ in checked(loader, ds)]
    return out


@pytest.mark.parametrize(
    "kind,split", [("crop", "train"), ("paper", "train"), ("none", "train"), ("eval", "val"), ("native", "val")]
)
def test_cached_uint8_batches_equal_the_per_image_transform(tmp_path, kind, split):
    _images.write_folder(tmp_path, {"train": 3, "val": 2}, 6, size=24, splits=("train", "val"))
    src = resolve_dataset("folder", tmp_path)
    tf = {"eval": eval_transform(SIZE), "native": native_eval_transform(24)}.get(kind) or train_transform(kind, SIZE)
    plain = ImageDataset(src, split, tf)
    fast = ImageDataset(src, split, tf, uint8=True, cache_bytes=1 << 20)
    assert fast.uint8 and plain.finish(torch.ones(1)).equal(torch.ones(1))  # plain: the identity
    want, got = _loader_batches(plain, 3), _loader_batches(fast, 3)
    assert len(want) == len(got) > 2
    for a, b in zip(want, got):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert fast.cache is not None and len(fast.cache) == len(fast)  # the second epoch read the cache


def test_workers_collate_and_pickle_uint8_items(tmp_path):
    _images.write_folder(tmp_path, {"train": 2}, 5, size=24, splits=("train",))
    src = resolve_dataset("folder", tmp_path)
    tf = train_transform("crop", SIZE)
    fast = ImageDataset(src, "train", tf, uint8=True, cache_bytes=1 << 20)
    assert fast.preload()
    plain = ImageDataset(src, "train", tf)
    # a worker draws its own augmentation stream: compare the same pipeline with and without the cache
    want = _loader_batches(plain, 0, workers=1, epochs=1)
    got = _loader_batches(fast, 0, workers=1, epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and len(got) == 2


def test_the_cache_keeps_to_its_budget_and_returns_identical_tensors(tmp_path):
    _images.write_folder(tmp_path, {"train": 2}, 5, size=24, splits=("train",))
    src = resolve_dataset("folder", tmp_path)
    tf = native_eval_transform(24)
    per_image = 24 * 24 * 3
    ds = ImageDataset(src, "train", tf, cache_bytes=3 * per_image + 100)
    ref = ImageDataset(src, "train", tf)
    assert ds.cache is not None and ref.cache is None
    for _rep in range(2):
        for i in range(len(ds)):
            assert torch.equal(ds[i][0], ref[i][0])
            assert ds.cache.nbytes <= ds.cache.max_bytes
    assert len(ds.cache) == 3 and ds.cache.nbytes == 3 * per_image
    assert [ds.cache.get(ds._key(i)) is not None for i in range(5)] == [True] * 3 + [False] * 2
    assert not ds.preload()  # 10 images do not fit: nothing more is decoded into memory
    assert ds.cache.nbytes == 3 * per_image
    whole = ImageDataset(src, "train", tf, cache_bytes=10 * per_image)
    assert whole.preload() and whole.cache is not None and whole.cache.nbytes == 10 * per_image
    assert all(torch.equal(whole[i][0], ref[i][0]) for i in range(len(ref)))
    assert not ref.preload()


def test_datasets_with_other_transforms_share_one_cache_of_decoded_images(tmp_path):
    _images.write_folder(tmp_path, {"train": 2}, 4, size=24, splits=("train",))
    src = resolve_dataset("folder", tmp_path)
    pixels = PixelCache(1 << 20)
    train = ImageDataset(src, "train", train_transform("crop", SIZE), cache=pixels, uint8=True)
    assert train.preload() and len(pixels) == 8
    decoded: list[int] = []
    src.open_image = lambda rel: decoded.append(1)  # type: ignore[method-assign]  # nothing may be decoded now
    ev = ImageDataset(src, "train", eval_transform(SIZE), cache=pixels, uint8=True)
    ref = ImageDataset(resolve_dataset("folder", tmp_path), "train", eval_transform(SIZE))
    got = ev.finish(torch.stack([ev[i][0] for i in range(len(ev))]))
    assert not decoded and torch.equal(got, torch.stack([ref[i][0] for i in range(len(ref))]))
    with pytest.raises(Exception, match="budget"):
        PixelCache(-1)


def test_the_cached_pixels_are_not_changed_by_a_later_step(tmp_path):
    _images.write_folder(tmp_path, {"train": 1}, 2, size=24, splits=("train",))

    class Scribble:  # a step that draws into its input image
        def __call__(self, img: Image.Image) -> Image.Image:
            img.paste((255, 0, 0), (0, 0, 24, 24))
            return img

    tf = T.Compose([Scribble(), T.ToTensor()])
    ds = ImageDataset(resolve_dataset("folder", tmp_path), "train", tf, cache_bytes=1 << 20)
    ds[0]
    assert ds.cache is not None and int(ds.cache.get(ds._key(0))[..., 1].max()) > 0  # not Scribble's red


def test_a_bad_image_is_never_cached_and_is_named_every_time(tmp_path):
    _images.write_folder(tmp_path, {"train": 2}, 3, size=24, splits=("train",))
    bad = _images.write_bad_image(tmp_path / "train" / "train_c01" / "001.png")
    src = resolve_dataset("folder", tmp_path)
    ds = ImageDataset(src, "train", eval_transform(SIZE), cache_bytes=1 << 20, uint8=True)
    for _ in range(2):
        with pytest.raises(DataError, match=f"cannot decode image {bad}"):
            ds[4]
    assert ds.cache is not None and ds.cache.get(ds._key(4)) is None
    assert not ds.preload() and len(ds.cache) == 5  # the others are cached
    loader = DataLoader(ds, batch_size=3, num_workers=1)  # the uint8 sentinel collates with uint8 items
    with pytest.raises(DataError, match=f"cannot decode image {bad}: UnidentifiedImageError"):
        list(checked(loader, ds))
    sentinel = ImageDataset(src, "train", eval_transform(SIZE), on_error="sentinel", uint8=True)
    x, y = sentinel[4]
    assert y == -5 and x.dtype == torch.uint8 and x.shape == (3, SIZE, SIZE)


def _train_weights(tmp_path, name: str, workers: int, per_image: bool, monkeypatch) -> dict[str, torch.Tensor]:
    if per_image:  # the pipeline before the cache and the batched finish: float items, decoded every time
        monkeypatch.setattr(
            loop,
            "_dataset",
            lambda cfg, split, transform, pixels=None: ImageDataset(
                resolve_dataset(cfg.dataset, cfg.data_root, cfg.cache_root), split, transform
            ),
        )
    else:
        monkeypatch.undo()
    cfg = TrainConfig(
        dataset="folder",
        data_root=str(tmp_path / "data"),
        backbone="conv4_64",
        epochs=2,
        batch_size=8,
        image_size=SIZE,
        augment="crop",
        val_every=1,
        val_episodes=10,
        val_way=3,
        val_query=2,
        workers=workers,
        device="cpu",
        cache_root=str(tmp_path / "cache"),
        out=str(tmp_path / name),
    )
    result = train(cfg)
    ckpt = torch.load(result.checkpoint, map_location="cpu", weights_only=True)
    assert ckpt["history"][-1]["val_acc"] is not None
    return ckpt["state_dict"]


@pytest.mark.parametrize("workers", [0, 1])
def test_training_gives_the_same_weights_as_the_per_image_pipeline(tmp_path, monkeypatch, workers):
    _images.write_folder(tmp_path / "data", {"train": 4, "val": 3}, 6, size=24, splits=("train", "val"))
    old = _train_weights(tmp_path, "old", workers, True, monkeypatch)
    new = _train_weights(tmp_path, "new", workers, False, monkeypatch)
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
