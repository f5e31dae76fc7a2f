"""The authors' released code of each transductive method, run as its own evaluation runs it.

Used by ``benchmarks/compare_official.py``; nothing of theirs is copied here. Each driver takes a
checkout of the release (a directory given by the user) and a set of episodes, and runs the
release's own functions in the order and with the batching of its evaluation script, with the
configuration values of its released config files or scripts. Feature extraction (which their
evaluations do from images) is replaced by the episodes' features; task sampling by our episodes.

What is changed in their code (nothing else):

* the device: ``.cuda()`` returns the tensor itself and ``torch.cuda.is_available()`` is False
  while their code runs (:func:`on_cpu`); protoLP hard-codes ``device='cuda'`` in its source, which
  is executed with ``'cpu'`` instead, and its 5-way / 10,000-episode identity sized to the episodes;
* functions removed from the libraries since: ``torch.qr`` (PT-MAP, BMS) is given as
  ``torch.linalg.qr(mode="reduced")``, the replacement BMS has commented out; ``np.float``
  (LaplacianShot) as ``float``;
* progress bars are silenced and their prints go nowhere (they still run).

Each driver returns :class:`Theirs`: per-episode accuracies as their evaluation computes them, the
predictions where their code exposes them, and the seconds their evaluation loop took (their
module imported and the episodes' features in memory, as after their feature extraction).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import sys
import tempfile
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F


# ------------------------------------------------------------------------------------- episodes
@dataclass
class Episodes:
    """``E`` episodes, with both inputs a method's code may receive.

    ``s_raw [E, Ns, D]``, ``q_raw [E, Nq, D]``: the backbone's rows (a cache stores each row
    normalised and its norm; ``raw = row * norm``), what the releases' evaluations feed their
    methods. ``s_l2n``, ``q_l2n``: the L2-normalised rows poodle's solvers receive (``--preprocess
    l2n``). ``y_s [E, Ns]`` class-major (``arange(way).repeat_interleave(shot)``), ``y_q [E, Nq]``.
    ``train_mean [D]``: mean raw row of the cache's ``train`` split (SimpleShot's centring, used by
    LaplacianShot's CL2N and TAFSSL), or ``None``.
    """

    s_raw: torch.Tensor
    q_raw: torch.Tensor
    s_l2n: torch.Tensor
    q_l2n: torch.Tensor
    y_s: torch.Tensor
    y_q: torch.Tensor
    way: int
    shot: int
    train_mean: torch.Tensor | None

    @property
    def n(self) -> int:
        return self.s_raw.shape[0]

    def inputs(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(support, query)`` copies: ``kind`` ``"raw"`` or ``"l2n"``."""
        s, q = (self.s_raw, self.q_raw) if kind == "raw" else (self.s_l2n, self.q_l2n)
        return s.clone(), q.clone()

    def head(self, n: int) -> Episodes:
        """The first ``n`` episodes."""
        sl = slice(0, n)
        return Episodes(
            self.s_raw[sl], self.q_raw[sl], self.s_l2n[sl], self.q_l2n[sl], self.y_s[sl], self.y_q[sl],
            self.way, self.shot, self.train_mean,
        )  # fmt: skip

    def one_ulp(self, seed: int = 0) -> Episodes:
        """The same episodes with every coordinate of every row moved by at most one unit in the
        last place (up or down, or kept, each with a seeded coin per coordinate and direction): an
        input change of the size of one rounding, to see whether a release reproduces itself."""
        g = torch.Generator().manual_seed(seed)

        def nudge(x: torch.Tensor) -> torch.Tensor:
            move = torch.rand(x.shape, generator=g) < 0.5
            up = torch.rand(x.shape, generator=g) < 0.5
            towards = torch.where(up, torch.full_like(x, float("inf")), torch.full_like(x, float("-inf")))
            return torch.where(move, torch.nextafter(x, towards), x)

        return Episodes(
            nudge(self.s_raw), nudge(self.q_raw), nudge(self.s_l2n), nudge(self.q_l2n), self.y_s, self.y_q,
            self.way, self.shot, self.train_mean,
        )  # fmt: skip

    def interleaved(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data [E, Ns + Nq, D], labels [E, Ns + Nq])`` in the layout of the PT-MAP family's
        scripts: support first, ordered shot-major (``s * way + c``, which their
        ``initFromLabelledDatas`` reshapes), then the queries (their order matters to nothing)."""
        s, q = self.inputs(kind)
        E, _, D = s.shape
        order = self.y_s.argsort(dim=1, stable=True).view(E, self.way, self.shot).transpose(1, 2).reshape(E, -1)
        s = torch.gather(s, 1, order.unsqueeze(-1).expand(-1, -1, D))
        y = torch.gather(self.y_s, 1, order)
        return torch.cat([s, q], 1), torch.cat([y, self.y_q], 1)


@dataclass
class Theirs:
    """What a release's evaluation gives: ``acc [E]`` float64 in [0, 1], ``pred [E, Nq]`` or None,
    ``seconds`` of its evaluation loop, and ``how`` (batching, configuration) in words."""

    acc: np.ndarray
    pred: torch.Tensor | None
    seconds: float
    how: str


# ---------------------------------------------------------------------------- running their code
@contextlib.contextmanager
def on_cpu():
    """While their code runs: ``.cuda()`` is the identity and CUDA reports unavailable (the device
    is the one thing patched); their prints and log lines are swallowed."""
    saved = (torch.Tensor.cuda, torch.nn.Module.cuda, torch.cuda.is_available)
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda, torch.cuda.is_available = saved  # type: ignore[method-assign]


class _NoBar:
    """Their ``tqdm``: iterates, counts nothing, prints nothing."""

    def __init__(self, it=None, *a, **k):
        self.it = it

    def __iter__(self):
        return iter(self.it)

    def update(self, *a, **k): ...
    def close(self): ...


class _Features:
    """Their backbone, after extraction: ``model(x, feature=True)`` returns ``(x, None)``."""

    def __call__(self, x, *a, **k):
        return x, None

    def train(self): ...
    def eval(self): ...


def _import_from(root: Path, name: str, stubs: tuple[str, ...] = ()):
    """Import ``name`` from ``root`` afresh (several releases call their package ``src`` or
    ``utils``). ``stubs``: packages made importable without running their ``__init__`` (which
    imports every method and its dependencies)."""
    top = name.split(".")[0]
    for k in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    for pkg in stubs:
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root.joinpath(*pkg.split(".")))]
        sys.modules[pkg] = mod
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))


def _stub_requests() -> None:
    """PADDLE's and TAFSSL's utils import ``requests`` (for downloads this comparison never makes)."""
    if "requests" not in sys.modules and importlib.util.find_spec("requests") is None:
        sys.modules["requests"] = types.ModuleType("requests")


def _torch_with_qr() -> types.ModuleType:
    """``torch`` with ``torch.qr`` (removed from PyTorch) as ``torch.linalg.qr(mode="reduced")``."""
    shim = types.ModuleType("torch_with_qr")
    shim.__dict__.update(torch.__dict__)
    shim.qr = lambda a: torch.linalg.qr(a, mode="reduced")  # type: ignore[attr-defined]
    return shim


def _log_file() -> str:
    return tempfile.NamedTemporaryFile(prefix="official-", suffix=".log", delete=False).name


def _tasks(s: torch.Tensor, q: torch.Tensor, ep: Episodes, sl: slice, xs: str = "x_s", xq: str = "x_q") -> dict:
    """A task dictionary as their task generators build it (labels ``[n_tasks, N, 1]``)."""
    return {
        xs: s[sl],
        "y_s": ep.y_s[sl].unsqueeze(-1),
        xq: q[sl],
        "y_q": ep.y_q[sl].unsqueeze(-1),
        "train_mean": ep.train_mean,
    }


def _acc(pred: torch.Tensor, y_q: torch.Tensor) -> np.ndarray:
    return (pred == y_q).double().mean(1).numpy()


# ------------------------------------------------------------------------------- mboudiaf/TIM
def tim(checkout: Path, ep: Episodes, kind: str, which: str) -> Theirs:
    """mboudiaf/TIM ``src/eval.py`` ``Evaluator.run_task`` (every task at once, as its evaluation:
    ``number_tasks`` tasks in one call), through sacred with the ``tim`` ingredient's config
    (``src/tim.py``: temp 15, weights 0.1/1/0.1, lr 1e-4, 150 iterations) and, for TIM-GD,
    ``tim.iter=1000`` as ``scripts/evaluate/tim_gd/*.sh`` set it."""
    with warnings.catch_warnings():  # sacred imports pkg_resources, deprecated
        warnings.simplefilter("ignore")
        from sacred import SETTINGS, Experiment

    SETTINGS.CAPTURE_MODE = "no"
    with on_cpu():
        E_ = _import_from(checkout, "src.eval", stubs=("src",))
    T = sys.modules["src.tim"]
    T.tqdm = _NoBar
    ex = Experiment("compare_official", ingredients=[E_.eval_ingredient, T.tim_ingredient], save_git_info=False)
    ex.logger = __import__("logging").getLogger("compare_official.sacred")
    ex.logger.setLevel("ERROR")
    s, q = ep.inputs(kind)
    out: dict = {}

    @ex.main
    def _run():
        evaluator = E_.Evaluator(device="cpu", ex=ex)
        with on_cpu():
            t = time.perf_counter()
            logs = evaluator.run_task(
                task_dic=_tasks(s, q, ep, slice(None), "z_s", "z_q"), model=_NoModel(), callback=None
            )
            out["seconds"] = time.perf_counter() - t
        out["acc"] = logs["acc"][:, -1].astype(np.float64)

    updates: dict = {"eval": {"method": which}}
    if which == "tim_gd":
        updates["tim"] = {"iter": 1000}
    ex.run(config_updates=updates, options={"--loglevel": "ERROR"})
    iters = "1000 (scripts/evaluate/tim_gd)" if which == "tim_gd" else "150 (src/tim.py config)"
    return Theirs(out["acc"], None, out["seconds"], f"all {ep.n} tasks in one call; iterations {iters}")


class _NoModel:
    def train(self): ...
    def eval(self): ...


# ---------------------------------------------------------- oveilleux/Realistic_Transductive_Few_Shot
def alpha_tim(checkout: Path, ep: Episodes, kind: str) -> Theirs:
    """``src/eval.py`` ``Evaluator.run_full_evaluation``'s loop: per batch of ``batch_size`` tasks
    (1 in every released base config), a new ``ALPHA_TIM`` built from the base config and
    ``methods_config/alpha_tim.yaml``, ``run_task`` (features, L2 normalisation, lambda, prototypes,
    1,000 Adam steps recording accuracy and entropies each step), accuracy at the last step."""
    U = _import_from(checkout, "src.utils", stubs=("src",))
    T = _import_from(checkout, "src.methods.tim", stubs=("src", "src.methods"))
    T.tqdm = _NoBar
    setting = "dirichlet"  # their protocol; config/balanced has the same method config and batch size
    args = U.load_cfg_from_cfg_file(str(checkout / f"config/{setting}/base_config/resnet18/mini/base_config.yaml"))
    args.update(U.load_cfg_from_cfg_file(str(checkout / f"config/{setting}/methods_config/alpha_tim.yaml")))
    s, q = ep.inputs(kind)
    log, bs, accs, preds, untimed = _log_file(), int(args.batch_size), [], [], 0.0
    with on_cpu():
        t = time.perf_counter()
        for lo in range(0, ep.n, bs):
            method = T.ALPHA_TIM(model=_Features(), device="cpu", log_file=log, args=args)
            logs = method.run_task(task_dic=_tasks(s, q, ep, slice(lo, lo + bs)), shot=ep.shot)
            accs.append(logs["acc"][:, -1])
            t_pred = time.perf_counter()  # their predictions, for the agreement only: not timed
            preds.append(method.get_preds(F.normalize(q[lo : lo + bs], dim=2)).detach())
            untimed += time.perf_counter() - t_pred
            del method
        secs = time.perf_counter() - t - untimed
    how = f"batch_size {bs} (config/{setting}/base_config), alpha_tim.yaml: {args.iter} iterations"
    return Theirs(np.concatenate(accs).astype(np.float64), torch.cat(preds), secs, how)


# ------------------------------------------------------------------------- SegoleneMartin/PADDLE
def paddle(checkout: Path, ep: Episodes, kind: str) -> Theirs:
    """``src/eval.py``'s loop: per batch of ``batch_size`` tasks (1,000, ``config/main_config.yaml``),
    a new ``PADDLE`` from ``config/mini/resnet18/methods_config/paddle.yaml`` (alpha 75, 100
    iterations) and ``run_task`` (min-max scaling, then the block updates)."""
    _stub_requests()
    U = _import_from(checkout, "src.utils", stubs=("src",))
    P = _import_from(checkout, "src.methods.paddle", stubs=("src", "src.methods"))
    P.tqdm = _NoBar
    args = U.load_cfg_from_cfg_file(str(checkout / "config/main_config.yaml"))
    args.update(U.load_cfg_from_cfg_file(str(checkout / "config/mini/resnet18/methods_config/paddle.yaml")))
    s, q = ep.inputs(kind)
    log, bs, accs, preds = _log_file(), int(args.batch_size), [], []
    with on_cpu():
        t = time.perf_counter()
        for lo in range(0, ep.n, bs):
            method = P.PADDLE(model=None, device="cpu", log_file=log, args=args)
            logs = method.run_task(task_dic=_tasks(s, q, ep, slice(lo, lo + bs)), shot=ep.shot)
            accs.append(logs["acc"][:, -1])
            preds.append(method.u.argmax(2))
            del method
        secs = time.perf_counter() - t
    how = f"batch_size {bs} (main_config.yaml), paddle.yaml: alpha {args.alpha}, {args.iter} iterations"
    return Theirs(np.concatenate(accs).astype(np.float64), torch.cat(preds), secs, how)


# --------------------------------------------------------------------- imtiazziko/LaplacianShot
def laplacianshot(checkout: Path, ep: Episodes, kind: str, norm_type: str = "CL2N") -> Theirs:
    """``src/train_lshot.py`` ``meta_evaluate``: one episode at a time, ``metric_class_type`` with
    the release's defaults (``src/utils/configuration.py`` and ``run.sh``: ``--lshot``, lambda 1.0,
    knn 3, ``--proto-rect True``) and ``norm_type`` (their tables report CL2N: centred on the mean
    train feature, then L2-normalised; ``meta_evaluate`` also runs L2N and UN on every episode,
    which is not timed here). The four functions it uses are taken from their source unchanged
    (the module itself loads datasets and models at import)."""
    from numpy import linalg as LA
    from scipy import sparse
    from sklearn.neighbors import NearestNeighbors

    for k in ("matplotlib", "matplotlib.pyplot"):  # imported by lshot_update for its plots only
        sys.modules.setdefault(k, types.ModuleType(k))
    sys.modules["matplotlib"].use = lambda *a, **k: None  # type: ignore[attr-defined]
    L = _import_from(checkout / "src", "lshot_update")
    tree = ast.parse((checkout / "src" / "train_lshot.py").read_text())
    wanted = ("get_metric", "metric_class_type", "create_affinity", "lshot_prediction")
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    np_shim = types.ModuleType("numpy_with_float")
    np_shim.__dict__.update(np.__dict__)
    np_shim.float = float  # type: ignore[attr-defined]
    args = argparse.Namespace(
        proto_rect=True, meta_val_way=ep.way, lshot=True, lmd=1.0, knn=3, plot_converge=False, num_NN=1
    )
    ns = dict(np=np_shim, LA=LA, torch=torch, F=F, sparse=sparse, NearestNeighbors=NearestNeighbors)
    ns.update(bound_update=L.bound_update, args=args)
    exec(compile(ast.Module(body=keep, type_ignores=[]), "train_lshot.py", "exec"), ns)
    s, q = ep.inputs(kind)
    s_np, q_np = s.numpy().astype(np.float32), q.numpy().astype(np.float32)
    mean = None if ep.train_mean is None else ep.train_mean.numpy().astype(np.float32)
    ys, yq = ep.y_s.numpy(), ep.y_q.numpy()
    accs = []
    with on_cpu():
        t = time.perf_counter()
        for e in range(ep.n):
            accs.append(
                ns["metric_class_type"](
                    s_np[e], q_np[e], ys[e], yq[e].tolist(), ep.shot, train_mean=mean, norm_type=norm_type
                )
            )
        secs = time.perf_counter() - t
    how = f"one episode per call, {norm_type}, lambda {args.lmd}, knn {args.knn}, proto_rect"
    return Theirs(np.asarray(accs, dtype=np.float64), None, secs, how)


# ---------------------------------------------------------------------------------- yhu01/PT-MAP
def pt_map(checkout: Path, ep: Episodes, kind: str, batch: int = 0) -> Theirs:
    """``test_standard.py``'s ``__main__``: every run at once (``n_runs`` 10,000 there; ``batch``
    episodes per call here, 0 for all), power transform (beta 0.5, ``+1e-6``), QR reduction, unit
    norm, ``centerDatas``, ``GaussianModel(lam=10).initFromLabelledDatas``, ``MAP(0.2).loop`` for
    20 epochs; predictions from the final ``getProbas``. Its Sinkhorn stops when the whole batch
    has converged (tolerance 1e-6)."""
    with on_cpu():
        M = _import_from(checkout, "test_standard")
    M.tqdm, M.torch = _NoBar, _torch_with_qr()
    data, labels = ep.interleaved(kind)
    size, preds, secs = batch or ep.n, [], 0.0
    n_l = ep.way * ep.shot
    for lo in range(0, ep.n, size):
        d, lab = data[lo : lo + size].clone(), labels[lo : lo + size]
        g = M.__dict__
        g.update(n_shot=ep.shot, n_ways=ep.way, n_queries=ep.y_q.shape[1] // ep.way, n_runs=d.shape[0])
        g.update(n_lsamples=n_l, n_usamples=ep.y_q.shape[1], n_samples=d.shape[1], labels=lab)
        with on_cpu():
            t = time.perf_counter()
            d[:,] = torch.pow(d[:,] + 1e-6, 0.5)
            d = M.QRreduction(d)
            g["n_nfeat"] = d.size(2)
            d = M.scaleEachUnitaryDatas(d)
            d = M.centerDatas(d)
            g["ndatas"] = d
            model = M.GaussianModel(ep.way, 10)
            model.initFromLabelledDatas()
            optim = M.MAP(0.2)
            optim.verbose, optim.progressBar = False, True
            optim.loop(model, n_epochs=20)
            secs += time.perf_counter() - t
            preds.append(model.getProbas()[:, n_l:].argmax(2))
    pred = torch.cat(preds)
    return Theirs(_acc(pred, ep.y_q), pred, secs, f"{size} episodes per call; lam 10, alpha 0.2, 20 epochs")


# ------------------------------------------------------------------------------------- yhu01/BMS
def bms(checkout: Path, ep: Episodes, kind: str, batch: int = 0) -> Theirs:
    """``test_standard_bms.py`` with its ``parse_args`` defaults (``--method BMS --preprocess PEME
    --step 20 --lam 8.5 --epoch 0 --lr 0.1 --mmt 0.8``): every run at once, ``getRunSet``'s PEME
    steps on a ``DataSet``, then its ``__main__``: ``SimpleWMask``, ``Optimizer``,
    ``TrainedLinRegModel.initFromLabelledDatas``, 20 x (``getProbas``, ``getWMask``,
    ``getMinsize``, ``train``, ``getAccuracy``)."""
    for k in ("matplotlib", "matplotlib.pyplot"):
        sys.modules.setdefault(k, types.ModuleType(k))
    with on_cpu():
        B = _import_from(checkout, "test_standard_bms")
    B.torch = _torch_with_qr()
    B.params = argparse.Namespace(method="BMS", preprocess="PEME", step=20, lam=8.5, epoch=0, lr=0.1, mmt=0.8)
    p = B.params
    data, labels = ep.interleaved(kind)
    size, preds, secs, n_l = batch or ep.n, [], 0.0, ep.way * ep.shot
    for lo in range(0, ep.n, size):
        with on_cpu():
            t = time.perf_counter()
            ds = B.DataSet(
                data[lo : lo + size].clone(), n_shot=ep.shot, n_ways=ep.way, n_queries=ep.y_q.shape[1] // ep.way
            )
            ds.labels[:, n_l:] = labels[lo : lo + size, n_l:]  # their labels assume balanced, interleaved queries
            for c in p.preprocess:  # getRunSet's loop for PEME
                if c == "P":
                    ds.data = torch.sqrt(ds.data + 1e-6)
                elif c == "M":
                    ds.data = B.QRreduction(B.centerDatas(ds.data))
                    ds.n_feat = ds.data.size(2)
                elif c == "E":
                    ds.data = B.scaleEachUnitaryDatas(ds.data)
            wmasker = B.SimpleWMask(ds)
            optim = B.Optimizer(ds, wmasker=wmasker)
            mm = B.TrainedLinRegModel(ds)
            mm.initFromLabelledDatas()
            probas = mm.getProbas()
            optim.getAccuracy(probas)
            min_size = torch.ones(ds.n_runs) * ep.shot
            for _ in range(p.step):
                probas = mm.getProbas(scoresRescale=p.lam)
                probas = wmasker.getWMask(probas, min_size)
                min_size = wmasker.getMinsize(probas)
                mm.train(probas, {"lr": p.lr, "mmt": p.mmt, "epochs": p.epoch}, wmasker=wmasker, updateWeights=True)
                optim.getAccuracy(probas)
            secs += time.perf_counter() - t
        preds.append(probas[:, n_l:].argmax(2))
    pred = torch.cat(preds)
    return Theirs(_acc(pred, ep.y_q), pred, secs, f"{size} episodes per call; lam {p.lam}, {p.step} steps, 0 epochs")


# ------------------------------------------------------------------------------ allenhaozhu/protoLP
def proto_lp(checkout: Path, ep: Episodes, kind: str, batch: int = 0) -> Theirs:
    """``test_standard_GSSL_lapshot.py``'s ``__main__``: every run at once (10,000 there; ``batch``
    episodes per call here, 0 for all), power 0.5 (``+1e-6``), unit norm, SVD to 40 dims,
    ``centerDatas``, ``GaussianModel(lam=10).initFromLabelledDatas``, ``MAP(0.2).loop`` for 100
    epochs with ``verbose = True`` as there (each epoch also re-scores for its printout), the final
    ``getProbas``. Both Sinkhorn loops stop when the whole batch has converged (1e-3, 0.01)."""
    path = checkout / "test_standard_GSSL_lapshot.py"
    src = path.read_text().replace("device='cuda'", "device='cpu'")
    src = src.replace("torch.eye(5,", "torch.eye(n_ways,").replace("reshape((1, 5, 5))", "reshape((1, n_ways, n_ways))")
    src = src.replace("repeat(10000, 1, 1)", "repeat(n_runs, 1, 1)")
    sys.modules.setdefault("tqdm.notebook", importlib.import_module("tqdm"))
    M = types.ModuleType("protolp_official")
    with on_cpu():
        exec(compile(src, str(path), "exec"), M.__dict__)
    g = M.__dict__
    g["tqdm"] = _NoBar
    data, labels = ep.interleaved(kind)
    size, preds, secs = batch or ep.n, [], 0.0
    n_l, n_u, way = ep.way * ep.shot, ep.y_q.shape[1], ep.way
    n_qc = n_u // way
    for lo in range(0, ep.n, size):
        nd, lab = data[lo : lo + size].clone(), labels[lo : lo + size]
        E = nd.shape[0]
        g.update(n_runs=E, n_shot=ep.shot, n_ways=way, n_queries=n_qc, n_lsamples=n_l, n_usamples=n_u, labels=lab)
        with on_cpu():
            t = time.perf_counter()
            nd[:,] = torch.pow(nd[:,] + 1e-6, 0.5)
            nd = M.scaleEachUnitaryDatas(nd)
            nd = M.SVDreduction(nd, 40)
            n_nfeat = nd.size(2)
            nd = M.centerDatas(nd)
            model = M.GaussianModel(way, 10)
            model.initFromLabelledDatas(nd, E, ep.shot, n_qc, way, n_nfeat)
            optim = M.MAP(0.2)
            optim.verbose, optim.progressBar = True, True
            optim.loop(model, nd, E, way, n_u, n_l, n_epochs=100)
            secs += time.perf_counter() - t
            preds.append(model.getProbas(nd, E, way, n_u, n_l)[:, n_l:].argmax(2))
    pred = torch.cat(preds)
    return Theirs(_acc(pred, ep.y_q), pred, secs, f"{size} episodes per call; lam 10, alpha 0.2, 40 dims, 100 epochs")


# ---------------------------------------------------------------------------- moseslichten/TAFSSL
def tafssl(checkout: Path, ep: Episodes, kind: str, which: str) -> Theirs:
    """``src/exp_table.py`` ``run_episode``: one episode at a time, ``ProtoMSP`` with
    ``utils/misc.py``'s ``parse_args`` defaults (sigma 1, 4 MSP iterations, 5 clusters) and
    ``reduced_dim`` 10 as ``run_episode`` sets it for its clustering and MSP rows; ``which``
    ``"msp"`` is its "pca msp" row (``method_project_and_mean_shift(z, mean_and_norm_ber,
    calc_pca)``), ``"bkm"`` its "pca cluster" row (``method_proj_and_cluster``, scikit-learn
    ``KMeans`` with its default k-means++ seeding, NumPy's global generator seeded 0 here). Only
    this row is timed (``run_episode`` runs eleven)."""
    _stub_requests()
    with on_cpu():
        Msp = _import_from(checkout / "src", "utils.proto_msp")
    opt = argparse.Namespace(n_way=ep.way, n_shot=ep.shot, n_query=ep.y_q.shape[1] // ep.way, reduced_dim=10)
    opt.__dict__.update(n_clusters=5, n_iter_msp=4, sigma=1)
    s, q = ep.inputs(kind)
    z = torch.cat([s, q], 1)
    preds = []
    np.random.seed(0)
    with on_cpu(), torch.no_grad():
        model = Msp.ProtoMSP(opt=opt)
        model.train_mean = None if ep.train_mean is None else ep.train_mean.numpy()
        t = time.perf_counter()
        for e in range(ep.n):
            if which == "msp":
                scores = model.method_project_and_mean_shift(z[e], model.mean_and_norm_ber, model.calc_pca)
            else:
                scores = model.method_proj_and_cluster(z[e], model.mean_and_norm_ber, model.calc_pca)
            preds.append(scores.argmax(0))
        secs = time.perf_counter() - t
    pred = torch.stack(preds)
    row = "pca msp" if which == "msp" else "pca cluster (k-means++)"
    return Theirs(_acc(pred, ep.y_q), pred, secs, f"one episode per call, {row}, reduced_dim 10")


# ------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Release:
    """One comparison row: ``method`` (ours), ``repo`` (owner/name of the release), ``run``
    (``(checkout, episodes, input kind) -> Theirs``; the kind ``"raw"`` is what their evaluation
    feeds, ``"l2n"`` our solvers' L2-normalised rows), ``ours`` (the ``poodle solve`` options that
    match the release's defaults and preprocessing), ``l2n`` (also run their code on our rows: where
    the input, not the method, makes the difference), ``max_episodes`` (0: all), ``note``."""

    method: str
    repo: str
    run: Callable[[Path, Episodes, str], Theirs]
    ours: tuple[str, ...] = ()
    l2n: bool = False
    max_episodes: int = 0
    note: str = ""


RELEASES: tuple[Release, ...] = (
    Release("tim-gd", "mboudiaf/TIM", lambda c, e, k: tim(c, e, k, "tim_gd")),
    Release("tim-adm", "mboudiaf/TIM", lambda c, e, k: tim(c, e, k, "tim_adm")),
    Release("alpha-tim", "oveilleux/Realistic_Transductive_Few_Shot", alpha_tim),
    Release("paddle", "SegoleneMartin/PADDLE", paddle, l2n=True),
    Release(
        "laplacianshot",
        "imtiazziko/LaplacianShot",
        laplacianshot,
        ours=("--preset", "official", "--preprocess", "cl2n"),
        note="CL2N, as their tables",
    ),
    Release(
        "laplacianshot",
        "imtiazziko/LaplacianShot",
        lambda c, e, k: laplacianshot(c, e, k, "L2N"),
        ours=("--preset", "official"),
        note="L2N",
    ),
    Release("pt-map", "yhu01/PT-MAP", pt_map),
    Release("bms", "yhu01/BMS", bms),
    Release("proto-lp", "allenhaozhu/protoLP", proto_lp),
    Release(
        "proto-lp",
        "allenhaozhu/protoLP",
        lambda c, e, k: proto_lp(c, e, k, batch=1),
        max_episodes=200,
        note="one episode per call (their Sinkhorn stops per batch)",
    ),
    Release("mean-shift", "moseslichten/TAFSSL", lambda c, e, k: tafssl(c, e, k, "msp"), l2n=True),
    Release("bayes-kmeans", "moseslichten/TAFSSL", lambda c, e, k: tafssl(c, e, k, "bkm")),
)
