"""A minimal PNG writer (zlib + struct; no imaging library needed).

:func:`write_png` writes a 2-D array as an 8-bit greyscale PNG, scaled linearly
from its minimum (black) to its maximum (white), optionally on a log scale;
:func:`write_png_pair` puts two images side by side with a 2-pixel white gap.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["to_uint8", "write_png", "write_png_pair"]


def to_uint8(image: np.ndarray, log: bool = False) -> np.ndarray:
    """(H, W) float -> (H, W) uint8, min -> 0 and max -> 255 (NaN/Inf -> 0)."""
    a = np.asarray(image, dtype=np.float64)
    a = np.where(np.isfinite(a), a, np.nan)
    if log:
        a = np.log1p(np.clip(a - np.nanmin(a), 0.0, None)) if np.isfinite(a).any() else a
    lo, hi = (np.nanmin(a), np.nanmax(a)) if np.isfinite(a).any() else (0.0, 0.0)
    scaled = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
    return np.nan_to_num(np.round(255.0 * scaled), nan=0.0).astype(np.uint8)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path: str | Path, image: np.ndarray, log: bool = False) -> Path:
    """Write ``image`` (H, W) as an 8-bit greyscale PNG; returns the path."""
    pixels = image if np.asarray(image).dtype == np.uint8 else to_uint8(image, log)
    h, w = pixels.shape
    raw = b"".join(b"\x00" + pixels[r].tobytes() for r in range(h))  # filter type 0 on every row
    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)  # 8-bit, greyscale, deflate, no interlace
    path = Path(path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9))
                     + _chunk(b"IEND", b""))
    return path


def write_png_pair(path: str | Path, left: np.ndarray, right: np.ndarray, log: bool = True) -> Path:
    """Two images (same height) side by side, each scaled on its own."""
    a, b = to_uint8(left, log), to_uint8(right, log)
    gap = np.full((a.shape[0], 2), 255, dtype=np.uint8)
    return write_png(path, np.concatenate([a, gap, b], axis=1))
