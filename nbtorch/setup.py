"""Resolve a :class:`SimulationConfig` into a static :class:`Setup`.

This is where nanoBragg's automatic rules live (step counts, default beam
centres, pivots, oversampling, sources, mosaic domains) and where units are
converted once.  Everything here is plain numbers and numpy arrays: the
:class:`~nbtorch.simulator.Simulator` turns the canonical parameters into
tensors and calls the physics.

Canonical parameters (``Setup.params``) and their units::

    cell_a cell_b cell_c (A)  cell_alpha cell_beta cell_gamma (deg)
    misset_x misset_y misset_z (deg)  phi0 (deg)  mosaic_spread (deg)
    N_a N_b N_c  distance (mm)  beam_x beam_y (mm)
    detector_rotx detector_roty detector_rotz twotheta (deg)
    wavelength (A)  fluence (photons/m^2)  polarization (Kahn K)  default_F

``beam_x, beam_y`` are the ``-Xbeam/-Ybeam`` values for MOSFLM, DENZO, ADXV
and CUSTOM, and ``ORGX*pixel, ORGY*pixel`` for XDS and DIALS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from nbtorch.config import CONVENTIONS, SHAPES, SimulationConfig
from nbtorch.errors import InputError

PARAMETER_NAMES = (
    "cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma",
    "misset_x", "misset_y", "misset_z", "phi0", "mosaic_spread",
    "N_a", "N_b", "N_c", "distance", "beam_x", "beam_y",
    "detector_rotx", "detector_roty", "detector_rotz", "twotheta",
    "wavelength", "fluence", "polarization", "default_F",
)
DEFAULT_FLUENCE = 125932015286227086360700780544.0  # photons/m^2 = 1/r_e^2
AVOGADRO = 6.02214179e23
WATER_F = 2.57
WATER_MW = 18.0
#: the largest oversample the automatic rule (``ceil(3 * crystal size / (lambda * distance / pixel))``,
#: the C's) may choose: 100 is 10^4 sub-pixels per pixel, far more than any crystal of normal size
#: needs (a 1 um crystal at 100 mm with 0.1 mm pixels and 1 A gets 30); beyond it the command
#: refuses and asks for an explicit ``-oversample`` (usually a unit mistake: ``-distance`` in metres,
#: ``-pixel`` in um)
MAX_AUTO_OVERSAMPLE = 100
#: the most samples (sub-pixels x sensor layers x sources) one pixel may have, whatever chose the
#: oversample: the simulator holds every sample of a tile (at least 16 pixels) at once, ~175 bytes
#: each (float64), so 2^20 per pixel is ~3 GB per tile; beyond it is an error, not an allocator crash
MAX_SAMPLES_PER_PIXEL = 1 << 20
#: two unit vectors closer to (anti)parallel than this (norm of their cross product) are parallel
_PARALLEL = 1e-12

# (beam, fdet, sdet, odet, twotheta_axis, polar, spindle) per convention
_BASES = {
    "mosflm": ((1, 0, 0), (0, 0, 1), (0, -1, 0), (1, 0, 0), (0, 0, -1), (0, 0, 1), (0, 0, 1)),
    "denzo": ((1, 0, 0), (0, 0, 1), (0, -1, 0), (1, 0, 0), (0, 0, -1), (0, 0, 1), (0, 0, 1)),
    "xds": ((0, 0, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0), (1, 0, 0), (1, 0, 0)),
    "dials": ((0, 0, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 0), (0, 1, 0), (0, 1, 0)),
    "adxv": ((0, 0, 1), (1, 0, 0), (0, -1, 0), (0, 0, 1), (-1, 0, 0), (1, 0, 0), (1, 0, 0)),
    # CUSTOM starts from the MOSFLM vectors except the two-theta axis (C defaults)
    "custom": ((1, 0, 0), (0, 0, 1), (0, -1, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 1)),
}
_FORCED_PIVOT = {"mosflm": "beam", "denzo": "beam", "adxv": "beam", "xds": "sample", "dials": "sample"}


@dataclass(frozen=True)
class Setup:
    """Everything static about a simulation (numbers and numpy arrays, SI where noted)."""

    config: SimulationConfig
    c_parity: bool
    params: dict  # canonical name -> float (units above)
    convention: str
    pivot: str
    beam: np.ndarray  # (3,) unit
    fdet: np.ndarray
    sdet: np.ndarray
    odet: np.ndarray
    twotheta_axis: np.ndarray
    polar_axis: np.ndarray
    spindle: np.ndarray
    pixel_m: float
    fpixels: int
    spixels: int
    detsize_s_m: float
    roi: tuple[int, int, int, int]  # xmin xmax ymin ymax inclusive, clipped to the detector
    close_distance_given_m: float | None
    oversample: int
    thicksteps: int
    layer_thickness_m: float
    mu_per_m: float
    has_thickness: bool
    phisteps: int
    phistep_deg: float
    incident: np.ndarray  # (Q, 3) unit vectors source -> sample
    wavelength_factor: np.ndarray  # (Q,) source wavelength / wavelength parameter
    mosaic_axes: np.ndarray  # (M, 3)
    mosaic_fractions: np.ndarray  # (M,) angle = spread * fraction; domain 0 has 0
    orientation0: np.ndarray  # (3, 3) U0: identity for -cell, the matrix's rotation for -mat
    cell_quirk: bool  # the C's triclinic formula applies (C parity with -cell)
    phi_quirk: bool  # the C's phi=0 stale rotation (C parity, or -phi_carryover_mode c-parity)
    F_grid: np.ndarray | None
    F_present: np.ndarray | None  # bool, entries listed in the HKL file (others follow default_F)
    hkl_min: np.ndarray | None
    hkl_max: np.ndarray | None
    interpolate: bool
    shape: str
    fudge: float
    water_F2N: float
    dmin_A: float
    steps: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: ``-mask``: bool (spixels, fpixels), True = simulate the pixel, False = skip it (value 0,
    #: as the C's zero mask pixels); None without ``-mask``.
    pixel_mask: np.ndarray | None = None

    @property
    def samples_per_pixel(self) -> int:
        """Sensor layers x sub-pixels x sources: the scattering vectors of one pixel."""
        return self.thicksteps * self.oversample**2 * len(self.incident)

    @property
    def evaluations_per_pixel(self) -> int:
        """Samples x phi steps x mosaic domains: the lattice-factor evaluations of one pixel."""
        return self.samples_per_pixel * self.phisteps * len(self.mosaic_fractions)


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    n = np.linalg.norm(v)
    if not np.isfinite(n) or n == 0:
        raise InputError(f"vector {tuple(v)} has zero or non-finite length")
    return v / n


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    bad = (value < 0) if allow_zero else (value <= 0)
    if not math.isfinite(value) or bad:
        need = "non-negative" if allow_zero else "positive"
        raise InputError(f"{name}: must be {need} and finite, got {value:g}")


def _resolve_steps(count, range_, step, count_only_range: float):
    """The C's count/range/step auto-resolution (divergence and dispersion)."""
    count = -1 if count is None else count
    range_ = -1.0 if range_ is None else range_
    step = -1.0 if step is None else step
    if count <= 0:
        if range_ < 0.0:
            if step <= 0.0:
                count, range_, step = 1, 0.0, 0.0
            else:
                range_, count = step, 2
        elif step <= 0.0:
            step, count = range_, 2
        else:
            count = math.ceil(range_ / step)
    else:
        if range_ < 0.0:
            if step <= 0.0:
                range_ = count_only_range
                step = range_ / count
            else:
                range_, count = step, 2
        elif step <= 0.0:
            if count <= 1:
                count = 2
            step = range_ / (count - 1)
    if range_ <= 0.0 or step <= 0.0 or count <= 0:
        count, range_, step = 1, 0.0, 0.0
    return count, range_, step


def _resolve_phi(cfg: SimulationConfig):
    """(phisteps, phistep in deg) by the C's rules."""
    osc = -1.0 if cfg.osc_deg is None else cfg.osc_deg
    step = -1.0 if cfg.phistep_deg is None else cfg.phistep_deg
    n = -1 if cfg.phisteps is None else cfg.phisteps
    if n < 0:
        if osc < 0.0:
            if step <= 0.0:
                n, osc, step = 1, 0.0, 0.0
            else:
                osc, n = step, 2
        elif step <= 0.0:
            n, step = 2, osc / 2.0
        else:
            n = math.ceil(osc / step)
    else:
        if n == 0:
            n = 1
        if osc < 0.0:
            if step <= 0.0:
                osc = 180.0 / math.pi  # 1 radian
                step = osc / n
            else:
                osc, n = step, 2
        elif step < 0.0:
            step = osc / n
    return n, step


def _sources(cfg: SimulationConfig, beam, polar, wavelength_m: float):
    """Incident directions (Q, 3) and wavelength factors (Q,), in the C's order."""
    if cfg.source_file is not None:
        from nbtorch.io.sources import read_sourcefile

        table = np.array(read_sourcefile(cfg.source_file), dtype=np.float64)
        dist_m = cfg.source_distance_mm / 1000.0
        xyz = table[:, :3].copy()
        for j in range(3):
            xyz[:, j] = np.where(np.isnan(xyz[:, j]), -dist_m * beam[j], xyz[:, j])
        lam = np.where(np.isnan(table[:, 4]), wavelength_m, table[:, 4])
        norms = np.linalg.norm(xyz, axis=1)
        if np.any(norms == 0) or np.any(lam <= 0):
            raise InputError(f"{cfg.source_file}: a source has zero position vector or non-positive wavelength")
        return -(xyz / norms[:, None]), lam / wavelength_m
    hsteps, hrange, hstep = _resolve_steps(cfg.hdivsteps, _mrad(cfg.hdivrange_mrad), _mrad(cfg.hdivstep_mrad), 1.0)
    vsteps, vrange, vstep = _resolve_steps(cfg.vdivsteps, _mrad(cfg.vdivrange_mrad), _mrad(cfg.vdivstep_mrad), 1.0)
    disp = None if cfg.dispersion_pct is None else cfg.dispersion_pct / 100.0
    dsteps, disp, dstep = _resolve_steps(cfg.dispsteps, disp, None, 1.0)
    vert = _unit(np.cross(beam, polar))
    dirs = []
    for ih in range(hsteps):
        for iv in range(vsteps):
            hdiv = hstep * ih - hrange / 2.0
            vdiv = vstep * iv - vrange / 2.0
            if cfg.round_div:
                test = (hdiv * hdiv - hstep * hstep / 4.0 * (1 - hsteps % 2)) / hrange / hrange if hrange else 0.0
                test += (vdiv * vdiv - vstep * vstep / 4.0 * (1 - vsteps % 2)) / vrange / vrange if vrange else 0.0
                if test * 4.0 > 1.1:
                    continue
            v = -beam
            v = _rotate(v, polar, vdiv)
            v = _rotate(v, vert, hdiv)
            dirs.extend([-_unit(v)] * dsteps)
    factors = [1.0 + dstep * j - disp / 2.0 for j in range(dsteps)]
    if min(factors) <= 0.0:
        raise InputError(f"{cfg.flag_for('dispersion_pct', '-dispersion')} {cfg.dispersion_pct:g}: the shortest of the "
                         f"{dsteps} wavelengths would be {min(factors) * wavelength_m * 1e10:g} A "
                         f"(lambda x (1 - dispersion/200)); the spectral width must be below 200%")
    lam = np.array(factors * (len(dirs) // dsteps), dtype=np.float64)
    return np.array(dirs, dtype=np.float64).reshape(-1, 3), lam


def _mrad(v):
    return None if v is None else v / 1000.0


def _rotate(v, axis, phi):
    c, s = math.cos(phi), math.sin(phi)
    return v * c + np.cross(axis, v) * s + axis * np.dot(axis, v) * (1.0 - c)


def _bases(cfg: SimulationConfig):
    conv = cfg.convention
    if conv not in CONVENTIONS:
        raise InputError(f"unknown detector convention {conv!r}; expected one of {', '.join(CONVENTIONS)}")
    beam, f, s, o, tt, polar, spindle = (np.array(v, dtype=np.float64) for v in _BASES[conv])
    if conv == "custom":
        given = {
            "beam_vector": cfg.beam_vector, "fdet_vector": cfg.fdet_vector, "sdet_vector": cfg.sdet_vector,
            "odet_vector": cfg.odet_vector, "twotheta_axis": cfg.twotheta_axis,
            "polar_vector": cfg.polar_vector, "spindle_axis": cfg.spindle_axis,
        }
        for name, vec in given.items():
            if vec is not None and (not np.all(np.isfinite(vec)) or np.linalg.norm(vec) == 0):
                raise InputError(f"-{name}: must be a finite non-zero vector, got {tuple(vec)}")
        beam = np.array(cfg.beam_vector or beam, dtype=np.float64)
        f = np.array(cfg.fdet_vector or f, dtype=np.float64)
        s = np.array(cfg.sdet_vector or s, dtype=np.float64)
        o = np.array(cfg.odet_vector or o, dtype=np.float64)
        tt = np.array(cfg.twotheta_axis or tt, dtype=np.float64)
        polar = np.array(cfg.polar_vector or polar, dtype=np.float64)
        spindle = np.array(cfg.spindle_axis or spindle, dtype=np.float64)
    beam, f, s, polar, spindle, tt = (_unit(v) for v in (beam, f, s, polar, spindle, tt))
    _check_not_parallel(cfg, "fdet_vector", f, "sdet_vector", s, "detector fast and slow axes")
    if cfg.odet_vector is not None and conv == "custom":
        o_unit = _unit(o)
        _check_not_parallel(cfg, "fdet_vector", f, "odet_vector", o_unit, "detector fast and normal axes")
        _check_not_parallel(cfg, "sdet_vector", s, "odet_vector", o_unit, "detector slow and normal axes")
    if np.linalg.norm(o) != 1.0:
        o = _unit(np.cross(f, s))
    if np.linalg.norm(np.cross(beam, polar)) < _PARALLEL:
        given_beam = conv == "custom" and cfg.beam_vector is not None
        given_polar = conv == "custom" and cfg.polar_vector is not None
        if given_beam and not given_polar:
            raise InputError(f"-beam_vector {_fmt(cfg.beam_vector)}: the beam is parallel to the default polarization "
                             f"vector ({_fmt(polar)}); give -polar_vector with a vector perpendicular to the beam")
        if given_beam:
            raise InputError(f"-polar_vector {_fmt(cfg.polar_vector)} and -beam_vector {_fmt(cfg.beam_vector)}: "
                             "the polarization vector must not be parallel to the beam")
        raise InputError(f"-polar_vector {_fmt(cfg.polar_vector or polar)}: must not be parallel to the beam vector "
                         f"({_fmt(beam)})")
    return beam, f, s, o, tt, polar, spindle


def _fmt(v) -> str:
    return " ".join(f"{float(x):g}" for x in v)


def _check_not_parallel(cfg: SimulationConfig, name1: str, u1, name2: str, u2, what: str) -> None:
    """Refuse two (unit) axes that are parallel, naming the flags that gave them."""
    if np.linalg.norm(np.cross(u1, u2)) >= _PARALLEL:
        return
    g1, g2 = getattr(cfg, name1) is not None, getattr(cfg, name2) is not None
    if g1 and g2:
        raise InputError(f"-{name1} {_fmt(getattr(cfg, name1))} and -{name2} {_fmt(getattr(cfg, name2))}: "
                         f"the {what} must not be parallel")
    given, default, vec = (name1, name2, u2) if g1 else (name2, name1, u1)
    raise InputError(f"-{given} {_fmt(getattr(cfg, given))}: parallel to the default -{default} ({_fmt(vec)}); "
                     f"the {what} must not be parallel: give -{default} too")


def beam_centre_defaults(cfg: SimulationConfig, pixel_m: float, detsize_f: float, detsize_s: float):
    """Canonical (beam_x, beam_y) in metres for the convention (C defaults where not given)."""
    mm = lambda v: None if v is None else v / 1000.0  # noqa: E731
    Fclose = (cfg.ORGX - 0.5) * pixel_m if cfg.ORGX is not None else detsize_f / 2.0
    Sclose = (cfg.ORGY - 0.5) * pixel_m if cfg.ORGY is not None else detsize_s / 2.0
    conv = cfg.convention
    xb, yb = mm(cfg.Xbeam_mm), mm(cfg.Ybeam_mm)
    if conv in ("mosflm", "denzo"):
        return (xb if xb is not None else (detsize_s + pixel_m) / 2.0,
                yb if yb is not None else (detsize_f + pixel_m) / 2.0)
    if conv == "adxv":
        return (xb if xb is not None else (detsize_f + pixel_m) / 2.0,
                yb if yb is not None else (detsize_s - pixel_m) / 2.0)
    if conv in ("xds", "dials"):
        return Fclose + pixel_m / 2.0, Sclose + pixel_m / 2.0
    xc = mm(cfg.Xclose_mm) if cfg.Xclose_mm is not None else Fclose
    yc = mm(cfg.Yclose_mm) if cfg.Yclose_mm is not None else Sclose
    return (xb if xb is not None else xc, yb if yb is not None else yc)


def check_cell(cell, label: str) -> None:
    """Raise unless ``(a, b, c, alpha, beta, gamma)`` (Å, degrees) is a possible unit cell."""
    a, b, c, al, be, ga = (float(v) for v in cell)
    for name, v in zip(("a", "b", "c"), (a, b, c)):
        _check_positive(f"{label} {name}", v)
    for name, v in zip(("alpha", "beta", "gamma"), (al, be, ga)):
        if not (0.0 < v < 180.0):
            raise InputError(f"{label} {name}: angle must be between 0 and 180 degrees, got {v:g}")
    if not (al < be + ga and be < al + ga and ga < al + be and al + be + ga < 360.0):
        raise InputError(f"{label}: angles {al:g} {be:g} {ga:g} do not make a unit cell "
                         "(each < sum of the others, sum < 360)")


def _validate(cfg: SimulationConfig) -> None:
    if cfg.cell is None and cfg.mat_file is None:
        raise InputError("no crystal: give -cell a b c alpha beta gamma or -mat FILE")
    if cfg.cell is not None and cfg.mat_file is not None:
        raise InputError("-cell and -mat both given: use one to define the lattice")
    if cfg.cell is not None:
        check_cell(cfg.cell, "-cell")
    flag = cfg.flag_for  # the flag the user typed for a field (e.g. -N for N_a), else the default name
    for field_, default in (("wavelength_A", "-lambda"), ("pixel_mm", "-pixel"), ("distance_mm", "-distance"),
                            ("close_distance_mm", "-close_distance"), ("detsize_f_mm", "-detsize_f"),
                            ("detsize_s_mm", "-detsize_s"), ("source_distance_mm", "-source_distance"),
                            ("fluence", "-fluence")):
        _check_positive(flag(field_, default), getattr(cfg, field_))
    for field_, default in (("N_a", "-Na"), ("N_b", "-Nb"), ("N_c", "-Nc"), ("flux", "-flux"),
                            ("exposure_s", "-exposure"), ("beamsize_mm", "-beamsize")):
        _check_positive(flag(field_, default), getattr(cfg, field_), allow_zero=True)
    for field_, default in (("fpixels", "-detpixels_f"), ("spixels", "-detpixels_s"), ("oversample", "-oversample")):
        v = getattr(cfg, field_)
        if v is not None and v <= 0:
            raise InputError(f"{flag(field_, default)}: must be a positive count, got {v}")
    for field_, default in (("phisteps", "-phisteps"), ("mosaic_domains", "-mosaic_dom"), ("dispsteps", "-dispsteps"),
                            ("hdivsteps", "-hdivsteps"), ("vdivsteps", "-vdivsteps"),
                            ("detector_thicksteps", "-thicksteps")):
        v = getattr(cfg, field_)
        if v is not None and v < 0:
            raise InputError(f"{flag(field_, default)}: must not be negative, got {v}")
    for field_, default in (("mosaic_spread_deg", "-mosaic"), ("dispersion_pct", "-dispersion"),
                            ("detector_thick_um", "-detector_thick"), ("water_um", "-water"), ("dmin_A", "-dmin"),
                            ("hdivrange_mrad", "-hdivrange"), ("vdivrange_mrad", "-vdivrange")):
        _check_positive(flag(field_, default), getattr(cfg, field_), allow_zero=True)
    if cfg.flux > 0:  # fluence = flux * exposure / beamsize^2
        for field_, default in (("exposure_s", "-exposure"), ("beamsize_mm", "-beamsize")):
            if getattr(cfg, field_) == 0:
                raise InputError(f"{flag(field_, default)}: must be positive to compute the fluence from -flux, got 0")
    if cfg.shape not in SHAPES:
        raise InputError(f"unknown crystal shape {cfg.shape!r}")
    if cfg.dtype not in ("float32", "float64"):
        raise InputError(f"-dtype: expected float32 or float64, got {cfg.dtype!r}")
    if not (cfg.device == "cpu" or cfg.device.startswith("cuda")):
        raise InputError(f"-device: expected cpu or cuda[:N], got {cfg.device!r}")


def resolve(cfg: SimulationConfig) -> Setup:
    """Apply nanoBragg's rules to a config.  Raises InputError for impossible input."""
    from nbtorch import crng
    from nbtorch.physics.crystal import orientation_from_reciprocal

    _validate(cfg)
    notes: list[str] = []
    c_parity = bool(cfg.c_parity)
    pixel = cfg.pixel_mm / 1000.0
    detsize_f, detsize_s = cfg.detsize_f_mm / 1000.0, cfg.detsize_s_mm / 1000.0
    if cfg.fpixels:
        detsize_f = pixel * cfg.fpixels
    if cfg.spixels:
        detsize_s = pixel * cfg.spixels
    fpixels = math.ceil(detsize_f / pixel - 0.5)
    spixels = math.ceil(detsize_s / pixel - 0.5)
    if fpixels <= 0 or spixels <= 0:
        raise InputError(f"detector has no pixels ({fpixels} x {spixels}): check -detpixels/-detsize/-pixel")
    roi = (0, fpixels - 1, 0, spixels - 1)
    if cfg.roi is not None:
        x0, x1, y0, y1 = cfg.roi
        if not (0 <= x0 <= x1 < fpixels and 0 <= y0 <= y1 < spixels):
            raise InputError(f"-roi {x0} {x1} {y0} {y1}: outside the {fpixels} x {spixels} detector or empty (xmin xmax ymin ymax, inclusive)")
        roi = (x0, x1, y0, y1)

    if cfg.printout_pixel is not None:
        pf, ps = cfg.printout_pixel
        if not (roi[0] <= pf <= roi[1] and roi[2] <= ps <= roi[3]):
            raise InputError(f"-printout_pixel {pf} {ps}: not inside the rendered pixels "
                             f"(fast {roi[0]}..{roi[1]}, slow {roi[2]}..{roi[3]})")
    pixel_mask = _read_mask(cfg.mask_file, fpixels, spixels) if cfg.mask_file is not None else None

    beam, f, s, o, tt, polar, spindle = _bases(cfg)
    conv = cfg.convention
    pivot = _FORCED_PIVOT.get(conv, cfg.pivot or "beam")
    beam_x, beam_y = beam_centre_defaults(cfg, pixel, detsize_f, detsize_s)

    # --- distance: the canonical parameter is the beam-path distance ---------------
    rot = _rotxyz(*(math.radians(v) for v in (cfg.detector_rotx_deg, cfg.detector_roty_deg, cfg.detector_rotz_deg)))
    ratio = float(beam @ (rot @ o)) or np.finfo(float).tiny
    if cfg.close_distance_mm is not None:
        distance_m = cfg.close_distance_mm / 1000.0 / abs(ratio)
    else:
        distance_m = cfg.distance_mm / 1000.0
    distance_c_m = abs(ratio * distance_m) / ratio

    # --- crystal ------------------------------------------------------------------------
    lam_m = cfg.wavelength_A * 1e-10
    if cfg.mat_file is not None:
        from nbtorch.io.matrix import read_mosflm_matrix

        recip = np.asarray(read_mosflm_matrix(cfg.mat_file), dtype=np.float64) / cfg.wavelength_A
        import torch

        try:
            cell_t, u0 = orientation_from_reciprocal(torch.as_tensor(recip))
        except ValueError as exc:
            raise InputError(f"{cfg.mat_file}: {exc}") from None
        cell = cell_t.numpy().copy()
        cell[3:] = np.degrees(cell[3:])
        orientation0 = u0.numpy()
        cell_quirk = False
    else:
        cell = np.array(cfg.cell, dtype=np.float64)
        orientation0 = np.eye(3)
        cell_quirk = c_parity
    if cfg.misset_random:
        seed = cfg.misset_seed if cfg.misset_seed is not None else cfg.seed
        if seed is None:
            raise InputError("-misset random: give -misset_seed (or -seed) so the orientation is reproducible")
        misset = tuple(float(v) for v in crng.random_misset_umat(seed).misset_deg)
    else:
        misset = cfg.misset_deg or (0.0, 0.0, 0.0)

    n_cells = [max(1.0, float(v)) for v in (cfg.N_a, cfg.N_b, cfg.N_c)]

    # --- sampling -------------------------------------------------------------------------
    phisteps, phistep = _resolve_phi(cfg)
    spread_deg, n_domains = crng.resolve_mosaic_domains(cfg.mosaic_spread_deg, cfg.mosaic_domains)
    seed = cfg.mosaic_seed if cfg.mosaic_seed is not None else crng.MOSAIC_SEED_DEFAULT
    if spread_deg > 0:
        axes, fractions = crng.mosaic_domain_draws(n_domains, seed)
    else:
        axes, fractions = np.array([[0.0, 0.0, 1.0]]), np.zeros(1)
    incident, wl_factor = _sources(cfg, beam, polar, lam_m)
    if len(incident) == 0:
        raise InputError("no beam sources left after the divergence cut")

    if cfg.oversample is not None:
        oversample = cfg.oversample
    else:
        size_m = float((cell[:3] * 1e-10 * np.array(n_cells)).max())  # the longest crystal edge, N x cell
        recip_pixel = lam_m * distance_c_m / pixel
        with np.errstate(all="ignore"):
            ratio = float(np.float64(3.0) * size_m / recip_pixel)
        if not ratio <= MAX_AUTO_OVERSAMPLE:  # also NaN / inf
            value = math.ceil(ratio) if math.isfinite(ratio) else ratio
            raise InputError(
                f"-oversample: the automatic value {value:.6g} = ceil(3 x crystal size {size_m * 1e6:.4g} um / "
                f"(lambda {cfg.wavelength_A:g} A x distance {distance_c_m * 1000:.4g} mm / pixel {cfg.pixel_mm:g} mm)) "
                f"is above the limit of {MAX_AUTO_OVERSAMPLE}: check the units (-cell in A, -N in unit cells, "
                f"-distance and -pixel in mm) or give -oversample explicitly")
        oversample = max(1, math.ceil(ratio))

    # --- sensor ---------------------------------------------------------------------------
    thick = cfg.detector_thick_um * 1e-6
    mu = -1.0
    if cfg.detector_abs_um is not None:
        if math.isinf(cfg.detector_abs_um) or cfg.detector_abs_um == 0:
            thick, mu = 0.0, 0.0
        else:
            _check_positive("-detector_abs", cfg.detector_abs_um)
            mu = 1.0 / (cfg.detector_abs_um * 1e-6)
    n_layers = cfg.detector_thicksteps if cfg.detector_thicksteps not in (None, 0) else None
    if thick > 0:
        if mu < 0:
            mu = 1.0 / thick
        if c_parity:
            if n_layers is None:
                n_layers, dz = 2, thick / 2.0
            else:
                n_layers = max(n_layers, 2)
                dz = thick / (n_layers - 1)
        else:
            n_layers = n_layers or 2
            dz = thick / n_layers
    else:
        n_layers, dz, mu = 1, 0.0, max(mu, 0.0)
    samples = n_layers * oversample * oversample * len(incident)
    if samples > MAX_SAMPLES_PER_PIXEL:
        what = f"{cfg.flag_for('oversample', '-oversample')} {oversample}" if cfg.oversample is not None else "sampling"
        raise InputError(
            f"{what}: {oversample}^2 sub-pixels x {n_layers} sensor layers x {len(incident)} sources = {samples:.6g} "
            f"samples per pixel, above the limit of {MAX_SAMPLES_PER_PIXEL} (a 16-pixel tile would need about "
            f"{16 * samples * 175 / 1e9:.3g} GB of memory): lower -oversample, -thicksteps or the number of "
            f"sources (-divsteps, -dispsteps, -sourcefile)")

    # --- structure factors -----------------------------------------------------------------
    F_grid = hkl_min = hkl_max = F_present = None
    if cfg.hkl_file is not None:
        from nbtorch.io.hkl import read_hkl

        table = read_hkl(cfg.hkl_file)
        F_grid, mins = table.to_grid(np.nan)
        try:
            F_present = ~np.isnan(F_grid)  # reflections listed in the file
            np.copyto(F_grid, cfg.default_F, where=~F_present)
        except MemoryError:
            raise InputError(f"{cfg.hkl_file}: not enough memory: {table.grid_description()}") from None
    elif cfg.dump_file is not None:  # -dump without -hkl: read the cache (never a stray Fdump.bin)
        from nbtorch.io.hkl import read_fdump

        try:
            F_grid, mins = read_fdump(cfg.dump_file)
        except InputError as exc:
            raise InputError(f"-dump {exc}") from None
        except MemoryError:
            raise InputError(f"-dump {cfg.dump_file}: not enough memory for its structure-factor grid") from None
        notes.append(f"structure factors read from {cfg.dump_file}")
    elif cfg.default_F == 0.0:
        notes.append("no -hkl file and -default_F 0: every structure factor is zero")
    if F_grid is not None:
        hkl_min = np.array(mins, dtype=np.float64)
        hkl_max = hkl_min + np.array(F_grid.shape) - 1
    interpolate = cfg.interpolate if cfg.interpolate is not None else min(n_cells) <= 2
    if F_grid is None:
        interpolate = False

    fluence = cfg.fluence if cfg.fluence is not None else DEFAULT_FLUENCE
    beamsize = cfg.beamsize_mm / 1000.0
    if cfg.flux != 0.0 and cfg.exposure_s > 0.0 and beamsize > 0:  # (all positive: _validate)
        fluence = cfg.flux * cfg.exposure_s / beamsize / beamsize
    water_m = cfg.water_um * 1e-6
    water_F2N = WATER_F**2 * water_m**3 * 1e6 * AVOGADRO / WATER_MW

    params = {
        "cell_a": cell[0], "cell_b": cell[1], "cell_c": cell[2],
        "cell_alpha": cell[3], "cell_beta": cell[4], "cell_gamma": cell[5],
        "misset_x": misset[0], "misset_y": misset[1], "misset_z": misset[2],
        "phi0": cfg.phi_deg, "mosaic_spread": spread_deg,
        "N_a": n_cells[0], "N_b": n_cells[1], "N_c": n_cells[2],
        "distance": distance_m * 1000.0, "beam_x": beam_x * 1000.0, "beam_y": beam_y * 1000.0,
        "detector_rotx": cfg.detector_rotx_deg, "detector_roty": cfg.detector_roty_deg,
        "detector_rotz": cfg.detector_rotz_deg, "twotheta": cfg.twotheta_deg,
        "wavelength": cfg.wavelength_A, "fluence": fluence,
        "polarization": cfg.polarization, "default_F": cfg.default_F,
    }
    params = {k: float(v) for k, v in params.items()}
    for k, v in params.items():
        if not math.isfinite(v):
            raise InputError(f"parameter {k} is not finite ({v})")
    steps = len(incident) * phisteps * len(fractions) * oversample * oversample
    return Setup(
        config=cfg, c_parity=c_parity, params=params, convention=conv, pivot=pivot,
        beam=beam, fdet=f, sdet=s, odet=o, twotheta_axis=tt, polar_axis=polar, spindle=spindle,
        pixel_m=pixel, fpixels=fpixels, spixels=spixels, detsize_s_m=detsize_s, roi=roi,
        close_distance_given_m=None if cfg.close_distance_mm is None else cfg.close_distance_mm / 1000.0,
        oversample=oversample, thicksteps=n_layers, layer_thickness_m=dz, mu_per_m=mu,
        has_thickness=thick > 0, phisteps=phisteps, phistep_deg=phistep,
        incident=incident, wavelength_factor=wl_factor, mosaic_axes=np.asarray(axes, dtype=np.float64),
        mosaic_fractions=np.asarray(fractions, dtype=np.float64), orientation0=orientation0,
        cell_quirk=cell_quirk, phi_quirk=(cfg.phi_carryover == "c-parity") if cfg.phi_carryover else c_parity, F_grid=F_grid, F_present=F_present, hkl_min=hkl_min, hkl_max=hkl_max, interpolate=bool(interpolate),
        shape=cfg.shape, fudge=cfg.fudge, water_F2N=water_F2N, dmin_A=cfg.dmin_A, steps=steps,
        notes=tuple(notes), pixel_mask=pixel_mask,
    )


def _read_mask(path: str, fpixels: int, spixels: int) -> np.ndarray:
    """``-mask``: True where the SMV pixel is non-zero (simulated), False where it is 0 (skipped)."""
    from nbtorch.io.smv import read_smv

    try:
        image, _ = read_smv(path)
    except InputError as exc:
        raise InputError(f"-mask {exc}") from None
    if image.shape != (spixels, fpixels):
        raise InputError(f"-mask {path}: mask is {image.shape[1]} x {image.shape[0]} pixels but the detector is "
                         f"{fpixels} x {spixels} (fast x slow)")
    mask = np.asarray(image != 0)
    mask.setflags(write=False)
    return mask


def _rotxyz(rx: float, ry: float, rz: float) -> np.ndarray:
    cx, sx, cy, sy, cz, sz = math.cos(rx), math.sin(rx), math.cos(ry), math.sin(ry), math.cos(rz), math.sin(rz)
    mx = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    my = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    mz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return mz @ my @ mx
