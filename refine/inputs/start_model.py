"""The starting model of a refinement: nanoBragg flags, completed from the measured image's header.

:func:`model_config` turns ``--model "<nanoBragg flags>"`` and a
:class:`~refine.inputs.images.MeasuredImage` into a :class:`nbtorch.SimulationConfig`.

Precedence (highest first):

1. flags in the model string (``-lambda``, ``-distance``, ``-Xbeam`` ...);
2. the image header (:attr:`MeasuredImage.geometry`): wavelength, distance, pixel size,
   beam centre, and the image shape for the detector size;
3. nanoBragg's defaults.

A quantity counts as given by the model when any of its flags is present:

============  ================================================================================
quantity      model flags that set it (then the header value is not used)
============  ================================================================================
wavelength    ``-lambda -wavelength -energy -img``
distance      ``-distance -close_distance -img``
pixel size    ``-pixel -img``
beam centre   ``-Xbeam -Ybeam -Xclose -Yclose -ORGX -ORGY -pix0_vector -pix0_vector_mm -img``
detector      ``-detpixels -detpixels_f/_s/_x/_y -detsize -detsize_f -detsize_s -img``
============  ================================================================================

The header's beam centre (direct-beam spot ``Fbeam, Sbeam`` along fast and slow
from the corner of pixel (0, 0)) is written in the model's convention by
:mod:`nbtorch.geometry.beam_centre` (``docs/conventions.md``): MOSFLM ``-Xbeam Sbeam-p/2
-Ybeam Fbeam-p/2``, DENZO ``-Xbeam Sbeam -Ybeam Fbeam``, ADXV ``-Xbeam Fbeam
-Ybeam detsize_s-Sbeam``, XDS/DIALS ``-ORGX Fbeam/p+1/2 -ORGY Sbeam/p+1/2`` (a
detector normal to the beam), CUSTOM ``-Xbeam Fbeam -Ybeam Sbeam``.

:func:`tie_start_cell` makes the starting cell obey the crystal system of ``--symmetry``
(:func:`refine.fitting.space_groups.crystal_system`).  The starting scale and background of a measured image:
:mod:`refine.inputs.scale_start`.

``@FILE`` tokens in the model string are replaced by the flags in FILE (an args
file such as ``nanobragg_geometry_args_*.txt``); a relative input path inside it
(``-mat -hkl -dump -sourcefile -img -mask``) that does not exist from the working
directory is looked up beside FILE.
"""

from __future__ import annotations

import math
import shlex
from typing import Sequence

import numpy as np

from nbtorch.cli.args import INPUT_FILE_FLAGS, config_from_args
from nbtorch.geometry.beam_centre import beam_centre_flags, beam_centre_from_offsets_m, swung_beam_spot_m
from nbtorch.cli.support import expand_argument_files
from nbtorch.config import SimulationConfig
from nbtorch.geometry.detector_axes import FORCED_PIVOT, detector_axes
from nbtorch.errors import InputError
from nbtorch.rules.resolve import EVEN_MOSAIC_MODELS, mosaic_model_of
from refine.fitting.parameters import CELL, constrained_cell
from refine.inputs.images import MeasuredImage, sensor_material
from refine.inputs.sensor import DEFAULT_THICKSTEPS, HC_KEV_A, silicon_attenuation_length_um

__all__ = ["expand_model_args", "header_flags", "model_config", "PHI_STEP_DEG", "tie_start_cell", "INPUT_FILE_FLAGS",
           "ANISOTROPIC_MOSAIC_NAMES", "with_anisotropic_mosaic"]

_GIVEN = {
    "wavelength": ("-lambda", "-wavelength", "-energy", "-img"),
    "distance": ("-distance", "-close_distance", "-img"),
    "pixel": ("-pixel", "-img"),
    "beam": ("-Xbeam", "-Ybeam", "-Xclose", "-Yclose", "-ORGX", "-ORGY", "-pix0_vector", "-pix0_vector_mm", "-img"),
    "detector": ("-detpixels", "-detpixels_f", "-detpixels_s", "-detpixels_x", "-detpixels_y", "-detsize",
                 "-detsize_f", "-detsize_s", "-img"),
    "twotheta": ("-twotheta", "-twotheta_axis", "-fdet_vector", "-sdet_vector", "-odet_vector", "-pix0_vector",
                 "-pix0_vector_mm", "-img"),
    "rotation": ("-phi", "-osc", "-phistep", "-phisteps", "-img"),
    "polarization": ("-polar", "-nopolar"),
    "sensor": ("-detector_thick", "-detector_abs", "-detector_thicksteps", "-thicksteps"),
}

#: the rotation of a rotation image is sampled at least this finely (-phisteps = ceil(osc / PHI_STEP_DEG))
PHI_STEP_DEG = 0.02
#: mosaic domains of an even set (nbtorch.physics.mosaic) in the starting model of a measured image when the model
#: flags give a spread but no count (a simulation's own default stays the C's 10; docs/still-from-images.md, "Mosaic
#: domains"): a still's (on both real thaumatin stills the refined cell at 80 domains is within 0.22 esd of 640's,
#: at 40 0.55-0.75 esd from it; 160 and 320 cost 2 and 4 times 80 and wobble as much, 0.1-0.4 esd) ...
STILL_MOSAIC_DOMAINS = 80
#: ... and a rotation image's (its phi steps sweep every domain through the reflection: on the real L-cysteine sweep
#: 40 and 80 domains give the same cell within 0.13 esd)
ROTATION_MOSAIC_DOMAINS = 40


def measured_mosaic_domains(osc_deg: float | None) -> int:
    """The even set's default count for a measured image of oscillation ``osc_deg`` (None or 0: a still)."""
    return ROTATION_MOSAIC_DOMAINS if osc_deg else STILL_MOSAIC_DOMAINS


# header names of the geometry keys, per format (for the notes)
_LABELS = {
    "cbf": {"twotheta_deg": "Detector_2theta", "phi_deg": "Start_angle", "osc_deg": "Angle_increment",
            "polarization_fraction": "Polarization", "sensor_thickness_mm": "sensor thickness"},
    "smv": {"twotheta_deg": "TWOTHETA", "phi_deg": "OSC_START", "osc_deg": "OSC_RANGE"},
    "hdf5": {"sensor_thickness_mm": "sensor_thickness"},
}
# Pilatus header lines refine.inputs.images turns into geometry (the others are said not to be used)
_PILATUS_USED = {"Wavelength", "Detector_distance", "Beam_xy", "Pixel_size", "Count_cutoff", "Detector_2theta",
                 "Start_angle", "Angle_increment", "Polarization", "Detector"}
# Pilatus header lines that could move or rotate the model if they were not what the model assumes: one line each
_PILATUS_GEOMETRY = {
    "Oscillation_axis": "the model rotates about its spindle axis {spindle} (-spindle_axis)",
    "Detector_Voffset": "the beam centre is Beam_xy; a detector offset belongs in --model",
    "Alpha": "goniometer setting: the crystal orientation is the model's (-mat, -misset)",
    "Kappa": "goniometer setting: the crystal orientation is the model's (-mat, -misset)",
    "Chi": "goniometer setting: the crystal orientation is the model's (-mat, -misset)",
    "Phi": "goniometer setting: the crystal orientation is the model's (-mat, -misset); the scan is Start_angle",
    "Omega": "goniometer setting: the crystal orientation is the model's (-mat, -misset); the scan is Start_angle",
    "Phi_increment": "the scan is Angle_increment",
    "Omega_increment": "the scan is Angle_increment",
    "Chi_increment": "the scan is Angle_increment",
    "Kappa_increment": "the scan is Angle_increment",
    "N_oscillations": "one oscillation of Angle_increment is modelled",
    "Start_position": "translation scans are not modelled",
    "Position_increment": "translation scans are not modelled",
}


def _split(model: str | Sequence[str]) -> list[str]:
    if isinstance(model, str):
        try:
            return shlex.split(model, comments=False)
        except ValueError as exc:
            raise InputError(f"--model: cannot split the flags: {exc}") from None
    return [str(t) for t in model]


def expand_model_args(model: str | Sequence[str]) -> list[str]:
    """Tokens of ``model`` with every ``@FILE`` replaced by FILE's flags (paths resolved beside FILE)."""
    return expand_argument_files(_split(model), "--model", path_flags=INPUT_FILE_FLAGS)


def _has(tokens: Sequence[str], quantity: str) -> bool:
    return any(t in _GIVEN[quantity] for t in tokens)


def _fmt(v: float) -> str:
    return repr(float(v))


def _given_by(tokens: Sequence[str], quantity: str) -> str:
    return " ".join(dict.fromkeys(t for t in tokens if t in _GIVEN[quantity]))


# geometry keys -> the reader's header keys, under which a reader gives the file's own names (header["labels"])
_HEADER_KEYS = {"twotheta_deg": "detector_2theta_deg", "phi_deg": "start_angle_deg", "osc_deg": "angle_increment_deg",
                "saturation": "count_cutoff", "polarization_fraction": "polarization",
                "sensor_thickness_mm": "sensor_thickness_mm", "pixel_mm": "pixel_size_mm"}
# why a header value a reader lists as unused (nbtorch.io.fabio_formats, nbtorch.io.nexus) is not used
_UNUSED_WHY = {
    "goniometer": "goniometer setting: the crystal orientation is the model's (-mat, -misset)",
    "rotation axis": "the model rotates about its spindle axis {spindle} (-spindle_axis)",
    "detector rotation": "a detector rotation belongs in --model (-detector_rotx, -detector_roty, -detector_rotz)",
    "detector offset": "a detector offset belongs in --model",
}


def _label(image: MeasuredImage, key: str, default: str) -> str:
    named = (image.header.get("labels") or {}).get(_HEADER_KEYS.get(key, key))
    if named:
        return str(named)
    fmt = "cbf" if image.header.get("pilatus") is not None else image.format  # a Pilatus TIFF: the CBF's lines
    return _LABELS.get(fmt, {}).get(key, default)


def _named(image: MeasuredImage, *keys: str) -> str:
    """`` (NAME, ...)``: the header's names of the geometry ``keys`` when the reader gives them, else ``""``."""
    labels = image.header.get("labels") or {}
    names = [labels.get(_HEADER_KEYS.get(key, key)) for key in keys]
    return f" ({', '.join(str(n) for n in names)})" if all(names) else ""


def _not_used(name: str, value: str, why: str) -> str:
    return f"{name} {value} from the header: not used ({why})"


def _vec(v) -> str:
    return "(" + ", ".join(f"{float(x):g}" for x in v) + ")"


def header_flags(tokens: Sequence[str], image: MeasuredImage, parallax: bool = True,
                 source: str = "--model") -> tuple[list[str], list[str]]:
    """Flags to add to ``tokens`` from ``image``'s header and shape, and one note per header value: how it is
    used, or that it is not used and why (the flags in ``tokens`` always win).

    Arguments:
        parallax: model the sensor's thickness and absorption (``-detector_thick/-detector_abs``) when the
            header gives a thickness (``--no-parallax``: False).
        source: where ``tokens`` came from, as the notes name it: "--model", or "--expt" when a DIALS experiment
            made them (a header value they replace is "not used (--expt gives ...)").
    """
    geo = image.geometry
    extra: list[str] = []
    notes: list[str] = []
    slow, fast = image.shape
    if not _has(tokens, "detector"):
        extra += ["-detpixels_f", str(fast), "-detpixels_s", str(slow)]
        notes.append(f"detector {fast} x {slow} pixels from the image")
    if not _has(tokens, "pixel") and "pixel_mm" in geo:
        extra += ["-pixel", _fmt(geo["pixel_mm"])]
        notes.append(f"pixel {geo['pixel_mm']:g} mm from the header{_named(image, 'pixel_mm')}")
    if not _has(tokens, "wavelength") and "wavelength_A" in geo:
        extra += ["-lambda", _fmt(geo["wavelength_A"])]
        notes.append(f"wavelength {geo['wavelength_A']:g} A from the header{_named(image, 'wavelength_A')}")
    cfg = config_from_args(list(tokens) + extra)  # convention, axes, pixel size and wavelength of the model
    beam_v, _, _, _, tt_axis, polar_v, spindle_v = detector_axes(cfg)

    geometry_extra, geometry_notes = _detector_flags(tokens, image, cfg, tt_axis, source)
    extra += geometry_extra
    notes += geometry_notes
    for more_extra, more_notes in (_rotation_flags(tokens, image, spindle_v, source),
                                   _polarization_flags(tokens, image, cfg, polar_v, beam_v, source),
                                   _sensor_flags(tokens, image, cfg.wavelength_A, parallax, source)):
        extra += more_extra
        notes += more_notes
    notes += _pilatus_notes(image, spindle_v) + _unused_notes(image, spindle_v)
    return extra, notes


def _detector_flags(tokens: Sequence[str], image: MeasuredImage, cfg: SimulationConfig, tt_axis,
                    source: str) -> tuple[list[str], list[str]]:
    """Distance, beam centre and two-theta from the header (flags and notes), for the model ``cfg`` so far."""
    geo = image.geometry
    extra: list[str] = []
    notes: list[str] = []
    conv, pixel_m = cfg.convention, cfg.pixel_mm / 1000.0
    slow = image.shape[0]
    # detector two-theta: the detector swings about the sample from its place normal to the beam, where the
    # header's beam centre is its near point and the header's distance its distance (as DIALS reads Pilatus)
    tt = geo.get("twotheta_deg")
    tt_name = _label(image, "twotheta_deg", "two-theta")
    swing = None
    if tt is not None:
        if _has(tokens, "twotheta"):
            notes.append(_not_used(tt_name, f"{tt:g} deg", f"{source} gives the detector's orientation: "
                                                            f"{_given_by(tokens, 'twotheta')}"))
        elif tt == 0:
            notes.append(f"{tt_name} 0 deg from the header: the detector is normal to the beam")
        else:
            swing = float(tt)
    distance_mm = geo.get("distance_mm") if not _has(tokens, "distance") else None
    have_beam = not _has(tokens, "beam") and "beam_x_px" in geo and "beam_y_px" in geo
    fast_m = geo["beam_x_px"] * pixel_m if have_beam else None
    slow_m = geo["beam_y_px"] * pixel_m if have_beam else None
    swing_note = ""
    if swing is not None:
        beam_pivot = FORCED_PIVOT.get(conv, "sample") == "beam"
        if beam_pivot and have_beam and distance_mm is not None:
            fast_m, slow_m, along_m = swung_beam_spot_m(cfg, swing, fast_m, slow_m, distance_mm / 1000.0)
            distance_mm = along_m * 1000.0
            swing_note = (f"; the {conv} convention pivots about the beam spot, so the header's near point and "
                          f"distance become the spot ({fast_m / pixel_m:.6g}, {slow_m / pixel_m:.6g}) px and "
                          f"{distance_mm:.6g} mm along the beam on the swung detector")
        elif beam_pivot:
            swing_note = (f"; the {conv} convention pivots about the beam spot: the model's beam centre and distance "
                          "are those on the swung detector")
        else:
            swing_note = "; SAMPLE pivot: the header's beam centre stays the near point"
    if distance_mm is not None:
        extra += ["-distance", _fmt(distance_mm)]
        notes.append(f"distance {geo['distance_mm']:g} mm from the header{_named(image, 'distance_mm')}"
                     + (f" (as -distance {distance_mm:.6g}, along the beam to the swung detector)"
                        if distance_mm != geo["distance_mm"] else ""))
    if have_beam:
        # the header's spot, taken as both the beam and the close point (a detector normal to the beam)
        beam_x_m, beam_y_m = beam_centre_from_offsets_m(conv, fast_m, slow_m, pixel_m, (cfg.spixels or slow) * pixel_m)
        flags = beam_centre_flags(conv, beam_x_m * 1000.0, beam_y_m * 1000.0, cfg.pixel_mm)
        extra += flags
        notes.append(f"beam centre ({geo['beam_x_px']:g}, {geo['beam_y_px']:g}) px (fast, slow) from the header"
                     f"{_named(image, 'beam_x_px', 'beam_y_px')} as {' '.join(flags)} ({conv} convention)")
    if swing is not None:
        extra += ["-twotheta", _fmt(swing)]  # after the beam flags: the last pivot flag wins (CUSTOM)
        notes.append(f"{tt_name} {swing:g} deg from the header as -twotheta {swing:g} (about the {conv} two-theta "
                     f"axis {_vec(tt_axis)}, right-handed; -twotheta/-twotheta_axis in --model override){swing_note}")
    return extra, notes


def _rotation_flags(tokens: Sequence[str], image: MeasuredImage, spindle_v, source: str) -> tuple[list[str], list[str]]:
    """The rotation of the image (start angle and width; a still has width 0) as -phi/-osc/-phisteps."""
    geo = image.geometry
    extra: list[str] = []
    notes: list[str] = []
    phi, osc = geo.get("phi_deg"), geo.get("osc_deg")
    if phi is not None or osc is not None:
        names = " ".join(x for x in (f"{_label(image, 'phi_deg', 'phi')} {phi:g} deg" if phi is not None else "",
                                     f"{_label(image, 'osc_deg', 'oscillation')} {osc:g} deg" if osc is not None
                                     else "") if x)
        names = names.replace(" deg ", " deg, ")
        if _has(tokens, "rotation"):
            notes.append(_not_used(names, "", f"{source} gives the rotation: {_given_by(tokens, 'rotation')}")
                         .replace("  from", " from"))
        elif not osc:
            notes.append(_not_used(names, "", "a still: no rotation during the exposure; the model's orientation "
                                              "(-mat, -misset) is the crystal's on this image, -phi would rotate it")
                         .replace("  from", " from"))
        else:
            start, width = (float(phi or 0.0) + min(float(osc), 0.0)), abs(float(osc))
            steps = max(1, math.ceil(width / PHI_STEP_DEG - 1e-9))
            extra += ["-phi", _fmt(start), "-osc", _fmt(width), "-phisteps", str(steps)]
            notes.append(f"rotation {names} from the header as -phi {start:g} -osc {width:g} -phisteps {steps} "
                         f"(a step per {PHI_STEP_DEG:g} deg at most) about the spindle {_vec(spindle_v)}")
    return extra, notes


def _polarization_flags(tokens: Sequence[str], image: MeasuredImage, cfg: SimulationConfig, polar_v,
                        beam_v, source: str) -> tuple[list[str], list[str]]:
    """The header's polarisation fraction as nanoBragg's Kahn factor (a NeXus Stokes vector: :func:`_stokes_flags`)."""
    geo = image.geometry
    extra: list[str] = []
    notes: list[str] = []
    if image.header.get("polarization_stokes") is not None and "polarization_fraction" in geo:
        return _stokes_flags(tokens, image, cfg, polar_v, beam_v, source)
    # polarization: Pilatus gives the fraction p of the beam polarised along the E-vector; nanoBragg's -polar is
    # Kahn's factor K = 2p - 1 (0: unpolarised, 1: fully polarised along -polar_vector)
    p = geo.get("polarization_fraction")
    if p is not None:
        name = _label(image, "polarization_fraction", "polarization")
        if _has(tokens, "polarization"):
            notes.append(_not_used(name, f"{p:g}", f"{source} gives {_given_by(tokens, 'polarization')}"))
        elif not 0.0 <= p <= 1.0:
            notes.append(_not_used(name, f"{p:g}", "a polarisation fraction lies in 0..1"))
        else:
            kahn = 2.0 * p - 1.0
            extra += ["-polar", _fmt(round(kahn, 12))]
            notes.append(f"{name} {p:g} from the header as -polar {kahn:g} (Kahn factor 2p - 1: fraction {p:g} of "
                         f"the beam polarised along the model's E-vector {_vec(polar_v)})")
    return extra, notes


def _rotated(v, axis, angle_deg: float) -> np.ndarray:
    """``v`` turned by ``angle_deg`` about the unit ``axis`` (right-handed)."""
    v, k, a = np.asarray(v, dtype=np.float64), np.asarray(axis, dtype=np.float64), math.radians(angle_deg)
    return v * math.cos(a) + np.cross(k, v) * math.sin(a) + k * float(k @ v) * (1.0 - math.cos(a))


def _stokes_flags(tokens: Sequence[str], image: MeasuredImage, cfg: SimulationConfig, polar_v,
                  beam_v, source: str) -> tuple[list[str], list[str]]:
    """NXmx ``incident_polarization_stokes`` (S0..S3, NeXus frame: x horizontal, y up) as -polar and, for a
    CUSTOM model, -polar_vector.  The model's E-vector (the convention's ``-polar_vector``, along its horizontal
    spindle) stands for NeXus x.  Linear polarisation P = sqrt(S1² + S2²)/S0 with its E-vector at psi from x is
    Kahn's factor P along the E-vector turned by psi about the beam; where the E-vector cannot be turned (a fixed
    convention, or -polar_vector in --model) -polar is S1/S0, the part along and across it, and S2 is said not used.
    """
    s0, s1, s2, s3 = image.header["polarization_stokes"]
    name = _label(image, "polarization_fraction", "incident_polarization_stokes")
    value = _vec((s0, s1, s2, s3))
    if _has(tokens, "polarization"):
        return [], [_not_used(name, value, f"{source} gives {_given_by(tokens, 'polarization')}")]
    degree, psi = math.hypot(s1, s2) / s0, float(image.geometry.get("polarization_angle_deg", 0.0))
    circular = f"; S3/S0 {s3 / s0:g}, the circular part, scatters as unpolarised light" if s3 else ""
    if abs(s2) <= 1e-9 * s0:  # along the model's E-vector (S1 >= 0) or across it (S1 < 0): nothing to turn
        kahn = s1 / s0
        where = "along" if s1 >= 0 else "across (at 90 deg to)"
        return ["-polar", _fmt(round(kahn, 12))], [
            f"{name} {value} from the header as -polar {kahn:g} (Kahn factor S1/S0: linear polarisation {degree:g} "
            f"{where} the model's E-vector {_vec(polar_v)}, NeXus x{circular})"]
    if cfg.convention == "custom" and "-polar_vector" not in tokens:
        e_vec = _rotated(polar_v, beam_v, psi)
        flags = ["-polar", _fmt(round(degree, 12)), "-polar_vector", *(_fmt(round(float(x), 12)) for x in e_vec)]
        return flags, [f"{name} {value} from the header as -polar {degree:g} -polar_vector {' '.join(flags[3:])} "
                       f"(Kahn factor sqrt(S1^2 + S2^2)/S0 along the E-vector at {psi:g} deg from the model's "
                       f"{_vec(polar_v)}, NeXus x, about the beam {_vec(beam_v)}, right-handed{circular})"]
    kahn = s1 / s0
    why = (f"{source} gives -polar_vector" if "-polar_vector" in tokens else
           f"the {cfg.convention} convention fixes the E-vector; -polar_vector would make the model CUSTOM: give the "
           "CUSTOM geometry in --model to turn it")
    return ["-polar", _fmt(round(kahn, 12))], [
        f"{name} {value} from the header as -polar {kahn:g} (Kahn factor S1/S0: the part of the linear polarisation "
        f"{degree:g} at {psi:g} deg along and across the model's E-vector {_vec(polar_v)}, NeXus x{circular})",
        _not_used(f"{name} S2/S0", f"{s2 / s0:g}", f"the polarisation at 45 deg to the model's E-vector: {why}")]


def _sensor_flags(tokens: Sequence[str], image: MeasuredImage, wavelength: float, parallax: bool,
                  source: str) -> tuple[list[str], list[str]]:
    """The sensor's thickness and absorption (parallax), unless ``parallax`` is False."""
    geo = image.geometry
    extra: list[str] = []
    notes: list[str] = []
    thick = geo.get("sensor_thickness_mm")
    if thick is not None:
        material = sensor_material(image)
        name = f"{material + ' ' if material else ''}{_label(image, 'sensor_thickness_mm', 'sensor thickness')}"
        value = f"{thick * 1000.0:g} um"
        if not parallax:
            notes.append(_not_used(name, value, "--no-parallax"))
        elif _has(tokens, "sensor"):
            notes.append(_not_used(name, value, f"{source} gives the sensor: {_given_by(tokens, 'sensor')}"))
        elif not thick > 0:
            notes.append(_not_used(name, value, "not a positive thickness"))
        elif material is not None and material.strip().lower() not in ("silicon", "si"):
            notes.append(_not_used(name, value, f"attenuation lengths are tabulated for silicon only, not "
                                                f"{material}; give -detector_thick and -detector_abs in --model"))
        else:
            try:
                abs_um = silicon_attenuation_length_um(wavelength)
            except InputError as exc:
                notes.append(_not_used(name, value, str(exc)))
            else:
                thick_um = thick * 1000.0
                extra += ["-detector_thick", _fmt(round(thick_um, 9)), "-detector_abs", _fmt(round(abs_um, 6)),
                          "-detector_thicksteps", str(DEFAULT_THICKSTEPS)]
                notes.append(f"sensor parallax: {material or 'silicon (assumed)'} {thick_um:g} um thick from the "
                             f"header, attenuation length {abs_um:.4g} um at {HC_KEV_A / wavelength:.4g} keV "
                             f"(NIST mu/rho, refine.inputs.sensor), as -detector_thick {thick_um:g} -detector_abs "
                             f"{abs_um:.6g} -detector_thicksteps {DEFAULT_THICKSTEPS} (--no-parallax: off)")
    return extra, notes


def _pilatus_notes(image: MeasuredImage, spindle) -> list[str]:
    """One line for each Pilatus header line that places or turns something the model does not take from
    it, and one line for the rest (exposure and detector settings: the fitted scale and background absorb them)."""
    if image.header.get("pilatus") is None:  # a mini-CBF or a Pilatus TIFF
        return []
    raw = image.header.get("pilatus") or {}
    notes: list[str] = []
    rest: list[str] = []
    saturation = image.header.get("count_cutoff")
    if saturation is not None:
        used = image.geometry.get("saturation")
        notes.append(f"Count_cutoff {saturation} counts from the header: "
                     + ("pixels at or above it are masked" if used == saturation
                        else f"not used (--saturation {used:g} masks instead)"))
    for key, text in raw.items():
        if key in _PILATUS_USED or key.startswith("#") or "thickness" in str(text):
            continue
        short = " ".join(str(text).split())
        short = short if len(short) <= 40 else short[:37] + "..."
        if key in _PILATUS_GEOMETRY:
            notes.append(_not_used(key, short, _PILATUS_GEOMETRY[key].format(spindle=_vec(spindle))))
        else:
            rest.append(f"{key} {short}".strip())
    if "detector" in image.header:
        rest.insert(0, f"Detector {image.header['detector']}")
    if rest:
        notes.append(_not_used("; ".join(rest), "", "exposure, counting and detector settings: they do not move "
                                                     "spots, and the fitted scale and background absorb their "
                                                     "effect on counts").replace("  from", " from"))
    return notes


def _unused_notes(image: MeasuredImage, spindle) -> list[str]:
    """The saturation and the values a fabio or NeXus reader lists as unused (``header["unused"]``): one line
    each, and one for the exposure, counting and provenance values."""
    notes: list[str] = []
    label = (image.header.get("labels") or {}).get("count_cutoff")
    used = image.geometry.get("saturation")
    if label and image.header.get("pilatus") is None and used is not None:
        value = image.header.get("count_cutoff", used)
        notes.append(f"{label} {value:g} counts from the header: "
                     + ("pixels at or above it are masked" if used == value
                        else f"not used (--saturation {used:g} masks instead)"))
    groups: dict[str, list[str]] = {}  # why -> "name value" of the values said together
    for name, (value, why) in (image.header.get("unused") or {}).items():
        if why in _UNUSED_WHY:
            notes.append(_not_used(name, value, _UNUSED_WHY[why].format(spindle=_vec(spindle))))
        else:
            groups.setdefault(why, []).append(f"{name} {value}".strip())
    layout = groups.pop("layout", None)
    rest = groups.pop("other", None)
    for why, names in groups.items():  # one line per reason: "A 1; B 2 from the header: not used (why)"
        notes.append(_not_used("; ".join(names), "", why).replace("  from", " from"))
    if layout:
        notes.append(f"{'; '.join(layout)} from the header: file layout: read, not model values")
    if rest:
        notes.append(_not_used("; ".join(rest), "", "exposure, counting, provenance and detector settings: they do "
                                                     "not move spots, and the fitted scale and background absorb "
                                                     "their effect on counts").replace("  from", " from"))
    if image.format == "tiff" and image.header.get("pilatus") is None:
        notes.append("the TIFF tags give no geometry: wavelength, distance, pixel size and beam centre come from "
                     "--model")
    return notes


def model_config(model: str | Sequence[str], image: MeasuredImage | None = None,
                 roi: Sequence[int] | None = None, parallax: bool = True,
                 given_by: str = "--model") -> tuple[SimulationConfig, list[str], list[str]]:
    """The starting model's config, its full flag list and notes on what came from the header.

    Arguments:
        model: nanoBragg flags (a string or tokens; ``@FILE`` tokens are expanded).
        image: the measured image whose header fills in what the model leaves out (None: nothing).
        roi: ``(x0, x1, y0, y1)`` inclusive fast/slow pixel bounds to simulate (replaces a model ``-roi``).
        parallax: model the sensor thickness and absorption from the header (``--no-parallax``: False).
        given_by: where ``model``'s flags came from, as the notes name it ("--model"; "--expt" when a DIALS
            experiment made them: a header value they replace is "not used (--expt gives ...)").

    Raises:
        InputError: a bad flag (one line, naming it).

    The caller checks that the simulator's detector ``(spixels, fpixels)`` equals the image's shape.
    """
    tokens = expand_model_args(model)
    extra, notes = header_flags(tokens, image, parallax, given_by) if image is not None else ([], [])
    tokens = tokens + extra
    if roi is not None:
        tokens += ["-roi", *(str(int(v)) for v in roi)]
    try:
        cfg = config_from_args(tokens)
        model = mosaic_model_of(cfg, cfg.c_parity)
    except InputError as exc:
        raise InputError(f"--model: {exc}") from None
    if (image is not None and cfg.mosaic_domains is None and model in EVEN_MOSAIC_MODELS
            and (cfg.mosaic_spread_deg or 0) > 0):
        count = measured_mosaic_domains(cfg.osc_deg)
        tokens += ["-mosaic_dom", str(count)]
        cfg = cfg.replace(mosaic_domains=count)
        notes.append(f"mosaic: {count} domains, the even set of the {model} model (the default for measured "
                     f"{'rotation images' if cfg.osc_deg else 'stills'}; -mosaic_dom N in --model sets another count)")
    return cfg, tokens, notes


#: the names and group that refine the anisotropic mosaic (the model must have one: :func:`with_anisotropic_mosaic`)
ANISOTROPIC_MOSAIC_NAMES = ("mosaic_aniso", "mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c")


def with_anisotropic_mosaic(cfg: SimulationConfig, start: dict) -> SimulationConfig:
    """``cfg`` with the anisotropic mosaic (``-mosaic_abc``, :mod:`nbtorch.physics.mosaic`) starting where the
    isotropic one is: each axis's spread ``start["mosaic_spread"]`` (else the ``-mosaic`` value), so that the
    starting image is the isotropic model's; ``cfg`` itself when it already has ``-mosaic_abc``."""
    if cfg.mosaic_spread_abc_deg is not None:
        return cfg
    spread = float(start.get("mosaic_spread", cfg.mosaic_spread_deg or 0.0))
    if cfg.c_parity:
        raise InputError("mosaic_spread_a/b/c: the anisotropic mosaic is a spec-mode model; drop -c_parity from "
                         "--model or refine mosaic_spread")
    return cfg.replace(mosaic_spread_abc_deg=(spread, spread, spread))


_TIES = {"cell_b": "cell_a", "cell_c": "cell_a", "cell_alpha": None, "cell_beta": "cell_alpha",
         "cell_gamma": "cell_alpha"}


def tie_start_cell(symmetry: str, model: dict, start: dict) -> dict[str, float]:
    """Starting cell values implied by ``symmetry``: the model's cell, overridden by ``start``, with tied values
    following their free partner (``cell_b = cell_a`` for tetragonal, angles 90 ...).

    A tied value given in ``start`` (or coming from the model while its partner does too) must agree within
    1 % (lengths) or 1 degree (angles): otherwise the cell does not belong to the crystal system.
    """
    base = {n: float(start.get(n, model[n])) for n in CELL}
    implied = {n: float(v) for n, v in constrained_cell(symmetry, base).items()}
    for n in CELL:
        diff = abs(implied[n] - base[n])
        tol = 0.01 * abs(base[n]) if n in ("cell_a", "cell_b", "cell_c") else 1.0
        partner = _TIES.get(n)
        follows = partner is not None and partner in start and n not in start
        if diff > tol and not follows:
            src = "--start" if n in start else "the model"
            raise InputError(f"{src}: {n}={base[n]:g} does not fit the {symmetry} cell (expected {implied[n]:g}); "
                             "fix the starting cell or --symmetry")
    return implied
