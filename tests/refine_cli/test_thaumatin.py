"""The real-data acceptance run: a Pilatus3 6M still of thaumatin (slow: about 2 minutes on 2 CPU cores).

Starting from the header geometry, the indexing orientation and a textbook cell (a = b = 57.8,
c = 150.0 Å), the refinement must move the model's spots onto the observed ones (rms spot offset
before and after) and return a thaumatin cell (P4(1)2(1)2, a = b ~ 57.8-58.4, c ~ 150-152.3 Å) at the
header distance, with esds and the distance-cell correlation.  Same options as the tutorial
(docs/refinement.md, examples/thaumatin_still.toml).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from refine.cli import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "real" / "thaumatin_i24_still"
CONFIG = ROOT / "examples" / "thaumatin_still.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DATA / "thau_3_2_0003.cbf.bz2").is_file(), reason="../shared/real/thaumatin_i24_still missing"),
]


def test_thaumatin_still_refinement(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the checkout
    t0 = time.monotonic()
    code = main(["--config", str(CONFIG), "--compile", "--out", str(tmp_path / "thau.h5"),
                 "--logdir", str(tmp_path / "runs")])
    wall = time.monotonic() - t0
    out = capsys.readouterr().out
    print(out)
    assert code == 0
    doc = json.loads((tmp_path / "thau.json").read_text())
    p, e = doc["params"], doc["esds"]

    # spots: the refined model's spots sit on the observed ones
    s = doc["spots"]
    assert s["rms_px_start_common"] > 3.0
    assert s["rms_px_final_common"] < 1.6
    assert s["matched_final"] >= 0.95 * s["n"]
    # ... far above their shot-noise floor (0.17 px on 2026-11-25; docs/refinement.md, "The spot noise floor")
    assert 0.05 < s["rms_px_floor"] < 0.4 * s["rms_px_final"] and s["floor_spots"] >= 0.75 * s["matched_final"]

    # the cell: thaumatin, tetragonal, at the header distance (351 mm, held fixed)
    assert p["distance"] == 351.0
    assert p["cell_a"] == p["cell_b"] and p["cell_alpha"] == p["cell_beta"] == p["cell_gamma"] == 90.0
    assert 57.8 <= p["cell_a"] <= 58.6, p["cell_a"]
    assert 150.0 <= p["cell_c"] <= 152.6, p["cell_c"]
    for name in ("cell_a", "cell_c"):
        assert 0 < e[name] < 0.05 and math.isfinite(e[name])

    # one still cannot separate distance and cell scale: the correlation the esds show
    extra = doc["esd_extra"]
    names = extra["names"]
    corr = extra["correlation"]
    d = names.index("distance")
    assert corr[d][names.index("cell_a")] > 0.9
    assert corr[d][names.index("cell_c")] > 0.9
    assert "correlation with cell_a" in out and "rms offset" in out
    assert wall < 900  # about 2 minutes on 2 idle cores, compile included
