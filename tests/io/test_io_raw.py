"""Tests for nbtorch.io.raw: headerless float images and file reading helpers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.raw import read_raw_float, read_text_lines, write_raw_float

from golden import GOLDEN, needs_golden


@needs_golden
def test_read_golden_float_nonsquare() -> None:
    image = read_raw_float(GOLDEN / "nonsquare_detector" / "float.bin", (160, 256))
    assert image.shape == (160, 256) and image.dtype == np.float32
    assert np.isclose(image.max(), 137.295, rtol=1e-5)  # max_I from the C's stdout
    with pytest.raises(InputError, match="expected 262144 bytes.*found 163840"):
        read_raw_float(GOLDEN / "nonsquare_detector" / "float.bin", (256, 256))


def test_roundtrip_and_byte_layout(tmp_path: Path) -> None:
    image = np.arange(6, dtype=np.float64).reshape(2, 3) / 7.0
    path = tmp_path / "img.bin"
    write_raw_float(path, image)
    assert path.read_bytes() == image.astype("<f4").tobytes()  # slow-major, fast fastest
    back = read_raw_float(path, (2, 3))
    assert np.array_equal(back, image.astype(np.float32))
    assert np.array_equal(read_raw_float(path, (3, 2)), image.astype(np.float32).reshape(3, 2))


def test_size_mismatch_message(tmp_path: Path) -> None:
    path = tmp_path / "img.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(InputError) as info:
        read_raw_float(path, (2, 2))
    message = str(info.value)
    assert str(path) in message and "expected 16 bytes" in message and "found 10" in message
    assert "\n" not in message


def test_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        read_raw_float(tmp_path / "none.bin", (2, 2))
    with pytest.raises(InputError, match="directory"):
        read_raw_float(tmp_path, (2, 2))
    with pytest.raises(InputError, match="shape"):
        read_raw_float(tmp_path / "none.bin", (0, 2))


def test_write_errors_leave_nothing(tmp_path: Path) -> None:
    with pytest.raises(InputError):
        write_raw_float(tmp_path / "a.bin", np.zeros(0))
    with pytest.raises(InputError):
        write_raw_float(tmp_path / "b.bin", np.array(["x", "y"]))
    with pytest.raises(InputError, match="does not exist"):
        write_raw_float(tmp_path / "sub" / "c.bin", np.zeros(3))
    assert list(tmp_path.iterdir()) == []


def test_read_text_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"a\r\nb\n")
    assert read_text_lines(path) == ["a", "b"]
    path.write_bytes(b"a\nb\x00c\n")
    with pytest.raises(InputError, match="line 2.*NUL"):
        read_text_lines(path)
