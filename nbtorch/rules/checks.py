"""The checks of a configuration before it is resolved (:mod:`nbtorch.rules.resolve`): positive numbers, the cell,
the crystal size matrix, the anisotropic mosaic and the whole configuration (:func:`validate`), and the pixel mask
file (:func:`read_mask`).
"""

from __future__ import annotations

import math

import numpy as np

from nbtorch.config import ANISOTROPIC_SHAPE, SHAPES, SimulationConfig
from nbtorch.errors import InputError
from nbtorch.io.smv import read_smv


def check_positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    bad = (value < 0) if allow_zero else (value <= 0)
    if not math.isfinite(value) or bad:
        need = "non-negative" if allow_zero else "positive"
        raise InputError(f"{name}: must be {need} and finite, got {value:g}")


# --------------------------------------------------------------------------------------
# checks of the config
# --------------------------------------------------------------------------------------
def check_cell(cell, label: str) -> None:
    """Raise unless ``(a, b, c, alpha, beta, gamma)`` (Å, degrees) is a possible unit cell."""
    a, b, c, al, be, ga = (float(v) for v in cell)
    for name, v in zip(("a", "b", "c"), (a, b, c)):
        check_positive(f"{label} {name}", v)
    for name, v in zip(("alpha", "beta", "gamma"), (al, be, ga)):
        if not (0.0 < v < 180.0):
            raise InputError(f"{label} {name}: angle must be between 0 and 180 degrees, got {v:g}")
    if not (al < be + ga and be < al + ga and ga < al + be and al + be + ga < 360.0):
        raise InputError(f"{label}: angles {al:g} {be:g} {ga:g} do not make a unit cell "
                         "(each < sum of the others, sum < 360)")


def check_size_matrix(n_cells, label: str) -> None:
    """Raise unless the symmetric size matrix of ``n_cells`` (Na Nb Nc Nd Ne Nf, unit cells) is positive
    definite (``-gauss_aniso_xtal``: the crystal's extent along every direction must be positive)."""
    na, nb, nc, nd, ne, nf = (float(v) for v in n_cells)
    if not all(math.isfinite(v) for v in (na, nb, nc, nd, ne, nf)):
        raise InputError(f"{label}: the crystal sizes must be finite, got {na:g} {nb:g} {nc:g} {nd:g} {ne:g} {nf:g}")
    eig = np.linalg.eigvalsh(np.array([[na, nd, nf], [nd, nb, ne], [nf, ne, nc]]))
    if not eig.min() > 0:
        raise InputError(f"{label}: the size matrix [[Na Nd Nf] [Nd Nb Ne] [Nf Ne Nc]] = [[{na:g} {nd:g} {nf:g}] "
                         f"[{nd:g} {nb:g} {ne:g}] [{nf:g} {ne:g} {nc:g}]] is not positive definite (eigenvalues "
                         f"{' '.join(f'{v:.3g}' for v in eig)}); make the off-diagonal terms smaller")


def _check_size_matrix(cfg: SimulationConfig) -> None:
    """The off-diagonal sizes -Nd -Ne -Nf: only with -gauss_aniso_xtal, and N positive definite there."""
    off = {"-Nd": cfg.N_d, "-Ne": cfg.N_e, "-Nf": cfg.N_f}
    for flag, v in off.items():
        if not math.isfinite(v):
            raise InputError(f"{flag}: value is not finite ({v})")
    if cfg.shape != ANISOTROPIC_SHAPE:
        given = [f"{k} {v:g}" for k, v in off.items() if v != 0]
        if given:
            raise InputError(f"{', '.join(given)}: the off-diagonal crystal sizes act only with -gauss_aniso_xtal "
                             f"(the crystal shape is {cfg.shape})")
        return
    diag = (max(1.0, float(v)) for v in (cfg.N_a, cfg.N_b, cfg.N_c))
    check_size_matrix((*diag, cfg.N_d, cfg.N_e, cfg.N_f), "-gauss_aniso_xtal")


def _check_mosaic_abc(cfg: SimulationConfig) -> None:
    """``-mosaic_abc``: three finite spreads >= 0 (deg), spec mode only (the C has no anisotropic mosaic)."""
    abc = cfg.mosaic_spread_abc_deg
    if abc is None:
        return
    if cfg.c_parity:
        raise InputError("-mosaic_abc: the anisotropic mosaic is a spec-mode model; drop it or -c_parity")
    if len(abc) != 3 or not all(math.isfinite(v) and v >= 0 for v in abc):
        raise InputError(f"-mosaic_abc: expected three finite spreads >= 0 (deg), got {' '.join(map(str, abc))}")


def validate(cfg: SimulationConfig) -> None:
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
                            ("fluence", "-fluence"), ("hkl_dmin_A", "-hkl_dmin")):
        check_positive(flag(field_, default), getattr(cfg, field_))
    for field_, default in (("N_a", "-Na"), ("N_b", "-Nb"), ("N_c", "-Nc"), ("flux", "-flux"),
                            ("exposure_s", "-exposure"), ("beamsize_mm", "-beamsize")):
        check_positive(flag(field_, default), getattr(cfg, field_), allow_zero=True)
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
        check_positive(flag(field_, default), getattr(cfg, field_), allow_zero=True)
    _check_mosaic_abc(cfg)
    if cfg.flux > 0:  # fluence = flux * exposure / beamsize^2
        for field_, default in (("exposure_s", "-exposure"), ("beamsize_mm", "-beamsize")):
            if getattr(cfg, field_) == 0:
                raise InputError(f"{flag(field_, default)}: must be positive to compute the fluence from -flux, got 0")
    if cfg.shape not in SHAPES:
        raise InputError(f"unknown crystal shape {cfg.shape!r}")
    _check_size_matrix(cfg)
    if cfg.dtype not in ("float32", "float64"):
        raise InputError(f"-dtype: expected float32 or float64, got {cfg.dtype!r}")
    if not (cfg.device == "cpu" or cfg.device.startswith("cuda")):
        raise InputError(f"-device: expected cpu or cuda[:N], got {cfg.device!r}")


def read_mask(path: str, fpixels: int, spixels: int) -> np.ndarray:
    """``-mask``: True where the SMV pixel is non-zero (simulated), False where it is 0 (skipped)."""
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
