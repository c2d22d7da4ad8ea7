"""Compiled mode gives the gradients of eager mode (float32, 1e-4 relative), on a real ROI.

Relative to the larger of |dL/dp| and the derivative's absolute mass sum_i w_i |dI_i/dp| / L0:
for a derivative that cancels between pixels (``distance``: spots move outwards on both
sides of the ROI) float32 itself (eager, against float64) is only good to ~1e-3 of the net
value, so the net value alone is no yardstick.

Slow (Inductor compiles for a minute or two on a CPU): ``pytest -m slow``.  Two ways in:
the simulator's own compiled kernel (``Simulator(compile=True)``, what ``nbtorch.runtime.policy``
selects by default) and ``torch.compile(backend="inductor")`` of a closure over an eager
simulator.  Skipped, with the reason, where compilation is unavailable.  (Double backward
through a compiled graph is not supported by torch: curvature checks run eager.)
"""

from __future__ import annotations

import pytest
import torch

from nbtorch.tools.gradcheck_report import CASES, GradientProbe, build_simulator

pytestmark = pytest.mark.slow
CASE = "mosaic"
RTOL = 1e-4


@pytest.fixture(scope="module")
def eager_probe():
    """float32 eager gradients, float64 gradients and each derivative's absolute mass
    sum_i w_i |dI_i/dp| / L0 (float64): a net derivative that cancels between pixels (a spot
    moving inside the ROI) is resolved in float32 only relative to that mass."""
    probe = GradientProbe.from_case(CASES[CASE], dtype=torch.float32)
    grads = probe.autograd(probe.names)  # (this case has one source: no beam widths)
    probe64 = GradientProbe.from_case(CASES[CASE], dtype=torch.float64)
    ref64 = probe64.autograd(probe64.names)
    mass = {n: probe64.gradient_mass(n) for n in probe64.names}
    return probe, grads, ref64, mass


def _compare(grads: dict, ref: dict, ref64: dict, mass: dict) -> None:
    assert any(abs(v) > 0.1 for v in ref.values())  # a non-trivial gradient
    bad = []
    for name in ref64:
        if name in CASES[CASE].zero:  # 0 by construction (e.g. the anisotropic spreads of an isotropic mosaic)
            assert grads[name] == 0.0 and ref[name] == 0.0, name
            continue
        g, e, e64, m = grads[name], ref[name], ref64[name], mass[name]
        assert m > 0 and abs(e - e64) <= 1e-3 * max(abs(e64), m), f"eager float32 vs float64: {name} {e} {e64}"
        if not abs(g - e) <= RTOL * max(abs(e), m):
            bad.append(f"{name}: compiled {g:.8g} eager {e:.8g} (mass {m:.3g})")
    assert not bad, "; ".join(bad)


def test_compiled_simulator_gradients_match_eager(eager_probe):
    probe, ref, ref64, mass = eager_probe
    try:
        sim = build_simulator(CASES[CASE], dtype=torch.float32, compile=True)
        compiled = GradientProbe(sim, roi=probe.roi)
        grads = compiled.autograd(compiled.names)
    except Exception as exc:  # pragma: no cover - depends on the toolchain
        pytest.skip(f"torch.compile unavailable here: {type(exc).__name__}: {exc}")
    if sim.compile_mode != "compiled":
        pytest.skip(f"simulator fell back to eager: {sim.compile_reason}")
    assert compiled.signal.n_spots >= 3
    assert torch.allclose(compiled.image, probe.image, rtol=1e-4, atol=1e-4 * float(probe.image.max()))
    _compare(grads, ref, ref64, mass)


def test_torch_compile_closure_gradients_match_eager(eager_probe):
    probe, ref, ref64, mass = eager_probe
    names = ("cell_a", "cell_alpha", "misset_x", "mosaic_spread", "N_a", "distance", "beam_x", "detector_rotx",
             "wavelength", "polarization")
    xs = {n: torch.tensor(probe.base[n], dtype=torch.float32, requires_grad=True) for n in names}
    try:
        fn = torch.compile(lambda kw: probe.loss(**kw), backend="inductor")
        loss = fn(xs)
    except Exception as exc:  # pragma: no cover - depends on the toolchain
        pytest.skip(f"torch.compile(backend='inductor') failed: {type(exc).__name__}: {exc}")
    grads = dict(zip(names, (float(g) for g in torch.autograd.grad(loss, list(xs.values())))))
    assert float(loss.detach()) == pytest.approx(1.0, rel=1e-5)
    _compare({**ref, **grads}, ref, ref64, mass)
