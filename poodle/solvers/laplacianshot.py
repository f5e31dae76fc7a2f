"""LaplacianShot: Laplacian-regularised transductive inference by bound optimisation.

Imtiaz Masud Ziko, Jose Dolz, Eric Granger, Ismail Ben Ayed. "Laplacian Regularized Few-Shot
Learning", ICML 2020, arXiv:2006.15486.

Minimises, per episode, ``sum_q y_q . a_q - lambda sum_{q,q'} w_{qq'} y_q . y_q'`` over query
assignments ``y_q`` on the simplex, with unary ``a_q[k] = ||z_q - m_k||^2`` to the prototypes
``m_k`` (BD-CSPN-rectified by default, as the authors' released runs) and ``w`` the kNN graph of
the queries (``w_{qq'} = 1`` when ``q'`` is among the ``knn`` nearest other queries of ``q``).
The concave-convex bound gives independent closed-form updates ``y_q = softmax(-a_q + lambda
sum_q' w_{qq'} y_q')``, iterated until the bound's energy changes by at most ``tol`` (relative) or
for ``steps`` iterations; each episode stops on its own (a mask). Transductive.

Two variants (``preset``). The default, ``"default"``, is the method as the paper writes it: a
``knn`` graph over the *other* queries, BD-CSPN prototypes as the BD-CSPN paper defines them
(Liu et al. 2020: per class, its support points plus the shifted queries nearest to it, averaged
with weights normalised over those members), and the unary term on the unshifted queries.
``"official"`` reproduces the authors' released code (imtiazziko/LaplacianShot,
``src/train_lshot.py`` ``metric_class_type`` with ``--proto-rect True --lshot``, and
``src/lshot_update.py``) exactly, which differs in four ways:

* their kNN graph (scikit-learn ``NearestNeighbors(n_neighbors=knn)``, first column dropped)
  counts each point as its own nearest neighbour, so their ``knn = 3`` links each query to 2 others
  (our default's ``knn = 2``);
* their prototype rectification re-predicts every support *and* query point (shifted queries) by
  cosine to the support means, weights each member by the softmax *over classes* of
  ``epsilon * cosine`` (``epsilon = 10``), and takes the plain mean of the weighted members (the
  weights do not sum to 1, so prototypes shrink); a class no point is predicted into is dropped,
  and, as in their code, the later classes then answer with the dropped class's label (their
  ``np.take(support_label, l)`` indexes the shortened prototype list; it needs every support
  point of a class to be nearer another class's mean and no query, so only from 2 shots);
* the unary term uses the shifted queries ``z_q + mean(z_s) - mean(z_q)``;
* lambda is 1.0 (``run.sh``'s ``--lmd 1.0``, the default of its ``--lmd``; ``run.sh`` also asks
  for ``--tune-lmd``, a search over 0.1..1.5 on the validation split, which needs that split's
  features); the default preset keeps 0.7.

The options ``self_neighbour``, ``released_rectification`` and ``shifted_unary`` switch the three
one at a time (``None``, their default, follows the preset), so each one's effect can be measured.

How much the variants differ depends on the features: on the glyph demo features they are within
0.3 points of each other (1 and 5 shots), on low-margin synthetic features the released
rectification alone adds 7 points at 1 shot (docs/transductive.md gives each difference's effect).

Differences from the POODLE authors' ``laplacian.py`` (docs/reference.md §2; it cannot run as
shipped): batched over episodes (kNN by ``torch.cdist`` + ``topk`` per episode batch, no
scikit-learn); ``knn``, ``lmd`` have values (theirs referenced undefined options); a class with no
predicted sample keeps its prototype (theirs dropped it, shrinking the prototype list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from poodle.options import option
from poodle.solvers._transductive import (
    TINY,
    cosine,
    dist_flops,
    mask_padded_classes,
    masked_mean,
    rectified_prototypes,
    row_sqnorm,
    row_weight,
    should_stop,
    sqdist,
    times_narrow,
)
from poodle.solvers.base import (
    EpisodeBatch,
    SolverOutput,
    class_means,
    mask_classes,
    one_hot,
    register,
    validate_config,
)

PRESETS: dict[str, dict[str, Any]] = {
    # the method as Ziko et al.'s paper and BD-CSPN's paper write it; lambda 0.7 from the paper's
    # validation grid (0.1..1.0)
    "default": dict(lmd=0.7, self_neighbour=False, released_rectification=False, shifted_unary=False),
    # imtiazziko/LaplacianShot as released (src/train_lshot.py metric_class_type, run.sh: --lshot
    # --proto-rect True --lmd 1.0, the default of src/utils/configuration.py's --lmd; knn 3 there too)
    "official": dict(lmd=1.0, self_neighbour=True, released_rectification=True, shifted_unary=True),
}


@dataclass(frozen=True)
class LaplacianShotConfig:
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS
    knn: int = option(3, min=1)  # Ziko et al.: k = 3 nearest neighbours
    lmd: float | None = option(None, min=0)  # lambda (None: the preset's; 0.7 default, 1.0 official)
    steps: int = option(20, min=0)  # bound iterations (authors' bound_update default)
    tol: float = option(1e-6, min=0)  # relative energy change that stops an episode
    rectify: bool = True  # BD-CSPN prototype rectification (the authors' proto_rect)
    epsilon: float = option(10.0, min=0, min_open=True)  # rectification temperature
    preset: str = "default"  # "official": the authors' released code exactly (see the module docstring)
    # The three differences one at a time (None: the preset's value), to measure each one's effect:
    self_neighbour: bool | None = None  # knn counts the point itself
    released_rectification: bool | None = None  # the released prototype rectification
    shifted_unary: bool | None = None  # unary term on the shifted queries

    def __post_init__(self) -> None:
        validate_config(self, "laplacianshot")

    def resolved(self) -> tuple[bool, bool, bool]:
        """``(self_neighbour, released_rectification, shifted_unary)`` as used."""
        return bool(self.self_neighbour), bool(self.released_rectification), bool(self.shifted_unary)

    def lambda_used(self) -> float:
        """``lmd`` as used (the preset's unless given; a built config always holds it)."""
        return float(self.lmd if self.lmd is not None else PRESETS[self.preset]["lmd"])


def knn_graph(z_q: Tensor, k: int, q2: Tensor | None = None, query_mask: Tensor | None = None) -> Tensor:
    """``z_q [E, Nq, D]`` -> ``[E, Nq, Nq]`` 0/1 affinity: row ``q`` marks its ``k`` nearest other
    queries (Euclidean; self excluded; ``k`` clipped to ``Nq - 1``; ``q2``: :func:`row_sqnorm` of
    ``z_q`` when the caller has it). ``query_mask [E, Nq]``: a ragged chunk's real queries; a padded
    query is nobody's neighbour and has none (its row and column are zero), and ``k`` is clipped to
    each episode's own count less one.

    Squared distances from the queries' Gram matrix, ``||a||^2 + ||b||^2 - 2 a.b``: one batched
    product and no ``[E, Nq, D + 2]`` copies (``torch.cdist`` augments both sides with their norms),
    and no square root, which ranks nothing differently."""
    E, n, _ = z_q.shape
    k = min(k, n - 1)
    # each episode's matrix starts 64-byte aligned whatever the batch (MKL rounds a product of
    # misaligned operands differently, so W y would depend on the episode's place in the chunk)
    size = n * n
    w = torch.zeros(E, -(-size // 16) * 16, dtype=z_q.dtype, device=z_q.device)[:, :size].view(E, n, n)
    if k <= 0:
        return w
    q2 = row_sqnorm(z_q) if q2 is None else q2
    d = torch.baddbmm(q2 + q2.transpose(1, 2), z_q, z_q.transpose(1, 2), alpha=-2.0)
    d.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    if query_mask is None:
        idx = d.topk(k, dim=-1, largest=False).indices
        return w.scatter_(2, idx, 1.0)
    d = d.masked_fill(~query_mask.unsqueeze(1), float("inf"))
    dist, idx = d.topk(k, dim=-1, largest=False)
    # an infinite distance is a padded query (or the row's own): no edge
    w.scatter_(2, idx, (dist < float("inf")).to(w.dtype))
    return w.mul_(query_mask.unsqueeze(-1).to(w.dtype))


def released_rectification(
    z_s: Tensor, labels_s: Tensor, z_q: Tensor, way: int, epsilon: float, pad: EpisodeBatch | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The released code's prototype rectification (see the module docstring).

    ``z_s [E, Ns, D]``, ``labels_s [E, Ns]``, ``z_q [E, Nq, D]`` -> ``(prototypes [E, way, D],
    kept [E, way] bool, shifted queries [E, Nq, D])``; a dropped class's prototype is zero.
    ``pad``: the ragged batch whose masks apply (means over real rows; a padded row is no member,
    a padded class is never predicted, so it is dropped).
    """
    cm = None
    if pad is None or not pad.ragged:
        # the shifted queries are written straight after the support rows: x is [z_s | z_q + shift]
        # without a separate shifted copy and a concatenation (two passes over the rows fewer)
        n_s = z_s.shape[1]
        x = z_s.new_empty(z_s.shape[0], n_s + z_q.shape[1], z_s.shape[2])
        x[:, :n_s] = z_s
        z_q = torch.add(z_q, z_s.mean(1, keepdim=True) - z_q.mean(1, keepdim=True), out=x[:, n_s:])
        real = None
    else:
        cm, q_mask = pad.class_mask, pad.query_mask
        z_q = z_q + (masked_mean(z_s, row_weight(pad.support_mask, z_s.dtype)) - masked_mean(z_q, pad.query_weight()))
        real = torch.cat(
            [labels_s >= 0, torch.ones_like(z_q[..., 0], dtype=torch.bool) if q_mask is None else q_mask], 1
        )
        x = torch.cat([z_s, z_q], 1)
    base = class_means(z_s, labels_s, way)
    cos = mask_padded_classes(cosine(x, base), cm)  # [E, N, way]
    member = one_hot(cos.argmax(-1), way, x.dtype)  # [E, N, way]
    if real is not None:
        member = member * real.unsqueeze(-1).to(x.dtype)  # a padded row is no member
    w = torch.softmax(epsilon * cos, -1) * member
    count = member.sum(1)  # [E, way]
    protos = torch.bmm(w.transpose(1, 2), x) / count.clamp_min(1.0).unsqueeze(-1)
    return protos, count > 0, z_q


def bound_energy(
    y: Tensor, unary: Tensor, w: Tensor, lmd: float, pair: Tensor | None = None, rows: Tensor | None = None
) -> Tensor:
    """The authors' energy ``sum(y*a - lmd*(W y)*y + y*log y)`` per episode ``[E]``, for ``y``,
    ``unary`` and ``pair`` (``W y`` when the caller has it) all ``[E, Nq, K]`` or all classes-first
    ``[E, K, Nq]``; ``rows``: 0/1, a ragged chunk's real queries, the only ones summed, ``[E, Nq, 1]``
    (or ``[E, 1, Nq]`` classes-first)."""
    pair = times_narrow(w, y) if pair is None else pair
    terms = unary * y - lmd * pair * y + y * torch.log(y.clamp_min(1e-20))
    return (terms if rows is None else terms * rows).sum((1, 2))


def bound_updates(
    unary: Tensor, w: Tensor, cfg: LaplacianShotConfig, masked: bool, rows: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The bound iterations ``y = softmax(-a + lmd W y)`` from ``y = softmax(-a)``, each episode
    until its energy's relative change is at most ``tol`` (after the third iteration) or for
    ``steps`` iterations. ``unary [E, Nq, K]`` (``masked``: infinite for dropped classes), ``w [E, Nq,
    Nq]`` -> ``(logits, y, iterations [E])``, the first two ``[E, Nq, K]`` views of classes-first
    tensors. ``W y`` is computed once per iteration: the energy's product is the next update's.
    ``rows [E, Nq, 1]``: a ragged chunk's real queries, the only ones the energy (hence each
    episode's stop) sees.

    The loop runs classes-first (``[E, K, Nq]``): a softmax over the middle axis of that layout
    took a seventh of the time of one over a last axis of 5 classes (137 against 972 us a chunk of
    40), and ``W y`` wants ``y`` column-major anyway (:func:`times_narrow`), so no copy is made."""
    E = unary.shape[0]
    lmd = cfg.lambda_used()
    unary_t = unary.transpose(1, 2).contiguous()  # [E, K, Nq]
    neg = -unary_t
    rows_t = None if rows is None else rows.transpose(1, 2)
    logits = neg
    y = torch.softmax(logits, 1)
    pair = _times_classes_first(w, y)
    active = torch.ones(E, dtype=torch.bool, device=unary.device)
    old = torch.full((E,), float("inf"), dtype=unary.dtype, device=unary.device)
    iters = torch.zeros(E, dtype=torch.long, device=unary.device)
    for i in range(cfg.steps):
        new_logits = neg + lmd * pair
        new_y = torch.softmax(new_logits, 1)
        keep = ~active
        logits = torch.where(keep[:, None, None], logits, new_logits)
        y = torch.where(keep[:, None, None], y, new_y)
        iters = iters + active.long()
        pair = _times_classes_first(w, y)
        energy = bound_energy(y, unary_t.masked_fill(y == 0, 0.0) if masked else unary_t, w, lmd, pair, rows_t)
        done = (energy - old).abs() <= cfg.tol * old.abs() if i > 1 else torch.zeros_like(active)
        old = torch.where(active, energy, old)
        active = active & ~done
        if should_stop(active, i):  # a stopped episode is frozen above, so looking late changes nothing
            break
    return logits.transpose(1, 2), y.transpose(1, 2), iters


def _times_classes_first(w: Tensor, y_t: Tensor) -> Tensor:
    """``(W y)`` classes-first ``[E, K, Nq]`` for ``w [E, Nq, Nq]`` and classes-first ``y_t [E, K,
    Nq]``: the product :func:`times_narrow` forms (``y`` column-major), its result transposed."""
    return torch.bmm(w, y_t.transpose(1, 2)).transpose(1, 2)


def _flops(Ns: int, Nq: int, M: int, D: int, way: int, cfg: LaplacianShotConfig) -> float:
    # rectification (three products with the rows), the kNN Gram matrix, the unary term, and one
    # ``W y`` product per bound iteration (plus the first); linear in ``steps``
    rect = 3 * dist_flops(Ns + Nq, way, D) if cfg.rectify else 0.0
    return rect + dist_flops(Nq, Nq, D) + dist_flops(Nq, way, D) + (cfg.steps + 1) * dist_flops(Nq, way, Nq)


@register(
    "laplacianshot",
    LaplacianShotConfig,
    transductive="always",
    flops=_flops,
    summary="LaplacianShot (Ziko et al. 2020): kNN Laplacian regularisation, bound updates",
    floor=dict(loops=("poodle.solvers.laplacianshot:bound_updates",)),
)
def laplacianshot(batch: EpisodeBatch, cfg: LaplacianShotConfig) -> SolverOutput:
    """Returns ``log_probs [E, Nq, way]`` (log of the final assignments ``Y``); state
    ``prototypes [E, way, D]``, ``iterations [E]``."""
    self_nb, released, shifted = cfg.resolved()
    z_s, z_q = batch.support, batch.query
    q2 = row_sqnorm(z_q)  # for the rectification, the unary term and the kNN graph
    kept = None
    z_u = z_q
    pad = batch if batch.ragged else None  # a ragged chunk: its masks, else today's arithmetic
    if cfg.rectify and released:
        m, kept, z_shift = released_rectification(z_s, batch.support_labels, z_q, batch.way, cfg.epsilon, pad)
        z_u = z_shift if shifted else z_q
    elif cfg.rectify:
        m, delta, _ = rectified_prototypes(z_s, batch.support_labels, z_q, batch.way, cfg.epsilon, q2=q2, pad=pad)
        z_u = z_q + delta if shifted else z_q
    else:
        m = class_means(z_s, batch.support_labels, batch.way)
    unary = sqdist(z_u, m, q2 if z_u is z_q else None)  # [E, Nq, way]
    if kept is not None:
        # a dropped class takes no query: infinite unary (its softmax weight is exactly 0)
        unary = unary.masked_fill(~kept.unsqueeze(1), float("inf"))
    elif pad is not None:
        unary = mask_padded_classes(unary, batch.class_mask, float("inf"))  # a padded class: the same
    w = knn_graph(z_q, cfg.knn - 1 if self_nb else cfg.knn, q2, batch.query_mask)
    masked = kept is not None or batch.class_mask is not None
    logits, y, iters = bound_updates(unary, w, cfg, masked, batch.query_weight())
    if kept is not None:
        # As released: the prototype list shrinks, so kept class number j (in class order) answers
        # with label j. A stable sort puts the kept classes first, in order.
        order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices  # [E, way]
        y = y.gather(2, order.unsqueeze(1).expand_as(y))
        return SolverOutput(
            torch.log_softmax(mask_classes(torch.log(y.clamp_min(TINY)), batch), -1),
            {"prototypes": m, "iterations": iters, "assignments": y.clamp_min(TINY)},
        )
    log_probs = torch.log_softmax(logits.transpose(1, 2), 1).transpose(1, 2).contiguous()  # see bound_updates
    return SolverOutput(log_probs, {"prototypes": m, "iterations": iters, "assignments": y.clamp_min(TINY)})
