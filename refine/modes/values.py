"""Options as checked values: ``--start``, ``--bounds``, ``--prior``, the stages of the run, the loss name and
the files the command reads.  Each function takes a :class:`refine.modes.job.Job` (a measurement and its settings) or their
strings and raises :class:`~nbtorch.errors.InputError` with one line naming the option."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

from losses import LOSSES
from nbtorch.cli.support import argument_files
from nbtorch.errors import InputError
from refine.modes.job import Job
from refine.fitting.objective import check_priors
from refine.fitting.parameters import BASE_NAMES
from refine.solver.loop import Convergence
from refine.solver.precondition import PRECONDITIONER_NAMES
from refine.solver.stages import MEASURED_DETECTOR, Stage, coarse_to_fine, stage_a
from refine.solver.strategies import LBFGS, Adam

__all__ = ["csv_names", "start_values", "prior_values", "bounds_values", "build_stages", "check_loss",
           "command_inputs"]

STAGE_KEYS = ("name", "free", "optimizer", "lr", "history_size", "precondition", "max_steps", "roi_fraction", "bin",
              "n_factor", "ftol", "xtol")


def csv_names(text: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]`` (empty items dropped)."""
    return [t.strip() for t in str(text).split(",") if t.strip()]



def _pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise InputError(f"{what}: expected name=value, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def start_values(items: Sequence[str] | None) -> dict[str, float]:
    """``--start name=value,...`` as floats, names checked."""
    out: dict[str, float] = {}
    for name, text in _pairs(items, "--start").items():
        if name not in BASE_NAMES:
            raise InputError(f"--start: unknown parameter {name!r}; valid: {', '.join(BASE_NAMES)}")
        try:
            out[name] = float(text)
        except ValueError:
            raise InputError(f"--start {name}: not a number: {text!r}") from None
        if not math.isfinite(out[name]):
            raise InputError(f"--start {name}: must be finite, got {text!r}")
    return out


def _number_pairs(items: Sequence[str] | None, flag: str, form: str) -> dict[str, tuple[float, float, str]]:
    """``flag name=x:y,...`` as ``name -> (x, y, text)``; ``form`` (e.g. ``low:high``) names the two numbers."""
    out = {}
    for name, text in _pairs(items, flag).items():
        first, sep, second = text.partition(":")
        try:
            out[name] = (float(first), float(second), text)
        except ValueError:
            raise InputError(f"{flag} {name}: expected {form}, got {text!r}") from None
        if not sep:
            raise InputError(f"{flag} {name}: expected {form}, got {text!r}")
    return out


def prior_values(items: Sequence[str] | None) -> dict[str, tuple[float, float]]:
    """``--prior name=mean:sigma,...`` (Gaussian priors, each name in its own unit)."""
    pairs = _number_pairs(items, "--prior", "mean:sigma")
    return check_priors({name: (mean, sigma) for name, (mean, sigma, _) in pairs.items()}, "--prior")


def bounds_values(items: Sequence[str] | None) -> dict[str, tuple[float, float]]:
    """``--bounds name=low:high,...``."""
    out = {}
    for name, (low, high, text) in _number_pairs(items, "--bounds", "low:high").items():
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise InputError(f"--bounds {name}: need finite low < high, got {text!r}")
        out[name] = (low, high)
    return out


def _strategy(name: str, lr: float | None, history_size: int | None = None):
    if name == "adam":
        if history_size is not None:
            raise InputError("--history-size: only for --optimizer lbfgs")
        return Adam(lr=lr) if lr is not None else Adam()
    options = {k: v for k, v in (("lr", lr), ("history_size", history_size)) if v is not None}
    return LBFGS(**options)


def build_stages(args: Job):
    """The stages of the run: ``--refine`` (one stage, ``--coarse`` adds coarse copies), ``[[stages]]`` tables
    from ``--config``, or ``--stages stage_a``; None = the core's default (stage_a with ``--optimizer``).
    ``--precondition`` (when given) replaces every stage's own."""
    stages = _build_stages(args)
    if stages is None or args.optimiser.precondition is None:
        return stages
    pre = None if args.optimiser.precondition == "none" else args.optimiser.precondition
    return tuple(replace(s, precondition=pre) for s in stages)


def _precondition(value: Any, index: int) -> str | None:
    if value is None:
        return None
    if value not in PRECONDITIONER_NAMES:
        names = PRECONDITIONER_NAMES
        raise InputError(f"--config [[stages]] #{index + 1}: precondition must be {', '.join(names[:-1])} or "
                         f"{names[-1]}, got {value!r}")
    return None if value == "none" else str(value)


def _build_stages(args: Job):
    if args.optimiser.history_size is not None and args.optimiser.history_size < 1:
        raise InputError(f"--history-size: must be >= 1, got {args.optimiser.history_size}")
    strategy = _strategy(args.optimiser.optimizer, args.optimiser.lr, args.optimiser.history_size)
    if args.fit.refine and args.fit.stages:
        raise InputError("--refine and --stages both given: --refine makes one stage, --stages names a schedule; "
                         "drop one")
    if args.optimiser.max_steps is not None and args.optimiser.max_steps < 1:
        raise InputError(f"--max-steps: must be >= 1, got {args.optimiser.max_steps}")
    if args.optimiser.bin < 1:
        raise InputError(f"--bin: must be >= 1, got {args.optimiser.bin}")
    if args.fit.refine:
        stage = Stage("refine", tuple(args.fit.refine), strategy,
                      Convergence(max_steps=args.optimiser.max_steps or 200), bin=args.optimiser.bin)
        return coarse_to_fine(stage) if args.optimiser.coarse else (stage,)
    if args.fit.stage_tables:
        stages = []
        for i, table in enumerate(args.fit.stage_tables):
            unknown = set(table) - set(STAGE_KEYS)
            if unknown:
                raise InputError(f"--config [[stages]] #{i + 1}: unknown key(s) {', '.join(sorted(unknown))}; "
                                 f"valid: {', '.join(STAGE_KEYS)}")
            if "free" not in table:
                raise InputError(f"--config [[stages]] #{i + 1}: 'free' (names and groups) is required")
            free = csv_names(table["free"]) if isinstance(table["free"], str) else [str(v) for v in table["free"]]
            conv = Convergence(max_steps=int(table.get("max_steps", args.optimiser.max_steps or 100)),
                               ftol=float(table.get("ftol", 1e-6 if i == len(args.fit.stage_tables) - 1 else 1e-3)),
                               xtol=float(table.get("xtol", 1e-4 if i == len(args.fit.stage_tables) - 1 else 1e-3)))
            stages.append(Stage(str(table.get("name", f"stage{i + 1}")), tuple(free),
                                _strategy(str(table.get("optimizer", args.optimiser.optimizer)), table.get("lr", args.optimiser.lr),
                                          table.get("history_size", args.optimiser.history_size)),
                                conv, float(table.get("roi_fraction", 1.0)), int(table.get("bin", 1)),
                                float(table.get("n_factor", 1.0)), _precondition(table.get("precondition"), i)))
        return tuple(stages)
    if args.fit.stages not in (None, "stage_a"):
        raise InputError(f"--stages: unknown schedule {args.fit.stages!r}; valid: stage_a (or give --refine, "
                         "or [[stages]] tables in --config)")
    if args.image.image:  # a measured image: the detector stage refines the tilt too (and the distance, unless fixed)
        return stage_a(strategy, max_steps=args.optimiser.max_steps, detector=MEASURED_DETECTOR)
    if (args.fit.stages is None and args.optimiser.max_steps is None and args.optimiser.optimizer == "lbfgs" and args.optimiser.lr is None
            and args.optimiser.history_size is None and args.optimiser.precondition is None):
        return None
    return stage_a(strategy, max_steps=args.optimiser.max_steps)


def check_loss(name: str) -> None:
    if name not in LOSSES:
        raise InputError(f"--loss: unknown loss {name!r}; valid: {', '.join(LOSSES)}")


def command_inputs(args: Job) -> list[tuple[str, str | None]]:
    """``(option, path)`` of the files the command itself reads (``@FILE`` tokens of ``--model`` too)."""
    inputs = [("--image", args.image.image), ("--mask", args.image.mask), ("--config", args.model.config),
              ("--spots", args.pixels.spots if args.pixels.spots != "find" else None), ("--expt", args.dials.expt),
              ("--refl", args.dials.refl)]
    if isinstance(args.model.model, str):
        inputs += argument_files(args.model.model.split(), "--model")
    return inputs
