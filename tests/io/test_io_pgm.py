"""Tests for nbtorch.io.pgm: nanoBragg-compatible 8-bit previews."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.pgm import default_pgm_scale, read_pgm, write_pgm


def test_header_and_pixels_like_c(tmp_path: Path) -> None:
    image = np.array([[0.0, 1.0, 2.9, 100.0], [-1.0, np.nan, 0.26, 12.75]], dtype=np.float32)
    path = tmp_path / "img.pgm"
    used = write_pgm(path, image, scale=10.0)
    assert used == 10.0
    data = path.read_bytes()
    header = b"P5\n4 2\n# pixels scaled by 10\n255\n"
    assert data.startswith(header)
    assert list(data[len(header):]) == [0, 10, 29, 255, 0, 0, 2, 127]


def test_scale_formatted_with_percent_g(tmp_path: Path) -> None:
    write_pgm(tmp_path / "a.pgm", np.ones((2, 2)), scale=1.23456789)
    assert b"# pixels scaled by 1.23457\n" in (tmp_path / "a.pgm").read_bytes()


def test_default_scale_is_250_over_5_rmsd(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    image = rng.random((20, 30)).astype(np.float32) * 50
    expected = 250.0 / (5.0 * np.std(image.astype(np.float64), ddof=1))
    assert np.isclose(default_pgm_scale(image), expected, rtol=1e-12)
    used = write_pgm(tmp_path / "a.pgm", image)
    assert used == default_pgm_scale(image)
    back = read_pgm(tmp_path / "a.pgm")
    assert np.array_equal(back, np.trunc(np.minimum(image.astype(np.float64) * used, 255)).astype(np.uint8))


def test_default_scale_constant_image_falls_back_to_int_scale() -> None:
    assert default_pgm_scale(np.full((3, 3), 5.0)) == 55000.0 / 5.0
    assert default_pgm_scale(np.full((3, 3), 5.0), intfile_scale=20.0) == 20.0
    assert default_pgm_scale(np.zeros((3, 3))) == 1.0


def test_roi_mask(tmp_path: Path) -> None:
    image = np.full((2, 2), 3.0)
    mask = np.array([[True, False], [False, True]])
    write_pgm(tmp_path / "r.pgm", image, scale=2.0, roi_mask=mask)
    assert read_pgm(tmp_path / "r.pgm").tolist() == [[6, 0], [0, 6]]


def test_read_with_comments_and_16_bit(tmp_path: Path) -> None:
    path = tmp_path / "x.pgm"
    path.write_bytes(b"P5\n# c1\n2 # c2\n1\n65535\n" + np.array([1, 513], ">u2").tobytes())
    image = read_pgm(path)
    assert image.dtype == np.uint16 and image.tolist() == [[1, 513]]


def _error(path: Path, fragment: str) -> None:
    with pytest.raises(InputError) as info:
        read_pgm(path)
    assert str(path) in str(info.value) and fragment in str(info.value) and "\n" not in str(info.value)


def test_read_errors(tmp_path: Path) -> None:
    _error(tmp_path / "none.pgm", "not found")
    (tmp_path / "p2.pgm").write_bytes(b"P2\n1 1\n255\n0\n")
    _error(tmp_path / "p2.pgm", "not a binary PGM")
    (tmp_path / "hdr.pgm").write_bytes(b"P5\n2 x\n255\n")
    _error(tmp_path / "hdr.pgm", "height")
    (tmp_path / "trunc.pgm").write_bytes(b"P5\n4 4\n255\n" + b"\0" * 10)
    _error(tmp_path / "trunc.pgm", "truncated")
    (tmp_path / "zero.pgm").write_bytes(b"P5\n0 4\n255\n")
    _error(tmp_path / "zero.pgm", "width=0")


def test_write_errors_leave_nothing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="2-D"):
        write_pgm(tmp_path / "a.pgm", np.zeros(4))
    with pytest.raises(InputError, match="roi_mask"):
        write_pgm(tmp_path / "b.pgm", np.zeros((2, 2)), roi_mask=np.ones((3, 3), bool))
    assert list(tmp_path.iterdir()) == []
