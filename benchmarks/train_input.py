"""Where the demo's training time goes: loading (decode + augmentation) versus the model's forward and
backward pass, on the same batches, side by side in one run.

    python benchmarks/train_input.py [--cache-root cache] [--batches 60]

Needs the demo's glyph images (``poodle demo`` makes them under CACHE_ROOT/glyphs). Prints the
versions, threads and CPU, then seconds for: the DataLoader as training uses it (no workers, uint8
items finished per batch), in its first epoch (decoding, filling the pixel cache) and in a later one
(from the cache); decoding alone and the per-image float transform alone (what loading cost before the
cache and the batched finish); and SGD steps of the demo's backbone on the loaded batches, in NCHW
and in NHWC (channels-last) layout alternately.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch.utils.data import DataLoader

from poodle import defaults
from poodle.data import PixelCache
from poodle.data.transforms import load_rgb
from poodle.demo import DemoConfig
from poodle.train.augment import train_transform
from poodle.train.loop import _build, _dataset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-root", default="cache")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the demo's")
    args = ap.parse_args()
    cfg = DemoConfig(cache_root=args.cache_root).train_config()
    if args.batch_size:
        cfg.batch_size = args.batch_size
    ds = _dataset(cfg, "train", train_transform(cfg.augment, cfg.image_size), PixelCache(defaults.IMAGE_CACHE_BYTES))
    print(
        f"poodle demo training input: {len(ds)} images, batch {cfg.batch_size}, {args.batches} batches; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}"
    )
    torch.manual_seed(0)
    loader = DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0)
    t_load = []
    for _ in range(2):  # the first epoch decodes and fills the cache, the second reads it
        t = time.perf_counter()
        it = iter(loader)
        batches = [(ds.finish(x), y) for x, y in (next(it) for _ in range(args.batches))]
        t_load.append(time.perf_counter() - t)
        torch.manual_seed(0)  # the same images again
    idx = range(cfg.batch_size * args.batches)
    t = time.perf_counter()
    images = [load_rgb(ds.path(i)) for i in idx]
    t_decode = time.perf_counter() - t
    t = time.perf_counter()
    for im in images:
        ds.transform(im)
    t_transform = time.perf_counter() - t

    def steps(channels_last: bool) -> float:
        """Seconds of SGD steps on the loaded batches, the model and batches in one layout."""
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        net = _build(cfg, len(ds.classes), 0).to(memory_format=fmt)
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        t = time.perf_counter()
        for x, y in batches:
            logits, _ = net(x.contiguous(memory_format=fmt))
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return time.perf_counter() - t

    # NCHW and NHWC alternately, best of 2 each: the ratio is side by side
    layouts: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(2):
        for cl in (False, True):
            layouts[cl].append(steps(cl))
    nchw, nhwc = min(layouts[False]), min(layouts[True])
    n_img = cfg.batch_size * args.batches
    print(
        f"model forward + backward + step, batch {cfg.batch_size}: NCHW {nchw:.2f} s ({n_img / nchw:.0f} images/s), "
        f"NHWC (channels-last) {nhwc:.2f} s ({n_img / nhwc:.0f} images/s), ratio {nchw / nhwc:.2f}x"
    )
    t_model = min(layouts[cfg.channels_last])
    print(
        f"loader {t_load[0]:.2f} s in the first epoch, {t_load[1]:.2f} s from the cache (without them: "
        f"decode {t_decode:.2f} s + float transform {t_transform:.2f} s); "
        f"model steps in the demo's layout {t_model:.2f} s; cached loader share {t_load[1] / (t_load[1] + t_model):.1%}"
    )


if __name__ == "__main__":
    main()
