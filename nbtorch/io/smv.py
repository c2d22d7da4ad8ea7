"""SMV (ADSC) images, as nanoBragg writes them for ``-intfile`` and ``-noisefile``.

File layout
    An ASCII header of ``HEADER_BYTES`` bytes (512 for nanoBragg; any multiple
    of 512 here when the text is longer, see :func:`format_smv_header`) that starts
    with ``{\\n``, holds one ``KEY=VALUE;`` per line, ends with ``}`` and a form
    feed, and is padded with spaces; then ``SIZE1 * SIZE2`` pixels in row-major
    (slow, fast) order: ``SIZE1`` is the fast (column) count and ``SIZE2`` the
    slow (row) count.  nanoBragg writes ``TYPE=unsigned_short`` in
    ``BYTE_ORDER=little_endian``.

nanoBragg's header
    Keys, in order: HEADER_BYTES DIM BYTE_ORDER TYPE SIZE1 SIZE2 PIXEL_SIZE (mm)
    DISTANCE (mm) WAVELENGTH (Å) BEAM_CENTER_X/Y (mm, nanoBragg's Xbeam/Ybeam)
    ADXV_CENTER_X/Y MOSFLM_CENTER_X/Y DENZO_X/Y_BEAM (mm) DIALS_ORIGIN (mm, three
    comma-separated numbers, and written **without** the trailing ``;``)
    XDS_ORGX/ORGY (pixels) CLOSE_DISTANCE (mm) PHI OSC_START OSC_RANGE TWOTHETA
    (degrees) DETECTOR_SN=000 BEAMLINE=fake.  Every number is C ``%g`` (six
    significant digits).  :func:`smv_header_from_geometry` builds this dict and
    :func:`write_smv` renders it byte-for-byte like the C.

Integer image
    :func:`intfile_from_float` reproduces nanoBragg's ``-intfile`` pixels:
    ``floorf(clip(float * scale + adc, 0, 65535) + 0.5)``, computed in double
    from the float32 pixel and rounded to float32 before the floor (the C
    passes the double to ``floorf``), 0 outside the ROI.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write
from nbtorch.io.raw import read_file_bytes

__all__ = [
    "SMV_HEADER_BYTES",
    "smv_header_from_geometry",
    "format_smv_header",
    "write_smv",
    "smv_bytes",
    "read_smv",
    "intfile_from_float",
    "roi_mask_from_bounds",
    "header_value",
]

SMV_HEADER_BYTES = 512
#: Keys nanoBragg writes without the trailing ';'.
_NO_SEMICOLON = frozenset({"DIALS_ORIGIN"})
_RESERVED = ("HEADER_BYTES", "DIM", "BYTE_ORDER", "TYPE", "SIZE1", "SIZE2")

# SMV TYPE name -> numpy dtype (without byte order)
_TYPE_TO_DTYPE = {
    "unsigned_short": "u2",
    "signed_short": "i2",
    "unsigned_int": "u4",
    "unsigned_long": "u4",
    "signed_int": "i4",
    "signed_long": "i4",
    "float": "f4",
    "float32": "f4",
    "double": "f8",
    "float64": "f8",
}
_DTYPE_TO_TYPE = {"u2": "unsigned_short", "i4": "signed_int", "u4": "unsigned_int", "f4": "float"}


def _fmt_g(value: float) -> str:
    """C ``printf("%g")`` of a double."""
    return "%g" % float(value)


def smv_header_from_geometry(
    *,
    fpixels: int,
    spixels: int,
    pixel_mm: float,
    distance_mm: float,
    wavelength_A: float,
    beam_center_x_mm: float,
    beam_center_y_mm: float,
    adxv_x: float,
    adxv_y: float,
    mosflm_x: float,
    mosflm_y: float,
    denzo_x: float,
    denzo_y: float,
    dials_origin: Sequence[float],
    xds_orgx: float,
    xds_orgy: float,
    close_distance_mm: float,
    phi_deg: float,
    osc_start_deg: float,
    osc_range_deg: float,
    twotheta_deg: float,
) -> dict[str, str]:
    """Return nanoBragg's SMV header as an ordered ``{KEY: formatted value}`` dict.

    Lengths in mm, wavelength in Å, XDS origin in pixels, angles in degrees.
    ``beam_center_x/y_mm`` are nanoBragg's Xbeam/Ybeam; ``adxv_*``,
    ``mosflm_*``, ``denzo_*`` and ``dials_origin`` are the values the C prints
    for those conventions (see the module docstring).
    """
    if len(dials_origin) != 3:
        raise InputError(f"dials_origin must have 3 components, got {len(dials_origin)}")
    return {
        "HEADER_BYTES": str(SMV_HEADER_BYTES),
        "DIM": "2",
        "BYTE_ORDER": "little_endian",
        "TYPE": "unsigned_short",
        "SIZE1": "%d" % int(fpixels),
        "SIZE2": "%d" % int(spixels),
        "PIXEL_SIZE": _fmt_g(pixel_mm),
        "DISTANCE": _fmt_g(distance_mm),
        "WAVELENGTH": _fmt_g(wavelength_A),
        "BEAM_CENTER_X": _fmt_g(beam_center_x_mm),
        "BEAM_CENTER_Y": _fmt_g(beam_center_y_mm),
        "ADXV_CENTER_X": _fmt_g(adxv_x),
        "ADXV_CENTER_Y": _fmt_g(adxv_y),
        "MOSFLM_CENTER_X": _fmt_g(mosflm_x),
        "MOSFLM_CENTER_Y": _fmt_g(mosflm_y),
        "DENZO_X_BEAM": _fmt_g(denzo_x),
        "DENZO_Y_BEAM": _fmt_g(denzo_y),
        "DIALS_ORIGIN": ",".join(_fmt_g(v) for v in dials_origin),
        "XDS_ORGX": _fmt_g(xds_orgx),
        "XDS_ORGY": _fmt_g(xds_orgy),
        "CLOSE_DISTANCE": _fmt_g(close_distance_mm),
        "PHI": _fmt_g(phi_deg),
        "OSC_START": _fmt_g(osc_start_deg),
        "OSC_RANGE": _fmt_g(osc_range_deg),
        "TWOTHETA": _fmt_g(twotheta_deg),
        "DETECTOR_SN": "000",
        "BEAMLINE": "fake",
    }


def _format_value(key: str, value: object) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bool, np.bool_)):
        raise InputError(f"SMV header {key}: boolean values are not allowed")
    elif isinstance(value, (int, np.integer)):
        text = "%d" % int(value)
    elif isinstance(value, (float, np.floating)):
        text = _fmt_g(float(value))
    elif isinstance(value, (Sequence, np.ndarray)):
        text = ",".join(_format_value(key, v) for v in value)
    else:
        raise InputError(f"SMV header {key}: unsupported value type {type(value).__name__}")
    if any(c in text for c in "\n\r\f;}{") or any(c in key for c in "\n\r\f;={} "):
        raise InputError(f"SMV header {key}: key or value contains a forbidden character")
    return text


def format_smv_header(header: Mapping[str, object]) -> bytes:
    """Render an ordered header dict as an SMV header, like nanoBragg; return its bytes.

    The text is padded with spaces to ``SMV_HEADER_BYTES`` (512) bytes, the C's
    header, byte for byte, when it fits.  A longer text (long values, e.g. a
    CUSTOM geometry with many digits) is padded to the next multiple of 512
    bytes and ``HEADER_BYTES`` says that size, which SMV readers honour (the C
    would write the longer text unpadded under ``HEADER_BYTES=512``, shifting
    the pixels; see docs/simulator.md).  ``HEADER_BYTES`` is always first (the
    writer's value replaces any given one).  Values that are not strings are
    formatted with ``%d`` (int) or ``%g`` (float); sequences are comma-joined.
    """
    items = dict(header)
    items.pop("HEADER_BYTES", None)
    lines = []
    for key, value in items.items():
        text = _format_value(key, value)
        lines.append(f"{key}={text}" if key in _NO_SEMICOLON else f"{key}={text};")
    size = SMV_HEADER_BYTES
    while True:  # the HEADER_BYTES line itself grows with the size it states
        body = ("\n".join(["{", f"HEADER_BYTES={size};", *lines]) + "\n}\f").encode("ascii", errors="strict")
        if len(body) <= size:
            return body + b" " * (size - len(body))
        size = -(-len(body) // SMV_HEADER_BYTES) * SMV_HEADER_BYTES


def _smv_type_for(path: str | os.PathLike[str], image: np.ndarray) -> tuple[str, np.dtype]:
    kind = image.dtype.kind + str(image.dtype.itemsize)
    if kind == "f8":
        kind = "f4"
    if kind not in _DTYPE_TO_TYPE:
        raise InputError(
            f"{path}: cannot write an SMV image of dtype {image.dtype} "
            "(use uint16, int32, uint32 or float32; see intfile_from_float)"
        )
    return _DTYPE_TO_TYPE[kind], np.dtype("<" + kind)


def smv_bytes(path: str | os.PathLike[str], image: np.ndarray, header: Mapping[str, object] | None = None) -> bytes:
    """The bytes of the SMV file :func:`write_smv` writes (``path`` only names it in errors)."""
    arr = np.asarray(image)
    if arr.ndim != 2 or arr.size == 0:
        raise InputError(f"{path}: SMV image must be a non-empty 2-D array, got shape {arr.shape}")
    type_name, dtype = _smv_type_for(path, arr)
    fixed = {
        "HEADER_BYTES": str(SMV_HEADER_BYTES),
        "DIM": "2",
        "BYTE_ORDER": "little_endian",
        "TYPE": type_name,
        "SIZE1": str(arr.shape[1]),
        "SIZE2": str(arr.shape[0]),
    }
    merged: dict[str, object] = dict(fixed)
    for key, value in (header or {}).items():
        if key in fixed:
            given = _format_value(key, value)
            if key in ("SIZE1", "SIZE2") and given != fixed[key]:
                raise InputError(f"{path}: header {key}={given} does not match the image ({key}={fixed[key]})")
            continue
        merged[key] = value
    try:
        head = format_smv_header(merged)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    return head + np.ascontiguousarray(arr, dtype=dtype).tobytes()


def write_smv(path: str | os.PathLike[str], image: np.ndarray, header: Mapping[str, object] | None = None) -> None:
    """Write a 2-D ``image`` (slow, fast) as an SMV file (header of 512 bytes, or more if needed). Atomic.

    ``uint16`` is written as ``unsigned_short`` (nanoBragg's type), ``int32`` as
    ``signed_int``, ``uint32`` as ``unsigned_int`` and float32/float64 as
    ``float`` (4-byte IEEE, rounded to float32).  Data are little-endian.
    ``header`` (e.g. from :func:`smv_header_from_geometry` or :func:`read_smv`)
    supplies the other keys, in order.  HEADER_BYTES, DIM, BYTE_ORDER and TYPE
    describe the encoding and are always set by the writer (a header read from
    a big-endian file can be reused); SIZE1/SIZE2, if given, must agree with
    the image, else :class:`InputError`.
    """
    data = smv_bytes(path, image, header)
    with atomic_write(path, "wb") as handle:
        handle.write(data)


_HEADER_BYTES_RE = re.compile(r"HEADER_BYTES\s*=\s*(\d+)")


def _parse_header_text(text: str) -> dict[str, str]:
    header: dict[str, str] = {}
    body = text[1:].split("}", 1)[0]
    for line in body.splitlines():
        for entry in line.split(";"):
            if "=" not in entry:
                continue
            key, value = entry.split("=", 1)
            key = key.strip()
            if key:
                header[key] = value.strip()  # a repeated key keeps its last value, as in the C
    return header


def _header_int(path: str | os.PathLike[str], header: Mapping[str, str], key: str) -> int:
    if key not in header:
        raise InputError(f"{path}: SMV header has no {key}")
    try:
        value = int(header[key])
    except ValueError:
        raise InputError(f"{path}: SMV header {key}={header[key]!r} is not an integer") from None
    if value <= 0:
        raise InputError(f"{path}: SMV header {key}={value} must be positive")
    return value


def read_smv(path: str | os.PathLike[str]) -> tuple[np.ndarray, dict[str, str]]:
    """Read an SMV file; return ``(image (slow, fast), header {KEY: value string})``.

    Supports TYPE unsigned_short, signed_short, unsigned_int/long,
    signed_int/long, float and double in either BYTE_ORDER.  The image is
    returned in native byte order.  The data must be exactly
    ``SIZE1 * SIZE2`` pixels after the header.
    """
    data = read_file_bytes(path, "SMV file")
    if not data.startswith(b"{"):
        raise InputError(f"{path}: not an SMV file (header does not start with '{{')")
    probe = data[:SMV_HEADER_BYTES].decode("latin-1")
    match = _HEADER_BYTES_RE.search(probe)
    if match is None:
        raise InputError(f"{path}: SMV header has no HEADER_BYTES")
    header_bytes = int(match.group(1))
    if header_bytes < 16 or header_bytes > len(data):
        raise InputError(f"{path}: bad HEADER_BYTES={header_bytes} (file is {len(data)} bytes)")
    text = data[:header_bytes].decode("latin-1")
    if "}" not in text:
        raise InputError(f"{path}: SMV header is not closed by '}}' within {header_bytes} bytes")
    header = _parse_header_text(text)
    if header.get("DIM", "2") != "2":
        raise InputError(f"{path}: only 2-D SMV images are supported (DIM={header['DIM']})")
    fast = _header_int(path, header, "SIZE1")
    slow = _header_int(path, header, "SIZE2")
    type_name = header.get("TYPE", "unsigned_short")
    if type_name not in _TYPE_TO_DTYPE:
        raise InputError(f"{path}: unsupported SMV TYPE={type_name!r}")
    order = header.get("BYTE_ORDER", "little_endian")
    if order not in ("little_endian", "big_endian"):
        raise InputError(f"{path}: unsupported BYTE_ORDER={order!r}")
    dtype = np.dtype(("<" if order == "little_endian" else ">") + _TYPE_TO_DTYPE[type_name])
    expected = fast * slow * dtype.itemsize
    found = len(data) - header_bytes
    if found != expected:
        what = "truncated" if found < expected else "has extra bytes"
        raise InputError(
            f"{path}: SMV data {what}: expected {expected} bytes for {fast}x{slow} {type_name}, found {found}"
        )
    image = np.frombuffer(data, dtype=dtype, offset=header_bytes).reshape(slow, fast)
    return image.astype(dtype.newbyteorder("=")), header


_LEADING_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def header_value(path: str | os.PathLike[str], header: Mapping[str, str], keyword: str) -> float | None:
    """A number from an SMV header, found the way nanoBragg's ``ValueOf`` finds it; None if absent.

    The key equal to ``keyword`` if there is one, else the last key that
    contains it (so ``ORGX`` finds ``XDS_ORGX``, as the C's substring search
    does).  The value's leading number is read (``atof``); a value that does
    not start with a number raises :class:`InputError` (the C would read 0).
    """
    if keyword in header:
        key = keyword
    else:
        matches = [k for k in header if keyword in k]
        if not matches:
            return None
        key = matches[-1]
    text = header[key]
    match = _LEADING_NUMBER.match(text)
    if match is None:
        raise InputError(f"{path}: SMV header {key}={text!r} is not a number")
    value = float(match.group(0))
    if not math.isfinite(value):
        raise InputError(f"{path}: SMV header {key}={text!r} is not finite")
    return value


def roi_mask_from_bounds(shape: tuple[int, int], fmin: int, fmax: int, smin: int, smax: int) -> np.ndarray:
    """Boolean (slow, fast) mask of nanoBragg's ``-roi fmin fmax smin smax`` (bounds inclusive)."""
    slow, fast = shape
    mask = np.zeros((slow, fast), dtype=bool)
    mask[max(smin, 0) : max(smax + 1, 0), max(fmin, 0) : max(fmax + 1, 0)] = True
    return mask


def intfile_from_float(
    float_image: np.ndarray,
    scale: float | None = None,
    adc: float = 40.0,
    roi_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """nanoBragg's ``-intfile`` pixels from a photon image; return ``(uint16 (slow, fast), scale_used)``.

    ``scale`` > 0 is used as given (``-scale``); otherwise it is
    ``55000 / max_I`` with ``max_I`` the largest pixel inside the ROI (1.0 if
    that is not positive).  The image is first rounded to float32, since the C
    keeps its float image in float32.  Pixels outside ``roi_mask`` (True =
    inside) are 0, and NaN pixels become 0.
    """
    img = np.asarray(float_image)
    if img.ndim != 2:
        raise InputError(f"intfile_from_float: image must be 2-D, got shape {img.shape}")
    values = img.astype(np.float32).astype(np.float64)
    if roi_mask is None:
        inside = np.ones(values.shape, dtype=bool)
    else:
        inside = np.asarray(roi_mask, dtype=bool)
        if inside.shape != values.shape:
            raise InputError(f"intfile_from_float: roi_mask shape {inside.shape} != image shape {values.shape}")
    if scale is None or not scale > 0.0:
        roi_values = values[inside]
        roi_values = roi_values[~np.isnan(roi_values)]
        max_I = max(0.0, float(roi_values.max())) if roi_values.size else 0.0
        scale_used = 55000.0 / max_I if max_I > 0.0 else 1.0
    else:
        scale_used = float(scale)
    if not math.isfinite(scale_used):
        raise InputError(f"intfile_from_float: scale {scale_used} is not finite")
    test = np.clip(values * scale_used + float(adc), 0.0, 65535.0)
    rounded = np.floor((test + 0.5).astype(np.float32))
    rounded[~inside | np.isnan(rounded)] = 0.0
    return rounded.astype(np.uint16), scale_used
