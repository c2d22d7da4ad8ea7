"""Every script of examples/python/ runs as docs/python.md says: the bank problem converges to its truth, and each
script on DIALS files prints what ``nbtorch-refine`` prints for the same files and options (the library's front
door, :mod:`refine.modes.entry`, is the command's), on the small synthetic DIALS data of tests/refine_cli (a still,
a three-image sweep; a step or two each, the script and the command both in this process); the serial set's script
runs on a file of two stills."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "refine_cli"))  # the synthetic DIALS data of the command's tests

from test_dials_still import still  # noqa: E402,F401 - the fixture
from test_dials_stills import stills  # noqa: E402,F401 - the fixture
from test_dials_sweep import CRYSTAL, sweep  # noqa: E402,F401 - the fixture

EXAMPLES = sorted((ROOT / "examples" / "python").glob("*.py"))
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "NANOBRAGG_DISABLE_COMPILE": "1"}


def _run(argv: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _lines(text: str) -> list[str]:
    """The printed lines with their wall times (``1.2 s``) left out: the rest is the same run's."""
    return [re.sub(r"\d+(\.\d+)? s\b", "T s", line) for line in text.splitlines()]


def _same_as_the_command(tmp_path: Path, script: str, args: list[str], command: list[str], capsys,
                         monkeypatch) -> list[str]:
    """Run the example and ``nbtorch-refine command`` each in a folder of its own; the command's lines are the
    example's first lines."""
    from refine.cli.main import main

    for name in ("py", "cli"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "py")
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "examples" / "python" / script), run_name="__main__")
    assert done.value.code == 0
    example = _lines(capsys.readouterr().out)
    monkeypatch.chdir(tmp_path / "cli")
    assert main(command) == 0
    cli = _lines(capsys.readouterr().out)
    assert example[:len(cli)] == cli
    return example


def test_there_are_examples():
    assert EXAMPLES, "examples/python/ holds no script"


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_docs_show_every_example(script):
    page = (ROOT / "docs" / "python.md").read_text(encoding="utf-8")
    assert f"examples/python/{script.name}" in page, f"docs/python.md does not show {script.name}"


def test_bank_problem_converges(tmp_path):
    out = _run([str(ROOT / "examples" / "python" / "refine_bank_problem.py")], tmp_path)
    assert "status: converged" in out, out[-2000:]


def test_still_from_dials_prints_what_the_command_prints(tmp_path, still, capsys, monkeypatch):
    files = [str(still / "obs.cbf"), str(still / "start.expt"), str(still / "obs.refl")]
    out = _same_as_the_command(tmp_path, "refine_still_from_dials.py", [*files, "--max-steps", "1", "--no-esds"],
                               ["--image", files[0], "--expt", files[1], "--refl", files[2], "--max-steps", "1",
                                "--no-esds", "--out", "out/still/result.h5"], capsys, monkeypatch)
    assert any(line.startswith("status: ") for line in out) and (tmp_path / "py" / "out/still/result.json").is_file()


def test_sweep_from_dials_prints_what_the_command_prints(tmp_path, sweep, capsys, monkeypatch):
    folder, _ = sweep
    expt, refl, images = str(folder / "truth.expt"), str(folder / "sweep.refl"), str(folder / "sweep_*.cbf")
    out = _same_as_the_command(tmp_path, "refine_sweep_from_dials.py",
                               [expt, refl, images, "--model", CRYSTAL, "--max-steps", "2", "--no-esds"],
                               ["--images", images, "--expt", expt, "--refl", refl, "--rotation-series", "--model",
                                CRYSTAL, "--max-steps", "2", "--no-esds", "--out-dir", "out/sweep"], capsys, monkeypatch)
    assert out[-1].startswith("shared: cell_a ") and (tmp_path / "py" / "out/sweep/joint.json").is_file()


def test_serial_from_dials_refines_the_files_stills_in_rounds(tmp_path, stills, capsys, monkeypatch):
    """The script alone (the still's and the sweep's tests show the front door prints the command's lines): its
    rounds, the stills it used, the files it wrote."""
    monkeypatch.chdir(tmp_path)
    expt, refl = str(stills / "many.expt"), str(stills / "many.refl")
    monkeypatch.setattr(sys, "argv", ["refine_serial_from_dials.py", expt, refl, "--max-steps", "1", "--no-esds"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "examples" / "python" / "refine_serial_from_dials.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0, out[-2000:]
    assert f"2 stills of --expt {expt}" in out and "refined jointly" in out and "in rounds" in out, out[-2000:]
    assert out.splitlines()[-1].startswith("used ") and (tmp_path / "out/serial/joint.json").is_file()
