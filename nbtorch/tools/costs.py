"""What one call of the simulator or of a refinement's evaluation costs besides its samples (both harnesses:
:mod:`nbtorch.tools.bench`, :mod:`refine.tools.bench`).

* :func:`operator_counts`: one call under the torch profiler: the operators it calls (aten operators that no other
  operator called: the eager glue around the compiled kernels and the compiled graphs' own allocations; on a GPU
  each launches at least one kernel), the calls of compiled graphs, and the kernels that ran on a device (a GPU's
  kernel launches; none on a CPU).
* :func:`fit_fixed_cost`: the least-squares line ``seconds = fixed_s + per_sample_s * samples`` through timings at
  several sizes, a sample being one pixel-evaluation (pixel x evaluations per pixel): the fixed cost of a call and
  the cost of each sample.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch.autograd import DeviceType

from nbtorch.errors import InputError

__all__ = ["operator_counts", "count_events", "fit_fixed_cost", "COMPILED_GRAPH_EVENT"]

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
