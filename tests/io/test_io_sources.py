"""Tests for nbtorch.io.sources: nanoBragg -sourcefile lists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.sources import fill_source_defaults, read_sourcefile

from golden import GOLDEN, needs_golden


@needs_golden
def test_golden_sourcefile() -> None:
    table = read_sourcefile(GOLDEN / "sourcefile" / "sources.txt")
    assert table.shape == (4, 5)
    assert table[1].tolist() == [-10.0, 0.03, 0.0, 0.5, 1.01e-10]
    assert table[:, 4].tolist() == [1e-10, 1.01e-10, 9.9e-11, 1e-10]


def test_missing_columns_and_delimiters(tmp_path: Path) -> None:
    path = tmp_path / "s.txt"
    path.write_text("# comment\n\n-10,0;0\n-10 0 0 2\n  1:2!3 4 5e-10 99\n")
    table = read_sourcefile(path)
    assert table.shape == (3, 5)
    assert np.isnan(table[0, 4]) and table[0, 3] == 1.0  # weight defaults to 1, lambda to NaN
    assert table[1].tolist()[:4] == [-10, 0, 0, 2] and np.isnan(table[1, 4])
    assert table[2].tolist() == [1, 2, 3, 4, 5e-10]  # sixth column ignored, like the C
    only_x = tmp_path / "x.txt"
    only_x.write_text("-10\n")
    row = read_sourcefile(only_x)[0]
    assert row[0] == -10 and np.isnan(row[1]) and np.isnan(row[2]) and row[3] == 1.0


def test_fill_defaults() -> None:
    table = np.array([[np.nan, np.nan, np.nan, 1.0, np.nan], [-5, 1, 2, 3, 2e-10]])
    filled = fill_source_defaults(table, beam_vector=np.array([1.0, 0, 0]), wavelength_m=1e-10)
    assert filled[0].tolist() == [-10.0, 0.0, 0.0, 1.0, 1e-10]  # MOSFLM beam: source at -10 m along x
    assert filled[1].tolist() == [-5, 1, 2, 3, 2e-10]
    assert np.isnan(table[0, 0])  # input untouched


def _error(path: Path, *fragments: str) -> None:
    with pytest.raises(InputError) as info:
        read_sourcefile(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_errors(tmp_path: Path) -> None:
    _error(tmp_path / "none.txt", "not found")
    bad = tmp_path / "bad.txt"
    bad.write_text("-10 0 0 1 1e-10\n-10 zero 0\n")
    _error(bad, "line 2", "Y", "'zero'")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n# only comments\n")
    _error(empty, "no sources")
    neg = tmp_path / "neg.txt"
    neg.write_text("-10 0 0 1 -1e-10\n")
    _error(neg, "line 1", "lambda must be positive")
    inf = tmp_path / "inf.txt"
    inf.write_text("-10 inf 0\n")
    _error(inf, "line 1", "not finite")


def test_wavelength_in_angstrom_is_a_unit_error(tmp_path: Path) -> None:
    """lambda is in metres: 1.0 (meant as 1 A) is refused, naming the unit (nanoBragg would use 1 m)."""
    angstrom = tmp_path / "angstrom.txt"
    angstrom.write_text("-10 0 0 1 1e-10\n-10 0 0 1 1.0\n")
    _error(angstrom, "line 2", "lambda 1 m is not an X-ray wavelength", "metres (1 A = 1e-10 m)")
