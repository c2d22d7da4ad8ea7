"""Multi-panel image files (nbtorch.io.panel_images): NXmx detectors of several modules and multi-array CBF,
read as the panels' boxes of one image, and taken by ``nbtorch-refine --expt`` in the detector's stacked layout.

The files are synthetic and small: an NXmx file whose data is ``frame x module x slow x fast`` (modules as slabs,
as the SACLA MPCCD files), one whose modules are boxes of a 2-D image (Jungfrau-like, with a gap), and imgCIF
files laid out as the LCLS CSPAD's (arrays of ``fast x slow x sensor`` cut by ``_array_structure_list_section``
into panels; the real CSPAD files of dials/data-files are ``x-CBF_PACKED``: CBFlib (pycbf) decodes those, checked
here on files CBFlib itself packed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.cbf import encode_byte_offset
from nbtorch.io.images import read_image_file
from nbtorch.io.panel_images import stack_panels

h5py = pytest.importorskip("h5py")


def _nx(group, cls: str):
    group.attrs["NX_class"] = cls
    return group


def _nexus(path: Path, data: np.ndarray, modules: list[tuple[list[int], list[int]]]) -> Path:
    with h5py.File(path, "w") as f:
        entry = _nx(f.create_group("entry"), "NXentry")
        det = _nx(entry.create_group("instrument/detector"), "NXdetector")
        _nx(entry["instrument"], "NXinstrument")
        for k, (origin, size) in enumerate(modules):
            m = _nx(det.create_group(f"module_{k:02d}"), "NXdetector_module")
            m["data_origin"] = np.asarray(origin, dtype=np.int64)
            m["data_size"] = np.asarray(size, dtype=np.int64)
        entry.create_dataset("data/data", data=data)
    return path


def test_nexus_module_slabs_are_stacked(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 1000, size=(2, 4, 20, 24)).astype(np.int32)  # frames x modules x slow x fast
    path = _nexus(tmp_path / "slabs.nxs", data, [([k, 0, 0], [1, 20, 24]) for k in range(4)])
    got = read_image_file(path, frame=1)
    assert got.image.shape == (80, 24) and got.header["panels_stacked"]
    assert [b[0] for b in got.header["panel_boxes"]] == [f"module_{k:02d}" for k in range(4)]
    for k, (_, y0, x0, h, w) in enumerate(got.header["panel_boxes"]):
        assert (y0, x0, h, w) == (20 * k, 0, 20, 24)
        assert np.array_equal(got.image[y0:y0 + h, x0:x0 + w], data[1, k])
    with pytest.raises(InputError, match=r"holds 2 frames; choose one"):
        read_image_file(path)


def test_nexus_module_boxes_of_one_image(tmp_path: Path) -> None:
    data = np.arange(50 * 30, dtype=np.int32).reshape(1, 50, 30)
    path = _nexus(tmp_path / "boxes.nxs", data, [([0, 0], [24, 30]), ([26, 0], [24, 30])])  # a 2-row gap
    got = read_image_file(path)
    assert got.image.shape == (50, 30) and not got.header["panels_stacked"]
    assert [b[1:] for b in got.header["panel_boxes"]] == [(0, 0, 24, 30), (26, 0, 24, 30)]


def test_nexus_bad_modules_name_the_module(tmp_path: Path) -> None:
    data = np.zeros((1, 2, 20, 24), dtype=np.int32)
    path = _nexus(tmp_path / "past.nxs", data, [([0, 0, 0], [1, 20, 24]), ([1, 0, 4], [1, 20, 24])])
    with pytest.raises(InputError, match=r"detector module module_01: data_origin \[1, 0, 4\] \+ data_size "
                                         r"\[1, 20, 24\] reach past the data's \[2, 20, 24\] pixels") as info:
        read_image_file(path)
    assert "\n" not in str(info.value)
    path = _nexus(tmp_path / "flat.nxs", data, [([0, 0, 0], [2, 20, 24]), ([1, 0, 0], [1, 20, 24])])
    with pytest.raises(InputError, match=r"module module_00: data_size \[2, 20, 24\] is not one 2-D panel"):
        read_image_file(path)
    path = _nexus(tmp_path / "ranks.nxs", data, [([0, 0, 0], [1, 20, 24]), ([0, 0], [20, 24])])
    with pytest.raises(InputError, match=r"module module_01: data_origin \[0, 0\] and data_size \[20, 24\] must both"):
        read_image_file(path)


def _cbf_section(array: str, binary_id: int, values: np.ndarray, conversion: str = "x-CBF_BYTE_OFFSET") -> bytes:
    payload = encode_byte_offset(values.reshape(-1))
    dims = values.shape[::-1]  # fastest first
    head = (f" {array} {binary_id}\r\n;\r\n--CIF-BINARY-FORMAT-SECTION--\r\n"
            f"Content-Type: application/octet-stream;\r\n     conversions=\"{conversion}\"\r\n"
            f"Content-Transfer-Encoding: BINARY\r\nX-Binary-Size: {len(payload)}\r\nX-Binary-ID: {binary_id}\r\n"
            f"X-Binary-Element-Type: \"signed 32-bit integer\"\r\nX-Binary-Element-Byte-Order: LITTLE_ENDIAN\r\n"
            f"X-Binary-Number-of-Elements: {values.size}\r\nX-Binary-Size-Fastest-Dimension: {dims[0]}\r\n"
            f"X-Binary-Size-Second-Dimension: {dims[1]}\r\n\r\n")
    return head.encode("latin-1") + b"\x0c\x1a\x04\xd5" + payload + b"\r\n--CIF-BINARY-FORMAT-SECTION----\r\n;\r\n"


def _cspad_like_cbf(path: Path, arrays: dict[str, np.ndarray], sections: bool = True,
                    conversion: str = "x-CBF_BYTE_OFFSET") -> Path:
    """imgCIF as the CSPAD's: each array ``sensor x slow x fast`` (2 ASICs side by side along fast per sensor)."""
    lines = ["###CBF: VERSION 1.7.10", "", "data_synthetic", "", "loop_", "_array_structure_list.array_id",
             "_array_structure_list.array_section_id", "_array_structure_list.index",
             "_array_structure_list.dimension", "_array_structure_list.precedence",
             "_array_structure_list.direction", "_array_structure_list.axis_set_id"]
    for a, v in arrays.items():
        for index, dim in enumerate(v.shape[::-1], start=1):
            lines.append(f" {a} . {index} {dim} {index} increasing .")
    if sections:
        lines += ["", "loop_", "_array_structure_list_section.array_id", "_array_structure_list_section.id",
                  "_array_structure_list_section.index", "_array_structure_list_section.start",
                  "_array_structure_list_section.end"]
        for a, v in arrays.items():
            half = v.shape[2] // 2
            for s in range(v.shape[0]):
                for asic in range(2):
                    sid = f"{a}S{s}A{asic}"
                    lines += [f" {a} {sid} 1 {1 + asic * half} {(asic + 1) * half}", f" {a} {sid} 2 1 {v.shape[1]}",
                              f" {a} {sid} 3 {s + 1} {s + 1}"]
    lines += ["", "loop_", "_array_structure.id", "_array_structure.encoding_type",
              "_array_structure.compression_type", "_array_structure.byte_order"]
    lines += [f" {a} 'signed 32-bit integer' packed little_endian" for a in arrays]
    lines += ["", "loop_", "_array_data.array_id", "_array_data.binary_id", "_array_data.data"]
    body = ("\r\n".join(lines) + "\r\n").encode("latin-1")
    for k, (a, v) in enumerate(arrays.items(), start=1):
        body += _cbf_section(a, k, v, conversion)
    path.write_bytes(body)
    return path


def test_multi_array_cbf_sections_are_the_panels(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays = {"ARRAY_Q0": rng.integers(-5, 3000, size=(2, 11, 16)).astype(np.int32),
              "ARRAY_Q1": rng.integers(0, 70000, size=(2, 11, 16)).astype(np.int32)}
    got = read_image_file(_cspad_like_cbf(tmp_path / "cspad.cbf", arrays))
    assert got.format == "cbf" and got.image.shape == (8 * 11, 8)
    names = [b[0] for b in got.header["panel_boxes"]]
    assert names == [f"ARRAY_Q{q}S{s}A{a}" for q in range(2) for s in range(2) for a in range(2)]
    for k, (_, y0, x0, h, w) in enumerate(got.header["panel_boxes"]):
        q, s, a = k // 4, (k // 2) % 2, k % 2
        assert np.array_equal(got.image[y0:y0 + h, x0:x0 + w], arrays[f"ARRAY_Q{q}"][s, :, 8 * a:8 * (a + 1)])


def test_multi_array_cbf_without_sections_and_refusals(tmp_path: Path) -> None:
    a, b = np.arange(12 * 10, dtype=np.int32).reshape(10, 12), np.ones((7, 12), dtype=np.int32)
    got = read_image_file(_cspad_like_cbf(tmp_path / "two.cbf", {"A": a, "B": b}, sections=False))
    assert [x[1:] for x in got.header["panel_boxes"]] == [(0, 0, 10, 12), (10, 0, 7, 12)]
    assert np.array_equal(got.image[:10], a) and np.array_equal(got.image[10:17], b)
    assert got.pixel_mask is not None and not got.pixel_mask[17:].any() and got.pixel_mask[:17].all()
    three = np.zeros((2, 10, 12), dtype=np.int32)
    with pytest.raises(InputError, match=r"array C has 3 dimensions and no array sections"):
        read_image_file(_cspad_like_cbf(tmp_path / "three.cbf", {"A": a, "C": three}, sections=False))


@pytest.mark.parametrize("compression", ["CBF_PACKED", "CBF_PACKED_V2", "CBF_CANONICAL"])
def test_multi_panel_cbflib_packed_arrays_read_as_their_values(tmp_path: Path, compression: str) -> None:
    """The CSPAD's layout in CBFlib's packed compressions reads as the same panels, value for value (negative
    pedestal-subtracted values, values beyond 16 bits); a corrupt payload is refused by its Content-MD5 before
    CBFlib (which may crash on a corrupt stream) sees it."""
    rng = np.random.default_rng(3)
    arrays = {"ARRAY_Q0": rng.integers(-600, 3000, size=(2, 11, 16)).astype(np.int32),
              "ARRAY_Q1": rng.integers(0, 90000, size=(2, 11, 16)).astype(np.int32)}
    arrays["ARRAY_Q0"][0, 3:6, 2:9] += 40000  # a bright, smooth patch, as a Bragg spot
    pytest.importorskip("pycbf")
    from cbflib_files import cbflib_copy

    source = _cspad_like_cbf(tmp_path / "cspad.cbf", arrays)
    packed = cbflib_copy(source, tmp_path / "packed.cbf", compression)
    assert f'conversions="x-{compression}"'.encode() in packed.read_bytes()
    got, want = read_image_file(packed), read_image_file(source)
    assert got.header["panel_boxes"] == want.header["panel_boxes"] and len(got.header["panel_boxes"]) == 8
    assert np.array_equal(got.image, want.image) and got.image.min() < 0 and got.image.max() > 65535
    data = bytearray(packed.read_bytes())
    data[data.index(b"\x0c\x1a\x04\xd5") + 60] ^= 0x10
    (tmp_path / "corrupt.cbf").write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"corrupt.cbf: binary section 1: Content-MD5 mismatch") as info:
        read_image_file(tmp_path / "corrupt.cbf")
    assert "\n" not in str(info.value)


def test_multi_panel_packed_cbf_without_pycbf_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = np.arange(12 * 10, dtype=np.int32).reshape(10, 12), np.ones((7, 12), dtype=np.int32)
    monkeypatch.setitem(sys.modules, "pycbf", None)  # import pycbf raises ImportError
    with pytest.raises(InputError, match=r"packed.cbf: CBF compression x-CBF_PACKED needs CBFlib's Python module: "
                                         r"pip install pycbf") as info:
        read_image_file(_cspad_like_cbf(tmp_path / "packed.cbf", {"A": a, "B": b}, False, "x-CBF_PACKED"))
    assert "\n" not in str(info.value)


def test_stack_panels_pads_the_smaller_panels() -> None:
    image, valid, boxes = stack_panels([("p0", np.ones((3, 4))), ("p1", 2 * np.ones((2, 5)))])
    assert image.shape == (6, 5) and boxes == [("p0", 0, 0, 3, 4), ("p1", 3, 0, 2, 5)]
    assert valid.sum() == 12 + 10 and image[3:5].sum() == 20 and image[:3, 4].sum() == 0


# ----------------------------------------------------------------------------- nbtorch-refine --expt

def _module_nexus(path: Path, photons: np.ndarray, n: int, h: int) -> Path:
    """The stacked test image as an NXmx file of ``n`` module slabs (1 frame x n x h x width)."""
    slabs = photons[:n * h].reshape(1, n, h, photons.shape[1]).astype(np.int32)
    return _nexus(path, slabs, [([k, 0, 0], [1, h, photons.shape[1]]) for k in range(n)])


def test_refine_takes_the_file_panels_in_the_stacked_layout(tmp_path: Path) -> None:
    """``stacked_image`` with the file's panel boxes: the NXmx modules give the same stacked image as the
    stacked CBF of tests/multi_panel_cli_data.py; a module of the wrong size is refused naming the panel."""
    from multi_panel_cli_data import H, write_case
    from nbtorch.dials.panels import panels_simulator
    from nbtorch.io.dials import read_expt
    from refine.inputs.measurement import DialsFiles
    from refine.inputs.panels import stacked_image

    case = write_case(tmp_path)
    layout = panels_simulator(read_expt(case["expt"], multi_panel=True), extra_flags=["-N", "5"]).panel_layout
    got = read_image_file(_module_nexus(tmp_path / "modules.nxs", case["photons"], 8, H))
    args = DialsFiles(expt=str(case["expt"]), image="modules.nxs")
    image, mask = stacked_image(args, layout, got.image, np.ones(got.image.shape, bool), got.header["panel_boxes"])
    assert np.array_equal(image, case["photons"]) and mask.all()
    cut = got.header["panel_boxes"][:3] + [("module_03", 3 * H, 0, H, 23)] + got.header["panel_boxes"][4:]
    with pytest.raises(InputError, match=r"detector panel 3 \(col0_row3\) is 24 x 20 pixels \(fast x slow\) but "
                                         r"--image modules.nxs's panel 3 is 23 x 20"):
        stacked_image(args, layout, got.image, np.ones(got.image.shape, bool), cut)


def _cli(*args: str, cwd: Path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "refine.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_refine_cli_refuses_a_file_of_other_panels(tmp_path: Path) -> None:
    """A multi-array CBF of 7 panels for the 8-panel detector: one line, exit 2, nothing written."""
    from multi_panel_cli_data import H, MODEL, write_case

    case = write_case(tmp_path)
    arrays = {f"ARRAY_{k}": case["photons"][k * H:(k + 1) * H].astype(np.int32) for k in range(7)}
    image = _cspad_like_cbf(tmp_path / "seven.cbf", arrays, sections=False)
    run = _cli("--expt", str(case["expt"]), "--image", str(image), "--refl", str(case["refl"]), "--model", MODEL,
               "--refine", "panels", "--out", str(tmp_path / "out" / "result.h5"), cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "the detector has 8 panels but --image" in lines[0] and "has 7" in lines[0], run.stderr
    assert not (tmp_path / "out").exists()
    run = _cli("--image", str(image), "--model", MODEL, "--out", str(tmp_path / "out" / "result.h5"), cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "the file holds 7 detector panels (stacked); give their geometry with a multi-panel --expt" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_refine_cli_on_an_nxmx_file_of_modules(tmp_path: Path) -> None:
    """The test_multi_panel_cli refinement with its image as an NXmx file of 8 module slabs: same result."""
    from multi_panel_cli_data import H, MODEL, write_case

    case = write_case(tmp_path)
    image = _module_nexus(tmp_path / "modules.nxs", case["photons"], 8, H)
    out = tmp_path / "out"
    run = _cli("--expt", str(case["expt"]), "--image", str(image), "--refl", str(case["refl"]), "--model", MODEL,
               "--refine", "panels", "--panel-groups", "1", "--spot-window", "3", "--out", str(out / "result.h5"),
               cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    result = json.loads((out / "result.json").read_text())
    for i in range(8):
        assert result["params"][f"beam_x_p{i}"] == pytest.approx(case["truth"][f"beam_x_p{i}"], abs=0.02)
        assert result["params"][f"beam_y_p{i}"] == pytest.approx(case["truth"][f"beam_y_p{i}"], abs=0.02)


def test_multi_panel_cbflib_crash_or_unknown_compression_is_one_line(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """CBFlib decodes in a child process: a crash there (here a stand-in child that segfaults) is a one-line error
    for the file, not the end of the caller; a compression that neither nbtorch nor CBFlib writes is refused."""
    pytest.importorskip("pycbf")
    from nbtorch.io import cbflib_arrays

    a, b = np.arange(12 * 10, dtype=np.int32).reshape(10, 12), np.ones((7, 12), dtype=np.int32)
    packed = _cspad_like_cbf(tmp_path / "packed.cbf", {"A": a, "B": b}, False, "x-CBF_PACKED")
    monkeypatch.setattr(cbflib_arrays, "_CHILD", "import ctypes; ctypes.string_at(0)")
    with pytest.raises(InputError, match=r"packed.cbf: CBFlib crashed decoding the file \(signal 11") as info:
        read_image_file(packed)
    assert "\n" not in str(info.value)
    odd = _cspad_like_cbf(tmp_path / "odd.cbf", {"A": a, "B": b}, False, "x-CBF_BYTE_OFFSEU")
    with pytest.raises(InputError, match=r"odd.cbf: array A: CBF compression x-CBF_BYTE_OFFSEU is not supported"):
        read_image_file(odd)
