"""What one evaluation of a refinement costs besides its pixels (the refinement harness, :mod:`refine.tools.bench`).

* :func:`~nbtorch.tools.costs.operator_counts` and :func:`~nbtorch.tools.costs.fit_fixed_cost` (shared with the
  simulator's harness, :mod:`nbtorch.tools.costs`).
* :func:`subset`: a harness's objective restricted to an evenly spread fraction of its fitted pixels (the
  simulator computes only those), to time the same evaluation at several sizes.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from nbtorch.errors import InputError
from refine.fitting.objective import ImageObjective, View

__all__ = ["subset", "parse_fractions"]


def parse_fractions(text: str) -> tuple[float, ...]:
    """``"1/8,1/4,1/2,1"`` (or decimals) -> the fractions of the fitted pixels, each in (0, 1]; one-line error."""
    out = []
    for item in text.split(","):
        try:
            num, _, den = item.strip().partition("/")
            value = float(num) / float(den) if den else float(num)
        except (ValueError, ZeroDivisionError):
            raise InputError(f"--fractions: expected fractions such as 1/8,1/4,1/2,1, got {item.strip()!r}") from None
        if not 0.0 < value <= 1.0:
            raise InputError(f"--fractions: each fraction must be in (0, 1], got {item.strip()!r}")
        out.append(value)
    if len(set(out)) < 2:
        raise InputError(f"--fractions: needs at least two different fractions, got {text!r}")
    return tuple(out)


def subset(bench, fraction: float):
    """A copy of the harness ``bench`` (:class:`refine.tools.bench.Bench`) whose objective fits ``fraction`` of its
    fitted pixels, evenly spread over them in their order, and whose simulator computes only those; the free names,
    values and loss are ``bench``'s.  Only an unbinned objective on the fitted pixels (the last stage of a run) can be
    cut this way."""
    objective = bench.objective
    if not objective.sparse or objective.view.mask is None:
        raise InputError("--fractions: the last stage's objective must be unbinned, on the fitted pixels")
    used = objective.used_pixels
    n = used.numel()
    m = max(1, round(fraction * n))
    keep = used[torch.div(torch.arange(m, device=used.device) * n, m, rounding_mode="floor")]
    view = objective.view
    mask = torch.zeros(view.shape[0] * view.shape[1], dtype=torch.bool)
    mask[keep.cpu()] = True
    mask = mask.reshape(view.shape)
    x0, x1, y0, y1 = view.roi
    pixels = np.zeros(bench.sim.shape, dtype=bool)
    pixels[y0:y1 + 1, x0:x1 + 1] = mask.numpy()
    sim = bench.sim.restricted(pixels)
    smaller = ImageObjective(sim, objective.observed_full, View(view.roi, mask.to(view.mask.device), 1, view.fraction),
                             objective.loss, n_factor=objective.n_factor, priors=objective.priors,
                             amplitudes=objective.amplitudes, restraint=objective.restraint,
                             background_model=objective.background_model)
    smaller.loss_fn = objective.loss_fn  # the same (compiled or plain) loss
    out = copy.copy(bench)
    out.sim, out.objective, out.pixels = sim, smaller, m
    out.fn = out.stage_function()  # its own (CUDA graph of the) evaluation
    return out
