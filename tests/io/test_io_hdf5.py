"""Tests for nbtorch.io.hdf5: NXmx-style HDF5 images."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.hdf5 import read_h5_image, write_h5

h5py = pytest.importorskip("h5py", reason="h5py not installed")

GEOMETRY = {"distance_mm": 100.0, "beam_center_x_mm": 12.9, "beam_center_y_mm": 12.8, "pixel_size_mm": 0.1,
            "wavelength_A": 6.2, "convention": "MOSFLM", "fdet_vector": [0.0, 0.0, 1.0], "oversample": 2,
            "curved": False, "unset": None}


def test_roundtrip_2d_and_nxmx_layout(tmp_path: Path) -> None:
    image = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "img.h5"
    write_h5(path, image, {"program": "nbtorch", "command": "nbtorch -N 5"}, GEOMETRY)
    with h5py.File(path, "r") as f:
        assert f["entry"].attrs["NX_class"] == "NXentry"
        assert f["entry/definition"][()] in (b"NXmx", "NXmx")
        assert f["entry/data"].attrs["signal"] == "data"
        det = f["entry/instrument/detector"]
        assert det.attrs["NX_class"] == "NXdetector"
        assert det["distance"][()] == 100.0 and det["distance"].attrs["units"] == "mm"
        assert det["x_pixel_size"][()] == 0.1 and det["y_pixel_size"][()] == 0.1
        wl = f["entry/instrument/beam/incident_wavelength"]
        assert wl[()] == 6.2 and wl.attrs["units"] == "angstrom"
    back, meta = read_h5_image(path)
    assert back.dtype == np.float32 and np.array_equal(back, image)
    assert meta["distance_mm"] == 100.0 and meta["beam_center_x_mm"] == 12.9
    assert meta["beam_center_y_mm"] == 12.8 and meta["wavelength_A"] == 6.2
    assert meta["x_pixel_size_mm"] == 0.1 and meta["y_pixel_size_mm"] == 0.1
    assert meta["nbtorch"]["convention"] == "MOSFLM" and meta["nbtorch"]["oversample"] == 2
    assert list(meta["nbtorch"]["fdet_vector"]) == [0.0, 0.0, 1.0]
    assert "unset" not in meta["nbtorch"]
    assert meta["attrs"] == {"program": "nbtorch", "command": "nbtorch -N 5"}
    assert [p.name for p in tmp_path.iterdir()] == ["img.h5"]


def test_frames(tmp_path: Path) -> None:
    stack = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    path = tmp_path / "stack.h5"
    write_h5(path, stack, geometry={}, compression="gzip")
    assert np.array_equal(read_h5_image(path, frame=1)[0], stack[1])
    with pytest.raises(InputError, match="holds 2 frames"):
        read_h5_image(path)
    with pytest.raises(InputError, match="frame 5 out of range"):
        read_h5_image(path, frame=5)
    single = tmp_path / "single.h5"
    write_h5(single, stack[:1])
    assert np.array_equal(read_h5_image(single)[0], stack[0])


def test_units_conversion_from_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["entry/data/data"] = np.zeros((2, 2), np.uint16)
        f["entry/instrument/detector/distance"] = 0.351
        f["entry/instrument/detector/distance"].attrs["units"] = "m"
        f["entry/instrument/detector/beam_center_x"] = 1261.61
        f["entry/instrument/detector/beam_center_x"].attrs["units"] = "pixels"
        f["entry/instrument/beam/incident_wavelength"] = 0.096859
        f["entry/instrument/beam/incident_wavelength"].attrs["units"] = "nm"
    _, meta = read_h5_image(path)
    assert meta["distance_mm"] == pytest.approx(351.0)
    assert meta["beam_center_x_px"] == 1261.61 and "beam_center_x_mm" not in meta
    assert meta["wavelength_A"] == pytest.approx(0.96859)


def _error(*args, fragments=(), **kwargs) -> None:
    with pytest.raises(InputError) as info:
        read_h5_image(*args, **kwargs)
    message = str(info.value)
    assert str(args[0]) in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_read_errors(tmp_path: Path) -> None:
    _error(tmp_path / "none.h5", fragments=("not found",))
    (tmp_path / "text.h5").write_text("not hdf5")
    _error(tmp_path / "text.h5", fragments=("cannot open as HDF5",))
    path = tmp_path / "img.h5"
    write_h5(path, np.zeros((2, 2)))
    _error(path, "/entry/data/missing", fragments=("no dataset", "/entry/data/missing"))
    _error(path, frame=3, fragments=("2-D",))
    with h5py.File(tmp_path / "odd.h5", "w") as f:
        f["entry/data/data"] = np.zeros(5)
        f["entry/instrument/detector/distance"] = 1.0
        f["entry/instrument/detector/distance"].attrs["units"] = "furlong"
    _error(tmp_path / "odd.h5", fragments=("1 dimensions",))
    with h5py.File(tmp_path / "units.h5", "w") as f:
        f["entry/data/data"] = np.zeros((2, 2))
        f["entry/instrument/detector/distance"] = 1.0
        f["entry/instrument/detector/distance"].attrs["units"] = "furlong"
    _error(tmp_path / "units.h5", fragments=("unsupported units", "furlong"))


def test_write_errors_leave_nothing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="unsupported type"):
        write_h5(tmp_path / "a.h5", np.zeros((2, 2)), geometry={"nested": {"a": 1}})
    with pytest.raises(InputError, match="must be a number"):
        write_h5(tmp_path / "b.h5", np.zeros((2, 2)), geometry={"distance_mm": "far"})
    with pytest.raises(InputError, match="2-D or 3-D"):
        write_h5(tmp_path / "c.h5", np.zeros(4))
    with pytest.raises(ValueError, match="unavailable"):  # a failure inside h5py: the temp file is removed too
        write_h5(tmp_path / "d.h5", np.zeros((2, 2)), compression=object())
    assert list(tmp_path.iterdir()) == []


def test_missing_h5py_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(InputError, match="pip install h5py"):
        write_h5(tmp_path / "x.h5", np.zeros((2, 2)))
    assert list(tmp_path.iterdir()) == []
