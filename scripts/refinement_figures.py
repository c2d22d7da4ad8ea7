"""Pictures for docs/refinement.md from a finished ``nbtorch-refine`` run (run from the checkout)::

    .venv/bin/nbtorch-refine --config examples/thaumatin_still.toml
    .venv/bin/python scripts/refinement_figures.py out/thaumatin docs/img

Writes into the second folder:

* ``thaumatin_panels.png``: a crop of the observed image, the model at the start and refined; the
  observed spots (green squares) with the model's spots next to them at the start (blue crosses) and
  refined (red crosses); the residuals (observed - model) at the start and refined;
* ``thaumatin_tensorboard.png``: the TensorBoard scalars of the run (loss and parameters against the
  step), read back from the event file with TensorBoard's ``EventAccumulator`` and drawn here (no
  browser is available to screenshot the TensorBoard page itself).

Labels need Pillow (installed with tensorboard); without it the pictures come without text.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from nbtorch import Simulator, config_from_args, eager
from refine.data import load_image
from refine.pictures import diverging, gray, side_by_side, spot_marks, write_png
from refine.results import load_h5
from refine.spots import render_pixels

TAGS = ("loss", "params/cell_a", "params/cell_c", "params/beam_x", "params/beam_y", "params/mosaic_spread",
        "params/N", "params/scale")


def _label(rgb: np.ndarray, text: str) -> np.ndarray:
    if rgb.ndim == 2:
        rgb = np.repeat(rgb[..., None], 3, axis=2)
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return rgb
    im = Image.fromarray(rgb)
    d = ImageDraw.Draw(im)
    d.rectangle([0, 0, 8 + 6 * len(text), 14], fill=(255, 255, 255))
    d.text((3, 2), text, fill=(0, 0, 0))
    return np.asarray(im)


def _zoom(a: np.ndarray, k: int) -> np.ndarray:
    return np.kron(a, np.ones((k, k) + (1,) * (a.ndim - 2), dtype=a.dtype)) if k > 1 else a


def panels(result: dict, out: Path, crop: tuple[int, int, int, int], zoom: int) -> None:
    doc = result["json"]
    tokens = doc["input"]["model"]
    obs = load_image(doc["input"]["image"])
    sim = Simulator(config_from_args(tokens), compile=False)
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
    def stretch(img: np.ndarray, mask=None) -> np.ndarray:  # median (background) to the brightest spots
        vals = img[mask] if mask is not None else img.ravel()
        return gray(img, mask, float(np.median(vals)), float(np.percentile(vals, 99.9)))

    res_lim = float(np.percentile(np.abs(o - models["params"])[m], 99.5))
    spots = result.get("spots", {})
    overlay = _zoom(stretch(o, m), zoom)
    if "observed" in spots:
        shift = np.array([x0, y0], dtype=float)
        ob = spots["observed"]
        keep = np.all((ob - shift >= 0) & (ob - shift < [x1 - x0 + 1, y1 - y0 + 1]), axis=1)
        overlay = spot_marks(overlay, ob[keep] - shift, (0, 170, 0), "square", size=4 * zoom, scale=zoom)
        for key, colour in (("predicted_start", (40, 80, 255)), ("predicted_final", (230, 0, 0))):
            overlay = spot_marks(overlay, spots[key][keep] - shift, colour, "cross", size=2 * zoom, scale=zoom)
    top = side_by_side([
        _label(_zoom(stretch(o, m), zoom), "observed"),
        _label(_zoom(stretch(models["initial_params"]), zoom), "model, start"),
        _label(_zoom(stretch(models["params"]), zoom), "model, refined"),
    ])
    bottom = side_by_side([
        _label(overlay, "spots: observed, start, refined"),
        _label(_zoom(diverging(o - models["initial_params"], m, res_lim), zoom), "observed - model, start"),
        _label(_zoom(diverging(o - models["params"], m, res_lim), zoom), "observed - model, refined"),
    ])
    gap = np.full((6, top.shape[1], 3), 255, np.uint8)
    write_png(out / "thaumatin_panels.png", np.concatenate([top, gap, bottom]))


def tensorboard_plot(logdir: Path, out: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    tags = [t for t in TAGS if t in ea.Tags()["scalars"]]
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        print("Pillow is missing: no TensorBoard plot", file=sys.stderr)
        return
    cols, w, h, pad = 4, 300, 190, 34
    rows = math.ceil(len(tags) / cols)
    im = Image.new("RGB", (cols * w, rows * h + 22), (255, 255, 255))
    d = ImageDraw.Draw(im)
    d.text((6, 4), f"TensorBoard scalars of {logdir} (read back with EventAccumulator; x = step)", fill=(0, 0, 0))
    for k, tag in enumerate(tags):
        ev = ea.Scalars(tag)
        x = np.array([e.step for e in ev], dtype=float)
        y = np.array([e.value for e in ev], dtype=float)
        if tag == "loss":
            y = np.log10(y)
        ox, oy = (k % cols) * w, 22 + (k // cols) * h
        left, top, right, bottom = ox + pad + 18, oy + 18, ox + w - 10, oy + h - 22
        d.rectangle([left, top, right, bottom], outline=(180, 180, 180))
        for f in (0.25, 0.5, 0.75):
            yy = top + f * (bottom - top)
            d.line([left, yy, right, yy], fill=(235, 235, 235))
        ymin, ymax = float(y.min()), float(y.max())
        if ymax - ymin < 1e-12 * max(1.0, abs(ymax)):
            ymin, ymax = ymin - 0.5, ymax + 0.5
        xmin, xmax = float(x.min()), float(max(x.max(), x.min() + 1))
        pts = [(left + (xi - xmin) / (xmax - xmin) * (right - left),
                bottom - (yi - ymin) / (ymax - ymin) * (bottom - top)) for xi, yi in zip(x, y)]
        d.line(pts, fill=(245, 124, 0), width=2)
        name = "log10 loss" if tag == "loss" else tag
        d.text((ox + 8, oy + 3), name, fill=(0, 0, 0))
        d.text((ox + 4, top - 2), f"{ymax:.6g}", fill=(90, 90, 90))
        d.text((ox + 4, bottom - 10), f"{ymin:.6g}", fill=(90, 90, 90))
        d.text((left, bottom + 4), f"{int(xmin)}", fill=(90, 90, 90))
        d.text((right - 20, bottom + 4), f"{int(xmax)}", fill=(90, 90, 90))
    im.save(out / "thaumatin_tensorboard.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", default="out/thaumatin", help="folder with result.h5 and runs/")
    p.add_argument("out", nargs="?", default="docs/img", help="where the PNG files go")
    p.add_argument("--crop", type=int, nargs=4, default=(1400, 1599, 1050, 1249), metavar=("X0", "X1", "Y0", "Y1"))
    p.add_argument("--zoom", type=int, default=2)
    a = p.parse_args(argv)
    run, out = Path(a.run), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = load_h5(run / "result.h5")
    with __import__("h5py").File(run / "result.h5", "r") as h5:
        if "spots" in h5:
            result["spots"] = {k: h5["spots"][k][()] for k in h5["spots"]}
    panels(result, out, tuple(a.crop), a.zoom)
    tensorboard_plot(run / "runs", out)
    print(f"wrote {out}/thaumatin_panels.png and {out}/thaumatin_tensorboard.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
