"""Tests for nbtorch.io.matrix: MOSFLM -mat files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.matrix import read_mosflm_matrix, write_mosflm_matrix

from golden import GOLDEN, needs_golden


def _one_line_error(path: Path, *fragments: str) -> None:
    with pytest.raises(InputError) as info:
        read_mosflm_matrix(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for fragment in fragments:
        assert fragment in message, message


@needs_golden
def test_golden_matrix_rows_are_reciprocal_vectors() -> None:
    A = read_mosflm_matrix(GOLDEN / "mat_file" / "A.mat")  # -lambda 1.0, so A = reciprocal vectors in 1/A
    assert A.shape == (3, 3) and A.dtype == np.float64
    # the C prints a*, b*, c* as columns X/Y/Z: a* = (0.01127171, 0.00876668, 0.00883512)
    assert np.array_equal(A[0], [0.01127171, 0.00876668, 0.00883512])
    assert np.array_equal(A[1], [-0.01006681, 0.00956618, 0.00335100])
    assert np.array_equal(A[2], [-0.00184308, -0.00580155, 0.01102500])
    # real-space vectors (rows of inv(A).T) as printed by the C for this run, in Angstrom
    real = np.linalg.inv(A).T
    assert np.allclose(real[0], [41.65631427, 34.95381614, 25.35711852], rtol=1e-6)
    assert np.allclose(real[1], [-49.32735023, 46.87428924, 16.41988935], rtol=1e-6)
    assert np.allclose(real[2], [-18.38935009, -42.25822252, 65.39172479], rtol=1e-6)
    # "Recp Cell: 0.0167918 0.0142857 0.0125939"
    assert np.allclose(np.linalg.norm(A, axis=1), [0.0167918, 0.0142857, 0.0125939], rtol=1e-5)


def test_numbers_on_one_line_and_rest_ignored(tmp_path: Path) -> None:
    path = tmp_path / "A.mat"
    path.write_text("1 0 0 0 2 0 0 0 4\nnot numbers at all\n")
    A = read_mosflm_matrix(path)
    assert np.array_equal(A, np.diag([1.0, 2.0, 4.0]))


def test_column_order(tmp_path: Path) -> None:
    path = tmp_path / "A.mat"
    path.write_text("1 2 3\n4 5 7\n8 9 10\n")
    A = read_mosflm_matrix(path)
    assert A[0].tolist() == [1, 4, 8] and A[1].tolist() == [2, 5, 9] and A[2].tolist() == [3, 7, 10]


def test_roundtrip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    A = rng.normal(size=(3, 3)) * 0.01
    write_mosflm_matrix(tmp_path / "A.mat", A)
    assert np.array_equal(read_mosflm_matrix(tmp_path / "A.mat"), A)


def test_missing_file(tmp_path: Path) -> None:
    _one_line_error(tmp_path / "none.mat", "not found")


def test_too_few_numbers(tmp_path: Path) -> None:
    path = tmp_path / "short.mat"
    path.write_text("1 0 0\n0 1 0\n")
    _one_line_error(path, "expected 9 numbers", "found 6")


def test_non_numeric(tmp_path: Path) -> None:
    path = tmp_path / "bad.mat"
    path.write_text("1 0 0\n0 one 0\n0 0 1\n")
    _one_line_error(path, "line 2", "'one'")


def test_non_finite(tmp_path: Path) -> None:
    path = tmp_path / "nan.mat"
    path.write_text("1 0 0\n0 nan 0\n0 0 1\n")
    _one_line_error(path, "line 2", "not finite")


@pytest.mark.parametrize("text", ["1 0 0\n0 1 0\n0 0 0\n", "1 2 3\n2 4 6.000000001\n0 1 1\n"])
def test_singular(tmp_path: Path, text: str) -> None:
    path = tmp_path / "sing.mat"
    path.write_text(text)
    _one_line_error(path, "singular")


def test_write_singular_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="out.mat"):
        write_mosflm_matrix(tmp_path / "out.mat", np.zeros((3, 3)))
    assert list(tmp_path.iterdir()) == []
