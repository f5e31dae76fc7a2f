"""``poodle predict``: unequal shots, every query right on trivially separable generated images,
atomic CSV output, features kept for the next call, base negatives from a cache of the same
backbone, and one-line errors for bad inputs."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from poodle.cache import write_arrays
from poodle.cli.predict import predict as predict_cmd
from poodle.errors import ConfigError
from poodle.predict import predict, query_from_folder, support_from_folder, write_csv
from poodle.stats import wilson_interval

SHOTS = {"circle": 1, "square": 3, "triangle": 2}  # unequal shots per class
KIND = {"circle": 0, "square": 1, "triangle": 2}  # _images draws shape class_index % 3
BACKBONE = ["conv4_64", "--image-size", "32"]


COLOUR = {"circle": (230, 30, 30), "square": (30, 230, 30), "triangle": (30, 30, 230)}


def _img(cls: str, i: int):
    """A 32x32 image of the class's colour with the class's shape on grey, plus per-image noise:
    trivially separable, whatever the (random) backbone."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([KIND[cls], i])
    px = np.clip(128 + rng.normal(0, 6, (32, 32, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(px, "RGB")
    d = ImageDraw.Draw(img)
    box = (4, 4, 28, 28)
    if KIND[cls] == 0:
        d.ellipse(box, fill=COLOUR[cls])
    elif KIND[cls] == 1:
        d.rectangle(box, fill=COLOUR[cls])
    else:
        d.polygon([(16, 4), (4, 28), (28, 28)], fill=COLOUR[cls])
    return img


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    for c, n in SHOTS.items():
        (root / "support" / c).mkdir(parents=True)
        for i in range(n):
            _img(c, i).save(root / "support" / c / f"{i}.png")
    (root / "query").mkdir()
    truth = {}
    rows = [("path", "label")]
    for c in SHOTS:
        for i in range(10, 14):
            name = f"{c[:2]}{i}.png"
            _img(c, i).save(root / "query" / name)
            truth[name] = c
            rows.append((f"query/{name}", c))
    with open(root / "query.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    return root, truth


def _run(*args):
    return CliRunner().invoke(predict_cmd, [*map(str, args)])


def _read(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize(
    "method,extra", [("proto", []), ("poodle", []), ("poodle", ["--transductive"]), ("tim-gd", ["--set", "steps=50"])]
)
def test_every_query_right_with_unequal_shots(task, tmp_path, method, extra):
    root, truth = task
    out = tmp_path / "pred.csv"
    r = _run(
        "--support",
        root / "support",
        "--query",
        root / "query",
        "--backbone",
        *BACKBONE,
        "--method",
        method,
        *extra,
        "--out",
        out,
    )
    assert r.exit_code == 0, r.output
    rows = _read(out)
    assert [c for c in rows[0]] == ["path", "prediction", "confidence", "prob_circle", "prob_square", "prob_triangle"]
    assert len(rows) == len(truth)
    for row in rows:
        name = row["path"].rsplit("/", 1)[-1]
        assert row["prediction"] == truth[name], (method, row)
        probs = [float(row[f"prob_{c}"]) for c in SHOTS]
        assert sum(probs) == pytest.approx(1, abs=1e-5)
        assert float(row["confidence"]) == pytest.approx(max(probs), abs=1e-6)
    assert "support" in r.output and "predicted" in r.output
    assert not list(tmp_path.glob("*.partial"))
    # messages: unlabelled queries are not "1 classes", and the deleted temporary cache is not named
    # (only what persists: the CSV)
    assert "6 images of 3 classes" in r.output and f"{len(truth)} unlabelled images" in r.output, r.output
    assert "1 classes" not in r.output and "poodle-predict-" not in r.output, r.output
    assert "features not kept (--cache-dir DIR" in r.output and f"predictions written to {out}" in r.output


def test_labelled_query_csv_reports_accuracy_and_cache_dir_is_reused(task, tmp_path):
    root, _ = task
    cache = tmp_path / "feats"
    args = [
        "--support",
        root / "support",
        "--query-csv",
        root / "query.csv",
        "--backbone",
        *BACKBONE,
        "--method",
        "proto",
        "--out",
        tmp_path / "p.csv",
        "--cache-dir",
        cache,
    ]
    r = _run(*args)
    assert r.exit_code == 0, r.output
    assert "accuracy 100.00%" in r.output and "12 queries" in r.output
    files = list(cache.rglob("*.h5"))
    assert len(files) == 1 and files[0].parent.name == "predict"
    assert "12 labelled images of 3 classes" in r.output and f"features kept in {files[0]}" in r.output, r.output
    r2 = _run(*args)
    assert r2.exit_code == 0 and "already complete" in r2.output
    # another image size is another file beside the first, not a conflict asking for --force
    r3 = _run(*[a if a != "32" else "40" for a in map(str, args)])
    assert r3.exit_code == 0, r3.output
    assert len(list(cache.rglob("*.h5"))) == 2


def test_library_result_and_wilson_interval(task):
    root, truth = task
    res = predict(
        support_from_folder(root / "support"),
        query_from_folder(root / "query"),
        "conv4_64",
        image_size=32,
        method="naive-ood",
        options={"steps": 30},
    )
    assert res.support_counts == [1, 3, 2]
    assert [res.classes[int(k)] for k in res.predictions] == [truth[p.rsplit("/", 1)[-1]] for p in res.paths]
    assert res.accuracy is None and [r["predicted"] for r in res.per_class()] == [4, 4, 4]
    lo, hi = wilson_interval(12, 12)
    assert hi == 1.0 and 0.75 < lo < 0.76  # 12/12: [0.7575, 1]
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)


def test_the_negatives_rule_runs_once_for_the_task(task, negatives_checks):
    """The method's negatives rule is checked once, where predict's choices are checked (before any
    image is read); solving the task trusts it. A method that reads negatives with none raises."""
    root, truth = task
    seen = negatives_checks
    support, query = support_from_folder(root / "support"), query_from_folder(root / "query")
    kw = dict(image_size=32, method="poodle", options={"steps": 20}, n_neg=10)
    res = predict(support, query, "conv4_64", negatives="random", **kw)
    assert seen == [("poodle", "random")]
    assert [res.classes[int(k)] for k in res.predictions] == [truth[p.rsplit("/", 1)[-1]] for p in res.paths]
    with pytest.raises(ConfigError, match="negatives none: method 'poodle' .with these options. reads negative"):
        predict(support, query, "conv4_64", negatives="none", **kw)
    assert seen == [("poodle", "random"), ("poodle", "none")]


def test_base_negatives_come_from_a_cache_of_the_same_backbone(task, tmp_path):
    root, _ = task
    rng = np.random.default_rng(0)
    base = tmp_path / "base.h5"
    write_arrays(
        base,
        {"train": (np.abs(rng.standard_normal((20, 64))), np.arange(20) % 4, list("abcd"))},
        dataset="x",
        backbone="conv4_64",
    )
    res = predict(
        support_from_folder(root / "support"),
        query_from_folder(root / "query"),
        "conv4_64",
        image_size=32,
        method="poodle",
        options={"steps": 20},
        negatives_from=base,
        preprocess="cl2n",
    )
    assert len(res.paths) == 12
    other = tmp_path / "other.h5"
    write_arrays(
        other,
        {"train": (rng.standard_normal((20, 64)), np.arange(20) % 4, list("abcd"))},
        dataset="x",
        backbone="resnet12",
    )
    with pytest.raises(ConfigError, match="holds features of backbone resnet12"):
        predict(
            support_from_folder(root / "support"),
            query_from_folder(root / "query"),
            "conv4_64",
            image_size=32,
            negatives_from=other,
        )
    with pytest.raises(ConfigError, match="cl2n centres on base-class features"):
        predict(
            support_from_folder(root / "support"),
            query_from_folder(root / "query"),
            "conv4_64",
            image_size=32,
            preprocess="cl2n",
        )


def _one_line_error(r, *needles):
    assert r.exit_code == 1, r.output
    # progress lines may come first (stderr); the error is one line, the last
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert sum(ln.startswith("error:") for ln in lines) == 1 and lines[-1].startswith("error:"), r.output
    for n in needles:
        assert n in lines[-1], r.output


def test_bad_inputs_are_one_line_errors(task, tmp_path):
    root, _ = task
    q, out = root / "query", tmp_path / "p.csv"
    # an empty class folder
    sup = tmp_path / "s1"
    for c in ("a", "b"):
        (sup / c).mkdir(parents=True)
    _img("circle", 0).save(sup / "a" / "0.png")
    _one_line_error(
        _run("--support", sup, "--query", q, "--backbone", *BACKBONE, "--out", out), "class 'b' has no images"
    )
    # one class only
    sup2 = tmp_path / "s2"
    (sup2 / "a").mkdir(parents=True)
    _img("circle", 0).save(sup2 / "a" / "0.png")
    _one_line_error(
        _run("--support", sup2, "--query", q, "--backbone", *BACKBONE, "--out", out), "one class only", "'a'"
    )
    # a query folder without images
    empty = tmp_path / "emptyq"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("no images here")
    _one_line_error(
        _run("--support", root / "support", "--query", empty, "--backbone", *BACKBONE, "--out", out), "holds no images"
    )
    # an unreadable image
    badq = tmp_path / "badq"
    badq.mkdir()
    _img("circle", 20).save(badq / "ok.png")
    (badq / "broken.png").write_bytes(b"\x89PNG not really")
    _one_line_error(
        _run("--support", root / "support", "--query", badq, "--backbone", *BACKBONE, "--out", out),
        "cannot decode image",
        "broken.png",
    )
    assert not out.exists()
    # a query label that is not a support class
    bad_csv = tmp_path / "q.csv"
    bad_csv.write_text(f"path,label\n{root / 'query' / 'ci10.png'},dog\n")
    _one_line_error(
        _run("--support", root / "support", "--query-csv", bad_csv, "--backbone", *BACKBONE, "--out", out),
        "'dog'",
        "not support classes",
    )
    # a method that is inductive only, asked to be transductive
    _one_line_error(
        _run(
            "--support",
            root / "support",
            "--query",
            q,
            "--backbone",
            *BACKBONE,
            "--method",
            "proto",
            "--transductive",
            "--out",
            out,
        ),
        "inductive only",
    )


def test_write_csv_is_atomic(task, tmp_path, monkeypatch):
    root, _ = task
    res = predict(
        support_from_folder(root / "support"),
        query_from_folder(root / "query"),
        "conv4_64",
        image_size=32,
        method="proto",
    )
    target = tmp_path / "out.csv"
    target.write_text("previous\n")

    def boom(*a, **k):
        raise RuntimeError("disk full")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", boom)
        with pytest.raises(RuntimeError):
            write_csv(res, target)
    assert target.read_text() == "previous\n" and not list(tmp_path.glob("*.partial"))
    # written whole: LF line endings (not the csv module's CRLF), one line per query and the header
    write_csv(res, target)
    raw = target.read_bytes()
    assert b"\r" not in raw and raw.count(b"\n") == len(res.paths) + 1 and raw.endswith(b"\n")
    assert not list(tmp_path.glob("*.partial"))


def test_every_registered_method_classifies_the_task(task, tmp_path):
    from test_solvers_transductive import FAST

    from poodle import solvers

    root, truth = task
    support, query = support_from_folder(root / "support"), query_from_folder(root / "query")
    for name in solvers.available():
        opts = dict(FAST.get(name, {}))
        if name in ("ce", "poodle", "naive-ood"):
            opts["steps"] = 30
        res = predict(
            support, query, "conv4_64", image_size=32, method=name, options=opts, cache_dir=tmp_path
        )  # extracted once, reused by every method
        got = [res.classes[int(k)] for k in res.predictions]
        assert got == [truth[p.rsplit("/", 1)[-1]] for p in res.paths], name


def test_images_go_through_the_transform_of_the_negatives_cache(task, tmp_path):
    """A pool cache made at 32 px: predict takes its image size when none is given, and refuses
    another one (a checkpoint trained at 28 px fed 84 px crops gives features of another kind)."""
    from poodle.data.transforms import eval_transform

    root, _ = task
    rng = np.random.default_rng(0)
    base = tmp_path / "base32.h5"
    x = np.abs(rng.standard_normal((20, 64)))
    write_arrays(
        base,
        {"train": (x, np.arange(20) % 4, list("abcd"))},
        dataset="x",
        backbone="conv4_64",
        image_size=32,
        transform=eval_transform(32).description,
    )
    said: list[str] = []
    args = (support_from_folder(root / "support"), query_from_folder(root / "query"), "conv4_64")
    res = predict(
        *args, method="poodle", options={"steps": 5}, negatives_from=base, on_event=lambda e: said.append(e.message)
    )
    assert len(res.paths) == 12 and any("image size 32 px, as the features of base32.h5" in m for m in said)
    with pytest.raises(ConfigError, match=r"the images went through 'eval: .*84.*', but the features of"):
        predict(*args, image_size=84, negatives_from=base)
