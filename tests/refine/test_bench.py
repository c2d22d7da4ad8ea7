"""The refinement benchmark harness (``python -m refine.tools.bench``) runs end to end on a tiny synthetic problem,
eagerly, so that it cannot rot; no time is asserted."""

import json

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
    """A refinement's simulator: tiles of 2^19 evaluations on a CPU (few tiles, cache-sized), 2^22 on a GPU;
    the tile changes no pixel's value (tests/test_simulator.py), so the choice is speed alone."""
    from refine.cli.single import tile_evaluations

    assert tile_evaluations("cpu") == 1 << 19
    assert tile_evaluations("cuda") == tile_evaluations("cuda:1") == 1 << 22
    b = bench.build_objective(TINY)
    assert b.sim.max_evals_per_tile == tile_evaluations(b.sim.device)
