"""Structure factors as refinable parameters (refine.fitting.structure_factors): the table, symmetry, gradients,
the EM start, the restraint, the staged run and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args, eager
from nbtorch.errors import InputError
from nbtorch.parameters import ORIENTATION_DELTAS, PARAMETER_NAMES
from refine import refine
from refine.fitting.objective import ImageObjective, make_view
from refine.fitting.parameters import ParameterMap
from refine.solver.plan import make_plan, observed_pixels, starting_values
from refine.inputs.problems import make_problem
from refine.solver.stages import Stage
from refine.fitting.structure_factors import (
    AmplitudeOptions, AmplitudeRestraint, amplitude_hkl, amplitude_name, amplitude_table, estimate_amplitudes,
    is_amplitude,
)

pytest.importorskip("gemmi")


@pytest.fixture(scope="module")
def ortho():
    """A bank still at its true geometry, its F table (Friedel-symmetric: space group P1) and the table of
    its visible amplitudes, started from the file."""
    with eager():
        p = make_problem("orthorhombic_xds", size=48, seed=3)
        sim = p.simulator()
        obs, valid = observed_pixels(sim, p.observed, None)
        values = starting_values(sim, obs, valid, p.truth)
        table, tsim = amplitude_table(sim, values, valid, "P1", start="file")
    return p, sim, obs, valid, values, table, tsim


def _truth(sim, name: str) -> float:
    s = sim.setup
    h = np.array(amplitude_hkl(name))
    return float(s.F_grid[tuple((h - s.hkl_min).astype(int))])


def _overrides(values) -> dict:
    return {n: values[n] for n in PARAMETER_NAMES + ORIENTATION_DELTAS}


def test_names_round_trip():
    assert amplitude_name((2, -1, 13)) == "F_2_-1_13"
    assert amplitude_hkl("F_2_-1_13") == (2, -1, 13)
    assert is_amplitude("F_0_0_4") and not is_amplitude("default_F") and not is_amplitude("F_1_2")
    with pytest.raises(InputError, match="not a structure-factor name"):
        amplitude_hkl("cell_a")


def test_file_start_reproduces_the_model_and_visible_reflections_are_free(ortho):
    p, sim, obs, valid, values, table, tsim = ortho
    with eager():
        before, _ = sim.render(**_overrides(values))
        after, _ = tsim.render(**_overrides(values))
        edited, _ = tsim.render(F_grid=table.grid(table.starts, torch.float64, "cpu"), **_overrides(values))
    assert torch.equal(before, after) and torch.equal(before, edited)
    assert len(table.names) > 50
    assert np.all(table.photons >= 0.1)  # candidates: 1 % of min_photons at the start
    for n in table.names[:20]:
        assert table.starts[n] == pytest.approx(_truth(sim, n))


def test_equivalents_and_friedel_mates_share_one_amplitude():
    """P4: (h k l), (-k h l), (-h -k l), (k -h l) and their Friedel mates follow one parameter; a change of it
    changes exactly those entries."""
    with eager():
        p = make_problem("tetragonal_mosflm", size=48, seed=2)
        sim = p.simulator()
        obs, valid = observed_pixels(sim, p.observed, None)
        values = starting_values(sim, obs, valid, p.truth)
        table, _ = amplitude_table(sim, values, valid, "P4", start="one")
    assert table.space_group == "P 4"
    name = next(n for n in table.names if all(x != 0 for x in amplitude_hkl(n)))
    h, k, l = amplitude_hkl(name)  # noqa: E741
    expected = {(h, k, l), (-k, h, l), (-h, -k, l), (k, -h, l)}
    expected |= {(-a, -b, -c) for a, b, c in expected}
    i = table.names.index(name)
    members = {tuple(int(x) for x in e + table.hkl_min) for e in np.argwhere(table.index == i)}
    inside = {e for e in expected if np.all(np.array(e) >= table.hkl_min) and np.all(np.array(e) <= table.hkl_max)}
    assert members == inside and len(members) >= 4
    bumped = dict(table.starts)
    bumped[name] = 2.0 * table.starts[name]
    a = table.grid(table.starts, torch.float64, "cpu")
    b = table.grid(bumped, torch.float64, "cpu")
    changed = {tuple(int(x) for x in e + table.hkl_min) for e in torch.nonzero(a != b).numpy()}
    assert changed == members


def test_loss_gradient_wrt_amplitudes_matches_finite_differences(ortho):
    """d loss / d raw amplitude (sparse pixel path, through the refine transforms) = central difference."""
    p, sim, obs, valid, values, table, tsim = ortho
    plan = make_plan(sim, p.observed, start=p.truth, free=("structure_factors",),
                     stages=(Stage("amps", ("structure_factors",)),),
                     structure_factors=AmplitudeOptions("P1", start="file"))
    names = plan.stages[0][1]
    assert all(is_amplitude(n) for n in names)
    objective = ImageObjective(plan.sim, plan.observed, make_view(plan.sim, plan.start, plan.valid), plan.loss_fn,
                               amplitudes=plan.amplitudes)
    assert objective.sparse
    pmap = ParameterMap(plan.space, plan.start, names)
    order = np.argsort(-plan.amplitudes.photons)
    probe = [int(order[0]), int(order[len(order) // 2]), int(order[-1])]
    with eager():
        raw = (0.05 * torch.arange(len(names), dtype=torch.float64) % 0.3).requires_grad_(True)

        def loss(r):
            return objective.evaluate(pmap.expand(pmap.physical(r)))[0]

        (g,) = torch.autograd.grad(loss(raw), raw)
        for i in probe:
            h = 1e-4
            e = torch.zeros_like(raw)
            e[i] = h
            with torch.no_grad():
                fd = (loss(raw + e) - loss(raw - e)) / (2 * h)
            assert abs(float(g[i])) > 1e-3
            assert float(g[i]) == pytest.approx(float(fd), rel=1e-5, abs=1e-6)


def test_em_estimate_recovers_the_amplitudes_at_the_true_geometry(ortho):
    p, sim, obs, valid, values, table, tsim = ortho
    start = {**values, **{n: 100.0 for n in table.names}}
    objective = ImageObjective(tsim, obs, make_view(tsim, start, valid), amplitudes=table)
    with eager():
        est = estimate_amplitudes(objective, table, start, iterations=8)
    strong = [n for n, ph in zip(table.names, table.photons) if ph > 300]
    ratio = np.array([est[n] / _truth(sim, n) for n in strong])
    assert len(strong) > 20
    assert np.median(np.abs(ratio - 1.0)) < 0.1  # from 100 for all: a Wilson spread far wider than this


def test_restraint_residuals_and_curvature(ortho):
    *_, table, _ = ortho
    r = AmplitudeRestraint(table, 0.5)
    F = torch.tensor([table.starts[n] for n in table.names], dtype=torch.float64)
    res = r.residuals(F)
    bins = r.bins.numpy()
    for b in range(r.n_bins):
        mean = F.numpy()[bins == b].mean()
        np.testing.assert_allclose(res.numpy()[bins == b], (F.numpy()[bins == b] - mean) / (0.5 * mean))
    assert float(r.residuals(torch.full_like(F, 7.0)).abs().max()) == 0.0  # every bin at its mean: no penalty
    C = r.curvature(F)
    assert C.shape == (len(F), len(F)) and torch.allclose(C, C.T)
    assert float(torch.linalg.eigvalsh(C).min()) > -1e-9
    with pytest.raises(InputError, match="sigma must be > 0"):
        AmplitudeRestraint(table, 0.0)


def test_refined_amplitudes_and_their_esds(ortho):
    """From one value for all, at the true geometry: the amplitudes come back within their esds (the
    spread of (refined - truth) / esd near 1), and a tight restraint shrinks their spread about the bin means."""
    p, sim, *_ = ortho
    stages = (Stage("amps", ("background", "structure_factors")),)
    with eager():
        free = refine(p, start=p.truth, stages=stages, free=("background", "structure_factors"), progress=False,
                      structure_factors=AmplitudeOptions("P1", start="estimate", min_photons=30.0))
        tight = refine(p, start=p.truth, stages=stages, free=("background", "structure_factors"), progress=False,
                       structure_factors=AmplitudeOptions("P1", start="estimate", min_photons=30.0,
                                                          restraint_sigma=0.01))
    names = [n for n in free.free if is_amplitude(n)]
    assert len(names) > 30 and free.amplitudes is not None
    pulls = np.array([(free.refined[n] - _truth(sim, n)) / free.esd_kinds["fisher"][n] for n in names])
    assert 0.6 < pulls.std() < 1.6, pulls.std()
    assert abs(pulls.mean()) < 0.5
    within = AmplitudeRestraint(free.amplitudes, 1.0)  # relative deviations from the resolution bins' means
    every = free.amplitudes.names  # the held candidates count in their bins' means
    refined = [every.index(n) for n in names if n in tight.free]

    def spread(result) -> float:
        return float(within.residuals(torch.tensor([result.amplitude_values[n] for n in every]))[refined].std())

    spread_free, spread_tight = spread(free), spread(tight)
    assert spread_tight < 0.7 * spread_free, (spread_tight, spread_free)
    fisher_t, fisher_f = tight.esd_kinds["fisher"], free.esd_kinds["fisher"]  # the restraint adds information
    assert np.median([fisher_t[n] / fisher_f[n] for n in names]) < 0.8
    doc = free.to_json_dict()["structure_factors"]
    assert doc["space_group"] == "P 1" and doc["n_free"] == len(names)
    assert doc["columns"] == ["h", "k", "l", "d_A", "F", "esd", "refined"]
    assert doc["n_free"] + doc["n_held"] == len(doc["reflections"]) == len(free.amplitudes.names)


def test_amplitudes_stage_comes_last_and_holds_the_scale(ortho):
    p, *_ = ortho
    plan = make_plan(p, structure_factors=AmplitudeOptions("P1", start="file"))
    (last, names), (_, names_before) = plan.stages[-1], plan.stages[-2]
    assert last.name == "amplitudes"
    assert "scale" in names_before and "scale" not in names
    assert set(names) - set(names_before) == set(plan.amplitudes.names)  # the candidates
    assert plan.fingerprint["structure_factors"]["space_group"] == "P1"


def test_errors():
    p = make_problem("orthorhombic_xds", size=48, seed=3)
    with pytest.raises(InputError, match="needs a space group"):
        make_plan(p, stages=(Stage("a", ("structure_factors",)),))
    with pytest.raises(InputError, match="unknown space group"):
        make_plan(p, structure_factors=AmplitudeOptions("P 99 z"))
    with pytest.raises(InputError, match="restraint sigma must be > 0"):
        AmplitudeOptions("P1", restraint_sigma=-1.0)
    with pytest.raises(InputError, match="start must be one of"):
        AmplitudeOptions("P1", start="guess")
    with pytest.raises(InputError, match="not a refinable amplitude"):
        make_plan(p, free=("F_1_2_3",), structure_factors=AmplitudeOptions("P1"))
    sim = Simulator(config_from_args("-cell 50 50 50 90 90 90 -default_F 100 -detpixels 32 -N 5".split()))
    values = starting_values(sim, torch.ones(sim.shape, dtype=torch.float64), torch.ones(sim.shape, dtype=bool), None)
    with pytest.raises(InputError, match="needs an -hkl table"):
        amplitude_table(sim, values, np.ones(sim.shape, dtype=bool), "P1", start="file")


@pytest.mark.slow
def test_amplitude_gradients_through_the_compiled_kernel(ortho):
    """The loss gradient with respect to the amplitudes from the compiled kernel equals eager autograd (slow:
    Inductor compiles the F-table-with-gradient graph)."""
    p, sim, obs, valid, values, table, tsim = ortho
    from nbtorch import Simulator

    grads = {}
    for mode in ("eager", "compiled"):
        base = Simulator(sim.config, compile=(mode == "compiled"))
        plan = make_plan(base, p.observed, start=p.truth, free=("structure_factors",),
                         stages=(Stage("amps", ("structure_factors",)),),
                         structure_factors=AmplitudeOptions("P1", start="file"))
        if mode == "compiled" and plan.sim.compile_mode != "compiled":
            pytest.skip(f"no compiled kernel here: {plan.sim.compile_reason}")
        names = plan.stages[0][1]
        objective = ImageObjective(plan.sim, plan.observed, make_view(plan.sim, plan.start, plan.valid),
                                   plan.loss_fn, amplitudes=plan.amplitudes)
        pmap = ParameterMap(plan.space, plan.start, names)
        raw = (0.05 * torch.arange(len(names), dtype=torch.float64) % 0.3).requires_grad_(True)
        loss = objective.evaluate(pmap.expand(pmap.physical(raw)))[0]
        grads[mode] = torch.autograd.grad(loss, raw)[0]
    assert float(grads["eager"].abs().max()) > 1e-3
    torch.testing.assert_close(grads["compiled"], grads["eager"], rtol=1e-7, atol=1e-9)


def test_a_run_stopped_in_the_amplitudes_stage_resumes_to_the_same_result(ortho, tmp_path):
    """Checkpoints hold the amplitudes; a resume inside the amplitudes stage recomputes the same held set and
    ends where an uninterrupted run ends."""
    from refine.solver.loop import Convergence

    p, *_ = ortho
    opts = AmplitudeOptions("P1", start="estimate", min_photons=30.0)
    free = ("background", "cell", "structure_factors")

    def stages(steps: int) -> tuple:
        return (Stage("geo", ("background", "cell"), convergence=Convergence(max_steps=3)),
                Stage("amps", ("background", "structure_factors"), convergence=Convergence(max_steps=steps)))

    with eager():
        full = refine(p, start=p.truth, stages=stages(6), free=free, progress=False, structure_factors=opts)
        refine(p, start=p.truth, stages=stages(4), free=free, progress=False, structure_factors=opts,
               checkpoint=tmp_path / "ck.h5", checkpoint_every=2)
        resumed = refine(p, start=p.truth, stages=stages(6), free=free, progress=False, structure_factors=opts,
                         checkpoint=tmp_path / "ck.h5", checkpoint_every=2, resume=tmp_path / "ck.h5")
    names = [n for n in full.free if is_amplitude(n)]
    assert names and resumed.free == full.free
    assert resumed.loss_final == pytest.approx(full.loss_final, rel=1e-12)
    assert max(abs(full.refined[n] - resumed.refined[n]) for n in names) < 1e-9
