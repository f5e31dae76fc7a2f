"""Throughput of ``poodle.extract.extract`` against a plain DataLoader + model loop on the same images.

Both read the same generated JPEGs (84x84, like mini-ImageNet's) with the same DataLoader settings,
transform and backbone in the same process; ``extract`` additionally lists and checks the images,
streams L2-normalised features into the HDF5 cache and commits it. The ratio extract/plain is the
cost of that machinery (target >= 0.9). The two are run alternately, ``--repeats`` times each, after a
short warm-up, and the best images/s of each is reported (the least disturbed run).

    python benchmarks/extract.py            # 3000 images, conv4_64 at 84 px (about a minute on 2 cores)
    python benchmarks/extract.py --quick    # 400 images, one repeat
    python benchmarks/extract.py --backbone resnet12 --device cuda --images 20000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from poodle import backbones
from poodle.data.transforms import eval_transform, load_rgb
from poodle.extract import default_workers, extract
from poodle.utils import resolve_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import _images  # noqa: E402  (the tests' image generator)


def make_images(root: Path, n_images: int, n_classes: int, px: int) -> Path:
    """``root/test/<class>/<i>.jpg``: ``n_images`` generated JPEGs of ``px`` x ``px`` pixels."""
    per_class = -(-n_images // n_classes)
    for c in range(n_classes):
        d = root / "test" / f"class_{c:03d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(min(per_class, n_images - c * per_class)):
            _images.make_image(c, i, px).save(d / f"{i:05d}.jpg", quality=90)
    return root


class Plain(Dataset):
    """The simplest image dataset: a list of files, decode to RGB, transform."""

    def __init__(self, paths: list[Path], tf) -> None:
        self.paths, self.tf = paths, tf

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return self.tf(load_rgb(self.paths[i])), 0


def plain_loop(root: Path, args: argparse.Namespace, dev: torch.device, limit: int | None = None) -> float:
    """images/s of DataLoader + forward_features + features to CPU (model build included, like extract)."""
    t0 = time.perf_counter()
    paths = sorted((root / "test").glob("*/*.jpg"))[:limit]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = backbones.build(args.backbone)
    model.eval().to(dev)
    fmt = torch.channels_last if dev.type == "cpu" else torch.contiguous_format  # as extract does
    model.to(memory_format=fmt)
    loader = DataLoader(
        Plain(paths, eval_transform(args.size)),
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.workers,
        pin_memory=dev.type == "cuda",
    )
    feats = []
    with torch.inference_mode():
        for x, _ in loader:
            feats.append(
                model.forward_features(x.to(dev, non_blocking=True).contiguous(memory_format=fmt)).float().cpu()
            )
    n = sum(len(f) for f in feats)
    return n / (time.perf_counter() - t0)


def poodle_extract(root: Path, cache_root: Path, args: argparse.Namespace) -> float:
    t0 = time.perf_counter()
    out = extract(
        "folder",
        args.backbone,
        data_root=root,
        splits=("test",),
        image_size=args.size,
        batch_size=args.batch_size,
        device=args.device,
        cache_root=cache_root,
        workers=args.workers,
        force=True,
    )
    dt = time.perf_counter() - t0
    assert out.exists()
    return args.images / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--px", type=int, default=84, help="side of the generated JPEGs")
    p.add_argument("--size", type=int, default=84, help="--image-size of the extraction")
    p.add_argument("--backbone", default="conv4_64")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers [one per core, at most 8]")
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="400 images, one repeat")
    p.add_argument("--data", type=Path, default=None, help="keep/reuse the generated images here")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args()
    if args.quick:
        args.images, args.repeats = min(args.images, 400), 1
    args.workers = default_workers() if args.workers is None else args.workers
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)

    with tempfile.TemporaryDirectory(prefix="poodle-bench-") as tmp:
        root = args.data or Path(tmp) / "images"
        if not (root / "test").is_dir():
            t = time.perf_counter()
            make_images(root, args.images, args.classes, args.px)
            print(f"generated {args.images} images of {args.px}x{args.px} px in {time.perf_counter() - t:.1f} s")
        n = len(list((root / "test").glob("*/*.jpg")))
        if n != args.images:
            sys.exit(f"{root} holds {n} images, not --images {args.images}")
        print(
            f"backbone {args.backbone}, image size {args.size}, batch {args.batch_size}, workers {args.workers}, "
            f"device {dev}, torch threads {torch.get_num_threads()}"
        )
        plain_loop(root, args, dev, limit=2 * args.batch_size)  # warm-up: imports, page cache, allocator
        plain, ours = [], []
        for r in range(args.repeats):
            for name in ("plain", "extract") if r % 2 == 0 else ("extract", "plain"):
                if name == "plain":
                    plain.append(plain_loop(root, args, dev))
                else:
                    ours.append(poodle_extract(root, Path(tmp) / "cache", args))
                print(f"  run {r + 1} {name:8s} {(plain if name == 'plain' else ours)[-1]:9.1f} images/s")
    best_plain, best_ours = max(plain), max(ours)
    print(
        f"plain DataLoader + model : {best_plain:9.1f} images/s (best of {len(plain)}; "
        f"median {statistics.median(plain):.1f})"
    )
    print(
        f"poodle extract           : {best_ours:9.1f} images/s (best of {len(ours)}; "
        f"median {statistics.median(ours):.1f})"
    )
    print(f"ratio extract / plain    : {best_ours / best_plain:9.3f}   (target >= 0.9)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "plain": plain,
                    "extract": ours,
                    "ratio": best_ours / best_plain,
                    "images": args.images,
                    "backbone": args.backbone,
                    "size": args.size,
                    "batch_size": args.batch_size,
                    "workers": args.workers,
                    "device": str(dev),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
