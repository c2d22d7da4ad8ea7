"""refine.inputs.spots (spot finding, model centroids, offsets) and refine.inputs.selection (pixel masks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.errors import InputError
from refine.inputs.selection import resolution_map, resolution_mask, subsample_mask
from refine.inputs.spots import find_spots, model_centroids, read_spot_list, spot_offsets, window_mask

# the C's random draw of 2 domains (the crystal and one rotated copy): compact spots for the finder (an even set
# of 2 is a symmetric pair whose two copies split a weak spot at the finder's threshold)
MODEL = ("-cell 30 30 40 90 90 90 -misset 10 20 30 -N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -mosaic_model random "
         "-oversample 1 "
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


THAU_HEADER = ("# observed spots on thau_3_2_0003 found by the helper (median-filter background, threshold)\n"
               "# x_px(fast) y_px(slow) [pixel centre = index+0.5]  summed_counts_above_bg  n_pixels  indexed(1/0)  "
               "h k l  x_pred y_pred (for indexed rows)\n")


def test_read_spot_list_our_own_format(tmp_path):
    (tmp_path / "s.txt").write_text(THAU_HEADER + "  1219.69      9.07        176    7 0    .    .    .         .         .\n"
                                                  "   747.33    236.75        338   15 1  -26   17   12    746.39    238.56\n")
    got = read_spot_list(tmp_path / "s.txt", shape=(2527, 2463))
    np.testing.assert_array_equal(got, [[1219.69, 9.07], [747.33, 236.75]])


DIALS_ROWS = "-26 17 12 0 338.0 747.33 236.75 0.5\n-22 19 -4 0 126.0 1046.17 245.52 0.5\n"


@pytest.mark.parametrize("header", [
    "# h k l id intensity.sum.value xyzobs.px.value\n",  # DIALS names; xyzobs stands for three columns
    "miller_index id intensity.sum.value xyzobs.px.value\n",  # a header line that is not a comment
    "H K L ID I XOBS YOBS ZOBS\n",  # case-insensitive
    "h,k,l,id,I,x,y,z\n",  # commas
])
def test_read_spot_list_finds_x_and_y_by_the_header(tmp_path, header):
    rows = DIALS_ROWS.replace(" ", ",") if "," in header else DIALS_ROWS
    (tmp_path / "s.txt").write_text(header + rows)
    np.testing.assert_array_equal(read_spot_list(tmp_path / "s.txt", shape=(2527, 2463)),
                                  [[747.33, 236.75], [1046.17, 245.52]])


def test_read_spot_list_refuses_a_wide_table_without_a_header(tmp_path):
    """#20: a DIALS-style table h k l ... x y z was read as if h, k were x, y."""
    (tmp_path / "s.txt").write_text(DIALS_ROWS)
    with pytest.raises(InputError, match="8 columns and no header naming them, so x and y cannot be told") as exc:
        read_spot_list(tmp_path / "s.txt")
    assert "--spot-columns" in str(exc.value) and "\n" not in str(exc.value)
    # ... unless the columns are named
    for cols in ("6,7", ["6", "7"]):
        np.testing.assert_array_equal(read_spot_list(tmp_path / "s.txt", cols), [[747.33, 236.75], [1046.17, 245.52]])
    # a narrow header-less table is x y [z]
    (tmp_path / "xyz.txt").write_text("10.5 20.5 0.5\n11 21 0.5\n")
    np.testing.assert_array_equal(read_spot_list(tmp_path / "xyz.txt"), [[10.5, 20.5], [11.0, 21.0]])


def test_read_spot_list_spot_columns_by_name_and_their_errors(tmp_path):
    (tmp_path / "s.txt").write_text("h k l x_pred y_pred xcal ycal\n1 2 3 5.5 6.5 7.5 8.5\n")
    with pytest.raises(InputError, match="the header names no x and y columns"):  # predictions are not observations
        read_spot_list(tmp_path / "s.txt")
    np.testing.assert_array_equal(read_spot_list(tmp_path / "s.txt", "X_PRED,y_pred"), [[5.5, 6.5]])
    (tmp_path / "p.txt").write_text("h k l x_pred y_pred\n1 2 3 5.5 6.5\n")
    with pytest.raises(InputError, match="the header names no x and y columns"):
        read_spot_list(tmp_path / "p.txt")
    with pytest.raises(InputError, match="no column 'xobs' in the header"):
        read_spot_list(tmp_path / "s.txt", "xobs,yobs")
    with pytest.raises(InputError, match="expected two columns"):
        read_spot_list(tmp_path / "s.txt", "4")
    with pytest.raises(InputError, match="column numbers start at 1"):
        read_spot_list(tmp_path / "s.txt", "0,1")
    with pytest.raises(InputError, match="the same column"):
        read_spot_list(tmp_path / "s.txt", "4,x_pred")
    (tmp_path / "n.txt").write_text(DIALS_ROWS)
    with pytest.raises(InputError, match="has no header naming its columns"):
        read_spot_list(tmp_path / "n.txt", "x,y")
    with pytest.raises(InputError, match="line 1: expected numbers in columns 9 and 2"):
        read_spot_list(tmp_path / "n.txt", "9,2")


def test_read_spot_list_refuses_positions_off_the_detector_and_files_without_rows(tmp_path):
    (tmp_path / "s.txt").write_text("x y\n5 6\n40.5 3\n")
    assert read_spot_list(tmp_path / "s.txt").shape == (2, 2)  # no detector given: not checked
    with pytest.raises(InputError, match=r"1 of 2 positions fall outside the 32 x 30 pixel detector \(line 3: "
                                         r"x=40.5, y=3"):
        read_spot_list(tmp_path / "s.txt", shape=(30, 32))
    (tmp_path / "h.txt").write_text("# x y\n-26 17\n")
    with pytest.raises(InputError, match="outside"):
        read_spot_list(tmp_path / "h.txt", shape=(30, 32))
    for text in ("", "# nothing here\n\n", "x y z\n"):
        (tmp_path / "e.txt").write_text(text)
        with pytest.raises(InputError, match="no spots found in the file"):
            read_spot_list(tmp_path / "e.txt")


def _floor_image(height, seed=5, background=10.0):
    """8 x 8 Gaussian spots of one height at random sub-pixel places, and those places."""
    rng = np.random.default_rng(seed)
    centres = np.array([(20 + 25 * i + rng.uniform(), 20 + 25 * j + rng.uniform()) for i in range(8) for j in range(8)])
    return _gauss_spots((220, 220), centres, sigma=0.9, height=height, background=background), centres


def test_centroid_floor_is_small_for_strong_spots_and_grows_for_weak_ones():
    from refine.quality.spot_floor import centroid_floor

    floors = {}
    for height in (3000.0, 60.0):
        model, centres = _floor_image(height)
        f = centroid_floor(model, None, centres + 0.7, centres, half=9, realisations=5, seed=0)
        assert f.spots == len(centres) and f.found > 0.95
        assert f.procedure_rms_px < 0.1  # the finder recovers the true centres of noise-free round spots
        # like for like: the finder's model centroids against the "observed" ones, which sit 0.7 px off in x and y
        assert f.finder_rms_px == pytest.approx(0.7 * 2 ** 0.5, abs=0.1) and f.to_dict()["rms_px_finder"] == f.finder_rms_px
        floors[height] = f.rms_px
    # shot noise: sigma / sqrt(photons) ~ 0.9 / sqrt(15 000) = 0.007 px plus the background's share
    assert 0.003 < floors[3000.0] < 0.03
    assert floors[60.0] > 5 * floors[3000.0] and 0.08 < floors[60.0] < 0.4


def test_centroid_floor_is_seeded_and_per_spot():
    from refine.quality.spot_floor import centroid_floor

    strong, centres = _floor_image(3000.0)
    weak, _ = _floor_image(60.0)
    left = np.indices(strong.shape)[1] < 110  # strong spots on the left half, weak ones on the right
    model = np.where(left, strong, weak)
    args = (model, None, centres, centres)
    a = centroid_floor(*args, half=9, realisations=4, seed=3)
    b = centroid_floor(*args, half=9, realisations=4, seed=3)
    c = centroid_floor(*args, half=9, realisations=4, seed=4)
    assert a.rms_px == b.rms_px and np.array_equal(a.per_spot, b.per_spot, equal_nan=True)
    assert c.rms_px != a.rms_px
    is_left = centres[:, 0] < 110
    assert np.nanmax(a.per_spot[is_left]) < np.nanmedian(a.per_spot[~is_left])
    assert a.to_dict()["floor_realisations"] == 4 and a.to_dict()["floor_seed"] == 3


def test_centroid_floor_leaves_out_spots_without_a_model_spot_and_masked_ones():
    from refine.quality.spot_floor import centroid_floor

    model, centres = _floor_image(3000.0)
    reference = centres.copy()
    reference[:4] = np.nan  # no model centroid: left out
    reference[4] += 5.0  # the model's spot is 5 px away from the finder's: not this spot
    usable = np.ones(model.shape, dtype=bool)
    x, y = np.floor(centres[5]).astype(int)
    usable[y - 4:y + 5, x - 4:x + 5] = False  # the 6th spot masked in the image
    f = centroid_floor(model, usable, centres, reference, half=9, realisations=2, seed=0)
    assert f.spots == len(centres) - 6
    assert np.isnan(f.per_spot[:6]).all() and np.isfinite(f.per_spot[6:]).all()


def test_spot_floor_reuses_the_rendered_model():
    from refine.quality.spot_floor import spot_floor

    sim = Simulator(config_from_args(MODEL.split()), compile=False)
    values = {k: float(v) for k, v in sim.setup.params.items()}
    with torch.no_grad():
        img = sim().numpy()
    spots = find_spots(img * 100 + 1.0)
    spots = spots[np.hypot(spots[:, 0] - 24.5, spots[:, 1] - 24.5) > 3]
    assert spot_offsets(sim, values, spots).bragg is None  # not kept unless asked for
    offsets = spot_offsets(sim, values, spots, keep_model=True)
    assert offsets.bragg is not None and offsets.window == 9
    bright = spot_floor(offsets, {"scale": 100.0, "background": 1.0}, seed=1)
    dim = spot_floor(offsets, {"scale": 1.0, "background": 1.0}, seed=1)
    assert bright.spots >= 0.8 * offsets.matched.sum() and bright.realisations == 5
    # 100x the photons: 10x less centroid noise (the rms itself also carries the finder's occasional jump,
    # a weak spot's component split or merged at the threshold)
    assert bright.rms_px < 0.02 and np.nanmedian(dim.per_spot) > 5 * np.nanmedian(bright.per_spot)
