"""The ``nbtorch-refine`` option table and the door: argv (and ``--config``) parsed into typed :class:`Options`.

::

    nbtorch-refine --image OBS --model "<nanoBragg flags of the starting model>" [--config run.toml]
                   [--refine cell,orientation,beam_x,beam_y,mosaic,scale,background | --stages stage_a]
                   [--symmetry NAME] [--fix distance] [--start cell_a=57.8,cell_c=150]
                   [--optimizer lbfgs|adam] [--loss poisson|gaussian|mse|...] [--max-steps N]
                   [--roi X0 X1 Y0 Y1] [--dmin D] [--dmax D] [--subsample F] [--spots FILE|find [--spot-columns X,Y]]
                   [--out result.h5] [--json result.json] [--logdir runs/NAME] [--resume]
                   [--device cpu|cuda] [--dtype float64|float32] [--kernel-dtype float32] [--quiet]
    nbtorch-refine --problem tetragonal_mosflm --size 64 ...      # a synthetic problem with known truth

Every option is documented by ``--help`` and in ``docs/options.md`` (generated from this parser); its groups there are the groups of
:class:`refine.cli.options.Options`.  The run itself: :mod:`refine.cli.main`.
"""

from __future__ import annotations

import argparse
import math
import shlex
from typing import Sequence

from nbtorch.cli.support import Parser
from nbtorch.errors import InputError
from nbtorch.io import read_toml
from refine.inputs.dials_pairs import path_count, refuse_with_pairs
from refine.cli.options import DEFAULT_DATASET, GEOMETRY_PRIORS, GROUP_TITLES, PROG, Options, options_from_namespace
from refine.modes.values import csv_names
from refine.many.distributed import process_device
from refine.fitting.structure_factors import AMPLITUDE_STARTS, DEFAULT_MIN_PHOTONS
from refine.quality.identifiability import TOO_FEW_SPOTS
from refine.solver.precondition import PRECONDITIONER_NAMES

__all__ = ["build_parser", "parse_args", "parse_namespace"]


def add_dials_options(group) -> None:
    """The DIALS options of :func:`build_parser`, added to its argparse ``group``."""
    group.add_argument("--expt", nargs="+", help="DIALS experiment (.expt) as the starting model (geometry, beam, "
                                                 "crystal); --model flags are applied after it; several (or "
                                                 "globs), paired in order with --refl's: one set of stills")
    group.add_argument("--expt-index", type=int, default=None,
                             help="which experiment of --expt (and id of --refl) (default 0)")
    group.add_argument("--expt-image", type=int, default=None,
                             help="rotation scans: image of the scan that --image is, 0 = the first (default: from the "
                                  "image's file name and the experiment's template, else 0)")
    group.add_argument("--refl", nargs="+", help="DIALS reflections (.refl): their xyzobs.px.value centroids are the "
                                            "spot list (as --spots); with a still's --expt, one --image is fitted in "
                                            "windows about them with the defaults --refine, --spot-window and "
                                            "--subsample say (docs/still-from-dials.md)")
    group.add_argument("--panel-groups", type=int, default=None, metavar="LEVEL",
                       help="a multi-panel --expt: the level of its hierarchy whose groups move as rigid bodies "
                            "(0 the whole detector, the last each panel; default 0); the detector names refine "
                            "each group's changes <name>_g<k>")
    group.add_argument("--expt-out", help="write the refined model as a DIALS experiment (.expt): the --expt "
                                                 "document with the refined values, or without --expt a new still "
                                                 "experiment (space group from --symmetry when it names one)")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The argument parser (``--help`` text); with ``parser``, the option groups are added to that parser instead
    (a command that takes nbtorch-refine's inputs plus options of its own: the experiments' scripts).

    Long because it is the option table, one ``add_argument`` per option in ``--help`` order; splitting
    it would only scatter the table."""
    p = parser if parser is not None else Parser(
        prog=PROG, description="Refine a nanoBragg model against measured images: one still, many stills "
                               "(independent or joint) or a rotation sweep.",
        epilog="Every option: docs/options.md; a still from DIALS: docs/still-from-dials.md; a sweep: "
               "docs/sweep-from-dials.md; many stills: docs/many-stills.md")
    g = p.add_argument_group(GROUP_TITLES["image"])
    g.add_argument("--image", help="measured image: SMV (.img), mini-CBF (.cbf, .cbf.bz2, .cbf.gz), "
                                   "HDF5/NeXus or Eiger master (.h5, .nxs), TIFF or Pilatus TIFF (.tif), "
                                   "MarCCD/Rayonix (.mccd), mar345 (.mar2300) or raw (.bin, with --shape)")
    g.add_argument("--frame", type=int, help="frame index of a 3-D HDF5 dataset")
    g.add_argument("--dataset", default=DEFAULT_DATASET, help="HDF5 dataset of the image (default %(default)s)")
    g.add_argument("--shape", type=int, nargs=2, metavar=("SLOW", "FAST"), help="shape of a raw image")
    g.add_argument("--raw-dtype", default="<f4", help="element type of a raw image (numpy, default %(default)s)")
    g.add_argument("--mask", help="mask file (any image format, same shape; nonzero = use the pixel)")
    g.add_argument("--saturation", type=float, help="mask pixels >= this (default: the header's count cutoff)")
    g.add_argument("--mask-nan", action="store_true", help="mask NaN/Inf pixels instead of refusing the image")
    g.add_argument("--no-parallax", dest="parallax", action="store_false",
                   help="leave the sensor's thickness and absorption (parallax) out of the model; by default a "
                        "header's sensor thickness enters it with silicon's attenuation length (docs/formats.md)")
    g.add_argument("--gain", type=float, help="detector counts per photon (default: the header's; 1 for photon "
                                              "counters and nanoBragg's noise images): photons = (counts - offset) / gain")
    g.add_argument("--adc-offset", type=float, help="counts the detector adds to every pixel (default: the header's; "
                                                    "40 for an SMV image nanoBragg wrote, its -adc; 0 for Pilatus, Eiger)")
    g = p.add_argument_group(GROUP_TITLES["model"])
    g.add_argument("--model", help='nanoBragg flags of the starting model ("@FILE" reads flags from FILE); '
                                   "the image header fills in wavelength, distance, beam centre, pixel size and "
                                   "detector size that the flags leave out; a mosaic spread without -mosaic_dom gets "
                                   "80 domains of the even set on a still, 40 on a rotation image. With --expt: a "
                                   "sweep's DIALS profile gives -N and -mosaic; a still's experiment (ML_domain_size_ang, "
                                   "ML_half_mosaicity_deg, profile sigma_b) makes --model optional; its flags replace "
                                   "those")
    g.add_argument("--f-column", help="amplitude column of an MTZ or mmCIF -hkl file in --model (e.g. FP, F-obs, "
                                      "F_meas_au; adds -hkl_column to the model's flags)")
    g.add_argument("--problem", help="refine a synthetic problem of the bank instead of --image (refine.PROBLEMS)")
    g.add_argument("--size", type=int, default=64, help="detector pixels per side of --problem (default %(default)s)")
    g.add_argument("--config", help="TOML file of options (keys = long option names; command-line flags win)")
    g = p.add_argument_group(GROUP_TITLES["dials"])
    add_dials_options(g)
    g = p.add_argument_group(GROUP_TITLES["many"])
    g.add_argument("--images", nargs="+", metavar="IMAGE", help="independent mode: refine each of these images on its "
                   "own (paths, quoted glob patterns, @LIST files); {stem} in --model/--spots/--mask is the image's "
                   "name; results in --out-dir/<stem>/ and a summary (docs/many-stills.md)")
    g.add_argument("--out-dir", help="independent mode: folder of the per-image results and summary.csv/summary.h5 "
                                     "(default out/batch)")
    g.add_argument("--redo", action="store_true", help="independent mode: refine images already done again")
    g.add_argument("--skip-missing", action="store_true", help="many stills of one DIALS file (--expt and --refl "
                   "without --image): skip the experiments whose image is not there, each listed with the reason in "
                   "the summary, instead of refusing the run (docs/many-stills.md)")
    g.add_argument("--joint", action="store_true", help="joint mode: refine the --images together, with --shared "
                   "names common to all; writes --out-dir/joint.json and joint.h5 (docs/many-stills.md)")
    g.add_argument("--shared", help="joint mode: groups/names shared by every image, comma-separated (default cell; the "
                                    "stills of one --expt/--refl file: cell,distance; "
                                    "cell,orientation with --rotation-series; a rotation series from --expt and "
                                    "--refl adds distance, beam_centre (with DIALS's prior, --geometry-prior) and "
                                    "mosaic where its spots decide them)")
    g.add_argument("--per-image", help="joint mode: groups/names of each image, comma-separated "
                                       "(default scale,background,orientation; scale,background with "
                                       "--rotation-series; the same with --expt and --refl)")
    g.add_argument("--rotation-series", action="store_true", help="joint mode for a sweep of rotation images of one "
                   "crystal, each with its phi start and width from its header: --joint with --shared "
                   "cell,orientation and --per-image scale,background unless given (docs/sweep-from-dials.md)")
    g.add_argument("--geometry-prior", choices=GEOMETRY_PRIORS, help="a rotation series from --expt/--refl: dials "
                   "(default) refines the distance and beam centre (and any detector name of --shared) with a Gaussian "
                   "prior at DIALS's values, each as wide as the esd the .refl's indexed spots give it, so the cell's "
                   "esds carry the geometry's uncertainty; none: the shared geometry without a prior (--shared "
                   "cell,orientation holds it; --prior name=mean:sigma replaces one)")
    g.add_argument("--pixel-memory", type=float, metavar="MB", help="joint mode: megabytes of fitted pixels each "
                   "process holds; the images beyond it are written to --out-dir/pixels/ and read back at each "
                   "evaluation (0: every image; default a quarter of the machine's memory per local process)")
    g.add_argument("--screen", action="store_true", help="joint mode for serial data: refine in rounds and drop the "
                   "images that do not fit, each with its reason (docs/many-stills.md)")
    g.add_argument("--add-to", metavar="JOINT_H5", help="joint mode: add images to a finished --screen run (its "
                   "OUT_DIR/joint.h5), whose images come first in --images, in the same order: they continue from "
                   "their refined values, the new ones are added (implies --screen)")
    g = p.add_argument_group(GROUP_TITLES["fit"])
    g.add_argument("--refine", type=csv_names, help="one stage refining these canonical names and groups (comma-separated): "
                                               "cell orientation mosaic mosaic_aniso Ndef detector beam_centre wavelength "
                                               "beam (the beam's widths) scale background, or names such as beam_x, "
                                               "mosaic_spread, N, distance, dispersion. Default: the stage_a schedule; "
                                               "one still from --expt and --refl: scale,background,orientation,cell,"
                                               "mosaic,beam_centre,distance less the --fix names; a rotation series from --expt and "
                                               "--refl: --shared and --per-image")
    g.add_argument("--stages", help="a named schedule: stage_a (default without --expt and --refl; coarse-to-fine, docs/python.md)")
    g.add_argument("--fix", type=csv_names, help="names or groups never refined (default with --image and the default "
                                            "schedule: distance, which one image cannot separate from the cell; "
                                            "one still from --expt and --refl: nothing, the distance is refined with "
                                            "the cell; --fix none refines everything)")
    g.add_argument("--start", type=csv_names, help="starting values overriding the model: name=value,... "
                                              "(cell values tied by --symmetry follow)")
    g.add_argument("--symmetry", help="crystal system (default: an --expt crystal's, a --problem's own, else triclinic): triclinic, monoclinic, orthorhombic, tetragonal, "
                                      "trigonal, hexagonal, rhombohedral, cubic; or a space-group name such as P41212")
    g.add_argument("--background", default="auto",
                   help="background model: constant, planar, resolution[:K] (a linear spline in 1/d with K refined "
                        "knots background_0.., default 6) or planes (a plane held per spot window; needs "
                        "--spots/--refl and --spot-window); default auto: planes for a measured image fitted in spot "
                        "windows, constant otherwise")
    g.add_argument("--bounds", type=csv_names, help="name=low:high,... refine inside open intervals")
    g.add_argument("--prior", type=csv_names, help="name=mean:sigma,... Gaussian priors (restraints) on refined names, "
                                              "each in its own unit (e.g. distance=150:0.5); they add "
                                              "0.5 ((value - mean)/sigma)^2 to the loss and count in the esds; "
                                              "in a joint run, on shared names, once")
    g = p.add_argument_group(GROUP_TITLES["amplitudes"])
    g.add_argument("--structure-factors", action=argparse.BooleanOptionalAction, default=None,
                   help="then refine one amplitude F_h_k_l per symmetry-unique reflection the fitted pixels see, with "
                        "the geometry (a last stage; needs a space group: --space-group, --symmetry P41212 or the "
                        "--expt crystal's). Default: on for a --rotation-series from --expt and --refl whose "
                        "experiment names a space group, off otherwise")
    g.add_argument("--space-group", help="space group of the amplitudes (default: --symmetry when it names one, "
                                         "else the --expt crystal's)")
    g.add_argument("--f-start", default="auto", choices=AMPLITUDE_STARTS,
                   help="starting amplitudes: file (the model's -hkl), one (-default_F for all), estimate (EM from "
                        "the observed spots at the refined geometry); auto (default): file with -hkl, else estimate")
    g.add_argument("--f-min-photons", type=float, default=DEFAULT_MIN_PHOTONS,
                   help="Bragg photons a reflection needs on the fitted pixels to be refined (default %(default)s)")
    g.add_argument("--f-restraint", type=float, metavar="SIGMA",
                   help="restrain each amplitude towards its resolution bin's mean, relative width SIGMA (e.g. 0.5)")
    g.add_argument("--anomalous", action="store_true",
                   help="refine F(+) and F(-) of each acentric reflection apart (Friedel mates not tied; refused in a "
                        "centrosymmetric space group or when no reflection has both mates in the data)")
    g.add_argument("--anomalous-restraint", type=float, metavar="SIGMA",
                   help="with --anomalous: restrain each pair's F(+) - F(-), relative width SIGMA of their mean")
    g = p.add_argument_group(GROUP_TITLES["optimiser"])
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
    g = p.add_argument_group(GROUP_TITLES["pixels"])
    g.add_argument("--roi", type=int, nargs=4, metavar=("X0", "X1", "Y0", "Y1"),
                   help="fit only this rectangle (inclusive fast x and slow y pixel bounds)")
    g.add_argument("--dmin", type=float, help="high-resolution limit (Å): mask pixels with d < dmin")
    g.add_argument("--dmax", type=float, help="low-resolution limit (Å): mask pixels with d > dmax")
    g.add_argument("--subsample", type=float, help="fit a random fraction of the pixels (with --spot-window: of "
                                                   "the pixels outside the spot windows). Default: none; one still "
                                                   "from --expt and --refl: 0.02 of the pixels outside the windows, "
                                                   "at most a quarter as many as the windows hold")
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
                                                   "(plus --subsample of the others). Default: none; DIALS spots (--expt "
                                                   "and --refl) from the profile's sigma_b, 5 without one: a rotation "
                                                   "scan ceil(3 sigma_b)+1 pixels, a still ceil(3 sigma_b/sqrt 2), at least 2")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of --subsample and of the spot noise floor's Poisson draws (default %(default)s)")
    g = p.add_argument_group(GROUP_TITLES["output"])
    g.add_argument("--out", default="result.h5", help="result HDF5 file (default %(default)s)")
    g.add_argument("--json", help="result JSON file (default: --out with .json)")
    g.add_argument("--hkl-out", help="with --structure-factors: the refined amplitudes as a nanoBragg -hkl file, "
                                     "every equivalent written (default: --out with .hkl)")
    g.add_argument("--mtz-out", help="with --structure-factors: the refined amplitudes as an MTZ file (H K L, F, SIGF, "
                                     "NOBS; with --anomalous also F(+), SIGF(+), F(-), SIGF(-), DANO, SIGDANO); "
                                     "default none")
    g.add_argument("--report", help="self-contained HTML report of the run (parameter table, loss and parameters per "
                                    "step, image crops with spots, spot offsets, residuals, correlations)")
    g.add_argument("--logdir", help="TensorBoard log directory (default: no logs)")
    g.add_argument("--tb-every", type=int, default=10, help="TensorBoard images every N steps (default %(default)s)")
    g.add_argument("--checkpoint", help="checkpoint file (default: --out with .ckpt.h5; joint mode: "
                                        "--out-dir/joint.ckpt.h5)")
    g.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint period in steps (default %(default)s)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    g.add_argument("--no-esds", action="store_true", help="skip the uncertainty estimate")
    g.add_argument("--esd-extra", type=csv_names, help="also report esds and correlations of these fixed parameters "
                                                  "at the refined point (e.g. distance)")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no printing (errors only)")
    g = p.add_argument_group(GROUP_TITLES["compute"])
    g.add_argument("--device", default="cpu", help="cpu, cuda[:N] or cuda:0,cuda:2 (default %(default)s); "
                                                   "torchrun: each process by local rank")
    g.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="default %(default)s")
    g.add_argument("--kernel-dtype", choices=("float64", "float32"),
                   help="dtype of the simulator's per-pixel kernel only (default: --dtype); float32 with --dtype "
                        "float64 keeps parameters, geometry, the loss and the sums over tiles in float64, but its "
                        "Miller indices are float32: a run ends at that precision, often after more evaluations")
    g.add_argument("--compile", dest="compile", action="store_const", const=True,
                   help="torch.compile the simulator kernel (default: only for big jobs)")
    g.add_argument("--no-compile", dest="compile", action="store_const", const=False, help="never compile")
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


def parse_args(argv: Sequence[str]) -> Options:
    """Parse ``argv`` after the options of ``--config`` (the command line wins): the typed :class:`Options`, its
    ``--device`` this process's (:func:`refine.many.distributed.process_device`: under torchrun the GPU of its
    local rank)."""
    args = options_from_namespace(parse_namespace(argv), tuple(argv))
    return args.with_fields(device=process_device(args.compute.device))


#: options whose value is nanoBragg flags: ``--model -gauss_aniso_xtal`` (one flag, no space) is that value, not
#: an option (argparse takes a lone ``-word`` for an option and would say "expected one argument")
FLAG_VALUED = ("--model",)


def join_flag_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--model -flag`` written ``--model=-flag`` where the value is one nanoBragg flag (a single
    dash; a ``--option`` after ``--model`` stays an option, so a forgotten value is still reported)."""
    out: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        if argv[i] in FLAG_VALUED and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def parse_namespace(argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """``argv`` after the options of ``--config`` (the command line wins), the modes checked, as ``parser``'s
    namespace (default :func:`build_parser`'s; a parser of :func:`build_parser` with options of its own added
    keeps them in the namespace, and ``--config`` may set them too)."""
    parser = parser if parser is not None else build_parser()
    argv = join_flag_values(argv)
    args = parser.parse_args(list(argv))
    args.stage_tables = None
    if args.config:
        tokens, stages = _config_tokens(args.config, parser)
        args = parser.parse_args(tokens + list(argv))
        args.stage_tables = stages
    _check_modes(args)
    return args


def _check_modes(args: argparse.Namespace) -> None:
    """Options that belong to a mode (independent, joint) given without it; ``--f-column`` folded into
    ``--model``; ``--rotation-series`` implies ``--joint``."""
    if path_count(args.expt) > 1 or path_count(args.refl) > 1:  # several pairs
        refuse_with_pairs(vars(args))
    stills = bool(args.expt and args.refl and not args.image and not args.problem)  # many stills of DIALS files
    for flag, value in (("--out-dir", args.out_dir), ("--redo", args.redo)):
        if value and not (args.images or stills):
            raise InputError(f"{flag}: only with --images (independent mode)")
    if args.skip_missing and not stills:
        raise InputError("--skip-missing: only with --expt and --refl without --image (many stills of one DIALS file)")
    if (args.images or stills) and (args.out != "result.h5" or args.json):
        flag = "--out" if args.out != "result.h5" else "--json"
        raise InputError(f"{flag}: with --images the results go to a folder per image under --out-dir, not to one file")
    if args.rotation_series:
        if not args.images:
            raise InputError("--rotation-series: only with --images (the rotation images of the sweep)")
        args.joint = True
    for flag, value in (("--joint", args.joint), ("--shared", args.shared), ("--per-image", args.per_image),
                        ("--pixel-memory", args.pixel_memory is not None), ("--screen", args.screen),
                        ("--add-to", args.add_to is not None), ("--geometry-prior", args.geometry_prior is not None)):
        if value and not ((args.images or stills) and args.joint):
            raise InputError(f"{flag}: only with --images and --joint (joint mode), or --expt and --refl with --joint "
                             "(the stills of one DIALS file)")
    if args.add_to is not None:
        args.screen = True
    if args.screen and args.resume:
        raise InputError("--resume: not with --screen (a screened run restarts its rounds; --add-to continues a "
                         "finished one)")
    if args.pixel_memory is not None and not (args.pixel_memory >= 0 and math.isfinite(args.pixel_memory)):
        raise InputError(f"--pixel-memory: expected megabytes >= 0, got {args.pixel_memory:g}")
    if args.f_column is not None:
        if not args.model:
            raise InputError("--f-column: names a column of the -hkl file in --model; give --model")
        args.model = f"{args.model} -hkl_column {shlex.quote(args.f_column)}"
