"""What ``nbtorch-refine`` does with parsed arguments, as named steps (:func:`run`).

1. :func:`check_arguments`: every check that needs no data (names, numbers, outputs, the device);
2. :func:`load_inputs`: the observed image (or synthetic problem) and the starting model's configuration;
3. the simulator and the pixel choice (:mod:`refine.inputs.pixels`, the public API the docs use too), the
   starting scale and background;
4. :func:`refine.refine` (plan, stages, finalise), then the spot offsets and extra esds;
5. :func:`write_and_report`: result files, the HTML report, the printed summary.

Parsing (:mod:`refine.cli.parser`) and this module are apart so that a reader of the run does not wade through
the option table.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nbtorch import Simulator, config_from_args, eager, runtime
from nbtorch.cli_support import Printer, check_outputs
from nbtorch.errors import InputError
from nbtorch.io.atomic import check_not_inputs
from refine.output.callbacks import TensorBoardCallback
from refine.cli.options import DEFAULT_DATASET, PROG, Options
from refine.cli.values import bounds_values, build_stages, check_loss, command_inputs, prior_values, start_values
from refine.inputs.detector_counts import check_counts, detector_counts, header_counts
from refine.inputs.images import load_image
from refine.quality.cell_distance import cell_distance_note, note_line
from refine.quality.degeneracy import extended_uncertainties
from refine.inputs.dials import (check_dials_options, experiment_space_group, experiment_symmetry, model_tokens,
                                 on_image, refl_spots, spot_window, write_expt_out)
from refine.quality.identifiability import drift_warning
from refine.fitting.space_groups import crystal_system
from refine.inputs.start_model import ANISOTROPIC_MOSAIC_NAMES, model_config, tie_start_cell, with_anisotropic_mosaic
from refine.fitting.background import AUTO, parse_background, resolve_auto
from refine.fitting.parameters import ParameterSpace, check_widths
from refine.inputs.pixels import check_pixel_options, choose_pixels, model_values, starting_scale_background
from refine.inputs.problems import make_problem
from refine.inputs.panels import (panel_configs, panel_count, panel_groups, refl_panel_spots, stacked_image,
                                  write_panels_expt)
from nbtorch.panels import resolve_panels
from refine.output.report import ESD_NOTE, floor_line, misfit_lines, results_table, write_outputs
from refine.solver.plan import background_model
from refine.solver.runner import refine
from refine.inputs.selection import check_roi
from refine.quality.misfit import spot_misfit
from refine.quality.spot_floor import spot_floor
from refine.inputs.spots import read_spot_list, spot_offsets
from refine.inputs.still_defaults import still_defaults
from refine.fitting.structure_factors import AmplitudeOptions, check_space_group

__all__ = ["run", "check_arguments", "load_inputs", "prepare", "plan_arguments", "Prepared", "write_and_report"]

log = logging.getLogger(__name__)


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


class _EndLater:
    """Passes a callback (the TensorBoard log) every call but the run's end, which :func:`run` makes (:meth:`end`)
    once the diagnostics that need the observed spots are in the result."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def on_run_start(self, info) -> None:
        self.inner.on_run_start(info)

    def on_stage_start(self, stage, index) -> None:
        self.inner.on_stage_start(stage, index)

    def on_step(self, state) -> None:
        self.inner.on_step(state)

    def on_stage_end(self, stage, index, status, message) -> None:
        self.inner.on_stage_end(stage, index, status, message)

    def on_run_end(self, result) -> None:
        pass

    def end(self, result) -> None:
        self.inner.on_run_end(result)


def _check_numbers(args: Options) -> None:
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


def check_arguments(args: Options) -> Checked:
    """Every check that needs no data; nothing is read or written."""
    if bool(args.image.image) == bool(args.model.problem):
        raise InputError("give exactly one of --image (a measured image) and --problem (a synthetic problem)")
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
    make_dirs = check_outputs({**outputs, "--logdir": args.output.logdir}, folders=("--logdir",), make_missing=True)
    check_not_inputs(command_inputs(args), outputs.items())  # before anything is read
    if args.output.resume and not Path(ckpt_path).is_file():
        raise InputError(f"--resume: checkpoint {ckpt_path} not found "
                         "(run once without --resume, or give --checkpoint)")
    return Checked(symmetry=symmetry, stages=stages, start=start, bounds=bounds, priors=priors, outputs=outputs,
                   make_dirs=make_dirs, json_path=json_path, ckpt_path=ckpt_path,
                   dtype=torch.float64 if args.compute.dtype == "float64" else torch.float32, amplitudes=amplitudes)


def amplitude_group(args: Options) -> str | None:
    """The amplitudes' space group: ``--space-group``, a ``--symmetry`` that names a space group, or the ``--expt``
    crystal's; None where none is given."""
    group = args.amplitudes.space_group
    if group is None and args.fit.symmetry and crystal_system(args.fit.symmetry) != args.fit.symmetry.strip().lower():
        group = args.fit.symmetry
    return group if group is not None else experiment_space_group(args)


def amplitude_options(args: Options) -> AmplitudeOptions | None:
    """``--structure-factors`` and its options (None without it); the space group from :func:`amplitude_group`."""
    named = [f for f, v in (("--space-group", args.amplitudes.space_group), ("--f-restraint", args.amplitudes.f_restraint),
                            ("--hkl-out", args.output.hkl_out)) if v is not None]
    if not args.amplitudes.structure_factors:
        if named:
            raise InputError(f"{named[0]}: only with --structure-factors")
        return None
    group = amplitude_group(args)
    if group is None:
        raise InputError("--structure-factors: give the space group (--space-group P41212, or --symmetry P41212): "
                         "equivalent reflections share one amplitude")
    check_space_group(group)
    return AmplitudeOptions(group, start=args.amplitudes.f_start, min_photons=args.amplitudes.f_min_photons,
                            restraint_sigma=args.amplitudes.f_restraint)


def _load_problem(args: Options, checked: Checked, say) -> Inputs:
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


def _load_image(args: Options, checked: Checked, say) -> Inputs:
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
    panels = _multi_panel_model(args, say) if args.dials.expt and panel_count(args) > 1 else None
    if panels is None and obs.header.get("panels_stacked"):
        raise InputError(f"--image {obs.path}: the file holds {len(obs.header['panel_boxes'])} detector panels "
                         "(stacked); give their geometry with a multi-panel --expt")
    if panels is not None:
        photons, mask = stacked_image(args, resolve_panels(panels[0], panels[1])[1], photons, mask,
                                      boxes=obs.header.get("panel_boxes"))
        cfg, tokens, notes = panels[0][0], list(panels[4]), []
        panels = panels[:4]
    else:
        roi = check_roi(args.pixels.roi, obs.shape) if args.pixels.roi else None
        cfg, tokens, notes = model_config(model_tokens(args, say), obs, roi, parallax=args.image.parallax,
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
    symmetry = checked.symmetry or experiment_symmetry(args)
    if symmetry and not checked.symmetry:
        say(f"  symmetry {symmetry} from the experiment's space group (--symmetry)")
    masked = {**obs.masked, **({"below_offset": below} if below else {})}
    return Inputs(observed=photons, mask=mask, cfg=cfg, start=dict(checked.start), symmetry=symmetry,
                  free_default=None, fixed=fixed, panels=panels,
                  extra={"input": {"image": obs.path, "format": obs.format, "frame": args.image.frame,
                                   "geometry": obs.geometry, "masked": masked, "model": tokens},
                         "detector_counts": counts.as_dict()})


def _multi_panel_model(args: Options, say) -> tuple:
    """A multi-panel ``--expt``: ``(configs, names, groups, group labels, panel 0's flags)`` (:mod:`refine.inputs.panels`)."""
    if args.pixels.roi:
        raise InputError("--roi: not with a multi-panel --expt detector (fit spot windows: --refl, --spot-window)")
    tokens = list(model_tokens(args, say, multi_panel=True))
    configs, names = panel_configs(args, tokens, args.compute.dtype)
    groups, labels = panel_groups(args, args.dials.panel_groups)
    say(f"  {len(configs)} detector panels; {len(groups)} rigid panel group{'s' if len(groups) > 1 else ''} "
        f"(--panel-groups {args.dials.panel_groups or 0}): " + ", ".join(f"{k} {label}" for k, label in enumerate(labels)))
    return configs, names, groups, labels, tokens


def load_inputs(args: Options, checked: Checked, say) -> Inputs:
    """The observed image (measured or a synthetic problem) and the starting model's configuration."""
    inputs = _load_problem(args, checked, say) if args.model.problem else _load_image(args, checked, say)
    inputs.extra["command"] = " ".join([PROG, *args.argv])
    check_not_inputs([(f"--model {flag}", path) for flag, path in inputs.cfg.model_files()], checked.outputs.items())
    if args.compute.dtype != inputs.cfg.dtype:
        inputs.cfg = inputs.cfg.replace(dtype=args.compute.dtype)
    return inputs


def tile_evaluations(device: str | torch.device) -> int:
    """Lattice-factor evaluations per kernel tile of a refinement's simulator on ``device``.

    On a CPU each tile costs ~1 ms of eager glue around its kernels, and tiles too large leave the caches and
    pad more: the tutorial's loss and gradient (2 threads, alternating, 2026-11-26) 55.1 ms median with tiles
    of 2^19 evaluations (5 tiles) against 58.9-64.5 ms with 2^18 (10), 61.0-63.1 ms with 2^20 (3, 28 %
    padding) and 69.7-75.3 ms with 2^17 (19); on a GPU the kernels are short and the time goes to launching
    them and to the glue, so one large tile (the tutorial: one tile instead of 19) saves most of it."""
    return 1 << 22 if torch.device(device).type == "cuda" else 1 << 19


def _simulator(args: Options, checked: Checked, inputs: Inputs) -> Simulator:
    """The starting model's simulator (eager until the pixels are chosen), the start tied to the symmetry,
    the names of --refine/--fix/--esd-extra checked against the run's parameter space."""
    kwargs = dict(dtype=checked.dtype, device=args.compute.device, compile=False,
                  max_evals_per_tile=tile_evaluations(args.compute.device), kernel_dtype=args.compute.kernel_dtype)
    named = {*(args.fit.refine or ()), *inputs.fixed, *(n for stage in checked.stages or () for n in stage.free)}
    if named & set(ANISOTROPIC_MOSAIC_NAMES):  # the model the names refine: one mosaic spread per crystal axis
        inputs.cfg = with_anisotropic_mosaic(inputs.cfg, inputs.start)
        if inputs.panels:
            inputs.panels = ([with_anisotropic_mosaic(c, inputs.start) for c in inputs.panels[0]], *inputs.panels[1:])
    sim = (Simulator.from_panels(inputs.panels[0], names=inputs.panels[1], **kwargs) if inputs.panels
           else Simulator(inputs.cfg, **kwargs))
    shape = inputs.observed.shape
    if tuple(sim.shape) != tuple(shape):
        raise InputError(f"{args.image.image}: image is {shape[1]} x {shape[0]} pixels (fast x slow) but "
                         f"the model's detector is {sim.shape[1]} x {sim.shape[0]}; fix -detpixels_f/-detpixels_s "
                         "in --model")
    if inputs.symmetry is not None:  # tie the starting cell to the crystal system (e.g. cell_b = cell_a)
        inputs.start.update(tie_start_cell(inputs.symmetry, sim.setup.params, inputs.start))
    space = ParameterSpace(symmetry=inputs.symmetry or "triclinic", background=resolve_auto(args.fit.background, False, False),
                           anisotropic_N=any(n in ("N_a", "N_b", "N_c") for n in (*(args.fit.refine or ()), *inputs.fixed)),
                           anisotropic_mosaic=sim.setup.sampling.mosaic_anisotropic,
                           panel_groups=tuple(inputs.panels[2]) if inputs.panels else (),
                           n_panels=len(inputs.panels[0]) if inputs.panels else 0,
                           beam_widths=sim.source_width_names())
    check_widths(inputs.start)
    for label, names in (("--refine", args.fit.refine), ("--fix", inputs.fixed), ("--esd-extra", args.output.esd_extra),
                         ("--prior", list(checked.priors))):
        if names:
            try:
                space.expand(names)
            except InputError as exc:
                raise InputError(f"{label}: {exc}") from None
    return sim


def _spot_offsets(sim: Simulator, values: dict, spots: np.ndarray, keep_model: bool = False):
    with eager():  # a few renders of small windows: not worth a compiled graph
        return spot_offsets(sim, values, spots, keep_model=keep_model)


def _spots_report(args: Options, spots: np.ndarray, before, after, floor) -> dict:
    """The ``spots`` of ``result.json``: the offsets before and after, and the noise floor of the final ones."""
    both = before.matched & after.matched
    return {"source": args.pixels.spots or args.dials.refl, "n": int(len(spots)),
            "matched_start": int(before.matched.sum()), "matched_final": int(after.matched.sum()),
            "rms_px_start": before.rms(), "rms_px_final": after.rms(),
            "rms_px_start_common": before.rms(both), "rms_px_final_common": after.rms(both),
            "n_common": int(both.sum()), "mean_px_final": after.mean(), **floor.to_dict(),
            "observed": spots, "predicted_start": before.predicted, "predicted_final": after.predicted}


def _with_drift_warning(result, spots: dict):
    """``result`` with :func:`refine.quality.identifiability.drift_warning`'s line added when the spots drifted."""
    warning = drift_warning(spots["rms_px_start_common"], spots["rms_px_final_common"], spots["n_common"],
                            result.loss_initial, result.loss_final)
    if warning is None:
        return result
    log.warning("%s", warning)
    return dataclasses.replace(result, warnings=tuple(result.warnings) + (warning,))


def _extra_esds(sim: Simulator, result, args: Options, background="constant") -> dict:
    # first derivatives only (refine.quality.uncertainty.pixel_jacobian runs the simulator eagerly itself; its large tiles
    # go through the compiled forward-mode kernels unless compiling is off)
    u = extended_uncertainties(sim, result.observed, result.mask, result, args.output.esd_extra, background)
    return {"names": list(u.names), "esds": u.as_dict(), "correlation": u.correlation, "condition": u.condition}


def _say_extra_esds(say, result, e: dict) -> None:
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


def write_and_report(args: Options, checked: Checked, inputs: Inputs, result, say, t0: float) -> None:
    """Write the result files (and the HTML report), then print the summary."""
    note = cell_distance_note(result.params, tuple(result.free)) if inputs.truth is None else None
    if note is not None:  # a measured image: the cell rests on a distance nothing refined
        inputs.extra["cell_distance"] = note
    write_outputs(result, args.output.out, checked.json_path, inputs.extra,
                  hkl_path=checked.outputs.get("--hkl-out") if result.amplitudes is not None else None)
    if args.output.report:
        from refine.output.html_report import write_report  # matplotlib: only when a report is asked for

        write_report(args.output.report, args.output.out, f"{PROG}: {Path(args.image.image).name if args.image.image else args.model.problem}")
    say(f"status: {result.status.value} ({result.message})")
    say(f"loss: {result.loss_initial:.6g} -> {result.loss_final:.6g} in {result.steps} steps "
        f"({result.evaluations} evaluations), {result.wall_s:.1f} s")
    say(results_table(result, inputs.truth))
    if result.esd_kinds:
        say(ESD_NOTE)
    if result.fit:
        say(f"fit: final loss {result.fit['excess']:.3g}x the shot-noise expectation of the refined model "
            f"(about 1 = a fit to the noise level)")
    for line in misfit_lines(result.fit, result.diagnostics):
        say(line)
    for w in result.warnings:
        say(f"warning: {w}")
    if "spots" in inputs.extra:
        s = inputs.extra["spots"]
        say(f"spots: rms offset {s['rms_px_start_common']:.3g} px -> {s['rms_px_final_common']:.3g} px over the "
            f"{s['n_common']} spots matched before and after ({s['matched_start']} -> {s['matched_final']} of "
            f"{s['n']} matched)")
        say(floor_line(s))
    if "esd_extra" in inputs.extra:
        _say_extra_esds(say, result, inputs.extra["esd_extra"])
    if note is not None:
        say(f"warning: {note_line(note)}")
    if result.amplitudes is not None:
        sf = result.structure_factors()
        say(f"structure factors: {sf['n_free']} amplitudes refined in {sf['space_group']} (start: {sf['start']}; "
            f"{sf['n_held']} candidates held, fewer than {args.amplitudes.f_min_photons:g} photons); written to "
            f"{checked.outputs['--hkl-out']}")
    say(f"wrote {args.output.out} and {checked.json_path}{' and ' + args.output.report if args.output.report else ''} "
        f"({time.monotonic() - t0:.1f} s in all)")
    if args.output.logdir:
        say(f"TensorBoard logs: {os.path.abspath(args.output.logdir)}  (view: tensorboard --logdir {args.output.logdir})")


def _callbacks(args: Options, sim: Simulator, say) -> list:
    callbacks: list = []
    if args.output.logdir:
        callbacks.append(_EndLater(TensorBoardCallback(args.output.logdir, every=args.output.tb_every)))
        say(f"  TensorBoard logs: {args.output.logdir}")
    if sim.compile_mode == "compiled" and not args.output.no_esds:
        callbacks.append(_EagerForEsds(sim))
    return callbacks


@dataclass
class Prepared:
    """Steps 1-3 done: the checked arguments, the inputs, the simulator restricted to the fitted pixels (its
    compile mode set; ``model``: the same unrestricted, for a caller that keeps the pixels itself), the pixel
    choice and the starting values."""

    checked: Checked
    inputs: Inputs
    sim: Simulator
    choice: Any
    start: dict
    model: Simulator
    background: Any = "constant"
    args: Options | None = None


def _still_defaults(args: Options, say) -> tuple[Options, Any]:
    """``args`` with the defaults of one still from DIALS files filled in (:mod:`refine.inputs.still_defaults`),
    said in the run's first lines, and those defaults (None for any other run)."""
    defaults = still_defaults(args)
    if defaults is None:
        return args, None
    say(f"{PROG}: a still from DIALS files (--expt {args.dials.expt}, --refl {args.dials.refl}); defaults:")
    for line in defaults.notes:
        say(f"  {line}")
    return defaults.apply(args), defaults


def prepare(args: Options, say) -> Prepared:
    """Check the arguments, load the inputs, build the simulator and choose the pixels (steps 1-3); also what
    :mod:`refine.tools.bench` measures, so that it times the objective a run fits.  ``Prepared.args``: the options
    the run goes on with (a still from DIALS files: its defaults filled in)."""
    check_dials_options(args)
    args, defaults = _still_defaults(args, say)
    checked = check_arguments(args)
    inputs = load_inputs(args, checked, say)
    sim = _simulator(args, checked, inputs)
    spots = (read_spot_list(args.pixels.spots, args.pixels.spot_columns, inputs.observed.shape) if args.pixels.spots and args.pixels.spots != "find"
             else args.pixels.spots)
    if args.dials.refl:
        spots = refl_panel_spots(args, sim.panel_layout) if sim.panel_layout is not None else refl_spots(args)
    window = spot_window(args, say)
    choice = choose_pixels(sim, inputs.observed, inputs.mask, dmin_A=args.pixels.dmin, dmax_A=args.pixels.dmax, spots=spots,
                           spot_window_px=window, subsample=args.pixels.subsample, seed=args.pixels.seed,
                           spots_source=f"--refl {args.dials.refl}" if args.dials.refl else f"--spots {args.pixels.spots}",
                           rest_ratio=defaults.rest_ratio if defaults is not None else None)
    if args.dials.refl and choice.spots is not None:  # the neighbours' spots are fitted, the image's compared
        choice = dataclasses.replace(choice, spots=on_image(choice.spots))
    if choice.spots is not None:
        say(f"  {len(choice.spots)} observed spots in the fitted region"
            + (f": {choice.windows} pixels in their windows and {100 * choice.rest_fraction:.3g} % of the others"
               if choice.rest_fraction else ""))
    model = sim
    sim = choice.simulator(sim)
    sim.set_compile(*runtime.compile_policy("refinement", choice.n_used * sim.evaluations_per_pixel(),
                                            explicit=args.compute.compile))
    say(f"  fitting {choice.n_used} of {choice.mask.size} pixels ({100.0 * choice.fraction:.3g}%), "
        f"{sim.evaluations_per_pixel()} evaluations per pixel, {sim.compile_mode} kernel, "
        f"{args.compute.dtype}{'' if sim.kernel_dtype == sim.dtype else ' (kernel ' + args.compute.kernel_dtype + ')'} on {args.compute.device}")
    start = inputs.start
    if args.image.image and not args.output.resume and not {"scale", "background"} <= set(start):
        start = starting_scale_background(sim, inputs.observed, choice.mask, start)
        say(f"  start: scale {start['scale']:.4g}, background {start['background']:.4g} photons/pixel "
            "(Poisson fit of the starting model)")
    model.set_compile(sim.compile_mode == "compiled", sim.compile_reason)
    background = _background(args, sim, inputs, choice, start, window, say)
    return Prepared(checked=checked, inputs=inputs, sim=sim, choice=choice, start=start, model=model,
                    background=background, args=args)


def _background(args: Options, sim: Simulator, inputs, choice, start: dict, window: int | None, say):
    """``--background`` as :func:`refine.refine` takes it: the text of ``constant`` and ``planar``, or the model
    of ``resolution:K`` (knots started between the observed spots) and ``planes`` (one held plane per window)."""
    one_image = bool(args.image.image) and not (args.many.joint or args.many.rotation_series)  # joint: constant
    windows = choice.spots is not None and len(choice.spots) > 0 and window is not None
    text = resolve_auto(args.fit.background, one_image, windows)
    model = background_model(sim, text, model_values(sim, start), inputs.observed, choice.mask,
                             spots=choice.spots, half_px=window)
    if model is None:
        return text
    if model.s_knots:
        say(f"  background: linear spline in 1/d, {len(model.names)} knots at d = "
            f"{', '.join(f'{1.0 / s:.3g}' if s > 0 else 'inf' for s in model.s_knots)} A, starting at "
            f"{', '.join(f'{v:.3g}' for v in model.start.values())} photons/pixel")
    else:
        say(f"  background: a plane held in each of {model.windows} spot windows (fitted to the pixels > 3 px "
            "from every spot), the flat background elsewhere")
    return model


def plan_arguments(args: Options, p: Prepared) -> dict:
    """The keyword arguments of :func:`refine.refine` (and so of :func:`refine.solver.plan.make_plan`) that describe
    the problem: everything but callbacks, progress, checkpoints and esds."""
    return dict(start=p.start, free=p.inputs.free_default if args.fit.refine is None else None, fixed=p.inputs.fixed,
                symmetry=p.inputs.symmetry, bounds=p.checked.bounds, mask=p.choice.mask, stages=p.checked.stages,
                strategy=args.optimiser.optimizer, background=p.background, loss=args.optimiser.loss, priors=p.checked.priors,
                n_spots=None if p.choice.spots is None else len(p.choice.spots), too_few_spots=args.pixels.too_few_spots,
                time_budget_s=args.optimiser.time_budget, structure_factors=p.checked.amplitudes,
                **({"panel_groups": p.inputs.panels[2]} if p.inputs.panels else {}))


def run(args: Options) -> int:
    """Load, refine, write.  Returns the exit status (0 ok, 1 diverged or failed)."""
    say = Printer(args.output.quiet)
    t0 = time.monotonic()
    p = prepare(args, say)
    args = p.args if p.args is not None else args
    checked, inputs, sim, choice, start = p.checked, p.inputs, p.sim, p.choice, p.start
    before = None if choice.spots is None else _spot_offsets(sim, model_values(sim, start), choice.spots)
    for directory in checked.make_dirs:
        directory.mkdir(parents=True, exist_ok=True)
    callbacks = _callbacks(args, sim, say)
    result = refine(sim, inputs.observed, **plan_arguments(args, p), callbacks=callbacks,
                    progress=False if args.output.quiet else None,
                    checkpoint=checked.ckpt_path, checkpoint_every=args.output.checkpoint_every,
                    resume=checked.ckpt_path if args.output.resume else None, esds=not args.output.no_esds,
                    domain_check=args.model.problem is None)
    if result.amplitudes is not None:  # the refined amplitudes in the model of every later report
        sim = result.amplitudes.simulator(sim, result.amplitude_values)
    if choice.spots is not None:
        after = _spot_offsets(sim, dict(result.params), choice.spots, keep_model=True)
        floor = spot_floor(after, result.params, inputs.mask, seed=args.pixels.seed, background=result.background_image)
        misfit = spot_misfit(sim, result.params, inputs.observed, inputs.mask, after, result.model, result.mask,
                             background=result.background_image)
        result = dataclasses.replace(result, diagnostics={**result.diagnostics, **misfit})
        inputs.extra["spots"] = _spots_report(args, choice.spots, before, after, floor)
        result = _with_drift_warning(result, inputs.extra["spots"])
    for callback in callbacks:  # the TensorBoard log's end of run, with the spot diagnostics
        if isinstance(callback, _EndLater):
            callback.end(result)
    if args.output.esd_extra:
        inputs.extra["esd_extra"] = _extra_esds(sim, result, args, p.background)
    if args.dials.expt_out:
        (write_panels_expt if sim.panel_layout is not None else write_expt_out)(args, sim, result.params)
        say(f"  wrote the refined DIALS experiment {args.dials.expt_out}")
    write_and_report(args, checked, inputs, result, say, t0)
    return 0 if result.status.ok else 1
