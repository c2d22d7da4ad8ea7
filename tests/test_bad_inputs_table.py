"""docs/bad-inputs.md cannot rot: every test it names exists; and the rows it added tests for (#20)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nbtorch.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "bad-inputs.md"
# `tests/path/file.py::test_name` or `...::test_name[parameter id]`, as written in the table
_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]`]+)\])?`")


def _references() -> list[tuple[str, str, str | None]]:
    return [m.groups() for m in _REF.finditer(TABLE.read_text(encoding="utf-8"))]


def test_table_names_tests():
    refs = _references()
    assert len(refs) >= 40, "the table lost its test references"
    text = TABLE.read_text(encoding="utf-8")
    for heading in ("## Files", "## Flags", "## Runs"):
        assert heading in text
    for kind in ("truncated", "wrong size", "NaN/Inf", "wrong columns", "wrong units", "unknown", "conflicting",
                 "out of range", "killed mid-write", "interrupted and resumed", "a worker killed mid-sweep"):
        assert kind in text, f"no row for {kind!r}"


@pytest.mark.parametrize("path, name, param", _references(), ids=lambda v: str(v))
def test_every_referenced_test_exists(path, name, param):
    """The file exists, defines the test function, and a parameter id in brackets is written in that file."""
    file = ROOT / path
    assert file.is_file(), f"{path} does not exist"
    source = file.read_text(encoding="utf-8")
    defined = {node.name for node in ast.walk(ast.parse(source))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert name in defined, f"{path} has no test {name}"
    if param is not None:
        assert f'"{param}"' in source or f"'{param}'" in source, f"{path}: no parameter {param!r} for {name}"


def test_table_is_linked_from_the_readme():
    assert "docs/bad-inputs.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_spot_list_bad_rows(tmp_path):
    """--spots files: NaN/Inf positions and rows without two numbers are one-line errors naming file and line."""
    from refine.inputs.spots import read_spot_list

    cases = {"inf.txt": ("1 2\n10 inf 3\n", "inf.txt line 2: spot position is not finite"),
             "nan.txt": ("nan 2\n", "nan.txt line 1: spot position is not finite"),
             "one.txt": ("10\n", "one.txt line 1: expected numbers in columns 1 and 2 (x, y: columns 1 and 2 (no header)), got '10'"),
             "empty.txt": ("# nothing\n\n", "empty.txt: no spots found in the file (no row of numbers)")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError) as info:
            read_spot_list(str(tmp_path / name))
        assert str(info.value).endswith(message) and "\n" not in str(info.value)
