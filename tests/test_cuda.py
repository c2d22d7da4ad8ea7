"""The CUDA path: C parity of every golden case, gradients and a refinement on a GPU agree with the CPU.

Marked ``gpu`` (not in the default suite; ``pytest -m gpu tests/test_cuda.py`` on a machine with CUDA).
``NBTORCH_TEST_DEVICE`` names the device under test (default ``cuda``); ``NBTORCH_TEST_DEVICE=cpu`` runs the
same comparisons on the CPU, which checks the tests themselves where no GPU is lent.

Acceptance as on the CPU (tests/test_parity.py): float64 max|diff| <= 1e-5 max(C) and |sum diff| / sum C <=
1e-6 (eager, and compiled for a few cases: Triton kernels on a GPU); float32 correlation >= 0.99999.
Gradients of a weighted image sum in every probed parameter: the device's equal the CPU's to 1e-9 relative
(float64; only the order of sums differs).  A short refinement (the README's main-job problem, 20 steps)
reaches the CPU's values to 1e-4 of each value's esd.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from golden import assert_parity, golden_args, golden_cases, golden_image, require_golden, simulate_case
from nbtorch import Simulator, config_from_args

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
    from nbtorch.cli import main

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
    from refine.cli import main

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
