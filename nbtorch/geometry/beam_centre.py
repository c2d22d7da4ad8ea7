"""Beam centre <-> detector offsets for the six detector conventions (the one home of this maths).

Three descriptions of where the direct beam meets the detector:

* **user values**, what the flags say: ``-Xbeam -Ybeam`` (mm) for MOSFLM, DENZO,
  ADXV and CUSTOM; ``-ORGX -ORGY`` (pixels) for XDS and DIALS;
* **canonical** ``beam_x, beam_y`` (the simulator parameters; mm in the parameter
  table, metres here): the user's ``Xbeam, Ybeam``, or ``ORGX*pixel, ORGY*pixel``;
* **detector offsets** ``Fbeam, Sbeam, Fclose, Sclose`` (m): positions along the
  fast and slow axes measured from ``pix0``, the corner of pixel (0, 0), of the
  direct-beam spot (BEAM pivot) and of the point nearest the sample (SAMPLE pivot).

==========  ================================================  ==========================================
convention  canonical -> offsets (p = pixel size)             default canonical centre
==========  ================================================  ==========================================
MOSFLM      Fbeam = beam_y + p/2, Sbeam = beam_x + p/2        ((detsize_s + p)/2, (detsize_f + p)/2)
DENZO       Fbeam = beam_y, Sbeam = beam_x                    as MOSFLM
ADXV        Fbeam = beam_x, Sbeam = detsize_s - beam_y        ((detsize_f + p)/2, (detsize_s - p)/2)
XDS, DIALS  Fclose = beam_x - p/2, Sclose = beam_y - p/2      the close point (default: detector centre)
CUSTOM      Fbeam = Fclose = beam_x, Sbeam = Sclose = beam_y  the close point
==========  ================================================  ==========================================

:func:`detector_offsets_m` returns one pair twice, as ``(Fbeam, Sbeam)`` and as
``(Fclose, Sclose)``: the pivot uses one of them (BEAM: the beam pair, SAMPLE: the
close pair) and the detector geometry
(:func:`nbtorch.physics.detector.detector_geometry`) derives the true other pair
from the rotated detector.  ``ORGX = Fclose/p + 1/2``: ORGX counts pixel centres from 1.

The functions are plain arithmetic: lengths may be Python floats or tensors
(the simulator differentiates through :func:`detector_offsets_m`).  Documented in
``docs/conventions.md`` ("Beam centre").

Also here: :func:`close_point_m` (the near point's default, the detector centre), :func:`header_beam_offsets`
(an image header's MOSFLM or DENZO beam centre as the spot from the corner, MOSFLM's half pixel) and
:func:`swung_beam_spot_m`, the one rule that needs the detector's geometry: where a BEAM-pivot convention
puts the beam spot of a detector that a header describes by its near point before a two-theta swing.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nbtorch.config import CONVENTIONS, SimulationConfig
from nbtorch.geometry.detector_axes import detector_axes
from nbtorch.errors import InputError
from nbtorch.physics.detector import detector_geometry

__all__ = ["CONVENTIONS", "XBEAM_CONVENTIONS", "ORG_CONVENTIONS", "detector_offsets_m", "beam_centre_from_offsets_m",
           "default_beam_centre_m", "close_point_m", "close_from_org_m", "org_from_close_px", "header_beam_offsets",
           "beam_centre_flags", "swung_beam_spot_m"]

#: conventions whose user beam centre is ``-Xbeam -Ybeam`` (mm)
XBEAM_CONVENTIONS = ("mosflm", "denzo", "adxv", "custom")
#: conventions whose user beam centre is ``-ORGX -ORGY`` (pixels)
ORG_CONVENTIONS = ("xds", "dials")


def _check(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown detector convention {convention!r}; expected one of {', '.join(CONVENTIONS)}")


def detector_offsets_m(convention: str, beam_x_m, beam_y_m, pixel_m, detsize_s_m):
    """Canonical beam centre (m) -> ``(Fbeam_m, Sbeam_m, Fclose_m, Sclose_m)`` along fast/slow from pix0."""
    _check(convention)
    half_m = pixel_m / 2.0
    if convention == "mosflm":
        fbeam_m, sbeam_m = beam_y_m + half_m, beam_x_m + half_m
        return fbeam_m, sbeam_m, fbeam_m, sbeam_m
    if convention == "denzo":
        return beam_y_m, beam_x_m, beam_y_m, beam_x_m
    if convention == "adxv":
        return beam_x_m, detsize_s_m - beam_y_m, beam_x_m, detsize_s_m - beam_y_m
    if convention in ORG_CONVENTIONS:
        fclose_m, sclose_m = beam_x_m - half_m, beam_y_m - half_m
        return fclose_m, sclose_m, fclose_m, sclose_m
    return beam_x_m, beam_y_m, beam_x_m, beam_y_m  # custom


def beam_centre_from_offsets_m(convention: str, fast_m, slow_m, pixel_m, detsize_s_m):
    """The inverse of :func:`detector_offsets_m`: offsets (m) -> canonical ``(beam_x_m, beam_y_m)``.

    ``fast_m, slow_m`` are ``Fbeam, Sbeam`` for MOSFLM, DENZO, ADXV and CUSTOM, and
    ``Fclose, Sclose`` for XDS and DIALS (equal for a detector normal to the beam).
    """
    _check(convention)
    half_m = pixel_m / 2.0
    if convention == "mosflm":
        return slow_m - half_m, fast_m - half_m
    if convention == "denzo":
        return slow_m, fast_m
    if convention == "adxv":
        return fast_m, detsize_s_m - slow_m
    if convention in ORG_CONVENTIONS:
        return fast_m + half_m, slow_m + half_m
    return fast_m, slow_m  # custom


def default_beam_centre_m(convention: str, pixel_m: float, detsize_f_m: float, detsize_s_m: float,
                          close_m: tuple[float, float] | None = None) -> tuple[float, float]:
    """Canonical beam centre (m) when no beam-centre flag is given (nanoBragg's defaults).

    ``close_m``: ``(Fclose, Sclose)`` of the near point (from ``-ORGX/-ORGY``, or for
    CUSTOM ``-Xclose/-Yclose``); default the detector centre.  XDS, DIALS and CUSTOM
    put the beam there; MOSFLM and DENZO half a pixel past the centre along each
    axis; ADXV half a pixel past it along fast and half a pixel short of it along the
    flipped slow axis.
    """
    _check(convention)
    if convention in ("mosflm", "denzo"):
        return (detsize_s_m + pixel_m) / 2.0, (detsize_f_m + pixel_m) / 2.0
    if convention == "adxv":
        return (detsize_f_m + pixel_m) / 2.0, (detsize_s_m - pixel_m) / 2.0
    fclose_m, sclose_m = close_m if close_m is not None else (detsize_f_m / 2.0, detsize_s_m / 2.0)
    return beam_centre_from_offsets_m(convention, fclose_m, sclose_m, pixel_m, detsize_s_m)


def close_point_m(org_x_px: float | None, org_y_px: float | None, pixel_m: float, detsize_f_m: float,
                  detsize_s_m: float) -> tuple[float, float]:
    """``(Fclose, Sclose)`` (m) of the near point: from ``-ORGX/-ORGY`` (pixels) where given, else the centre of
    a ``detsize_f_m`` x ``detsize_s_m`` detector (nanoBragg's default, each axis on its own)."""
    fclose_m = close_from_org_m(org_x_px, pixel_m) if org_x_px is not None else detsize_f_m / 2.0
    sclose_m = close_from_org_m(org_y_px, pixel_m) if org_y_px is not None else detsize_s_m / 2.0
    return fclose_m, sclose_m


def header_beam_offsets(convention: str, centre_x, centre_y, pixel) -> tuple:
    """A beam centre as an image header states it in ``convention``'s terms (MOSFLM ``MOSFLM_CENTER_X/Y``,
    DENZO ``DENZO_X/Y_BEAM``; ADSC's ``BEAM_CENTER_X/Y`` read as DENZO, as DIALS reads them) -> the direct-beam
    spot ``(Fbeam, Sbeam)`` along fast and slow from the corner of pixel (0, 0): MOSFLM adds half a pixel.
    Any length unit (the result is in the same one as the arguments)."""
    if convention not in ("mosflm", "denzo"):
        raise ValueError(f"header_beam_offsets: MOSFLM or DENZO terms only, got {convention!r}")
    fbeam, sbeam, _, _ = detector_offsets_m(convention, centre_x, centre_y, pixel, None)
    return fbeam, sbeam


def close_from_org_m(org_px: float, pixel_m: float) -> float:
    """``-ORGX`` or ``-ORGY`` (pixels, pixel centres counted from 1) -> ``Fclose_m`` or ``Sclose_m``."""
    return (org_px - 0.5) * pixel_m


def org_from_close_px(close_m: float, pixel_m: float) -> float:
    """``Fclose_m`` or ``Sclose_m`` -> ``ORGX`` or ``ORGY`` in pixels (the inverse of :func:`close_from_org_m`)."""
    return close_m / pixel_m + 0.5


def beam_centre_flags(convention: str, beam_x_mm: float, beam_y_mm: float, pixel_mm: float) -> list[str]:
    """The nanoBragg flags that give canonical ``beam_x_mm, beam_y_mm`` in ``convention``.

    ``-Xbeam X -Ybeam Y`` (mm) for MOSFLM, DENZO, ADXV, CUSTOM; ``-ORGX -ORGY`` (pixels,
    ``beam_x / pixel``) for XDS and DIALS.  Numbers are written with ``repr`` (exact).
    """
    _check(convention)
    if convention in ORG_CONVENTIONS:
        return ["-ORGX", repr(float(beam_x_mm / pixel_mm)), "-ORGY", repr(float(beam_y_mm / pixel_mm))]
    return ["-Xbeam", repr(float(beam_x_mm)), "-Ybeam", repr(float(beam_y_mm))]


def swung_beam_spot_m(cfg: SimulationConfig, twotheta_deg: float, fclose_m: float, sclose_m: float,
                      distance_m: float) -> tuple[float, float, float]:
    """The direct-beam spot (Fbeam, Sbeam, m) and the along-beam distance (m) of a detector whose near point
    is (fclose, sclose) at ``distance`` before it swings by ``twotheta`` about the sample: what a BEAM-pivot
    convention needs to place the same detector (nbtorch.physics.detector.detector_geometry, SAMPLE pivot).
    ``cfg`` gives the convention's axes and the detector rotations.

    Raises:
        InputError: the direct beam does not meet the swung detector (a header's two-theta that a beam-pivot
            convention cannot place).
    """
    beam, f, s, o, axis, _, _ = detector_axes(cfg)

    def t(v) -> torch.Tensor:
        return torch.as_tensor(np.asarray(v, dtype=np.float64))

    rot = [t(math.radians(a)) for a in (cfg.detector_rotx_deg, cfg.detector_roty_deg, cfg.detector_rotz_deg)]
    zero = t(0.0)
    g = detector_geometry(t(f), t(s), t(o), t(beam), t(axis), "sample", t(distance_m), zero, zero, t(fclose_m),
                          t(sclose_m), *rot, t(math.radians(twotheta_deg)))
    cos_in = float(g.odet @ g.beam)
    along = float(g.pix0 @ g.odet) / cos_in if abs(cos_in) > 1e-6 else math.inf
    if not (math.isfinite(along) and along > 0):
        raise InputError(f"two-theta {twotheta_deg:g} deg from the header: the direct beam does not meet the swung "
                         "detector, so the beam-pivot convention cannot place it; use a sample-pivot convention "
                         "(--model -xds or -dials) or give -twotheta yourself")
    hit = along * g.beam - g.pix0
    return float(hit @ g.fdet), float(hit @ g.sdet), along
