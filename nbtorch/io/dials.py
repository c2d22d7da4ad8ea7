"""DIALS experiment (``.expt``) and reflection (``.refl``) files, without dxtbx.

``.expt`` is JSON: an ``ExperimentList`` ``{"experiment": [...], "beam": [...], "detector": [...],
"crystal": [...], "goniometer": [...], "scan": [...], ...}`` whose experiments name their models by
index into those lists.  :func:`read_expt` returns one experiment's models as plain dicts
(:class:`DialsExperiment`, vectors in the **DIALS lab frame**, lengths in mm and Å, angles in
degrees) together with the whole document, so that :func:`write_expt` can write it back with only
the refined values changed.

``.refl`` is a msgpack reflection table ``["dials::af::reflection_table", 1, {"identifiers": {id:
uuid}, "nrows": n, "data": {column: [type, [n, bytes]]}}]``, the bytes little-endian C arrays
(``double`` float64, ``int`` int32, ``std::size_t`` uint64, ``bool`` one byte, ``vec3<double>``
n x 3 float64, ``cctbx::miller::index<>`` n x 3 int32 ...).  :func:`read_refl` decodes the columns
asked for; :func:`write_refl` writes a table in the same layout (used to cut test files down).
Pixel coordinates (``xyzobs.px.value``, ``xyzcal.px``) are ``(x fast, y slow, z frame)`` with
pixel centres at ``i + 0.5`` (the corner of pixel (0, 0) is 0, 0), as nbtorch's spot lists.

Every problem is one line, an :class:`~nbtorch.errors.InputError` naming the file.  No torch here.
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.raw import read_file_bytes
from nbtorch.io.atomic import atomic_write

__all__ = ["DialsExperiment", "parsed", "forget_parsed", "read_expt", "experiment_image", "write_expt", "read_refl",
           "write_refl", "refl_table", "REFL_TYPES", "scan_oscillation", "check_hierarchy", "hierarchy_walk", "panel_lab_frames", "local_frame"]

#: reflection-table column types this module decodes: type -> (numpy dtype, values per row)
REFL_TYPES: dict[str, tuple[str, int]] = {
    "double": ("<f8", 1), "int": ("<i4", 1), "std::size_t": ("<u8", 1), "bool": ("u1", 1),
    "vec2<double>": ("<f8", 2), "vec3<double>": ("<f8", 3), "int6": ("<i4", 6),
    "cctbx::miller::index<>": ("<i4", 3), "mat3<double>": ("<f8", 9),
}
_REFL_MAGIC = "dials::af::reflection_table"


@dataclass
class DialsExperiment:
    """One experiment of a ``.expt`` file: its models (dicts as in the file, DIALS lab frame).

    ``goniometer`` and ``scan`` are None for a still (also one whose scan has a width of 0: DIALS predicts a still
    from its crystal alone).  ``document`` is the whole file, ``index``
    the experiment's position in it (also the ``id`` of its reflections in a ``.refl``).
    """

    path: str
    document: dict
    index: int
    identifier: str
    beam: dict
    detector: dict
    crystal: dict
    goniometer: dict | None
    scan: dict | None

    @property
    def panel(self) -> dict:
        """The detector's one panel."""
        return self.detector["panels"][0]

    @property
    def panels(self) -> list[dict]:
        """The detector's panels (frames local to their hierarchy group when there is a hierarchy)."""
        return self.detector["panels"]

    def n_experiments(self) -> int:
        return len(self.document["experiment"])


#: the DIALS files this process has parsed, by path and file identity (:func:`parsed`)
_PARSED: OrderedDict = OrderedDict()
#: how many parsed files are kept (a run has one or two of each kind)
PARSED_KEPT = 4


def parsed(path: str, parse: Callable[[str], Any]) -> Any:
    """``parse(path)``, parsed once per process for as long as the file is unchanged: the key is the resolved path
    with the file's inode, size and modification and change times, so a rewritten file is parsed again.  A run's
    steps (its checks, each image, the spots, the profile, the prior, the written files) each ask for the ``.expt``
    and the ``.refl``; the file is parsed once.  The parsed document is shared: change a copy
    (``copy.deepcopy``), as :func:`updated_document` does.  The last :data:`PARSED_KEPT` are kept."""
    try:
        st = os.stat(path)
    except OSError:
        return parse(path)  # the parser names the problem
    key = (parse.__name__, os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _PARSED:
        _PARSED.move_to_end(key)
        return _PARSED[key]
    value = parse(path)
    _PARSED[key] = value
    while len(_PARSED) > PARSED_KEPT:
        _PARSED.popitem(last=False)
    return value


def forget_parsed() -> None:
    """Forget every parsed file (:func:`parsed`)."""
    _PARSED.clear()


def _load_json(path: str) -> dict:
    return parsed(path, _parse_json)


def _parse_json(path: str) -> dict:
    raw = read_file_bytes(path, "DIALS experiment file")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a DIALS .expt file (not JSON: {str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or "experiment" not in doc:
        raise InputError(f"{path}: not a DIALS .expt file (no 'experiment' list in the JSON)")
    return doc


def _model(path: str, doc: dict, exp: dict, kind: str, required: bool) -> dict | None:
    ref = exp.get(kind)
    if ref is None:
        if required:
            raise InputError(f"{path}: the experiment has no {kind} model")
        return None
    models = doc.get(kind)
    if not isinstance(ref, int) or not isinstance(models, list) or not 0 <= ref < len(models):
        raise InputError(f"{path}: the experiment's {kind} {ref!r} is not an index into the file's {kind} list "
                         "(models kept in separate files are not supported)")
    model = models[ref]
    if not isinstance(model, dict):
        raise InputError(f"{path}: {kind} {ref} is not a JSON object")
    return model


def _vector(path: str, what: str, model: dict, key: str, n: int = 3) -> list[float]:
    value = model.get(key)
    try:
        vec = [float(v) for v in value]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InputError(f"{path}: {what} '{key}' missing or not {n} numbers") from None
    if len(vec) != n or not all(np.isfinite(vec)):
        raise InputError(f"{path}: {what} '{key}' must be {n} finite numbers, got {value!r}")
    return vec


def read_expt(path: str | os.PathLike[str], index: int = 0, multi_panel: bool = False,
              document: dict | None = None) -> DialsExperiment:
    """Experiment ``index`` of a DIALS ``.expt`` file (checked: one panel, the vectors and sizes present).

    ``multi_panel``: accept a detector of several panels and its hierarchy (:func:`check_hierarchy`); every
    panel is checked, and an error names the panel.  ``document``: the file's JSON already read (the
    ``document`` of another of its experiments), so that reading every experiment of a file reads it once.

    Raises:
        InputError: unreadable, not JSON, no experiment, ``index`` out of range, a model missing,
            a multi-panel detector (unless ``multi_panel``), a malformed hierarchy, a goniometer with more
            than one scan axis, a field missing or not numbers.
    """
    name = os.fspath(path)
    doc = document if document is not None else _load_json(name)
    exps = doc["experiment"]
    if not isinstance(exps, list) or not exps:
        raise InputError(f"{name}: no experiment in the file")
    if not 0 <= index < len(exps):
        raise InputError(f"{name}: no experiment {index} (the file has {len(exps)}: 0..{len(exps) - 1})")
    exp = exps[index]
    if not isinstance(exp, dict):
        raise InputError(f"{name}: experiment {index} is not a JSON object")
    beam = _model(name, doc, exp, "beam", True)
    detector = _model(name, doc, exp, "detector", True)
    crystal = _model(name, doc, exp, "crystal", True)
    gonio = _model(name, doc, exp, "goniometer", False)
    scan = _model(name, doc, exp, "scan", False)
    assert beam is not None and detector is not None and crystal is not None
    panels = detector.get("panels")
    if not isinstance(panels, list) or not panels:
        raise InputError(f"{name}: the detector has no panels")
    if len(panels) != 1 and not multi_panel:
        raise InputError(f"{name}: multi-panel detector ({len(panels)} panels); only single-panel detectors "
                         "are supported here (several panels: nbtorch.dials.panels from Python, docs/multi-panel.md)")
    for i, panel in enumerate(panels):
        _check_panel(name, panel, "detector panel" if len(panels) == 1 else _panel_label(i, panel))
    if "hierarchy" in detector:  # its frames place the panels (panel_lab_frames)
        check_hierarchy(name, detector)
    _vector(name, "beam", beam, "direction")
    wavelength = beam.get("wavelength")
    if not isinstance(wavelength, (int, float)) or not wavelength > 0:
        raise InputError(f"{name}: beam 'wavelength' missing or not positive ({wavelength!r})")
    for key in ("real_space_a", "real_space_b", "real_space_c"):
        _vector(name, "crystal", crystal, key)
    if gonio is not None:
        _check_goniometer(name, gonio)
    if scan is not None and _zero_width(scan):
        gonio = scan = None  # a still that dials.import gave a scan: nothing turns during the exposure
    if scan is not None:
        scan_oscillation(scan, name)
        _vector(name, "scan", scan, "image_range", 2)
    return DialsExperiment(path=name, document=doc, index=index, identifier=str(exp.get("identifier", "")),
                           beam=beam, detector=detector, crystal=crystal, goniometer=gonio, scan=scan)


def experiment_image(exp: DialsExperiment) -> tuple[str | None, int | None]:
    """``(file, frame)`` of the one image a still experiment names: its imageset's one ``images`` entry (or a
    ``template`` without ``#``), ``frame`` its ``single_file_indices`` ``[k]`` (frame k of a multi-image file such as
    an HDF5 master; None: the file's only image).  A relative path is taken from the ``.expt``'s folder, as dxtbx
    does.  ``(None, None)`` when the experiment names no imageset or no file.

    Raises:
        InputError: an imageset of several images without one chosen, a template of numbered files (``#``),
            several frames chosen, a frame that is not a number >= 0.
    """
    ref = exp.document["experiment"][exp.index].get("imageset")
    imagesets = exp.document.get("imageset")
    if not isinstance(ref, int) or not isinstance(imagesets, list) or not 0 <= ref < len(imagesets) \
            or not isinstance(imagesets[ref], dict):
        return None, None
    iset, where = imagesets[ref], f"{exp.path}: experiment {exp.index}"
    files = [f for f in (iset.get("images") or []) if isinstance(f, str) and f]
    template = iset.get("template")
    if not files and isinstance(template, str) and template:
        if "#" in template:
            raise InputError(f"{where}: its imageset is the numbered files {os.path.basename(template)}, not one still")
        files = [template]
    indices = iset.get("single_file_indices")
    if len(files) > 1:
        raise InputError(f"{where}: its imageset names {len(files)} images; one image per still experiment is read "
                         "(dials.split_experiments gives each still its own)")
    if not files:
        return None, None
    frame = None
    if indices is not None:
        if not isinstance(indices, list) or len(indices) != 1 or isinstance(indices[0], bool) \
                or not isinstance(indices[0], int) or indices[0] < 0:
            raise InputError(f"{where}: single_file_indices {indices!r} is not one frame number >= 0")
        frame = int(indices[0])
    path = files[0]
    if not os.path.isabs(path):
        path = os.path.join(os.path.dirname(os.path.abspath(exp.path)), path)
    return os.path.normpath(path), frame


def _zero_width(scan) -> bool:
    """Whether ``scan`` turns the crystal by nothing: an ``oscillation`` (or one image's ``properties``
    ``oscillation_width``) of width 0."""
    if not isinstance(scan, dict):
        return False
    props = scan.get("properties") if isinstance(scan.get("properties"), dict) else {}
    pair = scan.get("oscillation")
    if isinstance(pair, list) and len(pair) == 2:
        width = pair[1]
    elif isinstance(props.get("oscillation"), list) and len(props["oscillation"]) == 1:
        width = (props.get("oscillation_width") or [None])[0]
    else:
        return False
    return isinstance(width, (int, float)) and width == 0


def _panel_label(index: int, panel) -> str:
    label = panel.get("name") if isinstance(panel, dict) else None
    return f"detector panel {index}" + (f" ({label})" if label else "")


def _check_panel(path: str, panel, what: str) -> None:
    if not isinstance(panel, dict):
        raise InputError(f"{path}: {what} is not a JSON object")
    for key in ("fast_axis", "slow_axis", "origin"):
        _vector(path, what, panel, key)
    _vector(path, what, panel, "pixel_size", 2)
    size = _vector(path, what, panel, "image_size", 2)
    if any(v < 1 or v != int(v) for v in size):
        raise InputError(f"{path}: {what} 'image_size' must be two positive integers, got {size}")


def check_hierarchy(path: str, detector: dict) -> None:
    """A detector's ``hierarchy`` (dxtbx's): a root group, groups with ``fast_axis``, ``slow_axis``, ``origin``
    (each frame local to its parent group) and ``children``, leaves ``{"panel": index}``; every panel exactly
    once.

    Raises:
        InputError: one line naming the group or panel and the problem.
    """
    panels = detector["panels"]
    root = detector["hierarchy"]
    if not isinstance(root, dict) or "panel" in root:
        raise InputError(f"{path}: detector hierarchy: the root must be a group (fast_axis, slow_axis, origin, "
                         "children), not a panel")
    seen: dict[int, str] = {}
    _check_group(path, root, "hierarchy root", len(panels), seen, 0)
    missing = sorted(set(range(len(panels))) - set(seen))
    if missing:
        raise InputError(f"{path}: {_panel_label(missing[0], panels[missing[0]])} is not in the detector hierarchy")


def _check_group(path: str, node: dict, where: str, n_panels: int, seen: dict, depth: int) -> None:
    if depth > 32:
        raise InputError(f"{path}: detector {where}: the hierarchy is more than 32 levels deep")
    for key in ("fast_axis", "slow_axis", "origin"):
        _vector(path, f"detector {where}", node, key)
    children = node.get("children")
    if not isinstance(children, list) or not children:
        raise InputError(f"{path}: detector {where}: 'children' missing, empty or not a list")
    for j, child in enumerate(children):
        if not isinstance(child, dict):
            raise InputError(f"{path}: detector {where} child {j}: not a JSON object")
        if "panel" not in child:
            _check_group(path, child, f"group {child.get('name') or j!s} (in {where})", n_panels, seen, depth + 1)
            continue
        idx = child["panel"]
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n_panels:
            raise InputError(f"{path}: detector {where} child {j}: panel {idx!r} is not a panel index "
                             f"0..{n_panels - 1}")
        if idx in seen:
            raise InputError(f"{path}: detector panel {idx} appears twice in the hierarchy ({seen[idx]} and {where})")
        seen[idx] = where


# --- frames of a hierarchy (dxtbx: every frame in the file is local to its parent group) -----------------------
def _rotation(fast, slow) -> np.ndarray:
    f, s = np.asarray(fast, dtype=np.float64), np.asarray(slow, dtype=np.float64)
    n = np.cross(f, s)
    norm = np.linalg.norm(n)
    if not norm > 0:
        raise InputError(f"detector frame with parallel fast and slow axes ({tuple(f)}, {tuple(s)})")
    return np.stack([f, s, n / norm], axis=1)


def _compose(parent: tuple, node: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lab frame of ``node`` (local fast_axis, slow_axis, origin) under a parent of lab frame ``parent``."""
    pf, ps, po = parent
    r = _rotation(pf, ps)
    f, s, o = (np.asarray(node[k], dtype=np.float64) for k in ("fast_axis", "slow_axis", "origin"))
    return r @ f, r @ s, po + r @ o


def hierarchy_walk(detector: dict):
    """``({panel index: its parent group's lab frame}, [(level, name, lab frame, [panel indices]) of every group])``
    of a detector with a (checked, :func:`check_hierarchy`) hierarchy."""
    leaves, groups = {}, []

    def visit(node: dict, frame: tuple, level: int, name: str) -> list[int]:
        members = []
        for j, child in enumerate(node["children"]):
            if "panel" in child:
                leaves[int(child["panel"])] = frame
                members.append(int(child["panel"]))
            else:
                child_frame = _compose(frame, child)
                members += visit(child, child_frame, level + 1, str(child.get("name") or f"{name}/{j}"))
        groups.append((level, name, frame, sorted(members)))
        return members

    root = detector["hierarchy"]
    identity = (np.array([1.0, 0, 0]), np.array([0, 1.0, 0]), np.zeros(3))
    visit(root, _compose(identity, root), 0, str(root.get("name") or "root"))
    return leaves, groups


def panel_lab_frames(detector: dict) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(fast, slow, origin)`` of every panel in the DIALS lab frame (mm), the hierarchy composed."""
    panels = detector["panels"]
    if "hierarchy" not in detector:
        return [tuple(np.asarray(p[k], dtype=np.float64) for k in ("fast_axis", "slow_axis", "origin"))
                for p in panels]
    leaves, _ = hierarchy_walk(detector)
    return [_compose(leaves[i], p) for i, p in enumerate(panels)]


def local_frame(parent: tuple, fast, slow, origin) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of the composition: a lab frame written local to a parent of lab frame ``parent``."""
    pf, ps, po = parent
    r_inv = np.linalg.inv(_rotation(pf, ps))
    return r_inv @ np.asarray(fast), r_inv @ np.asarray(slow), r_inv @ (np.asarray(origin) - po)

def _check_goniometer(path: str, gonio: dict) -> None:
    """A single-axis goniometer (``rotation_axis``) or a multi-axis one (``axes``, ``angles``, one ``scan_axis``)."""
    if "axes" not in gonio:
        _vector(path, "goniometer", gonio, "rotation_axis")
        return
    axes, angles, scan_axis = gonio.get("axes"), gonio.get("angles"), gonio.get("scan_axis")
    if not isinstance(axes, list) or not axes:
        raise InputError(f"{path}: goniometer 'axes' must be a list of 3-vectors")
    for i in range(len(axes)):
        _vector(path, f"goniometer axis {i}", {"axis": axes[i]}, "axis")
    if not isinstance(angles, list) or len(angles) != len(axes):
        raise InputError(f"{path}: goniometer 'angles' must be {len(axes)} numbers, one per axis, got {angles!r}")
    _vector(path, "goniometer", gonio, "angles", len(axes))
    if isinstance(scan_axis, list):
        raise InputError(f"{path}: goniometer scan_axis {scan_axis}: more than one moving axis; only one scan axis "
                         "is supported")
    if isinstance(scan_axis, bool) or not isinstance(scan_axis, int) or not 0 <= scan_axis < len(axes):
        raise InputError(f"{path}: goniometer 'scan_axis' must be one axis index 0..{len(axes) - 1}, got {scan_axis!r}")


def scan_oscillation(scan: dict, path: str = "") -> tuple[float, float]:
    """A scan's ``(start angle, width)`` in degrees: its ``oscillation`` pair, or (newer dxtbx) the per-image
    start angles ``properties.oscillation`` (width from two images, or ``oscillation_width`` for one).

    Raises:
        InputError: neither present, or not finite numbers; a width of 0.
    """
    props = scan.get("properties")
    if "oscillation" not in scan and isinstance(props, dict) and isinstance(props.get("oscillation"), list):
        starts = props["oscillation"]
        widths = props.get("oscillation_width") if isinstance(props.get("oscillation_width"), list) else [None]
        try:
            pair = [starts[0], float(starts[1]) - float(starts[0]) if len(starts) > 1 else widths[0]]
        except (IndexError, TypeError, ValueError):
            pair = [None, None]
        start, osc = _vector(path, "scan", {"oscillation": pair}, "oscillation", 2)
    else:
        start, osc = _vector(path, "scan", scan, "oscillation", 2)
    if osc == 0:
        raise InputError(f"{path}: scan oscillation width is 0")
    return start, osc


def write_expt(path: str | os.PathLike[str], document: dict) -> None:
    """Write an ExperimentList document as a ``.expt`` (JSON, indented as DIALS does). Atomic."""
    text = json.dumps(document, indent=2)
    with atomic_write(path, "w") as fh:
        fh.write(text)


def updated_document(experiment: DialsExperiment, beam: dict, detector_panel: dict | list[dict], crystal: dict) -> dict:
    """A copy of the experiment's document with fields of its beam, panel and crystal replaced.

    A model the experiment shares with others of the file (the stills of a serial experiment usually share
    one beam and one detector) is first copied to the end of its list for this experiment alone, so the
    other experiments keep their values.  ``detector_panel``: the fields of panel 0, or a list of fields of
    panels 0, 1, ... (a multi-panel detector).  Stale derived crystal fields (``B_covariance``, scan-point
    matrices) are dropped.
    """
    doc = copy.deepcopy(experiment.document)
    exp = doc["experiment"][experiment.index]
    for kind in ("beam", "detector", "crystal"):
        shared = any(other.get(kind) == exp[kind] for i, other in enumerate(doc["experiment"])
                     if i != experiment.index)
        if shared:
            doc[kind].append(copy.deepcopy(doc[kind][exp[kind]]))
            exp[kind] = len(doc[kind]) - 1
    doc["beam"][exp["beam"]].update(beam)
    for panel, fields in enumerate(detector_panel if isinstance(detector_panel, list) else [detector_panel]):
        doc["detector"][exp["detector"]]["panels"][panel].update(fields)
    cryst = doc["crystal"][exp["crystal"]]
    cryst.update(crystal)
    for key in ("B_covariance", "A_at_scan_points", "B_at_scan_points", "U_at_scan_points",
                "B_covariance_at_scan_points"):
        cryst.pop(key, None)
    return doc


def _unpack(path: str):
    return parsed(path, _parse_refl)


def _parse_refl(path: str):
    try:
        import msgpack
    except ImportError:
        raise InputError(f"{path}: reading DIALS .refl files needs the msgpack package (pip install msgpack)") from None
    raw = read_file_bytes(path, "DIALS reflection file")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise InputError(f"{path}: not a DIALS .refl file (not msgpack: {type(exc).__name__})") from None
    if not (isinstance(obj, list) and len(obj) == 3 and obj[0] == _REFL_MAGIC and isinstance(obj[2], dict)):
        raise InputError(f"{path}: not a DIALS .refl file (no '{_REFL_MAGIC}' header; pickle .refl files "
                         "of old DIALS versions are not supported)")
    table = obj[2]
    if not isinstance(table.get("data"), dict) or not isinstance(table.get("nrows"), int):
        raise InputError(f"{path}: DIALS .refl file without 'nrows' and 'data'")
    return table


def _decode(path: str, name: str, entry, nrows: int) -> np.ndarray:
    try:
        kind, (n, blob) = entry
    except (TypeError, ValueError):
        raise InputError(f"{path}: column {name!r} is not [type, [n, bytes]]") from None
    if kind not in REFL_TYPES:
        raise InputError(f"{path}: column {name!r} has type {kind!r}, which is not supported")
    dtype, width = REFL_TYPES[kind]
    if n != nrows or not isinstance(blob, bytes) or len(blob) != nrows * width * np.dtype(dtype).itemsize:
        raise InputError(f"{path}: column {name!r} has {len(blob) if isinstance(blob, bytes) else '?'} bytes, "
                         f"not {nrows} rows of {kind}")
    arr = np.frombuffer(blob, dtype=dtype).astype(bool if kind == "bool" else dtype[1:])  # native copy
    return arr.reshape(nrows, width) if width > 1 else arr


def read_refl(path: str | os.PathLike[str], columns: tuple[str, ...] = ("xyzobs.px.value",),
              experiment_id: int | None = None, optional: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The ``columns`` of a DIALS ``.refl`` file as numpy arrays (rows of experiment ``experiment_id`` only
    when given, selected by the ``id`` column), and those of ``optional`` that the file has.

    Raises:
        InputError: unreadable, not a msgpack reflection table, a column missing or of an unknown type.
    """
    name = os.fspath(path)
    table = _unpack(name)
    data, nrows = table["data"], table["nrows"]
    columns = tuple(columns) + tuple(c for c in optional if c in data and c not in columns)
    wanted = list(columns) + (["id"] if experiment_id is not None and "id" not in columns else [])
    out = {}
    for col in wanted:
        if col not in data:
            raise InputError(f"{name}: no {col!r} column (the file has: {', '.join(sorted(data)) or 'none'})")
        out[col] = _decode(name, col, data[col], nrows)
    if experiment_id is not None:
        keep = out["id"] == experiment_id
        if not keep.any():
            raise InputError(f"{name}: no reflections of experiment {experiment_id} (id column)")
        out = {k: v[keep] for k, v in out.items() if k in columns}
    return out


def refl_table(path: str | os.PathLike[str]) -> tuple[dict[str, tuple[str, np.ndarray]], dict[int, str]]:
    """Every column of a DIALS ``.refl`` of a type in :data:`REFL_TYPES` as ``{name: (type, array)}`` (the form
    :func:`write_refl` takes; columns of other types, such as shoeboxes, left out) and the ``{id: identifier}`` map.

    Raises:
        InputError: as :func:`read_refl`.
    """
    name = os.fspath(path)
    table = _unpack(name)
    data, nrows = table["data"], table["nrows"]
    columns = {col: (entry[0], _decode(name, col, entry, nrows)) for col, entry in data.items()
               if isinstance(entry, (list, tuple)) and entry and entry[0] in REFL_TYPES}
    ids = table.get("identifiers") or {}
    return columns, {int(k): str(v) for k, v in ids.items()} if isinstance(ids, dict) else {}


def write_refl(path: str | os.PathLike[str], columns: dict[str, tuple[str, np.ndarray]],
               identifiers: dict[int, str] | None = None) -> None:
    """Write a DIALS ``.refl`` (msgpack) from ``{name: (type, array)}`` (types of :data:`REFL_TYPES`). Atomic."""
    import msgpack

    nrows = {len(arr) for _, arr in columns.values()}
    if len(nrows) > 1:
        raise InputError(f"{path}: columns of different lengths {sorted(nrows)}")
    n = nrows.pop() if nrows else 0
    data = {}
    for name, (kind, arr) in columns.items():
        dtype, width = REFL_TYPES[kind]
        a = np.ascontiguousarray(np.asarray(arr).astype(dtype).reshape(n, width) if width > 1 else
                                 np.asarray(arr).astype(dtype).reshape(n))
        data[name] = [kind, [n, a.tobytes()]]
    obj = [_REFL_MAGIC, 1, {"identifiers": dict(identifiers or {}), "nrows": n, "data": data}]
    with atomic_write(path, "wb") as fh:
        fh.write(msgpack.packb(obj, use_bin_type=True))
