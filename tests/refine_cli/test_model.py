"""refine.model: the starting model's flags completed from the image header (and the precedence rules)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.io import write_cbf, write_h5, write_smv
from refine.data import load_image
from refine.model import expand_model_args, model_config

from cli_helpers import CRYSTAL

GEOMETRY = "-lambda 1.3 -distance 80 -pixel 0.2 -detpixels_f 40 -detpixels_s 36"


def _beam(sim: Simulator) -> tuple[float, float, float, float]:
    with torch.no_grad():
        g = sim.geometry(sim.parameters_dict())
        return float(g.Fbeam) * 1000, float(g.Sbeam) * 1000, float(g.distance) * 1000, float(sim.setup.params["wavelength"])


@pytest.mark.parametrize("conv", ["-mosflm", "-denzo", "-adxv", "-xds", "-dials",
                                  "-fdet_vector 1 0 0 -sdet_vector 0 -1 0 -odet_vector 0 0 1 -beam_vector 0 0 1 -polar_vector 1 0 0"])
@pytest.mark.parametrize("fmt", ["cbf", "h5", "smv"])
def test_header_geometry_round_trip(tmp_path, conv, fmt):
    """An image written with a known geometry, refined with a model that leaves the geometry out,
    gets the same direct-beam position, distance and wavelength."""
    beam = "-ORGX 17.3 -ORGY 21.6" if conv in ("-xds", "-dials") else "-Xbeam 3.1 -Ybeam 4.3"
    truth = Simulator(config_from_args(f"{conv} {CRYSTAL} {GEOMETRY} {beam}".split()), compile=False)
    fb, sb, dist, lam = _beam(truth)
    img = np.zeros((36, 40), dtype=np.int32)
    p = 0.2
    if fmt == "cbf":
        write_cbf(tmp_path / "x.cbf", img, {"wavelength_A": lam, "distance_mm": dist, "pixel_size_mm": p,
                                            "beam_x_px": fb / p, "beam_y_px": sb / p})
        path = tmp_path / "x.cbf"
    elif fmt == "h5":
        write_h5(tmp_path / "x.h5", img, geometry={"wavelength_A": lam, "distance_mm": dist, "pixel_size_mm": p,
                                                   "beam_center_x_mm": fb, "beam_center_y_mm": sb})
        path = tmp_path / "x.h5"
    else:
        write_smv(tmp_path / "x.img", img.astype(np.uint16), {"PIXEL_SIZE": p, "DISTANCE": dist, "WAVELENGTH": lam,
                                                              "DENZO_X_BEAM": sb, "DENZO_Y_BEAM": fb})
        path = tmp_path / "x.img"
    obs = load_image(path)
    cfg, tokens, notes = model_config(f"{conv} {CRYSTAL}", obs)
    sim = Simulator(cfg, compile=False)
    assert sim.shape == (36, 40)
    assert sim.setup.pixel_m == pytest.approx(0.2e-3)
    np.testing.assert_allclose(_beam(sim), (fb, sb, dist, lam), rtol=1e-9, atol=1e-9)
    assert len([n for n in notes if "not used" not in n]) == 5  # the rest: header values said to be unused


def test_model_flags_win_over_the_header(tmp_path):
    write_cbf(tmp_path / "x.cbf", np.zeros((36, 40), dtype=np.int32),
              {"wavelength_A": 0.9, "distance_mm": 300.0, "pixel_size_mm": 0.2, "beam_x_px": 20.0, "beam_y_px": 18.0})
    obs = load_image(tmp_path / "x.cbf")
    cfg, tokens, notes = model_config(f"{CRYSTAL} -lambda 1.1 -distance 90", obs)
    assert cfg.wavelength_A == 1.1 and cfg.distance_mm == 90.0 and cfg.pixel_mm == 0.2
    assert not any("wavelength" in n or "distance" in n for n in notes)


def test_roi_replaces_the_models(tmp_path):
    cfg, tokens, _ = model_config(f"{CRYSTAL} {GEOMETRY} -roi 0 5 0 5", None, roi=(2, 30, 3, 20))
    assert Simulator(cfg, compile=False).setup.roi == (2, 30, 3, 20)


def test_args_file_paths_resolved_beside_it(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "A.mat").write_text("0.01 0 0\n0 0.01 0\n0 0 0.01\n")
    (tmp_path / "sub" / "geo.txt").write_text("-mat A.mat -lambda 1.0  # comment\n-distance 50\n")
    monkeypatch.chdir(tmp_path)
    tokens = expand_model_args("@sub/geo.txt -N 3")
    assert tokens == ["-mat", str((tmp_path / "sub" / "A.mat").resolve()), "-lambda", "1.0", "-distance", "50",
                      "-N", "3"]


class _StubSim:
    """Just what fit_scale_background needs: the ROI and a render of a fixed Bragg image."""

    def __init__(self, image: np.ndarray) -> None:
        from types import SimpleNamespace

        self.image = torch.as_tensor(image, dtype=torch.float64)
        self.setup = SimpleNamespace(roi=(0, image.shape[1] - 1, 0, image.shape[0] - 1))

    def render(self, **overrides):
        return self.image, None


def _spots(shape, centres, height=500.0):
    y, x = np.mgrid[:shape[0], :shape[1]]
    r2 = [(x - cx) ** 2 + (y - cy) ** 2 for cx, cy in centres]
    return sum(np.where(r < 9, height * np.exp(-r / 2.0), 0.0) for r in r2)  # compact: 0 beyond 3 px


SPOTS = [(8, 8), (20, 10), (30, 25), (12, 28)]


def test_fit_scale_background_recovers_a_matching_start():
    from refine.model import fit_scale_background

    bragg = _spots((36, 40), SPOTS)
    obs = np.random.default_rng(3).poisson(0.2 * bragg + 7.0).astype(np.float64)
    s, b = fit_scale_background(_StubSim(bragg), {}, obs, np.ones(obs.shape, bool))
    assert s == pytest.approx(0.2, rel=0.05) and b == pytest.approx(7.0, rel=0.05)


def test_fit_scale_background_refuses_a_model_whose_spots_miss():
    """#20: spots beside the observed ones made the scale collapse to 1.9e-150 and the run 'converge' at step 0."""
    from nbtorch.errors import InputError
    from refine.model import fit_scale_background

    obs = np.random.default_rng(3).poisson(0.2 * _spots((36, 40), SPOTS) + 7.0).astype(np.float64)
    elsewhere = _spots((36, 40), [(cx + 5, cy + 4) for cx, cy in SPOTS])
    with pytest.raises(InputError, match="its spots miss the observed ones") as exc:
        fit_scale_background(_StubSim(elsewhere), {}, obs, np.ones(obs.shape, bool))
    assert "\n" not in str(exc.value) and "--start scale=" in str(exc.value)


def test_fit_scale_background_refuses_a_model_that_is_zero_on_the_fitted_pixels():
    from nbtorch.errors import InputError
    from refine.model import fit_scale_background

    bragg = _spots((36, 40), SPOTS)
    obs = np.random.default_rng(3).poisson(0.2 * bragg + 7.0).astype(np.float64)
    fitted = bragg == 0  # e.g. a tiny --subsample that keeps none of the model's spot pixels
    assert fitted.any() and not fitted.all()
    with pytest.raises(InputError, match=r"is 0 on all \d+ fitted pixels") as exc:
        fit_scale_background(_StubSim(bragg), {}, obs, fitted)
    assert "\n" not in str(exc.value) and "--subsample" in str(exc.value)
    with pytest.raises(InputError, match="no fitted pixel has a usable count"):
        fit_scale_background(_StubSim(bragg), {}, -np.ones(obs.shape), np.ones(obs.shape, bool))
