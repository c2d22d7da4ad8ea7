"""A serial run's result in one HDF5 file, one row per image (:class:`refine.many.serial.SerialResult`).

The file is the last round's joint result (:func:`refine.output.results.save_h5`, format
``nbtorch-refine-joint``: its ``images``/``image_esds`` rows are the images used) with a group ``serial``:

======================  =====================================================================================
``serial`` attrs        ``n_images``, ``n_used``, ``n_dropped``, ``rule`` (the screening rule in words),
                        ``summary`` (:meth:`SerialResult.summary`), ``rounds`` (JSON), ``wall_s``,
                        ``sources`` (JSON list of the images' names, when given)
``serial/index``        (n,) image index (the position in the run's list of images)
``serial/used``         (n,) 1 used, 0 dropped
``serial/reason``       (n,) why the image was dropped ("" when used)
``serial/round``        (n,) the round that dropped it (0 when used)
``serial/excess``       (n,) the image's final fit excess (loss / expected; at the round that dropped it)
``serial/values/NAME``  (n,) every per-image canonical value (``scale``, ``background``, ``misset_x``, ...)
``serial/esds/NAME``    (n,) the esds of the per-image names (NaN for a dropped image)
======================  =====================================================================================

:func:`load_serial_h5` reads back what :func:`refine.many.serial.refine_serial` needs to continue with more images.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from nbtorch.errors import InputError
from refine.output.results import save_joint_h5

__all__ = ["save_serial_h5", "load_serial_h5", "serial_rows"]


def serial_rows(result) -> dict:
    """Column name -> (n,) array over every image of ``result`` (the layout of the module docstring)."""
    n = result.n_images
    pos = {i: j for j, i in enumerate(result.used)}
    names = sorted({k for v in result.joint.images for k in v})
    esd_names = sorted({k for v in result.joint.image_esds for k in v})
    cols = {"index": np.arange(n), "used": np.array([int(i in pos) for i in range(n)], dtype=np.int8),
            "reason": np.array([result.dropped.get(i, {}).get("reason", "") for i in range(n)], dtype=object),
            "round": np.array([int(result.dropped.get(i, {}).get("round", 0)) for i in range(n)])}
    fits = result.joint.image_fit or tuple({} for _ in result.used)
    cols["excess"] = np.array([fits[pos[i]].get("excess", math.nan) if i in pos
                               else result.dropped[i].get("fit", {}).get("excess", math.nan) for i in range(n)])
    for k in names:
        cols[f"values/{k}"] = np.array([result.joint.images[pos[i]].get(k, math.nan) if i in pos
                                        else result.dropped[i].get("values", {}).get(k, math.nan) for i in range(n)])
    for k in esd_names:
        cols[f"esds/{k}"] = np.array([result.joint.image_esds[pos[i]].get(k, math.nan) if i in pos else math.nan
                                      for i in range(n)])
    return cols


def save_serial_h5(result, path: str | Path, sources=None) -> Path:
    """Write ``result`` (a :class:`~refine.many.serial.SerialResult`) to ``path`` atomically; ``sources``: the
    images' names (file names), one per image, kept as the attribute ``sources`` (JSON)."""
    import h5py

    path = Path(path)
    tmp = path.with_name(f".{path.name}.serial.tmp")
    save_joint_h5(result.joint, tmp)
    with h5py.File(tmp, "a") as h5:
        g = h5.create_group("serial")
        g.attrs.update({"n_images": result.n_images, "n_used": len(result.used), "n_dropped": len(result.dropped),
                        "rule": result.rule, "summary": result.summary(), "wall_s": result.wall_s,
                        "rounds": json.dumps(list(result.rounds))})
        if sources is not None:
            g.attrs["sources"] = json.dumps([str(x) for x in sources])
        for k, col in serial_rows(result).items():
            if col.dtype == object:
                g.create_dataset(k, data=np.array([s.encode() for s in col], dtype=h5py.string_dtype()))
            else:
                g.create_dataset(k, data=col)
    os.replace(tmp, path)
    return path


def load_serial_h5(path: str | Path) -> dict:
    """``{"n_images", "shared", "images": {index: values}, "dropped": {index: {"reason", "round", "values"}},
    "summary", "rows"}`` from a file of :func:`save_serial_h5`."""
    import h5py

    path = Path(path)
    try:
        h5 = h5py.File(path, "r")
    except OSError as exc:
        raise InputError(f"previous: {path} is not a readable HDF5 file ({exc})") from None
    with h5:
        if "serial" not in h5:
            raise InputError(f"previous: {path} is not a serial result (no group 'serial')")
        g = h5["serial"]
        rows = {}
        g.visititems(lambda name, obj: rows.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        doc = json.loads(h5["result_json"][()])
        summary, n = str(g.attrs["summary"]), int(g.attrs["n_images"])
        sources = json.loads(g.attrs["sources"]) if "sources" in g.attrs else None
    rows["reason"] = [r.decode() if isinstance(r, bytes) else str(r) for r in rows["reason"]]
    value_names = [k.split("/", 1)[1] for k in rows if k.startswith("values/")]

    def values(i: int) -> dict:
        return {k: float(rows[f"values/{k}"][i]) for k in value_names if math.isfinite(rows[f"values/{k}"][i])}
    images = {i: values(i) for i in range(n) if rows["used"][i]}
    dropped = {i: {"reason": rows["reason"][i], "round": int(rows["round"][i]), "values": values(i)}
               for i in range(n) if not rows["used"][i]}
    return {"n_images": n, "shared": doc["shared"], "images": images, "dropped": dropped, "summary": summary,
            "rows": rows, "sources": sources, "shared_names": list(doc.get("shared_names", [])),
            "per_image_names": list(doc.get("per_image_names", [])), "symmetry": doc.get("symmetry")}
