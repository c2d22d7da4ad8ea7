"""The detector's unit vectors and pivot per convention, with ``-fdet_vector`` ... for CUSTOM.

:func:`detector_axes` returns ``(beam, fdet, sdet, odet, twotheta_axis, polar, spindle)``
(unit vectors, lab frame, before any detector rotation) as in the table of
``docs/conventions.md``; CUSTOM starts from MOSFLM's vectors (two-theta axis
(0, 1, 0)) and takes any vector flag given.  An ``-odet_vector`` whose length is
not exactly 1 is replaced by ``unit(f x s)``.  Parallel axes (fast/slow, fast or
slow/normal, beam/polarization) are refused, naming the flags that gave them.
:data:`FORCED_PIVOT`: the conventions that fix the pivot.  Called by
:func:`nbtorch.rules.resolve.resolve_detector`.
"""

from __future__ import annotations

import numpy as np

from nbtorch.config import CONVENTIONS, SimulationConfig
from nbtorch.errors import InputError

__all__ = ["detector_axes", "FORCED_PIVOT"]

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
FORCED_PIVOT = {"mosflm": "beam", "denzo": "beam", "adxv": "beam", "xds": "sample", "dials": "sample"}


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    n = np.linalg.norm(v)
    if not np.isfinite(n) or n == 0:
        raise InputError(f"vector {tuple(v)} has zero or non-finite length")
    return v / n


def detector_axes(cfg: SimulationConfig):
    """``(beam, fdet, sdet, odet, twotheta_axis, polar, spindle)`` unit vectors for ``cfg``'s convention."""
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
