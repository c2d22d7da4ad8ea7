"""Many shared amplitudes by their diagonal (refine.fitting.amplitude_information, refine.many.sparse_amplitudes):
the eight-pass information against the column-by-column Fisher matrix, the restraint's diagonal, the chunked exact
sums, the joint run's optimum and esds against the dense treatment, one process against two, and the refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nbtorch.errors import InputError
from refine.fitting.amplitude_information import amplitude_information, entry_classes
from refine.fitting.objective import ImageObjective, make_view
from refine.fitting.parameters import ParameterMap
from refine.fitting.structure_factors import AmplitudeOptions, AmplitudeRestraint
from refine.inputs.problems import make_problem
from refine.many.exact_sum import ExactSum, exact_sums
from refine.many.sparse_amplitudes import DENSE_AMPLITUDES, use_diagonal
from refine.quality.uncertainty import image_information
from refine.solver.plan import make_plan
from refine.solver.precondition import physical_per_raw
from refine.solver.stages import Stage

pytest.importorskip("gemmi")

def _plan(interpolate: bool):
    p = make_problem("orthorhombic_xds", size=48, seed=3)
    if not interpolate:
        p = dataclasses.replace(p, args=tuple(p.args) + ("-nointerpolate",))
    plan = make_plan(p.simulator(), p.observed, start=p.truth, free=("structure_factors",),
                     stages=(Stage("amps", ("structure_factors",)),),
                     structure_factors=AmplitudeOptions("P1", start="file"))
    objective = ImageObjective(plan.sim, plan.observed, make_view(plan.sim, plan.start, plan.valid), plan.loss_fn,
                               amplitudes=plan.amplitudes)
    pmap = ParameterMap(plan.space, plan.start, plan.stages[0][1])
    return plan, objective, pmap


def test_eight_passes_give_the_fisher_diagonal_of_every_amplitude():
    torch.set_num_threads(1)
    plan, objective, pmap = _plan(interpolate=False)
    raw = pmap.raw0()
    values = pmap.values_at(raw)
    fast = amplitude_information(objective, plan.amplitudes, values)
    _, F, _ = image_information(objective, pmap, raw)
    dense = torch.diagonal(F).to(torch.float64)
    assert len(plan.amplitudes.names) > 50 and float(dense.max()) > 0
    assert torch.allclose(fast, dense, rtol=1e-9, atol=1e-12 * float(dense.max()))
    # the parity classes: neighbours differ, entries two apart share one
    cls = entry_classes((3, 3, 3), (-1, 0, 1))
    assert cls[0, 0, 0] != cls[1, 0, 0] and cls[0, 0, 0] == cls[2, 0, 0] and len(np.unique(cls)) == 8


def test_an_interpolating_model_keeps_the_dense_blocks():
    with pytest.raises(InputError, match="interpolation"):
        use_diagonal("diagonal", 500, interpolate=True)
    assert not use_diagonal("auto", 10 * DENSE_AMPLITUDES, interpolate=True)
    assert use_diagonal("auto", DENSE_AMPLITUDES + 1, interpolate=False)
    assert not use_diagonal("auto", DENSE_AMPLITUDES, interpolate=False)
    assert not use_diagonal("dense", 10 * DENSE_AMPLITUDES, interpolate=False)
    with pytest.raises(InputError, match="information must be one of"):
        AmplitudeOptions("P1", information="sparse")


def test_restraint_diagonal_in_closed_form():
    class Table:
        names = [f"F_{i}_0_0" for i in range(60)]
        d_A = np.random.default_rng(0).uniform(1.0, 5.0, 60)

        def pairs(self):
            return [(0, 1), (2, 3), (5, 9)]

    restraint = AmplitudeRestraint(Table(), 0.5, per_bin=10, anomalous_sigma=0.2)
    F = torch.tensor(np.random.default_rng(1).uniform(20.0, 200.0, 60))
    full = torch.diagonal(restraint.curvature(F))
    assert float(full.min()) > 0
    assert torch.allclose(restraint.curvature_diagonal(F), full, rtol=1e-12, atol=0)


def test_chunked_exact_sums_are_the_same_bits():
    rng = np.random.default_rng(2)
    terms = torch.tensor(rng.normal(size=(97, 13)) * 10.0 ** rng.integers(-8, 8, size=(97, 13)))
    acc = ExactSum(13)
    for c in range(0, 97, 10):
        acc.add(terms[c:c + 10])
    assert torch.equal(acc.total(), exact_sums(terms))


def test_physical_per_raw_is_the_jacobians_diagonal():
    plan, _, pmap = _plan(interpolate=False)
    raw = pmap.raw0() + 0.01 * torch.arange(len(pmap.names), dtype=torch.float64)
    jac = torch.func.jacfwd(lambda r: torch.stack(list(pmap.physical(r).values())))(raw)
    assert torch.allclose(physical_per_raw(pmap, raw), jac.diagonal(), rtol=1e-12, atol=0)
    assert torch.count_nonzero(jac - torch.diag(jac.diagonal())) == 0


@pytest.fixture(scope="module")
def serial_runs():
    """Six 56 x 56 synthetic stills at their true geometry: the amplitudes (estimate start), the cell, each still's
    scale and background, with the dense and the diagonal treatment, to convergence."""
    from experiments.serial_amplitudes import SPACE_GROUP, SYMMETRY, make_amplitude_set
    from refine.many.joint import DEFAULT_CONVERGENCE, refine_joint

    torch.set_num_threads(1)
    ds = make_amplitude_set(6, np.random.default_rng(3), size=56, truth_domains=6)
    out = {}
    for mode in ("dense", "diagonal"):
        out[mode] = refine_joint(
            ds.serial.simulators(), ds.serial.observed(), shared=("cell",), per_image=("scale", "background"),
            symmetry=SYMMETRY, start=dict(ds.serial.shared_truth), image_starts=[dict(im.truth) for im in ds.serial.images],
            geometry_first=False, structure_factors=AmplitudeOptions(SPACE_GROUP, start="estimate", information=mode),
            convergence=DEFAULT_CONVERGENCE.replace(max_steps=400, ftol=1e-9, xtol=1e-7))
    return out


def _amplitudes(result) -> dict:
    return {(h, k, l): F for h, k, l, _, F, _, free in result.structure_factors["reflections"] if free}


def test_the_diagonal_treatment_finds_the_dense_optimum(serial_runs):
    dense, diag = serial_runs["dense"], serial_runs["diagonal"]
    a, b = _amplitudes(dense), _amplitudes(diag)
    assert set(a) == set(b) and len(a) > 30
    rel = np.array([b[k] / a[k] - 1.0 for k in a])
    assert abs(diag.loss_final / dense.loss_final - 1.0) < 1e-7
    assert np.median(np.abs(rel)) < 1e-4
    assert abs(diag.shared["cell_a"] - dense.shared["cell_a"]) < 0.02 * dense.esds["cell_a"]


def test_diagonal_esds_against_the_dense_inverse(serial_runs):
    """Each amplitude's Fisher esd from its diagonal is conditional on every other name: at most the dense
    (marginal) one, and within 30 % of it for most; the cell's esd (amplitudes held: 0.88 of the dense one here)
    within 20 %."""
    dense, diag = serial_runs["dense"], serial_runs["diagonal"]
    ea, eb = dense.esds_by_kind["fisher"]["shared"], diag.esds_by_kind["fisher"]["shared"]
    names = [n for n in ea if n.startswith("F_")]
    ratio = np.array([eb[n] / ea[n] for n in names])
    assert len(names) > 30 and np.all(ratio < 1.0 + 1e-6)
    assert np.median(ratio) > 0.9 and np.percentile(ratio, 10) > 0.5
    assert 0.8 < eb["cell_a"] / ea["cell_a"] <= 1.0 + 1e-6
    sandwich = diag.esds_by_kind["sandwich"]["shared"]
    assert all(sandwich[n] >= eb[n] * (1 - 1e-12) for n in names)  # never below the Fisher esd


def test_one_and_two_processes_give_the_same_bits_with_the_diagonal(joint_stills_docs):
    one, two = joint_stills_docs("--stills", "2", "--size", "32", "--seed", "1", "--space-group", "P1",
                                 "--information", "diagonal", "--max-steps", "5")
    assert one["world_size"] == 1 and two["world_size"] == 2 and one["structure_factors"]["n_free"] > 10
    assert one["structure_factors"]["information"] == "diagonal"
    for key in ("structure_factors", "shared", "images", "esds_by_kind", "loss_final", "steps", "history"):
        assert one[key] == two[key], key


def test_the_amplitude_block_evaluates_the_same_loss_and_gradient(monkeypatch):
    """Joint.rows reads the amplitudes as one vector (ParameterMap.physical_block): the same bits as one tensor per
    amplitude name."""
    from experiments.serial_amplitudes import SPACE_GROUP, SYMMETRY, make_amplitude_set
    from refine.many.distributed import Comm
    from refine.many.joint_problem import joint_problem

    torch.set_num_threads(1)
    s = make_amplitude_set(3, np.random.default_rng(1), size=48, truth_domains=1, truth_oversample=1).serial
    prob = joint_problem(Comm(), s.simulators(), s.observed(), None, s.shared_start, s.image_starts(),
                         shared=("cell",), per_image=("scale", "background", "orientation"), symmetry=SYMMETRY,
                         background="constant", loss="poisson", structure_factors=AmplitudeOptions(SPACE_GROUP, start="one"),
                         local_images=None, priors=None)
    raw = prob.raw0 + 0.01 * torch.sin(torch.arange(prob.raw0.numel(), dtype=torch.float64))
    assert prob.joint.images[0].pmap._amplitude_block() is not None and prob.joint.S > 20
    block_loss, block_grad, _ = prob.joint.loss_and_grad(raw)
    monkeypatch.setattr(ParameterMap, "physical_block", ParameterMap.physical)
    loss, grad, _ = prob.joint.loss_and_grad(raw)
    assert float(block_loss) == float(loss) and torch.equal(block_grad.as_subclass(torch.Tensor),
                                                            grad.as_subclass(torch.Tensor))
    assert float(grad.as_subclass(torch.Tensor)[1:prob.joint.S].abs().max()) > 0


def test_a_diagonal_run_resumes_to_the_same_result(tmp_path):
    """Stopped after its checkpoint at step 4 and resumed (the preconditioner's amplitude tail read back): the
    uninterrupted run's values, bit for bit."""
    from experiments.serial_amplitudes import SPACE_GROUP, SYMMETRY, make_amplitude_set
    from refine.many.joint import DEFAULT_CONVERGENCE, refine_joint

    torch.set_num_threads(1)
    s = make_amplitude_set(3, np.random.default_rng(1), size=48, truth_domains=1, truth_oversample=1).serial
    kw = dict(shared=("cell",), per_image=("scale", "background", "orientation"), symmetry=SYMMETRY,
              start=s.shared_start, image_starts=s.image_starts(), esds=False, geometry_first=False,
              structure_factors=AmplitudeOptions(SPACE_GROUP, start="one", information="diagonal"),
              convergence=DEFAULT_CONVERGENCE.replace(max_steps=8))
    full = refine_joint(s.simulators(), s.observed(), **kw)

    class Stop(Exception):
        pass

    def stop(step, path):
        if step >= 4:
            raise Stop()

    with pytest.raises(Stop):
        refine_joint(s.simulators(), s.observed(), checkpoint=tmp_path / "c.h5", checkpoint_every=2, on_checkpoint=stop,
                     **kw)
    resumed = refine_joint(s.simulators(), s.observed(), resume=tmp_path / "c.h5", **kw)
    assert full.steps == 8 and resumed.structure_factors["information"] == "diagonal"
    assert resumed.loss_final == full.loss_final and resumed.shared == full.shared
    assert resumed.structure_factors == full.structure_factors
