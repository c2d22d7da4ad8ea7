"""The per-pixel accumulation: the one copy of the diffraction physics.

``accumulate_pixels`` renders a tile of pixels.  The full image, a tiled
image, an ROI and a single pixel all go through it.

Loop structure (nanoBragg's, outermost first) for each pixel::

    layer t -> sub-pixel (subS, subF) -> source -> phi step -> mosaic domain

Every evaluation adds ``F_cell^2 F_latt^2``.  Shapes below: P pixels, T sensor
layers, S = oversample^2 sub-pixels, Q sources, Φ phi steps, M mosaic domains.

Scaling (photons per pixel)::

    spec:     r_e^2 fluence / steps * sum_{t,s,q} omega_ts P_tsq capture_ts sum_{phi,m} F^2 L^2
              + water (linear in fluence, independent of sampling)
    C parity: r_e^2 fluence / steps * (I_bg + sum F^2 L^2) * capture * P * omega
              with omega and P taken at the first sub-pixel/source, capture of the
              last layer, and the ``-oversample_*`` running-sum quirks

with ``steps = Q Φ M oversample^2`` (layers are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nbtorch.physics.lattice import lattice_factor_components, nearest_index
from nbtorch.physics.polarization import kahn_polarization
from nbtorch.physics.structure import (
    interpolation_safe,
    nearest_structure_factor,
    structure_factor,
    tricubic_structure_factor,
)

R_E_SQR = 7.94079248018965e-30  # Thomson cross-section r_e^2 (m^2)


@dataclass(frozen=True)
class KernelOptions:
    """Static (graph-shaping) options of the kernel; never tensors."""

    shape: str = "square"
    interpolate: bool = False
    nopolar: bool = False
    point_pixel: bool = False
    curved: bool = False
    c_parity: bool = False
    oversample_thick: bool = False
    oversample_polar: bool = False
    oversample_omega: bool = False
    has_thickness: bool = False
    has_water: bool = False
    use_dmin: bool = False

    @property
    def running_sum_quirk(self) -> bool:
        return self.c_parity and (self.oversample_thick or self.oversample_polar or self.oversample_omega)


@dataclass(frozen=True)
class KernelInputs:
    """Tensors the kernel needs besides the pixel positions (units in the names)."""

    incident: Tensor  # (Q, 3) unit vectors source -> sample
    wavelength_A: Tensor  # (Q,)
    real_A: Tensor  # (Φ, M, 3, 3) rows a, b, c per phi step and mosaic domain (Angstrom)
    recip_per_A: Tensor  # (3, 3) static reciprocal basis (1/A) for gauss/tophat
    n_cells: Tensor  # (3,)
    fudge: Tensor  # ()
    F_grid: Tensor | None  # (nh, nk, nl) or None
    hkl_min: Tensor | None  # (3,)
    hkl_max: Tensor | None  # (3,)
    default_F: Tensor  # ()
    polar_axis: Tensor  # (3,)
    kahn: Tensor  # ()
    odet: Tensor  # (3,)
    close_distance_m: Tensor  # ()
    pixel_m: Tensor  # ()
    mu_per_m: Tensor  # () sensor attenuation coefficient
    layer_thickness_m: Tensor  # () thickness of one sensor layer
    dmin_A: Tensor  # ()
    fluence: Tensor  # () photons/m^2
    steps: Tensor  # () normalisation count
    water_F2N: Tensor  # () F_bg^2 * number of water molecules


def _norm(v: Tensor) -> Tensor:
    return torch.linalg.vector_norm(v, dim=-1)


def accumulate_pixels(
    pos_m: Tensor,
    inp: KernelInputs,
    opt: KernelOptions,
    structure_mode: Tensor | None = None,
    real_first_A: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Photons per pixel for a tile of pixels.

    Arguments:
        pos_m: (P, T, S, 3) sub-pixel positions (m) from the sample.
        inp: tensors (see :class:`KernelInputs`).
        opt: static options (see :class:`KernelOptions`).
        structure_mode: optional int tensor broadcastable to (P, T, S, Q, Φ, M):
            0 nearest, 1 tricubic, 2 default_F (C-parity interpolation switch-off).
        real_first_A: optional (Φ, M, 3, 3) crystal vectors for the very first
            evaluation of pixel 0 (first layer, sub-pixel and valid source): the C
            program's first evaluation still sees the un-rotated phi=0 vectors.

    Returns:
        ``(image (P,), diagnostics)``; diagnostics hold tensors
        ``n_eval``, ``n_default_F`` (lookups that fell outside the table),
        ``hkl0_min`` and ``hkl0_max`` (3,) over the tile.
    """
    dtype = pos_m.dtype
    P, T, S, _ = pos_m.shape
    airpath = _norm(pos_m)  # (P, T, S)
    diffracted = pos_m / airpath[..., None]

    # --- solid angle and obliquity -------------------------------------------------
    if opt.point_pixel:
        omega = 1.0 / (airpath * airpath)
    elif opt.c_parity:
        omega = inp.pixel_m**2 / (airpath * airpath) * inp.close_distance_m / airpath
    elif opt.curved:
        omega = inp.pixel_m**2 / (airpath * airpath)
    else:
        omega = inp.pixel_m**2 / (airpath * airpath) * torch.abs((diffracted * inp.odet).sum(-1))

    # --- sensor capture fraction per layer -----------------------------------------
    if opt.has_thickness:
        parallax = (diffracted * inp.odet).sum(-1)
        t_idx = torch.arange(T, dtype=dtype, device=pos_m.device)[None, :, None]
        dz = inp.layer_thickness_m * inp.mu_per_m / parallax
        capture = torch.exp(-t_idx * dz) - torch.exp(-(t_idx + 1.0) * dz)
    else:
        capture = torch.ones_like(airpath)

    # --- scattering vectors per source -----------------------------------------------
    inc = inp.incident  # (Q, 3)
    lam = inp.wavelength_A  # (Q,)
    scatter = (diffracted[..., None, :] - inc) / lam[:, None]  # (P, T, S, Q, 3) 1/A
    if opt.use_dmin:
        stol = 0.5 * _norm(scatter)
        valid = ~((stol > 0) & (inp.dmin_A * stol > 0.5))
    else:
        valid = torch.ones(scatter.shape[:-1], dtype=torch.bool, device=pos_m.device)

    if opt.nopolar:
        polar = torch.ones(scatter.shape[:-1], dtype=dtype, device=pos_m.device)
    else:
        polar = kahn_polarization(inc, diffracted[..., None, :], inp.polar_axis, inp.kahn)  # (P,T,S,Q)

    # --- Miller indices for every phi step and mosaic domain -------------------------
    # Layout (Φ, M, T, S, Q, P): the pixel axis is innermost, so a compiler vectorises
    # along pixels and reduces over the orientations in registers.
    real = inp.real_A  # (Φ, M, 3, 3)
    Q = scatter.shape[3]
    sc = scatter.permute(1, 2, 3, 0, 4)  # (T, S, Q, P, 3)
    valid_l = valid.permute(1, 2, 3, 0)  # (T, S, Q, P)
    h, k, l = _miller_indices(sc, real)  # each (Φ, M, T, S, Q, P)
    if real_first_A is not None:
        # replace the evaluation at (pixel 0, layer 0, sub-pixel 0, first valid source); no
        # data-dependent indexing, so the kernel still compiles into one graph
        q = torch.argmax(valid[0, 0, 0].to(torch.int8))
        first = _miller_indices(scatter[0, 0, 0], real_first_A)  # each (Φ, M, Q)
        dev = pos_m.device
        at = (
            (torch.arange(T, device=dev) == 0)[:, None, None, None]
            & (torch.arange(S, device=dev) == 0)[None, :, None, None]
            & (torch.arange(Q, device=dev) == q)[None, None, :, None]
            & (torch.arange(P, device=dev) == 0)[None, None, None, :]
        )
        h, k, l = (torch.where(at, f[:, :, None, None, :, None], x) for f, x in zip(first, (h, k, l)))
    hkl = (h, k, l)
    hkl0 = tuple(nearest_index(x) for x in hkl)

    f_latt = lattice_factor_components(hkl, hkl0, inp.n_cells, opt.shape, inp.recip_per_A, inp.fudge)
    if structure_mode is None:
        f_cell = structure_factor(
            hkl, hkl0, inp.F_grid, inp.hkl_min, inp.hkl_max, inp.default_F, opt.interpolate
        )
    else:
        mode = structure_mode.permute(4, 5, 1, 2, 3, 0) if structure_mode.dim() == 6 else structure_mode
        near = nearest_structure_factor(hkl0, inp.F_grid, inp.hkl_min, inp.hkl_max, inp.default_F)
        tri = tricubic_structure_factor(hkl, inp.F_grid, inp.hkl_min)
        f_cell = torch.where(mode == 1, tri, torch.where(mode == 2, inp.default_F, near))
    term = (f_cell * f_latt) ** 2  # (Φ, M, T, S, Q, P)
    if opt.use_dmin:
        term = torch.where(valid_l, term, torch.zeros_like(term))
    valid6 = valid_l

    scale = R_E_SQR * inp.fluence / inp.steps
    water_c = R_E_SQR * inp.fluence * inp.water_F2N if opt.has_water else None

    if not opt.c_parity:
        weight = (omega * capture)[..., None] * polar  # (P, T, S, Q)
        # one reduced axis, summed in order: the same bits whatever the tile size
        summed = term.reshape(-1, T, S, Q, P).sum(0).permute(3, 0, 1, 2)  # (P, T, S, Q)
        image = scale * (summed * weight).sum((1, 2, 3))
        if opt.has_water:
            image = image + R_E_SQR * inp.fluence * inp.water_F2N * weight.mean((2, 3)).sum(1)
    else:
        image = _c_parity_sum(term, valid, omega, capture, polar, f_latt, water_c, scale, opt)

    diag = _diagnostics(hkl0, valid6, inp)
    return image, diag


def _miller_indices(scatter: Tensor, real: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``h_i = a_i . S`` for every phi/mosaic orientation: (..., 3) x (Φ, M, 3, 3) -> 3 x (Φ, M, ...).

    Written as broadcast multiply-adds on separate components (no matmul, no
    trailing axis of 3) so a compiler fuses and vectorises it together with the
    lattice factor and the reduction instead of materialising it.
    """
    extra = scatter.dim() - 1
    sx, sy, sz = (scatter[..., j] for j in range(3))
    out = []
    for i in range(3):
        a = [real[..., i, j].reshape(real.shape[:2] + (1,) * extra) for j in range(3)]
        out.append(sx * a[0] + sy * a[1] + sz * a[2])
    return tuple(out)


def _first_valid(values: Tensor, valid: Tensor) -> Tensor:
    """Per pixel, the value at the first valid (t, s, q) in C loop order; 0 if none."""
    P = values.shape[0]
    v = values.reshape(P, -1)
    m = valid.reshape(P, -1)
    idx = torch.argmax(m.to(torch.int8), dim=1)
    first = v.gather(1, idx[:, None])[:, 0]
    return torch.where(m.any(1), first, torch.zeros_like(first))


def _c_parity_sum(term, valid, omega, capture, polar, f_latt, water_c, scale, opt: KernelOptions) -> Tensor:
    """nanoBragg's per-pixel accumulation, quirks included (see module docstring).

    ``term`` and ``f_latt`` come in the kernel's layout (Φ, M, T, S, Q, P).
    """
    P = term.shape[-1]
    I_bg = water_c if water_c is not None else torch.zeros((), dtype=term.dtype, device=term.device)
    omega_q = omega[..., None].expand_as(polar)
    capture_q = capture[..., None].expand_as(polar)
    polar_first = polar.new_ones(P) if opt.nopolar else _first_valid(polar, valid)
    omega_first = omega[:, 0, 0]
    capture_last = capture[:, -1, 0]
    if not opt.running_sum_quirk:
        total = I_bg + term.reshape(-1, term.shape[-1]).sum(0)
        return scale * total * capture_last * polar_first * omega_first
    term = term.permute(5, 2, 3, 4, 0, 1)  # (P, T, S, Q, Φ, M): the C's loop order per pixel
    f_latt = f_latt.permute(5, 2, 3, 4, 0, 1)
    # running sum: I = (I + t_k) * g_k for every evaluation k, in loop order
    g = torch.ones_like(polar)
    if opt.oversample_thick:
        g = g * capture_q
    if opt.oversample_polar:
        g = g * polar
    if opt.oversample_omega:
        g = g * omega_q
    g = g[..., None, None].expand_as(term)
    counted = valid[..., None, None].expand_as(term)
    if water_c is None:
        counted = counted & (f_latt != 0)
    g = torch.where(counted, g, torch.ones_like(g)).reshape(P, -1)
    t = term.reshape(P, -1)
    suffix = torch.flip(torch.cumprod(torch.flip(g, (1,)), 1), (1,))
    total = I_bg * suffix[:, 0] + (t * suffix).sum(1)
    out = scale * total
    if not opt.oversample_thick:
        out = out * capture_last
    if not opt.oversample_polar:
        out = out * polar_first
    if not opt.oversample_omega:
        out = out * omega_first
    return out


def _diagnostics(hkl0: tuple[Tensor, Tensor, Tensor], valid6: Tensor, inp: KernelInputs) -> dict[str, Tensor]:
    with torch.no_grad():
        h0 = hkl0[0]
        n_eval = torch.tensor(float(h0.numel()), dtype=torch.float64, device=h0.device)
        if inp.F_grid is None:
            outside = n_eval
        else:
            inside = None
            for x, lo, hi in zip(hkl0, inp.hkl_min.unbind(-1), inp.hkl_max.unbind(-1)):
                ok = (x >= lo) & (x <= hi)
                inside = ok if inside is None else inside & ok
            outside = (~inside).sum().to(torch.float64)
        return {
            "n_eval": n_eval,
            "n_default_F": outside,
            "hkl0_min": torch.stack([x.amin() for x in hkl0]),
            "hkl0_max": torch.stack([x.amax() for x in hkl0]),
        }
