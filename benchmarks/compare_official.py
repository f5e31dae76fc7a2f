"""Per-episode comparison of poodle's transductive solvers with their authors' released code.

Runs the authors' implementation (a checkout you provide; nothing is downloaded or copied) on CPU and
poodle's batched solver on the same episodes and the same features, and prints, per method, how
many episodes get identical accuracies and identical predictions, and both mean accuracies.

    python benchmarks/compare_official.py --method alpha-tim --checkout PATH/Realistic_Transductive_Few_Shot
    python benchmarks/compare_official.py --method tim-gd --checkout PATH/Realistic_Transductive_Few_Shot
    python benchmarks/compare_official.py --method paddle --checkout PATH/PADDLE
    python benchmarks/compare_official.py --method bms --checkout PATH/BMS                 (yhu01/BMS)
    python benchmarks/compare_official.py --method proto-lp --checkout PATH/protoLP        (allenhaozhu/protoLP)
    python benchmarks/compare_official.py --method laplacianshot --checkout PATH/LaplacianShot
    python benchmarks/compare_official.py --laplacian-ablation --cache FILE --episodes 500   (ours only)

``--checkout`` defaults to the environment variable ``POODLE_OFFICIAL_<METHOD>`` (e.g.
``POODLE_OFFICIAL_ALPHA_TIM``); without either, the method is skipped with a message and exit
status 0. Episodes come from a feature cache (``--cache FILE``, poodle's episode sampler with
``--way/--shot/--query/--imbalance/--query-classes/--seed``) or, without one, from synthetic
post-ReLU clustered features. Both sides get the same L2-normalised float32 features.

What is changed in their code to run it here (nothing else): the device (CPU); for protoLP, whose
script is not importable as a module, its source is executed with ``'cuda'`` replaced by ``'cpu'``
and its hard-coded 5-way / 10,000-episode identity sized to the episodes at hand; LaplacianShot's
``np.float`` (removed from NumPy) is provided as ``float`` and BMS's ``torch.qr`` (removed from
PyTorch) as ``torch.linalg.qr(mode="reduced")``, the replacement their own code has commented out.
Their progress bars are silenced. Where
their entry point needs their dataset files, this script calls the functions and classes that entry
point calls, in the same order, with the configuration values of their released config files.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from poodle import solvers
from poodle.solvers import EpisodeBatch

METHODS = ("tim-gd", "alpha-tim", "paddle", "bms", "proto-lp", "laplacianshot")


# --------------------------------------------------------------------------------- episodes
def synthetic_episodes(
    n: int,
    way: int,
    shot: int,
    query: int,
    dim: int,
    seed: int,
    spread: float,
    imbalance: float | None,
    query_classes: int | None,
):
    """Post-ReLU clustered features (a backbone's look) drawn through poodle's episode sampler."""
    from poodle.episodes import EpisodeSpec, sample_episodes

    g = torch.Generator().manual_seed(seed)
    n_classes, per_class = max(2 * way, 10), 60
    centres = torch.randn(n_classes, dim, generator=g).clamp_min(0) * 2
    x = centres.repeat_interleave(per_class, 0) + spread * torch.randn(n_classes * per_class, dim, generator=g)
    x = F.normalize(x.clamp_min(0) + 1e-3, dim=-1)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    spec = EpisodeSpec(way=way, shot=shot, query=query, imbalance=imbalance, seed=seed, query_classes=query_classes)
    return x, sample_episodes(labels, spec, n)


def cache_episodes(
    path: str,
    split: str,
    n: int,
    way: int,
    shot: int,
    query: int,
    seed: int,
    imbalance: float | None,
    query_classes: int | None,
):
    from poodle.cache import read_split
    from poodle.episodes import EpisodeSpec, sample_episodes

    feats = read_split(path, split)
    spec = EpisodeSpec(
        split=split, way=way, shot=shot, query=query, imbalance=imbalance, seed=seed, query_classes=query_classes
    )
    return feats.features.float(), sample_episodes(feats.labels, spec, n, classes=feats.classes)


def as_batch(x: torch.Tensor, eps) -> tuple[EpisodeBatch, torch.Tensor]:
    return (
        EpisodeBatch(x[eps.support], eps.support_labels.clone(), x[eps.query], None, eps.spec.way),
        eps.query_labels.clone(),
    )


# ------------------------------------------------------------------------- their code, on CPU
class _Quiet:
    def info(self, *a, **k): ...
    def del_logger(self): ...


class _NoModel:
    def train(self): ...
    def eval(self): ...


def _package_stub(name: str, path: Path) -> None:
    """Make ``name`` importable without running its ``__init__`` (which imports every method)."""
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    sys.modules[name] = mod


def _fresh_src(checkout: Path) -> None:
    for k in [k for k in sys.modules if k == "src" or k.startswith("src.")]:
        del sys.modules[k]
    sys.path.insert(0, str(checkout))
    _package_stub("src", checkout / "src")
    _package_stub("src.methods", checkout / "src" / "methods")
    if importlib.util.find_spec("requests") is None:  # imported, never used, by PADDLE's utils
        sys.modules["requests"] = types.ModuleType("requests")


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())["METHOD"]


def official_alpha_tim(checkout: Path, batch: EpisodeBatch, y_q: torch.Tensor, steps: int | None):
    _fresh_src(checkout)
    T = importlib.import_module("src.methods.tim")
    T.tqdm = lambda it, *a, **k: it
    cfg = _yaml(checkout / "config" / "dirichlet" / "methods_config" / "alpha_tim.yaml")
    m = T.ALPHA_TIM.__new__(T.ALPHA_TIM)
    m.device, m.model, m.logger = "cpu", _NoModel(), _Quiet()
    m.temp, m.loss_weights, m.iter = cfg["temp"], list(cfg["loss_weights"]), steps or cfg["iter"]
    m.lr, m.entropies = float(cfg["lr_alpha_tim"]), list(cfg["entropies"])
    m.alpha_values, m.use_tuned_alpha_values = list(cfg["alpha_values"]), cfg["use_tuned_alpha_values"]
    m.init_info_lists()
    s, q = F.normalize(batch.support, dim=2), F.normalize(batch.query, dim=2)
    m.compute_lambda(support=s, query=q, y_s=batch.support_labels)
    m.init_weights(support=s, y_s=batch.support_labels, query=q, y_q=y_q)
    m.run_adaptation(support=s, query=q, y_s=batch.support_labels, y_q=y_q, shot=batch.shot)
    ours = dict(temperature=float(cfg["temp"]), lr=float(cfg["lr_alpha_tim"]), steps=m.iter)
    return m.get_logits(q).argmax(2).detach(), ours


def official_tim_gd(checkout: Path, batch: EpisodeBatch, y_q: torch.Tensor, steps: int | None):
    """TIM-GD as released with alpha-TIM (the ``TIM_GD`` class of the same authors' code base), run
    with the TIM paper's scripts' settings, which are our default preset: weights 0.1 / 1 / 0.1,
    temperature 15, Adam lr 1e-4, 1,000 iterations (that repository's own ``tim.yaml`` uses weights
    1 / 1 / 1). Their support cross-entropy is ``log(softmax + 1e-12)``, ours ``log_softmax``."""
    _fresh_src(checkout)
    T = importlib.import_module("src.methods.tim")
    T.tqdm = lambda it, *a, **k: it
    m = T.TIM_GD.__new__(T.TIM_GD)
    m.device, m.model, m.logger = "cpu", _NoModel(), _Quiet()
    m.temp, m.loss_weights, m.iter, m.lr = 15.0, [0.1, 1.0, 0.1], steps or 1000, 1e-4
    m.init_info_lists()
    m.record_info = lambda **kw: None  # per-iteration accuracy logging only
    s, q = F.normalize(batch.support, dim=2), F.normalize(batch.query, dim=2)
    m.init_weights(support=s, y_s=batch.support_labels, query=q, y_q=y_q)
    m.run_adaptation(support=s, query=q, y_s=batch.support_labels, y_q=y_q, shot=batch.shot)
    return m.get_logits(q).argmax(2).detach(), dict(steps=m.iter)


def official_paddle(checkout: Path, batch: EpisodeBatch, y_q: torch.Tensor, steps: int | None):
    _fresh_src(checkout)
    P = importlib.import_module("src.methods.paddle")
    P.tqdm = lambda it, *a, **k: it
    cfg = _yaml(checkout / "config" / "mini" / "resnet18" / "methods_config" / "paddle.yaml")
    m = P.PADDLE.__new__(P.PADDLE)
    m.device, m.model, m.logger = "cpu", None, _Quiet()
    m.iter, m.alpha = steps or cfg["iter"], cfg["alpha"]
    m.init_info_lists()
    q, s = P.MinMaxScaler(feature_range=(0, 1))(batch.query.clone(), batch.support.clone())
    m.run_method(support=s, query=q, y_s=batch.support_labels, y_q=y_q)
    return m.u.argmax(2), dict(lmd=float(cfg["alpha"]), steps=m.iter)


def official_bms(checkout: Path, batch: EpisodeBatch, y_q: torch.Tensor, steps: int | None):
    sys.modules.setdefault("matplotlib", types.ModuleType("matplotlib"))
    sys.modules.setdefault("matplotlib.pyplot", types.ModuleType("matplotlib.pyplot"))
    sys.path.insert(0, str(checkout))
    B = importlib.import_module("test_standard_bms")
    # torch.qr was removed from PyTorch; their own commented-out line is the torch.linalg.qr equivalent
    torch_shim = types.ModuleType("torch_with_qr")
    torch_shim.__dict__.update(torch.__dict__)
    torch_shim.qr = lambda a: torch.linalg.qr(a, mode="reduced")
    B.torch = torch_shim
    # their parse_args() defaults: --method BMS --preprocess PEME --step 20 --lam 8.5 --epoch 0
    B.params = argparse.Namespace(method="BMS")
    n_steps, lam, cfg = steps or 20, 8.5, {"lr": 0.1, "mmt": 0.8, "epochs": 0}
    E, n_l = batch.support.shape[0], batch.support.shape[1]
    data = torch.cat([batch.support, batch.query], 1)
    # getRunSet's PEME: P (inline there: sqrt(x + 1e-6)), E, M (centre + QR), E
    data = torch.sqrt(data + 1e-6)
    data = B.scaleEachUnitaryDatas(data)
    data = B.QRreduction(B.centerDatas(data))
    data = B.scaleEachUnitaryDatas(data)
    ds = B.DataSet()
    ds.data, ds.n_runs, ds.n_samples, ds.n_feat = data, E, data.shape[1], data.shape[2]
    ds.n_ways, ds.n_shot, ds.n_lsamples = batch.way, batch.shot, n_l
    ds.n_queries = batch.query.shape[1] // batch.way
    ds.labels = torch.cat([batch.support_labels, y_q], 1)
    wmasker = B.SimpleWMask(ds)
    mm = B.TrainedLinRegModel(ds)
    # initFromLabelledDatas reshapes their class-interleaved layout; the support means directly:
    y1 = F.one_hot(batch.support_labels, batch.way).float()
    mm.mus = torch.bmm(y1.transpose(1, 2), data[:, :n_l]) / y1.sum(1).unsqueeze(-1)
    mm.initParams()
    min_size = torch.ones(E) * batch.shot
    probas = None
    for _ in range(n_steps):
        probas = mm.getProbas(scoresRescale=lam)
        probas = wmasker.getWMask(probas, min_size)
        min_size = wmasker.getMinsize(probas)
        mm.train(probas, cfg, wmasker=wmasker, updateWeights=True)
    return probas[:, n_l:].argmax(2), dict(lam=lam, steps=n_steps, epochs=0)


def official_proto_lp(checkout: Path, batch: EpisodeBatch, y_q: torch.Tensor, steps: int | None):
    src = (checkout / "test_standard_GSSL_lapshot.py").read_text()
    src = src.replace("device='cuda'", "device='cpu'").replace(".cuda()", "")
    src = src.replace("torch.eye(5,", "torch.eye(n_ways,").replace("reshape((1, 5, 5))", "reshape((1, n_ways, n_ways))")
    src = src.replace("repeat(10000, 1, 1)", "repeat(n_runs, 1, 1)")
    sys.modules.setdefault("tqdm.notebook", importlib.import_module("tqdm"))
    mod = types.ModuleType("protolp_official")
    exec(compile(src, str(checkout / "test_standard_GSSL_lapshot.py"), "exec"), mod.__dict__)
    E, n_l, n_u, way = batch.support.shape[0], batch.support.shape[1], batch.query.shape[1], batch.way
    labels = torch.cat([batch.support_labels, y_q], 1)
    g = mod.__dict__
    g.update(
        n_runs=E, n_shot=batch.shot, n_ways=way, n_queries=n_u / way, n_lsamples=n_l, n_usamples=n_u, labels=labels
    )
    # their __main__: power 0.5, unit, SVD to 40, centre + unit; lam 10, alpha 0.2, 100 epochs
    nd = torch.cat([batch.support, batch.query], 1)
    nd = torch.pow(nd + 1e-6, 0.5)
    nd = mod.scaleEachUnitaryDatas(nd)
    nd = mod.SVDreduction(nd, 40)
    nd = mod.centerDatas(nd)
    model = mod.GaussianModel(way, 10)
    y1 = F.one_hot(batch.support_labels, way).float()
    model.mus_ori = torch.bmm(y1.transpose(1, 2), nd[:, :n_l]) / y1.sum(1).unsqueeze(-1)
    model.initFromCenter(model.mus_ori.clone())
    n_epochs = steps or 100
    mod.MAP(0.2).loop(model, nd, E, way, n_u, n_l, n_epochs=n_epochs)
    final = model.getProbas(nd, E, way, n_u, n_l)
    return final[:, n_l:].argmax(2), dict(steps=n_epochs, lam=10.0, alpha=0.2, reduced_dim=40)


def official_laplacianshot(
    checkout: Path, batch: EpisodeBatch, y_q: torch.Tensor, steps: int | None, lmd: float = 0.7, knn: int = 3
):
    sys.modules.setdefault("matplotlib", types.ModuleType("matplotlib"))
    plt = types.ModuleType("matplotlib.pyplot")
    sys.modules.setdefault("matplotlib.pyplot", plt)
    sys.modules["matplotlib"].use = lambda *a, **k: None
    sys.modules["matplotlib"].pyplot = plt
    sys.path.insert(0, str(checkout / "src"))
    L = importlib.import_module("lshot_update")
    from numpy import linalg as LA
    from scipy import sparse
    from sklearn.neighbors import NearestNeighbors

    # the four functions train_lshot.py's evaluation runs, taken from its source unchanged (the
    # module itself needs their datasets and models at import)
    tree = ast.parse((checkout / "src" / "train_lshot.py").read_text())
    keep = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and n.name in ("get_metric", "metric_class_type", "create_affinity", "lshot_prediction")
    ]
    np_shim = types.ModuleType("numpy_with_float")
    np_shim.__dict__.update(np.__dict__)
    np_shim.float = float
    args = argparse.Namespace(
        proto_rect=True, meta_val_way=batch.way, lshot=True, lmd=lmd, knn=knn, plot_converge=False, num_NN=1
    )
    ns = dict(
        np=np_shim,
        LA=LA,
        torch=torch,
        F=F,
        sparse=sparse,
        NearestNeighbors=NearestNeighbors,
        bound_update=L.bound_update,
        args=args,
    )
    exec(compile(ast.Module(body=keep, type_ignores=[]), "train_lshot.py", "exec"), ns)
    accs = []
    for e in range(batch.support.shape[0]):
        gal = batch.support[e].numpy().astype(np.float32)
        qry = batch.query[e].numpy().astype(np.float32)
        accs.append(
            ns["metric_class_type"](
                gal, qry, batch.support_labels[e].numpy(), y_q[e].tolist(), batch.shot, norm_type="L2N"
            )
        )
    return torch.tensor(accs, dtype=torch.float64), dict(preset="official", lmd=lmd, knn=knn)


OFFICIAL = {
    "tim-gd": official_tim_gd,
    "alpha-tim": official_alpha_tim,
    "paddle": official_paddle,
    "bms": official_bms,
    "proto-lp": official_proto_lp,
    "laplacianshot": official_laplacianshot,
}


def compare(
    method: str, checkout: Path, batch: EpisodeBatch, y_q: torch.Tensor, steps: int | None, their_batch: int = 0
) -> dict:
    """``their_batch``: episodes per call of their code (0: all at once). Their Sinkhorn loops stop when
    the *whole* batch has converged; ours per episode, which is what a batch of one gives."""
    E = batch.support.shape[0]
    size = their_batch or E
    parts, options = [], {}
    for lo in range(0, E, size):
        sl = slice(lo, lo + size)
        sub = EpisodeBatch(batch.support[sl], batch.support_labels[sl], batch.query[sl], None, batch.way)
        t, options = OFFICIAL[method](checkout, sub, y_q[sl], steps)
        parts.append(t)
    theirs = torch.cat(parts)
    out = solvers.run(method, batch, **options)
    pred = out.log_probs.argmax(-1)
    ours_acc = (pred == y_q).double().mean(1)
    if theirs.dtype == torch.float64 and theirs.dim() == 1:  # they report accuracies only
        their_acc, agree = theirs, None
    else:
        their_acc = (theirs == y_q).double().mean(1)
        agree = (theirs == pred).double().mean().item()
    same = ours_acc == their_acc
    return {
        "method": method,
        "options": options,
        "episodes": len(same),
        "identical": int(same.sum()),
        "ours": ours_acc.mean().item(),
        "theirs": their_acc.mean().item(),
        "max_diff": (ours_acc - their_acc).abs().max().item(),
        "prediction_agreement": agree,
        "differing": [int(i) for i in (~same).nonzero().flatten()[:10]],
    }


LAPLACIAN_VARIANTS = [
    ("default (the paper's method)", {}),
    ("+ self_neighbour", {"self_neighbour": True}),
    ("+ released_rectification", {"released_rectification": True}),
    ("+ shifted_unary", {"shifted_unary": True}),
    ("official (all three)", {"preset": "official"}),
    ("official - self_neighbour", {"preset": "official", "self_neighbour": False}),
    ("official - released_rectification", {"preset": "official", "released_rectification": False}),
    ("official - shifted_unary", {"preset": "official", "shifted_unary": False}),
]


def laplacian_ablation(batch: EpisodeBatch, y_q: torch.Tensor, chunk: int = 100) -> None:
    """Each difference between our default LaplacianShot and the released code, alone, on these episodes."""
    from poodle.stats import mean_ci, paired_difference

    accs = {}
    for label, opts in LAPLACIAN_VARIANTS:
        pred = torch.cat(
            [
                solvers.run(
                    "laplacianshot",
                    EpisodeBatch(
                        batch.support[i : i + chunk],
                        batch.support_labels[i : i + chunk],
                        batch.query[i : i + chunk],
                        None,
                        batch.way,
                    ),
                    **opts,
                ).log_probs.argmax(-1)
                for i in range(0, batch.support.shape[0], chunk)
            ]
        )
        accs[label] = (pred == y_q).double().mean(1)
    base = accs[LAPLACIAN_VARIANTS[0][0]]
    for label, acc in accs.items():
        m, ci = mean_ci(acc)
        d, dci = paired_difference(acc, base)
        print(
            f"laplacianshot {label:36s} {100 * m:6.2f} ± {100 * ci:.2f}   vs default {100 * d:+6.2f} ± {100 * dci:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=METHODS, action="append", default=[])
    ap.add_argument(
        "--laplacian-ablation",
        action="store_true",
        help="ours only: LaplacianShot with each difference from the released code switched alone",
    )
    ap.add_argument("--checkout", help="the authors' repository (default: $POODLE_OFFICIAL_<METHOD>)")
    ap.add_argument("--cache", help="feature cache (HDF5); default: synthetic features")
    ap.add_argument("--split", default="test")
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--shot", type=int, default=1)
    ap.add_argument("--query", type=int, default=15)
    ap.add_argument("--imbalance", type=float)
    ap.add_argument("--query-classes", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dim", type=int, default=64, help="synthetic features' dimension")
    ap.add_argument("--spread", type=float, default=1.5, help="synthetic features' within-class spread")
    ap.add_argument("--steps", type=int, help="override both sides' iteration counts (quick checks)")
    ap.add_argument(
        "--their-batch",
        type=int,
        default=0,
        help="episodes per call of their code (0: all at once; 1: their batch-wide Sinkhorn "
        "stopping becomes per episode, as ours)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.cache:
        x, eps = cache_episodes(
            a.cache, a.split, a.episodes, a.way, a.shot, a.query, a.seed, a.imbalance, a.query_classes
        )
    else:
        x, eps = synthetic_episodes(
            a.episodes, a.way, a.shot, a.query, a.dim, a.seed, a.spread, a.imbalance, a.query_classes
        )
    batch, y_q = as_batch(x, eps)
    print(
        f"torch {torch.__version__}, numpy {np.__version__}; {a.episodes} episodes {a.way}-way {a.shot}-shot "
        f"{a.query} queries"
        + (f", imbalance {a.imbalance:g}" if a.imbalance else "")
        + (f", query classes {a.query_classes}" if a.query_classes else "")
        + f", features {'from ' + a.cache if a.cache else f'synthetic D={a.dim}'}"
    )
    if a.laplacian_ablation:
        laplacian_ablation(batch, y_q)
    for method in a.method:
        env = "POODLE_OFFICIAL_" + method.upper().replace("-", "_")
        checkout = a.checkout if len(a.method) == 1 and a.checkout else os.environ.get(env)
        if not checkout:
            print(f"{method}: skipped (give --checkout or set {env} to the authors' repository)")
            continue
        r = compare(method, Path(checkout), batch, y_q, a.steps, a.their_batch)
        pa = r["prediction_agreement"]
        agree = "" if pa is None else f", predictions agree {100 * pa:.2f}%"
        print(
            f"{method}: identical accuracy on {r['identical']}/{r['episodes']} episodes{agree}; mean accuracy "
            f"ours {100 * r['ours']:.2f}%, theirs {100 * r['theirs']:.2f}%; largest per-episode difference "
            f"{100 * r['max_diff']:.2f} points; options {r['options']}"
            + (f"; differing episodes {r['differing']}" if r["differing"] else "")
        )


if __name__ == "__main__":
    main()
