"""Every refinable parameter: autograd == central finite difference, on ROIs of real images.

Cases (``nbtorch.tools.gradcheck_report.CASES``): spec and ``-c_parity``; square, round
and gauss spots; anisotropic N; an HKL table with nearest-neighbour lookup and
with tricubic interpolation (ROIs across the table edge, so ``default_F`` and the
table both matter); a rotated MOSFLM detector (BEAM pivot); XDS (SAMPLE pivot);
C parity with the running-sum quirks, a sensor and water; divergence and
dispersion sources on a curved detector (there also the widths ``dispersion``,
``divergence_h``, ``divergence_v``; a case without spread along a width refuses
another value of it); a cubic crystal with the direct beam on a
pixel centre.  The orientation deltas ``orient_x/y/z`` are checked beside the
canonical names.  Each check uses
``L = sum(w * I_roi) / L0`` (random weights ``w``, ``L = 1`` at the base point):

* the ROI has signal: at least 3 Bragg spots above background (so no check can
  pass by comparing 0 with 0), and every derivative is non-zero;
* autograd agrees with a Richardson-extrapolated central difference to 1e-6
  relative (1e-9 absolute, in units of L per parameter unit; fluence per 1e28
  photons/m^2).  Parameters that a case declares zero by construction
  (``Case.zero``, with the reason) must be exactly 0 in both.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradient_probes import get_probe, one_thread_eager  # noqa: F401  (autouse fixture)
from nbtorch import PARAMETER_NAMES
from nbtorch.sampling.beam_sources import WIDTH_NAMES
from nbtorch.errors import InputError
from nbtorch.tools.gradcheck_report import ALL_PARAMS, ATOL, CASES, MIN_GRAD, PROBED_NAMES, RTOL

_GRADS: dict[str, dict[str, float]] = {}


def _autograd(case: str) -> dict[str, float]:
    """All derivatives of a case from one backward pass (cached)."""
    if case not in _GRADS:
        _GRADS[case] = get_probe(case).autograd(PROBED_NAMES)
    return _GRADS[case]


def test_canonical_names_are_all_probed():
    assert set(PARAMETER_NAMES) <= set(PROBED_NAMES)


@pytest.mark.parametrize("case", list(CASES))
def test_roi_has_bragg_spots(case):
    probe = get_probe(case)
    sig = probe.signal
    assert sig.n_spots >= 3, f"{case}: {sig}"
    assert sig.peak > 10 * sig.background, f"{case}: {sig}"
    assert torch.isfinite(probe.image).all()
    x0, x1, y0, y1 = probe.roi
    assert 24 <= x1 - x0 + 1 <= 32 and 24 <= y1 - y0 + 1 <= 32


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].hkl is not None])
def test_roi_uses_table_and_default_F(case):
    """The HKL cases' ROIs straddle the table edge: both F_grid and default_F shape the image."""
    probe = get_probe(case)
    assert abs(_autograd(case)["default_F"]) > MIN_GRAD
    g = probe.F_grid_gradient()
    assert torch.isfinite(g).all() and int((g != 0).sum()) >= 3


@pytest.mark.parametrize("name", PROBED_NAMES)
@pytest.mark.parametrize("case", list(CASES))
def test_gradient_matches_finite_difference(case, name):
    probe = get_probe(case)
    g = _autograd(case)[name]
    assert math.isfinite(g), f"{case}/{name}: autograd {g}"
    if name not in probe.names:  # a beam width without spread: no derivative, and no other value accepted
        assert name in WIDTH_NAMES and g == 0.0
        with pytest.raises(InputError, match=f"^{name} 0.5: .* needs"):
            probe.loss(**{name: probe.tensor(0.5)})
        return
    if name in CASES[case].zero:
        assert g == 0.0 and probe.finite_difference(name).value == 0.0
        return
    fd = probe.finite_difference(name)
    # compare per unit of the rescaled input (fluence: 1e28 photons/m^2), L = 1 at the base point
    scale = ALL_PARAMS[name].scale
    gs, fds = g * scale, fd.value * scale
    assert abs(gs) > MIN_GRAD, f"{case}/{name}: derivative {g:.3g} is (nearly) zero; signal {probe.signal}"
    assert abs(gs - fds) <= ATOL + RTOL * abs(fds), (
        f"{case}/{name}: autograd {g:.10g} vs finite difference {fd.value:.10g} (step {fd.step:g}, "
        f"smooth {fd.consistent}); {probe.signal}")


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].hkl is not None])
def test_structure_factor_table_matches_finite_difference(case):
    """dL/dF[h,k,l] for the 6 table entries with the largest derivative (one-hot lookups for
    nearest neighbour, the Lagrange weights for tricubic), each against a finite difference."""
    probe = get_probe(case)
    g = probe.F_grid_gradient()
    assert torch.isfinite(g).all()
    n = min(6, int((g != 0).sum()))
    assert n >= 3
    top = torch.topk(g.abs().reshape(-1), n).indices
    for flat in top.tolist():
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        fd = probe.F_grid_finite_difference(idx)
        assert float(g[idx]) != 0.0
        assert abs(float(g[idx]) - fd) <= ATOL + RTOL * abs(fd), f"{case} F{idx}: {float(g[idx])} vs {fd}"
