"""Exact sums (refine.many.exact_sum) and vectors split over processes (refine.many.sharded): the sums are the
correctly rounded exact sums, whatever the order and split of the terms; the split vector's reductions equal those
of the whole vector; the step rule on a split vector takes the steps it takes on the whole one."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from refine.many.exact_sum import exact_sums
from refine.many.sharded import ShardedLayout, sharded_type
from refine.solver.lbfgs import OneStepLBFGS


def _exact(values) -> float:
    total = sum(Fraction(float(v)) for v in values)
    try:
        return float(total)
    except OverflowError:
        return math.inf if total > 0 else -math.inf


def _terms(rng, n):
    kinds = rng.integers(0, 4, n)
    big = rng.uniform(-1, 1, n) * 10.0 ** rng.integers(-300, 300, n)
    tiny = 5e-324 * rng.integers(-5, 6, n)
    return np.where(kinds == 0, big, np.where(kinds == 1, tiny, np.where(kinds == 2, 0.0, rng.normal(size=n))))


def test_the_sum_is_the_correctly_rounded_exact_sum_in_any_order():
    rng = np.random.default_rng(5)
    for _ in range(200):
        values = _terms(rng, int(rng.integers(1, 60)))
        t = torch.tensor(values, dtype=torch.float64)
        got = float(exact_sums(t))
        assert got == _exact(values)
        assert float(exact_sums(t[torch.randperm(t.numel())])) == got


def test_a_sum_where_the_float_sum_loses_everything():
    t = torch.tensor([1e16, 1.0, -1e16, 1.0], dtype=torch.float64)
    assert float(t.sum()) != 2.0  # the ordered float sum (can fail: a sum that is already exact)
    assert float(exact_sums(t)) == 2.0


def test_columns_and_special_values():
    t = torch.tensor([[1.0, math.inf, math.inf, math.nan, 1e308],
                      [2.0, 1.0, -math.inf, 1.0, 1e308]], dtype=torch.float64)
    got = exact_sums(t).tolist()
    assert got[0] == 3.0 and got[1] == math.inf and math.isnan(got[2]) and math.isnan(got[3]) and got[4] == math.inf
    assert exact_sums(torch.zeros(0, 3, dtype=torch.float64)).tolist() == [0.0, 0.0, 0.0]


def test_split_sums_added_by_a_reduce_equal_the_whole():
    rng = np.random.default_rng(6)
    values = torch.tensor(_terms(rng, 101), dtype=torch.float64).reshape(-1, 1)
    parts = [values[:13], values[13:70], values[70:]]
    limbs = []

    def keep(acc):  # stands in for the all_reduce: the other parts' limbs added exactly
        limbs.append(acc.clone())
    for p in parts:
        exact_sums(p, keep)
    total_limbs = sum(limbs)

    def reduce(acc):
        acc.copy_(total_limbs)
    assert float(exact_sums(parts[0], reduce)[0]) == _exact(values.reshape(-1).tolist())


def _two_process_layout(shared: int, rank: int, other: torch.Tensor):
    """A split vector of this process (rank 0 or 1) whose reductions add the other process's part (``other``)."""
    def reduce_sum(acc):
        acc += exact_limbs(other)

    def reduce_max(t):  # [largest value, NaN flag]: with the other process's (its largest, no NaN)
        t.copy_(torch.maximum(t, torch.tensor([float(other.max()), 0.0], dtype=t.dtype)))

    def reduce_min(t):
        t.copy_(torch.minimum(t, torch.tensor([float(other.min())], dtype=t.dtype)))

    return ShardedLayout(shared, rank == 0, reduce_sum, reduce_max, reduce_min)


def exact_limbs(terms):
    got = []
    exact_sums(terms.reshape(-1, 1), got.append)
    return got[0]


def test_a_split_vector_reduces_over_the_whole_with_the_shared_part_once():
    rng = np.random.default_rng(7)
    whole = torch.tensor(rng.normal(size=11), dtype=torch.float64)  # shared 3, own 4 + 4
    S = 3
    p0, p1 = torch.cat([whole[:S], whole[S:7]]), torch.cat([whole[:S], whole[7:]])
    T = sharded_type(_two_process_layout(S, 0, p1[S:] ** 2))
    v = p0.as_subclass(T)
    assert float(v.dot(v)) == _exact((whole ** 2).tolist())
    T = sharded_type(_two_process_layout(S, 0, p1[S:].abs()))
    assert float(p0.as_subclass(T).abs().sum()) == _exact(whole.abs().tolist())
    T = sharded_type(_two_process_layout(S, 0, p1[S:]))
    assert float(p0.as_subclass(T).max()) == float(whole.max())
    assert type(p0.as_subclass(T) * 2) is T  # elementwise results keep the layout
    with pytest.raises(NotImplementedError, match="split over processes"):
        p0.as_subclass(T).mean()
    with pytest.raises(NotImplementedError, match="not differentiable"):
        p0.as_subclass(T).clone().requires_grad_(True).sum()


def test_lbfgs_on_a_one_process_split_vector_takes_the_whole_vectors_steps():
    rng = np.random.default_rng(8)
    M = torch.tensor(rng.normal(size=(6, 6)), dtype=torch.float64)
    A = M @ M.T + torch.eye(6, dtype=torch.float64)

    def run(x0):
        x = x0.detach().clone().requires_grad_(True)
        opt = OneStepLBFGS(x)

        def closure():
            with torch.enable_grad():
                xx = x.detach().clone().requires_grad_(True)
                p = xx.as_subclass(torch.Tensor)
                (g,) = torch.autograd.grad(0.5 * (p @ (A @ p)), xx)
            x.grad = g.as_subclass(type(x))
            return (0.5 * (p @ (A @ p))).detach()
        for _ in range(20):
            opt.step(closure)
        return x.detach().as_subclass(torch.Tensor)
    T = sharded_type(ShardedLayout(2, True))
    plain = run(torch.ones(6, dtype=torch.float64))
    split = run(torch.ones(6, dtype=torch.float64).as_subclass(T))
    assert torch.allclose(plain, split, rtol=1e-9, atol=1e-12)
    assert float(plain.abs().max()) < 1e-6
