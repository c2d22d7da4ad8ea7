"""Forward-mode derivatives of a tile's pixels through compiled kernels (the esds' Jacobian).

:func:`refine.quality.uncertainty.pixel_jacobian` pushes the P tangents of the free parameters through the
model at once (:func:`torch.func.jacfwd`).  Eagerly, the hot loop (orientations x evaluations) and the
pixel geometry then run as a few hundred separate passes over memory, each with the P tangents
batched (~2.3 s on the thaumatin tutorial).  Inside :func:`~nbtorch.physics.kernel.analytic_jvp` with
``compiled=True`` each tile of a square crystal without interpolation is instead one call of two
compiled kernels, entered through two :class:`torch.autograd.Function`\\ s, while the cheap rest of the
model (the parameters' mapping to the kernel's inputs, the scale and background) stays in eager
``jacfwd``:

* :class:`TileImage`: the photons of one tile (:func:`tile_image`, compiled), whose ``jvp`` hands the
  tangents of every kernel input to
* :class:`TileTangents`: whose ``vmap`` rule receives ``jacfwd``'s P tangents as plain tensors with a
  batch axis and calls :func:`tile_tangents` (compiled) on all of them at once.

:func:`tile_tangents` is the forward-mode derivative of :func:`tile_image`: autograd's forward mode
(``torch.func.jvp`` under ``vmap``) for the pixel geometry
(:func:`~nbtorch.physics.kernel.tile_pixel_terms`) and the weighting
(:func:`~nbtorch.physics.kernel.combine`), and for the hot loop the analytic tangent
(:func:`square_sum_tangents`: the factors of :func:`~nbtorch.physics.square_sum.square_sum_jvp`
computed once per evaluation, then a few products per tangent).  The tangents are padded to a
multiple of :data:`TANGENT_BLOCK`, so that runs with a few more or fewer free parameters (the esds and
``--esd-extra``) share one kernel.

How the kernels are compiled (:mod:`nbtorch.runtime.jacobian_kernels`, outside the physics, which compiles and caches
nothing itself): ``torch.func`` inside a ``torch.compile`` graph leaves guards that torch's
precompile cannot save (so every process would trace again, ~10-40 s), so both functions are traced
to plain ATen graphs (``make_fx``) and compiled by Inductor's standalone API
(``torch._inductor.standalone_compile``); the compiled artifact is saved with torch's own
``CompiledArtifact.save`` in ``$NBTORCH_CACHE_DIR/precompiled/torch-<version>/`` under a digest of
the arguments' kind, the static options, the thread count and the source of ``nbtorch/physics``
(an edited kernel never loads), and a later process loads it (``CompiledArtifact.load``) without
tracing.  ``NBTORCH_PRECOMPILE=0``: compiled in each process, nothing saved or loaded.  A failing
compile logs one warning and the same functions run eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch
from torch import Tensor

from nbtorch.physics.detector import DetectorGeometry
from nbtorch.physics.kernel import KernelInputs, KernelOptions, PixelTerms, TilePixels, combine, jacobian_runner, \
    orientation_sum, tile_pixel_terms
from nbtorch.physics.square_sum import square_sum_factors
from nbtorch.physics.structure import nearest_structure_factor

__all__ = ["tile_image", "tile_tangents", "square_sum_tangents", "tile_image_with_tangents",
           "TileImage", "TileTangents", "TANGENT_BLOCK"]

log = logging.getLogger(__name__)

#: tangents per compiled kernel call are padded to a multiple of this (one kernel for 9-12 free parameters)
TANGENT_BLOCK = 4

_GEOM = tuple(f.name for f in dataclasses.fields(DetectorGeometry))
_INPUTS = tuple(f.name for f in dataclasses.fields(KernelInputs))
#: the kernel's floating-point inputs, in order: the detector geometry, the pixel edge, the layer depths, then
#: the kernel inputs (those that are None are left out: see :func:`_leaves`)
LEAVES = tuple(f"geom.{n}" for n in _GEOM) + ("pixel_m", "layers_m") + _INPUTS


def _leaves(pixels: TilePixels, inp: KernelInputs) -> tuple[Tensor | None, ...]:
    g = pixels.geom
    return (tuple(getattr(g, n) for n in _GEOM) + (pixels.pixel_m, pixels.layers_m)
            + tuple(getattr(inp, n) for n in _INPUTS))


def _placed(n: int, present: Sequence[int], xs: Sequence[Tensor]) -> list:
    """A list of ``n`` entries with ``xs`` at the positions ``present`` and None elsewhere."""
    out: list = [None] * n
    for i, x in zip(present, xs):
        out[i] = x
    return out


def _rebuild(fast: Tensor, slow: Tensor, oversample: int, leaves: Sequence[Tensor | None]) \
        -> tuple[TilePixels, KernelInputs]:
    ng = len(_GEOM)
    geom = DetectorGeometry(*leaves[:ng])
    pixels = TilePixels(geom, fast, slow, leaves[ng], leaves[ng + 1], oversample)
    return pixels, KernelInputs(*leaves[ng + 2:])


def tile_image(pixels: TilePixels, inp: KernelInputs, opt: KernelOptions) -> Tensor:
    """Photons per pixel of a tile (P,): the kernel's three stages in one function (compiled as one graph)."""
    terms = tile_pixel_terms(pixels, inp, opt)
    sums, _ = orientation_sum(terms.sx, terms.sy, terms.sz, inp, opt)
    return combine(sums, terms, inp, opt)


def square_sum_tangents(sx: Tensor, sy: Tensor, sz: Tensor, real_A: Tensor, n_cells: Tensor, F_grid: Tensor | None,
                        hkl_min: Tensor | None, hkl_max: Tensor | None, default_F: Tensor, d_s: Sequence[Tensor],
                        d_real: Tensor, d_n: Tensor, d_f: Tensor, d_grid: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(sums, tangents)``: :func:`~nbtorch.physics.square_sum.square_sum` (``sx`` ... of shape (..., X)) and its
    tangents (K, ..., X) for K tangents of each input at once, each with a leading axis of K: ``d_s`` of
    ``sx, sy, sz``, ``d_real`` (K, Φ, M, 3, 3), ``d_n`` (K, 3), ``d_f`` (K,), ``d_grid`` (K, grid) or None.

    As :func:`~nbtorch.physics.square_sum.square_sum_jvp` (same factors, same formula)::

        d sums[x] = sum_j grad_S_j[x] dS_j[x] + sum_{e,i,j} G_i[e, x] S_j[x] dA_ij(e)
                    + sum_i D_i[x] dN_i + Fd[x] d default_F + sum_e 2 F L^2 dF[e, x]

    the factors computed once, each tangent costing a few products (``dA`` a matrix product).
    """
    shape = tuple(sx.shape)
    K = d_real.shape[0]
    hkl0, parts, others, latt, F, defaulted = square_sum_factors(sx, sy, sz, real_A, n_cells, F_grid, hkl_min,
                                                                 hkl_max, default_F, True)
    common = (2.0 * F * F) * latt
    E, X = real_A.shape[0] * real_A.shape[1], sx.numel()
    sums = ((F * latt) ** 2).reshape(E, X).sum(0)
    G = torch.stack([(common * others[i] * parts[i][1]).reshape(E, X) for i in range(3)], 1)  # (E, 3, X)
    grad_S = real_A.reshape(E * 3, 3).transpose(0, 1) @ G.reshape(E * 3, X)  # (3, X)
    out = sum(grad_S[j] * d_s[j].reshape(K, X) for j in range(3))  # (K, X)
    S = torch.stack((sx, sy, sz), 0).reshape(1, 1, 3, X)
    W = (G.reshape(E, 3, 1, X) * S).reshape(E * 9, X)
    out = out + d_real.reshape(K, E * 9) @ W
    D = torch.stack([(common * others[i] * parts[i][2]).reshape(E, X).sum(0) for i in range(3)], 0)  # (3, X)
    out = out + d_n @ D
    d = (2.0 * default_F) * latt * latt
    d = d if defaulted is None else torch.where(defaulted, d, torch.zeros_like(d))
    out = out + d_f[:, None] * d.reshape(E, X).sum(0)
    if d_grid is not None:  # the table's own entries (reflections that follow default_F)
        dF = torch.func.vmap(lambda g: nearest_structure_factor(tuple(hkl0), g, hkl_min, hkl_max,
                                                                torch.zeros_like(default_F)))(d_grid)
        out = out + ((2.0 * F * latt * latt) * dF).reshape(K, E, X).sum(1)
    return sums.reshape(shape), out.reshape((K,) + shape)


_TERMS = ("sx", "sy", "sz", "omega", "capture", "polar")


def tile_tangents(pixels: TilePixels, inp: KernelInputs, opt: KernelOptions,
                  tangents: Sequence[Tensor | None]) -> Tensor:
    """(K, P): the tangents of :func:`tile_image` for K tangents of its inputs, ``tangents`` in the order of
    :data:`LEAVES`, each (K, *shape of the input), None where the input is None (the compiled kernel)."""
    leaves = _leaves(pixels, inp)
    idx = [i for i, x in enumerate(leaves) if x is not None]
    prim = tuple(leaves[i] for i in idx)
    tan = tuple(tangents[i] for i in idx)
    fast, slow, oversample = pixels.fast_index, pixels.slow_index, pixels.oversample

    def pre(*xs: Tensor) -> tuple[Tensor, ...]:
        px, q = _rebuild(fast, slow, oversample, _placed(len(leaves), idx, xs))
        terms = tile_pixel_terms(px, q, opt)
        return tuple(getattr(terms, n) for n in _TERMS)

    terms = tile_pixel_terms(pixels, inp, opt)
    d_terms = torch.func.vmap(lambda *t: torch.func.jvp(pre, prim, t)[1])(*tan)
    ng = len(_GEOM) + 2
    d_inp = KernelInputs(*tangents[ng:])
    d_grid = d_inp.F_grid if inp.F_grid is not None else None
    sums, d_sums = square_sum_tangents(terms.sx, terms.sy, terms.sz, inp.real_A, inp.n_cells, inp.F_grid,
                                       inp.hkl_min, inp.hkl_max, inp.default_F, d_terms[:3], d_inp.real_A,
                                       d_inp.n_cells, d_inp.default_F, d_grid)
    inp_idx = [i for i, x in enumerate(leaves[ng:]) if x is not None]
    prim_inp = tuple(leaves[ng + i] for i in inp_idx)

    def post(s: Tensor, *xs: Tensor) -> Tensor:
        t = dict(zip(_TERMS, xs[:len(_TERMS)]))
        values = _placed(len(_INPUTS), inp_idx, xs[len(_TERMS):])
        return combine(s, PixelTerms(**t, valid=terms.valid), KernelInputs(*values), opt)

    primals = (sums,) + tuple(getattr(terms, n) for n in _TERMS) + prim_inp
    d_post = (d_sums,) + tuple(d_terms) + tuple(tangents[ng + i] for i in inp_idx)
    return torch.func.vmap(lambda *t: torch.func.jvp(post, primals, t)[1])(*d_post)


# --- the compiled kernels: flat functions of tensors, traced and compiled once per kind of arguments ---------

@dataclasses.dataclass(frozen=True)
class _Static:
    """What a tile's kernels are specialised on besides tensor shapes: the options, the sub-pixels per edge and
    which of :data:`LEAVES` are present (the others are None)."""

    opt: KernelOptions
    oversample: int
    present: tuple[int, ...]

    def rebuild(self, fast: Tensor, slow: Tensor, xs: Sequence[Tensor]) -> tuple[TilePixels, KernelInputs]:
        return _rebuild(fast, slow, self.oversample, self.full(xs))

    def full(self, xs: Sequence[Tensor]) -> list:
        return _placed(len(LEAVES), self.present, xs)


def _image_flat(static: _Static, fast: Tensor, slow: Tensor, *prims: Tensor) -> Tensor:
    pixels, inp = static.rebuild(fast, slow, prims)
    return tile_image(pixels, inp, static.opt)


def _tangents_flat(static: _Static, fast: Tensor, slow: Tensor, *xs: Tensor) -> Tensor:
    n = len(xs) // 2
    pixels, inp = static.rebuild(fast, slow, xs[:n])
    return tile_tangents(pixels, inp, static.opt, static.full(xs[n:]))


#: the two kernels' functions, ``(static, fast_index, slow_index, *tensors) -> Tensor``, by kind
KERNEL_FUNCTIONS = {"image": _image_flat, "tangents": _tangents_flat}


def _run(kind: str, static: _Static, args: list[Tensor]) -> Tensor:
    """``KERNEL_FUNCTIONS[kind](static, *args)`` through the compiled kernel of the runner given to
    :func:`~nbtorch.physics.kernel.analytic_jvp` (:func:`nbtorch.runtime.jacobian_kernels.run`), or eagerly when it has
    none (compiling off or failed)."""
    runner = jacobian_runner()
    out = None if runner is None else runner(kind, static, args)
    if out is not None:
        return out
    with torch.no_grad():
        return KERNEL_FUNCTIONS[kind](static, *args)


def _padded(tangents: Sequence[Tensor], K: int) -> list[Tensor]:
    """Each (K, ...) tangent padded with zero directions to a multiple of :data:`TANGENT_BLOCK` (contiguous)."""
    Kp = -(-max(K, 1) // TANGENT_BLOCK) * TANGENT_BLOCK
    if Kp == K:
        return [t.contiguous() for t in tangents]
    return [torch.cat([t, t.new_zeros((Kp - K,) + tuple(t.shape[1:]))]) for t in tangents]


def _tangents(static: _Static, fast: Tensor, slow: Tensor, prims: Sequence[Tensor], tangents: Sequence[Tensor],
              K: int) -> Tensor:
    """(K, P) tangents of the tile's pixels for K directions (each tangent (K, *shape of its input))."""
    out = _run("tangents", static, [fast, slow, *prims, *_padded(tangents, K)])
    return out[:K]


class TileImage(torch.autograd.Function):
    """The photons of one tile (:func:`tile_image`, compiled); forward mode only (its ``jvp`` is
    :class:`TileTangents`).  Arguments: ``(static, fast_index, slow_index, *present inputs)``."""

    @staticmethod
    def forward(static: _Static, fast: Tensor, slow: Tensor, *prims: Tensor) -> Tensor:  # type: ignore[override]
        return _run("image", static, [fast, slow, *(p.detach() for p in prims)])

    @staticmethod
    def setup_context(ctx, inputs, output):
        static, fast, slow, *prims = inputs
        ctx.static = static
        ctx.save_for_forward(fast, slow, *prims)

    @staticmethod
    def jvp(ctx, _static, _fast, _slow, *tangents):  # type: ignore[override]
        fast, slow, *prims = ctx.saved_tensors
        tangents = [torch.zeros_like(p) if t is None else t for p, t in zip(prims, tangents)]
        return TileTangents.apply(ctx.static, fast, slow, len(prims), *prims, *tangents)

    @staticmethod
    def vmap(info, in_dims, static, fast, slow, *prims):  # type: ignore[override]
        if all(d is None for d in in_dims[1:]):  # jacfwd: the primal is not batched
            return TileImage.forward(static, fast, slow, *prims), None
        args = [fast, slow, *prims]
        out = [TileImage.forward(static, *[a if d is None else a.select(d, b) for a, d in zip(args, in_dims[1:])])
               for b in range(info.batch_size)]
        return torch.stack(out), 0

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError("nbtorch.physics.jacobian.TileImage: forward-mode derivatives only (reverse mode: "
                           "the simulator's own kernels)")


class TileTangents(torch.autograd.Function):
    """The tangents of :class:`TileImage`'s pixels; under ``vmap`` (``jacfwd``) all directions at once in one
    compiled call.  Arguments: ``(static, fast_index, slow_index, n, *n inputs, *n tangents)``."""

    @staticmethod
    def forward(static: _Static, fast: Tensor, slow: Tensor, n: int, *rest: Tensor) -> Tensor:  # type: ignore[override]
        return _tangents(static, fast, slow, rest[:n], [t[None] for t in rest[n:]], 1)[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, static, fast, slow, n, *rest):  # type: ignore[override]
        if any(d is not None for d in in_dims[1:3] + in_dims[4:4 + n]):
            raise RuntimeError("nbtorch.physics.jacobian.TileTangents: batched primal inputs are not supported "
                               "(only batched tangents, as torch.func.jacfwd makes them)")
        K = info.batch_size
        tangents = [t.expand((K,) + tuple(t.shape)) if d is None else t.movedim(d, 0)
                    for t, d in zip(rest[n:], in_dims[4 + n:])]
        return _tangents(static, fast, slow, rest[:n], tangents, K), 0

    @staticmethod
    def jvp(ctx, *tangents):  # type: ignore[override]
        raise RuntimeError("nbtorch.physics.jacobian.TileTangents: no second derivatives")

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError("nbtorch.physics.jacobian.TileTangents: no second derivatives")


def tile_image_with_tangents(pixels: TilePixels, inp: KernelInputs, opt: KernelOptions) -> Tensor:
    """:func:`tile_image` through :class:`TileImage`: forward-mode derivatives (``torch.func.jacfwd``) through
    the compiled kernels (module docstring)."""
    leaves = _leaves(pixels, inp)
    present = tuple(i for i, x in enumerate(leaves) if x is not None)
    static = _Static(opt, int(pixels.oversample), present)
    return TileImage.apply(static, pixels.fast_index, pixels.slow_index, *(leaves[i] for i in present))
