"""Hyper-parameter sweeps of the refinement with optuna.

Usage::

    python -m experiments.sweep --n-trials N [--storage URL] [--study NAME] [--workers K] [--timeout S]
        [--space space.toml] [--problem NAME --size N | --image OBS --model "<flags>"] [--steps S] [--outdir DIR]

Each trial refines one problem of the bank (or ``--image`` with ``--model``) with settings drawn
from the search space: optimiser (``adam``/``lbfgs``), learning rate, loss, stage schedule
(``stage_a`` or one ``single`` stage), LBFGS history size and the parameter scaling
(``precondition``: ``none``/``diagonal``).  The objective is the parameter error left against
the truth (:func:`experiments.workload.parameter_error`: 1 = the start, 0 = the truth), or the
final loss without a truth; it is reported every step, so the pruner (``MedianPruner``) can
stop a bad trial early.

Storage: ``sqlite:///DIR/sweep.db`` by default; any optuna storage URL otherwise
(``postgresql://...``/``mysql://...`` for several machines, ``journal:PATH`` for a journal
file).  The study is created once, before ``--workers K`` processes share the ``N`` trials;
running again with the same ``--study`` continues it.  RDB storages keep a heartbeat, so a
worker killed mid-trial leaves a trial that the next worker marks FAIL.

Outputs in ``--outdir``: ``tb/trial-NNNN`` (one TensorBoard run per trial, with
``add_hparams``: TensorBoard's HParams tab compares the trials), ``best.toml`` (the best
trial's settings for ``nbtorch-refine --config``) and ``sweep_summary.json``.

``--space`` TOML: a name with a list is categorical (``optimizer = ["adam"]``); a table
``[lr]`` with ``low``, ``high`` and optionally ``log = true`` or ``int = true`` is a range
(:func:`check_space` lists the rules).

Exit status 0 when a trial completed, 1 when none did; bad input (a flag, a value, the space
file, the storage URL) is one line ``... error: ...`` on stderr and exit status 2, before anything
is simulated or written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna

from experiments.workload import Workload, load_workload, parameter_error
from losses import LOSSES
from nbtorch.cli_support import Parser, check_output_dir, int_at_least, make_output_dir, positive_float, run_main
from nbtorch.errors import InputError
from nbtorch.io import read_toml
from refine import LBFGS, Adam, Convergence, refine, single_stage, stage_a
from refine.solver.precondition import PRECONDITIONER_NAMES

warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

__all__ = ["DEFAULT_SPACE", "load_space", "check_space", "make_storage", "make_objective", "parse_args", "main"]

DEFAULT_SPACE: dict[str, Any] = {
    "optimizer": ["adam", "lbfgs"],
    "lr": {"low": 0.01, "high": 1.0, "log": True},
    "loss": ["poisson", "gaussian"],
    "schedule": ["stage_a", "single"],
    "history_size": {"low": 3, "high": 30, "int": True},
    "precondition": ["none", "diagonal"],
}


#: the values a categorical entry may take (``precondition = "none"``: no scaling)
CHOICES: dict[str, tuple[str, ...]] = {
    "optimizer": ("adam", "lbfgs"),
    "schedule": ("stage_a", "single"),
    "precondition": PRECONDITIONER_NAMES,
}
#: entries that are numbers (a list of values or a range), with their lower limit
NUMBERS: dict[str, tuple[float, bool]] = {"lr": (0, False), "history_size": (1, True)}  # (limit, integer)


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


def check_space(space: dict[str, Any], where: str = "search space") -> dict[str, Any]:
    """Check every entry of a search space; returns it with ``history_size`` always drawn as an integer."""
    out = dict(space)
    for name, spec in space.items():
        at = f"{where}: {name}"
        if isinstance(spec, list):
            if not spec:
                raise InputError(f"{at}: empty list")
            if name in NUMBERS:
                for v in spec:
                    _check_number(at, name, v)
            else:
                valid = _loss_names() if name == "loss" else CHOICES[name]
                bad = [v for v in spec if not isinstance(v, str) or v not in valid]
                if bad:
                    raise InputError(f"{at}: unknown value(s) {', '.join(map(repr, bad))}; valid: {', '.join(valid)}")
            continue
        if not isinstance(spec, dict):
            raise InputError(f"{at}: expected a list of values or a [{name}] table with low and high, got {spec!r}")
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
        if NUMBERS[name][1]:
            out[name] = {**spec, "int": True}
    return out


def load_space(path: str | None) -> dict[str, Any]:
    """The default search space updated by a ``--space`` TOML file (checked: :class:`InputError` if bad)."""
    space = dict(DEFAULT_SPACE)
    if path:
        user = read_toml(path, "--space")
        unknown = set(user) - set(DEFAULT_SPACE)
        if unknown:
            raise InputError(f"--space {path}: unknown name(s) {', '.join(sorted(unknown))}; "
                             f"valid: {', '.join(DEFAULT_SPACE)}")
        space.update(user)
    return check_space(space, f"--space {path}" if path else "search space")


def _suggest(trial: optuna.Trial, name: str, spec: Any) -> Any:
    if isinstance(spec, list):
        return trial.suggest_categorical(name, spec)
    if spec.get("int"):
        return trial.suggest_int(name, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log", False)))
    return trial.suggest_float(name, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log", False)))


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
    """Reports the objective every step to the trial and TensorBoard; stops the run once pruned."""

    def __init__(self, trial: optuna.Trial, w: Workload, writer: Any) -> None:
        self.trial, self.w, self.writer = trial, w, writer
        self.pruned = False
        self.last = float("nan")

    def value(self, canonical: dict, loss: float) -> float:
        if self.w.truth is None:
            return float(loss)
        return parameter_error(canonical, self.w.start, self.w.truth)

    def on_run_start(self, info: Any) -> None:
        pass

    def on_stage_start(self, stage: Any, index: int) -> None:
        pass

    def on_step(self, state: Any) -> None:
        if self.pruned:
            raise _Pruned()
        v = self.value(state.canonical, state.loss)
        self.last = v
        self.writer.add_scalar("loss", state.loss, state.step)
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


def _stages(params: dict, w: Workload, steps: int):
    if params["optimizer"] == "adam":
        strategy = Adam(lr=params["lr"])
    else:
        strategy = LBFGS(lr=params["lr"], history_size=int(params.get("history_size", 20)))
    if params["schedule"] == "stage_a":
        stages = stage_a(strategy, max_steps=steps)  # as nbtorch-refine --stages stage_a --max-steps
    else:
        stages = single_stage(w.free, strategy, Convergence(max_steps=4 * steps))
    pre = params.get("precondition", "none")
    return tuple(replace(s, precondition=None if pre == "none" else pre) for s in stages)


def make_objective(w: Workload, space: dict, steps: int, outdir: Path):
    """``trial -> value`` refining ``w`` with settings drawn from ``space``."""

    def objective(trial: optuna.Trial) -> float:
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard costs ~0.5 s of startup

        params = {}
        for name in ("optimizer", "lr", "loss", "schedule", "precondition"):
            params[name] = _suggest(trial, name, space[name])
        if params["optimizer"] == "lbfgs":
            params["history_size"] = _suggest(trial, "history_size", space["history_size"])
        writer = SummaryWriter(log_dir=str(outdir / "tb" / f"trial-{trial.number:04d}"))
        cb = TrialCallback(trial, w, writer)
        value, loss_final, state = float("nan"), float("nan"), "complete"
        try:
            try:
                result = refine(w.simulator(compile=False), w.observed, **w.refine_kwargs(),
                                stages=_stages(params, w, steps), loss=params["loss"], callbacks=[cb],
                                progress=False, esds=False)
            except _Pruned:
                result = None
            if cb.pruned:
                state, value = "pruned", cb.last
                raise optuna.TrialPruned(f"pruned at objective {cb.last:.4g}")
            loss_final = float(result.loss_final)
            value = cb.value(result.params, loss_final)
            trial.set_user_attr("status", result.status.value)
            trial.set_user_attr("loss_final", loss_final)
            trial.set_user_attr("steps", int(result.steps))
            if not math.isfinite(value):
                value = float("inf")
            return value
        finally:
            hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in trial.params.items()}
            hp["trial_state"] = state
            metrics = {"hparam/objective": value if math.isfinite(value) else 1e30,
                       "hparam/loss_final": loss_final if math.isfinite(loss_final) else 1e30}
            writer.add_hparams(hp, metrics, run_name=".")
            writer.close()

    return objective


def best_config_toml(study: optuna.Study, w: Workload, args: argparse.Namespace, steps: int) -> str:
    """The best trial's settings as an ``nbtorch-refine --config`` TOML."""
    best = study.best_trial
    p = best.params
    lines = [f"# best trial {best.number} of study {study.study_name!r}: objective {best.value:.6g}",
             "# use: nbtorch-refine --config best.toml"]
    if args.image:
        lines += [f"image = {json.dumps(str(args.image))}", f"model = {json.dumps(args.model)}"]
    else:
        lines += [f"problem = {json.dumps(args.problem)}", f"size = {int(args.size)}"]
    lines += [f"optimizer = {json.dumps(p['optimizer'])}", f"lr = {p['lr']!r}", f"loss = {json.dumps(p['loss'])}"]
    if p["schedule"] == "stage_a":
        lines += ['stages = "stage_a"', f"max-steps = {steps}"]
    else:
        lines += [f"refine = {json.dumps(list(w.free))}", f"max-steps = {4 * steps}"]
    lines += [f"symmetry = {json.dumps(w.symmetry)}"]
    if w.fixed:
        lines += [f"fix = {json.dumps(list(w.fixed))}"]
    if "history_size" in p and p["optimizer"] == "lbfgs":
        lines.append(f"history-size = {int(p['history_size'])}")
    lines.append(f"precondition = {json.dumps(p.get('precondition', 'none'))}")
    return "\n".join(lines) + "\n"


PROG = "python -m experiments.sweep"


def _parser() -> argparse.ArgumentParser:
    ap = Parser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--n-trials", type=int_at_least(1), required=True, help="trials to run now (over all workers)")
    ap.add_argument("--storage", help="optuna storage URL (default sqlite:///OUTDIR/sweep.db)")
    ap.add_argument("--study", default="nbtorch-sweep", help="study name (same name = resume; default %(default)s)")
    ap.add_argument("--workers", type=int_at_least(1), default=1, help="worker processes (default 1: in this process)")
    ap.add_argument("--timeout", type=positive_float, help="stop starting trials after this many seconds (per worker)")
    ap.add_argument("--space", help="TOML search space overriding the default (see the module docstring)")
    ap.add_argument("--problem", default="cubic_mosflm", help="bank problem (default %(default)s)")
    ap.add_argument("--size", type=int, default=32, help="detector pixels per side (default %(default)s)")
    ap.add_argument("--image", help="observed image instead of a bank problem (objective: final loss)")
    ap.add_argument("--model", help="nanoBragg flags of the starting model (with --image)")
    ap.add_argument("--steps", type=int_at_least(1), default=3,
                    help="steps per stage (single schedule: 4x; default %(default)s)")
    ap.add_argument("--outdir", default="out/sweep", help="output folder (default %(default)s)")
    ap.add_argument("--seed", type=int_at_least(0), help="sampler seed (each worker adds its index)")
    ap.add_argument("--heartbeat", type=int_at_least(1), default=10,
                    help="RDB heartbeat period, s (default %(default)s)")
    ap.add_argument("--grace", type=int_at_least(1), default=30,
                    help="a RUNNING trial silent this long is failed (s, > --heartbeat; default %(default)s)")
    ap.add_argument("--worker-index", type=int_at_least(0), help=argparse.SUPPRESS)  # internal: run as worker i
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and check the arguments (no file, storage or simulation touched)."""
    args = _parser().parse_args(argv)
    if args.grace <= args.heartbeat:
        raise InputError(f"--grace {args.grace}: must be greater than --heartbeat ({args.heartbeat}), or live "
                         f"trials would be failed between two heartbeats")
    if args.seed is not None and args.seed + args.workers - 1 > 2**32 - 1:
        raise InputError(f"--seed {args.seed}: must be <= {2**32 - args.workers} (each worker adds its index)")
    if not args.study.strip():
        raise InputError("--study: empty name")
    return args


def _pruner() -> optuna.pruners.BasePruner:
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2)


def _run_worker(args: argparse.Namespace, url: str, n: int, index: int, w: Workload | None = None,
                space: dict | None = None) -> None:
    logging.getLogger("refine.solver.loop").addFilter(_not_pruned)
    if w is None:
        w = load_workload(args.problem, args.size, args.image, args.model)
    if space is None:
        space = load_space(args.space)
    storage = make_storage(url, args.heartbeat, args.grace)
    seed = None if args.seed is None else args.seed + index
    study = optuna.load_study(study_name=args.study, storage=storage, pruner=_pruner(),
                              sampler=optuna.samplers.TPESampler(seed=seed))
    optuna.storages.fail_stale_trials(study)  # trials of crashed workers -> FAIL (a no-op without heartbeat)
    objective = make_objective(w, space, args.steps, Path(args.outdir))
    if n > 0:
        study.optimize(objective, n_trials=n, timeout=args.timeout, catch=(Exception,))


def _create_study(args: argparse.Namespace, url: str):
    storage = make_storage(url, args.heartbeat, args.grace)
    try:
        study = optuna.create_study(study_name=args.study, storage=storage, direction="minimize", pruner=_pruner(),
                                    load_if_exists=True)
    except Exception as exc:  # not an optuna database, a study of the other direction, ...
        raise InputError(f"--storage {url}: cannot create or load study {args.study!r}: {_first_line(exc)}") from None
    return storage, study


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.worker_index is not None:  # a worker of a checked launch: the folder and the study exist
        _run_worker(args, args.storage, args.n_trials, args.worker_index)
        return 0
    # every input is checked before anything is written: space, output folder, workload, storage
    space = load_space(args.space)
    check_output_dir(args.outdir)
    w = load_workload(args.problem, args.size, args.image, args.model)
    if args.storage:  # a storage of the user's: open it before making the folder
        url = args.storage
        storage, study = _create_study(args, url)
        outdir = make_output_dir(args.outdir)
    else:
        outdir = make_output_dir(args.outdir)
        url = f"sqlite:///{outdir.resolve() / 'sweep.db'}"
        storage, study = _create_study(args, url)
    before = len(study.trials)
    k = min(args.workers, args.n_trials)  # no idle worker
    print(f"sweep: study {args.study!r} in {url} ({before} trials before), {args.n_trials} trials on "
          f"{k} worker(s)", flush=True)
    t0 = time.perf_counter()
    shares = [args.n_trials // k + (1 if i < args.n_trials % k else 0) for i in range(k)]
    rcs = []
    if k == 1:
        _run_worker(args, url, shares[0], 0, w, space)
        rcs.append(0)
    else:
        base = list(argv)
        procs = []
        for i, n in enumerate(shares):
            cmd = [sys.executable, "-m", "experiments.sweep", *base, "--n-trials", str(n), "--storage", url,
                   "--worker-index", str(i)]
            procs.append(subprocess.Popen(cmd, env=os.environ.copy()))
        rcs = [p.wait() for p in procs]
        for i, rc in enumerate(rcs):
            if rc != 0:
                print(f"worker {i} exited with status {rc}; the study goes on", file=sys.stderr)
    study = optuna.load_study(study_name=args.study, storage=storage)
    trials = study.trials
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    summary = {"study": args.study, "storage": url, "trials_before": before, "trials": len(trials), "states": counts,
               "wall_s": time.perf_counter() - t0, "worker_exit_codes": rcs,
               "trial_list": [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params}
                              for t in trials]}
    print(f"trials: {len(trials)} ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), "
          f"{summary['wall_s']:.1f} s")
    if counts.get("COMPLETE"):
        best = study.best_trial
        (outdir / "best.toml").write_text(best_config_toml(study, w, args, args.steps))
        summary["best"] = {"number": best.number, "value": best.value, "params": best.params}
        print(f"best trial {best.number}: objective {best.value:.6g} with {best.params}")
        print(f"best settings: {outdir / 'best.toml'}; TensorBoard: tensorboard --logdir {outdir / 'tb'}")
    (outdir / "sweep_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if counts.get("COMPLETE") else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 a trial completed, 1 none did, 2 bad input: one line on stderr)."""
    return run_main(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
