"""CBF files rewritten by CBFlib (pycbf) in its own compressions, for the tests of the readers that hand such
files to CBFlib.  Import only where pycbf is installed (``pytest.importorskip("pycbf")`` first)."""

from __future__ import annotations

from pathlib import Path

import pycbf


def cbflib_copy(source: Path, target: Path, compression: str) -> Path:
    """``source`` (a CBF) rewritten by CBFlib with every array in ``compression`` (a pycbf constant's name:
    ``CBF_PACKED``, ``CBF_PACKED_V2``, ``CBF_CANONICAL`` ...)."""
    handle = pycbf.cbf_handle_struct()
    handle.read_widefile(str(source).encode(), pycbf.MSG_DIGEST)
    handle.find_category(b"array_data")
    for row in range(handle.count_rows()):
        handle.find_category(b"array_data")
        handle.find_column(b"data")
        handle.select_row(row)
        _, binary, size, signed, _, count, _, _, _, fast, mid, _, _ = handle.get_integerarrayparameters_wdims_fs()
        raw = handle.get_integerarray_as_string()
        handle.set_integerarray_wdims_fs(getattr(pycbf, compression), binary, raw, size, signed, count,
                                         b"little_endian", fast, mid, count // (fast * mid), 0)
    handle.write_widefile(str(target).encode(), pycbf.CBF, pycbf.MIME_HEADERS | pycbf.MSG_DIGEST, 0)
    return target
