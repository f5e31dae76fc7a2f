"""Bad input to this round's new surface, as a hostile user types it: the project file (poodle.toml,
--config), the index of caches (<cache_root>/caches.json), the default checkpoint of the newest
training run, --pretrained of timm:/torchvision: backbones, --cuda-step and LaplacianShot's lmd.

Every case runs the real command line in a temporary folder and checks three things: the command
fails with one line that names the culprit (the file, table, key, line or option), there is no
traceback and no click usage block, and nothing was written (the folder, the cache root and the
hubs' caches list the same files before and after). Nothing touches the network: the hubs' caches
are empty or fabricated under the temporary folder, and torch hub's download raises.
"""

from __future__ import annotations

import json
import os
import urllib.error
from pathlib import Path

import _images
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle import project
from poodle.cache import write_arrays
from poodle.cli.main import cli

TIMM = "timm:test_vit.r160_in1k"
TV = "torchvision:mobilenet_v3_small"
TV_FILE = "mobilenet_v3_small-047dcff4.pth"  # the file of MobileNet_V3_Small_Weights.IMAGENET1K_V1
TIMM_SNAPSHOT = Path("hf/hub/models--timm--test_vit.r160_in1k/snapshots") / ("0" * 40)
EXTRACT = ["extract", "--dataset", "folder", "--data-root", "img", "--splits", "train,test", "--image-size", "32"]
EXTRACT += ["--workers", "0", "--device", "cpu", "--batch-size", "8"]


def _offline(*args, **kwargs):
    raise urllib.error.URLError("no network in the tests")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Work in tmp_path, with empty hub caches under it and no way to download."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", _offline)


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def fails(root: Path, *args: object, code: int = 1, before: str | None = None) -> str:
    """``poodle ARGS`` must fail with exit ``code``, printing one ``error:`` line (after the line
    ``before`` starts with, where the command says which default it took) and writing nothing under
    ``root``; returns the error line (rich's wrapping joined back)."""
    listed = files(root)
    res = CliRunner().invoke(cli, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"traceback instead of one line: {res.exception!r}\n{res.output}") from res.exception
    assert res.exit_code == code, res.output
    lines = res.output.splitlines()
    if before is not None:
        assert lines[0].startswith(before), res.output
        lines = lines[1:]
    assert lines and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    assert not any(ln.startswith(("error:", "Usage:", "Try ")) for ln in lines[1:]), res.output
    assert files(root) == listed, "written: " + ", ".join(sorted(set(files(root)) - set(listed)))
    return " ".join(" ".join(lines).split())


def features(path: Path, **attrs: str) -> Path:
    rng = np.random.default_rng(0)

    def split(n: int, k: int, s: int):
        x = rng.standard_normal((n * k, 16)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True), np.arange(n).repeat(k), [f"c{s}{i}" for i in range(n)]

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_arrays(path, {"train": split(8, 10, 1), "test": split(6, 20, 2)}, **attrs)


# ------------------------------------------------------------------------------------------ the project file

TOML_CASES = [
    ("[solve]\nepisodes = = 3\n", "project file poodle.toml is not valid TOML: Invalid value (at line 2, column 12)"),
    ("[solv]\nepisodes = 3\n", "poodle.toml: unknown table [solv]; tables are [defaults] and the commands"),
    ("[solve]\nepisods = 3\n", "poodle.toml: [solve] episods: solve has no option 'episods'"),
    ('[solve]\ndata_root = "x"\n', "poodle.toml: [solve] data_root: solve has no option 'data_root'"),  # extract's
    ("[solve.sub]\nx = 1\n", "poodle.toml: [solve] sub: solve has no option 'sub'"),
    ("[defaults]\nnope = 1\n", "poodle.toml: [defaults] nope: no command has an option 'nope'"),
    ('[defaults]\nconfig = "x.toml"\n', "poodle.toml: [defaults] config: no command has an option 'config'"),
    ("episodes = 3\n", "poodle.toml: 'episodes' is outside any table"),
    ('[solve]\nepisodes = "many"\n', 'poodle.toml: [solve] episodes = "many": expected an integer'),
    ("[solve]\nepisodes = 3.5\n", "poodle.toml: [solve] episodes = 3.5: expected an integer"),  # not cut to 3
    ("[solve]\nepisodes = true\n", "poodle.toml: [solve] episodes = true: expected an integer"),  # not 1
    ("[solve]\nepisodes = {a = 1}\n", "poodle.toml: [solve] episodes = {a = 1}: expected a value, not a table"),
    ("[solve]\nepisodes = 1979-05-27\n", "poodle.toml: [solve] episodes = 1979-05-27: expected an integer"),
    ("[solve]\nshot = 1e400\n", "poodle.toml: [solve] shot = inf: expected an integer"),
    ("[solve]\ndevice = 5\n", 'poodle.toml: [solve] device = 5: expected a string (in quotes: "...")'),
    ('[solve]\ntransductive = "yes"\n', 'poodle.toml: [solve] transductive = "yes": expected true or false'),
    ("[solve]\ntransductive = 1\n", "poodle.toml: [solve] transductive = 1: expected true or false"),
    ("[solve]\nmethod = [1, 2]\n", 'poodle.toml: [solve] method = [1, 2]: expected a string (in quotes: "...")'),
    ("[solve]\nway = [5]\n", "poodle.toml: [solve] way = [5]: expected one value, not a list"),
    (
        '[solve]\ncuda_step = "cuda"\n',
        "poodle.toml: [solve] cuda_step = \"cuda\": 'cuda' is not one of 'torch', 'triton'",
    ),
    ('[solve]\nmax_memory = "lots"\n', 'poodle.toml: [solve] max_memory = "lots": cannot read memory size'),
    ('[extract]\ndataset = "imagenet"\n', "poodle.toml: [extract] dataset = \"imagenet\": 'imagenet' is not one of"),
    (b"[solve]\n# caf\xe9\nepisodes = 3\n", "project file poodle.toml is not UTF-8 text (byte 13)"),
    # a byte order mark is read past (Windows editors write one): the error is the key's, not line 1's
    (b'\xef\xbb\xbf[solve]\nepisodes = "x"\n', 'poodle.toml: [solve] episodes = "x": expected an integer'),
    # an empty file is no defaults at all
    ("", "no feature cache written by poodle extract under cache: make one with"),
]


@pytest.mark.parametrize("text,message", TOML_CASES, ids=[str(i) for i in range(len(TOML_CASES))])
def test_a_bad_project_file_is_one_line_naming_the_file_table_and_key(tmp_path, text, message):
    (tmp_path / "poodle.toml").write_bytes(text if isinstance(text, bytes) else text.encode())
    assert message in fails(tmp_path, "solve")


def test_a_value_of_the_right_type_that_the_library_refuses_names_the_file_table_and_key(tmp_path):
    features(tmp_path / "f.h5")
    (tmp_path / "poodle.toml").write_text('[solve]\ncache = "f.h5"\nepisodes = -3\n')
    line = fails(tmp_path, "solve", "--device", "cpu")  # was a ValueError traceback (share(-3, 1, 0))
    assert line == (
        "error: --episodes (poodle.toml [solve] episodes) must be a positive integer (the number of episodes), got -3"
    )
    assert fails(tmp_path, "solve", "--device", "cpu", "--episodes", -3) == (
        "error: --episodes must be a positive integer (the number of episodes), got -3"
    )


def _unreadable(path: Path, monkeypatch) -> None:
    path.write_text("[solve]\nepisodes = 3\n")
    if os.geteuid() != 0:
        path.chmod(0)
        return
    real = Path.read_bytes  # root reads any file: the refusal is simulated where it happens

    def read_bytes(self):
        if self.name == path.name:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize(
    "make,args,message",
    [
        ("dir", [], "project file poodle.toml is a directory"),  # was ignored: the defaults silently gone
        ("loop", [], "project file poodle.toml cannot be read: a symbolic link loop"),  # was ignored too
        ("dangling", [], "project file poodle.toml does not exist (a symbolic link to nothing)"),
        ("unreadable", [], "project file poodle.toml cannot be read: permission denied"),
        (None, ["--config", "absent.toml"], "project file absent.toml does not exist"),
        ("cfgdir", ["--config", "cfgdir"], "project file cfgdir is a directory"),  # was click's usage block
        ("cfgloop", ["--config", "a"], "--config a: cannot be resolved: a symbolic link loop"),
    ],
)
def test_a_project_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, make, args, message):
    if make == "dir":
        (tmp_path / "poodle.toml").mkdir()
    elif make == "loop":
        os.symlink("poodle.toml", tmp_path / "poodle.toml")
    elif make == "dangling":
        os.symlink("nowhere.toml", tmp_path / "poodle.toml")
    elif make == "unreadable":
        _unreadable(tmp_path / "poodle.toml", monkeypatch)
    elif make == "cfgdir":
        (tmp_path / "cfgdir").mkdir()
    elif make == "cfgloop":
        os.symlink("b", tmp_path / "a")
        os.symlink("a", tmp_path / "b")
    assert fails(tmp_path, *args, "solve") == f"error: {message}"


# ------------------------------------------------------------------------------------------ the index of caches


def _recorded(tmp_path: Path) -> Path:
    path = features(tmp_path / "cache" / "glyphs" / "conv4_64.h5")
    project.record_cache(tmp_path / "cache", path, {"dataset": "glyphs", "backbone": "conv4_64"})
    return path


@pytest.mark.parametrize(
    "index,message",
    [
        (None, ""),
        (
            "{not json",
            ": cache/caches.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
            "column 2)",
        ),
        (
            '{"caches": [{"path": "glyphs/conv',
            ": cache/caches.json is not valid JSON (Unterminated string starting at: line 1",
        ),
        ("[1, 2]", ": cache/caches.json is not an index of caches (no list 'caches')"),
        ("dir", ": cache/caches.json is a directory, not the index of caches"),
        ("deleted", ": cache/caches.json names last cache/glyphs/conv4_64.h5, which no longer exists"),
    ],
)
def test_solve_without_a_cache_says_why_the_index_gave_none(tmp_path, index, message):
    if index == "deleted":
        _recorded(tmp_path).unlink()
    elif index == "dir":
        (tmp_path / "cache" / "caches.json").mkdir(parents=True)
    elif index is not None:
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "caches.json").write_text(index)
    # was "no feature cache written by poodle extract under cache" alone, for every one of them
    line = fails(tmp_path, "solve", "--episodes", 5)
    assert line.startswith(f"error: no feature cache written by poodle extract under cache{message}"), line
    assert line.endswith("make one with 'poodle extract --backbone NAME' or give --cache FILE")


def test_an_index_naming_a_file_that_is_no_cache_names_that_file(tmp_path):
    (tmp_path / "cache" / "glyphs").mkdir(parents=True)
    (tmp_path / "cache" / "glyphs" / "conv4_64.h5").write_bytes(b"garbage")
    project.record_cache(tmp_path / "cache", tmp_path / "cache/glyphs/conv4_64.h5", {"dataset": "glyphs"})
    line = fails(tmp_path, "solve", "--episodes", 5, before="features: cache/glyphs/conv4_64.h5 (the cache")
    assert line.startswith("error: cache/glyphs/conv4_64.h5: not a poodle feature cache")


@pytest.fixture
def images(tmp_path) -> Path:
    return _images.write_folder(tmp_path / "img", {"train": 2, "test": 2}, 3, size=32, splits=("train", "test"))


def test_extract_with_a_folder_for_the_index_writes_no_cache_and_an_unreadable_index_is_started_anew(tmp_path, images):
    (tmp_path / "cache" / "caches.json").mkdir(parents=True)
    # was: the whole cache written, then a failure naming a temporary file
    assert fails(tmp_path, *EXTRACT, "--backbone", "conv4_64", "--random-weights") == (
        "error: cache/caches.json, the index of the caches extract writes, is a directory: move it out of the way"
    )
    (tmp_path / "cache" / "caches.json").rmdir()
    (tmp_path / "cache" / "caches.json").write_text('{"caches": [')
    res = CliRunner().invoke(cli, [*EXTRACT, "--backbone", "conv4_64", "--random-weights"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("note: cache/caches.json is not valid JSON (Expecting value: line 1 column 13)")
    assert [r.path for r in project.cache_records(tmp_path / "cache")] == [
        tmp_path / "cache" / "folder" / "conv4_64.h5"
    ]


# ------------------------------------------------------------------------------------------ the default checkpoint


def _run(tmp_path: Path, name: str, checkpoint: bytes, summary: str | None) -> Path:
    out = tmp_path / "cache" / "folder" / "checkpoints" / name
    out.mkdir(parents=True)
    for f in ("last.pt", "best.pt"):
        (out / f).write_bytes(checkpoint)
    if summary is not None:
        (out / "train.json").write_text(summary)
    return out


SUMMARY = json.dumps(
    {"config": {"dataset": "folder", "backbone": "conv4_64", "image_size": 32}, "checkpoint": "best.pt"}
)


@pytest.mark.parametrize("summary", [None, "{cut short"], ids=["stopped", "damaged-summary"])
def test_an_unfinished_training_run_is_named_and_not_taken(tmp_path, images, summary):
    _run(tmp_path, "conv4_64-simple", b"weights", summary)
    # was "no checkpoint of conv4_64 on folder: train one ..." with no word of the run there
    assert fails(tmp_path, *EXTRACT, "--backbone", "conv4_64") == (
        "error: no checkpoint of conv4_64 on folder; cache/folder/checkpoints/conv4_64-simple has no complete "
        "train.json (a run that did not finish: the same poodle train command resumes it): train one with "
        "'poodle train --backbone conv4_64 --dataset folder --data-root img' or give --checkpoint FILE "
        "or --random-weights"
    )


@pytest.mark.parametrize(
    "checkpoint,message",
    [
        (b"garbage", "is not a torch checkpoint (UnpicklingError: Unsupported operand 103)"),
        (b"", "is not a torch checkpoint (an empty file)"),  # was "(EOFError: )"
        ("keys", "does not fit conv4_64: 28 missing keys (encoder.0.0.weight"),
    ],
)
def test_a_damaged_checkpoint_of_the_newest_run_is_one_line_naming_it(tmp_path, images, checkpoint, message):
    if checkpoint == "keys":
        torch.save({"x": torch.zeros(3)}, tmp_path / "k.pt")
        checkpoint = (tmp_path / "k.pt").read_bytes()
    _run(tmp_path, "conv4_64-simple", checkpoint, SUMMARY)
    line = fails(tmp_path, *EXTRACT, "--backbone", "conv4_64", before="checkpoint: cache/folder/checkpoints/")
    assert "cache/folder/checkpoints/conv4_64-simple/best.pt " + message in line, line


# ------------------------------------------------------------------------------------------ --pretrained


def _cached(tmp_path: Path, where: str, content: bytes | dict) -> None:
    """A file in the hub caches: torch hub's file of TV, or timm's ``pytorch_model.bin`` / ``model.safetensors``."""
    if where == "torch":
        path = tmp_path / "th" / "hub" / "checkpoints" / TV_FILE
    else:
        path = tmp_path / TIMM_SNAPSHOT / where
        (tmp_path / TIMM_SNAPSHOT.parent.parent / "refs").mkdir(parents=True)
        (tmp_path / TIMM_SNAPSHOT.parent.parent / "refs" / "main").write_text("0" * 40)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, dict):
        torch.save(content, path)
    else:
        path.write_bytes(content)


DAMAGED = "(it is in the library's cache: delete it and run again to download it anew)"
PRETRAINED_CASES = [
    (TIMM, [], None, f"error: {TIMM} with --pretrained: model.safetensors or pytorch_model.bin of Hugging Face "),
    (TV, [], None, f"error: {TV} with --pretrained MobileNet_V3_Small_Weights.IMAGENET1K_V1: {TV_FILE} is not in"),
    (TV, ["IMAGENET9K"], None, "error: --pretrained 'IMAGENET9K': MobileNet_V3_Small_Weights has IMAGENET1K_V1"),
    (TIMM, ["IMAGENET1K_V1"], None, "error: --pretrained 'IMAGENET1K_V1': a timm model's weights are chosen by"),
    ("conv4_64", [], None, "error: --pretrained is for timm:NAME and torchvision:NAME backbones, not conv4_64"),
    (TV, ["--checkpoint", "w.pt"], None, "error: give one of --checkpoint FILE, --pretrained and --random-weights"),
    (TV, ["--random-weights"], None, "error: give one of --checkpoint FILE, --pretrained and --random-weights"),
    (TV, [], ("torch", b"PK\x03\x04garbage"), f"{TV_FILE} is not a torch checkpoint (RuntimeError: "),
    (TV, [], ("torch", {"a": torch.zeros(2)}), f"{TV_FILE} does not fit {TV}: "),
    (TIMM, [], ("pytorch_model.bin", b"not a torch file"), "pytorch_model.bin is not a torch checkpoint"),
    (TIMM, [], ("model.safetensors", b"\x08" + b"\x00" * 7 + b"{}junk"), "model.safetensors is not a safetensors"),
]


@pytest.mark.parametrize("backbone,more,cached,message", PRETRAINED_CASES, ids=[str(i) for i in range(11)])
def test_pretrained_weights_that_cannot_be_had_are_one_line(tmp_path, images, backbone, more, cached, message):
    (tmp_path / "w.pt").write_bytes(b"x")
    if cached is not None:
        _cached(tmp_path, *cached)
    line = fails(tmp_path, *EXTRACT, "--backbone", backbone, "--pretrained", *more)
    assert message in line, line
    assert line.endswith(DAMAGED) == (cached is not None), line
    assert "miniz" not in line  # torch's zip reader's second sentence is left out


def test_predict_names_the_weights_enum_member_that_does_not_exist(tmp_path):
    task = _images.write_folder(tmp_path / "task", {"s": 2, "q": 2}, 2, size=32, splits=("s", "q"))
    args = ["--support", task / "s", "--query", task / "q", "--out", "p.csv", "--device", "cpu"]
    line = fails(tmp_path, "predict", "--backbone", TV, "--pretrained", "NOPE", *args)
    assert line == "error: --pretrained 'NOPE': MobileNet_V3_Small_Weights has IMAGENET1K_V1 (or DEFAULT)"


# ------------------------------------------------------------------------------------------ --cuda-step, lmd, usage


@pytest.mark.parametrize(
    "args,message",
    [
        (["solve", "--cuda-step", "cuda"], "Invalid value for '--cuda-step': 'cuda' is not one of 'torch', 'triton'"),
        (
            ["grid", "g.toml", "--cuda-step", "x"],
            "Invalid value for '--cuda-step': 'x' is not one of 'torch', 'triton'",
        ),
        (["solve", "--episodes", "x"], "Invalid value for '--episodes': 'x' is not a valid integer"),
        (["solv"], "No such command 'solv'"),
        (["predict", "--support", "x"], "Missing option '--backbone'"),
    ],
)
def test_click_usage_errors_are_one_line_without_the_usage_block(tmp_path, args, message):
    line = fails(tmp_path, *args, code=2)
    assert line.startswith(f"error: {message}") and line.endswith("--help')"), line


@pytest.mark.parametrize(
    "value,message",
    [
        ("-1", "option 'lmd' must lie in [0, inf), got -1"),
        ("nan", "option 'lmd' must be a finite number, got nan"),
        ("abc", "option 'lmd' of method 'laplacianshot' expects a float, got 'abc'"),
    ],
)
def test_laplacianshot_lmd_out_of_range_is_one_line_and_no_results(tmp_path, value, message):
    features(tmp_path / "f.h5")
    args = ["--cache", "f.h5", "--method", "laplacianshot", "--transductive", "--episodes", 5, "--out", "r.jsonl"]
    assert message in fails(tmp_path, "solve", *args, "--set", f"lmd={value}", "--device", "cpu")
