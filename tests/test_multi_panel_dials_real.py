"""A real multi-panel DIALS still: the 64-panel CSPAD of DIALS's multi-still refinement test (thermolysin, LCLS).

tests/data/dials_cspad (README there): ``multi_stills_combined.expt`` (10 stills on one hierarchical CSPAD:
root, 4 quadrants, 32 sensors, 64 ASIC panels of 194 x 185 pixels of 0.11 mm) and the 87 indexed reflections
of its first still (``multi_stills_exp0.refl``: ``panel``, ``miller_index``, ``xyzcal.mm`` ...), on 37 panels.
DIALS's stills predictor turns each reciprocal-lattice point onto the Ewald sphere about ``q x s0`` by its
``delpsi`` (:func:`nbtorch.dials.geometry.stills_delpsi_rad`); the panels use SimplePxMmStrategy (no
parallax), so ``xyzcal.px = xyzcal.mm / 0.11``.

The still rendered as it is puts a spot where the Ewald sphere cuts the crystal's shape transform around the
lattice point; for this crystal (``delpsi`` up to 2.3 deg, the points up to 6e-3 1/A off the sphere) that is
up to ~3 px from DIALS's turned position (``test_unturned_still_misses_xyzcal_by_the_ewald_offset``).
Rendered with the crystal turned by a reflection's ``delpsi``
(:func:`nbtorch.dials.geometry.ewald_orientation_deg`), the spot is DIALS's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nbtorch.dials.geometry import bragg_positions_px, ewald_orientation_deg, stills_delpsi_rad
from nbtorch.dials.panels import hierarchy_groups, panel_lab_frames, panels_simulator
from nbtorch.io.dials import read_expt, read_refl

DATA = Path(__file__).resolve().parent / "data" / "dials_cspad"
EXPT, REFL = DATA / "multi_stills_combined.expt", DATA / "multi_stills_exp0.refl"
PIXEL_MM, WIDTH, HEIGHT = 0.11, 194, 185
MODEL = ["-N", "20", "-default_F", "100", "-oversample", "2"]
EDGE_PX = 5  # spot windows (search 2 + box 2 + 1 pixels) stay inside the spot's panel


def _experiment():
    return read_expt(EXPT, 0, multi_panel=True)


def _reflections() -> dict[str, np.ndarray]:
    r = read_refl(REFL, ("panel", "miller_index", "xyzcal.mm", "xyzobs.px.value", "xyzobs.mm.value"),
                  experiment_id=0)
    r["xyzcal.px"] = r["xyzcal.mm"] / PIXEL_MM  # SimplePxMmStrategy: no parallax
    return r


def _per_panel(panel: np.ndarray, offsets: np.ndarray) -> dict[int, tuple[float, float]]:
    """``{panel: (max |offset| of x or y, rms of the 2-D offsets)}`` (px)."""
    out = {}
    for i in np.unique(panel):
        o = offsets[panel == i]
        out[int(i)] = (float(np.abs(o).max()), float(np.sqrt((o ** 2).sum(1).mean())))
    return out


def test_real_cspad_is_64_panels_in_a_four_level_hierarchy() -> None:
    exp = _experiment()
    assert len(exp.panels) == 64
    levels = hierarchy_groups(exp.detector)
    assert [len(level) for level in levels] == [1, 4, 32, 64]
    assert levels[1][0][1] == tuple(range(16))  # quadrant 0: sensors S0..S7, two ASICs each
    frames = panel_lab_frames(exp.detector)
    assert all(np.isclose(np.linalg.norm(f), 1) and np.isclose(np.linalg.norm(s), 1) for f, s, _ in frames)
    r = _reflections()
    assert len(r["panel"]) == 87 and len(np.unique(r["panel"])) == 37
    # the file's own pixel <-> mm conversion is the plain one (so xyzcal.px = xyzcal.mm / 0.11)
    assert np.allclose(r["xyzobs.mm.value"][:, :2] / PIXEL_MM, r["xyzobs.px.value"][:, :2], atol=1e-9)


def test_stills_delpsi_is_dials_delpsical() -> None:
    """Our Ewald offset equals DIALS's own ``delpsical.rad`` of real stills (the 5 CuNiR Pilatus stills, all 360
    predicted reflections; measured 8e-16 rad)."""
    from nbtorch import Simulator, config_from_args
    from nbtorch.dials.geometry import experiment_flags

    cunir = Path(__file__).resolve().parent / "data" / "dials" / "cunir_ssx_indexed"
    seen = 0
    for index in range(5):
        exp = read_expt(cunir.with_suffix(".expt"), index)
        sim = Simulator(config_from_args(experiment_flags(exp) + ["-N", "5"]), dtype=torch.float64)
        r = read_refl(cunir.with_suffix(".refl"), ("miller_index", "xyzcal.mm", "delpsical.rad"), experiment_id=index)
        keep = np.any(r["xyzcal.mm"] != 0, axis=1)
        ours = stills_delpsi_rad(sim, {}, r["miller_index"][keep])
        assert np.abs(ours - r["delpsical.rad"][keep]).max() < 1e-12
        seen += int(keep.sum())
    assert seen == 360


def test_bragg_positions_on_xyzcal_on_every_panel() -> None:
    """Every reflection, predicted in its panel by the simulator's own per-panel geometry with DIALS's Ewald
    offset, lands on ``xyzcal``: every one of the 37 panels under 0.3 px (measured: 1e-12 px)."""
    exp = _experiment()
    sim = panels_simulator(exp, extra_flags=MODEL, dtype=torch.float64)
    r = _reflections()
    delpsi = stills_delpsi_rad(sim, {}, r["miller_index"])
    offsets = np.zeros((len(delpsi), 2))
    for i in np.unique(r["panel"]):
        m = r["panel"] == i
        pos = bragg_positions_px(sim, {}, r["miller_index"][m], 0.0, delpsi[m], panel=int(i))
        offsets[m] = pos - r["xyzcal.px"][m, :2]
    table = _per_panel(r["panel"], offsets)
    assert len(table) == 37
    worst = max(v[0] for v in table.values())
    assert worst < 0.3 and worst < 1e-6, table


def _rendered_offsets(sim, r: dict, rows: np.ndarray, turned: bool) -> np.ndarray:
    """Spot centroids rendered around each reflection of ``rows`` (one render each, the crystal turned by the
    reflection's delpsi when ``turned``) minus the window centre ``xyzcal.px`` (stacked image, px)."""
    from refine.inputs.spots import spot_offsets

    rows_per_panel = sim.panel_layout.rows
    delpsi = stills_delpsi_rad(sim, {}, r["miller_index"][rows])
    angles = ewald_orientation_deg(sim, {}, r["miller_index"][rows], delpsi)
    out = np.full((len(rows), 2), np.nan)
    for k, j in enumerate(rows):
        values = dict(zip(("orient_x", "orient_y", "orient_z"), angles[k])) if turned else {}
        x, y = r["xyzcal.px"][j, :2]
        spot = np.array([[x, y + r["panel"][j] * rows_per_panel]])
        found = spot_offsets(sim, values, spot, search=2 if turned else 6, box=2)
        if found.matched[0]:
            out[k] = found.offsets[0]
    return out


def _inside(r: dict, margin: float) -> np.ndarray:
    x, y = r["xyzcal.px"][:, 0], r["xyzcal.px"][:, 1]
    return np.flatnonzero((x > margin) & (y > margin) & (x < WIDTH - margin) & (y < HEIGHT - margin))


def _check_rendered(rows_wanted: int | None) -> dict[int, tuple[float, float]]:
    torch.set_num_threads(1)
    sim = panels_simulator(_experiment(), extra_flags=MODEL)
    r = _reflections()
    rows = _inside(r, EDGE_PX)
    if rows_wanted is not None:  # one reflection on each of the first panels, one per quadrant
        first = {int(r["panel"][j]) // 16: j for j in rows[::-1]}
        rows = np.array(sorted(first.values()))[:rows_wanted]
    off = _rendered_offsets(sim, r, rows, turned=True)
    assert not np.isnan(off).any()
    table = _per_panel(r["panel"][rows], off)
    assert max(v[0] for v in table.values()) < 0.3, table
    return table


def test_rendered_spots_on_xyzcal_one_per_quadrant() -> None:
    """The simulator's rendered spots (crystal turned by each reflection's delpsi, one window each), one
    reflection in each quadrant: centroids within 0.3 px of xyzcal."""
    table = _check_rendered(4)
    assert len(table) == 4


@pytest.mark.slow
def test_rendered_spots_on_xyzcal_on_every_panel() -> None:
    """As above, every reflection at least 5 px from its panel's edge (76 of 87, on all 37 panels): per panel
    the largest offset under 0.3 px (measured: 0.095 px at most, rms 0.048 px)."""
    table = _check_rendered(None)
    assert len(table) == 37


@pytest.mark.slow
def test_unturned_still_misses_xyzcal_by_the_ewald_offset() -> None:
    """Rendered without the delpsi turn, the spots are not DIALS's: this still's lattice points lie up to 6e-3
    1/A off the Ewald sphere (several widths of the -N 20 crystal's transform), so the spot is wherever the
    sphere cuts the transform's tail (measured: up to 3.3 px from xyzcal, rms 1.1 px over 69 spots); DIALS
    turns each point onto the sphere instead.  The convention, not the panel frames, makes the difference."""
    torch.set_num_threads(1)
    sim = panels_simulator(_experiment(), extra_flags=MODEL)
    r = _reflections()
    rows = _inside(r, 8)[:12]
    off = _rendered_offsets(sim, r, rows, turned=False)
    seen = ~np.isnan(off[:, 0])
    assert seen.sum() >= 8
    assert np.abs(off[seen]).max() > 1.0


def test_real_cspad_expt_out_round_trips(tmp_path: Path) -> None:
    """The CSPAD written back (``refined_panels_document``) at its own values keeps every panel's local frame
    to 1e-9 and the four-level hierarchy; one ASIC moved reads back moved, its neighbours not."""
    from nbtorch.dials.panels import refined_panels_document
    from nbtorch.io.dials import write_expt

    exp = _experiment()
    sim = panels_simulator(exp, extra_flags=MODEL, dtype=torch.float64)
    same = refined_panels_document(exp, sim, {})
    assert same["detector"][0]["hierarchy"] == exp.detector["hierarchy"]
    for got, want in zip(same["detector"][0]["panels"], exp.panels):
        for key in ("origin", "fast_axis", "slow_axis"):
            assert np.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    p = sim.parameters_dict()
    out = tmp_path / "moved.expt"
    write_expt(out, refined_panels_document(exp, sim, {"beam_x_p37": float(p["beam_x_p37"]) + 0.11}))
    back = panel_lab_frames(read_expt(out, 0, multi_panel=True).detector)
    before = panel_lab_frames(exp.detector)
    moved = np.linalg.norm(back[37][2] - before[37][2])
    assert moved == pytest.approx(0.11, abs=1e-9)
    assert all(np.allclose(back[i][2], before[i][2], atol=1e-9) for i in range(64) if i != 37)


def test_ewald_orientation_puts_each_reflection_on_the_sphere() -> None:
    """Turned by ``ewald_orientation_deg`` (composed with orientation deltas already set), reflection j has no
    Ewald offset left (1e-12 rad) while the others keep theirs."""
    exp = _experiment()
    sim = panels_simulator(exp, extra_flags=MODEL, dtype=torch.float64)
    hkl = _reflections()["miller_index"][:6]
    start = {"orient_x": 0.3, "orient_y": -0.2, "orient_z": 0.1}
    delpsi = stills_delpsi_rad(sim, start, hkl)
    assert np.abs(delpsi).max() > 1e-3
    angles = ewald_orientation_deg(sim, start, hkl, delpsi)
    for j in range(len(hkl)):
        turned = dict(zip(("orient_x", "orient_y", "orient_z"), angles[j]))
        left = stills_delpsi_rad(sim, turned, hkl)
        assert abs(left[j]) < 1e-12
        assert np.abs(np.delete(left, j)).max() > 1e-4
