"""The results of a refinement, of one image (:class:`RefinementResult`) or of many refined together
(:class:`JointResult`), and their files: ``result.json``/``result.h5``, ``joint.json``/``joint.h5``.

Both results are written in **one schema** (:func:`save_json`, :func:`save_h5`, read back by :func:`load_h5`);
a joint result is the single one extended with a list of per-image entries.  The JSON document holds::

    format          "nbtorch-refine-result" (one image) or "nbtorch-refine-joint" (many)
    params          final value of every canonical parameter (fixed ones too; N_a/N_b/N_c and N_d/N_e/N_f always; the
                    orientation as misset_x/y/z), plus scale and background; joint: the shared ones
    initial_params  the same at the start
    refined         refined name -> final value (orient_x/y/z: the small rotation refined)
    free            the refined names (joint: the shared ones, per_image_names the others)
    esds            estimated standard uncertainty of every refined name (and the canonical values tied to
                    them: cell_b for tetragonal, N_a/N_b/N_c, misset_x/y/z): the sandwich (robust) esds, which
                    hold when the model misses part of the image
    esd_kind        "sandwich" (null without esds)
    esds_by_kind    kind -> name -> esd (single: sandwich, scaled, fisher; joint: sandwich, fisher;
                    refine.quality.uncertainty explains each)
    units           unit of every name above (refine.fitting.parameters.UNITS: the table in nbtorch.parameters)
    correlation     {names, matrix} (joint: of the shared names, amplitudes left out); fisher_condition
    loss_initial, loss_final, steps, evaluations, status, message, wall_s, symmetry, warnings
    structure_factors   with refined amplitudes: space group, start, counts and one row
                    [h, k, l, d_A, F, esd, refined] per candidate reflection (:func:`amplitude_rows`); with
                    anomalous pairs ``anomalous`` {columns, rows}: [h, k, l, F+, esd+, F-, esd-, dano, sigdano]
    mosaic_domains  with a refined cell and mosaic domains: what twice the domain count would do to the cell
                    (refine.quality.domain_count: domains, check_domains, shift, shift_esd, max_shift_esd, warning)

one image adds ``stages`` [{name, status, steps, loss_start, loss_end, ...}], ``hparams``, ``fit`` and
``diagnostics`` (what the model misses, :mod:`refine.quality.misfit`: ``sigZ``, ``mean_z``, ``fraction_z_above_5``,
``z_pixels``; with observed spots from ``nbtorch-refine`` also ``direct_beam_px``, ``profile`` and
``background_by_resolution``); a joint
run adds ``n_images``, ``shared_names``, ``per_image_names``, ``loss`` (its name), ``world_size``, ``history``
(one row per point of its loop), ``resumed_from_step`` and ``images``, one entry per image: ``params``,
``initial_params``, ``esds``, ``esds_by_kind`` (as above, the image's own names), ``loss_final`` and, when known,
``fit`` and ``spots`` (the image's fit against shot noise and its spot offsets; ``fit`` and ``spots`` at the top:
over every image), ``priors`` (the Gaussian priors on shared names: name -> ``{mean, sigma}``, when any); ``shared``,
``shared_esds``, ``initial_shared`` and ``shared_correlation`` repeat ``params``, ``esds``, ``initial_params`` and
``correlation`` under the names joint files had before they took this schema.

The HDF5 file holds the same: attributes ``format``, ``status``, ``message``, ``symmetry``, ``esd_kind``,
``loss_initial``, ``loss_final``, ``steps``, ``evaluations``, ``wall_s``, ``fisher_condition``; groups
``params``, ``initial_params``, ``esds``, ``refined`` (one scalar dataset per name, attribute ``units``);
``correlation`` (P x P, attribute ``names``); ``history/`` (one column per field of the history); group
``structure_factors`` (attributes space_group, start, n_free, n_held (and min_photons); datasets ``hkl``,
``d_A``, ``F``, ``esd`` (NaN where held), ``refined``, and ``photons``, ``nobs`` of a joint run; subgroup
``anomalous`` of the pairs, a dataset per column); and ``result_json`` (the
JSON document).  One image adds ``covariance``, ``history/stage``, ``history/stage_step``, ``history/elapsed_s``,
``history/params/<name>`` (every base value, NaN-free) and ``images/observed``, ``images/model``,
``images/residuals`` (observed - model), ``images/mask`` and ``diagnostics`` (attributes: the scalars; with a
spot profile ``diagnostics/profile/{observed,model,difference}``, with the background between spots
``diagnostics/background_by_resolution/{d_max_A,d_min_A,pixels,observed,model}``).  A joint run adds attributes ``n_images``,
``world_size``, ``loss_name``; ``images/<name>``, ``image_esds/<name>``, ``initial_images/<name>`` (one value
per image, NaN where absent), ``image_losses``, ``image_fit/<name>`` and ``image_spots/<name>`` (one value per
image, when known), and ``shared``, ``shared_esds``, ``initial_shared``,
``shared_correlation`` (links to ``params``, ``esds``, ``initial_params``, ``correlation``).  Both files are
written atomically (:mod:`nbtorch.io.atomic`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from refine.fitting.parameters import canonical_values
from refine.fitting.structure_factors import is_amplitude
from refine.output.amplitude_mtz import anomalous_rows
from refine.quality.fit_quality import background_image, signal_support
from refine.solver.loop import Status
from refine.output.result_files import (common_document, jsonable, load_h5, save_h5, save_json, write_diagnostics,
                                        write_history)

__all__ = ["RefinementResult", "JointResult", "StageSummary", "save_json", "save_h5", "load_h5", "amplitude_rows",
           "reported_values", "jsonable", "save_joint_json", "save_joint_h5", "load_joint_h5", "FORMAT",
           "JOINT_FORMAT"]

#: the ``format`` of a single run's files and of a joint run's
FORMAT = "nbtorch-refine-result"
JOINT_FORMAT = "nbtorch-refine-joint"


def reported_values(values: Mapping[str, float], background: str) -> dict:
    """The canonical values a result reports (:func:`refine.fitting.parameters.canonical_values`), without the
    planar background's slopes unless the ``background`` is planar, nor the flat ``background`` that a
    ``resolution:K`` background's knots replace."""
    out = canonical_values(values)
    if background.startswith("resolution"):
        out.pop("background", None)
    if background != "planar":
        out.pop("background_x", None)
        out.pop("background_y", None)
    return out


def amplitude_rows(table, values: Mapping[str, float], esds: Mapping[str, float], free) -> dict:
    """The ``structure_factors`` of a result: the space group, how the amplitudes started, and one row
    ``[h, k, l, d_A, F, esd, refined]`` per candidate symmetry-unique reflection of ``table``
    (:class:`~refine.fitting.structure_factors.AmplitudeTable`); ``refined`` False: held (too faint on the
    fitted pixels), its F the value the model used (``values``, else the table's start), its esd None."""
    free = set(free)
    rows = [[int(h), int(k), int(l), float(d), float(values.get(n, table.starts[n])),
             esds.get(n) if n in free else None, n in free]
            for n, (h, k, l), d in zip(table.names, table.hkl, table.d_A)]  # noqa: E741
    n_free = sum(1 for n in table.names if n in free)
    pairs = {"anomalous": anomalous_rows(table, values, esds, free)} if table.anomalous else {}
    return {"space_group": table.space_group, "start": table.start_mode, "n_free": n_free,
            "n_held": len(table.names) - n_free, "columns": ["h", "k", "l", "d_A", "F", "esd", "refined"],
            "reflections": rows, **pairs}


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
        history: column -> list: ``step stage stage_step loss grad_norm elapsed_s`` and ``params`` (name -> list).
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
        diagnostics: what the model misses (:mod:`refine.quality.misfit`): sigZ (``sigZ``, ``mean_z``,
            ``fraction_z_above_5``, ``z_pixels``), and from ``nbtorch-refine`` with observed spots ``profile`` and
            ``background_by_resolution``.
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
    diagnostics: dict = field(default_factory=dict, repr=False)
    background_image: np.ndarray | None = field(default=None, repr=False)
    mosaic_domains: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the signal the fit rests on: from the result's own images, so every way of making a result reports it
        if not self.fit or "signal_spots" in self.fit or np.ndim(self.model) != 2 or np.shape(self.mask) != np.shape(self.model):
            return

        # an amplitude is decided by its own spot's intensity, not by spots' positions (refine.fitting.structure_factors)
        background = (background_image(np.shape(self.model), self.params) if self.background_image is None
                      else self.background_image)
        support = signal_support(self.model, background, self.mask,
                                 sum(1 for n in self.free if not is_amplitude(n)))
        object.__setattr__(self, "fit", {**self.fit, **support.to_dict()})
        if support.warning is not None:
            object.__setattr__(self, "warnings", tuple(self.warnings) + (support.warning,))

    @property
    def esd_kind(self) -> str | None:
        """The kind ``esds`` holds: ``"sandwich"`` (None without esds)."""
        return "sandwich" if self.esd_kinds else None

    def to_json_dict(self) -> dict[str, Any]:
        """The ``result.json`` document (plain Python types; the schema of the module docstring)."""
        doc = common_document(self, FORMAT, self.free, self.structure_factors() if self.amplitudes is not None
                               else None)
        doc.update(stages=[s.to_dict() for s in self.stages], hparams=self.hparams, fit=self.fit,
                   diagnostics=self.diagnostics)
        return doc

    def structure_factors(self) -> dict:
        """The amplitudes (``structure_factors`` of result.json, :func:`amplitude_rows`)."""
        return amplitude_rows(self.amplitudes, self.amplitude_values, self.esds, self.free)

    def hkl_table(self):
        """The refined amplitudes with every equivalent and Friedel mate (:class:`nbtorch.io.hkl.HKLTable`, for
        :func:`nbtorch.io.hkl.write_hkl`); None without structure factors."""
        return None if self.amplitudes is None else self.amplitudes.hkl_table(self.amplitude_values)

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

    def _write_h5(self, h5) -> None:
        """What the file of one image adds to the common part (module docstring)."""
        d = h5.create_dataset("covariance", data=np.asarray(self.covariance, dtype=np.float64))
        d.attrs["names"] = np.array([n.encode() for n in self.free])
        hist = write_history(h5, {col: self.history[col] for col in ("step", "stage", "stage_step", "loss",
                                                                       "grad_norm", "elapsed_s") if col in self.history})
        hp = hist.create_group("params")
        for name, col in self.history["params"].items():
            hp.create_dataset(name, data=np.asarray(col, dtype=np.float64))
        hist.attrs["stage_names"] = np.array([s.name.encode() for s in self.stages])
        img = h5.create_group("images")
        for key in ("observed", "model", "residuals"):
            img.create_dataset(key, data=np.asarray(getattr(self, key), dtype=np.float64), compression="gzip")
        img.create_dataset("mask", data=np.asarray(self.mask, dtype=np.uint8), compression="gzip")
        write_diagnostics(h5, self.diagnostics)


@dataclass(frozen=True)
class JointResult:
    """What a joint refinement (:func:`refine.many.joint.refine_joint`) produced.

    Attributes:
        status, message: how the loop ended (:class:`~refine.solver.loop.Status`).
        shared: final value of every shared canonical name (all six cell values when the cell is shared; a
            shared orientation as its deltas ``orient_x/y/z`` and, when every image has the same orientation,
            as ``misset_x/y/z``: one crystal turning through a rotation series).
        shared_esds: their esds (the default ``esd_kind``; tied names such as ``cell_b`` of a cubic cell too).
        images: per image, every canonical value at the end (the shared ones included; the orientation as
            ``misset_x/y/z``), plus ``scale`` and ``background``.
        image_esds: per image, the esds of its per-image names (and ``misset_x/y/z`` when the orientation
            is refined).
        initial_shared, initial_images: the same at the start.
        shared_names, per_image_names: the refined names (raw order: shared, then each image's own).
        esd_kind: ``"sandwich"`` (None without esds); ``esds_by_kind``: kind -> ``{"shared": {...},
            "images": [{...}, ...]}`` for ``sandwich``, ``fisher``.
        shared_correlation: (S, S) correlation of the shared names; ``fisher_condition``: condition number of
            the unit-diagonal joint Fisher matrix.
        loss_initial, loss_final: joint loss (sum over images); ``image_losses``: each image's final loss.
        steps, evaluations, wall_s: the loop; ``world_size``: processes that shared the images.
        history: one dict per point of the loop (step, loss, grad_norm, step_norm, evaluations).
        warnings: one line each.
        resumed_from_step: the step of the checkpoint this run continued from (None: it started afresh).
        structure_factors: with shared structure factors (:mod:`refine.many.amplitudes`): the space group,
            start, counts, each candidate's summed photons and one row ``[h, k, l, d_A, F, esd, refined]`` per
            candidate (esd of the default kind; the Fisher ones are in ``esds_by_kind[...]["shared"]``); empty
            without.  ``amplitude_table``, ``amplitude_values``: the table and every candidate's final value
            (:meth:`hkl_table`).
        refined: shared name -> final value (the amplitudes refined too).
        fit: the final fit against shot noise over every image (``loss``, ``expected_loss``, ``excess``, ``pixels``,
            as a single run's ``fit``; Poisson loss only), ``image_fit`` the same per image.
        spots: the observed spots against the model's over every image (``n``, ``matched_start``,
            ``matched_final``, ``n_common``, ``rms_px_start_common``, ``rms_px_final_common``, ``rms_px_final``:
            pooled over the images), ``image_spots`` the same per image (``nbtorch-refine`` with spots; empty without).

    ``params``, ``initial_params``, ``esds``, ``esd_kinds``, ``free`` and ``correlation`` name the shared part as
    :class:`RefinementResult` names its parameters (the common schema of the result files).
    """

    status: Status
    message: str
    shared: dict
    shared_esds: dict
    images: tuple
    image_esds: tuple
    initial_shared: dict
    initial_images: tuple
    shared_names: tuple
    per_image_names: tuple
    symmetry: str
    loss_name: str
    loss_initial: float
    loss_final: float
    image_losses: tuple
    steps: int
    evaluations: int
    wall_s: float
    world_size: int
    units: dict
    esd_kind: str | None = None
    esds_by_kind: dict = field(default_factory=dict)
    shared_correlation: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    fisher_condition: float = math.nan
    history: tuple = ()
    warnings: tuple = ()
    resumed_from_step: int | None = None
    structure_factors: dict = field(default_factory=dict)
    amplitude_table: Any = field(default=None, repr=False, compare=False)
    amplitude_values: dict = field(default_factory=dict, repr=False)
    refined: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)
    image_fit: tuple = ()
    spots: dict = field(default_factory=dict)
    image_spots: tuple = ()
    mosaic_domains: dict = field(default_factory=dict)
    priors: dict = field(default_factory=dict)

    @property
    def n_images(self) -> int:
        return len(self.images)

    # the shared part under the names of the common schema
    params = property(lambda self: self.shared, doc="The shared values (:attr:`shared`).")
    initial_params = property(lambda self: self.initial_shared, doc="The shared values at the start.")
    esds = property(lambda self: self.shared_esds, doc="The shared esds (:attr:`shared_esds`).")
    correlation = property(lambda self: self.shared_correlation, doc="The shared names' correlation.")
    free = property(lambda self: tuple(self.shared_names), doc="The shared names (refined in every image).")

    @property
    def esd_kinds(self) -> dict:
        """Kind -> shared name -> esd."""
        return {kind: by["shared"] for kind, by in self.esds_by_kind.items()}

    def hkl_table(self):
        """The shared amplitudes with every equivalent and Friedel mate (:class:`nbtorch.io.hkl.HKLTable`, for
        :func:`nbtorch.io.hkl.write_hkl`); None without structure factors."""
        if self.amplitude_table is None:
            return None
        return self.amplitude_table.hkl_table(self.amplitude_values)

    def _correlation_names(self) -> list[str]:
        return [n for n in self.shared_names if not is_amplitude(n)]

    def to_json_dict(self) -> dict[str, Any]:
        """The ``joint.json`` document (plain Python types; the schema of the module docstring)."""
        doc = common_document(self, JOINT_FORMAT, self._correlation_names(), self.structure_factors or None)
        by = self.esds_by_kind
        images = [{"params": p, "initial_params": q, "esds": e,
                   "esds_by_kind": {kind: by[kind]["images"][i] for kind in by}, "loss_final": l}
                  for i, (p, q, e, l) in enumerate(zip(self.images, self.initial_images, self.image_esds,
                                                       self.image_losses))]
        doc.update(n_images=self.n_images, shared_names=list(self.shared_names),
                   per_image_names=list(self.per_image_names), loss=self.loss_name, world_size=self.world_size,
                   history=list(self.history), resumed_from_step=self.resumed_from_step, images=images,
                   shared=self.shared, shared_esds=self.shared_esds, initial_shared=self.initial_shared,
                   shared_correlation=doc["correlation"], fit=self.fit, spots=self.spots)
        if self.priors:
            doc["priors"] = {k: {"mean": float(m), "sigma": float(s)} for k, (m, s) in self.priors.items()}
        for image, fit, spots in zip(images, self.image_fit or [None] * self.n_images,
                                     self.image_spots or [None] * self.n_images):
            image.update({k: v for k, v in (("fit", fit), ("spots", spots)) if v is not None})
        return doc

    def summary(self) -> str:
        """The shared values with esds, one line each, and the run's outcome."""
        lines = [f"joint refinement of {self.n_images} images: {self.status.value} after {self.steps} steps "
                 f"(loss {self.loss_initial:.6g} -> {self.loss_final:.6g}, {self.wall_s:.1f} s, "
                 f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
                 + (f", resumed from step {self.resumed_from_step})" if self.resumed_from_step is not None else ")")]
        for n, v in self.shared.items():
            e = self.shared_esds.get(n)
            lines.append(f"  {n:<14s} {v:14.6f}" + (f" +- {e:.2g}" if e is not None else "")
                         + f" {self.units.get(n, '')}")
        if self.fit:
            lines.append(f"  fit: final loss {self.fit['excess']:.3g}x the shot-noise expectation over {self.fit['pixels']} "
                         "pixels of all images (about 1 = a fit to the noise level)")
        if self.spots:
            s = self.spots
            lines.append(f"  spots: rms {s['rms_px_start_common']:.3g} -> {s['rms_px_final_common']:.3g} px over the "
                         f"{s['n_common']} spots matched before and after ({s['matched_final']} of {s['n']} matched at "
                         "the end, all images)")
        if self.structure_factors:
            sf = self.structure_factors
            lines.append(f"  structure factors: {sf['n_free']} amplitudes refined in {sf['space_group']} (start: "
                         f"{sf['start']}; {sf['n_held']} candidates held, fewer than {sf['min_photons']:g} photons "
                         f"on all images); on the scale of image 0")
        return "\n".join(lines + [f"  warning: {w}" for w in self.warnings])

    def _write_h5(self, h5) -> None:
        """What the file of a joint run adds to the common part (module docstring)."""
        for k in ("world_size", "n_images"):
            h5.attrs[k] = getattr(self, k)
        h5.attrs["loss_name"] = self.loss_name
        for alias, target in (("shared", "params"), ("shared_esds", "esds"), ("initial_shared", "initial_params"),
                              ("shared_correlation", "correlation")):
            h5[alias] = h5[target]  # a link: the same data under the joint files' former names
        for group, rows in (("images", self.images), ("image_esds", self.image_esds),
                            ("initial_images", self.initial_images)):
            g = h5.create_group(group)
            for name in dict.fromkeys(k for r in rows for k in r):
                d = g.create_dataset(name, data=np.array([r.get(name, math.nan) for r in rows], dtype=np.float64))
                d.attrs["units"] = self.units.get(name, "")
        h5.create_dataset("image_losses", data=np.asarray(self.image_losses, dtype=np.float64))
        for group, rows in (("image_fit", self.image_fit), ("image_spots", self.image_spots)):
            if rows:
                g = h5.create_group(group)
                for name in dict.fromkeys(k for r in rows for k in r):
                    g.create_dataset(name, data=np.array([math.nan if r.get(name) is None else r[name] for r in rows],
                                                         dtype=np.float64))
        columns = ("step", "loss", "grad_norm", "step_norm", "evaluations")
        write_history(h5, {c: [math.nan if h.get(c) is None else h[c] for h in self.history] for c in columns})


#: the names joint runs write and read their files by (the same functions)
save_joint_json, save_joint_h5, load_joint_h5 = save_json, save_h5, load_h5
