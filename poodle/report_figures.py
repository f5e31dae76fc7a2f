"""Figures from grid results (matplotlib, Agg canvas; written as PNG and PDF).

- :func:`heatmap`: accuracy gain over a baseline for every (alpha, beta), one panel per remaining
  setting (shot x inductive/transductive), like the paper's sensitivity figure (Figure 4 of the
  supplementary, ``fig:alpha_beta_ablation``). The gain is the mean paired difference over
  episodes, in percentage points; gains whose paired t-test has p > 0.05 are printed in grey.
- :func:`lines`: accuracy against a numeric option (``steps``: Table 11; ``n_neg``: Table 6) with
  95% CI bands, one panel per shot, one line per other setting.

Baselines: ``"zero"`` is the cell of the same panel with alpha = beta = 0 (fine-tuning with
cross-entropy only); any other name picks the result whose ``label`` or ``method`` has that name and
that was solved on the same episodes (the paper's figure uses no fine-tuning at all: the mean of
the support features, i.e. a prototype method).

No pyplot: figures are built on :class:`matplotlib.figure.Figure` with an Agg canvas, so nothing
global (the backend, open figures) is touched.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import matplotlib.colors as mcolors
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from poodle.errors import ConfigError, mark
from poodle.report import (
    Result,
    _hashable,
    _value_order,
    drop_derived,
    format_value,
    key_name,
    varying_keys,
)
from poodle.stats import paired_ttest
from poodle.utils import atomic_path


def _figure(w: float, h: float):
    fig = Figure(figsize=(w, h), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, out: str | Path) -> list[Path]:
    """Write ``out`` with suffix .png and .pdf (whatever suffix ``out`` has); returns both paths."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix.lower() in (".png", ".pdf") else out
    paths = []
    for ext in ("png", "pdf"):
        p = stem.with_name(stem.name + "." + ext)
        with atomic_path(p) as tmp:
            fig.savefig(tmp, format=ext)
        paths.append(p)
    return paths


def _panels(results: Sequence[Result], panel_keys: Sequence[str]) -> list[tuple[tuple, list[Result]]]:
    orders = {k: _value_order(results, k) for k in panel_keys}
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault(tuple(_hashable(r.flat.get(k)) for k in panel_keys), []).append(r)
    keys = sorted(groups, key=lambda t: tuple(orders[k][v] for k, v in zip(panel_keys, t)))
    return [(k, groups[k]) for k in keys]


def _panel_title(keys: Sequence[str], values: tuple) -> str:
    return ", ".join(format_value(k, v) for k, v in zip(keys, values))


def _find_baseline(results: Sequence[Result], name: str, like: Result) -> Result:
    pairing = like.pairing()
    found = [
        r
        for r in results
        if (r.flat.get("label") == name or r.flat.get("method") == name)
        and r.pairing() == pairing
        and len(r.acc) == len(like.acc)
    ]
    if not found:
        raise ConfigError(
            f"{mark('baseline')} {name!r}: no result with that label or method on the episodes of "
            f"{like.flat.get('label')} ({format_value('shot', like.flat.get('shot'))}); add a "
            f'[[cell]] with method = "{name}" to the grid, or set baseline to zero',
            param="baseline",
            value=name,
        )
    if len({_hashable(tuple(sorted((k, _hashable(v)) for k, v in r.flat.items()))) for r in found}) > 1:
        labels = sorted({str(r.flat.get("label")) for r in found})
        raise ConfigError(
            f"{mark('baseline')} {name!r} is ambiguous: {len(found)} results match ({', '.join(labels)}); "
            f"filter with {mark('where')}",
            param="baseline",
            value=name,
        )
    return found[0]


def _heatmap_layout(cells: Sequence[Result], panels: Sequence[str], groups: list) -> tuple[int, int, dict]:
    """``(rows, columns, {panel values: (row, column)})``: two panel keys are a rows x columns
    layout (shot x transductive, as in the paper); otherwise one row of up to three panels."""
    if len(panels) == 2:
        v0 = sorted({g[0][0] for g in groups}, key=lambda v: _value_order(cells, panels[0])[v])
        v1 = sorted({g[0][1] for g in groups}, key=lambda v: _value_order(cells, panels[1])[v])
        return len(v0), len(v1), {g[0]: (v0.index(g[0][0]), v1.index(g[0][1])) for g in groups}
    ncols = min(len(groups), 3)
    return math.ceil(len(groups) / ncols), ncols, {g[0]: divmod(i, ncols) for i, g in enumerate(groups)}


def _gains(
    results: Sequence[Result],
    group: list[Result],
    where: str,
    baseline: str,
    x: str,
    y: str,
    xs: list,
    ys: list,
    p_threshold: float,
) -> tuple[np.ndarray, np.ndarray, Result]:
    """One panel: the gain of every (x, y) cell over the baseline in points ``[len(ys), len(xs)]``,
    whether it is significant, and the baseline."""
    if baseline == "zero":
        zero = [r for r in group if r.flat[x] == 0 and r.flat[y] == 0]
        if len(zero) != 1:
            raise ConfigError(
                f"heatmap: panel {where} has {len(zero)} cells with {x}={y}=0; {mark('baseline')} zero needs "
                f"exactly one (or name a baseline method)",
                param="baseline",
                value=baseline,
            )
        base = zero[0]
    else:
        base = _find_baseline(results, baseline, group[0])
    gain = np.full((len(ys), len(xs)), np.nan)
    sig = np.zeros_like(gain, dtype=bool)
    for r in group:
        if r.pairing() != base.pairing():
            raise ConfigError(
                f"heatmap: {r.flat.get('label')} and the baseline were not solved on the same episodes",
                param="baseline",
                value=baseline,
            )
        i, j = ys.index(r.flat[y]), xs.index(r.flat[x])
        if not np.isnan(gain[i, j]):
            raise ConfigError(
                f"heatmap: several results at {x}={r.flat[x]}, {y}={r.flat[y]} in panel {where}; choose with "
                f"{mark('where')} or {mark('panels')}",
            )
        gain[i, j] = 100 * float(np.mean(r.acc - base.acc))
        sig[i, j] = r is not base and paired_ttest(r.acc, base.acc)[1] <= p_threshold
    return gain, sig, base


def _draw_panel(ax: Any, gain: np.ndarray, sig: np.ndarray, norm: Any, vmax: float, labels: tuple) -> Any:
    """One panel's image and its numbers (grey where the gain is not significant)."""
    x, y, xs, ys, title = labels
    image = ax.imshow(gain, cmap="RdBu", norm=norm, origin="lower", aspect="auto")
    ax.set_xticks(range(len(xs)), [format_value(x, v) for v in xs])
    ax.set_yticks(range(len(ys)), [format_value(y, v) for v in ys])
    ax.set_xlabel(key_name(x))
    ax.set_ylabel(key_name(y))
    ax.set_title(title, fontsize=9)
    for i in range(gain.shape[0]):
        for j in range(gain.shape[1]):
            if not np.isnan(gain[i, j]):
                strong = abs(gain[i, j]) > 0.6 * vmax
                colour = ("white" if strong else "black") if sig[i, j] else "0.55"
                ax.text(j, i, f"{gain[i, j]:+.1f}", ha="center", va="center", fontsize=7, color=colour)
    return image


def heatmap(
    results: Sequence[Result],
    out: str | Path,
    *,
    baseline: str = "zero",
    x: str = "alpha",
    y: str = "beta",
    panels: Sequence[str] | None = None,
    p_threshold: float = 0.05,
    title: str | None = None,
) -> list[Path]:
    """Accuracy gain (percentage points) over ``baseline`` on an ``x`` by ``y`` grid, per panel.

    ``panels`` defaults to the keys that vary among the (x, y) results other than x and y (and
    keys that merely repeat them). Returns the written PNG and PDF paths.
    """
    cells = [r for r in results if x in r.flat and y in r.flat and r.flat[x] is not None and r.flat[y] is not None]
    if not cells:
        raise ConfigError(f"heatmap: no result has both {x!r} and {y!r} (run a grid over them)", param="x", value=x)
    if baseline != "zero":
        cells = [r for r in cells if baseline not in (r.flat.get("label"), r.flat.get("method"))]
    if panels is None:
        panels = drop_derived(cells, [k for k in varying_keys(cells) if k not in (x, y)], (x, y))
    else:
        unknown = [k for k in panels if k not in cells[0].flat]
        if unknown:
            raise ConfigError(f"heatmap: unknown panel key {unknown[0]!r}", param="panels", value=panels)
    groups = _panels(cells, panels)
    nrows, ncols, place = _heatmap_layout(cells, panels, groups)
    xs, ys = sorted({r.flat[x] for r in cells}), sorted({r.flat[y] for r in cells})
    fig = _figure(3.6 * ncols + 0.8, 3.2 * nrows + 0.4)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for row in axes:
        for ax in row:
            ax.set_visible(False)
    drawn = [
        (values, *_gains(results, group, _panel_title(panels, values) or "all", baseline, x, y, xs, ys, p_threshold))
        for values, group in groups
    ]
    vmax = max(float(np.nanmax(np.abs(g))) for _, g, _, _ in drawn) or 1.0
    norm = mcolors.TwoSlopeNorm(vmin=-vmax, vcenter=0.0, vmax=vmax)
    image = None
    for values, gain, sig, base in drawn:
        ax = axes[place[values]]
        ax.set_visible(True)
        panel_title = (_panel_title(panels, values) + "\n" if panels else "") + f"base {100 * base.mean:.2f}%"
        image = _draw_panel(ax, gain, sig, norm, vmax, (x, y, xs, ys, panel_title))
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy gain (points)")
    name = "no fine-tuning" if baseline != "zero" else f"{x}={y}=0"
    fig.suptitle(
        title
        or f"Accuracy gain over {baseline if baseline != 'zero' else name} (grey: paired t-test p > {p_threshold:g})",
        fontsize=10,
    )
    return save_figure(fig, out)


def lines(
    results: Sequence[Result],
    out: str | Path,
    *,
    x: str = "steps",
    panels: Sequence[str] | None = None,
    baseline: str | None = None,
    title: str | None = None,
) -> list[Path]:
    """Accuracy (%) against the numeric option ``x``, mean with a 95% CI band, one line per
    setting; ``baseline`` (a label or method) is drawn as a dashed horizontal line with its band."""
    cells = [
        r
        for r in results
        if isinstance(r.flat.get(x), (int, float))
        and not isinstance(r.flat.get(x), bool)
        and (baseline is None or baseline not in (r.flat.get("label"), r.flat.get("method")))
    ]
    if not cells:
        raise ConfigError(f"figure: no result has a numeric {x!r}", param="x", value=x)
    if len({r.flat[x] for r in cells}) < 2:
        raise ConfigError(
            f"figure: every result has {x} = {format_value(x, cells[0].flat[x])}; run a grid over "
            f"several values of {x!r}",
            param="x",
            value=x,
        )
    vary = drop_derived(cells, [k for k in varying_keys(cells) if k != x], (x,))
    if panels is None:
        panels = [k for k in ("shot",) if k in vary]
    series_keys = [k for k in vary if k not in panels]
    groups = _panels(cells, panels)
    ncols = min(len(groups), 3)
    nrows = math.ceil(len(groups) / ncols)
    fig = _figure(4.2 * ncols, 3.3 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for row in axes:
        for ax in row:
            ax.set_visible(False)
    for n, (values, group) in enumerate(groups):
        ax = axes[divmod(n, ncols)]
        ax.set_visible(True)
        for svals, series in _panels(group, series_keys):
            series = sorted(series, key=lambda r: r.flat[x])
            xs = np.array([r.flat[x] for r in series], dtype=float)
            if len(set(xs.tolist())) != len(xs):
                raise ConfigError(
                    f"figure: several results share {x}={xs[0]:g} in one series; add a key to "
                    f"{mark('panels')} or filter with {mark('where')}",
                )
            m = np.array([100 * r.mean for r in series])
            c = np.array([100 * r.ci95 for r in series])
            label = ", ".join(
                format_value(k, v)
                if k in ("shot", "transductive", "imbalance")
                else f"{key_name(k)}={format_value(k, v)}"
                for k, v in zip(series_keys, svals)
            )
            (line,) = ax.plot(xs, m, marker="o", ms=3, label=label or None)
            ax.fill_between(xs, m - c, m + c, color=line.get_color(), alpha=0.2, linewidth=0)
        if baseline is not None:
            b = _find_baseline(results, baseline, group[0])
            ax.axhline(100 * b.mean, color="0.3", ls="--", lw=1, label=f"{baseline}")
            ax.axhspan(100 * (b.mean - b.ci95), 100 * (b.mean + b.ci95), color="0.5", alpha=0.15, lw=0)
        xv = sorted({r.flat[x] for r in group})
        if len(xv) > 2 and xv[0] > 0 and xv[-1] / xv[0] >= 20:
            ax.set_xscale("log")
        ax.set_xticks(xv, [format_value(x, v) for v in xv])
        ax.minorticks_off()
        ax.set_xlabel({"steps": "fine-tuning steps", "n_neg": "negatives per episode"}.get(x, key_name(x)))
        ax.set_ylabel("accuracy (%)")
        if panels:
            ax.set_title(_panel_title(panels, values), fontsize=9)
        ax.grid(alpha=0.3)
        if series_keys or baseline:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, out)
