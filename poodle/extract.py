"""Stage 1: images -> backbone features -> the HDF5 feature cache, streaming and resumable.

:func:`extract` reads every requested split of a dataset with a torch DataLoader (decoding in
worker processes), runs the backbone's ``forward_features`` in eval mode without autocast or TF32
(features must be exact), and streams each batch into a staging file of the split, so memory does
not grow with the dataset. A split enters the cache (``<cache-root>/<dataset>/<backbone>[-<tag>].h5``)
only when it is complete; an interrupted run resumes from the last written batch. The order of
work puts the cheap checks first: options, backbone name, split files and image existence, the
checkpoint file and an existing cache's provenance, and only then the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence, cast

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from poodle import backbones, defaults, distributed, interrupt, project
from poodle import cache_shares as cs
from poodle.backbones.checkpoint import checkpoint_digest
from poodle.backbones.external import INTERPOLATIONS
from poodle.backbones.pretrained import resolve_pretrained
from poodle.cache import (
    FEATURE_DTYPES,
    SplitWriter,
    identity_mismatches,
    make_root_attrs,
    partial_path,
    read_attrs,
    samples_digest,
)
from poodle.data import ImageDataset, PixelCache, resolve_dataset
from poodle.data.transforms import eval_transform, native_eval_transform
from poodle.errors import CacheError, CheckpointError, ConfigError, DataError, mark
from poodle.events import Notice, OnEvent, SplitResumed, SplitReused, SplitWritten, ignore
from poodle.options import check_group, option
from poodle.utils import check_writable_dir

ProgressFactory = Callable[[str, int], ContextManager[Callable[[int], None]]]


def cache_path(cache_root: str | os.PathLike, dataset: str, backbone: str, tag: str | None = None) -> Path:
    """``<cache_root>/<dataset>/<backbone>[-<tag>].h5``, where :func:`extract` writes."""
    name = f"{backbone}-{tag}" if tag else backbone
    for part, what in ((dataset, "dataset"), (name, "backbone/tag")):
        if not part or "/" in part or "\\" in part or part in (".", ".."):
            raise ConfigError(
                f"{what} {part!r} cannot be used in a file name", param=what.partition("/")[0], value=part
            )
    return Path(cache_root) / dataset / f"{name}.h5"


def default_workers() -> int:
    """DataLoader workers when none are asked for: one per usable core (shared among torchrun's
    processes on the node; :func:`poodle.system.default_workers`), at most 8."""
    from poodle.system import EXTRACT_WORKERS
    from poodle.system import default_workers as per_core

    return per_core(EXTRACT_WORKERS)


def _parse_splits(splits: Sequence[str] | str) -> list[str]:
    items = splits.split(",") if isinstance(splits, str) else list(splits)
    out: list[str] = []
    for s in (x.strip() for x in items):
        if not s:
            continue
        if s not in out:
            out.append(s)
    if not out:
        raise ConfigError.bad_value("splits", splits, "names no split (e.g. train,val,test)")
    return out


@contextlib.contextmanager
def _no_progress(desc: str, total: int) -> Iterator[Callable[[int], None]]:
    yield lambda n: None


@contextlib.contextmanager
def _exact_math(device: torch.device) -> Iterator[None]:
    # TF32 convolutions are cuDNN's default on Ampere+ GPUs; they would change the cached features.
    if device.type == "cuda":
        with torch.backends.cudnn.flags(
            enabled=torch.backends.cudnn.enabled,
            benchmark=torch.backends.cudnn.benchmark,
            deterministic=torch.backends.cudnn.deterministic,
            allow_tf32=False,
        ):
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                yield
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
    else:
        yield


@dataclass(frozen=True)
class ExtractOptions:
    """How :func:`extract` reads, computes and stores features (every field has a default).

    Attributes:
        data_root: folder of the dataset (``None`` for the embedded ``glyphs``).
        checkpoint: weights to load (strictly); without one (nor ``pretrained``) the backbone keeps
            its random initialisation, drawn from seed 0, and the cache records ``checkpoint_sha256="none"``.
        pretrained: a torchvision/timm model's own weights, from its library's cache or downloaded
            there (True or ``"DEFAULT"``: the default ones; torchvision: or a weights enum member's
            name; :func:`poodle.backbones.pretrained.resolve_pretrained`). They load as a checkpoint
            of that file does, and the cache records where they came from besides their sha256.
        splits: the splits to extract (a sequence, or one comma-separated string).
        image_size: side of the centre crop fed to the backbone (the paper: 84). None: 84, or the
            images' own side for datasets of one size (32 for cifar-fs and fc100), which are then fed
            as they are, without resizing or cropping; a torchvision/timm model's own input size.
        batch_size: images per forward pass.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        cache_root: the cache is ``<cache_root>/<dataset>/<backbone>[-<tag>].h5`` (:func:`cache_path`).
        tag: distinguishes caches of one backbone made otherwise (another checkpoint, image size).
        dtype: float32 or float16, the storage type of the features.
        workers: DataLoader worker processes (None: :func:`default_workers`; 0 decodes in-process).
        force: recompute complete splits, and replace a cache made by another backbone, checkpoint,
            image size or transform, or a file that is not a cache, instead of refusing.
        skip_bad: leave out images that do not decode (recorded in the split's ``skipped`` attribute)
            instead of stopping with a DataError.
        cub_split: ``release`` (100/50/50) or ``140-30-30`` for ``dataset="cub"``; the latter is
            cached as dataset ``cub-140-30-30``.
        class_split: for ``dataset="folder"``, class folders ``<data_root>/<class>/`` split by class
            lists: a shipped split (``md-ilsvrc``, ... :data:`poodle.data.sources.CLASS_SPLITS`) or a
            folder of ``train.txt``/``val.txt``/``test.txt``; cached as dataset ``<class_split>``.
        crop_pct, interpolation: override the crop fraction (crop / resize) and the resize
            interpolation of a torchvision/timm model's evaluation transform.
        record: enter the cache in ``<cache_root>/caches.json`` when it is complete, so that
            ``poodle solve`` without a cache takes it (:func:`poodle.project.latest_cache`).
    """

    data_root: str | os.PathLike | None = None
    checkpoint: str | os.PathLike | None = None
    pretrained: bool | str | None = None
    splits: Sequence[str] | str = defaults.SPLITS
    image_size: int | None = option(
        None,
        min=1,
        help="Centre-crop side fed to the backbone [default: 84 for the release's backbones, resized "
        "first to size*256/224; cifar-fs and fc100: 32, their images as they are; a torchvision/timm "
        "model's own input size].",
    )
    batch_size: int = option(defaults.EXTRACT_BATCH_SIZE, min=1, help="Images per forward pass.")
    device: str | torch.device = defaults.DEVICE
    cache_root: str | os.PathLike = defaults.CACHE_ROOT
    tag: str | None = None
    dtype: str = option(defaults.FEATURE_DTYPE, choices=tuple(FEATURE_DTYPES), help="Storage type of the features.")
    workers: int | None = option(
        None, min=0, help="DataLoader worker processes decoding images [default: one per usable core, at most 8]."
    )
    force: bool = False
    skip_bad: bool = False
    cub_split: str = defaults.CUB_SPLIT
    class_split: str | None = None
    crop_pct: float | None = option(
        None, min=0, max=1, min_open=True, help="torchvision/timm: crop side / resize side [default: the model's]."
    )
    interpolation: str | None = option(
        None, choices=INTERPOLATIONS, help="torchvision/timm: resize interpolation [default: the model's]."
    )
    record: bool = True

    def check(self, dataset: str) -> None:
        """ConfigError for a value no dataset or backbone could take."""
        if self.pretrained and self.checkpoint is not None:
            raise ConfigError(
                f"give {mark('checkpoint')} or {mark('pretrained')}, not both",
                param="checkpoint",
                value=self.checkpoint,
            )
        check_group(self, ConfigError)
        if self.cub_split != defaults.CUB_SPLIT and dataset != "cub":
            raise ConfigError(
                f"{mark('cub_split')} {self.cub_split} is an option of {mark('dataset')} cub, not {dataset}",
                param="cub_split",
                value=self.cub_split,
            )
        if self.class_split is not None and dataset != "folder":
            raise ConfigError(
                f"{mark('class_split')} {self.class_split} is an option of {mark('dataset')} folder, not {dataset}",
                param="class_split",
                value=self.class_split,
            )


@dataclass
class _Model:
    """The backbone to run, before it is built: its name, how to build it, its transform (for
    external models) and the smallest input side it takes."""

    name: str
    build: Callable[[], backbones.Backbone]
    transform: Any
    image_size: int | None
    min_size: int


@dataclass(frozen=True)
class _Weights:
    """The checkpoint file to load (None: random weights) and where it came from (root attributes)."""

    checkpoint: str | os.PathLike | None = None
    origin: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass
class _Plan:
    """What one extraction writes: where, from which images, under which provenance, and which
    splits are left to do (``fresh``: the cache file is replaced, not added to)."""

    source: Any
    out: Path
    samples: dict[str, list[tuple[str, str]]]
    root_attrs: dict[str, Any]
    todo: list[str]
    fresh: bool


def extract(
    dataset: str,
    backbone: str,
    options: ExtractOptions | None = None,
    *,
    on_event: OnEvent = ignore,
    progress_factory: ProgressFactory | None = None,
    source: Any = None,
    pixel_cache: PixelCache | None = None,
    **settings: Any,
) -> Path:
    """Extract L2-normalised features of the splits of ``dataset`` with ``backbone`` into the cache.

    Args:
        dataset: csv, folder, mini, tiered, cub or glyphs (see :mod:`poodle.data.sources`).
        backbone: a name from :func:`poodle.backbones.available`, or ``torchvision:NAME`` /
            ``timm:NAME`` (any model of those libraries; see :mod:`poodle.backbones.external`).
        options: an :class:`ExtractOptions`; ``settings`` override its fields by name
            (``extract("glyphs", "conv4_64", image_size=28)``).
        on_event: receives :class:`poodle.events.SplitWritten`, ``SplitReused``, ``SplitResumed``
            and ``Notice`` events (on rank 0 under torchrun).
        progress_factory: ``(description, total) -> context manager yielding advance(n)``, entered
            once per split extracted.
        source: a :class:`poodle.data.DatasetSource` to read instead of resolving ``dataset``
            (``dataset`` then only names the cache; ``poodle predict`` passes its image lists).
        pixel_cache: a :class:`poodle.data.PixelCache` holding decoded images of these files (e.g.
            what :func:`poodle.train.train` decoded), read instead of decoding them again; it also
            takes the images decoded here, within its budget. None: every image is decoded.

    Under torchrun (``WORLD_SIZE`` > 1) every process calls this function; each extracts a share of
    every split and rank 0 merges them (:mod:`poodle.cache_shares`), reports and writes the cache.

    Returns:
        The cache path. Every requested split is complete in it.
    """
    opts = dataclasses.replace(options or ExtractOptions(), **settings)
    # Under torchrun every rank runs this function: the checks on every rank (they agree), the
    # writing of the final cache on rank 0 only, which alone reports (see poodle.distributed).
    d = distributed.init(opts.device)
    tell = on_event if d.main else ignore
    progress_factory = (progress_factory or _no_progress) if d.main else _no_progress
    with d.guard():
        opts.check(dataset)
        model_spec = _model_spec(backbone, opts)
        trouble = project.check_index(opts.cache_root) if opts.record else None
    if trouble:
        tell(Notice("index-restarted", f"{trouble}: it is started anew with this cache", ()))
    weights = _weights(d, model_spec.name, opts)
    plan = _plan(d, dataset, model_spec, opts, source, tell, weights)
    if not plan.todo:
        _record(d, opts, plan)
        return plan.out
    with d.guard():
        try:
            model = _load_model(model_spec, weights.checkpoint, d.device)
        except CheckpointError as e:
            if not weights.origin:
                raise
            # a pretrained file found in timm's / torch hub's cache: damaged (a copy cut short) or foreign
            hint = "it is in the library's cache: delete it and run again to download it anew"
            raise CheckpointError(
                e.marked_message, params=e.params, hint=hint, param="pretrained", value=weights.checkpoint
            ) from None
    workers = default_workers() if opts.workers is None else int(opts.workers)
    run = _Run(d, model, opts, workers, progress_factory, tell)
    for split in plan.todo:
        ds = ImageDataset(plan.source, split, model_spec.transform, on_error="sentinel", uint8=True, cache=pixel_cache)
        if d.enabled or cs.share_files(plan.out, split):
            run.shared(ds, plan, split)
        else:
            run.alone(ds, plan, split)
        plan.fresh = False
    _record(d, opts, plan)
    return plan.out


def check_options(dataset: str, backbone: str, options: ExtractOptions) -> None:
    """The checks of :func:`extract`'s options that need no data and no model (the options' bounds
    and combinations, the backbone's image-size rules, a checkpoint file that is not there), for a
    caller that works before calling it: ``poodle extract`` generates the glyphs (minutes) only
    after these pass. Raises ConfigError or CheckpointError."""
    from poodle.utils import resolve_path

    options.check(dataset)
    _model_spec(backbone, options)
    if options.checkpoint is not None:
        ck = resolve_path(Path(options.checkpoint).expanduser(), "checkpoint")
        if not ck.is_file():
            raise CheckpointError(f"{mark('checkpoint')} {ck} does not exist", param="checkpoint", value=ck)


def _weights(d: Any, backbone: str, opts: ExtractOptions) -> _Weights:
    """The checkpoint, or the file of the pretrained weights (found in, or downloaded into, the
    library's cache by rank 0 first, so that torchrun's processes do not all fetch it)."""
    if not opts.pretrained:
        return _Weights(opts.checkpoint)
    found = None
    with d.guard():
        if d.main:
            found = resolve_pretrained(backbone, opts.pretrained)
    with d.guard():
        if found is None:
            found = resolve_pretrained(backbone, opts.pretrained)
    return _Weights(found.path, dict(found.origin))


def _record(d: Any, opts: ExtractOptions, plan: _Plan) -> None:
    """The cache is complete: it becomes the one extract wrote last under the cache root."""
    if opts.record and d.main:
        project.record_cache(opts.cache_root, plan.out, plan.root_attrs)


def _model_spec(backbone: str, opts: ExtractOptions) -> _Model:
    """The backbone's name, builder and transform; the image-size rules of its kind."""
    if backbones.is_external(backbone):
        # torchvision:/timm: models: the model's own evaluation transform (options override it)
        ts = backbones.eval_transform_spec(
            backbone, image_size=opts.image_size, crop_pct=opts.crop_pct, interpolation=opts.interpolation
        )
        return _Model(backbone, lambda: backbones.build_external(backbone, image_size=ts.crop), ts.build(), ts.crop, 1)
    spec = backbones.get_spec(backbone)
    if opts.crop_pct is not None or opts.interpolation is not None:
        raise ConfigError(
            f"{mark('crop_pct')} and {mark('interpolation')} apply to torchvision:/timm: backbones; {spec.name} "
            "uses the release's transform (resize to size*256/224, bilinear)",
            param="crop_pct",
            value=opts.crop_pct,
        )
    if opts.image_size is not None and opts.image_size < spec.min_input_size:
        raise ConfigError.bad_value("image_size", opts.image_size, f"must be >= {spec.min_input_size} for {spec.name}")
    return _Model(spec.name, lambda: backbones.build(spec.name), None, opts.image_size, spec.min_input_size)


def _plan(
    d: Any, dataset: str, model: _Model, opts: ExtractOptions, given_source: Any, tell: OnEvent, weights: _Weights
) -> _Plan:
    """The data (split files, rows, images exist, no empty class), the output place, the checkpoint's
    digest and what an existing cache already holds: every check that needs no model."""
    stem = backbones.external.file_stem(model.name)
    # rank 0 first: the glyphs may be generated
    source = given_source
    with d.guard():
        if d.main and source is None:
            source = resolve_dataset(
                dataset, opts.data_root, Path(opts.cache_root), cub_split=opts.cub_split, class_split=opts.class_split
            )
    with d.guard():
        if source is None:
            source = resolve_dataset(
                dataset, opts.data_root, Path(opts.cache_root), cub_split=opts.cub_split, class_split=opts.class_split
            )
        if given_source is None:
            dataset = source.name  # e.g. cub-140-30-30: another split is another dataset in the cache
        out = cache_path(opts.cache_root, dataset, stem, opts.tag)
        # the output place, before any work: a directory in the way, or a place we cannot write,
        # would otherwise surface only when the first split is committed
        if out.is_dir():
            raise CacheError(
                f"cache path {out} is a directory",
                params=("cache_root", "tag"),
                hint=f"remove it or choose another {mark('tag')}",
                param="cache_root",
                value=out,
            )
        check_writable_dir(out, "cache", param="cache_root")
        image_size = _image_size(model, source, dataset)
        split_list = _parse_splits(opts.splits)
        samples = {s: source.samples(s) for s in split_list}
        root_attrs = make_root_attrs(
            dataset,
            model.name,
            checkpoint_sha256=checkpoint_digest(weights.checkpoint),
            image_size=image_size,
            transform=cast(Any, model.transform).description,
            weights=weights.origin,
            data_root=str(Path(source.root).resolve()),
        )
        fresh, done = _existing(out, root_attrs, split_list, samples, opts, tell)
    return _Plan(source, out, samples, root_attrs, [s for s in split_list if s not in done], fresh)


def _image_size(model: _Model, source: Any, dataset: str) -> int:
    """The crop side: the option's, else the images' own side (datasets of one size), the dataset's
    (glyphs: 28, as they are drawn and the demo trains) or 84; and the model's transform made for it
    (the release's backbones)."""
    native = getattr(source, "native_size", None)
    size = model.image_size
    if size is None:
        size = native or defaults.DATASET_IMAGE_SIZES.get(dataset, defaults.IMAGE_SIZE)
        if size < model.min_size:
            raise ConfigError(
                f"backbone {model.name} needs an {mark('image_size')} >= {model.min_size}; {dataset}'s images "
                f"are {size} px",
                param="image_size",
                value=size,
            )
    if model.transform is None:
        model.transform = native_eval_transform(size) if size == native else eval_transform(size)
    return size


def _existing(
    out: Path,
    root_attrs: dict[str, Any],
    split_list: list[str],
    samples: dict[str, list[tuple[str, str]]],
    opts: ExtractOptions,
    tell: OnEvent,
) -> tuple[bool, set[str]]:
    """``(fresh, done)``: whether ``out`` is to be replaced, and the splits it already holds.
    Refuses what would mix features of different provenance."""
    if not out.exists():
        return False, set()
    hint = f"{mark('force')} replaces it; a {mark('tag')} writes another file"
    try:
        attrs = read_attrs(out)
    except CacheError as e:
        if not opts.force:
            raise CacheError(
                e.marked_message, params=("force", "tag"), hint=hint, param="cache_root", value=out
            ) from None
        tell(Notice("cache-replaced", f"{out} is not a poodle cache: replacing it ({mark('force')})", ("force",)))
        return True, set()
    mism = identity_mismatches(attrs, root_attrs)
    if mism and not opts.force:
        raise CacheError(
            f"{out} holds features made with {'; '.join(mism)}",
            params=("force", "tag"),
            hint=hint,
            param="cache_root",
            value=out,
        )
    if mism:
        tell(
            Notice("cache-replaced", f"{out} was made with other settings: replacing it ({mark('force')})", ("force",))
        )
        return True, set()
    return False, _complete_splits(out, split_list, samples, opts, tell)


def _load_model(model: _Model, checkpoint: str | os.PathLike | None, dev: torch.device) -> backbones.Backbone:
    # Without a checkpoint the weights are random: seed them, so a resumed split is made by the same
    # network as its first part (and two runs, or two ranks, agree).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = model.build()
    if checkpoint is not None:
        backbones.load_checkpoint(net, checkpoint)
    net.eval().to(dev)
    if _nhwc(dev):
        net.to(memory_format=torch.channels_last)
    return net


@dataclass
class _Run:
    """One extraction's model and settings, applied to each split in turn."""

    d: Any
    model: backbones.Backbone
    opts: ExtractOptions
    workers: int
    progress_factory: ProgressFactory
    tell: OnEvent

    def alone(self, ds: Any, plan: _Plan, split: str) -> None:
        """One split in this process, through a resumable staging file."""
        classes = plan.source.classes(split)
        with SplitWriter(
            plan.out,
            split,
            root_attrs=plan.root_attrs,
            classes=classes,
            samples_sha256=samples_digest(plan.samples[split]),
            n_total=len(ds),
            dim=self.model.feature_dim,
            dtype=self.opts.dtype,
            restart=self.opts.force,
        ) as writer:
            if writer.resumed:
                self.tell(SplitResumed(split, writer.n_consumed, len(ds)))
            self.run_split(ds, writer, self.progress_factory)
            _check_no_empty_class(split, classes, writer.class_counts())
            n_skipped = writer.n_consumed - writer.n_rows
            writer.commit(fresh=plan.fresh)
        self.tell(SplitWritten(split, plan.out, len(ds) - n_skipped, len(classes), n_skipped))

    def shared(self, ds: Any, plan: _Plan, split: str) -> None:
        """One split across the ranks: plan on rank 0, a share per rank, merge on rank 0."""
        d, opts = self.d, self.opts
        n, dim = len(ds), int(cast(int, self.model.feature_dim))
        digest = samples_digest(plan.samples[split])
        key = cs.share_key(digest, n, dim, opts.dtype, plan.root_attrs, opts.batch_size)
        pieces = None
        with d.guard():
            if d.main:
                pieces = self._plan_shares(plan.out, split, key, n)
        pieces = d.broadcast_json(pieces)
        with d.guard():
            mine = [(int(a), int(b)) for a, b in pieces[d.rank]]
            desc = split if d.world == 1 else f"{split} (rank 0 of {d.world})"
            with self.progress_factory(desc, sum(b - a for a, b in mine)) as advance:
                for a, b in mine:
                    with cs.ShareWriter(
                        plan.out,
                        split,
                        a,
                        b,
                        key=key,
                        root_attrs=plan.root_attrs,
                        classes=ds.classes,
                        dim=dim,
                        dtype=opts.dtype,
                    ) as writer:
                        self.run_split(ds, writer, lambda _desc, _total: contextlib.nullcontext(advance))
        with d.guard():
            if d.main:
                covered, _ = cs.scan(plan.out, split, key)
                _check_no_empty_class(split, ds.classes, cs.class_counts(covered, split, len(ds.classes)))
                rows, skipped = cs.commit_shares(
                    plan.out,
                    split,
                    covered,
                    n_split=n,
                    batch_size=opts.batch_size,
                    root_attrs=plan.root_attrs,
                    classes=ds.classes,
                    dim=dim,
                    dtype=opts.dtype,
                    samples_sha256=digest,
                    fresh=plan.fresh,
                )
                self.tell(SplitWritten(split, plan.out, rows, len(ds.classes), skipped, d.world))

    def _plan_shares(self, out: Path, split: str, key: Any, n: int) -> Any:
        """Rank 0: the row ranges of every rank, after what staged files already hold."""
        if self.opts.force:
            for p in [*cs.share_files(out, split), partial_path(out, split)]:
                p.unlink(missing_ok=True)
        covered, stale = cs.scan(out, split, key)
        for p in stale:
            p.unlink()
        staged = sum(c.consumed for c in covered)
        if staged:
            self.tell(SplitResumed(split, staged, n, len(covered)))
        return cs.plan(covered, n, self.opts.batch_size, self.d.world)

    def run_split(self, ds: Any, writer: SplitWriter, progress_factory: ProgressFactory) -> None:
        _run_split(
            self.model,
            ds,
            writer,
            self.d.device,
            self.opts.batch_size,
            self.workers,
            self.opts.skip_bad,
            progress_factory,
        )


def _check_no_empty_class(split: str, classes: Sequence[str], counts: np.ndarray) -> None:
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise DataError(
            f"split {split}: class {classes[int(empty[0])]!r} has no images left after skipping unreadable ones",
            param="split",
            value=split,
        )


def _complete_splits(
    out: Path,
    split_list: list[str],
    samples: dict[str, list[tuple[str, str]]],
    opts: ExtractOptions,
    tell: OnEvent,
) -> set[str]:
    """Requested splits already complete in ``out`` and made from the same images; refuse a mismatch."""
    done = set()
    with h5py.File(out, "r") as f:
        for s in split_list:
            g = f.get(s)
            if not isinstance(g, h5py.Group) or not bool(g.attrs.get("complete", False)):
                continue
            if opts.force:
                tell(Notice("split-recomputed", f"{s}: recomputing ({mark('force')})", ("force",)))
                continue
            problems, params = [], ["force", "tag"]
            if "features" in g and str(g["features"].dtype) != opts.dtype:
                problems.append(f"is stored as {g['features'].dtype} (this run: {mark('dtype')} {opts.dtype})")
                params.append("dtype")
            digest = g.attrs.get("samples_sha256")
            if digest is not None:
                digest = digest.decode() if isinstance(digest, bytes) else str(digest)
                if digest != samples_digest(samples[s]):
                    problems.append("was made from a different image list")
            if problems:
                raise CacheError(
                    f"{out}: split {s!r} {' and '.join(problems)}",
                    params=tuple(params),
                    hint=f"{mark('force')} recomputes it; a {mark('tag')} writes another file",
                    param="cache_root",
                    value=out,
                )
            done.add(s)
            tell(SplitReused(s, out))
    return done


def _nhwc(dev: torch.device) -> bool:
    # oneDNN's channels-last convolutions: conv4_64 at 28 px extracts 1.7x the images per second of
    # channels-first on 2 cores (docs/stage1.md). The features move by float rounding only (2.8e-7 at
    # most on unit vectors), and depend on the batch exactly as channels-first ones do. On CUDA the
    # layout is left to the user's model: NHWC pays there only with tensor cores, which exact
    # (fp32, no TF32) extraction does not use.
    return dev.type == "cpu"


def _run_split(
    model: torch.nn.Module,
    ds: Any,
    writer: SplitWriter,
    dev: torch.device,
    batch_size: int,
    workers: int,
    skip_bad: bool,
    progress_factory: ProgressFactory,
) -> None:
    # A share writer (poodle.cache_shares) holds rows [writer.start, writer.stop) of the split.
    offset = getattr(writer, "start", 0)
    start, n = offset + writer.n_consumed, offset + writer.n_total
    if start >= n:
        return
    loader = DataLoader(
        Subset(ds, range(start, n)),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        pin_memory=dev.type == "cuda",
        worker_init_fn=interrupt.quiet_worker if workers > 0 else None,
    )
    pos = start
    desc = ds.split if start == offset else f"{ds.split} (resumed)"
    # Fork the workers while the staging file is closed: they would inherit its lock otherwise.
    writer.close()
    with interrupt.loader_batches(loader) as batches:
        writer.reopen()
        _stage_batches(model, ds, writer, dev, skip_bad, progress_factory(desc, n - start), batches, pos)


def _stage_batches(
    model: torch.nn.Module,
    ds: Any,
    writer: SplitWriter,
    dev: torch.device,
    skip_bad: bool,
    progress: Any,
    batches: Iterator[Any],
    pos: int,
) -> None:
    """Features of every batch of ``batches`` appended to ``writer``; ``pos``: the first row's index."""
    with progress as advance, torch.inference_mode(), _exact_math(dev):
        for x, y in batches:
            b = int(y.shape[0])
            bad = set(ds.bad_indices(y))
            if bad and not skip_bad:
                err = ds.error(min(bad))
                raise DataError(
                    str(err),
                    hint=f"{mark('skip_bad')} leaves unreadable images out",
                    param="skip_bad",
                    value=skip_bad,
                ) from None
            good = [i for i in range(pos, pos + b) if i not in bad]
            if bad:
                keep = y >= 0
                x, y = x[keep], y[keep]
            if len(good):
                # uint8 [b, 3, H, W] -> float32 on the device: the values the per-image transform gives
                x = ds.finish(x.to(dev, non_blocking=True))
                if _nhwc(dev):
                    x = x.contiguous(memory_format=torch.channels_last)
                forward_features = cast(Callable[[torch.Tensor], torch.Tensor], model.forward_features)
                feats = forward_features(x).float().cpu()
            else:
                feats = torch.zeros(0, writer.dim)
            writer.append(
                feats.numpy(),
                y.numpy(),
                [ds.samples[i][0] for i in good],
                n_consumed=b,
                skipped=[ds.samples[i][0] for i in sorted(bad)],
            )
            pos += b
            advance(b)
            interrupt.check()  # a safe point: the batch is staged (see poodle.interrupt)
