"""nanoBragg's command line -> :class:`SimulationConfig`.

Flags are single-dash, matched exactly (the C's substring matching is not
reproduced, except where it changes the image and ``-c_parity`` is given: see
``docs/simulator.md``).  Units are the C's: mm for distances, sizes and beam
centres, A for wavelength and cell, degrees for angles, mrad for divergence,
percent for dispersion, um for sensor thickness, attenuation depth and water,
metres for ``-pix0_vector``.

Pivot and convention follow the C's order rules: the last flag that sets the
convention wins; every detector-vector flag switches to CUSTOM; the last
pivot-setting flag wins (BEAM: ``-distance -Xbeam -Ybeam -mosflm -adxv -denzo
-dials -pivot beam``; SAMPLE: ``-close_distance -twotheta -twotheta_axis
-Xclose -Yclose -ORGX -ORGY -xds -pivot sample``), and the convention may force
a pivot afterwards (:mod:`nbtorch.rules.resolve`).

The headers of ``-mask FILE`` and then ``-img FILE`` (SMV) are applied before
any other flag, as the C reads them first, so explicit flags override them
(:func:`apply_smv_header`).  Conflicting flags (``-nonoise`` with
``-noisefile``, ``-nopgm`` with ``-pgmfile``/``-pgmscale``) are errors rather
than "the later one wins".  Every flag is listed in ``docs/simulator.md``
(:func:`flag_names`).

Every problem is an :class:`~nbtorch.errors.InputError` naming the flag.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from nbtorch.config import SimulationConfig
from nbtorch.errors import InputError
from nbtorch.io.smv import header_value, read_smv


def _num(flag: str, token: str, kind: type = float) -> float:
    try:
        value = float(token)
    except ValueError:
        raise InputError(f"{flag}: expected a number, got {token!r}") from None
    if math.isnan(value):
        raise InputError(f"{flag}: value is NaN")
    if kind is int:
        if not math.isfinite(value) or value != int(value):
            raise InputError(f"{flag}: expected an integer, got {token!r}")
        return int(value)
    return value


# flag -> (number of values, setter(config, values))
Setter = Callable[[SimulationConfig, list], None]
_FLAGS: dict[str, tuple[int, Setter | None]] = {}
#: flag -> the config fields it sets (recorded in ``SimulationConfig.flags`` so that
#: errors found later name the flag the user typed, e.g. ``-N`` rather than ``-Na``)
_SETS: dict[str, tuple[str, ...]] = {
    "-cell": ("cell",), "-misset": ("misset_deg",), "-pivot": ("pivot",), "-curved_det": ("curved_det",),
    "-detector_abs": ("detector_abs_um",),
}


def _flag(names: str, nvals: int = 0, kind: type = float, sets: str = ""):
    def deco(fn: Setter) -> Setter:
        for name in names.split():
            _FLAGS[name] = (nvals, fn, kind)  # type: ignore[assignment]
            _SETS[name] = tuple(sets.split())
        return fn

    return deco


def _simple(name: str, field: str, kind: type = float, nvals: int = 1, pivot: str | None = None, scale: float = 1.0):
    def fn(cfg: SimulationConfig, vals: list) -> None:
        if nvals == 1:
            value = vals[0] * scale if (kind is float and scale != 1.0) else vals[0]
        else:
            value = tuple(vals)
        setattr(cfg, field, value)
        if pivot:
            cfg.pivot = pivot

    _FLAGS[name] = (nvals, fn, kind)  # type: ignore[assignment]
    _SETS[name] = (field,)


def _switch(name: str, field: str, value) -> None:
    def fn(cfg: SimulationConfig, vals: list) -> None:
        setattr(cfg, field, value)

    _FLAGS[name] = (0, fn, float)  # type: ignore[assignment]
    _SETS[name] = (field,)


# --- crystal -----------------------------------------------------------------------
_simple("-Na", "N_a", int)
_simple("-Nb", "N_b", int)
_simple("-Nc", "N_c", int)
_simple("-Nd", "N_d")
_simple("-Ne", "N_e")
_simple("-Nf", "N_f")


@_flag("-N", 1, int, sets="N_a N_b N_c")
def _n(cfg, vals):
    cfg.N_a = cfg.N_b = cfg.N_c = vals[0]


_simple("-mat", "mat_file", str)
_simple("-fudge", "fudge")
_switch("-round_xtal", "shape", "round")
_switch("-square_xtal", "shape", "square")
_switch("-gauss_xtal", "shape", "gauss")
_switch("-gauss_aniso_xtal", "shape", "gauss_aniso")
_switch("-tophat_spots", "shape", "tophat")
_switch("-binary_spots", "shape", "tophat")
_simple("-mosaic", "mosaic_spread_deg")
_simple("-mosaic_spread", "mosaic_spread_deg")
_simple("-mosaic_dom", "mosaic_domains", int)
_simple("-mosaic_domains", "mosaic_domains", int)
_simple("-mosaic_seed", "mosaic_seed", int)
_simple("-mosaic_model", "mosaic_model", str)  # gaussian | ball | random (nbtorch.physics.mosaic.MOSAIC_MODELS)
_simple("-mosaic_turn", "mosaic_turn", int)  # an even set's K-th fixed turn (nbtorch.physics.mosaic.mosaic_set_turn)
_simple("-mosaic_abc", "mosaic_spread_abc_deg", nvals=3)  # spec mode: one spread per crystal axis (deg)
_simple("-misset_seed", "misset_seed", int)
_simple("-phi", "phi_deg")
_simple("-osc", "osc_deg")
_simple("-phistep", "phistep_deg")
_simple("-phisteps", "phisteps", int)
_simple("-hkl", "hkl_file", str)
_simple("-hkl_column", "hkl_column", str)
_simple("-hkl_dmin", "hkl_dmin_A")
_simple("-dump", "dump_file", str)
_simple("-default_F", "default_F")
_switch("-interpolate", "interpolate", True)
_switch("-nointerpolate", "interpolate", False)

# --- beam ----------------------------------------------------------------------------
_simple("-lambda", "wavelength_A")
_simple("-wavelength", "wavelength_A")


@_flag("-energy", 1, sets="wavelength_A")
def _energy(cfg, vals):
    if vals[0] <= 0:
        raise InputError(f"-energy: must be positive, got {vals[0]:g} eV")
    cfg.wavelength_A = 12398.42 / vals[0]


_simple("-dispersion", "dispersion_pct")
_simple("-dispsteps", "dispsteps", int)


@_flag("-divergence", 1, sets="hdivrange_mrad vdivrange_mrad")
def _divergence(cfg, vals):
    cfg.hdivrange_mrad = cfg.vdivrange_mrad = vals[0]


_simple("-hdivrange", "hdivrange_mrad")
_simple("-vdivrange", "vdivrange_mrad")
_simple("-hdivstep", "hdivstep_mrad")
_simple("-vdivstep", "vdivstep_mrad")
_simple("-hdivsteps", "hdivsteps", int)
_simple("-vdivsteps", "vdivsteps", int)


@_flag("-divsteps", 1, int, sets="hdivsteps vdivsteps")
def _divsteps(cfg, vals):
    cfg.hdivsteps = cfg.vdivsteps = vals[0]


_switch("-round_div", "round_div", True)
_switch("-square_div", "round_div", False)
_simple("-sourcefile", "source_file", str)
_simple("-source_distance", "source_distance_mm")
_simple("-polar", "polarization")
_switch("-nopolar", "nopolar", True)
_simple("-fluence", "fluence")
_simple("-flux", "flux")
_simple("-exposure", "exposure_s")
_simple("-beamsize", "beamsize_mm")

# --- detector ------------------------------------------------------------------------
for _name, _conv, _piv in (
    ("-mosflm", "mosflm", "beam"),
    ("-xds", "xds", "sample"),
    ("-adxv", "adxv", "beam"),
    ("-denzo", "denzo", "beam"),
    ("-dials", "dials", "beam"),
):

    def _conv_fn(cfg, vals, _conv=_conv, _piv=_piv):
        cfg.convention = _conv
        cfg.pivot = _piv

    _FLAGS[_name] = (0, _conv_fn, float)  # type: ignore[assignment]
    _SETS[_name] = ("convention",)

for _name, _field in (
    ("-fdet_vector", "fdet_vector"),
    ("-sdet_vector", "sdet_vector"),
    ("-odet_vector", "odet_vector"),
    ("-beam_vector", "beam_vector"),
    ("-polar_vector", "polar_vector"),
    ("-spindle_axis", "spindle_axis"),
    ("-pix0_vector", "pix0_vector_m"),
):

    def _vec_fn(cfg, vals, _field=_field):
        cfg.convention = "custom"
        setattr(cfg, _field, tuple(vals))

    _FLAGS[_name] = (3, _vec_fn, float)  # type: ignore[assignment]
    _SETS[_name] = (_field,)


@_flag("-pix0_vector_mm", 3, sets="pix0_vector_m")
def _pix0_mm(cfg, vals):
    cfg.convention = "custom"
    cfg.pix0_vector_m = tuple(v / 1000.0 for v in vals)


@_flag("-twotheta_axis", 3, sets="twotheta_axis")
def _twotheta_axis(cfg, vals):
    cfg.convention = "custom"
    cfg.twotheta_axis = tuple(vals)
    cfg.pivot = "sample"
    if cfg.c_parity:  # the C's substring match also reads it as -twotheta <first component>
        cfg.twotheta_deg = vals[0]


_simple("-distance", "distance_mm", pivot="beam")
_simple("-close_distance", "close_distance_mm", pivot="sample")
_simple("-Xbeam", "Xbeam_mm", pivot="beam")
_simple("-Ybeam", "Ybeam_mm", pivot="beam")
_simple("-Xclose", "Xclose_mm", pivot="sample")
_simple("-Yclose", "Yclose_mm", pivot="sample")
_simple("-ORGX", "ORGX", pivot="sample")
_simple("-ORGY", "ORGY", pivot="sample")
_simple("-twotheta", "twotheta_deg", pivot="sample")
_simple("-detector_rotx", "detector_rotx_deg")
_simple("-detector_roty", "detector_roty_deg")
_simple("-detector_rotz", "detector_rotz_deg")
_simple("-pixel", "pixel_mm")


@_flag("-detpixels", 1, int, sets="fpixels spixels")
def _detpixels(cfg, vals):
    cfg.fpixels = cfg.spixels = vals[0]


_simple("-detpixels_f", "fpixels", int)
_simple("-detpixels_x", "fpixels", int)
_simple("-detpixels_s", "spixels", int)
_simple("-detpixels_y", "spixels", int)


@_flag("-detsize", 1, sets="detsize_f_mm detsize_s_mm")
def _detsize(cfg, vals):
    cfg.detsize_f_mm = cfg.detsize_s_mm = vals[0]


_simple("-detsize_f", "detsize_f_mm")
_simple("-detsize_s", "detsize_s_mm")
_switch("-point_pixel", "point_pixel", True)
_simple("-oversample", "oversample", int)
_switch("-oversample_thick", "oversample_thick", True)
_switch("-oversample_polar", "oversample_polar", True)
_switch("-oversample_omega", "oversample_omega", True)
_simple("-detector_thick", "detector_thick_um")
_simple("-detector_thicksteps", "detector_thicksteps", int)
_simple("-thicksteps", "detector_thicksteps", int)
_simple("-roi", "roi", int, nvals=4)
_simple("-dmin", "dmin_A")
_simple("-water", "water_um")
_simple("-img", "img_file", str)  # header applied before every other flag (see config_from_args)
_simple("-mask", "mask_file", str)

# --- outputs and run control -----------------------------------------------------------
_simple("-floatfile", "floatfile", str)
_simple("-floatimage", "floatfile", str)
_simple("-intfile", "intfile", str)
_simple("-intimage", "intfile", str)
_simple("-noisefile", "noisefile", str)
_simple("-noiseimage", "noisefile", str)
_simple("-pgmfile", "pgmfile", str)
_simple("-pgmimage", "pgmfile", str)
_simple("-h5file", "h5file", str)
_simple("-scale", "scale")
_simple("-adc", "adc")
_simple("-seed", "seed", int)
_switch("-nonoise", "nonoise", True)
_switch("-nopgm", "nopgm", True)
_switch("-noprogress", "progress", False)
_switch("-progress", "progress", True)
_switch("-printout", "printout", True)


@_flag("-printout_pixel", 2, int, sets="printout_pixel")
def _printout_pixel(cfg, vals):
    cfg.printout_pixel = (vals[0], vals[1])  # fast, slow
    cfg.printout = True  # as in the C, where "-printout_pixel" also matches "-printout"


_switch("-c_parity", "c_parity", True)


@_flag("-phi_carryover_mode", 1, str, sets="phi_carryover")
def _phi_carryover(cfg, vals):
    mode = vals[0].lower().replace("_", "-")
    if mode not in ("spec", "c-parity"):
        raise InputError(f"-phi_carryover_mode: expected 'spec' or 'c-parity', got {vals[0]!r}")
    cfg.phi_carryover = mode


_switch("-compile", "compile", True)
_switch("-nocompile", "compile", False)
_simple("-dtype", "dtype", str)
_simple("-device", "device", str)


_simple("-pgmscale", "pgmscale")


def _is_value(token: str) -> bool:
    """A token that is a value, not a flag (negative numbers are values)."""
    if not token.startswith("-"):
        return True
    try:
        float(token)
        return True
    except ValueError:
        return False


#: flags whose value is a file that is read (``-dump`` too: the ``nbtorch`` command writes it only with ``-hkl``)
INPUT_FILE_FLAGS = ("-mat", "-hkl", "-dump", "-sourcefile", "-img", "-mask")
#: flags whose value is a file name (the others taking text: -dtype, -device, -phi_carryover_mode)
_FILE_FLAGS = ("-mat", "-hkl", "-dump", "-sourcefile", "-img", "-mask", "-floatfile", "-floatimage", "-intfile",
               "-intimage", "-noisefile", "-noiseimage", "-pgmfile", "-pgmimage", "-h5file")


def _check_text_value(flag: str, token: str) -> None:
    """A text value (file name, ``-dtype``...) is neither empty nor the next flag.

    Numeric values are told from flags by :func:`_is_value` (negative numbers are
    values); a text value may start with ``-``, but one that is a flag this parser
    knows means the value was left out (``-floatfile -nonoise``).
    """
    what = "a file name" if flag in _FILE_FLAGS else "a value"
    if token in _FLAGS or token in _SPECIAL_PARSERS:
        raise InputError(f"{flag}: expected {what}, got the flag {token} (give {flag} its value)")
    if not token.strip():
        raise InputError(f"{flag}: expected {what}, got an empty {'name' if flag in _FILE_FLAGS else 'value'} {token!r}")


def flag_names() -> list[str]:
    """Every flag :func:`config_from_args` accepts (sorted)."""
    return sorted(set(_FLAGS) | set(_SPECIAL_PARSERS))


def apply_smv_header(cfg: SimulationConfig, path: str, flag: str) -> set[str]:
    """Seed ``cfg`` from the header of the SMV file given to ``-img`` or ``-mask``, as the C does.

    Keys (found like the C's ``ValueOf``, see :func:`nbtorch.io.smv.header_value`):
    SIZE1/SIZE2 -> detector pixels; PIXEL_SIZE (mm); DISTANCE, CLOSE_DISTANCE (mm);
    WAVELENGTH (A); BEAM_CENTER_X/Y (mm; for ``-mask`` Ybeam = detsize_s - BEAM_CENTER_Y,
    the C's flip); ORGX/ORGY (pixels); PHI, OSC_RANGE, TWOTHETA (deg).  No pivot is
    set.  Returns the names of the config fields it set.
    """
    try:
        image, header = read_smv(path)
    except InputError as exc:
        raise InputError(f"{flag} {exc}") from None
    slow, fast = image.shape
    cfg.fpixels, cfg.spixels = int(fast), int(slow)
    changed = {"fpixels", "spixels"}

    def get(key: str, positive: bool = False):
        value = header_value(path, header, key)
        if value is not None and positive and not value > 0:
            raise InputError(f"{flag} {path}: SMV header {key}={value:g} must be positive")
        return value

    pixel = get("PIXEL_SIZE", positive=True)
    if pixel is not None:
        cfg.pixel_mm = pixel
        changed.add("pixel_mm")
    detsize_s_mm = cfg.pixel_mm * slow
    for key, field, positive in (
        ("DISTANCE", "distance_mm", True),
        ("CLOSE_DISTANCE", "close_distance_mm", True),
        ("WAVELENGTH", "wavelength_A", True),
        ("BEAM_CENTER_X", "Xbeam_mm", False),
        ("BEAM_CENTER_Y", "Ybeam_mm", False),
        ("ORGX", "ORGX", False),
        ("ORGY", "ORGY", False),
        ("PHI", "phi_deg", False),
        ("OSC_RANGE", "osc_deg", False),
        ("TWOTHETA", "twotheta_deg", False),
    ):
        value = get(key, positive)
        if value is None:
            continue
        if key == "BEAM_CENTER_Y" and flag == "-mask":
            value = detsize_s_mm - value
        setattr(cfg, field, value)
        changed.add(field)
    return changed


def _conflicts(cfg: SimulationConfig, seen: set[str]) -> None:
    if "-nonoise" in seen and seen & {"-noisefile", "-noiseimage"}:
        raise InputError("-nonoise and -noisefile both given: -nonoise writes no noise image; drop one")
    if "-nopgm" in seen and seen & {"-pgmfile", "-pgmimage", "-pgmscale"}:
        given = sorted(seen & {"-pgmfile", "-pgmimage", "-pgmscale"})[0]
        raise InputError(f"-nopgm and {given} both given: -nopgm writes no PGM image; drop one")


Op = Callable[[SimulationConfig], None]


def _cell(tok: str, argv: list[str], i: int) -> tuple[Op, int]:
    """``-cell a [b c alpha beta gamma]``: 1 to 6 numbers, the rest from a cubic cell of edge ``a``."""
    vals = []
    while i < len(argv) and _is_value(argv[i]) and len(vals) < 6:
        vals.append(_num(tok, argv[i]))
        i += 1
    if not vals:
        raise InputError("-cell: expected 1 to 6 numbers (a b c alpha beta gamma)")
    a = vals[0]
    full = [a, a, a, 90.0, 90.0, 90.0]
    full[: len(vals)] = vals
    return (lambda c, full=tuple(full): setattr(c, "cell", full)), i


def _misset(tok: str, argv: list[str], i: int) -> tuple[Op, int]:
    """``-misset rx ry rz`` (degrees) or ``-misset random``."""
    if i < len(argv) and argv[i].lower().startswith("rand"):
        return (lambda c: setattr(c, "misset_random", True)), i + 1
    vals = argv[i : i + 3]
    if len(vals) < 3 or not all(_is_value(v) for v in vals):
        raise InputError("-misset: expected three angles in degrees or 'random'")
    angles = tuple(_num(tok, v) for v in vals)

    def op(c, angles=angles):
        c.misset_deg = angles
        c.misset_random = False

    return op, i + 3


def _pivot(tok: str, argv: list[str], i: int) -> tuple[Op, int]:
    if i >= len(argv) or argv[i] not in ("beam", "sample"):
        raise InputError("-pivot: expected 'beam' or 'sample'")
    return (lambda c, v=argv[i]: setattr(c, "pivot", v)), i + 1


def _curved_det(tok: str, argv: list[str], i: int) -> tuple[Op, int]:
    if i < len(argv) and _is_value(argv[i]):
        i += 1  # the C needs a (meaningless) argument here
    return (lambda c: setattr(c, "curved_det", True)), i


def _detector_abs(tok: str, argv: list[str], i: int) -> tuple[Op, int]:
    if i >= len(argv):
        raise InputError("-detector_abs: expected an attenuation depth in um or 'inf'")
    token = argv[i]
    value = math.inf if token.lower().startswith("inf") else _num(tok, token)
    return (lambda c, v=value: setattr(c, "detector_abs_um", v)), i + 1


#: the flags parsed by hand, whose values the table (:data:`_FLAGS`) cannot describe:
#: flag -> parser(flag, argv, index of its first value) -> (op, index after its values)
_SPECIAL_PARSERS = {"-cell": _cell, "-misset": _misset, "-pivot": _pivot, "-curved_det": _curved_det,
                    "-detector_abs": _detector_abs}


def _table_flag(tok: str, argv: list[str], i: int) -> tuple[Op, int]:
    """A flag of the table :data:`_FLAGS`: its fixed number of values, checked and converted."""
    spec = _FLAGS.get(tok)
    if spec is None:
        raise InputError(f"unknown flag {tok}")
    nvals, fn, kind = spec  # type: ignore[misc]
    raw = argv[i : i + nvals]
    if len(raw) < nvals or not all(kind is str or _is_value(v) for v in raw):
        what = "a value" if nvals == 1 else f"{nvals} values"
        raise InputError(f"{tok}: expected {what}")
    if kind is str:
        _check_text_value(tok, raw[0])
        vals = raw
    else:
        vals = [_num(tok, v, kind) for v in raw]
    return (lambda c, fn=fn, vals=vals: fn(c, vals)), i + nvals


def _parse_ops(argv: list[str]) -> list[tuple[str, Op]]:
    """``(flag, op)`` for every flag of ``argv`` in command-line order (nothing applied yet)."""
    ops: list[tuple[str, Op]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("-") or _is_value(tok):
            raise InputError(f"unexpected argument {tok!r} (not a flag, and no flag takes it)")
        op, i = _SPECIAL_PARSERS.get(tok, _table_flag)(tok, argv, i + 1)
        ops.append((tok, op))
    return ops


def _apply_headers(cfg: SimulationConfig, ops: list[tuple[str, Op]]) -> set[str]:
    """The headers of ``-mask`` then ``-img`` (the C's order); returns the config fields they set."""
    from_header: set[str] = set()
    for flag, field in (("-mask", "mask_file"), ("-img", "img_file")):
        for tok, op in ops:
            if tok == flag:
                op(cfg)
        path = getattr(cfg, field)
        if path is not None:
            from_header |= apply_smv_header(cfg, path, flag)
    return from_header


def config_from_args(argv: Sequence[str]) -> SimulationConfig:
    """Parse nanoBragg-style arguments (without the program name).

    Like the C, the headers of ``-mask`` and then ``-img`` files are applied
    first, so every other flag overrides them (whatever its position); a
    command-line ``-distance`` also drops a header's CLOSE_DISTANCE (the C keeps
    it, and does so under ``-c_parity``).

    Raises:
        InputError: unknown flag, missing or malformed value, conflicting flags,
            unreadable ``-img``/``-mask`` file (one line, naming the flag or file).
    """
    argv = list(argv)
    cfg = SimulationConfig()
    cfg.c_parity = "-c_parity" in argv  # some parsing quirks depend on it
    ops = _parse_ops(argv)
    seen = {tok for tok, _ in ops}
    _conflicts(cfg, seen)
    # headers first, mask then img (the C's order), then the flags in command-line order
    from_header = _apply_headers(cfg, ops)
    for tok, op in ops:
        op(cfg)
        for name in _SETS.get(tok, ()):
            cfg.flags[name] = tok
    if ("close_distance_mm" in from_header and "-distance" in seen and "-close_distance" not in seen
            and not cfg.c_parity):
        cfg.close_distance_mm = None  # an explicit -distance beats the header's CLOSE_DISTANCE
    return cfg
