"""A joint run's result (:mod:`refine.many.joint`): the :class:`~refine.output.results.JointResult` of the
ended loop, with the esds, each image's fit against shot noise and the shared amplitudes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import Tensor

from nbtorch.parameters import MISSET_NAMES
from refine.fitting.parameters import BASE_NAMES, ORIENTATION_DELTAS, ParameterMap, units_of
from refine.fitting.structure_factors import is_amplitude
from refine.many.amplitudes import SharedAmplitudes
from refine.many.checkpoint import JointCheckpoint
from refine.output.results import JointResult, reported_values
from refine.quality.fit_quality import FitQuality, assess_poisson_fit
from refine.solver.loop import LoopResult
from refine.many.joint_checkpoints import JointCheckpoints
from refine.many.joint_esds import joint_esds
from refine.many.joint_images import Joint, image_values
from refine.many.joint_problem import JointProblem, shared_canonical
from refine.many.value_rows import ValueRows, gather_value_rows


def finish(problem: JointProblem, res: LoopResult, saver: "JointCheckpoints", resumed: JointCheckpoint | None,
            esds: bool) -> JointResult:
    """The :class:`JointResult` of the ended loop: every image's final values, the esds, the amplitudes."""
    p, joint = problem, problem.joint
    raw = saver.pre.to_raw(res.state.raw).detach().as_subclass(Tensor)  # this process's part
    finals = {}
    for im in joint.images:
        values = im.pmap.values_at(joint.image_raw(raw, im.index))
        finals[im.index] = {k: float(values[k]) for k in BASE_NAMES}
    warnings, esd_fields = joint_esds(esds, joint, raw, p.space, p.shared_names, p.per_names, p.map_starts,
                                      p.map_start0)
    result = _joint_result(res, joint, finals, p.starts, esd_fields, warnings, shared_names=p.shared_names,
                           per_names=p.per_names, background=p.space.background, symmetry=p.space.symmetry,
                           loss_name=p.loss_name, wall_s=saver.clock.elapsed(), world=p.comm.world,
                           resumed_from_step=None if resumed is None else resumed.step)
    result = dataclasses.replace(result, priors=dict(p.priors))
    result = _with_fit(result, joint, raw, p.amps is not None) if p.loss_name == "poisson" else result
    if p.amps is None:
        return result
    shared_map = ParameterMap(p.space, p.map_start0, p.shared_names)
    return _with_amplitudes(result, p.amps, shared_map.values_at(raw[:joint.S]))


def _with_fit(result: JointResult, joint: Joint, raw: Tensor, amplitudes: bool) -> JointResult:
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
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(rows[:, 1] > 0, rows[:, 0] / rows[:, 1], math.inf)
    per_image = ValueRows(("loss", "expected_loss", "excess", "pixels"),
                          np.stack([rows[:, 0], rows[:, 1], excess, rows[:, 2]], 1), np.ones((len(rows), 4), bool),
                          {"pixels"})
    return dataclasses.replace(result, fit=total.to_dict(), image_fit=per_image, warnings=warnings)


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


def _joint_result(res: LoopResult, joint: Joint, finals: dict, starts: dict, esd_fields: dict, warnings: list[str],
                  *, shared_names, per_names, background: str, symmetry: str, loss_name: str, wall_s: float,
                  world: int, resumed_from_step: int | None) -> JointResult:
    """The :class:`JointResult` of a finished loop: canonical values per image (``finals``, ``starts``: this
    process's images' base values, by index; every image's gathered as :class:`ValueRows`), the shared ones, esds."""
    n, comm = joint.n, joint.comm
    keep = shared_canonical(shared_names)

    image_params = gather_value_rows(comm, {i: reported_values(v, background) for i, v in finals.items()}, n)
    initial_images = gather_value_rows(comm, {i: reported_values(v, background) for i, v in starts.items()}, n)
    final0, start0 = image_values(comm, finals, 0), image_values(comm, starts, 0)

    def shared_of(value0: dict, canonical: ValueRows) -> dict:
        """The shared names' values: canonical ones from image 0; a shared orientation as its deltas
        ``orient_x/y/z`` and, when every image has the same crystal orientation, its ``misset_x/y/z``."""
        first = canonical[0]
        out = {k: first[k] if k in first else float(value0.get(k, 0.0)) for k in keep}
        if any(k in ORIENTATION_DELTAS for k in keep):
            misset = np.stack([canonical.column(m) for m in MISSET_NAMES], 1)
            if np.allclose(misset, misset[0], rtol=0.0, atol=1e-9):
                out.update(zip(MISSET_NAMES, misset[0].tolist()))
        return out
    kind = esd_fields.get("esd_kind")
    by = esd_fields.get("esds_by_kind", {})
    image_losses = (joint.image_losses(res.state.aux) if isinstance(res.state.aux, Tensor)
                    else torch.full((n,), math.nan))
    history = tuple({k: h[k] for k in ("step", "loss", "grad_norm", "step_norm", "evaluations")}
                    for h in res.state.history)
    all_names = list(keep) + list(per_names) + list(image_params.names) + ["misset_x", "misset_y", "misset_z"]
    no_esds = ValueRows((), np.zeros((n, 0)), np.zeros((n, 0), bool))
    return JointResult(
        status=res.status, message=res.message,
        shared=shared_of(final0, image_params), shared_esds=dict(by[kind]["shared"]) if kind else {},
        images=image_params, image_esds=by[kind]["images"] if kind else no_esds,
        initial_shared=shared_of(start0, initial_images), initial_images=initial_images,
        shared_names=tuple(shared_names), per_image_names=tuple(per_names), symmetry=symmetry, loss_name=loss_name,
        loss_initial=float(res.state.history[0]["loss"]) if res.state.history else math.nan,
        loss_final=float(res.state.loss), image_losses=tuple(float(x) for x in image_losses),
        steps=res.state.step, evaluations=res.state.evaluations, wall_s=wall_s,
        world_size=world, units=units_of(dict.fromkeys(all_names)), history=history,
        warnings=tuple(warnings), **{k: v for k, v in esd_fields.items() if k != "esd_kind"},
        esd_kind=kind, resumed_from_step=resumed_from_step,
        refined={k: float(final0["N_a" if k == "N" else k]) for k in shared_names if not is_amplitude(k)})
