"""CBF binary sections in CBFlib's own compressions, decoded by CBFlib (``pycbf``, the optional extra
``nbtorch[formats]``) in a child process.

Pilatus and Eiger CBFs use ``x-CBF_BYTE_OFFSET``, which :mod:`nbtorch.io.cbf` decodes itself.  Other
facilities write CBFlib's other compressions: the LCLS CSPAD CBFs of ``cctbx.xfel`` are ``x-CBF_PACKED``
(J. P. Abrahams' packing with a neighbour-average predictor), and CBFlib also writes ``x-CBF_PACKED_V2``,
``x-CBF_CANONICAL`` and ``x-CBF_NIBBLE_OFFSET``.  Their predictors are CBFlib's, so CBFlib decodes them: a
second decoder here could drift from it (a predictor that rounds one way where CBFlib rounds the other makes
values walk away pixel by pixel) and misread images silently.

CBFlib runs in a child Python (``sys.executable``; numpy and pycbf only, ~0.3 s a file): on a damaged
stream it can crash (a segmentation fault was seen on a corrupt canonical stream and on fuzzed headers),
which must cost the caller a one-line error, not its process.  Only the compressions above go to CBFlib;
any other ``conversions`` value is refused by the caller.

:func:`decode_arrays` returns every ``_array_data`` row's integer array, in the file's order, shaped slowest
index first (numpy order): ``(slow, mid, fast)`` or ``(slow, fast)`` with CBFlib's size-1 dimensions dropped
from the slow end.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np

from nbtorch.errors import InputError

__all__ = ["CBFLIB_COMPRESSIONS", "cbflib_compression", "decode_arrays"]

#: CBFlib's compressions other than byte offset, by their MIME ``conversions`` name
CBFLIB_COMPRESSIONS = ("x-CBF_PACKED_V2", "x-CBF_PACKED", "x-CBF_CANONICAL", "x-CBF_NIBBLE_OFFSET")

#: seconds CBFlib may take for one file before it counts as hung
TIMEOUT_S = 120.0

# The child: CBF bytes on stdin, an .npz of the arrays on stdout; CBFlib's own refusal as one line on stderr
# with exit status 3.  Only numpy and pycbf are imported (not nbtorch, whose import pulls in torch).
_CHILD = r"""
import io, sys
import numpy as np
import pycbf
data = sys.stdin.buffer.read()
arrays = {}
try:
    h = pycbf.cbf_handle_struct()
    h.read_buffer(data, pycbf.MSG_DIGEST | pycbf.CBF_PARSE_WIDE)
    h.find_category(b"array_data")
    for row in range(h.count_rows()):
        h.find_category(b"array_data"); h.find_column(b"data"); h.select_row(row)
        (_c, _b, size, signed, _u, count, _lo, _hi, order, fast, mid, slow, _p) = h.get_integerarrayparameters_wdims_fs()
        if size not in (1, 2, 4, 8):
            raise ValueError(f"array_data row {row + 1}: element size {size} bytes is not supported")
        kind = ("<" if order in (b"little_endian", "little_endian") else ">") + ("i" if signed else "u") + str(size)
        values = np.frombuffer(h.get_integerarray_as_string(), dtype=kind, count=count)
        dims = [d for d in (slow, mid) if d > 1] + [fast]
        if int(np.prod(dims)) != count:
            raise ValueError(f"array_data row {row + 1}: dimensions {fast}x{mid}x{slow} do not match {count} elements")
        arrays[f"a{row:05d}"] = values.reshape(dims)
except Exception as exc:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    sys.stderr.write(text); sys.exit(3)
out = io.BytesIO()
np.savez(out, **arrays)
sys.stdout.buffer.write(out.getvalue())
"""


def cbflib_compression(conversion: str, what: str) -> str | None:
    """The CBFlib compression a binary section's ``conversions`` (:func:`nbtorch.io.cbf.binary_conversion`)
    names, or None for byte offset (decoded by :mod:`nbtorch.io.cbf`).

    Raises:
        InputError: any other compression (one line, after ``what``: the file, or the file and its array).
    """
    if "x-CBF_BYTE_OFFSET" in conversion:
        return None
    kind = next((c for c in CBFLIB_COMPRESSIONS if c in conversion), None)
    if kind is None:
        found = conversion.split("conversions=")[-1].strip().strip('"') or "none given"
        raise InputError(f"{what}: CBF compression {found} is not supported (x-CBF_BYTE_OFFSET, or CBFlib's "
                         f"{', '.join(CBFLIB_COMPRESSIONS)} through pycbf)")
    return kind


def decode_arrays(name: str, data: bytes, compression: str) -> list[np.ndarray]:
    """Every ``_array_data`` row of the CBF bytes ``data``, decoded by CBFlib in a child process (module
    docstring); ``compression``: the first section's, for the messages.

    Raises:
        InputError: ``pycbf`` is not installed, CBFlib refuses the file (its message), crashes or hangs on it
            (one line each).
    """
    try:
        import pycbf  # noqa: F401 - installed? (decoded in the child, never here)
    except ImportError:
        raise InputError(f"{name}: CBF compression {compression} needs CBFlib's Python module: pip install pycbf "
                         "(or nbtorch[formats])") from None
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=bytes(data), capture_output=True,
                              timeout=TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        raise InputError(f"{name}: CBFlib did not finish decoding the file in {TIMEOUT_S:g} s "
                         f"(CBF compression {compression})") from None
    message = done.stderr.decode("utf-8", "replace").strip().splitlines()
    if done.returncode == 3:
        raise InputError(f"{name}: CBFlib cannot decode the file: {message[-1] if message else 'no message'}")
    if done.returncode != 0:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        raise InputError(f"{name}: CBFlib crashed decoding the file ({how}; CBF compression {compression}): the "
                         "file is damaged or not what its header says")
    with np.load(io.BytesIO(done.stdout)) as npz:
        return [npz[k] for k in sorted(npz.files)]
