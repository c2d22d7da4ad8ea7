"""The files of a run's result (:mod:`refine.output.results`: its schema and layout): ``result.json``/``joint.json``
(:func:`save_json`), ``result.h5``/``joint.h5`` (:func:`save_h5`), read back by :func:`load_h5`; the JSON form of
numpy and enum values (:func:`jsonable`) and the document and HDF5 pieces both results share.
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from nbtorch.io.atomic import atomic_output_path, atomic_write

if TYPE_CHECKING:  # the results import these writers
    from refine.output.results import JointResult, RefinementResult


def common_document(result, fmt: str, correlation_names, structure_factors: dict | None) -> dict[str, Any]:
    """The part of the JSON document every result has (:mod:`refine.output.results`'s docstring)."""
    return {
        "format": fmt,
        "params": result.params,
        "esds": result.esds,
        "initial_params": result.initial_params,
        "loss_initial": result.loss_initial,
        "loss_final": result.loss_final,
        "steps": result.steps,
        "status": result.status.value,
        "message": result.message,
        "wall_s": result.wall_s,
        "evaluations": result.evaluations,
        "units": result.units,
        "free": list(result.free),
        "refined": result.refined,
        "symmetry": result.symmetry,
        "correlation": {"names": list(correlation_names), "matrix": np.asarray(result.correlation).tolist()},
        "fisher_condition": result.fisher_condition,
        "warnings": list(result.warnings),
        "esd_kind": result.esd_kind,
        "esds_by_kind": result.esd_kinds,
        **({"structure_factors": structure_factors} if structure_factors is not None else {}),
        **({"mosaic_domains": result.mosaic_domains} if result.mosaic_domains else {}),
    }


def jsonable(obj: Any) -> Any:
    """Plain JSON types for a nested structure: numpy scalars and arrays, enums; NaN/Inf -> None."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, Sequence)) and not isinstance(obj, (str, bytes)):  # also a joint run's ValueRows
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if np.isfinite(v) else None  # JSON has no NaN/Inf
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def save_json(result: RefinementResult | JointResult, path: str | Path) -> Path:
    """Write ``result.json`` (or ``joint.json``) atomically (non-finite numbers become ``null``)."""
    path = Path(path)
    text = json.dumps(jsonable(result.to_json_dict()), indent=2, sort_keys=False, allow_nan=False)
    with atomic_write(path, "w") as fh:
        fh.write(text + "\n")
    return path


def save_h5(result: RefinementResult | JointResult, path: str | Path) -> Path:
    """Write ``result.h5`` (or ``joint.h5``) atomically (layout in :mod:`refine.output.results`'s docstring)."""
    import h5py

    path = Path(path)
    doc = result.to_json_dict()
    text = json.dumps(jsonable(doc), allow_nan=False)
    with atomic_output_path(path) as tmp:
        with h5py.File(tmp, "w") as h5:
            for k in ("loss_initial", "loss_final", "steps", "evaluations", "wall_s", "fisher_condition"):
                h5.attrs[k] = getattr(result, k)
            h5.attrs["status"] = result.status.value
            h5.attrs["message"] = result.message
            h5.attrs["symmetry"] = result.symmetry
            h5.attrs["format"] = doc["format"]
            h5.attrs["esd_kind"] = result.esd_kind or ""
            for group in ("params", "initial_params", "esds", "refined"):
                g = h5.create_group(group)
                for name, v in getattr(result, group).items():
                    g.create_dataset(name, data=float(v)).attrs["units"] = result.units.get(name, "")
            d = h5.create_dataset("correlation", data=np.asarray(result.correlation, dtype=np.float64))
            d.attrs["names"] = np.array([n.encode() for n in doc["correlation"]["names"]])
            if "structure_factors" in doc:
                _write_amplitudes(h5, doc["structure_factors"])
            result._write_h5(h5)
            h5.create_dataset("result_json", data=text)
    return path


def write_history(h5, columns: Mapping[str, Any]):
    """Group ``history``: one dataset per column."""
    hist = h5.create_group("history")
    for col, values in columns.items():
        hist.create_dataset(col, data=np.asarray(values))
    return hist


def write_diagnostics(h5, diagnostics: Mapping[str, Any]) -> None:
    """Group ``diagnostics`` (:mod:`refine.output.results`'s docstring): its scalars as attributes (NaN for null),
    the spot profile's stacks and the background table's columns as datasets."""
    g = h5.create_group("diagnostics")
    for k, v in diagnostics.items():
        if isinstance(v, (int, float, np.number)) or v is None:
            g.attrs[k] = math.nan if v is None else v
    profile = diagnostics.get("profile")
    if profile:
        p = g.create_group("profile")
        p.attrs["spots"], p.attrs["half_px"] = profile["spots"], profile["half_px"]
        for key in ("observed", "model", "difference"):
            p.create_dataset(key, data=np.asarray(profile[f"stack_{key}"], dtype=np.float64))
    table = diagnostics.get("background_by_resolution")
    if table:
        b = g.create_group("background_by_resolution")
        b.attrs["exclude_px"] = table["exclude_px"]
        b.attrs["sigZ"] = math.nan if table.get("sigZ") is None else table["sigZ"]
        for key, column in (("d_max_A", "d_max_A"), ("d_min_A", "d_min_A"), ("pixels", "pixels"),
                            ("observed", "observed_mean"), ("model", "model_mean")):
            b.create_dataset(key, data=np.asarray([row[column] for row in table["bins"]], dtype=np.float64))


def _write_amplitudes(h5, sf: dict) -> None:
    """Group ``structure_factors``: attributes space_group, start, n_free, n_held (min_photons, information); datasets ``hkl``
    (A, 3), ``d_A``, ``F``, ``esd`` (NaN where held), ``refined`` (bool) (``photons``: summed over the images)."""
    g = h5.create_group("structure_factors")
    for k in ("space_group", "start", "n_free", "n_held", "min_photons", "information"):
        if k in sf:
            g.attrs[k] = sf[k]
    rows = sf["reflections"]
    g.create_dataset("hkl", data=np.array([r[:3] for r in rows], dtype=np.int64).reshape(-1, 3))
    g.create_dataset("d_A", data=np.array([r[3] for r in rows], dtype=np.float64))
    g.create_dataset("F", data=np.array([r[4] for r in rows], dtype=np.float64))
    g.create_dataset("esd", data=np.array([math.nan if r[5] is None else r[5] for r in rows], dtype=np.float64))
    g.create_dataset("refined", data=np.array([bool(r[6]) for r in rows], dtype=bool))
    if "photons" in sf:
        g.create_dataset("photons", data=np.asarray(sf["photons"], dtype=np.float64))
    if "nobs" in sf:
        g.create_dataset("nobs", data=np.asarray(sf["nobs"], dtype=np.int64))
    if "anomalous" in sf:  # the pairs: one dataset per column, NaN where an esd is unknown
        a = g.create_group("anomalous")
        table = np.array([[math.nan if x is None else x for x in r] for r in sf["anomalous"]["rows"]],
                         dtype=np.float64).reshape(-1, len(sf["anomalous"]["columns"]))
        for c, name in enumerate(sf["anomalous"]["columns"]):
            a.create_dataset(name, data=table[:, c].astype(np.int64) if name in ("h", "k", "l") else table[:, c])


def load_h5(path: str | Path) -> dict[str, Any]:
    """Read a result file (``result.h5`` or ``joint.h5``) into plain dicts and numpy arrays: the attributes; each
    group as name -> value (a scalar as a float; nested groups alike; ``structure_factors`` with its
    attributes); each other dataset as an array; the correlation's names under ``"names"`` and the JSON document
    under ``"json"``."""
    import h5py

    def attrs(obj) -> dict:
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in obj.attrs.items()}

    def group(g) -> dict:
        out = attrs(g) if g.name == "/structure_factors" else {}
        for k, item in g.items():
            if isinstance(item, h5py.Group):
                out[k] = group(item)
            else:
                out[k] = float(item[()]) if item.shape == () and item.dtype.kind == "f" else item[()]
        return out

    out: dict[str, Any] = {}
    with h5py.File(path, "r") as h5:
        out.update(attrs(h5))
        for k, item in h5.items():
            if k == "result_json":
                raw = item[()]
                out["json"] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            else:
                out[k] = group(item) if isinstance(item, h5py.Group) else item[()]
        out["names"] = [n.decode() for n in h5["correlation"].attrs["names"]]
    return out
