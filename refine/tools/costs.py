"""What one evaluation of a refinement costs besides its pixels (the refinement harness, :mod:`refine.tools.bench`).

* :func:`operator_counts`: one call under the torch profiler: the operators it calls (aten operators that no other
  operator called: the eager glue around the compiled kernels and the compiled graphs' own allocations; on a GPU
  each launches at least one kernel), the calls of compiled graphs, and the kernels that ran on a device (a GPU's
  kernel launches; none on a CPU).
* :func:`subset`: a harness's objective restricted to an evenly spread fraction of its fitted pixels (the
  simulator computes only those), to time the same evaluation at several sizes.
* :func:`fit_fixed_cost`: the least-squares line ``seconds = fixed_s + per_sample_s * samples`` through such
  timings, a sample being one pixel-evaluation (pixel x evaluations per pixel): the fixed cost of a call and the
  cost of each sample.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch.autograd import DeviceType

from nbtorch.errors import InputError
from refine.fitting.objective import ImageObjective, View

__all__ = ["operator_counts", "count_events", "subset", "fit_fixed_cost", "parse_fractions"]

#: the profiler's event of one call of an Inductor-compiled graph
COMPILED_GRAPH_EVENT = "## Call CompiledFxGraph"


def count_events(events: Iterable) -> dict[str, int]:
    """``operators`` (CPU events of aten operators with no aten operator above them), ``compiled_graphs`` (calls of
    compiled graphs) and ``device_kernels`` (events on a device other than the CPU) of a profiler's events
    (:meth:`torch.profiler.profile.events`)."""
    operators = graphs = kernels = 0
    for event in events:
        if event.device_type != DeviceType.CPU:
            kernels += 1
        elif event.name.startswith("aten::") and not _called_by_operator(event):
            operators += 1
        elif event.name.startswith(COMPILED_GRAPH_EVENT):
            graphs += 1
    return {"operators": operators, "compiled_graphs": graphs, "device_kernels": kernels}


def _called_by_operator(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def operator_counts(fn: Callable[[], object], device: torch.device | str = "cpu") -> dict[str, int]:
    """:func:`count_events` of one call of ``fn`` (warm: call it once before), profiled on the CPU and, for a CUDA
    ``device``, on the GPU too."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return count_events(prof.events())


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
    return out


def fit_fixed_cost(samples: Sequence[float], seconds: Sequence[float]) -> dict[str, float]:
    """The least-squares line through ``(samples, seconds)``: ``fixed_s`` (the time of a call of no sample),
    ``per_sample_s`` and ``ns_per_sample`` (the time of each further sample), ``rms_residual_s``.  Needs at least two
    different sample counts; one-line errors for bad input."""
    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    y = np.asarray(seconds, dtype=np.float64).reshape(-1)
    if x.size != y.size:
        raise InputError(f"fit_fixed_cost: {x.size} sample counts but {y.size} times")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(x > 0) and np.all(y >= 0)):
        raise InputError("fit_fixed_cost: sample counts must be finite and > 0, times finite and >= 0")
    if np.unique(x).size < 2:
        raise InputError("fit_fixed_cost: needs at least two different sample counts")
    design = np.stack([np.ones_like(x), x], axis=1)
    (fixed, per_sample), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ np.array([fixed, per_sample])
    return {"fixed_s": float(fixed), "per_sample_s": float(per_sample), "ns_per_sample": float(per_sample) * 1e9,
            "rms_residual_s": math.sqrt(float(np.mean(residual ** 2)))}
