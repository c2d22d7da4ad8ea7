"""Joint mode: many stills of one crystal form refined together (:func:`refine_joint`; from the command line
``nbtorch-refine --images ... --joint --shared cell``, :mod:`refine.modes.joint`; docs/many-stills.md).

One still determines the cell poorly; thousands of stills of one crystal form determine it well when
their likelihoods are combined.  The parameters split into

* **shared** ones (default the cell; any of ``cell``, ``detector``/``distance``, ``beam_centre``,
  ``wavelength``, ``mosaic``, ...): one value for every image;
* **per-image** ones (default ``scale``, ``background``, ``orientation``; ``mosaic``/``N`` too when asked):
  one value per image.

The raw vector is ``[shared raw, image-0 per-image raw, image-1 per-image raw, ...]`` (each process holds its
images' part of it, below); image ``i`` sees
``[shared raw, image-i raw]`` through its own :class:`~refine.fitting.parameters.ParameterMap` (every image's map
starts the shared names at the same value, so one raw value is one physical value in all of them) and its
own :class:`~refine.fitting.objective.ImageObjective` (the same physics and loss as a single run; a pixelwise
loss on an unbinned view simulates only the fitted pixels).  The loss is the exact sum of the images' losses
(:mod:`refine.many.exact_sum`), minimised by one :func:`refine.solver.loop.minimise` (LBFGS by default) in the whitened
coordinates of the joint Fisher matrix at the start, by its arrowhead's blocks (:mod:`refine.many.schur`).

**Structure factors** (``structure_factors=AmplitudeOptions(...)``; :mod:`refine.many.amplitudes`): one amplitude
table shared by every image; its visible amplitudes are appended to the shared names, image 0's scale is held
(the overall level of ``F^2 x scale`` is degenerate; :class:`~refine.fitting.transforms.Held` keeps its place in the raw
vector), and the optional restraint is one term of the joint loss, preconditioner and esds.

**Several processes** (``torchrun --nproc-per-node N``; ``torch.distributed`` with gloo): process ``r``
of ``W`` holds the contiguous shard :func:`image_shard` of the images, or those named by ``local_images`` (any
assignment with each image in exactly one process; :func:`refine.many.serial.refine_serial` keeps each process's
block of the whole set through its rounds): only those are simulated and kept in memory; the others may be passed
as None.  The raw vector is split too (:mod:`refine.many.sharded`): each process holds ``[shared, its images'
own]``, and so do the step rule's vectors (L-BFGS's curvature pairs, the line search's points), the preconditioner's
per-image factors and the checkpoint's rows.  Each evaluation computes, for each of its images, the loss and its
gradient with respect to ``[shared, own]``; the losses and shared gradients are summed *exactly* over every
process's images (:mod:`refine.many.exact_sum`: one integer ``all_reduce`` sized by the shared names), the own
gradients stay where they are, and every dot product and maximum of the step rule is reduced the same way.  The
joint loss, the shared gradient and every step are therefore the same bits in every process and for any number of
processes (the test checks 1 and 2 processes; the same thread count per process is assumed, as torchrun's
``OMP_NUM_THREADS=1`` gives).  A process whose image raises reports NaN for it, so every process stops
together (:attr:`~refine.solver.loop.Status.DIVERGED`) instead of waiting for the others; a time budget is
refused under several processes (the clocks would disagree about when to stop).

**Checkpoints** (``checkpoint=PATH``; :mod:`refine.many.checkpoint`): the processes write the state in turn every
``checkpoint_every`` steps, when the loop ends and on Ctrl-C (each its images' rows), complete before it is renamed;
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
own nuisances profiled out (the Schur complement).  Up to :data:`MAX_DENSE` raw parameters the esds' joint
matrices are built densely, ``(S + n K)^2`` for ``S`` shared and ``K`` per-image names of ``n`` images; above
it (16 000 images of 5 names would be 80 000^2 doubles) they come from the arrowhead's blocks, in memory and time
linear in ``n`` (:mod:`refine.many.schur`, :mod:`refine.many.esds`): each image's own block is eliminated on the
process that holds it, and only the ``S x S`` sums cross processes.  The ``"full"`` preconditioner always whitens
by the arrowhead's blocks (each image's on its process).  Each image's Fisher block for the preconditioner comes from the esds' Jacobian
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
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.simulator import Simulator
from refine.fitting.objective import LossFn
from refine.fitting.parameters import BASE_NAMES, ORIENTATION_DELTAS
from refine.fitting.structure_factors import AmplitudeOptions
from refine.many.amplitudes import check_options
from refine.many.checkpoint import JointCheckpoint
from refine.many.distributed import Comm, image_shard
from refine.many.esds import MAX_DENSE
from refine.output.results import JointResult, load_joint_h5, save_joint_h5, save_joint_json
from refine.solver.loop import Convergence, LoopResult, Status, minimise
from refine.solver.precondition import LinearPreconditioner
from refine.solver.runner import checkpoint_on_interrupt
from refine.solver.strategies import AbstractStrategy, get_strategy
from refine.many.joint_checkpoints import JointCheckpoints, start_or_resume
from refine.many.joint_images import Joint, JointLoss
from refine.many.joint_problem import joint_problem
from refine.many.joint_result import finish

# JointResult and its writers live with the single result (one schema); Comm and image_shard in
# refine.many.distributed: named here too, where joint runs have always found them
__all__ = ["JointResult", "refine_joint", "image_shard", "Comm", "save_joint_json", "save_joint_h5", "load_joint_h5",
           "MAX_DENSE", "geometry_checkpoint", "DEFAULT_CONVERGENCE"]

log = logging.getLogger(__name__)

#: the default stopping rules (those of the default schedule's final stage, more steps)
DEFAULT_CONVERGENCE = Convergence(max_steps=300, ftol=1e-4, xtol=1e-4)
#: the loop logs its step, loss and time every this many steps (logger ``refine.many.joint``, INFO)
PROGRESS_EVERY = 10


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
    comm: Comm | None = None,
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
            ``priors``: shared name -> (mean, sigma), once in the loss, preconditioner and esds (:mod:`refine.many.priors`);
            ``comm``: the processes (default :class:`Comm`: torchrun's group, or this process alone).

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
                 on_checkpoint=on_checkpoint, local_images=local_images, priors=priors, comm=comm))
    comm, conv = comm or Comm(), convergence or DEFAULT_CONVERGENCE
    if comm.world > 1 and conv.time_budget_s is not None:
        raise InputError("convergence.time_budget_s: not with several processes (they would stop at different steps)")
    problem = joint_problem(comm, simulators, observed_images, masks, start, image_starts, shared=shared,
                             per_image=per_image, symmetry=symmetry, background=background, loss=loss,
                             structure_factors=structure_factors, local_images=local_images, priors=priors)
    saver, resumed = start_or_resume(problem, step_rule := get_strategy(strategy), precondition, checkpoint,
                                     checkpoint_every, resume, on_checkpoint, t0)
    res = _run_loop(problem.joint, saver.pre, step_rule, conv, saver, resumed)
    return finish(problem, res, saver, resumed, esds)


def _check_lengths(simulators, observed_images, masks, image_starts) -> None:
    """One observed image (and mask, start when given) per simulator."""
    n = len(simulators)
    if n < 1 or len(observed_images) != n:
        raise InputError(f"observed_images: expected one image per simulator ({n}), got {len(observed_images)}")
    if masks is not None and len(masks) != n:
        raise InputError(f"masks: expected one per image ({n}), got {len(masks)}")
    if image_starts is not None and len(image_starts) != n:
        raise InputError(f"image_starts: expected one per image ({n}), got {len(image_starts)}")


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
    starts = [None if simulators[i] is None else  # an image another process holds: its start is not needed here
              {**((image_starts[i] or {}) if image_starts is not None else {}), **_restart_values(geometry.images[i])}
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


def _run_loop(joint: Joint, pre: LinearPreconditioner, strategy: AbstractStrategy, conv: Convergence,
              saver: JointCheckpoints, resumed: JointCheckpoint | None) -> LoopResult:
    """The one loop, from the start or from ``resumed`` (whose loop may have ended: then only its result),
    with its checkpoints."""
    if resumed is not None and resumed.finished:
        log.info("joint: the checkpoint's loop had ended (%s); only the result is computed", resumed.status)
        return LoopResult(Status(resumed.status), resumed.message, resumed.loop_state())
    losses_seen: list = []

    def fn(z: Tensor) -> tuple[Tensor, Tensor]:
        losses_seen.clear()
        value = JointLoss.apply(pre.to_raw(z), joint, losses_seen)
        return value, losses_seen[-1]

    t0 = time.monotonic()

    def progress(state) -> None:
        if state.step and state.step % PROGRESS_EVERY == 0:
            log.info("joint: step %d, loss %.10g, %d evaluations, %.0f s in this loop", state.step, state.loss,
                     state.evaluations, time.monotonic() - t0)

    with checkpoint_on_interrupt(lambda state: saver.save(state, wait=False)):
        res = minimise(fn, pre.z0(), strategy, conv, on_step=progress,
                       on_checkpoint=saver.save if saver.path is not None else None,
                       checkpoint_every=saver.every if saver.path is not None else 0,
                       resume=None if resumed is None else resumed.loop_state())
    saver.save(res.state, res.status, res.message)
    return res
