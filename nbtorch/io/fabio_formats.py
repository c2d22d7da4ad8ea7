"""Detector images read through fabio (the optional extra ``nbtorch[formats]``, imported lazily).

Formats (told apart by :func:`tiff_kind` and :func:`is_mar345` from a file's first 4096 bytes):

* **TIFF** (``.tif``, ``.tiff``), read with ``fabio.tifimage.TifImage``; a **Pilatus TIFF** carries the
  Pilatus header lines (``# Pixel_size ...``, as in a mini-CBF) in its ImageDescription tag, parsed by
  :func:`nbtorch.io.cbf.parse_pilatus_lines` so that it gives the same header as the CBF;
* **MarCCD / Rayonix** (``.mccd``, ``.rx``, or any TIFF with a MAR frame header at byte 1024), read with
  ``fabio.marccdimage.MarccdImage``;
* **mar345** image plates (``.mar2300`` ...; first int32 1234, ``mar research`` in the header), read with
  ``fabio.mar345image.Mar345Image``.

Each may be compressed as a whole with gzip or bzip2 (``.tif.gz``, ``.mccd.bz2``, ``.mar2300.bz2`` ...; told by
the compressed stream's first bytes, :func:`compression` and :func:`decompressed_head`): the file is decompressed
here, in memory, and fabio reads the bytes (fabio 2026.6 tells compression by the name only and prints a debug
line to stdout when it decompresses a TIFF itself).

Pilatus mini-CBF and SMV keep nbtorch's own readers (:mod:`nbtorch.io.cbf`, :mod:`nbtorch.io.smv`): fabio
2026.6 gives the same pixels on real Pilatus CBFs and on 16-bit SMV files, but decodes a 64-bit byte-offset
escape wrongly and takes an SMV file of any other element type for d*TREK (``tests/io/test_fabio_parity.py``).

Each reader returns ``(image (slow, fast), header)``; the header has the keys of
:func:`nbtorch.io.cbf.read_cbf` that the file states (``wavelength_A``, ``distance_mm``, ``pixel_size_mm``,
``pixel_size_slow_mm``, ``beam_x_px``/``beam_y_px`` (fast, slow, from the corner of pixel (0, 0)),
``count_cutoff``, ``detector_2theta_deg``, ``start_angle_deg``, ``angle_increment_deg``) plus:

* ``fields``: fabio's header dict (text and numbers; MarCCD's reserved blocks, statistics and
  padding left out);
* ``labels``: the file's name of each key above (``"start_angle_deg": "start_phi"`` ...);
* ``unused``: ``{name: (value text, why)}`` for every value that is read but not turned into one of the keys
  above, ``why`` being ``"goniometer"`` (a goniometer setting), ``"rotation axis"``, ``"detector rotation"``,
  ``"detector offset"``, ``"other"`` (exposure, counting and provenance) or a sentence.
"""

from __future__ import annotations

import bz2
import gzip
import io
import os
import struct
import zlib
from typing import Any

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.cbf import parse_pilatus_lines

__all__ = ["read_tiff", "read_marccd", "read_mar345", "tiff_kind", "is_mar345", "compression", "decompressed_head",
           "TIFF_NAMES", "MARCCD_NAMES", "MAR345_NAMES", "COMPRESSED_NAMES"]

TIFF_NAMES = (".tif", ".tiff")
MARCCD_NAMES = (".mccd", ".rx")
MAR345_NAMES = tuple(f".mar{n}" for n in (1200, 1600, 1800, 2000, 2300, 2400, 3000, 3450))
COMPRESSED_NAMES = (".gz", ".bz2")
_TIFF_MAGIC = (b"II*\x00", b"MM\x00*")
_COMPRESSION = {b"\x1f\x8b": ("gzip", gzip.open), b"BZh": ("bzip2", bz2.open)}
_MAR_BYTE_ORDER = 1234  # the MarCCD and mar345 byte-order marker
# MarCCD frame header (at byte 1024 of the file): axes of start_*/end_*, indexed by rotation_axis
_MARCCD_AXES = ("twotheta", "omega", "chi", "kappa", "phi", "delta", "gamma")
_MARCCD_OTHER = ("integration_time", "exposure_time", "readout_time", "nreads", "mean_bias", "photons_per_100adu",
                 "detector_type", "source_type", "source_dx", "source_dy", "source_power", "source_voltage",
                 "source_current", "source_bias", "optics_type", "optics_dx", "optics_dy", "optics_wavelength",
                 "optics_dispersion", "optics_crossfire_x", "optics_crossfire_y", "optics_angle",
                 "optics_polarization_x", "optics_polarization_y", "filetitle", "filename", "acquire_timestamp",
                 "file_comments", "dataset_comments")
# MarCCD text fields read besides those of _MARCCD_OTHER (said by the rest of the header, below)
_MARCCD_TEXT = ("header_name", "filepath", "header_timestamp", "save_timestamp")
# MarCCD frame header values that say how the pixels are stored
_MARCCD_LAYOUT = {"header_type", "header_name", "header_major_version", "header_minor_version", "header_byte_order",
                  "data_byte_order", "header_size", "frame_type", "magic_number", "compression_type", "compression1",
                  "compression2", "compression3", "compression4", "compression5", "compression6", "nheaders", "nfast",
                  "nslow", "depth", "record_length", "signif_bits", "data_type", "sequence", "nimages", "origin",
                  "orientation", "view_direction", "overflow_location", "over_8_bits", "over_16_bits", "multiplexed",
                  "nfastimages", "nslowimages"}
# ... and the corrections the detector software applied and its statistics of the pixels
_MARCCD_CORRECTIONS = {"background_applied", "bias_applied", "flatfield_applied", "distortion_applied",
                       "original_header_type", "file_saved", "total_counts", "special_counts1", "special_counts2",
                       "min", "max", "mean", "rms", "p10", "p90", "stats_uptodate", "pixel_noise", "percentile"}
_MARCCD_STATS_WHY = ("corrections the detector software applied and its statistics of the pixels: the pixels are "
                     "used as stored")
# TIFF tags that say how the pixels are stored
_TIFF_LAYOUT = ("nRows", "nColumns", "nBits", "compression", "compression_type", "rowsPerStrip", "stripOffsets",
                "stripByteCounts", "sampleFormat", "photometricInterpretation")
# mar345 ASCII header keys that only describe how the pixels are stored (fabio uses them to read them)
_MAR345_LAYOUT = {"FORMAT", "DIM", "FORMAT_TYPE", "NO_PIXELS", "HIGH", "PIXEL_LENGTH", "PIXEL_HEIGHT"}


def _fabio(path: str, what: str) -> Any:
    try:
        import fabio  # optional extra nbtorch[formats]: only these formats need it
        import fabio.mar345image  # noqa: F401
        import fabio.marccdimage  # noqa: F401
        import fabio.tifimage  # noqa: F401
    except ImportError:
        raise InputError(f"{path}: reading {what} images needs fabio: pip install 'nbtorch[formats]'") from None
    return fabio


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _read(path: str, what: str, make: Any, header_apart: bool = False) -> tuple[np.ndarray, dict]:
    """fabio's data and header of ``path`` read by the image class ``make()`` (``header_apart``: the header by
    ``readheader``, a second pass); any failure is one InputError."""
    source = _source(path, what)
    try:
        obj = make()
        obj.read(source())
        data = None if obj.data is None else np.asarray(obj.data)
        if header_apart:
            obj = make()
            obj.readheader(source())
        header = dict(obj.header or {})
    except InputError:
        raise
    except Exception as exc:  # fabio raises anything (struct.error, IndexError, ValueError ...) on a bad file
        raise InputError(f"{path}: cannot read {what} image (damaged or not {what}?): {_first_line(exc)}") from None
    if data is None or data.ndim != 2 or data.size == 0:
        shape = "no image" if data is None else f"shape {data.shape}"
        raise InputError(f"{path}: cannot read {what} image (damaged or not {what}?): fabio found {shape}")
    return data, header


def compression(head: bytes) -> str | None:
    """``"gzip"`` or ``"bzip2"`` for a file starting with ``head`` compressed as a whole, else None."""
    return next((kind for magic, (kind, _) in _COMPRESSION.items() if head.startswith(magic)), None)


def _opener(head: bytes) -> Any:
    return next((opener for magic, (_, opener) in _COMPRESSION.items() if head.startswith(magic)), None)


def decompressed_head(path: str | os.PathLike[str], head: bytes, n: int = 4096) -> bytes:
    """The first ``n`` decompressed bytes of ``path``, whose first bytes ``head`` are a gzip or bzip2 stream."""
    try:
        with _opener(head)(path, "rb") as fh:
            return fh.read(n)
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise InputError(f"{path}: cannot decompress the {compression(head)} file (damaged or truncated?): "
                         f"{_first_line(exc)}") from None


def _source(path: str, what: str) -> Any:
    """What fabio reads ``path`` from, a fresh one per call: the path, or an in-memory stream of the decompressed
    bytes of a gzip or bzip2 file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
            opener = _opener(head)
            if opener is None:
                return lambda: path
            fh.seek(0)
            with opener(fh, "rb") as stream:
                data = stream.read()
    except (EOFError, ValueError, zlib.error) as exc:
        raise InputError(f"{path}: cannot decompress the {compression(head)} {what} image (damaged or "
                         f"truncated?): {_first_line(exc)}") from None
    except OSError as exc:
        if isinstance(exc, (gzip.BadGzipFile,)) or exc.errno is None:
            raise InputError(f"{path}: cannot decompress the {compression(head)} {what} image (damaged or "
                             f"truncated?): {_first_line(exc)}") from None
        raise InputError(f"{path}: cannot read {what} image: {exc.strerror or exc}") from None

    def stream() -> io.BytesIO:
        buffer = io.BytesIO(data)
        buffer.name = path  # fabio names the stream in its messages
        return buffer

    return stream


def _head(path: str, n: int = 4096) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError as exc:
        raise InputError(f"{path}: cannot read image file: {exc.strerror or exc}") from None


def tiff_kind(head: bytes) -> str | None:
    """``"marccd"`` for a TIFF whose bytes 1024.. hold a MarCCD/Rayonix frame header (its byte-order
    field 1234 and a plausible size and depth), ``"tiff"`` for another TIFF, None for no TIFF."""
    if not head.startswith(_TIFF_MAGIC):
        return None
    if len(head) >= 1024 + 92:
        for end in "<>":
            order, = struct.unpack(end + "I", head[1024 + 28:1024 + 32])
            nfast, nslow, depth = struct.unpack(end + "3I", head[1024 + 80:1024 + 92])
            if order == _MAR_BYTE_ORDER and 0 < nfast < 100000 and 0 < nslow < 100000 and depth in (1, 2, 4):
                return "marccd"
    return "tiff"


def is_mar345(head: bytes) -> bool:
    """A mar345 image plate file: first int32 1234 (either byte order) and ``mar research`` in its header."""
    return head[:4] in (struct.pack("<i", _MAR_BYTE_ORDER), struct.pack(">i", _MAR_BYTE_ORDER)) and \
        b"mar research" in head[:256]


# ------------------------------------------------------------------------------ TIFF


def read_tiff(path: str | os.PathLike[str]) -> tuple[np.ndarray, dict[str, Any]]:
    """A TIFF image through fabio; a Pilatus TIFF's ImageDescription gives the mini-CBF header keys."""
    name = str(path)
    fabio = _fabio(name, "TIFF")
    data, tags = _read(name, "TIFF", fabio.tifimage.TifImage)
    description = str(tags.get("imageDescription") or "")
    header: dict[str, Any] = {"fields": {k: v for k, v in tags.items() if isinstance(v, (str, int, float))},
                              "labels": {}, "unused": {}}
    if any(line.startswith("#") for line in description.splitlines()):
        header.update(parse_pilatus_lines(name, description))  # the Pilatus lines: "pilatus", "detector" ...
    else:
        for key in ("software", "date", "model", "imageDescription"):
            value = " ".join(str(tags.get(key) or "").split())
            if value:
                header["unused"][key] = (value, "other")
    for key in _TIFF_LAYOUT:  # how the pixels are stored
        value = tags.get(key)
        if isinstance(value, (list, tuple)):
            value = value[0] if len(value) == 1 else f"{len(value)} values" if value else None
        if value is not None and not isinstance(value, dict):
            header["unused"][key] = (str(value), "layout")
    return data, header


# ------------------------------------------------------------------------------ MarCCD / Rayonix


def _text(value: Any) -> str:
    """A MarCCD char field (fabio gives a list of one-byte strings) as text."""
    if isinstance(value, (list, tuple)):
        value = b"".join(v for v in value if isinstance(v, bytes))
    if isinstance(value, bytes):
        value = value.split(b"\x00", 1)[0].decode("latin-1")
    return " ".join(str(value).split())


def read_marccd(path: str | os.PathLike[str]) -> tuple[np.ndarray, dict[str, Any]]:
    """A MarCCD / Rayonix TIFF through fabio, with the geometry of its MAR frame header (fabio reads the
    header in the machine's byte order: a header written big-endian is refused)."""
    name = str(path)
    fabio = _fabio(name, "MarCCD/Rayonix")
    # fabio 2026.6's MarccdImage.read replaces the MAR header by the TIFF tags: the header comes from readheader
    data, raw = _read(name, "MarCCD/Rayonix", fabio.marccdimage.MarccdImage, header_apart=True)
    raw = {k.split("[")[0]: v for k, v in raw.items()}  # char fields are named "filename[64]" ...
    if raw.get("header_byte_order") != _MAR_BYTE_ORDER:
        raise InputError(f"{name}: MarCCD/Rayonix header byte order {raw.get('header_byte_order')!r} is not "
                         f"{_MAR_BYTE_ORDER} (a big-endian header, which fabio reads wrongly on this machine)")
    fields = {k: (v if isinstance(v, int) else _text(v)) for k, v in raw.items()
              if isinstance(v, int) or k in _MARCCD_OTHER + _MARCCD_TEXT}
    header: dict[str, Any] = {"fields": fields, "labels": {}, "unused": {}}
    used: dict[str, str] = {}

    def put(key: str, field: str, value: float) -> None:
        header[key] = value
        used[key] = field

    distance_field = "xtal_to_detector" if fields.get("xtal_to_detector", 0) > 0 else "start_xtal_to_detector"
    if fields.get(distance_field, 0) > 0:
        put("distance_mm", distance_field, fields[distance_field] / 1000.0)
    if fields.get("pixelsize_x", 0) > 0:
        put("pixel_size_mm", "pixelsize_x", fields["pixelsize_x"] / 1e6)
        header["pixel_size_slow_mm"] = fields.get("pixelsize_y", fields["pixelsize_x"]) / 1e6
    if fields.get("source_wavelength", 0) > 0:
        put("wavelength_A", "source_wavelength", fields["source_wavelength"] / 1e5)
    if fields.get("beam_x") or fields.get("beam_y"):
        put("beam_x_px", "beam_x", fields.get("beam_x", 0) / 1000.0)
        put("beam_y_px", "beam_y", fields.get("beam_y", 0) / 1000.0)
    if fields.get("saturated_value", 0) > 0:
        put("count_cutoff", "saturated_value", int(fields["saturated_value"]))
    put("detector_2theta_deg", "start_twotheta", fields.get("start_twotheta", 0) / 1000.0)
    axis = fields.get("rotation_axis", -1)
    scan = _MARCCD_AXES[axis] if isinstance(axis, int) and 1 <= axis < len(_MARCCD_AXES) else None
    if scan is not None:
        start = fields.get(f"start_{scan}", 0) / 1000.0
        put("start_angle_deg", f"start_{scan}", start)
        if fields.get("rotation_range", 0) or not fields.get(f"end_{scan}", 0):
            put("angle_increment_deg", "rotation_range", fields.get("rotation_range", 0) / 1000.0)
        else:  # no range recorded: the width is the scan axis's end less its start
            put("angle_increment_deg", f"end_{scan} - start_{scan}", fields[f"end_{scan}"] / 1000.0 - start)
    elif fields.get("rotation_range", 0) == 0:
        put("angle_increment_deg", "rotation_range", 0.0)  # no scan axis and no range: a still
    else:
        header["unused"]["rotation_range"] = (f"{fields['rotation_range'] / 1000.0:g} deg",
                                              f"rotation_axis {axis} names no goniometer axis")
    for ax in _MARCCD_AXES[1:]:
        if ax != scan and fields.get(f"start_{ax}"):
            header["unused"][f"start_{ax}"] = (f"{fields[f'start_{ax}'] / 1000.0:g} deg", "goniometer")
    if scan is not None:
        header["unused"]["rotation_axis"] = (f"{axis} ({scan})", "rotation axis")
    for rot in ("detector_rotx", "detector_roty", "detector_rotz"):
        if fields.get(rot):
            header["unused"][rot] = (f"{fields[rot] / 1000.0:g} deg", "detector rotation")
    if fields.get("pixelsize_y", 0) > 0 and fields.get("pixelsize_y") != fields.get("pixelsize_x"):
        header["unused"]["pixelsize_y"] = (f"{fields['pixelsize_y'] / 1e6:g} mm", "the model's pixels are square "
                                           "(-pixel): pixelsize_x is taken")
    for pol in ("source_polarization_x", "source_polarization_y"):
        if fields.get(pol):
            header["unused"][pol] = (str(fields[pol]), "its units are undocumented; the model's -polar is used")
    for key in _MARCCD_OTHER:
        if fields.get(key) not in (None, 0, ""):
            header["unused"][key] = (f"{fields[key]}{' ms' if key.endswith('_time') else ''}", "other")
    if "distance_mm" not in header:  # MarCCD writes 0 where the distance was not recorded
        header["unused"]["xtal_to_detector"] = (f"{fields.get('xtal_to_detector', 0) / 1000.0:g} mm",
                                                "no distance recorded (0): give -distance in --model")
    _marccd_rest(fields, used, header["unused"], scan)
    header["labels"] = used
    return data, header


def _marccd_rest(fields: dict, used: dict, unused: dict, scan: str | None) -> None:
    """Every other non-zero value of a MarCCD frame header, with why it is not used (zero is MarCCD's "not
    recorded"): the file layout, the corrections and statistics, the axes' end values, the rest."""
    taken = {part for label in used.values() for part in label.split(" - ")}
    for key, value in fields.items():
        if key in taken or key in unused or value in (None, 0, ""):
            continue
        if key in _MARCCD_LAYOUT:
            why = "layout"
        elif key in _MARCCD_CORRECTIONS:
            why = _MARCCD_STATS_WHY
        elif key == "start_xtal_to_detector" or key == "end_xtal_to_detector":
            why = f"the distance is {used['distance_mm']}" if "distance_mm" in used else "other"
            value = f"{value / 1000.0:g} mm"
        elif key == "pixelsize_y":  # (one that differs from pixelsize_x is said above)
            why, value = "the same as pixelsize_x: square pixels", f"{value / 1e6:g} mm"
        elif key.startswith("end_") and key[4:] in _MARCCD_AXES:
            why = ("the detector's two-theta is start_twotheta" if key == "end_twotheta" else
                   f"the rotation's width is {used['angle_increment_deg']}" if key == f"end_{scan}" else "goniometer")
            value = f"{value / 1000.0:g} deg"
        else:
            why = "other"
        unused[key] = (str(value), why)


# ------------------------------------------------------------------------------ mar345


def _number(fields: dict, *keys: str) -> tuple[float, str] | None:
    """The first of ``keys`` in ``fields`` that is a finite number, with its key."""
    for key in keys:
        try:
            value = float(str(fields[key]).split()[0])
        except (KeyError, ValueError, IndexError):
            continue
        if np.isfinite(value):
            return value, key
    return None


def read_mar345(path: str | os.PathLike[str]) -> tuple[np.ndarray, dict[str, Any]]:
    """A mar345 image plate file through fabio, with the geometry of its header (the ASCII header's values,
    else the binary header's)."""
    name = str(path)
    fabio = _fabio(name, "mar345")
    data, fields = _read(name, "mar345", fabio.mar345image.Mar345Image)
    # fabio 2026.6 decodes a truncated packed stream without a word (reading past its end): refused here only when
    # that gives wrapped-around values; a larger decoder guard (decoding again with other bytes after the end)
    # crashed fabio's decoder, so it is not tried
    if data.size and int(data.max()) >= 2**31:
        raise InputError(f"{name}: cannot read mar345 image (damaged or truncated?): decoded pixel values out of range")
    header: dict[str, Any] = {"fields": {k: v for k, v in fields.items() if isinstance(v, (str, int, float))},
                              "labels": {}, "unused": {}}
    used: dict[str, str] = {}
    for key, names, factor in (("distance_mm", ("DISTANCE", "Distance"), 1.0),
                               ("wavelength_A", ("WAVELENGTH", "Wavelength"), 1.0),
                               ("pixel_size_mm", ("PIXEL_LENGTH",), 1e-3), ("pixel_size_mm", ("PixelLength",), 1.0),
                               ("pixel_size_slow_mm", ("PIXEL_HEIGHT",), 1e-3),
                               ("pixel_size_slow_mm", ("PixelHeight",), 1.0),
                               ("beam_x_px", ("CENTER_X",), 1.0), ("beam_y_px", ("CENTER_Y",), 1.0),
                               ("detector_2theta_deg", ("TWOTHETA", "TwoTheta"), 1.0)):
        found = _number(fields, *names)
        if key not in header and found is not None and (found[0] > 0 or key in ("detector_2theta_deg", "beam_x_px",
                                                                                "beam_y_px")):
            header[key], used[key] = found[0] * factor, found[1]
    if ("beam_x_px" in header) != ("beam_y_px" in header):
        for key in ("beam_x_px", "beam_y_px"):
            header.pop(key, None)
            used.pop(key, None)
    start = _number(fields, "PHI_START", "StartPhi")
    end = _number(fields, "PHI_END", "EndPhi")
    if start is not None and end is not None:
        header["start_angle_deg"], used["start_angle_deg"] = start[0], start[1]
        header["angle_increment_deg"], used["angle_increment_deg"] = end[0] - start[0], f"{end[1]} - {start[1]}"
    omega, omega_end = _number(fields, "OMEGA_START", "StartOmega"), _number(fields, "OMEGA_END", "EndOmega")
    if omega is not None and (omega[0] or (omega_end is not None and omega_end[0] != omega[0])):
        header["unused"]["omega"] = (f"{omega[0]:g} deg" + (f" to {omega_end[0]:g} deg" if omega_end else ""),
                                     "goniometer")
    chi = _number(fields, "CHI", "Chi")
    if chi is not None and chi[0]:
        header["unused"]["CHI"] = (f"{chi[0]:g} deg", "goniometer")
    for key in ("OFFSET_ROFF", "OFFSET_TOFF"):
        if _number(fields, key) not in (None, (0.0, key)):
            header["unused"][key] = (str(fields[key]), "detector offset")
    height = _number(fields, "PIXEL_HEIGHT")
    if height is not None and "pixel_size_mm" in header and height[0] * 1e-3 != header["pixel_size_mm"]:
        header["unused"]["PIXEL_HEIGHT"] = (f"{height[0]:g} um", "the model's pixels are square (-pixel): "
                                            f"{used['pixel_size_mm']} is taken")
    taken = set(used.values()) | {"PHI_END", "CHI", "OMEGA_START", "OMEGA_END", "OFFSET_ROFF", "OFFSET_TOFF",
                                  "PIXEL_HEIGHT"}
    for key, value in fields.items():
        if key == key.upper() and key not in taken and str(value).strip():  # ASCII header lines; the binary are Mixed
            why = ("layout" if key in _MAR345_LAYOUT else
                   "one pass from PHI_START to PHI_END is modelled" if key in ("PHI_OSC", "OMEGA_OSC") else "other")
            header["unused"][key] = (" ".join(str(value).split()), why)
    header["labels"] = used
    return data, header
