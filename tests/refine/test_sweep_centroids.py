"""A rotation sweep's spots compared over their whole shoebox (refine/many/sweep_centroids.py, issue #34): a spot that
moves across the detector while it rocks through three frames has its three-dimensional centroid where the
intensity-weighted mean of its frames puts it, not where the one frame that holds its ``z`` has it."""

from __future__ import annotations

import types

import numpy as np
import pytest

from refine.many import image_reports, sweep_centroids
from refine.many.sweep_centroids import box_sums, centroid_offsets

SHAPE = (20, 30)
#: the spot's centre (x, y) and peak on frames 0, 1, 2: it moves 1.5 px in x a frame and is brightest on frame 1
TRACK = {0: (10.0, 8.0, 2.0), 1: (11.5, 8.0, 6.0), 2: (13.0, 8.0, 2.0)}


def _spot(frame: int) -> np.ndarray:
    x, y, peak = TRACK[frame]
    gy, gx = np.mgrid[:SHAPE[0], :SHAPE[1]] + 0.5
    return peak * np.exp(-((gx - x) ** 2 + (gy - y) ** 2) / (2 * 0.8 ** 2))


@pytest.fixture
def frames_rendered(monkeypatch):
    """``render_pixels`` replaced by the moving spot of the frame a fake simulator stands for, on the asked pixels."""
    def render(sim, values, pixels):
        return np.where(pixels, _spot(sim.frame), 0.0)
    monkeypatch.setattr(sweep_centroids, "render_pixels", render)
    return [types.SimpleNamespace(shape=SHAPE, frame=k) for k in range(3)]


def test_three_dimensional_centroid_of_a_moving_spot(frames_rendered):
    box = np.array([[5, 19, 3, 14, 0, 3]])  # x0, x1, y0, y1, z0, z1 (ends exclusive)
    scales = (1.0, 1.0, 2.0)  # the third image twice as bright (its own scale)
    total = sum(box_sums(sim, {"scale": s}, box, k) for k, (sim, s) in enumerate(zip(frames_rendered, scales)))
    weights = np.array([2.0, 6.0, 4.0])  # peak x scale of each frame: the same spot shape
    x = float((weights * np.array([10.0, 11.5, 13.0])).sum() / weights.sum())
    offsets = centroid_offsets(total, np.array([[x, 8.0]]))
    assert np.abs(offsets).max() < 1e-3, offsets  # 11.75: not 11.5, the centre of the frame that holds z = 1.x
    assert box_sums(frames_rendered[0], {"scale": 1.0}, box, 3).sum() == 0  # a frame outside the box adds nothing
    only_middle = box_sums(frames_rendered[1], {"scale": 1.0}, box, 1)
    assert centroid_offsets(only_middle, np.array([[x, 8.0]]))[0, 0] == pytest.approx(11.5 - x, abs=1e-3)


def test_a_box_without_model_intensity_is_unmatched(frames_rendered):
    boxes = np.array([[5, 19, 3, 14, 0, 3], [25, 30, 15, 20, 0, 3]])  # the second far from the spot
    total = sum(box_sums(sim, {}, boxes, k) for k, sim in enumerate(frames_rendered))
    offsets = centroid_offsets(total, np.array([[11.5, 8.0], [27.0, 17.0]]))
    assert np.isfinite(offsets[0]).all() and np.isnan(offsets[1]).all()


def test_sweep_rows_count_each_spot_on_the_image_of_its_frame(frames_rendered):
    """Three images (frames 0-2), the third twice as bright, one spot observed at z 1.4 (the second image's frame)
    at its three-dimensional centroid: one row of one spot on the second image, no offset at the start or the end
    (the model's spot on the second image alone lies 0.25 px from it); the other images have no spot."""
    values = [{"scale": 1.0}, {"scale": 1.0}, {"scale": 2.0}]
    result = types.SimpleNamespace(n_images=3, initial_images=values, images=values)
    observed = np.array([[11.75, 8.0, 1.4]])
    rows = image_reports.sweep_spot_rows(frames_rendered, result, range(3), [0, 1, 2], observed,
                                         np.array([[5, 19, 3, 14, 0, 3]]))
    assert rows[:, 0].tolist() == [0, 1, 0] and rows[1, 1:4].tolist() == [1, 1, 1]
    assert rows[1, 4] == pytest.approx(0.0, abs=1e-6) and rows[1, 5] == pytest.approx(0.0, abs=1e-6)
    shifted = image_reports.sweep_spot_rows(frames_rendered, result, range(3), [0, 1, 2], observed + [0.3, 0, 0],
                                            np.array([[5, 19, 3, 14, 0, 3]]))
    assert shifted[1, 6] == pytest.approx(0.09, abs=1e-5)
