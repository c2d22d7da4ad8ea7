"""A tiny synthetic multi-panel still for tests/test_multi_panel_cli.py: a 48 x 80 pixel detector cut into 2 x 4 = 8
panels of 24 x 20 pixels under a two-level hierarchy (root, two column groups ``col0``/``col1``, four panels each,
every frame local to its parent as dxtbx writes it), its ``.expt``, an image simulated with the two column groups
moved, and the ``.refl`` of that image's spots (panel pixels and the ``panel`` column)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from nbtorch import Simulator, config_from_args
from nbtorch.dials.geometry import refined_document, still_experiment
from nbtorch.dials.panels import panels_simulator
from nbtorch.io.cbf import write_cbf
from nbtorch.io.dials import read_expt, write_refl
from refine.inputs.spots import find_spots

FLAGS = ("-cell 30 32 34 90 90 90 -misset 10 20 30 -lambda 1.0 -distance 50 -pixel 0.2 -detpixels_f 48 "
         "-detpixels_s 80 -Xbeam 4.9 -Ybeam 8.1").split()
MODEL = "-N 5 -default_F 100 -oversample 1"  # the --model flags the .expt does not give
COLS, ROWS, PIXEL_MM = 2, 4, 0.2
W, H = 24, 20  # each panel's fast x slow pixels
#: the true group moves (mm): col0 along its fast axis, col1 along its slow axis, ~0.5 px each
TRUTH = {0: ("beam_x", 0.1), 1: ("beam_y", -0.1)}
PHOTONS_PER_UNIT = 20.0  # photons per unit of the simulated image (brightest pixel ~5e4)
BACKGROUND = 2.0


def document() -> dict:
    """The multi-panel ``.expt`` document (panel 4 a + b: column a, row b)."""
    sim = Simulator(config_from_args(FLAGS))
    doc = refined_document(still_experiment(sim, "image.cbf"), sim, {})
    big = doc["detector"][0]["panels"][0]
    panels, groups = [], []
    for a in range(COLS):
        children = []
        for b in range(ROWS):
            p = copy.deepcopy(big)
            p.update(name=f"col{a}_row{b}", image_size=[W, H], fast_axis=[1.0, 0.0, 0.0], slow_axis=[0.0, 1.0, 0.0],
                     origin=[0.0, b * H * PIXEL_MM, 0.0])
            children.append({"panel": len(panels)})
            panels.append(p)
        groups.append({"name": f"col{a}", "type": "", "fast_axis": [1.0, 0.0, 0.0], "slow_axis": [0.0, 1.0, 0.0],
                       "origin": [a * W * PIXEL_MM, 0.0, 0.0], "children": children})
    root = {"name": "root", "type": "", "fast_axis": big["fast_axis"], "slow_axis": big["slow_axis"],
            "origin": big["origin"], "children": groups}
    doc["detector"][0] = {"panels": panels, "hierarchy": root}
    return doc


def truth_values(sim) -> dict:
    """The per-panel values of the true geometry (the two groups moved by :data:`TRUTH`)."""
    values = sim.panel_layout.values()
    for k, (name, change) in TRUTH.items():
        for i in range(k * ROWS, (k + 1) * ROWS):
            values[f"{name}_p{i}"] += change
    return values


def write_case(tmp: Path) -> dict:
    """Write ``multi.expt``, ``image.cbf`` (the stacked panels, 160 x 24 pixels) and ``multi.refl``; their paths
    and the true per-panel values."""
    expt = tmp / "multi.expt"
    expt.write_text(json.dumps(document()))
    sim = panels_simulator(read_expt(expt, multi_panel=True), extra_flags=MODEL.split())
    truth = truth_values(sim)
    image, _ = sim.render(**truth)
    photons = np.round(image.detach().numpy() * PHOTONS_PER_UNIT + BACKGROUND)
    write_cbf(tmp / "image.cbf", photons.astype(np.int32))
    spots = find_spots(photons)
    panel = (spots[:, 1] // H).astype(int)
    xyz = np.c_[spots[:, 0], spots[:, 1] - panel * H, np.zeros(len(spots))]
    write_refl(tmp / "multi.refl", {"xyzobs.px.value": ("vec3<double>", xyz), "panel": ("std::size_t", panel),
                                    "id": ("int", np.zeros(len(spots), dtype=int))}, {0: ""})
    return {"expt": expt, "image": tmp / "image.cbf", "refl": tmp / "multi.refl", "truth": truth, "spots": spots,
            "photons": photons}
