"""torchvision:/timm: backbones: random weights saved to a file, extracted from it; the cached rows are
the model's own pre-logits; strict loading; transforms from the model's configuration; nothing
downloads; a clear hint without timm."""

from __future__ import annotations

import socket
import sys

import _images
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from poodle import backbones
from poodle.backbones.external import TIMM_HINT, build_external, eval_transform_spec
from poodle.cache import read_attrs, read_split
from poodle.cli.extract import extract as extract_cmd
from poodle.data.transforms import load_rgb
from poodle.errors import CacheError, CheckpointError, ConfigError
from poodle.extract import extract
from poodle.utils import file_sha256

SIZE = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _images.write_folder(
        tmp_path_factory.mktemp("data"), {"train": 2, "test": 2}, 3, size=48, splits=("train", "test")
    )


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails the test: nothing may be fetched."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _randomise_bn(model):
    for m in model.modules():  # non-trivial statistics, so eval mode matters
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)


def _pre_logits_by_hook(model, layer, x):
    """What ``layer`` (the classifier) receives when ``model`` runs on ``x``: the model's own pre-logits."""
    seen = []
    h = layer.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].flatten(1)))
    with torch.no_grad():
        model(x)
    h.remove()
    return seen[0]


def _images_of(data, split, tf):
    paths = sorted((data / split).rglob("*.png"))
    return paths, torch.stack([tf(load_rgb(p)) for p in paths])


def _check_rows(cache, data, split, tf, reference_fn):
    s = read_split(cache, split)
    rows = {p: i for i, p in enumerate(s.paths)}
    paths, x = _images_of(data, split, tf)
    ref = F.normalize(reference_fn(x).double(), dim=-1)
    got = s.features[[rows[p.relative_to(data).as_posix()] for p in paths]].double()
    cos = (got * ref).sum(-1)
    assert cos.min() >= 0.999, cos
    return s


def test_torchvision_resnet18_cached_rows_are_its_pre_logits(data, tmp_path, no_network):
    import torchvision

    torch.manual_seed(3)
    net = torchvision.models.resnet18(weights=None, num_classes=10)
    _randomise_bn(net)
    net.eval()
    ck = tmp_path / "r18.pth"
    # a DataParallel-style file under "model": both wrappers are looked through
    torch.save({"model": {"module." + k: v for k, v in net.state_dict().items()}, "epoch": 3}, ck)
    path = extract(
        "folder",
        "torchvision:resnet18",
        data_root=data,
        checkpoint=ck,
        image_size=SIZE,
        batch_size=4,
        cache_root=tmp_path / "c",
        workers=0,
        device="cpu",
        splits="train,test",
    )
    assert path.name == "torchvision-resnet18.h5"
    attrs = read_attrs(path)
    assert attrs["backbone"] == "torchvision:resnet18" and attrs["image_size"] == SIZE
    assert attrs["checkpoint_sha256"] == file_sha256(ck)
    assert "center crop 64" in attrs["transform"] and "resize shorter side to 73" in attrs["transform"]
    tf = eval_transform_spec("torchvision:resnet18", image_size=SIZE).build()
    s = _check_rows(path, data, "test", tf, lambda x: _pre_logits_by_hook(net, net.fc, x))
    assert s.dim == 512 and s.norms is not None and (s.norms > 0).all()
    # the classifier is not part of the feature: another head gives the same rows
    assert backbones.build_external("torchvision:resnet18").feature_dim == 512


def test_timm_model_from_safetensors_uses_its_data_config(data, tmp_path, no_network):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file
    from timm.data import create_transform, resolve_data_config

    torch.manual_seed(4)
    net = timm.create_model("test_efficientnet", pretrained=False)  # with its 1000-way classifier
    _randomise_bn(net)
    net.eval()
    ck = tmp_path / "te.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(ck))
    path = extract(
        "folder",
        "timm:test_efficientnet",
        data_root=data,
        checkpoint=ck,
        batch_size=4,
        cache_root=tmp_path / "c",
        workers=0,
        device="cpu",
        splits="test",
    )
    cfg = resolve_data_config({}, model=net)
    attrs = read_attrs(path)
    assert attrs["image_size"] == cfg["input_size"][-1] == 160
    resize = int(160 / cfg["crop_pct"])
    assert "bicubic" in attrs["transform"] and f"resize shorter side to {resize}" in attrs["transform"]
    # the reference goes through timm's own transform and timm's own pre-logits
    tf = create_transform(**cfg, is_training=False)
    with torch.no_grad():
        _check_rows(path, data, "test", tf, lambda x: net.forward_head(net.forward_features(x), pre_logits=True))


def test_timm_vit_at_another_image_size_loads_its_default_size_checkpoint(data, tmp_path):
    timm = pytest.importorskip("timm")

    torch.manual_seed(5)
    net = timm.create_model("test_vit", pretrained=False).eval()  # built for 160 px
    ck = tmp_path / "vit.pth"
    torch.save(net.state_dict(), ck)
    path = extract(
        "folder",
        "timm:test_vit",
        data_root=data,
        checkpoint=ck,
        image_size=64,
        batch_size=8,
        cache_root=tmp_path / "c",
        workers=0,
        device="cpu",
        splits="test",
    )
    assert read_attrs(path)["image_size"] == 64
    ref = timm.create_model("test_vit", pretrained=False, dynamic_img_size=True).eval()
    ref.load_state_dict(net.state_dict())
    tf = eval_transform_spec("timm:test_vit", image_size=64).build()
    with torch.no_grad():
        _check_rows(path, data, "test", tf, lambda x: ref.forward_head(ref.forward_features(x), pre_logits=True))


def test_another_models_state_dict_is_refused_with_the_keys(tmp_path):
    import torchvision

    ck = tmp_path / "r34.pth"
    torch.save(torchvision.models.resnet34(weights=None).state_dict(), ck)
    model = build_external("torchvision:resnet18")
    with pytest.raises(CheckpointError) as e:
        backbones.load_checkpoint(model, ck)
    msg = str(e.value)
    assert "does not fit torchvision:resnet18" in msg and "unexpected keys" in msg and "layer1.2.conv1.weight" in msg
    assert "\n" not in msg
    # shape mismatches are listed too (resnet50's bottlenecks)
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), ck)
    with pytest.raises(CheckpointError, match=r"shape mismatches \(layer1.0.conv1.weight: checkpoint \[64, 64, 1, 1\]"):
        backbones.load_checkpoint(model, ck)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        backbones.load_checkpoint(model, bad)


@pytest.mark.parametrize(
    "name",
    ["mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x0_5", "efficientnet_b0", "regnet_x_400mf", "densenet121"],
)
def test_torchvision_families_give_the_input_of_their_classifier(name):
    import torchvision

    torch.manual_seed(0)
    full = torchvision.models.get_model(name, weights=None).eval()
    ext = build_external(f"torchvision:{name}").eval()
    ext.net.load_state_dict({k: v for k, v in full.state_dict().items() if k in ext.net.state_dict()})
    x = torch.randn(2, 3, 64, 64)
    if name.startswith("squeezenet"):
        layer = full.classifier[1]
        with torch.no_grad():
            feat = ext.forward_features(x)
            # squeezenet's classifier is conv -> ReLU -> pool; the feature is what the conv reads, pooled
            seen = []
            h = layer.register_forward_hook(lambda m, i, o: seen.append(i[0].mean((2, 3))))
            full(x)
            h.remove()
        assert feat.shape == (2, 512)
        assert torch.allclose(feat, F.relu(seen[0]), atol=1e-5)
        return
    layer = [m for m in full.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        assert torch.allclose(ext.forward_features(x), _pre_logits_by_hook(full, layer, x), atol=1e-5)
        assert torch.allclose(layer(ext.forward_features(x)), full(x), atol=1e-4)
    assert ext.feature_dim == layer.in_features


def test_transform_comes_from_the_model_and_options_override_it():
    swin = eval_transform_spec("torchvision:swin_t")
    assert (swin.crop, swin.resize, swin.interpolation) == (224, 232, "bicubic")
    r = eval_transform_spec("torchvision:resnet50", image_size=112)
    assert (r.crop, r.resize, r.interpolation) == (112, 128, "bilinear")
    r = eval_transform_spec("torchvision:resnet50", crop_pct=1.0, interpolation="bicubic")
    assert (r.crop, r.resize, r.interpolation) == (224, 224, "bicubic")
    pytest.importorskip("timm")
    d = eval_transform_spec("timm:vit_small_patch14_dinov2")
    assert (d.crop, d.resize, d.interpolation) == (518, 518, "bicubic")
    c = eval_transform_spec("timm:vit_base_patch16_clip_224")
    assert c.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    with pytest.raises(ConfigError, match="no model 'nope'"):
        eval_transform_spec("timm:nope")
    with pytest.raises(ConfigError, match="no classification model 'nope'"):
        eval_transform_spec("torchvision:nope")


def test_cache_with_another_transform_is_refused_unless_force(data, tmp_path):
    kw = {"data_root": data, "batch_size": 8, "cache_root": tmp_path, "workers": 0, "device": "cpu", "splits": "test"}
    path = extract("folder", "torchvision:mobilenet_v3_small", image_size=32, **kw)
    with pytest.raises(CacheError, match="transform="):
        extract("folder", "torchvision:mobilenet_v3_small", image_size=32, interpolation="bicubic", **kw)
    extract("folder", "torchvision:mobilenet_v3_small", image_size=32, interpolation="bicubic", force=True, **kw)
    assert "bicubic" in read_attrs(path)["transform"]
    with pytest.raises(ConfigError, match="apply to torchvision:/timm: backbones"):
        extract("folder", "conv4_64", crop_pct=0.9, **kw)


def test_a_builder_that_downloads_is_a_clear_error(monkeypatch, no_network):
    import torchvision

    def greedy_builder(**kwargs):
        return torch.hub.load_state_dict_from_url("https://example.invalid/weights.pth")

    monkeypatch.setattr(torchvision.models, "get_model_builder", lambda name: greedy_builder)
    with pytest.raises(ConfigError, match="tries to download weights .*as a checkpoint file"):
        build_external("torchvision:resnet18")
    # the patch is undone afterwards
    assert torch.hub.load_state_dict_from_url.__name__ == "load_state_dict_from_url"


def test_without_timm_the_error_says_how_to_install_it(monkeypatch, data, tmp_path):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm -> ImportError
    monkeypatch.setitem(sys.modules, "timm.data", None)
    with pytest.raises(ConfigError, match=r"pip install 'poodle\[timm\]'"):
        build_external("timm:resnet10t")
    result = CliRunner().invoke(
        extract_cmd,
        [
            "--dataset",
            "folder",
            "--data-root",
            str(data),
            "--backbone",
            "timm:resnet10t",
            "--cache-root",
            str(tmp_path),
            "--workers",
            "0",
        ],
    )
    assert result.exit_code == 1
    assert TIMM_HINT in " ".join(result.output.split()) and result.output.count("error:") == 1
    listing = CliRunner().invoke(extract_cmd, ["--list-backbones"])
    assert listing.exit_code == 0 and "torchvision:NAME" in listing.output and "resnet12" in listing.output
    assert "pip install" in listing.output


def test_list_backbones_names_all_three_sources():
    pytest.importorskip("timm")
    result = CliRunner().invoke(extract_cmd, ["--list-backbones"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for name in ("resnet12", "wrn28_10", "convnext_tiny", "vit_b_16", "vit_small_patch14_dinov2", "test_vit"):
        assert name in text
