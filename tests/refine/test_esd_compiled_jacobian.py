"""The esds' Jacobian through the compiled forward-mode kernels (:mod:`nbtorch.physics.jacobian`) equals the
eager forward-mode one (``jacfwd`` through the eager simulator, :mod:`refine.quality.uncertainty`) to 1e-6 relative in
every esd kind, on a synthetic problem with spots; the kernels are used only where compiling is allowed."""

from __future__ import annotations

import functools

import pytest
import torch

import nbtorch
import nbtorch.runtime.jacobian_kernels as jacobian_kernels
import nbtorch.physics.jacobian as jacobian
import nbtorch.physics.kernel as kernel
import refine.quality.uncertainty as unc
from nbtorch.runtime import policy as runtime
from test_esd_first_derivatives import _case, assert_same_esds  # tests/refine is on the path (pytest rootdir insertion)


def _eager_kernels(kind, static, args):  # the kernels' own functions, run eagerly (no Inductor)
    return functools.partial(jacobian.KERNEL_FUNCTIONS[kind], static)


def _compiled_path(monkeypatch, compile_for_real: bool) -> list:
    """Allow compiling, route every block through forward mode and every tile through the kernels (thresholds
    0); the tangent calls are counted."""
    monkeypatch.setenv("NANOBRAGG_DISABLE_COMPILE", "0")
    monkeypatch.setattr(kernel, "JACOBIAN_TILE_EVALUATIONS", 0)
    monkeypatch.setattr(unc, "REVERSE_JACOBIAN_EVALUATIONS", 0)
    monkeypatch.setattr(jacobian_kernels, "_ARTIFACTS", {})
    if not compile_for_real:
        monkeypatch.setattr(jacobian_kernels, "_compile", _eager_kernels)
    calls: list = []
    original = jacobian._tangents
    monkeypatch.setattr(jacobian, "_tangents", lambda *a: calls.append(a[-1]) or original(*a))
    return calls


@pytest.mark.parametrize("name,restricted", [("tetragonal_mosflm", True), ("cubic_mosflm", False)])
def test_kernel_path_equals_eager_jacfwd(problem_cache, monkeypatch, name, restricted):
    pmap, obj, _ = _case(problem_cache(name, 32), restricted, True, analytic=True)
    assert float(obj.pixel_model(pmap.expand(pmap.physical(pmap.raw0()))).max()) > 10 * float(
        obj.pixel_model(pmap.expand(pmap.physical(pmap.raw0()))).median())  # spots, not a flat image
    old = unc.estimate_uncertainties(obj, pmap, pmap.raw0(), excess=3.0)  # conftest: compiling disabled
    calls = _compiled_path(monkeypatch, compile_for_real=False)
    new = unc.estimate_uncertainties(obj, pmap, pmap.raw0(), excess=3.0)
    assert calls and all(k == len(pmap.names) for k in calls)  # every tile, all directions at once
    assert_same_esds(new, old)


def test_tile_tangents_equal_autograd_forward_mode(problem_cache):
    """:func:`tile_tangents` (analytic hot loop) against ``jvp`` of :func:`tile_image` by autograd, random tangents
    of every input, with a structure-factor table (the table's own tangents too)."""
    pmap, obj, _ = _case(problem_cache("tetragonal_mosflm", 32), True, False, analytic=True)
    sim = obj.sim
    captured = []
    original = kernel.accumulate_pixels

    def capture(pixels, inp, opt, *a, **k):
        captured.append((pixels, inp, opt))
        return original(pixels, inp, opt, *a, **k)

    import nbtorch.rendering as simulator
    simulator.accumulate_pixels, saved = capture, simulator.accumulate_pixels
    try:
        with torch.no_grad():
            sim.render_pixels(roi=obj.view.roi)
    finally:
        simulator.accumulate_pixels = saved
    pixels, inp, opt = captured[0]
    if inp.F_grid is None:  # exercise the table's tangents as well
        inp = kernel.KernelInputs(**{**{f: getattr(inp, f) for f in jacobian._INPUTS},
                                     "F_grid": torch.full((5, 5, 5), 80.0, dtype=torch.float64),
                                     "hkl_min": torch.tensor([-2.0, -2.0, -2.0], dtype=torch.float64),
                                     "hkl_max": torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64)})
    leaves = jacobian._leaves(pixels, inp)
    present = [i for i, x in enumerate(leaves) if x is not None]
    gen = torch.Generator().manual_seed(1)
    tangents = [None if x is None else 1e-3 * torch.randn((3,) + tuple(x.shape), dtype=x.dtype, generator=gen)
                * x.abs().max().clamp(min=1e-30) for x in leaves]
    static = jacobian._Static(opt, pixels.oversample, tuple(present))

    def image(*xs):
        px, q = static.rebuild(pixels.fast_index, pixels.slow_index, xs)
        return jacobian.tile_image(px, q, opt)

    prims = tuple(leaves[i] for i in present)
    ref = torch.func.vmap(lambda *t: torch.func.jvp(image, prims, t)[1])(*(tangents[i] for i in present))
    got = jacobian.tile_tangents(pixels, inp, opt, tangents)
    assert float(ref.abs().max()) > 0
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-10 * float(ref.abs().max()))


def test_compiling_off_means_eager(problem_cache, monkeypatch):
    """Inside ``nbtorch.eager()`` or with NANOBRAGG_DISABLE_COMPILE=1 the kernels are never used."""
    pmap, obj, _ = _case(problem_cache("tetragonal_mosflm", 32), True, False, analytic=True)
    calls = _compiled_path(monkeypatch, compile_for_real=False)
    with nbtorch.eager():
        assert runtime.compile_policy("jacobian")[0] is False
        unc.estimate_uncertainties(obj, pmap, pmap.raw0())
    monkeypatch.setenv("NANOBRAGG_DISABLE_COMPILE", "1")
    assert runtime.compile_policy("jacobian")[0] is False
    unc.estimate_uncertainties(obj, pmap, pmap.raw0())
    assert calls == []
    monkeypatch.setenv("NANOBRAGG_DISABLE_COMPILE", "0")
    assert runtime.compile_policy("jacobian")[0] is True
    unc.estimate_uncertainties(obj, pmap, pmap.raw0())
    assert calls


def test_small_tiles_stay_eager(problem_cache, monkeypatch):
    """Below JACOBIAN_TILE_EVALUATIONS (a 32 x 32 image is one small tile) nothing is compiled."""
    pmap, obj, _ = _case(problem_cache("tetragonal_mosflm", 32), True, False, analytic=True)
    calls = _compiled_path(monkeypatch, compile_for_real=False)
    monkeypatch.setattr(kernel, "JACOBIAN_TILE_EVALUATIONS", 10 ** 9)
    unc.estimate_uncertainties(obj, pmap, pmap.raw0())
    assert calls == []


@pytest.mark.slow
def test_compiled_kernels_equal_eager_jacfwd(problem_cache, monkeypatch):
    """The same through the real Inductor kernels (a first compile takes a minute or two)."""
    pmap, obj, _ = _case(problem_cache("tetragonal_mosflm", 32), True, True, analytic=True)
    old = unc.estimate_uncertainties(obj, pmap, pmap.raw0(), excess=3.0)
    calls = _compiled_path(monkeypatch, compile_for_real=True)
    new = unc.estimate_uncertainties(obj, pmap, pmap.raw0(), excess=3.0)
    assert calls and not jacobian_kernels._FAILED
    assert_same_esds(new, old)
