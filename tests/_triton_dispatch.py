"""Routes the solvers' fits to the Triton step (poodle/solvers/_triton_step.py) for the tests and
benchmarks/gpu.py, standing in for the dispatch that ``poodle.solvers._optim`` will make itself
under ``cuda_step = "triton"``: POODLE, CE and naive-OOD's ``fit_weighted_distance``, and TIM-GD,
entropy-min and alpha-TIM's ``fit_logit_loss`` (alpha-TIM passes no ``NativeLoss`` yet, so its
solver is wrapped to describe its loss from the batch and config)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

from poodle.solvers import _triton_step, alpha_tim, base, ce, entropy_min, naive_ood, tim_gd
from poodle.solvers import poodle as poodle_solver
from poodle.solvers.base import one_hot

_ALPHA: contextvars.ContextVar[Any] = contextvars.ContextVar("alpha_tim_loss", default=None)


def _wd(x, terms, w0, **kw):
    return _triton_step.fit_weighted_distance(x, terms, w0, **kw)


def _logit(x, w0, grad_logits, *, native=None, **kw):
    loss = native if native is not None else _ALPHA.get()
    if loss is None:
        raise RuntimeError("a logit loss the Triton step does not know")
    return _triton_step.fit_logit_loss(x, w0, loss, **kw)


def _alpha_solver(fn):
    def solve(batch, cfg):
        a = cfg.alpha if cfg.alpha > 0 else alpha_tim.tuned_alpha(batch.shot)
        y = one_hot(batch.support_labels, batch.way, batch.support.dtype).transpose(1, 2)
        weights = (cfg.ce_weight, cfg.marginal_weight, cfg.conditional_weight)
        token = _ALPHA.set(_triton_step.LogitLoss("alpha", batch.support.shape[1], y, weights, a))
        try:
            return fn(batch, cfg)
        finally:
            _ALPHA.reset(token)

    return solve


@contextlib.contextmanager
def triton_step() -> Iterator[None]:
    """Inside: the six methods fit with the Triton step (on CUDA compiled, elsewhere interpreted)."""
    patches = [(m, "fit_weighted_distance", _wd) for m in (poodle_solver, ce, naive_ood)]
    patches += [(m, "fit_logit_loss", _logit) for m in (tim_gd, alpha_tim, entropy_min)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    info = base._REGISTRY["alpha-tim"]
    for m, name, fn in patches:
        setattr(m, name, fn)
    base._REGISTRY["alpha-tim"] = dataclasses.replace(info, fn=_alpha_solver(info.fn))
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
        base._REGISTRY["alpha-tim"] = info


METHODS = ("poodle", "ce", "naive-ood", "tim-gd", "alpha-tim", "entropy-min")
