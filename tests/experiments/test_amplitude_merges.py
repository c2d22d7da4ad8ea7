"""The merges to beat (experiments.merging), their integration (experiments.spot_integration), the metrics
(experiments.amplitude_metrics) and the reflection keys (experiments.reflection_keys), on hand-made cases with
known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.amplitude_metrics import anomalous_cc, compare
from experiments.merging import amplitudes, counts, merge_partiality, merge_plain
from experiments.reflection_keys import reflection_keys
from experiments.spot_integration import integrate, predict_spots

pytest.importorskip("gemmi")

A, B = (1, 2, 3), (2, 0, 1)


def test_partiality_corrected_mean_recovers_f_squared_where_the_plain_mean_does_not():
    # reflection A: F^2 = 100 seen at partialities 1, 0.5, 0.25 (photons per F^2); B: F^2 = 400 at 0.1 and 0.3
    keys = [A, A, A, B, B, B]
    g = np.array([1.0, 0.5, 0.25, 0.1, 0.3, 0.0])  # the last: no model photons, left out of the corrected mean
    intensity = np.array([100.0, 50.0, 25.0, 40.0, 120.0, 999.0])
    plain = merge_plain(keys, intensity)
    assert plain[A] == pytest.approx(175.0 / 3) and plain[B] == pytest.approx(1159.0 / 3)
    corrected = merge_partiality(keys, intensity, g)
    assert corrected == pytest.approx({A: 100.0, B: 400.0})
    assert amplitudes(corrected) == pytest.approx({A: 10.0, B: 20.0})
    assert amplitudes({A: -4.0}) == {A: 0.0}
    assert counts(keys) == {A: 3, B: 3}
    with pytest.raises(ValueError, match="keys but a column"):
        merge_plain(keys, intensity[:2])


def _spot_image(centre, total, shape=(32, 32), width=1.0):
    s, f = np.mgrid[0:shape[0], 0:shape[1]].astype(float)
    g = np.exp(-((s - centre[0]) ** 2 + (f - centre[1]) ** 2) / (2 * width ** 2))
    return total * g / g.sum(), (s - centre[0]) ** 2 + (f - centre[1]) ** 2


def test_summation_integration_of_a_known_spot():
    """One reflection's Gaussian spot (1000 photons at F^2 = 1: unit image 10 per F^2 x F^2 = 100) on a flat
    45-count background: found at its centre, integrated to its photons in the disc, its model photons per F^2
    the disc's share of 10; a spot near the edge is dropped."""
    unit, d2 = _spot_image((12.0, 15.0), 10.0)
    edge, d2e = _spot_image((1.0, 30.0), 10.0)
    hkl_px = np.zeros((3,) + unit.shape, dtype=np.int64)
    hkl_px[:, d2 <= 16] = np.array(A)[:, None]
    hkl_px[:, d2e <= 16] = np.array(B)[:, None]
    unit_all = unit + edge
    spots = predict_spots(hkl_px, unit_all, min_unit=1.0)
    assert sorted(map(tuple, spots.hkl)) == sorted([A, B])
    i = [tuple(h) for h in spots.hkl].index(A)
    np.testing.assert_allclose(spots.centre[i], (12.0, 15.0), atol=1e-3)
    observed = 45.0 + 100.0 * unit_all  # noise-free counts: F^2 = 100
    got = integrate(observed, spots, hkl_px, unit_all, spot_radius_px=2.5, ring_px=(4.0, 6.0), pedestal=40.0)
    assert [tuple(h) for h in got.hkl] == [A]  # B's disc would leave the detector
    s, f = np.mgrid[0:32, 0:32]
    d2 = (s - spots.centre[i][0]) ** 2 + (f - spots.centre[i][1]) ** 2  # the found centre: ring edges at whole d2
    disc = d2 <= 2.5 ** 2
    ring = (d2 > 16.0) & (d2 <= 36.0)
    level = observed[ring].mean()  # 45 and the spot's tail (< 0.1 photon per pixel at 4 px)
    assert got.background[0] == pytest.approx(level, rel=1e-12) and abs(level - 45.0) < 0.1
    assert got.intensity[0] == pytest.approx(observed[disc].sum() - disc.sum() * level, rel=1e-12)
    assert got.intensity[0] == pytest.approx(100.0 * unit[disc].sum(), rel=1e-3)
    assert got.model[0] == pytest.approx(unit[disc].sum(), rel=1e-12)
    assert got.intensity[0] / got.model[0] == pytest.approx(100.0, rel=1e-3)
    var = (observed[disc] - 40.0).sum() + disc.sum() ** 2 * observed[ring].var(ddof=1) / ring.sum()
    assert got.sigma[0] == pytest.approx(math.sqrt(var), rel=1e-9)


def test_metrics_after_one_overall_scale():
    truth = {A: 10.0, B: 20.0, (0, 0, 1): 30.0, (0, 1, 1): 40.0}
    twice = {k: 2 * v for k, v in truth.items()}
    got = compare(twice, truth)
    assert got["n"] == 4 and got["scale"] == pytest.approx(0.5) and got["R"] == pytest.approx(0.0, abs=1e-12)
    assert got["CC"] == pytest.approx(1.0)
    off = {**truth, A: 14.0}  # k = sum F T / sum F^2 = 3040 / 3096
    k = 3040.0 / 3096.0
    expected = sum(abs(k * off[x] - truth[x]) for x in truth) / 100.0
    assert compare(off, truth)["R"] == pytest.approx(expected) and compare(off, truth)["scale"] == pytest.approx(k)
    assert compare({(9, 9, 9): 1.0}, truth)["n"] == 0


def test_anomalous_differences_correlated_with_the_truth():
    pairs = [((1, 0, i), (-1, 0, -i)) for i in range(1, 6)]
    truth = {}
    for i, (p, m) in enumerate(pairs):
        truth[p], truth[m] = 100.0 + i, 100.0 - i
    same = anomalous_cc(dict(truth), truth, pairs, signal=[p for p, _ in pairs[1:]])
    assert same["n_pairs"] == 5 and same["CC"] == pytest.approx(1.0) and same["n_signal"] == 4
    swapped = {**{p: truth[m] for p, m in pairs}, **{m: truth[p] for p, m in pairs}}
    assert anomalous_cc(swapped, truth, pairs)["CC"] == pytest.approx(-1.0)
    one_mate = {p: truth[p] for p, _ in pairs}
    assert anomalous_cc(one_mate, truth, pairs)["n_pairs"] == 0


def test_reflection_keys_follow_the_refinement_names():
    """P 4: (h k l), (-k h l), (-h -k l), (k -h l) are one amplitude; F(-) is keyed by the negative of F(+)'s
    key; hk0 is centric (one amplitude for both mates)."""
    eq = np.array([[1, 2, 3], [-2, 1, 3], [-1, -2, 3], [2, -1, 3]])
    tied = reflection_keys("P 4", eq, False)
    assert len(set(tied)) == 1
    plus = reflection_keys("P 4", eq, True)
    minus = reflection_keys("P 4", -eq, True)
    assert len(set(plus)) == 1 and set(minus) == {tuple(-x for x in plus[0])}
    assert set(reflection_keys("P 4", -eq, False)) == set(tied)
    centric = reflection_keys("P 4", np.array([[1, 2, 0], [-1, -2, 0]]), True)
    assert centric[0] == centric[1]


def test_reference_grid_puts_each_key_on_its_equivalents_and_mates():
    from experiments.merging import reference_grid

    grid, lo = reference_grid({(1, 2, 3): 7.0}, "P 4", 4, 100.0)
    assert grid.shape == (9, 9, 9) and lo.tolist() == [-4, -4, -4]
    for hkl in ([1, 2, 3], [-2, 1, 3], [-1, -2, 3], [2, -1, 3], [-1, -2, -3], [-2, 1, -3]):
        assert grid[tuple(np.array(hkl) + 4)] == 7.0, hkl
    assert grid[tuple(np.array([2, 1, 3]) + 4)] == 100.0 and grid[4, 4, 4] == 0.0  # (2 1 3): another amplitude in P 4
