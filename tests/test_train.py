"""`poodle train`: the losses, the lr schedule, each recipe learning, checkpoints that `poodle
extract` loads, and exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import _images
import pytest
import torch
import torch.nn.functional as F

from poodle.errors import ConfigError
from poodle.train import TrainConfig, train
from poodle.train.config import config_differences
from poodle.train.losses import distill_kl, rotate_all, smooth_cross_entropy

SIZE = 16  # conv4's smallest input: 16 -> 8 -> 4 -> 2 -> 1


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    """4 base classes of 8 images, 3 val and 3 test classes of 6 (tiny, distinct by colour/shape)."""
    root = tmp_path_factory.mktemp("images")
    return _images.write_folder(root, {"train": 4, "val": 3, "test": 3}, 8, size=SIZE)


def _cfg(root: Path, tmp: Path, **kw) -> TrainConfig:
    opts = dict(
        dataset="folder",
        data_root=str(root),
        backbone="conv4_64",
        recipe="simple",
        epochs=4,
        batch_size=8,
        lr=0.05,
        image_size=SIZE,
        augment="none",
        val_every=2,
        val_episodes=20,
        val_way=3,
        val_shot=1,
        val_query=2,
        workers=0,
        device="cpu",
        cache_root=str(tmp / "cache"),
        out=str(tmp / "run"),
    )
    opts.update(kw)
    return TrainConfig(**opts)


# ---- losses ------------------------------------------------------------------------------------


def test_smooth_cross_entropy_is_the_release_kl_to_a_smoothed_target():
    torch.manual_seed(0)
    logits, target, eps = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 4, 2, 2, 1, 3]), 0.1
    q = torch.full((6, 5), eps / 4, dtype=torch.float64)
    q[torch.arange(6), target] = 1 - eps
    expected = (q * (q.log() - logits.log_softmax(1))).sum(1).mean()
    assert torch.allclose(smooth_cross_entropy(logits, target, eps).double(), expected, atol=1e-6)
    # its gradient is that of cross-entropy against the smoothed target
    a = logits.clone().float().requires_grad_(True)
    smooth_cross_entropy(a, target, eps).backward()
    b = logits.clone().float().requires_grad_(True)
    (-(q.float() * b.log_softmax(1)).sum(1).mean()).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert torch.allclose(smooth_cross_entropy(logits, target, 0.0).double(), F.cross_entropy(logits, target))


def test_distill_kl_is_t_squared_kl_and_zero_for_identical_logits():
    torch.manual_seed(1)
    s, t = torch.randn(4, 7), torch.randn(4, 7)
    p_t, p_s = (t / 4).softmax(1), (s / 4).softmax(1)
    expected = 16 * (p_t * (p_t.log() - p_s.log())).sum(1).mean()
    assert torch.allclose(distill_kl(s, t, 4.0), expected, atol=1e-5)
    assert distill_kl(t, t, 4.0).abs() < 1e-6


def test_rotate_all_is_rotation_major_with_labels():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    r, labels = rotate_all(x)
    assert r.shape == (8, 3, 4, 4)
    assert labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(r[:2], x)
    assert torch.equal(r[2:4], torch.rot90(x, 1, (2, 3)))
    assert torch.equal(r[6:8], torch.rot90(x, 3, (2, 3)))


# ---- configuration -------------------------------------------------------------------------------


def test_lr_decays_at_the_milestone_epoch_not_one_late():
    cfg = TrainConfig(dataset="mini", backbone="resnet12")
    assert cfg.resolved_milestones() == (60, 80)
    assert cfg.lr_at(59) == 0.05 and math.isclose(cfg.lr_at(60), 0.005) and math.isclose(cfg.lr_at(80), 0.0005)
    assert TrainConfig(dataset="tiered", backbone="resnet12").resolved_milestones() == (60, 80, 90)
    assert TrainConfig(dataset="mini", backbone="resnet12", epochs=10).resolved_milestones() == (6, 8)
    assert TrainConfig(dataset="mini", backbone="x", epochs=10, milestones=[3]).lr_at(3) == pytest.approx(0.005)


@pytest.mark.parametrize(
    "bad, culprit, params",
    [
        ({"recipe": "kd"}, "recipe must be one of simple, rot, rot-kd, got 'kd'", ("recipe",)),
        ({"teacher": "first"}, "teacher must be one of last, best, got 'first'", ("teacher",)),
        ({"epochs": 0}, "epochs must be a positive integer, got 0", ("epochs",)),
        ({"milestones": (100,)}, "milestones contain 100, outside 1..99 (epochs 100)", ("milestones", "epochs")),
        ({"milestones": [0, 60]}, "milestones must be a comma-separated list, each a positive", ("milestones",)),
        ({"label_smoothing": 1.0}, "label_smoothing must be a number in [0, 1), got 1.0", ("label_smoothing",)),
        ({"recipe": "rot-kd", "generations": 0}, "recipe rot-kd needs generations >= 1", ("recipe", "generations")),
        ({"seed": -1}, "seed must be an integer in 0..9223372036854775807 (what torch, numpy", ("seed",)),
        ({"workers": -1}, "workers must be an integer >= 0, got -1", ("workers",)),
        ({"amp": "yes"}, "amp must be true or false, got 'yes'", ("amp",)),
    ],
)
def test_bad_settings_name_the_culprit(bad, culprit, params):
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset="mini", backbone="resnet12", **bad)
    # the parameter, not a command-line flag; the CLI writes params as flags
    assert culprit in str(e.value) and "--" not in str(e.value) and e.value.params == params


# ---- recipes -------------------------------------------------------------------------------------


def _epoch_losses(result, generation):
    return [h["loss"] for h in result.history if h["generation"] == generation]


@pytest.mark.parametrize("recipe", ["simple", "rot"])
def test_recipe_loss_goes_down(recipe, image_root, tmp_path):
    result = train(_cfg(image_root, tmp_path, recipe=recipe, epochs=5, val_every=0))
    losses = _epoch_losses(result, 0)
    assert len(losses) == 5
    assert losses[-1] < 0.7 * losses[0], losses
    accs = [h["acc"] for h in result.history]
    assert accs[-1] > accs[0]


KD = dict(recipe="rot-kd", generations=1, epochs=3, val_every=2, augment="paper")


@pytest.fixture(scope="module")
def kd_run(image_root, tmp_path_factory):
    """An uninterrupted rot-kd run: the teacher, then one born-again student, 3 epochs each."""
    events = []
    tmp = tmp_path_factory.mktemp("kd")
    return train(_cfg(image_root, tmp, **KD), callback=events.append), events


def test_rot_kd_trains_students_from_the_previous_generation(kd_run):
    result, events = kd_run
    out = Path(result.out_dir)
    for d in (out, out / "student_0"):
        assert (d / "last.pt").exists() and (d / "best.pt").exists()
    assert result.checkpoint == out / "student_0" / "best.pt"
    for g in (0, 1):
        losses = _epoch_losses(result, g)
        assert len(losses) == 3 and losses[-1] < losses[0], (g, losses)
    assert {e.generation for e in events if e.kind == "epoch"} == {0, 1}
    vals = [h["val_acc"] for h in result.history]
    assert [v is not None for v in vals] == [False, True, True] * 2  # every 2 epochs and at the end
    assert all(0.0 <= v <= 1.0 for v in vals if v is not None)
    # the student starts from the same initialisation as the teacher did; its loss adds distillation
    assert _epoch_losses(result, 1)[0] != pytest.approx(_epoch_losses(result, 0)[0])


# ---- checkpoints ---------------------------------------------------------------------------------


def test_checkpoint_has_the_release_layout_and_loads_in_extract(image_root, tmp_path):
    from poodle.backbones import build, load_checkpoint
    from poodle.cache import read_attrs, read_split
    from poodle.extract import extract
    from poodle.utils import file_sha256

    result = train(_cfg(image_root, tmp_path, recipe="rot", epochs=2, val_every=1))
    ckpt = torch.load(result.checkpoint, map_location="cpu", weights_only=True)
    assert ckpt["arch"] == "conv4_64" and ckpt["epoch"] in (1, 2)
    assert all(k.startswith("module.") for k in ckpt["state_dict"])
    assert {
        "module.encoder.0.0.weight",
        "module.fc.weight",
        "module.further.layers.Conv.weight",
        "module.fc2.weight",
    } <= set(ckpt["state_dict"])
    assert 0.0 <= ckpt["best_prec1"] <= 1.0

    cache = extract(
        "folder",
        "conv4_64",
        data_root=image_root,
        checkpoint=result.checkpoint,
        splits=("test",),
        image_size=SIZE,
        batch_size=16,
        device="cpu",
        cache_root=tmp_path / "cache",
        workers=0,
    )
    assert read_attrs(cache)["checkpoint_sha256"] == file_sha256(result.checkpoint)
    feats = read_split(cache, "test")
    # the cached features are the trained model's, not a fresh initialisation's
    model = build("conv4_64", num_classes=4, rotation_head=True)
    load_checkpoint(model, result.checkpoint)
    from poodle.data import ImageDataset, resolve_dataset
    from poodle.data.transforms import eval_transform

    ds = ImageDataset(resolve_dataset("folder", image_root, tmp_path / "cache"), "test", eval_transform(SIZE))
    x = torch.stack([ds[i][0] for i in range(4)])
    with torch.no_grad():
        f = F.normalize(model.eval().forward_features(x), dim=1)
    assert torch.allclose(feats.features[:4], f, atol=1e-4)


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(kd_run, image_root, tmp_path):
    full, _ = kd_run
    cfg = _cfg(image_root, tmp_path, **KD)
    part = train(cfg, stop_after=2)  # interrupted inside the teacher generation
    assert not part.complete
    part = train(cfg, stop_after=2)  # interrupted inside the student generation
    assert not part.complete
    resumed = train(cfg, resume=True)
    assert resumed.complete
    for rel in ("last.pt", "student_0/last.pt", "student_0/best.pt"):
        a = torch.load(Path(full.out_dir) / rel, weights_only=True)
        b = torch.load(Path(resumed.out_dir) / rel, weights_only=True)
        for k, v in a["state_dict"].items():
            assert torch.equal(v, b["state_dict"][k]), (rel, k)
        assert a["best_prec1"] == b["best_prec1"]
        for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
            assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert [h["loss"] for h in full.history] == [h["loss"] for h in resumed.history]


def test_a_complete_run_is_reused_and_other_settings_are_refused(image_root, tmp_path):
    cfg = _cfg(image_root, tmp_path, epochs=1, val_every=0)
    first = train(cfg)
    mtime = first.checkpoint.stat().st_mtime_ns
    again = train(cfg)
    assert again.checkpoint.stat().st_mtime_ns == mtime and again.generations[0]["epochs_run"] == 0
    with pytest.raises(ConfigError, match="lr: 0.05 -> 0.1") as e:
        train(_cfg(image_root, tmp_path, epochs=1, val_every=0, lr=0.1))
    assert str(e.value).startswith(f"out {tmp_path / 'run'}: last.pt was trained with other settings")
    assert "pass force to start over" in str(e.value) and e.value.params == ("out", "force")
    with pytest.raises(ConfigError, match="resume: nothing to resume") as e:
        train(_cfg(image_root, tmp_path / "other", epochs=1), resume=True)
    assert e.value.params == ("resume",)
    forced = train(_cfg(image_root, tmp_path, epochs=1, val_every=0, lr=0.1), force=True)
    assert forced.generations[0]["epochs_run"] == 1


def test_channels_last_is_the_same_training_up_to_rounding_and_resumes_exactly(image_root, tmp_path, monkeypatch):
    import poodle.train.loop as loop

    layouts = []
    build = loop._build

    def spying_build(cfg, *a):
        model = build(cfg, *a)
        model.register_forward_pre_hook(
            lambda m, args: (
                layouts.append(args[0].is_contiguous(memory_format=torch.channels_last)) if m.training else None
            )
        )
        return model

    monkeypatch.setattr(loop, "_build", spying_build)
    kw = dict(epochs=3, val_every=1, augment="crop")
    nchw = train(_cfg(image_root, tmp_path, out=str(tmp_path / "nchw"), **kw))
    assert layouts and not any(layouts)
    layouts.clear()
    nhwc = train(_cfg(image_root, tmp_path, out=str(tmp_path / "nhwc"), channels_last=True, **kw))
    assert layouts and all(layouts)
    cfg = _cfg(image_root, tmp_path, out=str(tmp_path / "resumed"), channels_last=True, **kw)
    assert not train(cfg, stop_after=1).complete
    resumed = train(cfg)
    a, b, c = (torch.load(r.out_dir / "last.pt", weights_only=True) for r in (nchw, nhwc, resumed))
    for k, v in b["state_dict"].items():
        assert v.is_contiguous(), k  # stored in the usual layout, whatever the training used
        assert torch.equal(v, c["state_dict"][k]), k
        if v.is_floating_point():
            torch.testing.assert_close(v, a["state_dict"][k], rtol=1e-3, atol=1e-4)
    assert [h["loss"] for h in nhwc.history] == [h["loss"] for h in resumed.history]


def test_a_setting_that_an_older_run_lacks_counts_as_its_default(image_root, tmp_path):
    current = _cfg(image_root, tmp_path).defining()
    older = {k: v for k, v in current.items() if k != "channels_last"}
    assert config_differences(older, current) == []
    assert config_differences(older, {**current, "channels_last": True}) == ["channels_last: False -> True"]


def test_cli_train_prints_the_checkpoint(image_root, tmp_path):
    from click.testing import CliRunner

    from poodle.cli.main import cli

    out = tmp_path / "cli-run"
    args = [
        "train",
        "--dataset",
        "folder",
        "--data-root",
        str(image_root),
        "--backbone",
        "conv4_64",
        "--recipe",
        "simple",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--image-size",
        str(SIZE),
        "--augment",
        "crop",
        "--val-every",
        "1",
        "--val-episodes",
        "10",
        "--val-way",
        "3",
        "--val-query",
        "2",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--cache-root",
        str(tmp_path / "c"),
        "--out",
        str(out),
    ]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert str(out / "best.pt") in res.output
    assert "epoch 2/2" in res.output
    res = CliRunner().invoke(cli, args[:-2] + ["--out", str(out), "--lr", "0.5"])
    assert res.exit_code == 1 and f"error: --out {out}: last.pt was trained with other settings" in res.output
    assert "lr: 0.05 -> 0.5" in res.output and "pass --force to start over" in res.output


def test_train_options_are_trainconfig_s_declarations(monkeypatch, tmp_path):
    """``poodle train``'s options are made from TrainConfig's fields: a list (``--milestones 3,5``),
    a flag said both ways (``--amp`` / ``--no-channels-last``), a bound refused with its flag."""
    from click.testing import CliRunner

    import poodle.train
    from poodle.cli.main import cli

    seen = []

    def stop(cfg, **kw):
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(poodle.train, "train", stop)
    base = ["train", "--backbone", "conv4_64", "--dataset", "mini", "--cache-root", str(tmp_path)]
    res = CliRunner().invoke(cli, [*base, "--epochs", "10", "--milestones", "3,5", "--amp", "--no-channels-last"])
    assert res.exit_code == 0 and len(seen) == 1, res.output
    cfg = seen[0]
    assert (cfg.milestones, cfg.amp, cfg.channels_last, cfg.lr, cfg.epochs) == ((3, 5), True, False, 0.05, 10)
    project = tmp_path / "poodle.toml"
    project.write_text("[train]\nmilestones = [4, 6]\nepochs = 8\n")
    res = CliRunner().invoke(cli, ["--config", str(project), *base])
    assert res.exit_code == 0 and (seen[-1].milestones, seen[-1].epochs) == ((4, 6), 8), res.output
    project.write_text("[train]\nmilestones = [4, 6.5]\n")
    res = CliRunner().invoke(cli, ["--config", str(project), *base])
    assert res.exit_code == 1 and "[train] milestones = [4, 6.5]: expected a list of integers" in res.output
    res = CliRunner().invoke(cli, [*base, "--milestones", "auto"])
    assert res.exit_code == 0 and seen[-1].milestones is None and seen[-1].amp is None, res.output
    for args, said in (
        (["--lr", "0"], "--lr must be a number in (0, inf), got 0.0"),
        (["--milestones", "0,5"], "--milestones must be a comma-separated list, each a positive integer, got (0, 5)"),
        (["--milestones", "x"], "expected comma-separated integers like 60,80, got 'x'"),
        (["--seed", "-1"], "--seed must be an integer in 0..9223372036854775807"),
    ):
        res = CliRunner().invoke(cli, [*base, *args])
        assert res.exit_code != 0 and said in res.output, res.output


@pytest.mark.parametrize(
    "args, said",
    [
        (["--device", "tpu"], "error: --device 'tpu': use auto, cpu, cuda or cuda:N (N >= 0)"),
        (["--dataset", "nope"], "Invalid value for '--dataset': 'nope' is not one of 'csv', 'folder', 'mini'"),
    ],
)
def test_a_bad_device_or_dataset_is_refused_before_the_glyphs_or_the_output_folder(monkeypatch, tmp_path, args, said):
    """Said with its flag, before the glyphs are generated (minutes on first use) or anything is written."""
    from click.testing import CliRunner

    import poodle.data.glyphs
    from poodle.cli.main import cli

    def generate(*a, **kw):
        raise AssertionError("the glyphs were generated before the setting was refused")

    monkeypatch.setattr(poodle.data.glyphs, "ensure_glyphs", generate)
    res = CliRunner().invoke(cli, ["train", "--backbone", "conv4_64", "--cache-root", str(tmp_path / "c"), *args])
    assert res.exit_code != 0 and said in " ".join(res.output.split()), res.output
    assert "training conv4_64" not in res.output and not (tmp_path / "c").exists()


def test_bounded_options_show_their_range_in_every_command_s_help():
    """A setting's bounds read in --help as click writes a range, after the default, on every command
    that takes it (train, demo, solve alike), from the one declaration."""
    from click.testing import CliRunner

    from poodle.cli.main import cli

    def help_of(command: str) -> str:
        res = CliRunner().invoke(cli, [command, "--help"], terminal_width=400)
        assert res.exit_code == 0, res.output
        return " ".join(res.output.split())

    train, demo, solve = help_of("train"), help_of("demo"), help_of("solve")
    for said in (
        "--epochs INTEGER Training epochs (paper 5.1: 100). [default: 100; x>=1]",
        "--lr FLOAT SGD learning rate (paper 5.1: 0.05). [default: 0.05; x>0]",
        "[default: 0.9; 0<=x<1]",  # --momentum
        "[default: 0.1; 0<x<=1]",  # --gamma
        "tiered 60/80/90%]. [each x>=1]",  # --milestones, each epoch
        "[default: 0; x>=0]",  # --seed: its int64 limit is not said
    ):
        assert said in train, said
    assert "--lr FLOAT Training learning rate. [default: 0.1; x>0]" in demo
    assert "[default: 2000, 600; --quick: 40; x>=1]" in demo  # --episodes: its own default text, then the range
    assert "--way INTEGER" in solve and "[default: 5; x>=2]" in solve
