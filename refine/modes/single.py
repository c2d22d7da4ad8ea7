"""One image refined from a measurement and its settings (a :class:`~refine.modes.job.Job`), as named steps
(:func:`refine_one`; ``nbtorch-refine --image`` and :func:`refine.refine_still` both come here).

1. :func:`~refine.modes.single_inputs.check_arguments`: every check that needs no data (names, numbers, outputs, the device);
2. :func:`~refine.modes.single_inputs.load_inputs`: the observed image (or synthetic problem) and the starting model's configuration;
3. the simulator and the pixel choice (:mod:`refine.inputs.pixels`, the public API the docs use too), the
   starting scale and background;
4. :func:`refine.refine` (plan, stages, finalise), then the spot offsets and extra esds;
5. :func:`write_and_report`: result files, the HTML report, the printed summary.

Parsing (:mod:`refine.cli.parser`) is the command line's alone: this module sees typed values, never argv.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nbtorch import Simulator, eager
from nbtorch.simulator import default_tile_evaluations
from nbtorch.runtime import policy as runtime
from nbtorch.cli.support import Printer
from nbtorch.errors import InputError
from refine.output.callbacks import TensorBoardCallback
from refine.modes.job import PROG, Job
from refine.quality.cell_distance import cell_distance_note, note_line
from refine.quality.degeneracy import extended_uncertainties
from refine.inputs.dials import on_image, refl_spots, spot_window, write_expt_out
from refine.quality.identifiability import drift_warning
from refine.inputs.start_model import ANISOTROPIC_MOSAIC_NAMES, tie_start_cell, with_anisotropic_mosaic
from refine.fitting.background import resolve_auto
from refine.fitting.parameters import ParameterSpace, check_widths
from refine.inputs.pixels import choose_pixels, model_values, starting_scale_background
from refine.inputs.panels import refl_panel_spots, write_panels_expt
from refine.output.amplitude_mtz import amplitude_notes
from refine.output.report import ESD_NOTE, floor_line, misfit_lines, results_table, write_outputs
from refine.solver.plan import background_model
from refine.solver.runner import refine
from refine.quality.misfit import spot_misfit
from refine.quality.spot_floor import spot_floor
from refine.inputs.spots import read_spot_list, spot_offsets
from refine.inputs.still_defaults import still_defaults
# amplitude_group and amplitude_options: named here too, where the joint and sweep commands find them
from refine.modes.single_inputs import (Checked, Inputs, amplitude_group, amplitude_options,  # noqa: F401
                                      check_arguments, check_dials_options, load_inputs)

__all__ = ["run", "refine_one", "check_arguments", "load_inputs", "prepare", "plan_arguments", "Prepared", "write_and_report"]

log = logging.getLogger(__name__)


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


def tile_evaluations(device: str | torch.device) -> int:
    """Lattice-factor evaluations per kernel tile of a refinement's simulator on ``device``.

    On a CPU each tile costs ~1 ms of eager glue around its kernels, and tiles too large leave the caches and
    pad more: the tutorial's loss and gradient (2 threads, alternating, 2026-11-26) 55.1 ms median with tiles
    of 2^19 evaluations (5 tiles) against 58.9-64.5 ms with 2^18 (10), 61.0-63.1 ms with 2^20 (3, 28 %
    padding) and 69.7-75.3 ms with 2^17 (19); on a GPU the kernels are short and the time goes to launching
    them and to the glue, so one large tile (the simulator's GPU default,
    :func:`nbtorch.simulator.default_tile_evaluations`; the tutorial: one tile instead of 19) saves most of it."""
    return default_tile_evaluations(device) if torch.device(device).type == "cuda" else 1 << 19


def _simulator(args: Job, checked: Checked, inputs: Inputs) -> Simulator:
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


def _spots_report(args: Job, spots: np.ndarray, before, after, floor) -> dict:
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


def _extra_esds(sim: Simulator, result, args: Job, background="constant") -> dict:
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


def write_and_report(args: Job, checked: Checked, inputs: Inputs, result, say, t0: float) -> None:
    """Write the result files (and the HTML report), then print the summary."""
    note = cell_distance_note(result.params, tuple(result.free)) if inputs.truth is None else None
    if note is not None:  # a measured image: the cell rests on a distance nothing refined
        inputs.extra["cell_distance"] = note
    write_outputs(result, args.output.out, checked.json_path, inputs.extra,
                  hkl_path=checked.outputs.get("--hkl-out") if result.amplitudes is not None else None,
                  mtz_path=checked.outputs.get("--mtz-out") if result.amplitudes is not None else None)
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
            f"{checked.outputs['--hkl-out']}" + (f" and {checked.outputs['--mtz-out']}" if "--mtz-out" in checked.outputs
                                                 else ""))
        for line in amplitude_notes(sf, args.output.no_esds, checked.outputs.get("--mtz-out")):
            say(line)
    say(f"wrote {args.output.out} and {checked.json_path}{' and ' + args.output.report if args.output.report else ''} "
        f"({time.monotonic() - t0:.1f} s in all)")
    if args.output.logdir:
        say(f"TensorBoard logs: {os.path.abspath(args.output.logdir)}  (view: tensorboard --logdir {args.output.logdir})")


def _callbacks(args: Job, sim: Simulator, say) -> list:
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
    args: Job | None = None


def _still_defaults(args: Job, say) -> tuple[Job, Any]:
    """``args`` with the defaults of one still from DIALS files filled in (:mod:`refine.inputs.still_defaults`),
    said in the run's first lines, and those defaults (None for any other run)."""
    fit = args.fit
    defaults = still_defaults(args.dials_files, args.model.model, fix=fit.fix, max_steps=args.optimiser.max_steps,
                              choose_names=not (fit.refine is not None or fit.stages is not None or fit.stage_tables
                                                or args.many.joint),
                              spot_window=args.pixels.spot_window, subsample=args.pixels.subsample,
                              rotation_series=args.many.rotation_series)
    if defaults is None:
        return args, None
    say(f"{PROG}: a still from DIALS files (--expt {args.dials.expt}, --refl {args.dials.refl}); defaults:")
    for line in defaults.notes:
        say(f"  {line}")
    fields = defaults.fields()
    return (args.with_fields(**fields) if fields else args), defaults


def prepare(args: Job, say) -> Prepared:
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
        dials = args.dials_files
        spots = refl_panel_spots(dials, sim.panel_layout) if sim.panel_layout is not None else refl_spots(dials)
    window = spot_window(args.dials_files, args.pixels.spot_window, say)
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


def _background(args: Job, sim: Simulator, inputs, choice, start: dict, window: int | None, say):
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


def plan_arguments(args: Job, p: Prepared) -> dict:
    """The keyword arguments of :func:`refine.refine` (and so of :func:`refine.solver.plan.make_plan`) that describe
    the problem: everything but callbacks, progress, checkpoints and esds."""
    return dict(start=p.start, free=p.inputs.free_default if args.fit.refine is None else None, fixed=p.inputs.fixed,
                symmetry=p.inputs.symmetry, bounds=p.checked.bounds, mask=p.choice.mask, stages=p.checked.stages,
                strategy=args.optimiser.optimizer, background=p.background, loss=args.optimiser.loss, priors=p.checked.priors,
                n_spots=None if p.choice.spots is None else len(p.choice.spots), too_few_spots=args.pixels.too_few_spots,
                time_budget_s=args.optimiser.time_budget, structure_factors=p.checked.amplitudes,
                **({"panel_groups": p.inputs.panels[2]} if p.inputs.panels else {}))


def run(args: Job) -> int:
    """Load, refine, write (:func:`refine_one`).  Returns the exit status (0 ok, 1 diverged or failed)."""
    return 0 if refine_one(args).status.ok else 1


def refine_one(args: Job, say=None):
    """Load, refine, write one image's refinement; the :class:`~refine.output.results.RefinementResult`.  ``say``:
    where the lines go (default: printed unless ``output.quiet``)."""
    say = say if say is not None else Printer(args.output.quiet)
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
        if sim.panel_layout is not None:
            write_panels_expt(args.dials_files, args.dials.expt_out, sim, result.params)
        else:
            write_expt_out(args.dials_files, args.dials.expt_out, sim, result.params, args.fit.symmetry)
        say(f"  wrote the refined DIALS experiment {args.dials.expt_out}")
    write_and_report(args, checked, inputs, result, say, t0)
    return result
