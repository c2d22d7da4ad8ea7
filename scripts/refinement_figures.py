"""Figures for docs/still-from-images.md from a finished ``nbtorch-refine`` run (run from the checkout)::

    .venv/bin/nbtorch-refine --config examples/thaumatin_still.toml --report out/thaumatin/report.html
    .venv/bin/python scripts/refinement_figures.py out/thaumatin docs/img

Writes into the second folder (matplotlib, :mod:`refine.output.figures`):

* ``thaumatin_panels.png``: a crop of the observed image, the model at the start and refined (one
  square-root colour scale, photons); the observed spots (green squares) with the model's spots next
  to them at the start (blue crosses) and refined (red crosses); the residuals (observed - model) at the
  start and refined (one diverging scale);
* ``thaumatin_tensorboard.png``: the TensorBoard scalars of the run (loss and parameters against the
  step), read back from the event file with TensorBoard's ``EventAccumulator``.

The report page itself (``--report``) is screenshotted for the docs with headless Chromium (see
docs/still-from-images.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from nbtorch import Simulator, config_from_args, eager
from refine.inputs.images import load_image
from refine.output.figures import save_png
from refine.output.html_report import load_report_data
from refine.inputs.spots import render_pixels

TAGS = ("loss", "params/cell_a", "params/cell_c", "params/beam_x", "params/beam_y", "params/mosaic_spread",
        "params/N", "params/scale")


def panels(result: dict, out: Path, crop: tuple[int, int, int, int]) -> None:
    import matplotlib.pyplot as plt
    from matplotlib import colors

    doc = result["json"]
    obs = load_image(doc["input"]["image"])
    sim = Simulator(config_from_args(doc["input"]["model"]), compile=False)
    x0, x1, y0, y1 = crop
    pixels = np.zeros(sim.shape, dtype=bool)
    pixels[y0:y1 + 1, x0:x1 + 1] = True
    sl = (slice(y0, y1 + 1), slice(x0, x1 + 1))
    o, m = obs.image[sl], obs.mask[sl]
    models = {}
    with eager():
        for key in ("initial_params", "params"):
            v = result[key]
            models[key] = v["scale"] * render_pixels(sim, v, pixels)[sl] + v["background"]
    vals = o[m]
    norm = colors.PowerNorm(0.5, vmin=float(np.median(vals)), vmax=float(np.percentile(vals, 99.9)))
    lim = float(np.percentile(np.abs(o - models["params"])[m], 99.5))
    dnorm = colors.Normalize(-lim, lim)
    extent = (x0, x1 + 1, y1 + 1, y0)
    fig, axes = plt.subplots(2, 3, figsize=(15, 9.6), constrained_layout=True)
    grey = plt.get_cmap("gray_r").with_extremes(bad="0.75")
    div = plt.get_cmap("RdBu_r").with_extremes(bad="0.75")
    masked = lambda a: np.where(m, a, np.nan)  # noqa: E731
    for ax, img, title in ((axes[0, 0], masked(o), "observed"), (axes[0, 1], models["initial_params"], "model, start"),
                           (axes[0, 2], models["params"], "model, refined"), (axes[1, 0], masked(o), "spots")):
        im = ax.imshow(img, cmap=grey, norm=norm, extent=extent, interpolation="nearest")
        ax.set_title(title)
        fig.colorbar(im, ax=ax, shrink=0.8, label="photons")
    for ax, key, title in ((axes[1, 1], "initial_params", "observed - model, start"),
                           (axes[1, 2], "params", "observed - model, refined")):
        im = ax.imshow(masked(o - models[key]), cmap=div, norm=dnorm, extent=extent, interpolation="nearest")
        ax.set_title(title)
        fig.colorbar(im, ax=ax, shrink=0.8, label="photons")
    spots = result.get("spots", {})
    if "observed" in spots:
        ob = np.asarray(spots["observed"])
        keep = (ob[:, 0] >= x0) & (ob[:, 0] <= x1 + 1) & (ob[:, 1] >= y0) & (ob[:, 1] <= y1 + 1)
        ax = axes[1, 0]
        ax.scatter(*ob[keep].T, s=70, marker="s", facecolors="none", edgecolors="#1a9e1a", label="observed")
        for key, colour, label in (("predicted_start", "#377eb8", "model, start"),
                                   ("predicted_final", "#e41a1c", "model, refined")):
            ax.scatter(*np.asarray(spots[key])[keep].T, s=30, marker="x", color=colour, label=label)
        ax.legend(loc="lower left", fontsize=8)
    for ax in axes.ravel():
        ax.set_xlim(x0, x1 + 1)
        ax.set_ylim(y1 + 1, y0)
        ax.set_xlabel("x (fast, px)")
        ax.set_ylabel("y (slow, px)")
    save_png(fig, out / "thaumatin_panels.png")


def tensorboard_plot(logdir: Path, out: Path) -> None:
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    tags = [t for t in TAGS if t in ea.Tags()["scalars"]]
    cols = 4
    rows = max(1, math.ceil(len(tags) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.6 * rows), squeeze=False, constrained_layout=True)
    fig.suptitle(f"TensorBoard scalars of {logdir} (read back with EventAccumulator)")
    for ax, tag in zip(axes.ravel(), tags):
        ev = ea.Scalars(tag)
        ax.plot([e.step for e in ev], [e.value for e in ev], color="#f57c00", lw=1.5)
        if tag == "loss":
            ax.set_yscale("log")
        ax.set_title(tag, fontsize=9)
        ax.set_xlabel("step")
        ax.ticklabel_format(axis="y", useOffset=False) if tag != "loss" else None
    for ax in axes.ravel()[len(tags):]:
        ax.axis("off")
    save_png(fig, out / "thaumatin_tensorboard.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", default="out/thaumatin", help="folder with result.h5 and runs/")
    p.add_argument("out", nargs="?", default="docs/img", help="where the PNG files go")
    p.add_argument("--crop", type=int, nargs=4, default=(1400, 1599, 1050, 1249), metavar=("X0", "X1", "Y0", "Y1"))
    a = p.parse_args(argv)
    run, out = Path(a.run), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = load_report_data(run / "result.h5")
    panels(result, out, tuple(a.crop))
    tensorboard_plot(run / "runs", out)
    print(f"wrote {out}/thaumatin_panels.png and {out}/thaumatin_tensorboard.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
