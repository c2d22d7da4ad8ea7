"""The per-pixel accumulation: the one copy of the diffraction physics.

``accumulate_pixels`` renders a tile of pixels (:class:`TilePixels`: the
detector geometry and the tile's pixel indices).  The full image, a tiled
image, an ROI and a single pixel all go through it.  It runs three pure
functions: :func:`tile_pixel_terms` (sub-pixel positions and the geometry
of every sub-pixel and source, :func:`pixel_terms`),
:func:`orientation_sum` (the hot loop over phi steps and mosaic domains) and
:func:`combine` (weights and scaling); the C-parity running-sum quirk keeps
every evaluation instead (:func:`_accumulate_evaluations`).

Loop structure (nanoBragg's, outermost first) for each pixel::

    layer t -> sub-pixel (subS, subF) -> source -> phi step -> mosaic domain

Every evaluation adds ``F_cell^2 F_latt^2``.  Shapes below: P pixels, T sensor
layers, S = oversample^2 sub-pixels, Q sources, Φ phi steps, M mosaic domains.

Scaling (photons per pixel)::

    spec:     r_e^2 fluence / steps * sum_{t,s,q} omega_ts P_tsq capture_ts sum_{phi,m} F^2 L^2
              + water (linear in fluence, independent of sampling)
    C parity: r_e^2 fluence / steps * (I_bg + sum F^2 L^2) * capture * P * omega
              with omega and P taken at the first sub-pixel/source, capture of the
              last layer, and the ``-oversample_*`` running-sum quirks

with ``steps = Q Φ M oversample^2`` (layers are not counted).

Forward-mode switch: :func:`analytic_jvp` sets a context variable that the eager hot stage
(:func:`eager_orientation_sum`) and the forward-mode kernels (:mod:`nbtorch.physics.jacobian`, through
:func:`jacobian_runner`) read.  Whether to compile is decided outside the physics
(:func:`nbtorch.runtime.policy.compile_policy`, purpose ``jacobian``), and the decision arrives here only as the runner
the caller passes to :func:`analytic_jvp`.  The variable itself must stay in the physics: it is read inside
the stages, whose signatures are fixed (the compiled stages share them), and the physics may import only torch
and itself, so it cannot read :mod:`nbtorch.runtime.policy`.  Which implementation renders an eager tile (these stages
or :func:`nbtorch.physics.jacobian.tile_image_with_tangents`, see :func:`compiled_jacobian_applies`) is chosen
by the simulator: :mod:`nbtorch.physics.jacobian` is built on this module, never the other way round.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
from torch import Tensor

from nbtorch.physics.detector import DetectorGeometry, flat_subpixel_components, pixel_geometry, subpixel_positions
from nbtorch.physics.lattice import lattice_factor_components, miller_indices, nearest_index
from nbtorch.physics.polarization import kahn_from_projections, polarization_basis
from nbtorch.physics.square_sum import square_orientation_sum, square_sum_backward
from nbtorch.physics.structure import in_grid, structure_factor

R_E_SQR = 7.94079248018965e-30  # Thomson cross-section r_e^2 (m^2)


@dataclass(frozen=True)
class KernelOptions:
    """Static (graph-shaping) options of the kernel; never tensors."""

    shape: str = "square"
    interpolate: bool = False
    nopolar: bool = False
    point_pixel: bool = False
    curved: bool = False
    c_parity: bool = False
    oversample_thick: bool = False
    oversample_polar: bool = False
    oversample_omega: bool = False
    has_thickness: bool = False
    has_water: bool = False
    use_dmin: bool = False

    @property
    def running_sum_quirk(self) -> bool:
        return self.c_parity and (self.oversample_thick or self.oversample_polar or self.oversample_omega)


@dataclass(frozen=True)
class KernelInputs:
    """Tensors the kernel needs besides the pixel positions (units in the names)."""

    incident: Tensor  # (Q, 3) unit vectors source -> sample
    wavelength_A: Tensor  # (Q,)
    real_A: Tensor  # (Φ, M, 3, 3) rows a, b, c per phi step and mosaic domain (Angstrom)
    recip_per_A: Tensor  # (3, 3) static reciprocal basis (1/A) for gauss/tophat
    n_cells: Tensor  # (3,)
    fudge: Tensor  # ()
    F_grid: Tensor | None  # (nh, nk, nl) or None
    hkl_min: Tensor | None  # (3,)
    hkl_max: Tensor | None  # (3,)
    default_F: Tensor  # ()
    polar_axis: Tensor  # (3,)
    kahn: Tensor  # ()
    odet: Tensor  # (3,)
    close_distance_m: Tensor  # ()
    pixel_m: Tensor  # ()
    mu_per_m: Tensor  # () sensor attenuation coefficient
    layer_thickness_m: Tensor  # () thickness of one sensor layer
    dmin_A: Tensor  # ()
    fluence: Tensor  # () photons/m^2
    steps: Tensor  # () normalisation count
    water_F2N: Tensor  # () F_bg^2 * number of water molecules


@dataclass(frozen=True)
class TilePixels:
    """The pixels of one tile, as the kernel's first stage receives them.

    The sub-pixel positions are computed inside that stage (compiled with it, so
    the (P, T, S, 3) positions are never stored), from ``geom`` (metres, lab
    frame), the (P,) integer ``fast_index``/``slow_index``, the pixel edge
    ``pixel_m``, the (T,) sensor-layer depths ``layers_m`` and ``oversample``
    (sub-pixels per edge, static).

    Several panels (``nbtorch.geometry.panels``): ``panel_index`` (P,) gives each pixel's panel, ``geom`` holds the
    panels stacked (:func:`~nbtorch.physics.detector.stack_geometries`), ``slow_index`` is the slow index in
    the pixel's own panel and ``pixel_m`` is () or (N,) per panel; :meth:`per_pixel` gathers each pixel's
    panel inside the first stage (so a compiled stage fuses the gather into its loads).
    """

    geom: DetectorGeometry
    fast_index: Tensor
    slow_index: Tensor
    pixel_m: Tensor
    layers_m: Tensor
    oversample: int
    panel_index: Tensor | None = None

    def per_pixel(self, inp: "KernelInputs") -> tuple["TilePixels", "KernelInputs"]:
        """A tile of several panels as a tile of one-pixel panels: the geometry of each pixel's panel
        (:func:`~nbtorch.physics.detector.pixel_geometry`) and the kernel inputs that follow the panel (normal,
        close distance, pixel size) per pixel."""
        g = pixel_geometry(self.geom, self.panel_index)
        pixel_m = self.pixel_m if self.pixel_m.dim() == 0 else self.pixel_m.index_select(0, self.panel_index)
        tile = TilePixels(g, self.fast_index, self.slow_index, pixel_m, self.layers_m, self.oversample)
        return tile, replace(inp, odet=g.odet, close_distance_m=g.close_distance, pixel_m=pixel_m)

    def positions_m(self, opt: "KernelOptions") -> Tensor:
        """(P, T, S, 3) sub-pixel positions (m) from the sample (:func:`subpixel_positions`)."""
        return subpixel_positions(self.geom, self.fast_index, self.slow_index, self.pixel_m, self.oversample,
                                  self.layers_m, curved=opt.curved, c_parity=opt.c_parity)

    def components_m(self, opt: "KernelOptions") -> tuple[Tensor, Tensor, Tensor]:
        """The same positions as x, y, z components, each (T, S, P) (:func:`pixel_terms`' layout)."""
        if opt.curved:
            return position_components(self.positions_m(opt))
        return flat_subpixel_components(self.geom, self.fast_index, self.slow_index, self.pixel_m, self.oversample,
                                        self.layers_m)


@dataclass(frozen=True)
class PixelTerms:
    """Per-(pixel, layer, sub-pixel, source) quantities, independent of the crystal orientation.

    ``scatter`` components are laid out (T, S, Q, P), pixel innermost and
    contiguous, ready for :func:`orientation_sum`; the others are (P, T, S) or
    (P, T, S, Q).
    """

    sx: Tensor  # (T, S, Q, P) scattering vector components (1/A)
    sy: Tensor
    sz: Tensor
    omega: Tensor  # (P, T, S) solid angle (sr; 1/m^2 for point pixels)
    capture: Tensor  # (P, T, S) fraction absorbed in the layer
    polar: Tensor  # (P, T, S, Q) polarization factor
    valid: Tensor  # (P, T, S, Q) inside the -dmin limit


def position_components(pos_m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(P, T, S, 3) positions -> x, y, z components, each (T, S, P) (the layout :func:`pixel_terms` takes)."""
    return tuple(pos_m[..., c].permute(1, 2, 0) for c in range(3))


def pixel_terms(pos_m: tuple[Tensor, Tensor, Tensor], inp: KernelInputs, opt: KernelOptions) -> PixelTerms:
    """Solid angle, capture, polarization and scattering vectors of every sub-pixel and source.

    ``pos_m``: x, y, z components (m) of the sub-pixel positions from the sample (lab
    frame), each (T, S, P).  Written on separate components with the pixel axis
    innermost (no trailing axis of 3), so a compiler vectorises it along pixels.
    """
    px, py, pz = pos_m
    T = px.shape[0]
    airpath = torch.sqrt(px * px + py * py + pz * pz)  # (T, S, P)
    d = (px / airpath, py / airpath, pz / airpath)  # unit diffracted ray
    o = inp.odet
    d_dot_o = d[0] * o[0] + d[1] * o[1] + d[2] * o[2]

    # --- solid angle and obliquity -------------------------------------------------
    if opt.point_pixel:
        omega = 1.0 / (airpath * airpath)
    elif opt.c_parity:
        omega = inp.pixel_m**2 / (airpath * airpath) * inp.close_distance_m / airpath
    elif opt.curved:
        omega = inp.pixel_m**2 / (airpath * airpath)
    else:
        omega = inp.pixel_m**2 / (airpath * airpath) * torch.abs(d_dot_o)

    # --- sensor capture fraction per layer -----------------------------------------
    if opt.has_thickness:
        t_idx = torch.arange(T, dtype=px.dtype, device=px.device)[:, None, None]
        dz = inp.layer_thickness_m * inp.mu_per_m / d_dot_o
        capture = torch.exp(-t_idx * dz) - torch.exp(-(t_idx + 1.0) * dz)
    else:
        capture = torch.ones_like(airpath)

    # --- scattering vectors per source: (T, S, Q, P) -----------------------------------
    inc = inp.incident  # (Q, 3)
    lam = inp.wavelength_A[:, None]  # (Q, 1)
    sx, sy, sz = ((d[c][:, :, None, :] - inc[:, c, None]) / lam for c in range(3))  # 1/A
    if opt.use_dmin:
        stol = 0.5 * torch.sqrt(sx * sx + sy * sy + sz * sz)
        valid = ~((stol > 0) & (inp.dmin_A * stol > 0.5))
    else:
        valid = torch.ones(sx.shape, dtype=torch.bool, device=px.device)
    if opt.nopolar:
        polar = torch.ones(sx.shape, dtype=px.dtype, device=px.device)
    else:
        e_in, b_in = polarization_basis(inc, inp.polar_axis)  # (Q, 3)

        def along(v: Tensor) -> Tensor:  # diffracted . v per source, (T, S, Q, P)
            return d[0][:, :, None, :] * v[:, 0, None] + d[1][:, :, None, :] * v[:, 1, None] \
                + d[2][:, :, None, :] * v[:, 2, None]

        polar = kahn_from_projections(along(inc), along(e_in), along(b_in), inp.kahn)
    return PixelTerms(sx.contiguous(), sy.contiguous(), sz.contiguous(), omega.permute(2, 0, 1),
                      capture.permute(2, 0, 1), polar.permute(3, 0, 1, 2), valid.permute(3, 0, 1, 2))


def tile_pixel_terms(pixels: TilePixels, inp: KernelInputs, opt: KernelOptions) -> PixelTerms:
    """:func:`pixel_terms` of a tile's sub-pixel positions (the first stage, positions included)."""
    if pixels.panel_index is not None:
        pixels, inp = pixels.per_pixel(inp)
    return pixel_terms(pixels.components_m(opt), inp, opt)


def orientation_sum(
    sx: Tensor, sy: Tensor, sz: Tensor, inp: KernelInputs, opt: KernelOptions, diagnostics: bool = False,
    real_A: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``sum over phi steps and mosaic domains of (F_cell F_latt)^2`` for every scattering vector.

    The hot loop of the simulator: ``s*`` are (..., P) components of the
    scattering vector (1/A); the result has their shape.  Miller indices are
    ``h_i = a_i . S`` for the crystal vectors ``real_A`` (Φ, M, 3, 3; default
    ``inp.real_A``).  Laid out (Φ, M, ..., P) with the pixel axis innermost, a
    compiler turns it into one loop vectorised along pixels that reduces over
    the orientations in registers, with nothing of size evaluations stored.

    ``diagnostics`` adds tensors ``n_eval``, ``n_default_F`` (lookups outside
    the HKL table), ``hkl0_min`` and ``hkl0_max`` (3,) (extra reductions: off
    unless asked for).  Gradients go through autograd (eager runs and gradcheck);
    the compiled simulator uses :func:`analytic_orientation_sum`.
    """
    real = inp.real_A if real_A is None else real_A
    h, k, l = miller_indices((sx, sy, sz), real)  # each (Φ, M, ..., P)
    hkl = (h, k, l)
    hkl0 = tuple(nearest_index(x) for x in hkl)
    f_latt = lattice_factor_components(hkl, hkl0, inp.n_cells, opt.shape, inp.recip_per_A, inp.fudge)
    flat = (-1,) + tuple(sx.shape)
    if inp.F_grid is None:  # every F is default_F: factor it out of the sum
        sums = inp.default_F**2 * (f_latt * f_latt).reshape(flat).sum(0)
    else:
        f_cell = structure_factor(hkl, hkl0, inp.F_grid, inp.hkl_min, inp.hkl_max, inp.default_F, opt.interpolate)
        sums = ((f_cell * f_latt) ** 2).reshape(flat).sum(0)
    return sums, (_diagnostics(hkl0, inp) if diagnostics else {})


def _wants_grad(sx: Tensor, sy: Tensor, sz: Tensor, inp: KernelInputs) -> bool:
    tensors = (sx, sy, sz, inp.real_A, inp.n_cells, inp.default_F, inp.F_grid, inp.recip_per_A, inp.fudge)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def analytic_orientation_sum(
    sx: Tensor, sy: Tensor, sz: Tensor, inp: KernelInputs, opt: KernelOptions, diagnostics: bool = False, *,
    plain: Callable = orientation_sum, no_grad: Callable = orientation_sum,
    backward: Callable = square_sum_backward,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`orientation_sum` with the hand-written backward where it applies (the compiled hot stage).

    For a square crystal whose structure-factor table needs no gradient, while
    gradients are recorded, this is
    :class:`~nbtorch.physics.square_sum.SquareOrientationSum`: its forward is
    ``no_grad`` (:func:`orientation_sum` run without gradients: the very kernel
    of a forward without gradients) and its backward ``backward``
    (:func:`~nbtorch.physics.square_sum.square_sum_backward`), several times
    cheaper than autograd's through the fused loop.  Otherwise ``plain`` runs
    (autograd), or ``no_grad`` when nothing needs a gradient.  The simulator
    passes compiled versions of the three functions (compiled apart, each with
    its own options); the tests compare the result with eager autograd.
    """
    if not _wants_grad(sx, sy, sz, inp):
        with torch.no_grad():  # nothing here needs a gradient
            return no_grad(sx, sy, sz, inp, opt, diagnostics)
    if opt.shape != "square" or opt.interpolate or (inp.F_grid is not None and inp.F_grid.requires_grad):
        return plain(sx, sy, sz, inp, opt, diagnostics)
    keys = DIAGNOSTICS_KEYS if diagnostics else ()

    def forward_fn(sx, sy, sz, real_A, n_cells, default_F):  # runs without gradients, on detached tensors
        q = _detached(inp, real_A=real_A, n_cells=n_cells, default_F=default_F)
        sums, diag = no_grad(sx.detach(), sy.detach(), sz.detach(), q, opt, diagnostics)
        return (sums, *(diag[k] for k in keys))

    out = square_orientation_sum(sx, sy, sz, inp.real_A, inp.n_cells, inp.F_grid, inp.hkl_min, inp.hkl_max,
                                 inp.default_F, forward_fn=forward_fn, backward_fn=backward)
    return out[0], dict(zip(keys, out[1:]))


_ANALYTIC_JVP = contextvars.ContextVar("nbtorch_analytic_jvp", default=False)
#: inside ``analytic_jvp(compiled=runner)``: tiles of at least this many evaluations go through the compiled
#: forward-mode kernels (:mod:`nbtorch.physics.jacobian`; a first compile costs ~1 min, then a load)
JACOBIAN_TILE_EVALUATIONS = 100_000


@contextlib.contextmanager
def analytic_jvp(compiled: Callable | None = None):
    """Inside: the eager hot loop goes through :class:`~nbtorch.physics.square_sum.SquareOrientationSum` where it
    applies, so that forward-mode derivatives (:func:`torch.func.jacfwd`) use its analytic ``jvp`` (the
    factors computed once for every tangent) instead of differentiating every operation of the loop.

    ``compiled``: a runner of compiled kernels, ``(kind, static, args) -> Tensor or None``
    (:func:`nbtorch.runtime.jacobian_kernels.run`; None from it: run eagerly).  With one, without gradient recording,
    each eager tile of a square crystal without interpolation of at least :data:`JACOBIAN_TILE_EVALUATIONS`
    evaluations goes through the forward-mode kernels of :mod:`nbtorch.physics.jacobian`, which it compiles
    (the caller decides whether compiling is allowed: :func:`nbtorch.runtime.policy.compile_policy` with purpose
    ``jacobian``; the physics itself never compiles or caches anything)."""
    token = _ANALYTIC_JVP.set(compiled if compiled is not None else True)
    try:
        yield
    finally:
        _ANALYTIC_JVP.reset(token)


def jacobian_runner() -> Callable | None:
    """The runner of compiled kernels given to :func:`analytic_jvp` (None outside it or without one)."""
    value = _ANALYTIC_JVP.get()
    return value if callable(value) else None


def compiled_jacobian_applies(pixels: "TilePixels", inp: KernelInputs, opt: KernelOptions) -> bool:
    """Whether this eager tile goes through the compiled forward-mode kernels of :mod:`nbtorch.physics.jacobian`
    (:func:`~nbtorch.physics.jacobian.tile_image_with_tangents`) instead of :func:`accumulate_pixels`: inside
    :func:`analytic_jvp` with a runner, without gradient recording, a square crystal without interpolation or
    the running-sum quirk, and at least :data:`JACOBIAN_TILE_EVALUATIONS` evaluations.  The caller that renders
    tiles (:class:`nbtorch.simulator.Simulator`) chooses between the two; this module never imports that one
    (it is built on this one)."""
    if jacobian_runner() is None or torch.is_grad_enabled() or opt.shape != "square" or opt.interpolate \
            or opt.running_sum_quirk:
        return False
    evaluations = (pixels.fast_index.numel() * pixels.layers_m.numel() * pixels.oversample ** 2
                   * inp.incident.shape[0] * inp.real_A.shape[0] * inp.real_A.shape[1])
    return evaluations >= JACOBIAN_TILE_EVALUATIONS


def eager_orientation_sum(sx: Tensor, sy: Tensor, sz: Tensor, inp: KernelInputs, opt: KernelOptions,
                          diagnostics: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """The eager hot stage: :func:`orientation_sum`, or inside :func:`analytic_jvp` for a square crystal whose
    structure factors need no derivative, the same sum through the analytic forward-mode derivative."""
    if diagnostics or not _ANALYTIC_JVP.get() or opt.shape != "square" or opt.interpolate or (
            inp.F_grid is not None and inp.F_grid.requires_grad):
        return orientation_sum(sx, sy, sz, inp, opt, diagnostics)
    # the forward is square_sum of the Function's own inputs (an autograd.Function under torch.func may not
    # use tensors it did not receive)
    out = square_orientation_sum(sx, sy, sz, inp.real_A, inp.n_cells, inp.F_grid, inp.hkl_min, inp.hkl_max,
                                 inp.default_F)
    return out[0], {}


def _detached(inp: KernelInputs, **tensors: Tensor) -> KernelInputs:
    """``inp`` with ``tensors`` swapped in and every tensor detached (same metadata: same compiled graph)."""
    values = {f.name: getattr(inp, f.name) for f in fields(inp)}
    values.update(tensors)
    return KernelInputs(**{k: v.detach() if isinstance(v, Tensor) else v for k, v in values.items()})


def combine(sums: Tensor, terms: PixelTerms, inp: KernelInputs, opt: KernelOptions) -> Tensor:
    """Photons per pixel (P,) from the orientation sums (T, S, Q, P) and the pixel terms (spec or C parity)."""
    if opt.use_dmin:
        sums = torch.where(terms.valid.permute(1, 2, 3, 0), sums, torch.zeros_like(sums))
    scale = R_E_SQR * inp.fluence / inp.steps
    if not opt.c_parity:
        weight = (terms.omega * terms.capture)[..., None] * terms.polar  # (P, T, S, Q)
        image = scale * (sums.permute(3, 0, 1, 2) * weight).sum((1, 2, 3))
        if opt.has_water:
            image = image + R_E_SQR * inp.fluence * inp.water_F2N * weight.mean((2, 3)).sum(1)
        return image
    P = sums.shape[-1]
    # the C adds its water background I_bg = r_e^2 fluence F_bg^2 N_water to the sum before scaling
    I_bg = R_E_SQR * inp.fluence * inp.water_F2N if opt.has_water else 0.0
    polar_first = terms.polar.new_ones(P) if opt.nopolar else _first_valid(terms.polar, terms.valid)
    total = I_bg + sums.reshape(-1, P).sum(0)
    return scale * total * terms.capture[:, -1, 0] * polar_first * terms.omega[:, 0, 0]


Stages = tuple[Callable, Callable, Callable]
EAGER_STAGES: Stages = (tile_pixel_terms, eager_orientation_sum, combine)


def accumulate_pixels(
    pixels: TilePixels,
    inp: KernelInputs,
    opt: KernelOptions,
    real_first_A: Tensor | None = None,
    diagnostics: bool = False,
    stages: Stages = EAGER_STAGES,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Photons per pixel for a tile of pixels.

    Arguments:
        pixels: the tile's pixels (:class:`TilePixels`).
        inp: tensors (see :class:`KernelInputs`).
        opt: static options (see :class:`KernelOptions`).
        real_first_A: optional (Φ, M, 3, 3) crystal vectors for the very first
            evaluation of pixel 0 (first layer, sub-pixel and valid source): the C
            program's first evaluation still sees the un-rotated phi=0 vectors.
        diagnostics: also return lookup statistics (see :func:`orientation_sum`).
        stages: the three pure functions ``(tile_pixel_terms, orientation_sum, combine)``
            to run; the simulator passes compiled versions of the same functions
            (compiled separately: fused into one graph, the per-pixel geometry
            would be recomputed inside the hot loop).

    Returns:
        ``(image (P,), diagnostics)``; diagnostics hold tensors ``n_eval``,
        ``n_default_F``, ``hkl0_min``, ``hkl0_max`` when asked for, else nothing.
    """
    if opt.running_sum_quirk:
        return _accumulate_evaluations(pixels, inp, opt, real_first_A, diagnostics)
    pre, hot, post = stages
    terms = pre(pixels, inp, opt)
    sums, diag = hot(terms.sx, terms.sy, terms.sz, inp, opt, diagnostics)
    if real_first_A is not None:
        sums = _replace_first_evaluation(sums, terms, inp, opt, real_first_A)
    return post(sums, terms, inp, opt), diag


def _replace_first_evaluation(sums: Tensor, terms: PixelTerms, inp: KernelInputs, opt: KernelOptions,
                              real_first_A: Tensor) -> Tensor:
    """Swap in the orientation sum of (pixel 0, layer 0, sub-pixel 0, first valid source) with ``real_first_A``.

    Only that one (Φ·M)-term sum changes; no data-dependent indexing.
    """
    first, _ = orientation_sum(terms.sx[0, 0, :, :1], terms.sy[0, 0, :, :1], terms.sz[0, 0, :, :1], inp, opt,
                               real_A=real_first_A)  # (Q, 1)
    return torch.where(_first_evaluation_mask(terms), first[None, None], sums)


def _first_evaluation_mask(terms: PixelTerms) -> Tensor:
    """(T, S, Q, P) True only at pixel 0, layer 0, sub-pixel 0 and the first valid source."""
    T, S, Q, P = terms.sx.shape
    dev = terms.sx.device
    q = torch.argmax(terms.valid[0, 0, 0].to(torch.int8))
    return (
        (torch.arange(T, device=dev) == 0)[:, None, None, None]
        & (torch.arange(S, device=dev) == 0)[None, :, None, None]
        & (torch.arange(Q, device=dev) == q)[None, None, :, None]
        & (torch.arange(P, device=dev) == 0)[None, None, None, :]
    )


def _accumulate_evaluations(pixels, inp, opt, real_first_A, diagnostics):
    """C parity with the ``-oversample_thick/_polar/_omega`` running-sum quirk: every evaluation kept."""
    terms = tile_pixel_terms(pixels, inp, opt)
    real = inp.real_A
    hkl = miller_indices((terms.sx, terms.sy, terms.sz), real)  # each (Φ, M, T, S, Q, P)
    if real_first_A is not None:
        first = miller_indices((terms.sx[0, 0, :, 0], terms.sy[0, 0, :, 0], terms.sz[0, 0, :, 0]), real_first_A)
        at = _first_evaluation_mask(terms)
        hkl = tuple(torch.where(at, f[:, :, None, None, :, None], x) for f, x in zip(first, hkl))
    hkl0 = tuple(nearest_index(x) for x in hkl)
    f_latt = lattice_factor_components(hkl, hkl0, inp.n_cells, opt.shape, inp.recip_per_A, inp.fudge)
    f_cell = structure_factor(hkl, hkl0, inp.F_grid, inp.hkl_min, inp.hkl_max, inp.default_F, opt.interpolate)
    term = (f_cell * f_latt) ** 2  # (Φ, M, T, S, Q, P)
    valid_l = terms.valid.permute(1, 2, 3, 0)
    if opt.use_dmin:
        term = torch.where(valid_l, term, torch.zeros_like(term))
    water_c = R_E_SQR * inp.fluence * inp.water_F2N if opt.has_water else None
    scale = R_E_SQR * inp.fluence / inp.steps
    image = _c_parity_sum(term, terms.valid, terms.omega, terms.capture, terms.polar, f_latt, water_c, scale, opt)
    return image, (_diagnostics(hkl0, inp) if diagnostics else {})


def _first_valid(values: Tensor, valid: Tensor) -> Tensor:
    """Per pixel, the value at the first valid (t, s, q) in C loop order; 0 if none."""
    P = values.shape[0]
    v = values.reshape(P, -1)
    m = valid.reshape(P, -1)
    idx = torch.argmax(m.to(torch.int8), dim=1)
    first = v.gather(1, idx[:, None])[:, 0]
    return torch.where(m.any(1), first, torch.zeros_like(first))


def _c_parity_sum(term, valid, omega, capture, polar, f_latt, water_c, scale, opt: KernelOptions) -> Tensor:
    """nanoBragg's per-pixel running sum for the ``-oversample_*`` quirks (module docstring).

    ``term`` and ``f_latt`` come in the kernel's layout (Φ, M, T, S, Q, P); the
    C multiplies its running sum by ``g_k`` after every evaluation ``k``:
    ``I = (I + t_k) g_k``, in loop order.
    """
    P = term.shape[-1]
    I_bg = water_c if water_c is not None else torch.zeros((), dtype=term.dtype, device=term.device)
    omega_q = omega[..., None].expand_as(polar)
    capture_q = capture[..., None].expand_as(polar)
    polar_first = polar.new_ones(P) if opt.nopolar else _first_valid(polar, valid)
    term = term.permute(5, 2, 3, 4, 0, 1)  # (P, T, S, Q, Φ, M): the C's loop order per pixel
    f_latt = f_latt.permute(5, 2, 3, 4, 0, 1)
    g = torch.ones_like(polar)
    if opt.oversample_thick:
        g = g * capture_q
    if opt.oversample_polar:
        g = g * polar
    if opt.oversample_omega:
        g = g * omega_q
    g = g[..., None, None].expand_as(term)
    counted = valid[..., None, None].expand_as(term)
    if water_c is None:
        counted = counted & (f_latt != 0)
    g = torch.where(counted, g, torch.ones_like(g)).reshape(P, -1)
    t = term.reshape(P, -1)
    suffix = torch.flip(torch.cumprod(torch.flip(g, (1,)), 1), (1,))
    total = I_bg * suffix[:, 0] + (t * suffix).sum(1)
    out = scale * total
    if not opt.oversample_thick:
        out = out * capture[:, -1, 0]
    if not opt.oversample_polar:
        out = out * polar_first
    if not opt.oversample_omega:
        out = out * omega[:, 0, 0]
    return out


DIAGNOSTICS_KEYS = ("n_eval", "n_default_F", "hkl0_min", "hkl0_max")


def _diagnostics(hkl0: tuple[Tensor, Tensor, Tensor], inp: KernelInputs) -> dict[str, Tensor]:
    with torch.no_grad():
        h0 = hkl0[0]
        n_eval = torch.tensor(float(h0.numel()), dtype=torch.float64, device=h0.device)
        if inp.F_grid is None:
            outside = n_eval
        else:
            outside = (~in_grid(hkl0, inp.hkl_min, inp.hkl_max)).sum().to(torch.float64)
        return {
            "n_eval": n_eval,
            "n_default_F": outside,
            "hkl0_min": torch.stack([x.amin() for x in hkl0]),
            "hkl0_max": torch.stack([x.amax() for x in hkl0]),
        }
