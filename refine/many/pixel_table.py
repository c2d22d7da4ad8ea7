"""The fitted pixels of one image, and nothing else of it: what a refinement of many images holds per image.

A joint refinement (:mod:`refine.many.joint`) fits each image on a small part of the detector (spot windows and a
sample of the background: ~80 000 of a Pilatus 6M's 6.2 million pixels).  Holding each whole observed image
(50 MB in float64), its mask and the fitted rectangle's dense copies would cost ~85 MB per image; a
:class:`FittedPixels` holds the fitted positions and their observed photons only (16 bytes per fitted pixel,
~1.3 MB for that still), and the objective built on it (:meth:`refine.fitting.objective.ImageObjective.from_pixels`)
simulates exactly those positions (:meth:`nbtorch.Simulator.render_pixels` with ``pixels=``), with no pixel
mask of the detector's size anywhere.

When even the fitted pixels of every image do not fit in memory, :meth:`FittedPixels.store` writes them to a
file and keeps a :class:`StoredPixels` (the path and the counts) instead: the refinement reads them back for
each evaluation (:meth:`StoredPixels.load`) and frees them after it.

Positions are flat row-major indices into the detector, ``slow * n_fast + fast`` (pixel ``(slow, fast)`` of
the ``(slow, fast)`` image; the frame of :meth:`nbtorch.Simulator.render`), strictly increasing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_output_path

__all__ = ["FittedPixels", "StoredPixels", "load_pixels"]

#: version tag of the files :meth:`FittedPixels.store` writes
_FORMAT = "nbtorch-fitted-pixels-1"


@dataclass(frozen=True, eq=False)
class FittedPixels:
    """The fitted pixels of one image.

    Attributes:
        shape: the detector's ``(slow, fast)`` size.
        index: int64 (n,) flat row-major positions in the detector, strictly increasing.
        observed: (n,) observed photons at ``index`` (finite, >= 0), float64 unless made otherwise.
        source: what the pixels came from (an image file name), for messages.
    """

    shape: tuple[int, int]
    index: Tensor
    observed: Tensor
    source: str = ""

    @classmethod
    def from_image(cls, observed: Tensor, valid: Tensor, source: str = "") -> "FittedPixels":
        """The ``valid`` (bool, the image's shape) pixels of a dense ``(slow, fast)`` image."""
        if tuple(valid.shape) != tuple(observed.shape) or observed.dim() != 2:
            raise InputError(f"{source or 'observed'}: expected a (slow, fast) image and a mask of its shape, got "
                             f"{tuple(observed.shape)} and {tuple(valid.shape)}")
        index = torch.nonzero(valid.reshape(-1)).reshape(-1)
        return cls((int(observed.shape[0]), int(observed.shape[1])), index,
                   observed.reshape(-1)[index].clone(), source)

    def __post_init__(self) -> None:
        n = self.index.numel()
        if self.index.dim() != 1 or self.index.dtype != torch.int64 or self.observed.shape != (n,):
            raise InputError(f"{self.source or 'fitted pixels'}: expected int64 positions (n,) and observed photons "
                             f"(n,), got {self.index.dtype} {tuple(self.index.shape)} and {tuple(self.observed.shape)}")
        if n == 0:
            raise InputError(f"{self.source or 'fitted pixels'}: no usable pixels (all masked, NaN or negative)")

    @property
    def n(self) -> int:
        """Number of fitted pixels."""
        return self.index.numel()

    @property
    def nbytes(self) -> int:
        """Bytes held (positions and photons)."""
        return self.index.numel() * self.index.element_size() + self.observed.numel() * self.observed.element_size()

    def load(self) -> "FittedPixels":
        """Itself (the same call as :meth:`StoredPixels.load`)."""
        return self

    def to(self, dtype: torch.dtype, device: torch.device | str) -> "FittedPixels":
        """The same pixels with the photons in ``dtype`` on ``device`` (itself when already so)."""
        if self.observed.dtype == dtype and self.observed.device == torch.device(device):
            return self
        return FittedPixels(self.shape, self.index.to(device), self.observed.to(dtype=dtype, device=device),
                            self.source)

    def valid_mask(self) -> Tensor:
        """A dense bool ``(slow, fast)`` mask, True at the fitted pixels (made on each call: not held)."""
        mask = torch.zeros(self.shape[0] * self.shape[1], dtype=torch.bool, device=self.index.device)
        mask[self.index] = True
        return mask.reshape(self.shape)

    def dense(self) -> Tensor:
        """The dense ``(slow, fast)`` observed image, 0 outside the fitted pixels (made on each call)."""
        image = self.observed.new_zeros(self.shape[0] * self.shape[1])
        image[self.index] = self.observed
        return image.reshape(self.shape)

    def in_roi(self, roi: tuple[int, int, int, int]) -> tuple[Tensor, Tensor]:
        """``(positions, observed)`` of the pixels inside ``roi`` (x0, x1, y0, y1 inclusive), positions flat
        row-major in the ROI (the tensors themselves when the ROI is the whole detector)."""
        x0, x1, y0, y1 = roi
        ny, nx = self.shape
        if (x0, x1, y0, y1) == (0, nx - 1, 0, ny - 1):
            return self.index, self.observed
        rows = torch.div(self.index, nx, rounding_mode="floor")
        cols = self.index % nx
        inside = (rows >= y0) & (rows <= y1) & (cols >= x0) & (cols <= x1)
        return (rows[inside] - y0) * (x1 - x0 + 1) + (cols[inside] - x0), self.observed[inside]

    def digest(self) -> Tensor:
        """(20,) float64: the SHA-1 bytes of the shape, positions and photons (a checkpoint's image identity)."""
        h = hashlib.sha1(np.asarray(self.shape, dtype=np.int64).tobytes())
        h.update(self.index.detach().cpu().numpy().tobytes())
        h.update(self.observed.detach().to(torch.float64).cpu().numpy().tobytes())
        return torch.tensor(list(h.digest()), dtype=torch.float64)

    def store(self, path: str | os.PathLike[str]) -> "StoredPixels":
        """Write the pixels to ``path`` (``.npz``, written atomically) and return the handle that reads them."""
        path = Path(path)
        with atomic_output_path(path) as tmp:
            with open(tmp, "wb") as fh:
                np.savez(fh, format=np.array(_FORMAT), shape=np.asarray(self.shape, dtype=np.int64),
                         index=self.index.cpu().numpy(), observed=self.observed.cpu().numpy(),
                         source=np.array(self.source))
        return StoredPixels(path, self.shape, self.n, self.source, self.observed.dtype, self.observed.device)


@dataclass(frozen=True)
class StoredPixels:
    """Fitted pixels kept in a file (:meth:`FittedPixels.store`); :meth:`load` reads them (nothing is held)."""

    path: Path
    shape: tuple[int, int]
    n: int
    source: str = ""
    dtype: torch.dtype = torch.float64
    device: torch.device | str = "cpu"

    nbytes = 0  # held in memory

    def load(self) -> FittedPixels:
        """The pixels, read from the file (one-line error when it is missing, damaged or changed)."""
        return load_pixels(self.path, expect=(self.shape, self.n)).to(self.dtype, self.device)


def load_pixels(path: str | os.PathLike[str], expect: tuple[tuple[int, int], int] | None = None) -> FittedPixels:
    """Read a :meth:`FittedPixels.store` file; ``expect``: the ``(shape, n)`` it must hold."""
    try:
        with np.load(path, allow_pickle=False) as f:
            if str(f["format"]) != _FORMAT:
                raise ValueError(f"not a fitted-pixels file (format {str(f['format'])!r})")
            shape = tuple(int(v) for v in f["shape"])
            index, observed, source = f["index"], f["observed"], str(f["source"])
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"fitted pixels {path}: cannot be read ({exc})") from None
    if expect is not None and (shape, int(index.size)) != (tuple(expect[0]), int(expect[1])):
        raise InputError(f"fitted pixels {path}: holds {index.size} pixels of a {shape} detector, expected "
                         f"{expect[1]} of {tuple(expect[0])} (changed since it was written)")
    return FittedPixels(shape, torch.from_numpy(index.astype(np.int64)), torch.from_numpy(observed), source)
