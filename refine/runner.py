"""The front door: :func:`refine` runs a staged refinement and returns a :class:`RefinementResult`."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.setup import PARAMETER_NAMES
from nbtorch.simulator import ORIENTATION_DELTAS, Simulator
from refine.callbacks import CallbackList, ProgressCallback, RunInfo, StepState
from refine.checkpoint import RunCheckpoint, read_checkpoint, write_checkpoint
from refine.loop import LoopInterrupted, LoopState, Status, minimise
from refine.fit_quality import assess_poisson_fit
from refine.objective import ImageObjective, LossFn, make_view, poisson_deviance, resolve_loss
from refine.precondition import LinearPreconditioner, make_preconditioner
from refine.parameters import (
    BASE_NAMES, REFINABLE, ParameterMap, ParameterSpace, canonical_values, units_of,
)
from refine.problems import Problem
from refine.results import RefinementResult, StageSummary
from refine.stages import Stage, stage_a
from refine.strategies import AbstractStrategy
from refine.uncertainty import ESD_KINDS, estimate_uncertainties

__all__ = ["refine", "RefinementInterrupted"]

log = logging.getLogger(__name__)
_HISTORY_COLUMNS = ("step", "stage", "stage_step", "loss", "grad_norm")


class RefinementInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a refinement; ``checkpoint`` is the file written (None if no path was given)."""

    def __init__(self, checkpoint: Path | None) -> None:
        where = f"; resume with resume={str(checkpoint)!r}" if checkpoint is not None else ""
        super().__init__(f"refinement interrupted{where}")
        self.checkpoint = checkpoint


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
    background: str = "constant",
    loss: str | LossFn = "poisson",
    callbacks: Sequence[Any] = (),
    progress: bool | None = None,
    time_budget_s: float | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 10,
    resume: str | Path | None = None,
    esds: bool = True,
    compile_loss: bool = False,
) -> RefinementResult:
    """Refine simulator parameters against an observed image.

    Arguments:
        problem_or_simulator: a :class:`~refine.problems.Problem` (its simulator, observed
            image, start, symmetry, free and fixed groups are the defaults of the arguments
            below) or an :class:`nbtorch.Simulator` whose parameters are the starting model.
        observed: (slow, fast) observed image in photons (a pedestal is fine: it is fitted as
            background); required with a simulator.  NaN/Inf and negative pixels are ignored.
        start: starting values overriding the simulator's, by base name (canonical names,
            ``orient_x/y/z``, ``scale``, ``background``, ``background_x/y``).  ``background``
            defaults to the median of the observed image, ``scale`` to 1.
        free: groups/names the run may refine (each stage refines its own list intersected
            with this); None = whatever the stages name.
        fixed: groups/names never refined (e.g. ``("distance",)`` with a known distance).
        symmetry: crystal system (``triclinic`` default, ``monoclinic`` (unique b),
            ``orthorhombic``, ``tetragonal``, ``trigonal``/``hexagonal``, ``rhombohedral``, ``cubic``).
        bounds: name -> (low, high): refine inside the open interval (a sigmoid transform).
        mask: (slow, fast) bool, True = use the pixel.
        stages: the schedule (default :func:`~refine.stages.stage_a` with ``strategy``).
        strategy: ``"lbfgs"`` (default), ``"adam"`` or a strategy object for the default stages.
        background: ``"constant"`` or ``"planar"``.
        loss: ``"poisson"`` (half Poisson deviance, default), another :func:`losses.get_loss`
            name (summed), or ``(model, observed, weights) -> scalar``.
        callbacks: objects implementing :class:`~refine.callbacks.Callback`.
        progress: show a tqdm bar (None = only when stderr is a terminal; False = quiet).
        time_budget_s: wall-clock budget of the whole run (seconds).
        checkpoint: HDF5 path written every ``checkpoint_every`` steps, at each stage end
            and on Ctrl-C.
        resume: a checkpoint to continue from (same problem and plan).
        esds: estimate uncertainties at the end (Fisher information; :mod:`refine.uncertainty`).
        compile_loss: wrap the loss in ``torch.compile(fullgraph=True)``.

    Returns:
        :class:`~refine.results.RefinementResult`.

    Raises:
        InputError: bad arguments (unknown names, a start breaking the symmetry, shape
            mismatch, a checkpoint from another problem).
        RefinementInterrupted: Ctrl-C (a ``KeyboardInterrupt``), after writing the checkpoint.
    """
    t0 = time.monotonic()
    # ---- inputs -------------------------------------------------------------------------
    problem = problem_or_simulator if isinstance(problem_or_simulator, Problem) else None
    if problem is not None:
        sim = problem.simulator()
        observed = problem.observed if observed is None else observed
        start = {**problem.start, **(start or {})}
        symmetry = symmetry or problem.symmetry
        free = problem.free if free is None else free
        fixed = problem.fixed if fixed is None else fixed
    elif isinstance(problem_or_simulator, Simulator):
        sim = problem_or_simulator
    else:
        raise InputError(f"problem_or_simulator: expected a Problem or a Simulator, got {type(problem_or_simulator).__name__}")
    if observed is None:
        raise InputError("observed: an observed image is required")
    symmetry = symmetry or "triclinic"
    fixed = tuple(fixed or ())
    obs = torch.as_tensor(np.asarray(observed) if not isinstance(observed, Tensor) else observed)
    obs = obs.to(dtype=sim.dtype, device=sim.device)
    if tuple(obs.shape) != tuple(sim.shape):
        raise InputError(f"observed: shape {tuple(obs.shape)} does not match the detector {tuple(sim.shape)} (slow, fast)")
    valid = torch.isfinite(obs) & (obs >= 0)
    if mask is not None:
        m = torch.as_tensor(np.asarray(mask) if not isinstance(mask, Tensor) else mask)
        if m.dtype != torch.bool or tuple(m.shape) != tuple(sim.shape):
            raise InputError(f"mask: expected a bool array of shape {tuple(sim.shape)}, got {m.dtype} {tuple(m.shape)}")
        valid &= m.to(valid.device)
    if sim.setup.pixel_mask is not None:
        valid &= torch.as_tensor(sim.setup.pixel_mask, device=valid.device)
    if not bool(valid.any()):
        raise InputError("observed: no usable pixels (all masked, NaN or negative)")
    obs = torch.where(valid, obs, torch.zeros((), dtype=obs.dtype, device=obs.device))

    values0 = {n: float(sim.setup.params[n]) for n in PARAMETER_NAMES}
    values0.update({n: 0.0 for n in ORIENTATION_DELTAS})
    values0.update({"scale": 1.0, "background": float(obs[valid].median()), "background_x": 0.0, "background_y": 0.0})
    for k, v in (start or {}).items():
        if k not in BASE_NAMES:
            raise InputError(f"start: unknown parameter {k!r}; valid: {', '.join(BASE_NAMES)}")
        values0[k] = float(v)

    stages = tuple(stages) if stages is not None else stage_a(strategy)
    if not stages:
        raise InputError("stages: at least one stage is needed")
    named = set(free or ()) | set(fixed) | {n for s in stages for n in s.free}
    space = ParameterSpace(symmetry=symmetry, anisotropic_N=bool(named & {"N_a", "N_b", "N_c"}),
                           background=background, bounds=dict(bounds or {}), fixed=fixed,
                           pixel_mm=sim.setup.pixel_m * 1000.0)
    space.check_start(values0)
    run_free = set(space.expand(free)) if free is not None else None
    plan: list[tuple[Stage, tuple[str, ...]]] = []
    for stage in stages:
        names = space.expand(stage.free)
        if run_free is not None:
            names = tuple(n for n in names if n in run_free)
        if names:
            plan.append((stage, names))
        else:
            log.info("stage %s has nothing to refine; skipped", stage.name)
    if not plan:
        raise InputError("nothing to refine: every stage's parameters are fixed or outside free=")
    all_names = tuple(n for n in REFINABLE if any(n in names for _, names in plan))
    loss_fn = resolve_loss(loss)
    fingerprint = {
        "shape": list(sim.shape),
        "observed_sha1": hashlib.sha1(obs.detach().cpu().numpy().tobytes()).hexdigest(),
        "stages": [[s.name, list(n)] for s, n in plan],
        "symmetry": symmetry,
    }
    hparams: dict[str, Any] = {
        "strategy": ",".join(sorted({s.strategy.name for s, _ in plan})), "symmetry": symmetry,
        "loss": loss if isinstance(loss, str) else getattr(loss, "__name__", "custom"),
        "background": background, "stages": "/".join(s.name for s, _ in plan), "n_free": len(all_names),
        "time_budget_s": time_budget_s or 0.0, "compile_loss": compile_loss,
    }
    for s, _ in plan:
        for k, v in s.strategy.hparams().items():
            hparams.setdefault(f"{s.strategy.name}_{k}", v)

    cb = CallbackList([c for c in callbacks])
    if progress is not False:
        cb.callbacks.append(ProgressCallback(quiet=None if progress is None else not progress))

    full_view = make_view(sim, values0, valid)
    full_objective = ImageObjective(sim, obs, full_view, loss_fn)

    # ---- resume -------------------------------------------------------------------------
    ckpt = read_checkpoint(resume) if resume is not None else None
    if ckpt is not None:
        if ckpt.fingerprint != fingerprint:
            raise InputError(f"resume: {resume} was written for another problem or plan")
        first_stage = ckpt.stage_index
        values = dict(ckpt.stage_values)
        initial_values = dict(ckpt.initial_values)
        loss_initial = float(ckpt.loss_initial)
        history = {k: list(v) for k, v in ckpt.history.items() if k != "params"}
        history["params"] = {k: list(v) for k, v in ckpt.history["params"].items()}
        summaries_d = list(ckpt.summaries)
        elapsed_before = float(ckpt.elapsed_s)
        loop_resume = LoopState.from_dict(ckpt.loop) if ckpt.loop is not None else None
        pre_resume = (LinearPreconditioner(ckpt.precond["raw0"], ckpt.precond["A"])
                      if ckpt.loop is not None and ckpt.precond is not None else None)
    else:
        first_stage = 0
        values = dict(values0)
        initial_values = dict(values0)
        with torch.no_grad():
            loss_initial = float(full_objective.evaluate(values0)[0])
        history = {c: [] for c in _HISTORY_COLUMNS}
        history["params"] = {}
        summaries_d = []
        elapsed_before = 0.0
        loop_resume = None
        pre_resume = None

    def elapsed() -> float:
        return elapsed_before + time.monotonic() - t0

    def save(stage_index: int, stage_values: dict, loop: LoopState | None, names: Sequence[str],
             pre: LinearPreconditioner | None = None) -> Path | None:
        if checkpoint is None:
            return None
        hist = {c: list(history[c]) for c in _HISTORY_COLUMNS}
        hist["params"] = {k: list(v) for k, v in history["params"].items()}
        # keep exactly the rows up to the loop's step (none of this stage at a stage boundary)
        last = -1 if loop is None else loop.step
        keep = [i for i, (st, ss) in enumerate(zip(hist["stage"], hist["stage_step"]))
                if st < stage_index or (st == stage_index and ss <= last)]
        hist = {c: [hist[c][i] for i in keep] for c in _HISTORY_COLUMNS} | {
            "params": {k: [v[i] for i in keep] for k, v in hist["params"].items()}}
        return write_checkpoint(checkpoint, RunCheckpoint(
            stage_index=stage_index, stage_values=dict(stage_values),
            loop=None if loop is None else loop.to_dict(), history=hist, summaries=list(summaries_d),
            initial_values=initial_values, loss_initial=loss_initial, elapsed_s=elapsed(),
            fingerprint=fingerprint, names=list(names),
            precond=None if loop is None or pre is None else {"raw0": pre.raw0, "A": pre.A}))

    cb.on_run_start(RunInfo(stages=tuple(s.describe() for s, _ in plan), names=all_names, hparams=hparams,
                            max_steps=sum(s.convergence.max_steps for s, _ in plan),
                            first_step=len(history["step"])))

    # ---- stages -------------------------------------------------------------------------
    status, message = Status.CONVERGED, "no stage run"
    if summaries_d:
        status, message = Status(summaries_d[-1]["status"]), summaries_d[-1]["message"]
    for index in range(first_stage, len(plan)):
        stage, names = plan[index]
        pmap = ParameterMap(space, values, names)
        n_free = any(n in ("N", "N_a", "N_b", "N_c") for n in names)
        view = make_view(sim, values, valid, stage.roi_fraction, stage.bin, stage.roi_radius)
        objective = ImageObjective(sim, obs, view, loss_fn, 1.0 if n_free else stage.n_factor, compile_loss)
        conv = stage.convergence
        resuming = loop_resume is not None and index == first_stage
        if time_budget_s is not None:
            # the loop counts this stage's time before a resume too
            left = max(0.0, time_budget_s - elapsed()) + (loop_resume.elapsed_s if resuming else 0.0)
            conv = conv.replace(time_budget_s=left if conv.time_budget_s is None else min(left, conv.time_budget_s))
        stage_values = dict(values)
        cb.on_stage_start(stage, index)
        if resuming and pre_resume is not None:
            pre = pre_resume
        else:
            pre = make_preconditioner(stage.precondition, objective, pmap, pmap.raw0(sim.dtype))

        def fn(z: Tensor, pmap=pmap, objective=objective, pre=pre) -> tuple[Tensor, Tensor]:
            loss_value, model = objective.evaluate(pmap.expand(pmap.physical(pre.to_raw(z))))
            return loss_value, model.detach()

        def on_step(state: LoopState, index=index, stage=stage, pmap=pmap, objective=objective, pre=pre) -> None:
            raw = pre.to_raw(state.raw)
            grad_raw = torch.linalg.solve(pre.A.T, state.grad) if state.grad.numel() else state.grad
            vals = pmap.values_at(raw)
            canon = canonical_values(vals)
            row = dict(canon)
            row.update({n: vals[n] for n in ORIENTATION_DELTAS})
            history["step"].append(len(history["step"]))
            history["stage"].append(index)
            history["stage_step"].append(state.step)
            history["loss"].append(state.loss)
            history["grad_norm"].append(state.grad_norm)
            n_rows = len(history["step"])
            for k, v in row.items():
                col = history["params"].setdefault(k, [])
                col.extend([v] * (n_rows - 1 - len(col)))  # names that appear later: pad with their value
                col.append(v)
            cb.on_step(StepState(
                stage=stage.name, stage_index=index, step=n_rows - 1, stage_step=state.step, loss=state.loss,
                grad_norm=state.grad_norm, params=pmap.physical_floats(raw),
                grads={n: float(g) for n, g in zip(pmap.names, grad_raw)}, canonical=canon,
                model=None if state.aux is None else objective.model_image(state.aux), observed=objective.observed,
                weights=objective.weights))

        try:
            res = minimise(fn, pre.z0(), stage.strategy, conv, on_step=on_step,
                           on_checkpoint=lambda st, i=index, sv=stage_values, nm=names, pr=pre: save(i, sv, st, nm, pr),
                           checkpoint_every=checkpoint_every if checkpoint is not None else 0,
                           resume=loop_resume if resuming else None)
        except LoopInterrupted as exc:
            path = save(index, stage_values, exc.state, names, pre)
            raise RefinementInterrupted(path) from None
        except KeyboardInterrupt:  # during the start evaluation: resume restarts this stage
            path = save(index, stage_values, None, names)
            raise RefinementInterrupted(path) from None
        loop_resume = None
        values = pmap.values_at(pre.to_raw(res.state.raw))
        first_loss = history["loss"][[i for i, st in enumerate(history["stage"]) if st == index][0]] \
            if index in history["stage"] else res.state.loss
        summary = StageSummary(stage.name, res.status, res.message, res.state.step, res.state.evaluations,
                               float(first_loss), res.state.loss, tuple(names), stage.describe(),
                               res.state.elapsed_s)
        summaries_d.append(summary.to_dict())
        status, message = res.status, f"stage {stage.name}: {res.message}"
        log.info("stage %s: %s (%d steps, loss %.6g)", stage.name, res.status.value, res.state.step, res.state.loss)
        cb.on_stage_end(stage, index, res.status, res.message)
        if res.status in (Status.DIVERGED, Status.FAILED, Status.TIME_BUDGET):
            break
        if index + 1 < len(plan):
            save(index + 1, values, None, plan[index + 1][1])

    # ---- final model, esds, result --------------------------------------------------------
    with torch.no_grad():
        loss_final_t, _ = full_objective.evaluate(values)
        model_roi = full_objective.full_model(values)
    loss_final = float(loss_final_t)
    model = torch.zeros(sim.shape, dtype=sim.dtype)
    x0, x1, y0, y1 = full_view.roi
    model[y0:y1 + 1, x0:x1 + 1] = model_roi.detach().cpu()
    used = torch.zeros(sim.shape, dtype=torch.bool)
    used[y0:y1 + 1, x0:x1 + 1] = full_view.mask.cpu()
    obs_np = obs.detach().cpu().numpy()
    residuals = np.where(used.numpy(), obs_np - model.numpy(), 0.0)

    fit: dict[str, Any] = {}
    warnings: list[str] = []
    if loss_fn is poisson_deviance:
        quality = assess_poisson_fit(loss_final, model_roi, full_objective.weights)
        fit = quality.to_dict()
        if quality.warning is not None:
            warnings.append(quality.warning)
    final_map = ParameterMap(space, values, all_names)
    esd_dict: dict[str, float] = {}
    esd_kinds: dict[str, dict[str, float]] = {}
    corr = np.zeros((0, 0))
    cov = np.zeros((0, 0))
    cond = math.nan
    if esds:
        try:
            u = estimate_uncertainties(full_objective, final_map, final_map.raw0(sim.dtype), excess=fit.get("excess"))
            esd_dict, corr, cov, cond = u.as_dict(), u.correlation, u.covariance, u.condition
            esd_kinds = {kind: u.as_dict(kind) for kind in ESD_KINDS}
        except Exception as exc:  # noqa: BLE001 - esds are a report, not the refinement
            log.warning("esd estimation failed: %s", exc)
    for w in warnings:  # also in result.warnings, summary() and the nbtorch-refine output
        log.info("%s", w)
    params = canonical_values(values)
    init_params = canonical_values(initial_values)
    if background != "planar":
        for d in (params, init_params):
            d.pop("background_x", None)
            d.pop("background_y", None)
    refined = {n: final_map.start_value(n) for n in all_names}
    units = units_of(list(params) + list(all_names) + list(esd_dict))
    summaries = tuple(StageSummary(d["name"], Status(d["status"]), d["message"], d["steps"], d["evaluations"],
                                   d["loss_start"], d["loss_end"], tuple(d["free"]), d["settings"], d["wall_s"])
                      for d in summaries_d)
    result = RefinementResult(
        status=status, message=message, params=params, initial_params=init_params, refined=refined,
        esds=esd_dict, units=units, free=all_names, correlation=np.asarray(corr), covariance=np.asarray(cov),
        fisher_condition=float(cond), loss_initial=loss_initial, loss_final=loss_final,
        steps=sum(s.steps for s in summaries), evaluations=sum(s.evaluations for s in summaries),
        wall_s=elapsed(), stages=summaries, history=history, observed=obs_np, model=model.numpy(),
        residuals=residuals, mask=used.numpy(), symmetry=symmetry, hparams=hparams, fit=fit,
        warnings=tuple(warnings), esd_kinds=esd_kinds)
    cb.on_run_end(result)
    return result
