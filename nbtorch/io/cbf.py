"""Pilatus mini-CBF images with ``x-CBF_BYTE_OFFSET`` compression.

File layout
    A CIF text part holding the Pilatus header lines (``# Wavelength 0.96859 A``,
    ``# Detector_distance 0.35100 m``, ``# Beam_xy (1261.61, 1306.96) pixels``,
    ``# Pixel_size 172e-6 m x 172e-6 m`` ...), then a MIME-like binary section
    (``X-Binary-Size``, ``X-Binary-Number-of-Elements``,
    ``X-Binary-Size-Fastest-Dimension``, ``X-Binary-Size-Second-Dimension``,
    ``Content-MD5``), the 4-byte marker ``0C 1A 04 D5`` and ``X-Binary-Size``
    bytes of compressed data.  Files compressed as a whole with bzip2 or gzip
    are recognised by their magic bytes and decompressed transparently.  A section in another of
    CBFlib's compressions (``x-CBF_PACKED`` ...) is decoded by CBFlib (:mod:`nbtorch.io.cbflib_arrays`,
    needs ``pycbf``).

Byte-offset compression
    Each pixel is stored as the difference from the previous one (the first
    from 0): one signed byte if it fits in -127..127; otherwise the escape byte
    0x80 followed by a little-endian int16; if that does not fit, 0x80 0x00 0x80
    (int16 value -32768 as a second escape) then an int32; then ``00 00 00 80``
    and an int64.  Decoding here is vectorised: the 0x80 bytes are candidate
    escapes, and the true ones (those not inside another escape's payload) are
    the chain of candidates reachable from the first one, found by pointer
    doubling in ``O(M log M)`` for ``M`` candidates.

Image: int32, shape (slow, fast) = (Second-Dimension, Fastest-Dimension).
Pilatus marks module gaps with -1 and bad pixels with -2.

Header dict returned by :func:`read_cbf`: numeric fields when present —
``wavelength_A``, ``distance_mm``, ``beam_x_px``, ``beam_y_px`` (fast, slow),
``pixel_size_mm`` (fast), ``pixel_size_slow_mm``, ``count_cutoff``,
``polarization``, ``exposure_time_s``, ``exposure_period_s``,
``start_angle_deg``, ``angle_increment_deg``, ``detector_2theta_deg``,
``sensor_thickness_mm``, ``flux``, ``filter_transmission`` — plus the strings
``detector`` and ``timestamp``, ``pilatus`` (every ``# key value`` line as
``{key: value text}``) and ``binary`` (the binary section's header fields).
"""

from __future__ import annotations

import base64
import bz2
import gzip
import hashlib
import logging
import math
import os
import re
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write
from nbtorch.io.cbflib_arrays import cbflib_compression, decode_arrays
from nbtorch.io.raw import read_file_bytes

__all__ = ["read_cbf", "write_cbf", "decode_byte_offset", "encode_byte_offset", "parse_pilatus_lines", "binary_headers",
           "binary_int", "binary_conversion", "check_payload", "decompress_cbf", "BINARY_MARKER"]

log = logging.getLogger(__name__)

BINARY_MARKER = _MARKER = b"\x0c\x1a\x04\xd5"  # start of a binary section's data
_PADDING = 4095
# Pilatus line key -> (header key, factor to our unit, unit written by write_cbf)
_SIMPLE_FIELDS = {
    "Wavelength": ("wavelength_A", 1.0, "A"),
    "Detector_distance": ("distance_mm", 1000.0, "m"),
    "Exposure_time": ("exposure_time_s", 1.0, "s"),
    "Exposure_period": ("exposure_period_s", 1.0, "s"),
    "Count_cutoff": ("count_cutoff", 1.0, "counts"),
    "Polarization": ("polarization", 1.0, ""),
    "Start_angle": ("start_angle_deg", 1.0, "deg."),
    "Angle_increment": ("angle_increment_deg", 1.0, "deg."),
    "Detector_2theta": ("detector_2theta_deg", 1.0, "deg."),
    "Flux": ("flux", 1.0, ""),
    "Filter_transmission": ("filter_transmission", 1.0, ""),
}
_LENGTH_TO_MM = {"m": 1000.0, "mm": 1.0, "um": 1e-3, "micron": 1e-3}
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


# ----------------------------------------------------------------------------- codec


def decode_byte_offset(data: bytes | np.ndarray, n_elements: int, source: str = "<data>") -> np.ndarray:
    """Decode ``n_elements`` byte-offset-compressed values; return int64 array."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(data, dtype=np.uint8)
    else:
        raw = np.asarray(data, dtype=np.uint8).reshape(-1)
    size = int(raw.size)
    buf = np.concatenate([raw, np.zeros(16, dtype=np.uint8)])
    cand = np.flatnonzero(raw == 0x80)
    m = cand.size
    if m:
        lo16 = buf[cand + 1].astype(np.uint32) | (buf[cand + 2].astype(np.uint32) << 8)
        word32 = np.zeros(m, dtype=np.uint64)
        for i in range(4):
            word32 |= buf[cand + 3 + i].astype(np.uint64) << np.uint64(8 * i)
        length = np.where(lo16 != 0x8000, 3, np.where(word32 != 0x80000000, 7, 15)).astype(np.int64)
        # successor of each candidate: the first candidate at or after the end of its element
        succ = np.append(np.searchsorted(cand, cand + length, side="left"), m)
        # The real escapes are the chain 0 -> succ[0] -> ...  Pointer doubling: after
        # step k, `on` holds the first 2**k chain links and `succ` jumps 2**k links.
        on = np.zeros(m + 1, dtype=bool)
        on[0] = True  # the first 0x80 byte is always a real escape
        count = 1
        while True:
            on[succ[np.flatnonzero(on)]] = True
            new_count = int(np.count_nonzero(on))
            if new_count == count:
                break
            count = new_count
            succ = succ[succ]
        esc = cand[on[:m]]
        esc_len = length[on[:m]]
    else:
        esc = np.zeros(0, dtype=np.int64)
        esc_len = np.zeros(0, dtype=np.int64)
    # a value starts at every byte that is not inside an escape (bytes esc + 1 .. esc + len - 1): mark those,
    # a few per escape, rather than a running count over the whole buffer
    inside = np.zeros(size + 16, dtype=bool)
    if esc.size:
        tail = esc_len - 1
        first = np.repeat(esc + 1 - np.cumsum(tail) + tail, tail)  # each inside byte's escape start, shifted
        inside[first + np.arange(int(tail.sum()))] = True
    starts = np.flatnonzero(~inside[:size])
    if starts.size < n_elements:
        raise InputError(f"{source}: compressed data hold {starts.size} values, expected {n_elements}")
    starts = starts[:n_elements]
    deltas = buf[starts].view(np.int8).astype(np.int64)
    n_esc = int(np.searchsorted(esc, starts[-1], side="right")) if n_elements else 0
    esc, esc_len = esc[:n_esc], esc_len[:n_esc]
    if n_esc and int(esc[-1] + esc_len[-1]) > size:
        raise InputError(f"{source}: compressed data truncated inside the last value")
    where = np.searchsorted(starts, esc)
    for nbytes, offset, dtype in ((3, 1, "<i2"), (7, 3, "<i4"), (15, 7, "<i8")):
        sel = esc_len == nbytes
        if np.any(sel):
            pos = esc[sel][:, None] + offset + np.arange(nbytes - offset)
            deltas[where[sel]] = np.ascontiguousarray(buf[pos]).view(dtype).reshape(-1).astype(np.int64)
    return np.cumsum(deltas)


def encode_byte_offset(values: np.ndarray) -> bytes:
    """Byte-offset-compress a 1-D integer array (successive differences must fit in int64)."""
    v = np.asarray(values, dtype=np.int64).reshape(-1)
    d = np.diff(v, prepend=np.int64(0))
    length = np.full(d.shape, 15, dtype=np.int64)
    length[np.abs(d) <= 2**31 - 1] = 7
    length[np.abs(d) <= 32767] = 3
    length[np.abs(d) <= 127] = 1
    off = np.cumsum(length) - length
    out = np.zeros(int(length.sum()), dtype=np.uint8)
    small = length == 1
    out[off[small]] = d[small].astype(np.int8).view(np.uint8)
    prefixes = {3: (b"\x80", "<i2"), 7: (b"\x80\x00\x80", "<i4"), 15: (b"\x80\x00\x80\x00\x00\x00\x80", "<i8")}
    for nbytes, (prefix, dtype) in prefixes.items():
        sel = length == nbytes
        if not np.any(sel):
            continue
        head = np.frombuffer(prefix, dtype=np.uint8)
        payload = d[sel].astype(dtype).view(np.uint8).reshape(-1, nbytes - len(prefix))
        rows = np.concatenate([np.broadcast_to(head, (payload.shape[0], head.size)), payload], axis=1)
        out[off[sel][:, None] + np.arange(nbytes)] = rows
    return out.tobytes()


# ----------------------------------------------------------------------------- reading


def decompress_cbf(path: str, data: bytes) -> bytes:
    """The bytes of a CBF file, bz2 or gzip compressed or not."""
    try:
        if data.startswith(b"BZh"):
            return bz2.decompress(data)
        if data.startswith(b"\x1f\x8b"):
            return gzip.decompress(data)
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise InputError(f"{path}: corrupt compressed file: {exc}") from None
    return data


def _convert(value: float, factor: float) -> float:
    """Unit conversion rounded to 12 significant digits (so 172e-6 m -> 0.172 mm exactly).

    A value that is not finite (``1e999`` in a damaged header) raises ValueError: the line is unparseable.
    """
    value = value if factor == 1.0 else float(f"{value * factor:.12g}")
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {value}")
    return value


def parse_pilatus_lines(path: str, text: str) -> dict[str, Any]:
    """The ``# key value`` Pilatus header lines of ``text`` (a mini-CBF header or a Pilatus TIFF's
    ImageDescription) as the header dict of :func:`read_cbf` (without ``binary``)."""
    header: dict[str, Any] = {}
    raw: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            continue
        body = line[1:].strip()
        if not body:
            continue
        if re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+", body):
            header["timestamp"] = body
            continue
        key, _, rest = body.partition(" ")
        key = key.rstrip(":")
        rest = rest.strip().lstrip("=:").strip()
        raw[key] = rest
        numbers = re.findall(_NUMBER, rest)
        try:
            if key == "Detector":
                header["detector"] = rest
            elif key in _SIMPLE_FIELDS and numbers:
                name, factor, _ = _SIMPLE_FIELDS[key]
                unit = rest[rest.find(numbers[0]) + len(numbers[0]) :].split()
                if key == "Detector_distance" and unit and unit[0] in _LENGTH_TO_MM:
                    factor = _LENGTH_TO_MM[unit[0]]
                value = _convert(float(numbers[0]), factor)
                header[name] = int(value) if name == "count_cutoff" else value
            elif key == "Beam_xy" and len(numbers) >= 2:
                header["beam_x_px"] = _convert(float(numbers[0]), 1.0)
                header["beam_y_px"] = _convert(float(numbers[1]), 1.0)
            elif key == "Pixel_size" and numbers:
                units = re.findall(rf"{_NUMBER}\s*([a-z]+)", rest)
                sizes = [_convert(float(n), _LENGTH_TO_MM.get(u, 1000.0)) for n, u in zip(numbers, units)] or [
                    _convert(float(numbers[0]), 1000.0)
                ]
                header["pixel_size_mm"] = sizes[0]
                header["pixel_size_slow_mm"] = sizes[1] if len(sizes) > 1 else sizes[0]
            elif "thickness" in body and numbers:
                unit = rest.split()[-1]
                header["sensor_thickness_mm"] = _convert(float(numbers[-1]), _LENGTH_TO_MM.get(unit, 1000.0))
        except ValueError:
            log.warning("%s: cannot parse header line %r", path, line)
    header["pilatus"] = raw
    return header


def binary_headers(path: str, text: str) -> dict[str, str]:
    """The MIME fields (``X-Binary-Size`` ...) of the last binary section header in ``text``."""
    start = text.rfind("--CIF-BINARY-FORMAT-SECTION--")
    if start < 0:
        raise InputError(f"{path}: no binary section (--CIF-BINARY-FORMAT-SECTION--) found")
    fields: dict[str, str] = {}
    last = None
    for line in text[start:].splitlines()[1:]:
        if not line.strip():
            continue
        if line[:1].isspace() and last is not None:
            fields[last] += " " + line.strip()
            continue
        key, sep, value = line.partition(":")
        if sep:
            last = key.strip()
            fields[last] = value.strip()
    return fields


def binary_int(path: str, fields: Mapping[str, str], key: str) -> int:
    """The non-negative integer MIME field ``key`` of :func:`binary_headers`."""
    if key not in fields:
        raise InputError(f"{path}: binary section has no {key}")
    try:
        value = int(fields[key])
    except ValueError:
        raise InputError(f"{path}: {key} is not an integer: {fields[key]!r}") from None
    if value < 0:
        raise InputError(f"{path}: {key} is negative: {value}")
    return value


def binary_conversion(fields: Mapping[str, str]) -> str:
    """A binary section's compression as its MIME fields give it (``Content-Type`` and ``conversions``)."""
    return fields.get("Content-Type", "") + " " + fields.get("conversions", "")


def check_payload(path: str, fields: Mapping[str, str], payload: bytes, what: str = "binary data") -> None:
    """Refuse a binary section shorter than its ``X-Binary-Size`` or whose ``Content-MD5`` (when given) does
    not match: before any decoder (CBFlib's included, which may crash on a corrupt stream) sees it."""
    nbytes = binary_int(path, fields, "X-Binary-Size")
    if len(payload) < nbytes:
        raise InputError(f"{path}: {what} truncated: X-Binary-Size {nbytes}, found {len(payload)} bytes")
    if "Content-MD5" in fields:
        digest = base64.b64encode(hashlib.md5(payload[:nbytes]).digest()).decode("ascii")
        if digest != fields["Content-MD5"]:
            raise InputError(f"{path}: {what}: Content-MD5 mismatch (file corrupt)")


def read_cbf(path: str | os.PathLike[str]) -> tuple[np.ndarray, dict[str, Any]]:
    """Read a (possibly .bz2/.gz compressed) Pilatus mini-CBF; return ``(int32 image (slow, fast), header)``."""
    name = str(path)
    data = decompress_cbf(name, read_file_bytes(path, "CBF file"))
    mark = data.find(_MARKER)
    if mark < 0:
        raise InputError(f"{name}: not a CBF file (no binary data marker found)")
    text = data[:mark].decode("latin-1")
    if "CBF" not in text[:200] and "_array_data" not in text:
        raise InputError(f"{name}: not a CBF file")
    fields = binary_headers(name, text)
    conversion = binary_conversion(fields)
    packed = cbflib_compression(conversion, name)
    if packed is not None:  # CBFlib's own compressions: CBFlib decodes them
        check_payload(name, fields, data[mark + len(_MARKER):])
        arrays = decode_arrays(name, data, packed)
        if len(arrays) != 1 or arrays[0].ndim != 2:
            raise InputError(f"{name}: CBF holds {len(arrays)} arrays of {[list(a.shape) for a in arrays]} pixels, "
                             "not one 2-D image")
        header = parse_pilatus_lines(name, text)
        header["binary"] = fields
        return arrays[0].astype(np.int32), header
    etype = fields.get("X-Binary-Element-Type", '"signed 32-bit integer"').strip('"')
    if etype != "signed 32-bit integer":
        raise InputError(f"{name}: unsupported element type {etype!r} (only signed 32-bit integer)")
    if fields.get("X-Binary-Element-Byte-Order", "LITTLE_ENDIAN") != "LITTLE_ENDIAN":
        raise InputError(f"{name}: unsupported byte order {fields['X-Binary-Element-Byte-Order']!r}")
    nbytes = binary_int(name, fields, "X-Binary-Size")
    count = binary_int(name, fields, "X-Binary-Number-of-Elements")
    fast = binary_int(name, fields, "X-Binary-Size-Fastest-Dimension")
    slow = binary_int(name, fields, "X-Binary-Size-Second-Dimension")
    if fast * slow != count or count == 0:
        raise InputError(f"{name}: dimensions {fast}x{slow} do not match {count} elements")
    start = mark + len(_MARKER)
    payload = data[start : start + nbytes]
    check_payload(name, fields, payload)
    values = decode_byte_offset(payload, count, name)
    if values.size and (values.min() < -(2**31) or values.max() > 2**31 - 1):
        raise InputError(f"{name}: decoded values overflow signed 32-bit integers")
    header = parse_pilatus_lines(name, text)
    header["binary"] = fields
    return values.astype(np.int32).reshape(slow, fast), header


# ----------------------------------------------------------------------------- writing


def _pilatus_lines(path: str, header: Mapping[str, Any]) -> list[str]:
    by_name = {v[0]: (k, v[1], v[2]) for k, v in _SIMPLE_FIELDS.items()}
    lines = [f"# Detector: {header.get('detector', 'nbtorch synthetic')}"]
    if "timestamp" in header:
        lines.append(f"# {header['timestamp']}")
    size = header.get("pixel_size_mm")
    if size is not None:
        slow = header.get("pixel_size_slow_mm", size)
        lines.append(f"# Pixel_size {float(size) / 1000.0!r} m x {float(slow) / 1000.0!r} m")
    if "sensor_thickness_mm" in header:
        lines.append(f"# Silicon sensor, thickness {float(header['sensor_thickness_mm']) / 1000.0!r} m")
    if ("beam_x_px" in header) != ("beam_y_px" in header):
        raise InputError(f"{path}: give both beam_x_px and beam_y_px")
    for key, value in header.items():
        if key in by_name:
            label, factor, unit = by_name[key]
            number = f"{int(value)}" if key == "count_cutoff" else repr(float(value) / factor)
            lines.append(f"# {label} {number} {unit}".rstrip())
        elif key == "beam_x_px":
            lines.append(f"# Beam_xy ({float(value)!r}, {float(header['beam_y_px'])!r}) pixels")
        elif key not in ("beam_y_px", "pixel_size_mm", "pixel_size_slow_mm", "sensor_thickness_mm",
                         "detector", "timestamp", "pilatus", "binary"):
            raise InputError(f"{path}: unknown CBF header field {key!r}")
    if any("\n" in line or "\r" in line for line in lines):
        raise InputError(f"{path}: CBF header values must not contain line breaks")
    return lines


def write_cbf(path: str | os.PathLike[str], image: np.ndarray, header: Mapping[str, Any] | None = None) -> None:
    """Write a 2-D int32 image (slow, fast) as a Pilatus-style byte-offset mini-CBF. Atomic.

    ``header`` takes the numeric fields :func:`read_cbf` returns (e.g.
    ``wavelength_A``, ``distance_mm``, ``beam_x_px``/``beam_y_px``,
    ``pixel_size_mm``, ``count_cutoff``).  A path ending in ``.bz2`` or ``.gz``
    is compressed accordingly.
    """
    name = str(path)
    arr = np.asarray(image)
    if arr.ndim != 2 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise InputError(f"{name}: CBF image must be a non-empty 2-D integer array, got {arr.dtype} {arr.shape}")
    if arr.min() < -(2**31) or arr.max() > 2**31 - 1:
        raise InputError(f"{name}: CBF image values must fit in signed 32-bit integers")
    lines = _pilatus_lines(name, header or {})
    payload = encode_byte_offset(arr.astype(np.int64).reshape(-1))
    md5 = base64.b64encode(hashlib.md5(payload).digest()).decode("ascii")
    slow, fast = arr.shape
    stem = os.path.basename(name).split(".")[0] or "image"
    text = "\r\n".join(
        ["###CBF: VERSION 1.5, CBFlib v0.7.8 - PILATUS detectors", "", f"data_{stem}", "",
         '_array_data.header_convention "PILATUS_1.2"', "_array_data.header_contents", ";", *lines, ";", "",
         "_array_data.data", ";", "--CIF-BINARY-FORMAT-SECTION--",
         "Content-Type: application/octet-stream;", '     conversions="x-CBF_BYTE_OFFSET"',
         "Content-Transfer-Encoding: BINARY", f"X-Binary-Size: {len(payload)}", "X-Binary-ID: 1",
         'X-Binary-Element-Type: "signed 32-bit integer"', "X-Binary-Element-Byte-Order: LITTLE_ENDIAN",
         f"Content-MD5: {md5}", f"X-Binary-Number-of-Elements: {arr.size}",
         f"X-Binary-Size-Fastest-Dimension: {fast}", f"X-Binary-Size-Second-Dimension: {slow}",
         f"X-Binary-Size-Padding: {_PADDING}", "", ""]
    )
    body = (text.encode("ascii", errors="replace") + _MARKER + payload + b"\x00" * _PADDING
            + b"\r\n--CIF-BINARY-FORMAT-SECTION----\r\n;\r\n\r\n")
    lower = name.lower()
    if lower.endswith(".bz2"):
        body = bz2.compress(body, 9)
    elif lower.endswith(".gz"):
        body = gzip.compress(body, mtime=0)
    with atomic_write(path, "wb") as handle:
        handle.write(body)
