"""The thaumatin still's Pilatus3 6M as 60 modules against one rigid panel (issue #35).

Run from the checkout: ``python experiments/thaumatin_modules.py [--image 3] [--mosaic-domains 10]``.

The model is the indexing solution of shared/real/thaumatin_i24_still (its nanoBragg geometry arguments and
``-mat``; cell and orientation fixed) plus ``-default_F 100 -N 20 -mosaic 0.4``.  The image is cut into its 60
modules (nbtorch.io.modules, gaps from the header's detector type) and the detector built as 60 module panels
placed where the one panel's pixels lie (nbtorch.panels.module_configs).  The fitted pixels are 7 x 7 windows
around the indexed observed spots (bad pixels out).  Two fits with the same loss and pixels
(refine.fitting.panel_groups, scale and background fitted too):

1. one rigid panel: one group of all 60 modules (distance, beam_x, beam_y);
2. 60 modules: from fit 1, each module its own group (distance, beam_x, beam_y; a module needs 6 spots).

Printed: the loss, and the rms distance of the model's spot centroids from the observed ones (spot_offsets),
for the start and both fits.
"""

from __future__ import annotations

import argparse
import bz2
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nbtorch import Simulator
from nbtorch.io.cbf import read_cbf
from nbtorch.io.modules import detector_family, module_grid, split_modules
from nbtorch.panels import module_configs
from refine.fitting.panel_groups import fit_panel_groups
from refine.inputs.spots import spot_offsets, window_mask

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "real" / "thaumatin_i24_still"


def observed_spots(image: int) -> np.ndarray:
    """(n, 2) observed centroids (x fast, y slow, px) of the indexed spots of the spot list."""
    rows = []
    for line in (DATA / f"thau_3_2_000{image}_spots.txt").read_text().splitlines():
        f = line.split()
        if line.startswith("#") or len(f) < 5 or f[4] != "1":
            continue
        rows.append((float(f[0]), float(f[1])))
    return np.array(rows)


def stacked_spots(spots: np.ndarray, grid, rows: int, margin: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Spots on a module (not within ``margin`` px of its edge) in stacked coordinates, and their module."""
    out, which = [], []
    for x, y in spots:
        for k, (x0, y0, w, h) in enumerate(grid):
            if x0 + margin <= x < x0 + w - margin and y0 + margin <= y < y0 + h - margin:
                out.append((x - x0, y - y0 + k * rows))
                which.append(k)
    return np.array(out), np.array(which)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", type=int, default=3, choices=(3, 4))
    ap.add_argument("--mosaic-domains", type=int, default=10)
    ap.add_argument("--evaluations", type=int, default=40)
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cbf = Path(tmp) / "image.cbf"
        cbf.write_bytes(bz2.decompress((DATA / f"thau_3_2_000{ns.image}.cbf.bz2").read_bytes()))
        image, header = read_cbf(str(cbf))
    family = detector_family(header, image.shape)
    grid = module_grid(family, image.shape)
    old = os.getcwd()
    os.chdir(DATA)  # the args name the -mat file relative to the data folder
    try:
        args = (DATA / f"nanobragg_geometry_args_thau_3_2_000{ns.image}.txt").read_text().split()
        args += ["-default_F", "100", "-N", "20", "-mosaic", "0.4", "-mosaic_dom", str(ns.mosaic_domains),
                 "-mosaic_seed", "1", "-oversample", "1"]
        sim = Simulator.from_panels(module_configs(args, grid), names=[f"module{k}" for k in range(len(grid))])
    finally:
        os.chdir(old)
    rows = sim.panel_layout.rows
    observed = np.concatenate([m.astype(np.float64) for m in split_modules(image, family)], axis=0)
    spots, which = stacked_spots(observed_spots(ns.image), grid, rows)
    pixels = window_mask(sim.shape, spots, 3) & (observed >= 0)
    print(f"{family}: {len(grid)} modules; {len(spots)} indexed spots on modules in {len(set(which))} modules; "
          f"{int(pixels.sum())} fitted pixels", flush=True)
    names = ("distance", "beam_x", "beam_y")
    t0 = time.perf_counter()
    rigid = fit_panel_groups(sim, observed, pixels, [tuple(range(len(grid)))], names=names, spots=spots,
                             max_evaluations=ns.evaluations, nuisance=True, labels=["detector"])
    print(f"one rigid panel: loss {rigid.loss_start:.5g} -> {rigid.loss_end:.5g}, {rigid.evaluations} evaluations, "
          f"{time.perf_counter() - t0:.0f} s; changes {rigid.changes}", flush=True)
    t0 = time.perf_counter()
    modules = fit_panel_groups(sim, observed, pixels, [(k,) for k in range(len(grid))], names=names, spots=spots,
                               max_evaluations=ns.evaluations, nuisance=True, start_values=rigid.overrides(sim))
    print(f"60 modules: loss {modules.loss_start:.5g} -> {modules.loss_end:.5g}, {modules.evaluations} evaluations, "
          f"{time.perf_counter() - t0:.0f} s; {len(modules.fixed)} modules fixed (too few spots)", flush=True)
    for label, values in (("start", {}), ("one rigid panel", rigid.overrides(sim)),
                          ("60 modules", modules.overrides(sim))):
        off = spot_offsets(sim, values, spots)
        d = off.offsets[off.matched]
        print(f"{label}: spot rms {off.rms():.3f} px (fast {np.sqrt(np.mean(d[:, 0] ** 2)):.3f}, slow "
              f"{np.sqrt(np.mean(d[:, 1] ** 2)):.3f}), {int(off.matched.sum())}/{len(spots)} matched", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
