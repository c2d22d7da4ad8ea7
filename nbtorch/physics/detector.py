"""Detector geometry: bases, pivots, pix0 and pixel positions.

Frame: lab frame of the convention (MOSFLM: beam along +x; XDS/DIALS/ADXV:
beam along +z; CUSTOM: user vectors).  Lengths in metres, angles in radians.

* ``f``, ``s``, ``o``: unit vectors of increasing fast and slow pixel index and
  the detector normal (sample -> detector);
* ``pix0``: vector from the sample to the **corner** of pixel (0, 0) (not its
  centre); the centre of pixel (slow j, fast i) is at
  ``pix0 + (i + 1/2) p f + (j + 1/2) p s``;
* ``Fbeam, Sbeam``: where the direct beam meets the detector, along f and s
  from pix0 (BEAM pivot); ``Fclose, Sclose``: the foot of the perpendicular from
  the sample (SAMPLE pivot); ``close_distance``: sample-to-plane distance.

Several panels (``nbtorch.geometry.panels``): each panel's geometry is this module's
:func:`detector_geometry` of its own values; :func:`stack_geometries` puts the N panels'
geometries on a leading axis ((N, 3) vectors, (N,) scalars) and :func:`pixel_geometry` gathers
each pixel's panel into the kernel's per-pixel layout: vectors (3, P) (component first, so
``geom.pix0[c]`` is a (P,) row that broadcasts against the (S, P) sub-pixel offsets exactly as a
single panel's scalar does), scalars (P,).  The same elementwise operations then give each pixel
the bits of its single-panel render.

Rotations: the detector is rotated about lab X, Y, Z (``rotx, roty, rotz``)
and then about the two-theta axis.  BEAM pivot keeps the direct-beam spot
fixed on the detector; SAMPLE pivot rotates the detector origin with it.
``ratio = b . o'`` (o' rotated by rotx/y/z only, as the C does); ``close =
|ratio distance|`` and the beam distance is ``close / ratio``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nbtorch.physics.rotation import rotate_axis, rotation_matrix_xyz


@dataclass(frozen=True)
class DetectorGeometry:
    """Resolved detector geometry (all tensors, metres).

    One panel: the shapes below.  Stacked panels (:func:`stack_geometries`): a leading panel axis,
    (N, 3) and (N,).  Per pixel (:func:`pixel_geometry`): (3, P) and (P,).
    """

    pix0: Tensor  # (3,) sample -> corner of pixel (0, 0)
    fdet: Tensor  # (3,)
    sdet: Tensor  # (3,)
    odet: Tensor  # (3,)
    beam: Tensor  # (3,) unit propagation direction
    close_distance: Tensor  # () pix0 . odet
    distance: Tensor  # () close_distance / ratio (beam-path distance to the plane)
    Fbeam: Tensor  # () direct-beam spot along f from pix0
    Sbeam: Tensor  # ()
    Fclose: Tensor  # () foot of the normal along f from pix0
    Sclose: Tensor  # ()


_FIELDS = ("pix0", "fdet", "sdet", "odet", "beam", "close_distance", "distance", "Fbeam", "Sbeam", "Fclose", "Sclose")


def _unit(v: Tensor) -> Tensor:
    return v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)


def detector_geometry(
    fdet0: Tensor,
    sdet0: Tensor,
    odet0: Tensor,
    beam: Tensor,
    twotheta_axis: Tensor,
    pivot: str,
    distance: Tensor,
    Fbeam: Tensor,
    Sbeam: Tensor,
    Fclose: Tensor,
    Sclose: Tensor,
    rotx: Tensor,
    roty: Tensor,
    rotz: Tensor,
    twotheta: Tensor,
) -> DetectorGeometry:
    """Place and orient the detector (nanoBragg's pivot logic).

    Arguments:
        fdet0, sdet0, odet0, beam, twotheta_axis: (3,) unit vectors before rotation.
        pivot: ``"beam"`` (Fbeam/Sbeam fixed) or ``"sample"`` (Fclose/Sclose fixed).
        distance: sample to detector plane along the beam (m).
        Fbeam, Sbeam, Fclose, Sclose: beam spot / near point from pix0 (m).
        rotx, roty, rotz, twotheta: rotations (rad).

    Several panels at once: every argument may carry a leading panel axis ((N, 3) vectors, (N,) scalars,
    broadcast against each other); the result is then the stacked geometry (:func:`stack_geometries`' layout),
    each panel bit for bit its own call's (the same elementwise operations, 3-term sums and 3 x 3 products).
    """
    rot = rotation_matrix_xyz(rotx, roty, rotz).to(fdet0)
    f1, s1, o1 = _matvec(rot, fdet0), _matvec(rot, sdet0), _matvec(rot, odet0)
    ratio = (beam * o1).sum(-1)
    tiny = torch.finfo(ratio.dtype).tiny
    ratio = torch.where(ratio == 0, torch.full_like(ratio, tiny), ratio)
    close = torch.abs(ratio * distance)
    f = rotate_axis(f1, twotheta_axis, twotheta)
    s = rotate_axis(s1, twotheta_axis, twotheta)
    o = rotate_axis(o1, twotheta_axis, twotheta)
    if pivot == "sample":
        p0 = -_v(Fclose) * fdet0 - _v(Sclose) * sdet0 + _v(close) * odet0
        pix0 = rotate_axis(_matvec(rot, p0), twotheta_axis, twotheta)
    elif pivot == "beam":
        pix0 = -_v(Fbeam) * f - _v(Sbeam) * s + _v(close / ratio) * beam
    else:
        raise ValueError(f"pivot must be 'beam' or 'sample', not {pivot!r}")
    close_final = (pix0 * o).sum(-1)
    dist_final = close_final / ratio
    hit = _v(dist_final) * beam - pix0
    return DetectorGeometry(
        pix0=pix0,
        fdet=f,
        sdet=s,
        odet=o,
        beam=beam.expand_as(pix0),
        close_distance=close_final,
        distance=dist_final,
        Fbeam=(hit * f).sum(-1),
        Sbeam=(hit * s).sum(-1),
        Fclose=-(pix0 * f).sum(-1),
        Sclose=-(pix0 * s).sum(-1),
    )


def _v(x: Tensor) -> Tensor:
    """A scalar (or (N,) per panel) as a factor of (3,) (or (N, 3)) vectors: the same products either way."""
    return torch.as_tensor(x)[..., None]


def _matvec(rot: Tensor, v: Tensor) -> Tensor:
    """``rot @ v`` for (3, 3) @ (3,) or, per panel, (N, 3, 3) @ (N, 3) (equal bits: measured)."""
    return rot @ v if rot.dim() == 2 and v.dim() == 1 else (rot @ v[..., None])[..., 0]


def stack_geometries(geoms: list[DetectorGeometry]) -> DetectorGeometry:
    """The panels' geometries on a leading panel axis: every (3,) field (N, 3), every () field (N,)."""
    return DetectorGeometry(**{f: torch.stack([getattr(g, f) for g in geoms]) for f in _FIELDS})


def pixel_geometry(panels: DetectorGeometry, panel_index: Tensor) -> DetectorGeometry:
    """Each pixel's panel geometry from stacked panels (:func:`stack_geometries`) and the (P,) panel index of
    every pixel: vectors (3, P) (contiguous rows per component), scalars (P,).  Differentiable (a gather)."""
    out = {}
    for f in _FIELDS:
        v = getattr(panels, f)
        # vectors: one 1-d gather per component, stacked: (3, P) contiguous without a transposed copy of
        # (P, 3) or a gather along a strided axis (each several times slower on a CPU)
        out[f] = (torch.stack([v[:, c].contiguous().index_select(0, panel_index) for c in range(3)])
                  if v.dim() == 2 else v.index_select(0, panel_index))
    return DetectorGeometry(**out)


def subpixel_offsets(fast_index: Tensor, slow_index: Tensor, pixel_size: Tensor, oversample: int,
                     like: Tensor) -> tuple[Tensor, Tensor]:
    """Distances (m) along f and s from ``pix0`` to the centre of every sub-pixel.

    Returns ``(fd, sd)``, each (P, oversample**2) with ``like``'s dtype and device;
    sub-pixel order slow-major (subS, subF), the C loop order.  ``pixel_size``: () or, for pixels of
    panels of different pixel sizes, (P,).
    """
    dtype = like.dtype
    if pixel_size.dim() == 1:
        pixel_size = pixel_size[:, None]
    sub = torch.arange(oversample, dtype=dtype, device=like.device)
    sub_size = pixel_size / oversample
    fd = (fast_index.to(dtype)[:, None] * oversample + sub) * sub_size + sub_size / 2  # (P, os)
    sd = (slow_index.to(dtype)[:, None] * oversample + sub) * sub_size + sub_size / 2
    fd = fd[:, None, :].expand(-1, oversample, -1).reshape(fd.shape[0], -1)  # (P, os*os) subF fastest
    sd = sd[:, :, None].expand(-1, -1, oversample).reshape(sd.shape[0], -1)
    return fd, sd


def flat_subpixel_components(
    geom: DetectorGeometry, fast_index: Tensor, slow_index: Tensor, pixel_size: Tensor, oversample: int,
    layer_offsets: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`subpixel_positions` of a flat detector as three (T, S, P) component tensors (x, y, z).

    The same numbers, laid out with the pixel axis innermost and no trailing axis of
    3, so a compiler vectorises the per-pixel geometry along pixels.
    """
    fd, sd = subpixel_offsets(fast_index, slow_index, pixel_size, oversample, geom.pix0)
    fd, sd = fd.T, sd.T  # (S, P)
    return tuple(geom.pix0[c] + fd * geom.fdet[c] + sd * geom.sdet[c] + layer_offsets[:, None, None] * geom.odet[c]
                 for c in range(3))


def subpixel_positions(
    geom: DetectorGeometry,
    fast_index: Tensor,
    slow_index: Tensor,
    pixel_size: Tensor,
    oversample: int,
    layer_offsets: Tensor,
    curved: bool = False,
    c_parity: bool = False,
) -> Tensor:
    """Lab positions (m) of every sub-pixel of the given pixels.

    Arguments:
        fast_index, slow_index: (P,) integer pixel indices (any dtype).
        pixel_size: pixel edge (m).
        oversample: sub-pixels per pixel edge.
        layer_offsets: (T,) sensor-layer depths along the normal (m).
        curved: place sub-pixels on a sphere of radius ``distance`` (``-curved_det``).
        c_parity: for the curved detector, reproduce the C's construction
            (rotations by the lab y and z components of the flat position);
            otherwise arc lengths along f and s from the beam spot.

    Returns:
        (P, T, oversample**2, 3); sub-pixel order is slow-major (subS, subF),
        the C loop order.
    """
    fd, sd = subpixel_offsets(fast_index, slow_index, pixel_size, oversample, geom.pix0)
    flat = geom.pix0 + fd[..., None] * geom.fdet + sd[..., None] * geom.sdet  # (P, S, 3)
    if not curved:
        return flat[:, None] + layer_offsets[None, :, None, None] * geom.odet
    dist = geom.distance
    if c_parity:
        # the C curves the flat position (layer offset included) using its lab y, z components
        flat = flat[:, None] + layer_offsets[None, :, None, None] * geom.odet  # (P, T, S, 3)
        start = (dist * geom.beam).expand_as(flat)
        v = rotate_axis(start, geom.sdet, flat[..., 1] / dist)
        return rotate_axis(v, geom.fdet, flat[..., 2] / dist)
    b = geom.beam
    # true direct-beam intercept (geom.distance/Fbeam/Sbeam are the C's values, which
    # ignore two-theta): the sphere has the beam-path distance as its radius
    dist = (geom.pix0 * geom.odet).sum() / (b * geom.odet).sum()
    hit = dist * b - geom.pix0
    f_beam, s_beam = (hit * geom.fdet).sum(), (hit * geom.sdet).sum()
    axis_f = _unit(torch.linalg.cross(b, geom.fdet, dim=-1))
    axis_s = _unit(torch.linalg.cross(b, geom.sdet, dim=-1))
    start = (dist * b).expand(fd.shape + (3,))
    v = rotate_axis(start, axis_f, (fd - f_beam) / dist)
    pos = rotate_axis(v, axis_s, (sd - s_beam) / dist)  # (P, S, 3), |pos| = distance
    # sensor layers lie along the local normal, which points at the sample
    scale = 1.0 + layer_offsets / dist
    return pos[:, None] * scale[None, :, None, None]
