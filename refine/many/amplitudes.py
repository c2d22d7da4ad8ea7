"""Structure factors shared by the images of a joint refinement (:func:`refine.many.joint.refine_joint` with
``structure_factors=AmplitudeOptions(...)``; ``nbtorch-refine --images ... --joint --structure-factors``).

All images are stills of one crystal form, so one amplitude ``F_h_k_l`` per symmetry-unique reflection
(:mod:`refine.fitting.structure_factors`) serves them all:

* **one table**: it covers the union of the index ranges each image's fitted pixels touch at its start (with
  the margin); its entries start from image 0's model (``-hkl`` file or ``-default_F``), and every image's
  simulator holds the same table (:meth:`~nbtorch.simulator.Simulator.with_structure_factors`), so every
  kernel sees the shared amplitudes of each evaluation;
* **candidates**: the reflections to which the starting models of all images together give at least 1 % of
  ``min_photons`` Bragg photons (each image's photons per table entry, summed exactly over the images: the same
  bits for any split over processes, nothing of size images x entries held);
* **the start** ``estimate``: the EM updates of :func:`~refine.fitting.structure_factors.estimate_amplitudes` with
  the sums ``c`` and ``a`` over the pixels of every image (each image's rows gathered in image order and
  added up, as the loss and gradient of :mod:`refine.many.joint`: the same bits for any number of processes);
* **visible** (refined): the candidates with at least ``min_photons`` on the fitted pixels of all images
  together with their starting amplitudes (what the pixels can see); the others are held at the table's starting value (the
  file's or ``-default_F``: an estimate from fewer photons is mostly noise, and a held amplitude is never
  corrected).  The refined amplitudes follow the shared names in the raw vector;
* **the restraint** (``restraint_sigma``): once for the run (not per image), in the joint loss, the
  preconditioner and the esds (Fisher and the sandwich's meat).

The overall level is degenerate: multiplying every ``F`` by ``l`` and every image's ``scale`` by ``1/l^2``
changes no pixel.  **Image 0's scale is held** at its start when the scale is refined per image: the amplitudes
come out on image 0's scale, every other image's scale relative to it (a shared ``scale`` is refused).  The
amplitudes and the per-image values are judged at the loop's starting geometry: by default
(``refine_joint(geometry_first=True)``) that is the result of a first joint loop over the same names without
the amplitudes, as a single run refines the amplitudes in its last stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.fitting.objective import ImageObjective, LossFn, make_view
from refine.fitting.amplitude_values import AmplitudeValues, layered
from refine.fitting.parameters import ParameterMap
from refine.many.exact_sum import ExactSum
from refine.many.memory import released
from refine.many.pixel_table import FittedPixels, StoredPixels
from refine.output.results import amplitude_rows
from refine.quality.uncertainty import restraint_curvature
from refine.solver.precondition import physical_per_raw
from refine.fitting.structure_factors import (AMPLITUDE_BLOCK, AmplitudeOptions, AmplitudeRestraint, AmplitudeTable,
                                      amplitude_photon_vector,
                                      check_space_group, check_table_size, em_sums, em_update, entry_photons,
                                      start_grid, table_from_photons, touched_range)

__all__ = ["SharedAmplitudes", "PreparedImage", "shared_amplitudes", "check_options", "observing_images"]

log = logging.getLogger(__name__)


@dataclass
class PreparedImage:
    """One image of this process before its parameter map exists: simulator, fitted pixels (held, or stored in a
    file and read for each use: :mod:`refine.many.pixel_table`), starting values (every base name; the amplitudes once
    known), the loss and, once known, the shared amplitude table."""

    index: int
    sim: Any
    pixels: FittedPixels | StoredPixels
    values: dict
    digest: Tensor
    loss_fn: LossFn
    amplitudes: AmplitudeTable | None = None
    _cached: ImageObjective | None = None

    def valid(self) -> Tensor:
        """The fitted pixels as a dense bool mask of the detector (made on each call, not held)."""
        return self.pixels.load().valid_mask()

    @property
    def objective(self) -> ImageObjective:
        """The image's objective: on its fitted pixels only (:meth:`ImageObjective.from_pixels`), kept while the
        pixels are held, made again at each use (and freed after it) while they are stored; a loss that is not
        pixelwise needs the dense image (held)."""
        if self._cached is not None:
            return self._cached
        px = self.pixels.load()
        if getattr(self.loss_fn, "pixelwise", False):
            objective = ImageObjective.from_pixels(self.sim, px, self.loss_fn, amplitudes=self.amplitudes)
        else:
            valid = px.valid_mask()
            objective = ImageObjective(self.sim, px.dense(), make_view(self.sim, self.values, valid), self.loss_fn,
                                       amplitudes=self.amplitudes)
        if isinstance(self.pixels, FittedPixels) or not objective.sparse:
            self._cached = objective
        return objective

    def set_amplitudes(self, sim, table: AmplitudeTable) -> None:
        """The simulator holding the shared table, and the table (the objective follows)."""
        self.sim, self.amplitudes, self._cached = sim, table, None


@dataclass
class SharedAmplitudes:
    """The run's shared table and how the joint run treats it (module docstring).

    Attributes:
        table: the :class:`~refine.fitting.structure_factors.AmplitudeTable` (candidates; ``table.photons`` summed
            over the images at the start).
        options: the :class:`~refine.fitting.structure_factors.AmplitudeOptions`.
        start: name -> starting amplitude (after the estimate) of every candidate (the process's one
            :class:`~refine.fitting.amplitude_values.AmplitudeValues`, under every image's values).
        photons: (A,) Bragg photons of each candidate on all images' fitted pixels at the loop's start.
        free: the refined (visible) names, in the table's order; ``held``: the others.
        restraint: the :class:`~refine.fitting.structure_factors.AmplitudeRestraint`, or None.
        nobs: (A,) the images on whose fitted pixels each candidate puts at least 1 % of ``min_photons`` Bragg
            photons at the loop's start; ``nobs_pair``: the same for the candidate or its anomalous partner.
    """

    table: AmplitudeTable
    options: AmplitudeOptions
    start: dict
    photons: np.ndarray
    free: tuple[str, ...]
    held: tuple[str, ...]
    restraint: AmplitudeRestraint | None
    nobs: np.ndarray | None = None
    nobs_pair: np.ndarray | None = None
    #: how the run treats the amplitudes' information: ``dense`` or ``diagonal`` (:mod:`refine.many.sparse_amplitudes`)
    information: str = "dense"

    def fingerprint(self) -> dict:
        """What a checkpoint of the run must match (the options, the candidates and their starts)."""
        text = json.dumps({n: float(self.start[n]) for n in self.table.names})
        return {**self.options.describe(), "candidates": len(self.table.names), "free": len(self.free),
                "starts_sha1": hashlib.sha1(text.encode()).hexdigest()}

    def restraint_term(self, shared_map: ParameterMap, raw_shared: Tensor) -> tuple[Tensor, Tensor]:
        """``(restraint, its gradient in the shared raw vector)`` at ``raw_shared`` (held amplitudes fixed)."""
        r = raw_shared.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss = self.restraint(shared_map.expand(shared_map.physical(r)), r.dtype, r.device)
            (g,) = torch.autograd.grad(loss, r, allow_unused=True)
        return loss.detach(), torch.zeros_like(r) if g is None else g.detach()

    def curvature(self, shared_names: Sequence[str], values: dict, raw_units: ParameterMap | None = None,
                  raw_shared: Tensor | None = None) -> Tensor:
        """(S, S) the restraint's Gauss-Newton curvature on the shared names at ``values`` (physical units;
        with ``raw_units`` and ``raw_shared``: in the raw units of that map, for the preconditioner)."""
        scale = physical_per_raw(raw_units, raw_shared) if raw_units is not None else None
        return restraint_curvature(self.restraint, shared_names, values, scale)

    def rows(self, values: dict, esds: dict) -> dict:
        """The result's ``structure_factors``: space group, start, counts and one row ``[h, k, l, d_A, F, esd,
        refined]`` per candidate (as a single run's :meth:`refine.output.results.RefinementResult.structure_factors`)."""
        nobs = {} if self.nobs is None else {"nobs": [int(k) for k in self.nobs],
                                             "nobs_pair": [int(k) for k in self.nobs_pair]}
        return {**amplitude_rows(self.table, values, esds, self.free), "information": self.information,
                "min_photons": self.options.min_photons,
                "restraint_sigma": self.options.restraint_sigma, "photons": [float(p) for p in self.photons], **nobs}


def check_options(options: AmplitudeOptions, shared: Sequence[str], per_image: Sequence[str]) -> None:
    """Refuse what a joint run with shared structure factors cannot do, in one line."""
    if not isinstance(options, AmplitudeOptions):
        raise InputError(f"structure_factors: expected AmplitudeOptions, got {type(options).__name__}")
    if not options.space_group or not str(options.space_group).strip():
        raise InputError("structure_factors: the amplitudes need a space group (AmplitudeOptions('P41212'); "
                         "nbtorch-refine --joint --structure-factors --space-group P41212)")
    check_space_group(options.space_group)
    if "structure_factors" in per_image:
        raise InputError("per_image: structure_factors are shared by every image (one amplitude table); "
                         "name them in shared or leave them out")
    if "scale" in shared:
        raise InputError("shared: scale cannot be shared with structure_factors (F^2 x scale is one number); "
                         "refine scale per image (image 0's is held)")


def shared_amplitudes(comm, images: Sequence[PreparedImage], n: int, options: AmplitudeOptions,
                      base: dict) -> SharedAmplitudes:
    """The shared table (module docstring): every image of ``images`` (this process's) gets the simulator that
    holds it, its objective and the starting amplitudes in its values.  ``base``: image 0's starting values
    (``default_F``, the cell of the resolutions)."""
    lo, hi = _union_range(comm, images, n)
    grid, has_table = _image0_grid(comm, images, lo, hi, float(base["default_F"]))
    start = options.start
    if start == "auto":
        start = "file" if has_table else "estimate"
    if start == "file" and not has_table:
        raise InputError("structure_factors: start 'file' needs an -hkl table in image 0's model")
    photons = _summed_entry_photons(comm, images, n, grid, lo)
    table, grid = table_from_photons(options.space_group, grid, lo, photons, base, start=start,
                                     min_photons=options.min_photons, anomalous=options.anomalous)
    starts = AmplitudeValues({nm: float(v) for nm, v in table.starts.items()})  # one copy for every image
    for im in images:
        im.set_amplitudes(im.sim.with_structure_factors(grid, lo), table)
        im.values = layered(im.values, starts)
    values = dict(table.starts)
    if table.start_mode == "estimate" and table.names:
        values = _estimate(comm, images, n, table, options.iterations)
        log.info("joint structure factors: %d amplitudes estimated from the spots of %d images (%d EM updates)",
                 len(table.names), n, options.iterations)
    # visible: what the fitted pixels can see, the photons at the starting amplitudes (an amplitude the data drive
    # to 0 is still seen, and refined)
    summed, nobs, nobs_pair = _image_photons(comm, images, table, dict(table.starts), options.min_photons)
    free = tuple(nm for nm, p in zip(table.names, summed) if p >= options.min_photons)
    held = tuple(nm for nm in table.names if nm not in set(free))
    values.update({nm: table.starts[nm] for nm in held})  # an estimate from too few photons: the table's value
    values = AmplitudeValues({nm: float(values[nm]) for nm in table.names})
    for im in images:
        im.values = layered(im.values, values)
    log.info("joint structure factors: %d amplitudes refined, %d held (fewer than %g photons on all images' fitted "
             "pixels together)", len(free), len(held), options.min_photons)
    restraint = options.restraint(table)
    return SharedAmplitudes(table, options, values, summed, free, held, restraint, nobs, nobs_pair)


def observing_images(table: AmplitudeTable, per_image: np.ndarray, min_photons: float) -> tuple[np.ndarray, np.ndarray]:
    """``(nobs, nobs_pair)`` (A,) of the (n, A) Bragg photons ``per_image``: the images where a candidate puts
    at least 1 % of ``min_photons`` (more than 0 with ``min_photons`` 0) on the fitted pixels, and where it or
    its anomalous partner does."""
    seen = per_image >= 0.01 * min_photons if min_photons > 0 else per_image > 0
    either = seen.copy()
    for i, j in table.pairs():
        either[:, i] = either[:, j] = seen[:, i] | seen[:, j]
    return seen.sum(0), either.sum(0)


def _union_range(comm, images: Sequence[PreparedImage], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index bounds of the table: the union over all images of the ranges their fitted pixels touch."""
    local = {}
    for im in images:
        _, _, lo, hi = touched_range(im.sim, im.values, im.valid())
        local[im.index] = torch.tensor(np.concatenate([lo, hi]), dtype=torch.float64)
    rows = comm.gather(local, n, (6,), torch.float64).numpy().astype(np.int64)
    lo, hi = rows[:, :3].min(0), rows[:, 3:].max(0)
    check_table_size(lo, hi)
    return lo, hi


def _image0_grid(comm, images: Sequence[PreparedImage], lo: np.ndarray, hi: np.ndarray,
                 default_F: float) -> tuple[np.ndarray, bool]:
    """``(F over [lo, hi] from image 0's model, whether it has an -hkl table)``, in every process."""
    shape = tuple(int(x) for x in hi - lo + 1)
    local = {}
    for im in images:
        if im.index == 0:
            grid = start_grid(im.sim, lo, hi, default_F)
            flag = 1.0 if im.sim.setup.F_grid is not None else 0.0
            local[0] = torch.cat([torch.tensor([flag], dtype=torch.float64), torch.from_numpy(grid).reshape(-1)])
    row = comm.gather(local, 1, (1 + int(np.prod(shape)),), torch.float64)[0]
    return row[1:].reshape(shape).numpy().copy(), bool(row[0] > 0)


def _summed_entry_photons(comm, images: Sequence[PreparedImage], n: int, grid: np.ndarray,
                          lo: np.ndarray) -> np.ndarray:
    """(nh, nk, nl) Bragg photons of each table entry on all images' fitted pixels at their starts, summed exactly
    (:class:`~refine.many.exact_sum.ExactSum`: the same bits for any split over processes) over the entries some
    image touches: a first pass marks them (a 0/1 grid, its maximum over the processes), a second adds each image's
    photons on them, one image at a time.  Nothing of size images x entries is held or gathered (10^4 stills each
    touching ~10^4 entries: 1.6 GB in every process as per-image lists)."""
    touched = torch.zeros(grid.size, dtype=torch.float64)
    for im in released(images):
        ph = entry_photons(im.sim, im.values, im.valid(), grid, lo).reshape(-1)
        touched[torch.from_numpy(np.nonzero(ph > 0)[0])] = 1.0
    reduce_max = comm.layout(grid.size).reduce_max
    if reduce_max is not None:
        reduce_max(touched)
    where = torch.nonzero(touched > 0).reshape(-1)
    if where.numel() == 0:
        return np.zeros(grid.shape, dtype=np.float64)
    total = ExactSum(int(where.numel()))
    for im in released(images):
        ph = torch.from_numpy(entry_photons(im.sim, im.values, im.valid(), grid, lo).reshape(-1))
        total.add(ph[where].to(torch.float64).reshape(1, -1))
    out = np.zeros(grid.size, dtype=np.float64)
    out[where.numpy()] = total.total(comm.layout(int(where.numel())).reduce_sum).numpy()
    return out.reshape(grid.shape)


def _estimate(comm, images: Sequence[PreparedImage], n: int, table: AmplitudeTable, iterations: int) -> dict:
    """The EM start: each update's sums ``c`` and ``a`` over the pixels of every image, exact
    (:class:`~refine.many.exact_sum.ExactSum`, one image's row at a time: the same bits in every process and for
    any number of processes, and nothing of size images x amplitudes)."""
    A = len(table.names)
    F = table.vector(table.starts, torch.float64, "cpu").detach().clone()
    for _ in range(int(iterations)):
        total = ExactSum(2 * A)
        for im in released(images):
            total.add(torch.cat(em_sums(im.objective, table, im.values, F)))
        sums = total.total(comm.layout(2 * A).reduce_sum)
        F = em_update(F, sums[:A], sums[A:])
    return {nm: float(v) for nm, v in zip(table.names, F)}


def _image_photons(comm, images: Sequence[PreparedImage], table: AmplitudeTable, values: dict,
                   min_photons: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(photons, nobs, nobs_pair)`` (A,) each: the Bragg photons of each candidate on all images' fitted pixels at
    ``values`` and :func:`observing_images`'s counts, summed exactly one image at a time (nothing of size images x
    amplitudes)."""
    A = len(table.names)
    total = ExactSum(3 * A)
    # the amplitudes as one vector over each image's values (no dict of every amplitude per image)
    block = {AMPLITUDE_BLOCK: (table.names, table.vector(values, torch.float64, "cpu"))}
    for im in released(images):
        row = amplitude_photon_vector(im.objective, table, ChainMap(block, im.values)).cpu().numpy()[None, :]
        seen, either = observing_images(table, row, min_photons)
        total.add(torch.from_numpy(np.concatenate([row[0], seen, either]).astype(np.float64)))
    sums = total.total(comm.layout(3 * A).reduce_sum).numpy()
    return sums[:A], sums[A:2 * A].round().astype(np.int64), sums[2 * A:].round().astype(np.int64)
