"""Measured images for refinement: read any supported file, build the mask, report the header geometry.

:func:`load_image` is the front door::

    obs = load_image("thau_3_2_0003.cbf.bz2")            # Pilatus mini-CBF, bzip2-compressed
    obs = load_image("run.nxs", frame=3)                 # HDF5 / NeXus NXmx, one frame
    obs = load_image("float.bin", shape=(512, 512))      # headerless float32
    obs.image, obs.mask, obs.geometry                    # float64 (slow, fast), bool, dict

Formats: SMV, mini-CBF, HDF5/NeXus, TIFF, MarCCD, mar345 and raw, told and read by
:func:`nbtorch.io.images.read_image_file` (which header fields each format gives: that module); this module turns
each header into the geometry below.

Geometry (:attr:`MeasuredImage.geometry`, only the keys the file states):
``wavelength_A``; ``distance_mm``; ``pixel_mm``; ``beam_x_px``, ``beam_y_px``: the
direct-beam spot along fast and slow in pixels from the **corner** of pixel (0, 0)
(pixel centres at ``i + 0.5``; multiply by ``pixel_mm`` for nanoBragg's ``Fbeam``/``Sbeam``
in mm); ``saturation`` (counts); ``twotheta_deg`` (detector two-theta); ``phi_deg``, ``osc_deg``
(start and width of the rotation, 0 for a still); ``polarization_fraction`` (Pilatus ``Polarization``:
the fraction of the beam polarised along the E-vector; NXmx: (1 + P) / 2 of the Stokes vector's linear
polarisation P) and ``polarization_angle_deg`` (NXmx: its E-vector's angle from the NeXus x axis towards y,
:mod:`nbtorch.io.nexus`); ``sensor_thickness_mm``.  :attr:`MeasuredImage.header` of an SMV file, as of the
fabio readers: ``fields`` (every key), ``labels`` (the key each geometry value came from) and ``unused``
(``{key: (value, why)}`` for every other key: the file layout, restated beam centres, second saturation or
rotation keys, goniometer settings, the exposure and provenance rest).  What the model
makes of each: :mod:`refine.inputs.start_model` (every header value is used or said not to be, one line each).
SMV beam centres: ``DENZO_Y_BEAM``/``DENZO_X_BEAM``
(mm along fast/slow, what nanoBragg writes) when present, else ``MOSFLM_CENTER_Y/X`` plus
half a pixel, else ADSC's ``BEAM_CENTER_Y``/``BEAM_CENTER_X`` (fast = Y, slow = X, as DIALS
reads ADSC headers).  Pilatus ``Beam_xy`` is already (fast, slow) pixels from the corner.

Mask (:attr:`MeasuredImage.mask`, True = use the pixel) is the AND of:

* **value masks**: pixels < 0 (Pilatus module gaps -1, bad pixels -2) and pixels
  ``>= saturation`` (``saturation=`` if given, else the header's count cutoff /
  saturated value / NXmx ``saturation_value``; an unsigned 16-bit SMV saturates at 65535);
* NXmx ``detector/pixel_mask`` (nonzero = bad) when the file has one;
* a mask file (``mask=``: any of the formats above, same shape; **nonzero = use**);
* non-finite pixels: an error (:class:`~nbtorch.errors.InputError`) unless
  ``nonfinite="mask"``, because NaN in a measured image usually means a broken conversion.

Every problem is an :class:`~nbtorch.errors.InputError` with a one-line message naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from nbtorch.geometry.beam_centre import header_beam_offsets
from nbtorch.errors import InputError
from nbtorch.io.images import ImageFile, detect_format, finite_float, read_image_file
from nbtorch.io.smv import header_value

__all__ = ["MeasuredImage", "load_image", "load_mask", "sensor_material"]


@dataclass(frozen=True)
class MeasuredImage:
    """A measured image ready for refinement.

    Attributes:
        path: the file read.
        format: one of :data:`nbtorch.io.images.FORMATS`.
        image: (slow, fast) float64 counts; masked pixels keep their file values (NaN stays NaN).
        mask: (slow, fast) bool, True = use the pixel.
        geometry: header geometry (module docstring): ``wavelength_A``, ``distance_mm``,
            ``pixel_mm``, ``beam_x_px``, ``beam_y_px``, ``saturation``, when the file states them.
        header: the reader's header (format specific; SMV and the fabio formats: ``fields``, ``labels``,
            ``unused``).
        masked: why pixels were masked: reason -> count (``negative``, ``saturated``,
            ``nonfinite``, ``pixel_mask``, ``mask_file``).
    """

    path: str
    format: str
    image: np.ndarray = field(repr=False)
    mask: np.ndarray = field(repr=False)
    geometry: dict
    header: dict = field(repr=False)
    masked: dict

    @property
    def shape(self) -> tuple[int, int]:
        """(slow, fast)."""
        return tuple(self.image.shape)  # type: ignore[return-value]

    def describe(self) -> str:
        """One line: file, format, shape, usable pixels and the mask reasons."""
        slow, fast = self.shape
        used = int(self.mask.sum())
        why = ", ".join(f"{n} {k}" for k, n in self.masked.items() if n) or "none"
        return (f"{self.path}: {self.format}, {fast} x {slow} pixels (fast x slow), "
                f"{used} used ({100.0 * used / self.mask.size:.1f}%); masked: {why}")


def sensor_material(image: MeasuredImage) -> str | None:
    """The sensor material the header names (Pilatus ``# Silicon sensor, thickness ...``, NXmx
    ``sensor_material``), or None."""
    if image.format in ("cbf", "tiff"):  # a mini-CBF or a Pilatus TIFF
        for key, rest in (image.header.get("pilatus") or {}).items():
            if "thickness" in str(rest) and "sensor" in str(rest).lower():
                return str(key)
    elif image.format == "hdf5" and image.header.get("sensor_material"):
        return str(image.header["sensor_material"])
    return None


# ------------------------------------------------------------------------------ header geometry


# SMV header keys: how the pixels are stored (read by nbtorch.io.smv, not model values)
_SMV_LAYOUT = ("HEADER_BYTES", "DIM", "BYTE_ORDER", "TYPE", "SIZE1", "SIZE2")
# the beam centre, (fast, slow) keys in the order they are taken (mm) and the convention whose terms they are in
# (nbtorch.geometry.beam_centre.header_beam_offsets: MOSFLM's is half a pixel short of the spot; ADSC's BEAM_CENTER_Y/X
# read as DENZO's, as DIALS reads ADSC headers), and the keys that restate it in other programs' terms
_SMV_BEAM = ((("DENZO_Y_BEAM", "DENZO_X_BEAM"), "denzo"), (("MOSFLM_CENTER_Y", "MOSFLM_CENTER_X"), "mosflm"),
             (("BEAM_CENTER_Y", "BEAM_CENTER_X"), "denzo"))
_SMV_BEAM_OTHER = ("DENZO_X_BEAM", "DENZO_Y_BEAM", "MOSFLM_CENTER_X", "MOSFLM_CENTER_Y", "BEAM_CENTER_X",
                   "BEAM_CENTER_Y", "ADXV_CENTER_X", "ADXV_CENTER_Y", "DIALS_ORIGIN", "XDS_ORGX", "XDS_ORGY")
_SMV_SATURATION = ("SATURATED_VALUE", "OVERLOAD", "CCD_IMAGE_SATURATION")
# (geometry key, reader key for the label, header keys in the order they are taken)
_SMV_ANGLES = (("twotheta_deg", "detector_2theta_deg", ("TWOTHETA",)),
               ("phi_deg", "start_angle_deg", ("OSC_START", "PHI")),
               ("osc_deg", "angle_increment_deg", ("OSC_RANGE", "OSC_WIDTH")))
# other SMV keys that would place or turn something (ADSC goniometers): said one line each
_SMV_GONIOMETER = {"OMEGA": "goniometer", "KAPPA": "goniometer", "CHI": "goniometer", "AXIS": "rotation axis",
                   "OSC_AXIS": "rotation axis"}


def _smv_geometry(path: str, image: np.ndarray, raw: dict) -> tuple[dict, dict]:
    """An SMV image's geometry and a header in the fabio readers' layout (``fields``, ``labels``, ``unused``:
    every key either taken, with its name in ``labels``, or listed in ``unused`` with why)."""
    geo: dict[str, float] = {}
    labels: dict[str, str] = {}
    unused: dict[str, tuple[str, str]] = {}
    header: dict[str, Any] = {"fields": dict(raw), "labels": labels, "unused": unused}
    for key, name, label in (("PIXEL_SIZE", "pixel_mm", "pixel_size_mm"), ("DISTANCE", "distance_mm", "distance_mm"),
                             ("WAVELENGTH", "wavelength_A", "wavelength_A")):
        if key in raw:
            v = header_value(path, raw, key)
            if v is not None and v > 0:
                geo[name], labels[label] = v, key
            else:
                unused[key] = (raw[key], "not a positive number")
    _smv_beam(path, raw, geo, labels, unused)
    for name, label, keys in _SMV_ANGLES:
        taken = None
        for key in (k for k in keys if k in raw):
            if taken is None:
                v = finite_float(header_value(path, raw, key))
                if v is not None:
                    geo[name], labels[label], taken = v, key, key
            else:
                unused[key] = (raw[key], f"{taken} is taken")
    sat = None
    for key in (k for k in _SMV_SATURATION if k in raw):
        v = finite_float(header_value(path, raw, key)) if sat is None else None
        if v is not None and v > 0:
            sat, labels["count_cutoff"], header["count_cutoff"] = v, key, v
        else:
            unused[key] = (raw[key], f"the saturation is {labels['count_cutoff']}" if sat else "not a positive count")
    if sat is None and image.dtype == np.uint16:
        sat = 65535.0
    if sat is not None:
        geo["saturation"] = sat
    _smv_rest(raw, set(labels.values()), unused)
    return geo, header


def _smv_beam(path: str, raw: dict, geo: dict, labels: dict, unused: dict) -> None:
    """The beam centre (fast, slow pixels from the corner of pixel (0, 0)) from the first pair of
    :data:`_SMV_BEAM` present; the other beam-centre keys said to restate it."""
    pixel = geo.get("pixel_mm")
    taken = None
    if pixel:
        for (fast_key, slow_key), convention in _SMV_BEAM:
            if fast_key in raw and slow_key in raw:
                centre_y, centre_x = header_value(path, raw, fast_key), header_value(path, raw, slow_key)
                fast_mm, slow_mm = header_beam_offsets(convention, centre_x, centre_y, pixel)
                geo["beam_x_px"], geo["beam_y_px"] = fast_mm / pixel, slow_mm / pixel
                labels["beam_x_px"], labels["beam_y_px"] = taken = (fast_key, slow_key)
                break
    why = (f"the same beam centre in other programs' terms; the model's is {taken[0]}, {taken[1]}" if taken
           else "no PIXEL_SIZE to turn a beam centre into pixels" if not pixel
           else "the beam centre is read from DENZO_Y/X_BEAM, MOSFLM_CENTER_Y/X or BEAM_CENTER_Y/X (a pair)")
    for key in raw:  # in the file's order
        if key in _SMV_BEAM_OTHER and (taken is None or key not in taken):
            unused[key] = (raw[key], why)


def _smv_rest(raw: dict, taken: set, unused: dict) -> None:
    """The SMV keys not taken and not yet said: the file layout, the close distance, goniometer settings, and the
    exposure, counting and provenance rest."""
    for key, value in raw.items():
        if key in taken or key in unused:
            continue
        if key in _SMV_LAYOUT:
            unused[key] = (value, "layout")
        elif key == "CLOSE_DISTANCE":
            unused[key] = (value, "the model's distance is DISTANCE; the close distance follows from it and the "
                                  "detector's orientation" if "DISTANCE" in taken else
                                  "a close distance belongs in --model (-close_distance)")
        elif key in _SMV_GONIOMETER:
            unused[key] = (value, _SMV_GONIOMETER[key])
        elif key in ("GAIN", "IMAGE_PEDESTAL", "ADC_OFFSET"):
            unused[key] = (value, "by the model: it turns the counts into photons, the 'detector counts' line "
                                  "(refine.inputs.detector_counts)")
        elif key == "BIN":
            unused[key] = (value, "PIXEL_SIZE is the size of the pixels as stored")
        else:
            unused[key] = (value, "other")


# header keys of nbtorch.io.cbf (and of the fabio readers, which use the same) -> geometry keys
_CBF_GEOMETRY = (("wavelength_A", "wavelength_A"), ("distance_mm", "distance_mm"), ("pixel_size_mm", "pixel_mm"),
                 ("beam_x_px", "beam_x_px"), ("beam_y_px", "beam_y_px"), ("count_cutoff", "saturation"),
                 ("detector_2theta_deg", "twotheta_deg"), ("start_angle_deg", "phi_deg"),
                 ("angle_increment_deg", "osc_deg"), ("polarization", "polarization_fraction"),
                 ("sensor_thickness_mm", "sensor_thickness_mm"))


def _cbf_geometry(header: dict) -> dict[str, float]:
    geo: dict[str, float] = {}
    for src, dst in _CBF_GEOMETRY:
        v = finite_float(header.get(src))
        if v is not None:
            geo[dst] = v
    return geo


def _hdf5_geometry(meta: dict) -> dict[str, float]:
    """NXmx geometry: wavelength, distance, sensor, two-theta, rotation, polarisation, pixel size, beam centre and
    the detector's saturation (:func:`nbtorch.io.images.read_image_file` puts it in ``count_cutoff``)."""
    geo = {k: v for k, v in _cbf_geometry(meta).items()
           if k in ("wavelength_A", "distance_mm", "sensor_thickness_mm", "twotheta_deg", "phi_deg", "osc_deg",
                    "polarization_fraction")}
    if "polarization_angle_deg" in meta:
        geo["polarization_angle_deg"] = float(meta["polarization_angle_deg"])
    pixel = meta.get("x_pixel_size_mm")
    if pixel:
        geo["pixel_mm"] = float(pixel)
    for axis, key in (("x", "beam_x_px"), ("y", "beam_y_px")):
        if f"beam_center_{axis}_px" in meta:
            geo[key] = float(meta[f"beam_center_{axis}_px"])
        elif f"beam_center_{axis}_mm" in meta and pixel:
            size = meta.get(f"{axis}_pixel_size_mm", pixel)
            geo[key] = float(meta[f"beam_center_{axis}_mm"]) / float(size)
    if "count_cutoff" in meta:
        geo["saturation"] = meta["count_cutoff"]
    return geo


def _geometry(path: str, file: ImageFile) -> tuple[dict, dict]:
    """``(geometry, header)`` of a file read by :func:`nbtorch.io.images.read_image_file`."""
    if file.format == "smv":
        return _smv_geometry(path, file.image, file.header)
    if file.format in ("cbf", "tiff", "marccd", "mar345"):  # the fabio readers give mini-CBF's keys
        return _cbf_geometry(file.header), file.header
    if file.format == "hdf5":
        return _hdf5_geometry(file.header), file.header
    return {}, file.header  # raw


def _read_any(path: str, frame: int | None, shape: Sequence[int] | None, dtype: str,
              dataset: str) -> tuple[str, np.ndarray, dict, dict, np.ndarray | None]:
    file = read_image_file(path, frame=frame, shape=shape, dtype=dtype, dataset=dataset)
    geo, header = _geometry(path, file)
    return file.format, file.image, geo, header, file.pixel_mask


# ------------------------------------------------------------------------------ front door


def load_mask(path: str | os.PathLike[str], shape: tuple[int, int], *, frame: int | None = None,
              dtype: str = "<f4", dataset: str = "/entry/data/data") -> np.ndarray:
    """A mask file as bool (slow, fast), **nonzero = use the pixel** (any image format; raw uses ``shape``).

    Raises:
        InputError: unreadable file, or its shape is not ``shape``.
    """
    name = str(path)
    fmt = detect_format(name, shape)
    _, values, _, _, _ = _read_any(name, frame, shape if fmt == "raw" else None, dtype, dataset)
    if tuple(values.shape) != tuple(shape):
        raise InputError(f"{name}: mask is {values.shape[0]} x {values.shape[1]} (slow x fast), "
                         f"the image is {shape[0]} x {shape[1]}")
    values = values.astype(np.float64)
    return np.isfinite(values) & (values != 0)


def load_image(
    path: str | os.PathLike[str],
    *,
    frame: int | None = None,
    shape: Sequence[int] | None = None,
    dtype: str = "<f4",
    dataset: str = "/entry/data/data",
    mask: str | os.PathLike[str] | np.ndarray | None = None,
    saturation: float | None = None,
    nonfinite: str = "error",
) -> MeasuredImage:
    """Read a measured image, its header geometry and its mask.

    Arguments:
        path: SMV, mini-CBF (optionally ``.bz2``/``.gz``), HDF5/NeXus, TIFF, MarCCD, mar345 or raw file.
        frame: frame index of a 3-D HDF5 dataset or an Eiger master (may be omitted for one frame).
        shape: (slow, fast) of a raw image (checked against the others when given).
        dtype: element type of a raw image (numpy notation, default little-endian float32).
        dataset: HDF5 path of the image.
        mask: a mask file (nonzero = use) or a bool (slow, fast) array (True = use).
        saturation: pixels ``>=`` this are masked (default: the header's, if any).
        nonfinite: ``"error"`` (default) or ``"mask"`` for NaN/Inf pixels.

    Returns:
        :class:`MeasuredImage` (image float64 (slow, fast), mask, geometry, reasons).

    Raises:
        InputError: missing or unreadable file, unknown format, bad frame or shape, mask of the
            wrong shape, NaN/Inf pixels (unless ``nonfinite="mask"``), no usable pixel.
    """
    name = str(path)
    if nonfinite not in ("error", "mask"):
        raise InputError(f"nonfinite: expected 'error' or 'mask', got {nonfinite!r}")
    fmt, raw, geo, header, pixel_mask = _read_any(name, frame, shape, dtype, dataset)
    image = raw.astype(np.float64)
    finite = np.isfinite(image)
    n_bad = int(image.size - finite.sum())
    if n_bad and nonfinite == "error":
        raise InputError(f"{name}: image has {n_bad} NaN/Inf pixel(s); mask them with --mask-nan "
                         "(nonfinite='mask') or fix the file")
    sat = float(saturation) if saturation is not None else geo.get("saturation")
    masked: dict[str, int] = {}
    keep = finite.copy()
    masked["nonfinite"] = n_bad
    with np.errstate(invalid="ignore"):
        negative = finite & (image < 0)
        masked["negative"] = int(negative.sum())
        keep &= ~negative
        if sat is not None:
            over = finite & (image >= sat)
            masked["saturated"] = int((over & keep).sum())
            keep &= ~over
    if pixel_mask is not None:
        masked["pixel_mask"] = int((keep & ~pixel_mask).sum())
        keep &= pixel_mask
    if mask is not None:
        if isinstance(mask, np.ndarray):
            user = np.asarray(mask, dtype=bool)
            if user.shape != image.shape:
                raise InputError(f"{name}: mask shape {user.shape} does not match the image {image.shape}")
        else:
            user = load_mask(mask, image.shape, dtype=dtype)
        masked["mask_file"] = int((keep & ~user).sum())
        keep &= user
    if not keep.any():
        raise InputError(f"{name}: every pixel is masked ({', '.join(f'{n} {k}' for k, n in masked.items() if n)})")
    if saturation is not None:
        geo = {**geo, "saturation": float(saturation)}
    return MeasuredImage(path=name, format=fmt, image=image, mask=keep, geometry=geo, header=header,
                         masked={k: v for k, v in masked.items() if v})
