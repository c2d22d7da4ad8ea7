"""The loop on analytic functions: convergence, statuses, NaN handling, interrupts and exact resume."""

from __future__ import annotations

import math
import time

import pytest
import torch

from refine.solver.loop import Convergence, LoopInterrupted, LoopState, Status, minimise
from refine.solver.strategies import LBFGS, AbstractStrategy, Adam, get_strategy

F64 = torch.float64


def rosenbrock(x):
    return 100.0 * (x[1] - x[0] ** 2) ** 2 + (1.0 - x[0]) ** 2, None


def quadratic(x):
    # badly scaled on purpose: curvatures 1 and 1e4
    return 0.5 * (x[0] - 1.0) ** 2 + 5e3 * (x[1] + 2.0) ** 2, None


START = torch.tensor([-1.2, 1.0], dtype=F64)


def test_status_enum_has_messages():
    assert {s.value for s in Status} == {"converged", "max_steps", "time_budget", "diverged", "failed",
                                          "no_step"}
    for s in Status:
        assert isinstance(s.message, str) and len(s.message) > 10
    assert Status.CONVERGED.ok and Status.MAX_STEPS.ok and not Status.DIVERGED.ok and not Status.FAILED.ok
    assert not Status.NO_STEP.ok and "converged" not in Status.NO_STEP.message


@pytest.mark.parametrize("strategy, fn, steps, target, tol", [
    (LBFGS(), rosenbrock, 200, (1.0, 1.0), 1e-5),
    (Adam(lr=0.1, lr_final=0.001), quadratic, 600, (1.0, -2.0), 1e-3),  # Adam ignores the bad scaling
])
def test_converges(strategy, fn, steps, target, tol):
    res = minimise(fn, START, strategy, Convergence(max_steps=steps, ftol=1e-12, xtol=1e-6))
    assert res.status in (Status.CONVERGED, Status.MAX_STEPS), res.message
    assert torch.allclose(res.state.raw, torch.tensor(target, dtype=F64), atol=tol)
    hist = res.state.history
    assert hist[0]["step"] == 0 and hist[-1]["step"] == res.state.step == len(hist) - 1
    assert hist[-1]["loss"] <= hist[0]["loss"]


def test_lbfgs_one_step_per_iteration_and_cache():
    calls = {"n": 0}

    def f(x):
        calls["n"] += 1
        return quadratic(x)

    res = minimise(f, START, LBFGS(), Convergence(max_steps=100))
    assert res.status is Status.CONVERGED
    # the post-step evaluation is cached, so evaluations count real calls only
    assert res.state.evaluations == calls["n"]
    assert torch.allclose(res.state.raw, torch.tensor([1.0, -2.0], dtype=F64), atol=1e-6)


def test_max_steps_and_time_budget():
    res = minimise(rosenbrock, START, Adam(lr=1e-3), Convergence(max_steps=5))
    assert res.status is Status.MAX_STEPS and res.state.step == 5 and len(res.state.history) == 6

    def slow(x):
        time.sleep(0.02)
        return rosenbrock(x)

    res = minimise(slow, START, Adam(lr=1e-3), Convergence(max_steps=10_000, time_budget_s=0.2))
    assert res.status is Status.TIME_BUDGET and 1 <= res.state.step < 50


def test_gradient_tolerance():
    res = minimise(quadratic, torch.tensor([1.0, -2.0], dtype=F64), LBFGS(), Convergence(gtol=1e-6))
    assert res.status is Status.CONVERGED and res.state.step == 0 and "gtol" in res.message
    assert "minimum" in res.message and "converged" not in res.message


@pytest.mark.parametrize("strategy", [LBFGS(), Adam()])
def test_flat_start_is_no_step_not_converged(strategy):
    """#20: a scale that underflowed (1e-150) makes every derivative ~0; that is no result, not convergence."""
    scale = 1e-150

    def degenerate(x):
        return 1234.5 + scale * ((x - torch.tensor([3.0, -1.0], dtype=F64)) ** 2).sum(), None

    res = minimise(degenerate, START, strategy, Convergence(max_steps=50))
    assert res.status is Status.NO_STEP and not res.status.ok
    assert res.state.step == 0 and "converged" not in res.message and "degenerate" in res.message
    assert torch.equal(res.state.raw, START)
    assert res.state.evaluations == 1 + 2  # the start and one probe per parameter


def test_start_at_the_background_optimum_with_a_collapsed_scale_is_no_step():
    """The #20 case: the background at its optimum (curved), everything else flat because the scale is ~0."""
    def f(x):
        return 1e-150 * ((x[0] - 2.0) ** 2 + x[2] ** 2) + (x[1] - 1.0) ** 2, None

    res = minimise(f, torch.tensor([0.0, 1.0, 0.0], dtype=F64), LBFGS(), Convergence())
    assert res.status is Status.NO_STEP and res.state.step == 0
    assert "parameter(s) 0, 2 (of 3)" in res.message


def test_steps_that_move_nothing_are_no_step():
    """A gradient just above gtol along a flat direction: the steps change nothing and the run stopped on
    'small steps'; that is a flat loss, not convergence (the real still with --start scale=9.9e-25)."""
    def f(x):
        return 1234.5 + 1e-150 * (x[0] - 2.0) ** 2 + 1e-7 * x[1], None

    res = minimise(f, torch.tensor([0.0, 0.0], dtype=F64), LBFGS(), Convergence(max_steps=50))
    assert res.state.step > 0 and res.status is Status.NO_STEP, res.message
    assert "moved nothing" in res.message and "converged" not in res.message

    def curved(x):  # a true minimum reached at once: still converged
        return ((x - 1.0) ** 2).sum(), None

    ok = minimise(curved, torch.tensor([1.0 + 1e-9, 1.0], dtype=F64), LBFGS(), Convergence(gtol=1e-12, max_steps=50))
    assert ok.status is Status.CONVERGED, ok.message


def _breaks_beyond(x):
    loss = quadratic(x)[0]
    if float(x[0].detach()) > 0.5:  # the model breaks down beyond this point (its minimum is at x[0] = 1)
        loss = loss * float("nan")
    return loss, None


def test_nan_stops_adam_with_diverged_and_keeps_last_finite_point():
    res = minimise(_breaks_beyond, torch.tensor([0.0, 0.0], dtype=F64), Adam(lr=0.5), Convergence(max_steps=100))
    assert res.status is Status.DIVERGED
    assert "nan" in res.message.lower() and "restored" in res.message
    assert torch.isfinite(res.state.raw).all() and float(res.state.raw[0]) <= 0.5
    assert math.isfinite(res.state.loss)


def test_lbfgs_steps_back_from_a_nan_trial_point():
    """A line-search trial where the loss is NaN shortens the step instead of ending the run: with the minimum
    beyond the breakdown the run ends at the edge, finite, and says the loss was NaN on the way."""
    res = minimise(_breaks_beyond, torch.tensor([0.0, 0.0], dtype=F64), LBFGS(), Convergence(max_steps=100))
    assert res.status is not Status.DIVERGED, res.message
    assert torch.isfinite(res.state.raw).all() and 0.4 < float(res.state.raw[0]) <= 0.5
    assert float(res.state.raw[1]) == pytest.approx(-2.0, abs=1e-4) and math.isfinite(res.state.loss)
    assert "NaN/Inf at" in res.message and "trial point" in res.message

    # a first trial that overshoots into the broken region (lr 10) with the minimum where the model is finite:
    # the run converges to it, as from a start that never met the NaN
    def overshoot(x):
        loss = ((x - 1.0) ** 2).sum()
        return (loss * float("nan") if float(x.detach().min()) < -2.0 else loss), None

    res = minimise(overshoot, torch.tensor([3.0, 2.5], dtype=F64), LBFGS(lr=10.0), Convergence(max_steps=50))
    assert res.status is Status.CONVERGED, res.message
    assert torch.allclose(res.state.raw, torch.ones(2, dtype=F64), atol=1e-6)
    assert "NaN/Inf at" in res.message


def test_nan_gradient_and_start_failures():
    def bad_grad(x):
        return torch.sqrt(x[0] - x[0]) + (x[1] ** 2), None  # d sqrt(0) = inf

    res = minimise(bad_grad, START, LBFGS(), Convergence())
    assert res.status is Status.FAILED and "starting point" in res.message

    def raises(x):
        if float(x[0].detach()) > -1.0:
            raise RuntimeError("model exploded")
        return quadratic(x)

    res = minimise(raises, START, Adam(lr=0.5), Convergence(max_steps=20))
    assert res.status is Status.FAILED and "model exploded" in res.message
    assert float(res.state.raw[0]) <= -1.0


def _interrupt_after(n_evals: int):
    calls = {"n": 0}

    def f(x):
        calls["n"] += 1
        if calls["n"] == n_evals:
            raise KeyboardInterrupt
        return rosenbrock(x)

    return f


@pytest.mark.parametrize("strategy", [LBFGS(history_size=5), Adam(lr=0.02, lr_final=0.01)])
@pytest.mark.parametrize("at", [3, 17])
def test_interrupt_then_resume_matches_uninterrupted(strategy, at):
    conv = Convergence(max_steps=60)
    full = minimise(rosenbrock, START, strategy, conv)
    with pytest.raises(LoopInterrupted) as info:
        minimise(_interrupt_after(at), START, strategy, conv)
    saved = info.value.state
    assert isinstance(info.value, KeyboardInterrupt)
    # round trip through the checkpoint representation
    restored = LoopState.from_dict(saved.to_dict())
    done = minimise(rosenbrock, START, strategy, conv, resume=restored)
    assert done.status == full.status and done.state.step == full.state.step
    assert torch.equal(done.state.raw, full.state.raw)
    assert [h["loss"] for h in done.state.history] == [h["loss"] for h in full.state.history]
    # the resumed point's loss and gradient come from the state: the evaluation counts are those of one run
    assert done.state.evaluations == full.state.evaluations
    assert [h["evaluations"] for h in done.state.history] == [h["evaluations"] for h in full.state.history]


def test_loop_aborted_propagates():
    """LoopAborted from fn (a lost process group) leaves minimise; any other exception ends the run as FAILED."""
    from refine.solver.loop import LoopAborted

    def lost(x):
        if float(x[0].detach()) != float(START[0]):
            raise LoopAborted("the process group failed")
        return rosenbrock(x)

    with pytest.raises(LoopAborted, match="process group"):
        minimise(lost, START, LBFGS(), Convergence(max_steps=5))

    def broken(x):
        if float(x[0].detach()) != float(START[0]):
            raise RuntimeError("model broke")
        return rosenbrock(x)

    assert minimise(broken, START, LBFGS(), Convergence(max_steps=5)).status is Status.FAILED


def test_on_step_and_checkpoint_hooks():
    seen, saved = [], []
    minimise(quadratic, START, LBFGS(), Convergence(max_steps=7, ftol=0, xtol=0, gtol=0),
             on_step=lambda s: seen.append(s.step), on_checkpoint=lambda s: saved.append(s.step), checkpoint_every=3)
    assert seen[0] == 0 and seen == list(range(len(seen)))
    assert saved == [s for s in seen if s > 0 and s % 3 == 0]


def test_get_strategy_and_settings():
    assert isinstance(get_strategy(None), LBFGS) and isinstance(get_strategy("adam"), Adam)
    with pytest.raises(ValueError, match="strategy"):
        get_strategy("sgd")
    with pytest.raises(ValueError, match="schedule"):
        Adam(schedule="linear")
    a = Adam(lr=0.1, schedule="cosine", lr_final=0.01)
    assert a.learning_rate(0, 101) == pytest.approx(0.1) and a.learning_rate(100, 101) == pytest.approx(0.001)
    assert Adam(lr=0.1, schedule="exponential", lr_final=0.01).learning_rate(50, 101) == pytest.approx(0.01)
    hp = LBFGS().hparams()
    assert hp["optimizer"] == "lbfgs" and hp["history_size"] == 20


def test_a_step_rule_with_the_old_init_signature_still_runs():
    """A user's AbstractStrategy written before init took a memory (init(self, x)) runs as before."""
    class Plain(AbstractStrategy):
        name = "plain"

        def init(self, x):
            return torch.optim.SGD([x], lr=0.1)

        def step(self, optimizer, closure, step, max_steps):
            optimizer.step(closure)

    res = minimise(lambda x: (((x - 1.0) ** 2).sum(), None), torch.zeros(2, dtype=F64), Plain(),
                   Convergence(max_steps=50, ftol=1e-14, xtol=1e-9))
    assert res.state.step > 0 and torch.allclose(res.state.raw, torch.ones(2, dtype=F64), atol=1e-3)


class _StallsUntilRestarted(AbstractStrategy):
    """Gradient descent whose first optimiser makes no progress (as a quasi-Newton step rule whose line search
    finds no decrease along a stale direction): only a fresh one moves."""

    def __init__(self) -> None:
        self.created = 0

    def init(self, x, memory=None):
        self.created += 1
        opt = torch.optim.SGD([x], lr=0.25)
        opt.fresh = self.created > 1
        return opt

    def step(self, optimizer, closure, step, max_steps):
        if optimizer.fresh:
            optimizer.step(closure)  # the loop's closure sets x.grad


def test_small_steps_are_trusted_only_after_a_fresh_start():
    """A loop whose step rule stalls far from the minimum is not 'converged': the rule starts afresh once and the
    loop reaches the minimum; the restart is part of the state (checkpoints carry it)."""
    target = torch.tensor([3.0, -2.0], dtype=torch.float64)

    def fn(x):
        return ((x - target) ** 2).sum(), None

    rule = _StallsUntilRestarted()
    res = minimise(fn, torch.zeros(2, dtype=torch.float64), rule, Convergence(max_steps=200, ftol=1e-12, xtol=1e-9))
    assert res.status is Status.CONVERGED and rule.created == 2 and res.state.restarted
    assert torch.allclose(res.state.raw, target, atol=1e-5)
    assert LoopState.from_dict(res.state.to_dict()).restarted
    assert not LoopState.from_dict({**res.state.to_dict(), "restarted": False}).restarted
    old = {k: v for k, v in res.state.to_dict().items() if k != "restarted"}  # a checkpoint of an earlier build
    assert not LoopState.from_dict(old).restarted
