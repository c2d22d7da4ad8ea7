"""The resolved configuration (:mod:`nbtorch.rules.resolve` makes it): the :class:`Setup` of a simulation and its
pieces, the detector, crystal, sampling, sensor and structure factors, each a frozen dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nbtorch.config import SimulationConfig


# --------------------------------------------------------------------------------------
# the pieces of a Setup (frozen: a Setup never changes once resolved)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DetectorSetup:
    """The detector: pixels, ROI, unit axes (lab frame), pivot and the canonical geometry values."""

    convention: str
    pivot: str  # "beam" or "sample"
    beam: np.ndarray  # (3,) unit, propagation direction
    fdet: np.ndarray  # (3,) unit, fast axis (unrotated)
    sdet: np.ndarray  # (3,) unit, slow axis (unrotated)
    odet: np.ndarray  # (3,) unit, normal (unrotated)
    twotheta_axis: np.ndarray
    polar_axis: np.ndarray  # (3,) unit, E-vector of the incident beam
    spindle: np.ndarray  # (3,) unit, phi rotation axis
    pixel_m: float
    fpixels: int
    spixels: int
    detsize_s_m: float
    roi: tuple[int, int, int, int]  # xmin xmax ymin ymax inclusive, clipped to the detector
    close_distance_given_m: float | None
    distance_m: float  # canonical: sample to detector plane along the beam
    close_distance_m: float  # signed close distance (ratio x distance) the oversample rule uses
    beam_x_m: float  # canonical beam centre (nbtorch.geometry.beam_centre)
    beam_y_m: float


@dataclass(frozen=True)
class CrystalSetup:
    """The crystal: cell (A, deg), starting orientation, misset (deg), size (unit cells), spot shape."""

    cell: np.ndarray  # (6,) a b c (A) alpha beta gamma (deg)
    orientation0: np.ndarray  # (3, 3) U0: identity for -cell, the matrix's rotation for -mat
    cell_quirk: bool  # the C's triclinic formula applies (C parity with -cell)
    misset_deg: tuple[float, float, float]
    n_cells: tuple[float, float, float]  # N_a N_b N_c, at least 1
    shape: str
    fudge: float
    water_F2N: float  # the water droplet's scattering (F^2 x number of molecules)


@dataclass(frozen=True)
class SamplingSetup:
    """What each pixel sums over: phi steps, mosaic domains, sources and sub-pixels."""

    phisteps: int
    phistep_deg: float
    phi_quirk: bool  # the C's phi=0 stale rotation (C parity, or -phi_carryover_mode c-parity)
    mosaic_spread_deg: float
    mosaic_axes: np.ndarray  # (M, 3)
    mosaic_fractions: np.ndarray  # (M,) angle = spread * fraction (the random draw: domain 0 has 0)
    incident: np.ndarray  # (Q, 3) unit vectors source -> sample
    wavelength_factor: np.ndarray  # (Q,) source wavelength / wavelength parameter
    oversample: int
    steps: int  # sources x phi steps x mosaic domains x oversample^2 (the C's normalisation)
    #: (Q,) wavelength_factor - 1 at the resolved dispersion; (Q, 2) each source's horizontal and vertical
    #: angle (rad) at the resolved divergence; the resolved widths (dispersion %, divergence_h/_v mrad; 0:
    #: no spread along that axis).  The simulator scales the offsets with the width parameters.
    wavelength_offset: np.ndarray
    source_angles_rad: np.ndarray
    source_widths: dict
    #: one spread per crystal axis (-mosaic_abc, nbtorch.physics.mosaic), the canonical names mosaic_spread_a/b/c;
    #: False: nanoBragg's isotropic mosaic_spread (the default; mosaic_spread_a/b/c are then not used)
    mosaic_anisotropic: bool = False
    #: the domains' model (nbtorch.physics.mosaic.MOSAIC_MODELS): gaussian or ball (even sets) or random (the C's draw)
    mosaic_model: str = "ball"


@dataclass(frozen=True)
class SensorSetup:
    """The sensor: layers through its thickness and their attenuation."""

    thicksteps: int
    layer_thickness_m: float
    mu_per_m: float
    has_thickness: bool


@dataclass(frozen=True)
class StructureFactorSetup:
    """The structure-factor table (None without ``-hkl``/``-dump``) and how it is looked up."""

    F_grid: np.ndarray | None
    F_present: np.ndarray | None  # bool, entries listed in the HKL file (others follow default_F)
    hkl_min: np.ndarray | None
    hkl_max: np.ndarray | None
    interpolate: bool
    dmin_A: float  # resolution cut (0 = none)
    notes: tuple[str, ...] = ()


def _delegate(piece: str, name: str) -> property:
    """A read-only Setup attribute that is ``setup.<piece>.<name>``."""
    return property(lambda self: getattr(getattr(self, piece), name), doc=f"``{piece}.{name}``")


@dataclass(frozen=True)
class Setup:
    """Everything static about a simulation (numbers and numpy arrays, SI where noted).

    The five pieces hold the values; the attributes below delegate to them, so that
    ``setup.pixel_m`` is ``setup.detector.pixel_m`` and so on.
    """

    config: SimulationConfig
    c_parity: bool
    params: dict  # canonical name -> float (units: nbtorch.parameters)
    detector: DetectorSetup
    crystal: CrystalSetup
    sampling: SamplingSetup
    sensor: SensorSetup
    structure_factors: StructureFactorSetup
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: ``-mask``: bool (spixels, fpixels), True = simulate the pixel, False = skip it (value 0,
    #: as the C's zero mask pixels); None without ``-mask``.  A field of its own (not of the
    #: detector) so that ``dataclasses.replace(setup, pixel_mask=...)`` restricts a simulator.
    pixel_mask: np.ndarray | None = None

    @property
    def samples_per_pixel(self) -> int:
        """Sensor layers x sub-pixels x sources: the scattering vectors of one pixel."""
        return self.thicksteps * self.oversample**2 * len(self.incident)

    @property
    def evaluations_per_pixel(self) -> int:
        """Samples x phi steps x mosaic domains: the lattice-factor evaluations of one pixel."""
        return self.samples_per_pixel * self.phisteps * len(self.mosaic_fractions)


#: the Setup attributes that are fields of one of its pieces (read through, never copied)
_DELEGATED = {
    "detector": ("convention", "pivot", "beam", "fdet", "sdet", "odet", "twotheta_axis", "polar_axis", "spindle",
                 "pixel_m", "fpixels", "spixels", "detsize_s_m", "roi", "close_distance_given_m"),
    "crystal": ("orientation0", "cell_quirk", "shape", "fudge", "water_F2N"),
    "sampling": ("phisteps", "phistep_deg", "phi_quirk", "mosaic_axes", "mosaic_fractions", "mosaic_anisotropic",
                 "mosaic_model", "incident", "wavelength_factor", "oversample", "steps"),
    "sensor": ("thicksteps", "layer_thickness_m", "mu_per_m", "has_thickness"),
    "structure_factors": ("F_grid", "F_present", "hkl_min", "hkl_max", "interpolate", "dmin_A"),
}
for _piece, _names in _DELEGATED.items():
    for _name in _names:
        setattr(Setup, _name, _delegate(_piece, _name))
del _piece, _names, _name
