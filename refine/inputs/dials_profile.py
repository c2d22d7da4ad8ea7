"""The spot profile a DIALS experiment states (:mod:`refine.inputs.dials`): its profile model's mosaicity and
beam divergence as the model's ``-N``/``-mosaic`` and divergence flags (:func:`profile_model`, :func:`still_model`),
and the half-width of the window around each spot (:func:`window_half_px`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nbtorch.errors import InputError


def lab_panel(exp) -> dict:
    """Panel 0 with its frame in the lab (a hierarchy's frames composed)."""
    from nbtorch.io.dials import panel_lab_frames

    f, s, o = panel_lab_frames(exp.detector)[0]
    return dict(exp.panel, fast_axis=list(f), slow_axis=list(s), origin=list(o))


def panel_distance_mm(exp) -> float:
    """The panel's distance from the sample along its normal (mm; a multi-panel detector: panel 0's)."""
    panel = lab_panel(exp)
    normal = np.cross(panel["fast_axis"], panel["slow_axis"])
    return abs(float(np.dot(panel["origin"], normal / np.linalg.norm(normal))))


def pixel_mm(exp) -> float:
    return float(exp.panel["pixel_size"][0])


#: sigma of the main lobe of nanoBragg's square lattice factor ``sin^2(pi N h) / sin^2(pi h)`` in ``N h`` (a Gaussian
#: with the same curvature at the peak: ``sqrt(3/2) / pi``); its width in reciprocal space is this over ``N a``
LATTICE_SIGMA_NH = math.sqrt(1.5) / math.pi
#: the crystal-model flags a DIALS profile gives (:func:`profile_model`) and the ``--model`` flags that replace each
PROFILE_FLAGS = {"size": ("-N", "-Na", "-Nb", "-Nc", "-xtalsize", "-samplesize", "-xtal_size"),
                 "mosaic": ("-mosaic", "-mosaic_spread"), "domains": ("-mosaic_dom", "-mosaic_domains"),
                 "phisteps": ("-phisteps", "-phistep"), "F": ("-default_F", "-hkl"), "oversample": ("-oversample",)}


@dataclass(frozen=True)
class ProfileModel:
    """The starting crystal model that a DIALS experiment's profile (``gaussian_rs``: ``sigma_b``, ``sigma_m``) and
    cell give (:func:`profile_model`): unit cells along a, b, c, nanoBragg's ``-mosaic`` spread (deg), mosaic domains,
    phi steps of an image, and what they came from (``mosaic_model``: the model whose spread ``mosaic_deg`` is)."""

    N: tuple[int, int, int]
    mosaic_deg: float
    domains: int
    phisteps: int
    domain_A: float
    dstar: float
    sigma_b_deg: float
    sigma_m_deg: float
    spot_px: float = 0.0
    mosaic_model: str = "ball"

    def flags(self) -> dict[str, list[str]]:
        """nanoBragg flags, by :data:`PROFILE_FLAGS` quantity (``-oversample 1`` where the spots are at least a pixel
        wide, ``spot_px``: sampling each pixel once then changes no partial by 1e-3, docs/log.md)."""
        return {"size": ["-Na", str(self.N[0]), "-Nb", str(self.N[1]), "-Nc", str(self.N[2])],
                "mosaic": ["-mosaic", f"{self.mosaic_deg:.6g}"], "domains": ["-mosaic_dom", str(self.domains)],
                "phisteps": ["-phisteps", str(self.phisteps)], "F": ["-default_F", "100"],
                **({"oversample": ["-oversample", "1"]} if self.spot_px >= 1.0 else {})}

    def note(self, kept: dict[str, list[str]]) -> str:
        """The printed note of the ``kept`` flags (those ``--model`` did not replace)."""
        size = f"domains of {self.domain_A:.0f} A as " if "size" in kept else ""
        return (f"crystal model from the DIALS profile (sigma_b {self.sigma_b_deg:.4g} deg, sigma_m {self.sigma_m_deg:.4g} "
                f"deg, typical d* {self.dstar:.3g} 1/A): {size}{' '.join(t for v in kept.values() for t in v)} (the "
                "scale is fitted; --model flags replace these)")


def _profile(exp) -> dict | None:
    """The experiment's ``gaussian_rs``-like profile (positive ``sigma_b``, ``sigma_m`` in degrees), or None."""
    profiles = exp.document.get("profile") or []
    ref = exp.document["experiment"][exp.index].get("profile")
    profile = profiles[ref] if isinstance(ref, int) and 0 <= ref < len(profiles) else None
    if not isinstance(profile, dict) or not all(isinstance(profile.get(k), (int, float)) and profile[k] > 0
                                                for k in ("sigma_b", "sigma_m")):
        return None
    return profile


#: mosaic domains of a crystal model from a DIALS profile with the C's random draw (``--model "-mosaic_model random"``):
#: on the real L-cysteine sweep 30 domains put the model's spots 0.42-0.49 px from DIALS's centroids over three random
#: sets, 10 domains 0.44-0.55 px (docs/log.md, 2026-11-27); an even set takes the simulator's default count
MIN_DOMAINS, MAX_DOMAINS = 30, 40


def mosaic_model_of_tokens(tokens: list[str]) -> str:
    """The mosaic model that ``--model`` tokens ask for (:func:`nbtorch.rules.resolve.mosaic_model_of` on their config)."""
    from nbtorch.cli.args import config_from_args
    from nbtorch.rules.resolve import mosaic_model_of

    try:
        cfg = config_from_args(list(tokens))
        return mosaic_model_of(cfg, cfg.c_parity)
    except InputError as exc:
        raise InputError(f"--model: {exc}") from None


def profile_model(exp, dstar: float, osc_deg: float | None, mosaic_model: str = "ball") -> ProfileModel | None:
    """The starting crystal model of ``exp`` from its profile (None without a ``gaussian_rs`` profile).

    DIALS' Gaussian profile has two widths: ``sigma_b``, the spread (deg) of the diffracted beam about its centre
    (spot size on the detector: beam divergence, crystal size, detector), and ``sigma_m``, the reflections' rocking
    width (deg) about the rotation axis.  As diffBragg's ``estimate_Ncells_Eta`` turns a stills model's domain size
    and mosaic angle into ``Ncells_abc`` and ``eta``, the domains' size and mosaic spread share these widths:

    * the lattice factor's width ``sigma_q`` (1/A) broadens the spot by ``lambda sigma_q`` (rad) and rocks a reflection
      at ``d*`` by ``sigma_q / d*``; it takes half the rocking variance at the typical ``dstar`` of the observed
      reflections and never more than the spot width: ``sigma_q = min(sigma_b / lambda, sigma_m d* / sqrt 2)``;
      the domain size is ``LATTICE_SIGMA_NH / sigma_q`` and ``N_i`` = size / cell length ``i``;
    * the mosaic spread carries the rest of the rocking width, ``sigma_eta^2 = sigma_m^2 - (sigma_q / d*)^2``, and
      ``-mosaic = sigma_eta / rocking_sigma_per_spread(mosaic_model)`` (:mod:`nbtorch.physics.mosaic`: the Gaussian
      model's spread is sigma_eta itself, the C's law's about twice it);
    * sampling (measured on the real L-cysteine sweep, docs/log.md): phi steps of at most a third of the
      narrowest rocking width (the reflections at ``1.5 dstar``) and at most
      :data:`refine.inputs.start_model.PHI_STEP_DEG`; an even mosaic set of
      :func:`refine.inputs.start_model.measured_mosaic_domains` domains (the random draw: ``clip(ceil(6 sigma_eta / sigma_rock),``
      :data:`MIN_DOMAINS`, :data:`MAX_DOMAINS`)); one sample per pixel where the spots are a pixel wide or more.
    """
    from nbtorch.rules.resolve import EVEN_MOSAIC_MODELS, rocking_sigma_per_spread
    from refine.inputs.start_model import PHI_STEP_DEG, measured_mosaic_domains

    profile = _profile(exp)
    if profile is None:
        return None
    sb, sm = math.radians(float(profile["sigma_b"])), math.radians(float(profile["sigma_m"]))
    wavelength = float(exp.beam["wavelength"])
    sigma_q = min(sb / wavelength, sm * dstar / math.sqrt(2.0))
    size = LATTICE_SIGMA_NH / sigma_q
    lengths = [float(np.linalg.norm(exp.crystal[k])) for k in ("real_space_a", "real_space_b", "real_space_c")]
    n_abc = tuple(max(1, round(size / x)) for x in lengths)
    eta = math.sqrt(max(sm * sm - (sigma_q / dstar) ** 2, 0.0))
    narrow = math.sqrt((sigma_q / (1.5 * dstar)) ** 2 + eta * eta)  # rocking sigma of the sharpest reflections (rad)
    step = min(PHI_STEP_DEG, math.degrees(narrow) / 3.0)
    phisteps = max(1, math.ceil(abs(osc_deg) / step - 1e-9)) if osc_deg else 1
    if eta <= 0:
        domains = 1
    elif mosaic_model in EVEN_MOSAIC_MODELS:
        domains = measured_mosaic_domains(osc_deg)
    else:
        domains = int(min(MAX_DOMAINS, max(MIN_DOMAINS, math.ceil(6.0 * eta / narrow))))
    try:
        per_spread = rocking_sigma_per_spread(mosaic_model)
    except ValueError:
        raise InputError(f"-mosaic_model: unknown model {mosaic_model!r}") from None
    return ProfileModel(N=n_abc, mosaic_deg=math.degrees(eta) / per_spread, domains=domains, mosaic_model=mosaic_model,
                        phisteps=phisteps, domain_A=size, dstar=dstar, sigma_b_deg=float(profile["sigma_b"]),
                        sigma_m_deg=float(profile["sigma_m"]), spot_px=sb * panel_distance_mm(exp) / pixel_mm(exp))


@dataclass(frozen=True)
class StillModel:
    """The starting crystal model of a still that its DIALS experiment gives (:func:`still_model`): unit cells along
    a, b, c and nanoBragg's ``-mosaic`` spread (deg), each None where the experiment does not give it, with what
    each came from."""

    N: tuple[int, int, int] | None
    mosaic_deg: float | None
    size_from: str = ""
    mosaic_from: str = ""

    def flags(self) -> dict[str, list[str]]:
        """nanoBragg flags by :data:`PROFILE_FLAGS` quantity: the size and spread known, ``-default_F 100`` and one
        sample per pixel (the thaumatin tutorial's ``-oversample 1``; DIALS's spots are wider than a pixel)."""
        out = {}
        if self.N is not None:
            out["size"] = ["-Na", str(self.N[0]), "-Nb", str(self.N[1]), "-Nc", str(self.N[2])]
        if self.mosaic_deg is not None:
            out["mosaic"] = ["-mosaic", f"{self.mosaic_deg:.6g}"]
        return {**out, "F": ["-default_F", "100"], "oversample": ["-oversample", "1"]}

    def missing(self) -> tuple[str, ...]:
        """The quantities the experiment does not give (``size``, ``mosaic``)."""
        return tuple(k for k, v in (("size", self.N), ("mosaic", self.mosaic_deg)) if v is None)

    def note(self, kept: dict[str, list[str]]) -> str:
        """The printed note of the ``kept`` flags (those ``--model`` did not replace)."""
        whence = "; ".join(w for k, w in (("size", self.size_from), ("mosaic", self.mosaic_from)) if k in kept and w)
        return (f"crystal model of the still from the DIALS experiment{' (' + whence + ')' if whence else ''}: "
                f"{' '.join(t for v in kept.values() for t in v)} (the scale is fitted; --model flags replace these)")


def still_model(exp, mosaic_model: str = "ball") -> StillModel:
    """The starting crystal model of a still (no scan) from its DIALS experiment.

    * size: the crystal's ``ML_domain_size_ang`` (the domain size of dials.stills_process's mosaic model, Sauter et
      al. 2014) as ``N_i`` = size / cell length ``i``; without it, the profile's ``sigma_b`` taken as the lattice
      factor's whole width (``sigma_q = sigma_b / lambda``, domains of ``LATTICE_SIGMA_NH / sigma_q``, the bound of
      :func:`profile_model`; a still's ``sigma_m`` is 0);
    * mosaic: the crystal's ``ML_half_mosaicity_deg`` (the half-width of the domains' misorientation) as the
      spread of nanoBragg's ball (``-mosaic``, also a half-width); another ``mosaic_model``'s spread has the ball's
      rocking width (``rocking_sigma_per_spread``, :mod:`nbtorch.physics.mosaic`)."""
    from nbtorch.rules.resolve import rocking_sigma_per_spread

    crystal = exp.crystal
    lengths = [float(np.linalg.norm(crystal[k])) for k in ("real_space_a", "real_space_b", "real_space_c")]
    size, size_from = _number(crystal.get("ML_domain_size_ang")), ""
    if size is not None:
        size_from = f"ML_domain_size_ang {size:.4g} A"
    else:
        sb = sigma_b_deg(exp)
        if sb is not None:
            size = LATTICE_SIGMA_NH * float(exp.beam["wavelength"]) / math.radians(sb)
            size_from = f"domains of {size:.0f} A from the profile's sigma_b {sb:.4g} deg"
    half = _number(crystal.get("ML_half_mosaicity_deg"), zero=True)
    mosaic = None
    if half is not None:
        try:
            mosaic = half * rocking_sigma_per_spread("ball") / rocking_sigma_per_spread(mosaic_model)
        except ValueError:
            raise InputError(f"-mosaic_model: unknown model {mosaic_model!r}") from None
    return StillModel(N=None if size is None else tuple(max(1, round(size / x)) for x in lengths),
                      mosaic_deg=mosaic, size_from=size_from,
                      mosaic_from="" if half is None else f"ML_half_mosaicity_deg {half:.4g}")


def _number(value, zero: bool = False) -> float | None:
    """A positive finite number (or zero, with ``zero``) from a JSON value; None otherwise."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and (v > 0 or (zero and v == 0)) else None


def sigma_b_deg(exp) -> float | None:
    """The experiment's profile ``sigma_b`` (deg; ``gaussian_rs``, a still's too, whose ``sigma_m`` is 0), or None."""
    profiles = exp.document.get("profile") or []
    ref = exp.document["experiment"][exp.index].get("profile")
    profile = profiles[ref] if isinstance(ref, int) and 0 <= ref < len(profiles) else None
    return _number(profile.get("sigma_b")) if isinstance(profile, dict) else None


#: the spot windows' half-width (pixels) when the experiment has no profile: the thaumatin tutorial's
WINDOW_PX_WITHOUT_PROFILE = 5


def window_half_px(exp, still: bool = False) -> tuple[int, str]:
    """The half-width (pixels) of a window that holds a DIALS spot, and why; from the profile's ``sigma_b``, else
    :data:`WINDOW_PX_WITHOUT_PROFILE`:

    * a rotation scan: ``ceil(3 sigma_b distance / pixel) + 1``, DIALS's foreground (``n_sigma`` 3) and a pixel;
    * a still (``still``): ``ceil(3 sigma_b distance / (sqrt 2 pixel))``, at least 2: three standard deviations
      along each detector axis.  DIALS's ``sigma_b`` is the rms of the whole angle between a spot's pixels and its
      centre (two axes), ``sqrt 2`` times the spread along one; on the thaumatin still (``sigma_b`` 2.0 pixels) this
      is the tutorial's hand-chosen 5.
    """
    sb = sigma_b_deg(exp)
    if sb is None:
        return WINDOW_PX_WITHOUT_PROFILE, "the experiment has no profile"
    px = math.radians(sb) * panel_distance_mm(exp) / pixel_mm(exp)
    if still:
        return (max(2, math.ceil(3.0 * px / math.sqrt(2.0) - 1e-9)),
                f"3 sigma along each axis, from the profile's sigma_b {sb:.4g} deg = {px:.3g} px")
    return math.ceil(3.0 * px) + 1, f"3 sigma_b of the profile, sigma_b {sb:.4g} deg"
