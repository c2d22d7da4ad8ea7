"""Tests for nbtorch.io.atomic: all-or-nothing output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_output_path, atomic_write


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_binary_write_creates_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with atomic_write(target) as handle:
        handle.write(b"abc")
        assert not target.exists()  # nothing visible before the block ends
    assert target.read_bytes() == b"abc"
    assert _leftovers(tmp_path) == ["out.bin"]


def test_text_mode_uses_unix_newlines(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    with atomic_write(target, "w") as handle:
        handle.write("a\nb\n")
    assert target.read_bytes() == b"a\nb\n"


def test_exception_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_write(target) as handle:
            handle.write(b"partial")
            raise RuntimeError("boom")
    assert _leftovers(tmp_path) == []


def test_exception_keeps_existing_target(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as handle:
            handle.write(b"new")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == ["out.bin"]


def test_replaces_existing_target(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with atomic_write(target) as handle:
        handle.write(b"new")
    assert target.read_bytes() == b"new"


def test_missing_directory_is_input_error(tmp_path: Path) -> None:
    target = tmp_path / "nope" / "out.bin"
    with pytest.raises(InputError) as info:
        with atomic_write(target) as handle:
            handle.write(b"x")
    message = str(info.value)
    assert str(target) in message and "\n" not in message and "does not exist" in message


def test_parent_is_a_file_is_input_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    target = tmp_path / "plain" / "out.bin"
    with pytest.raises(InputError, match=r"cannot write file: .*plain is not a directory$"):
        with atomic_write(target) as handle:
            handle.write(b"x")
    assert (tmp_path / "plain").read_text() == "x"


def test_target_is_directory_is_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="directory"):
        with atomic_write(tmp_path) as handle:
            handle.write(b"x")


def test_permissions_follow_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        target = tmp_path / "out.bin"
        with atomic_write(target) as handle:
            handle.write(b"x")
    finally:
        os.umask(old)
    assert target.stat().st_mode & 0o777 == 0o644


def test_atomic_output_path(tmp_path: Path) -> None:
    target = tmp_path / "lib.dat"
    with atomic_output_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        tmp.write_bytes(b"data")
    assert target.read_bytes() == b"data"
    assert _leftovers(tmp_path) == ["lib.dat"]
    with pytest.raises(ValueError):
        with atomic_output_path(tmp_path / "other.dat") as tmp:
            tmp.write_bytes(b"half")
            raise ValueError("fail")
    assert _leftovers(tmp_path) == ["lib.dat"]


def test_bad_mode_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        with atomic_write(tmp_path / "x", "ab"):
            pass
    assert _leftovers(tmp_path) == []
