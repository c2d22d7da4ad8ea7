"""Synthetic serial sets with known amplitudes (experiments.serial_amplitudes): the same seed gives the same bits, a
subset draws the same stills, the amplitudes are Wilson-distributed with a few anomalous pairs, and the model's
photons per F^2 explain the integrated spots at the true geometry (experiments.spot_integration)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from experiments.reflection_keys import reflection_key
from experiments.serial_amplitudes import MEAN_F, make_amplitude_set, true_amplitudes
from experiments.spot_integration import integrate, pixel_indices, predict_spots, unit_image
from nbtorch.errors import InputError
from refine.inputs.problems import PEDESTAL

pytest.importorskip("gemmi")

SMALL = dict(size=48, truth_domains=6, truth_oversample=1)


@pytest.fixture(scope="module")
def three():
    torch.set_num_threads(1)
    return make_amplitude_set(3, np.random.default_rng(5), **SMALL)


def test_same_seed_same_bits_and_a_subset_draws_the_same_stills(three):
    again = make_amplitude_set(3, np.random.default_rng(5), **SMALL)
    part = make_amplitude_set(3, np.random.default_rng(5), keep=[2], **SMALL)
    for a, b in zip(three.serial.images, again.serial.images):
        assert np.array_equal(a.observed, b.observed) and a.truth == b.truth and a.start == b.start
    assert part.serial.images[0] is None and part.serial.images[1] is None
    assert np.array_equal(part.serial.images[2].observed, three.serial.images[2].observed)
    assert part.serial.images[2].truth == three.serial.images[2].truth
    assert np.array_equal(part.truth.grid, three.truth.grid) and part.truth.tied == three.truth.tied
    other = make_amplitude_set(3, np.random.default_rng(6), **SMALL)
    assert not np.array_equal(other.serial.images[0].observed, three.serial.images[0].observed)
    with pytest.raises(InputError, match="stills: expected an integer >= 1"):
        make_amplitude_set(0, np.random.default_rng(5))


def test_amplitudes_are_wilson_with_a_few_anomalous_pairs():
    truth = true_amplitudes("P 4", 12, np.random.default_rng(3), anomalous_fraction=0.1, anomalous_rel=0.3)
    F = np.array(list(truth.tied.values()))
    assert len(F) > 1000 and np.mean(F ** 2) == pytest.approx(MEAN_F ** 2, rel=0.08)
    # acentric Wilson: <F>^2 / <F^2> = pi / 4
    acentric = np.array([truth.tied[p] for p, _ in truth.pairs])
    assert np.mean(acentric) ** 2 / np.mean(acentric ** 2) == pytest.approx(math.pi / 4, abs=0.02)
    assert 0.05 < len(truth.signal) / len(truth.pairs) < 0.15
    for p, m in truth.pairs:
        fp, fm = truth.anomalous[p], truth.anomalous[m]
        assert (fp != fm) == (p in truth.signal)
        assert truth.tied[p] == pytest.approx(math.sqrt((fp ** 2 + fm ** 2) / 2))
    # the table holds every index's mate: (h k l) its F(+) or F(-), its equivalents the same
    for hkl in ([1, 2, 3], [-2, 1, 3], [-1, -2, -3], [3, 0, 0]):
        key = reflection_key("P 4", tuple(hkl), True)
        assert truth.grid[tuple(np.array(hkl) + 12)] == truth.anomalous[key]
    assert truth.grid[12, 12, 12] == 0.0


def test_the_model_photons_per_f2_explain_the_spots_at_the_true_geometry(three):
    """At each still's truth the integrated photons over the model's photons per F^2 are the true F^2: the median
    ratio near 1 (the truth has finer mosaic domains than the model), correlated over the spots."""
    ratios, pred, got = [], [], []
    for im, sim in zip(three.serial.images, three.serial.simulators()):
        px, unit = pixel_indices(sim, im.truth), unit_image(sim, im.truth)
        spots = integrate(im.observed, predict_spots(px, unit, 10.0 / MEAN_F ** 2), px, unit, pedestal=PEDESTAL)
        F2 = np.array([three.truth.anomalous[reflection_key("P 4", tuple(int(x) for x in h), True)] ** 2
                       for h in spots.hkl])
        strong = spots.model * F2 > 200.0
        ratios += list(spots.intensity[strong] / (spots.model[strong] * F2[strong]))
        pred += list(spots.model * F2)
        got += list(spots.intensity)
    assert len(ratios) > 10
    assert 0.85 < np.median(ratios) < 1.15, np.median(ratios)
    assert np.corrcoef(pred, got)[0, 1] > 0.9
