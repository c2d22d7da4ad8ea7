"""``nbtorch-refine --images ... --joint``: the images refined together (:func:`refine.many.joint.refine_joint`).

::

    nbtorch-refine --images 'data/run7_*.cbf' --model "..." --joint --shared cell --out-dir out/joint
    nbtorch-refine --images 'data/sweep_00*.cbf' --model "..." --rotation-series --out-dir out/sweep
    torchrun --nproc-per-node 2 -m refine.cli --images @stills.txt --model "..." --joint --out-dir out/joint

Every image is loaded and its pixels chosen as for a single run (``--model`` with ``{stem}``, ``--mask``,
``--dmin``/``--dmax``, ``--spots`` or ``--refl``, ``--roi``, ...; :mod:`refine.modes.single`), each process only its block of
the images (:func:`refine.many.distributed.image_shard`).  ``--shared`` (default ``cell``) and ``--per-image`` (default
``scale,background,orientation``) name the groups.  ``--rotation-series`` is ``--joint`` for a sweep of
rotation images of one crystal, each image's ``-phi``/``-osc``/``-phisteps`` from its own header (as for a
single run): ``--shared`` defaults to ``cell,orientation`` and ``--per-image`` to ``scale,background``, and a
still is refused.  ``--optimizer``, ``--max-steps`` (the loop's steps, default 300), ``--background``,
``--loss``, ``--symmetry`` and ``--no-esds`` apply; stages do not.  With spots (``--spots``, ``--refl``) each image's
and the whole run's spot offsets are reported (:mod:`refine.many.image_reports`), with the fit against shot noise,
one line per image; ``--report`` writes one HTML page with a row per image (:mod:`refine.output.joint_report`).
With ``--expt`` (a rotation scan, one scan axis of a multi-axis goniometer too) every image is matched to the scan by
the experiment's template before any work (:func:`refine.inputs.dials.scan_indices`: its angle and width, its
spots and fitted pixels from the ``.refl``), the crystal model starts from the DIALS profile and, for
``--rotation-series``, the cell and orientation from the indexed spots (:mod:`refine.inputs.spot_start`);
``--expt-out`` writes the refined (scan-static) model into the experiment's document.
Each process holds only the fitted pixels of its images (:mod:`refine.many.pixel_table`; the whole images are read,
their pixels chosen and dropped one at a time); beyond ``--pixel-memory`` megabytes of them (default a quarter
of the machine's memory per local process) an image's pixels go to ``OUT_DIR/pixels/`` and are read back at
each evaluation, and are removed when the run ends.
Process 0 writes ``OUT_DIR/joint.json`` and ``OUT_DIR/joint.h5`` (:mod:`refine.many.joint`) and the checkpoint
``--checkpoint`` (default ``OUT_DIR/joint.ckpt.h5``) every ``--checkpoint-every`` steps; ``--resume`` continues
from it, and so does a worker that ``torchrun --max-restarts`` restarted (:mod:`refine.many.checkpoint`).
``--structure-factors`` (with ``--space-group`` or a space-group ``--symmetry``; ``--f-start``, ``--f-min-photons``,
``--f-restraint``, ``--anomalous``, ``--anomalous-restraint`` as for a single run) refines one amplitude table
shared by all images (:mod:`refine.many.amplitudes`); process 0 also writes it as a nanoBragg ``-hkl`` file,
``--hkl-out`` (default ``OUT_DIR/joint.hkl``), and with ``--mtz-out`` as MTZ (:mod:`refine.output.amplitude_mtz`;
``NOBS`` counts the images).
``--screen`` runs the images through :func:`refine.many.serial.refine_serial` (rounds, the images that do not
fit dropped and listed with their reasons) and ``--add-to`` continues a finished screened run (:mod:`refine.modes.serial`).
The exit status (:func:`refine.modes.entry.exit_status`) is 0 when the refinement converged or stopped at its step
limit, 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

from nbtorch.errors import InputError
from refine.fitting.background import parse_background, resolve_auto
from refine.modes.job import Job
from nbtorch.io.atomic import check_directory_can_be_made, check_not_inputs
from nbtorch.io.hkl import write_hkl
from refine.output.amplitude_mtz import amplitude_notes, write_amplitude_mtz
from refine.modes.independent import per_image_args
from refine.many.batch import end_process_group, expand_image_list, joint_summary_rows, write_summary
from refine.modes.dials_sweep import (ROTATION_PER_IMAGE, ROTATION_SHARED, default_shared, resolve_amplitudes,
                                    start_and_priors)
from refine.modes.single import amplitude_options, prepare
from refine.modes.stills_file import stills_shared, write_joint_expt, write_joint_refl
from refine.inputs.dials import experiment_symmetry, refl_shoeboxes, scan_indices, write_expt_out
from refine.fitting.parameters import GROUPS, ParameterSpace
from refine.many.image_reports import spot_rows, sweep_spot_rows, with_spot_report
from refine.many.distributed import Comm, image_shard
from refine.many.joint import DEFAULT_CONVERGENCE, geometry_checkpoint, refine_joint
from refine.many.serial import SerialResult
from refine.modes.serial import FAILED_START, dropped_lines, previous_run, refine_screened, write_serial
from refine.output.results import save_h5, save_json
from refine.many.amplitudes import check_options
from refine.fitting.space_groups import crystal_system
from refine.many.pixel_table import FittedPixels, StoredPixels
from refine.solver.plan import observed_pixels

__all__ = ["ROTATION_PER_IMAGE", "ROTATION_SHARED", "run_joint", "split_names"]

def split_names(text: str | None, default: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """``"cell,distance"`` -> ``("cell", "distance")`` (``default`` for None)."""
    if text is None:
        return default
    names = tuple(t.strip() for t in str(text).split(",") if t.strip())
    if not names:
        raise InputError(f"{flag}: expected comma-separated names or groups, got {text!r}")
    return names


def image_args(args: Job, image: str, out_dir: Path, index: int | dict | None) -> Job:
    """The single-run options that load ``image`` in a joint run: its ``{stem}`` and, with ``--expt``, its image of
    the scan (``index``, :func:`refine.inputs.dials.scan_indices`) or, a dict, its fields as a still of a many-still
    file (``expt_index``, ``frame``: :func:`refine.modes.stills_file.still_images`); the joint run's checkpoint is
    resumed, not a single run's, and the structure factors are the joint run's (one shared table), not each image's."""
    still = index if isinstance(index, dict) else {}
    return per_image_args(args, image, out_dir).with_fields(
        quiet=args.output.quiet, resume=False, structure_factors=False, space_group=None, f_restraint=None,
        hkl_out=None, mtz_out=None, anomalous=False, anomalous_restraint=None,
        expt_image=args.dials.expt_image if index is None or still else index, **still)


class _SayOnce:
    """``say`` for the images' preparation: a line exactly as printed for the first image (the header's notes, the
    crystal model, the spot windows: the same for every image of a sweep) is not printed again for the others;
    :attr:`repeated` counts those left out.  :meth:`next_image` starts each image after the first."""

    def __init__(self, say) -> None:
        self.say, self.first, self.repeated, self.later = say, set(), 0, False

    def next_image(self) -> None:
        self.later = True

    def __call__(self, line: str) -> None:
        if self.later and line in self.first:
            self.repeated += 1
            return
        if not self.later:
            self.first.add(line)
        self.say(line)


def _load(args: Job, image: str, out_dir: Path, say, index: int | None = None) -> tuple:
    """(simulator, the chosen pixels (:class:`~refine.many.pixel_table.FittedPixels`), start, the observed spots on
    the image (or None)) of one image, prepared as a single run prepares it (:func:`refine.modes.single.prepare`:
    inputs, model, spots or ``--refl``, pixels, compile decision, starting scale and background); the whole image
    is not kept."""
    say(f"  {image}:")
    p = prepare(image_args(args, image, out_dir, index), say)
    if args.many.rotation_series and not p.inputs.cfg.osc_deg:
        raise InputError(f"--rotation-series: {image} is a still (no oscillation in its header or --model); give "
                         "each image's rotation (-phi, -osc in a {{stem}} model) or refine stills with --joint")
    obs, valid = observed_pixels(p.model, p.inputs.observed, p.choice.mask)
    return p.model, FittedPixels.from_image(obs, valid, source=image), p.start, p.choice.spots


def pixel_budget_bytes(args: Job) -> float:
    """``--pixel-memory`` in bytes; default a quarter of the machine's memory per local process (torchrun's
    ``LOCAL_WORLD_SIZE``), unlimited where the memory size is unknown."""
    if args.many.pixel_memory is not None:
        return float(args.many.pixel_memory) * 1e6
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return math.inf
    return total / 4 / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def _keep_or_store(pixels: FittedPixels, index: int, held: list[int], budget: float, folder: Path):
    """``pixels`` while the process's held pixels stay within ``budget`` (``held[0]``: bytes so far), else
    stored in ``folder`` (:meth:`FittedPixels.store`) and read back at each evaluation."""
    if held[0] + pixels.nbytes <= budget:
        held[0] += pixels.nbytes
        return pixels
    folder.mkdir(parents=True, exist_ok=True)
    return pixels.store(folder / f"image_{index:06d}.npz")


def _check_distinct_rotations(images: list[str], sims: list, shard) -> None:
    """``--rotation-series``: no two images (of this process) with the same phi start and width, as when a
    ``-phi``/``-osc`` in ``--model`` overrides every image's header."""
    seen: dict[tuple[float, float], int] = {}
    for i in shard:
        cfg = sims[i].config
        key = (round(float(cfg.phi_deg or 0.0), 9), round(float(cfg.osc_deg or 0.0), 9))
        if key in seen:
            raise InputError(f"--rotation-series: {images[seen[key]]} and {images[i]} have the same rotation "
                             f"(-phi {key[0]:g} -osc {key[1]:g}); a -phi/-osc in --model is every image's: leave the "
                             "rotation to the headers or give it per image (--model @{stem}.model)")
        seen[key] = i


def _checkpoint_path(args: Job, images: list[str], out_dir: Path, hkl: Path | None,
                     mtz: Path | None = None) -> Path:
    """``--checkpoint`` (default ``OUT_DIR/joint.ckpt.h5``), checked by process 0 before any image is loaded:
    not an input (nor is the ``hkl`` output), and present with ``--resume``; process 0 makes ``OUT_DIR``."""
    path = Path(args.output.checkpoint) if args.output.checkpoint else out_dir / "joint.ckpt.h5"
    outputs = [("--checkpoint", str(path))] + [(f, str(p)) for f, p in (("--hkl-out", hkl), ("--mtz-out", mtz))
                                                 if p is not None]

    def check() -> None:
        check_not_inputs([("--images", image) for image in images], outputs)
        # a run with structure factors may have been stopped in its geometry stage (only that stage's file)
        if args.output.resume and not path.is_file() and not geometry_checkpoint(path).is_file():
            raise InputError(f"--resume: checkpoint {path} not found (run once without --resume, or give --checkpoint)")
        check_directory_can_be_made(out_dir, "--out-dir")
        out_dir.mkdir(parents=True, exist_ok=True)

    Comm().on_rank0(check)
    return path


def _load_images(args: Job, images: list[str], indices: list, out_dir: Path, say
                 ) -> tuple[list, list, list, list, dict]:
    """This process's images loaded (:func:`_load`; its block :func:`image_shard`, kept through the rounds of
    ``--screen``): simulators, fitted pixels (held, or stored beyond ``--pixel-memory``), starts and observed spots,
    None for the other processes' images; with ``--screen`` an image that cannot be prepared is left out:
    ``{index: its error}`` of every process's images, the last item)."""
    n = len(images)
    sims, pixels, starts, spots = [None] * n, [None] * n, [None] * n, [None] * n
    budget, held, folder = pixel_budget_bytes(args), [0], out_dir / "pixels"
    shard = image_shard(n)
    failed: dict[int, str] = {}
    say_new = _SayOnce(say)
    try:
        for i in shard:
            try:
                sims[i], px, starts[i], spots[i] = _load(args, images[i], out_dir, say_new, indices[i])
                say_new.next_image()
            except InputError as exc:
                if not args.many.screen:
                    raise
                failed[i] = str(exc)
                say(f"  {images[i]}: left out ({FAILED_START}): {exc}")
                continue
            pixels[i] = _keep_or_store(px, i, held, budget, folder)
    except BaseException:
        _drop_stored(pixels)
        raise
    if say_new.repeated:
        say(f"  ({say_new.repeated} lines the same as the first image's are printed once, under it)")
    if args.many.screen:  # every process learns every failed start (each loaded only its own images)
        failed = {i: msg for i, msg in enumerate(Comm().gather_objects(failed, n)) if msg is not None}
    stored = [i for i in shard if isinstance(pixels[i], StoredPixels)]
    say(f"  fitted pixels held in memory: {held[0] / 1e6:.1f} MB" + (
        f"; the pixels of {len(stored)} images read from {folder}/ at each evaluation (--pixel-memory {budget / 1e6:g} MB)"
        if stored else ""))
    if args.many.rotation_series:
        _check_distinct_rotations(images, sims, [i for i in shard if sims[i] is not None])
    return sims, pixels, starts, spots, failed


def _drop_stored(pixels: list) -> None:
    """This process's stored pixels removed (a resumed run chooses and stores its pixels again)."""
    for px in pixels:
        if isinstance(px, StoredPixels):
            px.path.unlink(missing_ok=True)


def run_joint(args: Job, say: Callable[[str], None] = print, stills: tuple | None = None):
    """Check the images against ``--expt``, load this process's images, refine all jointly, write
    ``joint.json``/``joint.h5``; the :class:`~refine.output.results.JointResult` (of a screened run, ``--screen``: the
    :class:`~refine.many.serial.SerialResult`).  A run refused with an :class:`InputError` leaves no ``--out-dir``
    it made behind.  ``stills``: the images, per-image fields and skipped stills of one DIALS file
    (:func:`refine.modes.stills_file.still_images`), also written as ``OUT_DIR/refined.expt`` and the per-still
    table ``OUT_DIR/summary.csv``/``summary.h5``."""
    images = expand_image_list(args.images) if stills is None else stills[0]
    out_dir = Path(args.many.out_dir or "out/joint")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out-dir {out_dir}: exists and is not a directory")
    made = not out_dir.exists()
    try:
        result = _run_joint(args, images, out_dir, say, None if stills is None else stills[1:])
    except InputError:
        if made and Comm().rank == 0:
            shutil.rmtree(out_dir, ignore_errors=True)
        end_process_group(wait=False)
        raise
    end_process_group()
    return result


def _held_geometry(free: Sequence[str]) -> str:
    """The printed note on the detector geometry a joint run holds; ``free``: its shared names, expanded
    (:meth:`~refine.fitting.parameters.ParameterSpace.expand`: ``beam_centre`` and ``detector`` are their names)."""
    parts = (("distance", {"distance"}), ("beam", {"beam_x", "beam_y"}),
             ("detector", set(GROUPS["detector"]) - {"distance", "beam_x", "beam_y"}))
    held = [word for word, names in parts if not names & set(free)]
    return f"every other parameter ({', '.join(held)}) held" if held else "every other parameter held"


def _run_joint(args: Job, images: list[str], out_dir: Path, say: Callable[[str], None],
               files: tuple | None = None):
    t0 = time.monotonic()
    stills, skipped = (None, ()) if files is None else files
    background = resolve_auto(args.fit.background, False, False)  # auto: constant
    if parse_background(background).kind not in ("constant", "planar"):
        raise InputError(f"--background {background}: a joint refinement fits constant or planar "
                         "backgrounds only (refine each image alone for resolution:K or planes)")
    series = args.many.rotation_series
    args = resolve_amplitudes(args, say)
    amplitudes = amplitude_options(args)  # its space group checked before any image is loaded
    symmetry = crystal_system(args.fit.symmetry) or experiment_symmetry(args.dials_files, args.fit.symmetry) or "triclinic"
    indices = (scan_indices(args.dials_files, images, frame=args.image.frame, shape=args.image.shape,
                            dtype=args.image.raw_dtype, dataset=args.image.dataset) if stills is None else stills)  # matched to the --expt scan, before any work
    if args.many.shared is not None:
        default = ()
    else:
        default = stills_shared(say) if stills is not None else default_shared(args, symmetry, say)
    shared = split_names(args.many.shared, default, "--shared")
    per_image = split_names(args.many.per_image, ROTATION_PER_IMAGE if series else ("scale", "background", "orientation"),
                            "--per-image")
    n = len(images)
    if amplitudes is not None:  # before any image is prepared
        check_options(amplitudes, shared, per_image)
    hkl = None if amplitudes is None else Path(args.output.hkl_out) if args.output.hkl_out else out_dir / "joint.hkl"
    mtz = Path(args.output.mtz_out) if amplitudes is not None and args.output.mtz_out else None
    if args.many.add_to is not None and Path(args.many.add_to).resolve() == (out_dir / "joint.h5").resolve():
        raise InputError(f"--add-to {args.many.add_to}: is this run's own output (--out-dir {out_dir}), which "
                         "it would replace; give the new run another --out-dir")
    space = ParameterSpace(symmetry=symmetry)
    shared_names = space.expand(tuple(x for x in shared if x != "structure_factors"))
    previous = None if args.many.add_to is None else previous_run(
        args.many.add_to, images, shared_names, space.expand(per_image), symmetry)
    checkpoint = _checkpoint_path(args, images, out_dir, hkl, mtz)
    args, priors = start_and_priors(args, images[0], indices[0], symmetry, shared_names, say)
    say(f"nbtorch-refine: joint refinement of {n} images, {len(image_shard(n))} in this "
        f"process; shared: {', '.join(shared)} (decided by all images); per image: {', '.join(per_image)}; "
        f"{_held_geometry(shared_names)}; results in {out_dir}/"
        + ("; in rounds, the images that do not fit dropped (--screen)" if args.many.screen else "")
        + (f"; the first {previous['n_images']} continue from {args.many.add_to}" if previous else ""))
    sims, pixels, starts, spots, failed = _load_images(args, images, indices, out_dir, say)
    try:
        conv = DEFAULT_CONVERGENCE if args.optimiser.max_steps is None else DEFAULT_CONVERGENCE.replace(max_steps=args.optimiser.max_steps)
        kw = dict(shared=shared, per_image=per_image, symmetry=symmetry, image_starts=starts,
                  strategy=args.optimiser.optimizer, convergence=conv, background=background, loss=args.optimiser.loss,
                  esds=not args.output.no_esds, checkpoint=checkpoint, checkpoint_every=args.output.checkpoint_every,
                  structure_factors=amplitudes, priors=priors)
        if args.many.screen:
            kw.pop("image_starts")
            result = refine_screened(sims, pixels, starts, failed, previous, image_shard(n), **kw)
        else:
            result = refine_joint(sims, pixels, resume=checkpoint if args.output.resume else None, **kw)
    finally:
        _drop_stored(pixels)
    predicted: dict = {}  # each held still's model spots at its final values (refined.refl)
    if args.pixels.spots or args.dials.refl:  # every process measures its own images
        result = _with_spots(result, sims, spots, _sweep_boxes(args, indices), predicted)
    if Comm().rank == 0:  # the process group refine_joint used
        _write_and_say(args, result, images, out_dir, (hkl, mtz), sims, say, t0)
        if stills is not None:
            _write_stills_table(result, images, stills, skipped, out_dir, say)
    if stills is not None:
        _write_stills_expt(args, result, images, stills, out_dir, sims, spots, say, predicted)
    return result


def _write_stills_expt(args: Job, result, images: list[str], stills: list[dict], out_dir: Path, sims: list,
                       spots: list, say, predicted: dict | None = None) -> None:
    """``OUT_DIR/refined.expt`` and ``refined.refl`` of a joint run of the stills of one DIALS file (every process
    its own images'; :func:`refine.modes.stills_file.write_joint_expt`, :func:`~refine.modes.stills_file.write_joint_refl`)."""
    if isinstance(result, SerialResult):  # the images a screened run kept
        values = {i: result.joint.images[j] for j, i in enumerate(result.used)}
    else:
        values = dict(enumerate(result.images))
    per_image = [image_args(args, image, out_dir, fields) for image, fields in zip(images, stills)]
    path = write_joint_expt(args, out_dir, values, sims, per_image)
    if path is not None:
        say(f"refined experiments: {path}")
    path = write_joint_refl(args, out_dir, values, sims, spots, per_image, predicted)
    if path is not None:
        say(f"refined predictions: {path}")


def _write_stills_table(result, images: list[str], stills: list[dict], skipped, out_dir: Path, say) -> None:
    """``OUT_DIR/summary.csv``/``summary.h5`` of a joint run of the stills of one DIALS file: a row per still as
    independent mode writes it (:func:`refine.many.batch.joint_summary_rows`); a screened run's dropped stills and
    the skipped ones with their reasons."""
    labels = [image if f.get("frame") is None else f"{image} frame {f['frame']}" for image, f in zip(images, stills)]
    if isinstance(result, SerialResult):
        skipped = [*((labels[i], f"dropped in round {d.get('round', 0)}: {d['reason']}")
                     for i, d in result.dropped.items()), *skipped]
        result, labels = result.joint, [labels[i] for i in result.used]
    csv_path, h5_path = write_summary(joint_summary_rows(result, labels, skipped), out_dir)
    say(f"per-still table: {csv_path} and {h5_path}")


def _sweep_boxes(args: Job, indices: list) -> tuple | None:
    """A rotation series from DIALS files with shoeboxes: ``(frames of the images, observed xyz, bbox)`` for
    :func:`refine.many.image_reports.sweep_spot_rows`; None otherwise (each image's spots compared on it alone)."""
    boxes = refl_shoeboxes(args.dials_files) if args.many.rotation_series and None not in indices else None
    if boxes is None:
        return None
    xyz, bbox, first = boxes
    return [int(first) + int(k) for k in indices], xyz, bbox


def _with_spots(result, sims: list, spots: list, sweep: tuple | None = None, predicted: dict | None = None):
    """The joint result (of a serial run: its last round's, over the images used) with its spot report; ``sweep``
    (:func:`_sweep_boxes`): each spot against the model's centroid over its whole shoebox; ``predicted``: filled
    with each held image's final model spots (by image position)."""
    if sweep is not None and not isinstance(result, SerialResult):
        return with_spot_report(result, sweep_spot_rows(sims, result, image_shard(len(sims)), *sweep))
    if not isinstance(result, SerialResult):
        return with_spot_report(result, spot_rows(sims, spots, result, image_shard(len(sims)), predicted=predicted))
    used = list(result.used)  # this process measures the used images it loaded
    of_used: dict = {}
    rows = spot_rows([sims[i] for i in used], [spots[i] for i in used], result.joint,
                     [j for j, i in enumerate(used) if sims[i] is not None], predicted=of_used)
    if predicted is not None:
        predicted.update({used[j]: p for j, p in of_used.items()})
    return dataclasses.replace(result, joint=with_spot_report(result.joint, rows))


def _image_line(image: str, params: dict, fit: dict | None, spots: dict | None) -> str:
    """One printed line per image: its rotation, scale, spots and fit."""
    parts = [f"  {Path(image).name}: phi {params.get('phi0', math.nan):g} deg, scale {params.get('scale', math.nan):.4g}"]
    if spots and spots["n"]:
        parts.append(f"{spots['n']} spots, rms {spots['rms_px_start_common']:.3g} -> {spots['rms_px_final_common']:.3g} px "
                     f"({spots['matched_final']} matched)")
    if fit:
        parts.append(f"fit {fit['excess']:.3g}x shot noise")
    return ", ".join(parts)


def _write_and_say(args: Job, result, images: list[str], out_dir: Path, amplitude_files: tuple, sims: list,
                   say, t0: float) -> None:
    """Process 0: ``joint.json``, ``joint.h5`` (and the amplitudes, ``--expt-out``, ``--report``), then the summary
    (of a serial run: also the images dropped, with their reasons)."""
    serial, all_images = (result if isinstance(result, SerialResult) else None), images
    if serial is not None:
        written = write_serial(serial, images, out_dir, args.many.add_to)
        result, images = serial.joint, [images[i] for i in serial.used]
        sim0 = sims[serial.used[0]]
    else:
        written = [str(save_json(result, out_dir / "joint.json")), str(save_h5(result, out_dir / "joint.h5"))]
        sim0 = sims[0]
    hkl, mtz = amplitude_files
    if hkl is not None:
        write_hkl(hkl, result.hkl_table())
        written.append(str(hkl))
    if mtz is not None:
        write_amplitude_mtz(mtz, result)
        written.append(str(mtz))
    if args.dials.expt_out and sim0 is not None:
        first = image_args(args, images[0], out_dir, None)
        write_expt_out(first.dials_files, first.dials.expt_out, sim0, result.images[0], first.fit.symmetry)
        written.append(args.dials.expt_out)
    if args.output.report:
        from refine.output.joint_report import write_joint_report  # matplotlib: only when a report is asked for

        written.append(str(write_joint_report(args.output.report, result, [Path(i).name for i in images])))
    for i, image in enumerate(images):
        say(_image_line(image, result.images[i], result.image_fit[i] if result.image_fit else None,
                        result.image_spots[i] if result.image_spots else None))
    for line in dropped_lines(serial, all_images) if serial is not None else ():
        say(line)
    say(result.summary())
    for line in amplitude_notes(result.structure_factors or {}, args.output.no_esds, None if mtz is None else str(mtz)):
        say(line)
    say(f"{time.monotonic() - t0:.1f} s; results: {', '.join(written)}")
