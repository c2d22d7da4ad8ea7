"""What the model misses (:mod:`refine.quality.misfit`): sigZ, the stacked spot profile in each spot's radial /
tangential frame, the background between spots by resolution, and the direct beam from the simulator."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from refine.quality.misfit import (
    background_by_resolution, direct_beam_px, poisson_z_spread, stacked_profile,
)


def test_sigz_is_one_for_poisson_noise_on_the_model_itself():
    rng = np.random.default_rng(3)
    model = rng.uniform(0.5, 200.0, size=(300, 300))
    observed = rng.poisson(model).astype(float)
    fitted = rng.random(model.shape) < 0.8
    observed[~fitted] = 1e6  # pixels not fitted never count
    z = poisson_z_spread(observed, model, fitted)
    assert z.pixels == int(fitted.sum())
    assert abs(z.sigZ - 1.0) < 0.02 and abs(z.mean_z) < 0.02
    assert z.fraction_above < 1e-3
    # a model twice too bright: z is no longer shot noise
    wrong = poisson_z_spread(observed, 2.0 * model, fitted)
    assert wrong.mean_z < -3.0 and wrong.sigZ > 1.5
    assert abs(z.sigZ_robust - 1.0) < 0.05
    assert set(z.to_dict()) == {"sigZ", "sigZ_robust", "mean_z", "fraction_z_above_5", "z_pixels"}


def _spots_around(beam, n=48):
    """Spots on three rings about ``beam``, at sub-pixel positions, all azimuths."""
    k = np.arange(n)
    radius = 60.0 + 50.0 * (k % 3)
    angle = 2 * math.pi * k / n + 0.1 * (k % 3)
    return np.stack([beam[0] + radius * np.cos(angle) + 0.13, beam[1] + radius * np.sin(angle) - 0.21], axis=1)


def _render(shape, spots, beam, sigma_radial, sigma_tangential, photons, background):
    """Background + elliptical Gaussian spots, their axes along each spot's radial / tangential direction."""
    yy, xx = np.indices(shape, dtype=float) + 0.5
    image = np.full(shape, float(background))
    for x, y in spots:
        er = np.array([x - beam[0], y - beam[1]])
        er /= np.linalg.norm(er)
        du, dv = (xx - x) * er[0] + (yy - y) * er[1], -(xx - x) * er[1] + (yy - y) * er[0]
        image += photons / (2 * math.pi * sigma_radial * sigma_tangential) * np.exp(
            -0.5 * ((du / sigma_radial) ** 2 + (dv / sigma_tangential) ** 2))
    return image


def test_profile_says_a_model_too_broad_radially_is_broader_there():
    shape, beam = (400, 400), (200.3, 199.7)
    spots = _spots_around(beam)
    rng = np.random.default_rng(5)
    observed = rng.poisson(_render(shape, spots, beam, 1.0, 1.0, 2000.0, 10.0)).astype(float)
    model = _render(shape, spots, beam, 2.0, 1.0, 2000.0, 10.0)  # too broad along the radial direction only
    valid = np.ones(shape, dtype=bool)
    er = (spots - beam) / np.linalg.norm(spots - beam, axis=1)[:, None]
    p = stacked_profile(observed, model, valid, spots, beam, half_px=5, offsets_xy=0.5 * er)
    assert p.spots == len(spots) and p.observed.shape == (11, 11)
    o, m = p.shape_numbers(p.observed), p.shape_numbers(p.model)
    assert m["rms_radial_px"] > o["rms_radial_px"] + 0.5  # the frame is each spot's own: radial stays radial
    assert abs(m["rms_tangential_px"] - o["rms_tangential_px"]) < 0.15
    assert abs(o["rms_radial_px"] - o["rms_tangential_px"]) < 0.15
    assert m["rms_radius_px"] > o["rms_radius_px"]
    assert o["peak_per_spot"] > 1.5 * m["peak_per_spot"]
    assert o["background_per_spot"] == pytest.approx(10.0, rel=0.05)
    assert abs(o["integrated_per_spot"] - 2000.0) < 150.0
    assert p.tail_excess > 0.0
    doc = p.to_dict()
    assert doc["offset_rms_px"]["radial"] == pytest.approx(0.5) and doc["offset_rms_px"]["tangential"] < 1e-12
    assert np.allclose(doc["stack_difference"], p.observed - p.model)
    # a spot whose grid touches an unusable pixel is left out
    valid[int(spots[0, 1]) + 3, int(spots[0, 0])] = False
    assert stacked_profile(observed, model, valid, spots, beam).spots == len(spots) - 1


def test_profile_about_the_models_own_centroids_separates_shape_from_position():
    """Model spots of the observed shape but 1.3 px beside them (random directions): stacked on the observed
    centroids the model looks wider and lower; about its own centroids it has the observed shape."""
    shape, beam = (400, 400), (200.3, 199.7)
    spots = _spots_around(beam)
    rng = np.random.default_rng(11)
    angle = rng.uniform(0.0, 2 * math.pi, len(spots))
    offsets = 1.3 * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    observed = _render(shape, spots, beam, 1.0, 1.4, 2000.0, 10.0)
    model = _render(shape, spots + offsets, beam, 1.0, 1.4, 2000.0, 10.0)
    p = stacked_profile(observed, model, np.ones(shape, dtype=bool), spots, beam, half_px=5, offsets_xy=offsets)
    doc = p.to_dict()
    o, m, own = doc["observed"], doc["model"], doc["model_own"]
    assert doc["own_spots"] == p.spots == len(spots)
    assert m["rms_radius_px"] > o["rms_radius_px"] + 0.3 and o["peak_per_spot"] > 1.3 * m["peak_per_spot"]
    assert own["rms_radius_px"] == pytest.approx(o["rms_radius_px"], abs=0.05)
    assert own["peak_per_spot"] == pytest.approx(o["peak_per_spot"], rel=0.05)
    assert own["rms_tangential_px"] > own["rms_radial_px"] + 0.2  # its frame is each spot's own
    # without offsets there is no own stack; unknown offsets (no model spot) are left out of it
    assert "model_own" not in stacked_profile(observed, model, np.ones(shape, dtype=bool), spots, beam).to_dict()
    offsets[0] = np.nan
    q = stacked_profile(observed, model, np.ones(shape, dtype=bool), spots, beam, offsets_xy=offsets)
    assert q.own_spots == len(spots) - 1 and q.spots == len(spots)


def test_background_by_resolution_recovers_a_radial_background():
    shape, beam = (500, 500), (250.0, 250.0)
    yy, xx = np.indices(shape, dtype=float) + 0.5
    two_theta = np.arctan(np.hypot(xx - beam[0], yy - beam[1]) * 0.1 / 100.0)  # 0.1 mm pixels at 100 mm
    with np.errstate(divide="ignore"):
        d_A = 1.0 / (2.0 * np.sin(two_theta / 2.0))  # 1 A
    inv_d2 = 1.0 / d_A ** 2
    truth = 5.0 + 200.0 * inv_d2
    rng = np.random.default_rng(7)
    observed_spots = rng.uniform(20, 480, size=(150, 2))
    model_spots = rng.uniform(20, 480, size=(150, 2))  # spots of the model where nothing was observed
    observed = rng.poisson(_render(shape, observed_spots, beam, 1.0, 1.0, 3000.0, 0.0) + truth).astype(float)
    bragg = _render(shape, model_spots, beam, 1.0, 1.0, 3000.0, 0.0)
    model = 1.5 * truth + bragg
    fitted = rng.random(shape) < 0.5
    table = background_by_resolution(observed, model, bragg, fitted, d_A, observed_spots, exclude_px=5, bins=6)
    assert len(table.pixels) == 6 and table.pixels.sum() > 0.3 * fitted.sum()
    assert np.all(np.diff(table.d_max_A) < 0) and np.all(table.d_min_A <= table.d_max_A)
    expected = [truth[fitted & (d_A <= hi) & (d_A >= lo)].mean() for hi, lo in zip(table.d_max_A, table.d_min_A)]
    assert np.allclose(table.observed, expected, rtol=0.02)
    assert np.allclose(table.model, 1.5 * table.observed, rtol=0.03)
    doc = table.to_dict()
    assert len(doc["bins"]) == 6 and doc["pixels"] == int(table.pixels.sum())


def test_direct_beam_is_where_the_resolution_is_lowest():
    from nbtorch import Simulator, config_from_args
    from refine.inputs.selection import resolution_map

    sim = Simulator(config_from_args("-cell 30 30 40 90 90 90 -N 5 -default_F 100 -lambda 1.0 -distance 40 "
                                     "-pixel 0.1 -detpixels 64 -Xbeam 2.0 -Ybeam 3.0".split()), compile=False)
    for values in (None, {"beam_x": float(sim.beam_x) + 1.2, "beam_y": float(sim.beam_y) - 0.7, "scale": 3.0}):
        x, y = direct_beam_px(sim, values)
        d = resolution_map(sim, values=values)
        j, i = np.unravel_index(np.argmax(d), d.shape)
        assert (int(math.floor(x)), int(math.floor(y))) == (i, j)
    # the beam moved by (1.2, -0.7) mm: 12 and 7 pixels, whatever the convention's axes
    x0, y0 = direct_beam_px(sim)
    x1, y1 = direct_beam_px(sim, {"beam_x": float(sim.beam_x) + 1.2, "beam_y": float(sim.beam_y) - 0.7})
    assert sorted([abs(x1 - x0), abs(y1 - y0)]) == pytest.approx([7.0, 12.0])


def test_tensorboard_logs_the_diagnostics_at_the_end():
    from refine.output.callbacks import TensorBoardCallback

    class Writer:
        def __init__(self):
            self.scalars, self.images = {}, {}

        def add_scalar(self, tag, value, step):
            self.scalars[tag] = (value, step)

        def add_image(self, tag, image, step, dataformats):
            self.images[tag] = tuple(image.shape)

        def add_hparams(self, hp, metrics, run_name):
            pass

        def flush(self):
            pass

    stack = np.ones((11, 11)).tolist()
    profile = {"spots": 4, "half_px": 5, "observed": {"peak_per_spot": 341.0, "rms_radius_px": 1.7},
               "model": {"peak_per_spot": 167.0, "rms_radius_px": None}, "excess_3to5_px": 0.4,
               "model_own": {"peak_per_spot": 330.0, "rms_radius_px": 1.75}, "own_spots": 4,
               "stack_observed": stack, "stack_model": stack, "stack_model_own": stack}
    result = SimpleNamespace(loss_final=1.0, steps=12, status=SimpleNamespace(value="converged"),
                             diagnostics={"sigZ": 3.1, "fraction_z_above_5": 0.01, "profile": profile,
                                          "background_by_resolution": {"observed_mean": 7.6, "model_mean": 12.2}})
    writer = Writer()
    TensorBoardCallback(writer=writer).on_run_end(result)
    assert writer.scalars["diagnostics/sigZ"] == (3.1, 12)
    assert writer.scalars["diagnostics/profile/model/peak_per_spot"] == (167.0, 12)
    assert writer.scalars["diagnostics/background/model_mean"] == (12.2, 12)
    assert writer.scalars["diagnostics/profile/model_own/rms_radius_px"] == (1.75, 12)
    assert "diagnostics/profile/model/rms_radius_px" not in writer.scalars  # null numbers are left out
    assert writer.images == {"diagnostics/spot_profile": (88, 280)}  # 11 x (3 x 11 + 2), 8 x 8 each


def test_printed_lines_put_sigz_beside_the_fit_excess():
    from refine.output.report import misfit_lines

    numbers = {"peak_per_spot": 341.0, "rms_radius_px": 1.71, "rms_radial_px": 1.2, "rms_tangential_px": 1.3}
    diag = {"sigZ": 3.1, "sigZ_robust": 1.3, "fraction_z_above_5": 0.012, "z_pixels": 100,
            "profile": {"spots": 483, "observed": numbers,
                        "model": {**numbers, "peak_per_spot": 167.0, "rms_radius_px": 1.99, "rms_radial_px": None},
                        "excess_3to5_px": 0.4},
            "background_by_resolution": {"exclude_px": 5, "pixels": 10, "observed_mean": 7.6, "model_mean": 12.2,
                                         "sigZ": 1.1, "bins": [{"d_max_A": None, "d_min_A": 4.4, "pixels": 10,
                                                                "observed_mean": 7.6, "model_mean": 12.2}]}}
    first, second = misfit_lines({"excess": 50.0}, diag)
    assert first.startswith("misfit: sigZ 3.1 (robust 1.3; fit excess 50x; 1.2% of 100 pixels |z| > 5); spot profile "
                            "(483 spots): observed peak 341, model 167 photons per spot, rms radius 1.71 vs 1.99 px "
                            "(radial -, tangential 1.3 vs 1.3), model +40% at 3-5 px")
    assert second.endswith("observed/model photons per pixel: 7.6/12.2; by resolution inf-4.4 A 7.6/12.2")
    diag["profile"].update(own_spots=480, model_own={**numbers, "peak_per_spot": 330.0, "rms_radius_px": 1.75})
    assert misfit_lines({"excess": 50.0}, diag)[0].endswith(
        "model +40% at 3-5 px; model about its own centroids (480 spots): peak 330, rms radius 1.75 px (radial 1.2, "
        "tangential 1.3)")
    assert misfit_lines({}, {"sigZ": 2.0, "fraction_z_above_5": 0.0, "z_pixels": 5}) == [
        "misfit: sigZ 2 (0% of 5 pixels |z| > 5)"]
    assert misfit_lines({}, {}) == []
