"""Simulator behaviour: tiling, ROI, overrides, dtype/device neutrality, memory bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch import InputError, Simulator, config_from_args

BASE = "-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1 -default_F 100 -distance 100 -detpixels 48 -pixel 0.4"


def make(extra: str = "", **kw) -> Simulator:
    return Simulator(config_from_args((BASE + " " + extra).split()), dtype=torch.float64, **kw)


def test_tiled_equals_untiled():
    extra = "-mosaic 0.3 -mosaic_dom 4 -phi 1 -osc 0.5 -phisteps 2 -oversample 2"
    whole = make(extra, max_evals_per_tile=1 << 30)()
    tiled = make(extra, max_evals_per_tile=97)()  # many small, uneven tiles
    assert whole.max() > 0
    assert torch.equal(whole, tiled)


def test_a_padded_bucketed_tile_gives_the_same_bits():
    """3600 pixels x 32 evaluations (over JACOBIAN_TILE_EVALUATIONS) in one tile: bucketed to 4096 pixels (496
    padding pixels); the image is the one of many small tiles, bit for bit."""
    from nbtorch.rendering import tile_pixels

    extra = "-mosaic 0.3 -mosaic_dom 4 -phi 1 -osc 0.5 -phisteps 2 -oversample 2 -detpixels 60"
    one = make(extra, max_evals_per_tile=1 << 30)
    assert tile_pixels(3600, (1 << 30) // one.evaluations_per_pixel(), True) == 4096
    whole = one()
    tiled = make(extra, max_evals_per_tile=97)()
    assert whole.max() > 0 and whole.shape == (60, 60)
    assert torch.equal(whole, tiled)


def test_tile_pixels_share_a_few_shapes():
    """Bucketed: at least the pixels (up to the most), a multiple of 16, under 25 % padding, four sizes per
    octave; not bucketed: the pixel count rounded up to 16."""
    from nbtorch.rendering import tile_pixels

    most = 139810  # a GPU's 2^22 evaluations / 30
    shapes = set()
    for n in range(1, 2 * most, 7):
        t = tile_pixels(n, most, True)
        assert t % 16 == 0 and min(n, most) <= t <= most + 15, (n, t)
        assert t - min(n, most) <= max(15, 0.25 * min(n, most)), (n, t)
        assert tile_pixels(n, most, False) == -(-min(n, most) // 16) * 16
        if n >= 1024:
            shapes.add(t)
    assert len(shapes) <= 4 * 8 + 1  # 1024 .. 139810 px: 7-8 octaves


def test_roi_is_the_same_physics():
    full = make()()
    roi = make("-roi 5 30 10 40")()
    assert torch.equal(roi[10:41, 5:31], full[10:41, 5:31])
    outside = roi.clone()
    outside[10:41, 5:31] = 0
    assert outside.abs().max() == 0


def test_render_single_pixel_matches_full_image():
    sim = make()
    full = sim()
    j, i = np.unravel_index(int(full.argmax()), full.shape)
    one, _ = sim.render(roi=(int(i), int(i), int(j), int(j)))
    assert torch.equal(one[0, 0], full[j, i])


def test_override_equals_config_value():
    a = make()(cell_a=torch.tensor(71.0, dtype=torch.float64))
    b = Simulator(config_from_args(BASE.replace("-cell 70", "-cell 71").split()), dtype=torch.float64)()
    assert torch.allclose(a, b, rtol=1e-12, atol=0)


def test_unknown_override_is_an_error():
    with pytest.raises(InputError, match="unknown parameter"):
        make()(cell_x=1.0)


def test_float32_matches_float64():
    img64 = make()().numpy()
    img32 = Simulator(config_from_args(BASE.split()), dtype=torch.float32)().double().numpy()
    assert np.corrcoef(img64.ravel(), img32.ravel())[0, 1] > 0.99999


def test_diagnostics_report_lookups(tmp_path):
    hkl = tmp_path / "small.hkl"
    hkl.write_text("\n".join(f"{h} {k} {l} 10" for h in range(-1, 2) for k in range(-1, 2) for l in range(-1, 2)))
    sim = Simulator(config_from_args((BASE + f" -hkl {hkl}").split()), dtype=torch.float64)
    _, plain = sim.render()
    assert "fraction_default_F" not in plain and float(plain["image_max"]) > 0  # lookups: only on request
    _, diag = sim.render(diagnostics=True)
    frac = float(diag["fraction_default_F"])
    assert 0.0 < frac < 1.0  # some lookups land in the tiny table, most fall outside
    assert (diag["hkl0_max"] >= diag["hkl0_min"]).all()
    assert float(diag["image_sum"]) == pytest.approx(float(plain["image_sum"]), rel=1e-12)


def test_memory_bound_tile_size():
    """A 2048^2 detector with 10 mosaic domains x 5 phi steps is processed in tiles that fit the bound."""
    sim = Simulator(
        config_from_args("-cell 100 100 100 90 90 90 -N 5 -default_F 100 -lambda 1 -detpixels 2048 "
                         "-mosaic 0.5 -mosaic_dom 10 -phi 0 -osc 1 -phisteps 5 -oversample 1".split()),
        dtype=torch.float32,
    )
    per_pixel = sim.evaluations_per_pixel()
    assert per_pixel == 50
    tile_pixels = sim.max_evals_per_tile // per_pixel
    assert tile_pixels * per_pixel <= sim.max_evals_per_tile < 2048 * 2048 * per_pixel


_MEMORY_SCRIPT = """
import resource, torch
from nbtorch import Simulator, config_from_args
sim = Simulator(config_from_args("-cell 100 100 100 90 90 90 -N 5 -default_F 100 -lambda 1 -detpixels 2048 "
                                 "-mosaic 0.5 -mosaic_dom 10 -mosaic_seed 1 -phi 0 -osc 1 -phisteps 5 "
                                 "-oversample 1".split()), dtype=torch.float32)
with torch.no_grad():
    img = sim()
assert float(img.max()) > 0
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


@pytest.mark.slow
def test_memory_2048_heavy_under_1_5GB():
    """Peak RSS of a fresh process (ru_maxrss is a lifetime maximum: earlier tests would count)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    peak_mb = float(out.stdout.strip().splitlines()[-1])
    assert peak_mb < 1536, f"peak RSS {peak_mb:.0f} MB"  # issue #21: <= 1.5 GB (506 MB on 2026-11-25)


# ------------------------------------------------------------------------------ not edited from outside

def test_setup_is_read_only_and_restricted_copies_leave_the_simulator_alone():
    import dataclasses

    import numpy as np

    sim = Simulator(config_from_args("-cell 40 40 40 90 90 90 -default_F 100 -N 3 -lambda 1 -distance 50 "
                                     "-detpixels 24 -pixel 0.2 -oversample 1".split()), compile=False)
    with pytest.raises(AttributeError):
        sim.setup = dataclasses.replace(sim.setup, pixel_mask=None)
    pixels = np.zeros(sim.shape, dtype=bool)
    pixels[5:15, 3:20] = True
    sub = sim.restricted(pixels)
    with torch.no_grad():
        full, part = sim(), sub()
    assert sim.setup.pixel_mask is None and sub.setup.pixel_mask is not None
    assert torch.equal(part[torch.as_tensor(pixels)], full[torch.as_tensor(pixels)])
    assert float(part[~torch.as_tensor(pixels)].abs().max()) == 0.0 and float(full.max()) > 0
    # a restriction replaces an earlier one (the model's own -mask aside), it does not narrow it
    other = np.zeros(sim.shape, dtype=bool)
    other[0:4, 0:4] = True
    assert np.array_equal(sub.restricted(other).setup.pixel_mask, other)
    # buffers are shared values, but the copy's dict of buffers is its own
    assert sub.cell_a is sim.cell_a
    sub.register_buffer("extra", torch.zeros(1))
    assert not hasattr(sim, "extra")
    with pytest.raises(Exception, match="pixel mask shape"):
        sim.restricted(np.ones((3, 3), dtype=bool))


def test_nothing_outside_nbtorch_assigns_a_simulator_setup():
    """refine/ and experiments/ use Simulator.restricted; only the simulator sets its own setup."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for folder in ("refine", "experiments", "scripts"):
        for path in (root / folder).rglob("*.py"):
            assert not re.search(r"\.setup\s*=[^=]", path.read_text()), path


def test_a_plain_number_override_keeps_every_digit_of_the_simulator_dtype():
    """sim(cell_a=50.1) in float64 uses 50.1 itself, not the float32 50.099998 (it once went through torch's
    default float32 before the cast); a tensor override keeps its graph."""
    sim = make()
    p = sim.parameters_dict(cell_a=50.1, distance=100.1)
    assert p["cell_a"].dtype == torch.float64 and float(p["cell_a"]) == 50.1 and float(p["distance"]) == 100.1
    x = torch.tensor(50.1, dtype=torch.float64, requires_grad=True)
    y = sim.parameters_dict(cell_a=x)["cell_a"]
    assert y.requires_grad and float(y) == 50.1


def test_plain_values_become_device_tensors_once(monkeypatch):
    """A plain number or set-up array reaches the device once and is reused (on a GPU each new one would be a
    host-to-device copy, which a CUDA graph's capture may not contain); equal content, the same tensor; -0.0 and
    0.0 apart; a refinement's fixed plain overrides give the same tensors at every evaluation."""
    from nbtorch import Simulator, config_from_args

    sim = Simulator(config_from_args("-cell 70 80 90 90 90 90 -N 5 -lambda 1 -default_F 100 -detpixels 8".split()))
    a = sim._t(1.5)
    assert a is sim._t(1.5) and a.dtype == sim.dtype and float(a) == 1.5
    assert sim._t(0.0) is not sim._t(-0.0) and str(float(sim._t(-0.0))) == "-0.0"
    axes = np.eye(3)
    assert sim._t(axes) is sim._t(axes.copy()) and torch.equal(sim._t(axes), torch.eye(3, dtype=sim.dtype))
    assert sim._t(np.ones(3)) is not sim._t(np.ones((1, 3)))  # shape is part of the content
    plain = {"distance": 101.0, "beam_x": 0.4, "phi0": 0.0}
    first, second = sim.parameters_dict(**plain), sim.parameters_dict(**plain)
    assert all(first[n] is second[n] for n in plain) and float(first["distance"]) == 101.0
    t = torch.tensor(2.0, dtype=torch.float64)
    assert sim._t(t) is t  # a tensor of the simulator's dtype and device: itself
    import nbtorch.simulator as simulator_module

    monkeypatch.setattr(simulator_module, "MAX_CONSTANTS", len(sim._constants))  # full: nothing dropped, none added
    assert sim._t(1.5) is a and sim._t(7.25) is not sim._t(7.25) and float(sim._t(7.25)) == 7.25


def test_a_value_made_inside_a_forward_mode_transform_is_not_kept():
    """A plain value first made inside ``torch.func.jacfwd`` (the esds' and a joint preconditioner's Jacobian) is a
    wrapper without storage: it is used there but not kept, so that a later (compiled) call gets a plain tensor;
    values kept before the transform are reused inside it."""
    from nbtorch import Simulator, config_from_args

    sim = Simulator(config_from_args("-cell 70 80 90 90 90 90 -N 5 -lambda 1 -default_F 100 -detpixels 8".split()),
                    compile=False)
    kept = sim._t(2.5)

    def f(x):
        return x * sim._t(3.25) + sim._t(2.5)

    J = torch.func.jacfwd(f)(torch.ones(2, dtype=sim.dtype))
    assert torch.equal(J, 3.25 * torch.eye(2, dtype=sim.dtype))
    assert all(t.untyped_storage().data_ptr() for t in sim._constants.values())
    assert sim._t(2.5) is kept and float(sim._t(3.25)) == 3.25 and sim._t(3.25).data_ptr()
