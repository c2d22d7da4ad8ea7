"""What a single run (:mod:`refine.modes.single`) reads: its checked arguments (:func:`check_arguments`), the
structure-factor options (:func:`amplitude_options`) and its inputs, a synthetic problem or a measured image with
its mask, model and spots (:func:`load_inputs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nbtorch import config_from_args
from nbtorch.runtime import policy as runtime
from nbtorch.cli.support import check_outputs
from nbtorch.errors import InputError
from nbtorch.io.atomic import check_not_inputs
from refine.inputs.measurement import DEFAULT_DATASET
from refine.modes.job import PROG, Job
from refine.modes.values import bounds_values, build_stages, check_loss, command_inputs, prior_values, start_values
from refine.inputs.detector_counts import check_counts, detector_counts, header_counts
from refine.inputs.images import load_image
from refine.inputs.dials import experiment_space_group, experiment_symmetry, model_tokens
from refine.fitting.space_groups import check_subgroup, crystal_system
from refine.inputs.start_model import model_config
from refine.fitting.background import AUTO, parse_background
from refine.inputs.pixels import check_pixel_options
from refine.inputs.problems import make_problem
from refine.inputs.panels import panel_configs, panel_count, panel_groups, stacked_image
from nbtorch.geometry.panels import resolve_panels
from refine.inputs.selection import check_roi
from refine.fitting.structure_factors import AmplitudeOptions, check_space_group


@dataclass(frozen=True)
class Checked:
    """The arguments converted and checked (step 1)."""

    symmetry: str | None
    stages: Any
    start: dict
    bounds: dict
    priors: dict
    outputs: dict
    make_dirs: list
    json_path: str
    ckpt_path: str
    dtype: torch.dtype
    amplitudes: AmplitudeOptions | None = None


@dataclass
class Inputs:
    """The observed image and the starting model (step 2)."""

    observed: np.ndarray
    mask: np.ndarray
    cfg: Any
    start: dict
    symmetry: str | None
    free_default: Any
    fixed: tuple
    truth: dict | None = None
    extra: dict = field(default_factory=dict)
    panels: tuple | None = None  # a multi-panel --expt: (configs, names, groups, group labels)


def check_dials_options(args: Job) -> None:
    """Checks that need no file."""
    if args.dials.expt_out and not args.dials.expt and not args.image.image:
        raise InputError("--expt-out: writes the refined model of a measured image; give --image (or --expt)")
    if args.dials.refl and args.pixels.spots:
        raise InputError("--refl and --spots both give the observed spots; drop one")
    if args.dials.panel_groups is not None and not args.dials.expt:
        raise InputError("--panel-groups: the groups of a multi-panel --expt detector; give --expt")
    if args.dials.expt_image is not None and not args.dials.expt:
        raise InputError("--expt-image: the image of an --expt rotation scan that --image is; give --expt")
    for flag, value in (("--expt-index", args.dials.expt_index), ("--expt-image", args.dials.expt_image),
                        ("--panel-groups", args.dials.panel_groups)):
        if value is not None and value < 0:
            raise InputError(f"{flag}: must be >= 0, got {value}")


def _check_numbers(args: Job) -> None:
    for flag, value in (("--time-budget", args.optimiser.time_budget), ("--checkpoint-every", args.output.checkpoint_every),
                        ("--tb-every", args.output.tb_every), ("--saturation", args.image.saturation)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise InputError(f"{flag}: must be a positive number, got {value:g}")
    if args.pixels.seed < 0:
        raise InputError(f"--seed: must be >= 0, got {args.pixels.seed}")
    check_counts(args.image.gain, args.image.adc_offset)
    for flag, names in (("--refine", args.fit.refine), ("--fix", args.fit.fix), ("--esd-extra", args.output.esd_extra)):
        if names is not None and not names:
            raise InputError(f"{flag}: no names given")
    both = sorted(set(args.fit.refine or ()) & set(args.fit.fix or ()))
    if both:
        raise InputError(f"--refine and --fix both name {', '.join(both)}: a parameter is either refined or fixed")
    check_pixel_options(args.pixels.subsample, args.pixels.spot_window, bool(args.pixels.spots or args.dials.refl))
    if args.pixels.spot_columns and (not args.pixels.spots or args.pixels.spots == "find"):
        raise InputError("--spot-columns names the columns of a --spots file; give --spots FILE")


def _refuse_image_file_options(args: Job) -> None:
    """The options that describe a measured image's file, given with a simulated ``--problem`` (they were ignored)."""
    given = (("--frame", args.image.frame is not None), ("--shape", args.image.shape is not None),
             ("--mask", bool(args.image.mask)), ("--saturation", args.image.saturation is not None),
             ("--mask-nan", args.image.mask_nan))
    for flag, present in given:
        if present:
            raise InputError(f"{flag}: describes a measured --image file; --problem {args.model.problem} is simulated "
                             "and has none")


def check_arguments(args: Job) -> Checked:
    """Every check that needs no data; nothing is read or written."""
    if bool(args.image.image) == bool(args.model.problem):
        raise InputError("give exactly one of --image (a measured image) and --problem (a synthetic problem)")
    if args.model.problem:
        _refuse_image_file_options(args)
    check_dials_options(args)
    if args.image.image and not (args.model.model or args.dials.expt):
        raise InputError("--model: the starting model's nanoBragg flags (or --expt) are required with --image "
                         '(e.g. --model "-cell 58 58 150 90 90 90 -misset 10 20 30 -N 20 -default_F 100")')
    symmetry = crystal_system(args.fit.symmetry)
    if args.fit.background != AUTO and parse_background(args.fit.background).kind == "planes" and not (
            args.pixels.spots or args.dials.refl):
        raise InputError("--background planes: needs observed spots (--spots or --refl) and --spot-window")
    stages = build_stages(args)
    check_loss(args.optimiser.loss)
    start, bounds, priors = start_values(args.fit.start), bounds_values(args.fit.bounds), prior_values(args.fit.prior)
    _check_numbers(args)
    runtime.check_device(args.compute.device, "--device")
    if Path(args.output.out).is_dir() or not Path(args.output.out).name or Path(args.output.out).name in (".", ".."):
        raise InputError(f"--out {args.output.out}: is a directory; give a file name such as result.h5")
    json_path = args.output.json or str(Path(args.output.out).with_suffix(".json"))
    ckpt_path = args.output.checkpoint or str(Path(args.output.out).with_suffix("")) + ".ckpt.h5"
    outputs = {"--out": args.output.out, "--json": json_path, "--checkpoint": ckpt_path}
    if args.output.report:
        from refine.output.figures import require_matplotlib  # matplotlib is an extra: only when a report is asked for

        require_matplotlib("--report")
        outputs["--report"] = args.output.report
    if args.dials.expt_out:
        outputs["--expt-out"] = args.dials.expt_out
    amplitudes = amplitude_options(args)
    if amplitudes is not None:
        outputs["--hkl-out"] = args.output.hkl_out or str(Path(args.output.out).with_suffix(".hkl"))
        if args.output.mtz_out:
            outputs["--mtz-out"] = args.output.mtz_out
    make_dirs = check_outputs({**outputs, "--logdir": args.output.logdir}, folders=("--logdir",), make_missing=True)
    check_not_inputs(command_inputs(args), outputs.items())  # before anything is read
    if args.output.resume and not Path(ckpt_path).is_file():
        raise InputError(f"--resume: checkpoint {ckpt_path} not found "
                         "(run once without --resume, or give --checkpoint)")
    return Checked(symmetry=symmetry, stages=stages, start=start, bounds=bounds, priors=priors, outputs=outputs,
                   make_dirs=make_dirs, json_path=json_path, ckpt_path=ckpt_path,
                   dtype=torch.float64 if args.compute.dtype == "float64" else torch.float32, amplitudes=amplitudes)


def amplitude_group(args: Job) -> str | None:
    """The amplitudes' space group: ``--space-group``, a ``--symmetry`` that names a space group, or the ``--expt``
    crystal's; None where none is given."""
    group = args.amplitudes.space_group
    if group is None and args.fit.symmetry and crystal_system(args.fit.symmetry) != args.fit.symmetry.strip().lower():
        group = args.fit.symmetry
    return group if group is not None else experiment_space_group(args.dials_files)


def amplitude_options(args: Job) -> AmplitudeOptions | None:
    """``--structure-factors`` and its options (None without it); the space group from :func:`amplitude_group`,
    checked against the ``--expt`` crystal's (:func:`check_subgroup`); ``--mtz-out``'s folder: :func:`_check_mtz_out`."""
    named = [f for f, v in (("--space-group", args.amplitudes.space_group), ("--f-restraint", args.amplitudes.f_restraint),
                            ("--hkl-out", args.output.hkl_out), ("--mtz-out", args.output.mtz_out),
                            ("--anomalous", args.amplitudes.anomalous or None),
                            ("--anomalous-restraint", args.amplitudes.anomalous_restraint)) if v is not None]
    if args.amplitudes.anomalous_restraint is not None and not args.amplitudes.anomalous:
        raise InputError("--anomalous-restraint: only with --anomalous")
    if not args.amplitudes.structure_factors:
        if named:
            raise InputError(f"{named[0]}: only with --structure-factors")
        return None
    group = amplitude_group(args)
    if group is None:
        raise InputError("--structure-factors: give the space group (--space-group P41212, or --symmetry P41212): "
                         "equivalent reflections share one amplitude")
    check_space_group(group)
    experiment = experiment_space_group(args.dials_files)
    if experiment is not None and group != experiment:
        check_subgroup(group, "--space-group" if args.amplitudes.space_group else "--symmetry", experiment)
    joint = args.many.joint or args.many.rotation_series
    _check_mtz_out(args.output.mtz_out, Path(args.many.out_dir or "out/joint") if joint else Path(args.output.out).parent)
    return AmplitudeOptions(group, start=args.amplitudes.f_start, min_photons=args.amplitudes.f_min_photons,
                            restraint_sigma=args.amplitudes.f_restraint, anomalous=args.amplitudes.anomalous,
                            anomalous_sigma=args.amplitudes.anomalous_restraint)


def _check_mtz_out(path: str | None, made: Path) -> None:
    """``--mtz-out`` in an existing folder or in the folder the run makes for its results (``made``: ``--out``'s,
    a joint run's ``--out-dir``), not a folder itself; nothing is made for it."""
    if path is None:
        return
    if Path(path).is_dir() or not Path(path).name:
        raise InputError(f"--mtz-out {path}: is a directory; give a file name such as amplitudes.mtz")
    folder = Path(path).absolute().parent
    if not folder.is_dir() and folder != made.absolute():
        raise InputError(f"--mtz-out {path}: folder {Path(path).parent} does not exist")


def _load_problem(args: Job, checked: Checked, say) -> Inputs:
    problem = make_problem(args.model.problem, size=args.model.size, option_prefix="--")
    say(f"{PROG}: problem {problem.name}: {problem.description}")
    cfg = config_from_args(list(problem.args))
    counts = detector_counts(problem.counts, args.image.gain, args.image.adc_offset)
    say(f"  {counts.describe()}")
    observed, mask, below = counts.photons(problem.observed)
    _say_below_offset(say, below, counts)
    if args.pixels.roi:
        cfg = cfg.replace(roi=tuple(check_roi(args.pixels.roi, observed.shape)))
    truth = counts.photon_values(problem.truth)  # the problem's values are those of a fit to its counts
    return Inputs(observed=observed, mask=mask, cfg=cfg,
                  start={**counts.photon_values(problem.start), **checked.start},
                  symmetry=checked.symmetry or problem.symmetry,
                  free_default=problem.free, fixed=tuple(args.fit.fix) if args.fit.fix is not None else problem.fixed,
                  truth=truth, extra={"input": {"problem": problem.name, "size": problem.size,
                                                "model": list(problem.args)}, "truth": truth,
                                      "detector_counts": counts.as_dict()})


def _say_below_offset(say, below: int, counts) -> None:
    if below:
        say(f"  {below} pixels below the ADC offset ({counts.adc_offset:g} counts) masked: not counts of photons")


def _load_image(args: Job, checked: Checked, say) -> Inputs:
    obs = load_image(args.image.image, frame=args.image.frame, shape=args.image.shape, dtype=args.image.raw_dtype, dataset=args.image.dataset,
                     mask=args.image.mask, saturation=args.image.saturation, nonfinite="mask" if args.image.mask_nan else "error")
    if args.image.dataset != DEFAULT_DATASET and obs.format != "hdf5":
        raise InputError(f"--dataset {args.image.dataset}: {args.image.image} is a {obs.format} file, not HDF5")
    say(f"{PROG}: {obs.describe()}")
    counts = detector_counts(header_counts(obs.path, obs.format, obs.header), args.image.gain, args.image.adc_offset)
    say(f"  {counts.describe()}")
    photons, mask, below = counts.photons(obs.image, obs.mask)
    _say_below_offset(say, below, counts)
    if not mask.any():
        raise InputError(f"{obs.path}: every pixel is masked after the ADC offset {counts.adc_offset:g} is taken off")
    panels = _multi_panel_model(args, say) if args.dials.expt and panel_count(args.dials_files) > 1 else None
    if panels is None and args.dials.panel_groups:
        raise InputError(f"--panel-groups {args.dials.panel_groups}: the --expt detector has one panel, whose only "
                         "level is 0 (panel groups are a multi-panel detector's)")
    if panels is None and obs.header.get("panels_stacked"):
        raise InputError(f"--image {obs.path}: the file holds {len(obs.header['panel_boxes'])} detector panels "
                         "(stacked); give their geometry with a multi-panel --expt")
    if panels is not None:
        photons, mask = stacked_image(args.dials_files, resolve_panels(panels[0], panels[1])[1], photons, mask,
                                      boxes=obs.header.get("panel_boxes"))
        cfg, tokens, notes = panels[0][0], list(panels[4]), []
        panels = panels[:4]
    else:
        roi = check_roi(args.pixels.roi, obs.shape) if args.pixels.roi else None
        cfg, tokens, notes = model_config(model_tokens(args.dials_files, args.model.model, say), obs, roi, parallax=args.image.parallax,
                                          given_by=("--expt" if not args.model.model else "--expt/--model")
                                          if args.dials.expt else "--model")
    for note in notes:
        say(f"  {note}")
    # the default schedule on one image: the distance fixed (it cannot be separated from the cell scale; their
    # correlation: --esd-extra distance); a --refine list or [[stages]] tables say themselves what is refined
    default_fix = args.fit.fix is None and args.fit.refine is None and not args.fit.stage_tables
    if default_fix and not (args.many.joint or args.many.rotation_series):  # a joint run's names: --shared/--per-image
        say("  distance fixed (one image; --fix none refines it, --esd-extra distance shows its correlation with the cell)")
    fixed = ("distance",) if default_fix else tuple(n for n in (args.fit.fix or ()) if n != "none")
    symmetry = checked.symmetry or experiment_symmetry(args.dials_files, args.fit.symmetry)
    if symmetry and not checked.symmetry:
        say(f"  symmetry {symmetry} from the experiment's space group (--symmetry)")
    masked = {**obs.masked, **({"below_offset": below} if below else {})}
    return Inputs(observed=photons, mask=mask, cfg=cfg, start=dict(checked.start), symmetry=symmetry,
                  free_default=None, fixed=fixed, panels=panels,
                  extra={"input": {"image": obs.path, "format": obs.format, "frame": args.image.frame,
                                   "geometry": obs.geometry, "masked": masked, "model": tokens,
                                   **({"expt": args.dials.expt, "expt_index": args.dials.expt_index}
                                      if args.dials.expt else {})},
                         "detector_counts": counts.as_dict()})


def _multi_panel_model(args: Job, say) -> tuple:
    """A multi-panel ``--expt``: ``(configs, names, groups, group labels, panel 0's flags)`` (:mod:`refine.inputs.panels`)."""
    if args.pixels.roi:
        raise InputError("--roi: not with a multi-panel --expt detector (fit spot windows: --refl, --spot-window)")
    dials = args.dials_files
    tokens = list(model_tokens(dials, args.model.model, say, multi_panel=True))
    configs, names = panel_configs(dials, tokens, args.compute.dtype)
    groups, labels = panel_groups(dials, args.dials.panel_groups)
    say(f"  {len(configs)} detector panels; {len(groups)} rigid panel group{'s' if len(groups) > 1 else ''} "
        f"(--panel-groups {args.dials.panel_groups or 0}): " + ", ".join(f"{k} {label}" for k, label in enumerate(labels)))
    return configs, names, groups, labels, tokens


def load_inputs(args: Job, checked: Checked, say) -> Inputs:
    """The observed image (measured or a synthetic problem) and the starting model's configuration."""
    inputs = _load_problem(args, checked, say) if args.model.problem else _load_image(args, checked, say)
    inputs.extra["command"] = " ".join([PROG, *args.argv])
    check_not_inputs([(f"--model {flag}", path) for flag, path in inputs.cfg.model_files()], checked.outputs.items())
    if args.compute.dtype != inputs.cfg.dtype:
        inputs.cfg = inputs.cfg.replace(dtype=args.compute.dtype)
    return inputs
