"""Detector two-theta and the rotation of a frame from a NeXus NXmx file (h5py, opened by the caller).

NXmx places the detector and the sample through chains of ``NXtransformations``: ``depends_on`` (a field of
``NXdetector`` / ``NXsample``) names the first axis, each axis dataset names the next in its ``depends_on``
attribute, down to ``"."``.  An axis has ``transformation_type`` (``rotation`` or ``translation``), ``vector``,
``units`` and one value per frame (or one for all).  Read here:

* **detector two-theta**: the rotation of the detector's chain whose name holds ``theta`` (``two_theta``);
  the other rotations of the chain are said not to be used; a translation gives the distance only when the
  detector has no ``distance`` field;
* **rotation**: the scan axis is the sample chain's rotation that moves (its values differ from frame to
  frame, or it has ``<axis>_increment_set`` / ``<axis>_end``); the frame's start is its value, the width
  ``<axis>_increment_set``, else ``<axis>_end - <axis>``, else the step to the next frame (0 for one frame:
  a still).  The other rotations with a non-zero angle are goniometer settings, said not to be used.

The beam's polarisation (:func:`beam_polarization`) is ``/entry/instrument/beam/incident_polarization_stokes``,
the Stokes vector (S0, S1, S2, S3) in the NeXus frame (z along the beam, y up, x horizontal), one row per frame or
one for all: its linear part ``P = sqrt(S1² + S2²) / S0`` has its E-vector at ``psi = atan2(S2, S1) / 2`` from x
towards y (the Stokes convention); the fraction of the beam's intensity along that E-vector is
``(1 + P) / 2`` (the circular part S3 scatters as unpolarised light).

Files without the chains (Dectris Eiger masters of older firmware) give the same from
``/entry/sample/goniometer/{omega, phi, chi, kappa}`` with ``<axis>_increment`` or ``<axis>_range_average``,
and ``/entry/instrument/detector/goniometer/two_theta``.

:func:`nexus_rest` lists every other dataset under ``/entry/instrument`` and ``/entry/sample`` with why it is not
used (layout, corrections, NXgeometry, restated values, goniometer, the rest; an Eiger master's ``detectorModule_NNN``
groups as one entry), so that the header notes of :mod:`refine.inputs.start_model` say every value.

:func:`nexus_goniometry` returns the keys of :func:`nbtorch.io.cbf.read_cbf` (``detector_2theta_deg``,
``start_angle_deg``, ``angle_increment_deg``, maybe ``distance_mm``) with ``labels`` and ``unused`` as
:mod:`nbtorch.io.fabio_formats` describes them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from nbtorch.errors import InputError

__all__ = ["nexus_goniometry", "beam_polarization", "nexus_rest"]

_ANGLE_TO_DEG = {"deg": 1.0, "degree": 1.0, "degrees": 1.0, "rad": 180.0 / math.pi, "radian": 180.0 / math.pi,
                 "radians": 180.0 / math.pi}
_LENGTH_TO_MM = {"m": 1000.0, "mm": 1.0, "um": 1e-3, "micron": 1e-3}
_INCREMENTS = ("_increment_set", "_increment", "_range_average")
_MAX_CHAIN = 32


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.size == 1:
        return _text(value.reshape(-1)[0])
    return str(value)


def _values(name: str, node: Any, table: dict[str, float], default: str) -> np.ndarray:
    """An axis's values (1-D) in degrees or mm."""
    unit = _text(node.attrs.get("units", default)).strip().lower()
    if unit not in table:
        raise InputError(f"{name}: {node.name} has unsupported units {unit!r}")
    try:
        values = np.asarray(node[()], dtype=np.float64).reshape(-1) * table[unit]
    except (TypeError, ValueError):
        raise InputError(f"{name}: {node.name} is not a number") from None
    if values.size == 0 or not np.all(np.isfinite(values)):
        raise InputError(f"{name}: {node.name} has no finite value")
    return values


def _chain(h5py: Any, f: Any, group: Any) -> list[Any]:
    """The axes ``group`` depends on, first to last (empty without ``depends_on``)."""
    if group is None:
        return []
    ref = group.get("depends_on") if isinstance(group.get("depends_on"), h5py.Dataset) else None
    path = _text(ref[()]) if ref is not None else _text(group.attrs.get("depends_on", "."))
    axes: list[Any] = []
    parent = group
    while path not in (".", "") and len(axes) < _MAX_CHAIN:
        node = f.get(path) if path.startswith("/") else parent.get(path)
        if not isinstance(node, h5py.Dataset) or any(node.name == a.name for a in axes):
            break
        axes.append(node)
        parent, path = node.parent, _text(node.attrs.get("depends_on", "."))
    return axes


def _at(values: np.ndarray, frame: int) -> float:
    return float(values[min(frame, values.size - 1)])


def _vector(node: Any) -> str:
    vec = node.attrs.get("vector")
    return "(" + ", ".join(f"{float(v):g}" for v in np.asarray(vec).reshape(-1)) + ")" if vec is not None else ""


def _detector(h5py: Any, f: Any, name: str, frame: int, have_distance: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"labels": {}, "unused": {}}
    det = f.get("/entry/instrument/detector")
    axes = _chain(h5py, f, det)
    if not axes and det is not None and isinstance(det.get("goniometer/two_theta"), h5py.Dataset):
        axes = [det["goniometer/two_theta"]]
    for node in axes:
        axis = node.name.rsplit("/", 1)[-1]
        kind = _text(node.attrs.get("transformation_type", "rotation" if "theta" in axis else "")).lower()
        if kind == "rotation":
            angle = _at(_values(name, node, _ANGLE_TO_DEG, "deg"), frame)
            if "theta" in axis.lower() and "detector_2theta_deg" not in out:
                out["detector_2theta_deg"], out["labels"]["detector_2theta_deg"] = angle, axis
                if _vector(node):
                    out["unused"][f"{axis} vector"] = (_vector(node), "the detector swings about the model's "
                                                       "two-theta axis (-twotheta_axis)")
            elif angle:
                out["unused"][axis] = (f"{angle:g} deg", "detector rotation")
        elif kind == "translation":
            shift = _at(_values(name, node, _LENGTH_TO_MM, "mm"), frame)
            if not have_distance and "distance_mm" not in out and shift > 0:
                out["distance_mm"], out["labels"]["distance_mm"] = shift, axis
            elif shift:
                out["unused"][axis] = (f"{shift:g} mm", "the distance is the detector's distance field"
                                       if have_distance else "detector offset")
    return out


def _sample_axes(h5py: Any, f: Any) -> list[Any]:
    sample = f.get("/entry/sample")
    axes = [a for a in _chain(h5py, f, sample)
            if _text(a.attrs.get("transformation_type", "")).lower() == "rotation"]
    gonio = f.get("/entry/sample/goniometer")
    if not axes and isinstance(gonio, h5py.Group):
        axes = [gonio[k] for k in ("omega", "phi", "chi", "kappa") if isinstance(gonio.get(k), h5py.Dataset)]
    return axes


def _width(name: str, node: Any, values: np.ndarray, frame: int) -> tuple[float, str] | None:
    """The frame's rotation width and where it came from, or None for an axis that does not move."""
    axis, parent = node.name.rsplit("/", 1)[-1], node.parent
    for suffix in _INCREMENTS:
        inc = parent.get(axis + suffix)
        if inc is not None and hasattr(inc, "shape"):
            return _at(_values(name, inc, _ANGLE_TO_DEG, "deg"), frame), axis + suffix
    end = parent.get(axis + "_end")
    if end is not None and hasattr(end, "shape"):
        return _at(_values(name, end, _ANGLE_TO_DEG, "deg"), frame) - _at(values, frame), f"{axis}_end - {axis}"
    if values.size > 1 and np.ptp(values) > 0:
        i = min(frame, values.size - 2)
        return float(values[i + 1] - values[i]), f"{axis} step"
    return None


def nexus_goniometry(h5py: Any, f: Any, name: str, frame: int, have_distance: bool) -> dict[str, Any]:
    """Detector two-theta and the rotation of ``frame`` (0-based) of an open NXmx file (module docstring)."""
    out = _detector(h5py, f, name, frame, have_distance)
    axes = []
    for node in _sample_axes(h5py, f):
        values = _values(name, node, _ANGLE_TO_DEG, "deg")
        axes.append((node, values, _width(name, node, values, frame)))
    # the scan axis: the first that moves on this frame, else the first with a (zero) width: a still
    moving = [a for a in axes if a[2] is not None and a[2][0]] or [a for a in axes if a[2] is not None]
    scan = moving[0][0].name if moving else None
    for node, values, width in axes:
        axis = node.name.rsplit("/", 1)[-1]
        if node.name == scan:
            out["start_angle_deg"], out["labels"]["start_angle_deg"] = _at(values, frame), axis
            out["angle_increment_deg"], out["labels"]["angle_increment_deg"] = width
            if _vector(node):
                out["unused"][f"{axis} vector"] = (_vector(node), "rotation axis")
        elif _at(values, frame):
            out["unused"][axis] = (f"{_at(values, frame):g} deg", "goniometer")
    return out


def beam_polarization(h5py: Any, f: Any, name: str, frame: int) -> dict[str, Any]:
    """The beam's polarisation of ``frame`` from ``beam/incident_polarization_stokes`` (module docstring):
    ``polarization`` (the fraction of the intensity along the E-vector), ``polarization_angle_deg`` (psi),
    ``polarization_stokes`` (the frame's S0..S3) and its label; a vector that is not a polarisation is listed in
    ``unused``; {} without the field."""
    field = "incident_polarization_stokes"
    node = f.get(f"/entry/instrument/beam/{field}")
    if not isinstance(node, h5py.Dataset):
        return {}
    try:
        rows = np.asarray(node[()], dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{name}: {node.name} is not a number") from None
    if rows.ndim not in (1, 2) or rows.shape[-1] != 4:
        return {"unused": {field: (f"of shape {rows.shape}", "a Stokes vector has 4 values (S0, S1, S2, S3)")}}
    s0, s1, s2, s3 = (float(v) for v in rows.reshape(-1, 4)[min(frame, rows.reshape(-1, 4).shape[0] - 1)])
    text = "(" + ", ".join(f"{v:g}" for v in (s0, s1, s2, s3)) + ")"
    if not (all(math.isfinite(v) for v in (s0, s1, s2, s3)) and s0 > 0):
        return {"unused": {field: (text, "S0, the intensity, must be positive and every value finite")}}
    if math.sqrt(s1 * s1 + s2 * s2 + s3 * s3) > s0 * (1.0 + 1e-9):
        return {"unused": {field: (text, "sqrt(S1^2 + S2^2 + S3^2) exceeds S0: not a polarisation")}}
    degree = min(1.0, math.hypot(s1, s2) / s0)
    return {"polarization": 0.5 * (1.0 + degree), "polarization_angle_deg": 0.5 * math.degrees(math.atan2(s2, s1)),
            "polarization_stokes": (s0, s1, s2, s3), "labels": {"polarization": field}}


# the fields a reader takes (nbtorch.io.hdf5, refine.inputs.images), relative to /entry/instrument
_TAKEN = {"detector/distance", "detector/beam_center_x", "detector/beam_center_y", "detector/x_pixel_size",
          "detector/y_pixel_size", "detector/sensor_thickness", "detector/sensor_material", "detector/saturation_value",
          "detector/pixel_mask", "detector/depends_on", "detector/detectorSpecific/countrate_correction_count_cutoff",
          "detector/detectorSpecific/pixel_mask", "beam/incident_wavelength", "beam/incident_polarization_stokes"}
_LAYOUT = {"x_pixels_in_detector", "y_pixels_in_detector", "bit_depth_image", "bit_depth_readout", "compression",
           "nimages", "ntrigger", "nsequences", "nframes_sum", "roi_mode", "data_collection_date"}
_CORRECTIONS_WHY = "corrections the detector applied and their tables: the pixels are used as stored"
_MODULES_WHY = "per-module calibration and settings: the pixels are used as stored"
_GEOMETRY_WHY = ("NXgeometry (deprecated) restating where the detector is: the model's distance and beam centre are "
                 "the detector's own fields")


_ZERO_AXES_WHY = "goniometer axes at zero: no setting to model"


def _all_zero(node: Any) -> bool:
    try:
        values = np.asarray(node[()], dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return values.size > 0 and not np.any(values)


def _shown(node: Any) -> str:
    """A dataset's value as short text (with its units), or its shape when it is an array."""
    if node.shape and int(np.prod(node.shape)) > 6:
        return f"array {tuple(int(n) for n in node.shape)}"
    value = node[()]
    if isinstance(value, (bytes, str, np.bytes_)) or getattr(value, "dtype", np.dtype(float)).kind in "SUO":
        text = " ".join(_text(value).split())
        return text if len(text) <= 60 else text[:57] + "..."
    values = np.asarray(value).reshape(-1)
    text = ", ".join(f"{float(v):g}" for v in values) if values.dtype.kind in "biuf" else _text(value)
    unit = _text(node.attrs.get("units", "")).strip()
    return (f"({text})" if values.size > 1 else text) + (f" {unit}" if unit else "")


def nexus_rest(h5py: Any, f: Any, meta: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Every dataset under ``/entry/instrument`` and ``/entry/sample`` that the readers do not take and that
    ``meta["labels"]``/``meta["unused"]`` do not already name, with why it is not used (``{name: (value, why)}``,
    names relative to their group; an Eiger master's ``detectorModule_NNN`` groups as one entry)."""
    labels = {str(v) for v in (meta.get("labels") or {}).values()}
    said = set(meta.get("unused") or {}) | {k.split(" ")[0] for k in (meta.get("unused") or {})}
    scan = (meta.get("labels") or {}).get("start_angle_deg")
    found: dict[str, tuple[str, str]] = {}
    modules: list[str] = []
    for top in ("instrument", "sample"):
        group = f.get(f"/entry/{top}")
        if not isinstance(group, h5py.Group):
            continue
        names: list[str] = []
        group.visit(names.append)
        for rel in names:
            parts = rel.split("/")
            module = next((p for p in parts if p.startswith("detectorModule_")), None)
            if module is not None:
                if module not in modules:
                    modules.append(module)
                continue
            try:
                node = group.get(rel)
            except (KeyError, OSError):  # an external link to a file that is not there
                continue
            if not isinstance(node, h5py.Dataset):
                continue
            base = parts[-1]
            if f"{top}/{rel}".split("/", 1)[1] in _TAKEN and top == "instrument" or base in labels or base in said:
                continue
            if rel == "detector/detector_distance":
                if "distance" not in group["detector"]:  # a Dectris master's distance (nbtorch.io.hdf5)
                    continue
                why = "the distance is detector/distance"
            elif rel.startswith("detector/geometry/"):
                why = _GEOMETRY_WHY
            elif base == "photon_energy":
                why = "restates the wavelength (incident_wavelength)"
            elif base in _LAYOUT:
                why = "layout"
            elif (base.endswith("_applied") or "countrate_correction" in base or base in ("flatfield", "trimbit")
                  or base == "number_of_excluded_pixels"):
                why = _CORRECTIONS_WHY
            elif top == "sample" or "goniometer" in parts:
                axis = base.split("_")[0] if base.split("_")[0] in ("omega", "phi", "chi", "kappa") else base
                axis = "two_theta" if base.startswith("two_theta") else axis
                why = (f"the rotation is {scan} and its width {meta['labels'].get('angle_increment_deg')}"
                       if scan and axis == scan else
                       "the detector's two-theta is two_theta" if axis == "two_theta" else
                       _ZERO_AXES_WHY if _all_zero(node) else "goniometer")
            else:
                why = "other"
            found[rel] = (_shown(node), why)
    if modules:
        found["detectorSpecific/detectorModule_*"] = (f"{len(modules)} groups ({modules[0]} ... {modules[-1]})",
                                                      _MODULES_WHY)
    return found
