"""refine.solver.lbfgs.OneStepLBFGS: torch.optim.LBFGS(max_iter=1)'s steps bit for bit, its state layout both ways,
and no torch._dynamo import."""

import subprocess
import sys

import pytest
import torch

from refine.solver.lbfgs import OneStepLBFGS

F64 = torch.float64


def rosenbrock(x):
    return ((1 - x[:-1]) ** 2).sum() + 100 * ((x[1:] - x[:-1] ** 2) ** 2).sum()


def scaled_quartic(x):
    w = torch.logspace(-2, 3, x.numel(), dtype=x.dtype)
    return (w * (x - 0.3) ** 2).sum() + 0.1 * (x**4).sum()


def _closure(fn, x):
    def closure():
        x.grad = None
        loss = fn(x)
        loss.backward()
        return loss
    return closure


def _torch_lbfgs(x, lr, history, line_search):
    return torch.optim.LBFGS([x], lr=lr, max_iter=1, max_eval=25, tolerance_grad=0.0, tolerance_change=0.0,
                             history_size=history, line_search_fn=line_search)


def _ours(x, lr, history, line_search):
    return OneStepLBFGS(x, lr=lr, max_eval=25, history_size=history, line_search_fn=line_search)


def _run(make, fn, x0, steps, lr=1.0, history=3, line_search="strong_wolfe", state=None):
    x = x0.clone().requires_grad_(True)
    opt = make(x, lr, history, line_search)
    if state is not None:
        opt.load_state_dict(state)
    path = []
    for _ in range(steps):
        opt.step(_closure(fn, x))
        path.append(x.detach().clone())
    return torch.stack(path), opt


@pytest.mark.parametrize("fn, n", [(rosenbrock, 4), (scaled_quartic, 6)])
@pytest.mark.parametrize("line_search, lr", [("strong_wolfe", 1.0), ("strong_wolfe", 0.5), (None, 0.05)])
def test_same_steps_as_torch_lbfgs_bit_for_bit(fn, n, line_search, lr):
    x0 = torch.linspace(-1.2, 0.8, n, dtype=F64)
    # 40 steps with a history of 3: the history wraps many times
    theirs, t_opt = _run(_torch_lbfgs, fn, x0, 40, lr, 3, line_search)
    ours, o_opt = _run(_ours, fn, x0, 40, lr, 3, line_search)
    assert torch.equal(ours, theirs)
    assert float(fn(theirs[-1])) < float(fn(x0))  # the steps go somewhere (a test that can fail)
    assert o_opt.state["func_evals"] == t_opt.state_dict()["state"][0]["func_evals"]


@pytest.mark.parametrize("first, second", [(_torch_lbfgs, _ours), (_ours, _torch_lbfgs)])
def test_state_dict_resumes_in_either(first, second):
    """A checkpoint written by torch.optim.LBFGS (earlier versions) resumes here, and the other way round."""
    x0 = torch.tensor([-1.2, 1.0, 0.5, -0.3], dtype=F64)
    whole, _ = _run(_torch_lbfgs, rosenbrock, x0, 25)
    head, opt = _run(first, rosenbrock, x0, 10)
    state = opt.state_dict()
    assert set(state) == {"state", "param_groups"} and list(state["state"]) == [0]
    tail, _ = _run(second, rosenbrock, head[-1], 15, state=state)
    assert torch.equal(torch.cat([head, tail]), whole)


def test_state_is_cast_to_the_parameters_dtype():
    x0 = torch.tensor([-1.2, 1.0], dtype=F64)
    _, opt = _run(_ours, rosenbrock, x0, 5)
    x32 = x0.float().requires_grad_(True)
    other = OneStepLBFGS(x32)
    other.load_state_dict(opt.state_dict())
    assert other.state["prev_flat_grad"].dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in other.state["old_dirs"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="real vector"):
        OneStepLBFGS(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="line_search_fn"):
        OneStepLBFGS(torch.zeros(2), line_search_fn="armijo")
    with pytest.raises(ValueError, match="one parameter group"):
        OneStepLBFGS(torch.zeros(2)).load_state_dict({"state": {}, "param_groups": []})


def test_a_refinement_loop_does_not_import_torch_dynamo():
    code = ("import sys, torch\n"
            "from refine.solver.loop import minimise, Convergence\n"
            "from refine.solver.strategies import LBFGS\n"
            "f = lambda x: (((x - 1.0) ** 2).sum(), None)\n"
            "res = minimise(f, torch.zeros(3, dtype=torch.float64), LBFGS(), Convergence(max_steps=5))\n"
            "assert res.state.step > 0, res\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def _bowl(centre):
    def f(x):
        w = torch.logspace(-2, 3, x.numel(), dtype=x.dtype)
        return (w * (x - centre) ** 2).sum() + 0.01 * ((x - centre) ** 4).sum()
    return f


def test_warm_memory_saves_steps_and_is_kept_apart():
    """A loop warmed with the memory of an earlier loop over the same parameters on a similar objective (as the
    coarse copies of a stage hand it to the next) reaches the new minimum in fewer steps than a cold one; the
    memory is a copy, None before any pair, trimmed to the history size, and refused for another size."""
    x0 = torch.linspace(-1.2, 0.8, 6, dtype=F64)
    first, opt = _run(_ours, _bowl(0.3), x0, 25, history=8)
    memory = opt.memory()
    assert _ours(x0.clone().requires_grad_(True), 1.0, 8, "strong_wolfe").memory() is None
    assert len(memory["old_dirs"]) == 8 and all(t.shape == (6,) for t in memory["old_stps"])
    kept = [t.clone() for t in memory["old_dirs"]]
    second = _bowl(0.35)  # the next stage's objective: the minimum moved a little
    target = float(second(torch.full((6,), 0.35, dtype=F64)))

    def steps_to_minimum(warm):
        x = first[-1].clone().requires_grad_(True)
        o = OneStepLBFGS(x, history_size=8)
        o.warm(memory if warm else None)
        for n in range(1, 100):
            o.step(_closure(second, x))
            if float(second(x.detach())) <= target + 1e-9:
                return n
        return 100

    warm, cold = steps_to_minimum(True), steps_to_minimum(False)
    assert warm < cold, (warm, cold)
    assert all(torch.equal(a, b) for a, b in zip(memory["old_dirs"], kept))
    small = OneStepLBFGS(torch.zeros(6, dtype=F64), history_size=3)
    small.warm(memory)
    assert len(small.state["old_dirs"]) == 3 and torch.equal(small.state["old_dirs"][-1], memory["old_dirs"][-1])
    with pytest.raises(ValueError, match="another number of parameters"):
        OneStepLBFGS(torch.zeros(4, dtype=F64)).warm(memory)
