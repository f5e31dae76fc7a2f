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
import os
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence, cast

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from poodle import backbones, distributed
from poodle import cache_shares as cs
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
from poodle.errors import CacheError, CheckpointError, ConfigError, DataError
from poodle.utils import check_writable_dir, count, file_sha256

ProgressFactory = Callable[[str, int], ContextManager[Callable[[int], None]]]


def cache_path(cache_root: str | os.PathLike, dataset: str, backbone: str, tag: str | None = None) -> Path:
    """``<cache_root>/<dataset>/<backbone>[-<tag>].h5``, where :func:`extract` writes."""
    name = f"{backbone}-{tag}" if tag else backbone
    for part, what in ((dataset, "dataset"), (name, "backbone/tag")):
        if not part or "/" in part or "\\" in part or part in (".", ".."):
            raise ConfigError(f"{what} {part!r} cannot be used in a file name")
    return Path(cache_root) / dataset / f"{name}.h5"


def default_workers() -> int:
    """DataLoader workers when none are asked for: one per core (shared among torchrun's processes on
    the node), at most 8."""
    per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(0, min(8, (os.cpu_count() or 1) // per_node))


def _parse_splits(splits: Sequence[str] | str) -> list[str]:
    items = splits.split(",") if isinstance(splits, str) else list(splits)
    out: list[str] = []
    for s in (x.strip() for x in items):
        if not s:
            continue
        if s not in out:
            out.append(s)
    if not out:
        raise ConfigError("no splits given (e.g. --splits train,val,test)")
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


def extract(
    dataset: str,
    backbone: str,
    *,
    data_root: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    splits: Sequence[str] | str = ("train", "val", "test"),
    image_size: int | None = None,
    batch_size: int = 64,
    device: str | torch.device = "auto",
    cache_root: str | os.PathLike = "cache",
    tag: str | None = None,
    dtype: str = "float32",
    workers: int | None = None,
    force: bool = False,
    skip_bad: bool = False,
    progress_factory: ProgressFactory | None = None,
    log: Callable[[str], None] | None = None,
    cub_split: str = "release",
    crop_pct: float | None = None,
    interpolation: str | None = None,
    source: Any = None,
    pixel_cache: PixelCache | None = None,
) -> Path:
    """Extract L2-normalised features of ``splits`` of ``dataset`` with ``backbone`` into the cache.

    Args:
        dataset: csv, folder, mini, tiered, cub or glyphs (see :mod:`poodle.data.sources`).
        backbone: a name from :func:`poodle.backbones.available`, or ``torchvision:NAME`` /
            ``timm:NAME`` (any model of those libraries; see :mod:`poodle.backbones.external`).
        checkpoint: weights to load (strictly); without one the backbone keeps its random
            initialisation, drawn from seed 0, and the cache records ``checkpoint_sha256="none"``.
        image_size: side of the centre crop fed to the backbone (the paper: 84). None: 84, or the
            images' own side for datasets of one size (32 for cifar-fs and fc100), which are then fed
            as they are, without resizing or cropping.
        dtype: float32 or float16, the storage type of the features.
        workers: DataLoader worker processes (None: :func:`default_workers`; 0 decodes in-process).
        force: recompute complete splits, and replace a cache made by another backbone, checkpoint,
            image size or transform, or a file that is not a cache, instead of refusing.
        skip_bad: leave out images that do not decode (recorded in the split's ``skipped`` attribute)
            instead of stopping with a DataError.
        progress_factory: ``(description, total) -> context manager yielding advance(n)``, entered
            once per split extracted.
        log: receives one line per notable event (split skipped, resumed, written).
        cub_split: ``release`` (100/50/50) or ``140-30-30`` for ``dataset="cub"``; the latter is
            cached as dataset ``cub-140-30-30``.
        crop_pct, interpolation: override the crop fraction (crop / resize) and the resize
            interpolation of a torchvision/timm model's evaluation transform (whose input size is the
            default ``image_size`` then).
        source: a :class:`poodle.data.DatasetSource` to read instead of resolving ``dataset``
            (``dataset`` then only names the cache; ``poodle predict`` passes its image lists).
        pixel_cache: a :class:`poodle.data.PixelCache` holding decoded images of these files (e.g.
            what :func:`poodle.train.train` decoded), read instead of decoding them again; it also
            takes the images decoded here, within its budget. None: every image is decoded.

    Under torchrun (``WORLD_SIZE`` > 1) every process calls this function; each extracts a share of
    every split and rank 0 merges them (:mod:`poodle.cache_shares`), logs and reports progress.

    Returns:
        The cache path. Every requested split is complete in it.
    """
    # Under torchrun every rank runs this function: the checks on every rank (they agree), the
    # writing of the final cache on rank 0 only, which alone reports (see poodle.distributed).
    d = distributed.init(device)
    say = (log or (lambda msg: None)) if d.main else (lambda msg: None)
    progress_factory = (progress_factory or _no_progress) if d.main else _no_progress
    dev = d.device
    with d.guard():
        # -- options and names (cheap)
        if dtype not in FEATURE_DTYPES:
            raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(FEATURE_DTYPES)}")
        if (image_size is not None and image_size < 1) or batch_size < 1:
            raise ConfigError(f"image size and batch size must be positive, got {image_size} and {batch_size}")
        workers = default_workers() if workers is None else int(workers)
        if workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {workers}")
        split_list = _parse_splits(splits)
        if cub_split != "release" and dataset != "cub":
            raise ConfigError(f"--cub-split {cub_split} is an option of --dataset cub, not {dataset}")
        external = backbones.is_external(backbone)
        ext_tf = None
        if external:
            # torchvision:/timm: models: the model's own evaluation transform (options override it)
            ts = backbones.eval_transform_spec(
                backbone, image_size=image_size, crop_pct=crop_pct, interpolation=interpolation
            )
            ext_tf, image_size = ts.build(), ts.crop
            min_size = 1
            build: Callable[[], backbones.Backbone] = lambda: backbones.build_external(  # noqa: E731
                backbone, image_size=ts.crop
            )
        else:
            spec = backbones.get_spec(backbone)
            backbone = spec.name
            min_size = spec.min_input_size
            if crop_pct is not None or interpolation is not None:
                raise ConfigError(
                    f"--crop-pct and --interpolation apply to torchvision:/timm: backbones; {backbone} "
                    f"uses the release's transform (resize to size*256/224, bilinear)"
                )
            if image_size is not None and image_size < min_size:
                raise ConfigError(f"backbone {backbone} needs --image-size >= {min_size}, got {image_size}")
            build = lambda: backbones.build(backbone)  # noqa: E731
        stem = backbones.external.file_stem(backbone)
        out = cache_path(cache_root, dataset, stem, tag)
        given_source = source
        # -- data: split files, rows, images exist, no empty class (rank 0 first: glyphs may be generated)
        if d.main:
            source = given_source or resolve_dataset(dataset, data_root, Path(cache_root), cub_split=cub_split)
    with d.guard():
        if not d.main:
            source = given_source or resolve_dataset(dataset, data_root, Path(cache_root), cub_split=cub_split)
        if given_source is None:
            dataset = source.name  # e.g. cub-140-30-30: another split is another dataset in the cache
        out = cache_path(cache_root, dataset, stem, tag)
        # -- the output place, before any work: a directory in the way, or a place we cannot write,
        # would otherwise surface only when the first split is committed
        if out.is_dir():
            raise CacheError(f"cache path {out} is a directory; remove it or choose another --cache-root/--tag")
        check_writable_dir(out, "cache")
        native = getattr(source, "native_size", None)
        if image_size is None:
            image_size = native or 84
            if image_size < min_size:
                raise ConfigError(
                    f"backbone {backbone} needs --image-size >= {min_size}; {dataset}'s images are {image_size} px"
                )
        samples = {s: source.samples(s) for s in split_list}
        # -- checkpoint file
        sha = "none"
        if checkpoint is not None:
            ck = Path(checkpoint).expanduser()
            if not ck.is_file():
                raise CheckpointError(f"checkpoint {ck} does not exist")
            sha = file_sha256(ck)
        if ext_tf is not None:
            tf = ext_tf
        else:
            tf = native_eval_transform(image_size) if image_size == native else eval_transform(image_size)
        root_attrs = make_root_attrs(
            dataset,
            backbone,
            checkpoint_sha256=sha,
            image_size=image_size,
            transform=cast(Any, tf).description,
            data_root=str(Path(source.root).resolve()),
        )
        # -- the existing cache: refuse what would mix features of different provenance
        fresh, done = False, set()
        if out.exists():
            try:
                attrs = read_attrs(out)
            except CacheError as e:
                if not force:
                    raise CacheError(
                        f"{e}; pass --force to overwrite it, or --tag NAME to write another file"
                    ) from None
                fresh = True
                say(f"{out} is not a poodle cache: replacing it (--force)")
            else:
                mism = identity_mismatches(attrs, root_attrs)
                if mism and not force:
                    raise CacheError(
                        f"{out} holds features made with {'; '.join(mism)}; pass --force to replace "
                        f"it, or --tag NAME to write another file"
                    )
                if mism:
                    fresh = True
                    say(f"{out} was made with other settings: replacing it (--force)")
                else:
                    done = _complete_splits(out, split_list, samples, dtype, force, say)
        todo = [s for s in split_list if s not in done]
    if not todo:
        return out
    # -- the model (expensive)
    with d.guard():
        # Without a checkpoint the weights are random: seed them, so a resumed split is made by the same
        # network as its first part (and two runs, or two ranks, agree).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = build()
        if checkpoint is not None:
            backbones.load_checkpoint(model, checkpoint)
        model.eval().to(dev)
        if _nhwc(dev):
            model.to(memory_format=torch.channels_last)
    for split in todo:
        source_classes = source.classes(split)
        # uint8 items, converted and normalised per batch in _run_split
        ds = ImageDataset(source, split, tf, on_error="sentinel", uint8=True, cache=pixel_cache)
        if d.enabled or cs.share_files(out, split):
            _extract_shared(
                d,
                model,
                ds,
                out,
                split,
                samples_digest(samples[split]),
                root_attrs,
                dtype,
                batch_size,
                workers,
                skip_bad,
                progress_factory,
                say,
                fresh=fresh,
                force=force,
            )
            fresh = False
            continue
        with SplitWriter(
            out,
            split,
            root_attrs=root_attrs,
            classes=source_classes,
            samples_sha256=samples_digest(samples[split]),
            n_total=len(ds),
            dim=model.feature_dim,
            dtype=dtype,
            restart=force,
        ) as writer:
            if writer.resumed:
                say(f"{split}: resuming after image {writer.n_consumed} of {len(ds)}")
            _run_split(model, ds, writer, dev, batch_size, workers, skip_bad, progress_factory)
            counts = writer.class_counts()
            _check_no_empty_class(split, source_classes, counts)
            n_skipped = writer.n_consumed - writer.n_rows
            writer.commit(fresh=fresh)
        fresh = False
        say(
            f"{split}: {count(len(ds) - n_skipped, 'image')}, {count(len(source_classes), 'class')} written to {out}"
            + (f" ({count(n_skipped, 'unreadable image')} skipped)" if n_skipped else "")
        )
    return out


def _check_no_empty_class(split: str, classes: Sequence[str], counts: np.ndarray) -> None:
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise DataError(
            f"split {split}: class {classes[int(empty[0])]!r} has no images left after skipping unreadable ones"
        )


def _extract_shared(
    d: Any,
    model: torch.nn.Module,
    ds: Any,
    out: Path,
    split: str,
    digest: str,
    root_attrs: dict[str, Any],
    dtype: str,
    batch_size: int,
    workers: int,
    skip_bad: bool,
    progress_factory: ProgressFactory,
    say: Callable[[str], None],
    *,
    fresh: bool,
    force: bool,
) -> None:
    """One split across the ranks of ``d``: plan on rank 0, a share per rank, merge on rank 0."""
    n, dim = len(ds), int(cast(int, model.feature_dim))
    key = cs.share_key(digest, n, dim, dtype, root_attrs, batch_size)
    pieces = None
    with d.guard():
        if d.main:
            if force:
                for p in [*cs.share_files(out, split), partial_path(out, split)]:
                    p.unlink(missing_ok=True)
            covered, stale = cs.scan(out, split, key)
            for p in stale:
                p.unlink()
            staged = sum(c.consumed for c in covered)
            if staged:
                say(f"{split}: resuming, {staged} of {n} images already staged in {len(covered)} file(s)")
            pieces = cs.plan(covered, n, batch_size, d.world)
    pieces = d.broadcast_json(pieces)
    mine = [(int(a), int(b)) for a, b in pieces[d.rank]]
    with d.guard():
        total = sum(b - a for a, b in mine)
        desc = split if d.world == 1 else f"{split} (rank 0 of {d.world})"
        with progress_factory(desc, total) as advance:
            for a, b in mine:
                with cs.ShareWriter(
                    out, split, a, b, key=key, root_attrs=root_attrs, classes=ds.classes, dim=dim, dtype=dtype
                ) as writer:
                    _run_split(
                        model,
                        ds,
                        writer,
                        d.device,
                        batch_size,
                        workers,
                        skip_bad,
                        lambda _desc, _total: contextlib.nullcontext(advance),
                    )
    with d.guard():
        if d.main:
            covered, _ = cs.scan(out, split, key)
            _check_no_empty_class(split, ds.classes, cs.class_counts(covered, split, len(ds.classes)))
            rows, skipped = cs.commit_shares(
                out,
                split,
                covered,
                n_split=n,
                batch_size=batch_size,
                root_attrs=root_attrs,
                classes=ds.classes,
                dim=dim,
                dtype=dtype,
                samples_sha256=digest,
                fresh=fresh,
            )
            say(
                f"{split}: {count(rows, 'image')}, {count(len(ds.classes), 'class')} written to {out}"
                + (f" by {d.world} processes" if d.world > 1 else "")
                + (f" ({count(skipped, 'unreadable image')} skipped)" if skipped else "")
            )


def _complete_splits(
    out: Path,
    split_list: list[str],
    samples: dict[str, list[tuple[str, str]]],
    dtype: str,
    force: bool,
    say: Callable[[str], None],
) -> set[str]:
    """Requested splits already complete in ``out`` and made from the same images; refuse a mismatch."""
    done = set()
    with h5py.File(out, "r") as f:
        for s in split_list:
            g = f.get(s)
            if not isinstance(g, h5py.Group) or not bool(g.attrs.get("complete", False)):
                continue
            if force:
                say(f"{s}: recomputing (--force)")
                continue
            problems = []
            if "features" in g and str(g["features"].dtype) != dtype:
                problems.append(f"is stored as {g['features'].dtype} (this run: --dtype {dtype})")
            digest = g.attrs.get("samples_sha256")
            if digest is not None:
                digest = digest.decode() if isinstance(digest, bytes) else str(digest)
                if digest != samples_digest(samples[s]):
                    problems.append("was made from a different image list")
            if problems:
                raise CacheError(
                    f"{out}: split {s!r} {' and '.join(problems)}; pass --force to recompute it, "
                    f"or --tag NAME to write another file"
                )
            done.add(s)
            say(f"{s}: already complete in {out}, skipped")
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
    )
    pos = start
    desc = ds.split if start == offset else f"{ds.split} (resumed)"
    # Fork the workers while the staging file is closed: they would inherit its lock otherwise.
    writer.close()
    batches = iter(loader)
    writer.reopen()
    with progress_factory(desc, n - start) as advance, torch.inference_mode(), _exact_math(dev):
        for x, y in batches:
            b = int(y.shape[0])
            bad = set(ds.bad_indices(y))
            if bad and not skip_bad:
                err = ds.error(min(bad))
                raise DataError(f"{err} (--skip-bad leaves unreadable images out)") from None
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
