"""Last step of a refinement: the final model image, the fit quality, the esds and the result.

:func:`finalise` evaluates the whole fitted image once at the final values (the stages may have used a
region, bins or a fraction of it), compares the loss with its shot-noise expectation
(:mod:`refine.quality.fit_quality`, Poisson deviance only) and measures the spread of the pixels' Poisson
z-scores (sigZ, :mod:`refine.quality.misfit`), estimates the uncertainties of every refined name
(:mod:`refine.quality.uncertainty`; a failure there is logged, the refinement still stands) and assembles the
:class:`~refine.output.results.RefinementResult`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from refine.quality.domain_count import CELL_NAMES, DomainCountCheck, single_check
from refine.quality.fit_quality import assess_poisson_fit
from refine.quality.misfit import poisson_z_spread
from refine.solver.history import History
from refine.solver.loop import Status
from refine.fitting.objective import ImageObjective, View, poisson_deviance
from refine.fitting.parameters import ParameterMap, units_of
from refine.solver.plan import RunPlan
from refine.output.results import RefinementResult, StageSummary, reported_values
from refine.quality.uncertainty import ESD_KINDS, estimate_uncertainties

__all__ = ["finalise"]

log = logging.getLogger(__name__)


def _full_images(plan: RunPlan, objective: ImageObjective, view: View, values: Mapping[str, float]):
    """``(loss, model, used, model in the view)`` at ``values``: the model and the fitted-pixel mask on the
    whole detector (0 / False outside the region of interest)."""
    with torch.no_grad():
        loss_t, _ = objective.evaluate(values)
        model_roi = objective.full_model(values)
    sim = plan.sim
    model = torch.zeros(sim.shape, dtype=sim.dtype)
    x0, x1, y0, y1 = view.roi
    model[y0:y1 + 1, x0:x1 + 1] = model_roi.detach().cpu()
    used = torch.zeros(sim.shape, dtype=torch.bool)
    used[y0:y1 + 1, x0:x1 + 1] = view.mask.cpu()
    return float(loss_t), model.numpy(), used.numpy(), model_roi


def _no_esds() -> dict[str, Any]:
    """The result's uncertainty fields when there is no estimate."""
    return {"esds": {}, "esd_kinds": {}, "correlation": np.zeros((0, 0)), "covariance": np.zeros((0, 0)),
            "fisher_condition": math.nan}


def _esds(objective: ImageObjective, pmap: ParameterMap, excess: float | None) -> tuple[dict[str, Any], Any]:
    """The uncertainty estimate as the result's fields (empty ones when it fails: it is a report), and the
    :class:`~refine.quality.uncertainty.Uncertainties` (None when it failed)."""
    out = _no_esds()
    try:
        u = estimate_uncertainties(objective, pmap, pmap.raw0(objective.sim.dtype), excess=excess)
    except Exception as exc:  # noqa: BLE001 - esds are a report, not the refinement
        log.warning("esd estimation failed: %s", exc)
        return out, None
    out.update(esds=u.as_dict(), esd_kinds={kind: u.as_dict(kind) for kind in ESD_KINDS},
               correlation=np.asarray(u.correlation), covariance=np.asarray(u.covariance),
               fisher_condition=float(u.condition))
    return out, u


def _domain_count(objective: ImageObjective, pmap: ParameterMap, u) -> DomainCountCheck | None:
    """Would the refined cell move at twice the mosaic domain count (:mod:`refine.quality.domain_count`)?  None
    without a refined cell length or angle, without mosaic domains, or when the check fails (it is a report)."""
    if u is None or not any(n in CELL_NAMES for n in pmap.names):
        return None
    try:
        return single_check(objective, pmap, torch.as_tensor(u.values, dtype=objective.dtype),
                            torch.as_tensor(u.fisher), u.as_dict())
    except Exception as exc:  # noqa: BLE001 - a report, not the refinement
        log.warning("mosaic domain count check failed: %s", exc)
        return None


def _fit_quality(plan: RunPlan, loss_final: float, model_roi, objective: ImageObjective,
                 held: frozenset) -> tuple[dict[str, Any], str | None]:
    """The final fit against shot noise (Poisson deviance only: ``{}`` otherwise) and its warning."""
    if plan.loss_fn is not poisson_deviance:
        return {}, None
    quality = assess_poisson_fit(loss_final, model_roi, objective.weights)
    if plan.amplitudes is not None and any(n not in held for n in plan.amplitudes.names):
        quality = dataclasses.replace(quality, amplitudes_refined=True)
    return quality.to_dict(), quality.warning


def finalise(plan: RunPlan, objective: ImageObjective, view: View, values: Mapping[str, float],
             initial_values: Mapping[str, float], loss_initial: float, summaries: Sequence[dict],
             history: History, status: Status, message: str, wall_s: float, esds: bool = True,
             held: frozenset = frozenset(), domain_check: bool = True) -> RefinementResult:
    """The result of a run that ended at ``values``.

    Arguments:
        plan: the run's plan; ``objective`` and ``view``: the whole fitted image (no binning, no fraction).
        values: base values at the end; ``initial_values``: at the start (``loss_initial`` there).
        summaries: every finished stage's :meth:`StageSummary.to_dict`; ``history``: the run's rows.
        status, message: how the run ended; ``wall_s``: its wall time (resumed parts included).
        esds: estimate uncertainties (False: empty esds and correlation).
        held: candidate amplitudes the run held (too faint to refine): not among the result's free names.
        domain_check: the check of the cell against twice the mosaic domain count (:mod:`refine.quality.domain_count`).
    """
    loss_final, model, used, model_roi = _full_images(plan, objective, view, values)
    obs_np = plan.observed.detach().cpu().numpy()
    fit, fit_warning = _fit_quality(plan, loss_final, model_roi, objective, held)
    names = tuple(n for n in plan.names if n not in held)
    final_map = ParameterMap(plan.space, values, names)
    uncertainty, u = _esds(objective, final_map, fit.get("excess")) if esds else (_no_esds(), None)
    count_check = _domain_count(objective, final_map, u) if domain_check else None
    warnings = list(plan.warnings) + [w for w in (fit_warning, count_check and count_check.warning) if w]
    for w in warnings:  # also in result.warnings, summary() and the nbtorch-refine output
        log.info("%s", w)
    params, init_params = reported_values(values, plan.background), reported_values(initial_values, plan.background)
    stage_summaries = tuple(StageSummary(d["name"], Status(d["status"]), d["message"], d["steps"], d["evaluations"],
                                         d["loss_start"], d["loss_end"], tuple(d["free"]), d["settings"], d["wall_s"])
                            for d in summaries)
    return RefinementResult(
        status=status, message=message, params=params, initial_params=init_params,
        refined={n: final_map.start_value(n) for n in names},
        units=units_of(list(params) + list(names) + list(uncertainty["esds"])), free=names,
        loss_initial=loss_initial, loss_final=loss_final, steps=sum(s.steps for s in stage_summaries),
        evaluations=sum(s.evaluations for s in stage_summaries), wall_s=wall_s, stages=stage_summaries,
        history=history.to_dict(), observed=obs_np, model=model, residuals=np.where(used, obs_np - model, 0.0),
        mask=used, symmetry=plan.symmetry, hparams=plan.hparams, fit=fit, warnings=tuple(warnings),
        amplitudes=plan.amplitudes,
        amplitude_values={} if plan.amplitudes is None else {n: float(values[n]) for n in plan.amplitudes.names},
        diagnostics=poisson_z_spread(obs_np, model, used).to_dict(), **uncertainty,
        mosaic_domains={} if count_check is None else count_check.to_dict(),
        background_image=None if plan.background_model is None else plan.background_model.image(values, model.shape))
