"""refine.inputs.start_model: the starting model's flags completed from the image header (and the precedence rules)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.errors import InputError
from nbtorch.io import write_cbf, write_h5, write_smv
from nbtorch.physics.detector import detector_geometry
from refine.cli.parser import parse_args
from refine.inputs.images import load_image
from refine.inputs.start_model import expand_model_args, model_config
from refine.inputs.sensor import HC_KEV_A, silicon_attenuation_length_um, silicon_mu_rho

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
    # the rest: header values said to be unused, and an SMV's file layout
    assert len([n for n in notes if "not used" not in n and "file layout" not in n]) == 5


def test_model_flags_win_over_the_header(tmp_path):
    write_cbf(tmp_path / "x.cbf", np.zeros((36, 40), dtype=np.int32),
              {"wavelength_A": 0.9, "distance_mm": 300.0, "pixel_size_mm": 0.2, "beam_x_px": 20.0, "beam_y_px": 18.0})
    obs = load_image(tmp_path / "x.cbf")
    cfg, tokens, notes = model_config(f"{CRYSTAL} -lambda 1.1 -distance 90", obs)
    assert cfg.wavelength_A == 1.1 and cfg.distance_mm == 90.0 and cfg.pixel_mm == 0.2
    assert not any("wavelength" in n or "distance" in n for n in notes)


def test_measured_images_default_mosaic_domains(tmp_path):
    """A measured image whose flags give a spread but no count: 80 domains of the even set on a still, 40 on a
    rotation image (docs/still-from-images.md, "Mosaic domains"); a count in the flags is kept, and the C's
    random draw keeps its own default."""
    from refine.inputs.start_model import ROTATION_MOSAIC_DOMAINS, STILL_MOSAIC_DOMAINS

    write_cbf(tmp_path / "x.cbf", np.zeros((36, 40), dtype=np.int32),
              {"wavelength_A": 0.9, "distance_mm": 300.0, "pixel_size_mm": 0.2, "beam_x_px": 20.0, "beam_y_px": 18.0})
    obs = load_image(tmp_path / "x.cbf")
    crystal = "-cell 40 40 40 90 90 90 -N 5 -default_F 100 -mosaic 0.3 -oversample 1"
    assert (STILL_MOSAIC_DOMAINS, ROTATION_MOSAIC_DOMAINS) == (80, 40)
    for flags, count, kind in (("", 80, "stills"), ("-osc 0.1 -phisteps 5", 40, "rotation images")):
        cfg, tokens, notes = model_config(f"{crystal} {flags}", obs)
        assert cfg.mosaic_domains == count and tokens[-2:] == ["-mosaic_dom", str(count)]
        assert Simulator(cfg, compile=False).setup.sampling.mosaic_fractions.shape == (count,)
        assert any(n.startswith(f"mosaic: {count} domains") and f"measured {kind}" in n for n in notes), notes
    cfg, _, notes = model_config(f"{crystal} -mosaic_dom 12", obs)
    assert cfg.mosaic_domains == 12 and not any(n.startswith("mosaic:") for n in notes)
    cfg, _, notes = model_config(f"{crystal} -mosaic_model random", obs)
    assert cfg.mosaic_domains is None and not any(n.startswith("mosaic:") for n in notes)


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
    from refine.inputs.scale_start import fit_scale_background

    bragg = _spots((36, 40), SPOTS)
    obs = np.random.default_rng(3).poisson(0.2 * bragg + 7.0).astype(np.float64)
    s, b = fit_scale_background(_StubSim(bragg), {}, obs, np.ones(obs.shape, bool))
    assert s == pytest.approx(0.2, rel=0.05) and b == pytest.approx(7.0, rel=0.05)


def test_fit_scale_background_refuses_a_model_whose_spots_miss():
    """#20: spots beside the observed ones made the scale collapse to 1.9e-150 and the run 'converge' at step 0."""
    from nbtorch.errors import InputError
    from refine.inputs.scale_start import fit_scale_background

    obs = np.random.default_rng(3).poisson(0.2 * _spots((36, 40), SPOTS) + 7.0).astype(np.float64)
    elsewhere = _spots((36, 40), [(cx + 5, cy + 4) for cx, cy in SPOTS])
    with pytest.raises(InputError, match="its spots miss the observed ones") as exc:
        fit_scale_background(_StubSim(elsewhere), {}, obs, np.ones(obs.shape, bool))
    assert "\n" not in str(exc.value) and "--start scale=" in str(exc.value)


def test_fit_scale_background_refuses_a_model_that_is_zero_on_the_fitted_pixels():
    from nbtorch.errors import InputError
    from refine.inputs.scale_start import fit_scale_background

    bragg = _spots((36, 40), SPOTS)
    obs = np.random.default_rng(3).poisson(0.2 * bragg + 7.0).astype(np.float64)
    fitted = bragg == 0  # e.g. a tiny --subsample that keeps none of the model's spot pixels
    assert fitted.any() and not fitted.all()
    with pytest.raises(InputError, match=r"is 0 on all \d+ fitted pixels") as exc:
        fit_scale_background(_StubSim(bragg), {}, obs, fitted)
    assert "\n" not in str(exc.value) and "--subsample" in str(exc.value)
    with pytest.raises(InputError, match="no fitted pixel has a usable count"):
        fit_scale_background(_StubSim(bragg), {}, -np.ones(obs.shape), np.ones(obs.shape, bool))


# ------------------------------------------------------------------ header values: used or said (#18, #17)

HEADER = {"wavelength_A": 1.3, "distance_mm": 80.0, "pixel_size_mm": 0.2, "beam_x_px": 21.5, "beam_y_px": 17.0}
REAL = Path(__file__).resolve().parents[3] / "shared" / "real" / "thaumatin_i24_still" / "thau_3_2_0003.cbf.bz2"


def _cbf(tmp_path, extra=None, name="x.cbf", lines=None):
    path = tmp_path / name
    write_cbf(path, np.zeros((36, 40), dtype=np.int32), {**HEADER, **(extra or {})})
    if lines:  # Pilatus lines the writer does not know, added to the text header
        data = path.read_bytes().replace(b"# Detector:", "".join(f"# {x}\r\n" for x in lines).encode() + b"# Detector:", 1)
        path.write_bytes(data)
    return load_image(path)


def _note(notes, start):
    found = [n for n in notes if n.startswith(start)]
    assert len(found) == 1, (start, notes)
    return found[0]


def test_silicon_attenuation_matches_the_nist_table():
    assert silicon_mu_rho(10.0) == pytest.approx(33.89)
    assert silicon_mu_rho(20.0) == pytest.approx(4.464)
    assert silicon_mu_rho(8.0) == pytest.approx(64.68)
    # log-log between 10 and 15 keV: 12.247 keV (the geometric mean) gets the geometric mean
    assert silicon_mu_rho((10.0 * 15.0) ** 0.5) == pytest.approx((33.89 * 10.34) ** 0.5)
    assert silicon_attenuation_length_um(HC_KEV_A / 10.0) == pytest.approx(1e4 / (33.89 * 2.33))
    assert 250 < silicon_attenuation_length_um(0.96859) < 270  # 12.8 keV (the thaumatin still)
    with pytest.raises(InputError, match="outside the silicon attenuation table"):
        silicon_attenuation_length_um(20.0)


def test_cbf_header_geometry_keys(tmp_path):
    obs = _cbf(tmp_path, {"detector_2theta_deg": 20.0, "start_angle_deg": 10.0, "angle_increment_deg": 0.1,
                          "polarization": 0.99, "sensor_thickness_mm": 0.32})
    g = obs.geometry
    assert (g["twotheta_deg"], g["phi_deg"], g["osc_deg"], g["polarization_fraction"], g["sensor_thickness_mm"]) == \
        (20.0, 10.0, 0.1, 0.99, 0.32)


def test_rotation_polarization_and_sensor_from_the_header(tmp_path):
    obs = _cbf(tmp_path, {"start_angle_deg": 10.0, "angle_increment_deg": 0.1, "polarization": 0.99,
                          "sensor_thickness_mm": 0.32})
    cfg, tokens, notes = model_config(f"-mosflm {CRYSTAL}", obs)
    assert (cfg.phi_deg, cfg.osc_deg, cfg.phisteps) == (10.0, 0.1, 5)  # a step per 0.02 deg
    assert cfg.polarization == pytest.approx(0.98)  # Kahn factor 2p - 1
    assert cfg.detector_thick_um == pytest.approx(320.0)
    assert cfg.detector_abs_um == pytest.approx(silicon_attenuation_length_um(1.3), rel=1e-6)
    assert cfg.detector_thicksteps == 3
    assert "-phisteps 5" in _note(notes, "rotation Start_angle 10 deg, Angle_increment 0.1 deg from the header")
    assert "as -polar 0.98 (Kahn factor 2p - 1" in _note(notes, "Polarization 0.99 from the header")
    assert "-detector_thick 320" in _note(notes, "sensor parallax: Silicon 320 um thick from the header")
    sim = Simulator(cfg, compile=False)
    assert sim.setup.sensor.thicksteps == 3 and sim.setup.sensor.mu_per_m == pytest.approx(1e6 / cfg.detector_abs_um)


def test_no_parallax_and_the_models_flags_win(tmp_path):
    obs = _cbf(tmp_path, {"start_angle_deg": 10.0, "angle_increment_deg": 0.1, "polarization": 0.99,
                          "sensor_thickness_mm": 0.32, "detector_2theta_deg": 15.0})
    cfg, _, notes = model_config(f"-mosflm {CRYSTAL}", obs, parallax=False)
    assert cfg.detector_thick_um == 0
    assert _note(notes, "Silicon sensor thickness 320 um from the header") == \
        "Silicon sensor thickness 320 um from the header: not used (--no-parallax)"
    model = (f"-mosflm {CRYSTAL} -phi 0 -osc 0 -nopolar -detector_thick 100 "
             "-fdet_vector 0 0 1 -sdet_vector 0 -1 0 -odet_vector 1 0 0")
    cfg, _, notes = model_config(model, obs)
    assert (cfg.phi_deg, cfg.osc_deg, cfg.twotheta_deg, cfg.detector_thick_um, cfg.nopolar) == (0, 0, 0, 100, True)
    assert cfg.detector_abs_um is None
    assert _note(notes, "Start_angle 10 deg, Angle_increment 0.1 deg from the header").endswith(
        "not used (--model gives the rotation: -phi -osc)")
    assert _note(notes, "Polarization 0.99").endswith("not used (--model gives -nopolar)")
    assert _note(notes, "Silicon sensor thickness").endswith("not used (--model gives the sensor: -detector_thick)")
    assert _note(notes, "Detector_2theta 15 deg").endswith(
        "not used (--model gives the detector's orientation: -fdet_vector -sdet_vector -odet_vector)")
    # flags a DIALS experiment made (--expt) are named as such: the user gave no --model
    _, _, notes = model_config(model, obs, given_by="--expt")
    assert _note(notes, "Start_angle 10 deg, Angle_increment 0.1 deg from the header").endswith(
        "not used (--expt gives the rotation: -phi -osc)")
    assert not any("--model gives" in n for n in notes)


def test_a_still_says_its_start_angle_is_not_used(tmp_path):
    obs = _cbf(tmp_path, {"start_angle_deg": 89.9997, "angle_increment_deg": 0.0, "detector_2theta_deg": 0.0})
    cfg, _, notes = model_config(f"-mosflm {CRYSTAL}", obs)
    assert (cfg.phi_deg, cfg.osc_deg or 0, cfg.twotheta_deg) == (0, 0, 0)
    assert "not used (a still" in _note(notes, "Start_angle 89.9997 deg, Angle_increment 0 deg from the header")
    assert _note(notes, "Detector_2theta 0 deg") == "Detector_2theta 0 deg from the header: the detector is normal to the beam"


def _swung(axes, fclose, sclose, distance, twotheta_deg):
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    z = t(0.0)
    return detector_geometry(*(t(v) for v in axes), "sample", t(distance), z, z, t(fclose), t(sclose), z, z, z,
                             t(np.radians(twotheta_deg)))


# (beam, f, s, o, two-theta axis) of docs/conventions.md
_AXES = {"-mosflm": ((0, 0, 1), (0, -1, 0), (1, 0, 0), (1, 0, 0), (0, 0, -1)),
         "-adxv": ((1, 0, 0), (0, -1, 0), (0, 0, 1), (0, 0, 1), (-1, 0, 0)),
         "-xds": ((1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 1), (1, 0, 0)),
         "-dials": ((1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 1), (0, 1, 0))}


@pytest.mark.parametrize("conv", list(_AXES))
def test_detector_two_theta_swings_about_the_sample(tmp_path, conv):
    """Whatever the convention (beam or sample pivot), the model's detector is the header's detector
    (near point = Beam_xy at the header distance) swung by Detector_2theta about the sample."""
    obs = _cbf(tmp_path, {"detector_2theta_deg": 25.0})
    cfg, tokens, notes = model_config(f"{conv} {CRYSTAL}", obs)
    assert cfg.twotheta_deg == 25.0
    sim = Simulator(cfg, compile=False)
    with torch.no_grad():
        g = sim.geometry(sim.parameters_dict())
    f, s, o, b, axis = _AXES[conv][0], _AXES[conv][1], _AXES[conv][2], _AXES[conv][3], _AXES[conv][4]
    want = _swung((f, s, o, b, axis), 21.5 * 0.2e-3, 17.0 * 0.2e-3, 0.08, 25.0)
    np.testing.assert_allclose(g.pix0.numpy(), want.pix0.numpy(), atol=1e-12)
    np.testing.assert_allclose(g.fdet.numpy(), want.fdet.numpy(), atol=1e-12)
    np.testing.assert_allclose(g.odet.numpy(), want.odet.numpy(), atol=1e-12)
    assert "as -twotheta 25" in _note(notes, "Detector_2theta 25 deg from the header")


def test_smv_two_theta_and_rotation(tmp_path):
    write_smv(tmp_path / "x.img", np.zeros((36, 40), dtype=np.uint16),
              {"PIXEL_SIZE": 0.2, "DISTANCE": 80, "WAVELENGTH": 1.3, "DENZO_X_BEAM": 3.4, "DENZO_Y_BEAM": 4.3,
               "PHI": 5.0, "OSC_START": 5.0, "OSC_RANGE": 0.05, "TWOTHETA": 0.0})
    obs = load_image(tmp_path / "x.img")
    assert (obs.geometry["phi_deg"], obs.geometry["osc_deg"], obs.geometry["twotheta_deg"]) == (5.0, 0.05, 0.0)
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert (cfg.phi_deg, cfg.osc_deg, cfg.phisteps) == (5.0, 0.05, 3)
    _note(notes, "rotation OSC_START 5 deg, OSC_RANGE 0.05 deg from the header as -phi 5 -osc 0.05 -phisteps 3")


def test_hdf5_sensor_thickness(tmp_path):
    pytest.importorskip("h5py")
    write_h5(tmp_path / "x.h5", np.zeros((36, 40), dtype=np.int32),
             geometry={"wavelength_A": 1.0, "distance_mm": 80.0, "pixel_size_mm": 0.2, "sensor_thickness_mm": 0.45})
    obs = load_image(tmp_path / "x.h5")
    assert obs.geometry["sensor_thickness_mm"] == pytest.approx(0.45)
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert cfg.detector_thick_um == pytest.approx(450.0)
    assert "silicon (assumed) 450 um" in _note(notes, "sensor parallax")


def test_header_values_the_model_does_not_take_are_said(tmp_path):
    obs = _cbf(tmp_path, {"exposure_time_s": 0.1, "sensor_thickness_mm": 0.32}, lines=[
        "Oscillation_axis X.CW", "Kappa 10.0000 deg.", "Threshold_setting: 6400 eV"])
    _, _, notes = model_config(f"-mosflm {CRYSTAL}", obs)
    assert _note(notes, "Oscillation_axis X.CW from the header") == (
        "Oscillation_axis X.CW from the header: not used (the model rotates about its spindle axis (0, 0, 1) "
        "(-spindle_axis))")
    assert "not used (goniometer setting" in _note(notes, "Kappa 10.0000 deg. from the header")
    rest = _note(notes, "Detector nbtorch synthetic")
    assert "Threshold_setting 6400 eV" in rest and "Exposure_time 0.1 s" in rest and "not used (exposure" in rest
    # a sensor other than silicon: no attenuation table, said
    path = tmp_path / "cdte.cbf"
    path.write_bytes((tmp_path / "x.cbf").read_bytes().replace(b"# Silicon sensor", b"# CdTe sensor", 1))
    cfg, _, notes = model_config(f"-mosflm {CRYSTAL}", load_image(path))
    assert cfg.detector_thick_um == 0
    assert "tabulated for silicon only, not CdTe" in _note(notes, "CdTe sensor thickness 320 um from the header")


def test_no_parallax_option():
    assert parse_args(["--image", "x.cbf", "--model=-mosflm"]).image.parallax is True
    assert parse_args(["--image", "x.cbf", "--model=-mosflm", "--no-parallax"]).image.parallax is False


def test_no_parallax_in_a_config_file(tmp_path):
    (tmp_path / "run.toml").write_text('image = "x.cbf"\nmodel = "-mosflm -N 5"\nno_parallax = true\n')
    assert parse_args(["--config", str(tmp_path / "run.toml")]).image.parallax is False


@pytest.mark.skipif(not REAL.is_file(), reason="../shared/real/thaumatin_i24_still missing")
def test_the_real_pilatus_header():
    obs = load_image(REAL)
    g = obs.geometry
    assert (g["twotheta_deg"], g["osc_deg"], g["polarization_fraction"], g["sensor_thickness_mm"]) == (0, 0, 0.99, 0.45)
    cfg, _, notes = model_config(f"-mat {REAL.parent / 'A_thau_3_2_0003.mat'}", obs)
    assert (cfg.phi_deg, cfg.osc_deg or 0, cfg.detector_thick_um, cfg.detector_thicksteps) == (0, 0, 450, 3)
    assert cfg.polarization == pytest.approx(0.98)
    assert "not used (a still" in _note(notes, "Start_angle 89.9997 deg, Angle_increment 0 deg")
    for key in ("Oscillation_axis ", "Omega ", "Kappa ", "Chi ", "Phi ", "Detector_Voffset "):
        assert "not used" in _note(notes, key)
    assert "Flux 1.396021" in _note(notes, "Detector PILATUS3 6M")
