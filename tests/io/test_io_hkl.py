"""Tests for nbtorch.io.hkl: text hkl files and Fdump.bin."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.hkl import HKLTable, read_fdump, read_hkl, write_fdump, write_hkl

from golden import GOLDEN, needs_golden


def _one_line_error(func, path: Path, *fragments: str) -> str:
    with pytest.raises(InputError) as info:
        func(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@needs_golden
def test_read_golden_p1() -> None:
    table = read_hkl(GOLDEN / "hkl_file" / "P1.hkl")
    assert len(table) == 4913
    assert table.bounds == ((-8, 8), (-8, 8), (-8, 8))
    assert (table.h[0], table.k[0], table.l[0], table.F[0]) == (-8, -8, -8, 125.75)
    grid, mins = table.to_grid(0.0)
    assert grid.shape == (17, 17, 17) and grid.dtype == np.float64
    assert mins == (-8, -8, -8)
    assert grid[0, 0, 1] == 144.08  # "-8 -8 -7 144.08"
    assert np.all(grid > 0.0)  # every cell is listed


@needs_golden
def test_golden_sparse_file_gets_default_F() -> None:
    table = read_hkl(GOLDEN / "hkl_default_F" / "P1_sparse.hkl")
    grid, mins = table.to_grid(30.0)
    assert mins == (-8, -8, -8)
    assert grid[0, 0, 0] == 30.0  # -8 -8 -8 is missing from the sparse file
    assert grid[0, 0, 1] == 195.99  # "-8 -8 -7 195.99"
    assert np.count_nonzero(grid != 30.0) <= len(table)


def test_comments_blanks_negative_and_integral_floats(tmp_path: Path) -> None:
    path = tmp_path / "x.hkl"
    path.write_text("# header\n\n 1 2 3 10.5\n-1 -2 -3 4e1  # inline\n2.0 0 0 1\r\n")
    table = read_hkl(path)
    assert table.h.tolist() == [1, -1, 2]
    assert table.l.tolist() == [3, -3, 0]
    assert table.F.tolist() == [10.5, 40.0, 1.0]
    assert table.h.dtype == np.int64 and not table.h.flags.writeable


def test_to_grid_fill_and_duplicates_keep_last() -> None:
    table = HKLTable(h=[0, 1, 0], k=[0, 0, 0], l=[0, 2, 0], F=[1.0, 2.0, 3.0])
    grid, mins = table.to_grid(default_F=7.0)
    assert mins == (0, 0, 0)
    assert grid.shape == (2, 1, 3)
    assert grid[0, 0, 0] == 3.0  # duplicate: last wins, as in nanoBragg
    assert grid[1, 0, 2] == 2.0
    assert grid[0, 0, 1] == 7.0 and grid[1, 0, 0] == 7.0


def test_to_grid_too_large() -> None:
    table = HKLTable(h=[-2000, 2000], k=[-2000, 2000], l=[-2000, 2000], F=[1.0, 1.0], source="big.hkl")
    with pytest.raises(InputError, match="big.hkl") as info:
        table.to_grid()
    message = str(info.value)
    assert "h -2000..2000, k -2000..2000, l -2000..2000 need a grid of 64048012001 cells (512 GB" in message
    assert message.endswith("over the limit of 1000000000 cells")


def test_missing_file(tmp_path: Path) -> None:
    _one_line_error(read_hkl, tmp_path / "none.hkl", "not found")


def test_wrong_field_count(tmp_path: Path) -> None:
    path = tmp_path / "bad.hkl"
    path.write_text("1 2 3 4\n1 2 3\n")
    _one_line_error(read_hkl, path, "line 2", "4 fields", "got 3")


def test_too_many_fields(tmp_path: Path) -> None:
    path = tmp_path / "bad.hkl"
    path.write_text("1 2 3 4 0.5\n")
    _one_line_error(read_hkl, path, "line 1", "got 5")


def test_non_numeric(tmp_path: Path) -> None:
    path = tmp_path / "bad.hkl"
    path.write_text("1 2 3 4\n1 x 3 4\n")
    _one_line_error(read_hkl, path, "line 2", "'x'")


def test_non_integer_index(tmp_path: Path) -> None:
    path = tmp_path / "bad.hkl"
    path.write_text("1 2 1.5 4\n")
    _one_line_error(read_hkl, path, "line 1", "integer", "l")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_F(tmp_path: Path, value: str) -> None:
    path = tmp_path / "bad.hkl"
    path.write_text(f"1 2 3 4\n0 0 1 {value}\n")
    _one_line_error(read_hkl, path, "line 2", "finite")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.hkl"
    path.write_text("# nothing here\n\n")
    _one_line_error(read_hkl, path, "no reflections")


def test_binary_garbage(tmp_path: Path) -> None:
    path = tmp_path / "garbage.hkl"
    path.write_bytes(b"1 2 3 4\n\xff\xfe\x00\x01")
    _one_line_error(read_hkl, path, "line 2", "not a text file")


def test_write_read_roundtrip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    table = HKLTable(h=rng.integers(-20, 20, 50), k=rng.integers(-5, 5, 50), l=rng.integers(0, 9, 50),
                     F=rng.random(50) * 1e3)
    path = tmp_path / "out.hkl"
    write_hkl(path, table)
    back = read_hkl(path)
    for name in "hklF":
        assert np.array_equal(getattr(back, name), getattr(table, name))


def test_write_rejects_nan_and_leaves_no_file(tmp_path: Path) -> None:
    table = HKLTable(h=[0], k=[0], l=[0], F=[np.nan])
    with pytest.raises(InputError, match="out.hkl"):
        write_hkl(tmp_path / "out.hkl", table)
    assert list(tmp_path.iterdir()) == []


def test_fdump_layout_matches_c(tmp_path: Path) -> None:
    grid = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4) + 0.5
    path = tmp_path / "Fdump.bin"
    write_fdump(path, grid, (-1, 0, 5))
    data = path.read_bytes()
    header = b"-1 0 0 2 5 8\n\f"
    assert data.startswith(header)
    body = np.frombuffer(data[len(header):], dtype="<f8")
    assert body.size == 3 * 4 * 5  # one padding slab per axis, as the C writes it
    padded = body.reshape(3, 4, 5)
    assert np.array_equal(padded[:2, :3, :4], grid)
    assert padded[2].sum() == 0 and padded[:, 3].sum() == 0 and padded[:, :, 4].sum() == 0
    back, mins = read_fdump(path)
    assert mins == (-1, 0, 5)
    assert np.array_equal(back, grid)


@needs_golden
def test_fdump_from_hkl_roundtrip(tmp_path: Path) -> None:
    grid, mins = read_hkl(GOLDEN / "hkl_file" / "P1.hkl").to_grid(0.0)
    write_fdump(tmp_path / "Fdump.bin", grid, mins)
    back, back_mins = read_fdump(tmp_path / "Fdump.bin")
    assert back_mins == mins and np.array_equal(back, grid)


def test_fdump_errors(tmp_path: Path) -> None:
    _one_line_error(read_fdump, tmp_path / "none.bin", "not found")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"hello world")
    _one_line_error(read_fdump, bad, "not an Fdump file")
    short = tmp_path / "short.bin"
    short.write_bytes(b"0 1 0 1 0 1\n\f" + b"\0" * 16)
    _one_line_error(read_fdump, short, "expected 216 bytes", "found 16")
    inverted = tmp_path / "inv.bin"
    inverted.write_bytes(b"3 1 0 1 0 1\n\f")
    _one_line_error(read_fdump, inverted, "invalid index ranges")


def test_write_fdump_bad_grid_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="F.bin"):
        write_fdump(tmp_path / "F.bin", np.zeros((2, 2)), (0, 0, 0))
    assert list(tmp_path.iterdir()) == []
