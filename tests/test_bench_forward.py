"""The forward benchmark harness (``python -m nbtorch.tools.bench``) on a tiny eager problem, so that it cannot rot:
its environment guard (:func:`~nbtorch.tools.bench.compile_env`), its JSON records, ``--disable-compile``,
``--profile`` and its one-line errors.  No time is asserted; the compiled run is ``-m slow``."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.tools import bench

VAR = "NANOBRAGG_DISABLE_COMPILE"
TINY = ["--sizes", "32", "--iterations", "1", "--case", "cubic"]
RECORD_KEYS = {"size", "case", "dtype", "device", "cold_s", "warm_s", "warm_min_s", "warm_max_s", "compile_mode",
               "compile_reason", "construct_s", "evaluations", "ns_per_evaluation", "peak_rss_mb", "c_command"}
DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"


@pytest.fixture(autouse=True)
def _leave_the_process_alone(monkeypatch):
    """main() tunes glibc's malloc and sets torch's threads for the whole process: not in the test process."""
    monkeypatch.setattr(bench.runtime, "tune_allocator", lambda: False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _set(monkeypatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)


def _run(argv: list[str], capsys) -> tuple[list[dict], str]:
    """main() on the tiny problem: (the JSON records printed, everything printed)."""
    assert bench.main(TINY + ["--threads", str(torch.get_num_threads())] + argv) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], out


# --- compile_env ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("before", [None, "0", "1", ""])
@pytest.mark.parametrize("disable", [True, False])
def test_compile_env_sets_then_restores_the_callers_environment(monkeypatch, before, disable):
    _set(monkeypatch, before)
    with bench.compile_env(disable):
        assert os.environ.get(VAR) == ("1" if disable else before)
    assert os.environ.get(VAR) == before  # None: unset again, not left as "" or "1"


@pytest.mark.parametrize("before", [None, "0"])
def test_compile_env_restores_after_an_error(monkeypatch, before):
    _set(monkeypatch, before)
    with pytest.raises(RuntimeError, match="boom"):
        with bench.compile_env(True):
            raise RuntimeError("boom")
    assert os.environ.get(VAR) == before


def test_compile_env_decides_what_a_simulator_runs(monkeypatch):
    """Inside compile_env(True) a simulator is eager because of the variable; with the variable unset and
    compile_env(False) it compiles (constructed only: nothing is compiled before the first call)."""
    cfg = config_from_args(bench.case_args("cubic", 16))
    _set(monkeypatch, None)
    with bench.compile_env(True):
        sim = Simulator(cfg)
    assert (sim.compile_mode, sim.compile_reason) == ("eager", "environment variable")
    with bench.compile_env(False):
        sim = Simulator(cfg)
    assert sim.compile_mode == "compiled", sim.compile_reason


# --- main() -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("before", [None, "0"])
def test_disable_compile_runs_eager_writes_the_records_and_restores_the_environment(monkeypatch, tmp_path, capsys,
                                                                                   before):
    _set(monkeypatch, before)
    out = tmp_path / "bench.json"
    printed, _ = _run(["--disable-compile", "--json", str(out)], capsys)
    assert os.environ.get(VAR) == before
    records = json.loads(out.read_text())
    assert records == printed and len(records) == 2
    header, rec = records
    assert {"machine", "python", "torch", "threads", "cpu_count", "device_name", "date"} <= set(header)
    assert header["threads"] == torch.get_num_threads()
    assert RECORD_KEYS <= set(rec), RECORD_KEYS - set(rec)
    assert (rec["compile_mode"], rec["compile_reason"]) == ("eager", "environment variable")
    assert (rec["size"], rec["case"], rec["dtype"], rec["device"]) == (32, "cubic", "float32", "cpu")
    assert rec["evaluations"] == 32 * 32  # cubic: one evaluation per pixel
    assert 0 < rec["warm_min_s"] <= rec["warm_s"] <= rec["warm_max_s"] and rec["cold_s"] > 0
    assert "-detpixels 32" in rec["c_command"] and "profile_evaluations" not in rec


def test_the_record_reports_a_callers_disable_variable(monkeypatch, capsys):
    """Without --disable-compile the harness leaves the environment as it is: a shell that disables compile gets
    eager, and the record says so and why."""
    monkeypatch.setenv(VAR, "1")
    (_, rec), _ = _run([], capsys)
    assert (rec["compile_mode"], rec["compile_reason"]) == ("eager", "environment variable")
    assert os.environ[VAR] == "1"


def test_profile_prints_the_profilers_table(monkeypatch, capsys):
    _set(monkeypatch, None)
    (_, rec), out = _run(["--disable-compile", "--profile", "2", "--grad"], capsys)
    assert rec["profile_evaluations"] == 2 and "profile" not in rec  # the table is printed, not kept in the JSON
    assert "grad_s" in rec and rec["compile_mode"] == "eager"
    assert "torch profiler, 2 forward evaluations, cubic 32x32:" in out
    assert "Self CPU" in out and "Name" in out
    assert os.environ.get(VAR) is None


@pytest.mark.parametrize("argv", [["--profile", "-1"], ["--iterations", "0"], ["--threads", "0"], ["--sizes", "0"],
                                  ["--sizes", "32,x"], ["--c-bin", "/nonexistent/nanoBragg"], ["--cuda-graph"]])
def test_bad_arguments_are_one_line(capsys, argv):
    assert bench.main(TINY + argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench: ") and "\n" not in err


def test_every_option_has_help():
    parser = bench.build_parser()
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not missing, f"options without help text: {missing}"
    help_text = " ".join(parser.format_help().split())
    assert "--disable-compile run eager: NANOBRAGG_DISABLE_COMPILE=1" in help_text
    assert "--profile N print the torch profiler's table" in help_text


def test_two_sizes_give_the_fixed_cost_and_kernels_per_call(monkeypatch, tmp_path, capsys):
    """Every record counts the operators (and a GPU's kernels) of one forward; two sizes fit a fixed cost per call
    and a cost per evaluation, printed and in the header of the JSON."""
    _set(monkeypatch, "1")
    out = tmp_path / "bench.json"
    assert bench.main(["--sizes", "16,32", "--iterations", "2", "--case", "cubic", "--grad", "--json", str(out)]) == 0
    header, *records = json.loads(out.read_text())
    assert all(r["operators_per_call"] > 0 and r["device_kernels_per_call"] == 0 for r in records)  # a CPU
    fits = header["fixed_cost"]
    assert set(fits) == {"warm_s", "grad_s"} and all(set(f) >= {"fixed_s", "ns_per_sample"} for f in fits.values())
    assert "fixed cost per call + cost per evaluation" in capsys.readouterr().out
    assert bench.fixed_cost_record(records[:1]) == {}  # one size: nothing to fit


@pytest.mark.slow
def test_compiled_run_is_recorded_as_compiled(monkeypatch, capsys):
    """The harness's compiled path end to end (one ~15-25 s compile of a 32x32 cubic image unless cached)."""
    _set(monkeypatch, None)
    (_, rec), _ = _run([], capsys)
    assert (rec["compile_mode"], rec["compile_reason"]) == ("compiled", "default (compile on)")
    assert os.environ.get(VAR) is None


# --- the recorded pair of runs ----------------------------------------------------------------------------------
def test_performance_doc_records_an_eager_and_a_compiled_run_of_each_case():
    text = DOC.read_text(encoding="utf-8")
    heading = "## Eager against compiled (forward harness)"
    assert heading in text, f"{DOC.name}: no section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    assert "--disable-compile" in section
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] in bench.CASES:
            rows[cells[0]] = cells
    assert set(rows) == set(bench.CASES), f"rows for {sorted(rows)}, expected {sorted(bench.CASES)}"
    for case, (_, size, eager, compiled, ratio, *rest) in rows.items():
        assert re.fullmatch(r"\d+²", size), (case, size)
        e, c, r = (float(re.sub(r"[^0-9.]", "", v)) for v in (eager, compiled, ratio))
        assert e > 0 and c > 0 and abs(r - e / c) <= 0.06 * e / c + 0.05, (case, eager, compiled, ratio)


def test_panels_with_c_bin_run_the_c_program_once_per_panel(monkeypatch, tmp_path, capsys):
    """``--panels N --c-bin``: the C program (here a stand-in that records its arguments and writes each panel's
    image as nbtorch renders it) runs on the whole detector and then once per panel on the panel's own lines."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "nanoBragg"
    fake.write_text(
        f"#!{sys.executable}\nimport sys, numpy as np\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "a = sys.argv[1:]\nn = int(a[a.index('-detpixels') + 1])\n"
        "rows = int(a[a.index('-detpixels_s') + 1]) if '-detpixels_s' in a else n\n"
        "np.arange(rows * n, dtype='<f4').tofile('c.bin')\n")
    fake.chmod(0o755)
    _set(monkeypatch, "1")
    printed, _ = _run(["--panels", "4", "--c-bin", str(fake)], capsys)
    rec = printed[1]
    calls = log.read_text().splitlines()
    assert len(calls) == 5 and "-detpixels_s" not in calls[0]
    assert [c.split("-detpixels_s ")[1].split()[0] for c in calls[1:]] == ["8"] * 4
    xbeam = [float(c.split("-Xbeam ")[1].split()[0]) for c in calls[1:]]
    assert xbeam == pytest.approx([xbeam[0] - 0.8 * i for i in range(4)])  # 8 rows of 0.1 mm further each
    assert rec["panels"] == 4 and {"c_panels_s", "speedup_vs_c_panels", "corr_vs_c_panels", "c_panels_over_c"} <= set(rec)
