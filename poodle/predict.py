"""``poodle predict``: label a few images per class, classify the rest.

The support images (one folder per class, or a ``path,label`` CSV) and the query images (a folder,
or a ``path[,label]`` CSV) become two splits, ``support`` and ``query``, of a feature cache made by
:func:`poodle.extract.extract` (the same transform, checks and strict checkpoint loading as
``poodle extract``); the cache is named after a digest of both image lists, so with ``cache_dir``
a later call on the same images reuses it. The whole task is then one episode with any number of
classes and any number of support images per class, solved by any registered method; negatives
come from the ``train`` split of a feature cache of the same backbone and checkpoint
(``negatives_from``), else they are random.

Output: per query its path, the predicted class, the confidence (the predicted class's
probability) and the probability of every class, written to a CSV atomically; when the query list
has labels, the accuracy with a 95% Wilson score interval.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import numbers
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from poodle import defaults, solvers
from poodle.backbones.checkpoint import checkpoint_digest
from poodle.backbones.pretrained import resolve_pretrained
from poodle.cache import SplitFeatures, read_attrs, read_split
from poodle.data.sources import IMAGE_EXTENSIONS, DatasetSource
from poodle.errors import CacheError, ConfigError, DataError, mark
from poodle.evaluate import solve_batch
from poodle.events import Event, Notice, OnEvent, SplitReused, SplitWritten, ignore
from poodle.extract import ExtractOptions, extract
from poodle.negatives import GENERATED, NegativeSpec, generate, sample_indices
from poodle.preprocess import Preprocess, Preprocessor, parse
from poodle.solvers import EpisodeBatch
from poodle.stats import wilson_interval
from poodle.utils import atomic_path, content_hash, count, file_sha256, resolve_device, resolve_path

UNLABELLED = "?"  # the class name of unlabelled query images inside the predict cache


def _is_image(p: Path) -> bool:
    return p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS


def _images_under(d: Path) -> list[Path]:
    return sorted(
        p for p in d.rglob("*") if _is_image(p) and not any(part.startswith(".") for part in p.relative_to(d).parts)
    )


def support_from_folder(folder: str | os.PathLike) -> list[tuple[str, str]]:
    """``[(absolute path, class)]`` from ``folder/<class>/<images>`` (images found recursively)."""
    d = resolve_path(Path(folder).expanduser(), "support")
    if not d.is_dir():
        raise DataError(f"{mark('support')} {d}: no such folder", params=("support",), param="support", value=folder)
    class_dirs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise DataError(
            f"{mark('support')} {d} has no class folders (layout: SUPPORT/<class>/<image>)",
            params=("support",),
            param="support",
            value=folder,
        )
    out = []
    for cd in class_dirs:
        files = _images_under(cd)
        if not files:
            raise DataError(
                f"support class {cd.name!r} has no images: {cd} (image extensions: {' '.join(IMAGE_EXTENSIONS)})",
                param="folder",
                value=folder,
            )
        out += [(str(f.resolve()), cd.name) for f in files]
    return out


def _read_csv(path: str | os.PathLike, what: str, need_label: bool) -> list[tuple[str, str | None]]:
    p = resolve_path(Path(path).expanduser(), what)
    if not p.is_file():
        raise DataError(f"{mark(what)} {p}: no such file", params=(what,), param=what, value=path)
    with open(p, newline="", encoding="utf-8") as fh:
        rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]
    if not rows:
        raise DataError(f"{mark(what)} {p} is empty", params=(what,), param=what, value=path)
    header = [c.strip().lower() for c in rows[0]]
    if "path" not in header:
        raise DataError(
            f"{mark(what)} {p}: the first line must be a header with a 'path' column"
            + (" and a 'label' column" if need_label else " (and optionally 'label')"),
            params=(what,),
            param=what,
            value=path,
        )
    ip, il = header.index("path"), header.index("label") if "label" in header else None
    if need_label and il is None:
        raise DataError(f"{mark(what)} {p}: no 'label' column in the header", params=(what,), param=what, value=path)
    out: list[tuple[str, str | None]] = []
    for n, r in enumerate(rows[1:], start=2):
        if len(r) <= max(ip, il or 0):
            raise DataError(
                f"{mark(what)} {p}, line {n}: {len(r)} fields, expected {len(header)}",
                params=(what,),
                param=what,
                value=path,
            )
        f = Path(r[ip].strip()).expanduser()
        f = f if f.is_absolute() else p.parent / f
        if not f.is_file():
            raise DataError(
                f"{mark(what)} {p}, line {n}: image {f} does not exist", params=(what,), param=what, value=path
            )
        label = r[il].strip() if il is not None else None
        if il is not None and not label:
            raise DataError(f"{mark(what)} {p}, line {n}: empty label", params=(what,), param=what, value=path)
        out.append((str(f.resolve()), label))
    if not out:
        raise DataError(f"{mark(what)} {p} lists no images", params=(what,), param=what, value=path)
    return out


def support_from_csv(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``[(absolute path, class)]`` from a CSV with a ``path,label`` header (paths relative to the CSV)."""
    return [(f, str(c)) for f, c in _read_csv(path, "support_csv", need_label=True)]


def query_from_folder(folder: str | os.PathLike) -> list[tuple[str, str | None]]:
    """``[(absolute path, None)]``: every image under ``folder``, sorted."""
    d = resolve_path(Path(folder).expanduser(), "query")
    if not d.is_dir():
        raise DataError(f"{mark('query')} {d}: no such folder", params=("query",), param="query", value=folder)
    files = _images_under(d)
    if not files:
        raise DataError(
            f"{mark('query')} {d} holds no images (image extensions: {' '.join(IMAGE_EXTENSIONS)})",
            params=("query",),
            param="query",
            value=folder,
        )
    return [(str(f.resolve()), None) for f in files]


def query_from_csv(path: str | os.PathLike) -> list[tuple[str, str | None]]:
    """``[(absolute path, label or None)]`` from a CSV with a ``path[,label]`` header."""
    return _read_csv(path, "query_csv", need_label=False)


class ListSource(DatasetSource):
    """Two splits, ``support`` and ``query``, from explicit lists of absolute paths."""

    def __init__(self, lists: Mapping[str, list[tuple[str, str]]]) -> None:
        super().__init__("predict", Path("/"))
        self._lists = {k: list(v) for k, v in lists.items()}

    def splits(self) -> list[str]:
        return list(self._lists)

    def _list(self, split: str) -> list[tuple[str, str]]:
        # relative to "/" so that root / path is the absolute file again
        return [(str(Path(p).relative_to(Path(p).anchor).as_posix()), c) for p, c in self._lists[split]]

    def describe(self) -> str:
        return ", ".join(f"{len(v)} {k} images" for k, v in self._lists.items())


@dataclass
class Prediction:
    """The result of :func:`predict`.

    ``probs`` float64 ``[Nq, C]`` (rows sum to 1), ``predictions`` int64 ``[Nq]`` indices into
    ``classes``; ``labels`` the query labels (None when not given); ``accuracy``/``ci95`` the
    accuracy and the half-width of its 95% Wilson interval (None without labels).
    """

    paths: list[str]
    classes: list[str]
    probs: torch.Tensor
    predictions: torch.Tensor
    support_counts: list[int]
    method: str
    options: dict[str, Any]
    cache: str | None
    labels: list[str] | None = None
    accuracy: float | None = None
    ci95: tuple[float, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def confidence(self) -> torch.Tensor:
        return self.probs.gather(1, self.predictions.unsqueeze(1)).squeeze(1)

    def per_class(self) -> list[dict[str, Any]]:
        """Per class: support images, queries predicted, and with labels: queries, correct."""
        out = []
        pred = self.predictions.tolist()
        for k, c in enumerate(self.classes):
            row: dict[str, Any] = {
                "class": c,
                "support": self.support_counts[k],
                "predicted": sum(1 for p in pred if p == k),
            }
            if self.labels is not None:
                idx = [i for i, y in enumerate(self.labels) if y == c]
                row["queries"] = len(idx)
                row["correct"] = sum(1 for i in idx if pred[i] == k)
            out.append(row)
        return out


def _check_base_cache(path: Path, backbone: str, sha: str) -> dict[str, Any]:
    """The root attributes of the ``negatives_from`` cache; ConfigError unless they are features of
    ``backbone`` with the checkpoint of digest ``sha``."""
    attrs = read_attrs(path)
    if attrs["backbone"] != backbone or attrs["checkpoint_sha256"] != sha:
        raise ConfigError(
            f"{mark('negatives_from')} {path} holds features of backbone {attrs['backbone']} (checkpoint "
            f"{attrs['checkpoint_sha256'][:12]}), not of {backbone} (checkpoint {sha[:12]}): "
            f"its rows would live in another feature space",
            params=("negatives_from",),
            param="negatives_from",
            value=path,
        )
    return attrs


@dataclass(frozen=True)
class Task:
    """A classification task as given: ``support [(path, class)]``, ``query [(path, label or None)]``,
    the sorted support ``classes`` and the query ``labels`` (``None`` when the queries have none)."""

    support: list[tuple[str, str]]
    query: list[tuple[str, str | None]]
    classes: list[str]
    labels: list[str] | None


def make_task(support: Sequence[tuple[str, str]], query: Sequence[tuple[str, str | None]]) -> Task:
    """The task of these image lists; a DataError for an empty list, a single class, or query labels
    that are partial or not support classes."""
    support, query = list(support), list(query)
    if not support:
        raise DataError("no support images", param="support", value=support)
    if not query:
        raise DataError("no query images", param="query", value=query)
    classes = sorted({c for _, c in support})
    if len(classes) < 2:
        raise DataError(
            f"the support has one class only ({classes[0]!r}); a classifier needs at least two",
            param="support",
            value=support,
        )
    labelled = [y is not None for _, y in query]
    if any(labelled) and not all(labelled):
        raise DataError(
            "some query images have a label and others none: label all of them or none", param="query", value=query
        )
    labels = [str(y) for _, y in query] if all(labelled) else None
    if labels is not None:
        unknown = sorted(set(labels) - set(classes))
        if unknown:
            raise DataError(
                f"query label(s) {', '.join(map(repr, unknown[:5]))} are not support classes ({', '.join(classes)})",
                param="query",
                value=unknown,
            )
    return Task(support, query, classes, labels)


@dataclass(frozen=True)
class Solving:
    """How the task is solved: the method and its configuration, the negatives of a method that
    reads some (``source``: ``base``, ``random`` or ``sphere``; ``None`` when it reads none), their
    count, the pool cache (``negatives_from``) and the preprocessing."""

    method: str
    config: Any
    source: str | None
    n_neg: int
    negatives_from: Path | None
    preprocess: Preprocess


def make_solving(
    method: str,
    options: Mapping[str, Any],
    negatives: str | None,
    negatives_from: str | os.PathLike | None,
    n_neg: int,
    preprocess: str,
) -> Solving:
    """Check the solving choices together: ``base`` negatives and ``cl2n`` need ``negatives_from``,
    a method that reads negatives cannot have none."""
    info = solvers.get(method)
    cfg = solvers.make_config(info.name, dict(options), strict=True)
    pool = None if negatives_from is None else Path(negatives_from).expanduser()
    if negatives is None:
        negatives = "base" if pool is not None else "random"
    if negatives not in ("base", "none") + GENERATED:
        raise ConfigError.bad_value(
            "negatives", negatives, "must be base (with negatives_from), random, sphere or none"
        )
    if negatives == "base" and pool is None:
        raise ConfigError(
            f"{mark('negatives')} base reads the train split of {mark('negatives_from')}: give a feature cache "
            "of the same backbone",
            params=("negatives", "negatives_from"),
            param="negatives_from",
            value=negatives_from,
        )
    info.check_negatives(cfg, negatives)
    NegativeSpec(negatives, n_neg).validate()
    pre = parse(preprocess)
    if pre.needs_base and pool is None:
        raise ConfigError(
            f"{mark('preprocess')} cl2n centres on base-class features: give {mark('negatives_from')} (a cache; "
            "its train split)",
            params=("preprocess", "negatives_from"),
            param="preprocess",
            value=preprocess,
        )
    return Solving(info.name, cfg, negatives if info.needs_negatives(cfg) else None, n_neg, pool, pre)


def _weights_digest(backbone: str, extraction: ExtractOptions) -> str:
    """The sha256 of the weights the images go through: the checkpoint's, or the pretrained file's."""
    if extraction.pretrained:
        extraction.check("predict")  # checkpoint and pretrained together: refused before any work
        return file_sha256(resolve_pretrained(backbone, extraction.pretrained).path)
    return checkpoint_digest(extraction.checkpoint)


def _pool_attrs(solving: Solving, backbone: str, sha: str) -> dict[str, Any]:
    """The root attributes of the ``negatives_from`` cache (checked: same backbone and checkpoint)."""
    if solving.negatives_from is None:
        return {}
    if not solving.negatives_from.is_file():
        raise ConfigError(
            f"{mark('negatives_from')} {solving.negatives_from}: no such cache file",
            params=("negatives_from",),
            param="negatives_from",
            value=solving.negatives_from,
        )
    return _check_base_cache(solving.negatives_from, backbone, sha)


def _negatives(solving: Solving, pre: Preprocessor, dim: int) -> torch.Tensor | None:
    """The negatives ``[1, M, D]`` of the task, as episode 0 of seed ``defaults.SEED`` draws them."""
    if solving.source is None:
        return None
    episode = torch.tensor([0])
    if solving.source == "base":
        pool = pre.pool("base", solving.negatives_from, dim)
        assert pool is not None  # "base" is a pool, never generated
        return pool[sample_indices(pool.shape[0], episode, solving.n_neg, defaults.SEED)]
    return generate(solving.source, episode, solving.n_neg, dim, defaults.SEED)


def solve_task(
    s: SplitFeatures, q: SplitFeatures, solving: Solving, device: str | torch.device, on_event: OnEvent = ignore
) -> torch.Tensor:
    """The task as one episode of any number of classes and support images per class, solved by
    the method through the evaluation path's :func:`poodle.evaluate.solve_batch`: query
    probabilities float64 ``[Nq, C]``. ``solving`` is :func:`make_solving`'s, its choices checked
    there (the config, the negatives rule): trusted here."""

    def say(message: str) -> None:
        on_event(Notice("preprocess-fallback", message, ("preprocess",)))

    pre = Preprocessor.from_cache(solving.preprocess, solving.negatives_from, log=say)
    s, q = pre.split(s), pre.split(q)
    batch = EpisodeBatch(
        s.features.unsqueeze(0),
        s.labels.unsqueeze(0),
        q.features.unsqueeze(0),
        _negatives(solving, pre, s.dim),
        len(s.classes),
    ).to(resolve_device(device))
    torch.manual_seed(defaults.SEED)
    log_probs = solve_batch(batch, solving.method, solving.config, checked=True)
    return torch.softmax(log_probs[0].double().cpu(), -1)


@dataclass(frozen=True)
class PredictOptions:
    """How :func:`predict` solves the task and where it keeps the features.

    Attributes:
        method, options: a registered method and its options (e.g. ``{"transductive": True}``).
        negatives: ``base`` (the ``train`` split of ``negatives_from``), ``random``, ``sphere`` or
            ``none``; default ``base`` with ``negatives_from``, else ``random``. Only read by
            methods that use negatives.
        negatives_from: a feature cache of the same backbone and checkpoint.
        n_neg: negatives in the episode.
        preprocess: ``l2n``, ``cl2n`` (centres on ``negatives_from``'s train split; required
            then) or ``power[:BETA]``.
        cache_dir: keep the features there for the next call (else a temporary folder).
        extraction: how the images become features, as for :func:`poodle.extract.extract` (its
            ``splits``, ``cache_root`` and ``tag`` are predict's own; ``image_size`` defaults to
            that of ``negatives_from``'s features).
    """

    method: str = defaults.METHOD
    options: Mapping[str, Any] = field(default_factory=dict)
    negatives: str | None = None
    negatives_from: str | os.PathLike | None = None
    n_neg: int = defaults.N_NEG
    preprocess: str = defaults.PREPROCESS
    cache_dir: str | os.PathLike | None = None
    extraction: ExtractOptions = field(default_factory=lambda: ExtractOptions(workers=defaults.PREDICT_WORKERS))

    def with_settings(self, settings: Mapping[str, Any]) -> PredictOptions:
        """A copy with ``settings`` applied by name, to these fields or to ``extraction``'s."""
        own = {f.name for f in dataclasses.fields(self)}
        ext = {k: v for k, v in settings.items() if k not in own}
        mine = {k: v for k, v in settings.items() if k in own}
        return dataclasses.replace(self, **mine, extraction=dataclasses.replace(self.extraction, **ext))


def predict(
    support: Sequence[tuple[str, str]],
    query: Sequence[tuple[str, str | None]],
    backbone: str,
    settings: PredictOptions | None = None,
    *,
    on_event: OnEvent = ignore,
    progress_factory: Any = None,
    **overrides: Any,
) -> Prediction:
    """Classify ``query`` images given the labelled ``support`` images.

    Args:
        support: ``[(image path, class)]``, at least two classes, any number of images per class.
        query: ``[(image path, label or None)]``; labels (all or none) turn on accuracy reporting
            and must be support classes.
        backbone: as for ``poodle extract``.
        settings: a :class:`PredictOptions`; ``overrides`` set its fields, or those of its
            ``extraction``, by name (``predict(s, q, "conv4_64", method="poodle", image_size=32)``).
        on_event: receives :class:`poodle.events.Notice` events (``features``: a split's features
            were extracted or reused; ``image-size``; ``preprocess-fallback``).
        progress_factory: as for :func:`poodle.extract.extract`.
    """
    opts = (settings or PredictOptions()).with_settings(overrides)
    task = make_task(support, query)
    solving = make_solving(opts.method, opts.options, opts.negatives, opts.negatives_from, opts.n_neg, opts.preprocess)
    sha = _weights_digest(backbone, opts.extraction)
    base_attrs = _pool_attrs(solving, backbone, sha)
    extraction = _pool_image_size(opts.extraction, base_attrs, solving, on_event)
    path, s, q = _task_features(
        task, backbone, sha, extraction, opts.cache_dir, base_attrs, solving, on_event, progress_factory
    )
    probs = solve_task(s, q, solving, extraction.device, on_event)
    pred = probs.argmax(-1)
    result = Prediction(
        paths=[p for p, _ in task.query],
        classes=task.classes,
        probs=probs,
        predictions=pred,
        support_counts=torch.bincount(s.labels, minlength=len(task.classes)).tolist(),
        method=solving.method,
        options=dict(opts.options),
        cache=str(path) if opts.cache_dir is not None else None,
        labels=task.labels,
    )
    if task.labels is not None:
        correct = sum(1 for i, y in enumerate(task.labels) if task.classes[int(pred[i])] == y)
        result.accuracy = correct / len(task.labels)
        result.ci95 = wilson_interval(correct, len(task.labels))
    return result


def _pool_image_size(
    extraction: ExtractOptions, base_attrs: dict[str, Any], solving: Solving, on_event: OnEvent
) -> ExtractOptions:
    """``extraction`` with the image size of the negative pool's features when none is given: the
    images must go through the transform those features were made with (a checkpoint trained at
    28 px fed the default 84 px crops gives features of another kind)."""
    known = base_attrs.get("transform", "none") != "none"  # "none": imported features, no transform known
    if not known or extraction.image_size is not None or not isinstance(base_attrs.get("image_size"), numbers.Integral):
        return extraction
    size = int(base_attrs["image_size"])
    pool = Path(solving.negatives_from or "").name
    on_event(Notice("image-size", f"image size {size} px, as the features of {pool}", ("image_size",)))
    return dataclasses.replace(extraction, image_size=size)


def _task_features(
    task: Task,
    backbone: str,
    sha: str,
    extraction: ExtractOptions,
    cache_dir: str | os.PathLike | None,
    base_attrs: dict[str, Any],
    solving: Solving,
    on_event: OnEvent,
    progress_factory: Any = None,
) -> tuple[Path, SplitFeatures, SplitFeatures]:
    """The features of the task's images: two splits, ``support`` and ``query``, of a cache named
    after the image lists (kept in ``cache_dir``, else in a temporary folder)."""
    q_items = [(p, y if y is not None else UNLABELLED) for p, y in task.query]
    lists = {"support": task.support, "query": q_items}
    n_query_classes = len(set(task.labels)) if task.labels is not None else 0

    def extract_event(event: Event) -> None:
        # said in predict's terms (the query split of unlabelled images has one placeholder class),
        # without naming a temporary cache that is deleted before the command ends (the caller says
        # whether the features are kept)
        if isinstance(event, SplitReused):
            on_event(Notice("features", f"{event.split}: already complete in {event.path}, skipped"))
        if not isinstance(event, SplitWritten):
            return
        if event.split == "support":
            what = f"{count(len(task.support), 'image')} of {count(len(task.classes), 'class')}"
        elif task.labels is None:
            what = count(len(task.query), "unlabelled image")
        else:
            what = f"{count(len(task.query), 'labelled image')} of {count(n_query_classes, 'class')}"
        on_event(Notice("features", f"{event.split}: {what}, features extracted"))

    tag = content_hash([lists, sha, extraction.image_size, extraction.crop_pct, extraction.interpolation])[:16]
    with contextlib.ExitStack() as stack:
        root = cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="poodle-predict-"))
        try:
            path = extract(
                "predict",
                backbone,
                # record=False: a task's images are not the cache a later `poodle solve` should take
                dataclasses.replace(extraction, splits=("support", "query"), cache_root=root, tag=tag, record=False),
                on_event=extract_event,
                progress_factory=progress_factory,
                source=ListSource(lists),
            )
        except DataError as e:  # predict has no skip_bad: every image must decode
            raise DataError(e.marked_message, params=e.params, param=e.param, value=e.value) from None
        _check_transform(path, base_attrs, solving)
        s, q = read_split(path, "support"), read_split(path, "query")
    # The splits' classes are sorted names: support's are exactly the task's classes.
    if s.classes != task.classes:
        # not a caller's value: predict wrote this cache itself, from the same image list
        raise CacheError(f"{path}: support classes {s.classes} differ from the image list's {task.classes}")
    # rows come back in the image-list order (extract writes them in order; nothing is skipped here)
    if s.paths is None or q.paths is None or len(q) != len(task.query) or len(s) != len(task.support):
        # not a caller's value: predict wrote this cache itself, from the same image list
        raise CacheError(f"{path}: expected {len(task.support)} support and {len(task.query)} query rows")
    return path, s, q


def _check_transform(path: Path, base_attrs: dict[str, Any], solving: Solving) -> None:
    """The task's features went through the transform of the negative pool's (when it is known)."""
    if base_attrs.get("transform", "none") == "none":
        return
    ours, theirs = read_attrs(path).get("transform"), base_attrs.get("transform")
    if ours != theirs:
        raise ConfigError(
            f"the images went through '{ours}', but the features of {mark('negatives_from')} {solving.negatives_from} "
            f"through '{theirs}': give the same {mark('image_size')} (and {mark('crop_pct')} / "
            f"{mark('interpolation')}) "
            f"as that cache, or leave them out to take its own",
            params=("negatives_from", "image_size", "crop_pct", "interpolation"),
            param="negatives_from",
            value=solving.negatives_from,
        )


def write_csv(result: Prediction, path: str | os.PathLike) -> Path:
    """``path,prediction,confidence,prob_<class>...`` (one row per query, in order, LF line endings),
    atomically."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")  # LF on every platform (the csv module's default is CRLF)
        w.writerow(["path", "prediction", "confidence"] + [f"prob_{c}" for c in result.classes])
        conf = result.confidence.tolist()
        for i, p in enumerate(result.paths):
            k = int(result.predictions[i])
            w.writerow([p, result.classes[k], f"{conf[i]:.6f}"] + [f"{v:.6f}" for v in result.probs[i].tolist()])
    return path


__all__ = [
    "ListSource",
    "PredictOptions",
    "Prediction",
    "predict",
    "query_from_csv",
    "query_from_folder",
    "support_from_csv",
    "support_from_folder",
    "wilson_interval",
    "write_csv",
]
