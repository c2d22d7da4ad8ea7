"""A slow, obviously correct reference: nanoBragg's inner loop in plain Python.

One pixel at a time, one evaluation at a time, with ``math`` and lists — no
tensors, no vectorisation.  It exists to test the vectorised kernel
(:mod:`nbtorch.physics.kernel`) on tiny inputs, in both modes; it reads the
same resolved geometry (detector vectors, crystal vectors per phi step and
mosaic domain, sources) from a :class:`~nbtorch.Simulator`, so the two share
only the set-up, never the per-pixel physics.

Use it on a handful of pixels: it costs microseconds per evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nbtorch.physics.kernel import R_E_SQR


def _dot(a, b):
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


def _cross(a, b):
    return [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]


def _unit(a):
    n = math.sqrt(_dot(a, a))
    return [a[0] / n, a[1] / n, a[2] / n], n


def _sincg(x, n):
    return n if x == 0 else math.sin(n * x) / math.sin(x)


def _sinc3(x):
    return 1.0 if x == 0 else 3.0 * (math.sin(x) / x - math.cos(x)) / (x * x)


def _polar(kahn, incident, diffracted, axis):
    cos2t = _dot(incident, diffracted)
    if kahn == 0:
        psi = 0.0
    else:
        b_in, _ = _unit(_cross(axis, incident))
        e_in, _ = _unit(_cross(incident, b_in))
        psi = -math.atan2(_dot(diffracted, b_in), _dot(diffracted, e_in))
    return 0.5 * (1.0 + cos2t * cos2t - kahn * math.cos(2 * psi) * (1 - cos2t * cos2t))


def reference_pixel(sim, fast: int, slow: int, **overrides) -> float:
    """Photons in pixel (slow, fast) computed by explicit loops (C loop order).

    Supports the square/round/gauss/tophat shapes, default_F or an HKL table
    (nearest neighbour; tricubic is tested separately), sources, phi, mosaic,
    oversampling, sensor layers, polarization, water, dmin, point pixel and the
    flat detector, in spec and C-parity modes.  ``-oversample_*`` quirks and the
    curved detector are not covered.
    """
    opt = sim.options
    if opt.curved or opt.running_sum_quirk or opt.interpolate:
        raise NotImplementedError("the reference loop covers the flat detector without -oversample_* quirks or interpolation")
    r = _inputs(sim, overrides)
    s = r.s
    total = 0.0 if not s.c_parity else r.water
    omega_first = polar_first = capture_last = None
    spec_sum = 0.0
    spec_water = 0.0
    for t in range(s.thicksteps):
        capture_layer = None
        for ss in range(r.os_):
            for ff in range(r.os_):
                d, omega, capture = _subpixel(r, fast, slow, t, ss, ff)
                if omega_first is None:
                    omega_first = omega
                if capture_layer is None:
                    capture_layer = capture
                for q, inc in enumerate(r.incident):
                    S = [(d[i] - inc[i]) / r.lam[q] for i in range(3)]
                    stol = 0.5 * math.sqrt(_dot(S, S))
                    pol = 1.0 if opt.nopolar else _polar(r.kahn, inc, d, r.polar_axis)
                    spec_water += omega * capture * pol
                    if opt.use_dmin and stol > 0 and s.dmin_A * stol > 0.5:
                        continue
                    if polar_first is None:
                        polar_first = pol
                    acc = _orientation_sum(r, S)
                    total += acc
                    spec_sum += acc * omega * capture * pol
        capture_last = capture_layer
    steps = s.steps
    if s.c_parity:
        pol = 1.0 if opt.nopolar else (polar_first if polar_first is not None else 0.0)
        return R_E_SQR * r.fluence * total / steps * capture_last * pol * omega_first
    value = R_E_SQR * r.fluence * spec_sum / steps
    if opt.has_water:
        value += r.water * spec_water / (r.os_ * r.os_ * len(r.incident))
    return value


@dataclass(frozen=True)
class _Inputs:
    """The resolved set-up as Python floats and lists (see :func:`_inputs`)."""

    s: object
    opt: object
    pix0: list
    f: list
    sv: list
    o: list
    close: float
    real: list
    rec: list
    incident: list
    lam: list
    N: list
    default_F: float
    kahn: float
    fluence: float
    polar_axis: list
    grid: object
    lo: list | None
    hi: list | None
    pixel: float
    os_: int
    sub: float
    dz: float
    mu: float
    water: float


def _inputs(sim, overrides: dict) -> _Inputs:
    """The resolved geometry, crystal, sources and parameters as Python floats and lists."""
    s = sim.setup
    with torch.no_grad():
        p = sim.parameters_dict(**overrides)
        g = sim.geometry(p)
        real_A, recip = sim.crystal(p)
        incident, lam = sim.sources(p)
    tolist = lambda t: t.double().cpu().tolist()  # noqa: E731
    fluence = float(p["fluence"])
    return _Inputs(
        s=s, opt=sim.options,
        pix0=tolist(g.pix0), f=tolist(g.fdet), sv=tolist(g.sdet), o=tolist(g.odet),
        close=float(g.close_distance),
        real=tolist(real_A),  # [phi][mos][row][col]
        rec=tolist(recip),
        incident=tolist(incident),
        lam=tolist(lam),
        N=[float(p["N_a"]), float(p["N_b"]), float(p["N_c"])],
        default_F=float(p["default_F"]), kahn=float(p["polarization"]), fluence=fluence,
        polar_axis=s.polar_axis.tolist(),
        grid=None if sim.F_grid is None else sim.F_grid.double().cpu().numpy(),
        lo=None if s.hkl_min is None else [int(v) for v in s.hkl_min],
        hi=None if s.hkl_max is None else [int(v) for v in s.hkl_max],
        pixel=s.pixel_m, os_=s.oversample, sub=s.pixel_m / s.oversample,
        dz=s.layer_thickness_m, mu=s.mu_per_m,
        water=R_E_SQR * fluence * s.water_F2N,
    )


def _subpixel(r: _Inputs, fast: int, slow: int, t: int, ss: int, ff: int):
    """``(direction, omega, capture)`` of sub-pixel (ss, ff) of layer ``t``."""
    s, opt, sub, os_ = r.s, r.opt, r.sub, r.os_
    fd = sub * (fast * os_ + ff) + sub / 2
    sd = sub * (slow * os_ + ss) + sub / 2
    pos = [r.pix0[i] + fd * r.f[i] + sd * r.sv[i] + t * r.dz * r.o[i] for i in range(3)]
    d, R = _unit(pos)
    if opt.point_pixel:
        omega = 1 / (R * R)
    elif s.c_parity:
        omega = r.pixel * r.pixel / (R * R) * r.close / R
    else:
        omega = r.pixel * r.pixel / (R * R) * abs(_dot(d, r.o))
    if opt.has_thickness:
        rho = _dot(d, r.o)
        capture = math.exp(-t * r.dz * r.mu / rho) - math.exp(-(t + 1) * r.dz * r.mu / rho)
    else:
        capture = 1.0
    return d, omega, capture


def _f_cell(r: _Inputs, h0, k0, l0) -> float:
    if r.grid is None:
        return r.default_F
    lo, hi = r.lo, r.hi
    if lo[0] <= h0 <= hi[0] and lo[1] <= k0 <= hi[1] and lo[2] <= l0 <= hi[2]:
        return float(r.grid[h0 - lo[0], k0 - lo[1], l0 - lo[2]])
    return r.default_F


def _lattice(r: _Inputs, hkl, h0) -> float:
    """F_latt of one evaluation for the crystal shape."""
    N, shape = r.N, r.opt.shape
    if shape == "square":
        L = 1.0
        for i in range(3):
            L *= _sincg(math.pi * (hkl[i] - h0[i]), N[i]) if N[i] > 1 else 1.0
        return L
    nnn = N[0] * N[1] * N[2]
    dh = [hkl[i] - h0[i] for i in range(3)]
    if shape == "round":
        hrad = sum(dh[i] * dh[i] * N[i] * N[i] for i in range(3))
        return nnn * 0.723601254558268 * _sinc3(math.pi * math.sqrt(hrad * float(r.s.fudge)))
    v = [sum(dh[i] * r.rec[i][j] for i in range(3)) for j in range(3)]
    rad = _dot(v, v) * nnn * nnn
    if shape == "gauss":
        return nnn * math.exp(-rad / 0.63 * float(r.s.fudge))
    return nnn * (1.0 if rad * float(r.s.fudge) < 0.3969 else 0.0)


def _orientation_sum(r: _Inputs, S) -> float:
    """sum of (F_cell F_latt)^2 over phi steps and mosaic domains for the scattering vector ``S``."""
    acc = 0.0
    for per_phi in r.real:
        for A in per_phi:
            hkl = [_dot(A[i], S) for i in range(3)]
            h0 = [math.ceil(x - 0.5) for x in hkl]
            L = _lattice(r, hkl, h0)
            F = _f_cell(r, *h0)
            acc += (F * L) ** 2
    return acc
