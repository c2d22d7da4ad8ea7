"""Hyper-parameter sweeps of the refinement with optuna.

Usage::

    python -m experiments.sweep --n-trials N [--storage URL] [--study NAME] [--workers K] [--timeout S]
        [--space space.toml] [--objective error|excess|spot_rms|loss] [--outdir DIR] [--sampler-seed S]
        [any nbtorch-refine option: --config run.toml, --image OBS --model "<flags>", --problem NAME,
         --roi, --spots, --spot-window, --subsample, --max-steps, --time-budget, ...]

The inputs are nbtorch-refine's, prepared by the same code (:func:`refine.modes.single.prepare`), so a
tutorial config sweeps its own still on the pixels its refinement fits.  Each trial is one nbtorch-refine
refinement (the same arguments to :func:`refine.refine`, no output files) whose options are the given
ones with settings drawn from the search space: optimiser (``adam``/``lbfgs``), learning rate, loss,
schedule (``stage_a``: ``--stages stage_a``; ``single``: one ``--refine`` stage), LBFGS history size,
parameter scaling (``--precondition``) and, for a measured image, the starting model's mosaic domains
(``-mosaic_dom``) and crystal size (``-N``).

Objective (``--objective``, minimised): ``error`` (the parameter error left against a problem's truth,
:func:`experiments.workload.parameter_error`: 1 = the start, 0 = the truth; the default with a truth),
``excess`` (the final loss over the shot-noise expectation of the refined model, nbtorch-refine's
``fit:`` line; the default for a measured image; needs the Poisson loss), ``spot_rms`` (the rms offset of
the observed spots from the refined model's, px: nbtorch-refine's ``spots: final rms``; needs
``--spots``/``--refl``) or ``loss`` (the final loss; one loss in the space).  ``error`` and ``loss`` are
reported every step, so the pruner (``MedianPruner``) can stop a bad trial early.

Storage: ``sqlite:///DIR/sweep.db`` by default; any optuna storage URL otherwise.  The study is created
once, before ``--workers K`` processes share the ``N`` trials; running again with the same ``--study``
continues it.  RDB storages keep a heartbeat, so a worker killed mid-trial leaves a trial that the next
worker marks FAIL.  Each finished trial prints a line (value, settings, seconds, the worker's peak memory).

Outputs in ``--outdir``: ``tb/trial-NNNN`` (one TensorBoard run per trial, with ``add_hparams``),
``best.toml`` (the best trial's options for ``nbtorch-refine --config``: it reproduces the trial's figure)
and ``sweep_summary.json``.

Exit status 0 when a trial completed, 1 when none did; bad input (a flag, a value, the space file, the
storage URL, anything nbtorch-refine refuses) is one line ``... error: ...`` on stderr and exit status 2,
before anything is simulated or written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import optuna

import nbtorch
from experiments.workload import (IMAGE_FREE, Workload, experiment_parser, load_workload, parameter_error,
                                  parse_experiment, refine_config_toml)
from losses import LOSSES
from nbtorch.cli.support import Printer, check_output_dir, int_at_least, make_output_dir, positive_float, run_main
from nbtorch.errors import InputError
from nbtorch.io import read_toml
from refine import refine
from refine.cli.options import Options
from refine.inputs.spots import spot_offsets
from refine.solver.precondition import PRECONDITIONER_NAMES

warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

__all__ = ["DEFAULT_SPACE", "IMAGE_SPACE", "OBJECTIVES", "load_space", "check_space", "make_storage",
           "make_objective", "trial_options", "SweepOptions", "main"]

DEFAULT_SPACE: dict[str, Any] = {
    "optimizer": ["adam", "lbfgs"],
    "lr": {"low": 0.01, "high": 1.0, "log": True},
    "loss": ["poisson", "gaussian"],
    "schedule": ["stage_a", "single"],
    "history_size": {"low": 3, "high": 30, "int": True},
    "precondition": ["none", "diagonal"],
}
#: a measured image's default: the Poisson loss (``excess`` is the Poisson deviance's), and the starting model
IMAGE_SPACE: dict[str, Any] = {**DEFAULT_SPACE, "loss": ["poisson"], "mosaic_domains": [5, 10, 20],
                               "crystal_size": {"low": 5, "high": 30, "int": True, "log": True}}
#: names that change the starting model's flags (a measured image's: a --problem's model is the bank's)
MODEL_NAMES = {"mosaic_domains": "-mosaic_dom", "crystal_size": "-N"}
#: the values a categorical entry may take (``precondition = "none"``: no scaling)
CHOICES: dict[str, tuple[str, ...]] = {
    "optimizer": ("adam", "lbfgs"),
    "schedule": ("stage_a", "single"),
    "precondition": PRECONDITIONER_NAMES,
}
#: entries that are numbers (a list of values or a range), with their lower limit
NUMBERS: dict[str, tuple[float, bool]] = {"lr": (0, False), "history_size": (1, True), "mosaic_domains": (1, True),
                                          "crystal_size": (1, True)}  # (limit, integer)
#: the figures a trial can be judged by (see the module docstring)
OBJECTIVES = ("error", "excess", "spot_rms", "loss")
#: nbtorch-refine's options a trial sets (written to best.toml even where they are the default)
TRIAL_OPTIONS = ("optimizer", "lr", "loss", "history_size", "precondition", "max_steps", "stages", "refine")
#: steps per stage when --max-steps is not given (stage_a: each coarse stage, the final one 5x; single: 4x)
DEFAULT_STEPS = 3


def _loss_names() -> tuple[str, ...]:
    return tuple(LOSSES)  # the registry's names (poisson first)


def _check_number(where: str, name: str, value: Any) -> float:
    limit, integer = NUMBERS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where}: expected a finite number, got {value!r}")
    if integer and int(value) != value:
        raise InputError(f"{where}: expected an integer, got {value!r}")
    if (value < limit) if integer else (value <= limit):
        raise InputError(f"{where}: must be {'>=' if integer else '>'} {limit}, got {value!r}")
    return value


def _check_list(at: str, name: str, spec: list) -> None:
    if not spec:
        raise InputError(f"{at}: empty list")
    if name in NUMBERS:
        for v in spec:
            _check_number(at, name, v)
        return
    valid = _loss_names() if name == "loss" else CHOICES[name]
    bad = [v for v in spec if not isinstance(v, str) or v not in valid]
    if bad:
        raise InputError(f"{at}: unknown value(s) {', '.join(map(repr, bad))}; valid: {', '.join(valid)}")


def _check_range(at: str, name: str, spec: dict) -> dict:
    if name not in NUMBERS:
        raise InputError(f"{at}: a range is only for {', '.join(NUMBERS)}; give a list of values")
    unknown = set(spec) - {"low", "high", "log", "int"}
    if unknown:
        raise InputError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}; valid: low, high, log, int")
    for key in ("log", "int"):
        if key in spec and not isinstance(spec[key], bool):
            raise InputError(f"{at}: {key} must be true or false, got {spec[key]!r}")
    if "low" not in spec or "high" not in spec:
        raise InputError(f"{at}: a range needs both low and high")
    low, high = (_check_number(f"{at}.{k}", name, spec[k]) for k in ("low", "high"))
    if low > high:
        raise InputError(f"{at}: low ({low!r}) is greater than high ({high!r})")
    if spec.get("int") and (int(low) != low or int(high) != high):
        raise InputError(f"{at}: int = true needs integer low and high, got {low!r} and {high!r}")
    return {**spec, "int": True} if NUMBERS[name][1] else spec


def check_space(space: dict[str, Any], where: str = "search space") -> dict[str, Any]:
    """Check every entry of a search space; returns it with the integer entries always drawn as integers."""
    out = dict(space)
    for name, spec in space.items():
        at = f"{where}: {name}"
        if isinstance(spec, list):
            _check_list(at, name, spec)
        elif isinstance(spec, dict):
            out[name] = _check_range(at, name, spec)
        else:
            raise InputError(f"{at}: expected a list of values or a [{name}] table with low and high, got {spec!r}")
    return out


def load_space(path: str | None, image: bool = False) -> dict[str, Any]:
    """The default search space (:data:`IMAGE_SPACE` for a measured image) updated by a ``--space`` TOML file
    (checked: :class:`InputError` if bad)."""
    space = dict(IMAGE_SPACE if image else DEFAULT_SPACE)
    if path:
        user = read_toml(path, "--space")
        unknown = set(user) - set(IMAGE_SPACE)
        if unknown:
            raise InputError(f"--space {path}: unknown name(s) {', '.join(sorted(unknown))}; "
                             f"valid: {', '.join(IMAGE_SPACE)}")
        model = sorted(set(user) & set(MODEL_NAMES))
        if model and not image:
            raise InputError(f"--space {path}: {', '.join(model)} change a measured image's starting model "
                             "(--image); a --problem's model is the bank's")
        space.update(user)
    return check_space(space, f"--space {path}" if path else "search space")


def choose_objective(name: str | None, w: Workload, space: Mapping[str, Any]) -> str:
    """The objective (``name``, or ``error`` with a truth and ``excess`` without), checked against the inputs."""
    objective = name or ("error" if w.truth is not None else "excess")
    losses = space["loss"] if isinstance(space["loss"], list) else []
    if objective == "error" and w.truth is None:
        raise InputError("--objective error: needs a truth (a --problem); for a measured image use excess, "
                         "spot_rms or loss")
    if objective == "excess" and losses != ["poisson"]:
        raise InputError("--objective excess: the fit excess is the Poisson deviance's; give loss = [\"poisson\"] "
                         "in --space")
    if objective == "spot_rms" and w.prepared.choice.spots is None:
        raise InputError("--objective spot_rms: needs observed spots (--spots FILE or find, or --refl)")
    if objective == "loss" and len(losses) != 1:
        raise InputError("--objective loss: final losses of different losses do not compare; give one loss "
                         "in --space (e.g. loss = [\"poisson\"])")
    return objective


def _suggest(trial: optuna.Trial, name: str, spec: Any) -> Any:
    if isinstance(spec, list):
        return trial.suggest_categorical(name, spec)
    if spec.get("int"):
        return trial.suggest_int(name, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log", False)))
    return trial.suggest_float(name, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log", False)))


def suggest(trial: optuna.Trial, space: Mapping[str, Any]) -> dict:
    """The trial's settings drawn from ``space`` (``history_size`` for LBFGS only)."""
    params = {name: _suggest(trial, name, space[name])
              for name in ("optimizer", "lr", "loss", "schedule", "precondition", *MODEL_NAMES) if name in space}
    if params["optimizer"] == "lbfgs":
        params["history_size"] = _suggest(trial, "history_size", space["history_size"])
    return params


def trial_options(base: Options, params: Mapping[str, Any], free_default: tuple[str, ...] | None = None) -> Options:
    """``base`` with a trial's settings: what nbtorch-refine then runs (and ``best.toml`` holds).

    ``single``: one ``--refine`` stage of ``base``'s ``--refine`` names (else ``free_default``, else
    :data:`IMAGE_FREE`); ``stage_a``: ``--stages stage_a``.  ``--max-steps``: ``base``'s, else
    :data:`DEFAULT_STEPS` (``single``: 4x).  The model's ``-mosaic_dom`` and ``-N`` go after its own flags."""
    single = params["schedule"] == "single"
    fields: dict[str, Any] = {
        "optimizer": params["optimizer"], "lr": float(params["lr"]), "loss": params["loss"],
        "precondition": params["precondition"], "stage_tables": None,
        "history_size": int(params["history_size"]) if params["optimizer"] == "lbfgs" else None,
        "max_steps": base.optimiser.max_steps or (4 * DEFAULT_STEPS if single else DEFAULT_STEPS),
    }
    if single:
        fields.update(stages=None, refine=tuple(base.fit.refine or free_default or IMAGE_FREE))
    else:
        fields.update(stages="stage_a", refine=None)
    flags = [f"{flag} {int(params[name])}" for name, flag in MODEL_NAMES.items() if name in params]
    if flags:
        fields["model"] = " ".join([base.model.model or "", *flags]).strip()
    return base.with_fields(**fields)


def make_storage(url: str, heartbeat_s: int = 10, grace_s: int = 30):
    """An optuna storage for ``url`` (RDB URLs get a heartbeat; ``journal:PATH`` a journal file).

    A URL that cannot be opened (unknown scheme, missing driver, unreachable database, journal
    file in a missing folder) raises :class:`InputError` naming ``--storage``.
    """
    try:
        if url.startswith("journal:"):
            # here, not on top: optuna < 4 has no JournalFileBackend, an unusable --storage like the others
            from optuna.storages import JournalStorage
            from optuna.storages.journal import JournalFileBackend

            return JournalStorage(JournalFileBackend(url[len("journal:"):]))
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
        return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s, **kwargs)
    except Exception as exc:  # sqlalchemy, driver import and OS errors: all say the URL is unusable
        raise InputError(f"--storage {url}: cannot open: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _Pruned(Exception):
    """Raised from a callback to stop a pruned trial's refinement."""


def _not_pruned(record) -> bool:
    """Logging filter: drop the loop's traceback of a step stopped by :class:`_Pruned`."""
    return not (record.exc_info and isinstance(record.exc_info[1], _Pruned))


class TrialCallback:
    """Logs the loss (and the objective, where it is known every step) to TensorBoard; reports ``error`` and
    ``loss`` to the trial every step and stops the run once pruned."""

    def __init__(self, trial: optuna.Trial, w: Workload, writer: Any, objective: str) -> None:
        self.trial, self.w, self.writer, self.objective = trial, w, writer, objective
        self.pruned = False
        self.last = float("nan")

    def on_run_start(self, info: Any) -> None:
        pass

    def on_stage_start(self, stage: Any, index: int) -> None:
        pass

    def on_step(self, state: Any) -> None:
        if self.pruned:
            raise _Pruned()
        self.writer.add_scalar("loss", state.loss, state.step)
        if self.objective not in ("error", "loss"):
            return
        v = float(state.loss) if self.objective == "loss" else parameter_error(state.canonical, self.w.start,
                                                                               self.w.truth)
        self.last = v
        self.writer.add_scalar("objective", v, state.step)
        if math.isfinite(v):
            self.trial.report(v, state.step)
            if self.trial.should_prune():
                self.pruned = True
                raise _Pruned()

    def on_stage_end(self, stage: Any, index: int, status: Any, message: str) -> None:
        pass

    def on_run_end(self, result: Any) -> None:
        pass


def figures(w: Workload, result, objective: str) -> dict[str, float]:
    """The run's quality figures: ``loss``, ``excess`` (NaN without the Poisson loss), ``error`` (with a truth),
    ``spot_rms`` (when it is the objective: one render of the windows around the spots)."""
    out = {"loss": float(result.loss_final), "excess": float((result.fit or {}).get("excess", math.nan))}
    if w.truth is not None:
        out["error"] = parameter_error(result.params, w.start, w.truth)
    if objective == "spot_rms":
        with nbtorch.eager():  # a few small windows: not worth a compiled graph
            out["spot_rms"] = spot_offsets(w.prepared.sim, dict(result.params), w.prepared.choice.spots).rms()
    return out


def _peak_rss_gb() -> float:
    """This process's peak resident memory so far (GB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def make_objective(base: Options, space: dict, objective: str, outdir: Path, free_default=None):
    """``trial -> value``: nbtorch-refine's refinement of ``trial_options(base, drawn settings)``."""

    def run(trial: optuna.Trial) -> float:
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard costs ~0.5 s of startup

        params = suggest(trial, space)
        t0 = time.perf_counter()
        w = load_workload(trial_options(base, params, free_default), say=lambda *a, **k: None)
        writer = SummaryWriter(log_dir=str(outdir / "tb" / f"trial-{trial.number:04d}"))
        cb = TrialCallback(trial, w, writer, objective)
        value, found, state = float("nan"), {}, "complete"
        try:
            try:
                result = refine(w.prepared.sim, w.observed, **w.refine_kwargs(), callbacks=[cb], progress=False,
                                esds=False)
            except _Pruned:
                result = None
            if cb.pruned:
                state, value = "pruned", cb.last
                raise optuna.TrialPruned(f"pruned at objective {cb.last:.4g}")
            found = figures(w, result, objective)
            value = found[objective]
            for k, v in {**found, "status": result.status.value, "steps": int(result.steps),
                         "compile_mode": w.prepared.sim.compile_mode}.items():
                trial.set_user_attr(k, v)
            return value if math.isfinite(value) else float("inf")
        finally:
            trial.set_user_attr("seconds", time.perf_counter() - t0)
            trial.set_user_attr("worker_peak_rss_gb", _peak_rss_gb())
            hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in trial.params.items()}
            hp["trial_state"] = state
            metrics = {f"hparam/{k}": (v if math.isfinite(v) else 1e30) for k, v in
                       {"objective": value, **{k: found.get(k, math.nan) for k in ("loss", "excess")}}.items()}
            writer.add_hparams(hp, metrics, run_name=".")
            writer.close()

    return run


def _progress(worker: int, objective: str):
    """optuna callback: one line per finished trial."""

    def say(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        value = "" if trial.value is None else f" {objective} {trial.value:.6g}"
        a = trial.user_attrs
        settings = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in trial.params.items())
        print(f"  [worker {worker}] trial {trial.number} {trial.state.name}{value} ({settings}); "
              f"{a.get('seconds', math.nan):.0f} s, worker peak memory {a.get('worker_peak_rss_gb', math.nan):.2f} GB",
              flush=True)

    return say


@dataclass(frozen=True)
class SweepOptions:
    """The script's own options (the rest are nbtorch-refine's)."""

    n_trials: int
    storage: str | None
    study: str
    workers: int
    timeout: float | None
    space: str | None
    objective: str | None
    outdir: str
    sampler_seed: int | None
    heartbeat: int
    grace: int
    worker_index: int | None


PROG = "python -m experiments.sweep"


def build_parser() -> argparse.ArgumentParser:
    """The script's options, then nbtorch-refine's option groups."""
    ap, g = experiment_parser(PROG, __doc__.split("\n")[0], "sweep")
    g.add_argument("--n-trials", type=int_at_least(1), required=True, help="trials to run now (over all workers)")
    g.add_argument("--storage", help="optuna storage URL (default sqlite:///OUTDIR/sweep.db)")
    g.add_argument("--study", default="nbtorch-sweep", help="study name (same name = resume; default %(default)s)")
    g.add_argument("--workers", type=int_at_least(1), default=1, help="worker processes (default 1: in this process)")
    g.add_argument("--timeout", type=positive_float, help="stop starting trials after this many seconds (per worker; "
                                                          "--time-budget bounds each trial's refinement)")
    g.add_argument("--space", help="TOML search space overriding the default (docs/hyperparameter-sweeps.md)")
    g.add_argument("--objective", choices=OBJECTIVES, help="figure to minimise (default: error with a --problem's "
                                                           "truth, excess for a measured image)")
    g.add_argument("--outdir", default="out/sweep", help="output folder (default %(default)s)")
    g.add_argument("--sampler-seed", type=int_at_least(0), help="sampler seed (each worker adds its index)")
    g.add_argument("--heartbeat", type=int_at_least(1), default=10,
                   help="RDB heartbeat period, s (default %(default)s)")
    g.add_argument("--grace", type=int_at_least(1), default=30,
                   help="a RUNNING trial silent this long is failed (s, > --heartbeat; default %(default)s)")
    g.add_argument("--worker-index", type=int_at_least(0), help=argparse.SUPPRESS)  # internal: run as worker i
    return ap


def parse_args(argv: list[str]) -> tuple[Options, SweepOptions]:
    """Parse and check the arguments (no file, storage or simulation touched but ``--config``)."""
    options, own = parse_experiment(argv, build_parser(), SweepOptions)
    if own.grace <= own.heartbeat:
        raise InputError(f"--grace {own.grace}: must be greater than --heartbeat ({own.heartbeat}), or live "
                         f"trials would be failed between two heartbeats")
    if own.sampler_seed is not None and own.sampler_seed + own.workers - 1 > 2**32 - 1:
        raise InputError(f"--sampler-seed {own.sampler_seed}: must be <= {2**32 - own.workers} (each worker adds "
                         "its index)")
    if not own.study.strip():
        raise InputError("--study: empty name")
    return options, own


def _pruner() -> optuna.pruners.BasePruner:
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2)


def _run_worker(options: Options, own: SweepOptions, url: str, n: int, index: int, w: Workload | None = None) -> None:
    logging.getLogger("refine.solver.loop").addFilter(_not_pruned)
    if w is None:
        w = load_workload(options, say=lambda *a, **k: None)
    space = load_space(own.space, image=options.model.problem is None)
    objective = choose_objective(own.objective, w, space)
    storage = make_storage(url, own.heartbeat, own.grace)
    seed = None if own.sampler_seed is None else own.sampler_seed + index
    study = optuna.load_study(study_name=own.study, storage=storage, pruner=_pruner(),
                              sampler=optuna.samplers.TPESampler(seed=seed))
    optuna.storages.fail_stale_trials(study)  # trials of crashed workers -> FAIL (a no-op without heartbeat)
    run = make_objective(options, space, objective, Path(own.outdir), w.prepared.inputs.free_default)
    if n > 0:
        study.optimize(run, n_trials=n, timeout=own.timeout, catch=(Exception,),
                       callbacks=[_progress(index, objective)])


def _create_study(own: SweepOptions, url: str):
    storage = make_storage(url, own.heartbeat, own.grace)
    try:
        study = optuna.create_study(study_name=own.study, storage=storage, direction="minimize", pruner=_pruner(),
                                    load_if_exists=True)
    except Exception as exc:  # not an optuna database, a study of the other direction, ...
        raise InputError(f"--storage {url}: cannot create or load study {own.study!r}: {_first_line(exc)}") from None
    return storage, study


def _launch(argv: list[str], options: Options, own: SweepOptions, url: str, w: Workload) -> list[int]:
    """Run the trials: in this process (one worker) or ``k`` worker processes sharing them; their exit codes."""
    k = min(own.workers, own.n_trials)  # no idle worker
    shares = [own.n_trials // k + (1 if i < own.n_trials % k else 0) for i in range(k)]
    if k == 1:
        _run_worker(options, own, url, shares[0], 0, w)
        return [0]
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.sweep", *argv, "--n-trials", str(n), "--storage",
                               url, "--worker-index", str(i)], env=os.environ.copy()) for i, n in enumerate(shares)]
    rcs = [p.wait() for p in procs]
    for i, rc in enumerate(rcs):
        if rc != 0:
            print(f"worker {i} exited with status {rc}; the study goes on", file=sys.stderr)
    return rcs


def _write_best(study: optuna.Study, options: Options, w: Workload, objective: str, outdir: Path) -> dict:
    best = study.best_trial
    best_options = trial_options(options, best.params, w.prepared.inputs.free_default)
    header = [f"best trial {best.number} of study {study.study_name!r}: {objective} {best.value:.6g}",
              f"use: nbtorch-refine --config {outdir / 'best.toml'}  (from {os.getcwd()}: relative paths "
              "are relative to it)"]
    text = refine_config_toml(best_options, header, str(outdir / "best" / "result.h5"), keep=TRIAL_OPTIONS)
    (outdir / "best.toml").write_text(text)
    print(f"best trial {best.number}: {objective} {best.value:.6g} with {best.params}")
    print(f"best settings: {outdir / 'best.toml'}; TensorBoard: tensorboard --logdir {outdir / 'tb'}")
    return {"number": best.number, "value": best.value, "params": best.params, "figures": best.user_attrs}


def _main(argv: list[str]) -> int:
    options, own = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if own.worker_index is not None:  # a worker of a checked launch: the folder and the study exist
        _run_worker(options, own, own.storage, own.n_trials, own.worker_index)
        return 0
    # every input is checked before anything is written: space, output folder, inputs, objective, storage
    space = load_space(own.space, image=options.model.problem is None)
    check_output_dir(own.outdir)
    w = load_workload(options, Printer(options.output.quiet))
    objective = choose_objective(own.objective, w, space)
    if own.storage:  # a storage of the user's: open it before making the folder
        url = own.storage
        storage, study = _create_study(own, url)
        outdir = make_output_dir(own.outdir)
    else:
        outdir = make_output_dir(own.outdir)
        url = f"sqlite:///{outdir.resolve() / 'sweep.db'}"
        storage, study = _create_study(own, url)
    before = len(study.trials)
    print(f"sweep: study {own.study!r} in {url} ({before} trials before), {own.n_trials} trials on "
          f"{min(own.workers, own.n_trials)} worker(s), objective {objective}", flush=True)
    t0 = time.perf_counter()
    rcs = _launch(argv, options, own, url, w)
    trials = optuna.load_study(study_name=own.study, storage=storage).trials
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    summary = {"study": own.study, "storage": url, "objective": objective, "trials_before": before,
               "trials": len(trials), "states": counts, "wall_s": time.perf_counter() - t0, "worker_exit_codes": rcs,
               "trial_list": [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
                               "figures": t.user_attrs} for t in trials]}
    print(f"trials: {len(trials)} ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), "
          f"{summary['wall_s']:.1f} s")
    if counts.get("COMPLETE"):
        summary["best"] = _write_best(optuna.load_study(study_name=own.study, storage=storage), options, w,
                                      objective, outdir)
    (outdir / "sweep_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if counts.get("COMPLETE") else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 a trial completed, 1 none did, 2 bad input: one line on stderr)."""
    return run_main(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
