"""The ``nbtorch-refine`` command: refine a nanoBragg model against a measured or synthetic still image.

::

    nbtorch-refine --image OBS --model "<nanoBragg flags of the starting model>" [--config run.toml]
                   [--refine cell,orientation,beam_x,beam_y,mosaic,scale,background | --stages stage_a]
                   [--symmetry NAME] [--fix distance] [--start cell_a=57.8,cell_c=150]
                   [--optimizer lbfgs|adam] [--loss poisson|gaussian|mse|...] [--max-steps N]
                   [--roi X0 X1 Y0 Y1] [--dmin D] [--dmax D] [--subsample F] [--spots FILE|find [--spot-columns X,Y]]
                   [--out result.h5] [--json result.json] [--logdir runs/NAME] [--resume]
                   [--device cpu|cuda] [--dtype float64|float32] [--kernel-dtype float32] [--quiet]
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
import contextlib
import math
import shlex
import sys
from dataclasses import replace
from typing import Any, Sequence

from losses import LOSSES
from nbtorch import runtime
from nbtorch.cli_support import Parser, Printer, argument_files
from nbtorch.errors import InputError
from nbtorch.io import read_toml
from refine.quality.identifiability import TOO_FEW_SPOTS
from refine.solver.loop import Convergence
from refine.fitting.objective import check_priors
from refine.fitting.parameters import BASE_NAMES
from refine.solver.precondition import PRECONDITIONER_NAMES
from refine.solver.runner import RefinementInterrupted
from refine.solver.stages import MEASURED_DETECTOR, Stage, coarse_to_fine, stage_a
from refine.solver.strategies import LBFGS, Adam
from refine.fitting.structure_factors import AMPLITUDE_STARTS, DEFAULT_MIN_PHOTONS

__all__ = ["main", "build_parser", "parse_args", "run"]

PROG = "nbtorch-refine"
_DEFAULT_DATASET = "/entry/data/data"
_STAGE_KEYS = ("name", "free", "optimizer", "lr", "history_size", "precondition", "max_steps", "roi_fraction", "bin",
               "n_factor", "ftol", "xtol")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``--help`` text).

    Long because it is the option table, one ``add_argument`` per option in ``--help`` order; splitting
    it would only scatter the table."""
    p = Parser(prog=PROG, description="Refine a nanoBragg model against a measured still image.",
               epilog="Tutorial and every option: docs/refinement.md")
    g = input_group = p.add_argument_group("input")
    g.add_argument("--image", help="measured image: SMV (.img), mini-CBF (.cbf, .cbf.bz2, .cbf.gz), "
                                   "HDF5/NeXus or Eiger master (.h5, .nxs), TIFF or Pilatus TIFF (.tif), "
                                   "MarCCD/Rayonix (.mccd), mar345 (.mar2300) or raw (.bin, with --shape)")
    g.add_argument("--images", nargs="+", metavar="IMAGE", help="independent mode: refine each of these images on its "
                   "own (paths, quoted glob patterns, @LIST files); {stem} in --model/--spots/--mask is the image's "
                   "name; results in --out-dir/<stem>/ and a summary (docs/refinement.md, 'Many images')")
    g.add_argument("--out-dir", help="independent mode: folder of the per-image results and summary.csv/summary.h5 "
                                     "(default out/batch)")
    g.add_argument("--redo", action="store_true", help="independent mode: refine images already done again")
    g.add_argument("--joint", action="store_true", help="joint mode: refine the --images together, with --shared "
                   "names common to all; writes --out-dir/joint.json and joint.h5 (docs/many-images.md)")
    g.add_argument("--shared", help="joint mode: groups/names shared by every image, comma-separated (default cell; "
                                    "cell,orientation with --rotation-series)")
    g.add_argument("--per-image", help="joint mode: groups/names of each image, comma-separated "
                                       "(default scale,background,orientation; scale,background with "
                                       "--rotation-series)")
    g.add_argument("--rotation-series", action="store_true", help="joint mode for a sweep of rotation images of one "
                   "crystal, each with its phi start and width from its header: --joint with --shared "
                   "cell,orientation and --per-image scale,background unless given (docs/many-images.md)")
    g.add_argument("--pixel-memory", type=float, metavar="MB", help="joint mode: megabytes of fitted pixels each "
                   "process holds; the images beyond it are written to --out-dir/pixels/ and read back at each "
                   "evaluation (0: every image; default a quarter of the machine's memory per local process)")
    g.add_argument("--frame", type=int, help="frame index of a 3-D HDF5 dataset")
    g.add_argument("--dataset", default=_DEFAULT_DATASET, help="HDF5 dataset of the image (default %(default)s)")
    g.add_argument("--shape", type=int, nargs=2, metavar=("SLOW", "FAST"), help="shape of a raw image")
    g.add_argument("--raw-dtype", default="<f4", help="element type of a raw image (numpy, default %(default)s)")
    g.add_argument("--mask", help="mask file (any image format, same shape; nonzero = use the pixel)")
    g.add_argument("--saturation", type=float, help="mask pixels >= this (default: the header's count cutoff)")
    g.add_argument("--mask-nan", action="store_true", help="mask NaN/Inf pixels instead of refusing the image")
    g.add_argument("--no-parallax", dest="parallax", action="store_false",
                   help="leave the sensor's thickness and absorption (parallax) out of the model; by default a "
                        "header's sensor thickness enters it with silicon's attenuation length (docs/refinement.md)")
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
    g.add_argument("--fix", type=_csv, help="names or groups never refined (default with --image and the default "
                                            "schedule: distance, which one image cannot separate from the cell; "
                                            "--fix none refines everything)")
    g.add_argument("--start", type=_csv, help="starting values overriding the model: name=value,... "
                                              "(cell values tied by --symmetry follow)")
    g.add_argument("--symmetry", help="crystal system: triclinic (default; --problem: its own), monoclinic, orthorhombic, tetragonal, "
                                      "trigonal, hexagonal, rhombohedral, cubic; or a space-group name such as P41212")
    g.add_argument("--structure-factors", action="store_true",
                   help="then refine one amplitude F_h_k_l per symmetry-unique reflection the fitted pixels see, with "
                        "the geometry (a last stage; needs a space group: --space-group or --symmetry P41212)")
    g.add_argument("--space-group", help="space group of the amplitudes (default: --symmetry when it names one)")
    g.add_argument("--f-start", default="auto", choices=AMPLITUDE_STARTS,
                   help="starting amplitudes: file (the model's -hkl), one (-default_F for all), estimate (EM from "
                        "the observed spots at the refined geometry); auto (default): file with -hkl, else estimate")
    g.add_argument("--f-min-photons", type=float, default=DEFAULT_MIN_PHOTONS,
                   help="Bragg photons a reflection needs on the fitted pixels to be refined (default %(default)s)")
    g.add_argument("--f-restraint", type=float, metavar="SIGMA",
                   help="restrain each amplitude towards its resolution bin's mean, relative width SIGMA (e.g. 0.5)")
    g.add_argument("--background", default="constant", choices=("constant", "planar"), help="background model")
    g.add_argument("--bounds", type=_csv, help="name=low:high,... refine inside open intervals")
    g.add_argument("--prior", type=_csv, help="name=mean:sigma,... Gaussian priors (restraints) on refined names, "
                                              "each in its own unit (e.g. distance=150:0.5); they add "
                                              "0.5 ((value - mean)/sigma)^2 to the loss and count in the esds")
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
    g.add_argument("--too-few-spots", choices=TOO_FEW_SPOTS, default="fix",
                   help="with --spots, fewer than 5 observed spots per refined parameter: fix the least determined "
                        "parameters (default: domain size, mosaic, cell angles, cell lengths, distance, tilts, beam "
                        "centre, in that order, until 5 per parameter), warn and refine all, or fail")
    g.add_argument("--spot-columns", metavar="X,Y", help="the x (fast) and y (slow) columns of the --spots table: "
                                                          "two header names or 1-based column numbers (e.g. "
                                                          "xobs,yobs or 6,7)")
    g.add_argument("--spot-window", type=int, help="fit the pixels within this many pixels of a spot "
                                                   "(plus --subsample of the others)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of --subsample and of the spot noise floor's Poisson draws (default %(default)s)")
    g = output_group = p.add_argument_group("output")
    g.add_argument("--out", default="result.h5", help="result HDF5 file (default %(default)s)")
    g.add_argument("--json", help="result JSON file (default: --out with .json)")
    g.add_argument("--hkl-out", help="with --structure-factors: the refined amplitudes as a nanoBragg -hkl file, "
                                     "every equivalent written (default: --out with .hkl)")
    g.add_argument("--report", help="self-contained HTML report of the run (parameter table, loss and parameters per "
                                    "step, image crops with spots, spot offsets, residuals, correlations)")
    g.add_argument("--logdir", help="TensorBoard log directory (default: no logs)")
    g.add_argument("--tb-every", type=int, default=10, help="TensorBoard images every N steps (default %(default)s)")
    g.add_argument("--checkpoint", help="checkpoint file (default: --out with .ckpt.h5; joint mode: "
                                        "--out-dir/joint.ckpt.h5)")
    g.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint period in steps (default %(default)s)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    g.add_argument("--no-esds", action="store_true", help="skip the uncertainty estimate")
    g.add_argument("--esd-extra", type=_csv, help="also report esds and correlations of these fixed parameters "
                                                  "at the refined point (e.g. distance)")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no printing (errors only)")
    g = p.add_argument_group("compute")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    g.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="default %(default)s")
    g.add_argument("--kernel-dtype", choices=("float64", "float32"),
                   help="dtype of the simulator's per-pixel kernel only (default: --dtype); float32 with --dtype "
                        "float64 keeps parameters, geometry, the loss and the sums over tiles in float64, but its "
                        "Miller indices are float32: a run ends at that precision, often after more evaluations")
    g.add_argument("--compile", dest="compile", action="store_const", const=True,
                   help="torch.compile the simulator kernel (default: only for big jobs)")
    g.add_argument("--no-compile", dest="compile", action="store_const", const=False, help="never compile")
    from refine.inputs.dials import add_options as add_dials_options

    add_dials_options(input_group, output_group)
    return p


# ------------------------------------------------------------------------------ config file


def _config_tokens(path: str, parser: argparse.ArgumentParser) -> tuple[list[str], list | None]:
    """Command-line tokens equivalent to a TOML config, and its ``[[stages]]`` tables (None if absent)."""
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
                tokens.append(f"{flag}={','.join(str(v) for v in value)}")
        else:  # flag=value: a value that starts with '-' (model = "-mosflm") is not taken for an option
            tokens.append(f"{flag}={value}")
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
    if args.rotation_series:
        if not args.images:
            raise InputError("--rotation-series: only with --images (the rotation images of the sweep)")
        args.joint = True
    for flag, value in (("--joint", args.joint), ("--shared", args.shared), ("--per-image", args.per_image),
                        ("--pixel-memory", args.pixel_memory is not None)):
        if value and not (args.images and args.joint):
            raise InputError(f"{flag}: only with --images and --joint (joint mode)")
    if args.pixel_memory is not None and not (args.pixel_memory >= 0 and math.isfinite(args.pixel_memory)):
        raise InputError(f"--pixel-memory: expected megabytes >= 0, got {args.pixel_memory:g}")
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


def build_stages(args: argparse.Namespace):
    """The stages of the run: ``--refine`` (one stage, ``--coarse`` adds coarse copies), ``[[stages]]`` tables
    from ``--config``, or ``--stages stage_a``; None = the core's default (stage_a with ``--optimizer``).
    ``--precondition`` (when given) replaces every stage's own."""
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
    if args.image:  # a measured image: the detector stage refines the tilt too (and the distance, unless fixed)
        return stage_a(strategy, max_steps=args.max_steps, detector=MEASURED_DETECTOR)
    if (args.stages is None and args.max_steps is None and args.optimizer == "lbfgs" and args.lr is None
            and args.history_size is None and args.precondition is None):
        return None
    return stage_a(strategy, max_steps=args.max_steps)


def _check_loss(name: str) -> None:
    if name not in LOSSES:
        raise InputError(f"--loss: unknown loss {name!r}; valid: {', '.join(LOSSES)}")


def _command_inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``(option, path)`` of the files the command itself reads (``@FILE`` tokens of ``--model`` too)."""
    inputs = [("--image", args.image), ("--mask", args.mask), ("--config", args.config),
              ("--spots", args.spots if args.spots != "find" else None), ("--expt", args.expt),
              ("--refl", args.refl)]
    if isinstance(args.model, str):
        inputs += argument_files(args.model.split(), "--model")
    return inputs


# ------------------------------------------------------------------------------ the run


def run(args: argparse.Namespace) -> int:
    """Load, refine, write (:func:`refine.cli.single.run`, the steps of the run).  Returns the exit status."""
    from refine.cli.single import run as run_command  # refine.cli.single imports this module's helpers

    return run_command(args)


def _dispatch(args: argparse.Namespace) -> int:
    """Joint, independent or single mode."""
    if args.images and args.joint:
        from refine.cli.joint import run_joint  # imports refine.cli.single, which imports this module

        return run_joint(args, Printer(args.quiet))
    if args.images:
        from refine.many.batch import run_batch

        return run_batch(args, run, Printer(args.quiet))
    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nbtorch-refine``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    runtime.tune_allocator()
    try:
        args = parse_args(argv)
        # --no-compile: nothing compiled, the esds' forward-mode kernels (refine.quality.uncertainty) included
        with runtime.eager() if args.compile is False else contextlib.nullcontext():
            return _dispatch(args)
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        where = ""
        if isinstance(exc, RefinementInterrupted) and exc.checkpoint is not None:
            where = f"; continue with the same command and --resume (checkpoint {exc.checkpoint})"
        print(f"{PROG}: interrupted{where}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
