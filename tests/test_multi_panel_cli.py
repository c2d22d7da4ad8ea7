"""``nbtorch-refine --expt`` with a multi-panel DIALS detector, end to end on one image (tests/multi_panel_cli_data.py:
8 panels of 24 x 20 pixels under a two-level hierarchy, the two column groups moved by 0.5 px in the image)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from multi_panel_cli_data import MODEL, PIXEL_MM, W, H, document, write_case
from nbtorch.dials.panels import panels_simulator, refined_panels_document
from nbtorch.io.cbf import write_cbf
from nbtorch.io.dials import panel_lab_frames, read_expt

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refine.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    return write_case(tmp_path_factory.mktemp("multi_panel_cli"))


def _spot_errors_px(truth_detector: dict, refined_detector: dict, spots: np.ndarray) -> np.ndarray:
    """Each spot's ray (from the sample through the spot on the true panels) met with the refined panels: the
    distance (px) between where it lands and where it was."""
    true, refined = panel_lab_frames(truth_detector), panel_lab_frames(refined_detector)
    out = []
    for x, y in spots[:, :2]:
        i = int(y // H)
        (f, s, o), (f2, s2, o2) = true[i], refined[i]
        ray = o + x * PIXEL_MM * f + (y - i * H) * PIXEL_MM * s
        # o2 + a px f2 + b px s2 = t ray
        a, b, _ = np.linalg.solve(np.c_[PIXEL_MM * f2, PIXEL_MM * s2, -ray], -o2)
        out.append(np.hypot(a - x, b - (y - i * H)))
    return np.asarray(out)


def test_multi_panel_cli_refines_panel_groups(case: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _cli("--expt", str(case["expt"]), "--image", str(case["image"]), "--refl", str(case["refl"]),
               "--model", MODEL, "--refine", "panels", "--panel-groups", "1", "--spot-window", "3",
               "--out", str(out / "result.h5"), "--expt-out", str(out / "refined.expt"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    assert "2 rigid panel groups (--panel-groups 1): 0 col0, 1 col1" in run.stdout
    assert "beam_x_g0" in run.stdout and "beam_y_p7" in run.stdout  # the printed table's names
    result = json.loads((out / "result.json").read_text())
    assert set(result["free"]) == {f"{n}_g{k}" for k in (0, 1) for n in ("distance", "beam_x", "beam_y")}
    assert result["units"]["beam_x_g0"] == "mm" and result["units"]["distance_p3"] == "mm"
    exp = read_expt(case["expt"], multi_panel=True)
    sim = panels_simulator(exp, extra_flags=MODEL.split())
    truth = refined_panels_document(exp, sim, case["truth"])["detector"][0]
    refined = read_expt(out / "refined.expt", multi_panel=True)
    start = _spot_errors_px(truth, exp.detector, case["spots"])
    final = _spot_errors_px(truth, refined.detector, case["spots"])
    assert start.max() > 0.45  # the start misses by the groups' moves
    assert final.max() < 0.1, final.max()
    assert refined.detector["hierarchy"] == exp.detector["hierarchy"]  # panels written local to the same groups
    for i in range(8):
        assert result["params"][f"beam_x_p{i}"] == pytest.approx(case["truth"][f"beam_x_p{i}"], abs=0.1 * PIXEL_MM)
        assert result["params"][f"beam_y_p{i}"] == pytest.approx(case["truth"][f"beam_y_p{i}"], abs=0.1 * PIXEL_MM)


@pytest.mark.parametrize("what", ["narrow image", "taller panel"])
def test_multi_panel_cli_refuses_mismatched_panels(case: dict, tmp_path: Path, what: str) -> None:
    expt, image = case["expt"], case["image"]
    if what == "narrow image":
        image = tmp_path / "narrow.cbf"
        write_cbf(image, case["photons"][:, :W - 1].astype(np.int32))
        expected = "detector panel 0 (col0_row0) is 24 x 20 pixels (fast x slow) but --image"
    else:
        doc = document()
        doc["detector"][0]["panels"][5]["image_size"] = [W, H + 1]
        expt = tmp_path / "taller.expt"
        expt.write_text(json.dumps(doc))
        expected = "detector panel 5 (col1_row1) is 24 x 21 pixels (fast x slow) but --image"
    run = _cli("--expt", str(expt), "--image", str(image), "--refl", str(case["refl"]), "--model", MODEL,
               "--refine", "panels", "--out", str(tmp_path / "out" / "result.h5"), cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], run.stderr
    assert not (tmp_path / "out").exists()


def test_multi_panel_cli_option_errors(case: dict, tmp_path: Path) -> None:
    base = ["--expt", str(case["expt"]), "--image", str(case["image"]), "--model", MODEL,
            "--out", str(tmp_path / "out" / "result.h5")]
    run = _cli(*base, "--refine", "panels", "--panel-groups", "3", cwd=tmp_path)
    assert run.returncode == 2 and "--panel-groups 3: the detector's hierarchy has levels 0..2" in run.stderr
    run = _cli(*base, "--refine", "panels", "--roi", "0", "10", "0", "10", cwd=tmp_path)
    assert run.returncode == 2 and "--roi: not with a multi-panel --expt" in run.stderr
    assert not (tmp_path / "out").exists()


def test_multi_panel_cli_cuts_a_pilatus_image_into_its_modules(tmp_path: Path) -> None:
    """A whole Pilatus image of 2 modules (487 x 195 pixels, a 17-row gap) stacked for a 2-panel detector of
    module-sized panels; the wrong module size is refused naming the panel."""
    from nbtorch.errors import InputError
    from nbtorch.geometry.panels import resolve_panels
    from nbtorch import config_from_args
    from refine.inputs.measurement import DialsFiles
    from refine.inputs.panels import stacked_image

    doc = document()
    doc["detector"][0]["panels"] = doc["detector"][0]["panels"][:2]
    for p in doc["detector"][0]["panels"]:
        p["image_size"] = [487, 195]
    doc["detector"][0]["hierarchy"]["children"] = [{"name": "col0", "type": "", "fast_axis": [1.0, 0.0, 0.0],
                                                    "slow_axis": [0.0, 1.0, 0.0], "origin": [0.0, 0.0, 0.0],
                                                    "children": [{"panel": 0}, {"panel": 1}]}]
    expt = tmp_path / "modules.expt"
    expt.write_text(json.dumps(doc))
    args = DialsFiles(expt=str(expt), image="whole.cbf")
    layout = resolve_panels([config_from_args("-cell 30 30 30 90 90 90 -detpixels_f 487 -detpixels_s 195".split())] * 2)[1]
    whole = np.arange(407 * 487, dtype=float).reshape(407, 487)
    image, mask = stacked_image(args, layout, whole, np.ones(whole.shape, dtype=bool))
    assert image.shape == (390, 487) and mask.all()
    assert np.array_equal(image[:195], whole[:195]) and np.array_equal(image[195:], whole[212:])
    doc["detector"][0]["panels"][1]["image_size"] = [487, 194]
    expt.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"detector panel 1 \(col0_row1\) is 487 x 194 pixels .* panel 1 is 487 x 195"):
        stacked_image(args, layout, whole, np.ones(whole.shape, dtype=bool))


def test_multi_panel_group_changes_in_the_parameter_space() -> None:
    """``<name>_g<k>`` in refine's parameter space: the detector names and ``panels`` expand to every group's
    changes, each panel's value is its start plus its group's change (no double count when a later stage starts
    from a state), and the gradient of a rendered multi-panel image in a change matches finite differences."""
    import torch

    from nbtorch import Simulator, config_from_args
    from nbtorch.errors import InputError
    from refine.fitting.parameters import ParameterMap, ParameterSpace
    from refine.solver.plan import panel_space

    shared = "-cell 30 32 34 90 90 90 -misset 10 20 30 -N 5 -lambda 1.0 -default_F 100 -oversample 1".split()
    panels = ["-detpixels_f 16 -detpixels_s 12 -pixel 0.2 -distance 50 -Xbeam 1 -Ybeam 1.2",
              "-detpixels_f 16 -detpixels_s 12 -pixel 0.2 -distance 50 -Xbeam 4.2 -Ybeam 1.2",
              "-detpixels_f 16 -detpixels_s 12 -pixel 0.2 -distance 50 -Xbeam 1 -Ybeam 3.6"]
    sim = Simulator.from_panels([config_from_args(shared + p.split()) for p in panels], dtype=torch.float64)
    base = panel_space(sim, [(0, 1), (2,)])
    space = ParameterSpace(panel_groups=base.panel_groups, n_panels=3, pixel_mm=0.2)
    assert space.expand(["panels"]) == ("distance_g0", "beam_x_g0", "beam_y_g0", "distance_g1", "beam_x_g1",
                                        "beam_y_g1")
    assert space.expand(["beam_centre"]) == ("beam_x_g0", "beam_y_g0", "beam_x_g1", "beam_y_g1")
    with pytest.raises(InputError, match="panels: the panel-group changes of a multi-panel detector"):
        ParameterSpace().expand(["panels"])
    with pytest.raises(InputError, match="every panel 0..2 must be in exactly one group"):
        panel_space(sim, [(0, 1)])
    values = {n: float(v) for n, v in sim.setup.params.items()}
    values.update({"orient_x": 0.0, "orient_y": 0.0, "orient_z": 0.0, "scale": 1.0, "background": 1.0,
                   "background_x": 0.0, "background_y": 0.0, **sim.panel_layout.values()})
    values.update({n: 0.0 for n in space.group_changes})
    pmap = ParameterMap(space, values, ("beam_x_g0", "distance_g1"))
    state = pmap.values_at(torch.tensor([1.0, 0.5], dtype=torch.float64))  # one pixel, half a pixel of distance
    assert state["beam_x_p0"] == pytest.approx(values["beam_x_p0"] + 0.2)
    assert state["beam_x_p1"] == pytest.approx(values["beam_x_p1"] + 0.2)
    assert state["distance_p2"] == pytest.approx(50.1) and state["beam_x_p2"] == values["beam_x_p2"]
    later = ParameterMap(space, state, ("beam_x_g0",)).values_at(torch.tensor([0.0], dtype=torch.float64))
    assert later["beam_x_p0"] == pytest.approx(state["beam_x_p0"])  # the change is counted once

    def total(raw: torch.Tensor) -> torch.Tensor:
        full = pmap.expand(pmap.physical(raw))
        image, _ = sim.render(**{n: full[n] for n in sim.panel_layout.names()})
        return (image * image).sum()

    raw = torch.tensor([0.3, 0.2], dtype=torch.float64, requires_grad=True)
    value = total(raw)
    assert float(value.detach()) > 0
    (grad,) = torch.autograd.grad(value, raw)
    for j in range(2):
        step = torch.zeros(2, dtype=torch.float64)
        step[j] = 1e-4
        with torch.no_grad():
            fd = (total(raw + step) - total(raw - step)) / 2e-4
        assert float(grad[j]) == pytest.approx(float(fd), rel=1e-4, abs=1e-9 * abs(float(value.detach())))
        assert abs(float(grad[j])) > 0
