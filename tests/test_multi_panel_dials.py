"""DIALS multi-panel and hierarchical detectors in and out (nbtorch.dials.panels, read_expt(multi_panel=True)).

The multi-panel experiment is synthetic but built from a real one: the Pilatus 6M panel of the CuNiR still
(tests/data/dials/cunir_ssx_indexed.expt, experiment 0) cut into 2 x 4 = 8 panels under a two-level
hierarchy (root, two column groups, four panels each, every frame local to its parent as dxtbx writes it).
The panels cover the same pixels, so DIALS' own predictions (``xyzcal``) of the real file hold on them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.dials.geometry import bragg_positions_px
from nbtorch.dials.panels import (
    check_image_panels, hierarchy_groups, panel_flags, panel_lab_frames, panels_simulator, refined_panels_document,
)
from nbtorch.errors import InputError
from nbtorch.io.dials import read_expt, read_refl, write_expt
from multi_panel_data import COLS, ROWS, STILLS, offset as _offset, split_document, write_doc as _write

def test_hierarchy_composes_to_the_original_panel(tmp_path: Path) -> None:
    exp = read_expt(_write(tmp_path, split_document()), multi_panel=True)
    big = read_expt(STILLS.with_suffix(".expt")).panel
    px = big["pixel_size"][0]
    f0, s0, o0 = (np.asarray(big[k]) for k in ("fast_axis", "slow_axis", "origin"))
    frames = panel_lab_frames(exp.detector)
    assert len(frames) == 8
    for i, (f, s, o) in enumerate(frames):
        x, y = _offset(i)
        assert np.allclose(f, f0, atol=1e-12) and np.allclose(s, s0, atol=1e-12)
        assert np.allclose(o, o0 + x * px * f0 + y * px * s0, atol=1e-9)
    levels = hierarchy_groups(exp.detector)
    assert [len(level) for level in levels] == [1, 2, 8]
    assert levels[0][0] == ("root", tuple(range(8))) and levels[1][1] == ("col1", (4, 5, 6, 7))


def test_each_panel_is_its_single_panel_simulator(tmp_path: Path) -> None:
    exp = read_expt(_write(tmp_path, split_document(gap_mm=1.0)), multi_panel=True)
    extra = ["-N", "5", "-default_F", "1", "-roi", "0", "15", "0", "11"]  # a corner of each panel: fast
    sim = panels_simulator(exp, extra_flags=extra)
    assert [p.name for p in sim.panel_layout.panels][:2] == ["col0_row0", "col0_row1"]
    image, _ = sim.render()
    for i, flags in enumerate(panel_flags(exp)):
        single, _ = Simulator(config_from_args(flags + extra)).render()
        assert torch.equal(sim.panel_layout.panel_image(image, i)[:12, :16], single)


def _reflections(index: int = 0) -> dict:
    r = read_refl(STILLS.with_suffix(".refl"), ("miller_index", "xyzcal.px", "xyzcal.mm", "delpsical.rad"),
                  experiment_id=index)
    predicted = np.any(r["xyzcal.mm"] != 0, axis=1)
    return {k: v[predicted] for k, v in r.items()}


def test_spots_on_every_panel_where_dials_predicts_them(tmp_path: Path) -> None:
    """Each reflection, predicted in the panel that holds it, lands on DIALS' xyzcal (1e-6 px of the plane
    intersection; 0.5 px of xyzcal.px, which includes DIALS' parallax correction) and spots reach >= 6 panels."""
    exp = read_expt(_write(tmp_path, split_document()), multi_panel=True)
    sim = panels_simulator(exp, extra_flags=["-N", "5", "-default_F", "1"])
    r = _reflections()
    px = exp.panels[0]["pixel_size"][0]
    hit_panels = set()
    for i, panel in enumerate(exp.panels):
        w, h = panel["image_size"]
        x0, y0 = _offset(i)
        pos = bragg_positions_px(sim, {}, r["miller_index"], 0.0, r["delpsical.rad"], panel=i)
        inside = (pos[:, 0] >= 0) & (pos[:, 0] < w) & (pos[:, 1] >= 0) & (pos[:, 1] < h)
        if inside.any():
            hit_panels.add(i)
        whole = pos[inside] + [x0, y0]
        assert np.abs(whole - r["xyzcal.mm"][inside, :2] / px).max(initial=0) < 1e-6, f"panel {i}"
        assert np.abs(whole - r["xyzcal.px"][inside, :2]).max(initial=0) < 0.5, f"panel {i}"
    assert len(hit_panels) >= 6


def test_expt_out_round_trips(tmp_path: Path) -> None:
    path = _write(tmp_path, split_document(gap_mm=0.5))
    exp = read_expt(path, multi_panel=True)
    sim = panels_simulator(exp, extra_flags=["-N", "5", "-default_F", "1"], dtype=torch.float64)
    same = refined_panels_document(exp, sim, {})
    for got, want in zip(same["detector"][0]["panels"], exp.panels):
        for key in ("origin", "fast_axis", "slow_axis"):
            assert np.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    assert same["detector"][0]["hierarchy"] == exp.detector["hierarchy"]
    # move panel 5 (distance and beam centre) and read the written file back
    p = sim.parameters_dict()
    moved = {"distance_p5": float(p["distance_p5"]) + 0.4, "beam_x_p5": float(p["beam_x_p5"]) - 0.2}
    out = tmp_path / "out.expt"
    write_expt(out, refined_panels_document(exp, sim, moved))
    back = read_expt(out, multi_panel=True)
    sim2 = panels_simulator(back, extra_flags=["-N", "5", "-default_F", "1"], dtype=torch.float64)
    p2 = sim2.parameters_dict()
    for name, value in moved.items():
        assert float(p2[name]) == pytest.approx(value, abs=1e-9)
    for i in (0, 4, 7):
        assert float(p2[f"distance_p{i}"]) == pytest.approx(float(p[f"distance_p{i}"]), abs=1e-9)
    lab_before, lab_after = panel_lab_frames(exp.detector), panel_lab_frames(back.detector)
    assert np.allclose(lab_after[4][2], lab_before[4][2], atol=1e-9)
    assert not np.allclose(lab_after[5][2], lab_before[5][2], atol=1e-3)


def _error(tmp_path: Path, doc: dict, match: str) -> None:
    with pytest.raises(InputError, match=match) as info:
        read_expt(_write(tmp_path, doc, "bad.expt"), multi_panel=True)
    assert "\n" not in str(info.value)


def test_malformed_hierarchy_names_the_panel(tmp_path: Path) -> None:
    doc = split_document()
    doc["detector"][0]["hierarchy"]["children"][1]["children"][2] = {"panel": 1}
    _error(tmp_path, doc, r"detector panel 1 appears twice in the hierarchy")
    doc = split_document()
    del doc["detector"][0]["hierarchy"]["children"][0]["children"][3]
    _error(tmp_path, doc, r"detector panel 3 \(col0_row3\) is not in the detector hierarchy")
    doc = split_document()
    doc["detector"][0]["hierarchy"]["children"][0]["children"][0] = {"panel": 12}
    _error(tmp_path, doc, r"panel 12 is not a panel index 0..7")
    doc = split_document()
    del doc["detector"][0]["hierarchy"]["children"][1]["origin"]
    _error(tmp_path, doc, r"detector group col1 \(in hierarchy root\) 'origin' missing")
    doc = split_document()
    doc["detector"][0]["panels"][6]["image_size"] = [0, 631]
    _error(tmp_path, doc, r"detector panel 6 \(col1_row2\) 'image_size' must be two positive integers")
    doc = split_document()
    doc["detector"][0]["panels"][2]["pixel_size"] = [0.172, 0.1]
    with pytest.raises(InputError, match=r"detector panel 2 \(col0_row2\): pixels of 0.172 x 0.1 mm are not square"):
        panel_flags(read_expt(_write(tmp_path, doc, "bad2.expt"), multi_panel=True))
    # the single-panel reader still refuses several panels
    with pytest.raises(InputError, match="multi-panel detector"):
        read_expt(_write(tmp_path, split_document(), "split.expt"))


def test_panels_not_matching_the_image(tmp_path: Path) -> None:
    exp = read_expt(_write(tmp_path, split_document()), multi_panel=True)
    shapes = [(h, w) for w in COLS for h in ROWS]
    check_image_panels(exp, shapes)
    with pytest.raises(InputError, match="the detector has 8 panels but the image has 7"):
        check_image_panels(exp, shapes[:7])
    shapes[5] = (630, 1232)
    with pytest.raises(InputError, match=r"detector panel 5 \(col1_row1\) is 1232 x 631 pixels .* panel 5 is 1232 x 630"):
        check_image_panels(exp, shapes)


DXTBX_PYTHON = os.environ.get("NBTORCH_DXTBX_PYTHON", "")


def _hierarchy_outline(node: dict) -> tuple:
    """A hierarchy (as the .expt holds it, or as dxtbx_dump.py describes dxtbx's) as nested names and panels."""
    if "panel" in node:
        return ("panel", node["panel"])
    return (node["name"], tuple(_hierarchy_outline(child) for child in node["children"]))


@pytest.mark.skipif(not DXTBX_PYTHON, reason="set NBTORCH_DXTBX_PYTHON to a Python with DIALS' dxtbx to check that "
                                             "dxtbx reads the multi-panel .expt nbtorch writes")
def test_dxtbx_reads_the_multi_panel_expt(tmp_path: Path) -> None:
    """The round trip nbtorch -> dxtbx -> nbtorch: dxtbx composes the written hierarchy into the lab frames
    nbtorch meant (every panel, 1e-9 mm) with the same groups and local group frames, and the file dxtbx's own
    writer makes of it reads back in nbtorch as the same detector (frames to 1e-9 mm, same groups)."""
    import subprocess

    exp = read_expt(_write(tmp_path, split_document(gap_mm=0.5)), multi_panel=True)
    sim = panels_simulator(exp, extra_flags=["-N", "5", "-default_F", "1"], dtype=torch.float64)
    p = sim.parameters_dict()
    out, back = tmp_path / "out.expt", tmp_path / "dxtbx_wrote.expt"
    write_expt(out, refined_panels_document(exp, sim, {"distance_p2": float(p["distance_p2"]) + 0.3}))
    script = Path(__file__).resolve().parent / "dxtbx_dump.py"
    done = subprocess.run([DXTBX_PYTHON, str(script), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])[str(out)][0]
    ours = read_expt(out, multi_panel=True).detector
    frames = panel_lab_frames(ours)
    assert len(seen["panels"]) == 8
    for s, (f, sl, o) in zip(seen["panels"], frames):
        assert np.allclose(s["origin"], o, atol=1e-9) and np.allclose(s["fast_axis"], f, atol=1e-9)
        assert np.allclose(s["slow_axis"], sl, atol=1e-9)
    written = json.loads(out.read_text())["detector"][0]["hierarchy"]
    assert _hierarchy_outline(seen["hierarchy"]) == _hierarchy_outline(written)
    for group, ours_group in zip(seen["hierarchy"]["children"], written["children"]):
        for key in ("fast_axis", "slow_axis", "origin"):
            assert np.allclose(group[key], ours_group[key], atol=1e-9), (group["name"], key)
    done = subprocess.run([DXTBX_PYTHON, str(script), "--rewrite", str(out), str(back)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    again = read_expt(back, multi_panel=True).detector
    assert hierarchy_groups(again) == hierarchy_groups(ours)
    for (f, sl, o), (f2, sl2, o2) in zip(frames, panel_lab_frames(again), strict=True):
        assert np.allclose(f2, f, atol=1e-9) and np.allclose(sl2, sl, atol=1e-9) and np.allclose(o2, o, atol=1e-9)


def test_rendered_spots_on_every_panel_on_dials_predictions(tmp_path: Path) -> None:
    """The multi-panel simulator's own spots (rendered in windows around them, in the stacked image) have
    centroids on xyzcal.px: rms under 0.3 px, none over 0.5 px (xyzcal.px includes DIALS' parallax
    correction, up to 0.3 px), on at least 6 of the 8 panels."""
    from refine.inputs.spots import spot_offsets

    exp = read_expt(_write(tmp_path, split_document()), multi_panel=True)
    sim = panels_simulator(exp, extra_flags=["-N", "20", "-default_F", "100", "-oversample", "2"])
    cal = _reflections()["xyzcal.px"][:, :2]
    layout = sim.panel_layout
    stacked, panels = [], set()
    for x, y in cal:
        a = min(int(x // COLS[0]), 1)
        b = min(int(y // ROWS[0]), 3)
        i = 4 * a + b
        x0, y0 = _offset(i)
        if x - x0 < 8 or y - y0 < 8 or x - x0 > COLS[a] - 8 or y - y0 > ROWS[b] - 8:
            continue  # near a panel edge: its window would reach the next panel's block
        stacked.append((x - x0, y - y0 + i * layout.rows))
        panels.add(i)
    assert len(panels) >= 6 and len(stacked) >= 25
    off = spot_offsets(sim, {}, np.array(stacked))
    assert off.matched.all()
    assert np.abs(off.offsets).max() < 0.5 and off.rms() < 0.3


def test_one_panel_under_a_moved_hierarchy_root(tmp_path: Path) -> None:
    """A single panel whose hierarchy root is not the lab frame: the flags use the composed lab frame (the same
    detector as the flattened file), and the refined panel is written back local to the root."""
    from nbtorch.dials.geometry import refined_document

    doc = json.loads(STILLS.with_suffix(".expt").read_text())
    doc["experiment"] = doc["experiment"][:1]
    flat_path = _write(tmp_path, doc, "flat.expt")
    c, s = np.cos(0.2), np.sin(0.2)
    root = {"name": "root", "fast_axis": [c, s, 0.0], "slow_axis": [-s, c, 0.0], "origin": [1.0, -2.0, 3.0],
            "children": [{"panel": 0}]}
    panel = doc["detector"][0]["panels"][0]
    lab = tuple(np.asarray(panel[k]) for k in ("fast_axis", "slow_axis", "origin"))
    r = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    panel.update(fast_axis=list(r.T @ lab[0]), slow_axis=list(r.T @ lab[1]),
                 origin=list(r.T @ (lab[2] - np.array(root["origin"]))))
    doc["detector"][0]["hierarchy"] = root
    moved = read_expt(_write(tmp_path, doc, "moved.expt"))
    flat = read_expt(flat_path)
    a = Simulator(config_from_args(experiment_flags_of(moved)))
    b = Simulator(config_from_args(experiment_flags_of(flat)))
    ga, gb = a.geometry(a.parameters_dict()), b.geometry(b.parameters_dict())
    for key in ("pix0", "fdet", "sdet"):
        assert torch.allclose(getattr(ga, key), getattr(gb, key), rtol=0, atol=1e-12), key
    out = refined_document(moved, a, {})
    for key in ("origin", "fast_axis", "slow_axis"):
        assert np.allclose(out["detector"][0]["panels"][0][key], panel[key], rtol=0, atol=1e-9), key


def experiment_flags_of(exp) -> list[str]:
    from nbtorch.dials.geometry import experiment_flags

    return experiment_flags(exp) + ["-N", "5", "-default_F", "1"]
