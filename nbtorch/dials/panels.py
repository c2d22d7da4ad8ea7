"""A DIALS multi-panel (and hierarchical) detector as nanoBragg panels, and the refined panels back.

Frames (dxtbx's)
    A detector without ``hierarchy`` lists every panel's ``fast_axis``, ``slow_axis`` and ``origin`` (mm) in
    the DIALS lab frame.  With a ``hierarchy`` every frame in the file is **local** to its parent group: a
    group or panel with local ``(f, s, o)`` under a parent whose lab frame is ``(F, S, O)`` has the lab frame
    ``(R f, R s, O + R o)`` with ``R = [F | S | unit(F x S)]`` (columns); the root group's frame is its lab
    frame.  :func:`panel_lab_frames` composes them; :func:`local_frame` inverts one step.

Each panel becomes one nanoBragg configuration (:func:`nbtorch.dials.geometry.experiment_flags` with the
panel's lab frame: CUSTOM convention, sample pivot, ``-Xbeam/-Ybeam`` the near point of the panel origin,
``-close_distance``) and :func:`panels_simulator` renders them all (:meth:`nbtorch.Simulator.from_panels`;
panel ``i``'s geometry is ``distance_p<i>``, ``beam_x_p<i>`` ...).  :func:`refined_panels_document` writes
every panel's refined origin and axes back (local to the unchanged hierarchy groups).
:func:`hierarchy_groups` lists the panels of every group at every level of the hierarchy (what a
refinement moves as rigid bodies).
"""

from __future__ import annotations

import torch

from nbtorch.cli.args import config_from_args
from nbtorch.dials.geometry import dials_from_nb, experiment_flags, refined_document
from nbtorch.errors import InputError
from nbtorch.io.dials import DialsExperiment, hierarchy_walk, local_frame, panel_lab_frames
from nbtorch.simulator import Simulator

__all__ = ["panel_lab_frames", "local_frame", "hierarchy_groups", "panel_flags", "panels_simulator",
           "refined_panels_document", "check_image_panels"]


def hierarchy_groups(detector: dict) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The panel groups at each level of the hierarchy, root first: ``levels[k]`` lists ``(group name, panel
    indices)``; the last level is the panels themselves.  Without a hierarchy: the whole detector, then the
    panels."""
    panels = detector["panels"]
    singles = [(str(p.get("name") or f"panel{i}"), (i,)) for i, p in enumerate(panels)]
    if "hierarchy" not in detector:
        return [[("detector", tuple(range(len(panels))))], singles]
    _, groups = hierarchy_walk(detector)
    depth = max(level for level, *_ in groups)
    levels = [[(name, tuple(members)) for level, name, _, members in groups if level == k] for k in range(depth + 1)]
    return levels + [singles]


def panel_flags(exp: DialsExperiment, image_index: int = 0) -> list[list[str]]:
    """The nanoBragg flags of every panel (:func:`~nbtorch.dials.geometry.experiment_flags` with the panel's
    lab frame); an error names the panel."""
    out = []
    for i, (panel, (f, s, o)) in enumerate(zip(exp.panels, panel_lab_frames(exp.detector))):
        lab = dict(panel, fast_axis=list(f), slow_axis=list(s), origin=list(o))
        try:
            out.append(experiment_flags(exp, image_index, panel=lab))
        except InputError as exc:
            label = f"detector panel {i}" + (f" ({panel.get('name')})" if panel.get("name") else "")
            raise InputError(str(exc).replace(f"{exp.path}: ", f"{exp.path}: {label}: ", 1)) from None
    return out


def panels_simulator(exp: DialsExperiment, image_index: int = 0, extra_flags=(), **kwargs):
    """The multi-panel :class:`~nbtorch.Simulator` of ``exp`` (each panel its flags plus ``extra_flags``, e.g.
    ``-N``, ``-default_F``, ``-oversample``); ``kwargs`` as :meth:`nbtorch.Simulator.from_panels`."""
    configs = [config_from_args(flags + list(extra_flags)) for flags in panel_flags(exp, image_index)]
    names = [str(p.get("name") or f"panel{i}") for i, p in enumerate(exp.panels)]
    return Simulator.from_panels(configs, names=names, **kwargs)


def refined_panels_document(exp: DialsExperiment, sim, values: dict, image_index: int = 0) -> dict:
    """:func:`~nbtorch.dials.geometry.refined_document` of a multi-panel simulator (:func:`panels_simulator`):
    beam and crystal as there, and every panel's origin and axes at ``values`` (per-panel names), written
    local to its unchanged hierarchy group when the detector has a hierarchy."""
    names = set(sim.parameter_names())
    with torch.no_grad():
        p = sim.parameters_dict(**{k: torch.as_tensor(float(v), dtype=sim.dtype, device=sim.device)
                                   for k, v in values.items() if k in names})
        geoms = [sim.geometry(p, panel=i) for i in range(len(exp.panels))]
    parents = hierarchy_walk(exp.detector)[0] if "hierarchy" in exp.detector else None
    fields = []
    for i, g in enumerate(geoms):
        f, s, o = (dials_from_nb(t.detach().cpu().double().numpy() * scale)
                   for t, scale in ((g.fdet, 1.0), (g.sdet, 1.0), (g.pix0, 1000.0)))
        if parents is not None:
            f, s, o = local_frame(parents[i], f, s, o)
        fields.append({"origin": [float(v) for v in o], "fast_axis": [float(v) for v in f],
                       "slow_axis": [float(v) for v in s]})
    return refined_document(exp, sim, values, image_index, panels=fields)


def check_image_panels(exp: DialsExperiment, shapes: list[tuple[int, int]], what: str = "the image") -> None:
    """Refuse a detector whose panels do not match an image's panels ``shapes`` ((slow, fast) each): one line
    naming the panel and the two sizes."""
    if len(shapes) != len(exp.panels):
        raise InputError(f"{exp.path}: the detector has {len(exp.panels)} panels but {what} has {len(shapes)}")
    for i, (panel, shape) in enumerate(zip(exp.panels, shapes)):
        nf, ns = (int(v) for v in panel["image_size"])
        if tuple(shape) != (ns, nf):
            label = f"detector panel {i}" + (f" ({panel.get('name')})" if panel.get("name") else "")
            raise InputError(f"{exp.path}: {label} is {nf} x {ns} pixels (fast x slow) but {what}'s panel {i} is "
                             f"{shape[1]} x {shape[0]}")

