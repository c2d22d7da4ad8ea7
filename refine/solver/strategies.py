"""Step rules for the refinement loop: Adam and LBFGS behind one interface.

A strategy makes a ``torch.optim`` optimiser for the single raw parameter
vector and performs **one** step with it (:meth:`AbstractStrategy.step`);
everything else (evaluation caching, convergence tests, NaN handling, time
budget, checkpoints, callbacks) is the loop's job (:mod:`refine.solver.loop`).

* :class:`LBFGS`: one quasi-Newton iteration per loop step with a strong-Wolfe
  line search (a few loss evaluations): :class:`refine.solver.lbfgs.OneStepLBFGS`,
  ``torch.optim.LBFGS(max_iter=1)``'s iteration and state layout without its
  ``torch._dynamo`` import.  The raw parameters are scaled to about one
  (:mod:`refine.fitting.parameters`), which LBFGS needs: it uses one step size and one
  initial inverse Hessian ``gamma I`` for every parameter.
* :class:`Adam`: ``torch.optim.Adam``, one loss evaluation per step, the
  learning rate (raw units per step) following ``schedule`` over the stage's
  ``max_steps``: ``"constant"``, ``"cosine"`` (from ``lr`` down to
  ``lr * lr_final``) or ``"exponential"`` (the same end points, geometric).
  The schedule is a pure function of the step number, so a resumed run
  follows it exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.solver.lbfgs import OneStepLBFGS, memory_of_state

__all__ = ["AbstractStrategy", "Adam", "LBFGS", "get_strategy"]


class AbstractStrategy:
    """Interface of a step rule (subclasses are frozen dataclasses)."""

    name: str = "abstract"

    def init(self, x: Tensor, memory: dict | None = None) -> torch.optim.Optimizer:  # pragma: no cover - abstract
        """A fresh optimiser over the raw parameter ``x`` (a leaf tensor, shape (P,)); ``memory``: what
        :meth:`memory_of` gave at the end of a loop over the same parameters (ignored by rules without one)."""
        raise NotImplementedError

    def memory_of(self, optimizer_state: dict) -> dict | None:
        """What a later loop over the same parameters may start from, from an optimiser ``state_dict()``
        (None: nothing; the default)."""
        return None

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Tensor], step: int, max_steps: int) -> None:
        """Take step number ``step`` (0-based) of at most ``max_steps``; ``closure`` evaluates loss and grads."""
        raise NotImplementedError  # pragma: no cover - abstract

    def hparams(self) -> dict[str, float | int | str]:
        """Settings as flat scalars (for TensorBoard's ``add_hparams`` and result files)."""
        out: dict[str, float | int | str] = {"optimizer": self.name}
        for k, v in asdict(self).items():  # type: ignore[call-overload]
            out[k] = v if isinstance(v, (int, float, str)) else str(v)
        return out


@dataclass(frozen=True)
class LBFGS(AbstractStrategy):
    """Limited-memory BFGS with a strong-Wolfe line search.

    Arguments:
        lr: step length tried first (1 is the quasi-Newton step).
        history_size: number of (s, y) pairs kept.
        max_eval: most loss evaluations per step (line search included).
        line_search: ``"strong_wolfe"`` or ``None`` (fixed step ``lr``).
    """

    lr: float = 1.0
    history_size: int = 20
    max_eval: int = 25
    line_search: str | None = "strong_wolfe"
    name = "lbfgs"

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise InputError(f"lr: must be > 0, got {self.lr!r}")
        if self.line_search not in ("strong_wolfe", None):
            raise InputError(f"line_search: expected 'strong_wolfe' or None, got {self.line_search!r}")

    def init(self, x: Tensor, memory: dict | None = None) -> OneStepLBFGS:
        # the loop decides convergence: OneStepLBFGS has torch's own tests off (tolerances 0)
        optimizer = OneStepLBFGS(x, lr=self.lr, max_eval=self.max_eval, history_size=self.history_size,
                                 line_search_fn=self.line_search)
        optimizer.warm(memory)
        return optimizer

    def memory_of(self, optimizer_state: dict) -> dict | None:
        """The curvature pairs of the loop (:func:`refine.solver.lbfgs.memory_of_state`)."""
        return memory_of_state(optimizer_state.get("state", {}).get(0, {}))

    def step(self, optimizer: OneStepLBFGS, closure: Callable[[], Tensor], step: int, max_steps: int) -> None:
        optimizer.step(closure)


@dataclass(frozen=True)
class Adam(AbstractStrategy):
    """Adam with a learning-rate schedule (raw units: 1 = a typical refinement step).

    Arguments:
        lr: initial learning rate.
        schedule: ``"constant"``, ``"cosine"`` or ``"exponential"``.
        lr_final: final learning rate as a fraction of ``lr`` (cosine and exponential).
        betas: Adam's moment decay rates.
    """

    lr: float = 0.1
    schedule: str = "cosine"
    lr_final: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    name = "adam"

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise InputError(f"lr: must be > 0, got {self.lr!r}")
        if self.schedule not in ("constant", "cosine", "exponential"):
            raise InputError(f"schedule: expected constant, cosine or exponential, got {self.schedule!r}")
        if not 0 < self.lr_final <= 1:
            raise InputError(f"lr_final: must be in (0, 1], got {self.lr_final!r}")

    def learning_rate(self, step: int, max_steps: int) -> float:
        """Learning rate of step ``step`` (0-based) of ``max_steps``."""
        frac = min(1.0, step / max(1, max_steps - 1))
        if self.schedule == "constant":
            return self.lr
        if self.schedule == "cosine":
            return self.lr * (self.lr_final + (1.0 - self.lr_final) * 0.5 * (1.0 + math.cos(math.pi * frac)))
        return self.lr * self.lr_final ** frac

    def init(self, x: Tensor, memory: dict | None = None) -> torch.optim.Optimizer:
        return torch.optim.Adam([x], lr=self.lr, betas=self.betas)

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Tensor], step: int, max_steps: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rate(step, max_steps)
        optimizer.step(closure)


def get_strategy(strategy: str | AbstractStrategy | None) -> AbstractStrategy:
    """``"lbfgs"`` / ``"adam"`` (default settings), a strategy object, or None (LBFGS)."""
    if strategy is None:
        return LBFGS()
    if isinstance(strategy, AbstractStrategy):
        return strategy
    if strategy == "lbfgs":
        return LBFGS()
    if strategy == "adam":
        return Adam()
    raise InputError(f"strategy: expected 'lbfgs', 'adam' or a strategy object, got {strategy!r}")
