"""Detector modules: where the modules of a Pilatus or Eiger image lie, from the detector type.

A Pilatus or Eiger image is one array whose modules are separated by fixed gaps of insensitive pixels (the
readers give them as -1 or masked).  :data:`MODULE_GRIDS` holds each family's module size and gaps (pixels):

============  ================  =========================  ==========================================
family        module (f x s)    gaps (fast, slow)          e.g.
============  ================  =========================  ==========================================
``pilatus``   487 x 195         7, 17                      6M: 2463 x 2527 = 5 x 12 modules
``eiger``     1030 x 514        10, 37                     16M: 4150 x 4371 = 4 x 8 modules
============  ================  =========================  ==========================================

:func:`detector_family` reads the family from a header (``Detector: PILATUS3 6M``, an HDF5 ``description``)
and checks the image size; :func:`module_grid` gives each module's ``(x0, y0, width, height)`` (pixels,
fast x and slow y of its first pixel), row by row (slow) and, in a row, along fast, the order DIALS gives
the panels of these detectors; :func:`split_modules` cuts the image.  numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nbtorch.errors import InputError

__all__ = ["ModuleGrid", "MODULE_GRIDS", "detector_family", "module_grid", "split_modules"]


@dataclass(frozen=True)
class ModuleGrid:
    """One family's module size and the gaps between modules (pixels)."""

    width: int  # along fast
    height: int  # along slow
    gap_fast: int
    gap_slow: int

    def count(self, size: int, module: int, gap: int) -> int | None:
        """Modules along an axis of ``size`` pixels, or None when the size is not n modules and n-1 gaps."""
        n, rest = divmod(size + gap, module + gap)
        return n if n >= 1 and rest == 0 else None


MODULE_GRIDS = {"pilatus": ModuleGrid(487, 195, 7, 17), "eiger": ModuleGrid(1030, 514, 10, 37)}


def _fits(family: str, shape) -> bool:
    g = MODULE_GRIDS[family]
    return g.count(int(shape[1]), g.width, g.gap_fast) is not None and g.count(int(shape[0]), g.height,
                                                                                 g.gap_slow) is not None


def detector_family(header, shape, what: str = "image") -> str:
    """``"pilatus"`` or ``"eiger"`` from a header (text, or a dict whose values are searched) whose image is
    ``shape`` (slow, fast).

    Raises:
        InputError: no known family named in the header, or an image size that is not whole modules and gaps.
    """
    text = " ".join(str(v) for v in header.values()) if isinstance(header, dict) else str(header)
    found = [f for f in MODULE_GRIDS if f in text.lower()]
    if not found:
        raise InputError(f"{what}: the header names no detector of modules ({', '.join(MODULE_GRIDS)})")
    family = found[0]
    if not _fits(family, shape):
        g = MODULE_GRIDS[family]
        raise InputError(f"{what}: {shape[1]} x {shape[0]} pixels (fast x slow) is not a whole number of "
                         f"{family} modules ({g.width} x {g.height} with gaps of {g.gap_fast} and {g.gap_slow})")
    return family


def module_grid(family: str, shape) -> list[tuple[int, int, int, int]]:
    """``(x0, y0, width, height)`` of every module of a ``family`` image of ``shape`` (slow, fast), row by row."""
    if family not in MODULE_GRIDS:
        raise InputError(f"unknown detector family {family!r}; expected one of {', '.join(MODULE_GRIDS)}")
    g = MODULE_GRIDS[family]
    nf, ns = g.count(int(shape[1]), g.width, g.gap_fast), g.count(int(shape[0]), g.height, g.gap_slow)
    if nf is None or ns is None:
        raise InputError(f"{shape[1]} x {shape[0]} pixels is not a whole number of {family} modules")
    return [(i * (g.width + g.gap_fast), j * (g.height + g.gap_slow), g.width, g.height)
            for j in range(ns) for i in range(nf)]


def split_modules(image: np.ndarray, family: str) -> list[np.ndarray]:
    """The modules of ``image`` (slow, fast), as views, in :func:`module_grid` order."""
    return [image[y0:y0 + h, x0:x0 + w] for x0, y0, w, h in module_grid(family, image.shape)]
