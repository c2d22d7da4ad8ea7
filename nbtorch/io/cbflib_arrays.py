"""CBF binary sections in CBFlib's own compressions, decoded by CBFlib (``pycbf``, the optional extra
``nbtorch[formats]``, imported lazily).

Pilatus and Eiger CBFs use ``x-CBF_BYTE_OFFSET``, which :mod:`nbtorch.io.cbf` decodes itself.  Other
facilities write CBFlib's other compressions: the LCLS CSPAD CBFs of ``cctbx.xfel`` are ``x-CBF_PACKED``
(J. P. Abrahams' packing with a neighbour-average predictor), and CBFlib also writes ``x-CBF_PACKED_V2``,
``x-CBF_CANONICAL`` and ``x-CBF_NIBBLE_OFFSET``.  Their predictors are CBFlib's, so CBFlib decodes them: a
second decoder here could drift from it (a predictor that rounds one way where CBFlib rounds the other makes
values walk away pixel by pixel) and misread images silently.

:func:`decode_arrays` returns every ``_array_data`` row's integer array, in the file's order, shaped slowest
index first (numpy order): ``(slow, mid, fast)`` or ``(slow, fast)`` with CBFlib's size-1 dimensions dropped
from the slow end.
"""

from __future__ import annotations

import numpy as np

from nbtorch.errors import InputError

__all__ = ["decode_arrays", "needs_cbflib"]

_OWN = "x-CBF_BYTE_OFFSET"


def needs_cbflib(conversion: str) -> bool:
    """Whether a binary section's ``conversions`` (MIME ``Content-Type`` and ``conversions`` fields) name a
    compression other than ``x-CBF_BYTE_OFFSET``: one that :func:`decode_arrays` must decode."""
    return _OWN not in conversion


def _pycbf(name: str, conversion: str):
    try:
        import pycbf  # optional extra nbtorch[formats]: only non-byte-offset CBF sections need it
    except ImportError:
        kind = conversion.split("conversions=")[-1].strip().strip('"') or conversion.strip()
        raise InputError(f"{name}: CBF compression {kind} needs CBFlib's Python module: pip install pycbf "
                         "(or nbtorch[formats])") from None
    return pycbf


def decode_arrays(name: str, data: bytes, conversion: str) -> list[np.ndarray]:
    """Every ``_array_data`` row of the CBF bytes ``data``, decoded by CBFlib (module docstring).

    ``conversion``: the first section's compression, for the message when ``pycbf`` is missing.

    Raises:
        InputError: ``pycbf`` is not installed, or CBFlib refuses the file (its message, one line).
    """
    pycbf = _pycbf(name, conversion)
    arrays = []
    try:
        handle = pycbf.cbf_handle_struct()
        handle.read_buffer(bytes(data), pycbf.MSG_DIGEST | pycbf.CBF_PARSE_WIDE)  # wide: lines over 80 characters
        handle.find_category(b"array_data")
        for row in range(handle.count_rows()):
            handle.find_category(b"array_data")
            handle.find_column(b"data")
            handle.select_row(row)
            (_compression, _binary, size, signed, _unsigned, count, _lo, _hi, order,
             fast, mid, slow, _pad) = handle.get_integerarrayparameters_wdims_fs()
            raw = handle.get_integerarray_as_string()
            if size not in (1, 2, 4, 8):
                raise InputError(f"{name}: array_data row {row + 1}: element size {size} bytes is not supported")
            kind = ("<" if order in (b"little_endian", "little_endian") else ">") + ("i" if signed else "u") + str(size)
            values = np.frombuffer(raw, dtype=kind, count=count)
            dims = [d for d in (slow, mid) if d > 1] + [fast]
            if int(np.prod(dims)) != count:
                raise InputError(f"{name}: array_data row {row + 1}: dimensions {fast}x{mid}x{slow} do not match "
                                 f"{count} elements")
            arrays.append(values.reshape(dims))
    except InputError:
        raise
    except Exception as exc:  # CBFlib's errors come as plain Exceptions ("CBFlib Error(s): CBF_FORMAT")
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{name}: CBFlib cannot decode the file: {text}") from None
    return arrays
