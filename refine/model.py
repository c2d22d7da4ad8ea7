"""The starting model of a refinement: nanoBragg flags, completed from the measured image's header.

:func:`model_config` turns ``--model "<nanoBragg flags>"`` and a
:class:`~refine.data.MeasuredImage` into a :class:`nbtorch.SimulationConfig`.

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
:mod:`nbtorch.beam_centre` (``docs/conventions.md``): MOSFLM ``-Xbeam Sbeam-p/2
-Ybeam Fbeam-p/2``, DENZO ``-Xbeam Sbeam -Ybeam Fbeam``, ADXV ``-Xbeam Fbeam
-Ybeam detsize_s-Sbeam``, XDS/DIALS ``-ORGX Fbeam/p+1/2 -ORGY Sbeam/p+1/2`` (a
detector normal to the beam), CUSTOM ``-Xbeam Fbeam -Ybeam Sbeam``.

:func:`fit_scale_background` gives a measured image's starting scale and background;
:func:`crystal_system` maps ``--symmetry`` (a crystal system or a space-group symbol such as
``P41212``) to a crystal system, and :func:`tie_start_cell` makes the starting cell obey it.

``@FILE`` tokens in the model string are replaced by the flags in FILE (an args
file such as ``nanobragg_geometry_args_*.txt``); a relative input path inside it
(``-mat -hkl -dump -sourcefile -img -mask``) that does not exist from the working
directory is looked up beside FILE.
"""

from __future__ import annotations

import math
import shlex
import sys
from typing import Sequence

import numpy as np
import torch

from nbtorch import eager
from nbtorch.args import INPUT_FILE_FLAGS, config_from_args
from nbtorch.beam_centre import beam_centre_flags, beam_centre_from_offsets_m
from nbtorch.cli_support import expand_argument_files
from nbtorch.config import SimulationConfig
from nbtorch.errors import InputError
from nbtorch.parameters import PARAMETER_NAMES
from refine.data import MeasuredImage
from refine.parameters import CELL, SYMMETRIES, constrained_cell

__all__ = ["expand_model_args", "header_flags", "model_config", "fit_scale_background", "crystal_system",
           "tie_start_cell", "INPUT_FILE_FLAGS", "MIN_BRAGG_FRACTION"]

_GIVEN = {
    "wavelength": ("-lambda", "-wavelength", "-energy", "-img"),
    "distance": ("-distance", "-close_distance", "-img"),
    "pixel": ("-pixel", "-img"),
    "beam": ("-Xbeam", "-Ybeam", "-Xclose", "-Yclose", "-ORGX", "-ORGY", "-pix0_vector", "-pix0_vector_mm", "-img"),
    "detector": ("-detpixels", "-detpixels_f", "-detpixels_s", "-detpixels_x", "-detpixels_y", "-detsize",
                 "-detsize_f", "-detsize_s", "-img"),
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


def header_flags(tokens: Sequence[str], image: MeasuredImage) -> tuple[list[str], list[str]]:
    """Flags to add to ``tokens`` from ``image``'s header and shape, and one note per quantity filled in."""
    geo = image.geometry
    extra: list[str] = []
    notes: list[str] = []
    slow, fast = image.shape
    if not _has(tokens, "detector"):
        extra += ["-detpixels_f", str(fast), "-detpixels_s", str(slow)]
        notes.append(f"detector {fast} x {slow} pixels from the image")
    if not _has(tokens, "pixel") and "pixel_mm" in geo:
        extra += ["-pixel", _fmt(geo["pixel_mm"])]
        notes.append(f"pixel {geo['pixel_mm']:g} mm from the header")
    if not _has(tokens, "wavelength") and "wavelength_A" in geo:
        extra += ["-lambda", _fmt(geo["wavelength_A"])]
        notes.append(f"wavelength {geo['wavelength_A']:g} A from the header")
    if not _has(tokens, "distance") and "distance_mm" in geo:
        extra += ["-distance", _fmt(geo["distance_mm"])]
        notes.append(f"distance {geo['distance_mm']:g} mm from the header")
    if not _has(tokens, "beam") and "beam_x_px" in geo and "beam_y_px" in geo:
        cfg = config_from_args(list(tokens) + extra)  # convention and pixel size of the model
        conv, pixel_m = cfg.convention, cfg.pixel_mm / 1000.0
        # the header's spot, taken as both the beam and the close point (a detector normal to the beam)
        fast_m, slow_m = geo["beam_x_px"] * pixel_m, geo["beam_y_px"] * pixel_m
        beam_x_m, beam_y_m = beam_centre_from_offsets_m(conv, fast_m, slow_m, pixel_m, (cfg.spixels or slow) * pixel_m)
        flags = beam_centre_flags(conv, beam_x_m * 1000.0, beam_y_m * 1000.0, cfg.pixel_mm)
        extra += flags
        notes.append(f"beam centre ({geo['beam_x_px']:g}, {geo['beam_y_px']:g}) px (fast, slow) from the header "
                     f"as {' '.join(flags)} ({conv} convention)")
    return extra, notes


def model_config(model: str | Sequence[str], image: MeasuredImage | None = None,
                 roi: Sequence[int] | None = None) -> tuple[SimulationConfig, list[str], list[str]]:
    """The starting model's config, its full flag list and notes on what came from the header.

    Arguments:
        model: nanoBragg flags (a string or tokens; ``@FILE`` tokens are expanded).
        image: the measured image whose header fills in what the model leaves out (None: nothing).
        roi: ``(x0, x1, y0, y1)`` inclusive fast/slow pixel bounds to simulate (replaces a model ``-roi``).

    Raises:
        InputError: a bad flag (one line, naming it).

    The caller checks that the simulator's detector ``(spixels, fpixels)`` equals the image's shape.
    """
    tokens = expand_model_args(model)
    extra, notes = header_flags(tokens, image) if image is not None else ([], [])
    tokens = tokens + extra
    if roi is not None:
        tokens += ["-roi", *(str(int(v)) for v in roi)]
    try:
        cfg = config_from_args(tokens)
    except InputError as exc:
        raise InputError(f"--model: {exc}") from None
    return cfg, tokens, notes


#: smallest share of the fitted counts the starting model's Bragg part may explain (below: a collapsed scale)
MIN_BRAGG_FRACTION = 1e-9

_START_HINT = ("give the start yourself (--start scale=...,background=...) or check the starting model's orientation "
               "(-mat, --start misset_*), cell, beam centre and distance, or fit more pixels (--subsample, --roi, "
               "--spot-window)")


def fit_scale_background(sim, values: dict, observed, mask) -> tuple[float, float]:
    """Starting ``scale`` and ``background`` for ``model = scale * simulator + background``: the Poisson
    maximum-likelihood pair for the starting model on the ``mask`` pixels (one eager simulation).

    A measured image's scale is unknown by orders of magnitude (``-default_F``, fluence, exposure), and
    a start far off makes the first steps of a refinement move the geometry to absorb it.

    A start that cannot be right is refused rather than handed to the optimiser, where every derivative
    would be ~0 and the run would stop at once (``Status.NO_STEP``):

    * no fitted pixel has a finite, non-negative count;
    * the starting model is 0 (or not finite) on every fitted pixel: none of its spots is fitted;
    * the observed counts are not higher where the model has its spots than on average (the
      model-weighted mean count is at most the plain mean): the likelihood's best scale is 0, the
      model's spots miss the observed ones;
    * the fitted scale is not a positive normal number, or the model's Bragg part explains less than
      :data:`MIN_BRAGG_FRACTION` of the fitted counts (a scale that collapsed towards 0).

    Arguments:
        sim: the simulator; ``values``: canonical parameters (and ``orient_x/y/z``) of the start.
        observed: (slow, fast) counts; ``mask``: (slow, fast) bool, True = pixel fitted.

    Raises:
        InputError: one line saying which of the above happened and what to do.
    """

    x0, x1, y0, y1 = sim.setup.roi
    overrides = {n: torch.tensor(float(values[n]), dtype=torch.float64) for n in PARAMETER_NAMES if n in values}
    with torch.no_grad(), eager():
        img, _ = sim.render(**overrides)
    m_roi = np.asarray(mask, dtype=bool)[y0:y1 + 1, x0:x1 + 1]
    model = img.detach().cpu().double().numpy()[m_roi]
    obs = np.asarray(observed, dtype=np.float64)[y0:y1 + 1, x0:x1 + 1][m_roi]
    ok = np.isfinite(obs) & (obs >= 0)
    model, obs = model[ok], obs[ok]
    n = int(model.size)
    if n == 0:
        raise InputError("starting scale: no fitted pixel has a usable count (finite, >= 0); check --mask, --roi, "
                         "--dmin/--dmax and --subsample")
    model = np.where(np.isfinite(model), model, 0.0)
    if not model.max() > 0:
        raise InputError(f"starting scale: the starting model is 0 on all {n} fitted pixels (none of its spots is "
                         f"fitted), so no scale can be fitted; {_START_HINT}")
    mean_obs = float(obs.mean())
    mean_at_spots = float(np.sum(model * obs) / np.sum(model))
    if not mean_at_spots > mean_obs:
        raise InputError(f"starting scale: the observed counts are not higher where the starting model has its spots "
                         f"({mean_at_spots:.4g} vs {mean_obs:.4g} on average over {n} fitted pixels): its spots miss "
                         f"the observed ones and the best scale is 0; {_START_HINT}")
    # least squares for a start, then the Poisson fixed point s <- s sum(w m)/sum(m), b <- b mean(w), w = k/mu
    coef = np.linalg.lstsq(np.c_[model, np.ones_like(model)], obs, rcond=None)[0]
    s = max(float(coef[0]), 1e-6 * max(mean_obs, 1.0) / max(float(model.mean()), 1e-300))
    b = max(float(coef[1]), 1e-3)
    for _ in range(200):
        mu = s * model + b
        w = obs / mu
        s_new, b_new = s * float(np.sum(w * model) / np.sum(model)), b * float(np.mean(w))
        done = abs(s_new - s) <= 1e-10 * s and abs(b_new - b) <= 1e-10 * b
        s, b = max(s_new, 1e-300), max(b_new, 1e-6)
        if done:
            break
    bragg = s * float(np.sum(model))
    share = bragg / (bragg + b * n) if math.isfinite(bragg) and bragg + b * n > 0 else math.nan
    if not (math.isfinite(s) and s >= sys.float_info.min and math.isfinite(b)) or not share >= MIN_BRAGG_FRACTION:
        raise InputError(f"starting scale: the Poisson fit of the starting model gives no usable scale (scale {s:.4g}, "
                         f"its spots explain "
                         f"{share:.3g} of the counts on {n} fitted pixels); {_START_HINT}")
    return s, b


#: space-group names accepted by --symmetry, mapped to crystal systems (a few common ones; any system name works)
_SPACE_GROUPS = {
    "P1": "triclinic", "P2": "monoclinic", "P21": "monoclinic", "C2": "monoclinic",
    "P222": "orthorhombic", "P212121": "orthorhombic", "C2221": "orthorhombic", "I222": "orthorhombic",
    "P4": "tetragonal", "P41": "tetragonal", "P42": "tetragonal", "P43": "tetragonal", "I4": "tetragonal",
    "P422": "tetragonal", "P4212": "tetragonal", "P4122": "tetragonal", "P41212": "tetragonal",
    "P4222": "tetragonal", "P42212": "tetragonal", "P4322": "tetragonal", "P43212": "tetragonal",
    "I422": "tetragonal", "I4122": "tetragonal",
    "P3": "trigonal", "P31": "trigonal", "P32": "trigonal", "P321": "trigonal", "P3121": "trigonal",
    "P3221": "trigonal", "P312": "trigonal", "R3": "rhombohedral", "R32": "rhombohedral",
    "P6": "hexagonal", "P61": "hexagonal", "P65": "hexagonal", "P622": "hexagonal", "P6122": "hexagonal",
    "P6522": "hexagonal", "P23": "cubic", "P213": "cubic", "I23": "cubic", "F23": "cubic", "P432": "cubic",
    "P4132": "cubic", "P4332": "cubic", "I432": "cubic", "F432": "cubic",
}


def crystal_system(name: str | None) -> str | None:
    """``--symmetry``: a crystal system name, or a space-group symbol mapped to its system."""
    if name is None:
        return None
    key = name.strip()
    if key.lower() in SYMMETRIES:
        return key.lower()
    compact = key.replace(" ", "").replace("_", "").upper()
    if compact in _SPACE_GROUPS:
        return _SPACE_GROUPS[compact]
    raise InputError(f"--symmetry: unknown crystal system or space group {name!r}; "
                     f"crystal systems: {', '.join(SYMMETRIES)}")


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
