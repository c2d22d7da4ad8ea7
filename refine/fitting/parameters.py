"""Refinable parameters: names, groups, crystal-system constraints and the raw <-> physical map.

Names (names, units, groups and steps of the simulator parameters: the table in
:mod:`nbtorch.parameters`; refine's own rows, ``N`` and the nuisance parameters,
are :data:`REFINE_TABLE`; :data:`UNITS` and :data:`STEPS` are read from both):

* every canonical simulator parameter (``cell_a`` ... ``default_F``), except that
  cell values tied by the crystal system are not refined on their own;
* ``orient_x orient_y orient_z`` (deg): a small crystal rotation about the lab
  axes applied on top of the starting misset (``R = Rz Ry Rx`` of these angles,
  left-multiplied onto the misset rotation); reported back as ``misset_x/y/z``;
* ``N``: one isotropic crystal size; ``N_a N_b N_c`` are multiplied by the common
  factor ``N / N_start`` (``N_start`` = geometric mean of the starting values).
  Naming ``N_a``/``N_b``/``N_c`` anywhere refines them separately instead; ``N`` scales the off-diagonal
  sizes ``N_d N_e N_f`` by the same factor where they are not refined themselves (the crystal keeps its shape);
* ``N_d N_e N_f`` (unit cells): the off-diagonal terms of the symmetric size matrix of ``-gauss_aniso_xtal``
  (group ``Ndef``, as cctbx diffBragg's Ndef); refined only with that shape;
* nuisance parameters of the image model
  ``model = scale * simulator image + background [+ background_x * (x - xc) + background_y * (y - yc)]``:
  ``scale`` (dimensionless), ``background`` (photons/pixel; a detector
  pedestal such as the SMV ADC offset of 40 is just background) and, with
  ``background="planar"``, ``background_x``/``background_y`` (photons/pixel per pixel along
  fast x and slow y, measured from the image centre ``xc, yc``);
* with ``background="resolution:K"`` the knot values ``background_0 .. background_{K-1}`` (photons/pixel) of a
  linear spline in 1/d replace ``background`` (:mod:`refine.fitting.background`; ``planes`` holds a plane per
  spot window and refines ``background`` outside the windows).

Groups (expanded with the crystal system, see :data:`SYMMETRIES`):

==============  ===========================================================
group           names
==============  ===========================================================
``cell``        the free cell values of the crystal system
``orientation`` ``orient_x orient_y orient_z``
``mosaic``      ``mosaic_spread`` and ``N`` (or ``N_a N_b N_c``); with an anisotropic mosaic
                ``mosaic_spread_a mosaic_spread_b mosaic_spread_c`` in place of ``mosaic_spread``
``mosaic_aniso`` ``mosaic_spread_a mosaic_spread_b mosaic_spread_c`` and ``N`` (or ``N_a N_b N_c``): the
                anisotropic mosaic (``-mosaic_abc``, :mod:`nbtorch.physics.mosaic`), which the simulator must
                use (``nbtorch-refine`` turns it on when these names are refined)
``Ndef``        ``N_d N_e N_f`` (``-gauss_aniso_xtal`` only)
``detector``    ``distance beam_x beam_y detector_rotx detector_roty detector_rotz twotheta``
``beam_centre`` ``beam_x beam_y``
``wavelength``  ``wavelength``
``beam``        the beam's widths the model has sources for: ``dispersion`` (%, full spectral width),
                ``divergence_h``, ``divergence_v`` (mrad, full ranges); the model's ``-dispsteps``/``-divsteps``
                ... keep the number of sources (one source along a width: that width cannot be refined)
``scale``       ``scale``
``background``  ``background`` (+ ``background_x background_y`` when planar; ``background_0 ..`` with
                resolution:K)
``structure_factors``  one amplitude ``F_h_k_l`` per visible symmetry-unique reflection
                (:mod:`refine.fitting.structure_factors`; the run's table decides which)
==============  ===========================================================

Transforms (one raw unit is a typical refinement step, so LBFGS and Adam can
use one step size for all; raw 0 is the starting value except for the
softplus and sigmoid transforms): lengths, ``N``, mosaic spread, wavelength,
fluence, ``default_F`` and ``scale`` are positive, ``Multiplicative(v, step)``
(``value = v * exp(step * raw)``); angles and the beam centre are
``Identity(step, v)`` (one raw unit of ``beam_x``/``beam_y`` is one pixel), and so are ``N_d N_e N_f``
(0.5 unit cells);
``background`` is ``Positive(max(v, 1))`` (softplus: a negative background would
let a misplaced model subtract intensity between its spots); the planar
background slopes are ``Identity``; a knot ``background_<k>`` is ``Positive`` like ``background``; the Kahn factor is ``Bounded(-1, 1)``; a
user bound ``(lo, hi)`` gives ``Bounded(lo, hi)``; an amplitude ``F_h_k_l`` is
``Multiplicative(F_start, step of default_F, AMPLITUDE_LIMIT)`` (positive by construction, within 10^4 of its start).  The steps are in :data:`STEPS`.
"""

from __future__ import annotations

import math
import re
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, MutableMapping, Sequence

import torch
from torch import Tensor

from nbtorch.sampling.beam_sources import WIDTH_NAMES
from nbtorch.errors import InputError
from nbtorch.geometry.rotation import rotation_matrix_xyz
from nbtorch.parameters import (
    CELL_NAMES, EXTRA_TABLE, MOSAIC_AXIS_NAMES, ORIENTATION_DELTAS, PARAMETER_NAMES, SIMULATOR_NAMES, SIZE_DIAGONAL,
    SIZE_OFF_DIAGONAL, TABLE, Parameter, names_in_group,
)
from nbtorch.rules.resolve import check_cell, check_size_matrix
from refine.fitting.amplitude_values import AmplitudeBlock, AmplitudeValues, shared_layer
from refine.fitting.background import is_knot, parse_background
from refine.fitting.structure_factors import AMPLITUDE_BLOCK, AMPLITUDE_LIMIT, is_amplitude
from refine.fitting.transforms import Bounded, Identity, Multiplicative, Positive, SharedHead, Transform
from nbtorch.geometry.panels import split_panel_parameter


__all__ = [
    "REFINE_TABLE", "NUISANCE", "BASE_NAMES", "REFINABLE", "UNITS", "SYMMETRIES", "GROUPS", "STEPS",
    "ParameterSpace", "ParameterMap", "constrained_cell", "misset_after_rotation", "canonical_values",
    "misset_rotation", "misset_from_rotation", "units_of", "check_widths", "is_panel_name", "split_group_change", "PANEL_SHIFTS",
]
_GROUP_CHANGE = re.compile(r"^(?P<base>[a-z_]+)_g(?P<k>0|[1-9][0-9]*)$")

#: refine's own rows of the parameter table (:class:`nbtorch.parameters.Parameter`): the
#: isotropic crystal size ``N`` and the nuisance parameters of the image model
REFINE_TABLE: tuple[Parameter, ...] = (
    Parameter("N", "unit cells", "crystal", "relative", 0.05, "isotropic crystal size (scales N_a N_b N_c)"),
    Parameter("scale", "1", "nuisance", "relative", 0.5, "model = scale x simulated image + background"),
    Parameter("background", "photons/pixel", "nuisance", "absolute", None, "constant background (softplus)"),
    Parameter("background_x", "photons/pixel^2", "nuisance", "absolute", 0.01, "background slope along fast x"),
    Parameter("background_y", "photons/pixel^2", "nuisance", "absolute", 0.01, "background slope along slow y"),
)
NUISANCE = tuple(p.name for p in REFINE_TABLE if p.group == "nuisance")
#: every value a refinement state holds (canonical, orientation delta, nuisance)
BASE_NAMES = SIMULATOR_NAMES + NUISANCE
#: every name that may be refined (``N`` is the isotropic crystal size)
REFINABLE = BASE_NAMES + ("N",)
CELL = CELL_NAMES

_ROWS = {p.name: p for p in TABLE + EXTRA_TABLE + REFINE_TABLE}
#: name -> unit of every refinable name (the simulator's table plus refine's rows)
UNITS = {n: _ROWS[n].unit for n in REFINABLE}



def check_widths(values: Mapping[str, float]) -> None:
    """Raise if a beam width of ``values`` (``dispersion``, ``divergence_h``, ``divergence_v``) is negative."""
    for n in WIDTH_NAMES:
        v = float(values.get(n, 0.0))
        if not v >= 0:
            raise InputError(f"start: {n}={v:g} is impossible (a width must be >= 0)")


def units_of(names: Iterable[str]) -> dict[str, str]:
    """``name -> unit`` (:data:`UNITS`; a background knot: photons/pixel; a per-panel name or panel-group change:
    its detector name's) for each name that has one, in first-seen order (result files)."""
    out = {}
    for n in names:
        base = (split_panel_parameter(n) or split_group_change(n) or (None,))[0]
        if n in UNITS or is_knot(n) or base is not None:
            out[n] = UNITS[n] if n in UNITS else UNITS[base] if base is not None else "photons/pixel"
    return out


#: what the model needs for a beam width to be refinable (its flags)
WIDTH_NEEDS = {"dispersion": "-dispersion > 0 and -dispsteps > 1",
               "divergence_h": "-hdivrange (or -divergence) > 0 and -hdivsteps (or -divsteps) > 1",
               "divergence_v": "-vdivrange (or -divergence) > 0 and -vdivsteps (or -divsteps) > 1"}
NO_WIDTHS = ("the model's beam has one source (no -dispersion/-dispsteps, -divergence/-divsteps): no width to "
             "refine")


#: free cell values per crystal system (monoclinic: unique axis b; trigonal/hexagonal: hexagonal axes)
SYMMETRIES = {
    "triclinic": CELL,
    "monoclinic": ("cell_a", "cell_b", "cell_c", "cell_beta"),
    "orthorhombic": ("cell_a", "cell_b", "cell_c"),
    "tetragonal": ("cell_a", "cell_c"),
    "trigonal": ("cell_a", "cell_c"),
    "hexagonal": ("cell_a", "cell_c"),
    "rhombohedral": ("cell_a", "cell_alpha"),
    "cubic": ("cell_a",),
}

GROUPS = {
    "cell": None,  # depends on the crystal system
    "orientation": ORIENTATION_DELTAS,
    "mosaic": None,  # mosaic_spread (or mosaic_spread_a/b/c when anisotropic) + N or N_a N_b N_c
    "mosaic_aniso": None,  # mosaic_spread_a/b/c + N or N_a N_b N_c (an anisotropic mosaic)
    "Ndef": SIZE_OFF_DIAGONAL,  # the off-diagonal sizes of -gauss_aniso_xtal
    "detector": names_in_group("detector"),
    "beam_centre": ("beam_x", "beam_y"),
    "wavelength": ("wavelength",),
    "beam": None,  # the beam's widths with sources along them (ParameterSpace.beam_widths)
    "scale": ("scale",),
    "background": None,  # background (+ background_x, background_y when planar)
    "structure_factors": None,  # the amplitudes of the run's table (ParameterSpace.amplitudes)
    "panels": None,  # a multi-panel detector: distance_g<k> beam_x_g<k> beam_y_g<k> of every panel group
}
#: the names a group ``panels`` frees for each panel group (a rigid shift of the group along its axes and normal)
PANEL_SHIFTS = ("distance", "beam_x", "beam_y")

#: (kind, step): "mul" = Multiplicative(v, step) (relative step), "add" = Identity(step, v), from the table's
#: step columns; ``polarization`` is always ``Bounded(-1, 1)`` and has none
STEPS: dict[str, tuple[str, float | None]] = {
    n: ("mul" if _ROWS[n].step_kind == "relative" else "add", _ROWS[n].step) for n in REFINABLE if n != "polarization"
}


def constrained_cell(symmetry: str, v: Mapping[str, Tensor | float]) -> dict[str, Tensor | float]:
    """The six cell values implied by the free ones of ``symmetry`` (``v`` holds at least those)."""
    a, b, c = v["cell_a"], v["cell_b"], v["cell_c"]
    al, be, ga = v["cell_alpha"], v["cell_beta"], v["cell_gamma"]
    if symmetry == "triclinic":
        pass
    elif symmetry == "monoclinic":
        al = ga = 90.0
    elif symmetry == "orthorhombic":
        al = be = ga = 90.0
    elif symmetry == "tetragonal":
        b, al, be, ga = a, 90.0, 90.0, 90.0
    elif symmetry in ("trigonal", "hexagonal"):
        b, al, be, ga = a, 90.0, 90.0, 120.0
    elif symmetry == "rhombohedral":
        b = c = a
        be = ga = al
    elif symmetry == "cubic":
        b = c = a
        al = be = ga = 90.0
    else:
        raise InputError(f"symmetry: unknown crystal system {symmetry!r}; valid: {', '.join(SYMMETRIES)}")
    return {"cell_a": a, "cell_b": b, "cell_c": c, "cell_alpha": al, "cell_beta": be, "cell_gamma": ga}


def misset_rotation(angles: Tensor) -> Tensor:
    """``Rz Ry Rx`` (3, 3) of misset angles ``(rx, ry, rz)`` in degrees (the simulator's convention)."""
    r = torch.as_tensor(angles, dtype=torch.float64) * (math.pi / 180.0)
    return rotation_matrix_xyz(r[..., 0], r[..., 1], r[..., 2])


def misset_from_rotation(R: Tensor, near: Tensor) -> Tensor:
    """Angles (deg, (3,)) with ``Rz Ry Rx = R``; of the two solutions, the one nearest ``near`` (deg)."""
    deg = 180.0 / math.pi
    ry = torch.atan2(-R[2, 0], torch.sqrt(R[0, 0] ** 2 + R[1, 0] ** 2))
    rx = torch.atan2(R[2, 1], R[2, 2])
    rz = torch.atan2(R[1, 0], R[0, 0])
    first = torch.stack([rx, ry, rz]) * deg
    second = torch.stack([first[0] + 180.0, 180.0 - first[1], first[2] + 180.0])
    best = None
    for cand in (first, second):
        wrapped = cand - 360.0 * torch.round((cand - near) / 360.0)  # nearest 360-degree branch
        dist = float((wrapped.detach() - near).abs().sum())
        if best is None or dist < best[0]:
            best = (dist, wrapped)
    return best[1]


def misset_after_rotation(misset_deg: Tensor, orient_deg: Tensor) -> Tensor:
    """Misset angles (deg, (3,)) of ``R(orient) @ R(misset)`` (both ``Rz Ry Rx``), nearest the input misset.

    Differentiable in both arguments (away from gimbal lock, ``|misset_y| = 90``).
    """
    misset_deg = torch.as_tensor(misset_deg, dtype=torch.float64)
    orient_deg = torch.as_tensor(orient_deg, dtype=torch.float64)
    R = misset_rotation(orient_deg) @ misset_rotation(misset_deg)
    return misset_from_rotation(R, misset_deg.detach())


def canonical_values(values: Mapping[str, float]) -> dict[str, float]:
    """Canonical parameters (plus nuisance) of a state, with the orientation delta folded into the misset."""
    out = {n: float(values[n]) for n in PARAMETER_NAMES}
    orient = torch.tensor([float(values.get(n, 0.0)) for n in ORIENTATION_DELTAS], dtype=torch.float64)
    if bool((orient != 0).any()):
        misset = torch.tensor([out["misset_x"], out["misset_y"], out["misset_z"]], dtype=torch.float64)
        m = misset_after_rotation(misset, orient)
        out["misset_x"], out["misset_y"], out["misset_z"] = (float(x) for x in m)
    for n in NUISANCE:
        if n in values:
            out[n] = float(values[n])
    out.update({n: float(v) for n, v in values.items() if is_knot(n)})  # a resolution background's knots
    out.update({n: float(v) for n, v in values.items() if is_panel_name(n)})  # a multi-panel detector's geometry
    return out


def is_panel_name(name: str) -> bool:
    """A multi-panel detector's per-panel geometry name ``<name>_p<i>`` or panel-group change ``<name>_g<k>``."""
    return split_panel_parameter(name) is not None or split_group_change(name) is not None


def split_group_change(name: str) -> tuple[str, int] | None:
    """``(detector name, group)`` of a panel-group change ``<name>_g<k>`` (``beam_x_g1`` -> ``("beam_x", 1)``)."""
    m = _GROUP_CHANGE.match(name)
    return (m["base"], int(m["k"])) if m is not None and m["base"] in GROUPS["detector"] else None


@dataclass(frozen=True)
class ParameterSpace:
    """Run-wide rules for turning names and groups into refinable parameters.

    Arguments:
        symmetry: crystal system (a key of :data:`SYMMETRIES`).
        anisotropic_N: refine ``N_a N_b N_c`` separately (group ``mosaic`` then holds them).
        background: ``"constant"``, ``"planar"``, ``"resolution:K"`` or ``"planes"``
            (:func:`refine.fitting.background.parse_background`).
        bounds: name -> (low, high) in physical units: a ``Bounded`` transform.
        fixed: names or groups never refined.
        pixel_mm: pixel size; one raw unit of ``beam_x``/``beam_y`` is one pixel.
        amplitudes: the refinable amplitudes' names (``F_h_k_l``, :mod:`refine.fitting.structure_factors`): the group
            ``structure_factors``; none without a table.
        panel_groups: a multi-panel detector's panel groups (panel indices; empty for one panel): the detector
            names (``distance``, ``beam_x`` ... and the groups ``detector``, ``beam_centre``, ``panels``) then
            stand for the rigid-body changes ``<name>_g<k>`` of every group ``k`` (mm or deg, starting at 0),
            added to the per-panel values ``<name>_p<i>`` of its panels (:class:`ParameterMap`).
        n_panels: the detector's panels (their per-panel values are carried in every state).
        anisotropic_mosaic: the simulator's mosaic has one spread per crystal axis (``-mosaic_abc``): the group
            ``mosaic`` and the name ``mosaic_spread`` stand for ``mosaic_spread_a/b/c``; without it those three
            names are refused (the isotropic model does not use them).
        beam_widths: the beam's widths the model has sources along (:meth:`nbtorch.Simulator.source_width_names`):
            the group ``beam``; refining another width is an error.
    """

    symmetry: str = "triclinic"
    anisotropic_N: bool = False
    background: str = "constant"
    bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    fixed: tuple[str, ...] = ()
    pixel_mm: float = 0.1
    amplitudes: tuple[str, ...] = ()
    panel_groups: tuple[tuple[int, ...], ...] = ()
    n_panels: int = 0
    beam_widths: tuple[str, ...] = WIDTH_NAMES
    anisotropic_mosaic: bool = False

    @property
    def group_changes(self) -> tuple[str, ...]:
        """Every panel-group change name ``<name>_g<k>``, group by group (none for one panel)."""
        return tuple(f"{n}_g{k}" for k in range(len(self.panel_groups)) for n in GROUPS["detector"])

    @property
    def panel_values(self) -> tuple[str, ...]:
        """Every per-panel geometry name ``<name>_p<i>`` (none for one panel)."""
        return tuple(f"{n}_p{i}" for i in range(self.n_panels) for n in GROUPS["detector"])

    def __post_init__(self) -> None:
        if self.symmetry not in SYMMETRIES:
            raise InputError(f"symmetry: unknown crystal system {self.symmetry!r}; valid: {', '.join(SYMMETRIES)}")
        object.__setattr__(self, "knots", parse_background(self.background).names)
        for name, bound in self.bounds.items():
            if name not in REFINABLE:
                raise InputError(f"bounds: unknown parameter {name!r}")
            lo, hi = (float(x) for x in bound)
            if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
                raise InputError(f"bounds: {name}: need finite low < high, got {bound!r}")
        object.__setattr__(self, "_fixed", frozenset(self._expand_raw(self.fixed, check_cell=False)))

    # -- names ------------------------------------------------------------------------
    def group(self, name: str) -> tuple[str, ...]:
        """The names of group ``name`` under this space's rules."""
        if name == "cell":
            return SYMMETRIES[self.symmetry]
        if name in ("mosaic", "mosaic_aniso"):
            spread = MOSAIC_AXIS_NAMES if self.anisotropic_mosaic or name == "mosaic_aniso" else ("mosaic_spread",)
            return spread + (("N_a", "N_b", "N_c") if self.anisotropic_N else ("N",))
        if name == "background":
            if self.knots:  # type: ignore[attr-defined]
                return self.knots  # type: ignore[attr-defined]
            return ("background",) + (("background_x", "background_y") if self.background == "planar" else ())
        if name == "structure_factors":
            return tuple(self.amplitudes)
        if name == "beam":
            return tuple(self.beam_widths)
        if name == "panels":
            if not self.panel_groups:
                raise InputError("panels: the panel-group changes of a multi-panel detector; this detector has one "
                                 "panel (refine detector or its names)")
            return PANEL_SHIFTS
        return GROUPS[name]

    def _expand_raw(self, items: Iterable[str], check_cell: bool = True) -> list[str]:
        if isinstance(items, str):
            items = (items,)
        out: list[str] = []
        for item in items:
            if item == "beam" and check_cell and not self.beam_widths:
                raise InputError(f"beam: {NO_WIDTHS}")
            if item in GROUPS:
                names = self.group(item)
            elif item in REFINABLE or item in self.amplitudes or item in self.knots:  # type: ignore[attr-defined]
                names = (item,)
            elif item in self.group_changes:
                names = (item,)
            elif is_amplitude(item):
                raise InputError(f"{item}: not a refinable amplitude of this run (refine the group structure_factors "
                                 f"with a space group; only reflections the fitted pixels see are free)")
            else:
                raise InputError(f"unknown parameter or group {item!r}; groups: {', '.join(GROUPS)}; "
                                 f"names: {', '.join(REFINABLE)}")
            for n in names:
                if check_cell and n in CELL and n not in SYMMETRIES[self.symmetry]:
                    raise InputError(f"{n} is not a free cell value for symmetry {self.symmetry!r} "
                                     f"(free: {', '.join(SYMMETRIES[self.symmetry])})")
                if check_cell and n in WIDTH_NAMES and n not in self.beam_widths:
                    raise InputError(f"refining {n} needs {WIDTH_NEEDS[n]} in the model (it has one source along it)")
                if n == "N" and self.anisotropic_N:
                    n_list: tuple[str, ...] = ("N_a", "N_b", "N_c")
                elif n in ("N_a", "N_b", "N_c") and not self.anisotropic_N:
                    n_list = ("N",)
                elif n in ("misset_x", "misset_y", "misset_z"):
                    n_list = ORIENTATION_DELTAS  # the misset is refined as a small rotation on top
                elif n == "mosaic_spread" and self.anisotropic_mosaic:
                    n_list = MOSAIC_AXIS_NAMES  # the anisotropic model's spreads
                elif n in MOSAIC_AXIS_NAMES and not self.anisotropic_mosaic:
                    raise InputError(f"{n}: the model's mosaic is isotropic (one mosaic_spread); give -mosaic_abc "
                                     "in the model flags for one spread per crystal axis")
                elif self.panel_groups and n in GROUPS["detector"]:  # every group's change of the name
                    n_list = tuple(f"{n}_g{k}" for k in range(len(self.panel_groups)))
                else:
                    n_list = (n,)
                out.extend(x for x in n_list if x not in out)
        return out

    def expand(self, items: Iterable[str]) -> tuple[str, ...]:
        """Refinable names of ``items`` (names or groups), fixed ones removed, in :data:`REFINABLE` order, then
        the amplitudes in the table's order."""
        names = set(self._expand_raw(items)) - self._fixed  # type: ignore[attr-defined]
        return tuple(n for n in self.all_names if n in names)

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every name this space may refine, in order: :data:`REFINABLE`, the background's knots, the amplitudes."""
        return REFINABLE + self.knots + self.group_changes + tuple(self.amplitudes)  # type: ignore[attr-defined]

    def check_start(self, values: Mapping[str, float]) -> None:
        """Raise if the starting cell breaks the crystal system, or a value cannot start a refinement."""
        check_cell(tuple(float(values[n]) for n in CELL), "start: cell")
        spreads = ("mosaic_spread",) + MOSAIC_AXIS_NAMES
        for n in ("distance", "wavelength", "N_a", "N_b", "N_c") + spreads:
            v = float(values.get(n, 1.0))
            if not (v > 0 or (n in spreads and v == 0)):
                raise InputError(f"start: {n}={v:g} is impossible (must be {'>= 0' if n in spreads else '> 0'})")
        if any(float(values.get(n, 0.0)) != 0.0 for n in SIZE_OFF_DIAGONAL):
            check_size_matrix([values[n] for n in SIZE_DIAGONAL + SIZE_OFF_DIAGONAL], "start: N_a .. N_f")
        check_widths(values)
        implied = constrained_cell(self.symmetry, values)
        for n in CELL:
            if abs(float(implied[n]) - float(values[n])) > 1e-6 * max(1.0, abs(float(values[n]))):
                raise InputError(f"start: {n}={values[n]:g} breaks the {self.symmetry} constraints "
                                 f"(expected {float(implied[n]):g}); fix the starting cell or the symmetry")

    # -- transforms -------------------------------------------------------------------
    def transform(self, name: str, value: float) -> Transform:
        """The transform of refinable ``name`` starting at ``value`` (raw 0 = ``value``)."""
        v = float(value)
        if not math.isfinite(v):
            raise InputError(f"start: {name} must be finite, got {value!r}")
        if name in self.bounds:
            lo, hi = (float(x) for x in self.bounds[name])
            if not lo < v < hi:
                raise InputError(f"start: {name}={v:g} is outside its bounds ({lo:g}, {hi:g})")
            return Bounded(lo, hi)
        if is_knot(name):  # photons/pixel, positive like the flat background
            return Positive(max(abs(v), 1.0))
        group_change = split_group_change(name)
        if group_change is not None:  # one raw unit: one pixel of shift, or the rotation's step
            base = group_change[0]
            return Identity(self.pixel_mm if base in PANEL_SHIFTS else STEPS[base][1], v)
        if name == "polarization":
            if not -1.0 < v < 1.0:
                raise InputError(f"start: polarization must be inside (-1, 1) to be refined, got {v:g}")
            return Bounded(-1.0, 1.0)
        kind, step = STEPS["default_F" if is_amplitude(name) else name]
        if kind == "mul":
            if not v > 0:
                raise InputError(f"start: {name} must be > 0 to be refined, got {v:g}")
            return Multiplicative(v, step, AMPLITUDE_LIMIT if is_amplitude(name) else None)
        if name in ("beam_x", "beam_y"):
            step = self.pixel_mm
        elif name == "background":
            # photons (and a pedestal) are never negative; a negative background would let a
            # badly placed model "subtract" intensity between its spots
            return Positive(max(abs(v), 1.0))
        return Identity(step, v)


class ParameterMap:
    """Raw vector (P,) <-> physical values of the free names, and the full state they imply.

    Arguments:
        space: the run's :class:`ParameterSpace`.
        values: the state at raw = 0: every name of :data:`BASE_NAMES` (and the space's amplitudes) -> float;
            values :func:`~refine.fitting.amplitude_values.layered` on a process's shared starting amplitudes are
            read from that one copy (``self.values`` is then a ``ChainMap``), other amplitudes are copied.
        names: the free refinable names (from :meth:`ParameterSpace.expand`).
        share: ``(other map, names)``: those names take ``other``'s transform objects where they start at the same
            value there (a joint run's images: one object per shared name in a process, not one per name and
            image; each transform is a module of ~2 kB, and thousands of shared amplitudes made and dropped per
            image left most of a held still's memory behind).

    ``expand(physical(raw))`` gives every base value: free ones as tensors (with
    gradients), the others as floats, the cell constraints and the isotropic
    ``N`` applied.
    """

    def __init__(self, space: ParameterSpace, values: Mapping[str, float], names: Sequence[str],
                 share: tuple["ParameterMap", Collection[str]] | None = None) -> None:
        extra = space.knots + space.group_changes + space.panel_values  # type: ignore[attr-defined]
        amplitudes = tuple(space.amplitudes)
        missing = [n for n in BASE_NAMES + extra + amplitudes if n not in values]
        if missing:
            raise InputError(f"values: missing {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        self.space = space
        own = {n: float(values[n]) for n in BASE_NAMES + extra}
        # the amplitudes' starts: the process's one shared layer when the values are layered on it, else a copy
        self._amplitudes = None if not amplitudes else (
            shared_layer(values, amplitudes) or AmplitudeValues({n: float(values[n]) for n in amplitudes}))
        self.values = own if self._amplitudes is None else ChainMap(own, self._amplitudes)
        self.names = tuple(names)
        self.n0 = (self.values["N_a"] * self.values["N_b"] * self.values["N_c"]) ** (1.0 / 3.0)
        self.transforms = self._transforms(share)
        # each panel's value less its group's change: a state's per-panel values always include the changes
        self.panel_base = {f"{n}_p{i}": (k, self.values[f"{n}_p{i}"] - self.values[f"{n}_g{k}"])
                           for k, members in enumerate(space.panel_groups) for i in members for n in GROUPS["detector"]}

    def _transforms(self, share: tuple["ParameterMap", Collection[str]] | None) -> Sequence[Transform]:
        """Each free name's transform: ``share``'s object where the rule of the class docstring allows, else new.
        When the leading names all take ``share``'s objects at the same places (a joint run's shared names), the
        list itself is shared too (:class:`SharedHead`: 8 bytes a name and map less, 10^4 amplitudes)."""
        if share is None:
            return [self.space.transform(n, self.start_value(n)) for n in self.names]
        other, names = share
        theirs = dict(zip(other.names, other.transforms))
        mine = [theirs[n] if n in names and n in theirs and other.start_value(n) == self.start_value(n)
                else self.space.transform(n, self.start_value(n)) for n in self.names]
        return SharedHead.over(other.transforms, mine)

    def start_value(self, name: str) -> float:
        """Physical value of refinable ``name`` where the stage starts (``raw0``)."""
        if name == "N":
            return self.n0
        if name == "background" or is_knot(name):
            return max(self.values[name], 1e-6)  # the positive transform needs a start > 0
        return self.values[name]

    def raw0(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """Raw vector (P,) of the starting values (zeros except for bounded parameters)."""
        return self.raw_from({n: self.start_value(n) for n in self.names}, dtype)

    def raw_from(self, physical: Mapping[str, float], dtype: torch.dtype = torch.float64) -> Tensor:
        """Raw vector (P,) for physical values of the free names."""
        return torch.stack([tr.inverse(torch.tensor(float(physical[n]), dtype=dtype))
                            for n, tr in zip(self.names, self.transforms)]) if self.names else torch.zeros(0, dtype=dtype)

    def physical(self, raw: Tensor) -> dict[str, Tensor]:
        """Free name -> physical value (0-d tensor, differentiable in ``raw``)."""
        return {n: tr(raw[i]) for i, (n, tr) in enumerate(zip(self.names, self.transforms))}

    def _amplitude_block(self) -> AmplitudeBlock | None:
        """The free amplitudes as one :class:`~refine.fitting.amplitude_values.AmplitudeBlock` when they are one
        contiguous run of :class:`Multiplicative` transforms of one step and limit (a refinement's), else None;
        found once."""
        if not hasattr(self, "_block"):
            idx = [i for i, n in enumerate(self.names) if is_amplitude(n)]
            trs = [self.transforms[i] for i in idx]
            ok = (self._amplitudes is not None and len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1))
                  and all(type(t) is Multiplicative for t in trs) and len({(t.step, t.limit) for t in trs}) == 1)
            self._block = None if not ok else AmplitudeBlock(
                self.names, idx[0], idx[-1] + 1, trs[0].step, trs[0].limit, tuple(self.space.amplitudes),
                self._amplitudes)
        return self._block

    def physical_vector(self, raw: Tensor) -> Tensor:
        """(P,) every free name's physical value in ``raw``'s order, differentiable (the amplitudes' run as one
        operation: :func:`refine.solver.precondition.physical_per_raw` of thousands of amplitudes)."""
        block = self._amplitude_block()
        if block is None:
            return torch.stack(list(self.physical(raw).values())) if self.names else raw.new_zeros(0)
        a, b = block.start, block.stop
        before = [self.transforms[i](raw[i]).reshape(1) for i in range(a)]
        after = [self.transforms[i](raw[i]).reshape(1) for i in range(b, len(self.names))]
        return torch.cat(before + [block.free(raw)] + after)

    def physical_block(self, raw: Tensor) -> dict:
        """:meth:`physical` with the amplitudes as one vector, ``AMPLITUDE_BLOCK -> (names, (A,) tensor)`` of every
        amplitude of the space in the table's order, the free ones from ``raw`` (one operation for thousands of
        amplitudes instead of one per name; the same formula as :class:`Multiplicative`), the held ones at their
        starts: an evaluation (a joint run's :meth:`refine.many.joint_images.Joint.rows`, a stage's
        :func:`refine.solver.runner.stage_function`), read by
        :meth:`refine.fitting.structure_factors.AmplitudeTable.vector`.  Without such a run of amplitudes,
        :meth:`physical`."""
        block = self._amplitude_block()
        if block is None:
            return self.physical(raw)
        a, b = block.start, block.stop
        out: dict = {self.names[i]: self.transforms[i](raw[i]) for i in (*range(a), *range(b, len(self.names)))}
        out[AMPLITUDE_BLOCK] = (block.names, block.every(raw))
        return out

    def expand(self, physical: Mapping[str, Tensor | float]) -> MutableMapping[str, Tensor | float]:
        """Every base value given physical values of (some) refinable names (with amplitudes in the space: a
        :class:`~collections.ChainMap` over the shared starts, :mod:`refine.fitting.amplitude_values`)."""
        out: MutableMapping[str, Tensor | float] = (
            dict(self.values) if self._amplitudes is None else ChainMap(dict(self.values.maps[0]), self._amplitudes))
        for n, v in physical.items():
            if n == "N":  # the whole size matrix, but off-diagonal terms refined themselves
                factor = v / self.n0
                for k in SIZE_DIAGONAL + tuple(k for k in SIZE_OFF_DIAGONAL if k not in physical):
                    out[k] = self.values[k] * factor
            else:
                out[n] = v
        out.update(constrained_cell(self.space.symmetry, out))
        for name, (k, base) in self.panel_base.items():
            out[name] = base + out[f"{name.rsplit('_p', 1)[0]}_g{k}"]
        return out

    def values_at(self, raw: Tensor) -> dict[str, float]:
        """Every base value (floats) at ``raw``."""
        with torch.no_grad():
            return {n: float(v) for n, v in self.expand(self.physical(raw.detach())).items()}

    def physical_floats(self, raw: Tensor) -> dict[str, float]:
        with torch.no_grad():
            return {n: float(v) for n, v in self.physical(raw.detach()).items()}
