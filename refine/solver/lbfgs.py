"""One L-BFGS iteration per call, without ``torch.optim``'s start-up cost.

:class:`OneStepLBFGS` is the step rule behind :class:`refine.solver.strategies.LBFGS`: the
same iteration as ``torch.optim.LBFGS(max_iter=1, tolerance_grad=0,
tolerance_change=0)`` -- the two-loop recursion over the last ``history_size``
pairs ``(s, y)``, a first step of ``min(1, 1/|g|_1) * lr``, torch's own
strong-Wolfe line search (``torch.optim.lbfgs._strong_wolfe``, a plain function)
-- with the same floating-point operations in the same order, so a refinement
takes bit for bit the same steps, and the same ``state_dict()`` layout, so a
checkpoint written by either resumes in the other.

Why not ``torch.optim.LBFGS`` itself: every ``torch.optim.Optimizer`` method
is wrapped by ``torch._disable_dynamo``, whose first call imports
``torch._dynamo`` (1.2-1.7 s on the 2-core CI machine), a cost each refinement
process paid once even when nothing is compiled -- a sixth of the README's main
job.  This class does not touch ``torch._dynamo``.

The parameter is one flat leaf tensor ``x`` (shape (P,), real); the closure
sets ``x.grad`` and returns the loss (the refinement loop's closure does).

A second addition: a line-search trial point where the closure raises
:class:`NonFiniteLoss` (the model breaks down there: a NaN or Inf loss or
gradient) does not end the step.  The trial counts as a loss far above the
step's start (:data:`BARRIER`), so the strong-Wolfe search brackets it and
zooms back towards the start, shortening the step; a point where the loss is
finite is what the step ends on (the start itself when no trial was finite).
Where every trial is finite the steps are torch's, bit for bit.

One addition: :meth:`OneStepLBFGS.memory` / :meth:`OneStepLBFGS.warm` hand the
curvature pairs ``(s, y)`` of one loop to the next (the coarse-to-fine copies of
a stage refine the same parameters in the same raw units): the warmed first step
is a quasi-Newton step of length ``lr`` from that memory instead of a short
steepest-descent step, and the pairs of the new loop replace the old ones as
they come.  Without ``warm`` every step is torch's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim.lbfgs import _strong_wolfe

__all__ = ["OneStepLBFGS", "memory_of_state", "NonFiniteLoss", "BARRIER"]

#: a trial point whose loss is NaN/Inf counts as the step's starting loss plus this many times
#: ``max(1, |loss|)``: far above any point the search would accept, finite for its cubic interpolation
BARRIER = 1e3


class NonFiniteLoss(Exception):
    """The loss or its gradient is NaN/Inf at the point evaluated (raised by the closure)."""


def memory_of_state(state: dict[str, Any]) -> dict[str, Any] | None:
    """The curvature memory in an L-BFGS ``state`` (this class's or ``torch.optim.LBFGS``'s state of its
    parameter): copies of the ``(s, y)`` pairs, their ``1/(y.s)`` and the initial inverse-Hessian scale; None
    before any pair was kept."""
    if not state.get("old_dirs"):
        return None

    def copy(v: Any) -> Any:
        return v.clone() if isinstance(v, Tensor) else v

    return {"old_dirs": [copy(t) for t in state["old_dirs"]], "old_stps": [copy(t) for t in state["old_stps"]],
            "ro": [copy(r) for r in state["ro"]], "H_diag": copy(state["H_diag"])}


class OneStepLBFGS:
    """One L-BFGS iteration per :meth:`step` on the flat parameter ``x`` (see the module docstring).

    Arguments:
        x: the leaf parameter vector (P,), updated in place.
        lr: the step length tried first (1 = the quasi-Newton step).
        max_eval: most closure calls per step, line search included.
        history_size: ``(s, y)`` pairs kept.
        line_search_fn: ``"strong_wolfe"`` or None (a fixed step ``lr``, no evaluation after it).
    """

    def __init__(self, x: Tensor, lr: float = 1.0, max_eval: int = 25, history_size: int = 20,
                 line_search_fn: str | None = "strong_wolfe") -> None:
        if x.dim() != 1 or torch.is_complex(x):
            raise ValueError(f"OneStepLBFGS: x must be a real vector, got shape {tuple(x.shape)} {x.dtype}")
        if line_search_fn not in ("strong_wolfe", None):
            raise ValueError(f"line_search_fn: expected 'strong_wolfe' or None, got {line_search_fn!r}")
        self.x = x
        # torch.optim.LBFGS's group layout (max_iter 1 and zero tolerances: the loop decides convergence)
        self.param_groups = [{"lr": lr, "max_iter": 1, "max_eval": max_eval, "tolerance_grad": 0.0,
                              "tolerance_change": 0.0, "history_size": history_size,
                              "line_search_fn": line_search_fn}]
        self.state: dict[str, Any] = {}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"state": {0: ...}, "param_groups": [...]}``, torch.optim.LBFGS's layout (references, not copies)."""
        return {"state": {0: self.state} if self.state else {},
                "param_groups": [{**self.param_groups[0], "params": [0]}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (this class's or ``torch.optim.LBFGS``'s): tensors are cast to
        ``x``'s dtype and device, as torch's optimisers do."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1:
            raise ValueError("OneStepLBFGS.load_state_dict: expected one parameter group")
        self.param_groups = [{k: v for k, v in groups[0].items() if k != "params"}]
        saved = state_dict.get("state", {})
        self.state = {k: self._cast(v) for k, v in saved.get(0, {}).items()} if saved else {}

    def _cast(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            if value.is_floating_point():
                return value.to(dtype=self.x.dtype, device=self.x.device)
            return value.to(device=self.x.device)
        if isinstance(value, list):
            return [self._cast(v) for v in value]
        return value

    def memory(self) -> dict[str, Any] | None:
        """:func:`memory_of_state` of this optimiser."""
        return memory_of_state(self.state)

    def warm(self, memory: dict[str, Any] | None) -> None:
        """Start from another loop's :meth:`memory` (its last ``history_size`` pairs); None: nothing."""
        if memory is None or not memory.get("old_dirs"):
            return
        keep = self.param_groups[0]["history_size"]
        if any(t.shape != self.x.shape for t in memory["old_dirs"]):
            raise ValueError("OneStepLBFGS.warm: the memory is of another number of parameters")
        own = memory_of_state({k: self._cast(list(memory[k][-keep:])) for k in ("old_dirs", "old_stps", "ro")}
                              | {"H_diag": self._cast(memory["H_diag"])})
        self.state = {"func_evals": 0, "n_iter": 1, **own}

    # ------------------------------------------------------------------ helpers
    def _grad(self) -> Tensor:
        g = self.x.grad  # a copy, as torch's _gather_flat_grad makes (its torch.cat)
        return self.x.new_zeros(self.x.numel()) if g is None else g.reshape(-1).clone()

    def _directional_evaluate(self, closure: Callable[[], Tensor], x0: list[Tensor], t: float,
                              d: Tensor) -> tuple[float, Tensor]:
        self.x.add_(d, alpha=t)
        try:
            loss = float(closure())
            flat_grad = self._grad()
        except NonFiniteLoss:  # the model breaks down there: a barrier the search steps back from
            loss, flat_grad = self._barrier  # (the loop's evaluator counts these points)
        finally:
            self.x.copy_(x0[0])
        return loss, flat_grad

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor]) -> Tensor:
        """One iteration; ``closure`` evaluates the loss at ``x`` and sets ``x.grad``.  Returns the loss
        at the start of the step."""
        closure = torch.enable_grad()(closure)
        group = self.param_groups[0]
        lr, max_eval, history_size = float(group["lr"]), group["max_eval"], group["history_size"]
        tolerance_grad, tolerance_change = group["tolerance_grad"], group["tolerance_change"]
        state = self.state
        state.setdefault("func_evals", 0)
        state.setdefault("n_iter", 0)

        orig_loss = closure()
        loss = float(orig_loss)
        current_evals = 1
        state["func_evals"] += 1
        flat_grad = self._grad()
        if flat_grad.abs().max() <= tolerance_grad:
            return orig_loss

        d, t = state.get("d"), state.get("t")
        old_dirs, old_stps, ro = state.get("old_dirs"), state.get("old_stps"), state.get("ro")
        H_diag, prev_flat_grad = state.get("H_diag"), state.get("prev_flat_grad")
        state["n_iter"] += 1
        if state["n_iter"] == 1:
            d = flat_grad.neg()
            old_dirs, old_stps, ro = [], [], []
            H_diag = 1
        else:
            if prev_flat_grad is not None:  # None: the first step after warm(): no pair of this loop yet
                y = flat_grad.sub(prev_flat_grad)
                s = d.mul(t)
                ys = y.dot(s)
                if ys > 1e-10:  # curvature condition: keep the pair
                    if len(old_dirs) == history_size:
                        old_dirs.pop(0)
                        old_stps.pop(0)
                        ro.pop(0)
                    old_dirs.append(y)
                    old_stps.append(s)
                    ro.append(1.0 / ys)
                    H_diag = ys / y.dot(y)
            # two-loop recursion: d = -H g
            num_old = len(old_dirs)
            if "al" not in state:
                state["al"] = [None] * history_size
            al = state["al"]
            q = flat_grad.neg()
            for i in range(num_old - 1, -1, -1):
                al[i] = old_stps[i].dot(q) * ro[i]
                q.add_(old_dirs[i], alpha=-al[i])
            d = r = torch.mul(q, H_diag)
            for i in range(num_old):
                be_i = old_dirs[i].dot(r) * ro[i]
                r.add_(old_stps[i], alpha=al[i] - be_i)

        if prev_flat_grad is None:
            prev_flat_grad = flat_grad.clone(memory_format=torch.contiguous_format)
        else:
            prev_flat_grad.copy_(flat_grad)
        prev_loss = loss
        t = min(1.0, 1.0 / flat_grad.abs().sum()) * lr if state["n_iter"] == 1 else lr
        gtd = flat_grad.dot(d)
        if not gtd > -tolerance_change:
            ls_func_evals = 0
            if group["line_search_fn"] is not None:
                x0 = [self.x.clone(memory_format=torch.contiguous_format)]
                # a NaN/Inf trial: far above the start, with the start's gradient (finite numbers for the search)
                self._barrier = (loss + BARRIER * max(1.0, abs(loss)), flat_grad.clone())

                def obj_func(x, t, d):
                    return self._directional_evaluate(closure, x, t, d)

                loss, flat_grad, t, ls_func_evals = _strong_wolfe(obj_func, x0, t, d, loss, flat_grad, gtd,
                                                                  max_ls=max_eval - current_evals)
            self.x.add_(d, alpha=t)
            state["func_evals"] += ls_func_evals

        state.update(d=d, t=t, old_dirs=old_dirs, old_stps=old_stps, ro=ro, H_diag=H_diag,
                     prev_flat_grad=prev_flat_grad, prev_loss=prev_loss)
        return orig_loss
