"""Refinement of a multi-panel detector's geometry by panel groups: each group one rigid body.

A group is a set of panels of a multi-panel simulator (:meth:`nbtorch.Simulator.from_panels`), e.g. one level
of a DIALS hierarchy (:func:`nbtorch.dials.panels.hierarchy_groups`: the whole detector, its modules, the
panels).  The free values of group ``k`` are changes ``<name>_g<k>`` (mm for ``distance``, ``beam_x``,
``beam_y``; deg for the rotations) added to the starting value of ``<name>_p<i>`` of every panel ``i`` in the
group (:func:`nbtorch.geometry.panels.group_overrides`): for panels that share their axes, pivot and rotations
(checked, :func:`nbtorch.geometry.panels.check_rigid_group`) the group moves as one rigid body.

Identifiability: a group is fitted only when it holds at least ``min_spots_per_name`` observed spots per free
name; the others keep their starting geometry and are reported (:attr:`GroupFit.fixed`).

The fit compares the model with the observed image on the given pixels (spot windows):
``sum (model - observed)^2 / sum observed^2``, minimised by LBFGS (strong Wolfe line search) over raw values
in which one unit is one pixel of shift (``distance``, ``beam_x``, ``beam_y``) or 0.01 deg.  With
``nuisance=True`` (a measured image) the model is ``scale * simulated + background``, both fitted too
(starting from their linear least-squares values on the pixels).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nbtorch.errors import InputError
from nbtorch.geometry.panels import PANEL_GEOMETRY_NAMES, check_rigid_group, group_overrides, split_panel_parameter

__all__ = ["GroupFit", "spots_per_group", "identifiable_groups", "fit_panel_groups"]

DEFAULT_NAMES = ("distance", "beam_x", "beam_y")
_ROTATION_STEP_DEG = 0.01


@dataclass(frozen=True)
class GroupFit:
    """What :func:`fit_panel_groups` found: the fitted changes, the groups left fixed, the loss."""

    changes: dict  # "<name>_g<k>" -> change (mm or deg) of every fitted group
    fixed: tuple[str, ...]  # one line per group left at its start (too few spots)
    loss_start: float
    loss_end: float
    evaluations: int
    groups: tuple = ()  # the panels of each group

    start_values: dict = None  # the per-panel values the fit started from (None: the simulator's)

    def overrides(self, sim) -> dict:
        """The per-panel values (``<name>_p<i>``, floats) of the fitted geometry: every panel, moved or not."""
        start = {k: float(v) for k, v in _panel_start(sim).items()}
        start.update(self.start_values or {})
        moved = group_overrides(sim.panel_layout, list(self.groups), start, self.changes)
        return {**start, **{k: float(v) for k, v in moved.items()}}


def _panel_start(sim) -> dict:
    """The simulator's per-panel geometry values (``<name>_p<i>`` -> tensor)."""
    return {n: v.detach() for n, v in sim.parameters_dict().items() if split_panel_parameter(n) is not None}


def spots_per_group(layout, groups: list[tuple[int, ...]], spots: np.ndarray) -> list[int]:
    """How many spots ((n, 2) x fast, y slow in the stacked image) lie on the panels of each group."""
    spots = np.asarray(spots, dtype=np.float64).reshape(-1, 2)
    panel = np.floor(spots[:, 1] / layout.rows).astype(int)
    return [int(np.isin(panel, list(members)).sum()) for members in groups]


def identifiable_groups(groups: list[tuple[int, ...]], counts: list[int], n_names: int,
                        min_spots_per_name: int = 2, labels: list[str] | None = None) -> tuple[list[int], list[str]]:
    """``(groups to fit, one line per group left fixed)``: a group needs ``min_spots_per_name`` spots per name."""
    need = min_spots_per_name * n_names
    free, fixed = [], []
    for k, n in enumerate(counts):
        label = labels[k] if labels else f"group {k}"
        if n >= need:
            free.append(k)
        else:
            fixed.append(f"panel group {label} (panels {', '.join(map(str, groups[k]))}): {n} spots for {n_names} "
                         f"names (needs {need}); its geometry stays at the start")
    return free, fixed


def _linear_start(model: torch.Tensor, obs: torch.Tensor) -> tuple[float, float]:
    """``(scale, background)`` of the least-squares line ``obs ~ scale * model + background`` (scale > 0)."""
    a = torch.stack([model, torch.ones_like(model)], dim=1)
    sol = torch.linalg.lstsq(a, obs[:, None]).solution[:, 0]
    return max(float(sol[0]), 1e-12), float(sol[1])


def _raw_units(sim, groups, names) -> dict[str, float]:
    """One raw unit of each ``<name>_g<k>``: one pixel (mm) of the group's first panel, or 0.01 deg."""
    out = {}
    for k, members in enumerate(groups):
        pixel_mm = sim.panel_layout.panels[members[0]].detector.pixel_m * 1000.0
        for name in names:
            out[f"{name}_g{k}"] = pixel_mm if name in DEFAULT_NAMES else _ROTATION_STEP_DEG
    return out


def fit_panel_groups(sim, observed, pixels: np.ndarray, groups: list[tuple[int, ...]],
                     names: tuple[str, ...] = DEFAULT_NAMES, spots: np.ndarray | None = None,
                     min_spots_per_name: int = 2, max_evaluations: int = 60,
                     labels: list[str] | None = None, nuisance: bool = False,
                     start_values: dict | None = None) -> GroupFit:
    """Fit the rigid-body changes ``<name>_g<k>`` of ``groups`` to ``observed`` (the stacked image, (slow, fast))
    on ``pixels`` (bool (slow, fast), e.g. windows around the spots).  ``spots`` ((n, 2), stacked x, y) decide
    which groups are identifiable (all groups when None).  ``start_values``: per-panel values (``<name>_p<i>``)
    to start from instead of the simulator's (e.g. a coarser level's fit, :meth:`GroupFit.overrides`).

    Raises:
        InputError: not a multi-panel simulator, an unknown name, a group that is not rigid (its panels do not
            share axes and rotations), shapes that do not match.
    """
    layout = sim.panel_layout
    if layout is None:
        raise InputError("panel groups: the simulator has one panel (use Simulator.from_panels)")
    bad = [n for n in names if n not in PANEL_GEOMETRY_NAMES]
    if bad:
        raise InputError(f"panel groups: {bad[0]} is not a panel geometry name ({', '.join(PANEL_GEOMETRY_NAMES)})")
    for k, members in enumerate(groups):
        check_rigid_group(layout, tuple(members), labels[k] if labels else str(k))
    observed = np.asarray(observed, dtype=np.float64)
    if observed.shape != tuple(sim.shape) or np.asarray(pixels).shape != tuple(sim.shape):
        raise InputError(f"panel groups: observed image and pixel mask must be {tuple(sim.shape)}, got "
                         f"{observed.shape} and {np.asarray(pixels).shape}")
    counts = spots_per_group(layout, groups, spots) if spots is not None else [len(names) * min_spots_per_name] * len(groups)
    free, fixed = identifiable_groups(groups, counts, len(names), min_spots_per_name, labels)
    keys = [f"{n}_g{k}" for k in free for n in names]
    fit = sim.restricted(np.asarray(pixels, dtype=bool))
    values, index, _ = fit.render_pixels()
    obs = torch.as_tensor(observed.reshape(-1), dtype=values.dtype)[index]
    norm = float((obs * obs).sum()) or 1.0
    start = _panel_start(sim)
    start.update({k: torch.as_tensor(float(v), dtype=values.dtype) for k, v in (start_values or {}).items()
                  if k in start})
    unit = _raw_units(sim, groups, names)
    scale0, background0 = _linear_start(values.detach(), obs) if nuisance else (1.0, 0.0)
    raw = torch.zeros(len(keys) + (2 if nuisance else 0), dtype=values.dtype, requires_grad=True)
    calls = [0]

    def loss_of(r: torch.Tensor) -> torch.Tensor:
        changes = {key: r[j] * unit[key] for j, key in enumerate(keys)}
        model, _, _ = fit.render_pixels(**group_overrides(layout, list(groups), start, changes))
        if nuisance:
            model = scale0 * torch.exp(0.1 * r[-2]) * model + background0 + r[-1]
        return ((model - obs) ** 2).sum() / norm

    with torch.no_grad():
        loss_start = float(loss_of(raw))
    if raw.numel():
        opt = torch.optim.LBFGS([raw], lr=1.0, max_iter=max_evaluations, max_eval=max_evaluations,
                                tolerance_grad=1e-12, tolerance_change=1e-14, history_size=20,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = loss_of(raw)
            loss.backward()
            calls[0] += 1
            return loss

        opt.step(closure)
    with torch.no_grad():
        loss_end = float(loss_of(raw))
    changes = {key: float(raw.detach()[j]) * unit[key] for j, key in enumerate(keys)}
    return GroupFit(changes=changes, fixed=tuple(fixed), loss_start=loss_start, loss_end=loss_end,
                    evaluations=calls[0], groups=tuple(tuple(m) for m in groups),
                    start_values=dict(start_values) if start_values else None)
