"""The ``nbtorch`` command: a drop-in for the C ``nanoBragg`` program.

Takes nanoBragg's flags (see ``docs/cli.md``), plus ``-c_parity``, ``-dtype``,
``-device`` and ``-h5file``.  Like the C program it writes ``floatimage.bin``,
``intimage.img``, ``image.pgm`` (unless ``-nopgm``) and ``noiseimage.img``
(unless ``-nonoise``) by default; ``-floatfile/-intfile/-pgmfile/-noisefile``
rename them.  Every file is written atomically.  Bad input prints one line
``nbtorch: error: ...`` and exits with status 2, writing nothing.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Sequence

import numpy as np
import torch

from nbtorch.args import config_from_args
from nbtorch.errors import InputError


def _stats(image: np.ndarray, roi) -> dict[str, float]:
    x0, x1, y0, y1 = roi
    v = image[y0:y1 + 1, x0:x1 + 1].astype(np.float64).ravel()
    n = max(v.size, 2)
    mean = v.sum() / max(v.size, 1)
    return {
        "max": float(v.max()),
        "mean": float(mean),
        "rms": math.sqrt(float((v * v).sum()) / (n - 1)),
        "rmsd": math.sqrt(float(((v - mean) ** 2).sum()) / (n - 1)),
        "sum": float(v.sum()),
    }


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
    if s.convention in ("xds", "dials"):
        fc0 = (cfg.ORGX - 0.5) * p if cfg.ORGX is not None else s.fpixels * p / 2
        sc0 = (cfg.ORGY - 0.5) * p if cfg.ORGY is not None else s.spixels * p / 2
        xb = cfg.Xbeam_mm / 1000 if cfg.Xbeam_mm is not None else (cfg.Xclose_mm / 1000 if cfg.Xclose_mm is not None else fc0)
        yb = cfg.Ybeam_mm / 1000 if cfg.Ybeam_mm is not None else (cfg.Yclose_mm / 1000 if cfg.Yclose_mm is not None else sc0)
    else:
        xb, yb = s.params["beam_x"] / 1000, s.params["beam_y"] / 1000
    osc = s.phistep_deg * s.phisteps if cfg.osc_deg is None else cfg.osc_deg
    return dict(
        fpixels=s.fpixels, spixels=s.spixels, pixel_mm=p * 1000, distance_mm=dist * 1000,
        wavelength_A=s.params["wavelength"], beam_center_x_mm=xb * 1000, beam_center_y_mm=yb * 1000,
        adxv_x=fbeam * 1000, adxv_y=(s.detsize_s_m - sbeam) * 1000,
        mosflm_x=(sbeam - 0.5 * p) * 1000, mosflm_y=(fbeam - 0.5 * p) * 1000,
        denzo_x=sbeam * 1000, denzo_y=fbeam * 1000,
        dials_origin=(1000 * pix0[2], 1000 * pix0[1], -1000 * pix0[0]),
        xds_orgx=fclose / p + 0.5, xds_orgy=sclose / p + 0.5, close_distance_mm=close * 1000,
        phi_deg=cfg.phi_deg, osc_start_deg=cfg.phi_deg, osc_range_deg=osc,
        twotheta_deg=s.params["twotheta"],
    )


def run(argv: Sequence[str]) -> int:
    """Parse, simulate, write the outputs.  Returns the exit status."""
    from nbtorch.simulator import Simulator
    from nbtorch.io import atomic  # noqa: F401  (fail early if io is broken)
    from nbtorch.io.raw import write_raw_float
    from nbtorch.io.smv import intfile_from_float, smv_header_from_geometry, write_smv, roi_mask_from_bounds
    from nbtorch.io.pgm import default_pgm_scale, write_pgm

    cfg = config_from_args(argv)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"-device {cfg.device}: CUDA is not available on this machine")
    t0 = time.perf_counter()
    sim = Simulator(cfg, dtype=dtype, device=cfg.device)
    s = sim.setup
    print(f"nbtorch ({'C-parity' if s.c_parity else 'spec'} mode, {cfg.dtype} on {cfg.device}): "
          f"{s.fpixels}x{s.spixels} pixels, oversample {s.oversample}, {len(s.incident)} sources, "
          f"{len(s.mosaic_fractions)} mosaic domains, {s.phisteps} phi steps, {s.thicksteps} sensor layers")
    for note in s.notes:
        print(f"note: {note}")
    progress = cfg.progress and sys.stderr.isatty()
    with torch.no_grad():
        image_t, diag = sim.render(progress=progress)
        full = image_t.new_zeros(sim.shape)
        x0, x1, y0, y1 = s.roi
        full[y0:y1 + 1, x0:x1 + 1] = image_t
    image = full.double().cpu().numpy()
    st = _stats(image, s.roi)
    print(f"max_I = {st['max']:g}  mean= {st['mean']:g} rms= {st['rms']:g} rmsd= {st['rmsd']:g}")
    print(f"fraction of structure-factor lookups outside the HKL table: {float(diag['fraction_default_F']):.3g}")
    roi_mask = roi_mask_from_bounds(image.shape, x0, x1, y0, y1)

    floatfile = cfg.floatfile or "floatimage.bin"
    write_raw_float(floatfile, image.astype(np.float32))
    print(f"writing {floatfile} as {image.size} 4-byte floats")
    header = smv_header_from_geometry(**header_values(sim))
    intimage, scale = intfile_from_float(image, scale=cfg.scale if cfg.scale > 0 else None, adc=cfg.adc, roi_mask=roi_mask)
    intfile = cfg.intfile or "intimage.img"
    write_smv(intfile, intimage, header)
    print(f"intfile_scale = {scale:g}\nwriting {intfile} as 2-byte integers")
    if not cfg.nopgm:
        pgmfile = cfg.pgmfile or "image.pgm"
        pscale = cfg.pgmscale if cfg.pgmscale > 0 else default_pgm_scale(image, roi_mask=roi_mask, intfile_scale=scale)
        write_pgm(pgmfile, image, pscale, roi_mask=roi_mask)
        print(f"pgm_scale = {pscale:g}\nwriting {pgmfile}")
    if not cfg.nonoise:
        seed = cfg.seed if cfg.seed is not None else int(time.time())
        if s.c_parity:
            from nbtorch.crng import poisson_noise_image

            noise, info = poisson_noise_image(image.astype(np.float32), seed, adc=cfg.adc, roi_mask=roi_mask)
            photons, overloads = info["photons"], info["overloads"]
        else:
            rng = np.random.default_rng(seed)
            counts = rng.poisson(np.where(roi_mask, np.clip(image, 0, None), 0.0)).astype(np.float64)
            photons = counts.sum()
            raw = counts + cfg.adc
            overloads = int((raw > 65535).sum())
            noise = np.where(roi_mask, np.clip(raw, 0, 65535), 0).astype(np.uint16)
        noisefile = cfg.noisefile or "noiseimage.img"
        write_smv(noisefile, noise, header)
        print(f"{photons:.0f} photons on noise image ({overloads} overloads)\nwriting {noisefile} (seed {seed})")
    if cfg.h5file:
        from nbtorch.io.hdf5 import write_h5

        hv = header_values(sim)
        geometry = {
            "distance": hv["distance_mm"], "beam_center_x": hv["beam_center_x_mm"], "beam_center_y": hv["beam_center_y_mm"],
            "x_pixel_size": s.pixel_m * 1000, "y_pixel_size": s.pixel_m * 1000, "incident_wavelength": s.params["wavelength"],
        }
        attrs = {**{k: v for k, v in s.params.items()}, "convention": s.convention, "pivot": s.pivot,
                 "c_parity": int(s.c_parity), "oversample": s.oversample, "steps": s.steps}
        write_h5(cfg.h5file, image.astype(np.float32), attrs, geometry)
        print(f"writing {cfg.h5file}")
    print(f"done in {time.perf_counter() - t0:.2f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "-help"):
        print(__doc__)
        print("usage: nbtorch -cell a b c alpha beta gamma | -mat FILE  [-hkl FILE | -default_F F] [nanoBragg flags...]")
        return 0 if argv else 2
    try:
        return run(argv)
    except InputError as exc:
        print(f"nbtorch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nbtorch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
