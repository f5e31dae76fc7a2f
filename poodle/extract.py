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
from typing import Any, Callable, ContextManager, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from poodle.cache import (FEATURE_DTYPES, SplitWriter, identity_mismatches, make_root_attrs, read_attrs,
                          samples_digest)
from poodle.errors import CacheError, CheckpointError, ConfigError, DataError

ProgressFactory = Callable[[str, int], ContextManager[Callable[[int], None]]]


def cache_path(cache_root: str | os.PathLike, dataset: str, backbone: str, tag: str | None = None) -> Path:
    """``<cache_root>/<dataset>/<backbone>[-<tag>].h5``, where :func:`extract` writes."""
    name = f"{backbone}-{tag}" if tag else backbone
    for part, what in ((dataset, "dataset"), (name, "backbone/tag")):
        if not part or "/" in part or "\\" in part or part in (".", ".."):
            raise ConfigError(f"{what} {part!r} cannot be used in a file name")
    return Path(cache_root) / dataset / f"{name}.h5"


def default_workers() -> int:
    """DataLoader workers when none are asked for: one per core, at most 8."""
    return max(0, min(8, (os.cpu_count() or 1)))


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
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled,
                                        benchmark=torch.backends.cudnn.benchmark,
                                        deterministic=torch.backends.cudnn.deterministic, allow_tf32=False):
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                yield
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
    else:
        yield


def extract(dataset: str, backbone: str, *, data_root: str | os.PathLike | None = None,
            checkpoint: str | os.PathLike | None = None,
            splits: Sequence[str] | str = ("train", "val", "test"), image_size: int = 84, batch_size: int = 64,
            device: str | torch.device = "auto", cache_root: str | os.PathLike = "cache", tag: str | None = None,
            dtype: str = "float32", workers: int | None = None, force: bool = False, skip_bad: bool = False,
            progress_factory: ProgressFactory | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Extract L2-normalised features of ``splits`` of ``dataset`` with ``backbone`` into the cache.

    Args:
        dataset: csv, folder, mini, tiered, cub or glyphs (see :mod:`poodle.data.sources`).
        backbone: a name from :func:`poodle.backbones.available`.
        checkpoint: weights to load (strictly); without one the backbone keeps its random
            initialisation, drawn from seed 0, and the cache records ``checkpoint_sha256="none"``.
        image_size: side of the centre crop fed to the backbone (the paper: 84).
        dtype: float32 or float16, the storage type of the features.
        workers: DataLoader worker processes (None: :func:`default_workers`; 0 decodes in-process).
        force: recompute complete splits, and replace a cache made by another backbone, checkpoint,
            image size or transform, or a file that is not a cache, instead of refusing.
        skip_bad: leave out images that do not decode (recorded in the split's ``skipped`` attribute)
            instead of stopping with a DataError.
        progress_factory: ``(description, total) -> context manager yielding advance(n)``, entered
            once per split extracted.
        log: receives one line per notable event (split skipped, resumed, written).

    Returns:
        The cache path. Every requested split is complete in it.
    """
    from poodle import backbones
    from poodle.data import ImageDataset, resolve_dataset
    from poodle.data.transforms import eval_transform
    from poodle.utils import check_writable_dir, file_sha256, resolve_device

    say = log or (lambda msg: None)
    progress_factory = progress_factory or _no_progress
    # -- options and names (cheap)
    if dtype not in FEATURE_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(FEATURE_DTYPES)}")
    if image_size < 1 or batch_size < 1:
        raise ConfigError(f"image size and batch size must be positive, got {image_size} and {batch_size}")
    workers = default_workers() if workers is None else int(workers)
    if workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {workers}")
    split_list = _parse_splits(splits)
    spec = backbones.get_spec(backbone)
    backbone = spec.name
    if image_size < spec.min_input_size:
        raise ConfigError(f"backbone {backbone} needs --image-size >= {spec.min_input_size}, got {image_size}")
    out = cache_path(cache_root, dataset, backbone, tag)
    dev = resolve_device(device)
    # -- the output place, before any work: a directory in the way, or a place we cannot write,
    # would otherwise surface only when the first split is committed
    if out.is_dir():
        raise CacheError(f"cache path {out} is a directory; remove it or choose another --cache-root/--tag")
    check_writable_dir(out, "cache")
    # -- data: split files, rows, images exist, no empty class
    source = resolve_dataset(dataset, data_root, Path(cache_root))
    samples = {s: source.samples(s) for s in split_list}
    # -- checkpoint file
    sha = "none"
    if checkpoint is not None:
        ck = Path(checkpoint).expanduser()
        if not ck.is_file():
            raise CheckpointError(f"checkpoint {ck} does not exist")
        sha = file_sha256(ck)
    tf = eval_transform(image_size)
    root_attrs = make_root_attrs(dataset, backbone, checkpoint_sha256=sha, image_size=image_size,
                                 transform=tf.description, data_root=str(Path(source.root).resolve()))
    # -- the existing cache: refuse what would mix features of different provenance
    fresh, done = False, set()
    if out.exists():
        try:
            attrs = read_attrs(out)
        except CacheError as e:
            if not force:
                raise CacheError(f"{e}; pass --force to overwrite it, or --tag NAME to write another file") from None
            fresh = True
            say(f"{out} is not a poodle cache: replacing it (--force)")
        else:
            mism = identity_mismatches(attrs, root_attrs)
            if mism and not force:
                raise CacheError(f"{out} holds features made with {'; '.join(mism)}; pass --force to replace "
                                 f"it, or --tag NAME to write another file")
            if mism:
                fresh = True
                say(f"{out} was made with other settings: replacing it (--force)")
            else:
                done = _complete_splits(out, split_list, samples, dtype, force, say)
    todo = [s for s in split_list if s not in done]
    if not todo:
        return out
    # -- the model (expensive)
    # Without a checkpoint the weights are random: seed them, so a resumed split is made by the same
    # network as its first part (and two runs agree).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = backbones.build(backbone)
    if checkpoint is not None:
        backbones.load_checkpoint(model, checkpoint)
    model.eval().to(dev)
    for split in todo:
        source_classes = source.classes(split)
        ds = ImageDataset(source, split, tf, on_error="sentinel")
        with SplitWriter(out, split, root_attrs=root_attrs, classes=source_classes,
                         samples_sha256=samples_digest(samples[split]), n_total=len(ds), dim=model.feature_dim,
                         dtype=dtype, restart=force) as writer:
            if writer.resumed:
                say(f"{split}: resuming after image {writer.n_consumed} of {len(ds)}")
            _run_split(model, ds, writer, dev, batch_size, workers, skip_bad, progress_factory)
            counts = writer.class_counts()
            empty = np.flatnonzero(counts == 0)
            if empty.size:
                raise DataError(f"split {split}: class {source_classes[int(empty[0])]!r} has no images left "
                                f"after skipping unreadable ones")
            n_skipped = writer.n_consumed - writer.n_rows
            writer.commit(fresh=fresh)
        fresh = False
        say(f"{split}: {len(ds) - n_skipped} images, {len(source_classes)} classes written to {out}"
            + (f" ({n_skipped} unreadable images skipped)" if n_skipped else ""))
    return out


def _complete_splits(out: Path, split_list: list[str], samples: dict[str, list[tuple[str, str]]], dtype: str,
                     force: bool, say: Callable[[str], None]) -> set[str]:
    """Requested splits already complete in ``out`` and made from the same images; refuse a mismatch."""
    import h5py

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
                raise CacheError(f"{out}: split {s!r} {' and '.join(problems)}; pass --force to recompute it, "
                                 f"or --tag NAME to write another file")
            done.add(s)
            say(f"{s}: already complete in {out}, skipped")
    return done


def _run_split(model: torch.nn.Module, ds: Any, writer: SplitWriter, dev: torch.device, batch_size: int,
               workers: int, skip_bad: bool, progress_factory: ProgressFactory) -> None:
    start, n = writer.n_consumed, len(ds)
    if start >= n:
        return
    loader = DataLoader(Subset(ds, range(start, n)), batch_size=batch_size, shuffle=False, num_workers=workers,
                        pin_memory=dev.type == "cuda")
    pos = start
    desc = ds.split if start == 0 else f"{ds.split} (resumed)"
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
                feats = model.forward_features(x.to(dev, non_blocking=True)).float().cpu()
            else:
                feats = torch.zeros(0, writer.dim)
            writer.append(feats.numpy(), y.numpy(), [ds.samples[i][0] for i in good], n_consumed=b,
                          skipped=[ds.samples[i][0] for i in sorted(bad)])
            pos += b
            advance(b)
