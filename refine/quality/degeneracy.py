"""How a parameter held fixed correlates with the refined ones: the Fisher information, fixed ones included.

On a single still the detector distance and the overall cell scale move the
spots almost identically, so a refinement usually holds the distance at its
header value.  That hides the degeneracy: the esds of the cell are then
conditional on a distance that is itself uncertain.  :func:`extended_uncertainties`
recomputes the Fisher information at the refined point with extra parameters
(e.g. ``distance``) added to the refined ones, and returns their esds and
correlations: the esd the cell *would* have with the distance free, and the
distance-cell correlation that explains the difference.  Nothing is refined again.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from nbtorch.errors import InputError
from nbtorch.simulator import ORIENTATION_DELTAS
from refine.fitting.objective import ImageObjective, make_view, resolve_loss
from refine.fitting.background import BackgroundModel, is_knot
from refine.fitting.parameters import BASE_NAMES, ParameterMap, ParameterSpace
from refine.quality.uncertainty import Uncertainties, estimate_uncertainties

__all__ = ["extended_uncertainties"]


def extended_uncertainties(sim, observed: np.ndarray, mask: np.ndarray, result, extra: Sequence[str],
                           background="constant") -> Uncertainties:
    """Esds and correlations of ``result.free`` plus ``extra`` at the refined point.

    Arguments:
        sim: the simulator the refinement used.
        observed: (slow, fast) observed photons; ``mask`` (slow, fast) bool, True = pixel used.
        result: the :class:`~refine.output.results.RefinementResult`.
        extra: names or groups to add (e.g. ``("distance",)``).
        background: the run's background: its text, or its :class:`~refine.fitting.background.BackgroundModel`.

    Returns:
        :class:`~refine.quality.uncertainty.Uncertainties` over ``result.free + extra`` (orientation as ``orient_x/y/z``).
    """
    anis = any(n in result.free for n in ("N_a", "N_b", "N_c"))
    model = background if isinstance(background, BackgroundModel) else None
    space = ParameterSpace(symmetry=result.symmetry, anisotropic_N=anis,
                           anisotropic_mosaic=sim.setup.sampling.mosaic_anisotropic,
                           background=background if model is None else model.text,
                           pixel_mm=sim.setup.pixel_m * 1000.0, beam_widths=sim.source_width_names())
    add = [n for n in space.expand(extra) if n not in result.free]
    if not add:
        raise InputError(f"extra parameters {', '.join(extra)}: all already refined, nothing to add")
    names = tuple(n for n in space.all_names if n in set(result.free) | set(add))
    values = {n: 0.0 for n in BASE_NAMES}
    values.update({n: float(v) for n, v in result.params.items() if n in BASE_NAMES or is_knot(n)})
    for n in ORIENTATION_DELTAS:  # the refined rotation is already folded into the misset
        values[n] = 0.0
    obs = torch.as_tensor(np.asarray(observed), dtype=sim.dtype, device=sim.device)
    valid = torch.as_tensor(np.asarray(mask, dtype=bool), device=sim.device) & torch.isfinite(obs) & (obs >= 0)
    obs = torch.where(valid, obs, torch.zeros((), dtype=obs.dtype, device=obs.device))
    view = make_view(sim, values, valid)
    objective = ImageObjective(sim, obs, view, resolve_loss("poisson"), background_model=model)
    pmap = ParameterMap(space, values, names)
    return estimate_uncertainties(objective, pmap, pmap.raw0(sim.dtype))
