"""The CUDA path: C parity of every golden case, gradients and a refinement on a GPU agree with the CPU.

Marked ``gpu`` (not in the default suite; ``pytest -m gpu tests/test_cuda.py`` on a machine with CUDA).
``NBTORCH_TEST_DEVICE`` names the device under test (default ``cuda``); ``NBTORCH_TEST_DEVICE=cpu`` runs the
same comparisons on the CPU, which checks the tests themselves where no GPU is lent.

Acceptance as on the CPU (tests/test_parity.py): float64 max|diff| <= 1e-5 max(C) and |sum diff| / sum C <=
1e-6 (eager, and compiled for a few cases: Triton kernels on a GPU); float32 correlation >= 0.99999.
Gradients of a weighted image sum in every probed parameter: the device's equal the CPU's to 1e-9 relative
(float64; only the order of sums differs), and ``torch.autograd.gradcheck``/``gradgradcheck`` pass on the device
itself (eager, float64, the gradient suite's tolerances).  ``NANOBRAGG_DISABLE_COMPILE`` and the forward harness's
``--disable-compile`` decide eager there as on the CPU.  A short refinement (the README's main-job problem, 20 steps)
reaches the CPU's values to 1e-4 of each value's esd; so do joint refinements of two stills (the API, the
command, and with shared structure factors, whose EM start and amplitudes also run on the device; 8 steps
there, 1e-3 esd) -- parameters held on the CPU, images on the device.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from golden import assert_parity, golden_args, golden_cases, golden_image, require_golden, simulate_case
from nbtorch import Simulator, config_from_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # joint_stills, as tests/refine/test_joint.py
DEVICE = os.environ.get("NBTORCH_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                 reason="needs a CUDA device (or NBTORCH_TEST_DEVICE=cpu)")]
CASES = golden_cases()
#: compiled (Triton on a GPU) as well as eager: a plain case, mosaic domains, sub-pixels with a thick sensor
COMPILED_CASES = [c for c in ("simple_cubic", "mosaic", "oversample_thick") if c in CASES]


@pytest.fixture(scope="module", autouse=True)
def _golden_present():
    require_golden()


def _simulate(case: str, dtype: torch.dtype, compile: bool = False) -> tuple[np.ndarray, Simulator]:
    img, sim = simulate_case(case, dtype, device=DEVICE, compile=compile)
    assert sim.device.type == torch.device(DEVICE).type, f"{case}: simulated on {sim.device}"
    return img, sim


@pytest.mark.parametrize("case", CASES)
def test_parity_float64_on_device(case):
    img, _ = _simulate(case, torch.float64)
    assert_parity(img, golden_image(case, img.shape), case)


@pytest.mark.parametrize("case", [c for c in CASES if c != "large_1024"])
def test_parity_float32_correlation_on_device(case):
    img, _ = _simulate(case, torch.float32)
    ref = golden_image(case, img.shape)
    corr = np.corrcoef(img.ravel(), ref.ravel())[0, 1]
    assert corr >= 0.99999, f"{case}: float32 correlation {corr:.7f}"


@pytest.mark.parametrize("case", COMPILED_CASES)
def test_parity_compiled_on_device(case):
    img, sim = _simulate(case, torch.float64, compile=True)
    assert sim.compile_mode == "compiled", f"{case}: fell back to eager: {sim.compile_reason}"
    assert_parity(img, golden_image(case, img.shape), case)


def test_command_on_device(case_copy):
    """``nbtorch ... -device cuda``: the command's float image matches the C's."""
    from nbtorch.cli.main import main

    folder = case_copy("simple_cubic")
    (folder / "float.bin").unlink()
    assert main(golden_args("simple_cubic") + ["-c_parity", "-nopgm", "-device", DEVICE]) == 0
    img = np.fromfile(folder / "float.bin", "<f4").astype(np.float64)
    assert_parity(img, golden_image("simple_cubic", img.shape).astype(np.float64), "simple_cubic")


def test_gradients_on_device_equal_the_cpu_ones():
    """dL/dp of a weighted image sum, every probed parameter, eager float64: device == CPU to 1e-9."""
    import nbtorch
    from nbtorch.tools.gradcheck_report import CASES as GRADIENT_CASES
    from nbtorch.tools.gradcheck_report import PROBED_NAMES, GradientProbe

    probe = GradientProbe.from_case(GRADIENT_CASES["mosaic"])  # CPU: picks an ROI with spots
    args = GRADIENT_CASES["mosaic"].args.split()
    grads = {}
    with nbtorch.eager():
        for device in ("cpu", DEVICE):
            sim = Simulator(config_from_args(args), dtype=torch.float64, device=device, compile=False)
            xs = {n: torch.tensor(probe.base[n], dtype=torch.float64, device=device, requires_grad=True)
                  for n in PROBED_NAMES}
            img = sim.render(roi=probe.roi, **xs)[0]
            assert img.device.type == torch.device(device).type
            loss = (probe.weights[0].to(device) * img).sum()
            out = torch.autograd.grad(loss, list(xs.values()), allow_unused=True)
            grads[device] = {n: (0.0 if g is None else float(g)) for n, g in zip(PROBED_NAMES, out)}
    cpu, dev = grads["cpu"], grads[DEVICE]
    assert sum(abs(v) > 0 for v in cpu.values()) >= 10, cpu  # a non-trivial gradient
    scale = max(abs(v) for v in cpu.values())
    bad = [f"{n}: {DEVICE} {dev[n]:.12g} cpu {cpu[n]:.12g}" for n in PROBED_NAMES
           if abs(dev[n] - cpu[n]) > 1e-9 * max(abs(cpu[n]), 1e-6 * scale)]
    assert not bad, "; ".join(bad)


def test_refinement_on_device_reaches_the_cpu_values(tmp_path, monkeypatch):
    """``nbtorch-refine --device cuda`` on the main job's problem: the values and esds of the CPU run."""
    from refine.cli.main import main

    monkeypatch.setenv("NBTORCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    argv = ["--problem", "tetragonal_mosflm", "--size", "48", "--refine", "scale,background,orientation,beam_centre,"
            "cell,mosaic", "--max-steps", "20", "--quiet"]
    results = {}
    for device in ("cpu", DEVICE):
        out = tmp_path / device.replace(":", "_")
        assert main(argv + ["--device", device, "--out", str(out / "r.h5"), "--json", str(out / "r.json")]) == 0
        results[device] = json.loads((out / "r.json").read_text())
    cpu, dev = results["cpu"], results[DEVICE]
    assert dev["steps"] == cpu["steps"] and dev["status"] == cpu["status"]
    assert dev["loss_final"] == pytest.approx(cpu["loss_final"], rel=1e-8)
    assert set(dev["refined"]) == set(cpu["refined"]) and set(cpu["refined"]) <= set(cpu["esds"])
    bad = [f"{n}: {dev['refined'][n]!r} vs {cpu['refined'][n]!r} (esd {cpu['esds'][n]:.3g})" for n in cpu["refined"]
           if abs(dev["refined"][n] - cpu["refined"][n]) > 1e-4 * cpu["esds"][n]
           or dev["esds"][n] != pytest.approx(cpu["esds"][n], rel=1e-5)]
    assert not bad, "; ".join(bad)


def test_joint_refinement_on_device_reaches_the_cpu_values(tmp_path):
    """:func:`refine.many.joint.refine_joint` with every image's simulator on the device (the joint Fisher
    preconditioner and esds summed beside the CPU-held parameters): the CPU run's values, esds and steps."""
    from joint_stills import image_start  # scripts/: orientation and scale from each still's start, geometry known
    from refine.many.joint import refine_joint
    from refine.fitting.parameters import SYMMETRIES
    from refine.inputs.problems import make_stills

    stills = make_stills("orthorhombic_xds", 2, 32, seed=1, directory=tmp_path)
    cell = SYMMETRIES["orthorhombic"]
    starts = [image_start(p) for p in stills]  # as tests/refine/test_joint.py
    results = {}
    for device in ("cpu", DEVICE):
        sims = [p.simulator(device=device) for p in stills]
        results[device] = refine_joint(sims, [p.observed for p in stills], symmetry=stills[0].symmetry,
                                       start={k: stills[0].start[k] for k in cell}, image_starts=starts)
    cpu, dev = results["cpu"], results[DEVICE]
    assert cpu.status.ok, cpu.message
    assert dev.status == cpu.status and dev.steps == cpu.steps
    assert dev.loss_final == pytest.approx(cpu.loss_final, rel=1e-8)
    assert set(cpu.shared_esds) >= set(cpu.shared_names) - {"orient_x", "orient_y", "orient_z"}
    bad = [f"{n}: {dev.shared[n]!r} vs {cpu.shared[n]!r} (esd {e:.3g})" for n, e in cpu.shared_esds.items()
           if abs(dev.shared[n] - cpu.shared[n]) > 1e-4 * e
           or dev.shared_esds[n] != pytest.approx(e, rel=1e-5)]
    for i, (d, c) in enumerate(zip(dev.image_esds, cpu.image_esds)):
        bad += [f"image {i} {n}: esd {d[n]!r} vs {e!r}" for n, e in c.items() if d[n] != pytest.approx(e, rel=1e-5)]
        bad += [f"image {i} {n}: {dev.images[i][n]!r} vs {cpu.images[i][n]!r} (esd {c[n]:.3g})" for n in c
                if n in cpu.images[i] and abs(dev.images[i][n] - cpu.images[i][n]) > 1e-4 * c[n]]
    assert not bad, "; ".join(bad)


def test_joint_structure_factors_on_device_reach_the_cpu_values(tmp_path):
    """Shared structure factors (the EM start, the amplitudes refined with the cell) with every image's
    simulator on the device: the CPU run's amplitudes, cell and esds (tests/refine/test_joint_structure_factors.py's
    problem, two stills); and one still's amplitudes refined alone."""
    pytest.importorskip("gemmi")
    from refine import refine
    from refine.many.joint import refine_joint
    from refine.solver.loop import Convergence
    from refine.inputs.problems import make_stills
    from refine.solver.stages import Stage
    from refine.fitting.structure_factors import AmplitudeOptions

    stills = make_stills("orthorhombic_xds", 2, 32, seed=1, directory=tmp_path)
    known = ("misset_x", "misset_y", "misset_z", "cell_a", "cell_b", "cell_c", "beam_x", "beam_y", "mosaic_spread",
             "N_a", "N_b", "N_c", "distance")
    starts = [{**{k: p.truth[k] for k in known}, "scale": 1.0 if i == 0 else 2.0} for i, p in enumerate(stills)]
    options = AmplitudeOptions("P1", start="estimate", min_photons=30.0)
    # a few steps: many amplitudes make a long, flat valley whose end (300 and 100 steps, not converged) would
    # depend on the sums' order; a short path compares the code, not where rounding leads the loop
    short = Convergence(max_steps=8, ftol=1e-4, xtol=1e-4)
    results = {}
    for device in ("cpu", DEVICE):
        sims = [p.simulator(device=device) for p in stills]
        results[device] = refine_joint(sims, [p.observed for p in stills], shared=("cell",),
                                       per_image=("scale", "background"), symmetry="orthorhombic",
                                       image_starts=starts, geometry_first=False, structure_factors=options,
                                       convergence=short)
    cpu, dev = results["cpu"], results[DEVICE]
    assert dev.status == cpu.status and dev.steps == cpu.steps == short.max_steps, (cpu.message, dev.message)
    rows = {device: {tuple(r[:3]): r for r in res.structure_factors["reflections"]} for device, res in results.items()}
    assert rows[DEVICE].keys() == rows["cpu"].keys() and any(r[6] for r in rows["cpu"].values())
    # (name, device value, CPU value, CPU esd, device esd) of every refined amplitude and shared cell value
    pairs = [(f"F{hkl}", rows[DEVICE][hkl][4], r[4], r[5], rows[DEVICE][hkl][5])
             for hkl, r in rows["cpu"].items() if r[6]]
    pairs += [(n, dev.shared[n], cpu.shared[n], e, dev.shared_esds[n]) for n, e in cpu.shared_esds.items()
              if n in cpu.shared]
    # one still alone (refine.refine's amplitudes stage, as tests/refine/test_joint_structure_factors.py's singles)
    singles = {}
    for device in ("cpu", DEVICE):
        singles[device] = refine(stills[0].simulator(device=device), stills[0].observed, start=starts[0],
                                 free=("background", "structure_factors"), progress=False, structure_factors=options,
                                 stages=(Stage("amps", ("background", "structure_factors"), convergence=short),))
    one = {device: {tuple(r[:3]): r for r in res.structure_factors()["reflections"]} for device, res in singles.items()}
    assert one[DEVICE].keys() == one["cpu"].keys() and any(r[6] for r in one["cpu"].values())
    pairs += [(f"still 0 alone F{hkl}", one[DEVICE][hkl][4], r[4], r[5], one[DEVICE][hkl][5])
              for hkl, r in one["cpu"].items() if r[6]]
    assert singles[DEVICE].steps == singles["cpu"].steps == short.max_steps
    pull = max(abs(d - c) / e for _, d, c, e, _ in pairs)
    esd_diff = max(abs(de / e - 1) for _, _, _, e, de in pairs)
    print(f"{len(pairs)} values: largest |{DEVICE} - cpu| / esd {pull:.3g}, largest esd difference {esd_diff:.3g}; "
          f"joint loss {dev.loss_final!r} vs {cpu.loss_final!r}, steps {dev.steps} vs {cpu.steps}; still 0 alone "
          f"loss {singles[DEVICE].loss_final!r} vs {singles['cpu'].loss_final!r}, steps {singles[DEVICE].steps} vs "
          f"{singles['cpu'].steps}")
    assert dev.loss_final == pytest.approx(cpu.loss_final, rel=1e-8)
    assert singles[DEVICE].loss_final == pytest.approx(singles["cpu"].loss_final, rel=1e-8)
    bad = [f"{n}: {d!r} vs {c!r} (esd {e:.3g}, {de:.3g})" for n, d, c, e, de in pairs
           if abs(d - c) > 1e-3 * e or de != pytest.approx(e, rel=1e-5)]
    assert not bad, "; ".join(bad)


def test_joint_command_on_device_reaches_the_cpu_values(tmp_path, monkeypatch):
    """``nbtorch-refine --images ... --joint --device cuda`` (every image prepared on the device, as a single run
    prepares it): the CPU run's joint.json values and esds."""
    from nbtorch.io.cbf import write_cbf
    from refine.cli.main import main

    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48 -Xbeam 2.45 -Ybeam 2.45"
    crystal = "-N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1"
    monkeypatch.setenv("NBTORCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for k, misset in enumerate(("10 20 30", "-40 5 75")):
        sim = Simulator(config_from_args(f"-cell 30 30 40 90 90 90 -misset {misset} {crystal} {geometry}".split()),
                        compile=False)
        with torch.no_grad():
            img = np.random.default_rng(20 + k).poisson(sim().numpy() + 1.0).astype(np.int32)
        write_cbf(tmp_path / f"still_{k}.cbf", img, {"pixel_size_mm": 0.1})
        (tmp_path / f"still_{k}.txt").write_text(f"-cell 30.09 30.09 40.12 90 90 90 -misset {misset} {crystal} "
                                                 f"{geometry}")
    docs = {}
    for device in ("cpu", DEVICE):
        out = device.replace(":", "_")
        # a short fixed path (as the structure-factor tests): near convergence the GPU's other order of sums can
        # end a run a step or two apart (the H200, tiles of 2^25 evaluations: 9 steps against the CPU's 11)
        assert main(["--images", "still_0.cbf", "still_1.cbf", "--model", "@{stem}.txt", "--joint", "--symmetry",
                     "tetragonal", "--max-steps", "6", "--device", device, "--out-dir", out, "--quiet"]) == 0
        docs[device] = json.loads((tmp_path / out / "joint.json").read_text())
    cpu, dev = docs["cpu"], docs[DEVICE]
    assert dev["status"] == cpu["status"] and dev["steps"] == cpu["steps"]
    assert dev["loss_final"] == pytest.approx(cpu["loss_final"], rel=1e-8)
    assert set(cpu["shared_esds"]) == {"cell_a", "cell_b", "cell_c"}
    bad = [f"{n}: {dev['shared'][n]!r} vs {cpu['shared'][n]!r} (esd {e:.3g})" for n, e in cpu["shared_esds"].items()
           if abs(dev["shared"][n] - cpu["shared"][n]) > 1e-4 * e
           or dev["shared_esds"][n] != pytest.approx(e, rel=1e-5)]
    assert not bad, "; ".join(bad)


# --- torch.autograd.gradcheck on the device (eager, float64: docs/gradients.md, "Writing a gradient test") -------
@functools.lru_cache(maxsize=1)
def _cpu_probe():
    """The gradient suite's 'mosaic' probe on the CPU: its ROI (with Bragg spots), weights and base point."""
    import nbtorch
    from nbtorch.tools.gradcheck_report import CASES as GRADIENT_CASES
    from nbtorch.tools.gradcheck_report import GradientProbe

    with nbtorch.eager():
        return GradientProbe.from_case(GRADIENT_CASES["mosaic"])


def _device_gradcheck_inputs(names):
    """``(fn, inputs, eps)`` as :meth:`GradientProbe.gradcheck_inputs`, with the simulator, the weights and the
    inputs on the device: fn maps the rescaled parameters to three normalised weighted sums of the ROI."""
    from nbtorch.tools.gradcheck_report import ALL_PARAMS

    probe = _cpu_probe()
    sim = Simulator(config_from_args(probe.case.args.split()), dtype=torch.float64, device=DEVICE, compile=False)
    weights = probe.weights.to(device=DEVICE, dtype=torch.float64)
    with torch.no_grad():
        norms = (weights * sim.render(roi=probe.roi)[0]).sum((1, 2))
    scales = [ALL_PARAMS[n].scale for n in names]
    inputs = tuple(torch.tensor(probe.base[n] / s, dtype=torch.float64, device=DEVICE, requires_grad=True)
                   for n, s in zip(names, scales))

    def fn(*xs):
        img = sim.render(roi=probe.roi, **{n: x * s for n, x, s in zip(names, xs, scales)})[0]
        return (weights * img).sum((1, 2)) / norms

    return fn, inputs, min(ALL_PARAMS[n].eps for n in names)


@pytest.mark.parametrize("group", ["cell", "geometry", "everything"])
def test_gradcheck_on_device(group):
    """torch.autograd.gradcheck of the simulator on the device, as tests/gradients/test_gradcheck.py on the CPU:
    the cell and the detector geometry jointly in full mode, every probed parameter at once in fast mode."""
    import nbtorch
    from torch.autograd import gradcheck
    from nbtorch.tools.gradcheck_report import CELL_PARAMS, GEOMETRY_PARAMS, PROBED_NAMES

    # everything the probe's model can move: a width without spread (one wavelength) is refused, not probed
    names = {"cell": CELL_PARAMS, "geometry": GEOMETRY_PARAMS, "everything": _cpu_probe().names}[group]
    assert set(names) <= set(PROBED_NAMES)
    with nbtorch.eager():
        fn, inputs, eps = _device_gradcheck_inputs(list(names))
        out = fn(*inputs)
        assert out.device.type == torch.device(DEVICE).type
        assert torch.allclose(out, torch.ones_like(out))
        if group != "everything":  # nothing passes as 0 = 0
            jac = torch.autograd.functional.jacobian(fn, inputs)
            assert all(bool(j.abs().amax() > 0) for j in jac), f"zero derivative among {names}"
        assert gradcheck(fn, inputs, eps=eps, atol=1e-9, rtol=1e-5, fast_mode=group == "everything")


def test_gradgradcheck_cell_on_device():
    import nbtorch
    from torch.autograd import gradgradcheck
    from nbtorch.tools.gradcheck_report import CELL_PARAMS

    with nbtorch.eager():
        fn, inputs, eps = _device_gradcheck_inputs(list(CELL_PARAMS))
        assert gradgradcheck(fn, inputs, eps=eps, atol=1e-7, rtol=1e-4)


# --- the compile guard on the device ---------------------------------------------------------------------------
SMALL_ARGS = "-cell 100 100 100 90 90 90 -N 5 -lambda 6.2 -default_F 100 -distance 100 -pixel 0.1 -detpixels 32".split()


@pytest.mark.parametrize("value, mode, reason", [("1", "eager", "environment variable"),
                                                 ("0", "compiled", "default (compile on)")])
def test_compile_env_guard_on_device(monkeypatch, value, mode, reason):
    """NANOBRAGG_DISABLE_COMPILE decides for a simulator on the device as on the CPU; with 1 its render compiles
    nothing (no Dynamo graph) and equals an explicit eager one.  (The 0 case is only constructed: the compile
    itself is test_parity_compiled_on_device's.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("NANOBRAGG_DISABLE_COMPILE", value)
    monkeypatch.delenv("NANOBRAG_DISABLE_COMPILE", raising=False)
    sim = Simulator(config_from_args(SMALL_ARGS), device=DEVICE)
    assert (sim.compile_mode, sim.compile_reason) == (mode, reason)
    if mode == "eager":
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            img = sim()
        assert img.device.type == torch.device(DEVICE).type
        assert counters["stats"]["unique_graphs"] == graphs
        with torch.no_grad():
            assert torch.equal(img, Simulator(config_from_args(SMALL_ARGS), device=DEVICE, compile=False)())


def test_bench_compile_env_on_device(monkeypatch, capsys):
    """The forward harness on the device with --disable-compile (and --profile): eager records, the caller's
    environment restored."""
    from nbtorch.tools import bench

    monkeypatch.delenv("NANOBRAGG_DISABLE_COMPILE", raising=False)
    monkeypatch.setattr(bench.runtime, "tune_allocator", lambda: False)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--sizes", "32", "--iterations", "1", "--device", DEVICE, "--disable-compile",
                           "--profile", "1", "--threads", str(threads)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "NANOBRAGG_DISABLE_COMPILE" not in os.environ
    out = capsys.readouterr().out
    rec = [json.loads(line) for line in out.splitlines() if line.startswith("{")][1]
    assert (rec["device"], rec["compile_mode"], rec["compile_reason"]) == (DEVICE, "eager", "environment variable")
    assert rec["profile_evaluations"] == 1 and "Self CPU" in out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_graphed_loss_and_gradient_equal_the_plain_ones(compiled, monkeypatch):
    """A stage's loss and gradient replayed from a CUDA graph (:mod:`refine.solver.graphed`, what the loop calls on
    a GPU) equal the same evaluation launched kernel by kernel, at the capture's point and at others (the graph's
    inputs are copied in, nothing of the first point is frozen); the graph was captured (no capture rule broken)."""
    from refine.tools import bench

    if not DEVICE.startswith("cuda"):
        pytest.skip("CUDA graphs need a CUDA device")
    monkeypatch.delenv("NBTORCH_CUDA_GRAPHS", raising=False)
    b = bench.build_objective(["--problem", "tetragonal_mosflm", "--size", "48", "--device", DEVICE,
                               "--compile" if compiled else "--no-compile",
                               "--refine", "scale,background,orientation,beam_centre,cell,mosaic"])
    _replays_match_launched(b, (0.0, 0.02, -0.05, 0.0))


def _replays_match_launched(b, shifts) -> None:
    """At ``raw0 + shift`` for each shift: the graph captured, its loss and gradient the launched evaluation's."""
    raw0 = b.raw.clone()
    for shift in shifts:
        b.raw = raw0 + shift
        loss, grad = b.loss_grad()
        assert b.graph_status() == "captured", b.graph_status()
        plain_loss, plain_grad = b.loss_grad_plain()
        assert float(loss) == pytest.approx(float(plain_loss), rel=1e-12)
        np.testing.assert_allclose(grad.numpy(), plain_grad.cpu().numpy(), rtol=1e-9,
                                   atol=1e-12 * float(grad.abs().max()))
    assert b.fn.graphed.replays >= len(shifts)


def test_a_structure_factor_stage_is_captured_in_one_graph(monkeypatch):
    """A stage refining 246 amplitudes with a restraint (their vector from tensors kept on the device,
    ParameterMap.physical_block; the restraint's bins copied there once) is captured and replays the launched
    evaluation's loss and gradient."""
    from refine.tools import bench

    if not DEVICE.startswith("cuda"):
        pytest.skip("CUDA graphs need a CUDA device")
    monkeypatch.delenv("NBTORCH_CUDA_GRAPHS", raising=False)
    b = bench.build_objective(["--problem", "tetragonal_mosflm", "--size", "48", "--device", DEVICE, "--no-compile",
                               "--structure-factors", "--space-group", "P4", "--f-start", "one", "--f-restraint", "0.5",
                               "--refine", "scale,orientation,structure_factors"])
    assert len(b.pmap.names) > 200 and b.pmap._amplitude_block() is not None
    _replays_match_launched(b, (0.0, 0.03, 0.0))
