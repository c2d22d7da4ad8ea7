"""Gradient checks: autograd against central finite differences, on small ROIs of real images.

``python -m nbtorch.tools.gradcheck_report`` prints, for every canonical parameter
(and the structure-factor table ``F_grid``), the autograd derivative of a
fixed random weighting of an ROI of a simulated image, the finite-difference
derivative, their relative error and the image signal the check used::

    python -m nbtorch.tools.gradcheck_report                  # the 'mosaic' case (a few seconds)
    python -m nbtorch.tools.gradcheck_report --case all       # every case in CASES
    python -m nbtorch.tools.gradcheck_report --case xds_sample --roi-size 32

The exit status is 1 when a check fails, so the report can gate CI.  The
same machinery (:class:`GradientProbe`, :data:`PARAMS`, :data:`CASES`) drives
``tests/gradients``; ``docs/gradients.md`` explains what each derivative means.

How a check works
    1. A cheap preview of the whole detector (oversample 1, one mosaic domain,
       one phi step, same geometry) locates the Bragg spots; the ``roi_size``
       square window holding the most spots becomes the ROI (or a window
       centred on a given pixel, e.g. the direct beam).
    2. The ROI of the real simulation is rendered; its signal (spots above
       background, peak, background) is recorded so a check can refuse a
       trivial image.
    3. The scalar is ``L = sum(w * I_roi) / sum(w * I_roi at the base point)``
       with fixed random weights ``w`` in [0.5, 1.5): a translation of a spot
       inside the ROI changes ``L`` (an unweighted sum would hide it), and
       ``L = 1`` at the base point, so ``dL/dp`` is a relative sensitivity
       per unit of ``p``.
    4. ``dL/dp`` from one backward pass is compared with a Richardson-
       extrapolated central difference ``(4 D(s/2) - D(s)) / 3`` (truncation
       error O(s^4)).  The step starts at the per-parameter ``h`` of
       :data:`PARAMS` and goes down the ladder h/10, h/100, h/1000 until
       ``D(s)`` and ``D(s/2)`` agree to 1e-6: the image is only piecewise
       smooth (docs/gradients.md) and a step straddling a boundary shows up
       as a disagreement.

This module is diagnostics only: nothing in the simulator imports it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch import simulator as _simulator_module
from nbtorch.cli.args import config_from_args
from nbtorch.sampling.beam_sources import WIDTH_NAMES
from nbtorch.parameters import PARAMETER_NAMES
from nbtorch.simulator import Simulator
from nbtorch.tools.gradcheck_roi import Signal, choose_roi, find_spots, measure_signal

__all__ = [
    "ParamSpec", "PARAMS", "EXTRA_PARAMS", "ALL_PARAMS", "PROBED_NAMES", "ORIENTATION_DELTAS",
    "CELL_PARAMS", "GEOMETRY_PARAMS", "F_GRID_STEP", "Case", "CASES", "Signal", "ParamCheck",
    "FiniteDifference", "GradientProbe", "find_spots", "choose_roi", "measure_signal",
    "write_hkl_table", "build_simulator", "direct_beam_pixel", "main",
]


# --------------------------------------------------------------------------------------
# parameters: unit, finite-difference step, gradcheck input scale
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """How to probe one canonical parameter.

    ``step``: finite-difference step in the parameter's own unit, small compared
    with the scale on which the image changes (a Bragg spot moves by a fraction
    of its width) and large enough that round-off (~1e-16 / step) is negligible.
    ``scale``: the gradcheck input is ``x = value / scale`` (fluence is ~1e29
    photons/m^2; its input is in units of 1e28 so a step in x is meaningful).
    """

    name: str
    unit: str
    step: float
    scale: float = 1.0
    group: str = ""

    @property
    def eps(self) -> float:
        """gradcheck's step in units of the (rescaled) input."""
        return self.step / self.scale


def _specs() -> dict[str, ParamSpec]:
    rows = [
        ("cell_a", "A", 1e-4, 1.0, "cell"), ("cell_b", "A", 1e-4, 1.0, "cell"), ("cell_c", "A", 1e-4, 1.0, "cell"),
        ("cell_alpha", "deg", 1e-4, 1.0, "cell"), ("cell_beta", "deg", 1e-4, 1.0, "cell"),
        ("cell_gamma", "deg", 1e-4, 1.0, "cell"),
        ("misset_x", "deg", 1e-4, 1.0, "orientation"), ("misset_y", "deg", 1e-4, 1.0, "orientation"),
        ("misset_z", "deg", 1e-4, 1.0, "orientation"), ("phi0", "deg", 1e-4, 1.0, "orientation"),
        ("mosaic_spread", "deg", 1e-4, 1.0, "crystal"), ("mosaic_spread_a", "deg", 1e-4, 1.0, "crystal"),
        ("mosaic_spread_b", "deg", 1e-4, 1.0, "crystal"), ("mosaic_spread_c", "deg", 1e-4, 1.0, "crystal"),
        ("N_a", "cells", 1e-4, 1.0, "crystal"), ("N_b", "cells", 1e-4, 1.0, "crystal"),
        ("N_c", "cells", 1e-4, 1.0, "crystal"), ("N_d", "cells", 1e-4, 1.0, "crystal"),
        ("N_e", "cells", 1e-4, 1.0, "crystal"), ("N_f", "cells", 1e-4, 1.0, "crystal"),
        ("distance", "mm", 1e-4, 1.0, "geometry"), ("beam_x", "mm", 1e-5, 1.0, "geometry"),
        ("beam_y", "mm", 1e-5, 1.0, "geometry"),
        ("detector_rotx", "deg", 1e-4, 1.0, "geometry"), ("detector_roty", "deg", 1e-4, 1.0, "geometry"),
        ("detector_rotz", "deg", 1e-4, 1.0, "geometry"), ("twotheta", "deg", 1e-4, 1.0, "geometry"),
        ("wavelength", "A", 1e-6, 1.0, "beam"), ("fluence", "photons/m^2", 1e25, 1e28, "beam"),
        ("polarization", "Kahn", 1e-3, 1.0, "beam"),
        ("dispersion", "%", 1e-4, 1.0, "beam"), ("divergence_h", "mrad", 1e-4, 1.0, "beam"),
        ("divergence_v", "mrad", 1e-4, 1.0, "beam"), ("default_F", "electrons", 1e-2, 1.0, "beam"),
    ]
    return {r[0]: ParamSpec(*r) for r in rows}


PARAMS: dict[str, ParamSpec] = _specs()
assert tuple(PARAMS) == PARAMETER_NAMES
#: refinement helpers beside the canonical names (``Simulator`` overrides, 0 by default):
#: a small crystal rotation about lab x, y, z on top of the misset
ORIENTATION_DELTAS: tuple[str, ...] = tuple(getattr(_simulator_module, "ORIENTATION_DELTAS", ()))
EXTRA_PARAMS: dict[str, ParamSpec] = {n: ParamSpec(n, "deg", 1e-4, 1.0, "orientation") for n in ORIENTATION_DELTAS}
ALL_PARAMS: dict[str, ParamSpec] = {**PARAMS, **EXTRA_PARAMS}
PROBED_NAMES: tuple[str, ...] = tuple(ALL_PARAMS)
F_GRID_STEP = 1e-2  # electrons, for finite differences of one table entry
CELL_PARAMS = tuple(n for n, s in PARAMS.items() if s.group == "cell")
GEOMETRY_PARAMS = tuple(n for n, s in PARAMS.items() if s.group == "geometry")


# --------------------------------------------------------------------------------------
# cases: real nanoBragg set-ups (the golden reference geometries), small ROIs
# --------------------------------------------------------------------------------------
TRICLINIC = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1.0 -default_F 100 "
             "-distance 100 -detpixels 256 -pixel 0.1")


@dataclass(frozen=True)
class Case:
    """A simulation set-up for gradient checks.

    ``args``: nanoBragg flags.  ``hkl``: ``None`` or ``(index_range, missing_fraction)``:
    a deterministic P1 table with |h|,|k|,|l| <= index_range (F in [20, 80)) is written
    to a temporary file and passed with ``-hkl``.  ``center``: ``None`` (the window with
    the most spots), ``"beam"`` (centred on the direct-beam pixel) or ``(fast, slow)``.
    ``zero``: parameters whose derivative is exactly zero by construction in this
    case, with the reason (the checks then require exactly 0, not agreement).
    """

    name: str
    args: str
    description: str
    hkl: tuple[int, float] | None = None
    center: str | tuple[int, int] | None = None
    roi_size: int = 24
    zero: dict[str, str] = field(default_factory=dict)


_CASE_LIST = [
    Case("mosaic", TRICLINIC + " -mosaic 0.5 -mosaic_dom 4 -phi 10 -osc 0.3 -phisteps 2",
         "spec, triclinic + misset (golden 'mosaic' geometry), the even set of 4 domains of the C's law (spec "
         "mode's default model), 2 phi steps, square shape"),
    Case("mosaic_random", TRICLINIC + " -mosaic 0.5 -mosaic_dom 4 -mosaic_seed 12345 -phi 10 -osc 0.3 -phisteps 2",
         "spec, the 'mosaic' case with the C's random draw of 4 domains (-mosaic_seed)"),
    Case("c_parity", TRICLINIC + " -mosaic 0.5 -mosaic_dom 4 -mosaic_seed 12345 -phi 10 -osc 0.3 -phisteps 2"
         " -polar 0.5 -c_parity",
         "C parity (triclinic c*_z quirk, omega/polar at the first sub-pixel), Kahn 0.5"),
    Case("round", TRICLINIC + " -round_xtal -mosaic 0.3 -mosaic_dom 3 -mosaic_seed 7",
         "spec, -round_xtal (golden 'xtal_round' geometry)"),
    Case("gauss", TRICLINIC + " -gauss_xtal -mosaic 0.3 -mosaic_dom 3 -mosaic_seed 7",
         "spec, -gauss_xtal (golden 'xtal_gauss' geometry; broad spots: 32 px ROI)", roi_size=32),
    Case("anisotropic_N", TRICLINIC + " -Na 3 -Nb 5 -Nc 8 -mosaic 0.3 -mosaic_dom 3 -mosaic_seed 7 -polar 0.8",
         "spec, -Na 3 -Nb 5 -Nc 8 (golden 'xtal_anisotropic_N'), Kahn 0.8"),
    Case("hkl_nearest", TRICLINIC.replace("-default_F 100", "-default_F 40")
         + " -mosaic 0.3 -mosaic_dom 3 -mosaic_seed 7 -nointerpolate",
         "spec, -hkl table |hkl| <= 5 (10% missing), nearest-neighbour lookup, default_F 40 outside; "
         "ROI across the table edge", hkl=(5, 0.1), center=(108, 204)),
    Case("hkl_tricubic", TRICLINIC.replace("-default_F 100", "-default_F 40").replace("-N 5", "-N 2")
         + " -mosaic 0.3 -mosaic_dom 3 -mosaic_seed 7 -interpolate",
         "spec, -hkl table |hkl| <= 6 with tricubic interpolation, N 2, default_F 40 where the 4x4x4 "
         "stencil leaves the table; ROI across that edge", hkl=(6, 0.0), center=(140, 204)),
    Case("rotated_beam_pivot", TRICLINIC + " -detector_rotx 1 -detector_roty 2 -detector_rotz 3 -twotheta 4"
         " -pivot beam -mosaic 0.3 -mosaic_dom 3 -mosaic_seed 7 -polar 0.5",
         "spec, MOSFLM detector rotated 1/2/3 deg + two-theta 4 (BEAM pivot)"),
    Case("xds_sample", TRICLINIC + " -xds -ORGX 110.5 -ORGY 140.25 -phi 20 -detector_rotx 1 -detector_roty 2 "
         "-detector_rotz 3 -twotheta 4 -mosaic 0.3 -mosaic_dom 3 -mosaic_seed 7 -polar 0.5",
         "spec, XDS convention (SAMPLE pivot, ORGX/ORGY beam centre), rotated detector + two-theta"),
    Case("c_parity_sensor", TRICLINIC + " -c_parity -oversample 2 -oversample_omega -oversample_polar -polar 0.5 "
         "-detector_thick 100 -detector_abs 50 -thicksteps 2 -water 0.1 -mosaic 0.3 -mosaic_dom 2 -mosaic_seed 7",
         "C parity with the running-sum quirks (-oversample_omega/_polar), a 2-layer sensor and water"),
    Case("sources_curved", TRICLINIC + " -divergence 2 -divsteps 3 -dispersion 2 -dispsteps 2 -curved_det "
         "-mosaic 0.3 -mosaic_dom 2 -mosaic_seed 7 -polar 0.5",
         "spec, 9 divergence x 2 dispersion sources, curved detector",
         zero={n: "the spec curved detector is a sphere about the sample laid out from the beam spot, which "
                  "the BEAM pivot keeps: tilts about lab y and z (and two-theta about -z) leave it unchanged"
               for n in ("detector_roty", "detector_rotz", "twotheta")}),
    Case("direct_beam", "-cell 100 100 100 90 90 90 -N 5 -lambda 1.0 -default_F 100 -distance 100 "
         "-detpixels 128 -pixel 0.1 -Xbeam 6.4 -Ybeam 6.4 -oversample 1 -mosaic 0.3 -mosaic_dom 3 "
         "-mosaic_seed 7 -polar 0.5",
         "spec, cubic 90-degree cell, no misset, no rotations, the direct beam exactly on the centre of "
         "pixel (64, 64): h = k = l = 0 exactly there (sincg 0/0 in all three)",
         center="beam"),
    Case("gauss_aniso", TRICLINIC + " -gauss_aniso_xtal -Na 3 -Nb 5 -Nc 8 -Nd 1 -Ne -1.5 -Nf 0.8 -mosaic 0.3 "
         "-mosaic_dom 3 -mosaic_seed 7",
         "spec, -gauss_aniso_xtal: a Gaussian crystal with the size matrix N = [[3 1 0.8] [1 5 -1.5] "
         "[0.8 -1.5 8]] unit cells (all six sizes matter)"),
    Case("anisotropic_mosaic", TRICLINIC + " -mosaic 0.5 -mosaic_abc 0.3 0.5 0.8 -mosaic_dom 6 "
         "-phi 10 -osc 0.3 -phisteps 2",
         "spec, the 'mosaic' case with one spread per crystal axis (-mosaic_abc 0.3 0.5 0.8; the even set of 6 "
         "domains), 2 phi steps",
         zero={"mosaic_spread": "the anisotropic model uses mosaic_spread_a/b/c, not mosaic_spread"}),
]
_OFF_DIAGONAL_ZERO = {n: "the off-diagonal crystal sizes act only with -gauss_aniso_xtal" for n in ("N_d", "N_e", "N_f")}
_ISOTROPIC_ZERO = {n: "isotropic mosaic: mosaic_spread_a/b/c are used only with -mosaic_abc"
                   for n in ("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c")}


def _with_zeros(c: Case) -> Case:
    """A case with the names its model does not use expected to have an exactly zero gradient."""
    zero = dict(c.zero)
    if "-gauss_aniso_xtal" not in c.args.split():
        zero = {**_OFF_DIAGONAL_ZERO, **zero}
    if "-mosaic_abc" not in c.args:
        zero = {**_ISOTROPIC_ZERO, **zero}
    return replace(c, zero=zero)


CASES: dict[str, Case] = {c.name: _with_zeros(c) for c in _CASE_LIST}
DEFAULT_CASE = "mosaic"


def write_hkl_table(path: str, index_range: int, missing: float = 0.0, seed: int = 1) -> None:
    """A deterministic P1 table: every h, k, l in [-r, r] (minus a random ``missing`` fraction), F in [20, 80)."""
    rng = np.random.default_rng(seed)
    r = range(-index_range, index_range + 1)
    lines = []
    for h in r:
        for k in r:
            for l in r:
                F = rng.uniform(20.0, 80.0)
                if missing and rng.uniform() < missing and (h, k, l) != (index_range, index_range, index_range):
                    continue  # keep the corner so the grid bounds stay fixed
                lines.append(f"{h} {k} {l} {F:.4f}")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def build_simulator(case: Case, extra: Sequence[str] = (), dtype=torch.float64, compile: bool = False) -> Simulator:
    """The case's simulator, eager unless ``compile=True`` (gradcheck must never meet a compiled graph).

    The HKL table, if any, is written to a temporary file and read once.
    """
    argv = case.args.split() + list(extra)
    if case.hkl is None:
        return Simulator(config_from_args(argv), dtype=dtype, compile=compile)
    with tempfile.TemporaryDirectory(prefix="nbtorch_grad_") as tmp:
        path = os.path.join(tmp, "P1.hkl")
        write_hkl_table(path, *case.hkl)
        return Simulator(config_from_args(argv + ["-hkl", path]), dtype=dtype, compile=compile)


# --------------------------------------------------------------------------------------
# the probe
# --------------------------------------------------------------------------------------
RTOL = 1e-6  # autograd vs finite difference, relative ...
ATOL = 1e-9  # ... plus absolute, in units of L (= 1) per (rescaled) parameter unit
MIN_GRAD = 1e-7  # |dL/dx| below this counts as zero


@dataclass(frozen=True)
class ParamCheck:
    """One parameter's autograd derivative against a finite difference (of the normalised loss)."""

    name: str
    unit: str
    value: float
    autograd: float
    finite_difference: float
    step: float
    smooth: bool
    signal: Signal
    scale: float = 1.0

    @property
    def rel_error(self) -> float:
        denom = max(abs(self.finite_difference), abs(self.autograd))
        return 0.0 if denom == 0 else abs(self.autograd - self.finite_difference) / denom

    def ok(self, rtol: float = RTOL, atol: float = ATOL) -> bool:
        """Finite, non-zero, and equal to the finite difference (compared per rescaled unit)."""
        g, fd = self.autograd * self.scale, self.finite_difference * self.scale
        return math.isfinite(g) and abs(g) > MIN_GRAD and abs(g - fd) <= atol + rtol * abs(fd)


@dataclass(frozen=True)
class FiniteDifference:
    """A Richardson-extrapolated central difference and the step it used."""

    value: float
    step: float
    consistent: bool  # D(step) and D(step/2) agreed: no boundary straddled


LADDER = (1.0, 1e-1, 1e-2, 1e-3)
CONSISTENCY = 1e-6


def _ladder(f: Callable[[float], float], x0: float, h: float, ladder: Sequence[float] = LADDER,
            consistency: float = CONSISTENCY) -> FiniteDifference:
    best = None
    for factor in ladder:
        s = h * factor
        d1 = (f(x0 + s) - f(x0 - s)) / (2.0 * s)
        d2 = (f(x0 + s / 2) - f(x0 - s / 2)) / s
        value = (4.0 * d2 - d1) / 3.0
        gap = abs(d1 - d2)
        if gap <= consistency * abs(d2) + 1e-11:
            return FiniteDifference(value, s, True)
        if best is None or gap < best[0]:
            best = (gap, value, s)
    return FiniteDifference(best[1], best[2], False)


class GradientProbe:
    """A simulator, an ROI with Bragg spots, and a fixed random weighting of it.

    ``loss(**overrides)`` is ``sum(w * I_roi) / sum(w * I_roi(base))`` (1 at the base
    point); overrides are canonical parameter names (or ``F_grid``) as for
    :meth:`Simulator.forward`.
    """

    def __init__(self, sim: Simulator, roi: tuple[int, int, int, int] | None = None, roi_size: int = 24,
                 center: tuple[int, int] | None = None, preview: Simulator | None = None,
                 n_outputs: int = 3, seed: int = 0) -> None:
        self.sim = sim
        self.dtype = sim.dtype
        if roi is None:
            with torch.no_grad():
                full = (preview or sim)().detach()
            roi = choose_roi(full, roi_size, center)
        self.roi = tuple(int(v) for v in roi)
        with torch.no_grad():
            image = self.render().detach()
        self.image = image
        self.signal = measure_signal(image, self.roi)
        gen = torch.Generator().manual_seed(seed)
        w = 0.5 + torch.rand((n_outputs,) + tuple(image.shape), generator=gen, dtype=torch.float64)
        self.weights = w.to(self.dtype)
        self.norms = (self.weights * image).sum((1, 2)).detach()
        self.base = {name: float(getattr(sim, name)) for name in PROBED_NAMES}
        #: the names this simulator can move: a beam width without spread (one source along it) cannot change
        self.names = tuple(n for n in PROBED_NAMES if n not in WIDTH_NAMES or n in sim.source_width_names())

    # ---- construction from a case ---------------------------------------------------
    @classmethod
    def from_case(cls, case: Case | str, roi_size: int | None = None, dtype=torch.float64, **kw
                  ) -> "GradientProbe":
        case = CASES[case] if isinstance(case, str) else case
        roi_size = roi_size or case.roi_size
        sim = build_simulator(case, dtype=dtype)
        center = None
        if case.center == "beam":
            center = direct_beam_pixel(sim)
        elif case.center is not None:
            center = case.center
        preview = None
        if center is None:
            preview = build_simulator(case, ["-oversample", "1", "-mosaic_dom", "1", "-phisteps", "1"], dtype=dtype)
        probe = cls(sim, roi_size=roi_size, center=center, preview=preview, **kw)
        probe.case = case
        return probe

    # ---- evaluation -----------------------------------------------------------------
    def render(self, **overrides) -> Tensor:
        """ROI image (slow, fast) in photons."""
        return self.sim.render(roi=self.roi, **overrides)[0]

    def outputs(self, **overrides) -> Tensor:
        """(n_outputs,) normalised weighted sums of the ROI (all 1 at the base point)."""
        img = self.render(**overrides)
        return (self.weights * img).sum((1, 2)) / self.norms

    def loss(self, **overrides) -> Tensor:
        """The first weighted sum, normalised: a scalar, 1 at the base point."""
        img = self.render(**overrides)
        return (self.weights[0] * img).sum() / self.norms[0]

    def tensor(self, value: float, requires_grad: bool = False) -> Tensor:
        return torch.tensor(value, dtype=self.dtype, requires_grad=requires_grad)

    def point(self, at: dict[str, float] | None = None) -> dict[str, float]:
        p = dict(self.base)
        p.update(at or {})
        return p

    def autograd(self, names: Iterable[str] = PROBED_NAMES, at: dict[str, float] | None = None,
                 ) -> dict[str, float]:
        """dL/dp for every name in one backward pass, at the base point updated by ``at``."""
        names = list(names)
        point = self.point(at)
        xs = {n: self.tensor(point[n], requires_grad=n in names) for n in point if n in names or n in (at or {})}
        loss = self.loss(**xs)
        grads = torch.autograd.grad(loss, [xs[n] for n in names], allow_unused=True)
        return {n: (0.0 if g is None else float(g)) for n, g in zip(names, grads)}

    def finite_difference(self, name: str, step: float | None = None, at: dict[str, float] | None = None
                          ) -> "FiniteDifference":
        """Central difference of L in ``name``, Richardson-extrapolated, on a step ladder.

        The image is only piecewise smooth (docs/gradients.md): a step can straddle a
        half-integer Miller index (kink or jump) or a nearest-neighbour F boundary.
        For s = h, h/10, h/100, h/1000 the two central differences D(s) and D(s/2) are
        compared; the first s where they agree (relative 1e-6, a straddled jump makes
        them differ wildly) gives ``(4 D(s/2) - D(s)) / 3``.
        """
        h = ALL_PARAMS[name].step if step is None else step
        point = self.point(at)
        fixed = {n: self.tensor(v) for n, v in (at or {}).items() if n != name}
        x0 = point[name]
        return _ladder(lambda x: self._loss_value(fixed, name, x), x0, h)

    def _loss_value(self, fixed: dict[str, Tensor], name: str, x: float) -> float:
        with torch.no_grad():
            return float(self.loss(**fixed, **{name: self.tensor(x)}))

    def check(self, name: str, grads: dict[str, float] | None = None, at: dict[str, float] | None = None
              ) -> ParamCheck:
        g = (grads or self.autograd([name], at=at))[name]
        fd = self.finite_difference(name, at=at)
        return ParamCheck(name=name, unit=ALL_PARAMS[name].unit, value=self.point(at)[name], autograd=g,
                          finite_difference=fd.value, step=fd.step, smooth=fd.consistent, signal=self.signal,
                          scale=ALL_PARAMS[name].scale)

    def gradient_mass(self, name: str, step: float | None = None) -> float:
        """``sum_i w_i |dI_i/dp| / L0``: the derivative's absolute mass over the ROI pixels
        (central differences per pixel).  A net dL/dp that cancels between pixels (a spot
        moving across the ROI) is resolved in float32 only to ~1e-7 of this, not of itself."""
        h = ALL_PARAMS[name].step if step is None else step
        x0 = self.base[name]
        with torch.no_grad():
            up = self.render(**{name: self.tensor(x0 + h)})
            dn = self.render(**{name: self.tensor(x0 - h)})
        return float((self.weights[0] * ((up - dn) / (2.0 * h)).abs()).sum() / self.norms[0])

    # ---- gradcheck --------------------------------------------------------------------
    def gradcheck_inputs(self, names: Sequence[str], at: dict[str, float] | None = None
                         ) -> tuple[Callable[..., Tensor], tuple[Tensor, ...], float]:
        """``(fn, inputs, eps)`` for torch.autograd.gradcheck over ``names`` jointly.

        Input i is ``value / ALL_PARAMS[name].scale`` (float64, requires grad); ``fn`` returns the
        normalised weighted sums (n_outputs,); ``eps`` is the smallest per-parameter step.
        """
        point = self.point(at)
        fixed = {n: self.tensor(v) for n, v in (at or {}).items() if n not in names}
        scales = [ALL_PARAMS[n].scale for n in names]
        inputs = tuple(torch.tensor(point[n] / s, dtype=torch.float64, requires_grad=True)
                       for n, s in zip(names, scales))

        def fn(*xs: Tensor) -> Tensor:
            over = {n: (x * s).to(self.dtype) for n, x, s in zip(names, xs, scales)}
            return self.outputs(**fixed, **over).to(torch.float64)

        return fn, inputs, min(ALL_PARAMS[n].eps for n in names)

    # ---- structure-factor table -------------------------------------------------------
    def F_grid_gradient(self) -> Tensor:
        """dL/dF_grid (same shape as the table)."""
        grid = self.sim.F_grid.detach().clone().to(self.dtype).requires_grad_(True)
        (g,) = torch.autograd.grad(self.loss(F_grid=grid), grid)
        return g

    def F_grid_finite_difference(self, index: tuple[int, ...], step: float = F_GRID_STEP) -> float:
        base = self.sim.F_grid.detach().to(self.dtype)

        def L(value: float) -> float:
            grid = base.clone()
            grid[index] = value
            with torch.no_grad():
                return float(self.loss(F_grid=grid))

        return _ladder(L, float(base[index]), step).value


def direct_beam_pixel(sim: Simulator) -> tuple[int, int]:
    """(fast, slow) index of the pixel whose centre is nearest to where the direct beam hits."""
    with torch.no_grad():
        geom = sim.geometry(sim.parameters_dict())
        p = sim.setup.pixel_m
        return (int(math.floor(float(geom.Fbeam) / p)), int(math.floor(float(geom.Sbeam) / p)))


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------
def _fmt(v: float) -> str:
    return f"{v: .6e}"


def report_case(case: Case, roi_size: int | None, dtype, rtol: float, out=sys.stdout) -> bool:
    t0 = time.perf_counter()
    probe = GradientProbe.from_case(case, roi_size=roi_size, dtype=dtype)
    grads = probe.autograd(probe.names)
    print(f"\n== {case.name}: {case.description}", file=out)
    print(f"   args: {case.args}" + (f" -hkl <P1 table |hkl| <= {case.hkl[0]}>" if case.hkl else ""), file=out)
    print(f"   image signal: {probe.signal}", file=out)
    print("   L = sum(w I_roi) / same at base (w random in [0.5, 1.5)); dL/dp per unit; "
          "FD: Richardson central difference, step h", file=out)
    head = (f"   {'parameter':<14}{'unit':<7}{'value':>12} {'autograd':>14} {'finite diff':>14} {'rel.err':>8}"
            f" {'h':>6}  signal")
    print(head, file=out)
    all_ok = True
    for name in probe.names:
        c = probe.check(name, grads)
        if name in case.zero:
            ok = c.autograd == 0.0 and c.finite_difference == 0.0
        else:
            ok = c.ok(rtol=rtol)
        all_ok &= ok
        unit = {"photons/m^2": "ph/m2", "electrons": "e"}.get(c.unit, c.unit)
        note = "" if ok else "  FAIL"
        if ok and name in case.zero:
            note = "  (0 by construction)"
        print(f"   {name:<14}{unit:<7}{c.value:>12.6g} {c.autograd:>14.6e} {c.finite_difference:>14.6e} "
              f"{c.rel_error:>8.1e} {c.step:>6.0e}  {c.signal.short}{note}", file=out)
    if probe.sim.F_grid is not None:
        g = probe.F_grid_gradient()
        idx = tuple(int(i) for i in torch.nonzero(g.abs() == g.abs().max())[0])
        fd = probe.F_grid_finite_difference(idx)
        ag = float(g[idx])
        rel = abs(ag - fd) / max(abs(fd), 1e-300)
        ok = bool(torch.isfinite(g).all()) and abs(ag) > MIN_GRAD and abs(ag - fd) <= ATOL + rtol * abs(fd)
        all_ok &= ok
        hkl = "F(" + ",".join(str(int(i + m)) for i, m in zip(idx, probe.sim.setup.hkl_min)) + ")"
        print(f"   {hkl:<14}{'e':<7}{float(probe.sim.F_grid[idx]):>12.6g} {ag:>14.6e} {fd:>14.6e} {rel:>8.1e} "
              f"{F_GRID_STEP:>6.0e}  {probe.signal.short}{'' if ok else '  FAIL'}", file=out)
        print(f"   F_grid: {int((g != 0).sum())} of {g.numel()} table entries have a non-zero derivative "
              "(shown: the largest)", file=out)
    print(f"   {'all ok' if all_ok else 'FAILURES'} ({time.perf_counter() - t0:.1f} s)", file=out)
    return all_ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nbtorch.tools.gradcheck_report",
                                 description="autograd vs finite differences for every canonical parameter")
    ap.add_argument("--case", default=DEFAULT_CASE, help=f"one of {', '.join(CASES)}, or 'all' (default {DEFAULT_CASE})")
    ap.add_argument("--roi-size", type=int, default=None, help="ROI edge in pixels (default: the case's, 24 or 32)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: faster on 24-32 px ROIs)")
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    ap.add_argument("--rtol", type=float, default=None, help=f"relative tolerance (default {RTOL:g}; float32: 1e-2)")
    args = ap.parse_args(argv)
    names = list(CASES) if args.case == "all" else [args.case]
    for n in names:
        if n not in CASES:
            ap.error(f"unknown case {n!r}; expected one of {', '.join(CASES)} or 'all'")
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    torch.set_num_threads(max(1, args.threads))
    rtol = args.rtol if args.rtol is not None else (RTOL if dtype == torch.float64 else 1e-2)
    ok = True
    for n in names:
        ok &= report_case(CASES[n], args.roi_size, dtype, rtol)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
