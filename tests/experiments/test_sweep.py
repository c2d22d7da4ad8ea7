"""Optuna sweeps: a 4-trial sweep on 2 workers against SQLite, a resumed study, a killed worker; nbtorch-refine's
inputs and the best config reproducing its figure (synthetic, fast; a crop of the real still, slow)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[2]
# the fastest space: Adam, one stage (--max-steps steps), the loss and the scaling still vary
SPACE = 'optimizer = ["adam"]\nschedule = ["single"]\nloss = ["poisson", "gaussian"]\n' \
        'precondition = ["none", "diagonal"]\n[lr]\nlow = 0.01\nhigh = 0.2\nlog = true\n'


def _cmd(outdir: Path, *extra: str) -> list[str]:
    space = outdir / "space.toml"
    if not space.exists():
        outdir.mkdir(parents=True, exist_ok=True)
        space.write_text(SPACE)
    return [sys.executable, "-m", "experiments.sweep", "--size", "32", "--max-steps", "4", "--outdir", str(outdir),
            "--space", str(space), "--sampler-seed", "0", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "NANOBRAGG_DISABLE_COMPILE": "1"}


def _study(outdir: Path, name: str = "nbtorch-sweep"):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{outdir / 'sweep.db'}")


def test_sweep_two_workers_then_resume(tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run(_cmd(out, "--n-trials", "4", "--workers", "2"), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    trials = _study(out).trials
    assert len(trials) == 4
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert any(t.state.name == "COMPLETE" for t in trials)
    summary = json.loads((out / "sweep_summary.json").read_text())
    assert summary["trials"] == 4 and summary["worker_exit_codes"] == [0, 0]
    # one TensorBoard run per trial, hyper-parameters included
    for t in trials:
        assert any((out / "tb" / f"trial-{t.number:04d}").rglob("events.out.tfevents.*"))
    # the best trial as an nbtorch-refine config
    best = tomllib.loads((out / "best.toml").read_text())
    assert best["optimizer"] == "adam" and best["problem"] == "cubic_mosflm" and best["max-steps"] == 4
    assert best["loss"] in ("poisson", "gaussian") and 0.01 <= best["lr"] <= 0.2
    from refine.cli.parser import parse_args

    args = parse_args(["--config", str(out / "best.toml")])
    assert args.optimiser.optimizer == "adam" and args.optimiser.max_steps == 4 and args.model.problem == "cubic_mosflm"
    best_trial = _study(out).best_trial
    assert args.optimiser.precondition == best_trial.params["precondition"]
    from refine.modes.values import build_stages

    pre = None if args.optimiser.precondition == "none" else args.optimiser.precondition
    assert [s.precondition for s in build_stages(args)] == [pre]
    # the objective: parameter error relative to the start (1 = no progress)
    assert all(0.0 <= t.value < 10.0 for t in trials if t.state.name == "COMPLETE")
    # resume: the same study continues
    r = subprocess.run(_cmd(out, "--n-trials", "1"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(4 trials before)" in r.stdout
    assert len(_study(out).trials) == 5


def _trial_states(outdir: Path) -> list[str]:
    """Trial states read straight from the SQLite file (milliseconds; no Optuna storage set-up per poll)."""
    db = outdir / "sweep.db"
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0) as con:
            return [row[0] for row in con.execute("SELECT state FROM trials ORDER BY number")]
    except sqlite3.Error:  # the schema may not exist yet, or a writer holds the lock
        return []


def test_killed_worker_does_not_corrupt_the_study(tmp_path):
    out = tmp_path / "killed"
    beat = ("--heartbeat", "1", "--grace", "2")
    log = tmp_path / "worker.log"
    # a trial far longer than the test waits (single stage of 8000 steps), killed once it is RUNNING
    with log.open("w") as sink:
        proc = subprocess.Popen(_cmd(out, "--n-trials", "1", "--max-steps", "8000", *beat), cwd=ROOT, env=_env(),
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and "RUNNING" not in _trial_states(out):
            time.sleep(0.1)
        running = proc.poll() is None and "RUNNING" in _trial_states(out)
        assert running, (f"no running trial seen (worker exit code {proc.poll()}, states {_trial_states(out)}):\n"
                         + log.read_text()[-3000:])
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert [t.state.name for t in _study(out).trials] == ["RUNNING"]
    time.sleep(3.5)  # longer than the grace period
    r = subprocess.run(_cmd(out, "--n-trials", "1", *beat), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    states = [t.state.name for t in _study(out).trials]
    assert states[0] == "FAIL"
    assert states[1:] == ["COMPLETE"]


# ------------------------------------------------------------------ nbtorch-refine's inputs (issue #32)
def _reproduce(best: Path, workdir: Path) -> dict:
    """``nbtorch-refine --config best`` (in-process, from ``workdir``): its result.json."""
    from refine.cli.main import main as refine_main

    old = os.getcwd()
    os.chdir(workdir)
    try:
        assert refine_main(["--config", str(best), "--quiet", "--no-esds"]) == 0
    finally:
        os.chdir(old)
    text = best.read_text()
    out = tomllib.loads(text)["out"]
    return json.loads((workdir / Path(out).with_suffix(".json")).read_text())


@pytest.mark.parametrize("objective", ["excess", "loss"])
def test_best_config_reproduces_the_figure(tmp_path, objective, capsys):
    """Two trials in-process on a config of nbtorch-refine's options (ROI, subsample): the best trial's
    config, run by nbtorch-refine, gives the trial's figure (the fit excess or the final loss)."""
    from experiments.sweep import main

    (tmp_path / "run.toml").write_text('problem = "cubic_mosflm"\nsize = 32\nroi = [2, 29, 2, 29]\n'
                                       'subsample = 0.6\nseed = 5\nmax-steps = 3\nout = "not/written.h5"\n')
    (tmp_path / "space.toml").write_text('optimizer = ["lbfgs", "adam"]\nschedule = ["single"]\nloss = ["poisson"]\n'
                                         'precondition = ["none"]\nlr = [0.05, 0.5]\n')
    out = tmp_path / "sweep"
    argv = ["--config", str(tmp_path / "run.toml"), "--space", str(tmp_path / "space.toml"), "--n-trials", "2",
            "--objective", objective, "--outdir", str(out), "--sampler-seed", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("] trial ") == 2 and "worker peak memory" in printed  # progress: a line per trial
    summary = json.loads((out / "sweep_summary.json").read_text())
    best = summary["best"]
    assert summary["objective"] == objective and best["figures"]["compile_mode"] == "eager"
    best_toml = tomllib.loads((out / "best.toml").read_text())
    assert best_toml["roi"] == [2, 29, 2, 29] and best_toml["subsample"] == 0.6 and best_toml["seed"] == 5
    assert not (tmp_path / "not").exists()
    result = _reproduce(out / "best.toml", tmp_path)
    got = result["fit"]["excess"] if objective == "excess" else result["loss_final"]
    assert got == pytest.approx(best["value"], rel=1e-9)
    assert result["input"]["problem"] == "cubic_mosflm"


REAL = ROOT.parent / "shared" / "real" / "thaumatin_i24_still"


@pytest.mark.slow
@pytest.mark.skipif(not REAL.is_dir(), reason="the real thaumatin still is not here")
def test_real_crop_sweep_and_reproduction(tmp_path):
    """The tutorial's config on a crop of the real still: two short trials of the image space (mosaic domains,
    crystal size), the fit excess as objective; nbtorch-refine --config best.toml gives the same excess."""
    (tmp_path / "space.toml").write_text('optimizer = ["lbfgs"]\nschedule = ["single"]\nprecondition = ["none"]\n'
                                         'lr = [1.0]\nmosaic_domains = [10]\ncrystal_size = [10, 20]\n')
    out = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("NANOBRAGG_DISABLE_COMPILE", "NANOBRAG_DISABLE_COMPILE")}
    r = subprocess.run([sys.executable, "-m", "experiments.sweep", "--config", "examples/thaumatin_still.toml",
                        "--roi", "1012", "1511", "1057", "1556", "--max-steps", "5", "--n-trials", "2",
                        "--space", str(tmp_path / "space.toml"), "--outdir", str(out), "--sampler-seed", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "sweep_summary.json").read_text())
    assert summary["objective"] == "excess" and summary["states"] == {"COMPLETE": 2}
    assert all(t["figures"]["worker_peak_rss_gb"] < 4.0 for t in summary["trial_list"])
    best = tomllib.loads((out / "best.toml").read_text())
    assert "-mosaic_dom 10" in best["model"] and best["max-steps"] == 5
    r = subprocess.run([sys.executable, "-m", "refine.cli", "--config", str(out / "best.toml"), "--no-esds"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((out / "best" / "result.json").read_text())
    assert result["fit"]["excess"] == pytest.approx(summary["best"]["value"], rel=1e-6)
