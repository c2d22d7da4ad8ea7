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
    s = sim.setup
    opt = sim.options
    if opt.curved or opt.running_sum_quirk or opt.interpolate:
        raise NotImplementedError("the reference loop covers the flat detector without -oversample_* quirks or interpolation")
    with torch.no_grad():
        p = sim.parameters_dict(**overrides)
        g = sim.geometry(p)
        real_A, recip = sim.crystal(p)
    tolist = lambda t: t.double().cpu().tolist()  # noqa: E731
    pix0, f, sv, o = tolist(g.pix0), tolist(g.fdet), tolist(g.sdet), tolist(g.odet)
    close = float(g.close_distance)
    real = tolist(real_A)  # [phi][mos][row][col]
    rec = tolist(recip)
    incident = [[float(x) for x in row] for row in s.incident.tolist()]
    lam = [float(p["wavelength"]) * w for w in s.wavelength_factor.tolist()]
    N = [float(p["N_a"]), float(p["N_b"]), float(p["N_c"])]
    default_F = float(p["default_F"])
    kahn = float(p["polarization"])
    fluence = float(p["fluence"])
    polar_axis = s.polar_axis.tolist()
    grid = None if sim.F_grid is None else sim.F_grid.double().cpu().numpy()
    lo = None if s.hkl_min is None else [int(v) for v in s.hkl_min]
    hi = None if s.hkl_max is None else [int(v) for v in s.hkl_max]
    pixel, os_ = s.pixel_m, s.oversample
    sub = pixel / os_
    dz, mu, T = s.layer_thickness_m, s.mu_per_m, s.thicksteps
    water = R_E_SQR * fluence * s.water_F2N

    def f_cell(h0, k0, l0):
        if grid is None:
            return default_F
        if lo[0] <= h0 <= hi[0] and lo[1] <= k0 <= hi[1] and lo[2] <= l0 <= hi[2]:
            return float(grid[h0 - lo[0], k0 - lo[1], l0 - lo[2]])
        return default_F

    total = 0.0 if not s.c_parity else water
    omega_first = polar_first = capture_last = None
    spec_sum = 0.0
    spec_water = 0.0
    for t in range(T):
        capture_layer = None
        for ss in range(os_):
            for ff in range(os_):
                fd = sub * (fast * os_ + ff) + sub / 2
                sd = sub * (slow * os_ + ss) + sub / 2
                pos = [pix0[i] + fd * f[i] + sd * sv[i] + t * dz * o[i] for i in range(3)]
                d, R = _unit(pos)
                if opt.point_pixel:
                    omega = 1 / (R * R)
                elif s.c_parity:
                    omega = pixel * pixel / (R * R) * close / R
                else:
                    omega = pixel * pixel / (R * R) * abs(_dot(d, o))
                if opt.has_thickness:
                    rho = _dot(d, o)
                    capture = math.exp(-t * dz * mu / rho) - math.exp(-(t + 1) * dz * mu / rho)
                else:
                    capture = 1.0
                if omega_first is None:
                    omega_first = omega
                if capture_layer is None:
                    capture_layer = capture
                for q, inc in enumerate(incident):
                    S = [(d[i] - inc[i]) / lam[q] for i in range(3)]
                    stol = 0.5 * math.sqrt(_dot(S, S))
                    pol = 1.0 if opt.nopolar else _polar(kahn, inc, d, polar_axis)
                    spec_water += omega * capture * pol
                    if opt.use_dmin and stol > 0 and s.dmin_A * stol > 0.5:
                        continue
                    if polar_first is None:
                        polar_first = pol
                    acc = 0.0
                    for per_phi in real:
                        for A in per_phi:
                            hkl = [_dot(A[i], S) for i in range(3)]
                            h0 = [math.ceil(x - 0.5) for x in hkl]
                            if opt.shape == "square":
                                L = 1.0
                                for i in range(3):
                                    L *= _sincg(math.pi * (hkl[i] - h0[i]), N[i]) if N[i] > 1 else 1.0
                            else:
                                nnn = N[0] * N[1] * N[2]
                                dh = [hkl[i] - h0[i] for i in range(3)]
                                if opt.shape == "round":
                                    hrad = sum(dh[i] * dh[i] * N[i] * N[i] for i in range(3))
                                    L = nnn * 0.723601254558268 * _sinc3(math.pi * math.sqrt(hrad * float(s.fudge)))
                                else:
                                    v = [sum(dh[i] * rec[i][j] for i in range(3)) for j in range(3)]
                                    rad = _dot(v, v) * nnn * nnn
                                    if opt.shape == "gauss":
                                        L = nnn * math.exp(-rad / 0.63 * float(s.fudge))
                                    else:
                                        L = nnn * (1.0 if rad * float(s.fudge) < 0.3969 else 0.0)
                            F = f_cell(*h0)
                            acc += (F * L) ** 2
                    total += acc
                    spec_sum += acc * omega * capture * pol
        capture_last = capture_layer
    steps = s.steps
    if s.c_parity:
        pol = 1.0 if opt.nopolar else (polar_first if polar_first is not None else 0.0)
        return R_E_SQR * fluence * total / steps * capture_last * pol * omega_first
    value = R_E_SQR * fluence * spec_sum / steps
    if opt.has_water:
        value += water * spec_water / (os_ * os_ * len(incident))
    return value
