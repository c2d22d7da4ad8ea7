"""The front door: :func:`refine` runs a staged refinement and returns a :class:`RefinementResult`.

A run is four named steps, each in its own place:

1. **plan** (:func:`refine.solver.plan.make_plan`): the arguments checked and frozen into a :class:`RunPlan`;
2. **start or resume** (:func:`start_run`, :func:`resume_run`): the mutable :class:`RunState` (values,
   :class:`~refine.solver.history.History`, finished stages) from the plan or from a checkpoint;
3. **run each stage** (:func:`run_stage`): one loop (:func:`refine.solver.loop.minimise`) over the stage's names,
   recording every point in the history and writing checkpoints;
4. **finalise** (:func:`refine.solver.finalise.finalise`): the whole image at the final values, fit quality,
   esds, the result.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.runtime import cuda_graph
from nbtorch.parameters import SIZE_DIAGONAL, SIZE_OFF_DIAGONAL
from nbtorch.simulator import ORIENTATION_DELTAS, Simulator
from refine.output.callbacks import CallbackList, ProgressCallback, RunInfo, StepState
from refine.solver.checkpoint import RunCheckpoint, read_checkpoint, write_checkpoint
from refine.solver.finalise import finalise
from refine.solver.graphed import GraphedObjective
from refine.solver.history import History
from refine.solver.loop import LoopInterrupted, LoopResult, LoopState, Status, minimise
from refine.fitting.objective import ImageObjective, LossFn, View, make_view
from refine.fitting.parameters import ParameterMap, canonical_values
from refine.solver.plan import RunPlan, make_plan
from refine.solver.precondition import LinearPreconditioner, make_preconditioner
from refine.inputs.problems import Problem
from refine.output.results import RefinementResult, StageSummary
from refine.solver.stages import Stage
from refine.solver.strategies import AbstractStrategy
from refine.fitting.structure_factors import AmplitudeOptions, amplitude_photons, estimate_amplitudes

__all__ = ["refine", "RefinementInterrupted", "RunClock", "checkpoint_on_interrupt", "RunState", "start_run",
           "resume_run", "run_stage", "run_stages", "stage_objective", "stage_function", "whole_image_objective"]

log = logging.getLogger(__name__)


class RefinementInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a refinement; ``checkpoint`` is the file written (None if no path was given)."""

    def __init__(self, checkpoint: Path | None) -> None:
        where = f"; resume with resume={str(checkpoint)!r}" if checkpoint is not None else ""
        super().__init__(f"refinement interrupted{where}")
        self.checkpoint = checkpoint


@contextlib.contextmanager
def checkpoint_on_interrupt(save: Callable[[LoopState], Path | None],
                            save_at_start: Callable[[], Path | None] | None = None) -> Iterator[None]:
    """Around a loop (:func:`refine.solver.loop.minimise`): Ctrl-C inside it (:class:`LoopInterrupted`, carrying the
    state at the end of the last full step) writes ``save(state)`` and raises :class:`RefinementInterrupted`
    naming the file; Ctrl-C before the loop's first step (a plain ``KeyboardInterrupt``) does the same with
    ``save_at_start()``, or goes on as it is without one."""
    try:
        yield
    except LoopInterrupted as exc:
        raise RefinementInterrupted(save(exc.state)) from None
    except KeyboardInterrupt:
        if save_at_start is None:
            raise
        raise RefinementInterrupted(save_at_start()) from None


@dataclass
class RunClock:
    """The wall time of a run over its attempts: ``before_s`` seconds of the attempts before a resume (from its
    checkpoint), and this attempt's since ``started`` (:func:`time.monotonic`)."""

    before_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        """Wall seconds of the run, the attempts before a resume included."""
        return self.before_s + time.monotonic() - self.started


@dataclass
class RunState:
    """What changes while a run goes on: the current values, the history, the finished stages' summaries
    (as dicts), the stage to run next and, after a resume, the loop and preconditioner to continue."""

    values: dict
    initial_values: dict
    loss_initial: float
    history: History
    summaries: list = field(default_factory=list)
    first_stage: int = 0
    clock: RunClock = field(default_factory=RunClock)
    loop_resume: LoopState | None = None
    pre_resume: LinearPreconditioner | None = None
    held: frozenset = frozenset()  # candidate amplitudes too faint to refine (refine.fitting.structure_factors)
    #: the last stage's ``(names, strategy memory)`` when it was not preconditioned (else None): a next stage over
    #: the same names, not preconditioned either (the same raw units), starts from that memory (LBFGS: its
    #: curvature pairs)
    memory: tuple | None = None

    def elapsed(self) -> float:
        """Wall seconds of the run, the parts before a resume included."""
        return self.clock.elapsed()

    def last_status(self) -> tuple[Status, str]:
        if not self.summaries:
            return Status.CONVERGED, "no stage run"
        return Status(self.summaries[-1]["status"]), self.summaries[-1]["message"]


def start_run(plan: RunPlan, objective: ImageObjective) -> RunState:
    """A fresh run at the plan's start (``objective``: the whole fitted image, for the initial loss)."""
    with torch.no_grad():
        loss_initial = float(objective.evaluate(plan.start)[0])
    return RunState(values=dict(plan.start), initial_values=dict(plan.start), loss_initial=loss_initial,
                    history=History())


def resume_run(plan: RunPlan, path: str | Path) -> RunState:
    """The state stored in the checkpoint ``path``; it must have been written for this plan."""
    ckpt = read_checkpoint(path)
    if ckpt.fingerprint != plan.fingerprint:
        raise InputError(f"resume: {path} was written for another problem or plan")
    in_loop = ckpt.loop is not None
    # a canonical name added after the checkpoint was written (a later nbtorch): the model's value, which the
    # earlier run had too (e.g. mosaic_spread_a/b/c, N_d N_e N_f, the beam's widths), under the stored ones
    newer = {n: v for n, v in plan.start.items() if n not in ckpt.stage_values}
    return RunState(
        values={**newer, **ckpt.stage_values}, initial_values={**newer, **ckpt.initial_values},
        loss_initial=float(ckpt.loss_initial),
        history=History(ckpt.history), summaries=list(ckpt.summaries), first_stage=ckpt.stage_index,
        clock=RunClock(float(ckpt.elapsed_s)), loop_resume=LoopState.from_dict(ckpt.loop) if in_loop else None,
        pre_resume=(LinearPreconditioner(ckpt.precond["raw0"], ckpt.precond["A"])
                    if in_loop and ckpt.precond is not None else None),
        memory=None if in_loop or ckpt.memory is None else tuple(ckpt.memory))


def save_checkpoint(path: str | Path | None, plan: RunPlan, state: RunState, stage_index: int, stage_values: dict,
                    loop: LoopState | None, names: Sequence[str], pre: LinearPreconditioner | None = None) -> Path | None:
    """Write the run as it stands to ``path`` (None: nothing written).  At a stage boundary (``loop`` None)
    the checkpoint holds none of stage ``stage_index``'s rows; inside a stage, the rows up to the loop's step."""
    if path is None:
        return None
    history = state.history.up_to(stage_index, -1 if loop is None else loop.step)
    return write_checkpoint(path, RunCheckpoint(
        stage_index=stage_index, stage_values=dict(stage_values),
        loop=None if loop is None else loop.to_dict(), history=history.to_dict(), summaries=list(state.summaries),
        initial_values=state.initial_values, loss_initial=state.loss_initial, elapsed_s=state.elapsed(),
        fingerprint=plan.fingerprint, names=list(names),
        precond=None if loop is None or pre is None else {"raw0": pre.raw0, "A": pre.A},
        memory=None if loop is not None or state.memory is None else list(state.memory)))


def stage_objective(plan: RunPlan, stage: Stage, names: Sequence[str], values: Mapping[str, float]) -> ImageObjective:
    """The stage's view of the image (region, bins, fraction) and its loss; a stage refining N fits every
    pixel at full weight (its ``n_factor`` would scale the very thing refined)."""
    view = make_view(plan.sim, values, plan.valid, stage.roi_fraction, stage.bin, stage.roi_radius)
    refines_n = any(n in ("N", *SIZE_DIAGONAL, *SIZE_OFF_DIAGONAL) for n in names)
    return ImageObjective(plan.sim, plan.observed, view, plan.loss_fn, 1.0 if refines_n else stage.n_factor,
                          plan.compile_loss, priors=plan.priors, amplitudes=plan.amplitudes, restraint=plan.restraint,
                          background_model=plan.background_model)


def whole_image_objective(plan: RunPlan) -> tuple[View, ImageObjective]:
    """The view of every fitted pixel (no region, bins or fraction) and its objective: the initial loss and
    :func:`refine.solver.finalise.finalise` (the esds) use it."""
    view = make_view(plan.sim, plan.start, plan.valid)
    return view, ImageObjective(plan.sim, plan.observed, view, plan.loss_fn, priors=plan.priors,
                                amplitudes=plan.amplitudes, restraint=plan.restraint,
                                background_model=plan.background_model)


def _amplitude_stage(plan: RunPlan, state: RunState, index: int, names: Sequence[str],
                     objective: ImageObjective) -> tuple[str, ...]:
    """The names stage ``index`` refines.  A stage that frees amplitudes first (at the first such stage, with the
    ``estimate`` start, never on a resume inside it) estimates them from the observed spots at the geometry
    refined so far, then holds the candidates that would put fewer than ``min_photons`` on its pixels with their
    starting amplitudes (``state.held``, at those starting values: an estimate from so few photons is mostly
    noise; recomputed the same way on a resume, from the geometry the stage started at), as joint mode does."""
    table, options = plan.amplitudes, plan.amplitude_options
    if table is None or options is None or not set(names) & set(table.names):
        return tuple(names)
    first = next(i for i, (_, stage_names) in enumerate(plan.stages) if set(stage_names) & set(table.names))
    resumed = state.loop_resume is not None and index == state.first_stage
    if table.start_mode == "estimate" and index == first and not resumed:
        state.values.update(estimate_amplitudes(objective, table, state.values, options.iterations))
        log.info("structure factors: %d amplitudes estimated from the observed spots (%d EM updates)",
                 len(table.names), options.iterations)
    photons = amplitude_photons(objective, table, {**state.values, **table.starts})
    state.held = frozenset(n for n, p in photons.items() if not p >= options.min_photons)
    state.values.update({n: table.starts[n] for n in state.held})
    log.info("structure factors: %d amplitudes refined, %d held (fewer than %g photons on the fitted pixels)",
             len(table.names) - len(state.held), len(state.held), options.min_photons)
    return tuple(n for n in names if n not in state.held)


def _step_recorder(state: RunState, callbacks: CallbackList, stage: Stage, index: int, pmap: ParameterMap,
                   objective: ImageObjective, pre: LinearPreconditioner):
    """The loop's ``on_step``: one history row and one :class:`StepState` for the callbacks per point."""

    def on_step(point: LoopState) -> None:
        raw = pre.to_raw(point.raw)
        grad_raw = torch.linalg.solve(pre.A.T, point.grad) if point.grad.numel() else point.grad
        vals = pmap.values_at(raw)
        canon = canonical_values(vals)
        step = state.history.append(index, point.step, point.loss, point.grad_norm,
                                    {**canon, **{n: vals[n] for n in ORIENTATION_DELTAS}}, point.elapsed_s)
        callbacks.on_step(StepState(
            stage=stage.name, stage_index=index, step=step, stage_step=point.step, loss=point.loss,
            grad_norm=point.grad_norm, params=pmap.physical_floats(raw),
            grads={n: float(g) for n, g in zip(pmap.names, grad_raw)}, canonical=canon,
            model=None if point.aux is None else functools.partial(objective.model_image, point.aux),
            observed=objective.observed,
            weights=objective.weights))

    return on_step


def stage_function(objective, pmap: ParameterMap, pre, name: str):
    """The loop's ``fn(z) -> (loss, model)`` of a stage; on a GPU (the objective's simulator's device,
    :func:`nbtorch.runtime.cuda_graph.enabled`) a
    :class:`~refine.solver.graphed.GraphedObjective` that evaluates from device copies of ``z`` and the
    preconditioner, its loss and gradient replayed from one CUDA graph -- unless the simulator's diagnostics have
    subscribers (a replay runs no Python: they would hear nothing after the capture)."""
    device = objective.sim.device
    graphed = cuda_graph.enabled(device) and not len(objective.sim.diagnostics)
    here = pre.to(device) if graphed else pre

    def fn(z: Tensor) -> tuple[Tensor, Tensor]:
        # the amplitudes (if refined) as one vector made from tensors kept on the device (ParameterMap.physical_block)
        loss_value, model = objective.evaluate(pmap.expand(pmap.physical_block(here.to_raw(z))))
        return loss_value, model.detach()

    return GraphedObjective(fn, device, f"stage {name}'s loss and gradient") if graphed else fn


def run_stage(plan: RunPlan, state: RunState, index: int, callbacks: CallbackList,
              checkpoint: str | Path | None = None, checkpoint_every: int = 10) -> LoopResult:
    """Run stage ``index`` of the plan from ``state.values`` (or from the loop saved in ``state`` after a
    resume); on return ``state.values`` and ``state.summaries`` include it.

    Raises:
        RefinementInterrupted: Ctrl-C, after writing the checkpoint.
    """
    stage, names = plan.stages[index]
    objective = stage_objective(plan, stage, names, state.values)
    names = _amplitude_stage(plan, state, index, names, objective)
    pmap = ParameterMap(plan.space, state.values, names)
    resume = state.loop_resume if index == state.first_stage else None
    conv = stage.convergence
    if plan.time_budget_s is not None:  # the loop counts this stage's time before a resume too
        left = max(0.0, plan.time_budget_s - state.elapsed()) + (resume.elapsed_s if resume is not None else 0.0)
        conv = conv.replace(time_budget_s=left if conv.time_budget_s is None else min(left, conv.time_budget_s))
    stage_values = dict(state.values)
    callbacks.on_stage_start(stage, index)
    if resume is not None and state.pre_resume is not None:
        pre = state.pre_resume
    else:
        pre = make_preconditioner(stage.precondition, objective, pmap, pmap.raw0(plan.sim.dtype))

    fn = stage_function(objective, pmap, pre, stage.name)

    def save(point: LoopState | None) -> Path | None:
        return save_checkpoint(checkpoint, plan, state, index, stage_values, point, names, pre)

    carried = state.memory
    same_units = carried is not None and carried[0] == tuple(names) and stage.precondition is None
    memory = carried[1] if same_units else None
    # Ctrl-C during the start evaluation: a resume restarts this stage
    with checkpoint_on_interrupt(save, lambda: save_checkpoint(checkpoint, plan, state, index, stage_values, None,
                                                               names)):
        res = minimise(fn, pre.z0(), stage.strategy, conv, on_step=_step_recorder(state, callbacks, stage, index,
                                                                                   pmap, objective, pre),
                       on_checkpoint=save, checkpoint_every=checkpoint_every if checkpoint is not None else 0,
                       resume=resume, memory=memory)
    state.loop_resume = None
    state.memory = ((tuple(names), stage.strategy.memory_of(res.state.optimizer)) if stage.precondition is None
                    else None)
    state.values = pmap.values_at(pre.to_raw(res.state.raw))
    first_loss = state.history.first_loss(index)
    state.summaries.append(StageSummary(
        stage.name, res.status, res.message, res.state.step, res.state.evaluations,
        float(res.state.loss if first_loss is None else first_loss), res.state.loss, tuple(names), stage.describe(),
        res.state.elapsed_s).to_dict())
    log.info("stage %s: %s (%d steps, loss %.6g)", stage.name, res.status.value, res.state.step, res.state.loss)
    callbacks.on_stage_end(stage, index, res.status, res.message)
    return res


#: the arguments of :func:`refine` that :func:`refine.solver.plan.make_plan` takes
_PLAN_ARGUMENTS = ("start", "free", "fixed", "symmetry", "bounds", "mask", "stages", "strategy", "background", "loss",
                   "priors", "time_budget_s", "compile_loss", "n_spots", "too_few_spots", "structure_factors",
                   "panel_groups")


def refine(
    problem_or_simulator: Problem | Simulator,
    observed: np.ndarray | Tensor | None = None,
    *,
    start: Mapping[str, float] | None = None,
    free: Sequence[str] | None = None,
    fixed: Sequence[str] | None = None,
    symmetry: str | None = None,
    bounds: Mapping[str, tuple[float, float]] | None = None,
    mask: np.ndarray | Tensor | None = None,
    stages: Sequence[Stage] | None = None,
    strategy: str | AbstractStrategy | None = None,
    background: str | Any = "constant",
    loss: str | LossFn = "poisson",
    callbacks: Sequence[Any] = (),
    progress: bool | None = None,
    time_budget_s: float | None = None,
    checkpoint: str | Path | None = None, checkpoint_every: int = 10,
    resume: str | Path | None = None,
    esds: bool = True, compile_loss: bool = False,
    priors: Mapping[str, tuple[float, float]] | None = None,
    n_spots: int | None = None, too_few_spots: str = "fix",
    structure_factors: AmplitudeOptions | None = None,
    panel_groups: Sequence[Sequence[int]] | None = None,
    domain_check: bool | None = None,
) -> RefinementResult:
    """Refine simulator parameters against an observed image: a :class:`~refine.output.results.RefinementResult`.

    Arguments:
        problem_or_simulator: a :class:`~refine.inputs.problems.Problem` (its simulator, observed image, start,
            symmetry, free and fixed groups are the defaults of the arguments below; without ``observed`` its image
            is fitted in photons and its start and ``start`` become photon values, :meth:`Problem.counts`) or an
            :class:`nbtorch.Simulator` whose parameters are the starting model.
        observed: (slow, fast) photons (counts: ``DetectorCounts.photons`` first, :mod:`refine.inputs.detector_counts`);
            required with a simulator; NaN/Inf and negative pixels are ignored.
        start: starting values overriding the simulator's, by base name (canonical names, ``orient_x/y/z``,
            ``scale``, ``background``, ``background_x/y``); ``background`` defaults to the median of the
            observed image, ``scale`` to 1.
        free: groups/names the run may refine (each stage refines its own list intersected with this); None =
            whatever the stages name.  ``fixed``: groups/names never refined (e.g. a known ``distance``).
        symmetry: crystal system (``triclinic`` default, ``monoclinic`` (unique b), ``orthorhombic``,
            ``tetragonal``, ``trigonal``/``hexagonal``, ``rhombohedral``, ``cubic``).
        bounds: name -> (low, high): refine inside the open interval (a sigmoid transform).
        mask: (slow, fast) bool, True = use the pixel; ``background``: ``"constant"``, ``"planar"``, ``"resolution:K"``
            or a :class:`~refine.fitting.background.BackgroundModel` (``planes``).
        stages: the schedule (default :func:`~refine.solver.stages.stage_a` with ``strategy``: ``"lbfgs"``
            (default), ``"adam"`` or a strategy object).
        loss: ``"poisson"`` (half Poisson deviance, default), another :func:`losses.get_loss` name (summed), or
            ``(model, observed, weights) -> scalar``.
        callbacks: :class:`~refine.output.callbacks.Callback` objects; ``progress``: a tqdm bar (None: only when
            stderr is a terminal; False: quiet).  ``time_budget_s``: wall-clock budget of the whole run (s).
        checkpoint: HDF5 path written every ``checkpoint_every`` steps, at each stage end and on Ctrl-C;
            ``resume``: a checkpoint to continue from (same problem and plan).
        esds: estimate esds at the end (:mod:`refine.quality.uncertainty`); ``compile_loss``: ``torch.compile`` the loss.
        priors: name -> (mean, sigma): Gaussian priors on base names (in their units): ``0.5 ((value - mean) /
            sigma)^2`` added to the loss, ``1 / sigma^2`` to the esds' Fisher information.
        n_spots: observed spots in the fitted region (None: no check); below
            :data:`refine.quality.fit_quality.MIN_SPOTS_PER_PARAMETER` per refined name ``too_few_spots`` decides:
            ``"fix"`` (default: the least determined names), ``"warn"``, ``"fail"`` (:mod:`refine.quality.identifiability`).
        structure_factors: :class:`~refine.fitting.structure_factors.AmplitudeOptions`: refine one amplitude per
            visible symmetry-unique reflection in a last stage (``F_h_k_l`` in the result's ``refined``, ``esds``).
        panel_groups: a multi-panel simulator's rigid groups of panels (default one): ``<name>_g<k>``, multi-panel.md.
        domain_check: the cell against twice the mosaic domains (:mod:`refine.quality.domain_count`); None: not
            for a bank ``Problem`` (its image has the model's own domains), else on.

    Raises:
        InputError: bad arguments (unknown names, a start breaking the symmetry, shape mismatch, a checkpoint
            from another problem).
        RefinementInterrupted: Ctrl-C (a ``KeyboardInterrupt``), after writing the checkpoint.
    """
    plan = make_plan(problem_or_simulator, observed, **{k: v for k, v in locals().items() if k in _PLAN_ARGUMENTS})
    cb = _callback_list(callbacks, progress)
    full_view, full_objective = whole_image_objective(plan)
    state = resume_run(plan, resume) if resume is not None else start_run(plan, full_objective)
    status, message = run_stages(plan, state, cb, checkpoint, checkpoint_every)
    check = not isinstance(problem_or_simulator, Problem) if domain_check is None else domain_check
    result = finalise(plan, full_objective, full_view, state.values, state.initial_values, state.loss_initial,
                      state.summaries, state.history, status, message, state.elapsed(), esds, state.held, check)
    cb.on_run_end(result)
    return result


def _callback_list(callbacks: Sequence[Any], progress: bool | None) -> CallbackList:
    """The run's callbacks, and a progress bar unless ``progress`` is False (None: on a terminal only)."""
    cb = CallbackList(list(callbacks))
    if progress is not False:
        cb.callbacks.append(ProgressCallback(quiet=None if progress is None else not progress))
    return cb


def run_stages(plan: RunPlan, state: RunState, callbacks: CallbackList, checkpoint: str | Path | None = None,
               checkpoint_every: int = 10) -> tuple[Status, str]:
    """Run the plan's stages from ``state.first_stage`` (:func:`run_stage`), checkpointing at each boundary, until
    the last or one that ends the run (diverged, failed, out of time, no step); how the run ended."""
    callbacks.on_run_start(RunInfo(
        stages=tuple(s.describe() for s, _ in plan.stages), names=plan.names, hparams=plan.hparams,
        max_steps=sum(s.convergence.max_steps for s, _ in plan.stages), first_step=len(state.history)))
    status, message = state.last_status()
    for index in range(state.first_stage, len(plan.stages)):
        res = run_stage(plan, state, index, callbacks, checkpoint, checkpoint_every)
        status, message = res.status, f"stage {plan.stages[index][0].name}: {res.message}"
        if res.status in (Status.DIVERGED, Status.FAILED, Status.TIME_BUDGET, Status.NO_STEP):
            break
        if index + 1 < len(plan.stages):
            save_checkpoint(checkpoint, plan, state, index + 1, state.values, None, plan.stages[index + 1][1])
    return status, message
