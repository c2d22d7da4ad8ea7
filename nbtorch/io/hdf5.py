"""HDF5 images in a NeXus NXmx-style layout (needs ``h5py``, imported lazily).

Layout written by :func:`write_h5`::

    /                              @default="entry", plus the ``attrs`` dict
    /entry                         @NX_class=NXentry, @default="data"
    /entry/definition              "NXmx"
    /entry/data                    @NX_class=NXdata, @signal="data"
    /entry/data/data               the image: (slow, fast) or (frame, slow, fast)
    /entry/instrument              @NX_class=NXinstrument
    /entry/instrument/detector     @NX_class=NXdetector
        distance                   float64, @units="mm"
        beam_center_x              float64, @units="mm"  (along fast, from the corner of pixel (0,0))
        beam_center_y              float64, @units="mm"  (along slow)
        x_pixel_size, y_pixel_size float64, @units="mm"  (fast, slow)
        sensor_thickness           float64, @units="mm"  (when given)
    /entry/instrument/beam         @NX_class=NXbeam
        incident_wavelength        float64, @units="angstrom"
    /entry/nbtorch                 @NX_class=NXcollection; every ``geometry`` item as an attribute

Geometry keys that fill the NXmx fields (any subset): ``distance_mm``,
``beam_center_x_mm``, ``beam_center_y_mm``, ``pixel_size_mm`` (both axes) or
``x_pixel_size_mm`` / ``y_pixel_size_mm``, ``sensor_thickness_mm``, ``wavelength_A``.  Every geometry
item (numbers, strings, booleans, 1-D/2-D number sequences) is also stored on
``/entry/nbtorch``; ``None`` values are omitted.

:func:`read_h5_image` returns the image and a dict with the same ``*_mm`` /
``wavelength_A`` keys (converted from the units found in the file: m, mm, um,
or pixels for beam centres, reported as ``beam_center_x_px``; a Dectris
``detector_distance`` when there is no ``distance``), plus ``nbtorch``
(the attributes of ``/entry/nbtorch``), ``attrs`` (root attributes),
``dataset``, ``shape`` (of the whole stack), ``frame`` (0-based) and ``frames``,
and what :func:`nbtorch.io.nexus.nexus_goniometry` reads (``detector_2theta_deg``,
``start_angle_deg``, ``angle_increment_deg``, ``labels``, ``unused``) and
:func:`nbtorch.io.nexus.beam_polarization` (``polarization``, ``polarization_angle_deg``,
``polarization_stokes``); a ``y_pixel_size`` other than ``x_pixel_size`` is listed in ``unused``.  Eiger
masters (frames in ``/entry/data/data_000001 ...`` external links) and
compressed datasets (hdf5plugin, imported lazily when installed) are read too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_output_path
from nbtorch.io.nexus import beam_polarization, nexus_goniometry, nexus_rest
from nbtorch.io.panel_images import read_nexus_panels

__all__ = ["write_h5", "h5_writer", "read_h5_image", "h5_frame_count"]

_DETECTOR_FIELDS = {
    "distance_mm": "distance",
    "beam_center_x_mm": "beam_center_x",
    "beam_center_y_mm": "beam_center_y",
    "x_pixel_size_mm": "x_pixel_size",
    "y_pixel_size_mm": "y_pixel_size",
    "sensor_thickness_mm": "sensor_thickness",
}
_LENGTH_TO_MM = {"m": 1000.0, "metre": 1000.0, "meter": 1000.0, "mm": 1.0, "millimetre": 1.0, "millimeter": 1.0,
                 "um": 1e-3, "micron": 1e-3, "microns": 1e-3, "micrometre": 1e-3, "nm": 1e-6}
DEFAULT_DATASET = "/entry/data/data"
_WAVELENGTH_TO_A = {"angstrom": 1.0, "angstroms": 1.0, "a": 1.0, "å": 1.0, "nm": 10.0, "m": 1e10}


def _h5py(path: str | os.PathLike[str]) -> Any:
    try:
        import h5py
    except ImportError:
        raise InputError(f"{path}: HDF5 files need the h5py package: pip install h5py") from None
    try:  # optional extra nbtorch[formats]: registers bitshuffle/LZ4 and the other compression filters with libhdf5
        import hdf5plugin  # noqa: F401
    except ImportError:
        pass
    return h5py


def _attr_value(path: str | os.PathLike[str], key: str, value: Any) -> Any:
    if isinstance(value, (str, bool, np.bool_, int, float, np.integer, np.floating)):
        return value
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.dtype.kind not in "biuf" or arr.ndim > 2:
        raise InputError(f"{path}: geometry/attr {key!r} has unsupported type {type(value).__name__}")
    return arr


def write_h5(
    path: str | os.PathLike[str],
    image: np.ndarray,
    attrs: Mapping[str, Any] | None = None,
    geometry: Mapping[str, Any] | None = None,
    compression: str | None = None,
) -> None:
    """Write a (slow, fast) or (frame, slow, fast) image as NXmx-style HDF5 (see module docstring). Atomic.

    ``attrs`` become root attributes (e.g. program, version, command line);
    ``geometry`` fills the NXmx detector/beam fields and ``/entry/nbtorch``.
    ``compression`` is passed to h5py (e.g. ``"gzip"``).
    """
    writer = h5_writer(path, image, attrs, geometry, compression)
    with atomic_output_path(path) as tmp:
        writer(tmp)


def h5_writer(
    path: str | os.PathLike[str],
    image: np.ndarray,
    attrs: Mapping[str, Any] | None = None,
    geometry: Mapping[str, Any] | None = None,
    compression: str | None = None,
) -> Callable[[os.PathLike[str]], None]:
    """Check what :func:`write_h5` would write and return the function that writes it at a given path.

    Every problem with the inputs (h5py missing, a bad image, attribute or
    geometry value) is raised here; the function raises :class:`InputError`
    (naming ``path``) only if the file system fails.
    """
    h5py = _h5py(path)
    arr = np.asarray(image)
    if arr.ndim not in (2, 3) or arr.size == 0 or arr.dtype.kind not in "biuf":
        raise InputError(f"{path}: HDF5 image must be a non-empty 2-D or 3-D numeric array, got {arr.dtype} {arr.shape}")
    geometry = {k: v for k, v in (geometry or {}).items() if v is not None}
    attrs = {k: v for k, v in (attrs or {}).items() if v is not None}
    geo_attrs = {k: _attr_value(path, k, v) for k, v in geometry.items()}
    root_attrs = {k: _attr_value(path, k, v) for k, v in attrs.items()}
    fields: dict[str, float] = {}
    if "pixel_size_mm" in geometry:
        fields["x_pixel_size"] = fields["y_pixel_size"] = float(geometry["pixel_size_mm"])
    for key, field in _DETECTOR_FIELDS.items():
        if key in geometry:
            try:
                fields[field] = float(geometry[key])
            except (TypeError, ValueError):
                raise InputError(f"{path}: geometry {key!r} must be a number, got {geometry[key]!r}") from None
    wavelength = geometry.get("wavelength_A")
    try:
        wavelength = None if wavelength is None else float(wavelength)
    except (TypeError, ValueError):
        raise InputError(f"{path}: geometry 'wavelength_A' must be a number, got {wavelength!r}") from None

    def write(tmp: os.PathLike[str]) -> None:
        try:
            _write_layout(h5py, tmp, arr, root_attrs, geo_attrs, fields, wavelength, compression)
        except OSError as exc:
            raise InputError(f"{path}: cannot write HDF5 file: {str(exc).splitlines()[0]}") from None

    return write


def _write_layout(h5py: Any, tmp: os.PathLike[str], arr: np.ndarray, root_attrs: Mapping[str, Any],
                  geo_attrs: Mapping[str, Any], fields: Mapping[str, float], wavelength: float | None,
                  compression: str | None) -> None:
    chunks = (1, *arr.shape[1:]) if arr.ndim == 3 and compression else None
    with h5py.File(tmp, "w") as f:
        f.attrs["default"] = "entry"
        for key, value in root_attrs.items():
            f.attrs[key] = value
        entry = f.create_group("entry")
        entry.attrs["NX_class"] = "NXentry"
        entry.attrs["default"] = "data"
        entry.create_dataset("definition", data="NXmx")
        data = entry.create_group("data")
        data.attrs["NX_class"] = "NXdata"
        data.attrs["signal"] = "data"
        data.create_dataset("data", data=arr, compression=compression, chunks=chunks)
        instrument = entry.create_group("instrument")
        instrument.attrs["NX_class"] = "NXinstrument"
        detector = instrument.create_group("detector")
        detector.attrs["NX_class"] = "NXdetector"
        for field, value in fields.items():
            detector.create_dataset(field, data=value).attrs["units"] = "mm"
        beam = instrument.create_group("beam")
        beam.attrs["NX_class"] = "NXbeam"
        if wavelength is not None:
            beam.create_dataset("incident_wavelength", data=wavelength).attrs["units"] = "angstrom"
        extra = entry.create_group("nbtorch")
        extra.attrs["NX_class"] = "NXcollection"
        for key, value in geo_attrs.items():
            extra.attrs[key] = value


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        return value.tolist() if value.dtype.kind in "OSU" else value
    if isinstance(value, np.generic):
        return value.item()
    return value


def _scalar_with_units(path: str, node: Any, name: str, table: Mapping[str, float], default_unit: str) -> tuple[float, str]:
    try:
        value = float(np.asarray(node[()]).reshape(-1)[0])
    except (TypeError, ValueError, IndexError):
        raise InputError(f"{path}: {node.name} is not a number") from None
    unit = str(_plain(node.attrs.get("units", default_unit))).strip().lower()
    if unit in ("pixel", "pixels"):
        return value, "px"
    if unit not in table:
        raise InputError(f"{path}: {node.name} has unsupported units {unit!r}")
    return value * table[unit], name


def _check_filters(h5py: Any, name: str, node: Any) -> None:
    """Refuse a dataset compressed with an HDF5 filter that is not available (before libhdf5 fails on it)."""
    plist = node.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        code, _, _, label = plist.get_filter(i)
        if not h5py.h5z.filter_avail(code):
            what = label.decode("latin-1", errors="replace") if isinstance(label, bytes) else str(label)
            raise InputError(f"{name}: {node.name} is compressed with HDF5 filter {code} ({what or 'unknown'}), which "
                             "this h5py cannot decode: pip install 'nbtorch[formats]' (hdf5plugin)")


def _image_datasets(h5py: Any, f: Any, name: str, dataset: str) -> list[Any]:
    """The dataset, or for the default dataset of an Eiger master without it, its ``data_000001 ...`` series."""
    node = f.get(dataset)
    if node is not None and isinstance(node, h5py.Dataset):
        return [node]
    group = f.get("/entry/data") if dataset == DEFAULT_DATASET else None
    series = sorted(k for k in group if re.fullmatch(r"data_\d{6}", k)) if isinstance(group, h5py.Group) else []
    nodes = []
    for key in series:
        try:
            nodes.append(group[key])
        except (KeyError, OSError):  # an external link to a file that is not there
            raise InputError(f"{name}: /entry/data/{key} links to a data file that cannot be opened "
                             "(the Eiger master needs its data files beside it)") from None
    if not nodes:
        raise InputError(f"{name}: no dataset {dataset!r}")
    return nodes


def _one_frame(name: str, dataset: str, nodes: list[Any], frame: int | None) -> tuple[np.ndarray, tuple, int, int]:
    """The (slow, fast) image of ``frame`` among ``nodes``: (image, shape of the whole stack, frame, frames)."""
    if len(nodes) == 1 and len(nodes[0].shape) == 2:
        if frame not in (None, 0):
            raise InputError(f"{name}: {dataset} is 2-D; frame {frame} does not exist")
        return nodes[0][()], tuple(nodes[0].shape), 0, 1
    for node in nodes:
        if len(node.shape) != 3:
            raise InputError(f"{name}: {node.name} has {len(node.shape)} dimensions, expected 2 or 3")
    total = sum(int(node.shape[0]) for node in nodes)
    if frame is None:
        if total != 1:
            raise InputError(f"{name}: {dataset} holds {total} frames; choose one with --frame N (frame= from Python)")
        frame = 0
    if not -total <= frame < total:
        raise InputError(f"{name}: frame {frame} out of range for {dataset} with {total} frames")
    index = frame % total
    local = index
    for node in nodes:
        if local < node.shape[0]:
            return node[local], (total, *nodes[0].shape[1:]), index, total
        local -= int(node.shape[0])
    raise InputError(f"{name}: frame {frame} out of range for {dataset} with {total} frames")  # not reached


def _detector_meta(name: str, f: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    detector = f.get("/entry/instrument/detector")
    if detector is not None:
        for key, field in _DETECTOR_FIELDS.items():
            if field in detector:
                value, unit = _scalar_with_units(name, detector[field], key, _LENGTH_TO_MM, "mm")
                meta[key if unit != "px" else key.replace("_mm", "_px")] = value
        if "distance_mm" not in meta and "detector_distance" in detector:  # Dectris Eiger masters
            meta["distance_mm"], _ = _scalar_with_units(name, detector["detector_distance"], "distance_mm",
                                                        _LENGTH_TO_MM, "m")
    beam = f.get("/entry/instrument/beam")
    if beam is not None and "incident_wavelength" in beam:
        value, _ = _scalar_with_units(name, beam["incident_wavelength"], "wavelength_A", _WAVELENGTH_TO_A,
                                      "angstrom")
        meta["wavelength_A"] = value
    return meta


def _pixel_notes(meta: dict[str, Any]) -> None:
    """``y_pixel_size`` that differs from ``x_pixel_size`` is said not to be the model's pixel size."""
    x, y = meta.get("x_pixel_size_mm"), meta.get("y_pixel_size_mm")
    if x is not None and y is not None and y != x:
        meta["unused"]["y_pixel_size"] = (f"{y:g} mm", "the model's pixels are square (-pixel): x_pixel_size is "
                                          "taken; y_pixel_size turns beam_center_y into pixels")


def h5_frame_count(path: str | os.PathLike[str], dataset: str = DEFAULT_DATASET) -> int:
    """How many frames the image ``dataset`` of an HDF5 file holds (a 2-D dataset: 1; an Eiger master: the frames of
    its data files), from the shapes alone (no pixel read).

    Raises:
        InputError: not found, not HDF5, no such dataset, a data file of a master missing.
    """
    h5py, f = _open_h5(path)
    with f:
        nodes = _image_datasets(h5py, f, str(path), dataset)
        return sum(int(n.shape[0]) if len(n.shape) == 3 else 1 for n in nodes)


def _open_h5(path: str | os.PathLike[str]):
    """``(h5py, the open file)``; a missing or non-HDF5 file is an :class:`InputError` naming it."""
    h5py = _h5py(path)
    name = str(path)
    try:
        return h5py, h5py.File(path, "r")
    except FileNotFoundError:
        raise InputError(f"{name}: HDF5 file not found") from None
    except OSError as exc:
        raise InputError(f"{name}: cannot open as HDF5: {_first_line(exc)}") from None


def read_h5_image(
    path: str | os.PathLike[str], dataset: str = DEFAULT_DATASET, frame: int | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """Read an image (and NXmx geometry) from HDF5; return ``(image (slow, fast), meta)``.

    For 3-D data ``(frame, slow, fast)`` give ``frame`` (it may be omitted when there is a single frame).
    An Eiger master without ``/entry/data/data`` gives the frames of its ``data_000001, data_000002 ...``
    (external links to the data files) as one stack.  Compressed datasets (bitshuffle/LZ4 ...) need the
    filters of hdf5plugin (``nbtorch[formats]``), loaded here when it is installed.
    """
    h5py, f = _open_h5(path)
    name = str(path)
    try:
        with f:
            nodes = _image_datasets(h5py, f, name, dataset)
            for node in nodes:
                _check_filters(h5py, name, node)
            panelled = read_nexus_panels(h5py, f, name, nodes[0], frame) if len(nodes) == 1 else None
            if panelled is None:
                image, shape, index, frames = _one_frame(name, dataset, nodes, frame)
            else:  # an NXmx detector of several modules (nbtorch.io.panel_images)
                image, boxes, frames, stacked = panelled
                shape, index = tuple(nodes[0].shape), (frame or 0) % frames
            meta: dict[str, Any] = {"dataset": dataset, "shape": shape, "frame": index, "frames": frames}
            if panelled is not None:
                meta["panel_boxes"] = boxes
                meta["panels_stacked"] = stacked
            meta.update(_detector_meta(name, f))
            for more in (nexus_goniometry(h5py, f, name, index, "distance_mm" in meta),
                         beam_polarization(h5py, f, name, index)):
                meta.setdefault("labels", {}).update(more.pop("labels", {}))
                meta.setdefault("unused", {}).update(more.pop("unused", {}))
                meta.update(more)
            _pixel_notes(meta)
            for key, note in nexus_rest(h5py, f, meta).items():  # every other value, said not to be used
                meta["unused"].setdefault(key, note)
            extra = f.get("/entry/nbtorch")
            meta["nbtorch"] = ({k: _plain(v) for k, v in extra.attrs.items() if k != "NX_class"}
                               if extra is not None else {})
            meta["attrs"] = {k: _plain(v) for k, v in f.attrs.items() if k != "default"}
    except InputError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError, IndexError) as exc:
        # libhdf5 reports a damaged file from deep inside (bad signature, address past the end of file ...)
        raise InputError(f"{name}: cannot read HDF5 file (damaged or truncated?): {_first_line(exc)}") from None
    return np.asarray(image), meta
