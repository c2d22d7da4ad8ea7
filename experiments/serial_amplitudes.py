"""Synthetic serial sets with known amplitudes: the truth a merge and an amplitude refinement are measured against.

:func:`make_amplitude_set` draws ``n`` stills of one tetragonal crystal (cell 46 x 46 x 56 A, space group
:data:`SPACE_GROUP` P 4, mosflm convention, 1 A, ``size x size`` pixels of 0.1 mm at ``distance_mm``), every
random number from the ``numpy.random.Generator`` passed in:

* **amplitudes** (:func:`true_amplitudes`): one per symmetry-unique reflection of P 4 out to the detector's
  corner, Wilson-distributed with ``<F^2> = MEAN_F^2`` (acentric: the modulus of a complex normal; centric: of a
  real normal); a fraction ``anomalous_fraction`` of the acentric ones has ``F(+) = F exp(d / 2)``,
  ``F(-) = F exp(-d / 2)`` with ``d ~ N(0, anomalous_rel)``; the tied amplitude of a pair is
  ``sqrt((F(+)^2 + F(-)^2) / 2)`` (what a merge that ties the mates estimates);
* **stills**, as :mod:`experiments.serial_data` draws its good ones: misset angles uniform in [-180, 180) x
  [-60, 60) x [-180, 180) deg, scale ``exp(N(0, scale_spread))``, mosaic spread ``0.8 deg x (1 + N(0,
  mosaic_spread))`` (floored at 0.2 deg), background ``5 photons x exp(N(0, background_spread))``;
  ``observed = Poisson(scale x crystal + background) + 40`` (the pedestal); the reflections a still crosses are
  partial (crystal ``N`` cells a side, mosaic);
* **the truth is finer than the model**: the truth images are simulated with ``truth_domains`` mosaic domains
  and ``truth_oversample``-fold sub-pixels, the refinement's model (:attr:`AmplitudeSet.serial`'s ``args``) has
  ``model_domains`` domains, no sub-pixels and one amplitude ``MEAN_F`` for every reflection (no table: the
  amplitudes are what is measured).  Neither interpolates the structure factors (``-nointerpolate``): each
  pixel's Bragg photons are its nearest reflection's ``F^2`` times a lattice factor.

The truth table is drawn from its own generator, seeded by the first number drawn from ``rng``; still ``i``
from ``numpy.random.default_rng([seed, i])`` with ``seed`` the second, so ``keep=`` draws only some stills, the
same bits as in the whole set.  A still's start is an indexer's (:mod:`experiments.serial_data`): orientation off
by ``orientation_error_deg`` about a random axis, scale 1, beam centre, distance, N and mosaic spread known; the
shared start is the cell ``x (1 + cell_error)``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from experiments.reflection_keys import hm_symbol, is_absent, is_centric, reflection_key
from experiments.serial_data import KNOWN, SerialImage, SerialSet, turn_misset
from nbtorch.cli.args import config_from_args
from nbtorch.errors import InputError
from nbtorch.parameters import ORIENTATION_DELTAS, PARAMETER_NAMES
from nbtorch.simulator import Simulator
from refine.inputs.problems import PEDESTAL
from refine.many.pixel_table import FittedPixels

_log = logging.getLogger(__name__)

__all__ = ["AmplitudeTruth", "AmplitudeSet", "true_amplitudes", "make_amplitude_set", "SPACE_GROUP", "CELL",
           "MEAN_F", "SYMMETRY"]

SPACE_GROUP = "P 4"
SYMMETRY = "tetragonal"
CELL = (46.0, 46.0, 56.0, 90.0, 90.0, 90.0)
#: sqrt(<F^2>) of the Wilson amplitudes, and the model's one amplitude for every reflection (electrons)
MEAN_F = 100.0
SHOT_BACKGROUND = 5.0
MOSAIC_DEG = 0.8
PIXEL_MM = 0.1
_CELL_NAMES = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")

Key = tuple[int, int, int]


@dataclass(frozen=True)
class AmplitudeTruth:
    """The true amplitudes (electrons) of a set.

    Attributes:
        space_group: Hermann-Mauguin symbol.
        hkl_min: (3,) the indices of ``grid[0, 0, 0]``; ``grid``: (nh, nk, nl) F of every index (each mate its own).
        tied: key -> F of the tied amplitudes (:mod:`experiments.reflection_keys`, ``anomalous=False``).
        anomalous: key -> F with F(+) and F(-) apart (``anomalous=True`` keys).
        pairs: ``(plus, minus)`` keys of every acentric reflection; ``signal``: the plus keys whose mates differ.
    """

    space_group: str
    hkl_min: np.ndarray = field(repr=False)
    grid: np.ndarray = field(repr=False)
    tied: dict = field(repr=False)
    anomalous: dict = field(repr=False)
    pairs: tuple = field(repr=False)
    signal: frozenset = field(repr=False)


def true_amplitudes(space_group: str, hmax: int, rng: np.random.Generator, *, anomalous_fraction: float = 0.1,
                    anomalous_rel: float = 0.3) -> AmplitudeTruth:
    """The amplitudes of every index in ``[-hmax, hmax]^3`` (module docstring); F(000) and absences 0."""
    if not 0.0 <= anomalous_fraction <= 1.0:
        raise InputError(f"anomalous_fraction: expected a number in [0, 1], got {anomalous_fraction!r}")
    hm = hm_symbol(space_group)
    r = np.arange(-hmax, hmax + 1)
    index = np.stack(np.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3)
    keys = sorted({reflection_key(hm, tuple(int(x) for x in h), False) for h in index} - {(0, 0, 0)})
    keys = [k for k in keys if not is_absent(hm, k)]
    centric = np.array([is_centric(hm, k) for k in keys])
    z = rng.standard_normal((len(keys), 2))
    F = np.where(centric, MEAN_F * np.abs(z[:, 0]), MEAN_F / math.sqrt(2.0) * np.hypot(z[:, 0], z[:, 1]))
    chosen = (rng.random(len(keys)) < anomalous_fraction) & ~centric
    d = rng.normal(0.0, anomalous_rel, len(keys)) * chosen
    tied, anomalous, pairs, signal = {}, {}, [], set()
    for k, f, c, dk in zip(keys, F, centric, d):
        if c:
            tied[k] = anomalous[k] = float(f)
            continue
        minus = (-k[0], -k[1], -k[2])
        anomalous[k], anomalous[minus] = float(f * math.exp(dk / 2)), float(f * math.exp(-dk / 2))
        tied[k] = math.sqrt(0.5 * (anomalous[k] ** 2 + anomalous[minus] ** 2))
        pairs.append((k, minus))
        if dk != 0.0:
            signal.add(k)
    grid = np.zeros((2 * hmax + 1,) * 3)
    for h in index:
        t = tuple(int(x) for x in h)
        grid[tuple(h + hmax)] = anomalous.get(reflection_key(hm, t, True), 0.0)
    return AmplitudeTruth(hm, np.array([-hmax] * 3), grid, tied, anomalous, tuple(pairs), frozenset(signal))


@dataclass(frozen=True)
class AmplitudeSet:
    """A drawn set: ``serial`` (the stills as a :class:`~experiments.serial_data.SerialSet` whose ``args`` are the
    refinement's model; each image's ``truth`` its true base values, ``scale`` included), the ``truth`` amplitudes
    and the nanoBragg flags the truth images were simulated with (``truth_args``, its table in ``truth``)."""

    serial: SerialSet
    truth: AmplitudeTruth
    truth_args: tuple

    def __len__(self) -> int:
        return len(self.serial)

    @property
    def space_group(self) -> str:
        return self.truth.space_group


def _args(size: int, distance_mm: float, n_cells: int, fluence: float, domains: int, oversample: int,
          default_F: float) -> list[str]:
    cell = " ".join(repr(c) for c in CELL)
    return (f"-mosflm -cell {cell} -misset 0 0 0 -mosaic {MOSAIC_DEG} -distance {distance_mm!r} -pixel {PIXEL_MM} "
            f"-detpixels {int(size)} -lambda 1.0 -nointerpolate -oversample {int(oversample)} -mosaic_dom {int(domains)} "
            f"-mosaic_seed 7 -fluence {fluence!r} -N {int(n_cells)} -default_F {default_F!r}").split()


def _hmax(size: int, distance_mm: float) -> int:
    """Largest |index| a pixel reaches: ``|h| <= a / d_min`` at the detector's corner (with a margin)."""
    r = math.sqrt(2.0) * size * PIXEL_MM / 2.0 + 2 * PIXEL_MM
    d_min = 1.0 / (2.0 * math.sin(math.atan2(r, 0.9 * distance_mm) / 2.0))
    return int(math.ceil(1.05 * max(CELL[:3]) / d_min)) + 2


def make_amplitude_set(n: int, rng: np.random.Generator, *, size: int = 96, distance_mm: float = 40.0,
                       n_cells: int = 6, fluence: float = 5e28, scale_spread: float = 0.3, mosaic_spread: float = 0.1,
                       background_spread: float = 0.3, orientation_error_deg: float = 0.2, cell_error: float = 0.005,
                       truth_domains: int = 40, truth_oversample: int = 2, model_domains: int = 6,
                       anomalous_fraction: float = 0.1, anomalous_rel: float = 0.3, keep=None,
                       as_pixels: bool = False) -> AmplitudeSet:
    """``n`` stills and their true amplitudes (module docstring); ``keep``: the stills drawn (default all; the
    others None in ``serial.images``, the same bits either way); ``as_pixels``: each still's ``observed`` is kept as
    the :class:`~refine.many.pixel_table.FittedPixels` of all its pixels (what a joint run from files holds), not
    as a dense array."""
    if int(n) != n or n < 1:
        raise InputError(f"stills: expected an integer >= 1, got {n!r}")
    if int(size) != size or size < 16:
        raise InputError(f"size: expected an integer >= 16, got {size!r}")
    if min(truth_domains, truth_oversample, model_domains) < 1:
        raise InputError("truth_domains, truth_oversample, model_domains: expected integers >= 1")
    truth_seed, seed = (int(x) for x in rng.integers(2 ** 63, size=2))
    truth = true_amplitudes(SPACE_GROUP, _hmax(size, distance_mm), np.random.default_rng(truth_seed),
                            anomalous_fraction=anomalous_fraction, anomalous_rel=anomalous_rel)
    model_args = _args(size, distance_mm, n_cells, fluence, model_domains, 1, MEAN_F)
    truth_args = _args(size, distance_mm, n_cells, fluence, truth_domains, truth_oversample, 0.0)
    sim = Simulator(config_from_args(truth_args), dtype=torch.float64, compile=False)
    sim = sim.with_structure_factors(truth.grid, truth.hkl_min)
    base = {k: float(sim.setup.params[k]) for k in PARAMETER_NAMES}
    base.update({k: 0.0 for k in ORIENTATION_DELTAS})
    base.update({"background_x": 0.0, "background_y": 0.0, "default_F": MEAN_F})
    cell = dict(zip(_CELL_NAMES, CELL))
    kept = range(int(n)) if keep is None else sorted({int(i) for i in keep})
    images: list = [None] * int(n)
    for i in kept:
        if not 0 <= i < n:
            raise InputError(f"keep: still {i} is not among the {n} stills")
        images[i] = _still(i, sim, base, np.random.default_rng([seed, i]), scale_spread, mosaic_spread,
                           background_spread, orientation_error_deg)
        if as_pixels:
            dense = torch.from_numpy(images[i].observed)
            images[i] = dataclasses.replace(images[i], observed=FittedPixels.from_image(
                dense, torch.ones(dense.shape, dtype=torch.bool), f"still {i}"))
        if (i + 1) % 100 == 0:
            _log.info("drew still %d of %d", i + 1, n)
    start = {k: v * (1.0 + cell_error) if k in ("cell_a", "cell_b", "cell_c") else v for k, v in cell.items()}
    serial = SerialSet(tuple(images), tuple(model_args), SYMMETRY, start, cell, ("good",) * int(n))
    return AmplitudeSet(serial, truth, tuple(truth_args))


def _still(i: int, sim: Simulator, base: dict, rng: np.random.Generator, scale_spread: float, mosaic_spread: float,
           background_spread: float, orientation_error_deg: float) -> SerialImage:
    """Still ``i``, every random number from ``rng`` (its own)."""
    misset = rng.uniform([-180.0, -60.0, -180.0], [180.0, 60.0, 180.0])
    truth = {**base, **dict(zip(("misset_x", "misset_y", "misset_z"), (float(m) for m in misset)))}
    truth["scale"] = float(np.exp(rng.normal(0.0, scale_spread)))
    truth["mosaic_spread"] = max(0.2, MOSAIC_DEG * (1.0 + rng.normal(0.0, mosaic_spread)))
    shot = SHOT_BACKGROUND * float(np.exp(rng.normal(0.0, background_spread)))
    truth["background"] = shot + PEDESTAL
    params = {k: torch.tensor(truth[k], dtype=torch.float64) for k in PARAMETER_NAMES if k != "default_F"}
    with torch.no_grad():
        crystal = sim(**params).numpy()
    observed = rng.poisson(truth["scale"] * crystal + shot).astype(np.float64) + PEDESTAL
    start = {**{k: truth[k] for k in KNOWN}, **turn_misset(misset, orientation_error_deg, rng), "scale": 1.0}
    return SerialImage(i, "good", observed, {k: float(v) for k, v in truth.items()}, start)
