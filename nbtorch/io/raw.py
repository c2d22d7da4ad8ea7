"""Raw (headerless) image files, and the low-level file reading shared by the
other readers of :mod:`nbtorch.io`.

Raw float images are what nanoBragg writes with ``-floatfile``: IEEE float32,
**little-endian**, no header, ``spixels * fpixels`` values in row-major
(slow, fast) order, i.e. the fast index varies fastest and the value at
(slow ``s``, fast ``f``) is element ``s * fpixels + f``.  Values are photons
per pixel.

:func:`read_file_bytes`, :func:`read_text_lines` and :func:`read_toml` turn
every operating system, decoding or syntax problem into a one-line
:class:`~nbtorch.errors.InputError` that names the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write

__all__ = ["read_raw_float", "write_raw_float", "raw_float_bytes", "read_file_bytes", "read_text_lines", "read_toml"]


def read_file_bytes(path: str | os.PathLike[str], what: str = "file") -> bytes:
    """Return the whole content of ``path``; OS errors become :class:`InputError`."""
    p = Path(path)
    try:
        with open(p, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise InputError(f"{p}: {what} not found") from None
    except IsADirectoryError:
        raise InputError(f"{p}: {what} is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read {what}: {exc.strerror or exc}") from None


def read_toml(path: str | os.PathLike[str], label: str) -> dict:
    """Parse a TOML file; every problem is an :class:`InputError` starting with ``label`` (e.g. ``--config``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise InputError(f"{label} {path}: reading TOML needs Python 3.11 or: pip install tomli") from None
    try:
        data = read_file_bytes(path)
    except InputError as exc:
        raise InputError(f"{label} {exc}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"{label} {path}: not valid TOML: {exc}") from None


def read_text_lines(path: str | os.PathLike[str], what: str = "file") -> list[str]:
    """Read a text file as UTF-8 and return its lines without line endings.

    ``\\r\\n`` line endings are accepted.  An undecodable byte raises
    :class:`InputError` naming the line where it sits.
    """
    data = read_file_bytes(path, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{path} line {line}: not a text file (undecodable byte 0x{data[exc.start]:02x})") from None
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise InputError(f"{path} line {line}: not a text file (NUL byte)")
    return text.splitlines()


def read_raw_float(path: str | os.PathLike[str], shape: Sequence[int], dtype: str = "<f4") -> np.ndarray:
    """Read a headerless image of ``shape`` (slow, fast) and element ``dtype``.

    The file size must be exactly ``prod(shape) * itemsize`` bytes.  Returns a
    native-byte-order array of ``shape`` (float32 for the default dtype).
    """
    dt = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if any(n <= 0 for n in shape):
        raise InputError(f"{path}: invalid image shape {shape}")
    data = read_file_bytes(path, "raw image file")
    expected = int(np.prod(shape)) * dt.itemsize
    if len(data) != expected:
        raise InputError(
            f"{path}: expected {expected} bytes for a {'x'.join(map(str, shape))} image of {dt.str}, "
            f"found {len(data)} bytes"
        )
    return np.frombuffer(data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="))


def write_raw_float(path: str | os.PathLike[str], image: np.ndarray) -> None:
    """Write ``image`` as headerless float32 little-endian, slow-major (fast index fastest).

    Accepts any array-like (including CPU torch tensors); values are rounded to
    float32.  The write is atomic.
    """
    data = raw_float_bytes(path, image)
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def raw_float_bytes(path: str | os.PathLike[str], image: np.ndarray) -> bytes:
    """The bytes :func:`write_raw_float` writes (``path`` only names the file in errors)."""
    arr = np.asarray(image)
    if arr.ndim < 1 or arr.size == 0:
        raise InputError(f"{path}: cannot write an empty image")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise InputError(f"{path}: cannot write an image of dtype {arr.dtype} as float32")
    return np.ascontiguousarray(arr, dtype="<f4").tobytes()
