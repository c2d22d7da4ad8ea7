"""A fixed-shape GPU computation captured once into a CUDA graph and replayed: one launch instead of hundreds.

On a GPU a small evaluation's time goes to launching its kernels and to the Python around them (the tutorial's
loss and gradient: a few hundred kernels, each a few microseconds of launch, and the eager glue between the
compiled stages); a CUDA graph records the kernels of one call and replays them all with one launch.  A
refinement's evaluation suits it: its fitted pixels, and so every shape, are fixed for a stage.

:class:`GraphedFunction` wraps ``fn(*inputs) -> tuple of tensors``: the first call runs ``fn`` twice on a side
stream (compiles, autotuning and the allocator's first requests happen there, outside the capture), records a
third call into a graph, and replays it; each later call copies its inputs into the graph's fixed input tensors
and replays.  The outputs are the graph's own tensors, overwritten by the next replay: copy what you keep.

What ``fn`` may not do (CUDA's capture rules, each an error at capture, after which the wrapper gives up and runs
``fn`` plainly, logging why once): read a tensor into Python (``float(t)``, ``.item()``, ``bool(t)``), copy
host data to the device (``torch.tensor(1.0, device=...)``: :meth:`nbtorch.Simulator._constant` keeps such values
on the device once), synchronise, or take a data-dependent shape (``nonzero``, boolean indexing).  Its Python
control flow is frozen at capture: everything that varies between calls must come in through ``inputs``.

``NBTORCH_CUDA_GRAPHS=0`` turns graphs off (:func:`enabled`); nothing here runs on a CPU.
"""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = ["GraphedFunction", "enabled", "ENV"]

#: the environment variable that turns CUDA graphs off (``0``)
ENV = "NBTORCH_CUDA_GRAPHS"
#: plain calls on a side stream before the capture
WARMUP_CALLS = 2


def enabled(device: torch.device | str) -> bool:
    """Whether an evaluation on ``device`` is captured into a CUDA graph: a CUDA device and ``$NBTORCH_CUDA_GRAPHS``
    not ``0``."""
    return torch.device(device).type == "cuda" and os.environ.get(ENV, "1").strip() != "0"


class GraphedFunction:
    """``fn`` captured into a CUDA graph on its first call and replayed after (see the module docstring).

    Arguments:
        fn: ``fn(*inputs) -> tuple of tensors``, every input a tensor on the one CUDA device; the same shapes,
            dtypes and Python path at every call.
        name: what the log calls it.

    Attributes:
        captured: True once the graph is recorded; False before, and for good if the capture failed.
        failure: why the capture failed (one line), else None.
        replays: calls answered by a replay.
    """

    def __init__(self, fn: Callable[..., Sequence[Tensor]], name: str = "evaluation") -> None:
        self.fn, self.name = fn, name
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: tuple[Tensor, ...] = ()
        self.static_outputs: tuple[Tensor, ...] = ()
        self.captured = False
        self.failure: str | None = None
        self.replays = 0

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if self.failure is not None:
            return tuple(self.fn(*inputs))
        if not self.captured:
            return self._capture(inputs)
        for static, value in zip(self.static_inputs, inputs):
            static.copy_(value, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.static_outputs

    def _capture(self, inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Warm up, capture and replay once; on a capture error, fall back to plain calls for good."""
        self.static_inputs = tuple(t.detach().clone() for t in inputs)
        side = torch.cuda.Stream(device=self.static_inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self.fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = tuple(self.fn(*self.static_inputs))
        except Exception as exc:  # a capture rule broken (module docstring): run plainly from now on
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.failure = f"{type(exc).__name__}: {first}{_where(exc)}"
            log.warning("CUDA graph of the %s not captured (%s); it runs without one", self.name, self.failure)
            self.static_inputs = ()
            torch.cuda.synchronize()
            return tuple(self.fn(*inputs))
        self.graph, self.static_outputs, self.captured = graph, outputs, True
        log.debug("CUDA graph of the %s captured", self.name)
        graph.replay()
        self.replays += 1
        return self.static_outputs


def _where(exc: BaseException) -> str:
    """`` (at package/module.py:line)``: the deepest frame of the project's own code in ``exc``'s traceback (where
    a capture rule was broken), or ``""``."""
    root = Path(__file__).resolve().parents[2]
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if (path.is_file() and path.is_relative_to(root) and path != Path(__file__).resolve()
                and path.relative_to(root).parts[0] in ("nbtorch", "refine", "losses", "experiments")):
            return f" (at {path.relative_to(root)}:{frame.lineno})"
    return ""
