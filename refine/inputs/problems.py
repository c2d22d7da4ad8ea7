"""A bank of synthetic refinement problems with known truth.

Each problem is a still image simulated at a known truth, with Poisson noise
and a detector pedestal, and a starting model perturbed the way a real
indexing solution is wrong:

* cell lengths +1 %, free cell angles +0.5 deg;
* orientation off by 0.3 deg (a rotation about the unit axis (1, 2, 3)/sqrt(14));
* beam centre +2 pixels along both axes;
* mosaic spread x2, crystal size N -25 %, overall scale x3;
* distance known (it is nearly degenerate with the cell lengths on a
  low-angle still), except in ``cubic_wide``, a wide-angle problem where
  the distance is refined together with the cell.

Structure factors are random (acentric Wilson statistics, mean ``F^2 = 100^2``,
Friedel pairs equal, a fixed seed per problem): with one ``F`` for every
reflection the spot pattern would be a pure lattice, and shifting the beam
centre by one spot spacing (about 5 pixels here) while tilting the crystal
would give an almost identical image, a false minimum that real data do not
have.  The table is written once as a nanoBragg ``Fdump`` file under
``$NBTORCH_CACHE_DIR/problems`` (default ``~/.cache/nbtorch/problems``) and
passed with ``-dump``.

``observed = Poisson(truth image + 5 photons) + 40`` (a 40-count pedestal, like
the SMV ADC offset), drawn with a fixed seed.  ``truth`` and ``start`` are the values
of a fit to these counts: the truth background is 45 per pixel, of which only 5
carry shot noise.  :attr:`Problem.counts` is the detector's gain 1 and ADC offset 40:
``counts.photons(observed)`` and ``counts.photon_values(truth)`` are the problem in
photons (background 5), what ``nbtorch-refine --problem`` and ``refine(problem)`` fit
(:mod:`refine.inputs.detector_counts`).  Pixels are 0.1 mm and the
detector has ``size x size`` pixels (64 in CI, 512 in the slow tests), so a
larger size sees higher-resolution spots, where the cell error moves spots
by more than their width.

``problem = make_problem("cubic_mosflm", size=64)`` returns a :class:`Problem`:
``args`` is the nanoBragg command line of the **starting** model (what a user
would type), ``start``/``truth`` are every base value (:data:`refine.fitting.parameters.BASE_NAMES`),
``observed`` the noisy image, ``symmetry``, ``free``/``fixed`` the
groups a refinement should free and hold; ``problem.simulator()`` builds the
simulator.  :data:`PROBLEMS` lists the names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from nbtorch.cli.args import config_from_args
from nbtorch.errors import InputError
from nbtorch.io.hkl import write_fdump
from nbtorch.geometry.beam_centre import beam_centre_flags
from nbtorch.parameters import ORIENTATION_DELTAS, PARAMETER_NAMES
from nbtorch.geometry.rotation import rotation_matrix_axis_angle
from nbtorch.runtime.cache import cache_dir
from nbtorch.simulator import Simulator
from refine.inputs.detector_counts import DetectorCounts
from refine.fitting.parameters import BASE_NAMES, SYMMETRIES, constrained_cell, misset_from_rotation, misset_rotation

__all__ = ["Problem", "make_problem", "make_stills", "PROBLEMS", "PERTURBATION", "misorientation_deg"]

PIXEL_MM = 0.1
PEDESTAL = 40.0
SHOT_BACKGROUND = 5.0

#: the start perturbation applied to every problem
PERTURBATION = {
    "cell_length_factor": 1.01,
    "cell_angle_deg": 0.5,
    "orientation_deg": 0.3,
    "orientation_axis": (1.0, 2.0, 3.0),
    "beam_centre_px": 2.0,
    "mosaic_factor": 2.0,
    "N_factor": 0.75,
    "scale_factor": 3.0,
}

# name: convention flags, cell, symmetry, misset, N, mosaic (deg), distance (mm), extra flags
_SPECS: dict[str, dict] = {
    "cubic_mosflm": dict(conv="-mosflm", cell=(48.0, 48.0, 48.0, 90.0, 90.0, 90.0), symmetry="cubic",
                         misset=(10.0, 20.0, 30.0), distance=25.0, seed=11),
    "orthorhombic_xds": dict(conv="-xds", cell=(42.0, 50.0, 58.0, 90.0, 90.0, 90.0), symmetry="orthorhombic",
                             misset=(-15.0, 35.0, 5.0), distance=25.0, seed=12),
    "monoclinic_dials": dict(conv="-dials", cell=(44.0, 52.0, 48.0, 90.0, 104.0, 90.0), symmetry="monoclinic",
                             misset=(25.0, -10.0, 40.0), distance=25.0, seed=13, fluence=3e31),
    "tetragonal_mosflm": dict(conv="-mosflm", cell=(46.0, 46.0, 56.0, 90.0, 90.0, 90.0), symmetry="tetragonal",
                              misset=(5.0, 30.0, -20.0), distance=25.0, seed=14),
    "hexagonal_custom": dict(conv="-fdet_vector 0.0523 0.0 0.99863 -sdet_vector 0.0 -1.0 0.0 "
                                  "-odet_vector 0.99863 0.0 -0.0523 -beam_vector 1 0 0",
                             cell=(48.0, 48.0, 60.0, 90.0, 90.0, 120.0), symmetry="hexagonal",
                             misset=(35.0, 15.0, -25.0), distance=25.0, seed=15),
    "triclinic_mosflm": dict(conv="-mosflm", cell=(44.0, 50.0, 54.0, 82.0, 95.0, 104.0), symmetry="triclinic",
                             misset=(10.0, 20.0, 30.0), distance=25.0, seed=16, fluence=3e31),
    "cubic_wide": dict(conv="-mosflm", cell=(24.0, 24.0, 24.0, 90.0, 90.0, 90.0), symmetry="cubic",
                       misset=(-20.0, 10.0, 15.0), distance=12.5, seed=17, wide=True),
}
PROBLEMS = tuple(_SPECS)
_COMMON = "-lambda 1.0 -default_F 0 -interpolate -oversample 1 -mosaic_dom 3 -mosaic_seed 7 -pixel {pixel} -detpixels {size}"
N_TRUTH = 4
FLUENCE = 1e31
MOSAIC_TRUTH_DEG = 0.8


@dataclass(frozen=True)
class Problem:
    """One synthetic problem (see the module docstring).

    Attributes:
        name: problem name (a key of :data:`PROBLEMS`).
        size: detector pixels along each axis.
        args: nanoBragg flags of the starting model (a list of tokens).
        truth: every base value at the truth (``scale`` 1, ``background`` 45 photons/pixel).
        start: every base value at the start (``background`` = median of the observed image).
        symmetry: crystal system.
        free: groups to refine.
        fixed: names held fixed (e.g. ``distance``).
        observed: (size, size) float64 noisy image, photons + pedestal.
        seed: the noise seed.
        pedestal: the constant added after the noise.
        description: one line.
    """

    name: str
    size: int
    args: tuple[str, ...]
    truth: dict = field(repr=False)
    start: dict = field(repr=False)
    symmetry: str
    free: tuple[str, ...]
    fixed: tuple[str, ...]
    observed: np.ndarray = field(repr=False)
    seed: int
    pedestal: float
    description: str

    @property
    def counts(self) -> DetectorCounts:
        """The detector constants of :attr:`observed`: gain 1, ADC offset :attr:`pedestal` (as a nanoBragg noise
        image's ``-adc``); ``counts.photons(observed)`` and ``counts.photon_values(truth)`` are the problem in
        photons, what ``nbtorch-refine --problem`` fits."""
        return DetectorCounts(1.0, self.pedestal, f"bank problem: gain 1, a {self.pedestal:g}-count pedestal "
                                                  "added after the Poisson draw")

    def simulator(self, dtype: torch.dtype = torch.float64, compile: bool | None = False,
                  device: str | torch.device = "cpu") -> Simulator:
        """A simulator of the starting model on ``device`` (``compile=None`` follows the environment)."""
        return Simulator(config_from_args(list(self.args)), dtype=dtype, device=device, compile=compile)


def misorientation_deg(misset_a, misset_b) -> float:
    """Angle (deg) of the rotation between two misset orientations (``Rz Ry Rx``, deg)."""
    Ra = misset_rotation(torch.tensor(misset_a, dtype=torch.float64))
    Rb = misset_rotation(torch.tensor(misset_b, dtype=torch.float64))
    c = (float(torch.trace(Ra @ Rb.T)) - 1.0) / 2.0
    return math.degrees(math.acos(max(-1.0, min(1.0, c))))


def structure_factor_file(name: str, hmax: int, seed: int, directory: str | Path | None = None) -> Path:
    """A random Friedel-symmetric Wilson F table for ``|h|, |k|, |l| <= hmax`` as an Fdump file (cached)."""
    base = Path(directory) if directory is not None else cache_dir() / "problems"
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{name}_F_h{hmax}_s{seed}.bin"
    if path.is_file():
        return path
    rng = np.random.default_rng(seed + 1000)
    n = 2 * hmax + 1
    z = rng.standard_normal((n, n, n)) + 1j * rng.standard_normal((n, n, n))
    F = np.abs(z) * (100.0 / math.sqrt(2.0))  # <F^2> = 100^2
    F = np.sqrt(0.5 * (F**2 + F[::-1, ::-1, ::-1] ** 2))  # Friedel pairs equal (index -h is the mirror)
    write_fdump(path, F, (-hmax, -hmax, -hmax))
    return path


def _hmax(cell_max_A: float, distance_mm: float, size: int, wavelength_A: float = 1.0) -> int:
    """Largest |index| any pixel can reach: ``|h| = |a . S| <= a / d_min`` at the detector corner."""
    r = math.sqrt(2.0) * size * PIXEL_MM / 2.0 + 2 * PIXEL_MM
    two_theta = math.atan2(r, distance_mm * 0.9)
    d_min = wavelength_A / (2.0 * math.sin(two_theta / 2.0))
    return int(math.ceil(1.05 * cell_max_A / d_min)) + 2


def _convention(spec: dict) -> str:
    """The detector convention the spec's flags select (detector vectors: CUSTOM)."""
    return config_from_args(spec["conv"].split()).convention


def _args(spec: dict, size: int, v: dict, fdump: Path) -> list[str]:
    cell = " ".join(repr(v[n]) for n in ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma"))
    misset = " ".join(repr(v[n]) for n in ("misset_x", "misset_y", "misset_z"))
    n = v["N_a"]
    n_flag = f"-N {int(n)}" if float(n).is_integer() else None
    text = (f"{spec['conv']} -cell {cell} -misset {misset} -mosaic {v['mosaic_spread']!r} "
            f"-distance {v['distance']!r} {' '.join(beam_centre_flags(_convention(spec), v['beam_x'], v['beam_y'], PIXEL_MM))} "
            + _COMMON.format(pixel=PIXEL_MM, size=size)
            + f" -fluence {spec.get('fluence', FLUENCE)!r}")
    if n_flag is None:
        raise InputError(f"N={n}: nanoBragg's -N takes integers")
    return text.split() + n_flag.split() + ["-dump", str(fdump)]


def make_problem(name: str, size: int = 64, seed: int | None = None, directory: str | Path | None = None,
                 option_prefix: str = "", misset: tuple[float, float, float] | None = None) -> Problem:
    """Build problem ``name`` on a ``size x size`` detector; ``seed`` overrides the noise seed and ``misset``
    (deg) the crystal's true orientation (:func:`make_stills`).

    ``directory``: where the structure-factor file goes (default: the nbtorch cache).
    ``option_prefix``: put before ``problem``/``size`` in error messages (``"--"`` from a command
    line, so that they name its options).  Cost: one simulation of the truth image.
    """
    if name not in _SPECS:
        raise InputError(f"{option_prefix}problem: unknown name {name!r}; valid: {', '.join(PROBLEMS)}")
    if int(size) != size or size < 16:
        raise InputError(f"{option_prefix}size: expected an integer >= 16, got {size!r}")
    spec = _SPECS[name] if misset is None else {**_SPECS[name], "misset": tuple(float(m) for m in misset)}
    size = int(size)
    seed = spec["seed"] if seed is None else int(seed)
    pert = PERTURBATION
    centre = size * PIXEL_MM / 2.0
    a, b, c, al, be, ga = spec["cell"]
    truth = {
        "cell_a": a, "cell_b": b, "cell_c": c, "cell_alpha": al, "cell_beta": be, "cell_gamma": ga,
        "misset_x": spec["misset"][0], "misset_y": spec["misset"][1], "misset_z": spec["misset"][2],
        "mosaic_spread": MOSAIC_TRUTH_DEG, "N_a": float(N_TRUTH), "N_b": float(N_TRUTH), "N_c": float(N_TRUTH),
        "distance": spec["distance"], "beam_x": centre + 0.37 * PIXEL_MM, "beam_y": centre - 0.21 * PIXEL_MM,
    }
    # the start: perturbed truth, respecting the crystal system
    start = dict(truth)
    free_cell = SYMMETRIES[spec["symmetry"]]
    for n in ("cell_a", "cell_b", "cell_c"):
        start[n] = truth[n] * pert["cell_length_factor"]
    for n in ("cell_alpha", "cell_beta", "cell_gamma"):
        if n in free_cell:
            start[n] = truth[n] + pert["cell_angle_deg"]
    start.update({k: float(v) for k, v in constrained_cell(spec["symmetry"], start).items()})
    axis = torch.tensor(pert["orientation_axis"], dtype=torch.float64)
    R_pert = rotation_matrix_axis_angle(axis / torch.linalg.norm(axis), math.radians(pert["orientation_deg"]))
    misset = torch.tensor(spec["misset"], dtype=torch.float64)
    sx, sy, sz = (float(v) for v in misset_from_rotation(R_pert @ misset_rotation(misset), misset))
    start.update({"misset_x": sx, "misset_y": sy, "misset_z": sz})
    start["beam_x"] = truth["beam_x"] + pert["beam_centre_px"] * PIXEL_MM
    start["beam_y"] = truth["beam_y"] + pert["beam_centre_px"] * PIXEL_MM
    start["mosaic_spread"] = truth["mosaic_spread"] * pert["mosaic_factor"]
    for n in ("N_a", "N_b", "N_c"):
        start[n] = round(truth[n] * pert["N_factor"])
    hmax = _hmax(max(spec["cell"][:3]), spec["distance"], size)
    fdump = structure_factor_file(name, hmax, spec["seed"], directory)
    args = _args(spec, size, start, fdump)
    sim = Simulator(config_from_args(args), dtype=torch.float64, compile=False)
    base_start = {n: float(sim.setup.params[n]) for n in PARAMETER_NAMES}
    base_truth = dict(base_start)
    base_truth.update({k: float(v) for k, v in truth.items()})
    with torch.no_grad():
        image = sim(**{k: torch.tensor(v, dtype=torch.float64) for k, v in base_truth.items()}).numpy()
    rng = np.random.default_rng(seed)
    observed = rng.poisson(image + SHOT_BACKGROUND).astype(np.float64) + PEDESTAL
    for d in (base_start, base_truth):
        d.update({n: 0.0 for n in ORIENTATION_DELTAS})
        d.update({"background_x": 0.0, "background_y": 0.0})
    base_truth.update({"scale": 1.0, "background": SHOT_BACKGROUND + PEDESTAL})
    base_start.update({"scale": pert["scale_factor"], "background": float(np.median(observed))})
    assert set(base_start) == set(BASE_NAMES)
    wide = bool(spec.get("wide"))
    free = ("scale", "background", "orientation", "cell", "beam_centre", "mosaic") + (("distance",) if wide else ())
    fixed = () if wide else ("distance",)
    desc = (f"{spec['symmetry']} cell {spec['cell']}, {spec['conv'].split()[0].lstrip('-')} convention, "
            f"distance {spec['distance']} mm, {size}x{size} pixels of {PIXEL_MM} mm")
    return Problem(name=name, size=size, args=tuple(args), truth=base_truth, start=base_start,
                   symmetry=spec["symmetry"], free=free, fixed=fixed, observed=observed, seed=seed,
                   pedestal=PEDESTAL, description=desc)


def make_stills(name: str, n: int, size: int = 64, seed: int = 0, directory: str | Path | None = None,
                indices: Sequence[int] | None = None) -> list[Problem]:
    """``n`` stills of one crystal (problem ``name``'s cell, mosaic, detector and structure factors) at random
    orientations: still ``k`` has true misset angles drawn uniformly in [-180, 180) x [-60, 60) x [-180, 180) deg
    from ``seed`` and its own noise seed ``1000 * seed + k``; its start has the bank's perturbation
    (:data:`PERTURBATION`) about its own truth.  ``indices``: build only these stills (a process's share of a
    joint job); the others are None.  The same ``(name, n, size, seed)`` always gives the same stills.
    """
    if int(n) != n or n < 1:
        raise InputError(f"n: expected an integer >= 1, got {n!r}")
    rng = np.random.default_rng(seed)
    angles = rng.uniform([-180.0, -60.0, -180.0], [180.0, 60.0, 180.0], size=(int(n), 3))
    wanted = set(range(int(n))) if indices is None else set(int(i) for i in indices)
    return [make_problem(name, size, seed=1000 * int(seed) + k, directory=directory, misset=tuple(angles[k]))
            if k in wanted else None for k in range(int(n))]
