"""``Simulator(kernel_dtype=float32)``: float64 parameters, geometry and pixels around a float32 kernel (the
refinement's ``--kernel-dtype float32``); eager, so the check is of the casts, not of a compiled kernel."""

from __future__ import annotations

import pytest
import torch

from nbtorch import InputError, Simulator, config_from_args

ARGS = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1 -default_F 100 -distance 100 -detpixels 40 "
        "-pixel 0.4 -mosaic 0.3 -mosaic_dom 3 -detector_thick 450 -detector_abs 260 -detector_thicksteps 3").split()
NAMES = ("cell_a", "distance", "beam_x", "mosaic_spread", "orient_x", "N_a")


def image_and_grads(**kw):
    sim = Simulator(config_from_args(list(ARGS)), dtype=torch.float64, compile=False, **kw)
    params = {n: getattr(sim, n).detach().clone().requires_grad_(True) for n in NAMES}
    image = sim(**params)
    grads = torch.autograd.grad(image.square().sum(), list(params.values()))
    return image, torch.stack(grads)


def test_float32_kernel_gives_float64_pixels_close_to_float64():
    ref, g_ref = image_and_grads()
    mixed, g_mixed = image_and_grads(kernel_dtype="float32")
    assert mixed.dtype == torch.float64 and g_mixed.dtype == torch.float64
    assert ref.max() > 0
    assert float((mixed - ref).detach().abs().max() / ref.detach().abs().max()) < 1e-4
    assert not torch.equal(mixed, ref)  # the kernel did run in float32
    assert torch.allclose(g_mixed, g_ref, rtol=1e-3, atol=1e-3 * float(g_ref.abs().max()))


def test_default_kernel_dtype_is_the_dtype():
    sim = Simulator(config_from_args(list(ARGS)), dtype=torch.float64, compile=False)
    assert sim.kernel_dtype == torch.float64


def test_bad_kernel_dtype_is_one_line():
    with pytest.raises(InputError, match="kernel_dtype: expected one of float32, float64"):
        Simulator(config_from_args(list(ARGS)), kernel_dtype="float16")
