"""The one refinement loop: init -> step -> check -> stop, for any step rule.

:func:`minimise` minimises ``fn(raw) -> (loss, aux)`` over a raw vector (P,)
with a strategy from :mod:`refine.solver.strategies`:

1. **init**: evaluate the loss and gradient at the start (or take them from
   the :class:`LoopState` being resumed);
2. **step**: ``strategy.step`` (one Adam update, or one LBFGS iteration with its
   line search), then evaluate at the new point (a cache keyed by the raw bytes
   means the point the line search already evaluated costs nothing);
3. **check**: non-finite loss, gradient or parameters stop the run with
   :attr:`Status.DIVERGED` and restore the last finite point (an LBFGS
   line-search trial point where they are non-finite does not: the search
   steps back from it, :mod:`refine.solver.lbfgs`); an exception
   from the model stops it with :attr:`Status.FAILED`; otherwise the
   convergence tests of :class:`Convergence` are applied;
4. **stop** with :attr:`Status.CONVERGED`, :attr:`Status.MAX_STEPS`,
   :attr:`Status.TIME_BUDGET` or :attr:`Status.NO_STEP`.

Convergence (all in raw units, where one unit is a typical step): the run has
converged when the gradient's largest component is at most ``gtol``, or when
for ``patience`` consecutive steps the loss changed by at most
``ftol + rtol * |loss|`` **and** no raw parameter moved by more than ``xtol``.

A gradient at most ``gtol`` *at the start* means one of two things, and a run
that took no step is never reported as simply "converged":

* the start is a true minimum (e.g. a synthetic image without noise, started
  at its truth): the loss is curved there;
* the model is **degenerate**: the loss does not depend on the parameters at
  all, e.g. a scale that underflowed to ~1e-150 or a model that is zero on
  every fitted pixel, so every derivative vanishes.

The loop tells them apart by probing: it evaluates the loss one raw unit
(a typical step) from the start along each parameter.  If any of these
changes the loss by at most ``ftol + rtol * |loss|``, the loss is flat along
that parameter (a scale of ~1e-150 leaves every geometry parameter
undetermined, while the background alone may still sit at its optimum), the
run ends with :attr:`Status.NO_STEP` (``ok`` is False: the parameters are the
start, not a result) and the message says why; otherwise the start is a
minimum (curved along every parameter) and the run ends with
:attr:`Status.CONVERGED`, its message saying that no step was needed.  The probes cost one evaluation per parameter and
happen only in this case.

After every step ``on_step(state)`` is called with the :class:`LoopState`
(outside any compiled region); every ``checkpoint_every`` steps
``on_checkpoint(state)`` too.  Ctrl-C (``KeyboardInterrupt``) during a step
restores the state at the end of the previous step and raises
:class:`LoopInterrupted` carrying it, so a caller can checkpoint and a resumed
run (``resume=state``) continues exactly where the last full step ended; the resumed point's loss and
gradient are the state's own (no evaluation), so the steps, the evaluation counts and the history are those
of an uninterrupted run.  ``fn`` raising :class:`LoopAborted` (e.g. a lost process group) stops the loop
at once: the exception propagates instead of ending the run as :attr:`Status.FAILED`.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from refine.solver.lbfgs import NonFiniteLoss
from refine.solver.strategies import AbstractStrategy

__all__ = ["Status", "Convergence", "LoopState", "LoopResult", "LoopInterrupted", "LoopAborted", "minimise"]

log = logging.getLogger(__name__)


class Status(enum.Enum):
    """How a refinement (or one stage of it) ended; ``.message`` says it in words."""

    CONVERGED = "converged"
    MAX_STEPS = "max_steps"
    TIME_BUDGET = "time_budget"
    DIVERGED = "diverged"
    FAILED = "failed"
    NO_STEP = "no_step"

    @property
    def message(self) -> str:
        return _MESSAGES[self]

    @property
    def ok(self) -> bool:
        """True when the parameters are usable (converged, or stopped by a step or time limit).

        False for :attr:`NO_STEP`: a degenerate start is not a result (``nbtorch-refine`` exits with 1).
        """
        return self in (Status.CONVERGED, Status.MAX_STEPS, Status.TIME_BUDGET)


_MESSAGES = {
    Status.CONVERGED: "converged: loss, parameter and gradient changes are below the tolerances",
    Status.MAX_STEPS: "stopped at the maximum number of steps before converging",
    Status.TIME_BUDGET: "stopped when the time budget ran out",
    Status.DIVERGED: "stopped: the loss, gradient or parameters became NaN/Inf; the last finite point was kept",
    Status.FAILED: "stopped: evaluating the model raised an error; the last good point was kept",
    Status.NO_STEP: "no step taken: the loss does not change with some parameter at the start (a degenerate model, "
                    "e.g. a scale of ~0 or a model that is 0 on every fitted pixel); the start was kept",
}

#: raw units (one = a typical step) of the probes that tell a flat start from a minimum
PROBE_STEP = 1.0


@dataclass(frozen=True)
class Convergence:
    """Stopping rules of one loop (raw units).

    Arguments:
        max_steps: most optimiser steps.
        time_budget_s: wall-clock limit in seconds (None = none).
        ftol, rtol: absolute and relative loss-change tolerance (``|df| <= ftol + rtol |f|``).
        xtol: largest raw-parameter change tolerated as "not moving".
        gtol: gradient tolerance (largest raw component).
        patience: consecutive small steps needed.
    """

    max_steps: int = 100
    time_budget_s: float | None = None
    ftol: float = 1e-6
    rtol: float = 1e-10
    xtol: float = 1e-4
    gtol: float = 1e-8
    patience: int = 2

    def replace(self, **kw: Any) -> "Convergence":
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(kw)
        return Convergence(**d)


@dataclass
class LoopState:
    """Everything needed to continue a loop exactly (what a checkpoint holds).

    Attributes:
        step: steps taken.
        raw: (P,) current raw parameters.
        loss: loss at ``raw``.
        grad: (P,) gradient at ``raw``.
        optimizer: the optimiser's ``state_dict()``.
        small_steps: consecutive steps that met the change tolerances.
        restarted: the step rule was started afresh once because the loop's steps became small, the last
            vanishing, while its gradient was not (:func:`minimise`, :data:`STALL_FRACTION`).
        evaluations: loss evaluations so far.
        elapsed_s: wall time spent in this loop so far.
        history: one dict per point (start and every step): step, loss, grad_norm, step_norm,
            evaluations, lr, raw (list).
        aux: the ``aux`` output of ``fn`` at ``raw`` (e.g. the model image); not checkpointed.
    """

    step: int
    raw: Tensor
    loss: float
    grad: Tensor
    optimizer: dict
    small_steps: int = 0
    evaluations: int = 0
    elapsed_s: float = 0.0
    history: list = field(default_factory=list)
    aux: Any = None
    restarted: bool = False
    _grad_norm: float | None = field(default=None, repr=False, compare=False)

    @property
    def grad_norm(self) -> float:
        """The largest gradient component, computed once (a vector split over processes reduces it over all of
        them, :mod:`refine.many.sharded`: every process asks first at the same point of the loop)."""
        if self._grad_norm is None:
            self._grad_norm = float(self.grad.abs().max()) if self.grad.numel() else 0.0
        return self._grad_norm

    def snapshot(self, history: bool = True) -> "LoopState":
        """A copy (tensors cloned) that later steps cannot modify.

        The optimizer state is shared: it is a private copy (:func:`frozen_copy`) that nothing writes to
        (a resume loads a copy of it).  ``history=False`` shares the (append-only) history list too.
        """
        return LoopState(self.step, self.raw.detach().clone(), self.loss, self.grad.detach().clone(),
                         self.optimizer, self.small_steps, self.evaluations, self.elapsed_s,
                         [dict(h) for h in self.history] if history else self.history, self.aux, self.restarted,
                         self._grad_norm)

    def to_dict(self) -> dict:
        """Plain containers and tensors only (``torch.save`` with ``weights_only`` loading)."""
        return {"step": self.step, "raw": self.raw.detach().clone(), "loss": self.loss, "grad": self.grad.detach().clone(),
                "optimizer": self.optimizer, "small_steps": self.small_steps, "evaluations": self.evaluations,
                "elapsed_s": self.elapsed_s, "history": self.history, "restarted": self.restarted}

    @classmethod
    def from_dict(cls, d: dict) -> "LoopState":
        return cls(int(d["step"]), d["raw"], float(d["loss"]), d["grad"], d["optimizer"], int(d["small_steps"]),
                   int(d["evaluations"]), float(d["elapsed_s"]), list(d["history"]),
                   restarted=bool(d.get("restarted", False)))


@dataclass(frozen=True)
class LoopResult:
    """Outcome of :func:`minimise`: final ``state`` (the last finite point), ``status`` and ``message``."""

    status: Status
    message: str
    state: LoopState


class LoopInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`minimise`; ``state`` is the loop state at the end of the last full step."""

    def __init__(self, state: LoopState) -> None:
        super().__init__("interrupted")
        self.state = state


class LoopAborted(RuntimeError):
    """Raised by ``fn`` when the run cannot go on at all (e.g. another process of a joint run died): it
    leaves :func:`minimise` unchanged, where any other exception of ``fn`` ends the run as FAILED."""


def frozen_copy(obj: Any) -> Any:
    """A copy of an optimizer ``state_dict`` that later optimizer steps cannot modify: containers rebuilt,
    tensors cloned (what ``copy.deepcopy`` gives, ~10x faster: LBFGS keeps two tensors per history pair)."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: frozen_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(frozen_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all())


class _Evaluator:
    """``fn`` at the loop's parameters ``x`` with its gradient, cached by the bytes of ``x`` (a line search
    re-evaluates points), counted, and checked: a NaN/Inf loss or gradient raises :class:`NonFiniteLoss` (the LBFGS
    line search steps back from such a trial point; at an accepted point it ends the run with DIVERGED)."""

    def __init__(self, fn: Callable[[Tensor], tuple[Tensor, Any]], x: Tensor, evaluations: int = 0) -> None:
        self.fn, self.x, self.evaluations = fn, x, evaluations
        self.cache: dict[bytes, tuple[Tensor, Tensor, Any]] = {}
        self.nonfinite = 0  # points where the loss or gradient was NaN/Inf

    def __call__(self) -> tuple[Tensor, Tensor, Any]:
        key = self.x.detach().cpu().numpy().tobytes()
        hit = self.cache.get(key)
        agree = getattr(type(self.x), "agree", None)  # a vector split over processes: a hit in every one of them
        if agree is not None and not agree(hit is not None):
            hit = None
        if hit is not None:
            return hit
        value_and_grad = getattr(self.fn, "value_and_grad", None)  # both at once (a CUDA graph: refine.solver.graphed)
        if value_and_grad is not None:
            xi = self.x.detach().clone()
            loss, grad, aux = value_and_grad(xi)
            if not _finite(loss):
                self.nonfinite += 1
                raise NonFiniteLoss(f"loss is {float(loss)}")
        else:
            with torch.enable_grad():
                xi = self.x.detach().clone().requires_grad_(True)
                loss, aux = self.fn(xi)
                if not _finite(loss.detach()):
                    self.nonfinite += 1
                    raise NonFiniteLoss(f"loss is {float(loss.detach())}")
                (grad,) = torch.autograd.grad(loss, xi, allow_unused=True)
                grad = torch.zeros_like(xi) if grad is None else grad
        if type(grad) is not type(xi):  # autograd hands back plain tensors: the parameters' type again
            grad = grad.as_subclass(type(xi))
        if not _finite(grad):
            self.nonfinite += 1
            bad = (~torch.isfinite(grad.detach())).nonzero().reshape(-1).tolist()
            raise NonFiniteLoss(f"gradient component {bad[0]} is {float(grad[bad[0]])}" if bad else
                                "a gradient component of another process is NaN/Inf")
        self.evaluations += 1
        entry = (loss.detach(), grad.detach(), aux)
        if len(self.cache) >= 16:
            self.cache.pop(next(iter(self.cache)))
        self.cache[key] = entry
        return entry

    def closure(self) -> Tensor:
        """The optimizers' closure: the loss, with ``x.grad`` set."""
        loss, grad, _ = self()
        self.x.grad = grad.clone()
        return loss

    def seed(self, state: LoopState) -> None:
        """Know ``fn`` at a resumed state's point (its loss and gradient), as the uninterrupted run did."""
        loss = torch.tensor(state.loss, dtype=state.grad.dtype)
        self.cache = {state.raw.detach().cpu().numpy().tobytes(): (loss, state.grad.detach().clone(), state.aux)}

    def keep_only(self, raw: Tensor) -> None:
        """Forget every point but ``raw`` (the next step starts from it)."""
        key = raw.cpu().numpy().tobytes()
        self.cache = {key: self.cache[key]} if key in self.cache else {}


def _start(evaluate: _Evaluator, optimizer, on_step, t_start: float) -> LoopState | LoopResult:
    """The state at the starting point (reported to ``on_step``), or a FAILED result when it is not usable."""
    x = evaluate.x
    try:
        loss0, grad0, aux0 = evaluate()
    except LoopAborted:
        raise
    except NonFiniteLoss as exc:
        state = LoopState(0, x.detach().clone(), math.nan, torch.zeros_like(x.detach()), optimizer.state_dict())
        return LoopResult(Status.FAILED, f"the starting point is not usable: {exc}", state)
    except Exception as exc:  # noqa: BLE001 - reported as a status
        log.exception("evaluating the starting point failed")
        state = LoopState(0, x.detach().clone(), math.nan, torch.zeros_like(x.detach()), optimizer.state_dict())
        return LoopResult(Status.FAILED, f"evaluating the starting point raised {type(exc).__name__}: {exc}", state)
    state = LoopState(0, x.detach().clone(), float(loss0), grad0.clone(), frozen_copy(optimizer.state_dict()),
                      evaluations=evaluate.evaluations, elapsed_s=time.monotonic() - t_start, aux=aux0)
    state.history.append(_record(state, 0.0, math.nan))
    if on_step is not None:
        try:
            on_step(state)
        except KeyboardInterrupt:
            state.elapsed_s = time.monotonic() - t_start
            raise LoopInterrupted(state.snapshot()) from None
    return state


def _limit_reached(state: LoopState, convergence: Convergence, elapsed_s: float) -> tuple[Status | None, str]:
    if state.step >= convergence.max_steps:
        return Status.MAX_STEPS, f"reached max_steps={convergence.max_steps}"
    if convergence.time_budget_s is not None and elapsed_s >= convergence.time_budget_s:
        return Status.TIME_BUDGET, f"time budget of {convergence.time_budget_s:g} s used"
    return None, ""


def _step(strategy: AbstractStrategy, optimizer, evaluate: _Evaluator, state: LoopState, convergence: Convergence,
          elapsed) -> tuple[LoopState, Status | None, str]:
    """One step of ``strategy`` from ``state``: the new state, or the last good one with DIVERGED/FAILED."""
    x = evaluate.x
    good = state.snapshot(history=False)  # the history list is only appended to after a full step
    n_history = len(state.history)
    lr = getattr(strategy, "learning_rate", None)
    lr_now = lr(state.step, convergence.max_steps) if lr is not None else float(getattr(strategy, "lr", math.nan))
    try:
        strategy.step(optimizer, evaluate.closure, state.step, convergence.max_steps)
        if not _finite(x.detach()):
            raise NonFiniteLoss("the parameters became NaN/Inf")
        loss, grad, aux = evaluate()
    except KeyboardInterrupt:
        del good.history[n_history:]
        good = good.snapshot()
        good.elapsed_s = elapsed()
        raise LoopInterrupted(good) from None
    except LoopAborted:
        raise
    except NonFiniteLoss as exc:
        del good.history[n_history:]
        return good, Status.DIVERGED, f"step {state.step + 1}: {exc}; parameters restored to step {state.step}"
    except Exception as exc:  # noqa: BLE001 - a failing model is a status, not a crash
        log.exception("refinement step %d failed", state.step + 1)
        del good.history[n_history:]
        return good, Status.FAILED, (f"step {state.step + 1} raised {type(exc).__name__}: {exc}; "
                                     f"parameters restored to step {state.step}")
    new_raw = x.detach().clone()
    df = abs(float(loss) - state.loss)
    dx = float((new_raw - state.raw).abs().max()) if new_raw.numel() else 0.0
    small = df <= convergence.ftol + convergence.rtol * abs(float(loss)) and dx <= convergence.xtol
    state = LoopState(state.step + 1, new_raw, float(loss), grad.clone(), frozen_copy(optimizer.state_dict()),
                      state.small_steps + 1 if small else 0, evaluate.evaluations, elapsed(), state.history, aux,
                      state.restarted)
    state.history.append(_record(state, dx, lr_now))
    evaluate.keep_only(new_raw)
    if state.grad_norm <= convergence.gtol:
        return state, Status.CONVERGED, f"gradient {state.grad_norm:.3g} <= gtol={convergence.gtol:g}"
    if state.small_steps >= convergence.patience:
        return state, Status.CONVERGED, (f"loss change {df:.3g} and parameter change {dx:.3g} below tolerances "
                                         f"for {state.small_steps} steps")
    return state, None, ""


def _report_step(state: LoopState, on_step, on_checkpoint, checkpoint_every: int, elapsed) -> None:
    """The step is complete: tell ``on_step`` and checkpoint; an interrupt from here on keeps the step."""
    try:
        if on_step is not None:
            on_step(state)
        if on_checkpoint is not None and checkpoint_every > 0 and state.step % checkpoint_every == 0:
            on_checkpoint(state.snapshot())
    except KeyboardInterrupt:
        done = state.snapshot()
        done.elapsed_s = elapsed()
        raise LoopInterrupted(done) from None


def minimise(
    fn: Callable[[Tensor], tuple[Tensor, Any]],
    raw0: Tensor,
    strategy: AbstractStrategy,
    convergence: Convergence = Convergence(),
    *,
    on_step: Callable[[LoopState], None] | None = None,
    on_checkpoint: Callable[[LoopState], None] | None = None,
    checkpoint_every: int = 0,
    resume: LoopState | None = None,
    memory: dict | None = None,
) -> LoopResult:
    """Minimise ``fn`` over a raw parameter vector with ``strategy`` (see the module docstring).

    Arguments:
        fn: ``raw (P,) -> (scalar loss tensor, aux)``; differentiable in ``raw``.
        raw0: (P,) starting raw parameters (ignored when resuming).
        strategy: the step rule (:class:`~refine.solver.strategies.LBFGS`, :class:`~refine.solver.strategies.Adam`).
        convergence: stopping rules.
        on_step: called with the state after the start evaluation and after every step.
        on_checkpoint: called with the state every ``checkpoint_every`` steps (0 = never).
        resume: a :class:`LoopState` to continue from (e.g. read from a checkpoint).
        memory: the strategy's :meth:`~refine.solver.strategies.AbstractStrategy.memory_of` an earlier loop over the same
            parameters to start from (LBFGS: its curvature pairs); ignored when resuming (the state has its own).

    Returns:
        :class:`LoopResult`; its state holds the last finite point.

    Raises:
        LoopInterrupted: on Ctrl-C, carrying the state at the end of the last full step.
        LoopAborted: raised by ``fn``, unchanged.
    """
    t_start = time.monotonic()
    x = (resume.raw if resume is not None else raw0).detach().clone().requires_grad_(True)
    # a memory only when there is one: a step rule written against init(x) keeps working
    optimizer = strategy.init(x) if memory is None or resume is not None else strategy.init(x, memory)
    evaluate = _Evaluator(fn, x)
    raw_start = x.detach().clone()
    if resume is not None:
        state = resume.snapshot()
        optimizer.load_state_dict(frozen_copy(resume.optimizer))
        evaluate.evaluations = state.evaluations
        evaluate.seed(state)
        elapsed0 = state.elapsed_s
    else:
        elapsed0 = 0.0
        started = _start(evaluate, optimizer, on_step, t_start)
        if isinstance(started, LoopResult):
            return started
        state = started

    def elapsed() -> float:
        return elapsed0 + time.monotonic() - t_start

    status, message = None, ""
    if state.grad_norm <= convergence.gtol:
        if state.step == 0:
            status, message = _classify_start(fn, state, convergence, evaluate)
        else:  # a resumed run: it took its steps before
            status, message = Status.CONVERGED, f"gradient {state.grad_norm:.3g} <= gtol={convergence.gtol:g}"
    while status is None:
        status, message = _limit_reached(state, convergence, elapsed())
        if status is not None:
            break
        state, status, message = _step(strategy, optimizer, evaluate, state, convergence, elapsed)
        if status is Status.CONVERGED and _stalled(state, convergence):
            optimizer, status, message = _restart(strategy, x, state, message)
        if status in (Status.DIVERGED, Status.FAILED):
            break
        _report_step(state, on_step, on_checkpoint, checkpoint_every, elapsed)
    if status is Status.CONVERGED and resume is None and state.step > 0 and _went_nowhere(state, raw_start, convergence):
        # steps that changed nothing: a minimum where it started, or a loss flat in some parameter
        status, message = _classify_start(fn, state, convergence, evaluate)
        message = f"{state.step} steps moved nothing; {message}"
    message = _with_nonfinite_note(message, status, evaluate.nonfinite)
    state.elapsed_s = elapsed()
    state.evaluations = evaluate.evaluations
    return LoopResult(status, message, state)


def _with_nonfinite_note(message: str, status: Status, nonfinite: int) -> str:
    """``message`` and, when the run went on past NaN/Inf trial points of the line search, how many there were."""
    if not nonfinite or status is Status.DIVERGED:
        return message
    note = (f"the loss was NaN/Inf at {nonfinite} trial point(s) of the line search, which stepped back from them: "
            "the model breaks down near the path taken")
    log.warning("%s", note)
    return f"{message}; {note}" if message else note


#: a step shorter than this fraction of ``xtol`` did not become small, it vanished: the line search found no
#: decrease along the step rule's direction (the bank problem's stall in photons: 1e-3 of xtol; steps that end
#: converged loops on the README's main job and the tutorial: 0.05-0.06 of it)
STALL_FRACTION = 0.01


def _stalled(state: LoopState, convergence: Convergence) -> bool:
    """Small steps ended a loop not restarted yet, the last one vanishing (:data:`STALL_FRACTION`) while the
    gradient is not small."""
    return (not state.restarted and state.small_steps >= convergence.patience and state.grad_norm > convergence.gtol
            and state.history[-1]["step_norm"] <= STALL_FRACTION * convergence.xtol)


def _restart(strategy: AbstractStrategy, x: Tensor, state: LoopState, message: str):
    """``(fresh optimizer, None, "")``: a quasi-Newton rule can stall on its own curvature memory (or on one
    carried over from an earlier loop), its line search finding no decrease along the directions that memory
    bends; "no change" then is not a minimum.  The step rule starts afresh once, from the current point, and
    the loop goes on until its own steps are small (measured on the bank problem in photons: the final stage
    stopped at 1.29x the shot noise after 3 steps; afresh it reaches 0.98x)."""
    log.info("step %d: %s; starting the step rule afresh once", state.step, message)
    state.restarted = True
    state.small_steps = 0
    return strategy.init(x), None, ""


def _went_nowhere(state: LoopState, raw_start: Tensor, convergence: Convergence) -> bool:
    """The run ended within ``xtol`` of its start and the loss within ``ftol``: no step did anything."""
    first_loss = state.history[0]["loss"] if state.history else state.loss
    dx = float((state.raw - raw_start).abs().max()) if raw_start.numel() else 0.0
    return dx <= convergence.xtol and abs(state.loss - first_loss) <= convergence.ftol + convergence.rtol * abs(state.loss)


def _classify_start(fn: Callable[[Tensor], tuple[Tensor, Any]], state: LoopState, convergence: Convergence,
                    counter: _Evaluator) -> tuple[Status, str]:
    """Status of a start whose gradient is already at most ``gtol``: a minimum, or a degenerate (flat) loss.

    Evaluates the loss :data:`PROBE_STEP` raw units from the start along each parameter (no gradients); a
    probe that fails or is not finite counts as a change.  One parameter the loss does not depend on is
    enough for :attr:`Status.NO_STEP`: a minimum is curved along every parameter.
    """
    x0 = state.raw.detach()
    if getattr(type(x0), "agree", None) is not None:  # split over processes: no probe of each process's own part
        return Status.CONVERGED, (f"no step needed: gradient {state.grad_norm:.3g} <= gtol={convergence.gtol:g} at "
                                  "the start")
    tol = convergence.ftol + convergence.rtol * abs(state.loss)
    flat: list[int] = []
    for i in range(x0.numel()):
        xi = x0.clone()
        xi[i] += PROBE_STEP
        try:
            with torch.no_grad():
                value = float(fn(xi)[0].detach())
        except LoopAborted:
            raise
        except Exception:  # noqa: BLE001 - a model that breaks one step away is not flat
            value = math.nan
        counter.evaluations += 1
        if math.isfinite(value) and abs(value - state.loss) <= tol:
            flat.append(i)
    state.evaluations = counter.evaluations
    if flat:
        which = ", ".join(str(i) for i in flat[:8]) + (", ..." if len(flat) > 8 else "")
        log.warning("no step taken: the gradient is %.3g and the loss does not change when parameter(s) %s of %d "
                    "move by %g raw units", state.grad_norm, which, x0.numel(), PROBE_STEP)
        return Status.NO_STEP, (f"no step taken: gradient {state.grad_norm:.3g} <= gtol at the start, but the loss "
                                f"does not change when parameter(s) {which} (of {x0.numel()}) move by "
                                f"{PROBE_STEP:g} raw units (a degenerate model: a scale of ~0, or no model signal "
                                "on the fitted pixels)")
    return Status.CONVERGED, (f"no step needed: gradient {state.grad_norm:.3g} <= gtol={convergence.gtol:g} at the "
                              "start, which is a minimum (the loss rises along every parameter)")


def _record(state: LoopState, step_norm: float, lr: float) -> dict:
    """One history entry; ``raw`` only for a plain vector (not one split over processes)."""
    out = {"step": state.step, "loss": state.loss, "grad_norm": state.grad_norm, "step_norm": step_norm,
           "evaluations": state.evaluations, "lr": lr}
    if type(state.raw) is Tensor:
        out["raw"] = [float(v) for v in state.raw]
    return out
