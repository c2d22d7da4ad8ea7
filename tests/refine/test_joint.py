"""Joint mode (refine.many.joint): shared cell + per-image orientation, scale, background over many stills.

Four 32 x 32 stills of one orthorhombic crystal (refine.inputs.problems.make_stills) are refined jointly and one
by one; the joint cell is compared with the truth, its esds with the per-image Fisher blocks and with its
error, and one process with two (torchrun, gloo on loopback).  The 16-still check of the issue is the
slow test at the end.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nbtorch.errors import InputError
from refine import refine
from refine.many.joint import (DEFAULT_CONVERGENCE, JointResult, image_shard, load_joint_h5, refine_joint, save_joint_h5,
                          save_joint_json)
from refine.many.checkpoint import read_joint_checkpoint
from refine.fitting.objective import ImageObjective, make_view
from refine.fitting.parameters import ParameterMap, ParameterSpace, SYMMETRIES
from refine.solver.plan import observed_pixels
from refine.inputs.problems import make_stills
from refine.output.results import jsonable
from refine.quality.uncertainty import estimate_uncertainties

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "joint_stills.py"
sys.path.insert(0, str(ROOT / "scripts"))
from joint_stills import cell_error, image_start  # noqa: E402

PROBLEM, N, SIZE, SEED = "orthorhombic_xds", 4, 32, 1
CELL = SYMMETRIES["orthorhombic"]
PER_IMAGE = ("scale", "background", "orientation")


def _joint(stills, **kw):
    return refine_joint([p.simulator() for p in stills], [p.observed for p in stills], symmetry=stills[0].symmetry,
                        start={k: stills[0].start[k] for k in CELL}, image_starts=[image_start(p) for p in stills],
                        **kw)


@pytest.fixture(scope="module")
def stills(tmp_path_factory):
    torch.set_num_threads(1)
    return make_stills(PROBLEM, N, SIZE, seed=SEED, directory=tmp_path_factory.mktemp("joint_problems"))


@pytest.fixture(scope="module")
def joint(stills):
    torch.set_num_threads(1)
    return _joint(stills)


@pytest.fixture(scope="module")
def singles(stills):
    torch.set_num_threads(1)
    return [refine(p.simulator(), p.observed, start=image_start(p), free=PER_IMAGE + ("cell",),
                   symmetry=p.symmetry, progress=False) for p in stills]


def test_joint_cell_beats_single_stills(stills, joint, singles):
    truth = stills[0].truth
    assert joint.status.ok and joint.n_images == N and joint.world_size == 1
    assert joint.loss_final < joint.loss_initial
    assert joint.loss_final == pytest.approx(sum(joint.image_losses), rel=1e-12)
    single_errors = [cell_error(r.params, truth, "orthorhombic") for r in singles]
    joint_error = cell_error(joint.shared, truth, "orthorhombic")
    assert joint_error < np.mean(single_errors), (joint_error, single_errors)
    # each still's own orientation is recovered too (every still is a different crystal orientation)
    for p, params in zip(stills, joint.images):
        assert params["scale"] == pytest.approx(1.0, rel=0.02)
        for k in ("misset_x", "misset_y", "misset_z"):
            assert params[k] == pytest.approx(p.truth[k], abs=0.02)
        assert {k: params[k] for k in CELL} == {k: joint.shared[k] for k in CELL}


def test_joint_esds_combine_the_images_fisher_blocks(stills, joint, singles):
    """The shared Fisher covariance is the inverse of the sum over images of each image's information about
    the shared names with its own names profiled out; the esds are consistent with the error."""
    space = ParameterSpace(symmetry="orthorhombic")
    names = space.expand(("cell",) + PER_IMAGE)
    info = np.zeros((3, 3))
    for p, params in zip(stills, joint.images):
        sim = p.simulator()
        obs, valid = observed_pixels(sim, p.observed, None)
        values = {**params, "orient_x": 0.0, "orient_y": 0.0, "orient_z": 0.0, "background_x": 0.0,
                  "background_y": 0.0}
        objective = ImageObjective(sim, obs, make_view(sim, values, valid))
        pmap = ParameterMap(space, values, names)
        u = estimate_uncertainties(objective, pmap, pmap.raw0(), kind="fisher")
        info += np.linalg.inv(u.covariance[:3, :3])
    combined = np.sqrt(np.diag(np.linalg.inv(info)))
    fisher = joint.esds_by_kind["fisher"]["shared"]
    np.testing.assert_allclose([fisher[k] for k in CELL], combined, rtol=1e-5)
    # no still alone pins a length as well as all of them together
    for k in CELL:
        assert fisher[k] < min(r.esd_kinds["fisher"][k] for r in singles)
    # the error is consistent with the esds (sandwich, the default, and fisher)
    truth = stills[0].truth
    z = [(joint.shared[k] - truth[k]) / joint.shared_esds[k] for k in CELL]
    assert max(abs(v) for v in z) < 4.0, z
    for k in CELL:
        assert joint.shared_esds[k] == pytest.approx(fisher[k], rel=0.5)
    assert set(joint.image_esds[0]) >= {"orient_x", "scale", "background", "misset_x", "misset_y", "misset_z"}
    assert joint.shared_correlation.shape == (3, 3)


def test_joint_esds_from_blocks_equal_the_dense_ones(stills, joint, monkeypatch):
    """Above MAX_DENSE the esds come from the per-image blocks (refine.many.esds): forced here on the same
    problem (the same steps: the preconditioner is unchanged), every esd equals the dense path's."""
    import refine.many.esds

    monkeypatch.setattr(refine.many.esds, "MAX_DENSE", 0)
    blocked = _joint(stills)
    assert blocked.shared == joint.shared
    for kind in ("sandwich", "fisher"):
        d, b = joint.esds_by_kind[kind], blocked.esds_by_kind[kind]
        assert b["shared"] == pytest.approx(d["shared"], rel=1e-8)
        for di, bi in zip(d["images"], b["images"]):
            assert bi == pytest.approx(di, rel=1e-8)
    np.testing.assert_allclose(blocked.shared_correlation, joint.shared_correlation, rtol=1e-8, atol=1e-12)


def test_joint_result_files(joint, singles, tmp_path):
    doc = json.loads(save_joint_json(joint, tmp_path / "joint.json").read_text())
    assert doc["format"] == "nbtorch-refine-joint" and doc["n_images"] == N
    assert doc["shared"] == pytest.approx(joint.shared) and doc["shared_names"] == list(CELL)
    assert len(doc["images"]) == N and doc["images"][1]["params"]["misset_x"] == joint.images[1]["misset_x"]
    # one schema: a single result's document (its keys, for the shared names) extended with a list of images
    single = json.loads(json.dumps(jsonable(singles[0].to_json_dict())))
    assert set(single) - {"stages", "hparams", "fit", "diagnostics"} <= set(doc) and single["format"] == "nbtorch-refine-result"
    assert doc["params"] == doc["shared"] and doc["esds"] == doc["shared_esds"] and doc["free"] == list(CELL)
    assert doc["correlation"] == doc["shared_correlation"] and doc["correlation"]["names"] == list(CELL)
    assert doc["esds_by_kind"]["fisher"] == pytest.approx(joint.esds_by_kind["fisher"]["shared"])
    assert doc["images"][1]["esds_by_kind"]["fisher"] == pytest.approx(joint.esds_by_kind["fisher"]["images"][1])
    assert doc["refined"] == pytest.approx({k: joint.shared[k] for k in CELL})
    h5 = load_joint_h5(save_joint_h5(joint, tmp_path / "joint.h5"))
    assert h5["status"] == joint.status.value and h5["shared"] == pytest.approx(joint.shared)
    assert h5["params"] == h5["shared"] and h5["names"] == list(CELL) and h5["format"] == "nbtorch-refine-joint"
    np.testing.assert_array_equal(h5["images"]["misset_z"], [p["misset_z"] for p in joint.images])
    np.testing.assert_array_equal(h5["image_esds"]["scale"], [e["scale"] for e in joint.image_esds])
    np.testing.assert_array_equal(h5["history"]["loss"], [row["loss"] for row in joint.history])
    assert h5["json"]["loss_final"] == joint.loss_final
    assert "cell_a" in joint.summary() and "4 images" in joint.summary()


def test_joint_input_errors(stills):
    sims, obs = [p.simulator() for p in stills[:2]], [p.observed for p in stills[:2]]
    with pytest.raises(InputError, match="shared and per_image both name cell_a"):
        refine_joint(sims, obs, shared=("cell",), per_image=("cell_a",), symmetry="orthorhombic")
    with pytest.raises(InputError, match="one image per simulator"):
        refine_joint(sims, obs[:1])
    with pytest.raises(InputError, match="breaks the orthorhombic constraints"):
        refine_joint(sims, obs, symmetry="orthorhombic", start={"cell_alpha": 91.0})
    assert list(image_shard(10, 0, 3)) == [0, 1, 2] and list(image_shard(10, 2, 3)) == [6, 7, 8, 9]
    assert list(image_shard(5)) == [0, 1, 2, 3, 4]


def _same_result(a: JointResult, b: JointResult) -> None:
    """Two joint results are the same bits (wall time and provenance aside)."""
    da, db = a.to_json_dict(), b.to_json_dict()
    for key in ("wall_s", "resumed_from_step"):
        da.pop(key), db.pop(key)
    assert json.dumps(da, sort_keys=True) == json.dumps(db, sort_keys=True)


def test_stopped_joint_run_resumes_to_the_uninterrupted_result(stills, joint, tmp_path):
    """A run stopped after 3 steps (its checkpoint every 2 steps and at the end) and resumed with the default
    step limit ends with the uninterrupted run's result: every value, esd, loss, count and history row."""
    path = tmp_path / "joint.ckpt.h5"
    seen = []
    first = _joint(stills, convergence=DEFAULT_CONVERGENCE.replace(max_steps=3), checkpoint=path,
                   checkpoint_every=2, on_checkpoint=lambda step, where: seen.append((step, where)), esds=False)
    assert first.status.value == "max_steps" and first.steps == 3
    assert seen == [(2, path), (3, path)]
    ckpt = read_joint_checkpoint(path)
    assert ckpt.step == 3 and ckpt.status == "max_steps" and ckpt.image_losses.shape == (N,)
    assert ckpt.fingerprint["n_images"] == N and ckpt.fingerprint["shared"] == list(CELL)
    resumed = _joint(stills, checkpoint=path, resume=path)
    assert resumed.resumed_from_step == 3 and joint.resumed_from_step is None
    assert resumed.steps == joint.steps > 3
    _same_result(resumed, joint)
    # the end was checkpointed with the loop's status: resuming again only computes the result
    assert read_joint_checkpoint(path).status == joint.status.value
    again = _joint(stills, resume=path)
    assert again.resumed_from_step == joint.steps
    _same_result(again, joint)


def test_the_loop_logs_its_progress(stills, monkeypatch, caplog):
    """Long runs show progress: every PROGRESS_EVERY steps one INFO line with the step, loss and time."""
    import logging

    import refine.many.joint as joint_module

    monkeypatch.setattr(joint_module, "PROGRESS_EVERY", 2)
    with caplog.at_level(logging.INFO, logger="refine.many.joint"):
        result = _joint(stills, convergence=DEFAULT_CONVERGENCE.replace(max_steps=5), esds=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("joint: step")]
    assert result.steps == 5 and [line.split(",")[0] for line in lines] == ["joint: step 2", "joint: step 4"]
    assert "evaluations" in lines[0] and lines[0].endswith("s in this loop")


def test_joint_resume_refuses_another_problem(stills, tmp_path):
    path = tmp_path / "joint.ckpt.h5"
    _joint(stills[:2], convergence=DEFAULT_CONVERGENCE.replace(max_steps=1), checkpoint=path, esds=False)
    with pytest.raises(InputError, match=r"^resume: .*joint.ckpt.h5 was written for another joint problem or "
                                         r"settings \(differs: number of images, images \(pixels or masks\), "
                                         r"starting values\)$"):
        _joint(stills[1:4], resume=path)
    with pytest.raises(InputError, match=r"\(differs: per-image names\)$"):
        _joint(stills[:2], resume=path, per_image=("scale", "background"))
    with pytest.raises(InputError, match=r"\(differs: strategy\)$"):
        _joint(stills[:2], resume=path, strategy="adam")
    with pytest.raises(InputError, match="^resume: .*missing.h5: checkpoint file not found$"):
        _joint(stills[:2], resume=tmp_path / "missing.h5")
    single = tmp_path / "single.ckpt.h5"
    refine(stills[0].simulator(), stills[0].observed, free=("scale", "background"), checkpoint=single,
           progress=False, esds=False)
    with pytest.raises(InputError, match="not an nbtorch joint refinement checkpoint"):
        _joint(stills[:2], resume=single)
    with pytest.raises(InputError, match="folder .* does not exist"):
        _joint(stills[:2], checkpoint=tmp_path / "nowhere" / "joint.ckpt.h5")
    with pytest.raises(InputError, match="checkpoint_every: expected an integer >= 1"):
        _joint(stills[:2], checkpoint=path, checkpoint_every=0)


def _script(tmp_path: Path, out: str, processes: int, n: int = N, size: int = SIZE, extra=()) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NANOBRAGG_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1", "NBTORCH_CACHE_DIR": str(tmp_path / "cache")}
    args = [str(SCRIPT), "--stills", str(n), "--size", str(size), "--seed", str(SEED), "--out", str(tmp_path / out),
            *extra]
    if processes == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-addr",
               "127.0.0.1", "--master-port", str(29500 + (os.getpid() + 7) % 1000), *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / out).read_text())


def _same(a, b, rel=1e-8):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k], rel)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, rel)
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=rel, abs=1e-300)
    else:
        assert a == b


def test_one_and_two_processes_give_the_same_result(tmp_path):
    """torchrun --nproc-per-node 2 (gloo on loopback): each process holds one of two stills and its part of the
    raw vector; the result equals the one-process result to 1e-8 relative (in fact bit for bit: every sum over
    stills is exact).  A run stopped after 3 steps by one process and resumed by two ends there too."""
    one = _script(tmp_path, "one.json", 1, n=2)["joint"]
    two = _script(tmp_path, "two.json", 2, n=2)["joint"]
    ckpt = tmp_path / "stopped.ckpt.h5"
    stopped = _script(tmp_path, "stopped.json", 1, n=2, extra=("--max-steps", "3", "--checkpoint", str(ckpt)))
    resumed = _script(tmp_path, "resumed.json", 2, n=2, extra=("--resume", str(ckpt)))["joint"]
    assert stopped["joint"]["steps"] == 3 and resumed["resumed_from_step"] == 3 and resumed["world_size"] == 2
    assert one["world_size"] == 1 and two["world_size"] == 2
    for key in ("shared", "shared_esds", "images", "esds_by_kind", "loss_final", "loss_initial", "steps",
                "evaluations", "status", "history"):
        _same(one[key], resumed[key], rel=0.0)
        _same(one[key], two[key], rel=0.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_restarts_a_killed_worker_from_the_checkpoint(joint, tmp_path):
    """torchrun --nproc-per-node 2 --max-restarts 1 (gloo on loopback), the four stills of ``joint``: process 1
    kills itself (SIGKILL) after the checkpoint of step 2; torchrun restarts both processes, which resume
    from the checkpoint by themselves (TORCHELASTIC_RESTART_COUNT 1) and end with the uninterrupted
    one-process result (1e-8 relative, as one and two processes)."""
    worker = Path(__file__).with_name("joint_restart_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NANOBRAGG_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1", "NBTORCH_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(worker), "--stills", str(N),
           "--size", str(SIZE), "--seed", str(SEED), "--checkpoint", str(tmp_path / "joint.ckpt.h5"), "--every", "2",
           "--kill-rank", "1", "--kill-step", "2", "--out", str(tmp_path / "result.json"),
           "--attempts", str(tmp_path / "attempts.txt")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    attempts = sorted((tmp_path / "attempts.txt").read_text().split("\n")[:-1])
    assert attempts == ["0 0", "0 1", "1 0", "1 1"], attempts  # both processes started twice
    two = json.loads((tmp_path / "result.json").read_text())
    one = json.loads(json.dumps(jsonable(joint.to_json_dict())))
    assert two["resumed_from_step"] == 2 and two["world_size"] == 2 and one["resumed_from_step"] is None
    assert two["steps"] == one["steps"] > 2
    for key in ("shared", "shared_esds", "images", "esds_by_kind", "loss_final", "loss_initial",
                "steps", "evaluations", "status", "history"):
        _same(one[key], two[key], rel=0.0)


@pytest.mark.slow
def test_sixteen_stills(tmp_path):
    """The issue's check: 16 stills (48 x 48): the joint cell error is at most 1.5 x the single-still error
    (rms over the stills) / sqrt(16), the joint esds are consistent with it, and 2 processes give the same
    result as 1 (the wall times are printed; docs/log.md has the measured numbers)."""
    one = _script(tmp_path, "one.json", 1, n=16, size=48, extra=("--singles",))
    two = _script(tmp_path, "two.json", 2, n=16, size=48)
    assert all(s["status"] in ("converged", "max_steps") for s in one["singles"])
    assert one["joint_cell_error"] <= 1.5 * one["single_cell_error_rms"] / math.sqrt(16), one
    joint, truth = one["joint"], one["truth"]
    z = [(joint["shared"][k] - truth[k]) / joint["shared_esds"][k] for k in CELL]
    assert max(abs(v) for v in z) < 4.0, z
    for key in ("shared", "shared_esds", "images", "loss_final", "steps"):
        _same(one["joint"][key], two["joint"][key])
    print(f"16 stills: joint cell error {one['joint_cell_error']:.3g} A, single-still rms "
          f"{one['single_cell_error_rms']:.3g} A; joint wall {one['joint']['wall_s']:.1f} s (1 process), "
          f"{two['joint']['wall_s']:.1f} s (2 processes)")


def test_joint_domain_count_check(joint, singles, tmp_path):
    """The shared cell's step towards twice the mosaic domain count (refine.quality.domain_count), in the result and
    its files; each still refined alone gets its own."""
    check = joint.mosaic_domains
    assert check["domains"] == 3 and check["check_domains"] == 6  # the bank's random draw of 3 domains
    assert set(check["shift_esd"]) == {"cell_a", "cell_b", "cell_c"} and 0 < check["secant"] <= 4
    assert all(math.isfinite(v) for v in check["shift_esd"].values())
    assert (check["warning"] is None) == all(abs(v) <= check["max_shift_esd"] for v in check["shift_esd"].values())
    save_joint_json(joint, tmp_path / "joint.json")
    assert json.loads((tmp_path / "joint.json").read_text())["mosaic_domains"]["shift"] == pytest.approx(check["shift"])
    assert all(s.mosaic_domains["domains"] == 3 for s in singles)
