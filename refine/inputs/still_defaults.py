"""Defaults of ``nbtorch-refine`` on one still from DIALS files: ``--image X --expt X.expt --refl X.refl``.

An experiment without a scan (or with a scan of zero width) and its reflections, refined on their own or as one
image of a ``--joint`` run of stills (not ``--rotation-series``), get what the thaumatin tutorial chooses by hand
(docs/still-from-images.md), each default only where its option is not given:

* **pixels** (``--spot-window``, ``--subsample``): square windows about every observed reflection of the
  ``.refl``, half-width from the profile's ``sigma_b`` (:func:`refine.inputs.dials.window_half_px`: three
  standard deviations along each detector axis; 5 pixels without a profile), and :data:`REST_FRACTION` of the other
  pixels (background, and model spots where nothing was observed), lowered to at most :data:`REST_PER_WINDOW_PIXEL`
  of them per window pixel;
* **refined names** (``--refine``; on its own only, a joint run's are ``--shared`` and ``--per-image``):
  :data:`STILL_REFINE` in one stage, less the ``--fix`` names.  The distance
  is refined with the cell: one still measures the cell over the distance, and held at a header's value the cell
  carries the distance's error (docs/esds-and-fit.md); where the spots are too few for the names,
  ``--too-few-spots`` fixes the least determined (:mod:`refine.quality.identifiability`);
* **crystal model** (``--model`` optional): the experiment's domain size and mosaic
  (:func:`refine.inputs.dials.still_model`); without a size ``--model`` must give one, without a spread the model
  has none (and ``N`` is refined instead of the ``mosaic`` group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nbtorch.errors import InputError
from refine.inputs.dials import PROFILE_FLAGS, is_still, mosaic_model_of_tokens, read_experiment, still_model, window_half_px
from refine.inputs.start_model import expand_model_args

if TYPE_CHECKING:  # types only
    from refine.inputs.measurement import DialsFiles

__all__ = ["STILL_REFINE", "REST_FRACTION", "REST_PER_WINDOW_PIXEL", "StillDefaults", "dials_still", "still_defaults"]

#: what one still from DIALS refines by default: the crystal (orientation, cell, its size and mosaic spread) and the
#: detector's distance and beam centre; the tilt is left to ``--refine`` (a detector calibration, better measured on
#: several stills jointly: docs/many-stills.md)
STILL_REFINE = ("scale", "background", "orientation", "cell", "mosaic", "beam_centre", "distance")
#: fraction of the pixels outside the spot windows fitted with them (the thaumatin tutorial's ``--subsample``)
REST_FRACTION = 0.02
#: at most this many of those pixels per window pixel, so that the windows hold most of the work on a large detector
#: (the tutorial's central region: 0.39 of them)
REST_PER_WINDOW_PIXEL = 0.25


@dataclass(frozen=True)
class StillDefaults:
    """The options a still from DIALS files fills in (None: the user's own stands) and the lines that say so."""

    refine: tuple[str, ...] | None
    spot_window: int | None
    subsample: float | None
    rest_ratio: float | None
    notes: tuple[str, ...]

    def fields(self) -> dict:
        """The options the defaults fill in, by name (``refine``, ``spot_window``, ``subsample``)."""
        return {k: v for k, v in (("refine", self.refine), ("spot_window", self.spot_window),
                                  ("subsample", self.subsample)) if v is not None}


def dials_still(dials: DialsFiles, rotation_series: bool = False) -> bool:
    """Whether ``dials`` are one measured still from DIALS files: an image, an ``--expt`` still and a ``--refl``,
    refined on its own or as one image of a joint run of stills (independent and joint modes' images are each such
    a run; a rotation series, ``rotation_series``, is not)."""
    if not (dials.image and dials.expt and dials.refl):
        return False
    if rotation_series:
        return False
    return is_still(read_experiment(dials))


def _refined(mosaic: bool, choose_names: bool, fix, max_steps: int | None
             ) -> tuple[tuple[str, ...] | None, str | None]:
    """The default names and their note; None where not ``choose_names`` (``--refine``, ``--stages`` or
    ``[[stages]]`` choose, or a joint run).  Without a mosaic spread in the model (``mosaic`` False) the crystal size
    ``N`` is refined instead of the ``mosaic`` group."""
    if not choose_names:
        return None, None
    fixed = {n for n in (fix or ()) if n != "none"}
    names = tuple(n if mosaic or n != "mosaic" else "N" for n in STILL_REFINE if n not in fixed)
    held = f"; --fix holds {', '.join(sorted(fixed))}" if fixed else ""
    return names, (f"refine {','.join(names)} in one stage (at most {max_steps or 200} steps; the "
                   f"distance with the cell: one still measures their ratio{held}; --refine)")


def _pixels(dials: DialsFiles, spot_window: int | None, given_subsample: float | None
            ) -> tuple[int | None, float | None, float | None, list[str]]:
    """``(spot window, subsample, rest ratio, notes)``: None where ``--spot-window`` or ``--subsample`` is given."""
    notes = []
    half = None
    if spot_window is None:
        half, why = window_half_px(read_experiment(dials), still=True)
        notes.append(f"spot windows of +-{half} pixels around the --refl spots ({why}; --spot-window)")
    subsample, ratio = None, None
    if given_subsample is None:
        subsample, ratio = REST_FRACTION, REST_PER_WINDOW_PIXEL
        notes.append(f"{100 * REST_FRACTION:g} % of the pixels outside the windows, at most {REST_PER_WINDOW_PIXEL:g} per "
                     "window pixel (the background, and model spots where none was observed; --subsample)")
    return half, subsample, ratio, notes


def _crystal(dials: DialsFiles, model_flags: str | None) -> tuple[bool, list[str]]:
    """Whether the starting model has a mosaic spread (the experiment's or ``--model``'s), and its note; a crystal
    size from neither is one line naming ``--model``."""
    user = expand_model_args(model_flags) if model_flags else []
    model = still_model(read_experiment(dials), mosaic_model_of_tokens(user))
    missing = [q for q in model.missing() if not any(t in PROFILE_FLAGS[q] for t in user)]
    if "size" in missing:
        raise InputError(f"--model: the experiment ({dials.expt}) gives no crystal size of the still (no "
                         "ML_domain_size_ang in its crystal, no profile sigma_b); give one, e.g. --model \"-N 20\"")
    if "mosaic" in missing:
        return False, ["no mosaic spread (the experiment's crystal has no ML_half_mosaicity_deg): the model has none "
                       "(-mosaic in --model gives one)"]
    return True, []


def still_defaults(dials: DialsFiles, model: str | None = None, *, choose_names: bool = True, fix=None,
                   max_steps: int | None = None, spot_window: int | None = None, subsample: float | None = None,
                   rotation_series: bool = False) -> StillDefaults | None:
    """The defaults of one still from DIALS files (module docstring); None for any other run (:func:`dials_still`).
    ``model``: the ``--model`` flags; ``choose_names``: the refined names are the default's (no ``--refine``,
    ``--stages`` or ``[[stages]]``, not a joint run), less ``fix``, in one stage of at most ``max_steps``;
    ``spot_window``, ``subsample``: those given (None: the defaults').

    Raises:
        InputError: the experiment and ``--model`` give no crystal size (``--model``).
    """
    if not dials_still(dials, rotation_series):
        return None
    mosaic, crystal_notes = _crystal(dials, model)
    names, refine_note = _refined(mosaic, choose_names, fix, max_steps)
    half, subsample, ratio, notes = _pixels(dials, spot_window, subsample)
    lines = crystal_notes + ([refine_note] if refine_note else []) + notes
    return StillDefaults(refine=names, spot_window=half, subsample=subsample, rest_ratio=ratio,
                         notes=tuple(lines))
