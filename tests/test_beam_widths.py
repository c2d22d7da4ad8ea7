"""The beam's widths as canonical parameters: ``dispersion`` (%), ``divergence_h``, ``divergence_v`` (mrad).

The sources' number and their places in units of each width are resolved from the flags
(nbtorch.sampling.beam_sources); the widths move each source's wavelength and direction.  At the resolved widths the
sources are exactly the resolved ones (images and goldens unchanged); at other widths they are the sources a
simulator configured with those widths resolves (the same count); a width without spread refuses other values.
The derivatives against finite differences: tests/gradients (case ``sources_curved``) and below on a flat
detector.
"""

from __future__ import annotations

import pytest
import torch

import nbtorch
from nbtorch import Simulator, config_from_args
from nbtorch.sampling.beam_sources import WIDTH_NAMES
from nbtorch.errors import InputError
from nbtorch.tools.gradcheck_report import GradientProbe

BASE = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1.0 -default_F 100 -distance 100 -detpixels 64 "
        "-pixel 0.1 -polar 0.5 -oversample 1")

# (flags at the widths the simulator resolves, the same sources at other widths, those widths)
CONFIGS = {
    "dispersion": ("-dispersion 2 -dispsteps 5", "-dispersion 0.5 -dispsteps 5", {"dispersion": 0.5}),
    "two wavelengths": ("-dispersion 1", "-dispersion 3", {"dispersion": 3.0}),
    "round divergence": ("-divergence 2 -divsteps 5", "-hdivrange 3 -vdivrange 1 -divsteps 5",
                         {"divergence_h": 3.0, "divergence_v": 1.0}),
    "square, horizontal only": ("-square_div -hdivrange 4 -hdivsteps 4", "-square_div -hdivrange 0.5 -hdivsteps 4",
                                {"divergence_h": 0.5}),
    "both": ("-hdivrange 2 -vdivrange 1 -divsteps 3 -dispersion 0.4 -dispsteps 3",
             "-hdivrange 1 -vdivrange 4 -divsteps 3 -dispersion 0.1 -dispsteps 3",
             {"divergence_h": 1.0, "divergence_v": 4.0, "dispersion": 0.1}),
}


def _sim(flags: str, dtype=torch.float64) -> Simulator:
    return Simulator(config_from_args(f"{BASE} {flags}".split()), dtype=dtype, compile=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_resolved_widths_give_the_resolved_sources_exactly(name, dtype):
    sim = _sim(CONFIGS[name][0], dtype)
    p = sim.parameters_dict()
    incident, lam = sim.sources(p)
    s = sim.setup
    assert torch.equal(incident, torch.as_tensor(s.incident, dtype=dtype))
    assert torch.equal(lam, p["wavelength"] * torch.as_tensor(s.wavelength_factor, dtype=dtype))
    assert len(incident) > 1 and set(sim.source_width_names()) == {n for n in WIDTH_NAMES if s.params[n] > 0}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_other_widths_give_the_sources_of_those_flags(name):
    flags, other_flags, widths = CONFIGS[name]
    sim, other = _sim(flags), _sim(other_flags)
    assert {n: other.setup.params[n] for n in widths} == pytest.approx(widths)
    widths = {n: torch.tensor(v, dtype=torch.float64) for n, v in widths.items()}  # (a Python float is float32)
    incident, lam = sim.sources(sim.parameters_dict(**widths))
    assert incident.shape == torch.Size(other.setup.incident.shape)
    torch.testing.assert_close(incident, torch.as_tensor(other.setup.incident), rtol=0, atol=1e-15)
    torch.testing.assert_close(lam, torch.as_tensor(other.setup.wavelength_factor), rtol=0, atol=1e-15)
    with nbtorch.eager():
        torch.testing.assert_close(sim(**widths), other(), rtol=1e-12, atol=0)


def test_flag_rules_give_the_widths():
    """The resolved widths are the parameters' values: the count-only and step rules included."""
    assert _sim("-dispersion 0.2").setup.params["dispersion"] == pytest.approx(0.2)
    sim = _sim("-hdivrange 1 -hdivstep 0.25")
    assert sim.setup.params["divergence_h"] == pytest.approx(1.0) and sim.setup.params["divergence_v"] == 0.0
    assert sim.source_width_names() == ("divergence_h",)
    plain = _sim("")
    assert [plain.setup.params[n] for n in WIDTH_NAMES] == [0.0, 0.0, 0.0] and plain.source_width_names() == ()


def test_width_without_spread_refuses_another_value():
    sim = _sim("-dispersion 0.2 -dispsteps 3")
    sim.parameters_dict(divergence_h=0.0)  # its own value: accepted
    for name, flag in (("divergence_h", "-hdivrange"), ("divergence_v", "-vdivrange")):
        with pytest.raises(InputError, match=f"^{name} 0.3: the model's sources do not spread .* needs {flag}"):
            sim.parameters_dict(**{name: 0.3})
    with pytest.raises(InputError, match="^dispersion 0.1: the model has one wavelength"):
        _sim("-divergence 1 -divsteps 3").parameters_dict(dispersion=torch.tensor(0.1))


@pytest.mark.parametrize("name", WIDTH_NAMES)
def test_width_gradient_matches_finite_difference_on_a_flat_detector(name):
    """d(weighted ROI sum)/d(width) on an ROI with Bragg spots, against a Richardson central difference."""
    sim = _sim("-hdivrange 2 -vdivrange 1.5 -divsteps 3 -dispersion 1 -dispsteps 3 -mosaic 0.3 -mosaic_dom 2 "
               "-detpixels 192")
    with nbtorch.eager():
        probe = GradientProbe(sim, roi_size=24)
        assert probe.signal.n_spots >= 3
        g = probe.autograd([name])[name]
        fd = probe.finite_difference(name)
    assert abs(g) > 1e-4, f"{name}: derivative {g}"
    assert abs(g - fd.value) <= 1e-9 + 1e-6 * abs(fd.value), f"{name}: autograd {g} vs FD {fd}"
