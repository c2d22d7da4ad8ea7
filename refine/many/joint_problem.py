"""A joint run's problem (:mod:`refine.many.joint`): the shared and per-image names, image 0's model and the
shared start, this process's prepared images with the shared amplitude table and priors, and the raw start
(:func:`joint_problem`, :class:`JointProblem`).
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from nbtorch.sampling.beam_sources import WIDTH_NAMES
from nbtorch.errors import InputError
from nbtorch.simulator import Simulator
from refine.fitting.objective import resolve_loss
from refine.fitting.amplitude_values import layered
from refine.fitting.parameters import BASE_NAMES, CELL, ParameterMap, ParameterSpace
from refine.fitting.structure_factors import AmplitudeOptions, is_amplitude
from refine.many.amplitudes import PreparedImage, SharedAmplitudes, check_options, shared_amplitudes
from refine.many.distributed import Comm, held_images
from refine.many.priors import add_priors, prior_terms, shared_priors
from refine.many.sparse_amplitudes import AmplitudeTail, use_diagonal
from refine.solver.plan import starting_values
from refine.many.joint_images import Joint, fitted_pixels, image_values, joint_image, prepare_image, share_tables


log = logging.getLogger(__name__)




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
            px = fitted_pixels(0, sim, observed_images[0], None if masks is None else masks[0]).load()
            v = starting_values(sim, px.observed, torch.ones_like(px.observed, dtype=torch.bool), start)
            rows[0] = torch.tensor([v[k] for k in BASE_NAMES], dtype=torch.float64)
    got = comm.gather(rows, 1, (len(BASE_NAMES),), torch.float64)[0]
    return {k: float(x) for k, x in zip(BASE_NAMES, got)}


def shared_canonical(shared_names: Sequence[str]) -> list[str]:
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


@dataclass
class JointProblem:
    """A joint run ready for its loop: the names, this process's images in their :class:`Joint`, the starting
    base values of this process's images (``starts``, by index; ``map_starts`` with the amplitudes' starts: what
    the maps start at) and image 0's (``map_start0``, in every process: the shared names' map), the raw start
    ``[shared, own, own, ...]`` and the shared amplitudes (or None).  Nothing in it is a per-image value of the
    whole set but the raw start (a few numbers an image)."""

    comm: Comm
    space: ParameterSpace
    shared_names: tuple
    per_names: tuple
    loss_name: str
    joint: Joint
    starts: dict
    map_starts: dict
    map_start0: dict
    raw0: Tensor
    amps: SharedAmplitudes | None
    priors: dict


def joint_problem(comm: Comm, simulators, observed_images, masks, start, image_starts, *, shared, per_image,
                   symmetry: str, background: str, loss, structure_factors: AmplitudeOptions | None,
                   local_images: Sequence[int] | None, priors: Mapping[str, tuple[float, float]] | None) -> JointProblem:
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
        prepared.append(prepare_image(i, simulators[i], observed_images[i], None if masks is None else masks[i],
                                 image_starts[i] if image_starts is not None else None, shared_start, space, loss_fn))
        share_tables(prepared)
    amps = None if structure_factors is None else shared_amplitudes(comm, prepared, n, structure_factors,
                                                                     {**base, **shared_start})
    if amps is not None:
        space = dataclasses.replace(space, amplitudes=amps.table.names)
        shared_names = shared_names + amps.free
    images: list = []
    shared_set, names = frozenset(shared_names), shared_names + per_names  # one tuple of names for every map
    for im in prepared:  # every map after the first takes its transform objects for the shared names
        images.append(joint_image(im, space, names, hold_scale=amps is not None and im.index == 0,
                                  share=(images[0].pmap, shared_set) if images else None))
    joint = Joint(images, n, len(shared_names), len(per_names), comm, torch.float64)
    starts = {im.index: {k: float(im.start[k]) for k in BASE_NAMES} for im in images}
    # the maps' starts read the amplitudes from the process's one shared copy (refine.fitting.amplitude_values)
    extra = amps.start if amps is not None else None
    map_starts = {i: s if extra is None else layered(s, extra) for i, s in starts.items()}
    map_start0 = image_values(comm, starts, 0) if extra is None else layered(image_values(comm, starts, 0), extra)
    own = {i: ParameterMap(space, s, per_names).raw0(torch.float64) for i, s in map_starts.items()}
    raw0 = joint.local(ParameterMap(space, map_start0, shared_names).raw0(torch.float64), own)
    if amps is not None:
        _share_amplitudes(joint, amps, ParameterMap(space, map_start0, shared_names), per_names)
    add_priors(joint, priors, ParameterMap(space, map_start0, shared_names))
    if amps is not None and use_diagonal(structure_factors.information, len(amps.free),
                                         _image0_interpolates(comm, prepared)):
        S0 = len(shared_names) - len(amps.free)
        geometry = prior_terms(priors, ParameterMap(space, map_start0, shared_names[:S0]))[1] if priors else None
        joint.tail = AmplitudeTail(S0, len(amps.free), amps, ParameterMap(space, map_start0, shared_names), geometry)
        amps.information = "diagonal"
        log.info("joint structure factors: %d amplitudes, each by its own diagonal information "
                 "(refine.many.sparse_amplitudes)", len(amps.free))
    loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
    return JointProblem(comm, space, shared_names, per_names, loss_name, joint, starts, map_starts, map_start0, raw0,
                        amps, priors)


def _image0_interpolates(comm: Comm, prepared: Sequence[PreparedImage]) -> bool:
    """Whether image 0's model interpolates the structure factors, in every process (its holder's)."""
    rows = {im.index: torch.tensor([float(bool(im.sim.setup.interpolate))], dtype=torch.float64)
            for im in prepared if im.index == 0}
    return bool(comm.gather(rows, 1, (1,), torch.float64)[0, 0] > 0)


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
    shared_start = {k: base[k] for k in BASE_NAMES if k in shared_canonical(shared_names) or k in shared_names}
    if any(k in CELL for k in shared_names):
        shared_start.update({k: base[k] for k in CELL})
    return base, shared_start


def _share_amplitudes(joint: Joint, amps: SharedAmplitudes, shared_map: ParameterMap, per_names) -> None:
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
