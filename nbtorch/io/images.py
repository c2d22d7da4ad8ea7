"""Image files of any supported format: the one place where a file's format is told and its pixels read.

:func:`detect_format` tells the format; :func:`read_image_file` reads the pixels (numpy, (slow, fast)) and the
header as the format's reader gives it (:mod:`nbtorch.io.smv`, :mod:`nbtorch.io.cbf`, :mod:`nbtorch.io.hdf5`,
:mod:`nbtorch.io.fabio_formats`, :mod:`nbtorch.io.raw`), plus an HDF5 detector's pixel mask, saturation and
sensor material.  What the header means for a model is the caller's (a refinement's:
:mod:`refine.inputs.images`; the ``nbtorch`` command's ``-img``/``-mask``: :func:`nbtorch.cli.args.apply_smv_header`).

Formats (told by the first bytes, then by the name; TIFF, MarCCD and mar345 need fabio, the optional extra
``nbtorch[formats]``, and say so in a one-line error without it; SMV and mini-CBF keep nbtorch's own readers,
because fabio 2026.6 misreads 64-bit byte-offset escapes and SMV files of other element types than unsigned
16-bit: ``tests/io/test_fabio_parity.py``):

==========  ==========================================  =====================================
format      recognised by                               geometry read from the header
==========  ==========================================  =====================================
SMV         first byte ``{`` (``.img``, ``.smv``)       PIXEL_SIZE, DISTANCE, WAVELENGTH, beam
                                                        centre (below), SATURATED_VALUE
                                                        (else OVERLOAD, CCD_IMAGE_SATURATION),
                                                        TWOTHETA, OSC_START (else PHI),
                                                        OSC_RANGE (else OSC_WIDTH)
mini-CBF    ``.cbf``, ``.cbf.bz2``, ``.cbf.gz``, or a   Wavelength, Detector_distance,
            CBF header (plain, bzip2 or gzip)           Beam_xy, Pixel_size, Count_cutoff,
                                                        Detector_2theta, Start_angle,
                                                        Angle_increment, Polarization,
                                                        ``<material> sensor, thickness``
HDF5/NeXus  HDF5 signature (``.h5``, ``.nxs``,          NXmx ``detector/{distance,
            ``.hdf5``); image ``/entry/data/data``,     beam_center_x/y, x_pixel_size,
            2-D or (frame, slow, fast), or an Eiger     saturation_value, pixel_mask,
            master's ``data_000001 ...`` links;         sensor_thickness, sensor_material}``,
            compressed: hdf5plugin                      ``beam/{incident_wavelength,
                                                        incident_polarization_stokes}``;
                                                        two-theta and rotation from the
                                                        NXtransformations (nbtorch.io.nexus)
TIFF        TIFF signature (``.tif``, ``.tiff``),       none; a Pilatus TIFF's ImageDescription:
            through fabio                               as mini-CBF
MarCCD      ``.mccd``, ``.rx``, or a TIFF with a MAR    xtal_to_detector, beam_x/y, pixelsize_x,
(Rayonix)   header at byte 1024, through fabio          source_wavelength, saturated_value,
                                                        start_twotheta, rotation_axis's start
                                                        and rotation_range
mar345      first int32 1234 + ``mar research``,        DISTANCE, WAVELENGTH, PIXEL LENGTH,
            ``.mar2300`` ..., through fabio             CENTER X/Y, TWOTHETA, PHI START/END
compressed  TIFF, MarCCD or mar345 compressed with       as the file inside
            gzip or bzip2 (``.tif.gz``, ``.mar2300.bz2``
            ...), told by the decompressed first bytes
raw         anything else, with ``shape`` given         none
            (``.bin``, ``.raw``; element type ``dtype``,
            default little-endian float32)
==========  ==========================================  =====================================

Multi-panel files (:mod:`nbtorch.io.panel_images`): a CBF of several arrays or array sections (imgCIF, e.g. a
CSPAD) and an NXmx detector of several ``NXdetector_module`` groups come with ``header["panel_boxes"]``, one
``(name, y0, x0, height, width)`` per panel of the image returned: the panels stacked along the slow axis
(CBF; NXmx modules that are slabs of a ``module x slow x fast`` dataset) or the whole 2-D image (NXmx modules
that are boxes of it); ``header["panels_stacked"]`` says which.

Every problem is an :class:`~nbtorch.errors.InputError` with a one-line message naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.cbf import decompress_cbf, read_cbf
from nbtorch.io.fabio_formats import (COMPRESSED_NAMES, MAR345_NAMES, MARCCD_NAMES, TIFF_NAMES, compression,
                                      decompressed_head, is_mar345, read_mar345, read_marccd, read_tiff, tiff_kind)
from nbtorch.io.hdf5 import DEFAULT_DATASET, read_h5_image
from nbtorch.io.panel_images import is_multi_array_cbf, read_cbf_panels
from nbtorch.io.raw import read_file_bytes, read_raw_float
from nbtorch.io.smv import read_smv

__all__ = ["FORMATS", "ImageFile", "detect_format", "read_image_file", "finite_float"]

FORMATS = ("smv", "cbf", "hdf5", "tiff", "marccd", "mar345", "raw")
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_CBF_NAMES = (".cbf", ".cbf.bz2", ".cbf.gz")
_H5_NAMES = (".h5", ".hdf5", ".nxs", ".hdf", ".nx5")
_SMV_NAMES = (".img", ".smv")
_RAW_NAMES = (".bin", ".raw", ".f32", ".float")


@dataclass(frozen=True)
class ImageFile:
    """What :func:`read_image_file` read.

    Attributes:
        format: one of :data:`FORMATS`.
        image: the pixels, (slow, fast), as stored (not converted).
        header: the reader's header: SMV ``{key: text}``; mini-CBF, TIFF, MarCCD, mar345 and HDF5 the readers'
            dicts (HDF5: with ``count_cutoff`` and its label, and ``sensor_material``, where the NXmx detector
            gives them); raw ``{}``.
        pixel_mask: an HDF5 detector's ``pixel_mask`` as bool (True = good pixel), None without one.
    """

    format: str
    image: np.ndarray
    header: dict
    pixel_mask: np.ndarray | None = None


def _lower_name(path: str | os.PathLike[str]) -> str:
    return os.path.basename(str(path)).lower()


def detect_format(path: str | os.PathLike[str], shape: Sequence[int] | None = None) -> str:
    """The format of ``path`` (one of :data:`FORMATS`), from its first bytes and then its name."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: image file not found")
    if p.is_dir():
        raise InputError(f"{path}: is a directory, not an image file")
    try:
        with open(p, "rb") as fh:
            head = fh.read(4096)
    except OSError as exc:
        raise InputError(f"{path}: cannot read image file: {exc.strerror or exc}") from None
    name = _lower_name(p)
    if head.startswith(_HDF5_MAGIC) or name.endswith(_H5_NAMES):
        return "hdf5"
    if name.endswith(_CBF_NAMES):
        return "cbf"
    if head.startswith(b"{"):
        return "smv"
    if compression(head) is not None and shape is None:
        return _compressed_format(path, head, name)
    kind = tiff_kind(head)
    if kind is not None:
        return "marccd" if name.endswith(MARCCD_NAMES) else kind
    if is_mar345(head) or name.endswith(MAR345_NAMES):
        return "mar345"
    if name.endswith(TIFF_NAMES + MARCCD_NAMES):
        raise InputError(f"{path}: not a TIFF file (no TIFF signature)")
    if head.startswith(b"###CBF") and shape is None:
        return "cbf"
    if name.endswith(_SMV_NAMES):
        return "smv"
    if shape is not None or name.endswith(_RAW_NAMES):
        return "raw"
    raise InputError(f"{path}: cannot tell the image format (not SMV, CBF, HDF5, TIFF, MarCCD or mar345); "
                     "for a headerless raw image give its shape (--shape SLOW FAST)")


def _compressed_format(path: str | os.PathLike[str], head: bytes, name: str) -> str:
    """The format of a file compressed as a whole (gzip or bzip2), from its decompressed first bytes: TIFF, MarCCD
    and mar345 (read through fabio), else a mini-CBF (whose reader decompresses it)."""
    inner = decompressed_head(path, head)
    base = next((name[: -len(s)] for s in COMPRESSED_NAMES if name.endswith(s)), name)
    kind = tiff_kind(inner)
    if kind is not None:
        return "marccd" if base.endswith(MARCCD_NAMES) else kind
    if is_mar345(inner):
        return "mar345"
    if inner.startswith(b"{"):
        raise InputError(f"{path}: a {compression(head)}-compressed SMV file: decompress it first "
                         f"({'gunzip' if compression(head) == 'gzip' else 'bunzip2'} -k)")
    for names, what in ((TIFF_NAMES, "TIFF"), (MARCCD_NAMES, "MarCCD/Rayonix"), (MAR345_NAMES, "mar345")):
        if base.endswith(names):
            raise InputError(f"{path}: the decompressed file is not a {what} file (no {what} signature)")
    return "cbf"


def finite_float(value: Any) -> float | None:
    """A header value as a finite float, or None (missing, not a number, infinite or NaN)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def _hdf5_detector_extras(path: str, meta: dict, shape: tuple) -> np.ndarray | None:
    """An NXmx detector's saturation (``meta["count_cutoff"]``, its name in ``meta["labels"]``) and sensor material
    (``meta["sensor_material"]``), put into ``meta``; returns its pixel mask (True = good) when it has the image's
    shape.  Optional: a value that cannot be read is skipped."""
    pixel_mask = None
    try:
        import h5py

        with h5py.File(path, "r") as f:
            det = f.get("/entry/instrument/detector")
            det = det if isinstance(det, h5py.Group) else None
            for name in ("saturation_value", "detectorSpecific/countrate_correction_count_cutoff"):
                sat = finite_float(np.asarray(det[name][()]).reshape(-1)[0]) if det is not None and name in det else None
                if sat is not None:
                    meta["count_cutoff"] = sat
                    meta["labels"]["count_cutoff"] = name
                    break
            if det is not None and "sensor_material" in det:
                material = det["sensor_material"][()]
                meta["sensor_material"] = material.decode() if isinstance(material, bytes) else str(material)
            name = next((k for k in ("pixel_mask", "detectorSpecific/pixel_mask") if det is not None and k in det), None)
            if name is not None:
                pm = np.asarray(det[name][()])
                if pm.ndim == 3:
                    pm = pm[min(meta.get("frame", 0), pm.shape[0] - 1)]
                if pm.shape == shape:
                    pixel_mask = pm == 0
    except (OSError, KeyError, RuntimeError, ValueError, TypeError, IndexError):  # optional extras: skip a bad one
        pass
    return pixel_mask


def _read_raw(path: str, shape: Sequence[int] | None, dtype: str) -> np.ndarray:
    if shape is None:
        raise InputError(f"{path}: a raw image needs its shape (--shape SLOW FAST)")
    if len(shape) != 2:
        raise InputError(f"{path}: raw image shape must be (slow, fast), got {tuple(shape)}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InputError(f"{path}: unknown raw element type {dtype!r}") from None
    return read_raw_float(path, shape, dt.str)


def _read(path: str, fmt: str, frame: int | None, shape: Sequence[int] | None, dtype: str,
          dataset: str) -> tuple[np.ndarray, dict, np.ndarray | None]:
    """The pixels, header and (HDF5) pixel mask of a file of format ``fmt``."""
    if fmt == "smv":
        image, header = read_smv(path)
    elif fmt == "cbf":
        data = decompress_cbf(path, read_file_bytes(path, "CBF file"))
        if not is_multi_array_cbf(data):
            image, header = read_cbf(path)
        else:  # several arrays or array sections: the panels stacked, the padding of smaller panels masked
            image, boxes, header = read_cbf_panels(path, data)
            header["panel_boxes"], header["panels_stacked"] = boxes, True
            valid = np.zeros(image.shape, dtype=bool)
            for _, y0, x0, h, w in boxes:
                valid[y0:y0 + h, x0:x0 + w] = True
            return image, header, None if valid.all() else valid
    elif fmt == "hdf5":
        image, header = read_h5_image(path, dataset=dataset, frame=frame)
        return image, header, _hdf5_detector_extras(path, header, image.shape)
    elif fmt in ("tiff", "marccd", "mar345"):
        image, header = {"tiff": read_tiff, "marccd": read_marccd, "mar345": read_mar345}[fmt](path)
    else:
        return _read_raw(path, shape, dtype), {}, None
    return image, header, None


def read_image_file(path: str | os.PathLike[str], *, frame: int | None = None, shape: Sequence[int] | None = None,
                    dtype: str = "<f4", dataset: str = DEFAULT_DATASET) -> ImageFile:
    """Read an image file of any supported format (module docstring).

    Arguments:
        path: SMV, mini-CBF (optionally ``.bz2``/``.gz``), HDF5/NeXus, TIFF, MarCCD, mar345 or raw file.
        frame: frame index of a 3-D HDF5 dataset or an Eiger master (other formats: None or 0).
        shape: (slow, fast) of a raw image (checked against the others when given).
        dtype: element type of a raw image (numpy notation, default little-endian float32).
        dataset: HDF5 path of the image.

    Raises:
        InputError: missing or unreadable file, unknown format, bad frame or shape, not a 2-D numeric image.
    """
    name = str(path)
    fmt = detect_format(name, shape)
    if frame is not None and fmt != "hdf5" and frame != 0:
        raise InputError(f"{name}: frame {frame} given, but a {fmt} file holds one image")
    image, header, pixel_mask = _read(name, fmt, frame, shape, dtype, dataset)
    image = np.asarray(image)
    if image.ndim != 2 or image.size == 0:
        raise InputError(f"{name}: expected a 2-D image, got shape {image.shape}")
    if image.dtype.kind not in "biuf":
        raise InputError(f"{name}: image has non-numeric type {image.dtype}")
    if shape is not None and tuple(int(n) for n in shape) != tuple(image.shape):
        raise InputError(f"{name}: image is {image.shape[0]} x {image.shape[1]} (slow x fast), "
                         f"not the {tuple(shape)[0]} x {tuple(shape)[1]} given")
    return ImageFile(format=fmt, image=image, header=header, pixel_mask=pixel_mask)
