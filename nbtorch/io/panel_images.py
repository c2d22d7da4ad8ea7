"""Image files whose pixels are several detector panels (modules): NeXus/NXmx modules and multi-array CBF.

Both are read into one 2-D image plus **panel boxes** ``(name, y0, x0, height, width)`` (pixels, slow x fast):
panel ``i`` is ``image[y0:y0 + height, x0:x0 + width]``, in the file's order.

NeXus/NXmx
    The ``NXdetector`` under ``/entry/instrument`` lists its modules as ``NXdetector_module`` groups (h5py's
    order: by name), each with ``data_origin`` and ``data_size``: the 0-based first index and the extent of
    the module's hyperslab in the detector's data, slow to fast, without the frame index.  Two indices: the
    modules are boxes of one 2-D image (an Eiger or Jungfrau image with gaps), which is returned whole.
    Three indices: the data is ``(frame,) module x slow x fast`` (each module a slab, e.g. SACLA MPCCD); the
    slabs are stacked as below.
Multi-array CBF (imgCIF)
    Each binary section is one ``_array_data`` row (array id, binary id); its ``_array_structure_list``
    gives the dimensions (index 1 the fastest).  With ``_array_structure_list_section`` rows (array, section
    id, index, start, end; 1-based, inclusive) every section is a panel, in the order listed (the CSPAD's
    ASICs); without them every 2-D array is one panel.  ``x-CBF_BYTE_OFFSET`` sections of signed 32-bit
    integers are decoded here (:func:`nbtorch.io.cbf.decode_byte_offset`); CBFlib's other compressions
    (``x-CBF_PACKED`` as in the LCLS CSPAD files, ``_V2``, canonical, nibble offset) by CBFlib
    (:mod:`nbtorch.io.cbflib_arrays`, needs ``pycbf``).

:func:`stack_panels` lays separate panels out as :meth:`nbtorch.Simulator.from_panels` stacks a detector's
panels: along the slow axis in order, each in a block of the tallest panel's rows and the widest panel's
columns (pixels of a block outside its panel are 0 and not valid).
"""

from __future__ import annotations

import shlex
from typing import Any

import numpy as np

from nbtorch.errors import InputError

__all__ = ["stack_panels", "nexus_module_boxes", "read_nexus_panels", "read_cbf_panels", "is_multi_array_cbf"]

Box = tuple[str, int, int, int, int]  # (name, y0, x0, height, width)


def stack_panels(panels: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[Box]]:
    """``(image, valid, boxes)``: 2-D ``panels`` ``(name, (slow, fast) array)`` stacked along the slow axis."""
    rows = max(p.shape[0] for _, p in panels)
    cols = max(p.shape[1] for _, p in panels)
    dtype = np.result_type(*(p.dtype for _, p in panels))
    image = np.zeros((len(panels) * rows, cols), dtype=dtype)
    valid = np.zeros(image.shape, dtype=bool)
    boxes = []
    for i, (name, p) in enumerate(panels):
        image[i * rows:i * rows + p.shape[0], :p.shape[1]] = p
        valid[i * rows:i * rows + p.shape[0], :p.shape[1]] = True
        boxes.append((name, i * rows, 0, int(p.shape[0]), int(p.shape[1])))
    return image, valid, boxes


# ----------------------------------------------------------------------------- NeXus


def _nx_class(node: Any) -> str:
    value = node.attrs.get("NX_class", b"")
    return value.decode() if isinstance(value, bytes) else str(value)


def _modules(h5py: Any, f: Any) -> list[tuple[str, Any]]:
    instrument = f.get("/entry/instrument")
    if not isinstance(instrument, h5py.Group):
        return []
    for det in instrument.values():
        if isinstance(det, h5py.Group) and _nx_class(det) == "NXdetector":
            mods = [(k, g) for k, g in det.items() if isinstance(g, h5py.Group) and _nx_class(g) == "NXdetector_module"]
            if mods:
                return mods
    return []


def nexus_module_boxes(h5py: Any, f: Any, name: str, data_shape: tuple[int, ...]) -> list[tuple[str, tuple, tuple]]:
    """``[(module, origin, size)]`` of the detector's ``NXdetector_module`` groups (slow to fast, no frame index),
    checked against the data's ``data_shape`` (with or without the frame index); ``[]`` with fewer than two.

    Raises:
        InputError: a module without ``data_origin``/``data_size``, of another rank than the others, or
            reaching past the data (one line naming the module).
    """
    out: list[tuple[str, tuple, tuple]] = []
    modules = _modules(h5py, f)
    if len(modules) < 2:  # one module (or none): the image is the one panel, as a plain NXmx image
        return out
    for key, g in modules:
        if "data_origin" not in g or "data_size" not in g:
            raise InputError(f"{name}: detector module {key}: 'data_origin' or 'data_size' missing")
        origin = tuple(int(v) for v in np.atleast_1d(g["data_origin"][()]))
        size = tuple(int(v) for v in np.atleast_1d(g["data_size"][()]))
        if len(origin) != len(size) or len(origin) not in (2, 3) or (out and len(origin) != len(out[0][1])):
            raise InputError(f"{name}: detector module {key}: data_origin {list(origin)} and data_size {list(size)} "
                             "must both have 2 or 3 indices, as every other module")
        dims = data_shape[-len(origin):]
        if len(data_shape) < len(origin) or any(o < 0 or s < 1 or o + s > d for o, s, d in zip(origin, size, dims)):
            raise InputError(f"{name}: detector module {key}: data_origin {list(origin)} + data_size {list(size)} "
                             f"reach past the data's {list(dims)} pixels")
        out.append((key, origin, size))
    return out


def _frame_of(name: str, node: Any, rank: int, frame: int | None) -> np.ndarray:
    if len(node.shape) == rank:
        if frame not in (None, 0):
            raise InputError(f"{name}: {node.name} holds one frame; frame {frame} does not exist")
        return node[()]
    if len(node.shape) != rank + 1:
        raise InputError(f"{name}: {node.name} has {len(node.shape)} dimensions; its modules need {rank} (+ frames)")
    total = int(node.shape[0])
    if frame is None and total != 1:
        raise InputError(f"{name}: {node.name} holds {total} frames; choose one with --frame N (frame= from Python)")
    index = 0 if frame is None else frame
    if not -total <= index < total:
        raise InputError(f"{name}: frame {frame} out of range for {node.name} with {total} frames")
    return node[index]


def read_nexus_panels(h5py: Any, f: Any, name: str, node: Any,
                      frame: int | None) -> tuple[np.ndarray, list[Box], int, bool] | None:
    """``(image, boxes, frames in the dataset, stacked)`` of an open NXmx file's image dataset ``node`` cut by
    its modules (module docstring); None when the detector has fewer than two modules.  Three-index modules:
    the image is the stacked panels (:func:`stack_panels`); two-index modules: the frame's 2-D image with the
    module boxes."""
    boxes = nexus_module_boxes(h5py, f, name, tuple(node.shape))
    if len(boxes) < 2:
        return None
    rank = len(boxes[0][1])
    data = np.asarray(_frame_of(name, node, rank, frame))
    frames = int(node.shape[0]) if len(node.shape) == rank + 1 else 1
    if rank == 2:
        return data, [(key, o[0], o[1], s[0], s[1]) for key, o, s in boxes], frames, False
    panels = []
    for key, o, s in boxes:
        part = data[tuple(slice(a, a + b) for a, b in zip(o, s))]
        if 1 not in s:
            raise InputError(f"{name}: detector module {key}: data_size {list(s)} is not one 2-D panel "
                             "(no index of size 1)")
        panels.append((key, np.take(part, 0, axis=s.index(1))))
    image, _, stacked = stack_panels(panels)
    return image, stacked, frames, True


# ----------------------------------------------------------------------------- multi-array CBF


def _cif_loops(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The ``loop_`` tables of CIF ``text``: ``(tags, rows)``; a row ends a table at a blank line, a tag or a
    text field (``;``)."""
    loops, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() != "loop_":
            i += 1
            continue
        i += 1
        tags: list[str] = []
        while i < len(lines) and lines[i].strip().startswith("_"):
            tags.append(lines[i].strip())
            i += 1
        values: list[str] = []
        while i < len(lines) and lines[i].strip() and not lines[i].startswith((";", "_", "loop_", "data_")):
            try:
                values += shlex.split(lines[i])
            except ValueError:
                values += lines[i].split()
            i += 1
        loops.append((tags, [values[k:k + len(tags)] for k in range(0, len(values) - len(tags) + 1, len(tags))]))
    return loops


def _table(loops, tag_prefix: str) -> list[dict[str, str]]:
    for tags, rows in loops:
        if tags and tags[0].startswith(tag_prefix):
            return [{t[len(tag_prefix):]: v for t, v in zip(tags, row)} for row in rows]
    return []


def _sections(name: str, data: bytes) -> tuple[str, list[tuple[str, dict[str, str], bytes]]]:
    """``(text, [(array id, MIME fields, payload)])`` of every binary section, in file order; the text is the
    file without its binary payloads."""
    from nbtorch.io.cbf import BINARY_MARKER, binary_headers, binary_int, check_payload

    texts, out, pos = [], [], 0
    while True:
        mark = data.find(BINARY_MARKER, pos)
        if mark < 0:
            texts.append(data[pos:].decode("latin-1"))
            break
        chunk = data[pos:mark].decode("latin-1")
        texts.append(chunk)
        fields = binary_headers(name, chunk)
        size = binary_int(name, fields, "X-Binary-Size")
        payload = data[mark + len(BINARY_MARKER):mark + len(BINARY_MARKER) + size]
        check_payload(name, fields, payload, f"binary section {len(out) + 1}")
        out.append((_section_array_id(chunk) or f"array{len(out) + 1}", fields, payload))
        pos = mark + len(BINARY_MARKER) + size
    return "".join(texts), out


def _section_array_id(chunk: str) -> str | None:
    """The array id of the binary section that ``chunk`` (the text before it) opens: the ``_array_data`` loop
    row just before the section (``ARRAY_Q0 1`` then ``;``), or the single item ``_array_data.array_id
    ARRAY_Q0`` that CBFlib writes for a one-row category."""
    head = chunk[:chunk.rfind("--CIF-BINARY-FORMAT-SECTION--")].rstrip().rsplit("\n", 2)
    if len(head) >= 2 and head[-1].strip() == ";":
        row = head[-2].split()
        if row and not row[0].startswith("_"):
            return row[0]
    item = chunk[chunk.rfind("_array_data.array_id"):].split("\n", 1)[0].split() if "_array_data.array_id" in chunk \
        else []
    return item[1] if len(item) == 2 else None


def is_multi_array_cbf(data: bytes) -> bool:
    """Whether CBF bytes hold several binary sections or array sections (:func:`read_cbf_panels`)."""
    from nbtorch.io.cbf import BINARY_MARKER

    return data.count(b"--CIF-BINARY-FORMAT-SECTION--\r\n") + data.count(b"--CIF-BINARY-FORMAT-SECTION--\n") > 1 \
        or b"_array_structure_list_section" in data.split(BINARY_MARKER, 1)[0]


def _decode_array(name: str, array: str, fields: dict[str, str], payload: bytes, dims: list[int],
                  cbflib: np.ndarray | None = None) -> np.ndarray:
    """The array's values, shaped slowest first (``dims`` fastest first, from ``_array_structure_list``);
    ``cbflib``: the section as CBFlib decoded it (:mod:`nbtorch.io.cbflib_arrays`), for compressions other
    than byte offset."""
    from nbtorch.io.cbf import decode_byte_offset

    count = int(np.prod(dims))
    if cbflib is not None:
        if cbflib.size != count:
            raise InputError(f"{name}: array {array}: dimensions {dims} do not match the {cbflib.size} elements "
                             "CBFlib decoded")
        return cbflib.astype(np.int32).reshape(dims[::-1])
    etype = fields.get("X-Binary-Element-Type", '"signed 32-bit integer"').strip('"')
    order = fields.get("X-Binary-Element-Byte-Order", "LITTLE_ENDIAN")
    if etype != "signed 32-bit integer" or order != "LITTLE_ENDIAN":
        raise InputError(f"{name}: array {array}: element type {etype!r} is not supported (only little-endian signed "
                         "32-bit integers)")
    if str(count) != fields.get("X-Binary-Number-of-Elements", str(count)):
        raise InputError(f"{name}: array {array}: dimensions {dims} do not match "
                         f"X-Binary-Number-of-Elements {fields['X-Binary-Number-of-Elements']}")
    return decode_byte_offset(payload, count, name).astype(np.int32).reshape(dims[::-1])


def _array_dims(name: str, array: str, structure: list[dict[str, str]], fields: dict[str, str]) -> list[int]:
    rows = sorted((int(r["index"]), int(r["dimension"])) for r in structure
                  if r.get("array_id") == array and r.get("array_section_id", ".") in (".", "?", array))
    if rows:
        return [d for _, d in rows]
    keys = ("X-Binary-Size-Fastest-Dimension", "X-Binary-Size-Second-Dimension", "X-Binary-Size-Third-Dimension")
    dims = [int(fields[k]) for k in keys if k in fields]
    if len(dims) < 2:
        raise InputError(f"{name}: array {array}: no dimensions (_array_structure_list or X-Binary-Size-*-Dimension)")
    return dims


def _section_panels(name: str, arrays: dict[str, np.ndarray],
                    ranges: list[dict[str, str]]) -> list[tuple[str, np.ndarray]]:
    order: dict[tuple[str, str], dict[int, tuple[int, int]]] = {}
    for r in ranges:
        key = (r["array_id"], r["id"])
        order.setdefault(key, {})[int(r["index"])] = (int(r["start"]), int(r["end"]))
    panels = []
    for (array, section), span in order.items():
        if array not in arrays:
            raise InputError(f"{name}: array section {section}: its array {array} has no binary data")
        values = arrays[array]
        cut = []
        for axis in range(values.ndim):  # numpy axis 0 is the slowest, CBF index ndim
            lo, hi = span.get(values.ndim - axis, (1, values.shape[axis]))
            if not 1 <= lo <= hi <= values.shape[axis]:
                raise InputError(f"{name}: array section {section}: index {values.ndim - axis} range {lo}..{hi} is "
                                 f"outside 1..{values.shape[axis]}")
            cut.append(slice(lo - 1, hi))
        part = values[tuple(cut)]
        while part.ndim > 2 and part.shape[0] == 1:  # the slower indices fixed: one slab
            part = part[0]
        if part.ndim != 2:
            raise InputError(f"{name}: array section {section} is {list(part.shape[::-1])} pixels: not one 2-D panel")
        panels.append((section, part))
    return panels


def read_cbf_panels(path: str, data: bytes | None = None) -> tuple[np.ndarray, list[Box], dict[str, Any]]:
    """``(stacked image, boxes, header)`` of a multi-array CBF (module docstring; ``data``: the file's bytes,
    already read and decompressed); header: ``panels`` (names) and ``arrays`` (array ids).

    Raises:
        InputError: unsupported compression or element type, dimensions that do not match the data, a section
            outside its array or not 2-D (one line naming the array or section).
    """
    from nbtorch.io.cbf import binary_conversion, decompress_cbf
    from nbtorch.io.cbflib_arrays import cbflib_compression, decode_arrays
    from nbtorch.io.raw import read_file_bytes

    name = str(path)
    if data is None:
        data = decompress_cbf(name, read_file_bytes(path, "CBF file"))
    text, sections = _sections(name, data)
    if not sections:
        raise InputError(f"{name}: not a CBF file (no binary section)")
    loops = _cif_loops(text)
    structure = _table(loops, "_array_structure_list.")
    kinds = [cbflib_compression(binary_conversion(fields), f"{name}: array {aid}") for aid, fields, _ in sections]
    packed = [k for k in kinds if k is not None]
    decoded = decode_arrays(name, data, packed[0]) if packed else None
    if decoded is not None and len(decoded) != len(sections):
        raise InputError(f"{name}: CBFlib found {len(decoded)} arrays where the file has {len(sections)} binary "
                         "sections")
    arrays = {aid: _decode_array(name, aid, fields, payload, _array_dims(name, aid, structure, fields),
                                 None if decoded is None else decoded[k])
              for k, (aid, fields, payload) in enumerate(sections)}
    ranges = _table(loops, "_array_structure_list_section.")
    if ranges:
        panels = _section_panels(name, arrays, ranges)
    else:
        panels = []
        for aid, values in arrays.items():
            if values.ndim != 2:
                raise InputError(f"{name}: array {aid} has {values.ndim} dimensions and no array sections: "
                                 "not one 2-D panel")
            panels.append((aid, values))
    image, _, boxes = stack_panels(panels)
    return image, boxes, {"panels": [n for n, _ in panels], "arrays": list(arrays)}
