"""Figures of a refinement, drawn with matplotlib (axes, colour bars, labels).

Each function takes plain numpy arrays and dicts (as :func:`refine.output.results.load_h5` returns them)
and returns a :class:`matplotlib.figure.Figure`; :func:`png_bytes` and :func:`save_png` turn one into
a PNG.  matplotlib is an optional extra (``pip install nbtorch[report]``, installed by
``scripts/bootstrap.sh``): it is imported when a figure is first drawn, so ``import refine`` does
not need it, and a missing matplotlib is one :class:`~nbtorch.errors.InputError` line.

Image conventions: arrays are (slow, fast); ``x`` is the fast pixel index and ``y`` the slow one,
pixel centres at ``i + 0.5`` (the spot lists' convention), drawn with ``y`` increasing downwards as
detector images are shown by ADXV and DIALS.

* :func:`history_figure`: the loss (log scale) and every free parameter against the step, stage
  boundaries marked;
* :func:`crop_figure`: observed / model / residual crops around chosen centres, observed spots as
  green squares and the refined model's spots as red crosses;
* :func:`offsets_figure`: observed -> predicted spot offsets across the detector (arrows magnified);
* :func:`residual_histogram`: (observed - model) / sqrt(model) over the fitted pixels, with the unit
  normal that shot noise alone would give;
* :func:`correlation_figure`: the correlation matrix of the free parameters;
* :func:`spot_profile_figure`: the stacked spot profile (observed, model, difference, and their azimuthal means
  against the radius) of :mod:`refine.quality.misfit`;
* :func:`background_figure`: the background between spots against resolution, observed and model;
* :func:`distribution_figure`: a value's histogram over many stills (their cells, their spot rms).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write

__all__ = ["history_figure", "crop_figure", "offsets_figure", "residual_histogram", "correlation_figure",
           "png_bytes", "save_png", "crop_centres", "require_matplotlib", "spot_profile_figure", "background_figure",
           "distribution_figure"]

_OBSERVED = "#1a9e1a"   # observed spots
_PREDICTED = "#e41a1c"  # the refined model's spots
_START = "#377eb8"      # the starting model's spots


def require_matplotlib(what: str) -> None:
    """Refuse ``what`` (e.g. ``--report``) up front, before a long run, when matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise InputError(f"{what}: figures need matplotlib: pip install 'nbtorch[report]'")


def _pyplot():
    """matplotlib with the non-interactive Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("figures need matplotlib: pip install 'nbtorch[report]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int = 96) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def save_png(fig, path: str | Path, dpi: int = 96) -> Path:
    """Write the figure as a PNG file atomically; the figure is closed."""
    data = png_bytes(fig, dpi)
    with atomic_write(path, "wb") as fh:
        fh.write(data)
    return Path(path)


# ------------------------------------------------------------------------------------------ history

def history_figure(history: Mapping[str, Any], names: Sequence[str], stage_names: Sequence[str] = (),
                   units: Mapping[str, str] | None = None):
    """Loss and each of ``names`` (those in ``history["params"]``) against the step.

    ``history``: ``step``, ``stage`` (index per row), ``loss`` and ``params`` (name -> values), as in
    ``result.h5``'s ``history/`` group.  Stage boundaries are dashed lines labelled with ``stage_names``.
    """
    plt = _pyplot()
    units = units or {}
    steps = np.asarray(history.get("step", []), dtype=float)
    loss = np.asarray(history.get("loss", []), dtype=float)
    stage = np.asarray(history.get("stage", np.zeros(len(steps))), dtype=int)
    params = history.get("params", {})
    shown = [n for n in names if n in params and len(params[n]) == len(steps)]
    panels = 1 + len(shown)
    cols = min(4, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.6 * rows), squeeze=False, constrained_layout=True)
    flat = axes.ravel()
    boundaries = [(int(steps[i]), int(stage[i])) for i in range(1, len(steps)) if stage[i] != stage[i - 1]]

    def mark(ax) -> None:
        for x, s in boundaries:
            ax.axvline(x, color="0.6", lw=0.8, ls="--")
            if s < len(stage_names):
                ax.annotate(stage_names[s], (x, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                            color="0.4", va="top", ha="left", rotation=90)

    ax = flat[0]
    positive = np.isfinite(loss) & (loss > 0)
    ax.plot(steps[positive], loss[positive], color="black", lw=1.2)
    if positive.any():
        ax.set_yscale("log")
    ax.set_title("loss")
    ax.set_xlabel("step")
    mark(ax)
    for ax, name in zip(flat[1:], shown):
        ax.plot(steps, np.asarray(params[name], dtype=float), color="#d95f02", lw=1.2)
        unit = units.get(name, "")
        ax.set_title(name)
        ax.set_xlabel("step")
        if unit:
            ax.set_ylabel(unit)
        ax.ticklabel_format(axis="y", useOffset=False)
        mark(ax)
    for ax in flat[panels:]:
        ax.axis("off")
    return fig


# ------------------------------------------------------------------------------------------ image crops

def crop_centres(shape: tuple[int, int], mask: np.ndarray, model: np.ndarray, spots: np.ndarray | None,
                 count: int = 3, half: int = 24) -> list[tuple[int, int]]:
    """Up to ``count`` (x, y) crop centres: around the observed spots with the most neighbours (or, with
    no spot list, the model's brightest fitted pixels), at least one crop width apart."""
    slow, fast = shape
    if spots is not None and len(spots):
        xy = np.asarray(spots, dtype=float).reshape(-1, 2)
        d2 = ((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1)
        crowd = (d2 < half * half).sum(1)
        order = np.argsort(-crowd, kind="stable")
        candidates = [(int(xy[i, 0]), int(xy[i, 1])) for i in order]
    else:
        score = np.where(mask, model, -np.inf).ravel()
        order = np.argsort(-score, kind="stable")[: 50 * count]
        candidates = [(int(i % fast), int(i // fast)) for i in order if np.isfinite(score[i])]
    out: list[tuple[int, int]] = []
    for x, y in candidates:
        if all(abs(x - cx) > 2 * half or abs(y - cy) > 2 * half for cx, cy in out):
            out.append((min(max(x, half), fast - half - 1) if fast > 2 * half else fast // 2,
                        min(max(y, half), slow - half - 1) if slow > 2 * half else slow // 2))
        if len(out) == count:
            break
    return out


def _inside(xy: np.ndarray | None, x0: int, x1: int, y0: int, y1: int) -> np.ndarray:
    if xy is None or len(xy) == 0:
        return np.zeros((0, 2))
    xy = np.asarray(xy, dtype=float).reshape(-1, 2)
    keep = np.isfinite(xy).all(1) & (xy[:, 0] >= x0) & (xy[:, 0] < x1) & (xy[:, 1] >= y0) & (xy[:, 1] < y1)
    return xy[keep]


def crop_figure(observed: np.ndarray, model: np.ndarray, mask: np.ndarray, centres: Sequence[tuple[int, int]],
                half: int = 24, spots_observed: np.ndarray | None = None,
                spots_predicted: np.ndarray | None = None):
    """One row per centre: observed, model (same square-root colour scale, photons) and residual
    (observed - model, diverging scale symmetric about 0), each with a colour bar; masked pixels grey."""
    plt = _pyplot()
    from matplotlib import colors

    rows = max(1, len(centres))
    fig, axes = plt.subplots(rows, 3, figsize=(11.5, 3.4 * rows), squeeze=False, constrained_layout=True)
    slow, fast = observed.shape
    for r, (cx, cy) in enumerate(centres or [(fast // 2, slow // 2)]):
        x0, x1 = max(0, cx - half), min(fast, cx + half)
        y0, y1 = max(0, cy - half), min(slow, cy + half)
        sl = (slice(y0, y1), slice(x0, x1))
        m = np.asarray(mask[sl], dtype=bool)
        o = np.where(m, observed[sl], np.nan)
        mo = np.asarray(model[sl], dtype=float)
        res = np.where(m, observed[sl] - model[sl], np.nan)
        vals = np.concatenate([o[m], mo[m]]) if m.any() else mo.ravel()
        lo = float(np.nanmin(vals)) if vals.size else 0.0
        hi = float(np.nanpercentile(vals, 99.9)) if vals.size else 1.0
        norm = colors.PowerNorm(0.5, vmin=lo, vmax=max(hi, lo + 1e-9))
        lim = float(np.nanpercentile(np.abs(res), 99.5)) if np.isfinite(res).any() else 1.0
        extent = (x0, x1, y1, y0)
        cmap = plt.get_cmap("viridis").with_extremes(bad="0.75")  # grey: pixels not fitted
        dmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.75")
        panels = ((o, cmap, norm, "observed", "photons"), (mo, cmap, norm, "model (refined)", "photons"),
                  (res, dmap, colors.Normalize(-max(lim, 1e-9), max(lim, 1e-9)), "observed - model", "photons"))
        for c, (img, cm, nm, title, unit) in enumerate(panels):
            ax = axes[r, c]
            im = ax.imshow(img, cmap=cm, norm=nm, extent=extent, interpolation="nearest")
            fig.colorbar(im, ax=ax, shrink=0.85, label=unit)
            ax.set_title(f"{title}, x {x0}-{x1 - 1}, y {y0}-{y1 - 1}", fontsize=9)
            ax.set_xlabel("x (fast, px)")
            ax.set_ylabel("y (slow, px)")
            obs_xy = _inside(spots_observed, x0, x1, y0, y1)
            pred_xy = _inside(spots_predicted, x0, x1, y0, y1)
            if len(obs_xy):
                ax.scatter(obs_xy[:, 0], obs_xy[:, 1], s=60, marker="s", facecolors="none",
                           edgecolors=_OBSERVED, linewidths=1.2, label="observed spot")
            if len(pred_xy):
                ax.scatter(pred_xy[:, 0], pred_xy[:, 1], s=40, marker="x", color=_PREDICTED, linewidths=1.2,
                           label="model spot")
            ax.set_xlim(x0, x1)
            ax.set_ylim(y1, y0)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=len(handles), fontsize=9)
    return fig


# ------------------------------------------------------------------------------------------ spots

def offsets_figure(shape: tuple[int, int], observed: np.ndarray, predicted_final: np.ndarray,
                   predicted_start: np.ndarray | None = None):
    """Arrows from each observed spot to the refined model's spot across the whole detector, magnified so
    that the typical offset is visible (the factor is in the title); colour = offset length (px)."""
    plt = _pyplot()
    slow, fast = shape
    obs = np.asarray(observed, dtype=float).reshape(-1, 2)
    fig, axes = plt.subplots(1, 2 if predicted_start is not None else 1, figsize=(12 if predicted_start is not None
                                                                                  else 6.5, 5.6),
                             squeeze=False, constrained_layout=True)
    pairs = [("refined", predicted_final)]
    if predicted_start is not None:
        pairs.insert(0, ("start", predicted_start))
    lengths = []
    for _, pred in pairs:
        d = np.asarray(pred, dtype=float).reshape(-1, 2) - obs
        lengths.append(np.hypot(d[:, 0], d[:, 1]))
    finite = np.concatenate([v[np.isfinite(v)] for v in lengths]) if lengths else np.zeros(0)
    typical = float(np.median(finite)) if finite.size else 1.0
    magnify = max(1.0, 0.03 * max(shape) / max(typical, 1e-6))
    vmax = float(np.percentile(finite, 95)) if finite.size else 1.0
    for ax, (label, pred), length in zip(axes[0], pairs, lengths):
        d = np.asarray(pred, dtype=float).reshape(-1, 2) - obs
        ok = np.isfinite(d).all(1)
        q = ax.quiver(obs[ok, 0], obs[ok, 1], d[ok, 0] * magnify, -d[ok, 1] * magnify, length[ok], cmap="plasma",
                      angles="xy", scale_units="xy", scale=1.0, width=0.003, clim=(0.0, max(vmax, 1e-6)))
        ax.scatter(obs[~ok, 0], obs[~ok, 1], s=8, color="0.6", label="no model spot found")
        ax.set_xlim(0, fast)
        ax.set_ylim(slow, 0)
        ax.set_aspect("equal")
        rms = float(np.sqrt(np.mean(length[ok] ** 2))) if ok.any() else math.nan
        ax.set_title(f"spot offsets, {label}: rms {rms:.3g} px over {int(ok.sum())} of {len(obs)} spots\n"
                     f"(arrows x{magnify:.0f})", fontsize=10)
        ax.set_xlabel("x (fast, px)")
        ax.set_ylabel("y (slow, px)")
        fig.colorbar(q, ax=ax, shrink=0.8, label="offset (px)")
        if (~ok).any():
            ax.legend(loc="upper right", fontsize=8)
    return fig


# ------------------------------------------------------------------------------------------ residuals

def residual_histogram(observed: np.ndarray, model: np.ndarray, mask: np.ndarray):
    """Histogram of (observed - model) / sqrt(model) over the fitted pixels with model > 0, against the
    unit normal density (what Poisson noise alone gives for counts that are not too small)."""
    plt = _pyplot()
    m = np.asarray(mask, dtype=bool) & (np.asarray(model) > 0) & np.isfinite(observed)
    z = (np.asarray(observed)[m] - np.asarray(model)[m]) / np.sqrt(np.asarray(model)[m])
    fig, ax = plt.subplots(figsize=(6.5, 3.8), constrained_layout=True)
    if z.size:
        lim = max(5.0, float(np.percentile(np.abs(z), 99.5)))
        ax.hist(np.clip(z, -lim, lim), bins=121, range=(-lim, lim), density=True, color="#7570b3",
                alpha=0.8, label=f"{z.size} pixels, mean {z.mean():+.3g}, std {z.std():.3g}")
        t = np.linspace(-lim, lim, 400)
        ax.plot(t, np.exp(-0.5 * t * t) / math.sqrt(2 * math.pi), color="black", lw=1.2, label="unit normal")
        ax.set_yscale("log")
        ax.set_ylim(bottom=max(1e-6, 0.5 / z.size))
        ax.legend(fontsize=8)
    ax.set_xlabel("(observed - model) / sqrt(model)")
    ax.set_ylabel("density")
    ax.set_title("normalised residuals of the fitted pixels")
    return fig


def correlation_figure(names: Sequence[str], matrix: np.ndarray):
    """The correlation matrix as a colour map (-1 blue ... +1 red) with the values written in."""
    plt = _pyplot()
    c = np.asarray(matrix, dtype=float)
    n = len(names)
    size = max(4.0, 0.45 * n + 2.0)
    fig, ax = plt.subplots(figsize=(size + 1.2, size), constrained_layout=True)
    im = ax.imshow(c if c.size else np.zeros((1, 1)), cmap="RdBu_r", vmin=-1, vmax=1)
    fig.colorbar(im, ax=ax, shrink=0.8, label="correlation")
    ax.set_xticks(range(n), names, rotation=90, fontsize=8)
    ax.set_yticks(range(n), names, fontsize=8)
    if n <= 20 and c.shape == (n, n):
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{c[i, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if abs(c[i, j]) > 0.6 else "black")
    ax.set_title("correlation of the free parameters")
    return fig


def distribution_figure(values: Sequence[float], label: str, title: str):
    """Histogram of one value over many stills (a cell length, angle or spot rms), the median marked; NaN (a still
    without the value) left out and counted in the title."""
    plt = _pyplot()
    v = np.asarray(values, dtype=float)
    finite = v[np.isfinite(v)]
    fig, ax = plt.subplots(figsize=(4.2, 3.0), constrained_layout=True)
    if finite.size:
        ax.hist(finite, bins=int(min(40, max(5, round(math.sqrt(finite.size) * 2)))), color="#4c72b0", alpha=0.85)
        med = float(np.median(finite))
        ax.axvline(med, color="black", lw=1.0, label=f"median {med:.5g}, std {finite.std():.3g}")
        ax.legend(fontsize=7)
    ax.set_xlabel(label)
    ax.set_ylabel("stills")
    ax.ticklabel_format(axis="x", useOffset=False)
    missing = v.size - finite.size
    ax.set_title(f"{title}: {finite.size} stills" + (f" ({missing} without)" if missing else ""), fontsize=9)
    return fig


# ------------------------------------------------------------------------------------------ what the model misses

def spot_profile_figure(profile: Mapping[str, Any]):
    """The stacked spot profile (``diagnostics.profile`` of ``result.json``): observed and model stacks on one
    colour scale (photons summed over the spots), observed - model (diverging, symmetric about 0), and both
    averaged over the azimuth against the distance from the centre (photons per spot and pixel)."""
    plt = _pyplot()
    from matplotlib import colors

    obs, mod = (np.asarray(profile[k], dtype=float) for k in ("stack_observed", "stack_model"))
    half, n = int(profile["half_px"]), max(int(profile["spots"]), 1)
    diff = obs - mod
    extent = (-half - 0.5, half + 0.5, half + 0.5, -half - 0.5)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6), constrained_layout=True)
    norm = colors.Normalize(min(obs.min(), mod.min()), max(obs.max(), mod.max()))
    lim = float(np.abs(diff).max()) or 1.0
    o, m = profile.get("observed") or {}, profile.get("model") or {}
    for ax, img, cmap, nm, title in ((axes[0], obs, "viridis", norm, "observed"), (axes[1], mod, "viridis", norm, "model"),
                                     (axes[2], diff, "RdBu_r", colors.Normalize(-lim, lim), "observed - model")):
        im = ax.imshow(img, cmap=cmap, norm=nm, extent=extent, interpolation="nearest")
        fig.colorbar(im, ax=ax, shrink=0.85, label=f"photons ({n} spots)")
        ax.set_xlabel("radial (px, outward)")
        ax.set_ylabel("tangential (px)")
        ax.set_title(title, fontsize=10)
    for ax, numbers in ((axes[0], o), (axes[1], m)):
        if numbers.get("rms_radius_px") is not None:
            ax.set_title(f"{ax.get_title()}: peak {numbers['peak_per_spot']:.3g}/spot, rms radius "
                         f"{numbers['rms_radius_px']:.3g} px", fontsize=9)
    u = np.arange(-half, half + 1)
    radius = np.rint(np.hypot(*np.meshgrid(u, u))).astype(int).ravel()
    count = np.bincount(radius)
    r = np.nonzero(count)[0]
    curves = [(obs, n, _OBSERVED, "o-", "observed"), (mod, n, _PREDICTED, "o-", "model")]
    if profile.get("stack_model_own") is not None and profile.get("own_spots"):
        # the model about its own centroids: its shape without the spread of its positions
        curves.append((np.asarray(profile["stack_model_own"], dtype=float), int(profile["own_spots"]), _PREDICTED,
                       "s--", "model (own centroids)"))
    for stack, spots, colour, style, label in curves:
        mean = np.bincount(radius, weights=stack.ravel())[r] / count[r] / spots
        axes[3].plot(r, mean, style, color=colour, label=label, ms=4)
    axes[3].set_yscale("log")
    axes[3].set_xlabel("distance from the centroid (px)")
    axes[3].set_ylabel("photons per spot and pixel")
    axes[3].set_title("azimuthal mean", fontsize=10)
    axes[3].legend(fontsize=7, loc="upper right")  # the curves fall from upper left to lower right
    return fig


def background_figure(table: Mapping[str, Any]):
    """The background between spots (``diagnostics.background_by_resolution`` of ``result.json``): mean observed
    and model photons per pixel in each resolution bin, plotted at the bin's middle in 1/d^2 (its range as a bar)
    and labelled in d (Å)."""
    plt = _pyplot()
    bins = list(table.get("bins") or [])

    def inv(d) -> float:
        return 0.0 if d is None or not math.isfinite(d) or d <= 0 else 1.0 / (d * d)

    lo = np.array([inv(b["d_max_A"]) for b in bins])
    hi = np.array([inv(b["d_min_A"]) for b in bins])
    mid = 0.5 * (lo + hi)
    fig, ax = plt.subplots(figsize=(7.5, 3.8), constrained_layout=True)
    for key, colour, label in (("observed_mean", _OBSERVED, "observed"), ("model_mean", _PREDICTED, "model")):
        y = np.array([b[key] for b in bins], dtype=float)
        ax.errorbar(mid, y, xerr=[mid - lo, hi - mid], fmt="o-", color=colour, label=label, ms=4, capsize=2)
    ticks = mid[mid > 0]
    ax.set_xticks(ticks, [f"{1.0 / math.sqrt(t):.3g}" for t in ticks], fontsize=8)
    ax.set_xlabel("resolution d (Å), bin middles (axis linear in 1/d²)")
    ax.set_ylabel("photons per pixel")
    ax.set_title(f"background between spots (> {table.get('exclude_px', '?')} px from any spot; "
                 f"{table.get('pixels', 0)} pixels)", fontsize=10)
    ax.legend(fontsize=8)
    return fig
