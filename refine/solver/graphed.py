"""A stage's loss and gradient on a GPU as one CUDA graph replay (:mod:`nbtorch.runtime.cuda_graph`).

The loop (:mod:`refine.solver.loop`) keeps its parameters, LBFGS memory and line search on the CPU: they are a few
dozen numbers.  On a GPU each evaluation would otherwise launch every kernel of the simulator, the loss and their
backward one by one, with the Python glue between them.  :class:`GraphedObjective` evaluates the loss and its
gradient on the device from a device copy of the parameters, captured into a CUDA graph on the first call and
replayed after: per evaluation one copy of the parameters to the device, one replay, and one copy of the loss and
gradient back (the line search needs them on the host).

It is used by :func:`refine.solver.runner.run_stage` when the simulator is on a CUDA device,
:func:`nbtorch.runtime.cuda_graph.enabled`, and no diagnostics hook listens (a replay runs no Python); a capture that
fails (a rule of that module's docstring broken by some model) logs why and the evaluation runs as before, with the
same values.  A joint run's stills are evaluated without graphs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from nbtorch.runtime.cuda_graph import GraphedFunction

__all__ = ["GraphedObjective", "loss_and_gradient"]


def loss_and_gradient(fn: Callable[[Tensor], tuple[Tensor, Any]], x: Tensor) -> tuple[Tensor, Any]:
    """``(loss and gradient as one (1 + P,) vector, aux)`` of ``fn`` at ``x`` by autograd, on ``x``'s device: what a
    graph records (:class:`GraphedObjective`) and what runs launched kernel by kernel."""
    with torch.enable_grad():
        xi = x.detach().requires_grad_(True)
        loss, aux = fn(xi)
        (grad,) = torch.autograd.grad(loss, xi, allow_unused=True)
        grad = torch.zeros_like(xi) if grad is None else grad
    return torch.cat([loss.detach().reshape(1).to(grad.dtype), grad.detach()]), aux.detach()


class GraphedObjective:
    """``fn(raw) -> (loss, aux)`` (``raw`` on ``device``) with :meth:`value_and_grad` through a CUDA graph.

    Called as ``fn`` (``objective(x)``, ``x`` anywhere), it evaluates plainly and differentiably on the device;
    :class:`refine.solver.loop._Evaluator` calls :meth:`value_and_grad` instead, when present.
    """

    def __init__(self, fn: Callable[[Tensor], tuple[Tensor, Any]], device: torch.device, name: str = "evaluation"):
        self.fn, self.device = fn, torch.device(device)
        self.graphed = GraphedFunction(lambda x: loss_and_gradient(self.fn, x), name)

    def __call__(self, x: Tensor) -> tuple[Tensor, Any]:
        return self.fn(x.to(self.device))

    def value_and_grad(self, x: Tensor) -> tuple[Tensor, Tensor, Any]:
        """``(loss, gradient, aux)`` at ``x`` (a CPU vector): loss and gradient on ``x``'s device, ``aux`` (the
        model) on the GPU, copied out of the graph's buffers."""
        both, aux = self.graphed(x.detach().to(self.device))
        both = both.to(x.device)  # the one read per evaluation: the line search needs loss and gradient
        return both[0].to(x.dtype), both[1:].to(x.dtype), aux.clone()

    @property
    def failure(self) -> str | None:
        """Why the graph was not captured (None: captured, or not yet called)."""
        return self.graphed.failure
