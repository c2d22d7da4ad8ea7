"""The ``nbtorch`` command: a drop-in for the C ``nanoBragg`` program.

Takes nanoBragg's flags (see ``docs/simulator.md``), plus ``-c_parity``, ``-dtype``,
``-device``, ``-h5file`` and ``-pix0_vector_mm``.  Like the C program it writes
``floatimage.bin``, ``intimage.img``, ``image.pgm`` (unless ``-nopgm``) and
``noiseimage.img`` (unless ``-nonoise``) by default;
``-floatfile/-intfile/-pgmfile/-noisefile`` rename them, ``-h5file`` adds an
NXmx HDF5 file and ``-dump`` (with ``-hkl``) a structure-factor cache.  Every
file is written atomically (temporary file + rename).  ``@FILE`` reads flags
from FILE, in place (blank or newline separated, ``#`` comments, shell quotes).
Bad input prints one line ``nbtorch: error: ...`` and exits with status 2,
writing nothing.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Sequence

import numpy as np
import torch

from nbtorch import __version__
from nbtorch.geometry import beam_centre as bc
from nbtorch.runtime import policy as runtime
from nbtorch.cli.args import INPUT_FILE_FLAGS, config_from_args
from nbtorch.cli.support import Printer, argument_files, check_outputs, expand_argument_files, run_main
from nbtorch.sampling.crng import poisson_noise_image
from nbtorch.dials.geometry import dials_origin_mm
from nbtorch.errors import InputError
from nbtorch.io.atomic import write_files_together
from nbtorch.io.hdf5 import h5_writer
from nbtorch.io.hkl import fdump_bytes, grid_description
from nbtorch.io.pgm import pgm_bytes
from nbtorch.io.raw import raw_float_bytes
from nbtorch.io.smv import intfile_from_float, roi_mask_from_bounds, smv_bytes, smv_header_from_geometry
from nbtorch.cli.printout import format_report, pixel_reports, roi_pixels, solid_angle_sum
from nbtorch.simulator import Simulator


def image_statistics(image: np.ndarray, roi, mask: np.ndarray | None, c_parity: bool,
                     pixel_m: float, oversample: int) -> dict[str, float]:
    """The C's end-of-run statistics of a (slow, fast) photon image.

    Values are taken as float32 (the C's image) and summed in pixel order in
    double (squares for ``rms`` rounded to float, as the C computes them).  ``max`` (0 if no pixel is positive, as the C starts from 0) and its
    position ``max_x, max_y`` in metres along fast and slow from pixel (0, 0)'s
    corner: the pixel centre, or under C parity the C's last sub-pixel of that
    pixel.  ``mean`` and ``rms = sqrt(sum v^2 / (n - 1))`` over the simulated
    (ROI, unmasked) pixels; ``rmsd`` about the mean over the same pixels, or under
    C parity over the whole ROI, masked pixels (0) included, as the C.
    """
    x0, x1, y0, y1 = roi
    sub = image[y0:y1 + 1, x0:x1 + 1].astype(np.float32).astype(np.float64)
    keep = np.ones(sub.shape, dtype=bool) if mask is None else np.asarray(mask)[y0:y1 + 1, x0:x1 + 1]
    v = sub[keep]
    n = v.size
    total = float(np.cumsum(v)[-1]) if n else 0.0
    mean = total / max(n, 1)
    v32 = v.astype(np.float32)
    sumsq = float(np.cumsum((v32 * v32).astype(np.float64))[-1]) if n else 0.0  # the C squares in float
    rms = math.sqrt(sumsq / (max(n, 2) - 1))
    w = sub.ravel() if c_parity else v
    dev = float(np.cumsum((w - mean) ** 2)[-1]) if w.size else 0.0
    rmsd = math.sqrt(dev / (max(w.size, 2) - 1))
    max_I, max_x, max_y = 0.0, 0.0, 0.0
    if n and v.max() > 0.0:
        masked = np.where(keep, sub, -np.inf)
        j, i = np.unravel_index(int(np.argmax(masked)), sub.shape)  # first maximum, C order
        max_I = float(sub[j, i])
        f, s = x0 + i, y0 + j
        if c_parity:
            sub_size = pixel_m / oversample
            max_x = sub_size * (f * oversample + oversample - 1) + sub_size / 2.0
            max_y = sub_size * (s * oversample + oversample - 1) + sub_size / 2.0
        else:
            max_x, max_y = (f + 0.5) * pixel_m, (s + 0.5) * pixel_m
    return {"max": max_I, "max_x": max_x, "max_y": max_y, "mean": mean, "rms": rms, "rmsd": rmsd,
            "sum": total, "n": n}


def noise_image(image: np.ndarray, seed: int, adc: float, roi_mask: np.ndarray, c_parity: bool):
    """The ``-noisefile`` pixels: Poisson deviates of the photon image plus ``adc``, clipped at 65535.

    C parity: the C's own generator (:func:`nbtorch.sampling.crng.poisson_noise_image`), bit
    for bit.  Spec: numpy's Poisson generator seeded with ``seed`` (deterministic
    for a seed; negative photon counts are taken as 0).  Pixels outside
    ``roi_mask`` are 0.  Returns ``(uint16 image, photons, overloads)``.
    """
    if c_parity:
        noise, info = poisson_noise_image(image.astype(np.float32), seed, adc=adc, roi_mask=roi_mask)
        return noise, float(info["photons"]), int(info["overloads"])
    rng = np.random.default_rng(seed)
    lam = np.where(roi_mask, np.clip(image.astype(np.float32).astype(np.float64), 0.0, None), 0.0)
    counts = rng.poisson(lam).astype(np.float64)
    raw = counts + adc
    overloads = int((roi_mask & (raw > 65535.0)).sum())
    noise = np.where(roi_mask, np.clip(raw, 0.0, 65535.0), 0.0).astype(np.uint16)
    return noise, float(counts.sum()), overloads


def header_values(sim) -> dict:
    """SMV header numbers (mm, deg) for the simulator's resolved geometry, as the C writes them."""
    s, cfg = sim.setup, sim.config
    with torch.no_grad():
        g = sim.geometry(sim.parameters_dict())
        pix0 = g.pix0.double().cpu().numpy()
        fbeam, sbeam = float(g.Fbeam), float(g.Sbeam)
        fclose, sclose = float(g.Fclose), float(g.Sclose)
        close, dist = float(g.close_distance), float(g.distance)
    p = s.pixel_m
    if s.convention in bc.ORG_CONVENTIONS:  # the C's header: the -Xbeam/-Xclose flag, else the ORGX point
        fc0, sc0 = bc.close_point_m(cfg.ORGX, cfg.ORGY, p, s.fpixels * p, s.spixels * p)
        xb = cfg.Xbeam_mm / 1000 if cfg.Xbeam_mm is not None else (cfg.Xclose_mm / 1000 if cfg.Xclose_mm is not None else fc0)
        yb = cfg.Ybeam_mm / 1000 if cfg.Ybeam_mm is not None else (cfg.Yclose_mm / 1000 if cfg.Yclose_mm is not None else sc0)
    else:
        xb, yb = s.params["beam_x"] / 1000, s.params["beam_y"] / 1000
    osc = s.phistep_deg * s.phisteps if cfg.osc_deg is None else cfg.osc_deg
    # the direct beam in each convention's own terms (nbtorch.geometry.beam_centre)
    adxv = bc.beam_centre_from_offsets_m("adxv", fbeam, sbeam, p, s.detsize_s_m)
    mosflm = bc.beam_centre_from_offsets_m("mosflm", fbeam, sbeam, p, s.detsize_s_m)
    denzo = bc.beam_centre_from_offsets_m("denzo", fbeam, sbeam, p, s.detsize_s_m)
    return dict(
        fpixels=s.fpixels, spixels=s.spixels, pixel_mm=p * 1000, distance_mm=dist * 1000,
        wavelength_A=s.params["wavelength"], beam_center_x_mm=xb * 1000, beam_center_y_mm=yb * 1000,
        adxv_x=adxv[0] * 1000, adxv_y=adxv[1] * 1000,
        mosflm_x=mosflm[0] * 1000, mosflm_y=mosflm[1] * 1000,
        denzo_x=denzo[0] * 1000, denzo_y=denzo[1] * 1000,
        dials_origin=dials_origin_mm(pix0),
        xds_orgx=bc.org_from_close_px(fclose, p), xds_orgy=bc.org_from_close_px(sclose, p),
        close_distance_mm=close * 1000,
        phi_deg=cfg.phi_deg, osc_start_deg=cfg.phi_deg, osc_range_deg=osc,
        twotheta_deg=s.params["twotheta"],
    )


def h5_metadata(sim, argv: Sequence[str]) -> tuple[dict, dict]:
    """(root attributes, geometry) for :func:`nbtorch.io.hdf5.write_h5`.

    NXmx fields: ``distance`` (beam-path distance), ``beam_center_x/y`` (the
    direct-beam spot along fast/slow from the corner of pixel (0, 0), i.e. Fbeam
    and Sbeam), ``x/y_pixel_size`` (mm) and ``incident_wavelength`` (A).  Every
    resolved quantity is also stored on ``/entry/nbtorch``.
    """
    s, cfg = sim.setup, sim.config
    hv = header_values(sim)
    with torch.no_grad():
        g = sim.geometry(sim.parameters_dict())
        vec = {k: getattr(g, k).double().cpu().numpy() for k in ("pix0", "fdet", "sdet", "odet", "beam")}
        fbeam, sbeam = float(g.Fbeam) * 1000, float(g.Sbeam) * 1000
        fclose, sclose = float(g.Fclose) * 1000, float(g.Sclose) * 1000
    geometry = {
        "distance_mm": hv["distance_mm"], "beam_center_x_mm": fbeam, "beam_center_y_mm": sbeam,
        "pixel_size_mm": s.pixel_m * 1000, "wavelength_A": s.params["wavelength"],
        "close_distance_mm": hv["close_distance_mm"], "Fbeam_mm": fbeam, "Sbeam_mm": sbeam,
        "Fclose_mm": fclose, "Sclose_mm": sclose, "Xbeam_mm": hv["beam_center_x_mm"],
        "Ybeam_mm": hv["beam_center_y_mm"], "xds_orgx": hv["xds_orgx"], "xds_orgy": hv["xds_orgy"],
        "dials_origin_mm": np.array(hv["dials_origin"]),
        "pix0_vector_m": vec["pix0"], "fdet_vector": vec["fdet"], "sdet_vector": vec["sdet"],
        "odet_vector": vec["odet"], "beam_vector": vec["beam"], "polar_vector": s.polar_axis,
        "spindle_axis": s.spindle, "twotheta_axis": s.twotheta_axis,
        "convention": s.convention, "pivot": s.pivot, "fpixels": s.fpixels, "spixels": s.spixels,
        "roi": np.array(s.roi), "oversample": s.oversample, "phisteps": s.phisteps,
        "phistep_deg": s.phistep_deg, "osc_range_deg": hv["osc_range_deg"], "sources": len(s.incident),
        "mosaic_domains": len(s.mosaic_fractions), "thicksteps": s.thicksteps, "steps": s.steps,
    }
    attrs = {"program": "nbtorch", "version": __version__, "command_line": " ".join(argv), "mode": "c_parity" if s.c_parity else "spec",
             "c_parity": bool(s.c_parity), "dtype": cfg.dtype, "units": "photons per pixel"}
    attrs.update({k: v for k, v in s.params.items()})  # canonical parameters (units: README)
    return attrs, geometry


def choose_compile(sim, cfg) -> None:
    """Compile or not for one image (:func:`nbtorch.runtime.policy.compile_policy`, purpose ``one-shot``)."""
    x0, x1, y0, y1 = sim.setup.roi
    evaluations = (x1 - x0 + 1) * (y1 - y0 + 1) * sim.evaluations_per_pixel()
    sim.set_compile(*runtime.compile_policy("one-shot", evaluations, explicit=cfg.compile))


def run(argv: Sequence[str], context: dict | None = None) -> int:
    """Parse, simulate, write the outputs.  Returns the exit status.

    ``context`` (optional dict) is kept up to date with the ``stage`` of the run
    and the ``sim`` once built, so that :func:`main` can say what ran out of memory.
    """
    context = {} if context is None else context
    context["stage"] = "reading the inputs"
    say = Printer()
    typed = list(argv)
    argv = expand_argument_files(typed, path_flags=INPUT_FILE_FLAGS)
    cfg = config_from_args(argv)
    outputs = output_files(cfg)
    inputs = [named for named in cfg.model_files() if named not in outputs]  # -dump may be both
    check_outputs(outputs, inputs + argument_files(typed))
    runtime.check_device(cfg.device, "-device")
    t0 = time.perf_counter()
    sim = start_simulation(cfg, context, say)
    image, diag, roi_mask = render_image(sim, cfg)
    context["stage"] = "writing the outputs"
    st = report_image(sim, cfg, image, diag, say)
    # every output is built in memory first and written together at the end, so that a
    # failure (a header, the file system) leaves no output file at all
    files = image_files(sim, cfg, image, st, roi_mask, say) + extra_files(sim, cfg, image, argv, say)
    write_files_together(files)
    say(f"done in {time.perf_counter() - t0:.2f} s")
    return 0


def start_simulation(cfg, context: dict, say) -> Simulator:
    """The simulator of ``cfg``, compiled or not (:func:`choose_compile`), and the C's opening lines about it."""
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    context["stage"] = "setting up the simulation"
    sim = Simulator(cfg, dtype=dtype, device=cfg.device, compile=cfg.compile if cfg.compile is not None else False)
    context["sim"] = sim
    context["stage"] = "rendering"
    choose_compile(sim, cfg)
    s = sim.setup
    say(f"nbtorch ({'C-parity' if s.c_parity else 'spec'} mode, {cfg.dtype} on {cfg.device}): "
          f"{s.fpixels}x{s.spixels} pixels, oversample {s.oversample}, {len(s.incident)} sources, "
          f"{len(s.mosaic_fractions)} mosaic domains ({s.mosaic_model}), {s.phisteps} phi steps, {s.thicksteps} sensor layers; "
          f"{sim.compile_mode} ({sim.compile_reason})")
    from nbtorch.cli.printout import distances_summary

    say(distances_summary(sim))
    for note in s.notes:
        say(f"note: {note}")
    if s.pixel_mask is not None:
        say(f"  skipping zero-flagged pixels in {cfg.mask_file}")
    return sim


def render_image(sim, cfg) -> tuple[np.ndarray, dict, np.ndarray]:
    """``(image, diagnostics, roi_mask)``: the whole (slow, fast) photon image (float64, 0 outside the ROI and on
    ``-mask``'s zero pixels), the render's diagnostics and the ROI as a bool image."""
    s = sim.setup
    with torch.no_grad():
        image_t, diag = sim.render(progress=use_progress(cfg), diagnostics=True)
        full = image_t.new_zeros(sim.shape)
        x0, x1, y0, y1 = s.roi
        full[y0:y1 + 1, x0:x1 + 1] = image_t
    image = full.double().cpu().numpy()
    if s.pixel_mask is not None:
        image[~s.pixel_mask] = 0.0  # the C skips these pixels (the simulator may already have)
    return image, diag, roi_mask_from_bounds(image.shape, x0, x1, y0, y1)


def report_image(sim, cfg, image: np.ndarray, diag: dict, say) -> dict[str, float]:
    """The C's pixel printout (``-printout``), solid angle and lookup lines; returns :func:`image_statistics`."""
    s = sim.setup
    mask = s.pixel_mask
    if cfg.printout:
        pixels = [tuple(cfg.printout_pixel)] if cfg.printout_pixel is not None else roi_pixels(s.roi, mask)
        for report in pixel_reports(sim, pixels, image):
            say(format_report(report))
        say()
    omega = solid_angle_sum(sim, mask)
    say(f"solid angle subtended by detector = {omega:g} steradian ( {100 * omega / 4 / math.pi:g}% sphere)")
    say(f"fraction of structure-factor lookups outside the HKL table: {float(diag['fraction_default_F']):.3g}")
    return image_statistics(image, s.roi, mask, s.c_parity, s.pixel_m, s.oversample)


def image_files(sim, cfg, image: np.ndarray, st: dict, roi_mask: np.ndarray, say) -> list:
    """``(path, bytes)`` of the float, int, PGM and noise images (built, not written), with the C's lines."""
    s = sim.setup
    files: list = []
    floatfile = cfg.floatfile or "floatimage.bin"
    say(f"writing {floatfile} as {image.size} 4-byte floats")
    files.append((floatfile, raw_float_bytes(floatfile, image.astype(np.float32))))
    say(f"max_I = {st['max']:g}  at {st['max_x']:g} {st['max_y']:g}")
    say(f"mean= {st['mean']:g} rms= {st['rms']:g} rmsd= {st['rmsd']:g}")
    header = smv_header_from_geometry(**header_values(sim))
    scale = cfg.scale if cfg.scale > 0 else (55000.0 / st["max"] if st["max"] > 0 else 1.0)
    intimage, scale = intfile_from_float(image, scale=scale, adc=cfg.adc, roi_mask=roi_mask)
    intfile = cfg.intfile or "intimage.img"
    say(f"intfile_scale = {scale:g}")
    say(f"writing {intfile} as 2-byte integers")
    files.append((intfile, smv_bytes(intfile, intimage, header)))
    if not cfg.nopgm:
        pgmfile = cfg.pgmfile or "image.pgm"
        pscale = cfg.pgmscale if cfg.pgmscale > 0 else (250.0 / (5.0 * st["rmsd"]) if st["rmsd"] > 0 else scale)
        say(f"pgm_scale = {pscale:g}")
        say(f"writing {pgmfile} as 1-byte integers")
        files.append((pgmfile, pgm_bytes(pgmfile, image, pscale, roi_mask=roi_mask)[0]))
    if not cfg.nonoise:
        seed = cfg.seed if cfg.seed is not None else int(time.time())
        noise, photons, overloads = noise_image(image, seed, cfg.adc, roi_mask, s.c_parity)
        noisefile = cfg.noisefile or "noiseimage.img"
        say(f"{photons:.0f} photons on noise image ({overloads} overloads)")
        say(f"writing {noisefile} as 2-byte integers (seed {seed})")
        files.append((noisefile, smv_bytes(noisefile, noise, header)))
    return files


def extra_files(sim, cfg, image: np.ndarray, argv: Sequence[str], say) -> list:
    """``(path, writer or bytes)`` of ``-h5file`` and ``-dump`` (built, not written), with the C's lines."""
    s = sim.setup
    files: list = []
    if cfg.h5file:
        attrs, geometry = h5_metadata(sim, argv)
        say(f"writing {cfg.h5file} (NXmx HDF5)")
        files.append((cfg.h5file, h5_writer(cfg.h5file, image.astype(np.float32), attrs, geometry)))
    if cfg.dump_file and cfg.hkl_file and s.F_grid is not None:
        say(f"writing dump file for next time: {cfg.dump_file}")
        files.append((cfg.dump_file, fdump_bytes(cfg.dump_file, s.F_grid, tuple(int(v) for v in s.hkl_min))))
    return files


def output_files(cfg) -> list[tuple[str, str]]:
    """``(flag, path)`` of every file this run will write, defaults included."""
    out = [("-floatfile", cfg.floatfile or "floatimage.bin"), ("-intfile", cfg.intfile or "intimage.img")]
    if not cfg.nopgm:
        out.append(("-pgmfile", cfg.pgmfile or "image.pgm"))
    if not cfg.nonoise:
        out.append(("-noisefile", cfg.noisefile or "noiseimage.img"))
    if cfg.h5file:
        out.append(("-h5file", cfg.h5file))
    if cfg.dump_file and cfg.hkl_file:
        out.append(("-dump", cfg.dump_file))
    return out


def use_progress(cfg) -> bool:
    """Whether to show the tqdm bar: ``-progress`` (default) on, no ``-printout``, stderr a terminal."""
    return bool(cfg.progress and not cfg.printout and sys.stderr.isatty())


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: ``MemoryError`` (numpy) or torch's allocator ``RuntimeError`` (CPU or CUDA)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def out_of_memory_message(exc: BaseException, context: dict) -> str:
    """One line: what ran out of memory, the sizes that drove it, the allocator's words and what to lower."""
    parts = []
    sim = context.get("sim")
    if sim is not None:
        s = sim.setup
        x0, x1, y0, y1 = s.roi
        parts.append(f"{(x1 - x0 + 1) * (y1 - y0 + 1)} pixels, oversample {s.oversample}, {s.samples_per_pixel:.6g} "
                     f"samples and {s.evaluations_per_pixel:.6g} evaluations per pixel")
        if s.F_grid is not None:
            parts.append(f"structure-factor grid: {grid_description(s.hkl_min, s.hkl_max)}")
    words = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    sizes = f" ({'; '.join(parts)})" if parts else ""
    return str(InputError(
        f"out of memory while {context.get('stage', 'running')}{sizes}: {words}; lower -oversample, the sampling "
        f"steps (-phisteps, -mosaic_dom, -divsteps, -dispsteps), the detector or -roi size, or the HKL index range"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "-help"):
        print(__doc__)
        print("usage: nbtorch -cell a b c alpha beta gamma | -mat FILE  [-hkl FILE | -default_F F] [nanoBragg flags...]"
              "  (@FILE: flags from FILE)")
        return 0 if argv else 2
    context: dict = {}
    runtime.tune_allocator()
    return run_main("nbtorch", lambda args: run(args, context), argv,
                    explain=lambda exc: out_of_memory_message(exc, context) if is_out_of_memory(exc) else None,
                    interrupted=lambda exc: "")


if __name__ == "__main__":
    sys.exit(main())
