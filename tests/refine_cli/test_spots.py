"""refine.spots (spot finding, model centroids, offsets) and refine.selection (pixel masks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from refine.selection import resolution_map, resolution_mask, subsample_mask
from refine.spots import find_spots, model_centroids, read_spot_list, spot_offsets, window_mask

MODEL = ("-cell 30 30 40 90 90 90 -misset 10 20 30 -N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1 "
         "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48 -Xbeam 2.45 -Ybeam 2.45")


def _gauss_spots(shape, centres, sigma=0.8, height=200.0, background=2.0):
    yy, xx = np.indices(shape) + 0.5  # pixel centres at i + 0.5
    img = np.full(shape, background)
    for x, y in centres:
        img += height * np.exp(-((xx - x) ** 2 + (yy - y) ** 2) / (2 * sigma**2))
    return img


def test_find_spots_recovers_centroids():
    centres = [(10.3, 12.7), (30.5, 8.2), (40.1, 40.9), (5.6, 35.4)]
    img = np.random.default_rng(3).poisson(_gauss_spots((48, 50), centres)).astype(float)
    found = find_spots(img)
    assert len(found) == len(centres)
    for c in centres:
        d = np.hypot(*(found - np.array(c)).T).min()
        assert d < 0.15


def test_find_spots_respects_mask_and_roi():
    img = _gauss_spots((48, 50), [(10.3, 12.7), (30.5, 8.2)])
    mask = np.ones(img.shape, dtype=bool)
    mask[5:20, 5:15] = False
    assert len(find_spots(img, mask)) == 1
    assert len(find_spots(img, roi=(20, 49, 0, 47))) == 1


def test_model_centroids_follow_a_shift():
    model = _gauss_spots((40, 40), [(10.5, 10.5), (30.2, 25.7)], background=0.0)
    observed = np.array([[11.5, 10.0], [29.2, 26.7], [20.0, 35.0]])  # the third has no model spot
    pred = model_centroids(model, observed, search=4, box=2, min_peak=1.0)
    np.testing.assert_allclose(pred[0], (10.5, 10.5), atol=0.05)
    np.testing.assert_allclose(pred[1], (30.2, 25.7), atol=0.05)
    assert np.isnan(pred[2]).all()


def test_spot_offsets_zero_for_the_true_model_and_follow_the_beam():
    sim = Simulator(config_from_args(MODEL.split()), compile=False)
    values = {k: float(v) for k, v in sim.setup.params.items()}
    with torch.no_grad():
        img = sim().numpy()
    spots = find_spots(img * 100 + 1.0)
    spots = spots[np.hypot(spots[:, 0] - 24.5, spots[:, 1] - 24.5) > 3]  # not the direct beam
    assert len(spots) >= 8
    same = spot_offsets(sim, values, spots)
    assert same.matched.sum() >= 0.8 * len(spots)
    # the model centroid is a 5 x 5 box around the peak, the found one the whole blob: they agree for
    # compact spots (most), less for streaks and spots cut by the detector edge
    dist = np.hypot(*same.offsets[same.matched].T)
    assert np.median(dist) < 0.1 and same.rms() < 0.6
    # MOSFLM: beam_y moves the pattern along fast (x); +0.1 mm = +1 pixel
    moved = spot_offsets(sim, {**values, "beam_y": values["beam_y"] + 0.1}, spots)
    dx, dy = moved.mean(moved.matched & same.matched)
    assert dx == pytest.approx(1.0 + same.mean()[0], abs=0.2) and abs(dy - same.mean()[1]) < 0.2


def test_read_spot_list(tmp_path):
    (tmp_path / "s.txt").write_text("# x y counts\n 1.5 2.5 100 . .\n\n3 4 # comment\n")
    np.testing.assert_array_equal(read_spot_list(tmp_path / "s.txt"), [[1.5, 2.5], [3.0, 4.0]])
    (tmp_path / "bad.txt").write_text("1.5 x\n")
    with pytest.raises(ValueError, match="line 1"):
        read_spot_list(tmp_path / "bad.txt")


def test_window_mask():
    m = window_mask((10, 12), np.array([[0.2, 0.7], [11.9, 9.9]]), 1)
    assert m.sum() == 4 + 4 and m[0, 0] and m[1, 1] and m[9, 11] and m[8, 10]


def test_resolution_map_matches_bragg():
    sim = Simulator(config_from_args(MODEL.split()), compile=False)
    d = resolution_map(sim)
    # pixel (slow 24, fast 44): 20 pixels = 2 mm from the beam centre along fast (beam at pixel 24.5 + 0.5 - 0.5)
    with torch.no_grad():
        g = sim.geometry(sim.parameters_dict())
    fb, sb = float(g.Fbeam) * 1e3, float(g.Sbeam) * 1e3
    x, y = (44 + 0.5) * 0.1 - fb, (24 + 0.5) * 0.1 - sb
    two_theta = math.atan2(math.hypot(x, y), 40.0)
    assert d[24, 44] == pytest.approx(1.0 / (2 * math.sin(two_theta / 2)), rel=1e-9)
    keep = resolution_mask(sim, dmin=15.0, dmax=30.0)
    assert keep.any() and (~keep).any()
    assert (d[keep] >= 15.0).all() and (d[keep] <= 30.0).all()
    with pytest.raises(ValueError, match="dmin"):
        resolution_mask(sim, dmin=5.0, dmax=2.0)


def test_subsample_mask_is_seeded():
    m = np.ones((100, 100), dtype=bool)
    a, b = subsample_mask(m, 0.25, seed=1), subsample_mask(m, 0.25, seed=1)
    np.testing.assert_array_equal(a, b)
    assert 2200 < a.sum() < 2800
    with pytest.raises(ValueError):
        subsample_mask(m, 0.0)
