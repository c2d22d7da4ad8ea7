"""8-bit PGM preview images, as nanoBragg writes them for ``-pgmfile``.

File layout (binary PGM, "P5")::

    P5\\n<fpixels> <spixels>\\n# pixels scaled by <scale %g>\\n255\\n<bytes>

followed by ``fpixels * spixels`` unsigned bytes in row-major (slow, fast)
order.  Pixel value = ``(unsigned char) min(255, float * scale)`` (truncation
toward zero; negative values give 0 here, undefined in the C); pixels outside
the ROI are 0.

Default scale (nanoBragg ``-pgmscale`` not given): ``250 / (5 * rmsd)`` where
``rmsd`` is the sample standard deviation of the ROI pixels (about their
mean, divided by ``n - 1``, sums taken in order in double precision as the C
does); when ``rmsd`` is 0 the int-file scale is used instead (``55000 / max``,
or 1.0 when the maximum is not positive, unless an ``intfile_scale`` is given).
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write
from nbtorch.io.raw import read_file_bytes

__all__ = ["write_pgm", "pgm_bytes", "read_pgm", "default_pgm_scale"]


def _roi_values(path: str, image: np.ndarray, roi_mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    values = image.astype(np.float32).astype(np.float64)
    if roi_mask is None:
        return values, np.ones(values.shape, dtype=bool)
    inside = np.asarray(roi_mask, dtype=bool)
    if inside.shape != values.shape:
        raise InputError(f"{path}: roi_mask shape {inside.shape} != image shape {values.shape}")
    return values, inside


def default_pgm_scale(
    float_image: np.ndarray, roi_mask: np.ndarray | None = None, intfile_scale: float | None = None
) -> float:
    """The scale nanoBragg picks for its PGM when ``-pgmscale`` is not given (see module docstring)."""
    values, inside = _roi_values("default_pgm_scale", np.asarray(float_image), roi_mask)
    roi = values[inside]
    n = roi.size
    # nanoBragg sums in pixel order in double precision: cumsum reproduces that order.
    total = float(np.cumsum(roi)[-1]) if n else 0.0
    avg = total / (n if n > 0 else 1)
    sumsqr = float(np.cumsum((roi - avg) ** 2)[-1]) if n else 0.0
    rmsd = math.sqrt(sumsqr / ((n if n > 1 else 2) - 1))
    if rmsd > 0.0:
        return 250.0 / (5.0 * rmsd)
    if intfile_scale is not None and intfile_scale > 0.0:
        return float(intfile_scale)
    max_I = max(0.0, float(roi.max())) if n else 0.0
    return 55000.0 / max_I if max_I > 0.0 else 1.0


def write_pgm(
    path: str | os.PathLike[str],
    float_image: np.ndarray,
    scale: float | None = None,
    roi_mask: np.ndarray | None = None,
) -> float:
    """Write a 2-D (slow, fast) photon image as nanoBragg's 8-bit PGM; return the scale used. Atomic.

    ``scale`` > 0 is used as given, otherwise :func:`default_pgm_scale`.
    ``roi_mask`` (True = inside) zeroes the pixels outside the ROI.
    """
    data, used = pgm_bytes(path, float_image, scale, roi_mask)
    with atomic_write(path, "wb") as handle:
        handle.write(data)
    return used


def pgm_bytes(
    path: str | os.PathLike[str],
    float_image: np.ndarray,
    scale: float | None = None,
    roi_mask: np.ndarray | None = None,
) -> tuple[bytes, float]:
    """``(the bytes :func:`write_pgm` writes, the scale used)``; ``path`` only names the file in errors."""
    img = np.asarray(float_image)
    if img.ndim != 2 or img.size == 0:
        raise InputError(f"{path}: PGM image must be a non-empty 2-D array, got shape {img.shape}")
    values, inside = _roi_values(str(path), img, roi_mask)
    used = float(scale) if scale is not None and scale > 0.0 else default_pgm_scale(img, roi_mask)
    if not math.isfinite(used):
        raise InputError(f"{path}: PGM scale {used} is not finite")
    test = np.minimum(values * used, 255.0)
    test[~inside | ~(test > 0.0)] = 0.0  # also maps NaN and negatives to 0
    pixels = np.trunc(test).astype(np.uint8)
    slow, fast = img.shape
    head = f"P5\n{fast} {slow}\n# pixels scaled by {'%g' % used}\n255\n".encode("ascii")
    return head + pixels.tobytes(), used


_TOKEN = re.compile(rb"(?:\s|#[^\n]*\n)*([^\s#]+)")


def read_pgm(path: str | os.PathLike[str]) -> np.ndarray:
    """Read a binary (P5) PGM; return uint8 (or uint16 if maxval > 255) array (slow, fast).

    Comments (``#`` to end of line) are allowed between header tokens.
    """
    data = read_file_bytes(path, "PGM file")
    if not data.startswith(b"P5"):
        raise InputError(f"{path}: not a binary PGM file (does not start with 'P5')")
    pos = 2
    fields = []
    for name in ("width", "height", "maxval"):
        match = _TOKEN.match(data, pos)
        if match is None or not match.group(1).isdigit():
            raise InputError(f"{path}: bad PGM header: missing or invalid {name}")
        fields.append(int(match.group(1)))
        pos = match.end()
    width, height, maxval = fields
    if width <= 0 or height <= 0 or not 0 < maxval < 65536:
        raise InputError(f"{path}: bad PGM header: width={width} height={height} maxval={maxval}")
    if pos >= len(data) or not data[pos : pos + 1].isspace():
        raise InputError(f"{path}: bad PGM header: no whitespace after maxval")
    pos += 1
    dtype = np.dtype("u1") if maxval < 256 else np.dtype(">u2")
    expected = width * height * dtype.itemsize
    found = len(data) - pos
    if found < expected:
        raise InputError(f"{path}: PGM data truncated: expected {expected} bytes, found {found}")
    image = np.frombuffer(data, dtype=dtype, count=width * height, offset=pos).reshape(height, width)
    return image.astype(dtype.newbyteorder("="))
