"""Detector counts and photons: ``counts = gain * photons + adc_offset``, so that the likelihood sees photons.

A detector records counts, not photons.  An integrating detector (a CCD, nanoBragg's SMV images) adds a
constant ADC offset (a pedestal) to every pixel and may record several counts per photon (a gain); a
photon counter (Pilatus, Eiger) records one count per photon and adds nothing.  The Poisson likelihood
(:mod:`refine.fitting.objective`) is the likelihood of photons: fitted to counts with a pedestal it takes the
pedestal for photons (the flat background absorbs it, and the shot noise it expects from it is not there),
and with a gain its shot-noise expectation is off by the gain.  Both are detector constants, not refined:
the image is turned into photons once, where it is read (:meth:`DetectorCounts.photons`), and everything
after it (starting scale and background, the fit, its excess and sigZ, the spot diagnostics) sees photons::

    photons = (counts - adc_offset) / gain

Where the values come from (:func:`header_counts`; ``--gain``/``--adc-offset`` override either):

===========================  =========  ===============  ==============================================
image                        gain       ADC offset       from
===========================  =========  ===============  ==============================================
SMV with ``GAIN=``,          the key's  the key's        the header (``IMAGE_PEDESTAL``, else
``ADC_OFFSET=`` or                                       ``ADC_OFFSET``)
``IMAGE_PEDESTAL=``
SMV written by nanoBragg     1          40               ``-noisefile``'s counts are Poisson photons
(``BEAMLINE=fake``,                                      plus ``-adc`` (default 40), which the header
``DETECTOR_SN=000``)                                     does not record: another ``-adc``, or an
                                                         ``-intfile`` (scaled by ``intfile_scale``),
                                                         needs ``--adc-offset``/``--gain``
other SMV                    1          0                nothing in the header: say so
mini-CBF / Pilatus TIFF,     1          0                photon counters
NXmx / Eiger
multi-panel CBF (CSPAD)      1          0                nothing in the file: say so (integrating)
MarCCD, mar345, raw          1          0                nothing in the header: say so
bank problems (``--problem``) 1         40               the pedestal added after the Poisson draw
===========================  =========  ===============  ==============================================

Pixels whose counts lie below the ADC offset cannot come from a photon counter plus that offset (pixels
outside nanoBragg's ``-roi`` are written as 0): they are masked, and counted, as ``below_offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.images import finite_float

__all__ = ["DetectorCounts", "check_counts", "header_counts", "detector_counts", "NANOBRAGG_ADC"]

#: nanoBragg's default ``-adc`` offset (counts), added to every pixel of ``-intfile`` and ``-noisefile``
NANOBRAGG_ADC = 40.0
# SMV header keys, in the order they are taken
_SMV_GAIN = ("GAIN",)
_SMV_OFFSET = ("IMAGE_PEDESTAL", "ADC_OFFSET")


@dataclass(frozen=True)
class DetectorCounts:
    """The detector constants that turn counts into photons.

    Attributes:
        gain: counts per photon (> 0).
        adc_offset: counts added to every pixel (finite).
        source: where the values came from, one line.
    """

    gain: float = 1.0
    adc_offset: float = 0.0
    source: str = "default: a photon counter (gain 1, no offset)"

    @property
    def identity(self) -> bool:
        """True when counts are photons (gain 1, no offset)."""
        return self.gain == 1.0 and self.adc_offset == 0.0

    def photons(self, counts: np.ndarray, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """``(photons, mask, below)``: ``(counts - adc_offset) / gain`` as float64, the mask with the pixels below
        the offset removed (True = use), and how many of the usable pixels that removed."""
        counts = np.asarray(counts, dtype=np.float64)
        keep = np.ones(counts.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        if self.identity:
            return counts, keep, 0
        photons = (counts - self.adc_offset) / self.gain
        with np.errstate(invalid="ignore"):
            below = keep & (photons < 0)
        return photons, keep & ~below, int(below.sum())

    def photon_values(self, values: Mapping[str, float]) -> dict:
        """Model values of a fit to counts as those of a fit to photons: ``scale / gain``,
        ``(background - adc_offset) / gain`` and the background's slopes ``/ gain``; the rest unchanged."""
        out = dict(values)
        for name in ("scale", "background_x", "background_y"):
            if name in out:
                out[name] = float(out[name]) / self.gain
        if "background" in out:
            out["background"] = (float(out["background"]) - self.adc_offset) / self.gain
        return out

    def as_dict(self) -> dict:
        """For ``result.json``: ``{"gain", "adc_offset", "source"}``."""
        return {"gain": self.gain, "adc_offset": self.adc_offset, "source": self.source}

    def describe(self) -> str:
        """One line for the printout."""
        return f"detector counts: gain {self.gain:g} counts/photon, ADC offset {self.adc_offset:g} counts ({self.source})"


def check_counts(gain: Any, adc_offset: Any, what: str = "") -> tuple[float | None, float | None]:
    """``(gain, adc_offset)`` checked (None stays None): a finite gain > 0 and a finite offset; one-line errors
    naming ``--gain``/``--adc-offset`` (after ``what``, e.g. a file)."""
    prefix = f"{what}: " if what else ""
    if gain is not None:
        g = finite_float(gain)
        if g is None or not g > 0:
            raise InputError(f"{prefix}--gain: counts per photon must be a finite number > 0, got {gain!r}")
        gain = g
    if adc_offset is not None:
        o = finite_float(adc_offset)
        if o is None:
            raise InputError(f"{prefix}--adc-offset: counts must be a finite number, got {adc_offset!r}")
        adc_offset = o
    return gain, adc_offset


def _smv_counts(path: str, fields: Mapping[str, str]) -> DetectorCounts:
    """An SMV header's gain and offset (module docstring)."""
    found: dict[str, tuple[str, float]] = {}
    for name, keys in (("gain", _SMV_GAIN), ("adc_offset", _SMV_OFFSET)):
        for key in (k for k in keys if k in fields):
            value = finite_float(str(fields[key]).strip().rstrip(";"))
            if value is None or (name == "gain" and not value > 0):
                raise InputError(f"{path}: SMV header {key}={fields[key]!r} is not a usable "
                                 f"{'gain (> 0)' if name == 'gain' else 'offset'}; give --gain/--adc-offset")
            found[name] = (key, value)
            break
    if found:
        gain = found.get("gain", ("", 1.0))[1]
        offset = found.get("adc_offset", ("", 0.0))[1]
        keys = ", ".join(f"{k}={v:g}" for k, v in found.values())
        return DetectorCounts(gain, offset, f"SMV header {keys}")
    if str(fields.get("BEAMLINE", "")).strip() == "fake" and str(fields.get("DETECTOR_SN", "")).strip() == "000":
        return DetectorCounts(1.0, NANOBRAGG_ADC, "an SMV image nanoBragg wrote (BEAMLINE=fake): its noise image's "
                                                  f"gain 1 and default -adc {NANOBRAGG_ADC:g}")
    return DetectorCounts(1.0, 0.0, "the SMV header gives no gain or offset: 1 and 0 assumed (--gain, --adc-offset)")


def header_counts(path: str, fmt: str, header: Mapping[str, Any]) -> DetectorCounts:
    """The detector constants an image's header gives (module docstring's table), for the format ``fmt`` of
    :data:`nbtorch.io.images.FORMATS` and :attr:`refine.inputs.images.MeasuredImage.header`."""
    if fmt == "smv":
        return _smv_counts(path, header.get("fields", header))
    if fmt in ("cbf", "tiff") and header.get("pilatus"):
        return DetectorCounts(1.0, 0.0, "a Pilatus photon counter: gain 1, no offset")
    if fmt == "cbf" and header.get("panel_boxes"):  # a multi-array imgCIF (a CSPAD's): no gain in the file
        return DetectorCounts(1.0, 0.0, "a multi-panel CBF gives no gain or offset: 1 and 0 assumed (an integrating "
                                        "detector's counts are not photons: give --gain, --adc-offset)")
    if fmt == "cbf":
        return DetectorCounts(1.0, 0.0, "a mini-CBF: a photon counter's gain 1, no offset")
    if fmt == "hdf5":
        return DetectorCounts(1.0, 0.0, "NXmx: a photon counter's gain 1, no offset")
    return DetectorCounts(1.0, 0.0, f"the {fmt} header gives no gain or offset: 1 and 0 assumed (--gain, --adc-offset)")


def detector_counts(found: DetectorCounts, gain: float | None = None, adc_offset: float | None = None) -> DetectorCounts:
    """``found`` (a header's or a problem's constants) with ``--gain``/``--adc-offset`` put over it (checked)."""
    gain, adc_offset = check_counts(gain, adc_offset)
    if gain is None and adc_offset is None:
        return found
    given = ", ".join(f"{flag} {v:g}" for flag, v in (("--gain", gain), ("--adc-offset", adc_offset)) if v is not None)
    return DetectorCounts(found.gain if gain is None else gain, found.adc_offset if adc_offset is None else adc_offset,
                          f"{given}; otherwise {found.source}")

