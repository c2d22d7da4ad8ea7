"""Joint mode: many stills of one crystal form refined together (:func:`refine_joint`; from the command line
``nbtorch-refine --images ... --joint --shared cell``, :mod:`refine.cli.joint`; docs/many-images.md).

One still determines the cell poorly; thousands of stills of one crystal form determine it well when
their likelihoods are combined.  The parameters split into

* **shared** ones (default the cell; any of ``cell``, ``detector``/``distance``, ``beam_centre``,
  ``wavelength``, ``mosaic``, ...): one value for every image;
* **per-image** ones (default ``scale``, ``background``, ``orientation``; ``mosaic``/``N`` too when asked):
  one value per image.

The raw vector is ``[shared raw, image-0 per-image raw, image-1 per-image raw, ...]``; image ``i`` sees
``[shared raw, image-i raw]`` through its own :class:`~refine.fitting.parameters.ParameterMap` (every image's map
starts the shared names at the same value, so one raw value is one physical value in all of them) and its
own :class:`~refine.fitting.objective.ImageObjective` (the same physics and loss as a single run; a pixelwise
loss on an unbinned view simulates only the fitted pixels).  The loss is the sum of the images' losses in
image order, minimised by one :func:`refine.solver.loop.minimise` (LBFGS by default) in the whitened
coordinates of the joint Fisher matrix at the start (:mod:`refine.solver.precondition`).

**Structure factors** (``structure_factors=AmplitudeOptions(...)``; :mod:`refine.many.amplitudes`): one amplitude
table shared by every image; its visible amplitudes are appended to the shared names, image 0's scale is held
(the overall level of ``F^2 x scale`` is degenerate; :class:`~refine.fitting.transforms.Held` keeps its place in the raw
vector), and the optional restraint is one term of the joint loss, preconditioner and esds.

**Several processes** (``torchrun --nproc-per-node N``; ``torch.distributed`` with gloo): process ``r``
of ``W`` holds the contiguous shard :func:`image_shard` of the images, or those named by ``local_images`` (any
assignment with each image in exactly one process; :func:`refine.many.serial.refine_serial` keeps each process's
block of the whole set through its rounds): only those are simulated and kept in memory; the others may be passed
as None.  Each evaluation computes, for each of its images, the loss
and its gradient with respect to ``[shared, own]``; the rows ``(loss, gradient)`` of every image are
gathered with one ``all_reduce`` (each row is non-zero in one process only, so the sum is exact) and
every process then adds them up in image order.  The joint loss and gradient are therefore the same bits
in every process and for any number of processes: 1 and 2 processes take identical steps and give the
same result (the test checks 1e-8 relative; the same thread count per process is assumed, as torchrun's
``OMP_NUM_THREADS=1`` gives).  A process whose image raises reports NaN for it, so every process stops
together (:attr:`~refine.solver.loop.Status.DIVERGED`) instead of waiting for the others; a time budget is
refused under several processes (the clocks would disagree about when to stop).

**Checkpoints** (``checkpoint=PATH``; :mod:`refine.many.checkpoint`): process 0 writes the whole state every
``checkpoint_every`` steps, when the loop ends and on Ctrl-C, and every process waits until it is complete;
``resume=PATH`` continues to the result of an uninterrupted run, and a worker that ``torchrun --max-restarts``
restarted resumes by itself.  A collective that fails (another process died) raises
:class:`~refine.solver.loop.LoopAborted`, so the survivors stop at once and torchrun can restart the job.

**Esds** (``esds=True``): the Fisher matrix ``F`` and the clustered score matrix ``B`` of each image for
its ``[shared, own]`` names (:func:`refine.quality.uncertainty.image_information`, the same estimate as a single
run) are summed into the joint matrices (shared-shared blocks add up over images; each image's own block
and its coupling to the shared block are its own; images are independent, so there is no coupling
between two images' own blocks).  The covariance is ``C = F^-1`` (``fisher``) or ``F^-1 B F^-1``
(``sandwich``, the default, robust to a model that misses part of the images).  The shared esds are thus
those of the combined data with every image's nuisance parameters estimated too: for the Fisher kind,
``1 / esd_shared^2`` is the sum over images of each image's own ``1 / esd^2`` of the shared name with its
own nuisances profiled out (the Schur complement).  Up to :data:`MAX_DENSE` raw parameters the joint
matrices are built densely, ``(S + n K)^2`` for ``S`` shared and ``K`` per-image names of ``n`` images; above
it (16 000 images of 5 names would be 80 000^2 doubles) the esds and the ``"full"`` preconditioner come from the
arrowhead's blocks, in memory and time linear in ``n`` (:mod:`refine.many.schur`, :mod:`refine.many.esds`): each
image's own block is eliminated on the process that holds it, and only ``S x S`` and ``K x K`` rows per image
are gathered.  Each image's Fisher block for the preconditioner comes from the esds' Jacobian
(:func:`~refine.quality.uncertainty.image_information`, scaled to raw units).  Many stills with bad ones among
them: :mod:`refine.many.serial`.

**What a single run shares with it.**  Each image's objective, its Fisher block in raw units
(:func:`refine.solver.precondition.raw_fisher_information`) and its esd matrices are a single run's; the esds
and correlations come from the covariances as in one (:func:`refine.quality.uncertainty.named_esds`,
:func:`~refine.quality.uncertainty.correlation_matrix`), the elapsed time and Ctrl-C as in
:mod:`refine.solver.runner` (:class:`~refine.solver.runner.RunClock`,
:func:`~refine.solver.runner.checkpoint_on_interrupt`), and the result (:class:`~refine.output.results.JointResult`)
is written in the single run's schema extended with a list of images (:mod:`refine.output.results`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.beam_sources import WIDTH_NAMES
from nbtorch.errors import InputError
from nbtorch.parameters import MISSET_NAMES
from nbtorch.simulator import Simulator
from refine.fitting.objective import ImageObjective, LossFn, resolve_loss
from refine.fitting.parameters import (BASE_NAMES, CELL, ORIENTATION_DELTAS, ParameterMap, ParameterSpace, units_of)
from refine.fitting.structure_factors import AmplitudeOptions, is_amplitude
from refine.fitting.transforms import Held
from refine.many.amplitudes import PreparedImage, SharedAmplitudes, check_options, shared_amplitudes
from refine.many.batch import restart_count
from refine.many.checkpoint import (DIGEST_BYTES, JointCheckpoint, fingerprint_difference, joint_fingerprint,
                                    read_joint_checkpoint, write_joint_checkpoint)
from refine.many.distributed import Comm, held_images, image_shard
import refine.many.esds as esds_module
from refine.many.priors import add_priors, shared_priors
from refine.many.esds import MAX_DENSE, JointCovariances, assemble, joint_covariances, shared_covariance
from refine.many.schur import (ArrowheadPreconditioner, arrowhead_factors, arrowhead_preconditioner, eliminate,
                               own_covariances)
from refine.many.pixel_table import FittedPixels, StoredPixels
from refine.output.results import JointResult, load_joint_h5, reported_values, save_joint_h5, save_joint_json
from refine.quality.fit_quality import FitQuality, assess_poisson_fit
from refine.quality.domain_count import (CELL_NAMES, CountProbe, DomainCountCheck, check_names, reduced_terms,
                                         secant_factor, shared_shift)
from refine.quality.uncertainty import correlation_matrix, image_information, mark_blind, named_esds
from refine.solver.loop import Convergence, LoopAborted, LoopResult, LoopState, Status, minimise
from refine.solver.plan import observed_pixels, starting_values
from refine.solver.precondition import (LinearPreconditioner, physical_per_raw, preconditioner_from_fisher,
                                       raw_fisher_information)
from refine.solver.runner import RunClock, checkpoint_on_interrupt
from refine.solver.strategies import AbstractStrategy, get_strategy

# JointResult and its writers live with the single result (one schema); Comm and image_shard in
# refine.many.distributed: named here too, where joint runs have always found them
__all__ = ["JointResult", "refine_joint", "image_shard", "Comm", "save_joint_json", "save_joint_h5", "load_joint_h5",
           "MAX_DENSE", "geometry_checkpoint", "DEFAULT_CONVERGENCE"]

log = logging.getLogger(__name__)

#: the default stopping rules (those of the default schedule's final stage, more steps)
DEFAULT_CONVERGENCE = Convergence(max_steps=300, ftol=1e-4, xtol=1e-4)


# -- the images -----------------------------------------------------------------------------------------
@dataclass
class _Image:
    """One image this process holds: its index, prepared pixels (whose objective it evaluates) and map
    ``[shared, own]``."""

    index: int
    prepared: PreparedImage
    pmap: ParameterMap
    start: dict
    digest: Tensor

    @property
    def objective(self) -> ImageObjective:
        """The image's objective on its fitted pixels (:attr:`PreparedImage.objective`: read from the file at each
        use while the pixels are stored)."""
        return self.prepared.objective


def _fitted(index: int, sim: Simulator, observed, mask) -> FittedPixels | StoredPixels:
    """The image's fitted pixels: ``observed`` itself when it is :class:`~refine.many.pixel_table.FittedPixels` or
    :class:`~refine.many.pixel_table.StoredPixels` (less any the model's own ``-mask`` excludes), else the usable
    pixels of the dense image (:func:`refine.solver.plan.observed_pixels`)."""
    if not isinstance(observed, (FittedPixels, StoredPixels)):
        obs, valid = observed_pixels(sim, observed, mask)
        return FittedPixels.from_image(obs, valid, source=f"image {index}")
    if mask is not None:
        raise InputError(f"masks[{index}]: give None for fitted pixels (they are the pixels to fit)")
    if tuple(observed.shape) != tuple(sim.shape):
        raise InputError(f"observed_images[{index}]: fitted pixels of a {tuple(observed.shape)} detector, the model's "
                         f"is {tuple(sim.shape)} (slow, fast)")
    if sim.setup.pixel_mask is None:
        return observed
    px = observed.load()
    keep = torch.as_tensor(np.asarray(sim.setup.pixel_mask, dtype=bool)).reshape(-1)[px.index.cpu()]
    if bool(keep.all()):
        return observed
    log.info("image %d: %d fitted pixels lie under the model's -mask and are left out", index, int((~keep).sum()))
    keep = keep.to(px.index.device)
    return FittedPixels(px.shape, px.index[keep], px.observed[keep], px.source)


def _prepare(index: int, sim: Simulator, observed, mask, start: Mapping[str, float] | None, shared_start: dict,
             space: ParameterSpace, loss_fn: LossFn) -> PreparedImage:
    """One image's pixels and starting values (the shared names at the shared start)."""
    if not isinstance(sim, Simulator):
        raise InputError(f"simulators[{index}]: expected a Simulator, got {type(sim).__name__}")
    pixels = _fitted(index, sim, observed, mask)
    px = pixels.load().to(sim.dtype, sim.device)
    values = starting_values(sim, px.observed, torch.ones_like(px.observed, dtype=torch.bool), start)
    values.update(shared_start)
    try:
        space.check_start(values)
    except InputError as exc:
        raise InputError(f"image {index}: {exc}") from None
    return PreparedImage(index, sim, px if isinstance(pixels, FittedPixels) else pixels, values, px.digest(), loss_fn)


def _share_tables(prepared: list[PreparedImage]) -> None:
    """The last image's simulator holds the structure-factor table of an earlier one when they are equal
    (:meth:`nbtorch.Simulator.sharing_structure_factors`): one copy per process for images of one crystal."""
    last, tried = prepared[-1], set()
    for im in prepared[:-1]:
        if im.sim.F_grid is None or id(im.sim.F_grid) in tried:  # each distinct table once
            continue
        tried.add(id(im.sim.F_grid))
        shared = last.sim.sharing_structure_factors(im.sim)
        if shared is not last.sim:
            last.sim = shared
            return


def _image(im: PreparedImage, space: ParameterSpace, names: tuple[str, ...], hold_scale: bool) -> _Image:
    """The image's map (its objective is the prepared image's: the shared table's, when the structure factors
    are refined); with ``hold_scale`` (image 0 next to shared structure factors) its scale keeps its start
    (:class:`Held`)."""
    pmap = ParameterMap(space, im.values, names)
    if hold_scale and "scale" in names:
        pmap.transforms[names.index("scale")] = Held(im.values["scale"])
    return _Image(im.index, im, pmap, im.values, im.digest)


class _Joint:
    """The joint loss and gradient over the images of every process (module docstring)."""

    def __init__(self, images: Sequence[_Image], n: int, n_shared: int, n_own: int, comm: Comm,
                 dtype: torch.dtype) -> None:
        self.images, self.n, self.S, self.K, self.comm, self.dtype = images, n, n_shared, n_own, comm, dtype
        #: ``raw[:S] -> (loss, gradient (S,))`` added once to the sum over images (the amplitude restraint)
        self.extra: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
        #: raw positions that are not refined (image 0's held scale): left out of the esds
        self.held: list[int] = []
        #: ``(raw[:S], raw_units) -> (S, S)``: the restraint's curvature on the shared names (physical units, or
        #: raw ones for the preconditioner)
        self.curvature: Callable[[Tensor, bool], Tensor] | None = None

    def image_raw(self, raw: Tensor, i: int) -> Tensor:
        lo = self.S + i * self.K
        return torch.cat([raw[:self.S], raw[lo:lo + self.K]])

    def rows(self, raw: Tensor) -> Tensor:
        """(n, 1 + S + K): each image's loss and gradient in ``[shared, own]``; NaN where an image failed."""
        local = {}
        for im in self.images:
            r = self.image_raw(raw.detach(), im.index).clone().requires_grad_(True)
            try:
                with torch.enable_grad():
                    loss, _ = im.objective.evaluate(im.pmap.expand(im.pmap.physical(r)))
                    (g,) = torch.autograd.grad(loss, r, allow_unused=True)
                g = torch.zeros_like(r) if g is None else g
                # the loss on the model's device (a GPU), the gradient beside the raw values (the CPU)
                local[im.index] = torch.cat([loss.detach().reshape(1).to(g.device), g.detach()])
            except Exception:  # noqa: BLE001 - every process must stop together: NaN tells them
                log.exception("image %d: evaluating the model failed", im.index)
                local[im.index] = torch.full((1 + self.S + self.K,), math.nan, dtype=self.dtype)
        return self.comm.gather(local, self.n, (1 + self.S + self.K,), self.dtype)

    def loss_and_grad(self, raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(joint loss, joint gradient (P,), per-image losses (n,)), summed in image order."""
        rows = self.rows(raw)
        loss = rows[:, 0].sum()
        grad = torch.cat([rows[:, 1:1 + self.S].sum(0), rows[:, 1 + self.S:].reshape(-1)])
        if self.extra is not None:
            term, g = self.extra(raw.detach()[:self.S])
            loss = loss + term.to(loss.dtype)
            grad[:self.S] += g.to(grad.dtype)
        return loss, grad, rows[:, 0].clone()

class _JointLoss(torch.autograd.Function):
    """``raw -> joint loss``: the forward pass computes the loss and the all-reduced gradient, the backward
    pass hands the stored gradient back (every process gets the same)."""

    @staticmethod
    def forward(ctx, raw: Tensor, joint: _Joint, out: list) -> Tensor:  # type: ignore[override]
        loss, grad, losses = joint.loss_and_grad(raw.detach())
        ctx.save_for_backward(grad)
        out.append(losses)
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return g * grad, None, None



# -- the run --------------------------------------------------------------------------------------------
def _names(space: ParameterSpace, shared: Sequence[str], per_image: Sequence[str],
           amplitudes: bool) -> tuple[tuple, tuple]:
    """The shared and per-image names (the amplitudes, known later, are not among them yet)."""
    shared = (shared,) if isinstance(shared, str) else tuple(shared)
    per_image = (per_image,) if isinstance(per_image, str) else tuple(per_image)
    if not amplitudes and "structure_factors" in shared + per_image:
        raise InputError("structure_factors: refining the amplitudes needs a space group (refine_joint("
                         "structure_factors=AmplitudeOptions('P41212')); nbtorch-refine --joint --structure-factors "
                         "--space-group P41212)")
    shared_names = space.expand(tuple(x for x in shared if x != "structure_factors"))
    per_names = space.expand(per_image)
    both = sorted(set(shared_names) & set(per_names))
    if both:
        raise InputError(f"shared and per_image both name {', '.join(both)}")
    if not shared_names and not amplitudes:
        raise InputError("shared: nothing to share (a joint refinement needs at least one shared name)")
    return shared_names, per_names


def _shared_start(simulators, observed_images, masks, start, comm: Comm, n: int, local: Sequence[int]) -> dict:
    """Every base value of image 0 (from this process's first image when it is image 0, else gathered) with
    ``start`` over it: the shared names start there in every image."""
    rows = {}
    if 0 in local:
        sim = simulators[0]
        if isinstance(sim, Simulator):
            px = _fitted(0, sim, observed_images[0], None if masks is None else masks[0]).load()
            v = starting_values(sim, px.observed, torch.ones_like(px.observed, dtype=torch.bool), start)
            rows[0] = torch.tensor([v[k] for k in BASE_NAMES], dtype=torch.float64)
    got = comm.gather(rows, 1, (len(BASE_NAMES),), torch.float64)[0]
    return {k: float(x) for k, x in zip(BASE_NAMES, got)}


def _all_values(joint: _Joint, local: Mapping[int, Mapping[str, float]]) -> list[dict]:
    """Every image's base values (``local``: those of this process's images, by index), in every process."""
    rows = {i: torch.tensor([v[k] for k in BASE_NAMES], dtype=torch.float64) for i, v in local.items()}
    return [{k: float(x) for k, x in zip(BASE_NAMES, row)}
            for row in joint.comm.gather(rows, joint.n, (len(BASE_NAMES),), torch.float64)]


def _shared_canonical(shared_names: Sequence[str]) -> list[str]:
    """The canonical names a shared name determines (all six cell values for any cell name; N_a/b/c for N)."""
    out: list[str] = []
    for n in shared_names:
        if is_amplitude(n):  # the result's structure_factors
            continue
        if n in CELL:
            out.extend(c for c in CELL if c not in out)
        elif n == "N":
            out.extend(("N_a", "N_b", "N_c"))
        else:
            out.append(n)
    return out


def _preconditioner(kind: str | None, joint: _Joint, raw0: Tensor) -> LinearPreconditioner:
    """Whitening by the joint Fisher matrix at the start (``full``), or its diagonal: each image's block in raw
    units of ``[shared, own]`` (a single run's, on its fitted pixels) gathered and assembled."""
    if kind is None:
        return LinearPreconditioner.identity(raw0)
    q = joint.S + joint.K
    local = {im.index: _raw_fisher(im, joint.image_raw(raw0, im.index)) for im in joint.images}
    extra = joint.curvature(raw0[:joint.S], True) if joint.curvature is not None else None
    if kind == "full" and raw0.numel() > MAX_DENSE:
        log.info("joint: %d raw parameters > %d: arrowhead (Schur complement) preconditioning", raw0.numel(),
                 MAX_DENSE)
        return _arrowhead(joint, local, raw0, extra)
    blocks = joint.comm.gather(local, joint.n, (q, q), raw0.dtype)
    if kind == "diagonal":
        diag = torch.cat([torch.diagonal(blocks[:, :joint.S, :joint.S], dim1=1, dim2=2).sum(0),
                          torch.diagonal(blocks[:, joint.S:, joint.S:], dim1=1, dim2=2).reshape(-1)])
        if extra is not None:
            diag[:joint.S] += torch.diagonal(extra).to(diag.dtype)
        diag[joint.held] = 1.0  # a held position: one raw unit, never moved (its gradient is 0)
        return preconditioner_from_fisher("diagonal", torch.diag(diag), raw0)
    F = assemble(blocks, joint.S)
    if extra is not None:
        F[:joint.S, :joint.S] += extra.to(F.dtype)
    for k in joint.held:
        F[k, :], F[:, k] = 0.0, 0.0
        F[k, k] = 1.0
    return preconditioner_from_fisher(kind, F, raw0)



def _raw_fisher(im: _Image, raw: Tensor) -> Tensor:
    """The image's Fisher block in raw units of ``[shared, own]`` on its fitted pixels: from the esds' Jacobian
    (:func:`~refine.quality.uncertainty.image_information`, ``D F D`` with ``D = d physical / d raw``; the same
    matrix as :func:`raw_fisher_information`'s forward-mode one to rounding, about 10x faster on a 64 x 64 still);
    with amplitudes among the names, :func:`raw_fisher_information` (their restraint)."""
    if any(is_amplitude(n) for n in im.pmap.names):
        return raw_fisher_information(im.objective, im.pmap, raw, fitted_only=True)
    _, F, _ = image_information(im.objective, im.pmap, raw)
    d = physical_per_raw(im.pmap, raw)
    return d[:, None] * F.to(raw.dtype) * d[None, :]


def _arrowhead(joint: _Joint, local: Mapping[int, Tensor], raw0: Tensor,
               extra: Tensor | None) -> ArrowheadPreconditioner:
    """The arrowhead preconditioner (:mod:`refine.many.schur`): each image's own block eliminated on its
    process, the ``(K, K)``, ``(K, S)`` and ``(S, S)`` factors gathered exactly and summed in image order."""
    S, K, n = joint.S, joint.K, joint.n
    held = {(h - S) // K: (h - S) % K for h in joint.held}
    parts = {i: arrowhead_factors(F, S, held.get(i)) for i, F in local.items()}
    W = joint.comm.gather({i: p[0] for i, p in parts.items()}, n, (K, K), raw0.dtype)
    G = joint.comm.gather({i: p[1] for i, p in parts.items()}, n, (K, S), raw0.dtype)
    schur = joint.comm.gather({i: p[2] for i, p in parts.items()}, n, (S, S), raw0.dtype)
    return arrowhead_preconditioner(raw0, (W, G, schur), extra)


def _blocked_covariances(joint: _Joint, info: Mapping[int, tuple], R: Tensor | None):
    """``(fisher, sandwich, condition)`` by the Schur complement with each image's own block eliminated on the
    process that holds it: only ``(S, S)`` and ``(K, K)`` rows per image are gathered (:mod:`refine.many.schur`)."""
    S, K, n = joint.S, joint.K, joint.n
    held = {(h - S) // K: (h - S) % K for h in joint.held}
    parts = {i: eliminate(F, M, S, held.get(i)) for i, (_, F, M) in info.items()}
    schur = joint.comm.gather({i: e.schur for i, e in parts.items()}, n, (S, S), torch.float64)
    meat = joint.comm.gather({i: e.meat for i, e in parts.items()}, n, (S, S), torch.float64)
    conds = joint.comm.gather({i: torch.tensor([e.condition]) for i, e in parts.items()}, n, (1,), torch.float64)
    C_ss, blind, Q, cond = shared_covariance(schur, meat, R)
    own = {i: own_covariances(e, C_ss, Q, K) for i, e in parts.items()}
    fisher_own = joint.comm.gather({i: o[0] for i, o in own.items()}, n, (K, K), torch.float64)
    sandwich_own = joint.comm.gather({i: o[1] for i, o in own.items()}, n, (K, K), torch.float64)
    S_ss = C_ss @ Q @ C_ss
    return (JointCovariances(mark_blind(C_ss, blind), fisher_own),
            JointCovariances(mark_blind(0.5 * (S_ss + S_ss.T), blind), sandwich_own),
            max([cond] + conds.reshape(-1).tolist()))


def _esds(joint: _Joint, raw: Tensor, space: ParameterSpace, shared_names, per_names,
          starts: Sequence[dict]) -> tuple[dict, float, np.ndarray]:
    """``(esds_by_kind, fisher condition, shared correlation)`` from the joint Fisher and score matrices:
    dense up to :data:`MAX_DENSE` raw parameters, else by the distributed Schur complement."""
    S, K, n = joint.S, joint.K, joint.n
    q = S + K
    info = {im.index: image_information(im.objective, im.pmap, joint.image_raw(raw, im.index)) for im in joint.images}
    thetas = joint.comm.gather({i: v[0] for i, v in info.items()}, n, (q,), torch.float64)
    R = joint.curvature(raw[:S], False).to(torch.float64) if joint.curvature is not None else None
    if S + n * K > esds_module.MAX_DENSE:
        fisher, sandwich, cond = _blocked_covariances(joint, info, R)
    else:
        F_blocks = joint.comm.gather({i: v[1] for i, v in info.items()}, n, (q, q), torch.float64)
        M_blocks = joint.comm.gather({i: v[2] for i, v in info.items()}, n, (q, q), torch.float64)
        fisher, sandwich, cond = joint_covariances(F_blocks, M_blocks, S, R, joint.held, blocked=False)
    shared_map = ParameterMap(space, starts[0], shared_names)
    own_maps = [ParameterMap(space, starts[i], per_names) for i in range(n)] if K else []
    out: dict[str, dict] = {}
    for kind, cov in (("sandwich", sandwich), ("fisher", fisher)):
        images = [named_esds(own_maps[i], thetas[i, S:], cov.own[i]) if K else {} for i in range(n)]
        for k in joint.held:  # image 0's scale next to shared structure factors: not refined, no esd
            images[(k - S) // K].pop(per_names[(k - S) % K], None)
        out[kind] = {"shared": named_esds(shared_map, thetas[0, :S], cov.shared), "images": images}
    S0 = sum(1 for nm in shared_names if not is_amplitude(nm))  # the amplitudes follow the other shared names
    count = _domain_count(joint, info, R, shared_names, out["sandwich"]["shared"])
    return out, cond, correlation_matrix(sandwich.shared[:S0, :S0]).numpy().copy(), count


def _domain_count(joint: _Joint, info: Mapping[int, tuple], R: Tensor | None, shared_names,
                  esds: Mapping[str, float]) -> DomainCountCheck | None:
    """Would the shared cell move at twice the mosaic domain count (:mod:`refine.quality.domain_count`)?  Each image's
    gradient difference and Fisher block are reduced to the shared names on the process that holds it and summed
    (the Fisher step of the shared names); each image's own names follow the step, and the slope of the loss at
    twice the count along the whole step gives its length (the secant).  None without a shared cell name or mosaic
    domains, or when the check fails (it is a report)."""
    S = joint.S
    if not any(n in CELL_NAMES for n in shared_names):
        return None
    try:
        local, probes, domains = {}, {}, 0
        for im in joint.images:
            theta, F, _ = info[im.index]
            probe = CountProbe(im.objective, im.pmap)
            if not probe.active:
                local[im.index] = torch.zeros(S * S + S, dtype=torch.float64)
                continue
            g_own, g_two = probe.gradients(theta)
            probes[im.index] = (probe, theta, F.to(torch.float64), g_own, g_two - g_own)
            domains = probe.domains
            A, gs = reduced_terms(F, g_two - g_own, S)
            local[im.index] = torch.cat([A.reshape(-1), gs])
        rows = joint.comm.gather(local, joint.n, (S * S + S,), torch.float64)
        counts = joint.comm.gather({im.index: torch.tensor([float(domains)]) for im in joint.images}, joint.n, (1,),
                                   torch.float64)
        if float(counts.max()) < 2:
            return None
        d_s = shared_shift([(r[:S * S].reshape(S, S), r[S * S:]) for r in rows], R)
        slopes = {}
        for i, (probe, theta, F, g_own, diff) in probes.items():
            B, D = F[:S, S:], F[S:, S:]
            d_o = -(torch.linalg.pinv(D) @ (diff[S:] + B.T @ d_s)) if D.numel() else d_s.new_zeros(0)
            d = torch.cat([d_s, d_o])
            _, g_end = probe.gradients(theta.to(torch.float64) + d.to(theta.dtype), own=False)
            slopes[i] = torch.tensor([float(d @ diff), float(d @ (g_end - g_own))], dtype=torch.float64)
        for im in joint.images:
            slopes.setdefault(im.index, torch.zeros(2, dtype=torch.float64))
        h = joint.comm.gather(slopes, joint.n, (2,), torch.float64).sum(0)
        alpha = secant_factor(float(h[0]), float(h[1]))
        return check_names(list(shared_names)[:S], alpha * d_s, esds, int(counts.max()), alpha)
    except LoopAborted:
        raise
    except Exception as exc:  # noqa: BLE001 - a report, not the refinement
        log.warning("mosaic domain count check failed: %s", exc)
        return None


def refine_joint(
    simulators: Sequence[Simulator | None],
    observed_images: Sequence[Any],
    masks: Sequence[Any] | None = None,
    *,
    shared: Sequence[str] = ("cell",),
    per_image: Sequence[str] = ("scale", "background", "orientation"),
    symmetry: str = "triclinic",
    start: Mapping[str, float] | None = None,
    image_starts: Sequence[Mapping[str, float] | None] | None = None,
    strategy: str | AbstractStrategy | None = None,
    convergence: Convergence | None = None,
    precondition: str | None = "full",
    background: str = "constant",
    loss: str | LossFn = "poisson",
    esds: bool = True,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 10,
    resume: str | Path | None = None,
    on_checkpoint: Callable[[int, Path], None] | None = None,
    structure_factors: AmplitudeOptions | None = None,
    geometry_first: bool = True,
    local_images: Sequence[int] | None = None,
    priors: Mapping[str, tuple[float, float]] | None = None,
) -> JointResult:
    """Refine shared parameters (default the cell) and per-image ones of many stills together: a :class:`JointResult`.

    Arguments:
        simulators: one :class:`nbtorch.Simulator` per image (its parameters are the image's starting model);
            under torchrun only those this process holds are used (the others may be None): ``local_images``.
        observed_images: (slow, fast) photons per image (same rule); ``masks``: None or one bool mask (or None)
            per image, True = use the pixel.
        shared: groups/names with one value for all images (:data:`refine.fitting.parameters.GROUPS`, names).
        per_image: groups/names with one value per image; every other name stays at its start.
        symmetry: crystal system of the cell; ``start``: the shared names' start (default: image 0's simulator's);
            ``image_starts``: per image, starting values overriding its simulator's (e.g. a known beam centre).
        strategy: ``"lbfgs"`` (default), ``"adam"`` or an object; ``convergence``: (:data:`DEFAULT_CONVERGENCE`);
            ``precondition``: ``"full"`` (default: whiten by the joint Fisher matrix at the start), ``"diagonal"``, None.
        background: ``"constant"`` or ``"planar"``; ``loss``: as for :func:`refine.refine`; ``esds``: estimate
            esds at the end (module docstring).
        checkpoint: HDF5 file of the whole state (:mod:`refine.many.checkpoint`; its folder must exist), written by
            process 0 every ``checkpoint_every`` steps, when the loop ends and on Ctrl-C; under a torchrun restart
            (``TORCHELASTIC_RESTART_COUNT`` > 0) an existing checkpoint of this problem is resumed without ``resume``.
        resume: a checkpoint to continue from (same images, names and settings; the stopping rules may differ);
            ``on_checkpoint``: ``(step, path)`` called in every process after each checkpoint is complete.
        structure_factors: one amplitude per symmetry-unique reflection, one table for all images (:class:`~refine.
            fitting.structure_factors.AmplitudeOptions`; :mod:`refine.many.amplitudes`), image 0's scale held.
        geometry_first: with ``structure_factors``, first the names without the amplitudes (no esds; checkpoint
            :func:`geometry_checkpoint`), then everything from that result (the amplitudes judged there; False: one loop).
        local_images: the images this process holds (each in one process; default :func:`image_shard`'s block);
            ``priors``: shared name -> (mean, sigma), once in the loss, preconditioner and esds (:mod:`refine.many.priors`).

    Raises:
        InputError: mismatched lists, unknown names, a name both shared and per-image, a start breaking the symmetry,
            an image without usable pixels, a time budget under several processes, a bad ``resume`` (missing, damaged,
            of another problem or settings), structure factors without a space group, per image or with a shared scale,
            a prior on a name that is not shared.
        RefinementInterrupted: Ctrl-C, after writing the checkpoint; LoopAborted: another process died (torchrun
            then restarts the job when asked to).
    """
    t0 = time.monotonic()
    _check_lengths(simulators, observed_images, masks, image_starts)
    if structure_factors is not None and geometry_first:
        return _geometry_then_amplitudes(
            simulators, observed_images, masks, start, image_starts, checkpoint, resume, esds, structure_factors,
            dict(shared=shared, per_image=per_image, symmetry=symmetry, strategy=strategy, convergence=convergence,
                 precondition=precondition, background=background, loss=loss, checkpoint_every=checkpoint_every,
                 on_checkpoint=on_checkpoint, local_images=local_images, priors=priors))
    comm = Comm()
    conv = convergence or DEFAULT_CONVERGENCE
    if comm.world > 1 and conv.time_budget_s is not None:
        raise InputError("convergence.time_budget_s: not with several processes (they would stop at different steps)")
    problem = _joint_problem(comm, simulators, observed_images, masks, start, image_starts, shared=shared,
                             per_image=per_image, symmetry=symmetry, background=background, loss=loss,
                             structure_factors=structure_factors, local_images=local_images, priors=priors)
    step_rule = get_strategy(strategy)
    saver, resumed = _start_or_resume(problem, step_rule, precondition, checkpoint, checkpoint_every, resume,
                                      on_checkpoint, t0)
    res = _run_loop(problem.joint, saver.pre, step_rule, conv, saver, resumed)
    return _finish(problem, res, saver, resumed, esds)


def _check_lengths(simulators, observed_images, masks, image_starts) -> None:
    """One observed image (and mask, start when given) per simulator."""
    n = len(simulators)
    if n < 1 or len(observed_images) != n:
        raise InputError(f"observed_images: expected one image per simulator ({n}), got {len(observed_images)}")
    if masks is not None and len(masks) != n:
        raise InputError(f"masks: expected one per image ({n}), got {len(masks)}")
    if image_starts is not None and len(image_starts) != n:
        raise InputError(f"image_starts: expected one per image ({n}), got {len(image_starts)}")


@dataclass
class _Problem:
    """A joint run ready for its loop: the names, this process's images in their :class:`_Joint`, every image's
    starting base values (``starts``; ``map_starts`` with the amplitudes' starts: what the maps start at), the
    raw start ``[shared, own, own, ...]`` and the shared amplitudes (or None)."""

    comm: Comm
    space: ParameterSpace
    shared_names: tuple
    per_names: tuple
    loss_name: str
    joint: _Joint
    starts: list
    map_starts: list
    raw0: Tensor
    amps: SharedAmplitudes | None
    priors: dict


def _joint_problem(comm: Comm, simulators, observed_images, masks, start, image_starts, *, shared, per_image,
                   symmetry: str, background: str, loss, structure_factors: AmplitudeOptions | None,
                   local_images: Sequence[int] | None, priors: Mapping[str, tuple[float, float]] | None) -> _Problem:
    """The names, this process's prepared images (with the shared amplitude table) and the raw start."""
    n = len(simulators)
    local = held_images(comm, n, local_images)
    first = next((simulators[i] for i in local if isinstance(simulators[i], Simulator)), None)
    if local and first is None:
        raise InputError(f"simulators: images {local[0]}..{local[-1]} of this process are missing")
    pixel_mm, anisotropic_mosaic, widths = _image0_model(comm, simulators, local)
    space = ParameterSpace(symmetry=symmetry, background=background, pixel_mm=pixel_mm,
                           anisotropic_mosaic=anisotropic_mosaic, beam_widths=widths)
    if structure_factors is not None:
        check_options(structure_factors, shared, per_image)
    shared_names, per_names = _names(space, shared, per_image, structure_factors is not None)
    priors = shared_priors(priors, shared_names)
    loss_fn = resolve_loss(loss)
    base, shared_start = _shared_starts(simulators, observed_images, masks, start, image_starts, shared_names, comm,
                                        local)
    prepared: list[PreparedImage] = []
    for i in local:
        prepared.append(_prepare(i, simulators[i], observed_images[i], None if masks is None else masks[i],
                                 image_starts[i] if image_starts is not None else None, shared_start, space, loss_fn))
        _share_tables(prepared)
    amps = None if structure_factors is None else shared_amplitudes(comm, prepared, n, structure_factors,
                                                                     {**base, **shared_start})
    if amps is not None:
        space = dataclasses.replace(space, amplitudes=amps.table.names)
        shared_names = shared_names + amps.free
    images = [_image(im, space, shared_names + per_names, hold_scale=amps is not None and im.index == 0)
              for im in prepared]
    joint = _Joint(images, n, len(shared_names), len(per_names), comm, torch.float64)
    starts = _all_values(joint, {im.index: im.start for im in images})
    map_starts = [{**s, **(amps.start if amps is not None else {})} for s in starts]
    raw0 = torch.cat([ParameterMap(space, map_starts[0], shared_names).raw0(torch.float64)] + [
        ParameterMap(space, map_starts[i], per_names).raw0(torch.float64) for i in range(n)])
    if amps is not None:
        _share_amplitudes(joint, amps, ParameterMap(space, map_starts[0], shared_names), per_names)
    add_priors(joint, priors, ParameterMap(space, map_starts[0], shared_names))
    loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
    return _Problem(comm, space, shared_names, per_names, loss_name, joint, starts, map_starts, raw0, amps, priors)


def _image0_model(comm: Comm, simulators, local: Sequence[int]) -> tuple[float, bool, tuple[str, ...]]:
    """Image 0's pixel size (mm; 0.1 for a model without one), whether its mosaic is anisotropic and the beam
    widths its sources spread along, in every process (its holder's): every process builds the same parameter
    space, also one that holds no image."""
    rows = {}
    if 0 in local and isinstance(simulators[0], Simulator):
        sim = simulators[0]
        widths = sim.source_width_names()
        rows[0] = torch.tensor([sim.setup.pixel_m * 1000.0, float(bool(sim.setup.sampling.mosaic_anisotropic)),
                                *(float(n in widths) for n in WIDTH_NAMES)], dtype=torch.float64)
    got = comm.gather(rows, 1, (2 + len(WIDTH_NAMES),), torch.float64)[0]
    widths = tuple(n for n, on in zip(WIDTH_NAMES, got[2:].tolist()) if on > 0)
    return (float(got[0]) if float(got[0]) > 0 else 0.1), bool(got[1] > 0), widths


def _shared_starts(simulators, observed_images, masks, start, image_starts, shared_names, comm: Comm,
                   local: range) -> tuple[dict, dict]:
    """``(image 0's base values with start over them, the shared names' start)``: every image starts its shared
    names there (all six cell values when any is shared)."""
    first_start = dict((image_starts[0] or {}) if image_starts is not None else {})
    base = _shared_start(simulators, observed_images, masks, {**first_start, **(start or {})}, comm,
                         len(simulators), local)
    shared_start = {k: base[k] for k in BASE_NAMES if k in _shared_canonical(shared_names) or k in shared_names}
    if any(k in CELL for k in shared_names):
        shared_start.update({k: base[k] for k in CELL})
    return base, shared_start


def _start_or_resume(problem: _Problem, step_rule: AbstractStrategy, precondition: str | None, checkpoint,
                     checkpoint_every: int, resume, on_checkpoint, t0: float
                     ) -> tuple["_Checkpoints", JointCheckpoint | None]:
    """The run's checkpoints and the checkpoint it continues from (or None); the preconditioner: the resumed
    one, else the joint Fisher matrix's at the start."""
    p = problem
    fingerprint = joint_fingerprint(
        p.comm.gather({im.index: im.digest for im in p.joint.images}, p.joint.n, (DIGEST_BYTES,), torch.float64),
        p.starts, shared=list(p.shared_names), per_image=list(p.per_names), symmetry=p.space.symmetry,
        background=p.space.background, loss=p.loss_name, strategy=step_rule.hparams(), precondition=precondition,
        **({"structure_factors": p.amps.fingerprint()} if p.amps is not None else {}),
        **({"priors": {k: list(v) for k, v in sorted(p.priors.items())}} if p.priors else {}))
    saver = _Checkpoints(checkpoint, checkpoint_every, p.comm, fingerprint, on_checkpoint, t0)
    resumed = _resume_point(p.comm, checkpoint, resume, fingerprint)
    saver.pre = (_preconditioner(precondition, p.joint, p.raw0) if resumed is None
                 else _precond_from_state(resumed.precond))
    saver.clock.before_s = resumed.elapsed_s if resumed is not None else 0.0
    return saver, resumed


def _finish(problem: _Problem, res: LoopResult, saver: "_Checkpoints", resumed: JointCheckpoint | None,
            esds: bool) -> JointResult:
    """The :class:`JointResult` of the ended loop: every image's final values, the esds, the amplitudes."""
    p, joint = problem, problem.joint
    raw = saver.pre.to_raw(res.state.raw).detach()
    finals = _all_values(joint, {im.index: im.pmap.values_at(joint.image_raw(raw, im.index)) for im in joint.images})
    warnings, esd_fields = _joint_esds(esds, joint, raw, p.space, p.shared_names, p.per_names, p.map_starts)
    result = _joint_result(res, finals, p.starts, esd_fields, warnings, shared_names=p.shared_names,
                           per_names=p.per_names, background=p.space.background, symmetry=p.space.symmetry,
                           loss_name=p.loss_name, wall_s=saver.clock.elapsed(), world=p.comm.world,
                           resumed_from_step=None if resumed is None else resumed.step)
    result = dataclasses.replace(result, priors=dict(p.priors))
    result = _with_fit(result, joint, raw, p.amps is not None) if p.loss_name == "poisson" else result
    if p.amps is None:
        return result
    shared_map = ParameterMap(p.space, p.map_starts[0], p.shared_names)
    return _with_amplitudes(result, p.amps, shared_map.values_at(raw[:joint.S]))


def _with_fit(result: JointResult, joint: _Joint, raw: Tensor, amplitudes: bool) -> JointResult:
    """``result`` with each image's final fit against shot noise and the whole run's
    (:func:`refine.quality.fit_quality.assess_poisson_fit` on the image's fitted pixels; the images' sums pooled),
    and the fit's warning (a false minimum or a model that lacks something) for the whole run."""
    local = {}
    for im in joint.images:
        pmap = im.pmap
        with torch.no_grad():
            model, observed, weights = im.objective.pixels(pmap.expand(pmap.physical(joint.image_raw(raw, im.index))))
            loss = im.objective.loss_fn(model, observed, weights)
        q = assess_poisson_fit(float(loss), model, weights)
        local[im.index] = torch.tensor([q.loss, q.expected, float(q.pixels)], dtype=torch.float64)
    rows = joint.comm.gather(local, joint.n, (3,), torch.float64).numpy()

    def fit(loss: float, expected: float, pixels: float) -> FitQuality:
        return FitQuality(loss=float(loss), expected=float(expected), pixels=int(pixels),
                          excess=float(loss / expected) if expected > 0 else math.inf,
                          amplitudes_refined=amplitudes)
    total = fit(*rows.sum(axis=0))
    warnings = result.warnings + ((total.warning,) if total.warning is not None else ())
    return dataclasses.replace(result, fit=total.to_dict(), image_fit=tuple(fit(*r).to_dict() for r in rows),
                               warnings=warnings)


def geometry_checkpoint(checkpoint: str | Path) -> Path:
    """The checkpoint of the geometry stage of a joint run with structure factors: ``x.ckpt.h5`` ->
    ``x.ckpt.geometry.h5`` (beside the amplitudes stage's)."""
    path = Path(checkpoint)
    return path.with_name(f"{path.stem}.geometry{path.suffix or '.h5'}")


def _restart_values(values: Mapping[str, float]) -> dict:
    """A result's canonical values as a start: base names only, the orientation folded into the misset."""
    return {k: float(v) for k, v in values.items() if k in BASE_NAMES and k not in ORIENTATION_DELTAS}


def _geometry_then_amplitudes(simulators, observed_images, masks, start, image_starts, checkpoint, resume, esds,
                              structure_factors: AmplitudeOptions, common: dict) -> JointResult:
    """``refine_joint(geometry_first=True)``: the names without the amplitudes, then everything from there."""
    check_options(structure_factors, common["shared"], common["per_image"])  # before the geometry stage's work
    n = len(simulators)
    resume_geometry = resume_final = None
    if resume is not None:
        resume_geometry = geometry_checkpoint(resume) if geometry_checkpoint(resume).exists() else None
        resume_final = resume if Path(resume).exists() else None
        if resume_geometry is None and resume_final is None:
            raise InputError(f"resume: {resume} does not exist (nor its geometry stage's "
                             f"{geometry_checkpoint(resume)})")
    geometry = refine_joint(simulators, observed_images, masks, start=start, image_starts=image_starts, esds=False,
                            checkpoint=None if checkpoint is None else geometry_checkpoint(checkpoint),
                            resume=resume_geometry, structure_factors=None, **common)
    if geometry.status in (Status.FAILED, Status.DIVERGED):
        note = f"the amplitudes were not refined: the geometry stage ended with {geometry.status.value}"
        return dataclasses.replace(geometry, warnings=geometry.warnings + (note,))
    log.info("joint: geometry stage %s in %d steps; now the structure factors from its result",
             geometry.status.value, geometry.steps)
    shared_start = {**(start or {}), **_restart_values(geometry.shared)}
    starts = [{**((image_starts[i] or {}) if image_starts is not None else {}), **_restart_values(geometry.images[i])}
              for i in range(n)]
    final = refine_joint(simulators, observed_images, masks, start=shared_start, image_starts=starts, esds=esds,
                         checkpoint=checkpoint, resume=resume_final, structure_factors=structure_factors,
                         geometry_first=False, **common)
    history = geometry.history + tuple({**h, "step": h["step"] + geometry.steps,
                                        "evaluations": h["evaluations"] + geometry.evaluations}
                                       for h in final.history[1:])
    return dataclasses.replace(
        final, message=f"geometry: {geometry.status.value} in {geometry.steps} steps ({geometry.message}); "
                       f"with the structure factors: {final.message}",
        initial_shared=geometry.initial_shared, initial_images=geometry.initial_images,
        loss_initial=geometry.loss_initial, steps=geometry.steps + final.steps,
        evaluations=geometry.evaluations + final.evaluations, wall_s=geometry.wall_s + final.wall_s, history=history,
        warnings=geometry.warnings + final.warnings)


def _share_amplitudes(joint: _Joint, amps: SharedAmplitudes, shared_map: ParameterMap, per_names) -> None:
    """The joint loss's restraint term and its curvature (once, not per image); image 0's held scale."""
    if "scale" in per_names:
        joint.held = [joint.S + list(per_names).index("scale")]
        log.info("joint structure factors: image 0's scale held at %g (the amplitudes are on its scale)",
                 shared_map.values["scale"])
    if amps.restraint is None:
        return
    names = list(shared_map.names)
    joint.extra = lambda r: amps.restraint_term(shared_map, r)

    def curvature(raw_shared: Tensor, raw_units: bool) -> Tensor:
        values = shared_map.values_at(raw_shared)
        return amps.curvature(names, values, shared_map if raw_units else None, raw_shared.detach())

    joint.curvature = curvature


def _with_amplitudes(result: JointResult, amps: SharedAmplitudes, values: dict) -> JointResult:
    """``result`` with the shared amplitudes (rows, table, final values; the restraint's final value)."""
    kind = result.esd_kind
    esds = result.esds_by_kind[kind]["shared"] if kind else {}
    finals = {n: float(values[n]) for n in amps.table.names}
    doc = amps.rows(finals, esds)
    if amps.restraint is not None:
        doc["restraint_final"] = float(amps.restraint(finals, torch.float64, "cpu"))
    return dataclasses.replace(result, structure_factors=doc, amplitude_table=amps.table, amplitude_values=finals,
                               shared_esds={k: v for k, v in result.shared_esds.items() if not is_amplitude(k)},
                               refined={**result.refined, **{k: finals[k] for k in amps.free}})


# -- checkpoints ----------------------------------------------------------------------------------------
class _Checkpoints:
    """The run's checkpoints (:mod:`refine.many.checkpoint`): process 0 writes each; then every process
    waits for it (a process that dies after a checkpoint leaves it complete) and calls ``on_checkpoint``."""

    def __init__(self, path: str | Path | None, every: int, comm: Comm, fingerprint: dict,
                 on_checkpoint: Callable[[int, Path], None] | None, t0: float) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InputError(f"checkpoint_every: expected an integer >= 1, got {every!r}")
        self.path = None if path is None else Path(path)
        self.every, self.comm, self.fingerprint, self.on_checkpoint = every, comm, fingerprint, on_checkpoint
        #: the run's wall time since ``t0`` (the attempts before a resume added once known)
        self.clock = RunClock(started=t0)
        #: the loop's preconditioner (set once known)
        self.pre: LinearPreconditioner | None = None
        if self.path is not None:
            comm.on_rank0(self._check_path)

    def _check_path(self) -> None:
        if self.path.is_dir():
            raise InputError(f"checkpoint {self.path}: is a directory; give a file name such as joint.ckpt.h5")
        if not self.path.absolute().parent.is_dir():
            raise InputError(f"checkpoint {self.path}: folder {self.path.absolute().parent} does not exist")

    def save(self, state: LoopState, status: Status | None = None, message: str = "", wait: bool = True) -> Path | None:
        """Write ``state`` (and the loop's end, ``status``); ``wait=False``: no waiting, no callback (Ctrl-C)."""
        if self.path is None:
            return None
        if self.comm.rank == 0:
            losses = state.aux.detach().clone() if isinstance(state.aux, Tensor) else None
            write_joint_checkpoint(self.path, JointCheckpoint(
                loop=state.to_dict(), image_losses=losses, precond=_precond_state(self.pre),
                status=None if status is None else status.value, message=message, elapsed_s=self.clock.elapsed(),
                fingerprint=self.fingerprint, world_size=self.comm.world))
            log.info("joint: checkpoint at step %d written to %s", state.step, self.path)
        if wait:
            self.comm.barrier()
            if self.on_checkpoint is not None:
                self.on_checkpoint(state.step, self.path)
        return self.path


def _resume_point(comm: Comm, checkpoint: str | Path | None, resume: str | Path | None,
                  fingerprint: dict) -> JointCheckpoint | None:
    """The checkpoint to continue from (read by process 0, the same in every process), or None.

    ``resume``: that file, refused when missing, damaged or of another problem.  Without it, under a torchrun
    restart: ``checkpoint`` when it exists and is of this problem (else a fresh start, with a warning)."""
    auto = resume is None and checkpoint is not None and restart_count() > 0
    if resume is None and not auto:
        return None
    path = Path(resume if resume is not None else checkpoint)

    def read() -> JointCheckpoint | None:
        if auto and not path.is_file():
            log.info("joint: torchrun restart %d, no checkpoint %s yet: starting afresh", restart_count(), path)
            return None
        try:
            ckpt = read_joint_checkpoint(path)
        except InputError as exc:
            if not auto:
                raise InputError(f"resume: {exc}") from None
            log.warning("joint: torchrun restart: %s; starting afresh", exc)
            return None
        differs = fingerprint_difference(ckpt.fingerprint, fingerprint)
        if differs:
            message = f"resume: {path} was written for another joint problem or settings (differs: {differs})"
            if not auto:
                raise InputError(message)
            log.warning("joint: torchrun restart: %s; starting afresh", message)
            return None
        log.info("joint: resuming from %s at step %d", path, ckpt.step)
        return ckpt

    return comm.on_rank0(read)


def _precond_state(pre) -> dict:
    """A checkpoint's record of the loop's preconditioner (dense ``A`` or the arrowhead's factors)."""
    return pre.to_dict() if isinstance(pre, ArrowheadPreconditioner) else {"raw0": pre.raw0, "A": pre.A}


def _precond_from_state(state: Mapping[str, Tensor]):
    """The preconditioner a checkpoint recorded (:func:`_precond_state`)."""
    if state.get("kind") == "arrowhead":
        return ArrowheadPreconditioner(state["raw0"], state["Ws"], state["W"], state["G"])
    return LinearPreconditioner(state["raw0"], state["A"])


def _run_loop(joint: _Joint, pre: LinearPreconditioner, strategy: AbstractStrategy, conv: Convergence,
              saver: _Checkpoints, resumed: JointCheckpoint | None) -> LoopResult:
    """The one loop, from the start or from ``resumed`` (whose loop may have ended: then only its result),
    with its checkpoints."""
    if resumed is not None and resumed.finished:
        log.info("joint: the checkpoint's loop had ended (%s); only the result is computed", resumed.status)
        return LoopResult(Status(resumed.status), resumed.message, resumed.loop_state())
    losses_seen: list = []

    def fn(z: Tensor) -> tuple[Tensor, Tensor]:
        losses_seen.clear()
        value = _JointLoss.apply(pre.to_raw(z), joint, losses_seen)
        return value, losses_seen[-1]

    with checkpoint_on_interrupt(lambda state: saver.save(state, wait=False)):
        res = minimise(fn, pre.z0(), strategy, conv, on_checkpoint=saver.save if saver.path is not None else None,
                       checkpoint_every=saver.every if saver.path is not None else 0,
                       resume=None if resumed is None else resumed.loop_state())
    saver.save(res.state, res.status, res.message)
    return res


def _joint_esds(esds: bool, joint, raw: Tensor, space, shared_names, per_names, starts) -> tuple[list[str], dict]:
    """The joint esds as the result's fields, and the warnings (the estimate failed)."""
    warnings: list[str] = []
    esd_fields: dict[str, Any] = {}
    if esds:
        try:
            by_kind, cond, corr, count = _esds(joint, raw, space, shared_names, per_names, starts)
            esd_fields = dict(esd_kind="sandwich", esds_by_kind=by_kind, shared_correlation=corr, fisher_condition=cond)
            if count is not None:
                esd_fields["mosaic_domains"] = count.to_dict()
                if count.warning is not None:
                    warnings.append(count.warning)
        except LoopAborted:
            raise
        except Exception as exc:  # noqa: BLE001 - esds are a report, not the refinement
            log.warning("joint esd estimation failed: %s", exc)
            warnings.append(f"esd estimation failed: {exc}")
    return warnings, esd_fields


def _joint_result(res: LoopResult, finals: list[dict], starts: list[dict], esd_fields: dict, warnings: list[str], *,
                  shared_names, per_names, background: str, symmetry: str, loss_name: str, wall_s: float,
                  world: int, resumed_from_step: int | None) -> JointResult:
    """The :class:`JointResult` of a finished loop: canonical values per image, the shared ones, esds."""
    n = len(finals)
    keep = _shared_canonical(shared_names)

    image_params = tuple(reported_values(v, background) for v in finals)
    initial_images = tuple(reported_values(v, background) for v in starts)

    def shared_of(values: Sequence[dict], canonical: Sequence[dict]) -> dict:
        """The shared names' values: canonical ones from image 0; a shared orientation as its deltas
        ``orient_x/y/z`` and, when every image has the same crystal orientation, its ``misset_x/y/z``."""
        out = {k: canonical[0][k] if k in canonical[0] else float(values[0].get(k, 0.0)) for k in keep}
        if any(k in ORIENTATION_DELTAS for k in keep):
            misset = [[c[m] for m in MISSET_NAMES] for c in canonical]
            if all(np.allclose(m, misset[0], rtol=0.0, atol=1e-9) for m in misset):
                out.update(zip(MISSET_NAMES, misset[0]))
        return out
    kind = esd_fields.get("esd_kind")
    by = esd_fields.get("esds_by_kind", {})
    image_losses = res.state.aux if isinstance(res.state.aux, Tensor) else torch.full((n,), math.nan)
    history = tuple({k: h[k] for k in ("step", "loss", "grad_norm", "step_norm", "evaluations")}
                    for h in res.state.history)
    all_names = list(keep) + list(per_names) + list(image_params[0]) + ["misset_x", "misset_y", "misset_z"]
    return JointResult(
        status=res.status, message=res.message,
        shared=shared_of(finals, image_params), shared_esds=dict(by[kind]["shared"]) if kind else {},
        images=image_params, image_esds=tuple(by[kind]["images"]) if kind else tuple({} for _ in range(n)),
        initial_shared=shared_of(starts, initial_images), initial_images=initial_images,
        shared_names=tuple(shared_names), per_image_names=tuple(per_names), symmetry=symmetry, loss_name=loss_name,
        loss_initial=float(res.state.history[0]["loss"]) if res.state.history else math.nan,
        loss_final=float(res.state.loss), image_losses=tuple(float(x) for x in image_losses),
        steps=res.state.step, evaluations=res.state.evaluations, wall_s=wall_s,
        world_size=world, units=units_of(dict.fromkeys(all_names)), history=history,
        warnings=tuple(warnings), **{k: v for k, v in esd_fields.items() if k != "esd_kind"},
        esd_kind=kind, resumed_from_step=resumed_from_step,
        refined={k: float(finals[0]["N_a" if k == "N" else k]) for k in shared_names if not is_amplitude(k)})
