"""Structure factors shared by the stills of a joint refinement (refine.many.amplitudes): four 32 x 32 stills of
one crystal (refine.inputs.problems.make_stills, whose F table is random: space group P1) at their true geometry, the
amplitudes started by the EM estimate from the spots of all four, image 0's scale held (the overall level),
the other scales started 2x off; compared with the truth table and with each still refined alone.  One process
against two is in test_joint.py's pattern (torchrun, gloo on loopback)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nbtorch.errors import InputError
from nbtorch.io.hkl import read_fdump, read_hkl, write_hkl
from refine import refine
from refine.many.joint import DEFAULT_CONVERGENCE, load_joint_h5, refine_joint, save_joint_h5, save_joint_json
from refine.inputs.problems import make_stills
from refine.solver.stages import Stage
from refine.fitting.structure_factors import AmplitudeOptions, amplitude_hkl, is_amplitude

pytest.importorskip("gemmi")

N, SIZE, SEED = 4, 32, 1
#: the stills' true geometry (only the scales, backgrounds, cell and amplitudes are refined here)
KNOWN = ("misset_x", "misset_y", "misset_z", "cell_a", "cell_b", "cell_c", "beam_x", "beam_y", "mosaic_spread",
         "N_a", "N_b", "N_c", "distance")
OPTIONS = AmplitudeOptions("P1", start="estimate", min_photons=30.0)


def _starts(stills) -> list[dict]:
    return [{**{k: p.truth[k] for k in KNOWN}, "scale": 1.0 if i == 0 else 2.0} for i, p in enumerate(stills)]


def _joint(stills, **kw):
    kw.setdefault("structure_factors", OPTIONS)
    kw.setdefault("geometry_first", False)  # the stills start at their true geometry (the two stages: below)
    return refine_joint([p.simulator() for p in stills], [p.observed for p in stills], shared=("cell",),
                        per_image=("scale", "background"), symmetry="orthorhombic", image_starts=_starts(stills), **kw)


@pytest.fixture(scope="module")
def stills(tmp_path_factory):
    torch.set_num_threads(1)
    return make_stills("orthorhombic_xds", N, SIZE, seed=SEED, directory=tmp_path_factory.mktemp("sf_problems"))


@pytest.fixture(scope="module")
def truth(stills):
    args = list(stills[0].args)
    F, lo = read_fdump(args[args.index("-dump") + 1])
    return lambda name: float(F[tuple(np.array(amplitude_hkl(name)) - np.array(lo))])


@pytest.fixture(scope="module")
def joint(stills):
    torch.set_num_threads(1)
    return _joint(stills)


@pytest.fixture(scope="module")
def singles(stills):
    """Each still alone: its amplitudes (same options) with its background, at its true geometry and scale."""
    torch.set_num_threads(1)
    return [refine(p.simulator(), p.observed, start={**_starts(stills)[i], "scale": 1.0},
                   stages=(Stage("amps", ("background", "structure_factors")),),
                   free=("background", "structure_factors"), progress=False, structure_factors=OPTIONS)
            for i, p in enumerate(stills)]


def _refined(result) -> dict:
    rows = result.structure_factors["reflections"]
    return {f"F_{h}_{k}_{l}": (F, esd) for h, k, l, _, F, esd, free in rows if free}


def test_shared_amplitudes_recover_the_truth_better_than_one_still(stills, joint, singles, truth):
    assert joint.status.ok and joint.structure_factors["space_group"] == "P 1"
    refined = _refined(joint)
    names = list(refined)
    assert [n for n in joint.shared_names if is_amplitude(n)] == names
    # more reflections are seen well enough on four stills than on any one
    alone = [sum(1 for n in r.free if is_amplitude(n)) for r in singles]
    assert len(names) > max(alone), (len(names), alone)
    # the esds describe the errors (Fisher: pull spread near 1), the level is image 0's (its scale is the truth)
    fisher = joint.esds_by_kind["fisher"]["shared"]
    pulls = np.array([(refined[n][0] - truth(n)) / fisher[n] for n in names])
    assert 0.6 < pulls.std() < 1.6 and abs(pulls.mean()) < 0.5, (pulls.std(), pulls.mean())
    # on the reflections each still refines alone, the shared amplitudes are as close to the truth (a reflection
    # is mostly seen well by one still of four: the gain is in how many are refined, not in each)
    for r in singles:
        common = [n for n in r.free if is_amplitude(n) and n in refined]
        err_joint = np.sqrt(np.mean([(refined[n][0] / truth(n) - 1) ** 2 for n in common]))
        err_alone = np.sqrt(np.mean([(r.refined[n] / truth(n) - 1) ** 2 for n in common]))
        assert len(common) > 0.8 * sum(1 for n in r.free if is_amplitude(n))
        assert err_joint < 1.1 * err_alone, (err_joint, err_alone)
    # image 0's scale held (the overall level); the others, started 2x off, come back relative to it
    assert joint.images[0]["scale"] == 1.0 and "scale" not in joint.image_esds[0]
    for params, esds in zip(joint.images[1:], joint.image_esds[1:]):
        assert params["scale"] == pytest.approx(1.0, abs=0.01) and esds["scale"] > 0
    assert joint.loss_final == pytest.approx(sum(joint.image_losses), rel=1e-12)  # no restraint
    assert not any(is_amplitude(n) for n in joint.shared) and set(joint.shared_esds) <= set(joint.shared)


def test_joint_amplitude_files(joint, tmp_path):
    doc = json.loads(save_joint_json(joint, tmp_path / "joint.json").read_text())
    sf = doc["structure_factors"]
    assert sf["columns"] == ["h", "k", "l", "d_A", "F", "esd", "refined"] and sf["start"] == "estimate"
    assert sf["n_free"] + sf["n_held"] == len(sf["reflections"]) == len(sf["photons"])
    assert all(p >= 30.0 for p, row in zip(sf["photons"], sf["reflections"]) if row[6])
    assert doc["shared_correlation"]["names"] == [n for n in doc["shared_names"] if not is_amplitude(n)][:3]
    h5 = load_joint_h5(save_joint_h5(joint, tmp_path / "joint.h5"))["structure_factors"]
    assert h5["space_group"] == "P 1" and h5["hkl"].shape == (len(sf["reflections"]), 3)
    np.testing.assert_array_equal(h5["F"], [row[4] for row in sf["reflections"]])
    assert int(h5["refined"].sum()) == sf["n_free"] and np.isnan(h5["esd"][~h5["refined"]]).all()
    write_hkl(tmp_path / "joint.hkl", joint.hkl_table())
    table = read_hkl(str(tmp_path / "joint.hkl"))  # P1: each amplitude and its Friedel mate
    assert len(table) == 2 * len(sf["reflections"])
    h, k, l, F = sf["reflections"][0][:3] + [sf["reflections"][0][4]]  # noqa: E741
    got = {(int(a), int(b), int(c)): f for a, b, c, f in zip(table.h, table.k, table.l, table.F)}
    assert got[(h, k, l)] == pytest.approx(F) == got[(-h, -k, -l)]
    assert "structure factors: " in joint.summary() and "on the scale of image 0" in joint.summary()


def test_restraint_enters_once(stills, joint):
    """The restraint is one term of the joint loss (not one per image) and adds information to the esds."""
    tight = _joint(stills, structure_factors=AmplitudeOptions("P1", start="estimate", min_photons=30.0,
                                                              restraint_sigma=0.05))
    sf = tight.structure_factors
    assert sf["restraint_final"] > 0
    assert tight.loss_final == pytest.approx(sum(tight.image_losses) + sf["restraint_final"], rel=1e-10)
    names = [n for n in _refined(tight) if n in _refined(joint)]
    ratio = [tight.esds_by_kind["fisher"]["shared"][n] / joint.esds_by_kind["fisher"]["shared"][n] for n in names]
    assert np.median(ratio) < 0.9


def test_joint_structure_factor_errors(stills):
    sims, obs = [p.simulator() for p in stills[:2]], [p.observed for p in stills[:2]]
    cases = [
        (dict(structure_factors=AmplitudeOptions("")), "structure_factors: the amplitudes need a space group"),
        (dict(shared=("cell", "structure_factors")), "refining the amplitudes needs a space group"),
        (dict(structure_factors=OPTIONS, per_image=("scale", "structure_factors")),
         "per_image: structure_factors are shared by every image"),
        (dict(structure_factors=OPTIONS, shared=("cell", "scale"), per_image=("background",)),
         "shared: scale cannot be shared with structure_factors"),
        (dict(structure_factors=AmplitudeOptions("P 99 z")), "unknown space group"),
    ]
    for kw, message in cases:
        with pytest.raises(InputError, match=message) as err:
            refine_joint(sims, obs, symmetry="orthorhombic", **kw)
        assert "\n" not in str(err.value)


def test_checkpoint_fingerprint_names_the_amplitude_options(stills, tmp_path):
    path = tmp_path / "joint.ckpt.h5"
    two = stills[:2]
    _joint(two, convergence=DEFAULT_CONVERGENCE.replace(max_steps=1), checkpoint=path, esds=False)
    with pytest.raises(InputError, match=r"\(differs: (shared names, )?structure_factors\)$"):
        _joint(two, resume=path, structure_factors=AmplitudeOptions("P1", start="estimate", min_photons=20.0))
    with pytest.raises(InputError, match=r"\(differs: shared names, structure_factors\)$"):
        _joint(two, resume=path, structure_factors=None)
    resumed = _joint(two, resume=path, convergence=DEFAULT_CONVERGENCE.replace(max_steps=2), esds=False)
    assert resumed.resumed_from_step == 1 and resumed.structure_factors["n_free"] > 0


def test_geometry_first_judges_the_amplitudes_at_the_refined_geometry(stills, tmp_path):
    """The default: a joint loop without the amplitudes, then the amplitudes and everything from its result (the
    scales start 2x off here, so the visible amplitudes' EM start differs from the one-loop run's); its own
    checkpoint; a resume of the finished run gives the same result; a missing resume file is one line."""
    two = stills[:2]
    conv = DEFAULT_CONVERGENCE.replace(max_steps=8)
    path = tmp_path / "joint.ckpt.h5"
    staged = _joint(two, geometry_first=True, convergence=conv, checkpoint=path, esds=False)
    assert path.exists() and (tmp_path / "joint.ckpt.geometry.h5").exists()
    assert staged.message.startswith("geometry: ") and "with the structure factors: " in staged.message
    geometry = refine_joint([p.simulator() for p in two], [p.observed for p in two], shared=("cell",),
                            per_image=("scale", "background"), symmetry="orthorhombic", image_starts=_starts(two),
                            convergence=conv, esds=False)
    assert staged.steps > geometry.steps and staged.history[geometry.steps]["loss"] == geometry.loss_final
    assert staged.initial_images[1]["scale"] == 2.0  # the run's start, not the second loop's
    # image 0's scale: held at the geometry stage's result (the amplitudes' level)
    assert staged.images[0]["scale"] == geometry.images[0]["scale"] != 1.0
    assert staged.structure_factors["n_free"] > 0 and all(is_amplitude(n) for n in staged.shared_names[3:])
    again = _joint(two, geometry_first=True, convergence=conv, checkpoint=path, resume=path, esds=False)
    assert again.shared == staged.shared and again.images == staged.images
    with pytest.raises(InputError, match=r"^resume: .*nope\.h5 does not exist"):
        _joint(two, geometry_first=True, resume=tmp_path / "nope.h5")


def test_one_and_two_processes_share_the_same_amplitudes(joint_stills_docs):
    """torchrun --nproc-per-node 2: each process holds one of two stills; the table's range, candidates, EM start
    (its sums gathered per image), visibility and the refined amplitudes equal the one-process run's."""
    one, two = joint_stills_docs("--stills", "2", "--size", str(SIZE), "--seed", str(SEED), "--space-group", "P1",
                                 "--max-steps", "6")
    assert one["world_size"] == 1 and two["world_size"] == 2 and one["structure_factors"]["n_free"] > 10
    for key in ("structure_factors", "shared", "shared_esds", "images", "esds_by_kind", "loss_final", "steps",
                "evaluations", "history"):
        assert one[key] == two[key], key  # bit for bit: every sum over images is taken in image order
