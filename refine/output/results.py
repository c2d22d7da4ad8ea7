"""The result of a refinement, and its two files: ``result.json`` and ``result.h5``.

``result.json`` (:func:`save_json`) holds::

    params          final value of every canonical parameter (fixed ones too; N_a/N_b/N_c always;
                    the orientation as misset_x/y/z), plus scale and background
    initial_params  the same at the start
    esds            estimated standard uncertainty of every free parameter (and the canonical
                    values tied to them: cell_b for tetragonal, N_a/N_b/N_c, misset_x/y/z): the
                    sandwich (robust) esds, which hold when the model misses part of the image
    esd_kind        "sandwich" (null without esds)
    esds_by_kind    {sandwich, scaled, fisher}: name -> esd (refine.quality.uncertainty explains each)
    units           unit of every name above (refine.fitting.parameters.UNITS: the table in nbtorch.parameters)
    loss_initial, loss_final, steps, evaluations, status, message, wall_s
    free, symmetry, correlation {names, matrix}, stages [{name, status, steps, loss_start, loss_end, ...}]

``result.h5`` (:func:`save_h5`) holds all of it: attributes ``status``,
``message``, ``loss_initial``, ``loss_final``, ``steps``, ``wall_s``,
``symmetry``; groups ``params``, ``initial_params``, ``esds`` (one scalar
dataset per name, attribute ``units``); ``correlation`` and ``covariance``
(P x P, attribute ``names``); ``history/`` (one row per point: ``step``,
``stage`` (index), ``stage_step``, ``loss``, ``grad_norm`` and
``history/params/<name>`` for every base value, NaN-free); ``images/observed``,
``images/model``, ``images/residuals`` (observed - model), ``images/mask``;
and ``result_json`` (the JSON document).  Both files are written atomically
(:mod:`nbtorch.io.atomic`).  :func:`load_h5` reads it back into plain dicts.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nbtorch.io.atomic import atomic_output_path, atomic_write
from refine.quality.fit_quality import background_image, signal_support
from refine.solver.loop import Status
from refine.fitting.structure_factors import is_amplitude

__all__ = ["RefinementResult", "StageSummary", "save_json", "save_h5", "load_h5"]


@dataclass(frozen=True)
class StageSummary:
    """One stage's outcome."""

    name: str
    status: Status
    message: str
    steps: int
    evaluations: int
    loss_start: float
    loss_end: float
    free: tuple[str, ...]
    settings: dict
    wall_s: float

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status.value, "message": self.message, "steps": self.steps,
                "evaluations": self.evaluations, "loss_start": self.loss_start, "loss_end": self.loss_end,
                "free": list(self.free), "settings": self.settings, "wall_s": self.wall_s}


@dataclass(frozen=True)
class RefinementResult:
    """Everything a refinement produced.

    Attributes:
        status: how it ended (:class:`~refine.solver.loop.Status`); ``message`` in words.
        params: final canonical parameters (+ ``scale``, ``background``...), units in ``units``.
        initial_params: the same at the start.
        refined: free name -> final value (``orient_x/y/z``: deg of the small rotation refined).
        esds: name -> estimated standard uncertainty (free names and tied canonical names).
        units: name -> unit.
        free: every name refined in some stage, order of ``correlation``.
        correlation, covariance: (P, P) at the final point (NaN-free; empty if esds were skipped).
        fisher_condition: condition number of the unit-diagonal Fisher matrix.
        loss_initial, loss_final: loss on the full image at the start and the end.
        steps, evaluations: optimiser steps and loss evaluations over all stages.
        wall_s: wall time (s) of the whole run (resumed runs included).
        stages: per-stage :class:`StageSummary`.
        history: column -> list: ``step stage stage_step loss grad_norm`` and ``params`` (name -> list).
        observed, model, residuals: (slow, fast) images (photons); residuals = observed - model.
        mask: (slow, fast) bool, pixels used by the final stage.
        symmetry: crystal system.
        hparams: flat settings of the run.
        fit: the final fit against shot noise (:class:`refine.quality.fit_quality.FitQuality` as a dict:
            ``loss``, ``expected_loss``, ``excess``, ``pixels``), empty for losses other than Poisson;
            completed when the result is made by the signal it rests on
            (:func:`refine.quality.fit_quality.signal_support`: ``signal_pixels``, ``signal_spots``,
            ``parameters``, ``spots_per_parameter``, ``support_warning``; the warning is added to
            ``warnings`` too).
        warnings: one line each: what makes the result doubtful although the optimiser stopped
            normally (e.g. a fit far from the noise level).
        esd_kinds: kind -> name -> esd for the three kinds of :mod:`refine.quality.uncertainty`: ``sandwich``
            (robust to a model that misses part of the image; what ``esds`` holds), ``scaled`` (Fisher
            esds times sqrt of the fit's excess) and ``fisher`` (right only for a right model).
    """

    status: Status
    message: str
    params: dict
    initial_params: dict
    refined: dict
    esds: dict
    units: dict
    free: tuple[str, ...]
    correlation: np.ndarray
    covariance: np.ndarray
    fisher_condition: float
    loss_initial: float
    loss_final: float
    steps: int
    evaluations: int
    wall_s: float
    stages: tuple[StageSummary, ...]
    history: dict = field(repr=False)
    observed: np.ndarray = field(repr=False)
    model: np.ndarray = field(repr=False)
    residuals: np.ndarray = field(repr=False)
    mask: np.ndarray = field(repr=False)
    symmetry: str = "triclinic"
    hparams: dict = field(default_factory=dict, repr=False)
    fit: dict = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    esd_kinds: dict = field(default_factory=dict)
    amplitudes: Any = field(default=None, repr=False)
    amplitude_values: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # the signal the fit rests on: from the result's own images, so every way of making a result reports it
        if not self.fit or "signal_spots" in self.fit or np.ndim(self.model) != 2 or np.shape(self.mask) != np.shape(self.model):
            return

        # an amplitude is decided by its own spot's intensity, not by spots' positions (refine.fitting.structure_factors)
        support = signal_support(self.model, background_image(np.shape(self.model), self.params), self.mask,
                                 sum(1 for n in self.free if not is_amplitude(n)))
        object.__setattr__(self, "fit", {**self.fit, **support.to_dict()})
        if support.warning is not None:
            object.__setattr__(self, "warnings", tuple(self.warnings) + (support.warning,))

    def to_json_dict(self) -> dict[str, Any]:
        """The ``result.json`` document (plain Python types)."""
        return {
            "params": self.params,
            "esds": self.esds,
            "initial_params": self.initial_params,
            "loss_initial": self.loss_initial,
            "loss_final": self.loss_final,
            "steps": self.steps,
            "status": self.status.value,
            "message": self.message,
            "wall_s": self.wall_s,
            "evaluations": self.evaluations,
            "units": self.units,
            "free": list(self.free),
            "refined": self.refined,
            "symmetry": self.symmetry,
            "correlation": {"names": list(self.free), "matrix": np.asarray(self.correlation).tolist()},
            "fisher_condition": self.fisher_condition,
            "stages": [s.to_dict() for s in self.stages],
            "hparams": self.hparams,
            "fit": self.fit,
            "warnings": list(self.warnings),
            "esd_kind": "sandwich" if self.esd_kinds else None,
            "esds_by_kind": self.esd_kinds,
            **({"structure_factors": self.structure_factors()} if self.amplitudes is not None else {}),
        }

    def structure_factors(self) -> dict:
        """The amplitudes (``structure_factors`` of result.json): the space group, how they started, and one row
        ``[h, k, l, d_A, F, esd, refined]`` per candidate symmetry-unique reflection (``refined`` False: held,
        too faint on the fitted pixels; its F is the value the model used, its esd None)."""
        t = self.amplitudes
        free = set(self.free)
        rows = [[int(h), int(k), int(l), float(d), float(self.amplitude_values.get(n, t.starts[n])),
                 self.esds.get(n) if n in free else None, n in free]
                for n, (h, k, l), d in zip(t.names, t.hkl, t.d_A)]  # noqa: E741
        n_free = sum(1 for n in t.names if n in free)
        return {"space_group": t.space_group, "start": t.start_mode, "n_free": n_free,
                "n_held": len(t.names) - n_free, "columns": ["h", "k", "l", "d_A", "F", "esd", "refined"],
                "reflections": rows}

    def summary(self) -> str:
        """A short human-readable table of the refined values with esds."""
        lines = [f"status: {self.status.value} ({self.message})",
                 f"loss: {self.loss_initial:.6g} -> {self.loss_final:.6g} in {self.steps} steps, {self.wall_s:.1f} s"]
        amplitudes = [n for n in self.free if is_amplitude(n)]
        if amplitudes:
            lines.append(f"  {len(amplitudes)} structure-factor amplitudes (F_h_k_l: refined, esds)")
        for name in self.free:
            if is_amplitude(name):
                continue
            key = name
            v = self.refined.get(name)
            e = self.esds.get(key, float("nan"))
            lines.append(f"  {name:<14} {v:>14.6f} +- {e:<10.3g} {self.units.get(name, '')}")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def jsonable(obj: Any) -> Any:
    """Plain JSON types for a nested structure: numpy scalars and arrays, enums; NaN/Inf -> None."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if np.isfinite(v) else None  # JSON has no NaN/Inf
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def save_json(result: RefinementResult, path: str | Path) -> Path:
    """Write ``result.json`` atomically (non-finite numbers become ``null``)."""
    path = Path(path)
    text = json.dumps(jsonable(result.to_json_dict()), indent=2, sort_keys=False, allow_nan=False)
    with atomic_write(path, "w") as fh:
        fh.write(text + "\n")
    return path


def save_h5(result: RefinementResult, path: str | Path) -> Path:
    """Write ``result.h5`` atomically (layout in the module docstring)."""
    import h5py

    path = Path(path)
    doc = json.dumps(jsonable(result.to_json_dict()), allow_nan=False)
    with atomic_output_path(path) as tmp:
        with h5py.File(tmp, "w") as h5:
            for k in ("loss_initial", "loss_final", "steps", "evaluations", "wall_s", "fisher_condition"):
                h5.attrs[k] = getattr(result, k)
            h5.attrs["status"] = result.status.value
            h5.attrs["message"] = result.message
            h5.attrs["symmetry"] = result.symmetry
            h5.attrs["format"] = "nbtorch-refine-result"
            for group, values in (("params", result.params), ("initial_params", result.initial_params),
                                  ("esds", result.esds), ("refined", result.refined)):
                g = h5.create_group(group)
                for name, v in values.items():
                    d = g.create_dataset(name, data=float(v))
                    d.attrs["units"] = result.units.get(name, "")
            names = np.array([n.encode() for n in result.free])
            for key in ("correlation", "covariance"):
                d = h5.create_dataset(key, data=np.asarray(getattr(result, key), dtype=np.float64))
                d.attrs["names"] = names
            hist = h5.create_group("history")
            for col in ("step", "stage", "stage_step", "loss", "grad_norm"):
                hist.create_dataset(col, data=np.asarray(result.history[col]))
            hp = hist.create_group("params")
            for name, col in result.history["params"].items():
                hp.create_dataset(name, data=np.asarray(col, dtype=np.float64))
            hist.attrs["stage_names"] = np.array([s.name.encode() for s in result.stages])
            img = h5.create_group("images")
            for key in ("observed", "model", "residuals"):
                img.create_dataset(key, data=np.asarray(getattr(result, key), dtype=np.float64), compression="gzip")
            img.create_dataset("mask", data=np.asarray(result.mask, dtype=np.uint8), compression="gzip")
            h5.create_dataset("result_json", data=doc)
    return path


def load_h5(path: str | Path) -> dict[str, Any]:
    """Read a ``result.h5`` into plain dicts and numpy arrays (the JSON document under ``"json"``)."""
    import h5py

    out: dict[str, Any] = {}
    with h5py.File(path, "r") as h5:
        out.update({k: (v.decode() if isinstance(v, bytes) else v) for k, v in h5.attrs.items()})
        for group in ("params", "initial_params", "esds", "refined"):
            out[group] = {k: float(h5[group][k][()]) for k in h5[group]}
        out["correlation"] = h5["correlation"][()]
        out["covariance"] = h5["covariance"][()]
        out["names"] = [n.decode() for n in h5["correlation"].attrs["names"]]
        hist = h5["history"]
        out["history"] = {k: hist[k][()] for k in hist if k != "params"}
        out["history"]["params"] = {k: hist["params"][k][()] for k in hist["params"]}
        out["images"] = {k: h5["images"][k][()] for k in h5["images"]}
        raw = h5["result_json"][()]
        out["json"] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return out
