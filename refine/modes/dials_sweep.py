"""The defaults of a rotation series from DIALS files (``nbtorch-refine --images ... --expt --refl --rotation-series``;
docs/sweep-from-dials.md): what is shared, whether one amplitude per reflection is
refined, where the cell and orientation start, and DIALS's detector geometry as a prior.

* **Shared names** (:func:`default_shared`): the cell and orientation; the distance and beam centre
  (:data:`DIALS_ROTATION_GEOMETRY`) with a prior at DIALS's values (below); the mosaic spread and domain size when
  the observed spots decide them (:data:`~refine.quality.fit_quality.MIN_SPOTS_PER_PARAMETER` per name).
* **The geometry's prior** (:func:`start_and_priors`; ``--geometry-prior dials``, the default): each shared detector
  name (distance, beam centre, and the tilts when ``--shared`` names them) gets a Gaussian prior centred on DIALS's
  value whose width is the esd the ``.refl``'s indexed spots give it (:mod:`refine.inputs.geometry_prior`).  The cell's
  esds then carry the geometry's uncertainty; from a whole sweep's spots the prior is narrow, from a wedge's as
  wide as the wedge leaves it.  ``--geometry-prior none`` refines the shared geometry without a prior, ``--shared
  cell,orientation`` holds it at DIALS's values, ``--prior`` replaces a name's prior.
* **Amplitudes** (:func:`resolve_amplitudes`): one per symmetry-unique reflection when the experiment (or
  ``--space-group``) gives a space group.
* **Start** (:func:`start_and_priors`): the ``--expt`` model, or, when it misses the indexed spots by more (rms) than
  the spot windows' half-width less :data:`ALIGN_MARGIN_PX`, the cell, orientation and shared geometry fitted to
  them (:func:`refine.inputs.spot_start.align_to_spots`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from nbtorch import Simulator, config_from_args
from nbtorch.io.dials import scan_oscillation
from refine.modes.job import Job
from refine.modes.single import amplitude_group
from refine.modes.values import prior_values, start_values
from refine.fitting.parameters import GROUPS, ParameterSpace, units_of
from refine.inputs.dials import model_tokens, read_experiment, refl_indexed, spot_window
from refine.inputs.geometry_prior import spot_geometry_prior
from refine.inputs.spot_start import align_to_spots
from refine.many.priors import shared_priors
from refine.quality.fit_quality import MIN_SPOTS_PER_PARAMETER
from refine.solver.plan import model_values

__all__ = ["ROTATION_SHARED", "ROTATION_PER_IMAGE", "DIALS_ROTATION_GEOMETRY", "GEOMETRY_PRIORS", "MIN_ALIGN_SPOTS",
           "ALIGN_MARGIN_PX",
           "from_dials_sweep", "resolve_amplitudes", "default_shared", "start_and_priors"]

#: ``--geometry-prior``: DIALS's detector geometry as a prior (``dials``, the default of a rotation series from DIALS
#: files) or not (``none``)
GEOMETRY_PRIORS = ("dials", "none")
#: ``--rotation-series``: one crystal turning through the sweep (its cell and orientation at phi 0 shared; each
#: image's phi start and width its own, from its header) and each image's own scale and background
ROTATION_SHARED = ("cell", "orientation")
ROTATION_PER_IMAGE = ("scale", "background")
#: a rotation series from DIALS files also shares these, each with a prior at DIALS's value (module docstring)
DIALS_ROTATION_GEOMETRY = ("distance", "beam_centre")
#: a rotation series from DIALS files starts from its indexed spots when it has at least this many
MIN_ALIGN_SPOTS = 6
#: ... and when its starting model predicts them further off (rms) than the spot windows' half-width less this many
#: pixels: nearer, the windows hold the spots and the pixels take it from there, while a cell fitted to a few spots
#: can run off (9 and 20 spots of two synthetic wedges took b 6-9 % away from starts 1.5 and 3 px off)
ALIGN_MARGIN_PX = 1.0


def from_dials_sweep(args: Job) -> bool:
    return bool(args.many.rotation_series and args.dials.expt and args.dials.refl)


def resolve_amplitudes(args: Job, say: Callable[[str], None]) -> Job:
    """``--structure-factors`` not given: on for a rotation series from DIALS files whose amplitudes have a space
    group (``--space-group``, ``--symmetry`` or the experiment's), off otherwise.  One amplitude for every reflection
    cannot explain a sweep's intensities, and on the real sweep the pixels then pull the cell (docs/sweep-from-dials.md)."""
    if args.amplitudes.structure_factors is not None:
        return args
    group = amplitude_group(args) if from_dials_sweep(args) else None
    if group is None:
        return args.with_fields(structure_factors=False)
    say(f"  structure factors: one amplitude per unique reflection in {group}, refined with the shared names (a "
        f"rotation series from DIALS files; --no-structure-factors keeps one F for every reflection)")
    return args.with_fields(structure_factors=True)


def default_shared(args: Job, symmetry: str, say: Callable[[str], None]) -> tuple[str, ...]:
    """``--shared`` when not given: the cell (and the orientation for ``--rotation-series``); for a rotation series
    from DIALS files with indexed spots also the distance and beam centre (their prior: :func:`start_and_priors`),
    and the mosaic spread and domain size (``mosaic``) when the observed spots decide them: at least
    :data:`~refine.quality.fit_quality.MIN_SPOTS_PER_PARAMETER` per shared name, the rule by which a single run
    decides which names its spots can refine (:mod:`refine.quality.identifiability`)."""
    if not args.many.rotation_series:
        return ("cell",)
    indexed = refl_indexed(args.dials_files) if from_dials_sweep(args) else None
    if indexed is None:
        return ROTATION_SHARED
    base = ROTATION_SHARED + DIALS_ROTATION_GEOMETRY
    space = ParameterSpace(symmetry=symmetry)
    names = space.expand(base + ("mosaic",))
    if len(indexed[0]) >= MIN_SPOTS_PER_PARAMETER * len(names):
        say(f"  shared: {', '.join(base)} and mosaic (mosaic spread and domain size): {len(indexed[0])} observed spots "
            f"decide {len(names)} names")
        return base + ("mosaic",)
    say(f"  mosaic spread and domain size held at the DIALS profile's: {len(indexed[0])} observed spots are fewer than "
        f"{MIN_SPOTS_PER_PARAMETER} per name for {len(names)} names (--shared {','.join(base)},mosaic refines them)")
    return base


def _geometry_names(shared_names: tuple[str, ...]) -> tuple[str, ...]:
    """The shared detector names (expanded): those DIALS refined, whose values enter as a prior."""
    return tuple(n for n in shared_names if n in GROUPS["detector"])


def start_and_priors(args: Job, image: str, index: int | None, symmetry: str, shared_names: tuple[str, ...],
                     say: Callable[[str], None]) -> tuple[Job, dict]:
    """``(args with --start completed by the cell and orientation fitted to the indexed spots, the joint run's
    priors)`` for a rotation series from DIALS files with :data:`MIN_ALIGN_SPOTS` indexed spots or more: the spots
    start the cell, orientation and shared geometry when the model misses them by more than the spot windows hold
    (:data:`ALIGN_MARGIN_PX`)
    (:func:`refine.inputs.spot_start.align_to_spots`) and, with ``--geometry-prior
    dials``, give the shared detector names their priors (:func:`refine.inputs.geometry_prior.spot_geometry_prior`;
    ``--prior`` over them).  Otherwise ``(args, --prior)``."""
    user = shared_priors(prior_values(args.fit.prior), shared_names, "--prior")
    indexed = refl_indexed(args.dials_files)
    if not args.many.rotation_series or indexed is None or len(indexed[0]) < MIN_ALIGN_SPOTS:
        return args, user
    hkl, xyz, phi = indexed
    a = args.with_fields(image=image, expt_image=index)
    sim = Simulator(config_from_args(list(model_tokens(a.dials_files, a.model.model))), compile=False)
    start = {**model_values(sim), **start_values(args.fit.start)}
    osc = scan_oscillation(read_experiment(args.dials_files).scan)[1]
    shared_geometry = _geometry_names(shared_names)
    geometry = [n for n in shared_geometry if n not in user]
    prior_on = (args.many.geometry_prior or "dials") == "dials" and bool(geometry)
    # the shared geometry moves with the cell: a distance error must not go into the cell
    fit = align_to_spots(sim, start, hkl, xyz, phi, osc, symmetry, names=("cell", "orientation") + shared_geometry)
    name, aligned = Path(args.dials.refl).name, dict(fit.values)
    limit = (spot_window(args.dials_files, args.pixels.spot_window) or 0) - ALIGN_MARGIN_PX
    if fit.rms_px_start <= limit:
        say(f"  start: the model as given, its {fit.n} indexed spots of {name} within {fit.rms_px_start:.3g} px, "
            f"{fit.rms_frames_start:.3g} frames (the spots refit the start from {limit:g} px)")
        fit = dataclasses.replace(fit, values={k: start[k] for k in fit.values})
    else:
        say(f"  start from the {fit.n} indexed spots of {name}: rms {fit.rms_px_start:.3g} px, "
            f"{fit.rms_frames_start:.3g} frames -> {fit.rms_px_final:.3g} px, {fit.rms_frames_final:.3g} frames (cell "
            + " ".join(f"{fit.values[k]:.5g}" for k in ("cell_a", "cell_b", "cell_c"))
            + "".join(f", {k} {fit.values[k]:.5g}" for k in shared_geometry) + ")")
        moved = {k: v for k, v in fit.values.items() if k.startswith(("cell_", "orient_")) or k in shared_geometry}
        given = {k: v for k, v in start_values(args.fit.start).items() if k not in moved}
        args = args.with_fields(start=tuple(f"{k}={v!r}" for k, v in {**given, **moved}.items()))
    if not prior_on:
        return args, user
    # centred on DIALS's values, its width at the model fitted to the spots (their scatter, not the start's miss)
    prior = spot_geometry_prior(sim, {**start, **aligned}, hkl, xyz, phi, osc, symmetry, geometry)
    dials = {k: float(sim.setup.params[k]) for k in prior.priors}
    prior = dataclasses.replace(prior, priors={k: (dials[k], s) for k, (_, s) in prior.priors.items()})
    units = units_of(dict.fromkeys(prior.priors))
    say("  DIALS's geometry as a prior: " + ", ".join(f"{k} {m:.6g} +- {s:.2g} {units.get(k, '')}".rstrip()
                                                      for k, (m, s) in prior.priors.items())
        + f" (the esds its {prior.n_spots} indexed spots give it, scatter {prior.scatter_px:.2g} px, "
        f"{prior.scatter_frames:.2g} frames; --geometry-prior none: no prior; --shared cell,orientation: held)")
    return args, {**prior.priors, **user}
