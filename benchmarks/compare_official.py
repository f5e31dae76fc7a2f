"""Each transductive method against its authors' released code: same episodes, same CPU, one table.

For every method with a release, on one episode file: ``poodle solve --episodes-from FILE`` as a
whole process (start-up, cache read and all, timed from launch to exit), and the release's own
functions run as its evaluation runs them (``benchmarks/official_releases.py``: their batching,
their config files' values, their preprocessing; timed over their evaluation loop alone, after
their imports, with the features in memory). Printed per method: the episodes with identical
accuracy, both mean accuracies, the prediction agreement where their code exposes predictions,
both episodes/s and their ratio.

    python benchmarks/compare_official.py --cache FILE --episodes 2000 --checkouts DIR
    python benchmarks/compare_official.py --cache FILE --episodes-from EPISODES.h5 --method pt-map \\
        --checkout pt-map=PATH/PT-MAP
    python benchmarks/compare_official.py --synthetic standard --episodes 2000 --checkouts DIR
    python benchmarks/compare_official.py --laplacian-ablation --cache FILE --episodes 500   (ours only)

Checkouts (nothing is downloaded, copied or vendored): ``--checkout METHOD=PATH``, the environment
variable ``POODLE_OFFICIAL_<METHOD>`` (``POODLE_OFFICIAL_PT_MAP=PATH``), or ``--checkouts DIR`` /
``POODLE_OFFICIAL_DIR``, a folder holding the repositories under their GitHub names (``DIR/TIM``,
``DIR/Realistic_Transductive_Few_Shot``, ``DIR/PADDLE``, ``DIR/LaplacianShot``, ``DIR/PT-MAP``,
``DIR/BMS``, ``DIR/protoLP``, ``DIR/TAFSSL``). A method without one is skipped with a message and
the exit status stays 0. Their code needs ``tqdm``, ``pyyaml``, ``scipy``, ``scikit-learn`` and
(mboudiaf/TIM) ``sacred``, which poodle does not install; ``sacred`` imports ``pkg_resources``,
which setuptools 81 removed: ``pip install tqdm pyyaml scipy scikit-learn sacred "setuptools<81"``.

Episodes: ``--episodes-from FILE`` (written by ``poodle solve --save-episodes``), or drawn from
``--cache`` with ``--split/--way/--shot/--query/--imbalance/--query-classes/--seed`` and written to
a temporary episode file that both sides read. Without ``--cache``, ``--synthetic`` writes a
temporary cache: ``standard`` (benchmarks/solver.py's standard workload: D=640 clustered Gaussian
features, negative coordinates included), ``standard-nonneg`` (the same, shifted by its smallest
coordinate so that the power transforms of PT-MAP, BMS and protoLP are defined, as on post-ReLU
backbone features), ``relu`` (post-ReLU clustered features of ``--dim``).

Where a release's accuracy differs from ours on some episode, the release runs a second time on
the same episodes with every coordinate moved by at most one unit in the last place, and the
episodes it keeps are printed ("the release against itself"): a method whose outcome hangs on
rounding disagrees with itself on a comparable share of episodes (``--no-self-check``: skip it).

``--their-episodes N`` (or ``METHOD=N``) gives a release only the first N episodes (for the
slowest, one task per call); agreement and their speed are then over those N, ours over all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from official_releases import RELEASES, Episodes, Release, Theirs  # noqa: E402

from poodle import solvers  # noqa: E402
from poodle.solvers import EpisodeBatch  # noqa: E402

METHODS = tuple(dict.fromkeys(r.method for r in RELEASES))


# --------------------------------------------------------------------------------- features
def write_synthetic(kind: str, folder: Path, dim: int, seed: int) -> Path:
    """A temporary cache (``train`` and ``test`` splits) of the kind ``--synthetic`` names."""
    from poodle.cache import write_arrays

    if kind in ("standard", "standard-nonneg"):
        from solver import clustered  # benchmarks/solver.py: the standard workload's features

        xtr, ytr = clustered(64, 600, 640, seed=1)
        xte, yte = clustered(20, 600, 640, seed=2, spread=1.2)
        if kind == "standard-nonneg":
            low = min(xtr.min(), xte.min())
            xtr, xte = xtr - low, xte - low
    else:
        g = torch.Generator().manual_seed(seed)

        def relu_clusters(n_classes: int) -> tuple[np.ndarray, np.ndarray]:
            centres = torch.randn(n_classes, dim, generator=g).clamp_min(0) * 2
            x = centres.repeat_interleave(100, 0) + 4.0 * torch.randn(n_classes * 100, dim, generator=g)
            return (x.clamp_min(0) + 1e-3).numpy(), np.arange(n_classes).repeat(100)

        (xtr, ytr), (xte, yte) = relu_clusters(64), relu_clusters(20)
    splits = {"train": (xtr, ytr, [f"b{i}" for i in range(64)]), "test": (xte, yte, [f"t{i}" for i in range(20)])}
    return write_arrays(folder / f"synthetic-{kind}.h5", splits, dataset=f"synthetic-{kind}")


def episode_file(a: argparse.Namespace, cache: Path, folder: Path) -> Path:
    """``--episodes-from``, or the episodes drawn from the cache, written where both sides read them."""
    if a.episodes_from:
        return Path(a.episodes_from)
    from poodle.cache import read_split
    from poodle.episodes import EpisodeSpec, sample_episodes, save_episodes

    labels = read_split(cache, a.split)
    spec = EpisodeSpec(
        split=a.split, way=a.way, shot=a.shot, query=a.query, imbalance=a.imbalance, seed=a.seed,
        query_classes=a.query_classes,
    )  # fmt: skip
    eps = sample_episodes(labels.labels, spec, a.episodes, classes=labels.classes)
    return save_episodes(folder / "episodes.h5", eps, cache=str(cache))


def load(cache: Path, episodes: Path) -> Episodes:
    """The episodes of ``episodes`` with the rows of ``cache``: raw (row x stored norm) and L2N."""
    from poodle.cache import list_splits, read_split
    from poodle.episodes import load_episodes

    eps = load_episodes(episodes)
    split = read_split(cache, eps.spec.split)
    x = split.features.float()
    raw = x * split.norms.unsqueeze(1) if split.norms is not None else x
    xn = F.normalize(x, dim=-1)
    mean = read_split(cache, "train").raw_mean if "train" in list_splits(cache) else None
    return Episodes(
        raw[eps.support], raw[eps.query], xn[eps.support], xn[eps.query], eps.support_labels.clone(),
        eps.query_labels.clone(), eps.spec.way, eps.spec.shot, mean,
    )  # fmt: skip


# --------------------------------------------------------------------------------- our side
def run_ours(cache: Path, episodes: Path, method: str, options: tuple[str, ...]) -> dict:
    """``poodle solve`` as a subprocess on the episode file: per-episode accuracies and wall seconds
    from launch to exit."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.jsonl"
        cmd = [sys.executable, "-m", "poodle.cli.main", "solve", "--cache", str(cache), "--episodes-from"]
        cmd += [str(episodes), "--method", method, *options, "--device", "cpu", "--out", str(out)]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if done.returncode:
            raise SystemExit(f"poodle solve failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
        rec = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    cell = next(r for r in rec if r.get("kind") == "cell")
    shown = ["poodle", *cmd[3:-4]]
    acc = np.asarray(cell["acc"], dtype=np.float64)
    return {"acc": acc, "wall": wall, "cmd": " ".join(shown)}


def our_predictions(ep: Episodes, method: str, options: tuple[str, ...]) -> torch.Tensor | None:
    """Our predictions on the same rows, in process (for the prediction agreement only; accuracies
    and timings come from ``poodle solve``). ``None`` for options other than ``--preset``."""
    opts: dict = {}
    for k, v in zip(options[::2], options[1::2]):
        if k == "--preset":
            opts["preset"] = v
        elif k != "--preprocess" or v != "l2n":
            return None
    batch = EpisodeBatch(ep.s_l2n, ep.y_s, ep.q_l2n, None, ep.way)
    preds = []
    for lo in range(0, ep.n, 200):
        sub = EpisodeBatch(batch.support[lo : lo + 200], batch.support_labels[lo : lo + 200],
                           batch.query[lo : lo + 200], None, ep.way)  # fmt: skip
        preds.append(solvers.run(method, sub, **opts).log_probs.argmax(-1))
    return torch.cat(preds)


# ------------------------------------------------------------------------------- comparison
def checkout_for(method: str, repo: str, a: argparse.Namespace) -> Path | None:
    given = dict(c.split("=", 1) for c in a.checkout)
    env = "POODLE_OFFICIAL_" + method.upper().replace("-", "_")
    path = given.get(method) or os.environ.get(env)
    parent = a.checkouts or os.environ.get("POODLE_OFFICIAL_DIR")
    if not path and parent and (Path(parent) / repo.split("/")[1]).is_dir():
        path = str(Path(parent) / repo.split("/")[1])
    return Path(path) if path else None


def their_count(method: str, a: argparse.Namespace, n: int) -> int:
    counts = dict(c.split("=", 1) if "=" in c else ("*", c) for c in a.their_episodes)
    return min(n, int(counts.get(method, counts.get("*", n))))


def compare(row: Release, kind: str, theirs: Theirs, ours: dict, pred: torch.Tensor | None) -> dict:
    n = len(theirs.acc)
    acc_o = ours["acc"][:n]
    same = np.abs(acc_o - theirs.acc) < 1e-6  # their logs keep float32 accuracies
    agree = None
    if theirs.pred is not None and pred is not None:
        agree = float((theirs.pred == pred[:n]).double().mean())
    ours_eps = len(ours["acc"]) / ours["wall"]
    their_eps = n / theirs.seconds
    return {
        "method": row.method, "repo": row.repo, "kind": kind, "note": row.note, "how": theirs.how,
        "n": n, "identical": int(same.sum()), "ours": float(acc_o.mean()), "theirs": float(theirs.acc.mean()),
        "max_diff": float(np.abs(acc_o - theirs.acc).max()), "agree": agree, "ours_eps": ours_eps,
        "ours_n": len(ours["acc"]), "their_eps": their_eps,
        "ratio": ours_eps / their_eps, "cmd": ours["cmd"],
        "differing": [int(i) for i in np.flatnonzero(~same)[:8]],
    }  # fmt: skip


def self_check(row: Release, checkout: Path, ep: Episodes, kind: str, theirs: Theirs, seed: int) -> int:
    """The release run again on the same episodes with every coordinate moved by at most one unit
    in the last place (``Episodes.one_ulp``): how many episodes keep their accuracy. Where ours and
    the release differ, this tells a method whose outcome hangs on rounding (the release disagrees
    with itself on a comparable share of episodes) from a difference of method."""
    again = row.run(checkout, ep.one_ulp(seed), kind)
    return int((np.abs(again.acc - theirs.acc) < 1e-6).sum())


INPUT = {"raw": "their input", "l2n": "our L2N rows"}

LEGEND = """\
How to read it:
- identical accuracy: episodes whose accuracy is the same on both sides, of those the release ran.
- release vs itself: only where the release differs from ours on some episode. The release runs again on
  the same episodes with every coordinate moved by at most one unit in the last place; the count is the
  episodes whose accuracy it keeps. A count of the same order as "identical accuracy" means rounding
  decides those episodes, not a difference of method (docs/transductive.md, "TIM-GD and TIM-ADM on
  near-chance episodes"). A full count (n/n) next to a lower "identical accuracy" means the release is
  stable on those episodes: the difference comes from the method or its input.
  Blank: not rerun (no episode differs, or --no-self-check).
- predictions agree: the share of queries with the same label, where their code returns its predictions
  and ours ran with the release's options; blank otherwise.
- ours ep/s is a whole `poodle solve` process, start-up included (about 2-3 s: at a few hundred episodes
  it dominates); theirs is their evaluation loop alone, after their imports."""


def table(rows: list[dict]) -> str:
    head = (
        "| method | release | their input | episodes compared | identical accuracy | mean ours | mean theirs | "
        "predictions agree | release vs itself, rows one ulp away | ours ep/s (whole process) | theirs ep/s | ratio |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        agree = "" if r["agree"] is None else f"{100 * r['agree']:.3f}%"
        itself = f"{r['itself']}/{r['n']}" if "itself" in r else ""
        inp = INPUT[r["kind"]] + (f"; {r['note']}" if r["note"] else "")
        lines.append(
            f"| `{r['method']}` | {r['repo']} | {inp} | {r['n']} | {r['identical']}/{r['n']} | "
            f"{100 * r['ours']:.2f} | {100 * r['theirs']:.2f} | {agree} | {itself} | {r['ours_eps']:.1f} | "
            f"{r['their_eps']:.2f} | {r['ratio']:.1f}x |"
        )
    return "\n".join(lines)


def run_all(a: argparse.Namespace, cache: Path, episodes: Path) -> list[dict]:
    ep = load(cache, episodes)
    ours_done: dict = {}
    rows = []
    skipped: set[str] = set()
    for row in RELEASES:
        if a.method and row.method not in a.method:
            continue
        checkout = checkout_for(row.method, row.repo, a)
        if checkout is None:
            env = "POODLE_OFFICIAL_" + row.method.upper().replace("-", "_")
            if row.method not in skipped:  # a method with two release rows is named once
                print(
                    f"{row.method}: skipped (give --checkout {row.method}=PATH, {env}, or --checkouts DIR or "
                    f"POODLE_OFFICIAL_DIR=DIR with DIR/{row.repo.split('/')[1]} from {row.repo})"
                )
            skipped.add(row.method)
            continue
        key = (row.method, row.ours)
        if key not in ours_done:
            ours_done[key] = (
                run_ours(cache, episodes, row.method, row.ours),
                our_predictions(ep, row.method, row.ours),
            )
        ours, pred = ours_done[key]
        n = their_count(row.method, a, ep.n)
        n = min(n, row.max_episodes) if row.max_episodes else n
        for kind in ["raw"] + (["l2n"] if row.l2n or a.l2n_too else []):
            theirs = row.run(checkout, ep.head(n), kind)
            r = compare(row, kind, theirs, ours, pred)
            if a.self_check and r["identical"] < r["n"]:
                r["itself"] = self_check(row, checkout, ep.head(n), kind, theirs, a.seed)
            rows.append(r)
            print(
                f"{r['method']} ({r['repo']}, on {INPUT[kind]}{', ' + r['note'] if r['note'] else ''}): identical "
                f"accuracy on {r['identical']}/{r['n']} episodes; mean ours {100 * r['ours']:.2f}%, theirs "
                f"{100 * r['theirs']:.2f}% (largest difference {100 * r['max_diff']:.2f} points"
                + (f", differing e.g. {r['differing']}" if r["differing"] else "")
                + ")"
                + (
                    f"; the release against itself on rows one ulp away: {r['itself']}/{r['n']} identical"
                    if "itself" in r
                    else ""
                )
                + f"; {r['ours_eps']:.1f} vs {r['their_eps']:.2f} episodes/s ({r['ratio']:.1f}x); theirs: "
                f"{r['how']}; ours: {r['cmd']}",
                flush=True,
            )
    return rows


# ------------------------------------------------------------------------ LaplacianShot ablation
LAPLACIAN_VARIANTS = [
    ("default (the paper's method)", {}),
    ("+ self_neighbour", {"self_neighbour": True}),
    ("+ released_rectification", {"released_rectification": True}),
    ("+ shifted_unary", {"shifted_unary": True}),
    ("official (the release: all three, lambda 1.0)", {"preset": "official"}),
    ("official - self_neighbour", {"preset": "official", "self_neighbour": False}),
    ("official - released_rectification", {"preset": "official", "released_rectification": False}),
    ("official - shifted_unary", {"preset": "official", "shifted_unary": False}),
    ("official with lambda 0.7", {"preset": "official", "lmd": 0.7}),
]


def laplacian_ablation(ep: Episodes, chunk: int = 100) -> None:
    """Each difference between our default LaplacianShot and the released code, alone, on these episodes."""
    from poodle.stats import mean_ci, paired_difference

    accs = {}
    for label, opts in LAPLACIAN_VARIANTS:
        preds = []
        for lo in range(0, ep.n, chunk):
            sl = slice(lo, lo + chunk)
            batch = EpisodeBatch(ep.s_l2n[sl], ep.y_s[sl], ep.q_l2n[sl], None, ep.way)
            preds.append(solvers.run("laplacianshot", batch, **opts).log_probs.argmax(-1))
        accs[label] = (torch.cat(preds) == ep.y_q).double().mean(1)
    base, official = accs[LAPLACIAN_VARIANTS[0][0]], accs[LAPLACIAN_VARIANTS[4][0]]
    for label, acc in accs.items():
        m, ci = mean_ci(acc)
        d, dci = paired_difference(acc, base)
        same = int((acc == official).sum())
        print(
            f"laplacianshot {label:48s} {100 * m:6.2f} ± {100 * ci:.2f}   vs default {100 * d:+6.2f} ± {100 * dci:.2f}"
            f"   same accuracy as official on {same}/{len(acc)} episodes"
        )


# ------------------------------------------------------------------------------------- main
def add_release_options(ap: argparse.ArgumentParser) -> None:
    """Where the releases are and how much of them to run (this script's and ``methods.py``'s)."""
    ap.add_argument("--checkout", action="append", default=[], metavar="METHOD=PATH")
    ap.add_argument("--checkouts", metavar="DIR", help="folder of the releases under their GitHub names")
    ap.add_argument("--their-episodes", action="append", default=[], metavar="[METHOD=]N")
    ap.add_argument(
        "--no-self-check",
        dest="self_check",
        action="store_false",
        help="do not rerun a release that differs from ours on its rows moved by one ulp",
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=METHODS, action="append", default=[], help="default: every method")
    add_release_options(ap)
    ap.add_argument("--l2n-too", action="store_true", help="also run every release on our L2-normalised rows")
    ap.add_argument("--laplacian-ablation", action="store_true", help="ours only: LaplacianShot's variants")
    ap.add_argument("--cache", help="feature cache (HDF5)")
    ap.add_argument("--synthetic", choices=("standard", "standard-nonneg", "relu"), default="standard")
    ap.add_argument("--dim", type=int, default=64, help="--synthetic relu: dimension")
    ap.add_argument("--episodes-from", help="episode file (poodle solve --save-episodes)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--shot", type=int, default=1)
    ap.add_argument("--query", type=int, default=15)
    ap.add_argument("--imbalance", type=float)
    ap.add_argument("--query-classes", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here too")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(a.cache) if a.cache else write_synthetic(a.synthetic, Path(tmp), a.dim, a.seed)
        episodes = episode_file(a, cache, Path(tmp))
        load1, load5, load15 = os.getloadavg()
        print(
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}; "
            f"{os.cpu_count()} CPUs, load average {load1:.2f} {load5:.2f} {load15:.2f}; features "
            + (str(cache) if a.cache else f"synthetic {a.synthetic}")
            + f"; episodes {episodes if a.episodes_from else f'drawn ({a.episodes}, {a.way}-way {a.shot}-shot)'}",
            flush=True,
        )
        if a.laplacian_ablation:
            laplacian_ablation(load(cache, episodes))
            return 0
        rows = run_all(a, cache, episodes)
    if rows:
        print()
        print(table(rows))
        print()
        print(LEGEND)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
