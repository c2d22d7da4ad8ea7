"""A joint run's esds (:mod:`refine.many.joint`, ``esds=True``): the images' Fisher and score blocks summed,
densely up to :data:`refine.many.esds.MAX_DENSE` raw parameters, else by the distributed Schur complement; and the
mosaic domain count check on the shared cell (:mod:`refine.quality.domain_count`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from refine.fitting.parameters import ParameterMap, ParameterSpace
from refine.fitting.structure_factors import is_amplitude
import refine.many.esds as esds_module
from refine.many.esds import JointCovariances, joint_covariances, shared_covariance
from refine.many.exact_sum import exact_sums
from refine.many.memory import released
from refine.many.schur import eliminate, own_covariances
from refine.quality.domain_count import (CELL_NAMES, CountProbe, DomainCountCheck, check_names, reduced_terms,
                                         secant_factor, shared_shift)
from refine.quality.uncertainty import correlation_matrix, image_information, mark_blind, named_esds
from refine.solver.loop import LoopAborted
from refine.many.joint_images import ROW_CHUNK, Joint
from refine.many.sparse_amplitudes import amplitudes_at, image_information_sparse, summed
from refine.many.value_rows import gather_value_rows


log = logging.getLogger(__name__)



def _blocked_covariances(joint: Joint, info: Mapping[int, tuple], R: Tensor | None, S: int | None = None):
    """``(fisher, sandwich, condition)`` by the Schur complement with each image's own block eliminated on the
    process that holds it: only the ``(S, S)`` sums cross processes, exactly (:mod:`refine.many.schur`); ``S``:
    the shared names of ``info``'s blocks (default all; the geometry's in :mod:`refine.many.sparse_amplitudes`)."""
    S_all, K = joint.S, joint.K
    S = S_all if S is None else S
    held = {(h - S_all) // K: (h - S_all) % K for h in joint.held}
    parts = {i: eliminate(F, M, S, held.get(i)) for i, (_, F, M) in info.items()}
    rows = [torch.cat([e.schur.reshape(-1), e.meat.reshape(-1)]).to(torch.float64) for e in parts.values()]
    total = exact_sums(torch.stack(rows) if rows else torch.zeros(0, 2 * S * S, dtype=torch.float64),
                       joint.vector.layout.reduce_sum)  # summed exactly over every process's images
    schur, meat = total[:S * S].reshape(1, S, S), total[S * S:].reshape(1, S, S)
    conds = torch.tensor([max([1.0] + [e.condition for e in parts.values()])], dtype=torch.float64)
    if joint.vector.layout.reduce_max is not None:
        joint.vector.layout.reduce_max(conds)
    C_ss, blind, Q, cond = shared_covariance(schur, meat, R)
    own = {i: own_covariances(e, C_ss, Q, K) for i, e in parts.items()}  # this process's images only
    fisher_own = {i: o[0] for i, o in own.items()}
    sandwich_own = {i: o[1] for i, o in own.items()}
    S_ss = C_ss @ Q @ C_ss
    return (JointCovariances(mark_blind(C_ss, blind), fisher_own),
            JointCovariances(mark_blind(0.5 * (S_ss + S_ss.T), blind), sandwich_own),
            max([cond] + conds.reshape(-1).tolist()))


def _esds(joint: Joint, raw: Tensor, space: ParameterSpace, shared_names, per_names,
          starts: Mapping[int, dict], start0: dict) -> tuple[dict, float, np.ndarray]:
    """``(esds_by_kind, fisher condition, shared correlation)`` from the joint Fisher and score matrices:
    dense up to :data:`MAX_DENSE` raw parameters, else by the distributed Schur complement.  Each image's esds
    are named on the process that holds it (``starts``: its images' map starts; ``start0``: image 0's) and
    gathered as :class:`~refine.many.value_rows.ValueRows`."""
    if joint.tail is not None:
        return _sparse_esds(joint, raw, space, shared_names, per_names, starts, start0)
    S, K, n = joint.S, joint.K, joint.n
    q = S + K
    info = {im.index: image_information(im.objective, im.pmap, joint.image_raw(raw, im.index)) for im in joint.images}
    theta0 = joint.comm.gather({0: info[0][0][:S]} if 0 in info else {}, 1, (S,), torch.float64)[0]
    R = joint.curvature(raw[:S], False).to(torch.float64) if joint.curvature is not None else None
    if S + n * K > esds_module.MAX_DENSE:
        fisher, sandwich, cond = _blocked_covariances(joint, info, R)
    else:
        F_blocks = joint.comm.gather({i: v[1] for i, v in info.items()}, n, (q, q), torch.float64)
        M_blocks = joint.comm.gather({i: v[2] for i, v in info.items()}, n, (q, q), torch.float64)
        fisher, sandwich, cond = joint_covariances(F_blocks, M_blocks, S, R, joint.held, blocked=False)
    out = _named(joint, {"sandwich": sandwich, "fisher": fisher}, {i: v[0] for i, v in info.items()}, theta0,
                 ParameterMap(space, start0, shared_names), starts, space, per_names, S)
    S0 = sum(1 for nm in shared_names if not is_amplitude(nm))  # the amplitudes follow the other shared names
    count = _domain_count(joint, info, R, shared_names, out["sandwich"]["shared"])
    return out, cond, correlation_matrix(sandwich.shared[:S0, :S0]).numpy().copy(), count


def _named(joint: Joint, by_kind: Mapping[str, JointCovariances], thetas: Mapping[int, Tensor], theta0: Tensor,
           shared_map: ParameterMap, starts: Mapping[int, dict], space: ParameterSpace, per_names, S: int) -> dict:
    """Each kind's esds by name: the shared ones of ``shared_map`` at ``theta0``, each image's own (its theta
    after the first ``S``) gathered as :class:`~refine.many.value_rows.ValueRows`; a held own name has none."""
    K, S_all = joint.K, joint.S
    own_maps = {i: ParameterMap(space, starts[i], per_names) for i in thetas} if K else {}
    out: dict[str, dict] = {}
    for kind, cov in by_kind.items():
        images = {i: named_esds(own_maps[i], thetas[i].to(torch.float64)[S:], cov.own[i]) if K else {}
                  for i in thetas}
        for k in joint.held:  # image 0's scale next to shared structure factors: not refined, no esd
            images.get((k - S_all) // K, {}).pop(per_names[(k - S_all) % K], None)
        out[kind] = {"shared": named_esds(shared_map, theta0, cov.shared),
                     "images": gather_value_rows(joint.comm, images, joint.n)}
    return out


def _sparse_esds(joint: Joint, raw: Tensor, space: ParameterSpace, shared_names, per_names,
                 starts: Mapping[int, dict], start0: dict):
    """:func:`_esds` of the diagonal treatment (:mod:`refine.many.sparse_amplitudes`): the geometry's by the
    Schur complement over the geometry names, each amplitude's from its diagonal; no domain count check."""
    tail = joint.tail
    S0, S, A = tail.S0, joint.S, tail.A
    order = sorted(joint.slots)
    by_index = {im.index: im for im in joint.images}
    at = amplitudes_at(joint, raw)
    infos: dict = {}  # each still's geometry blocks (theta, F, B); its amplitude diagonal is summed as it is made
    d_amp: list = []  # the amplitudes' d physical / d raw: the same for every still (shared transforms), kept once

    def amplitude_rows():
        for i in released(order):
            v = image_information_sparse(joint, by_index[i], raw, at)
            infos[i] = (v.theta, v.F, v.B)
            if not d_amp:
                d_amp.append(v.d[S0:S].to(torch.float64))
            yield v.amplitudes

    restraint = tail.restraint_diagonal(raw.as_subclass(Tensor)[:S], False)
    info = summed(joint, amplitude_rows(), A) + restraint
    R = tail.geometry_curvature(raw[:S0], False).to(torch.float64) if tail.geometry_curvature is not None else None
    fisher, sandwich, cond = _blocked_covariances(joint, infos, R, S0)
    theta0 = joint.comm.gather({0: infos[0][0][:S0].to(torch.float64)} if 0 in infos else {}, 1, (S0,),
                               torch.float64)[0]
    out = _named(joint, {"sandwich": sandwich, "fisher": fisher}, {i: v[0] for i, v in infos.items()}, theta0,
                 ParameterMap(space, start0, shared_names[:S0]), starts, space, per_names, S0)
    by_slot = [im for im in sorted(joint.images, key=lambda im: joint.slots[im.index])]

    def scores():  # each still's score in the amplitudes (physical units), a chunk of stills at a time
        for c in range(0, len(by_slot), ROW_CHUNK):
            chunk = by_slot[c:c + ROW_CHUNK]
            rows = joint.rows(raw, chunk)[:, 1 + S0:1 + S].to(torch.float64)
            d = d_amp[0].expand(len(chunk), -1)
            yield (rows / torch.where(d != 0, d, torch.ones_like(d))) ** 2

    # the sandwich's meat clustered by still (a reflection's spots in different stills are its independent
    # measurements; the scatter of their scores carries what the model misses between stills), with the small-sample
    # factor n / (n - 1) of its n observing stills, and never below the Fisher esd (one or two observations)
    nobs = torch.as_tensor(tail.amps.nobs, dtype=torch.float64)[tail.columns] if tail.amps.nobs is not None \
        else torch.ones(A, dtype=torch.float64)
    factor = torch.where(nobs >= 2, nobs / torch.clamp(nobs - 1, min=1.0), torch.zeros_like(nobs))
    meat = factor * summed(joint, scores(), A) + restraint
    ok = info > 0
    safe = torch.where(ok, info, torch.ones_like(info))
    fisher_esd = torch.where(ok, 1.0 / torch.sqrt(safe), math.nan)
    sandwich_esd = torch.where(ok, torch.maximum(torch.sqrt(meat) / safe, 1.0 / torch.sqrt(safe)), math.nan)
    names = shared_names[S0:]
    for kind, esd in (("fisher", fisher_esd), ("sandwich", sandwich_esd)):
        out[kind]["shared"].update({n: float(e) for n, e in zip(names, esd)})
    log.info("joint esds: %d amplitudes from their diagonal (conditional on the other names); the mosaic domain "
             "count check is not made", A)
    return out, cond, correlation_matrix(sandwich.shared).numpy().copy(), None


def _domain_count(joint: Joint, info: Mapping[int, tuple], R: Tensor | None, shared_names,
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
        layout = joint.vector.layout
        terms = torch.stack(list(local.values())) if local else torch.zeros(0, S * S + S, dtype=torch.float64)
        total = exact_sums(terms, layout.reduce_sum)
        counts = torch.tensor([float(domains)], dtype=torch.float64)
        if layout.reduce_max is not None:
            layout.reduce_max(counts)
        if float(counts.max()) < 2:
            return None
        d_s = shared_shift([(total[:S * S].reshape(S, S), total[S * S:])], R)
        slopes = {}
        for i, (probe, theta, F, g_own, diff) in probes.items():
            B, D = F[:S, S:], F[S:, S:]
            d_o = -(torch.linalg.pinv(D) @ (diff[S:] + B.T @ d_s)) if D.numel() else d_s.new_zeros(0)
            d = torch.cat([d_s, d_o])
            _, g_end = probe.gradients(theta.to(torch.float64) + d.to(theta.dtype), own=False)
            slopes[i] = torch.tensor([float(d @ diff), float(d @ (g_end - g_own))], dtype=torch.float64)
        h = exact_sums(torch.stack(list(slopes.values())) if slopes else torch.zeros(0, 2, dtype=torch.float64),
                       layout.reduce_sum)
        alpha = secant_factor(float(h[0]), float(h[1]))
        return check_names(list(shared_names)[:S], alpha * d_s, esds, int(counts.max()), alpha)
    except LoopAborted:
        raise
    except Exception as exc:  # noqa: BLE001 - a report, not the refinement
        log.warning("mosaic domain count check failed: %s", exc)
        return None


def joint_esds(esds: bool, joint, raw: Tensor, space, shared_names, per_names, starts: Mapping[int, dict],
               start0: dict) -> tuple[list[str], dict]:
    """The joint esds as the result's fields, and the warnings (the estimate failed); ``starts``: the map starts
    of this process's images, ``start0``: image 0's."""
    warnings: list[str] = []
    esd_fields: dict[str, Any] = {}
    if esds:
        try:
            by_kind, cond, corr, count = _esds(joint, raw, space, shared_names, per_names, starts, start0)
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
