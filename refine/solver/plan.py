"""Step 1 of a refinement: validated inputs become a frozen :class:`RunPlan`.

:func:`make_plan` checks everything :func:`refine.refine` is given (the observed image against the
detector, the mask, the start values against the crystal system, the stages against ``free``/``fixed``,
the loss, the priors) before any simulation runs, and records what the run will do: the starting
values, the parameter space, each stage with the names it refines, and a fingerprint that a checkpoint
must match to be resumed.  Nothing in a plan changes while the run goes on.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.config import ANISOTROPIC_SHAPE
from nbtorch.parameters import ORIENTATION_DELTAS, PARAMETER_NAMES, SIZE_OFF_DIAGONAL
from nbtorch.simulator import Simulator
from refine.quality.identifiability import reduce_free
from refine.fitting.objective import LossFn, check_priors, resolve_loss
from refine.fitting.background import (
    BackgroundModel, is_knot, parse_background, plane_background, resolution_background,
)
from refine.fitting.parameters import BASE_NAMES, ParameterSpace, is_panel_name, split_group_change
from nbtorch.geometry.panels import check_rigid_group
from refine.inputs.selection import resolution_map
from refine.inputs.problems import Problem
from refine.solver.stages import Stage, stage_a, with_amplitudes
from refine.fitting.structure_factors import (
    AmplitudeOptions, AmplitudeRestraint, AmplitudeTable, amplitude_table, is_amplitude,
)
from refine.solver.strategies import AbstractStrategy

__all__ = ["RunPlan", "make_plan", "observed_pixels", "model_values", "starting_values", "background_model",
           "panel_space"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    """What a refinement will do, fixed before it starts.

    Attributes:
        sim: the simulator (its parameters are the starting model).
        observed: (slow, fast) observed photons, 0 where ``valid`` is False; ``valid``: the pixels fitted.
        start: every base value at the start (canonical names, ``orient_x/y/z``, scale, background...).
        space: the parameter space (symmetry, bounds, fixed names, background model).
        stages: ``(stage, names refined)`` of every stage that refines something, in order.
        names: every name refined in some stage (the order of the esds and correlation).
        loss_fn, loss_name: the loss as ``(model, observed, weights) -> scalar`` and its name.
        priors: name -> (mean, sigma), Gaussian priors added to every stage's loss.
        fingerprint: what a checkpoint must match to be resumed (shape, observed image, stages, symmetry,
            priors).
        hparams: flat settings for the callbacks (TensorBoard's hparams).
        warnings: one line each, said before the run and kept in the result (e.g. parameters fixed
            because the spots are too few: :func:`refine.quality.identifiability.reduce_free`).
        amplitudes, amplitude_options, restraint: the structure-factor table whose amplitudes are refined
            (``sim`` holds it), how, and its restraint (None when the structure factors are not refined).
    """

    sim: Simulator
    observed: Tensor
    valid: Tensor
    start: dict
    space: ParameterSpace
    stages: tuple[tuple[Stage, tuple[str, ...]], ...]
    names: tuple[str, ...]
    loss_fn: LossFn
    loss_name: str
    priors: dict
    symmetry: str
    background: str
    compile_loss: bool
    time_budget_s: float | None
    fingerprint: dict
    hparams: dict
    warnings: tuple[str, ...] = ()
    amplitudes: AmplitudeTable | None = None
    amplitude_options: AmplitudeOptions | None = None
    restraint: AmplitudeRestraint | None = None
    background_model: BackgroundModel | None = None


def background_model(sim: Simulator, background, values: Mapping[str, float], observed, valid, spots=None,
                     half_px: int | None = None) -> BackgroundModel | None:
    """The :class:`~refine.fitting.background.BackgroundModel` of ``background`` (a model is returned as it is; the
    text of a kind is checked): ``resolution:K`` from the resolution of the fitted pixels at ``values``' geometry,
    its knots started from the pixels between ``spots``; ``planes`` from the windows of ``half_px`` around
    ``spots``; None for ``constant`` and ``planar``.  ``observed``, ``valid``: (slow, fast) photons and fitted
    pixels (arrays or tensors)."""
    if isinstance(background, BackgroundModel):
        return background
    spec = parse_background(background)
    if spec.kind in ("constant", "planar"):
        return None
    roi = tuple(int(v) for v in sim.setup.roi)
    obs = observed.detach().cpu().numpy() if isinstance(observed, Tensor) else np.asarray(observed)
    fit = valid.detach().cpu().numpy() if isinstance(valid, Tensor) else np.asarray(valid, dtype=bool)
    if spec.kind == "planes":
        return plane_background(obs, fit, spots, half_px, roi)
    return resolution_background(resolution_map(sim, roi, values), roi, obs, fit, spec, spots)


def _background(sim: Simulator, background, values0: dict, obs: Tensor, valid: Tensor):
    """``(text, model)`` of the run's ``background`` (:func:`background_model`; ``planes`` must come built, with
    its spots); the model's starting knots go into ``values0`` unless given."""
    if not isinstance(background, BackgroundModel) and parse_background(background).kind == "planes":
        raise InputError("background planes: needs the observed spots; build it with "
                         "refine.solver.plan.background_model(..., spots=, half_px=) (nbtorch-refine: --spots/--refl)")
    model = background_model(sim, background, values0, obs, valid)
    if model is None:
        return parse_background(background).text, None
    values0.update({n: v for n, v in (model.start or {}).items() if n not in values0})
    return model.text, model


def _problem_defaults(problem_or_simulator, observed, start, free, fixed, symmetry):
    """The simulator and the arguments a :class:`Problem` provides where the caller gave none.

    A problem's own image is counts (photons + its pedestal, :attr:`Problem.counts`): without ``observed`` the
    run fits photons, ``counts.photons(problem.observed)``, as ``nbtorch-refine --problem`` does, and the
    problem's start and the caller's ``start`` (values of a fit to those counts, as :attr:`Problem.truth`) become
    photon values (:meth:`~refine.inputs.detector_counts.DetectorCounts.photon_values`: the background less the
    pedestal); the pixels below the pedestal are negative photons, which :func:`observed_pixels` leaves out.  With
    ``observed`` nothing is converted."""
    if isinstance(problem_or_simulator, Problem):
        problem = problem_or_simulator
        start = {**problem.start, **(start or {})}
        if observed is None:
            observed = problem.counts.photons(problem.observed)[0]
            start = problem.counts.photon_values(start)
        return (problem.simulator(), observed, start, problem.free if free is None else free,
                problem.fixed if fixed is None else fixed, symmetry or problem.symmetry)
    if isinstance(problem_or_simulator, Simulator):
        return problem_or_simulator, observed, start, free, fixed, symmetry
    raise InputError(f"problem_or_simulator: expected a Problem or a Simulator, got {type(problem_or_simulator).__name__}")


def observed_pixels(sim: Simulator, observed, mask) -> tuple[Tensor, Tensor]:
    """The observed image on the simulator's device and dtype (0 where unusable) and the usable pixels:
    finite, >= 0, inside ``mask`` and the model's own mask."""
    if observed is None:
        raise InputError("observed: an observed image is required")
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
    return torch.where(valid, obs, torch.zeros((), dtype=obs.dtype, device=obs.device)), valid


def panel_space(sim: Simulator, panel_groups=None) -> dict:
    """The :class:`ParameterSpace` arguments of a multi-panel simulator's panels (``panel_groups``: the panels of
    each rigid group; default one group, the whole detector); none for one panel.  Whether a group can move as
    one rigid body is checked where its changes are refined (:func:`check_refined_groups`)."""
    layout = sim.panel_layout
    if layout is None:
        if panel_groups:
            raise InputError("panel_groups: the simulator has one panel")
        return ParameterSpace()
    n = len(layout.panels)
    groups = tuple(tuple(int(i) for i in g) for g in panel_groups) if panel_groups else (tuple(range(n)),)
    seen = sorted(i for g in groups for i in g)
    if seen != list(range(n)):
        raise InputError(f"panel_groups: every panel 0..{n - 1} must be in exactly one group, got {list(groups)}")
    return ParameterSpace(panel_groups=groups, n_panels=n)


def check_refined_groups(sim: Simulator, space: ParameterSpace, names: tuple[str, ...]) -> None:
    """Every panel group whose changes ``<name>_g<k>`` are among the refined ``names`` must be a rigid body
    (its panels parallel and equally oriented: :func:`nbtorch.geometry.panels.check_rigid_group`); groups whose geometry
    is held may be anything (a CSPAD's whole detector, its quadrants turned 90 degrees to each other)."""
    refined = sorted({g[1] for g in map(split_group_change, names) if g is not None})
    for k in refined:
        check_rigid_group(sim.panel_layout, space.panel_groups[k], str(k))


def model_values(sim: Simulator) -> dict:
    """Every base value of the simulator's model: its parameters, no rotation, scale 1, no background (what a fit of
    spot positions starts from; :func:`starting_values` adds the observed background)."""
    values = {n: float(sim.setup.params[n]) for n in PARAMETER_NAMES}
    values.update({n: 0.0 for n in ORIENTATION_DELTAS})
    values.update({"scale": 1.0, "background": 0.0, "background_x": 0.0, "background_y": 0.0})
    return values


def starting_values(sim: Simulator, obs: Tensor, valid: Tensor, start: Mapping[str, float] | None,
                    panel_groups=None) -> dict:
    """The simulator's parameters, no rotation, scale 1, the median observed pixel as background (a multi-panel
    detector: its per-panel values and group changes 0), then ``start`` over them (names checked)."""
    values = model_values(sim)
    values["background"] = float(obs[valid].median())
    if sim.panel_layout is not None:  # every panel's geometry, and each group's change (0 at the start)
        values.update(sim.panel_layout.values())
        values.update({n: 0.0 for n in panel_space(sim, panel_groups).group_changes})
    for k, v in (start or {}).items():
        if k in values and is_panel_name(k):
            values[k] = float(v)
            continue
        if k not in BASE_NAMES and not is_amplitude(k) and not is_knot(k):  # amplitudes: checked against the table
            raise InputError(f"start: unknown parameter {k!r}; valid: {', '.join(BASE_NAMES)}")
        values[k] = float(v)
    return values


def _stage_plan(space: ParameterSpace, stages: Sequence[Stage], free) -> tuple[tuple[Stage, tuple[str, ...]], ...]:
    """Each stage with the names it refines (its own list within ``free``); stages left with none are skipped."""
    run_free = set(space.expand(free)) if free is not None else None
    plan = []
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
    return tuple(plan)


def _space_and_stages(sim: Simulator, symmetry: str, named: set, background: str, bounds, fixed: tuple,
                      values0: dict, stages: Sequence[Stage], free, amplitudes: tuple[str, ...] = (),
                      panel_groups=None):
    """The parameter space (start checked against it), each stage's names and every name refined."""
    panels = panel_space(sim, panel_groups)
    space = ParameterSpace(symmetry=symmetry, anisotropic_N=bool(named & {"N_a", "N_b", "N_c"}),
                           anisotropic_mosaic=sim.setup.sampling.mosaic_anisotropic,
                           background=background, bounds=dict(bounds or {}), fixed=fixed,
                           pixel_mm=sim.setup.pixel_m * 1000.0, amplitudes=tuple(amplitudes),
                           panel_groups=panels.panel_groups, n_panels=panels.n_panels,
                           beam_widths=sim.source_width_names())
    space.check_start(values0)
    plan = _stage_plan(space, stages, free)
    names = tuple(n for n in space.all_names if any(n in stage_names for _, stage_names in plan))
    check_refined_groups(sim, space, names)
    off = [n for n in names if n in SIZE_OFF_DIAGONAL]
    if off and sim.setup.shape != ANISOTROPIC_SHAPE:
        raise InputError(f"{', '.join(off)}: the off-diagonal crystal sizes act only with -gauss_aniso_xtal in the "
                         f"model flags (the crystal shape is {sim.setup.shape}); refine them with that shape")
    return space, plan, names


def _amplitudes(sim: Simulator, values0: dict, valid: Tensor, stages: tuple, named: set,
                options: AmplitudeOptions | None):
    """``(sim, stages, table, restraint)``: with ``options``, the simulator holding the amplitude table, the
    stages with an ``amplitudes`` stage last (unless one names ``structure_factors``), the table (its starting
    amplitudes put in ``values0``) and the restraint; without, everything as it was."""
    if options is None:
        if any(is_amplitude(n) for n in values0):
            raise InputError(f"start: {next(n for n in values0 if is_amplitude(n))} is an amplitude; refining "
                             "amplitudes needs structure_factors= (a space group)")
        if "structure_factors" in named:
            raise InputError("structure_factors: refining the amplitudes needs a space group "
                             "(refine(structure_factors=AmplitudeOptions('P41212')), nbtorch-refine --symmetry P41212 "
                             "--structure-factors)")
        return sim, stages, None, None
    if not any("structure_factors" in s.free for s in stages):
        stages = with_amplitudes(stages)  # and the run's free= (a problem's default) gains the group
    table, sim = amplitude_table(sim, values0, valid, options.space_group, start=options.start,
                                 min_photons=options.min_photons, anomalous=options.anomalous)
    if not table.names:
        log.warning("structure factors: no reflection has %g photons on the fitted pixels; none is refined",
                    options.min_photons)
    unknown = [n for n in values0 if is_amplitude(n) and n not in table.starts]
    if unknown:
        raise InputError(f"start: {unknown[0]} is not a refinable amplitude of this run (free: the reflections with "
                         f">= {options.min_photons:g} photons on the fitted pixels)")
    values0.update({n: v for n, v in table.starts.items() if n not in values0})  # a given start wins
    return sim, stages, table, options.restraint(table)


def _hparams(plan, names, symmetry, loss_name, background, time_budget_s, compile_loss) -> dict[str, Any]:
    hparams: dict[str, Any] = {
        "strategy": ",".join(sorted({s.strategy.name for s, _ in plan})), "symmetry": symmetry, "loss": loss_name,
        "background": background, "stages": "/".join(s.name for s, _ in plan), "n_free": len(names),
        "time_budget_s": time_budget_s or 0.0, "compile_loss": compile_loss,
    }
    for s, _ in plan:
        for k, v in s.strategy.hparams().items():
            hparams.setdefault(f"{s.strategy.name}_{k}", v)
    return hparams


def make_plan(
    problem_or_simulator: Problem | Simulator,
    observed=None,
    *,
    start: Mapping[str, float] | None = None,
    free: Sequence[str] | None = None,
    fixed: Sequence[str] | None = None,
    symmetry: str | None = None,
    bounds: Mapping[str, tuple[float, float]] | None = None,
    mask=None,
    stages: Sequence[Stage] | None = None,
    strategy: str | AbstractStrategy | None = None,
    background: str | BackgroundModel = "constant",
    loss: str | LossFn = "poisson",
    priors: Mapping[str, tuple[float, float]] | None = None,
    time_budget_s: float | None = None,
    compile_loss: bool = False,
    n_spots: int | None = None,
    too_few_spots: str = "fix",
    structure_factors: AmplitudeOptions | None = None,
    panel_groups: Sequence[Sequence[int]] | None = None,
) -> RunPlan:
    """Check the arguments of :func:`refine.refine` (same meaning) and return the run's plan.

    With ``n_spots`` (observed spots in the fitted region), too few spots for the names refined are
    handled by ``too_few_spots`` (:func:`refine.quality.identifiability.reduce_free`: fix, warn or fail).
    With ``structure_factors`` the amplitudes of the visible reflections are refined in a last stage
    (:mod:`refine.fitting.structure_factors`).  ``panel_groups``: a multi-panel simulator's rigid panel groups
    (:func:`panel_space`; default the whole detector).

    Raises:
        InputError: unknown names, a start breaking the symmetry, a shape mismatch, no usable pixel,
            nothing to refine, a bad loss or prior.
    """
    sim, observed, start, free, fixed, symmetry = _problem_defaults(
        problem_or_simulator, observed, start, free, fixed, symmetry)
    symmetry = symmetry or "triclinic"
    fixed = tuple(fixed or ())
    obs, valid = observed_pixels(sim, observed, mask)
    values0 = starting_values(sim, obs, valid, start, panel_groups)
    background, background_model = _background(sim, background, values0, obs, valid)
    stages = tuple(stages) if stages is not None else stage_a(strategy)
    if not stages:
        raise InputError("stages: at least one stage is needed")
    named = set(free or ()) | set(fixed) | {n for s in stages for n in s.free}
    sim, stages, table, restraint = _amplitudes(sim, values0, valid, stages, named, structure_factors)
    if table is not None and free is not None and "structure_factors" not in free:
        free = tuple(free) + ("structure_factors",)
    amps = table.names if table is not None else ()
    space, plan, names = _space_and_stages(sim, symmetry, named, background, bounds, fixed, values0, stages, free,
                                           amps, panel_groups)
    warnings: tuple[str, ...] = ()
    if n_spots is not None:
        more_fixed, warning = reduce_free(names, n_spots, too_few_spots)
        warnings = (warning,) if warning else ()
        if more_fixed:
            space, plan, names = _space_and_stages(sim, symmetry, named, background, bounds, fixed + more_fixed,
                                                   values0, stages, free, amps, panel_groups)
    loss_fn = resolve_loss(loss)
    loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
    priors = check_priors(priors)
    fingerprint = {
        "shape": list(sim.shape),
        "observed_sha1": hashlib.sha1(obs.detach().cpu().numpy().tobytes()).hexdigest(),
        "stages": [[s.name, list(n)] for s, n in plan],
        "symmetry": symmetry,
    }
    if structure_factors is not None:  # absent otherwise (older checkpoints still match)
        fingerprint["structure_factors"] = structure_factors.describe() | {"free": len(amps)}
    if priors:  # absent without priors, so that checkpoints written before priors existed still match
        fingerprint["priors"] = {k: list(v) for k, v in sorted(priors.items())}
    return RunPlan(sim=sim, observed=obs, valid=valid, start=values0, space=space, stages=plan, names=names,
                   loss_fn=loss_fn, loss_name=loss_name, priors=priors, symmetry=symmetry, background=background,
                   compile_loss=compile_loss, time_budget_s=time_budget_s, fingerprint=fingerprint,
                   hparams=_hparams(plan, names, symmetry, loss_name, background, time_budget_s, compile_loss),
                   warnings=warnings, amplitudes=table, amplitude_options=structure_factors, restraint=restraint,
                   background_model=background_model)
