"""Resolve a :class:`SimulationConfig` into a static :class:`Setup`.

This is where nanoBragg's automatic rules live (step counts, default beam
centres, pivots, oversampling, sources, mosaic domains) and where units are
converted once.  Everything here is plain numbers and numpy arrays (torch is
used only through the shared rotation and orientation functions, converted at
the boundary): the :class:`~nbtorch.simulator.Simulator` turns the canonical
parameters into tensors and calls the physics.

:func:`resolve` checks the config and composes five frozen pieces, one builder
each: :class:`DetectorSetup` (:func:`resolve_detector`: pixels, ROI, axes and pivot
(:mod:`nbtorch.geometry.detector_axes`),
beam centre, distance), :class:`CrystalSetup` (:func:`resolve_crystal`: cell,
orientation, size, shape), :class:`SamplingSetup` (:func:`resolve_sampling`: phi
steps, mosaic domains, sources (:mod:`nbtorch.sampling.beam_sources`), oversampling), :class:`SensorSetup`
(:func:`resolve_sensor`: sensor layers and attenuation) and
:class:`StructureFactorSetup` (:func:`resolve_structure_factors`: the F table).
:class:`Setup` holds them and exposes their fields under the names callers use
(``setup.pixel_m``, ``setup.incident`` ...).

The canonical parameters (``Setup.params``), their units and groups are the
table in :mod:`nbtorch.parameters`; the beam-centre rules are in
:mod:`nbtorch.geometry.beam_centre`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from nbtorch.geometry import beam_centre as bc
from nbtorch.sampling import crng
from nbtorch.sampling.beam_sources import resolve_sources
from nbtorch.config import SimulationConfig
from nbtorch.geometry.detector_axes import FORCED_PIVOT, detector_axes
from nbtorch.errors import InputError
from nbtorch.io.hkl import read_fdump, read_hkl
from nbtorch.io.reflections import is_reflection_file, read_reflection_file
from nbtorch.io.matrix import read_mosflm_matrix
from nbtorch.parameters import PARAMETER_NAMES
from nbtorch.physics.crystal import orientation_from_reciprocal
from nbtorch.physics.mosaic import (EVEN_MOSAIC_MODELS, MOSAIC_MODELS, even_mosaic_domains, mosaic_set_turn,
                                    rocking_sigma_per_spread)
from nbtorch.physics.rotation import rotation_matrix_xyz
from nbtorch.rules.checks import check_cell, check_positive, check_size_matrix, read_mask, validate
from nbtorch.rules.resolved import (CrystalSetup, DetectorSetup, SamplingSetup, SensorSetup, Setup,
                                    StructureFactorSetup)

__all__ = ["PARAMETER_NAMES", "Setup", "DetectorSetup", "CrystalSetup", "SamplingSetup", "SensorSetup",
           "StructureFactorSetup", "resolve", "resolve_detector", "resolve_crystal", "resolve_sampling",
           "resolve_sensor", "resolve_structure_factors", "beam_centre_defaults", "check_cell", "check_size_matrix",
           "corner_dmin_A",
           "DEFAULT_FLUENCE", "MAX_AUTO_OVERSAMPLE", "MAX_SAMPLES_PER_PIXEL", "mosaic_model_of", "with_mosaic_domains",
           "EVEN_MOSAIC_DOMAINS", "MAX_EVEN_MOSAIC_DOMAINS", "DEFAULT_MOSAIC_MODEL", "EVEN_MOSAIC_MODELS", "MOSAIC_MODELS",
           "rocking_sigma_per_spread"]

DEFAULT_FLUENCE = 125932015286227086360700780544.0  # photons/m^2 = 1/r_e^2
AVOGADRO = 6.02214179e23
WATER_F = 2.57
WATER_MW = 18.0
#: the largest oversample the automatic rule (``ceil(3 * crystal size / (lambda * distance / pixel))``,
#: the C's) may choose: 100 is 10^4 sub-pixels per pixel, far more than any crystal of normal size
#: needs (a 1 um crystal at 100 mm with 0.1 mm pixels and 1 A gets 30); beyond it the command
#: refuses and asks for an explicit ``-oversample`` (usually a unit mistake: ``-distance`` in metres,
#: ``-pixel`` in um)
MAX_AUTO_OVERSAMPLE = 100
#: the most samples (sub-pixels x sensor layers x sources) one pixel may have, whatever chose the
#: oversample: the simulator holds every sample of a tile (at least 16 pixels) at once, ~175 bytes
#: each (float64), so 2^20 per pixel is ~3 GB per tile; beyond it is an error, not an allocator crash
MAX_SAMPLES_PER_PIXEL = 1 << 20


def _resolve_phi(cfg: SimulationConfig):
    """(phisteps, phistep in deg) by the C's rules."""
    osc = -1.0 if cfg.osc_deg is None else cfg.osc_deg
    step = -1.0 if cfg.phistep_deg is None else cfg.phistep_deg
    n = -1 if cfg.phisteps is None else cfg.phisteps
    if n < 0:
        if osc < 0.0:
            if step <= 0.0:
                n, osc, step = 1, 0.0, 0.0
            else:
                osc, n = step, 2
        elif step <= 0.0:
            n, step = 2, osc / 2.0
        else:
            n = math.ceil(osc / step)
    else:
        if n == 0:
            n = 1
        if osc < 0.0:
            if step <= 0.0:
                osc = 180.0 / math.pi  # 1 radian
                step = osc / n
            else:
                osc, n = step, 2
        elif step < 0.0:
            step = osc / n
    return n, step


# --------------------------------------------------------------------------------------
# the builders, one per piece, and resolve
# --------------------------------------------------------------------------------------
def beam_centre_defaults(cfg: SimulationConfig, pixel_m: float, detsize_f: float, detsize_s: float):
    """Canonical (beam_x, beam_y) in metres for the convention (C defaults where not given).

    ``-Xbeam/-Ybeam`` give it for MOSFLM, DENZO, ADXV and CUSTOM; XDS and DIALS take
    ``-ORGX/-ORGY`` (the C ignores ``-Xbeam`` there); CUSTOM falls back on
    ``-Xclose/-Yclose``.  The rules: :mod:`nbtorch.geometry.beam_centre`.
    """
    conv = cfg.convention
    fclose, sclose = bc.close_point_m(cfg.ORGX, cfg.ORGY, pixel_m, detsize_f, detsize_s)
    if conv == "custom":
        fclose = cfg.Xclose_mm / 1000.0 if cfg.Xclose_mm is not None else fclose
        sclose = cfg.Yclose_mm / 1000.0 if cfg.Yclose_mm is not None else sclose
    default_x, default_y = bc.default_beam_centre_m(conv, pixel_m, detsize_f, detsize_s, (fclose, sclose))
    if conv in bc.ORG_CONVENTIONS:
        return default_x, default_y
    return (cfg.Xbeam_mm / 1000.0 if cfg.Xbeam_mm is not None else default_x,
            cfg.Ybeam_mm / 1000.0 if cfg.Ybeam_mm is not None else default_y)


def _detector_size(cfg: SimulationConfig) -> tuple[float, float, float, int, int]:
    """(pixel, detsize_f, detsize_s) in m and (fpixels, spixels): ``-detpixels`` wins over ``-detsize``."""
    pixel = cfg.pixel_mm / 1000.0
    detsize_f, detsize_s = cfg.detsize_f_mm / 1000.0, cfg.detsize_s_mm / 1000.0
    if cfg.fpixels:
        detsize_f = pixel * cfg.fpixels
    if cfg.spixels:
        detsize_s = pixel * cfg.spixels
    fpixels = math.ceil(detsize_f / pixel - 0.5)
    spixels = math.ceil(detsize_s / pixel - 0.5)
    if fpixels <= 0 or spixels <= 0:
        raise InputError(f"detector has no pixels ({fpixels} x {spixels}): check -detpixels/-detsize/-pixel")
    return pixel, detsize_f, detsize_s, fpixels, spixels


def _roi(cfg: SimulationConfig, fpixels: int, spixels: int) -> tuple[int, int, int, int]:
    """``-roi`` (inclusive, inside the detector) or the whole detector; checks ``-printout_pixel`` is inside."""
    roi = (0, fpixels - 1, 0, spixels - 1)
    if cfg.roi is not None:
        x0, x1, y0, y1 = cfg.roi
        if not (0 <= x0 <= x1 < fpixels and 0 <= y0 <= y1 < spixels):
            raise InputError(f"-roi {x0} {x1} {y0} {y1}: outside the {fpixels} x {spixels} detector or empty (xmin xmax ymin ymax, inclusive)")
        roi = (x0, x1, y0, y1)
    if cfg.printout_pixel is not None:
        pf, ps = cfg.printout_pixel
        if not (roi[0] <= pf <= roi[1] and roi[2] <= ps <= roi[3]):
            raise InputError(f"-printout_pixel {pf} {ps}: not inside the rendered pixels "
                             f"(fast {roi[0]}..{roi[1]}, slow {roi[2]}..{roi[3]})")
    return roi


def resolve_detector(cfg: SimulationConfig) -> DetectorSetup:
    """Pixels, ROI, axes, pivot, beam centre and distance (the canonical one is along the beam)."""
    pixel, detsize_f, detsize_s, fpixels, spixels = _detector_size(cfg)
    roi = _roi(cfg, fpixels, spixels)
    beam, f, s, o, tt, polar, spindle = detector_axes(cfg)
    conv = cfg.convention
    pivot = FORCED_PIVOT.get(conv, cfg.pivot or "beam")
    beam_x, beam_y = beam_centre_defaults(cfg, pixel, detsize_f, detsize_s)
    # ratio = beam . (normal rotated by -detector_rotx/y/z): -close_distance is along the normal
    angles = (math.radians(v) for v in (cfg.detector_rotx_deg, cfg.detector_roty_deg, cfg.detector_rotz_deg))
    rot = rotation_matrix_xyz(*(torch.tensor(a, dtype=torch.float64) for a in angles)).numpy()
    ratio = float(beam @ (rot @ o)) or np.finfo(float).tiny
    if cfg.close_distance_mm is not None:
        distance_m = cfg.close_distance_mm / 1000.0 / abs(ratio)
    else:
        distance_m = cfg.distance_mm / 1000.0
    return DetectorSetup(
        convention=conv, pivot=pivot, beam=beam, fdet=f, sdet=s, odet=o, twotheta_axis=tt, polar_axis=polar,
        spindle=spindle, pixel_m=pixel, fpixels=fpixels, spixels=spixels, detsize_s_m=detsize_s, roi=roi,
        close_distance_given_m=None if cfg.close_distance_mm is None else cfg.close_distance_mm / 1000.0,
        distance_m=distance_m, close_distance_m=abs(ratio * distance_m) / ratio, beam_x_m=beam_x, beam_y_m=beam_y,
    )


def resolve_crystal(cfg: SimulationConfig, c_parity: bool) -> CrystalSetup:
    """Cell and starting orientation (``-cell`` or ``-mat``), misset, size, shape and water."""
    if cfg.mat_file is not None:
        recip = np.asarray(read_mosflm_matrix(cfg.mat_file), dtype=np.float64) / cfg.wavelength_A
        try:
            cell_t, u0 = orientation_from_reciprocal(torch.as_tensor(recip))
        except ValueError as exc:
            raise InputError(f"{cfg.mat_file}: {exc}") from None
        cell = cell_t.numpy().copy()
        cell[3:] = np.degrees(cell[3:])
        orientation0 = u0.numpy()
        cell_quirk = False
    else:
        cell = np.array(cfg.cell, dtype=np.float64)
        orientation0 = np.eye(3)
        cell_quirk = c_parity
    if cfg.misset_random:
        seed = cfg.misset_seed if cfg.misset_seed is not None else cfg.seed
        if seed is None:
            raise InputError("-misset random: give -misset_seed (or -seed) so the orientation is reproducible")
        misset = tuple(float(v) for v in crng.random_misset_umat(seed).misset_deg)
    else:
        misset = tuple(cfg.misset_deg or (0.0, 0.0, 0.0))
    water_F2N = _water_F2N(cfg.water_um)
    return CrystalSetup(
        cell=cell, orientation0=orientation0, cell_quirk=cell_quirk, misset_deg=misset,
        n_cells=tuple(max(1.0, float(v)) for v in (cfg.N_a, cfg.N_b, cfg.N_c)), shape=cfg.shape, fudge=cfg.fudge,
        water_F2N=water_F2N,
    )


def _water_F2N(water_um: float) -> float:
    """F^2 N of the water background for a ``-water`` thickness (µm); one line when it overflows a float."""
    try:
        value = WATER_F**2 * (water_um * 1e-6) ** 3 * 1e6 * AVOGADRO / WATER_MW
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise InputError(f"-water: {water_um:g} µm is too thick: the water scattering overflows a float")
    return value


def _auto_oversample(cfg: SimulationConfig, detector: DetectorSetup, crystal: CrystalSetup) -> int:
    """The C's rule ``ceil(3 x crystal size / (lambda x close distance / pixel))``, capped (see MAX_AUTO_OVERSAMPLE)."""
    size_m = float((crystal.cell[:3] * 1e-10 * np.array(crystal.n_cells)).max())  # the longest crystal edge, N x cell
    distance_c_m = detector.close_distance_m
    recip_pixel = cfg.wavelength_A * 1e-10 * distance_c_m / detector.pixel_m
    with np.errstate(all="ignore"):
        ratio = float(np.float64(3.0) * size_m / recip_pixel)
    if not ratio <= MAX_AUTO_OVERSAMPLE:  # also NaN / inf
        value = math.ceil(ratio) if math.isfinite(ratio) else ratio
        raise InputError(
            f"-oversample: the automatic value {value:.6g} = ceil(3 x crystal size {size_m * 1e6:.4g} um / "
            f"(lambda {cfg.wavelength_A:g} A x close_distance {distance_c_m * 1000:.4g} mm / pixel {cfg.pixel_mm:g} mm)) "
            f"is above the limit of {MAX_AUTO_OVERSAMPLE}: check the units (-cell in A, -N in unit cells, "
            f"-distance and -pixel in mm) or give -oversample explicitly")
    return max(1, math.ceil(ratio))


#: mosaic domains of an even set (``-mosaic_model gaussian`` or ``ball``) when ``-mosaic_dom`` is not given and the
#: spread is positive: the count at which the refined cells of the real stills and sweep stop moving (docs/conventions.md,
#: "Mosaic domains")
EVEN_MOSAIC_DOMAINS = 10
#: spec mode's mosaic model: the even set of the C program's law (the spread keeps the C's meaning, the largest
#: angle); on the real thaumatin still it fits better than the Gaussian set at 20 and 40 domains and its cell settles
#: at fewer domains (docs/conventions.md, "Mosaic domains")
DEFAULT_MOSAIC_MODEL = "ball"
#: the largest even set built (its quantiles are found one pair at a time)
MAX_EVEN_MOSAIC_DOMAINS = 100_000
#: the largest ``-mosaic_turn`` index
MAX_MOSAIC_TURN = 1000


def mosaic_model_of(cfg: SimulationConfig, c_parity: bool) -> str:
    """The mosaic model a config asks for: ``-mosaic_model`` as given, else ``random`` (the C's draw) with
    ``-c_parity`` or ``-mosaic_seed``, else :data:`DEFAULT_MOSAIC_MODEL` (an even, deterministic set of the C's law,
    :mod:`nbtorch.physics.mosaic`)."""
    model = cfg.mosaic_model
    if model is None:
        model = "random" if (c_parity or cfg.mosaic_seed is not None) else DEFAULT_MOSAIC_MODEL
    elif model not in MOSAIC_MODELS:
        raise InputError(f"-mosaic_model: unknown model {model!r} (expected {', '.join(MOSAIC_MODELS)})")
    elif model in EVEN_MOSAIC_MODELS and cfg.mosaic_seed is not None:
        raise InputError(f"-mosaic_seed: the {model} mosaic set is even and deterministic and takes no seed "
                         "(a seed is for -mosaic_model random)")
    _check_turn(cfg, model)
    return model


def _check_turn(cfg: SimulationConfig, model: str) -> None:
    """``-mosaic_turn``: an index 0..MAX_MOSAIC_TURN, for an even set only."""
    turn = cfg.mosaic_turn
    if turn is None:
        return
    if not 0 <= turn <= MAX_MOSAIC_TURN:
        raise InputError(f"-mosaic_turn: expected a turn index 0 to {MAX_MOSAIC_TURN} (0: the set as built), got {turn}")
    if model not in EVEN_MOSAIC_MODELS and turn:
        raise InputError(f"-mosaic_turn: turns an even mosaic set ({', '.join(EVEN_MOSAIC_MODELS)}); the {model} "
                         "draw takes -mosaic_seed instead")


def _mosaic_domains(cfg: SimulationConfig, model: str, spread_deg: float | None) -> tuple[float, np.ndarray, np.ndarray]:
    """(spread simulated (deg), axes (M, 3), fractions (M,)) of the model's domains for the largest spread given."""
    if model == "random":
        drawn_deg, n_domains = crng.resolve_mosaic_domains(spread_deg, cfg.mosaic_domains)
        if drawn_deg <= 0:
            return drawn_deg, np.array([[0.0, 0.0, 1.0]]), np.zeros(1)
        seed = cfg.mosaic_seed if cfg.mosaic_seed is not None else crng.MOSAIC_SEED_DEFAULT
        axes, fractions = crng.mosaic_domain_draws(n_domains, seed)
        return drawn_deg, axes, fractions
    if spread_deg is None or spread_deg <= 0:
        return 0.0, np.array([[0.0, 0.0, 1.0]]), np.zeros(1)
    count = EVEN_MOSAIC_DOMAINS if cfg.mosaic_domains is None else cfg.mosaic_domains
    if not 1 <= count <= MAX_EVEN_MOSAIC_DOMAINS:
        raise InputError(f"{cfg.flag_for('mosaic_domains', '-mosaic_dom')}: the {model} mosaic set is built with 1 to "
                         f"{MAX_EVEN_MOSAIC_DOMAINS} domains (1: the unrotated crystal alone; 0, the C's 'automatic', is "
                         f"for -mosaic_model random), got {count}")
    axes_t, fractions_t = even_mosaic_domains(count, model)
    if cfg.mosaic_turn:
        axes_t = axes_t @ mosaic_set_turn(cfg.mosaic_turn).T
    return float(spread_deg), axes_t.numpy(), fractions_t.numpy()


def with_mosaic_domains(cfg: SimulationConfig, sampling: SamplingSetup, count: int, part: int = 0,
                        parts: int = 1) -> SamplingSetup:
    """``sampling`` with ``count`` mosaic domains of its own model (an even set of that count, or the random draw of
    that length from the same seed), or only the ``part``-th of ``parts`` equal slices of them (``count`` a multiple
    of ``parts``: the mean of the slices' images is the image of all ``count``); the spread, sources and phi steps
    unchanged.  ``cfg``: the config it came from."""
    if count < 1 or parts < 1 or count % parts or not 0 <= part < parts:
        raise InputError(f"mosaic domains: expected a count >= 1 in {parts} equal parts, got {count} (part {part})")
    abc = cfg.mosaic_spread_abc_deg
    _, axes, fractions = _mosaic_domains(cfg.replace(mosaic_domains=count), sampling.mosaic_model,
                                         cfg.mosaic_spread_deg if abc is None else max(abc))
    size = len(fractions) // parts
    cut = slice(part * size, (part + 1) * size) if len(fractions) == count else slice(None)
    axes, fractions = np.asarray(axes[cut], dtype=np.float64), np.asarray(fractions[cut], dtype=np.float64)
    steps = sampling.steps // len(sampling.mosaic_fractions) * len(fractions)
    return dataclasses.replace(sampling, mosaic_axes=axes, mosaic_fractions=fractions, steps=steps)


def resolve_sampling(cfg: SimulationConfig, c_parity: bool, detector: DetectorSetup,
                     crystal: CrystalSetup) -> SamplingSetup:
    """Phi steps, mosaic domains (an even set, or the C's generator), sources and the oversample."""
    phisteps, phistep = _resolve_phi(cfg)
    abc = cfg.mosaic_spread_abc_deg
    model = mosaic_model_of(cfg, c_parity)
    # the anisotropic model builds and counts its domains as an isotropic spread of its largest axis would
    drawn_deg, axes, fractions = _mosaic_domains(cfg, model, cfg.mosaic_spread_deg if abc is None else max(abc))
    # mosaic_spread: the isotropic value as given (with -mosaic_abc not used by the model)
    spread_deg = drawn_deg if abc is None else crng.resolve_mosaic_domains(cfg.mosaic_spread_deg, None)[0]
    sources = resolve_sources(cfg, detector.beam, detector.polar_axis, cfg.wavelength_A * 1e-10)
    incident, wl_factor = sources.incident, sources.wavelength_factor
    if len(incident) == 0:
        raise InputError("no beam sources left after the divergence cut")
    oversample = cfg.oversample if cfg.oversample is not None else _auto_oversample(cfg, detector, crystal)
    return SamplingSetup(
        phisteps=phisteps, phistep_deg=phistep,
        phi_quirk=(cfg.phi_carryover == "c-parity") if cfg.phi_carryover else c_parity,
        mosaic_spread_deg=spread_deg, mosaic_axes=np.asarray(axes, dtype=np.float64),
        mosaic_fractions=np.asarray(fractions, dtype=np.float64), mosaic_anisotropic=abc is not None,
        mosaic_model=model,
        incident=incident, wavelength_factor=wl_factor,
        oversample=oversample, steps=len(incident) * phisteps * len(fractions) * oversample * oversample,
        wavelength_offset=sources.wavelength_offset, source_angles_rad=sources.angles_rad,
        source_widths=dict(sources.widths),
    )


def resolve_sensor(cfg: SimulationConfig, c_parity: bool, sampling: SamplingSetup) -> SensorSetup:
    """Sensor layers and attenuation; refuses more samples per pixel than MAX_SAMPLES_PER_PIXEL."""
    thick = cfg.detector_thick_um * 1e-6
    mu = -1.0
    if cfg.detector_abs_um is not None:
        if math.isinf(cfg.detector_abs_um) or cfg.detector_abs_um == 0:
            thick, mu = 0.0, 0.0
        else:
            check_positive("-detector_abs", cfg.detector_abs_um)
            mu = 1.0 / (cfg.detector_abs_um * 1e-6)
    n_layers = cfg.detector_thicksteps if cfg.detector_thicksteps not in (None, 0) else None
    if thick > 0:
        if mu < 0:
            mu = 1.0 / thick
        if c_parity:
            if n_layers is None:
                n_layers, dz = 2, thick / 2.0
            else:
                n_layers = max(n_layers, 2)
                dz = thick / (n_layers - 1)
        else:
            n_layers = n_layers or 2
            dz = thick / n_layers
    else:
        n_layers, dz, mu = 1, 0.0, max(mu, 0.0)
    oversample, sources = sampling.oversample, len(sampling.incident)
    samples = n_layers * oversample * oversample * sources
    if samples > MAX_SAMPLES_PER_PIXEL:
        what = f"{cfg.flag_for('oversample', '-oversample')} {oversample}" if cfg.oversample is not None else "sampling"
        raise InputError(
            f"{what}: {oversample}^2 sub-pixels x {n_layers} sensor layers x {sources} sources = {samples:.6g} "
            f"samples per pixel, above the limit of {MAX_SAMPLES_PER_PIXEL} (a 16-pixel tile would need about "
            f"{16 * samples * 175 / 1e9:.3g} GB of memory): lower -oversample, -thicksteps or the number of "
            f"sources (-divsteps, -dispsteps, -sourcefile)")
    return SensorSetup(thicksteps=n_layers, layer_thickness_m=dz, mu_per_m=mu, has_thickness=thick > 0)


def corner_dmin_A(wavelength_A: float, distance_m: float, beam_x_m: float, beam_y_m: float, width_f_m: float,
                  width_s_m: float, tilt_deg: float = 0.0) -> float:
    """The finest resolution (Å) the detector can see, with a margin: the scattering angle of the farthest
    corner from the beam centre (either axis assignment of the beam centre), plus ``tilt_deg`` (2theta and
    detector rotations, added to be safe), times 0.95.  Used as the resolution limit of structure factors
    computed from a model file (``-hkl model.pdb``) when ``-hkl_dmin`` does not give one."""
    reach = max(math.hypot(max(abs(beam_x_m), abs(width_f_m - beam_x_m)), max(abs(beam_y_m), abs(width_s_m - beam_y_m))),
                math.hypot(max(abs(beam_x_m), abs(width_s_m - beam_x_m)), max(abs(beam_y_m), abs(width_f_m - beam_y_m))))
    two_theta = min(math.pi, math.atan2(reach, max(distance_m, 1e-12)) + math.radians(tilt_deg))
    return 0.95 * wavelength_A / (2.0 * math.sin(0.5 * two_theta)) if two_theta > 0 else float("inf")


def _reference_table(cfg: SimulationConfig, detector: DetectorSetup, notes: list[str]):
    """The ``-hkl`` table: nanoBragg text, or an MTZ / mmCIF / model file through gemmi
    (:mod:`nbtorch.io.reflections`), a model's F computed to the detector corner's resolution."""
    if not is_reflection_file(cfg.hkl_file):
        return read_hkl(cfg.hkl_file)
    dmin = cfg.hkl_dmin_A
    if dmin is None:
        width_f = detector.pixel_m * detector.fpixels
        dmin = corner_dmin_A(cfg.wavelength_A, abs(detector.close_distance_m), detector.beam_x_m, detector.beam_y_m,
                             width_f, detector.detsize_s_m,
                             abs(cfg.twotheta_deg) + abs(cfg.detector_rotx_deg) + abs(cfg.detector_roty_deg))
    reference = read_reflection_file(cfg.hkl_file, column=cfg.hkl_column, dmin_A=dmin)
    notes.append(reference.note())
    return reference.table


def resolve_structure_factors(cfg: SimulationConfig, n_cells, detector: DetectorSetup) -> StructureFactorSetup:
    """The F table from ``-hkl`` (missing entries = ``default_F``) or a ``-dump`` cache; interpolation."""
    F_grid = hkl_min = hkl_max = F_present = None
    notes: list[str] = []
    if cfg.hkl_column is not None and not (cfg.hkl_file is not None and is_reflection_file(cfg.hkl_file)):
        raise InputError(f"-hkl_column {cfg.hkl_column}: only with an MTZ or mmCIF -hkl file")
    if cfg.hkl_file is not None:
        table = _reference_table(cfg, detector, notes)
        F_grid, mins = table.to_grid(np.nan)
        try:
            F_present = ~np.isnan(F_grid)  # reflections listed in the file
            np.copyto(F_grid, cfg.default_F, where=~F_present)
        except MemoryError:
            raise InputError(f"{cfg.hkl_file}: not enough memory: {table.grid_description()}") from None
    elif cfg.dump_file is not None:  # -dump without -hkl: read the cache (never a stray Fdump.bin)
        try:
            F_grid, mins = read_fdump(cfg.dump_file)
        except InputError as exc:
            raise InputError(f"-dump {exc}") from None
        except MemoryError:
            raise InputError(f"-dump {cfg.dump_file}: not enough memory for its structure-factor grid") from None
        notes.append(f"structure factors read from {cfg.dump_file}")
    elif cfg.default_F == 0.0:
        notes.append("no -hkl file and -default_F 0: every structure factor is zero")
    if F_grid is not None:
        hkl_min = np.array(mins, dtype=np.float64)
        hkl_max = hkl_min + np.array(F_grid.shape) - 1
    interpolate = cfg.interpolate if cfg.interpolate is not None else min(n_cells) <= 2
    return StructureFactorSetup(F_grid=F_grid, F_present=F_present, hkl_min=hkl_min, hkl_max=hkl_max,
                                interpolate=bool(interpolate) and F_grid is not None, dmin_A=cfg.dmin_A,
                                notes=tuple(notes))


def _fluence(cfg: SimulationConfig) -> float:
    """``-fluence``, or ``-flux x -exposure / -beamsize^2`` when all three are given, or the default."""
    fluence = cfg.fluence if cfg.fluence is not None else DEFAULT_FLUENCE
    beamsize = cfg.beamsize_mm / 1000.0
    if cfg.flux != 0.0 and cfg.exposure_s > 0.0 and beamsize > 0:  # (all positive: validate)
        fluence = cfg.flux * cfg.exposure_s / beamsize / beamsize
    return fluence


def _canonical_params(cfg: SimulationConfig, detector: DetectorSetup, crystal: CrystalSetup,
                      sampling: SamplingSetup) -> dict[str, float]:
    """``Setup.params``: every canonical parameter (table order, units of :mod:`nbtorch.parameters`)."""
    cell, misset, n_cells = crystal.cell, crystal.misset_deg, crystal.n_cells
    values = {
        "cell_a": cell[0], "cell_b": cell[1], "cell_c": cell[2],
        "cell_alpha": cell[3], "cell_beta": cell[4], "cell_gamma": cell[5],
        "misset_x": misset[0], "misset_y": misset[1], "misset_z": misset[2],
        "phi0": cfg.phi_deg, "mosaic_spread": sampling.mosaic_spread_deg,
        **dict(zip(("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c"),
                   cfg.mosaic_spread_abc_deg or (sampling.mosaic_spread_deg,) * 3)),
        "N_a": n_cells[0], "N_b": n_cells[1], "N_c": n_cells[2], "N_d": cfg.N_d, "N_e": cfg.N_e, "N_f": cfg.N_f,
        "distance": detector.distance_m * 1000.0, "beam_x": detector.beam_x_m * 1000.0,
        "beam_y": detector.beam_y_m * 1000.0,
        "detector_rotx": cfg.detector_rotx_deg, "detector_roty": cfg.detector_roty_deg,
        "detector_rotz": cfg.detector_rotz_deg, "twotheta": cfg.twotheta_deg,
        "wavelength": cfg.wavelength_A, "fluence": _fluence(cfg),
        "polarization": cfg.polarization, **sampling.source_widths, "default_F": cfg.default_F,
    }
    params = {k: float(values[k]) for k in PARAMETER_NAMES}
    for k, v in params.items():
        if not math.isfinite(v):
            raise InputError(f"parameter {k} is not finite ({v})")
    return params


def resolve(cfg: SimulationConfig) -> Setup:
    """Apply nanoBragg's rules to a config.  Raises InputError for impossible input."""
    validate(cfg)
    c_parity = bool(cfg.c_parity)
    detector = resolve_detector(cfg)
    pixel_mask = (read_mask(cfg.mask_file, detector.fpixels, detector.spixels)
                  if cfg.mask_file is not None else None)
    crystal = resolve_crystal(cfg, c_parity)
    sampling = resolve_sampling(cfg, c_parity, detector, crystal)
    sensor = resolve_sensor(cfg, c_parity, sampling)
    structure_factors = resolve_structure_factors(cfg, crystal.n_cells, detector)
    return Setup(
        config=cfg, c_parity=c_parity, params=_canonical_params(cfg, detector, crystal, sampling),
        detector=detector, crystal=crystal, sampling=sampling, sensor=sensor,
        structure_factors=structure_factors, notes=structure_factors.notes, pixel_mask=pixel_mask,
    )
