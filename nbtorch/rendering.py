"""The image of a :class:`~nbtorch.simulator.Simulator`, tile by tile: its pixels, the kernel's tiles, the eager
or compiled kernel (:mod:`nbtorch.runtime.policy` decides) and the merged diagnostics.

:class:`Rendering` holds the simulator's ``render``, ``render_pixels`` and the methods behind them; the
:class:`~nbtorch.simulator.Simulator` (which owns the parameters, the geometry and the crystal) inherits them.
:func:`phi_angles` and :func:`tile_pixels` are the spindle angles of the phi steps and the tile size.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import sys

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.physics.jacobian import tile_image_with_tangents
from nbtorch.physics.kernel import (
    JACOBIAN_TILE_EVALUATIONS, TilePixels, accumulate_pixels, analytic_orientation_sum, combine,
    compiled_jacobian_applies, orientation_sum, tile_pixel_terms,
)
from nbtorch.physics.square_sum import square_sum_backward
from nbtorch.runtime import policy as runtime

log = logging.getLogger(__name__)


def _cast_fields(obj, dtype: torch.dtype):
    """A frozen dataclass of tensors with its floating-point tensors cast to ``dtype`` (differentiably)."""
    return dataclasses.replace(obj, **{f.name: v.to(dtype) for f in dataclasses.fields(obj)
                                       if isinstance(v := getattr(obj, f.name), Tensor) and v.is_floating_point()})


def phi_angles(phi0: Tensor, phistep: float, phisteps: int, c_parity: bool, first_evaluation: bool = False) -> Tensor:
    """Spindle angles (rad) of each phi step: ``phi0 + k * phistep``.

    C parity: a step whose angle is exactly 0 reuses the rotation the loop
    applied last (the previous step, or the last step of the previous
    evaluation): the C only rotates when ``phi != 0``.  ``first_evaluation``:
    the angles the C's very first evaluation uses (nothing rotated yet).
    """
    k = torch.arange(phisteps, dtype=phi0.dtype, device=phi0.device)
    phi = phi0 + k * phistep
    if not c_parity or phisteps < 2:
        return phi
    out = []
    carried = torch.zeros_like(phi0) if first_evaluation else phi[-1]
    for j in range(phisteps):
        eff = torch.where(phi[j] == 0, carried, phi[j])
        out.append(eff)
        carried = eff
    return torch.stack(out)


# Inductor options of the hot loop's forward (square crystal, nearest-neighbour F).  Its body
# (three polynomial sincg and the Miller indices) is larger than Inductor's CPU thresholds for
# inlining a pointwise producer into a reduction, so by default it stores F_latt (orientations x
# pixels) and reduces it in a second pass; raised thresholds keep it one loop that reduces in
# registers (heavy 1024^2: ~10 % faster; docs/performance.md).  Only that forward, which runs
# without gradients, gets them: on the backward (a separate kernel) they inline every
# intermediate into each of its many consumers (minutes to compile); autograd graphs keep
# Inductor's defaults.
FUSE_HOT_LOOP = {"realize_opcount_threshold": 100_000, "realize_acc_reads_threshold": 100_000,
                 "realize_reads_threshold": 1_000}
# The backward only inlines values read many times (the Miller indices: by default each is stored,
# one extra pass over orientations x pixels apiece); its large per-axis derivative terms stay
# realized (float64 heavy 128^2 with cell, detector, N and default_F gradients: first compile
# 136 s, warm 0.031 s; Inductor's defaults 89 s and 0.053 s; FUSE_HOT_LOOP for both >240 s)
FUSE_BACKWARD = {"realize_reads_threshold": 1_000}


def tile_pixels(n_pix: int, most: int, bucket: bool) -> int:
    """Pixels per tile for ``n_pix`` pixels and tiles of at most ``most``: a multiple of 16 (the last tile padded).

    A compiled kernel is compiled for each tile shape (``dynamic=False``), so when the pixels fit in fewer than
    ``most`` and a compiled kernel may run (``bucket``: a compiled simulator, or tiles large enough for the esds'
    compiled Jacobian kernels), the tile is not the pixel count but the next of four sizes per octave
    (multiples of a quarter of the power of two below it): images and Jacobian blocks of different sizes share
    a few shapes (a GPU's one large tile, :func:`refine.modes.single.tile_evaluations`), at the price of under 25 %
    padding pixels in that one tile.
    """
    n = max(1, min(int(most), int(n_pix)))
    if bucket and n < most:
        step = max(16, 1 << max(n.bit_length() - 3, 0))
        n = min(-(-n // step) * step, int(most))
    return -(-n // 16) * 16


class Rendering:
    """The rendering half of :class:`~nbtorch.simulator.Simulator` (a mixin: it reads the simulator's setup,
    parameters, geometry, crystal and kernel options)."""

    def _pixel_indices(self, roi=None) -> tuple[Tensor, Tensor, Tensor | None]:
        """(slow, fast) indices of the ROI pixels to simulate, and their flat positions in
        the ROI (None when every ROI pixel is simulated; ``-mask`` zeros skip pixels).

        Cached per ROI (a refinement renders the same pixels at every step) for the
        current setup object, which a new pixel mask replaces (:func:`dataclasses.replace`).
        """
        x0, x1, y0, y1 = roi or self.setup.roi
        key = ((x0, x1, y0, y1), self.device)
        cache = self._setup_cache()
        if key in cache:
            return cache[key]
        slow = torch.arange(y0, y1 + 1, device=self.device)
        fast = torch.arange(x0, x1 + 1, device=self.device)
        ss, ff = torch.meshgrid(slow, fast, indexing="ij")
        ss, ff = ss.reshape(-1), ff.reshape(-1)
        mask = getattr(self.setup, "pixel_mask", None)
        if mask is None:
            out = (ss, ff, None)
        else:
            keep = torch.as_tensor(np.array(mask[y0:y1 + 1, x0:x1 + 1], dtype=bool).reshape(-1), device=self.device)
            where = torch.nonzero(keep).reshape(-1)
            out = (ss[where], ff[where], where)
        cache[key] = out
        return out

    def _setup_cache(self) -> dict:
        """A dict kept while the setup object stays the same (a new pixel mask replaces it): the tensors made from
        it, such as pixel indices and the model's mask on the device."""
        owner, cache = getattr(self, "_pixel_cache", (None, {}))
        if owner is not self.setup or len(cache) > 16:
            owner, cache = self.setup, {}
            self._pixel_cache = (owner, cache)
        return cache

    def _mask_tensor(self) -> Tensor:
        """The model's own ``-mask`` (bool (slow, fast)) on the simulator's device, made once per setup."""
        cache = self._setup_cache()
        key = ("pixel_mask", self.device)
        if key not in cache:
            cache[key] = torch.as_tensor(np.asarray(self.setup.pixel_mask, dtype=bool), device=self.device)
        return cache[key]

    def _positions(self, roi, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(slow, fast) indices of the given flat ROI positions, and the positions (:meth:`render_pixels`)."""
        x0, x1, y0, y1 = roi or self.setup.roi
        w, n = x1 - x0 + 1, (x1 - x0 + 1) * (y1 - y0 + 1)
        p = torch.as_tensor(positions, device=self.device)
        if p.dim() != 1 or p.dtype not in (torch.int64, torch.int32):
            raise InputError(f"pixels: expected a 1-d integer tensor of ROI positions, got {p.dtype} {tuple(p.shape)}")
        p = p.to(torch.int64)
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n):
            raise InputError(f"pixels: positions must lie in [0, {n}) (the ROI's {n} pixels), got "
                             f"{int(p.min())}..{int(p.max())}")
        return y0 + torch.div(p, w, rounding_mode="floor"), x0 + p % w, p

    def simulated_pixels(self, roi=None) -> Tensor | None:
        """Flat (row-major) positions in the ROI of the pixels :meth:`render` computes; None = all of them."""
        return self._pixel_indices(roi)[2]

    def evaluations_per_pixel(self) -> int:
        return self.setup.evaluations_per_pixel

    def render(self, roi=None, progress: bool = False, diagnostics: bool | None = None,
               **overrides) -> tuple[Tensor, dict[str, Tensor]]:
        """Image of the ROI (rows slow, columns fast) and diagnostics tensors.

        ``roi`` = (xmin, xmax, ymin, ymax) inclusive, default the config's ROI.
        ``progress`` shows a tqdm bar over the tiles (stderr).
        ``diagnostics``: also compute the HKL-lookup statistics (``fraction_default_F``,
        ``hkl0_min``, ``hkl0_max``); default: only when a hook is subscribed (they cost
        extra reductions in the hot loop).  Image statistics are always returned.
        """
        values, where, merged, roi = self._render_values(roi, progress, diagnostics, overrides)
        x0, x1, y0, y1 = roi
        if where is not None:  # masked pixels stay exactly 0 and are never computed
            values = values.new_zeros((y1 - y0 + 1) * (x1 - x0 + 1)).index_put((where,), values)
        return values.reshape(y1 - y0 + 1, x1 - x0 + 1), merged

    def render_pixels(self, roi=None, progress: bool = False, diagnostics: bool | None = None,
                      pixels: Tensor | None = None, **overrides) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """The simulated pixels of the ROI as one vector, without the masked pixels' zeros.

        Returns ``(values (n,), index (n,), diagnostics)``: ``index`` holds the flat
        row-major positions of ``values`` in the ROI (:meth:`render`'s image is ``values``
        put at ``index`` in zeros), so a sparse pixel mask costs nothing outside its pixels.
        Arguments and diagnostics as :meth:`render` (image statistics over the whole ROI).

        ``pixels``: the flat row-major positions in the ROI to compute instead of the simulator's own
        (int64 (n,), each in ``[0, ROI size)``; ``index`` is then ``pixels`` and ``values`` follow its
        order).  The simulator needs no pixel mask of the detector's size for that: a refinement of many
        images keeps only each image's fitted positions (:mod:`refine.many.pixel_table`).  A position the model's
        own ``-mask`` excludes gives exactly 0, as in :meth:`render`.
        """
        values, where, merged, roi = self._render_values(roi, progress, diagnostics, overrides, pixels)
        x0, x1, y0, y1 = roi
        index = where if where is not None else torch.arange((y1 - y0 + 1) * (x1 - x0 + 1), device=values.device)
        return values, index, merged

    def _render_values(self, roi, progress: bool, diagnostics: bool | None, overrides: dict,
                       positions: Tensor | None = None):
        """``(values, where, diagnostics, roi)``: the kernel over the ROI's simulated pixels (or ``positions``,
        :meth:`render_pixels`); the diagnostics (those of the ROI image, masked pixels 0) are also sent to the
        subscribed hooks."""
        want_diag = bool(len(self.diagnostics)) if diagnostics is None else bool(diagnostics)
        s = self.setup
        F_grid = overrides.pop("F_grid", self.F_grid)
        if F_grid is not None:
            F_grid = torch.as_tensor(F_grid, device=self.device).to(self.dtype)
        p = self.parameters_dict(**overrides)
        if F_grid is not None and self.F_present is not None:
            # reflections missing from the HKL file follow the (differentiable) default_F
            F_grid = torch.where(self.F_present, F_grid, p["default_F"])
        geom = self.geometry(p)
        inp = self.kernel_inputs(p, geom, F_grid)
        slow, fast, where = self._pixel_indices(roi) if positions is None else self._positions(roi, positions)
        t = self._t
        layers = torch.arange(s.thicksteps, dtype=self.dtype, device=self.device) * t(s.layer_thickness_m)
        pixel_m = t(s.pixel_m)
        if self.kernel_dtype != self.dtype:  # the kernel's inputs in its dtype (differentiable casts)
            geom, inp = _cast_fields(geom, self.kernel_dtype), _cast_fields(inp, self.kernel_dtype)
            layers, pixel_m = layers.to(self.kernel_dtype), pixel_m.to(self.kernel_dtype)
        tile = max(1, self.max_evals_per_tile // self.evaluations_per_pixel())
        real_first = None
        if s.phi_quirk and s.phisteps > 1:
            deg = math.pi / 180.0
            phi = phi_angles(p["phi0"].detach() * deg, s.phistep_deg * deg, s.phisteps, False)
            if bool((phi == 0).any()):
                real_first, _ = self.crystal(p, first_evaluation=True)
                real_first = real_first.to(self.kernel_dtype)
        pieces = []
        diags = []
        n_pix = slow.numel()
        # tiles hold a multiple of 16 pixels (the last one padded): with the pixel axis
        # innermost, vectorised math then never meets a scalar tail, so every pixel gets
        # the same bits whatever the tile size or its position in a tile
        bucket = self.compile_mode == "compiled" or n_pix * self.evaluations_per_pixel() >= JACOBIAN_TILE_EVALUATIONS
        tile = tile_pixels(n_pix, tile, bucket)
        starts = range(0, n_pix, tile)
        if progress:
            from tqdm import tqdm

            starts = tqdm(starts, desc="nbtorch", unit="tile", file=sys.stderr)
        kernel = self._kernel_for(tile, real_first is not None)
        # per pixel: (slow, fast), or for several panels (slow in its panel, fast, panel), split once
        columns = (slow, fast)
        if self.panel_layout is not None:
            columns, pixel_m = self._panel_pixels(slow, fast), self._panel_pixel_sizes()
        for start in starts:
            cols = [c[start:start + tile] for c in columns]
            n = cols[0].numel()
            if n < tile:  # pad the last tile so every call has the same (static) shape
                cols = [torch.cat([c, c[-1:].expand(tile - n)]) for c in cols]
            first = real_first if start == 0 else None
            pixels = TilePixels(geom, cols[1], cols[0], pixel_m, layers, s.oversample,
                                panel_index=cols[2] if len(cols) == 3 else None)
            values, diag = self._run_kernel(kernel, pixels, inp, first, want_diag)
            if n < tile:
                values = values[:n]
            pieces.append(values)
            diags.append(diag)
        values = (torch.cat(pieces) if pieces else layers.new_zeros(0)).to(self.dtype)
        if positions is not None and s.pixel_mask is not None:  # the model's own -mask: exactly 0
            keep = self._mask_tensor()[slow, fast]
            values = torch.where(keep, values, values.new_zeros(()))
        x0, x1, y0, y1 = roi or s.roi
        merged = _merge_diagnostics(diags, values, want_diag, (y1 - y0 + 1) * (x1 - x0 + 1))
        self.diagnostics.emit(merged)
        return values, where, merged, (x0, x1, y0, y1)

    def _panel_pixels(self, slow: Tensor, fast: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A multi-panel image's pixels as the kernel's first stage takes them (it gathers each pixel's panel:
        :meth:`~nbtorch.physics.kernel.TilePixels.per_pixel`): ``(slow index in the pixel's panel, fast,
        panel index)``, from the stacked image's slow index."""
        panel = torch.div(slow, self.panel_layout.rows, rounding_mode="floor")
        return slow - panel * self.panel_layout.rows, fast, panel

    def _panel_pixel_sizes(self) -> Tensor:
        """The panels' pixel edge (m) in the kernel's dtype: one value when they share it, else (N,)."""
        key = (id(self.panel_layout), self.kernel_dtype, self.device)
        if getattr(self, "_panel_sizes", (None,))[0] != key:
            sizes = self.panel_layout.pixel_sizes_m()
            self._panel_sizes = (key, torch.as_tensor(sizes[0] if np.all(sizes == sizes[0]) else sizes,
                                                      dtype=self.kernel_dtype, device=self.device))
        return self._panel_sizes[1]

    # --- compiled / eager kernel ---------------------------------------------------
    def set_compile(self, enabled: bool, reason: str) -> None:
        """Switch this simulator between compiled and eager (``nbtorch.eager()`` still wins)."""
        self.compile_mode = "compiled" if enabled and not runtime.in_eager_block() else "eager"
        self.compile_reason = reason

    def _kernel_key(self, tile: int, with_first: bool) -> tuple:
        s = self.setup
        dev = self.device
        return (
            dev.type, dev.index, str(self.kernel_dtype), self.options, tile, s.thicksteps, s.oversample,
            len(s.incident), s.phisteps, len(s.mosaic_fractions),
            None if s.F_grid is None else tuple(s.F_grid.shape), with_first,
        ) + (("panels",) if self.panel_layout is not None else ())

    def _kernel_for(self, tile: int, with_first: bool):
        """The compiled kernel: three separately compiled stages, or the whole function for the running-sum quirk."""
        if self.compile_mode != "compiled" or runtime.in_eager_block():
            return None
        key = self._kernel_key(tile, with_first)
        if self.options.running_sum_quirk:
            return runtime.compiled_kernel(key + ("whole",), accumulate_pixels)
        # compiled apart: fused into one graph, Inductor would recompute the per-pixel
        # geometry inside the orientation loop instead of loading it
        return (runtime.compiled_kernel(key + ("tile_pixel_terms",), tile_pixel_terms),
                self._hot_stage(key),
                runtime.compiled_kernel(key + ("combine",), combine))

    def _fuses_hot_loop(self) -> bool:
        """Whether the hot loop's forward gets :data:`FUSE_HOT_LOOP` (square crystal, no interpolation)."""
        return self.options.shape == "square" and not self.options.interpolate

    def _hot_stage(self, key: tuple):
        """:func:`analytic_orientation_sum` over three kernels compiled apart (see its docstring)."""
        fuse = FUSE_HOT_LOOP if self._fuses_hot_loop() else None
        return functools.partial(
            analytic_orientation_sum,
            plain=runtime.compiled_kernel(key + ("orientation_sum", "autograd"), orientation_sum),
            no_grad=runtime.compiled_kernel(key + ("orientation_sum",), orientation_sum, fuse),
            backward=runtime.compiled_kernel(key + ("square_sum_backward",), square_sum_backward, FUSE_BACKWARD),
        )

    def _eager_tile(self, pixels, inp, first, diagnostics: bool = False):
        """One tile eagerly: :func:`accumulate_pixels`, or inside :func:`~nbtorch.physics.kernel.analytic_jvp` with a
        runner, a large tile through the compiled forward-mode kernels (:mod:`nbtorch.physics.jacobian`)."""
        if (first is None and not diagnostics and self.panel_layout is None
                and compiled_jacobian_applies(pixels, inp, self.options)):
            return tile_image_with_tangents(pixels, inp, self.options), {}
        return accumulate_pixels(pixels, inp, self.options, real_first_A=first, diagnostics=diagnostics)

    def _run_kernel(self, kernel, pixels, inp, first, diagnostics: bool = False):
        if kernel is None or self.compile_mode != "compiled" or runtime.in_eager_block():
            return self._eager_tile(pixels, inp, first, diagnostics)
        try:
            if isinstance(kernel, tuple):
                return accumulate_pixels(pixels, inp, self.options, real_first_A=first, diagnostics=diagnostics,
                                         stages=kernel)
            return kernel(pixels, inp, self.options, real_first_A=first, diagnostics=diagnostics)
        except Exception as exc:  # compilation problems surface here, on first use
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise  # a CUDA graph's capture rule broken, not the compiler: the graph gives up, the kernel stays
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("torch.compile failed, falling back to eager for this simulator: %s", reason)
            self.compile_mode = "eager"
            self.compile_reason = f"compile failed: {reason}"
            return self._eager_tile(pixels, inp, first, diagnostics)


def _merge_diagnostics(diags: list[dict[str, Tensor]], image: Tensor, lookups: bool, n_roi: int) -> dict[str, Tensor]:
    """Image statistics, plus the tiles' HKL-lookup statistics when ``lookups``.

    ``image`` is the vector of the ROI's simulated pixels; the statistics are those of
    the ROI image of ``n_roi`` pixels (the masked ones 0).
    """
    with torch.no_grad():
        img = image.detach()
        out = {}
        if lookups:
            diags = [d for d in diags if d]
            if not diags:  # every pixel masked
                z = image.new_zeros(3)
                diags = [{"n_eval": image.new_ones(()), "n_default_F": image.new_zeros(()), "hkl0_min": z,
                          "hkl0_max": z}]
            out["fraction_default_F"] = sum(d["n_default_F"] for d in diags) / sum(d["n_eval"] for d in diags)
            out["hkl0_min"] = torch.stack([d["hkl0_min"] for d in diags]).amin(0)
            out["hkl0_max"] = torch.stack([d["hkl0_max"] for d in diags]).amax(0)
        if n_roi:
            total = img.sum()
            peak = img.max() if img.numel() else img.new_zeros(())
            if img.numel() < n_roi:  # masked pixels are 0
                peak = torch.clamp(peak, min=0.0)
            out.update(image_max=peak, image_mean=total / n_roi, image_sum=total)
        return out
