"""Anomalous pairs (refine.fitting.structure_factors, ``anomalous=True``): F(+) and F(-) as two amplitudes, each
tying its own equivalents; their restraint; the gradients of the loss through the table and of the restraint
against central differences; the refusals (centrosymmetric group, no pair in the data)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch import eager
from nbtorch.errors import InputError
from refine.fitting.objective import ImageObjective, make_view
from refine.fitting.parameters import ParameterMap
from refine.fitting.structure_factors import (AmplitudeOptions, AmplitudeRestraint, amplitude_hkl, amplitude_table,
                                              table_from_photons)
from refine.many.amplitudes import observing_images
from refine.inputs.problems import make_problem
from refine.solver.plan import make_plan, observed_pixels, starting_values
from refine.solver.stages import Stage

pytest.importorskip("gemmi")

OPTIONS = AmplitudeOptions("P4", start="one", anomalous=True, anomalous_sigma=0.2)


@pytest.fixture(scope="module")
def tetra():
    """A 48 x 48 tetragonal still and its anomalous P4 table (every candidate started at -default_F)."""
    torch.set_num_threads(1)
    with eager():
        p = make_problem("tetragonal_mosflm", size=48, seed=2)
        sim = p.simulator()
        obs, valid = observed_pixels(sim, p.observed, None)
        values = starting_values(sim, obs, valid, p.truth)
        table, tsim = amplitude_table(sim, values, valid, "P4", start="one", anomalous=True)
    return p, table, tsim, values


def _members(table, i: int) -> set:
    return {tuple(int(x) for x in e + table.hkl_min) for e in np.argwhere(table.index == i)}


def test_friedel_mates_are_two_amplitudes_each_with_its_equivalents(tetra):
    _, table, _, _ = tetra
    pairs = table.pairs()
    assert table.anomalous and len(pairs) >= 3
    i, j = next((i, j) for i, j in pairs if len(_members(table, i)) >= 2 and len(_members(table, j)) >= 2)
    h, k, l = amplitude_hkl(table.names[i])  # noqa: E741
    assert amplitude_hkl(table.names[j]) == (-h, -k, -l) and table.signs[i] == 1 and table.signs[j] == -1
    plus = {(h, k, l), (-k, h, l), (-h, -k, l), (k, -h, l)}  # P4's rotations: h R
    assert _members(table, i) <= plus and _members(table, j) <= {(-a, -b, -c) for a, b, c in plus}
    bumped = dict(table.starts)
    bumped[table.names[i]] = 2.0 * table.starts[table.names[i]]
    a = table.grid(table.starts, torch.float64, "cpu")
    b = table.grid(bumped, torch.float64, "cpu")
    changed = {tuple(int(x) for x in e + table.hkl_min) for e in torch.nonzero(a != b).numpy()}
    assert changed == _members(table, i)  # F(-) and its equivalents untouched
    # a centric reflection (l = 0 in P4: -h is h turned by 180 degrees) keeps one amplitude with its mate
    centric = [n for n, s in zip(table.names, table.signs) if s == 0]
    assert centric and all(amplitude_hkl(n)[2] == 0 for n in centric)
    # the -hkl file lists F(+) and F(-) apart
    written = table.hkl_table({table.names[i]: 150.0, table.names[j]: 50.0})
    got = {(int(a), int(b), int(c)): F for a, b, c, F in zip(written.h, written.k, written.l, written.F)}
    assert got[(h, k, l)] == 150.0 and got[(-h, -k, -l)] == 50.0


def test_loss_gradient_through_the_anomalous_table_matches_finite_differences(tetra):
    p, table, _, _ = tetra
    plan = make_plan(p.simulator(), p.observed, start=p.truth, free=("structure_factors",),
                     stages=(Stage("amps", ("structure_factors",)),), structure_factors=OPTIONS)
    names = plan.stages[0][1]
    assert plan.restraint is not None and plan.restraint.anomalous_sigma == 0.2
    objective = ImageObjective(plan.sim, plan.observed, make_view(plan.sim, plan.start, plan.valid), plan.loss_fn,
                               amplitudes=plan.amplitudes, restraint=plan.restraint)
    pmap = ParameterMap(plan.space, plan.start, names)
    i, j = next((a, b) for a, b in plan.amplitudes.pairs()
                if plan.amplitudes.names[a] in names and plan.amplitudes.names[b] in names)
    probe = [names.index(plan.amplitudes.names[i]), names.index(plan.amplitudes.names[j])]
    with eager():
        raw = (0.05 * torch.arange(len(names), dtype=torch.float64) % 0.3).requires_grad_(True)

        def loss(r):
            return objective.evaluate(pmap.expand(pmap.physical(r)))[0]

        (g,) = torch.autograd.grad(loss(raw), raw)
        for q in probe:
            e = torch.zeros_like(raw)
            e[q] = 1e-4
            with torch.no_grad():
                fd = (loss(raw + e) - loss(raw - e)) / 2e-4
            assert abs(float(g[q])) > 1e-3
            assert float(g[q]) == pytest.approx(float(fd), rel=1e-5, abs=1e-6)


def test_pair_restraint_value_and_gradient(tetra):
    _, table, _, _ = tetra
    r = AmplitudeRestraint(table, None, anomalous_sigma=0.25)
    rng = np.random.default_rng(0)
    F = torch.tensor(rng.uniform(50, 150, len(table.names)), dtype=torch.float64)
    pairs = table.pairs()
    expected = sum(0.5 * (float((F[i] - F[j]) / (0.25 * 0.5 * (F[i] + F[j])))) ** 2 for i, j in pairs)
    values = {n: F[k] for k, n in enumerate(table.names)}
    assert float(r(values, torch.float64, "cpu")) == pytest.approx(expected, rel=1e-12)
    x = F.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(0.5 * (r.residuals(x) ** 2).sum(), x)
    for q in (pairs[0][0], pairs[0][1], pairs[-1][1]):
        e = torch.zeros_like(F)
        e[q] = 1e-3
        fd = (0.5 * (r.residuals(F + e) ** 2).sum() - 0.5 * (r.residuals(F - e) ** 2).sum()) / 2e-3
        assert float(g[q]) == pytest.approx(float(fd), rel=1e-6) and abs(float(g[q])) > 0
    equal = torch.full_like(F, 80.0)
    assert float(r.residuals(equal).abs().max()) == 0.0  # equal mates: no penalty
    both = AmplitudeRestraint(table, 0.5, anomalous_sigma=0.25)  # the bin term first, then the pairs
    assert both.residuals(F).shape == (len(F) + len(pairs),)


def test_refusals():
    with pytest.raises(InputError, match="centrosymmetric space group P-1"):
        AmplitudeOptions("P-1", anomalous=True)
    with pytest.raises(InputError, match="needs anomalous pairs"):
        AmplitudeOptions("P4", anomalous_sigma=0.3)
    lo = np.array([-3, -3, -3])
    photons = np.zeros((7, 7, 7))
    photons[tuple(np.array([1, 2, 3]) - lo)] = 50.0  # only (1 2 3): its mate (-1 -2 -3) never lit
    photons[tuple(np.array([2, 1, 1]) - lo)] = 50.0
    values = {"default_F": 100.0, "cell_a": 30.0, "cell_b": 30.0, "cell_c": 40.0, "cell_alpha": 90.0,
              "cell_beta": 90.0, "cell_gamma": 90.0}
    with pytest.raises(InputError, match="pairs asked without anomalous data to tell them apart"):
        table_from_photons("P1", np.full((7, 7, 7), 100.0), lo, photons, values, start="one", min_photons=10.0,
                           anomalous=True)
    photons[tuple(np.array([-1, -2, -3]) - lo)] = 50.0
    table, _ = table_from_photons("P1", np.full((7, 7, 7), 100.0), lo, photons, values, start="one",
                                  min_photons=10.0, anomalous=True)
    assert sorted(table.names) == ["F_-1_-2_-3", "F_1_2_3", "F_2_1_1"] and len(table.pairs()) == 1


def test_observing_images_of_each_mate_and_of_the_pair(tetra):
    """NOBS: the images where an amplitude puts 1 % of min_photons on the fitted pixels; of a pair, where either does."""
    _, table, _, _ = tetra
    i, j = table.pairs()[0]
    photons = np.zeros((3, len(table.names)))
    photons[0, i] = 5.0  # image 0 sees F(+)
    photons[1, j] = 0.2  # image 1 sees F(-) (1 % of 10 photons: 0.1)
    photons[2, i], photons[2, j] = 0.05, 3.0  # image 2: F(+) below the threshold
    nobs, pair = observing_images(table, photons, 10.0)
    assert (nobs[i], nobs[j]) == (1, 2) and (pair[i], pair[j]) == (3, 3)
    assert nobs.sum() == 3 and pair.sum() == 6
