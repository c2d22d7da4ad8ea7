"""The ``nbtorch-refine`` command: refine a nanoBragg model against a measured or synthetic still image.

::

    nbtorch-refine --image OBS --model "<nanoBragg flags of the starting model>" [--config run.toml]
                   [--refine cell,orientation,beam_x,beam_y,mosaic,scale,background | --stages stage_a]
                   [--symmetry NAME] [--fix distance] [--start cell_a=57.8,cell_c=150]
                   [--optimizer lbfgs|adam] [--loss poisson|gaussian|mse|...] [--max-steps N]
                   [--roi X0 X1 Y0 Y1] [--dmin D] [--dmax D] [--subsample F] [--spots FILE|find [--spot-columns X,Y]]
                   [--out result.h5] [--json result.json] [--logdir runs/NAME] [--resume]
                   [--device cpu|cuda] [--dtype float64|float32] [--quiet]
    nbtorch-refine --problem tetragonal_mosflm --size 64 ...      # a synthetic problem with known truth

Every option is documented in ``docs/refinement.md`` and by ``--help``.  Bad input
(a missing file, an image whose shape is not the model's detector, an unknown
parameter name, an all-masked image, NaN pixels, a bad option) prints one line
``nbtorch-refine: error: ...`` on stderr and exits with status 2 before anything
is written.  A refinement that ends diverged or failed still writes its files and
exits with status 1; Ctrl-C writes the checkpoint and exits with status 130.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nbtorch import runtime
from nbtorch.errors import InputError
from refine.precondition import PRECONDITIONER_NAMES

__all__ = ["main", "build_parser", "parse_args", "run"]

PROG = "nbtorch-refine"
_DEFAULT_DATASET = "/entry/data/data"
_STAGE_KEYS = ("name", "free", "optimizer", "lr", "history_size", "precondition", "max_steps", "roi_fraction", "bin",
               "n_factor", "ftol", "xtol")


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one-line :class:`InputError` (exit status 2 in :func:`main`)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(message)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``--help`` text)."""
    p = _Parser(prog=PROG, description="Refine a nanoBragg model against a measured still image.",
                epilog="Tutorial and every option: docs/refinement.md", allow_abbrev=False)
    g = p.add_argument_group("input")
    g.add_argument("--image", help="measured image: SMV (.img), mini-CBF (.cbf, .cbf.bz2, .cbf.gz), "
                                   "HDF5/NeXus (.h5, .nxs) or raw (.bin, with --shape)")
    g.add_argument("--images", nargs="+", metavar="IMAGE", help="independent mode: refine each of these images on its "
                   "own (paths, quoted glob patterns, @LIST files); {stem} in --model/--spots/--mask is the image's "
                   "name; results in --out-dir/<stem>/ and a summary (docs/refinement.md, 'Many images')")
    g.add_argument("--out-dir", help="independent mode: folder of the per-image results and summary.csv/summary.h5 "
                                     "(default out/batch)")
    g.add_argument("--redo", action="store_true", help="independent mode: refine images already done again")
    g.add_argument("--frame", type=int, help="frame index of a 3-D HDF5 dataset")
    g.add_argument("--dataset", default=_DEFAULT_DATASET, help="HDF5 dataset of the image (default %(default)s)")
    g.add_argument("--shape", type=int, nargs=2, metavar=("SLOW", "FAST"), help="shape of a raw image")
    g.add_argument("--raw-dtype", default="<f4", help="element type of a raw image (numpy, default %(default)s)")
    g.add_argument("--mask", help="mask file (any image format, same shape; nonzero = use the pixel)")
    g.add_argument("--saturation", type=float, help="mask pixels >= this (default: the header's count cutoff)")
    g.add_argument("--mask-nan", action="store_true", help="mask NaN/Inf pixels instead of refusing the image")
    g.add_argument("--model", help='nanoBragg flags of the starting model ("@FILE" reads flags from FILE); '
                                   "the image header fills in wavelength, distance, beam centre, pixel size and "
                                   "detector size that the flags leave out")
    g.add_argument("--f-column", help="amplitude column of an MTZ or mmCIF -hkl file in --model (e.g. FP, F-obs, "
                                      "F_meas_au; adds -hkl_column to the model's flags)")
    g.add_argument("--problem", help="refine a synthetic problem of the bank instead of --image (refine.PROBLEMS)")
    g.add_argument("--size", type=int, default=64, help="detector pixels per side of --problem (default %(default)s)")
    g.add_argument("--config", help="TOML file of options (keys = long option names; command-line flags win)")
    g = p.add_argument_group("what to refine")
    g.add_argument("--refine", type=_csv, help="one stage refining these canonical names and groups (comma-separated): "
                                               "cell orientation mosaic detector beam_centre wavelength scale "
                                               "background, or names such as beam_x, mosaic_spread, N, distance")
    g.add_argument("--stages", help="a named schedule: stage_a (default; coarse-to-fine, see docs/refinement.md)")
    g.add_argument("--fix", type=_csv, help="names or groups never refined (e.g. distance)")
    g.add_argument("--start", type=_csv, help="starting values overriding the model: name=value,... "
                                              "(cell values tied by --symmetry follow)")
    g.add_argument("--symmetry", help="crystal system: triclinic (default; --problem: its own), monoclinic, orthorhombic, tetragonal, "
                                      "trigonal, hexagonal, rhombohedral, cubic; or a space-group name such as P41212")
    g.add_argument("--background", default="constant", choices=("constant", "planar"), help="background model")
    g.add_argument("--bounds", type=_csv, help="name=low:high,... refine inside open intervals")
    g = p.add_argument_group("optimiser")
    g.add_argument("--optimizer", default="lbfgs", choices=("lbfgs", "adam"), help="step rule (default %(default)s)")
    g.add_argument("--lr", type=float, help="step length (LBFGS, default 1) or learning rate (Adam, default 0.1)")
    g.add_argument("--history-size", type=int, help="LBFGS: (s, y) pairs kept (default 20)")
    g.add_argument("--precondition", choices=PRECONDITIONER_NAMES,
                   help="parameter scaling of every stage from its Fisher matrix (default: the schedule's own; "
                        "stage_a: full for LBFGS, none for Adam; --refine: none)")
    g.add_argument("--loss", default="poisson", help="poisson (the half Poisson deviance, default), poisson_nll, gaussian, mse, huber, log, ncc (losses.LOSSES)")
    g.add_argument("--max-steps", type=int, help="steps per stage (stage_a: per coarse stage, the final one 5x; "
                                                 "--refine: default 200)")
    g.add_argument("--bin", type=int, default=1, help="bin model and observed KxK in the --refine stage (default 1)")
    g.add_argument("--coarse", action="store_true", help="precede the --refine stage by binned, low-resolution copies")
    g.add_argument("--time-budget", type=float, help="wall-clock budget of the refinement (s)")
    g = p.add_argument_group("pixels (speed)")
    g.add_argument("--roi", type=int, nargs=4, metavar=("X0", "X1", "Y0", "Y1"),
                   help="fit only this rectangle (inclusive fast x and slow y pixel bounds)")
    g.add_argument("--dmin", type=float, help="high-resolution limit (Å): mask pixels with d < dmin")
    g.add_argument("--dmax", type=float, help="low-resolution limit (Å): mask pixels with d > dmax")
    g.add_argument("--subsample", type=float, help="fit a random fraction of the pixels (with --spot-window: of "
                                                   "the pixels outside the spot windows)")
    g.add_argument("--spots", help="observed spots: a text table (pixels, centres at i+0.5; x and y named by its "
                                   "header, e.g. 'x y', 'x_px y_px', 'xyzobs.px.value', or a header-less 'x y [z]') "
                                   "or 'find'; reports the rms spot offset before and after")
    g.add_argument("--spot-columns", metavar="X,Y", help="the x (fast) and y (slow) columns of the --spots table: "
                                                          "two header names or 1-based column numbers (e.g. "
                                                          "xobs,yobs or 6,7)")
    g.add_argument("--spot-window", type=int, help="fit the pixels within this many pixels of a spot "
                                                   "(plus --subsample of the others)")
    g.add_argument("--seed", type=int, default=0, help="seed of --subsample (default %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="result.h5", help="result HDF5 file (default %(default)s)")
    g.add_argument("--json", help="result JSON file (default: --out with .json)")
    g.add_argument("--report", help="self-contained HTML report of the run (parameter table, loss and parameters per "
                                    "step, image crops with spots, spot offsets, residuals, correlations)")
    g.add_argument("--logdir", help="TensorBoard log directory (default: no logs)")
    g.add_argument("--tb-every", type=int, default=10, help="TensorBoard images every N steps (default %(default)s)")
    g.add_argument("--checkpoint", help="checkpoint file (default: --out with .ckpt.h5)")
    g.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint period in steps (default %(default)s)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    g.add_argument("--no-esds", action="store_true", help="skip the uncertainty estimate")
    g.add_argument("--esd-extra", type=_csv, help="also report esds and correlations of these fixed parameters "
                                                  "at the refined point (e.g. distance)")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no printing (errors only)")
    g = p.add_argument_group("compute")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    g.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="default %(default)s")
    g.add_argument("--compile", dest="compile", action="store_const", const=True,
                   help="torch.compile the simulator kernel (default: only for big jobs)")
    g.add_argument("--no-compile", dest="compile", action="store_const", const=False, help="never compile")
    return p


# ------------------------------------------------------------------------------ config file


def _config_tokens(path: str, parser: argparse.ArgumentParser) -> tuple[list[str], list | None]:
    """Command-line tokens equivalent to a TOML config, and its ``[[stages]]`` tables (None if absent)."""
    from nbtorch.io import read_toml

    data = read_toml(path, "--config")
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    tokens: list[str] = []
    stages = None
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if key == "stages" and isinstance(value, list) and all(isinstance(v, dict) for v in value):
            stages = value
            continue
        if flag in ("--config", "--help") or flag not in actions:
            raise InputError(f"--config {path}: unknown option {key!r}")
        action = actions[flag]
        if isinstance(value, bool):
            if action.nargs == 0:
                if value:
                    tokens.append(flag)
                continue
            value = str(value).lower()
        if isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        if isinstance(value, list):
            if action.nargs in (2, 4, "+"):
                tokens += [flag, *(str(v) for v in value)]
            else:
                tokens += [flag, ",".join(str(v) for v in value)]
        else:
            tokens += [flag, str(value)]
    return tokens, stages


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` after the options of ``--config`` (the command line wins)."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    args.stage_tables = None
    args.argv = list(argv)
    if args.config:
        tokens, stages = _config_tokens(args.config, parser)
        args = parser.parse_args(tokens + list(argv))
        args.stage_tables = stages
        args.argv = list(argv)
    for flag, value in (("--out-dir", args.out_dir), ("--redo", args.redo)):
        if value and not args.images:
            raise InputError(f"{flag}: only with --images (independent mode)")
    if args.f_column is not None:
        if not args.model:
            raise InputError("--f-column: names a column of the -hkl file in --model; give --model")
        args.model = f"{args.model} -hkl_column {shlex.quote(args.f_column)}"
    return args


# ------------------------------------------------------------------------------ building blocks

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
    from refine.parameters import BASE_NAMES

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


def bounds_values(items: Sequence[str] | None) -> dict[str, tuple[float, float]]:
    """``--bounds name=low:high,...``."""
    out = {}
    for name, text in _pairs(items, "--bounds").items():
        lo, sep, hi = text.partition(":")
        try:
            out[name] = (float(lo), float(hi))
        except ValueError:
            raise InputError(f"--bounds {name}: expected low:high, got {text!r}") from None
        if not sep:
            raise InputError(f"--bounds {name}: expected low:high, got {text!r}")
        lo_v, hi_v = out[name]
        if not (math.isfinite(lo_v) and math.isfinite(hi_v) and lo_v < hi_v):
            raise InputError(f"--bounds {name}: need finite low < high, got {text!r}")
    return out


def _strategy(name: str, lr: float | None, history_size: int | None = None):
    from refine.strategies import LBFGS, Adam

    if name == "adam":
        if history_size is not None:
            raise InputError("--history-size: only for --optimizer lbfgs")
        return Adam(lr=lr) if lr is not None else Adam()
    options = {k: v for k, v in (("lr", lr), ("history_size", history_size)) if v is not None}
    return LBFGS(**options)


def build_stages(args: argparse.Namespace):
    """The stages of the run: ``--refine`` (one stage, ``--coarse`` adds coarse copies), ``[[stages]]`` tables
    from ``--config``, or ``--stages stage_a``; None = the core's default (stage_a with ``--optimizer``).
    ``--precondition`` (when given) replaces every stage's own."""
    from dataclasses import replace

    stages = _build_stages(args)
    if stages is None or args.precondition is None:
        return stages
    pre = None if args.precondition == "none" else args.precondition
    return tuple(replace(s, precondition=pre) for s in stages)


def _precondition(value: Any, index: int) -> str | None:
    if value is None:
        return None
    if value not in PRECONDITIONER_NAMES:
        names = PRECONDITIONER_NAMES
        raise InputError(f"--config [[stages]] #{index + 1}: precondition must be {', '.join(names[:-1])} or "
                         f"{names[-1]}, got {value!r}")
    return None if value == "none" else str(value)


def _build_stages(args: argparse.Namespace):
    from refine.loop import Convergence
    from refine.stages import Stage, coarse_to_fine, stage_a

    if args.history_size is not None and args.history_size < 1:
        raise InputError(f"--history-size: must be >= 1, got {args.history_size}")
    strategy = _strategy(args.optimizer, args.lr, args.history_size)
    if args.refine and args.stages:
        raise InputError("--refine and --stages both given: --refine makes one stage, --stages names a schedule; "
                         "drop one")
    if args.max_steps is not None and args.max_steps < 1:
        raise InputError(f"--max-steps: must be >= 1, got {args.max_steps}")
    if args.bin < 1:
        raise InputError(f"--bin: must be >= 1, got {args.bin}")
    if args.refine:
        stage = Stage("refine", tuple(args.refine), strategy,
                      Convergence(max_steps=args.max_steps or 200), bin=args.bin)
        return coarse_to_fine(stage) if args.coarse else (stage,)
    if args.stage_tables:
        stages = []
        for i, table in enumerate(args.stage_tables):
            unknown = set(table) - set(_STAGE_KEYS)
            if unknown:
                raise InputError(f"--config [[stages]] #{i + 1}: unknown key(s) {', '.join(sorted(unknown))}; "
                                 f"valid: {', '.join(_STAGE_KEYS)}")
            if "free" not in table:
                raise InputError(f"--config [[stages]] #{i + 1}: 'free' (names and groups) is required")
            free = _csv(table["free"]) if isinstance(table["free"], str) else [str(v) for v in table["free"]]
            conv = Convergence(max_steps=int(table.get("max_steps", args.max_steps or 100)),
                               ftol=float(table.get("ftol", 1e-6 if i == len(args.stage_tables) - 1 else 1e-3)),
                               xtol=float(table.get("xtol", 1e-4 if i == len(args.stage_tables) - 1 else 1e-3)))
            stages.append(Stage(str(table.get("name", f"stage{i + 1}")), tuple(free),
                                _strategy(str(table.get("optimizer", args.optimizer)), table.get("lr", args.lr),
                                          table.get("history_size", args.history_size)),
                                conv, float(table.get("roi_fraction", 1.0)), int(table.get("bin", 1)),
                                float(table.get("n_factor", 1.0)), _precondition(table.get("precondition"), i)))
        return tuple(stages)
    if args.stages not in (None, "stage_a"):
        raise InputError(f"--stages: unknown schedule {args.stages!r}; valid: stage_a (or give --refine, "
                         "or [[stages]] tables in --config)")
    if (args.stages is None and args.max_steps is None and args.optimizer == "lbfgs" and args.lr is None
            and args.history_size is None and args.precondition is None):
        return None
    return stage_a(strategy, max_steps=args.max_steps)


def _check_loss(name: str) -> None:
    from losses import LOSSES

    if name not in LOSSES:
        raise InputError(f"--loss: unknown loss {name!r}; valid: {', '.join(LOSSES)}")


def _check_outputs(paths: dict[str, str | None]) -> list[Path]:
    """Refuse output paths that cannot be written; return the missing directories to create before writing
    (output directories are made as needed, like ``--logdir``; nothing is created here)."""
    from nbtorch.io.atomic import check_directory_can_be_made

    seen: dict[str, str] = {}
    to_make: list[Path] = []
    for flag, path in paths.items():
        if not path:
            continue
        p = Path(path)
        key = os.path.abspath(path)
        if key in seen:
            raise InputError(f"{seen[key]} and {flag} both name {path}: give them different names")
        seen[key] = flag
        if flag == "--logdir":  # a directory, created (or appended to) by TensorBoard
            if p.exists() and not p.is_dir():
                raise InputError(f"{flag} {path}: exists and is not a directory")
            directory = p
        else:
            if p.is_dir():
                raise InputError(f"{flag} {path}: is a directory")
            directory = p.parent if str(p.parent) else Path(".")
        check_directory_can_be_made(directory, f"{flag} {path}")
        if not directory.exists() and flag != "--logdir":
            to_make.append(directory)
    return to_make


def _command_inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``(option, path)`` of the files the command itself reads (``@FILE`` tokens of ``--model`` too)."""
    inputs = [("--image", args.image), ("--mask", args.mask), ("--config", args.config),
              ("--spots", args.spots if args.spots != "find" else None)]
    if isinstance(args.model, str):
        inputs += [("--model", tok[1:]) for tok in args.model.split() if tok.startswith("@") and len(tok) > 1]
    return inputs


class _EagerForEsds:
    """Switch a compiled simulator to eager when the last stage ends: the esds differentiate twice
    (``create_graph=True``), which a compiled backward does not support."""

    def __init__(self, sim) -> None:
        self.sim = sim
        self.n_stages = 0

    def on_run_start(self, info) -> None:
        self.n_stages = len(info.stages)

    def on_stage_start(self, stage, index) -> None:
        pass

    def on_step(self, state) -> None:
        pass

    def on_stage_end(self, stage, index, status, message) -> None:
        if index + 1 >= self.n_stages or not status.ok:
            self.sim.set_compile(*runtime.compile_policy("esds"))

    def on_run_end(self, result) -> None:
        pass


# ------------------------------------------------------------------------------ the run


class _Say:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, *parts: Any) -> None:
        if self.quiet:
            return
        try:
            print(*parts, flush=True)
        except BrokenPipeError:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
            self.quiet = True


def run(args: argparse.Namespace) -> int:
    """Load, refine, write.  Returns the exit status (0 ok, 1 diverged or failed)."""
    import torch

    from nbtorch import Simulator, config_from_args
    from nbtorch.io.atomic import check_not_inputs
    from refine.callbacks import TensorBoardCallback
    from refine.data import load_image
    from refine.model import model_config
    from refine.model import crystal_system, tie_start_cell
    from refine.parameters import ParameterSpace
    from refine.report import ESD_NOTE, results_table, write_outputs
    from refine.runner import refine
    from refine.selection import check_roi, resolution_mask, roi_mask, subsample_mask

    say = _Say(args.quiet)
    t0 = time.monotonic()
    # ---- checks that need no data ------------------------------------------------------------
    if bool(args.image) == bool(args.problem):
        raise InputError("give exactly one of --image (a measured image) and --problem (a synthetic problem)")
    if args.image and not args.model:
        raise InputError("--model: the starting model's nanoBragg flags are required with --image "
                         '(e.g. --model "-cell 58 58 150 90 90 90 -misset 10 20 30 -N 20 -default_F 100")')
    symmetry = crystal_system(args.symmetry)
    stages = build_stages(args)
    _check_loss(args.loss)
    start = start_values(args.start)
    bounds = bounds_values(args.bounds)
    for flag, value in (("--time-budget", args.time_budget), ("--checkpoint-every", args.checkpoint_every),
                        ("--tb-every", args.tb_every), ("--saturation", args.saturation)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise InputError(f"{flag}: must be a positive number, got {value:g}")
    if args.seed < 0:
        raise InputError(f"--seed: must be >= 0, got {args.seed}")
    for flag, names in (("--refine", args.refine), ("--fix", args.fix), ("--esd-extra", args.esd_extra)):
        if names is not None and not names:
            raise InputError(f"{flag}: no names given")
    both = sorted(set(args.refine or ()) & set(args.fix or ()))
    if both:
        raise InputError(f"--refine and --fix both name {', '.join(both)}: a parameter is either refined or fixed")
    if args.subsample is not None and not 0 < args.subsample <= 1:
        raise InputError(f"--subsample: fraction must be in (0, 1], got {args.subsample:g}")
    if args.spot_window is not None and args.spot_window < 0:
        raise InputError(f"--spot-window: must be >= 0 pixels, got {args.spot_window}")
    if args.spot_window is not None and not args.spots:
        raise InputError("--spot-window needs --spots (a spot list or 'find')")
    runtime.check_device(args.device, "--device")
    if Path(args.out).is_dir() or not Path(args.out).name or Path(args.out).name in (".", ".."):
        raise InputError(f"--out {args.out}: is a directory; give a file name such as result.h5")
    json_path = args.json or str(Path(args.out).with_suffix(".json"))
    ckpt_path = args.checkpoint or str(Path(args.out).with_suffix("")) + ".ckpt.h5"
    outputs = {"--out": args.out, "--json": json_path, "--checkpoint": ckpt_path}
    if args.report:
        from refine.figures import require_matplotlib

        require_matplotlib("--report")
        outputs["--report"] = args.report
    make_dirs = _check_outputs({**outputs, "--logdir": args.logdir})
    check_not_inputs(_command_inputs(args), outputs.items())  # before anything is read
    if args.resume and not Path(ckpt_path).is_file():
        raise InputError(f"--resume: checkpoint {ckpt_path} not found "
                         "(run once without --resume, or give --checkpoint)")
    dtype = torch.float64 if args.dtype == "float64" else torch.float32

    # ---- observed image and starting model ----------------------------------------------------------
    truth = None
    extra: dict[str, Any] = {"command": " ".join([PROG, *getattr(args, "argv", [])])}
    if args.problem:
        from refine.problems import make_problem

        problem = make_problem(args.problem, size=args.size, option_prefix="--")
        say(f"{PROG}: problem {problem.name}: {problem.description}")
        cfg = config_from_args(list(problem.args))
        observed = problem.observed
        mask = np.ones(observed.shape, dtype=bool)
        truth = {k: v for k, v in problem.truth.items()}
        start = {**problem.start, **start}
        symmetry = symmetry or problem.symmetry
        free_default, fixed = problem.free, tuple(args.fix) if args.fix is not None else problem.fixed
        extra["input"] = {"problem": problem.name, "size": problem.size, "model": list(problem.args)}
        extra["truth"] = truth
        if args.roi:
            cfg = cfg.replace(roi=tuple(check_roi(args.roi, observed.shape)))
    else:
        obs = load_image(args.image, frame=args.frame, shape=args.shape, dtype=args.raw_dtype, dataset=args.dataset,
                         mask=args.mask, saturation=args.saturation, nonfinite="mask" if args.mask_nan else "error")
        if args.dataset != _DEFAULT_DATASET and obs.format != "hdf5":
            raise InputError(f"--dataset {args.dataset}: {args.image} is a {obs.format} file, not HDF5")
        say(f"{PROG}: {obs.describe()}")
        roi = check_roi(args.roi, obs.shape) if args.roi else None
        cfg, tokens, notes = model_config(args.model, obs, roi)
        for note in notes:
            say(f"  {note}")
        observed, mask = obs.image, obs.mask
        free_default, fixed = None, tuple(args.fix or ())
        extra["input"] = {"image": obs.path, "format": obs.format, "frame": args.frame, "geometry": obs.geometry,
                          "masked": obs.masked, "model": tokens}
    check_not_inputs([(f"--model {flag}", path) for flag, path in cfg.model_files()], outputs.items())
    if args.dtype != cfg.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    sim = Simulator(cfg, dtype=dtype, device=args.device, compile=False, max_evals_per_tile=1 << 17)
    if tuple(sim.shape) != tuple(observed.shape):
        raise InputError(f"{args.image}: image is {observed.shape[1]} x {observed.shape[0]} pixels (fast x slow) but "
                         f"the model's detector is {sim.shape[1]} x {sim.shape[0]}; fix -detpixels_f/-detpixels_s "
                         "in --model")
    if symmetry is not None:  # tie the starting cell to the crystal system (e.g. cell_b = cell_a)
        start.update(tie_start_cell(symmetry, sim.setup.params, start))
    # early check of names (the run's space decides groups such as 'cell')
    space = ParameterSpace(symmetry=symmetry or "triclinic", background=args.background,
                           anisotropic_N=any(n in ("N_a", "N_b", "N_c") for n in (args.refine or []) + list(fixed)))
    for label, names in (("--refine", args.refine), ("--fix", fixed), ("--esd-extra", args.esd_extra)):
        if names:
            try:
                space.expand(names)
            except InputError as exc:
                raise InputError(f"{label}: {exc}") from None

    # ---- pixels ---------------------------------------------------------------------------------------
    x0, x1, y0, y1 = sim.setup.roi
    use = mask & roi_mask(observed.shape, (x0, x1, y0, y1))
    if args.dmin is not None or args.dmax is not None:
        use &= resolution_mask(sim, args.dmin, args.dmax, (x0, x1, y0, y1))
    spots = None
    if args.spots:
        from refine.spots import find_spots, read_spot_list, window_mask

        if args.spots == "find":
            spots = find_spots(observed, use, roi=(x0, x1, y0, y1))
        else:
            spots = read_spot_list(args.spots, args.spot_columns, observed.shape)
        sx, sy = np.floor(spots[:, 0]).astype(int), np.floor(spots[:, 1]).astype(int)
        inside = (sx >= x0) & (sx <= x1) & (sy >= y0) & (sy <= y1)
        inside &= use[np.clip(sy, 0, use.shape[0] - 1), np.clip(sx, 0, use.shape[1] - 1)]
        spots = spots[inside]
        if len(spots) == 0:
            raise InputError(f"--spots {args.spots}: no spot inside the fitted region")
        say(f"  {len(spots)} observed spots in the fitted region")
        if args.spot_window is not None:
            win = window_mask(observed.shape, spots, int(args.spot_window))
            rest = subsample_mask(use & ~win, args.subsample, args.seed) if args.subsample else np.zeros_like(use)
            use = (use & win) | rest
    if args.subsample and args.spot_window is None:
        use = subsample_mask(use, args.subsample, args.seed)
    n_used = int(use.sum())
    if n_used == 0:
        raise InputError("no pixel left to fit: the mask, --roi, --dmin/--dmax and --subsample exclude every pixel")
    if n_used < use.size:
        sim = sim.restricted(use)
    sim.set_compile(*runtime.compile_policy("refinement", n_used * sim.evaluations_per_pixel(), explicit=args.compile))
    say(f"  fitting {n_used} of {use.size} pixels ({100.0 * n_used / use.size:.3g}%), "
        f"{sim.evaluations_per_pixel()} evaluations per pixel, {sim.compile_mode} kernel, "
        f"{args.dtype} on {args.device}")

    # ---- starting scale and background of a measured image --------------------------------------------
    if args.image and not ({"scale", "background"} <= set(start)) and not args.resume:
        from refine.model import fit_scale_background

        vals0 = {n: float(v) for n, v in sim.setup.params.items()}
        vals0.update({k: v for k, v in start.items() if k in vals0})
        s0, b0 = fit_scale_background(sim, vals0, observed, use)
        start.setdefault("scale", s0)
        start.setdefault("background", b0)
        say(f"  start: scale {start['scale']:.4g}, background {start['background']:.4g} photons/pixel "
            "(Poisson fit of the starting model)")

    # ---- spots before -------------------------------------------------------------------------------
    def offsets(values: dict) -> Any:
        from nbtorch import eager
        from refine.spots import spot_offsets

        with eager():
            return spot_offsets(sim, values, spots)

    spots_before = None
    if spots is not None:
        vals0 = {n: float(v) for n, v in sim.setup.params.items()}
        vals0.update({k: v for k, v in start.items() if k in vals0})
        spots_before = offsets(vals0)

    # ---- refine ----------------------------------------------------------------------------------------
    for directory in make_dirs:
        directory.mkdir(parents=True, exist_ok=True)
    callbacks = []
    if args.logdir:
        callbacks.append(TensorBoardCallback(args.logdir, every=args.tb_every))
        say(f"  TensorBoard logs: {args.logdir}")
    if sim.compile_mode == "compiled" and not args.no_esds:
        callbacks.append(_EagerForEsds(sim))
    progress = False if args.quiet else None
    result = refine(sim, observed, start=start, free=free_default if args.refine is None else None, fixed=fixed,
                    symmetry=symmetry, bounds=bounds, mask=use, stages=stages,
                    strategy=args.optimizer, background=args.background, loss=args.loss, callbacks=callbacks,
                    progress=progress, time_budget_s=args.time_budget, checkpoint=ckpt_path,
                    checkpoint_every=args.checkpoint_every, resume=ckpt_path if args.resume else None,
                    esds=not args.no_esds)

    # ---- after -------------------------------------------------------------------------------------------
    if spots is not None:
        after = offsets(dict(result.params))
        both = spots_before.matched & after.matched
        extra["spots"] = {
            "source": args.spots, "n": int(len(spots)),
            "matched_start": int(spots_before.matched.sum()), "matched_final": int(after.matched.sum()),
            "rms_px_start": spots_before.rms(), "rms_px_final": after.rms(),
            "rms_px_start_common": spots_before.rms(both), "rms_px_final_common": after.rms(both),
            "n_common": int(both.sum()), "mean_px_final": after.mean(),
            "observed": spots, "predicted_start": spots_before.predicted, "predicted_final": after.predicted,
        }
    if args.esd_extra:
        from refine.degeneracy import extended_uncertainties

        from nbtorch import eager

        with eager():  # second derivatives: never through a compiled graph
            u = extended_uncertainties(sim, result.observed, result.mask, result, args.esd_extra, args.background)
        extra["esd_extra"] = {"names": list(u.names), "esds": u.as_dict(), "correlation": u.correlation,
                              "condition": u.condition}
    write_outputs(result, args.out, json_path, extra)
    if args.report:
        from refine.html_report import write_report  # matplotlib: only when a report is asked for

        write_report(args.report, args.out, f"{PROG}: {Path(args.image).name if args.image else args.problem}")

    # ---- report --------------------------------------------------------------------------------------------
    say(f"status: {result.status.value} ({result.message})")
    say(f"loss: {result.loss_initial:.6g} -> {result.loss_final:.6g} in {result.steps} steps "
        f"({result.evaluations} evaluations), {result.wall_s:.1f} s")
    say(results_table(result, truth))
    if result.esd_kinds:
        say(ESD_NOTE)
    if result.fit:
        say(f"fit: final loss {result.fit['excess']:.3g}x the shot-noise expectation of the refined model "
            f"(about 1 = a fit to the noise level)")
    for w in result.warnings:
        say(f"warning: {w}")
    if spots is not None:
        s = extra["spots"]
        say(f"spots: rms offset {s['rms_px_start_common']:.3g} px -> {s['rms_px_final_common']:.3g} px over the "
            f"{s['n_common']} spots matched before and after ({s['matched_start']} -> {s['matched_final']} of "
            f"{s['n']} matched)")
    if args.esd_extra:
        e = extra["esd_extra"]
        names = e["names"]
        corr = np.asarray(e["correlation"])
        for x in [n for n in names if n not in result.free]:
            i = names.index(x)
            pairs = ", ".join(f"{n} {corr[i, names.index(n)]:+.3f}" for n in names if n != x and
                              (n.startswith("cell_") or n in ("wavelength", "distance")))
            say(f"{x} (fixed) esd if refined: {e['esds'][x]:.3g}; correlation with {pairs}")
        freed = [n for n in names if n not in result.free]
        widened = ", ".join(f"{n} {e['esds'][n]:.2g}" for n in ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta",
                                                                 "cell_gamma") if n in e["esds"] and n in result.esds)
        if widened:
            say(f"esds with {', '.join(freed)} refined as well: {widened}")
    say(f"wrote {args.out} and {json_path}{' and ' + args.report if args.report else ''} "
        f"({time.monotonic() - t0:.1f} s in all)")
    if args.logdir:
        say(f"TensorBoard logs: {os.path.abspath(args.logdir)}  (view: tensorboard --logdir {args.logdir})")
    return 0 if result.status.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nbtorch-refine``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        if args.images:
            from refine.batch import run_batch

            return run_batch(args, run, (lambda line: None) if args.quiet else print)
        return run(args)
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from refine.runner import RefinementInterrupted

        where = ""
        if isinstance(exc, RefinementInterrupted) and exc.checkpoint is not None:
            where = f"; continue with the same command and --resume (checkpoint {exc.checkpoint})"
        print(f"{PROG}: interrupted{where}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
