"""Many shared amplitudes in a joint run: each amplitude's information from its own diagonal, never a matrix of
all of them (:func:`refine.many.joint.refine_joint` with ``structure_factors``; ``AmplitudeOptions.information``).

The shared names of a joint run with structure factors are ``[geometry (S0), amplitudes (A)]`` and each still has
``K`` own names.  The dense treatment (:mod:`refine.many.joint_precondition`, :mod:`refine.many.joint_esds`) builds
every still's Fisher block over all ``S0 + A + K`` names, one derivative pass per name and still, and the
preconditioner's coupling rows ``(stills, K, S0 + A)``: at a few hundred amplitudes and a hundred stills the passes
take hours, and at 10^4 of each the matrices do not fit.  Here (``information="diagonal"``, and ``"auto"`` above
:data:`DENSE_AMPLITUDES` refined amplitudes):

* **the geometry** (the shared geometry names and each still's own) keeps the dense arrowhead of
  :mod:`refine.many.schur` over ``S0 + K`` names: each still's block from the esds' Jacobian
  (:func:`~refine.quality.uncertainty.image_information`) with the amplitudes at their current values;
* **the amplitudes**: each still's diagonal information in them (:func:`~refine.fitting.amplitude_information.
  amplitude_information`: eight passes a still, whatever the number of amplitudes), summed exactly over every
  process's stills (:class:`~refine.many.exact_sum.ExactSum`), plus the restraint's diagonal
  (:meth:`~refine.fitting.structure_factors.AmplitudeRestraint.curvature_diagonal`).  The preconditioner whitens
  each amplitude by it alone (:class:`~refine.many.schur.ArrowheadPreconditioner`'s ``tail``); LBFGS learns the
  couplings (neighbouring spots, the scales) from its steps;
* **esds**: the geometry's from its arrowhead (the amplitudes held: conditional on them); each amplitude's from
  its diagonal, ``1 / sqrt(I_h + R_hh)`` (Fisher) and ``max(sqrt(M_h) / (I_h + R_hh), Fisher)`` (sandwich;
  ``M_h``: the squares of each still's score in ``F_h`` summed over the stills, times ``n / (n - 1)`` for its
  ``n`` observing stills, 0 below two, plus ``R_hh``: the stills are the clusters, as a reflection's spots in
  different stills are its independent measurements).  Both are conditional on every other parameter, so at most
  the dense marginal esds where an amplitude shares its spots' information with a still's scale or a neighbour
  (measured against the dense inverse in the tests and docs/structure-factors.md); the mosaic domain count check is
  not made.

Memory per process: its stills' objectives, ``(K, K)`` and ``(K, S0)`` factors each, and vectors of ``A``
numbers; the loss and gradient rows of its stills are summed a chunk at a time
(:data:`refine.many.joint_images.ROW_CHUNK`).  Nothing of size ``A^2`` or ``stills x A`` is built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import ChainMap
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.fitting.amplitude_information import amplitude_information
from refine.fitting.amplitude_values import AmplitudeValues, layered
from refine.fitting.parameters import ParameterMap
from refine.fitting.structure_factors import AMPLITUDE_BLOCK
from refine.many.exact_sum import ExactSum
from refine.many.memory import released
from refine.many.schur import ArrowheadPreconditioner, arrowhead_factors, arrowhead_preconditioner
from refine.quality.uncertainty import image_information
from refine.solver.precondition import diagonal_whitening, physical_per_raw

__all__ = ["DENSE_AMPLITUDES", "INFORMATION", "AmplitudeTail", "use_diagonal", "ImageInformation",
           "image_information_sparse", "amplitudes_at", "sparse_preconditioner", "summed"]

log = logging.getLogger(__name__)

#: ``AmplitudeOptions.information``'s choices
INFORMATION = ("auto", "dense", "diagonal")
#: with ``information="auto"``, up to this many refined amplitudes the dense blocks (exact couplings), above it the
#: diagonal
DENSE_AMPLITUDES = 64


def use_diagonal(information: str, n_free: int, interpolate: bool) -> bool:
    """Whether a run with ``n_free`` refined amplitudes takes the diagonal treatment (module docstring); a
    tricubic-interpolating model (every evaluation reads 64 entries) cannot."""
    if information == "dense":
        return False
    if interpolate:
        if information == "diagonal":
            raise InputError("structure_factors: information 'diagonal' needs a model without interpolation of the "
                             "structure factors (-nointerpolate); use 'dense'")
        return False
    return information == "diagonal" or n_free > DENSE_AMPLITUDES


@dataclass
class AmplitudeTail:
    """The diagonal treatment's facts about a joint run: ``S0`` geometry names before the ``A`` amplitudes among
    the ``S`` shared ones, the run's :class:`~refine.many.amplitudes.SharedAmplitudes`, the shared names' map and
    the priors' curvature on the geometry names (``(raw[:S0], raw_units) -> (S0, S0)``, or None)."""

    S0: int
    A: int
    amps: object
    shared_map: ParameterMap
    geometry_curvature: Callable[[Tensor, bool], Tensor] | None = None

    def __post_init__(self) -> None:
        where = {n: i for i, n in enumerate(self.amps.table.names)}
        self.columns = torch.tensor([where[n] for n in self.shared_map.names[self.S0:]], dtype=torch.long)

    def restraint_diagonal(self, raw_shared: Tensor, raw_units: bool) -> Tensor:
        """(A,) the restraint's curvature on the refined amplitudes at ``raw_shared`` (physical or raw units)."""
        restraint = self.amps.restraint
        if restraint is None:
            return torch.zeros(self.A, dtype=torch.float64)
        raw_shared = raw_shared.detach().to(torch.float64)
        values = self.shared_map.values_at(raw_shared)
        F = self.amps.table.vector(values, torch.float64, "cpu")
        diag = restraint.curvature_diagonal(F)[self.columns]
        if raw_units:
            diag = diag * physical_per_raw(self.shared_map, raw_shared)[self.S0:] ** 2
        return diag


@dataclass
class ImageInformation:
    """One still's information in the diagonal treatment, physical units: ``theta``, ``F``, ``B`` over
    ``[geometry shared (S0), own (K)]`` (:func:`~refine.quality.uncertainty.image_information`), ``amplitudes``
    (A,) the diagonal in the refined amplitudes, ``d`` (S + K,) ``d physical / d raw`` of every name."""

    theta: Tensor
    F: Tensor
    B: Tensor
    amplitudes: Tensor
    d: Tensor

    def geometry_raw(self, S0: int, S: int) -> Tensor:
        """(S0 + K, S0 + K) the geometry block in raw units (``D F D``)."""
        d = torch.cat([self.d[:S0], self.d[S:]]).to(torch.float64)
        return d[:, None] * self.F.to(torch.float64) * d[None, :]


def amplitudes_at(joint, raw: Tensor) -> tuple[AmplitudeValues, Tensor] | None:
    """Every amplitude (the table's order) at ``raw``'s shared part, as a mapping and as a vector: the same for all
    of this process's stills (their maps share the amplitudes' transforms), so made once for a pass over them and
    not as ~10^4 numbers per still.  None without a still here or without the amplitudes as one block."""
    for im in joint.images:
        r = joint.image_raw(raw.detach(), im.index).to(torch.float64)
        with torch.no_grad():
            block = im.pmap.physical_block(r).get(AMPLITUDE_BLOCK)
        if block is None:
            return None
        names, vec = block
        return AmplitudeValues(zip(names, vec.tolist())), vec.detach()
    return None


def _geometry_map(pmap: ParameterMap, keep: list[int], amplitudes: Mapping[str, float]) -> ParameterMap:
    """``pmap`` over the names at ``keep`` only (the same transforms, so the same raw values), every other name
    (the amplitudes) at ``amplitudes`` (read from it, not copied, when it is one :class:`AmplitudeValues`)."""
    if isinstance(amplitudes, AmplitudeValues):
        sub = ParameterMap(pmap.space, layered(pmap.values, amplitudes), [pmap.names[i] for i in keep])
    else:
        sub = ParameterMap(pmap.space, pmap.values, [pmap.names[i] for i in keep])
        sub.values.update({n: float(amplitudes[n]) for n in pmap.names if n not in sub.names and n in sub.values})
    sub.transforms = [pmap.transforms[i] for i in keep]
    return sub


def image_information_sparse(joint, im, raw: Tensor, at: tuple[AmplitudeValues, Tensor] | None = None
                             ) -> ImageInformation:
    """One still's :class:`ImageInformation` at this process's raw vector ``raw``; ``at``: the amplitudes there
    (:func:`amplitudes_at`, made once for a pass over the stills; None: from this still's map)."""
    tail: AmplitudeTail = joint.tail
    S0, S, K = tail.S0, joint.S, joint.K
    r = joint.image_raw(raw.detach(), im.index).to(torch.float64)
    keep = list(range(S0)) + list(range(S, S + K))
    table = tail.amps.table
    if at is None and im.pmap._amplitude_block() is None:  # amplitudes by name: every value as a float
        values = im.pmap.values_at(r)
        geometry = _geometry_map(im.pmap, keep, values)
    else:
        layer, vec = at if at is not None else amplitudes_at(joint, raw)
        geometry = _geometry_map(im.pmap, keep, layer)
        with torch.no_grad():  # the geometry at r, the amplitudes as one vector: nothing of size A per still
            values = ChainMap({AMPLITUDE_BLOCK: (table.names, vec)}, geometry.expand(geometry.physical(r[keep])))
    theta, F, B = image_information(im.objective, geometry, r[keep])
    amp = amplitude_information(im.objective, table, values)[tail.columns]
    return ImageInformation(theta, F, B, amp, physical_per_raw(im.pmap, r))


def summed(joint, rows, columns: int) -> Tensor:
    """(columns,) the exact sum over every process's stills of this process's ``rows`` (an iterable of
    ``(columns,)`` or ``(T, columns)`` tensors, added one at a time)."""
    total = ExactSum(columns)
    for row in rows:
        total.add(row.to(torch.float64))
    return total.total(joint.vector.layout.reduce_sum)


def sparse_preconditioner(kind: str | None, joint, raw0: Tensor) -> ArrowheadPreconditioner:
    """The preconditioner of the diagonal treatment (module docstring): ``full``: the geometry's arrowhead and
    the amplitudes' diagonal; ``diagonal``: every name by its diagonal; None: none."""
    tail: AmplitudeTail = joint.tail
    S0, S, K, dt = tail.S0, joint.S, joint.K, raw0.dtype
    order = sorted(joint.slots)
    if kind is None:
        return ArrowheadPreconditioner(raw0.detach().clone(), torch.eye(S0, dtype=dt),
                                       torch.eye(K, dtype=dt).expand(len(order), K, K).clone(),
                                       torch.zeros(len(order), K, S0, dtype=dt), torch.ones(tail.A, dtype=dt))
    by_index = {im.index: im for im in joint.images}
    blocks: dict = {}
    at = amplitudes_at(joint, raw0)

    def amplitude_rows():  # one still's information at a time: nothing of size stills x amplitudes is held
        for i in released(order):
            info = image_information_sparse(joint, by_index[i], raw0, at)
            blocks[i] = info.geometry_raw(S0, S)
            yield info.amplitudes * info.d[S0:S].to(torch.float64) ** 2

    amp = summed(joint, amplitude_rows(), tail.A)
    amp = amp + tail.restraint_diagonal(raw0.as_subclass(Tensor)[:S], True)
    extra = (tail.geometry_curvature(raw0.as_subclass(Tensor)[:S0], True).to(torch.float64)
             if tail.geometry_curvature is not None else None)
    held = {(h - S) // K: (h - S) % K for h in joint.held}
    for i, k in held.items():  # a held own position: one raw unit, never moved (its gradient is 0)
        if i in blocks:
            blocks[i][S0 + k, :], blocks[i][:, S0 + k] = 0.0, 0.0
            blocks[i][S0 + k, S0 + k] = 1.0
    if kind == "diagonal":
        diags = torch.stack([torch.diagonal(blocks[i]) for i in order]) if order else torch.zeros(0, S0 + K)
        shared = summed(joint, [diags[:, :S0]], S0)
        if extra is not None:
            shared = shared + torch.diagonal(extra)
        diag = torch.cat([shared, amp, diags[:, S0:].reshape(-1)])
        w = diagonal_whitening(diag, float(diag.as_subclass(joint.vector).max()))  # the largest over every process
        return ArrowheadPreconditioner(raw0.detach().clone(), torch.diag(w[:S0]).to(dt),
                                       torch.diag_embed(w[S0 + tail.A:].reshape(-1, K)).to(dt),
                                       torch.zeros(len(order), K, S0, dtype=dt), w[S0:S0 + tail.A].to(dt))
    parts = [arrowhead_factors(blocks[i].to(dt), S0) for i in order]
    W = torch.stack([p[0] for p in parts]) if parts else torch.zeros(0, K, K, dtype=dt)
    G = torch.stack([p[1] for p in parts]) if parts else torch.zeros(0, K, S0, dtype=dt)
    schur = summed(joint, (p[2].reshape(-1) for p in parts), S0 * S0)
    pre = arrowhead_preconditioner(raw0, (W, G, schur.to(dt).reshape(1, S0, S0)), extra)
    log.info("joint structure factors: %d amplitudes whitened by their diagonal information (%d stills here)",
             tail.A, len(order))
    return dataclasses.replace(pre, tail=diagonal_whitening(amp).to(dt))  # amp: the same in every process
