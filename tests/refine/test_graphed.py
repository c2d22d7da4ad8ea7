"""The loop's evaluation through ``value_and_grad`` (a GPU's CUDA graph, :mod:`refine.solver.graphed`) on a CPU: the
loop takes loss and gradient from it as from autograd, and its checks still apply.  The capture itself needs a
GPU (tests/test_cuda.py::test_graphed_loss_and_gradient_equal_the_plain_ones)."""

from __future__ import annotations

import math

import pytest
import torch

from nbtorch.runtime import cuda_graph
from refine.solver.graphed import GraphedObjective, loss_and_gradient
from refine.solver.loop import NonFiniteLoss, _Evaluator, minimise
from refine.solver.strategies import LBFGS


def _quadratic(x):
    target = torch.arange(1.0, 1.0 + x.numel(), dtype=x.dtype, device=x.device)
    return ((x - target) ** 2 * torch.linspace(1.0, 3.0, x.numel(), dtype=x.dtype)).sum(), x.detach() * 2


class _Stub(GraphedObjective):
    """A GraphedObjective whose 'graph' is a plain call (what a replay computes), counting calls."""

    def __init__(self, fn):
        super().__init__(fn, torch.device("cpu"))
        self.calls = 0

        def plain(x):
            self.calls += 1
            return loss_and_gradient(self.fn, x)

        self.graphed = plain


def test_cuda_graphs_only_on_a_cuda_device_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv(cuda_graph.ENV, raising=False)
    assert not cuda_graph.enabled("cpu") and cuda_graph.enabled("cuda") and cuda_graph.enabled(torch.device("cuda:1"))
    monkeypatch.setenv(cuda_graph.ENV, "0")
    assert not cuda_graph.enabled("cuda")


def test_value_and_grad_is_what_autograd_gives():
    stub = _Stub(_quadratic)
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    loss, grad, aux = stub.value_and_grad(x)
    xi = x.clone().requires_grad_(True)
    ref_loss, _ = _quadratic(xi)
    (ref_grad,) = torch.autograd.grad(ref_loss, xi)
    assert float(loss) == float(ref_loss) and torch.equal(grad, ref_grad) and torch.equal(aux, x * 2)
    assert loss.dtype == grad.dtype == torch.float64 and loss.dim() == 0


def test_the_loop_uses_value_and_grad_and_reaches_the_same_minimum():
    stub = _Stub(_quadratic)
    x0 = torch.zeros(3, dtype=torch.float64)
    via_graph = minimise(stub, x0, LBFGS())
    plain = minimise(_quadratic, x0, LBFGS())
    assert stub.calls == via_graph.state.evaluations > 0
    assert via_graph.state.step == plain.state.step
    assert torch.allclose(via_graph.state.raw.detach(), plain.state.raw.detach(), rtol=0, atol=1e-12)
    assert torch.allclose(via_graph.state.raw.detach(), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), atol=1e-6)


def test_a_nonfinite_loss_from_value_and_grad_is_caught():
    stub = _Stub(lambda x: (x.sum() * math.inf, x.detach()))
    evaluate = _Evaluator(stub, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(NonFiniteLoss, match="loss is"):
        evaluate()
    assert evaluate.nonfinite == 1


def test_a_capture_failure_names_the_project_line_that_broke_the_rule():
    from nbtorch.runtime.cuda_graph import _where
    from refine.fitting import background

    def deep():
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    try:
        background.BackgroundModel._table(None, None, None, None, None)  # a project frame on the way down
    except Exception as exc:  # noqa: BLE001
        assert _where(exc).startswith(" (at refine/fitting/background.py:")
    try:
        deep()
    except RuntimeError as exc:
        assert _where(exc) == ""  # tests/ is not the project's code
