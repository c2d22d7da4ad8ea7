"""The shell scripts: valid bash, and scripts/gpu_check.sh runs its steps with the arguments it documents (here
with a stand-in Python that records its arguments, so no GPU and no time are needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


SCRIPTS = sorted(str(p.relative_to(ROOT / "scripts")) for p in (ROOT / "scripts").rglob("*.sh"))  # scripts/peer too


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script):
    done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_gpu_check_runs_each_step_with_its_arguments(tmp_path):
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexit 0\n')
    fake.chmod(0o755)
    shared = tmp_path / "shared"
    (shared / "golden").mkdir(parents=True)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(out), "SHARED": str(shared), "DEVICE": "cpu",
           "C_BIN": "/opt/nanoBragg", "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failed steps: 0" in done.stdout
    calls = log.read_text().splitlines()
    assert any(c.startswith("-m pytest -q -m gpu tests/test_cuda.py") for c in calls), calls
    bench = [c for c in calls if c.startswith("-m nbtorch.tools.bench")]
    assert len(bench) == 2 and all("--device cpu" in c and "--c-bin /opt/nanoBragg --c-parity" in c for c in bench)
    refine = [c for c in calls if c.startswith("-m refine.tools.bench")]
    assert len(refine) == 2 and refine[0].endswith("--device cpu") and "--main-job" in refine[0]
    toml = Path(refine[0].split("--config ")[1].split()[0])
    text = toml.read_text()
    assert f"{shared}/real/thaumatin_i24_still/thau_3_2_0003.cbf.bz2" in text and "../shared" not in text
    tutorial = [c for c in calls if c.startswith("-m refine.cli --config")]
    assert len(tutorial) == 1 and tutorial[0].split("--config ")[1].split()[0] == str(toml)
    assert "--device cpu" in tutorial[0] and "--json" in tutorial[0]
    assert any(c.startswith("-c ") and "main_job_seconds" in c for c in calls), calls
    assert "--fractions" in refine[0] and all("--cuda-graph" not in c for c in bench)  # a CPU: no graphs
    assert "--problem cubic_mosflm --size 64" in refine[1] and refine[1].endswith("--device cpu")  # a serial still
    assert sorted(p.name for p in out.iterdir()) == ["steps.log"]  # one log (the harnesses' JSON: not faked)
    assert "=== refine_bench" in (out / "steps.log").read_text()


def test_gpu_check_runs_only_the_steps_asked_for(tmp_path):
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexit 0\n')
    fake.chmod(0o755)
    (tmp_path / "shared" / "golden").mkdir(parents=True)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out"), "SHARED": str(tmp_path / "shared"),
           "DEVICE": "cuda", "TMPDIR": str(tmp_path), "STEPS": "tutorial bench_heavy"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [c for c in log.read_text().splitlines() if c.startswith("-m ")]  # not the import checks
    assert [c.split()[1] for c in calls] == ["refine.cli", "nbtorch.tools.bench"], calls  # in the order asked for
    assert "--cuda-graph" in calls[1]
    env["STEPS"] = "tutorial nonsense"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 1 and "unknown step nonsense" in done.stdout
