"""A detector of several flat panels: one crystal and one beam seen by N panels, rendered in one call.

A multi-panel simulator (:meth:`nbtorch.Simulator.from_panels`) is built from N complete nanoBragg
configurations, one per panel: panel ``i`` is exactly the single-panel run of ``configs[i]`` (its own
convention, fast/slow/normal axes, pivot, beam centre, distance, rotations, pixel size, pixel counts,
``-roi`` and ``-mask``).  Everything else (crystal, beam, sources, sampling, sensor, structure factors,
kernel options) is shared and must be the same in every configuration: :func:`resolve_panels` refuses a
difference, naming the panel and the value.

Image layout (the "stacked" image every method of the simulator sees)
    The panels are stacked along the slow axis in list order, each in a block of ``rows`` x ``cols``
    pixels (the tallest and the widest panel): panel ``i``'s pixel (slow ``j``, fast ``k``) is the stacked
    pixel (``i * rows + j``, ``k``).  Block pixels outside a smaller panel, outside a panel's ``-roi`` or
    excluded by its ``-mask`` are never computed and render as exactly 0 (the simulator's own mask,
    :attr:`PanelLayout.mask`).  :meth:`PanelLayout.panel_image` cuts panel ``i`` out again.

Canonical names
    Each panel's geometry has the names of the ``detector`` group (:data:`PANEL_GEOMETRY_NAMES`:
    ``distance, beam_x, beam_y, detector_rotx, detector_roty, detector_rotz, twotheta``) with the suffix
    ``_p<i>`` (:func:`panel_parameter`): ``distance_p3`` is panel 3's ``distance`` in mm, with the units,
    frame and signs of the single-panel name in panel 3's own convention (``docs/multi-panel.md``).  The
    plain detector names are not used by a multi-panel simulator (an override of one is refused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from nbtorch.cli.args import config_from_args
from nbtorch.geometry.beam_centre import ORG_CONVENTIONS, beam_centre_flags, beam_centre_from_offsets_m, detector_offsets_m
from nbtorch.config import SimulationConfig
from nbtorch.errors import InputError
from nbtorch.parameters import names_in_group
from nbtorch.rules.resolve import DetectorSetup, Setup, resolve

__all__ = ["PANEL_GEOMETRY_NAMES", "PanelSetup", "PanelLayout", "panel_parameter", "split_panel_parameter",
           "resolve_panels", "check_rigid_group", "group_overrides",
           "module_configs"]

#: the per-panel geometry names (the ``detector`` group of :mod:`nbtorch.parameters`)
PANEL_GEOMETRY_NAMES: tuple[str, ...] = names_in_group("detector")
_SUFFIX = re.compile(r"^(?P<base>[a-z_]+)_p(?P<index>0|[1-9][0-9]*)$")
#: sampling and sensor fields every panel must share (the per-pixel sums and their normalisation)
_SHARED_COUNTS = ("oversample", "phisteps", "thicksteps", "steps")


def panel_parameter(name: str, index: int) -> str:
    """The canonical name of panel ``index``'s geometry value ``name`` (``distance`` -> ``distance_p3``)."""
    if name not in PANEL_GEOMETRY_NAMES:
        raise KeyError(f"{name!r} is not a panel geometry name; expected one of {', '.join(PANEL_GEOMETRY_NAMES)}")
    return f"{name}_p{int(index)}"


def split_panel_parameter(name: str) -> tuple[str, int] | None:
    """``(base name, panel index)`` of a per-panel name (``beam_x_p12`` -> ``("beam_x", 12)``), else None."""
    m = _SUFFIX.match(name)
    if m is None or m["base"] not in PANEL_GEOMETRY_NAMES:
        return None
    return m["base"], int(m["index"])


@dataclass(frozen=True)
class PanelSetup:
    """One panel: its name, its resolved detector (axes, pivot, pixels, ROI) and its geometry values."""

    name: str
    detector: DetectorSetup
    params: dict  # base geometry name -> value (canonical units: mm, deg)
    pixel_mask: np.ndarray | None  # the panel's own -mask (spixels, fpixels), True = simulate


@dataclass(frozen=True)
class PanelLayout:
    """The panels of a multi-panel simulator and where their pixels lie in the stacked image."""

    panels: tuple[PanelSetup, ...]
    rows: int  # rows of one panel block (the tallest panel)
    cols: int  # columns of the stacked image (the widest panel)

    @property
    def shape(self) -> tuple[int, int]:
        """Stacked image shape (slow, fast)."""
        return (len(self.panels) * self.rows, self.cols)

    @property
    def mask(self) -> np.ndarray | None:
        """bool (slow, fast) of the stacked image: True where a panel pixel is simulated; None if all are."""
        out = np.zeros(self.shape, dtype=bool)
        for i, p in enumerate(self.panels):
            x0, x1, y0, y1 = p.detector.roi
            block = np.zeros((p.detector.spixels, p.detector.fpixels), dtype=bool)
            block[y0:y1 + 1, x0:x1 + 1] = True
            if p.pixel_mask is not None:
                block &= p.pixel_mask
            out[i * self.rows:i * self.rows + block.shape[0], :block.shape[1]] = block
        return None if out.all() else out

    def names(self) -> tuple[str, ...]:
        """Every per-panel canonical name, panel by panel."""
        return tuple(panel_parameter(n, i) for i in range(len(self.panels)) for n in PANEL_GEOMETRY_NAMES)

    def values(self) -> dict[str, float]:
        """Per-panel canonical name -> starting value."""
        return {panel_parameter(n, i): float(p.params[n]) for i, p in enumerate(self.panels)
                for n in PANEL_GEOMETRY_NAMES}

    def panel_image(self, stacked, index: int):
        """Panel ``index``'s own image (its (spixels, fpixels)) cut out of a stacked image (numpy or torch)."""
        d = self.panels[index].detector
        r0 = index * self.rows
        return stacked[..., r0:r0 + d.spixels, :d.fpixels]

    def pixel_sizes_m(self) -> np.ndarray:
        """(N,) pixel edge of each panel (m)."""
        return np.array([p.detector.pixel_m for p in self.panels], dtype=np.float64)


def _differs(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape != b.shape or not np.array_equal(a, b)
    return a != b


def _check_shared(first: Setup, other: Setup, index: int) -> None:
    """Refuse a panel whose crystal, beam, sampling or sensor differs from panel 0's."""
    for name, value in first.params.items():
        if name in PANEL_GEOMETRY_NAMES:
            continue
        if other.params[name] != value:
            raise InputError(f"panel {index}: {name} {other.params[name]:g} differs from panel 0's {value:g}; "
                             "the panels share the crystal and the beam")
    for name in _SHARED_COUNTS:
        if getattr(other, name) != getattr(first, name):
            raise InputError(f"panel {index}: {name} {getattr(other, name)} differs from panel 0's "
                             f"{getattr(first, name)}; give the same value (e.g. -oversample) to every panel")
    if _differs(other.beam, first.beam):
        raise InputError(f"panel {index}: its beam direction {tuple(other.beam)} differs from panel 0's "
                         f"{tuple(first.beam)}; the panels share one lab frame (one convention, or CUSTOM vectors)")
    for name in ("incident", "wavelength_factor", "mosaic_axes", "mosaic_fractions", "polar_axis", "spindle",
                 "orientation0", "shape", "F_grid", "c_parity"):
        if _differs(getattr(other, name), getattr(first, name)):
            raise InputError(f"panel {index}: its {name} differs from panel 0's; the panels share the crystal, "
                             "the beam and the sampling")


def resolve_panels(configs: list[SimulationConfig], names: list[str] | None = None) -> tuple[Setup, PanelLayout]:
    """``(shared setup, layout)`` of the panels ``configs`` (panel 0's setup holds the shared model).

    Raises:
        InputError: no panel, names of the wrong count, a curved detector, a panel whose crystal, beam,
            sampling or sensor differs from panel 0's (naming the panel and the value).
    """
    if not configs:
        raise InputError("multi-panel detector: no panel given")
    if names is not None and len(names) != len(configs):
        raise InputError(f"multi-panel detector: {len(names)} names for {len(configs)} panels")
    setups = []
    for i, cfg in enumerate(configs):
        try:
            s = resolve(cfg)
        except InputError as exc:
            raise InputError(f"panel {i}: {exc}") from None
        if cfg.curved_det:
            raise InputError(f"panel {i}: -curved_det: a multi-panel detector is made of flat panels")
        if i:
            _check_shared(setups[0], s, i)
        setups.append(s)
    panels = tuple(PanelSetup(name=names[i] if names else f"panel{i}", detector=s.detector,
                              params={n: float(s.params[n]) for n in PANEL_GEOMETRY_NAMES}, pixel_mask=s.pixel_mask)
                   for i, s in enumerate(setups))
    layout = PanelLayout(panels=panels, rows=max(p.detector.spixels for p in panels),
                         cols=max(p.detector.fpixels for p in panels))
    return setups[0], layout


def check_rigid_group(layout: PanelLayout, members: tuple[int, ...], label: str) -> None:
    """Refuse a group whose panels do not share their axes, pivot, convention and rotations: for such panels the
    same change of every member's geometry names (:func:`group_overrides`) is not a rigid-body motion."""
    first = layout.panels[members[0]]
    for i in members[1:]:
        p = layout.panels[i]
        same = (p.detector.convention == first.detector.convention and p.detector.pivot == first.detector.pivot
                and all(np.allclose(getattr(p.detector, k), getattr(first.detector, k), rtol=0, atol=1e-12)
                        for k in ("fdet", "sdet", "odet", "twotheta_axis"))
                and all(p.params[n] == first.params[n]
                        for n in ("detector_rotx", "detector_roty", "detector_rotz", "twotheta")))
        if not same:
            raise InputError(f"panel group {label}: panel {i} ({p.name}) does not share the axes, pivot and rotations "
                             f"of panel {members[0]} ({first.name}); a group moves as a rigid body only when its "
                             "panels are parallel and equally oriented")


def group_overrides(layout: PanelLayout, groups: list[tuple[int, ...]], start: dict[str, float],
                    changes: dict) -> dict:
    """Per-panel overrides for group changes: ``changes[f"{name}_g{k}"]`` (a tensor; mm or deg) is added to the
    starting ``start[f"{name}_p{i}"]`` of every panel ``i`` of group ``k``.  For a group that passes
    :func:`check_rigid_group` this moves the group as one rigid body (a shift along its fast and slow axes and
    its distance, a rotation about the sample)."""
    out = {}
    for key, change in changes.items():
        m = re.match(r"^(?P<base>[a-z_]+)_g(?P<k>[0-9]+)$", key)
        if m is None or m["base"] not in PANEL_GEOMETRY_NAMES or int(m["k"]) >= len(groups):
            raise InputError(f"{key}: not a group change <detector name>_g<k> of groups 0..{len(groups) - 1}")
        for i in groups[int(m["k"])]:
            name = panel_parameter(m["base"], i)
            out[name] = start[name] + change
    return out


def module_configs(argv: list[str], modules: list[tuple[int, int, int, int]]) -> list[SimulationConfig]:
    """One configuration per module of the single-panel detector of ``argv``: module ``(x0, y0, width,
    height)`` (pixels; :func:`nbtorch.io.modules.module_grid`) is a panel of ``width x height`` pixels whose
    first pixel lies where pixel (x0, y0) of the one panel lies (its beam centre moved by the module's offset in
    the convention's own flags; pivot and everything else as ``argv``)."""
    one = resolve(config_from_args(list(argv)))
    d = one.detector
    fb, sb, fc, sc = detector_offsets_m(d.convention, d.beam_x_m, d.beam_y_m, d.pixel_m, d.detsize_s_m)
    fast_m, slow_m = (fc, sc) if d.convention in ORG_CONVENTIONS else (fb, sb)
    out = []
    for x0, y0, w, h in modules:
        if x0 < 0 or y0 < 0 or x0 + w > d.fpixels or y0 + h > d.spixels:
            raise InputError(f"module at ({x0}, {y0}) of {w} x {h} pixels lies outside the {d.fpixels} x "
                             f"{d.spixels} detector")
        bx, by = beam_centre_from_offsets_m(d.convention, fast_m - x0 * d.pixel_m, slow_m - y0 * d.pixel_m,
                                            d.pixel_m, h * d.pixel_m)
        flags = ["-detpixels_f", str(w), "-detpixels_s", str(h),
                 *beam_centre_flags(d.convention, bx * 1000.0, by * 1000.0, d.pixel_m * 1000.0), "-pivot", d.pivot]
        out.append(config_from_args(list(argv) + flags))
    return out
