"""A synthetic multi-panel DIALS experiment built from a real one (imported by the tests/test_multi_panel* files).

The Pilatus 6M panel of the CuNiR still (tests/data/dials/cunir_ssx_indexed.expt, experiment 0) cut into
2 x 4 = 8 panels under a two-level hierarchy (root, two column groups, four panels each, every frame local to
its parent as dxtbx writes it).  The panels cover the same pixels, so DIALS' predictions of the real file
(``xyzcal``) hold on them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "dials"
STILLS = DATA / "cunir_ssx_indexed"
COLS, ROWS = (1231, 1232), (631, 631, 631, 634)  # 2463 x 2527 pixels (fast x slow) in 2 x 4 panels


def split_document(gap_mm: float = 0.0) -> dict:
    """The CuNiR still's document with its one panel cut into 8 under a hierarchy (panel 2a+b: column a, row b)."""
    doc = json.loads(STILLS.with_suffix(".expt").read_text())
    doc["experiment"] = doc["experiment"][:1]
    det = doc["detector"][0]
    big = det["panels"][0]
    px = big["pixel_size"][0]
    panels, groups = [], []
    for a, w in enumerate(COLS):
        children = []
        for b, h in enumerate(ROWS):
            p = copy.deepcopy(big)
            p.update(name=f"col{a}_row{b}", image_size=[w, h], fast_axis=[1.0, 0.0, 0.0], slow_axis=[0.0, 1.0, 0.0],
                     origin=[0.0, (b * ROWS[0] * px) + b * gap_mm, 0.0])
            children.append({"panel": len(panels)})
            panels.append(p)
        groups.append({"name": f"col{a}", "type": "", "fast_axis": [1.0, 0.0, 0.0], "slow_axis": [0.0, 1.0, 0.0],
                       "origin": [a * COLS[0] * px + a * gap_mm, 0.0, 0.0], "children": children})
    root = {"name": "root", "type": "", "fast_axis": big["fast_axis"], "slow_axis": big["slow_axis"],
            "origin": big["origin"], "children": groups}
    doc["detector"][0] = {"panels": panels, "hierarchy": root}
    return doc


def write_doc(tmp_path: Path, doc: dict, name: str = "split.expt") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def offset(i: int) -> tuple[int, int]:
    """(fast, slow) pixel offset of panel i in the original panel."""
    a, b = divmod(i, 4)
    return a * COLS[0], b * ROWS[0]


