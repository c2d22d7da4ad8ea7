"""``nbtorch-refine --expt/--refl/--expt-out``: a DIALS experiment as the starting model, DIALS spots as the
spot list, and the refined model written back as a DIALS experiment.

* ``--expt FILE`` (experiment ``--expt-index``, default 0; for a rotation scan the image ``--expt-image``,
  0 = the scan's first): :func:`nbtorch.dials_geometry.experiment_flags` gives the geometry and crystal
  as nanoBragg flags (CUSTOM convention); the ``--model`` flags come after them, so they win
  (e.g. ``-N``, ``-default_F``, ``-mosaic``, which a DIALS experiment does not give).
* ``--refl FILE``: the ``xyzobs.px.value`` centroids of experiment ``--expt-index`` (its ``id``;
  for a scan, those whose frame ``z`` lies on image ``--expt-image``) are the spot list, as ``--spots``:
  ``(x fast, y slow)`` pixels, centres at ``i + 0.5`` in both programs.
* ``--expt-out FILE``: the ``--expt`` document with the refined beam, panel origin and axes and crystal
  real-space vectors (:func:`nbtorch.dials_geometry.refined_document`).
"""

from __future__ import annotations


from typing import TYPE_CHECKING

import numpy as np

from nbtorch.errors import InputError

if TYPE_CHECKING:  # the command's options; this module only reads them
    from refine.cli.options import Options

__all__ = ["add_options", "check_dials_options", "model_tokens", "refl_spots", "write_expt_out"]


def add_options(group) -> None:
    """The DIALS options of :func:`refine.cli.parser.build_parser`, added to its argparse ``group``."""
    group.add_argument("--expt", help="DIALS experiment (.expt) as the starting model (geometry, beam, crystal); "
                                            "--model flags are applied after it")
    group.add_argument("--expt-index", type=int, default=0,
                             help="which experiment of --expt (and id of --refl) (default %(default)s)")
    group.add_argument("--expt-image", type=int, default=0,
                             help="rotation scans: image of the scan that --image is, 0 = the first (default %(default)s)")
    group.add_argument("--refl", help="DIALS reflections (.refl): their xyzobs.px.value centroids are the "
                                            "spot list (as --spots)")
    group.add_argument("--expt-out", help="write the refined model as a DIALS experiment (.expt): the --expt "
                                                 "document with the refined values, or without --expt a new still "
                                                 "experiment (space group from --symmetry when it names one)")


def check_dials_options(args: Options) -> None:
    """Checks that need no file."""
    if args.dials.expt_out and not args.dials.expt and not args.image.image:
        raise InputError("--expt-out: writes the refined model of a measured image; give --image (or --expt)")
    if args.dials.refl and args.pixels.spots:
        raise InputError("--refl and --spots both give the observed spots; drop one")
    for flag, value in (("--expt-index", args.dials.expt_index), ("--expt-image", args.dials.expt_image)):
        if value < 0:
            raise InputError(f"{flag}: must be >= 0, got {value}")


def _experiment(args: Options):
    from nbtorch.io.dials import read_expt

    try:
        return read_expt(args.dials.expt, args.dials.expt_index)
    except InputError as exc:
        raise InputError(f"--expt {exc}") from None


def model_tokens(args: Options) -> str | list[str] | None:
    """The starting model for :func:`refine.inputs.start_model.model_config`: ``--model`` alone, or the ``--expt`` flags
    followed by the ``--model`` tokens."""
    if not args.dials.expt:
        return args.model.model
    from nbtorch.dials_geometry import experiment_flags
    from refine.inputs.start_model import expand_model_args

    try:
        flags = experiment_flags(_experiment(args), args.dials.expt_image)
    except InputError as exc:
        raise InputError(exc if str(exc).startswith("--expt") else f"--expt {exc}") from None
    return flags + (expand_model_args(args.model.model) if args.model.model else [])


def refl_spots(args: Options) -> np.ndarray:
    """``(n, 2)`` observed spot centroids (x fast, y slow, pixels) of ``--refl``."""
    from nbtorch.io.dials import read_refl

    try:
        cols = read_refl(args.dials.refl, ("xyzobs.px.value",), experiment_id=args.dials.expt_index)
    except InputError as exc:
        raise InputError(f"--refl {exc}") from None
    xyz = cols["xyzobs.px.value"]
    if args.dials.expt and _experiment(args).scan is not None:  # frames z in [image, image + 1)
        xyz = xyz[(xyz[:, 2] >= args.dials.expt_image) & (xyz[:, 2] < args.dials.expt_image + 1)]
    xyz = xyz[np.all(np.isfinite(xyz), axis=1) & np.any(xyz[:, :2] != 0, axis=1)]
    if not len(xyz):
        raise InputError(f"--refl {args.dials.refl}: no observed spots of experiment {args.dials.expt_index}"
                         + (f" on image {args.dials.expt_image}" if args.dials.expt else ""))
    return np.ascontiguousarray(xyz[:, :2])


def _hall_symbol(symmetry: str | None) -> str:
    """The Hall symbol of ``--symmetry`` when it names a space group (gemmi), else P 1."""
    try:
        import gemmi
    except ImportError:
        return " P 1"
    group = gemmi.find_spacegroup_by_name(symmetry) if symmetry else None
    return group.hall if group is not None else " P 1"


def write_expt_out(args: Options, sim, params) -> None:
    """Write ``--expt-out``: the ``--expt`` document (or, without one, a new still experiment of ``--image``)
    with ``sim``'s geometry at the refined ``params``."""
    from nbtorch.dials_geometry import refined_document, still_experiment
    from nbtorch.io.dials import write_expt

    if args.dials.expt:
        doc = refined_document(_experiment(args), sim, dict(params), args.dials.expt_image)
    else:
        doc = refined_document(still_experiment(sim, args.image.image, _hall_symbol(args.fit.symmetry)), sim, dict(params))
    write_expt(args.dials.expt_out, doc)
