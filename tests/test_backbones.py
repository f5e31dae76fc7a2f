"""Backbones: the release's structure (key names and counts, parameter counts, feature sizes),
forward shapes on small inputs, save/load round trips and strict checkpoint loading.

Reference numbers are those of docs/reference.md §4, measured on the authors' code at 84x84.
Counting and 84x84 shape checks run on the meta device (shapes only, no memory, no arithmetic).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from poodle import backbones
from poodle.backbones.heads import ConvBlock
from poodle.backbones.resnet12 import ANNEAL_STEPS, DropBlock
from poodle.errors import CheckpointError, ConfigError

# name: (D, final map side at 84x84, state-dict keys with every head (classifier of 64 classes,
#        further, fc2), params with every head "M", backbone-only params "M", classifier attribute)
FACTS = {
    "resnet12": (640, 5, 106, "16.16", "12.42", "fc"),
    "wrn28_10": (640, 21, 191, "40.21", "36.48", "linear"),
    "conv4_64": (64, 5, 38, "0.15", "0.11", "fc"),
    "conv4_512": (512, 5, 38, "2.77", "0.37", "fc"),
    "densenet121": (1024, 10, 730, "16.52", "6.95", "classifier"),
    "mobilenet": (1024, 6, 172, "12.72", "3.21", "linear"),
    "resnet10": (512, 11, 82, "7.29", "4.90", "fc"),
    "resnet18": (512, 11, 130, "13.56", "11.17", "fc"),
}
NAMES = sorted(FACTS)


def meta_build(name: str, **kw) -> backbones.Backbone:
    with torch.device("meta"):
        return backbones.build(name, **kw)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def small_side(name: str) -> int:
    return max(backbones.BACKBONES[name].min_input_size, 4)


def images(side: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, side, side, generator=g)


# ---- registry ---------------------------------------------------------------------------------


def test_registry_lists_every_backbone():
    assert backbones.available() == NAMES
    for name in NAMES:
        assert backbones.BACKBONES[name].feature_dim == FACTS[name][0]


def test_unknown_backbone_lists_the_known_ones():
    with pytest.raises(ConfigError, match="resnet50") as e:
        backbones.build("resnet50")
    assert all(name in str(e.value) for name in NAMES)


def test_release_arch_name_is_an_alias_and_bad_num_classes_refused():
    assert meta_build("wideres").name == "wrn28_10"
    with pytest.raises(ConfigError, match="num_classes"):
        backbones.build("conv4_64", num_classes=-1)


# ---- structure as in the release -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_structure_matches_release(name):
    dim, side84, n_keys, total, bare, cls = FACTS[name]
    full = meta_build(name, num_classes=64, rotation_head=True)
    bare_model = meta_build(name)
    assert full.feature_dim == bare_model.feature_dim == dim
    assert len(full.state_dict()) == n_keys
    # The heads add exactly: classifier weight/bias, further conv + 5 BN entries, fc2 weight/bias.
    assert len(full.state_dict()) - len(bare_model.state_dict()) == 10
    assert f"{n_params(bare_model) / 1e6:.2f}" == bare
    if name == "densenet121":
        # The release's fc2 is Linear(1024, num_classes) (a bug); ours has 4 outputs.
        assert f"{(n_params(full) + (64 - 4) * (1024 + 1)) / 1e6:.2f}" == total
    else:
        assert f"{n_params(full) / 1e6:.2f}" == total
    assert full.classifier_name == cls and isinstance(getattr(full, cls), nn.Linear)
    assert bare_model.class_head is None and bare_model.further is None and bare_model.fc2 is None
    fmap = full.forward_map(torch.empty(2, 3, 84, 84, device="meta"))
    assert tuple(fmap.shape) == (2, dim, side84, side84)
    assert tuple(full.fc2.weight.shape) == (4, dim)


def test_resnet12_without_classifier_has_104_keys_in_release_order():
    keys = list(meta_build("resnet12", rotation_head=True).state_dict())
    assert len(keys) == 104
    keys = list(meta_build("resnet12", num_classes=64, rotation_head=True).state_dict())
    assert keys[:3] == ["layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.bn1.bias"]
    assert keys[-10:] == ["further.layers.Conv.weight"] + [
        f"further.layers.BatchNorm.{s}"
        for s in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    ] + ["fc2.weight", "fc2.bias", "fc.weight", "fc.bias"]
    # ConvNet and DenseNet list the classifier before the rotation head.
    assert list(meta_build("conv4_64", num_classes=5, rotation_head=True).state_dict())[28:31] == [
        "fc.weight",
        "fc.bias",
        "further.layers.Conv.weight",
    ]


@pytest.mark.parametrize(
    "name, present, absent",
    [
        (
            "resnet12",
            [
                "layer1.0.downsample.0.weight",
                "layer4.0.downsample.1.running_var",
                "layer3.0.conv3.weight",
                "further.layers.Conv.weight",
                "further.layers.BatchNorm.num_batches_tracked",
                "fc2.bias",
                "fc.weight",
            ],
            ["conv1.weight", "layer1.1.conv1.weight"],
        ),
        (
            "conv4_64",
            ["encoder.0.0.weight", "encoder.0.0.bias", "encoder.3.1.running_mean", "fc.bias"],
            ["encoder.4.0.weight"],
        ),
        (
            "wrn28_10",
            ["conv1.bias", "layer1.0.shortcut.0.weight", "layer3.3.conv2.bias", "bn1.running_var", "linear.weight"],
            ["layer1.1.shortcut.0.weight", "layer4.0.conv1.weight"],
        ),
        (
            "densenet121",
            [
                "features.conv0.weight",
                "features.denseblock1.denselayer1.norm1.weight",
                "features.denseblock4.denselayer16.conv2.weight",
                "features.transition3.conv.weight",
                "features.norm5.bias",
                "classifier.weight",
            ],
            ["features.norm0.weight", "features.denseblock1.denselayer7.conv1.weight"],
        ),
        (
            "mobilenet",
            ["conv1.weight", "bn1.bias", "layers.0.conv1.weight", "layers.12.bn2.weight", "linear.bias"],
            ["layers.13.conv1.weight", "conv1.bias"],
        ),
        (
            "resnet10",
            ["conv1.weight", "layer2.0.downsample.0.weight", "layer4.0.bn2.weight"],
            ["layer1.0.downsample.0.weight", "layer1.1.conv1.weight"],
        ),
        (
            "resnet18",
            ["layer1.1.conv2.weight", "layer4.0.downsample.1.weight", "fc.weight"],
            ["layer1.0.downsample.0.weight", "layer2.1.downsample.0.weight"],
        ),
    ],
)
def test_known_release_keys(name, present, absent):
    sd = meta_build(name, num_classes=64, rotation_head=True).state_dict()
    assert set(present) <= set(sd)
    assert not set(absent) & set(sd)


def test_wrn_final_bn_momentum_and_conv_biases_as_release():
    m = meta_build("wrn28_10")
    assert m.bn1.momentum == 0.9 and m.layer1[0].bn1.momentum == 0.1
    assert m.layer2[1].shortcut is None and m.layer2[0].conv2.stride == (2, 2)


@pytest.mark.parametrize("name", NAMES)
def test_smallest_input_accepted_and_smaller_refused(name):
    m = meta_build(name, num_classes=3, rotation_head=True).eval()
    side = backbones.BACKBONES[name].min_input_size
    logits, rot = m(torch.empty(1, 3, side, side, device="meta"))
    assert tuple(logits.shape) == (1, 3) and tuple(rot.shape) == (1, 4)
    if side > 1:
        with pytest.raises(ConfigError, match=f"at least {side}x{side}"):
            m.forward_features(torch.empty(1, 3, side - 1, side - 1, device="meta"))
    with pytest.raises(ConfigError, match=r"\[B, 3, H, W\]"):
        m.forward_features(torch.empty(1, 1, 32, 32, device="meta"))


# ---- real forward passes and round trips -----------------------------------------------------

# The heads are the same code on every backbone; the two largest networks skip the rotation head
# here to keep the file fast (their heads are covered by the structure tests).
BIG = {"densenet121", "wrn28_10"}


@pytest.mark.parametrize("name", NAMES)
def test_saved_checkpoint_reloads_with_identical_features(name, tmp_path):
    dim = FACTS[name][0]
    side = small_side(name)
    x = images(side)
    heads = name not in BIG
    src = backbones.build(name, num_classes=5, rotation_head=heads)
    src.train()
    logits, rot = src(x)  # moves the BN running statistics away from their initial values
    assert logits.shape == (2, 5) and (rot.shape == (2, 4) if heads else rot is None)
    src.eval()
    with torch.no_grad():
        feats = src.forward_features(x)
        logits, rot = src(x)
    assert feats.shape == (2, dim) and feats.dtype == torch.float32 and torch.isfinite(feats).all()

    path = backbones.save_checkpoint(src, tmp_path / "ckpt.pth.tar", epoch=7)
    stored = torch.load(path, weights_only=True)
    assert stored["arch"] == name and stored["epoch"] == 7
    assert all(k.startswith("module.") for k in stored["state_dict"])
    assert len(stored["state_dict"]) == len(src.state_dict())

    fresh = backbones.build(name, num_classes=5, rotation_head=heads).eval()
    with torch.no_grad():
        assert not torch.equal(fresh.forward_features(x), feats)
        sha = backbones.load_checkpoint(fresh, path)
        assert torch.equal(fresh.forward_features(x), feats)
        logits2, rot2 = fresh(x)
    assert torch.equal(logits2, logits) and (torch.equal(rot2, rot) if heads else rot2 is None)
    assert len(sha) == 64 and not (tmp_path / "ckpt.pth.tar.partial").exists()
    if not heads:
        return
    # A feature extractor without heads takes the same file and gives the same features.
    bare = backbones.build(name).eval()
    backbones.load_checkpoint(bare, path)
    with torch.no_grad():
        assert torch.equal(bare.forward_features(x), feats)
        assert bare(x) == (None, None)


def test_conv4_rotation_head_works_on_a_1x1_map():
    m = backbones.build("conv4_64", num_classes=5, rotation_head=True).eval()
    x = images(28)
    with torch.no_grad():
        assert m.forward_map(x).shape == (2, 64, 1, 1)
        logits, rot = m(x)
    assert logits.shape == (2, 5) and rot.shape == (2, 4)
    block = ConvBlock(4, 4).eval()
    assert block(torch.randn(1, 4, 1, 1)).shape == (1, 4, 1, 1)
    assert block(torch.randn(1, 4, 5, 5)).shape == (1, 4, 2, 2)


def test_resnet12_features_can_be_negative_and_others_not():
    x = images(16)
    with torch.no_grad():
        assert backbones.build("resnet12").eval().forward_features(x).min() < 0
        assert backbones.build("conv4_64").eval().forward_features(x).min() >= 0


# ---- ResNet-12 regularisation ----------------------------------------------------------------


def test_resnet12_dropout_and_dropblock_only_in_training():
    m = backbones.build("resnet12")
    x = images(16)
    with torch.no_grad():
        m.eval()
        a, b = m.forward_features(x), m.forward_features(x)
        assert torch.equal(a, b)
        m.train()
        c, d = m.forward_features(x), m.forward_features(x)
        assert not torch.equal(c, d)
    # The annealing counter counts training forwards only and is not in the state dict.
    steps = [m.layer3[0].dropblock_step, m.layer4[0].dropblock_step]
    assert steps == [2, 2] and m.layer1[0].dropblock_step == 0
    assert not any("dropblock" in k for k in m.state_dict())


def test_dropblock_gamma_anneals_to_release_value():
    block = backbones.build("resnet12").layer4[0]
    assert block.dropblock_gamma(5, 5) == 0.0
    block.dropblock_step = ANNEAL_STEPS // 2
    assert block.dropblock_gamma(10, 10) == pytest.approx(0.05 / 25 * 100 / 36)
    block.dropblock_step = 10 * ANNEAL_STEPS
    # keep rate floors at 0.9; on a 5x5 map gamma = 0.1 / 25 * 25 / 1.
    assert block.dropblock_gamma(5, 5) == pytest.approx(0.1)


def test_dropblock_drops_whole_squares_and_rescales():
    drop = DropBlock(5).train()
    x = torch.ones(4, 8, 12, 12)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        y = drop(x, gamma=0.02)
        ch = drop(torch.ones(4, 8, 5, 5), gamma=0.3)
    zero = y == 0
    assert zero.any() and (~zero).any()
    kept = y[~zero]
    assert torch.allclose(kept, torch.full_like(kept, y.numel() / (~zero).sum().item()))
    # Every dropped pixel lies in a 5x5 square that is dropped entirely.
    covered = -nn.functional.max_pool2d(-zero.float(), 5, stride=1)  # all-zero 5x5 windows
    grown = nn.functional.max_pool2d(nn.functional.pad(covered, (4, 4, 4, 4)), 5, stride=1)
    assert torch.equal(grown.bool(), zero)
    # On a 5x5 map (layer 4 at 84x84) a block is the whole map: channels are dropped whole.
    per_channel = ch.flatten(2)
    assert torch.all(per_channel.amax(2) == per_channel.amin(2))
    assert drop.eval()(x, gamma=0.5) is x


# ---- strict checkpoint loading ---------------------------------------------------------------


@pytest.fixture(scope="module")
def conv4_state() -> dict[str, torch.Tensor]:
    m = backbones.build("conv4_64", num_classes=64, rotation_head=True)
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("prefix", ["", "module."])
@pytest.mark.parametrize("wrapped", [False, True])
def test_load_bare_or_wrapped_with_or_without_prefix(conv4_state, tmp_path, prefix, wrapped):
    sd = {prefix + k: v for k, v in conv4_state.items()}
    torch.save({"state_dict": sd, "arch": "conv4_64", "epoch": 3} if wrapped else sd, tmp_path / "c.pth")
    for kw in ({"num_classes": 64, "rotation_head": True}, {"num_classes": 64}, {}):
        model = backbones.build("conv4_64", **kw)
        backbones.load_checkpoint(model, tmp_path / "c.pth")
        assert _same_weights(model, conv4_state)


def test_remap_strips_prefix_and_drops_absent_heads(conv4_state):
    model = backbones.build("conv4_64", rotation_head=True)
    sd = backbones.remap_state_dict(model, {"module." + k: v for k, v in conv4_state.items()})
    assert set(sd) == set(model.state_dict())
    assert "fc.weight" not in sd and "further.layers.Conv.weight" in sd


def test_heads_the_model_has_are_required(conv4_state, tmp_path):
    sd = {k: v for k, v in conv4_state.items() if not k.startswith(("fc.", "further.", "fc2."))}
    torch.save(sd, tmp_path / "bare.pth")
    backbones.load_checkpoint(backbones.build("conv4_64"), tmp_path / "bare.pth")
    with pytest.raises(CheckpointError) as e:
        backbones.load_checkpoint(
            backbones.build("conv4_64", num_classes=64, rotation_head=True), tmp_path / "bare.pth"
        )
    msg = str(e.value)
    assert "bare.pth" in msg and "10 missing keys" in msg and "further.layers.Conv.weight" in msg


def test_unexpected_keys_and_shape_mismatches_are_listed(conv4_state, tmp_path):
    sd = dict(conv4_state, **{"encoder.4.0.weight": torch.zeros(3)})
    torch.save(sd, tmp_path / "extra.pth")
    with pytest.raises(CheckpointError, match=r"1 unexpected keys \(encoder\.4\.0\.weight\)"):
        backbones.load_checkpoint(backbones.build("conv4_64", num_classes=64), tmp_path / "extra.pth")
    torch.save(conv4_state, tmp_path / "c.pth")
    model = backbones.build("conv4_64", num_classes=100)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        backbones.load_checkpoint(model, tmp_path / "c.pth")
    assert "fc.weight: checkpoint [64, 64], model [100, 64]" in str(e.value)
    assert "num_classes=64" in str(e.value)
    assert _same_weights(model, before)  # nothing was half-loaded


def test_checkpoint_of_another_architecture_is_refused_with_a_guess(conv4_state, tmp_path):
    torch.save({"state_dict": {"module." + k: v for k, v in conv4_state.items()}}, tmp_path / "c.pth")
    with pytest.raises(CheckpointError) as e:
        backbones.load_checkpoint(backbones.build("resnet12"), tmp_path / "c.pth")
    msg = str(e.value)
    assert "does not fit resnet12" in msg and "96 missing keys (layer1.0.conv1.weight" in msg
    assert "28 unexpected keys (encoder.0.0.weight" in msg
    assert msg.endswith("it looks like a conv4_64 checkpoint")
    # Same key names, other widths: the shapes tell conv4_512 from conv4_64.
    other = backbones.build("conv4_512").state_dict()
    with pytest.raises(
        CheckpointError, match="encoder.3.0.weight: checkpoint \\[512, 64, 3, 3\\].*looks like a conv4_512 checkpoint"
    ):
        backbones.load_state_dict_strict(backbones.build("conv4_64"), other)
    assert backbones.guess_architecture(meta_build("resnet18").state_dict()) == ("resnet18", True)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"definitely not a checkpoint", "is not a torch checkpoint"),
        (b"", "is not a torch checkpoint"),
        (pickle.dumps({"state_dict": {}}), "is not a torch checkpoint"),
        (None, "refuses to unpickle"),
    ],
)
def test_garbage_files_are_refused_naming_the_file(tmp_path, content, match):
    path = tmp_path / "bad.pth"
    if content is None:  # a real torch file, but with a pickled object weights_only must refuse
        torch.save({"state_dict": {}, "config": ConfigError("x")}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match) as e:
        backbones.load_checkpoint(backbones.build("conv4_64"), path)
    assert str(path) in str(e.value)


def test_files_without_a_state_dict_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        backbones.load_checkpoint(backbones.build("conv4_64"), tmp_path / "missing.pth")
    torch.save({"epoch": 3, "arch": "conv4_64"}, tmp_path / "meta.pth")
    with pytest.raises(CheckpointError, match="not a state dict"):
        backbones.load_checkpoint(backbones.build("conv4_64"), tmp_path / "meta.pth")
    torch.save({"state_dict": {"encoder.0.0.weight": [1, 2]}}, tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="encoder.0.0.weight"):
        backbones.load_checkpoint(backbones.build("conv4_64"), tmp_path / "list.pth")


def test_densenet_release_fc2_keeps_its_four_rotation_rows(tmp_path):
    src = meta_build("densenet121", num_classes=64, rotation_head=True)
    g = torch.Generator().manual_seed(0)
    sd = {
        k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else torch.zeros((), dtype=v.dtype))
        for k, v in src.state_dict().items()
    }
    sd["fc2.weight"], sd["fc2.bias"] = torch.randn(64, 1024, generator=g), torch.randn(64, generator=g)
    model = backbones.build("densenet121", num_classes=64, rotation_head=True)
    backbones.load_state_dict_strict(model, {"module." + k: v for k, v in sd.items()})
    assert torch.equal(model.fc2.weight, sd["fc2.weight"][:4])
    assert torch.equal(model.fc2.bias, sd["fc2.bias"][:4])


def test_old_checkpoints_without_bn_counters_load(conv4_state):
    sd = {k: v for k, v in conv4_state.items() if not k.endswith("num_batches_tracked")}
    model = backbones.build("conv4_64", num_classes=64, rotation_head=True)
    backbones.load_state_dict_strict(model, sd)
    assert torch.equal(model.encoder[0][0].weight, conv4_state["encoder.0.0.weight"])


def test_save_checkpoint_looks_through_dataparallel_and_guards_its_keys(tmp_path):
    model = backbones.build("conv4_64")
    wrapper = nn.Module()
    wrapper.module = model
    backbones.save_checkpoint(wrapper, tmp_path / "w.pth")
    keys = list(torch.load(tmp_path / "w.pth", weights_only=True)["state_dict"])
    assert keys[0] == "module.encoder.0.0.weight"
    with pytest.raises(ConfigError, match="arch"):
        backbones.save_checkpoint(model, tmp_path / "x.pth", arch="other")
