"""Say when the data cannot decide: too few spots for the parameters refined, and spots that drift away.

Two checks, both about the *spots* the image shows rather than the pixel loss:

**Before the run** (:func:`reduce_free`): a refinement that frees more parameters than its observed spots
can determine finds *a* minimum and calls it converged (a real case: 8 spots, a run started at the right
answer walked 0.6 deg in orientation and 0.75 % in a cell edge to match intensities with one F for all
reflections).  Like DIALS's automatic parameter reduction, the number of observed spots in the fitted
region is compared with :data:`~refine.quality.fit_quality.MIN_SPOTS_PER_PARAMETER` (5, the reason is in
:mod:`refine.quality.fit_quality`) per refined parameter that the spots determine (every refined name but the
nuisance ones, scale and background, which every fitted pixel determines).  When there are fewer, the user's choice applies
(``too_few_spots``, ``nbtorch-refine --too-few-spots``):

* ``"fix"`` (default): fix parameters in :data:`FIX_ORDER` (what a few spot positions determine least
  first: domain size, mosaic spread, cell angles, cell lengths, distance and tilts, then the beam centre)
  until the spots suffice, and say which in the result's warnings; scale, background and orientation are
  never fixed (without them nothing is fitted);
* ``"warn"``: refine everything, with a warning;
* ``"fail"``: refuse the run (one-line :class:`~nbtorch.errors.InputError`).

**After the run** (:func:`drift_warning`): when the pixel loss improved but the refined model's spots
moved *away* from the observed spot positions (the rms offset over the spots matched before and after
grew by more than :data:`DRIFT_TOLERANCE`), the pixels have pulled the geometry somewhere the spots do
not support; the run says so instead of letting "converged" stand alone.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

from nbtorch.errors import InputError
from refine.quality.fit_quality import MIN_SPOTS_PER_PARAMETER
from refine.fitting.parameters import NUISANCE
from refine.fitting.structure_factors import is_amplitude

__all__ = ["TOO_FEW_SPOTS", "FIX_ORDER", "DRIFT_TOLERANCE", "reduce_free", "drift_warning"]

log = logging.getLogger(__name__)

#: what to do when there are fewer observed spots than MIN_SPOTS_PER_PARAMETER per refined parameter
TOO_FEW_SPOTS = ("fix", "warn", "fail")
#: the order in which "fix" fixes parameters: what a few spot positions determine least, first
FIX_ORDER = ("N_a", "N_b", "N_c", "N", "mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c", "mosaic_spread",
             "cell_alpha", "cell_beta", "cell_gamma", "cell_c",
             "cell_b", "cell_a", "distance", "detector_rotx", "detector_roty", "detector_rotz", "twotheta",
             "beam_x", "beam_y")
#: the spot rms may grow this much (fraction, and 0.1 px at least) before a run with a lower loss is suspect
DRIFT_TOLERANCE = 0.1


def reduce_free(names: Sequence[str], n_spots: int, policy: str = "fix",
                minimum: float = MIN_SPOTS_PER_PARAMETER) -> tuple[tuple[str, ...], str | None]:
    """The names to fix so that ``n_spots`` observed spots give at least ``minimum`` per refined name, and
    the warning to give (None when the spots suffice).

    Arguments:
        names: every name the run would refine (expanded: ``cell_a``, ``orient_x``, ``scale``...); the
            nuisance names (scale, background) are not counted.
        n_spots: observed spots in the fitted region.
        policy: ``"fix"``, ``"warn"`` or ``"fail"`` (the module docstring).

    Raises:
        InputError: ``policy`` unknown, or ``"fail"`` with too few spots.
    """
    if policy not in TOO_FEW_SPOTS:
        raise InputError(f"too_few_spots: expected one of {', '.join(TOO_FEW_SPOTS)}, got {policy!r}")
    # scale and background come from every pixel, an amplitude from its own spot's intensity (each free one
    # has photons there: refine.fitting.structure_factors); the spots' positions decide the rest
    names = tuple(n for n in names if n not in NUISANCE and not is_amplitude(n))
    if n_spots >= minimum * len(names):
        return (), None
    needed = math.ceil(minimum * len(names))
    what = (f"{n_spots} observed spots in the fitted region for {len(names)} refined parameters "
            f"(fewer than {minimum:g} per parameter, {needed} wanted)")
    if policy == "fail":
        raise InputError(f"{what}: the spots cannot decide them all; fix some (--fix), fit more of the image, "
                         "or choose --too-few-spots fix or warn")
    if policy == "warn":
        return (), f"{what}: the data may not decide every parameter (--too-few-spots warn)"
    fixed: list[str] = []
    for name in FIX_ORDER:
        if n_spots >= minimum * (len(names) - len(fixed)):
            break
        if name in names:
            fixed.append(name)
    left = len(names) - len(fixed)
    enough = n_spots >= minimum * left
    message = (f"{what}: fixed {', '.join(fixed) or 'nothing'} at the start value"
               f"{'' if enough else f'; still {n_spots} spots for {left} parameters'} (--too-few-spots fix; "
               "--too-few-spots warn refines them anyway)")
    log.warning("%s", message)
    return tuple(fixed), message


def drift_warning(rms_start_px: float, rms_final_px: float, n_common: int, loss_initial: float,
                  loss_final: float) -> str | None:
    """A warning when the loss fell but the spots matched before and after moved away from the observed ones."""
    if not (math.isfinite(rms_start_px) and math.isfinite(rms_final_px)) or n_common == 0:
        return None
    if loss_final >= loss_initial:
        return None
    if rms_final_px <= rms_start_px + max(DRIFT_TOLERANCE * rms_start_px, 0.1):
        return None
    return (f"the pixel loss fell ({loss_initial:.6g} -> {loss_final:.6g}) but the model's spots moved away from "
            f"the observed ones (rms {rms_start_px:.3g} -> {rms_final_px:.3g} px over {n_common} spots): the pixels "
            "do not decide the geometry the way the spots do (a model that cannot explain the intensities, "
            "e.g. one F for every reflection, or too few spots); check the refined orientation and cell")
