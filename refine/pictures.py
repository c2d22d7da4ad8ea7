"""PNG pictures of images and residuals, with no plotting library: a 40-line PNG writer and two colour maps.

* :func:`write_png`: (H, W) gray or (H, W, 3) RGB ``uint8`` -> PNG file (zlib + struct, atomic);
* :func:`gray`: counts -> gray levels, white = bright, with a square-root stretch between
  percentiles (diffraction spots span orders of magnitude);
* :func:`diverging`: residuals -> blue (negative) / white (0) / red (positive);
* :func:`spot_marks`: draw small open squares (observed) or crosses (predicted) onto an RGB image;
* :func:`side_by_side`: panels with a gap.
"""

from __future__ import annotations

import struct
import zlib
from typing import Sequence

import numpy as np

__all__ = ["write_png", "gray", "diverging", "side_by_side", "spot_marks"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path, pixels: np.ndarray) -> None:
    """Write ``pixels`` ((H, W) gray or (H, W, 3) RGB, uint8) as an 8-bit PNG (atomic)."""
    from nbtorch.io.atomic import atomic_write

    a = np.ascontiguousarray(pixels, dtype=np.uint8)
    if a.ndim == 2:
        colour = 0
    elif a.ndim == 3 and a.shape[2] == 3:
        colour = 2
    else:
        raise ValueError(f"write_png: expected (H, W) or (H, W, 3), got {a.shape}")
    h, w = a.shape[:2]
    rows = a.reshape(h, -1)
    raw = np.concatenate([np.zeros((h, 1), dtype=np.uint8), rows], axis=1).tobytes()  # filter 0 per row
    png = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 0))
           + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))
    with atomic_write(path, "wb") as fh:
        fh.write(png)


def gray(image: np.ndarray, mask: np.ndarray | None = None, lo: float | None = None, hi: float | None = None,
         percentiles: tuple[float, float] = (1.0, 99.8)) -> np.ndarray:
    """uint8 (H, W): ``sqrt`` stretch of ``image`` between ``lo`` and ``hi`` (default: percentiles of the
    unmasked pixels); masked pixels (``mask`` False) are mid-gray."""
    img = np.asarray(image, dtype=np.float64)
    m = np.isfinite(img) if mask is None else (np.asarray(mask, dtype=bool) & np.isfinite(img))
    vals = img[m] if m.any() else np.zeros(1)
    lo = float(np.percentile(vals, percentiles[0])) if lo is None else lo
    hi = float(np.percentile(vals, percentiles[1])) if hi is None else hi
    t = np.sqrt(np.clip((img - lo) / max(hi - lo, 1e-12), 0.0, 1.0))
    out = (255.0 * (1.0 - t)).round().astype(np.uint8)  # dark spots on white, like film
    out[~m] = 160
    return out


def diverging(residual: np.ndarray, mask: np.ndarray | None = None, limit: float | None = None) -> np.ndarray:
    """uint8 (H, W, 3): residual -> blue (< 0), white (0), red (> 0), saturating at ``limit``
    (default: the 99.5th percentile of ``|residual|``); masked pixels are gray."""
    r = np.asarray(residual, dtype=np.float64)
    m = np.isfinite(r) if mask is None else (np.asarray(mask, dtype=bool) & np.isfinite(r))
    if limit is None:
        limit = float(np.percentile(np.abs(r[m]), 99.5)) if m.any() else 1.0
    t = np.clip(np.where(m, r, 0.0) / max(limit, 1e-12), -1.0, 1.0)
    out = np.empty(r.shape + (3,))
    pos, neg = np.clip(t, 0, 1), np.clip(-t, 0, 1)
    out[..., 0] = 1.0 - neg
    out[..., 1] = 1.0 - pos - neg
    out[..., 2] = 1.0 - pos
    out = (255.0 * np.clip(out, 0, 1)).round().astype(np.uint8)
    out[~m] = (160, 160, 160)
    return out


def _rgb(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.uint8)
    return np.repeat(a[..., None], 3, axis=2) if a.ndim == 2 else a


def side_by_side(panels: Sequence[np.ndarray], gap: int = 6) -> np.ndarray:
    """RGB uint8 image of ``panels`` (gray or RGB, same height) left to right, ``gap`` white pixels apart."""
    rgb = [_rgb(p) for p in panels]
    h = max(p.shape[0] for p in rgb)
    parts = []
    for i, p in enumerate(rgb):
        if p.shape[0] < h:
            p = np.concatenate([p, np.full((h - p.shape[0],) + p.shape[1:], 255, np.uint8)])
        parts.append(p)
        if i + 1 < len(rgb):
            parts.append(np.full((h, gap, 3), 255, np.uint8))
    return np.concatenate(parts, axis=1)


def spot_marks(rgb: np.ndarray, xy: np.ndarray, colour: tuple[int, int, int], kind: str = "square",
               size: int = 4, scale: int = 1) -> np.ndarray:
    """A copy of ``rgb`` with a mark at each ``(x, y)`` (pixels of the picture before ``scale``-fold magnification;
    pixel centres at ``i + 0.5``): ``"square"`` (open) or ``"cross"``."""
    out = _rgb(rgb).copy()
    h, w = out.shape[:2]
    for x, y in np.asarray(xy, dtype=np.float64).reshape(-1, 2):
        if not (np.isfinite(x) and np.isfinite(y)):
            continue
        cx, cy = int(round(x * scale - 0.5)), int(round(y * scale - 0.5))
        if kind == "square":
            for d in range(-size, size + 1):
                for px, py in ((cx + d, cy - size), (cx + d, cy + size), (cx - size, cy + d), (cx + size, cy + d)):
                    if 0 <= px < w and 0 <= py < h:
                        out[py, px] = colour
        else:
            for d in range(-size, size + 1):
                for px, py in ((cx + d, cy), (cx, cy + d)):
                    if 0 <= px < w and 0 <= py < h:
                        out[py, px] = colour
    return out
