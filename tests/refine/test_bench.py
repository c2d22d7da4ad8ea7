"""The refinement benchmark harness (``python -m refine.tools.bench``) runs end to end on a tiny synthetic problem,
eagerly, so that it cannot rot; no time is asserted."""

import json

import pytest
import torch

from nbtorch.errors import InputError
from refine.tools import bench

TINY = ["--problem", "tetragonal_mosflm", "--size", "16", "--refine", "scale,background,cell", "--no-compile"]


def test_harness_runs_on_a_tiny_problem(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--repeats", "2", "--esd-repeats", "1", "--profile", "1", "--json", str(out), "--", *TINY]) == 0
    rec = json.loads(out.read_text())
    for key in ("date", "processor", "torch", "threads", "load_average", "load_average_after"):
        assert key in rec
    assert rec["compile_mode"] == "eager" and rec["dtype"] == "float64" and rec["device"] == "cpu"
    assert rec["pixels"] > 0 and rec["evaluations_per_pixel"] >= 1
    for name in ("loss_grad", "loss", "forward", "esds"):
        r = rec[name]
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["ns_per_evaluation"] > 0
    printed = capsys.readouterr().out
    assert "| loss_grad |" in printed and "| esds |" in printed and "Self CPU" in printed


def test_bad_repeats_is_one_line(capsys):
    assert bench.main(["--repeats", "0", "--", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m refine.tools.bench: error:") and "\n" not in err


def test_main_job_time_is_parsed(monkeypatch):
    class Done:
        returncode = 0
        stdout = "wrote a and b (4.2 s in all)\n"
        stderr = ""

    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: Done())
    got = bench.main_job_seconds()
    assert got["in_all_s"] == 4.2 and "--problem tetragonal_mosflm" in got["command"]
    assert "--device cuda:0" in bench.main_job_seconds(("--device", "cuda:0"))["command"]


def test_the_refinement_tile_is_small_on_a_cpu_and_one_large_tile_on_a_gpu():
    """A refinement's simulator: tiles of 2^19 evaluations on a CPU (few tiles, cache-sized), 2^25 on a GPU (the
    simulator's own GPU default); the tile changes no pixel's value (tests/test_simulator.py), so the choice is
    speed alone."""
    from nbtorch.simulator import default_tile_evaluations
    from refine.modes.single import tile_evaluations

    assert tile_evaluations("cpu") == 1 << 19
    assert tile_evaluations("cuda") == tile_evaluations("cuda:1") == default_tile_evaluations("cuda") == 1 << 25
    assert default_tile_evaluations("cpu") == 1 << 20
    b = bench.build_objective(TINY)
    assert b.sim.max_evals_per_tile == tile_evaluations(b.sim.device)


def test_fractions_fixed_cost_and_operator_counts_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--repeats", "1", "--esd-repeats", "0", "--fractions", "1/4,1", "--json", str(out), "--",
                       *TINY]) == 0
    rec = json.loads(out.read_text())
    quarter, whole = rec["fractions"]
    assert whole["pixels"] == rec["pixels"] and quarter["pixels"] == round(rec["pixels"] / 4)
    assert quarter["samples"] == quarter["pixels"] * rec["evaluations_per_pixel"]
    for name in ("loss_grad", "forward"):
        assert set(rec["fixed_cost"][name]) == {"fixed_s", "per_sample_s", "ns_per_sample", "rms_residual_s"}
        assert quarter[name]["median_s"] > 0 and whole[name]["median_s"] > 0
    # counts, not times: the gradient's backward adds operators to the forward's; eager: no compiled graph
    ops = {name: rec[name]["operators_per_call"] for name in ("loss_grad", "loss", "forward")}
    assert 0 < ops["forward"] < ops["loss"] < ops["loss_grad"]
    assert rec["loss_grad"]["compiled_graphs_per_call"] == 0 and rec["loss_grad"]["device_kernels_per_call"] == 0
    printed = capsys.readouterr().out
    assert "operators per call" in printed and "fixed cost per call" in printed and "| 0.25 |" in printed


def test_a_subset_fits_fewer_pixels_of_the_same_objective():
    """The quarter's pixels are every fourth fitted pixel, and the simulator computes only those: its model on them
    is the whole objective's model there."""
    from refine.tools.costs import subset

    b = bench.build_objective(TINY)
    part = subset(b, 0.25)
    used, kept = b.objective.used_pixels, part.objective.used_pixels
    assert kept.numel() == part.pixels == round(used.numel() / 4)
    assert torch.equal(kept, used[torch.arange(kept.numel()) * used.numel() // kept.numel()])
    values = b.pmap.expand(b.pmap.physical(b.raw))
    assert part.sim.simulated_pixels(b.objective.view.roi).numel() == kept.numel()
    with torch.no_grad():
        whole = b.objective.pixel_model(values)
        assert torch.equal(part.objective.pixel_model(values), whole[torch.searchsorted(used, kept)])


def test_fixed_cost_fit_recovers_a_line():
    from nbtorch.tools.costs import fit_fixed_cost

    samples = [1e5, 2e5, 4e5, 8e5]
    seconds = [2e-3 + 15e-9 * n for n in samples]
    fit = fit_fixed_cost(samples, seconds)
    assert fit["fixed_s"] == pytest.approx(2e-3, rel=1e-9) and fit["ns_per_sample"] == pytest.approx(15.0, rel=1e-9)
    assert fit["rms_residual_s"] < 1e-15
    noisy = fit_fixed_cost(samples, [t * f for t, f in zip(seconds, (1.01, 0.99, 1.0, 1.005))])
    assert noisy["fixed_s"] == pytest.approx(2e-3, rel=0.1) and noisy["ns_per_sample"] == pytest.approx(15.0, rel=0.02)
    assert noisy["rms_residual_s"] > 0


@pytest.mark.parametrize("samples, seconds", [([1e5], [1e-3]), ([1e5, 1e5], [1e-3, 2e-3]), ([1e5, 2e5], [1e-3]),
                                              ([0, 1e5], [1e-3, 2e-3]), ([1e5, 2e5], [1e-3, float("nan")])])
def test_fixed_cost_fit_refuses_bad_input(samples, seconds):
    from nbtorch.tools.costs import fit_fixed_cost

    with pytest.raises(InputError) as err:
        fit_fixed_cost(samples, seconds)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["1/8", "0,1", "1/0,1", "2,1", "a,1", "1,1"])
def test_bad_fractions_is_one_line(text, capsys):
    assert bench.main(["--fractions", text, "--", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m refine.tools.bench: error: --fractions") and "\n" not in err


def test_operator_counts_of_profiler_events():
    """Operators called by another operator are not counted again; kernels on a device and compiled graphs apart."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from nbtorch.tools.costs import count_events

    def event(i, name, parent=None, device=DeviceType.CPU):
        e = FunctionEvent(i, name, thread=0, start_us=i, end_us=i + 1, device_type=device)
        if parent is not None:
            e.set_cpu_parent(parent)
        return e

    graph = event(0, "## Call CompiledFxGraph fabc ##")
    mul = event(1, "aten::mul")
    empty = event(2, "aten::empty", parent=mul)  # inside mul: not another operator call
    wrapper = event(3, "autograd::engine::evaluate_function: MulBackward0")
    backward_mul = event(4, "aten::mul", parent=wrapper)
    alloc = event(5, "aten::empty_strided", parent=graph)
    kernel = event(6, "triton_poi_fused_mul_0", device=DeviceType.CUDA)
    got = count_events([graph, mul, empty, wrapper, backward_mul, alloc, kernel])
    assert got == {"operators": 3, "compiled_graphs": 1, "device_kernels": 1}
    assert count_events([]) == {"operators": 0, "compiled_graphs": 0, "device_kernels": 0}
