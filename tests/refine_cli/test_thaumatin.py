"""The real-data acceptance run: a Pilatus3 6M still of thaumatin (slow: about 2 minutes on 2 CPU cores).

Starting from the header geometry, the indexing orientation and a textbook cell (a = b = 57.8,
c = 150.0 Å), the refinement must move the model's spots onto the observed ones (rms spot offset
before and after) and return a thaumatin cell (P4(1)2(1)2, a = b ~ 57.7, c ~ 150.4 Å) with the distance refined
(~346 mm; the header's 351 mm would make the cell 1.3 % long), with esds and the distance-cell correlation.  Same
options as the tutorial (docs/still-from-images.md, examples/thaumatin_still.toml).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from refine.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "real" / "thaumatin_i24_still"
CONFIG = ROOT / "examples" / "thaumatin_still.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DATA / "thau_3_2_0003.cbf.bz2").is_file(), reason="../shared/real/thaumatin_i24_still missing"),
]


def test_thaumatin_still_refinement(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the checkout
    code = main(["--config", str(CONFIG), "--compile", "--out", str(tmp_path / "thau.h5"),
                 "--logdir", str(tmp_path / "runs")])
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
    # ... far above their shot-noise floor (0.17 px on 2026-11-25; docs/log.md, "The spot noise floor")
    assert 0.05 < s["rms_px_floor"] < 0.4 * s["rms_px_final"] and s["floor_spots"] >= 0.75 * s["matched_final"]
    # what the model misses (docs/log.md, "What the model still misses", 2026-11-27): observed spots sharper
    # than the model's; the held planes of --background auto put the background between spots at the observed
    # level (6.85 vs 6.88 photons/pixel; the flat background gave 10.7)
    diag = doc["diagnostics"]
    o, m = diag["profile"]["observed"], diag["profile"]["model"]
    assert diag["profile"]["spots"] >= 0.8 * s["n"] and diag["sigZ"] > 10 * diag["sigZ_robust"]
    assert o["peak_per_spot"] > 1.5 * m["peak_per_spot"] and m["rms_radius_px"] > o["rms_radius_px"]
    # about its own centroids the model's spot is less smeared, still wider than the observed one (2.16 vs 1.91 px)
    own = diag["profile"]["model_own"]
    assert o["rms_radius_px"] < own["rms_radius_px"] < m["rms_radius_px"] and own["peak_per_spot"] > m["peak_per_spot"]
    table = diag["background_by_resolution"]
    assert "a plane held in each of" in out
    assert abs(table["model_mean"] / table["observed_mean"] - 1) < 0.1, table

    # the detector's tilt, which both stills measure alike (-0.068 / -0.066 deg about x, +0.373 / +0.405 deg about y,
    # esds 0.02; docs/log.md, "What each model term removes")
    assert -0.15 < p["detector_rotx"] < 0.0 and 0.25 < p["detector_roty"] < 0.5, (p["detector_rotx"], p["detector_roty"])
    assert s["rms_px_final"] < 1.5  # 1.33 px with the Gaussian crystal at 80 domains; 1.44 with the sinc^2 shape
    # the cell: thaumatin, tetragonal, with the distance refined (57.794, 150.477 A at 346.65 mm; docs/log.md,
    # "where the domains lie, and the crystal shape")
    assert 344.0 < p["distance"] < 349.0, p["distance"]
    assert p["cell_a"] == p["cell_b"] and p["cell_alpha"] == p["cell_beta"] == p["cell_gamma"] == 90.0
    assert 57.5 <= p["cell_a"] <= 58.0, p["cell_a"]
    assert 149.8 <= p["cell_c"] <= 151.0, p["cell_c"]
    for name in ("cell_a", "cell_c"):  # 0.065, 0.17 A with the Gaussian crystal (sinc^2: 0.053, 0.14)
        assert 0 < e[name] < 0.25 and math.isfinite(e[name])
    assert "cell_distance" not in doc and "rests on the distance" not in out

    # one still cannot separate distance and cell scale: the correlation the esds show
    names, corr = doc["correlation"]["names"], doc["correlation"]["matrix"]
    d = names.index("distance")
    assert corr[d][names.index("cell_a")] > 0.9
    assert corr[d][names.index("cell_c")] > 0.9
    assert "rms offset" in out


def test_thaumatin_stills_with_structure_factors(tmp_path, monkeypatch, capsys):
    """Both stills, same settings, one F for all and with the amplitudes refined (docs/log.md, "Measured on
    the two thaumatin stills"): the amplitudes lower the fit excess by at least a fifth on each still, the cell over
    the distance stays, and the two stills' cells agree within 3 combined esds.  The issue's thresholds
    (spot rms <= 0.7 px, fit <= 3x) are not reached: the spot shape limits them."""
    monkeypatch.chdir(ROOT)
    docs = {}
    for still in ("0003", "0004"):
        config = tmp_path / f"{still}.toml"
        config.write_text(CONFIG.read_text().replace("0003", still))
        for kind, extra in (("one", []), ("amplitudes", ["--structure-factors"])):
            out = tmp_path / f"{still}_{kind}.h5"
            assert main(["--config", str(config), "--compile", "--out", str(out), "--no-esds" if kind == "one" else
                         "--quiet", "--logdir", str(tmp_path / "runs" / f"{still}_{kind}"), *extra]) == 0
            docs[still, kind] = json.loads(out.with_suffix(".json").read_text())
    capsys.readouterr()
    for still in ("0003", "0004"):
        one, amp = docs[still, "one"], docs[still, "amplitudes"]
        assert amp["fit"]["excess"] < 0.8 * one["fit"]["excess"], (one["fit"], amp["fit"])
        assert amp["structure_factors"]["n_free"] > 300 and amp["structure_factors"]["space_group"] == "P 41 21 2"
        # with the distance refined the amplitudes move cell and distance together along their +0.99 correlation
        # (2026-11-27: a by -3.3 / -1.6 esds, the distance by -0.9 / -0.4 mm), while the cell over the distance, what
        # one still measures, stays (a/D by 1.4e-4 / 0.8e-4)
        ratio = (amp["params"]["cell_a"] / amp["params"]["distance"]) / (one["params"]["cell_a"] / one["params"]["distance"])
        assert abs(ratio - 1) < 3e-4, ratio
        assert abs(amp["params"]["cell_a"] - one["params"]["cell_a"]) < 4 * amp["esds"]["cell_a"]
        assert amp["spots"]["matched_final"] >= 0.9 * amp["spots"]["n"]
    a3, a4 = docs["0003", "amplitudes"], docs["0004", "amplitudes"]
    combined = math.hypot(a3["esds"]["cell_a"], a4["esds"]["cell_a"])
    apart = abs(a3["params"]["cell_a"] - a4["params"]["cell_a"])
    assert apart / combined < 3.0, (apart, combined)  # 1.06 on 2026-11-27 (distance refined, held planes, no tilt); was 3.9
