"""``nbtorch-refine --expt/--refl/--expt-out``: a DIALS experiment as the starting model, DIALS spots as the
spot list, and the refined model written back as a DIALS experiment.

* ``--expt FILE`` (experiment ``--expt-index``, default 0; for a rotation scan the image ``--expt-image``,
  0 = the scan's first): :func:`nbtorch.dials.geometry.experiment_flags` gives the geometry and crystal
  as nanoBragg flags (CUSTOM convention); the ``--model`` flags come after them, so they win
  (e.g. ``-N``, ``-default_F``, ``-mosaic``, which a DIALS experiment does not give).
* ``--refl FILE``: the ``xyzobs.px.value`` centroids of experiment ``--expt-index`` (its ``id``;
  for a scan, those whose frame ``z`` lies on image ``--expt-image``) are the spot list, as ``--spots``:
  ``(x fast, y slow)`` pixels, centres at ``i + 0.5`` in both programs.
* ``--expt-out FILE``: the ``--expt`` document with the refined beam, panel origin and axes and crystal
  real-space vectors (:func:`nbtorch.dials.geometry.refined_document`).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import numpy as np

from nbtorch.errors import InputError
from refine.inputs.dials_profile import (PROFILE_FLAGS, lab_panel, mosaic_model_of_tokens, profile_model,
                                         still_model, window_half_px)

if TYPE_CHECKING:  # types only
    from refine.inputs.measurement import DialsFiles

__all__ = ["read_experiment", "image_index", "model_tokens", "refl_spots", "write_expt_out", "observed_rows"]


def read_experiment(dials: DialsFiles):
    """Experiment ``dials.index`` of ``dials.expt`` (:meth:`DialsFiles.experiment`: multi-panel detectors read too,
    :func:`model_tokens` refuses them where they are not taken; errors name ``--expt``)."""
    return dials.experiment()


def is_still(exp) -> bool:
    """A still: an experiment without a scan (:func:`nbtorch.io.dials.read_expt` drops a scan of zero width)."""
    return exp.scan is None


def _template_pattern(template: str) -> re.Pattern:
    """``l-cyst_02_#####.cbf`` -> a regex of its file names, the number (as many digits as ``#``) captured."""
    parts = re.split(r"(#+)", os.path.basename(template))
    return re.compile("".join(f"(\\d{{{len(p)}}})" if p.startswith("#") else re.escape(p) for p in parts) + "$")


def template_index(exp, image: str) -> int | None:
    """The index (0 = the scan's first image) of the file ``image`` in the scan of ``exp``: its number in the
    imageset's ``template`` (``#`` for the digits) less the scan's first image number, or its place in the imageset's
    ``images`` list.  None when ``exp`` has no scan or its imageset names no files (a single-file template).

    Raises:
        InputError: the file is not one of the template's or list's, or its number is not in the scan.
    """
    if exp.scan is None:
        return None
    imagesets = exp.document.get("imageset") or []
    ref = exp.document["experiment"][exp.index].get("imageset")
    iset = imagesets[ref] if isinstance(ref, int) and 0 <= ref < len(imagesets) else {}
    first, last = (int(v) for v in exp.scan["image_range"])
    name = os.path.basename(str(image))
    template = iset.get("template") if isinstance(iset, dict) else None
    if isinstance(template, str) and "#" in template:
        match = _template_pattern(template).match(name)
        if match is None:
            raise InputError(f"{image}: not a file of the experiment's template {os.path.basename(template)} "
                             f"(--expt {exp.path})")
        number = int(match.group(1))
        if not first <= number <= last:
            raise InputError(f"{image}: image number {number} is not in the experiment's scan (images {first}..{last} "
                             f"of {os.path.basename(template)})")
        return number - first
    listed = [os.path.basename(str(p)) for p in (iset.get("images") or [])] if isinstance(iset, dict) else []
    if listed:
        if name not in listed:
            raise InputError(f"{image}: not one of the experiment's images ({', '.join(listed[:3])}"
                             f"{', ...' if len(listed) > 3 else ''}; --expt {exp.path})")
        return listed.index(name)
    return None


def image_index(dials: DialsFiles) -> int:
    """The scan image ``dials.image`` is (0 = the scan's first): ``dials.scan_image`` (``--expt-image``), else from
    the image's file name (:func:`template_index`), else 0."""
    if dials.scan_image is not None:
        return int(dials.scan_image)
    if not dials.expt or not dials.image:
        return 0
    index = template_index(read_experiment(dials), dials.image)
    return 0 if index is None else index


def _typical_dstar(dials: DialsFiles, exp) -> float:
    """The median ``1/d`` of the ``--refl`` spots (its ``d`` column), else of the panel's pixels (1/A)."""
    from nbtorch.dials.geometry import nb_from_dials
    from nbtorch.io.dials import read_refl

    if dials.refl:
        try:
            d = read_refl(dials.refl, ("d",), experiment_id=dials.index)["d"]
        except InputError:
            d = np.zeros(0)
        d = d[np.isfinite(d) & (d > 0)]
        if len(d):
            return float(np.median(1.0 / d))
    panel = lab_panel(exp)
    nf, ns = (int(v) for v in panel["image_size"])
    px = float(panel["pixel_size"][0])
    u, v = np.meshgrid(np.linspace(0, nf, 17), np.linspace(0, ns, 17))
    pos = (np.asarray(panel["origin"])[None, None] + u[..., None] * px * np.asarray(panel["fast_axis"])
           + v[..., None] * px * np.asarray(panel["slow_axis"]))
    beam = nb_from_dials(-np.asarray(exp.beam["direction"], dtype=np.float64))
    cos2t = (nb_from_dials(pos) @ beam) / np.linalg.norm(pos, axis=-1) / np.linalg.norm(beam)
    return float(np.median(2.0 * np.sin(np.arccos(np.clip(cos2t, -1, 1)) / 2.0))) / float(exp.beam["wavelength"])


def model_tokens(dials: DialsFiles | None, model: str | None, say=None,
                 multi_panel: bool = False) -> str | list[str] | None:
    """The starting model for :func:`refine.inputs.start_model.model_config`: ``model`` (``--model``) alone, or the
    ``--expt`` flags
    (geometry, crystal, the scan's rotation of the image; the crystal model of the profile, :func:`profile_model`,
    or of a still's crystal and profile, :func:`still_model`) followed by the ``--model`` tokens, whose flags replace
    those.  ``say``: where the profile's note goes.
    ``multi_panel``: a detector of several panels is taken (the flags are panel 0's; :mod:`refine.inputs.panels`
    gives every panel's), else refused."""
    if dials is None or not dials.expt:
        return model
    from nbtorch.dials.geometry import experiment_flags
    from nbtorch.io.dials import scan_oscillation
    from refine.inputs.start_model import expand_model_args

    exp = read_experiment(dials)
    if len(exp.panels) > 1 and not multi_panel:
        raise InputError(f"--expt {exp.path}: multi-panel detector ({len(exp.panels)} panels); nbtorch-refine takes "
                         "one on a single --image (not in joint runs)")
    try:
        if len(exp.panels) > 1:
            from nbtorch.dials.panels import panel_flags

            flags = panel_flags(exp, image_index(dials))[0]
        else:
            flags = experiment_flags(exp, image_index(dials))
    except InputError as exc:
        raise InputError(exc if str(exc).startswith("--expt") else f"--expt {exc}") from None
    user = expand_model_args(model) if model else []
    osc = scan_oscillation(exp.scan, exp.path)[1] if exp.scan is not None else None
    profile = (still_model(exp, mosaic_model_of_tokens(user)) if exp.scan is None
               else profile_model(exp, _typical_dstar(dials, exp), osc, mosaic_model_of_tokens(user)))
    if profile is not None:
        kept = {k: v for k, v in profile.flags().items() if not any(t in PROFILE_FLAGS[k] for t in user)}
        if exp.scan is None:
            kept.pop("phisteps", None)
        if kept and say is not None:
            say(f"  {profile.note(kept)}")
        flags += [t for v in kept.values() for t in v]
    return flags + user


def _header_index(exp, geo: dict) -> int | None:
    """The scan image whose start angle the header gives (None without one)."""
    from nbtorch.io.dials import scan_oscillation

    if geo.get("phi_deg") is None:
        return None
    start, width = scan_oscillation(exp.scan, exp.path)
    return int(round((float(geo["phi_deg"]) + min(float(geo.get("osc_deg") or 0.0), 0.0) - start) / width))


def _check_against_scan(exp, image: str, index: int | None, obs) -> int:
    """``image``'s scan index (``index`` from the file name, else from its header's angle), its size and its
    header's rotation checked against the experiment's panel and scan."""
    from nbtorch.dials.geometry import nominal_phi_deg
    from nbtorch.io.dials import scan_oscillation

    nf, ns = (int(v) for v in exp.panel["image_size"])
    if tuple(obs.shape) != (ns, nf):
        raise InputError(f"{image}: image is {obs.shape[1]} x {obs.shape[0]} pixels (fast x slow) but the "
                         f"experiment's detector is {nf} x {ns} (--expt {exp.path})")
    geo = obs.geometry
    if index is None:
        index = _header_index(exp, geo)
        if index is None:
            raise InputError(f"{image}: neither its file name (the experiment's imageset names no files) nor its "
                             "header tells which image of the experiment's scan it is; give --expt-image")
    first, last = (int(v) for v in exp.scan["image_range"])
    if not 0 <= index <= last - first:
        raise InputError(f"{image}: its header's angle is off the experiment's scan (images {first}..{last})")
    start, width = nominal_phi_deg(exp, index), scan_oscillation(exp.scan, exp.path)[1]
    if geo.get("phi_deg") is not None and geo.get("osc_deg"):
        head = float(geo["phi_deg"]) + min(float(geo["osc_deg"]), 0.0)
        tol = 1e-3 + 0.01 * abs(width)
        if abs(head - start) > tol or abs(abs(float(geo["osc_deg"])) - abs(width)) > tol:
            raise InputError(f"{image}: its header's rotation ({head:g} deg, width {abs(float(geo['osc_deg'])):g}) is "
                             f"off the experiment's scan, which has image {first + index} at {start:g} deg, width "
                             f"{abs(width):g} (--expt {exp.path})")
    return index


def scan_indices(dials: DialsFiles | None, images: list[str], frame: int | None = None,
                 shape: tuple[int, int] | None = None, dtype: str = "<f4",
                 dataset: str = "/entry/data/data") -> list[int | None]:
    """Each image's index in the ``--expt`` scan (0 = its first image), matched by the experiment's template or
    image list (:func:`template_index`) or else the header's start angle, and each image checked against the
    experiment before any work: a file of the template, its size the detector's, its header's rotation the scan's
    (one line naming the image and the mismatch).  None for every image without ``--expt`` or a scan.
    ``frame``, ``shape``, ``dtype``, ``dataset``: how the images are read (:func:`refine.inputs.images.load_image`)."""
    from refine.inputs.images import load_image

    if dials is None or not dials.expt:
        return [None] * len(images)
    exp = read_experiment(dials)
    if exp.scan is None:
        return [None] * len(images)
    out: list[int | None] = []
    for image in images:
        index = template_index(exp, image)
        if not os.path.isfile(image):
            raise InputError(f"{image}: image file not found")
        obs = load_image(image, frame=frame, shape=shape, dtype=dtype, dataset=dataset)
        out.append(_check_against_scan(exp, image, index, obs))
    return out


def spot_window(dials: DialsFiles | None, given: int | None, say=None) -> int | None:
    """``given`` (``--spot-window``), or for DIALS spots of a rotation scan (``--refl`` with an ``--expt`` scan) by default the
    half-width that holds a spot (:func:`window_half_px`); None otherwise (every pixel of the fitted region; a
    still's default windows: :mod:`refine.inputs.still_defaults`)."""
    if given is not None or dials is None or not (dials.refl and dials.expt):
        return given
    exp = read_experiment(dials)
    if exp.scan is None:
        return None
    half, why = window_half_px(exp)
    if say is not None:
        say(f"  spot windows of +-{half} pixels around the DIALS spots ({why}; --spot-window)")
    return half


#: DIALS reflection flags (``dials.array_family.flex.reflection_table.flags``) that select the observed centroids
STRONG, CENTROID_OUTLIER = 1 << 5, 1 << 17


def observed_rows(path: str, cols: dict) -> np.ndarray:
    """The rows of a ``.refl`` whose ``xyzobs.px.value`` is an observed centroid: never a zero or non-finite
    position; with a ``flags`` column that marks spots found by the spot finder (``strong``, what DIALS refines
    against), those not flagged as centroid outliers (an integrated table's other rows hold the centres of
    shoeboxes that may hold nothing); else every row."""
    xyz = cols["xyzobs.px.value"]
    keep = np.all(np.isfinite(xyz), axis=1) & np.any(xyz[:, :2] != 0, axis=1)
    flags = cols.get("flags")
    if flags is not None and bool(((flags & STRONG) > 0).any()):
        keep &= ((flags & STRONG) > 0) & ((flags & CENTROID_OUTLIER) == 0)
    return keep


#: which ``.refl`` rows a rotation image's fitted pixels surround (:func:`refl_spots`): ``"observed"`` (the observed
#: spots whose shoebox reaches into the image) or ``"all"`` (every reflection DIALS predicted there, observed or not)
WINDOWS = "all"


def refl_spots(dials: DialsFiles, windows: str | None = None) -> np.ndarray:
    """``(n, 3)`` observed spots of ``--refl`` (x fast, y slow in pixels, z in frames; :func:`observed_rows`).

    For a rotation scan (``--expt`` with a scan) those of the image: the spots whose centroid frame ``z`` lies on it
    (``z`` in ``[f + k, f + k + 1)`` for image ``k``, ``f`` the scan's first image number less 1, as DIALS counts
    frames), and after them, with ``z`` NaN, the other reflections whose shoebox (``bbox``) reaches into this image
    (``windows``, default :data:`WINDOWS`: ``"all"`` every such row at its predicted ``xyzcal.px`` position,
    ``"observed"`` only the observed spots of the neighbouring images): their pixels are fitted too (a partial, or
    where DIALS predicts a reflection that is not there), but only the spots of the image are compared with the
    model (:func:`on_image`).
    """
    from nbtorch.io.dials import read_refl

    path = dials.refl
    try:
        cols = read_refl(path, ("xyzobs.px.value",), experiment_id=dials.index,
                         optional=("flags", "bbox", "xyzcal.px"))
    except InputError as exc:
        raise InputError(f"--refl {exc}") from None
    observed = observed_rows(path, cols)
    xyz = cols["xyzobs.px.value"]
    exp = read_experiment(dials) if dials.expt else None
    index = image_index(dials)
    if exp is not None and exp.scan is not None:
        z0 = float(exp.scan["image_range"][0]) - 1.0 + index
        here = observed & (xyz[:, 2] >= z0) & (xyz[:, 2] < z0 + 1.0)
        out = [xyz[here]]
        if "bbox" in cols:
            bbox = cols["bbox"]
            near = ~here & (bbox[:, 4] < z0 + 1.0) & (bbox[:, 5] > z0)
            near &= observed if (windows or WINDOWS) == "observed" else np.isfinite(xyz).all(axis=1)
            where = cols["xyzcal.px"] if "xyzcal.px" in cols and (windows or WINDOWS) == "all" else xyz
            out.append(np.c_[where[near, :2], np.full(int(near.sum()), np.nan)])
        xyz = np.concatenate(out)
        xyz = xyz[np.isfinite(xyz[:, :2]).all(axis=1)]
    else:
        xyz = xyz[observed]
    if not len(xyz):
        raise InputError(f"--refl {path}: no observed spots of experiment {dials.index}"
                         + (f" on image {index} of the scan" if exp is not None and exp.scan is not None else ""))
    return np.ascontiguousarray(xyz)


def _scan_observations(dials: DialsFiles | None, column: str):
    """``(the --expt experiment, the --refl columns xyzobs.px.value, flags and column)`` for an experiment with a
    scan; None without a scan, without ``--refl`` or without ``column`` in it."""
    from nbtorch.io.dials import read_refl

    exp = read_experiment(dials) if dials is not None and dials.expt else None
    if exp is None or exp.scan is None or not dials.refl:
        return None
    try:
        cols = read_refl(dials.refl, ("xyzobs.px.value",), experiment_id=dials.index,
                         optional=(column, "flags"))
    except InputError as exc:
        raise InputError(f"--refl {exc}") from None
    return (exp, cols) if column in cols else None


def refl_indexed(dials: DialsFiles | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The indexed observed spots of ``--refl`` on the ``--expt`` scan: ``(hkl (n, 3), xyz (n, 3) x, y px and z frames,
    phi (n,) the scan angle of each spot's frame in deg)`` (:func:`observed_rows` with a non-zero ``miller_index``),
    None without a scan or Miller indices."""
    from nbtorch.io.dials import scan_oscillation

    found = _scan_observations(dials, "miller_index")
    if found is None:
        return None
    exp, cols = found
    keep = observed_rows(dials.refl, cols) & np.any(cols["miller_index"] != 0, axis=1)
    xyz = cols["xyzobs.px.value"][keep]
    start, width = scan_oscillation(exp.scan, exp.path)
    phi = start + (xyz[:, 2] - (float(exp.scan["image_range"][0]) - 1.0)) * width
    return cols["miller_index"][keep].astype(np.float64), xyz, phi


def refl_shoeboxes(dials: DialsFiles | None) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The observed spots of ``--refl`` on the ``--expt`` scan with their shoeboxes: ``(xyz (m, 3) x, y px and z frames,
    bbox (m, 6) x0, x1, y0, y1, z0, z1 (ends exclusive), the frame of the scan's image 0)`` (:func:`observed_rows`);
    None without a scan or a ``bbox`` column (:func:`refine.many.image_reports.sweep_spot_rows` compares them)."""
    found = _scan_observations(dials, "bbox")
    if found is None:
        return None
    exp, cols = found
    keep = observed_rows(dials.refl, cols)
    return cols["xyzobs.px.value"][keep], cols["bbox"][keep].astype(np.int64), float(exp.scan["image_range"][0]) - 1.0


def on_image(spots: np.ndarray | None) -> np.ndarray | None:
    """The spots of :func:`refl_spots` observed on the image (not a neighbour's, whose ``z`` is NaN)."""
    if spots is None or spots.shape[1] < 3:
        return spots
    return spots[np.isfinite(spots[:, 2])]


def _experiment_group(dials: DialsFiles | None):
    """The gemmi space group of the ``--expt`` crystal (its Hall symbol); None without ``--expt``, a Hall symbol or
    gemmi."""
    if dials is None or not dials.expt:
        return None
    hall = read_experiment(dials).crystal.get("space_group_hall_symbol")
    try:
        import gemmi

        return gemmi.find_spacegroup_by_ops(gemmi.symops_from_hall(str(hall)))
    except (ImportError, RuntimeError, ValueError, TypeError):
        return None


def experiment_symmetry(dials: DialsFiles | None, symmetry: str | None = None) -> str | None:
    """Without a ``symmetry`` given (``--symmetry``): the crystal system of the ``--expt`` crystal's space group (:func:`_experiment_group`),
    so that the refined cell keeps the symmetry DIALS indexed; None where the experiment names none."""
    group = None if symmetry else _experiment_group(dials)
    if group is None:
        return None
    system = group.crystal_system_str()
    return "rhombohedral" if system == "trigonal" and group.hm.startswith("R") and group.ext == "R" else system


def experiment_space_group(dials: DialsFiles | None) -> str | None:
    """The ``--expt`` crystal's space group by its Hermann-Mauguin name (e.g. ``P 2 2 2``), the amplitudes' space
    group when ``--structure-factors`` names none; None where the experiment names none."""
    group = _experiment_group(dials)
    return None if group is None else group.hm


def _hall_symbol(symmetry: str | None) -> str:
    """The Hall symbol of ``--symmetry`` when it names a space group (gemmi), else P 1."""
    try:
        import gemmi
    except ImportError:
        return " P 1"
    group = gemmi.find_spacegroup_by_name(symmetry) if symmetry else None
    return group.hall if group is not None else " P 1"


def write_expt_out(dials: DialsFiles, path: str, sim, params, symmetry: str | None = None) -> None:
    """Write ``path`` (``--expt-out``): the ``--expt`` document (or, without one, a new still experiment of
    ``dials.image``, its space group ``symmetry`` where that names one) with ``sim``'s geometry at the refined
    ``params``."""
    from nbtorch.dials.geometry import refined_document, still_experiment
    from nbtorch.io.dials import write_expt

    if dials.expt:
        doc = refined_document(read_experiment(dials), sim, dict(params), image_index(dials))
    else:
        doc = refined_document(still_experiment(sim, dials.image, _hall_symbol(symmetry)), sim, dict(params))
    write_expt(path, doc)
