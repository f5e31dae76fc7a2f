"""Pretrained weights the way timm and torchvision ship them (poodle.backbones.pretrained), and
checkpoints in their original layouts (DINOv2, OpenAI CLIP, open_clip) converted by timm's filters.

Nothing here touches the network: the Hugging Face and torch hub caches are fabricated under a
temporary HF_HOME / TORCH_HOME (random weights saved in the hubs' layouts), HF_HUB_OFFLINE is set and
torch hub's download function raises as it does without a connection."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest
import torch

from poodle.backbones import build_external, load_state_dict_strict
from poodle.backbones.pretrained import resolve_pretrained
from poodle.errors import CheckpointError, ConfigError
from poodle.utils import file_sha256

timm = pytest.importorskip("timm")

TIMM_MODEL = "test_vit.r160_in1k"  # 0.3M parameters; timm's weights live in hub repository timm/<name>
TV_MODEL = "mobilenet_v3_small"  # torchvision's default weights: MobileNet_V3_Small_Weights.IMAGENET1K_V1
TV_FILE = "mobilenet_v3_small-047dcff4.pth"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _offline(*args, **kwargs):
    raise urllib.error.URLError("no network in the tests")


@pytest.fixture
def hubs(tmp_path, monkeypatch):
    """Empty hub caches under tmp_path, downloads impossible: ``(HF_HOME, TORCH_HOME)``."""
    hf, th = tmp_path / "hf", tmp_path / "torch"
    monkeypatch.setenv("HF_HOME", str(hf))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_HOME", str(th))
    monkeypatch.setattr(torch.hub, "download_url_to_file", _offline)
    return hf, th


def hub_file(hf_home: Path, repo: str, filename: str, state: dict, commit: str = COMMIT) -> Path:
    """``state`` saved as the Hugging Face hub cache keeps a downloaded file: the snapshot of ``commit``
    holds it, ``refs/main`` names the commit."""
    folder = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    path = folder / "snapshots" / commit / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def random_weights(model: str, source: str = "timm", seed: int = 1) -> dict[str, torch.Tensor]:
    """The state dict of the library's own model with its classifier, as its pretrained file holds it."""
    torch.manual_seed(seed)
    if source == "timm":
        net = timm.create_model(model, pretrained=False)
    else:
        import torchvision

        net = torchvision.models.get_model(model, weights=None)
    return {k: v.clone() for k, v in net.state_dict().items()}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ------------------------------------------------------------------------------------------ resolution


def test_timm_weights_come_from_the_hub_cache_with_their_provenance(hubs):
    hf, _ = hubs
    path = hub_file(hf, f"timm/{TIMM_MODEL}", "pytorch_model.bin", random_weights("test_vit"))
    for name in (f"timm:{TIMM_MODEL}", "timm:test_vit"):  # without a tag: timm's default tag
        w = resolve_pretrained(name, True)
        assert w.path == path
        assert w.origin == {
            "weights": f"timm:{TIMM_MODEL}",
            "weights_source": "hf-hub",
            "weights_repository": f"timm/{TIMM_MODEL}",
            "weights_revision": COMMIT,
            "weights_file": "pytorch_model.bin",
        }


def test_torchvision_weights_come_from_the_torch_hub_cache(hubs):
    _, th = hubs
    path = th / "hub" / "checkpoints" / TV_FILE
    path.parent.mkdir(parents=True)
    torch.save(random_weights(TV_MODEL, "torchvision"), path)
    for choice in (True, "DEFAULT", "IMAGENET1K_V1", "MobileNet_V3_Small_Weights.IMAGENET1K_V1"):
        w = resolve_pretrained(f"torchvision:{TV_MODEL}", choice)
        assert w.path == path
        assert w.origin["weights"] == "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
        assert w.origin["weights_url"].endswith("/" + TV_FILE)
    with pytest.raises(ConfigError, match=r"pretrained 'IMAGENET1K_V9': MobileNet_V3_Small_Weights has IMAGENET1K_V1"):
        resolve_pretrained(f"torchvision:{TV_MODEL}", "IMAGENET1K_V9")


def test_weights_neither_cached_nor_downloadable_are_one_line_and_leave_the_caches_alone(hubs):
    hf, th = hubs
    with pytest.raises(ConfigError) as e:
        resolve_pretrained(f"timm:{TIMM_MODEL}", True)
    msg = str(e.value)
    assert "\n" not in msg and e.value.params == ("pretrained", "checkpoint")
    assert msg.startswith(f"timm:{TIMM_MODEL} with pretrained: model.safetensors or pytorch_model.bin of Hugging Face")
    assert f"repository timm/{TIMM_MODEL} is not in the hub cache {hf / 'hub'} (HF_HOME)" in msg
    assert "downloads are off (HF_HUB_OFFLINE) (where there is network, `hf download" in msg
    assert f"`hf download timm/{TIMM_MODEL} model.safetensors` with the same HF_HOME puts it there" in msg
    with pytest.raises(ConfigError) as e:
        resolve_pretrained(f"torchvision:{TV_MODEL}", True)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"torchvision:{TV_MODEL} with pretrained MobileNet_V3_Small_Weights.IMAGENET1K_V1: {TV_FILE} is not in "
        f"torch hub's cache {th / 'hub' / 'checkpoints'} (TORCH_HOME) and cannot be downloaded from https://"
    )
    assert "URLError" in msg and msg.endswith("(put the file there, or give a checkpoint FILE)")
    assert _files(hf) == [] and _files(th) == []


def test_pretrained_is_for_external_backbones_and_timm_tags_go_in_the_name(hubs):
    with pytest.raises(ConfigError, match="pretrained is for timm:NAME and torchvision:NAME backbones, not conv4_64"):
        resolve_pretrained("conv4_64", True)
    with pytest.raises(ConfigError, match=r"chosen by the tag in its name \(timm:NAME.TAG"):
        resolve_pretrained("timm:test_vit", "r160_in1k")
    with pytest.raises(ConfigError, match="timm has no model 'no_such_net'"):
        resolve_pretrained("timm:no_such_net", True)


# ------------------------------------------------------------------------------------------ original layouts


def _truth(net: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random values for every entry of ``net``'s state dict: the weights an original file holds."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in net.state_dict().items()}


def _assert_loaded(net: torch.nn.Module, truth: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    got = net.state_dict()
    assert got.keys() == truth.keys()
    for k, v in truth.items():
        assert torch.allclose(got[k], v, rtol=0, atol=atol), k


def test_dinov2_as_facebookresearch_releases_it_loads_into_the_timm_model():
    model = build_external("timm:vit_small_patch14_dinov2", image_size=28)
    truth = _truth(model.net, 0)
    # the release's dinov2_vits14_pretrain.pth: the same keys as timm's model plus the masking token
    release = {**{k: v.clone() for k, v in truth.items()}, "mask_token": torch.randn(1, 384)}
    load_state_dict_strict(model, release, source="dinov2_vits14_pretrain.pth")
    _assert_loaded(model.net, truth)
    release["blocks.0.ls1.scale"] = torch.ones(384)  # anything left over is named
    with pytest.raises(CheckpointError, match=r"1 unexpected keys \(blocks\.0\.ls1\.scale\)"):
        load_state_dict_strict(model, release, source="dinov2_vits14_pretrain.pth")


def test_dinov2_with_registers_as_released_loads_into_the_timm_model():
    model = build_external("timm:vit_small_patch14_reg4_dinov2", image_size=28)
    truth = _truth(model.net, 1)
    # the release keeps the class token's position in pos_embed; timm folds it into cls_token
    pos0 = torch.randn(1, 1, 384)
    release = {k: v.clone() for k, v in truth.items() if k not in ("reg_token", "cls_token", "pos_embed")}
    release["register_tokens"] = truth["reg_token"].clone()
    release["cls_token"] = truth["cls_token"] - pos0
    release["pos_embed"] = torch.cat([pos0, truth["pos_embed"]], 1)
    release["mask_token"] = torch.randn(1, 384)
    load_state_dict_strict(model, release, source="dinov2_vits14_reg4_pretrain.pth")
    _assert_loaded(model.net, truth, atol=1e-6)


def _openai_visual(truth: dict[str, torch.Tensor], proj: torch.Tensor) -> dict[str, torch.Tensor]:
    """OpenAI CLIP's image tower keys (``model.visual`` of github.com/openai/CLIP) for timm's values."""
    out = {
        "conv1.weight": truth["patch_embed.proj.weight"],
        "class_embedding": truth["cls_token"][0, 0],
        "positional_embedding": truth["pos_embed"][0],
        "ln_pre.weight": truth["norm_pre.weight"],
        "ln_pre.bias": truth["norm_pre.bias"],
        "ln_post.weight": truth["norm.weight"],
        "ln_post.bias": truth["norm.bias"],
        "proj": proj,
    }
    names = {
        "norm1": "ln_1",
        "attn.qkv.weight": "attn.in_proj_weight",
        "attn.qkv.bias": "attn.in_proj_bias",
        "attn.proj": "attn.out_proj",
        "norm2": "ln_2",
        "mlp.fc1": "mlp.c_fc",
        "mlp.fc2": "mlp.c_proj",
    }
    for k, v in truth.items():
        if k.startswith("blocks."):
            _, i, rest = k.split(".", 2)
            for a, b in names.items():
                if rest.startswith(a):
                    rest = b + rest[len(a) :]
                    break
            out[f"transformer.resblocks.{i}.{rest}"] = v
    return {k: v.clone() for k, v in out.items()}


def test_openai_clip_and_open_clip_image_towers_load_into_the_timm_model():
    model = build_external("timm:vit_xsmall_patch16_clip_224")
    truth = _truth(model.net, 2)
    visual = _openai_visual(truth, proj=torch.randn(256, 512))
    assert len(visual) == len(truth) + 1
    # the whole CLIP model as OpenAI's (and open_clip's) files hold it: the text tower is not the image's
    text = {
        "positional_embedding": torch.randn(77, 64),
        "token_embedding.weight": torch.randn(100, 64),
        "transformer.resblocks.0.attn.in_proj_weight": torch.randn(192, 64),
        "ln_final.weight": torch.ones(64),
        "text_projection": torch.randn(64, 512),
        "logit_scale": torch.tensor(4.6),
    }
    full = {**{f"visual.{k}": v for k, v in visual.items()}, **text}
    load_state_dict_strict(model, full, source="ViT-B-16.pt")
    _assert_loaded(model.net, truth)
    # an open_clip image tower saved alone (model.visual.state_dict()), under DataParallel's prefix too
    other = _truth(model.net, 3)
    tower = {f"module.{k}": v for k, v in _openai_visual(other, proj=torch.randn(256, 512)).items()}
    load_state_dict_strict(model, tower, source="visual.pt")
    _assert_loaded(model.net, other)
    # still strict: what the conversion leaves unmatched is listed
    del full["visual.ln_post.weight"]
    full["visual.transformer.resblocks.0.attn.extra"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as e:
        load_state_dict_strict(model, full, source="ViT-B-16.pt")
    msg = str(e.value)
    assert "ViT-B-16.pt does not fit timm:vit_xsmall_patch16_clip_224: 1 missing keys (norm.weight)" in msg
    assert "1 unexpected keys (blocks.0.attn.extra)" in msg


def test_a_checkpoint_in_timms_layout_is_loaded_as_it_is(hubs):
    hf, _ = hubs
    state = random_weights("test_vit")
    path = hub_file(hf, f"timm/{TIMM_MODEL}", "pytorch_model.bin", state)
    model = build_external(f"timm:{TIMM_MODEL}")
    sha = file_sha256(path)
    from poodle.backbones import load_checkpoint

    assert load_checkpoint(model, resolve_pretrained(f"timm:{TIMM_MODEL}").path) == sha
    _assert_loaded(model.net, {k: v for k, v in state.items() if not k.startswith("head.")})


# ------------------------------------------------------------------------------------------ the command line


def _extract(*args: object):
    from click.testing import CliRunner

    from poodle.cli.main import cli

    common = [
        "--dataset",
        "folder",
        "--splits",
        "train,test",
        "--image-size",
        32,
        "--workers",
        0,
        "--device",
        "cpu",
        "--batch-size",
        8,
    ]
    res = CliRunner().invoke(cli, ["extract", *map(str, common), *map(str, args)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    import _images

    return _images.write_folder(
        tmp_path_factory.mktemp("img"), {"train": 2, "test": 2}, 3, size=32, splits=("train", "test")
    )


@pytest.mark.parametrize(
    "backbone,choice",
    [(f"timm:{TIMM_MODEL}", []), (f"torchvision:{TV_MODEL}", ["IMAGENET1K_V1"])],
)
def test_features_with_pretrained_equal_those_with_the_checkpoint_of_that_file(
    hubs, tmp_path, images, backbone, choice
):
    from poodle import cache

    hf, th = hubs
    if backbone.startswith("timm:"):
        path = hub_file(hf, f"timm/{TIMM_MODEL}", "pytorch_model.bin", random_weights("test_vit"))
    else:
        path = th / "hub" / "checkpoints" / TV_FILE
        path.parent.mkdir(parents=True)
        torch.save(random_weights(TV_MODEL, "torchvision"), path)
    data = ["--data-root", images, "--backbone", backbone]
    code, out = _extract(*data, "--pretrained", *choice, "--cache-root", tmp_path / "a")
    assert code == 0, out
    code, out = _extract(*data, "--checkpoint", path, "--cache-root", tmp_path / "b")
    assert code == 0, out
    stem = backbone.replace(":", "-")
    a, b = tmp_path / "a" / "folder" / f"{stem}.h5", tmp_path / "b" / "folder" / f"{stem}.h5"
    for split in ("train", "test"):
        assert torch.equal(cache.read_split(a, split).features, cache.read_split(b, split).features)
    attrs = cache.read_attrs(a)
    assert attrs["checkpoint_sha256"] == cache.read_attrs(b)["checkpoint_sha256"] == file_sha256(path)
    if backbone.startswith("timm:"):
        assert attrs["weights_source"] == "hf-hub" and attrs["weights_repository"] == f"timm/{TIMM_MODEL}"
        assert attrs["weights_revision"] == COMMIT and attrs["weights_file"] == "pytorch_model.bin"
        # the hub's cache now holds other weights under a new revision: they are not mixed into the cache
        hub_file(hf, f"timm/{TIMM_MODEL}", "pytorch_model.bin", random_weights("test_vit", seed=2), commit="f" * 40)
        code, out = _extract(*data, "--pretrained", "--cache-root", tmp_path / "a")
        assert code == 1 and f"{a} holds features made with checkpoint_sha256=" in " ".join(out.split())
    else:
        assert attrs["weights"] == "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
        assert attrs["weights_source"] == "torchvision" and attrs["weights_url"].endswith(TV_FILE)
    assert "weights_source" not in cache.read_attrs(b)


def test_pretrained_weights_nowhere_to_be_found_are_one_line_and_write_nothing(hubs, tmp_path, images):
    for backbone in (f"timm:{TIMM_MODEL}", f"torchvision:{TV_MODEL}"):
        code, out = _extract("--data-root", images, "--backbone", backbone, "--pretrained", "--cache-root", tmp_path)
        assert code == 1 and out.startswith(f"error: {backbone}") and out.count("\n") == 1, out
        assert "--pretrained" in out and "--checkpoint FILE" in out and "Traceback" not in out
    assert _files(tmp_path / "hf") == [] and _files(tmp_path / "torch") == []
    assert not list(tmp_path.rglob("*.h5")) and not list(tmp_path.rglob("*.partial"))
    code, out = _extract("--data-root", images, "--backbone", "timm:test_vit", "--cache-root", tmp_path)
    assert code == 1 and out.startswith("error: which weights for timm:test_vit? give --pretrained")
    code, out = _extract("--data-root", images, "--backbone", "conv4_64", "--pretrained", "--cache-root", tmp_path)
    assert code == 1 and "--pretrained is for timm:NAME and torchvision:NAME backbones, not conv4_64" in out


def test_predict_takes_pretrained_weights_too(hubs, tmp_path):
    import _images
    from click.testing import CliRunner

    from poodle.cli.main import cli

    _, th = hubs
    path = th / "hub" / "checkpoints" / TV_FILE
    path.parent.mkdir(parents=True)
    torch.save(random_weights(TV_MODEL, "torchvision"), path)
    root = _images.write_folder(tmp_path / "task", {"support": 3, "query": 3}, 3, size=32, splits=("support", "query"))
    args = [
        "predict",
        "--support",
        root / "support",
        "--query",
        root / "query",
        "--backbone",
        f"torchvision:{TV_MODEL}",
    ]
    args += ["--pretrained", "--image-size", 32, "--method", "proto", "--out", tmp_path / "p.csv", "--device", "cpu"]
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 1 + 9
