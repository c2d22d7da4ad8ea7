"""File readers and writers for nbtorch (pure numpy; h5py, hdf5plugin and fabio imported lazily where needed).

Modules:

- :mod:`nbtorch.io.atomic` -- atomic file output (temp file + fsync + ``os.replace``).
- :mod:`nbtorch.io.raw` -- headerless float32 images (nanoBragg ``-floatfile``) and file reading helpers.
- :mod:`nbtorch.io.hkl` -- text ``h k l F`` structure-factor files and nanoBragg's ``Fdump.bin`` cache.
- :mod:`nbtorch.io.matrix` -- MOSFLM orientation matrices (nanoBragg ``-mat``).
- :mod:`nbtorch.io.smv` -- SMV/ADSC images (nanoBragg ``-intfile``/``-noisefile``) and the int-image scaling.
- :mod:`nbtorch.io.pgm` -- 8-bit PGM previews (nanoBragg ``-pgmfile``).
- :mod:`nbtorch.io.sources` -- source lists (nanoBragg ``-sourcefile``).
- :mod:`nbtorch.io.cbf` -- Pilatus mini-CBF with byte-offset compression (plain, .bz2, .gz).
- :mod:`nbtorch.io.hdf5` -- NeXus NXmx-style HDF5 images and Eiger masters (hdf5plugin's filters when installed).
- :mod:`nbtorch.io.nexus` -- detector two-theta and the rotation of a frame from NXmx NXtransformations.
- :mod:`nbtorch.io.fabio_formats` -- TIFF, Pilatus TIFF, MarCCD/Rayonix and mar345 through fabio (optional).
- :mod:`nbtorch.io.panel_images` -- multi-panel image files: NXmx detector modules, multi-array (imgCIF) CBF.

Images are always numpy arrays indexed (slow, fast).  Every problem with an
input file raises :class:`nbtorch.errors.InputError` with a one-line message
naming the file, and every writer is atomic.
"""

from __future__ import annotations

from nbtorch.io.atomic import atomic_output_path, atomic_write
from nbtorch.io.cbf import decode_byte_offset, encode_byte_offset, read_cbf, write_cbf
from nbtorch.io.hdf5 import read_h5_image, write_h5
from nbtorch.io.hkl import HKLTable, read_fdump, read_hkl, write_fdump, write_hkl
from nbtorch.io.matrix import read_mosflm_matrix, write_mosflm_matrix
from nbtorch.io.pgm import default_pgm_scale, read_pgm, write_pgm
from nbtorch.io.raw import read_file_bytes, read_raw_float, read_text_lines, read_toml, write_raw_float
from nbtorch.io.smv import (
    SMV_HEADER_BYTES,
    format_smv_header,
    header_value,
    intfile_from_float,
    read_smv,
    roi_mask_from_bounds,
    smv_bytes,
    smv_header_from_geometry,
    write_smv,
)
from nbtorch.io.sources import DEFAULT_SOURCE_DISTANCE_M, fill_source_defaults, read_sourcefile

__all__ = [
    "atomic_write",
    "atomic_output_path",
    "read_file_bytes",
    "read_text_lines",
    "read_toml",
    "read_raw_float",
    "write_raw_float",
    "HKLTable",
    "read_hkl",
    "write_hkl",
    "read_fdump",
    "write_fdump",
    "read_mosflm_matrix",
    "write_mosflm_matrix",
    "SMV_HEADER_BYTES",
    "smv_header_from_geometry",
    "format_smv_header",
    "write_smv",
    "smv_bytes",
    "read_smv",
    "intfile_from_float",
    "header_value",
    "roi_mask_from_bounds",
    "write_pgm",
    "read_pgm",
    "default_pgm_scale",
    "read_sourcefile",
    "fill_source_defaults",
    "DEFAULT_SOURCE_DISTANCE_M",
    "read_cbf",
    "write_cbf",
    "decode_byte_offset",
    "encode_byte_offset",
    "write_h5",
    "read_h5_image",
]
