"""A DIALS experiment as nanoBragg flags, and a model's geometry written back as a DIALS experiment.

Frames
    The DIALS lab frame (dxtbx) has ``x`` along the horizontal detector fast direction, ``y`` up and
    ``z`` towards the source: the beam travels along ``-z`` (a beam model's ``direction`` points to
    the source, ``s0 = -direction/λ``).  nanoBragg's frame (MOSFLM convention, ``docs/conventions.md``)
    has ``x`` along the beam.  The two differ by a proper rotation (the C's own DIALS origin printout,
    ``nanobragg-physics.md`` "DIALS origin"):

    ``nb = (-d_z, d_y, d_x)``, ``d = (nb_z, nb_y, -nb_x)``  (:data:`NB_FROM_DIALS`, det = +1),

    so the beam ``(0, 0, -1)`` of DIALS is nanoBragg's ``(1, 0, 0)`` and DIALS ``x`` (horizontal)
    is nanoBragg's spindle/polarization ``z``.

The flags (:func:`experiment_flags`, CUSTOM convention, every vector in nanoBragg's frame)
    * ``-lambda`` the beam's wavelength (Å); ``-beam_vector`` = ``-direction`` (propagation);
      ``-polar_vector`` = ``unit(normal × direction)`` (the E-vector, perpendicular to the
      polarization plane's normal) and ``-polar K`` with the Kahn factor ``K = 2·fraction - 1``;
    * ``-fdet_vector -sdet_vector`` the panel's fast and slow axes, ``-odet_vector unit(f × s)``;
      the panel origin (the corner of pixel (0, 0), mm) is ``-Fc·f - Sc·s + close·o``, solved
      exactly (f and s need not be orthogonal) and given as ``-Xbeam Fc -Ybeam Sc
      -close_distance close -pivot sample`` (CUSTOM: ``Xbeam`` is the near point ``Fclose``);
      ``-pixel`` (square pixels only), ``-detpixels_f/_s`` the image size;
    * ``-cell`` and ``-misset`` from the real-space vectors: the reciprocal basis is split into a
      cell and the rotation U (``recip = B(cell) U^T``, as ``-mat``), and ``U = Rz·Ry·Rx``
      gives the misset angles;
    * with a goniometer: ``-spindle_axis`` = setting rotation · rotation axis, and the crystal is
      taken at the datum ``setting · fixed · A``; with a scan, ``-phi`` the start angle of the image
      (array index ``image_index``, 0 = first image) and ``-osc`` the oscillation width (deg).

    Pixel coordinates need no shift: DIALS and nbtorch both put pixel centres at ``i + 0.5``.
    Sensor thickness and parallax are not carried over (DIALS' ``xyzcal.mm`` is the plain
    plane intersection; ``xyzcal.px`` may include a parallax correction).

:func:`refined_document` goes the other way: from a simulator's geometry at given parameter values
to the experiment's document, changing only the beam (direction, wavelength, polarization
fraction), the panel (origin, fast and slow axes) and the crystal's real-space vectors.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nbtorch.errors import InputError
from nbtorch.io.dials import (
    DialsExperiment, hierarchy_walk, local_frame, panel_lab_frames, scan_oscillation, updated_document,
)
from nbtorch.physics.crystal import orientation_from_reciprocal
from nbtorch.physics.rotation import rotation_matrix_axis_angle, rotation_matrix_xyz

__all__ = ["NB_FROM_DIALS", "nb_from_dials", "dials_from_nb", "dials_origin_mm", "experiment_flags", "nominal_phi_deg",
           "misset_from_rotation_deg", "refined_document", "still_experiment", "bragg_positions_px",
           "goniometer_rotations", "stills_delpsi_rad", "ewald_orientation_deg"]

#: v_nb = NB_FROM_DIALS @ v_dials (a proper rotation; its transpose goes back)
NB_FROM_DIALS = np.array([[0.0, 0.0, -1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def nb_from_dials(v) -> np.ndarray:
    """DIALS lab-frame vector(s) (..., 3) -> nanoBragg frame."""
    return np.asarray(v, dtype=np.float64) @ NB_FROM_DIALS.T


def dials_from_nb(v) -> np.ndarray:
    """nanoBragg-frame vector(s) (..., 3) -> DIALS lab frame."""
    return np.asarray(v, dtype=np.float64) @ NB_FROM_DIALS


def dials_origin_mm(pix0_m) -> tuple[float, float, float]:
    """The panel origin ``pix0`` (m, nanoBragg frame) in the DIALS lab frame in mm, as the C's SMV header writes
    ``DIALS_ORIGIN``: :func:`dials_from_nb` of ``1000 pix0``, each DIALS component taken as the one signed
    nanoBragg component :data:`NB_FROM_DIALS` maps to it (no sum over zero terms), so that a zero keeps the
    sign the C prints (``-0``)."""
    v = [float(x) for x in pix0_m]
    out = []
    for j in range(3):
        i = int(np.flatnonzero(NB_FROM_DIALS[:, j])[0])
        out.append(float(NB_FROM_DIALS[i, j]) * (1000 * v[i]))
    return out[0], out[1], out[2]


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def _fmt(v) -> str:
    return repr(float(v))


def _vec_flags(flag: str, v) -> list[str]:
    return [flag, *(_fmt(x) for x in v)]


def misset_from_rotation_deg(u: np.ndarray) -> tuple[float, float, float]:
    """Angles ``(x, y, z)`` in degrees with ``u = Rz(z) Ry(y) Rx(x)`` (``-misset``'s order)."""
    y = math.atan2(-u[2, 0], math.hypot(u[0, 0], u[1, 0]))
    x = math.atan2(u[2, 1], u[2, 2])
    z = math.atan2(u[1, 0], u[0, 0])
    return tuple(math.degrees(a) for a in (x, y, z))  # type: ignore[return-value]


def _axis_angle_matrix(axis, angle_deg: float) -> np.ndarray:
    """Rotation by ``angle_deg`` (right-handed) about ``axis`` (normalised here), as dxtbx's ``axis_and_angle_as_matrix``."""
    k = _unit(axis)
    a = math.radians(angle_deg)
    kx = np.array([[0.0, -k[2], k[1]], [k[2], 0.0, -k[0]], [-k[1], k[0], 0.0]])
    return np.eye(3) + math.sin(a) * kx + (1.0 - math.cos(a)) * (kx @ kx)


def goniometer_rotations(gonio: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fixed rotation F, setting rotation S, rotation axis at the datum e)`` of a DIALS goniometer (DIALS frame):
    the crystal's real-space vectors at scan angle ``phi`` are ``S R(e, phi) F A`` (A as the .expt writes them).

    A single-axis goniometer gives its ``fixed_rotation``/``setting_rotation``/``rotation_axis``.  A multi-axis one
    (``axes`` from the crystal outwards, ``angles``, ``scan_axis``) reduces exactly to one spindle, as dxtbx's
    ``MultiAxisGoniometer``: the axes below the scan axis make ``F = R_{k-1} ... R_0``, those above it
    ``S = R_{n-1} ... R_{k+1}`` (each ``R_i`` its axis at its angle), ``e`` = the scan axis; the scan axis's own
    angle in ``angles`` is the scan's, not used."""
    if "axes" not in gonio:
        fixed = np.asarray(gonio.get("fixed_rotation", np.eye(3).ravel()), dtype=np.float64).reshape(3, 3)
        setting = np.asarray(gonio.get("setting_rotation", np.eye(3).ravel()), dtype=np.float64).reshape(3, 3)
        return fixed, setting, _unit(gonio["rotation_axis"])
    axes, angles, k = gonio["axes"], [float(a) for a in gonio["angles"]], int(gonio["scan_axis"])
    fixed, setting = np.eye(3), np.eye(3)
    for i in range(k):
        fixed = _axis_angle_matrix(axes[i], angles[i]) @ fixed
    for i in range(k + 1, len(axes)):
        setting = _axis_angle_matrix(axes[i], angles[i]) @ setting
    return fixed, setting, _unit(axes[k])


def _goniometer_setting(exp: DialsExperiment) -> tuple[np.ndarray, np.ndarray | None]:
    """``(setting · fixed rotation, spindle axis)`` in the DIALS frame (identity and None without a goniometer)."""
    g = exp.goniometer
    if g is None:
        return np.eye(3), None
    fixed, setting, axis = goniometer_rotations(g)
    return setting @ fixed, setting @ axis


def nominal_phi_deg(exp: DialsExperiment, image_index: int = 0) -> float:
    """The scan angle (deg) at the start of image ``image_index`` (0 = first image of the scan); 0 for a still."""
    if exp.scan is None:
        return 0.0
    start, width = scan_oscillation(exp.scan, exp.path)
    first, last = (int(v) for v in exp.scan["image_range"])
    if not 0 <= image_index <= last - first:
        raise InputError(f"{exp.path}: no image {image_index} in the scan (images 0..{last - first})")
    return start + image_index * width


def _real_vectors_dials(exp: DialsExperiment) -> np.ndarray:
    return np.array([exp.crystal[k] for k in ("real_space_a", "real_space_b", "real_space_c")], dtype=np.float64)


def experiment_flags(exp: DialsExperiment, image_index: int = 0, panel: dict | None = None) -> list[str]:
    """nanoBragg flags (CUSTOM convention, nanoBragg frame) for experiment ``exp`` (see the module docstring).

    ``panel``: the panel to use instead of the detector's one panel (fast_axis, slow_axis, origin in the lab
    frame, pixel_size, image_size; :mod:`nbtorch.dials.panels` gives each panel of a multi-panel detector).

    Raises:
        InputError: non-square pixels, a left-handed crystal basis, a detector facing away from the sample,
            a beam parallel to the polarization normal.
    """
    path, beam = exp.path, exp.beam
    if panel is None:  # the one panel in the lab frame: a hierarchy's group frames composed (none: as written)
        f_lab, s_lab, o_lab = panel_lab_frames(exp.detector)[0]
        panel = dict(exp.panel, fast_axis=list(f_lab), slow_axis=list(s_lab), origin=list(o_lab))
    pf, ps = (float(v) for v in panel["pixel_size"])
    if not (pf > 0 and abs(pf - ps) <= 1e-12 * pf):
        raise InputError(f"{path}: pixels of {pf:g} x {ps:g} mm are not square; nanoBragg has one -pixel size")
    nf, ns = (int(v) for v in panel["image_size"])
    f = _unit(nb_from_dials(panel["fast_axis"]))
    s = _unit(nb_from_dials(panel["slow_axis"]))
    o = _unit(np.cross(f, s))
    origin_mm = nb_from_dials(panel["origin"])
    neg_fc, neg_sc, close = np.linalg.solve(np.stack([f, s, o], axis=1), origin_mm)
    if not close > 0:
        raise InputError(f"{path}: the panel's fast x slow normal points towards the sample (origin . normal = "
                         f"{close:.4g} mm); such a detector is not supported")
    direction = _unit(beam["direction"])
    b = nb_from_dials(-direction)
    normal = np.asarray(beam.get("polarization_normal", (0.0, 1.0, 0.0)), dtype=np.float64)
    e_vec = np.cross(normal, direction)
    if not np.linalg.norm(e_vec) > 1e-12:
        raise InputError(f"{path}: beam 'polarization_normal' is parallel to the beam direction")
    kahn = 2.0 * float(beam.get("polarization_fraction", 0.5)) - 1.0
    flags = ["-lambda", _fmt(beam["wavelength"]), *_vec_flags("-beam_vector", b),
             *_vec_flags("-polar_vector", nb_from_dials(_unit(e_vec))), "-polar", _fmt(kahn),
             *_vec_flags("-fdet_vector", f), *_vec_flags("-sdet_vector", s), *_vec_flags("-odet_vector", o),
             "-pixel", _fmt(pf), "-detpixels_f", str(nf), "-detpixels_s", str(ns),
             "-Xbeam", _fmt(-neg_fc), "-Ybeam", _fmt(-neg_sc), "-close_distance", _fmt(close), "-pivot", "sample"]
    datum, spindle = _goniometer_setting(exp)
    real_d = _real_vectors_dials(exp) @ datum.T  # rows a, b, c at the goniometer datum (DIALS frame)
    real = nb_from_dials(real_d)
    if np.linalg.det(real) <= 0:
        raise InputError(f"{path}: the crystal's real_space_a, _b, _c are left-handed or coplanar")
    recip = np.linalg.inv(real).T  # rows a*, b*, c* (1/Å)
    cell_t, u = orientation_from_reciprocal(torch.as_tensor(recip))
    cell = cell_t.numpy().copy()
    cell[3:] = np.degrees(cell[3:])
    flags += ["-cell", *(_fmt(v) for v in cell), "-misset", *(_fmt(v) for v in misset_from_rotation_deg(u.numpy()))]
    if spindle is not None:
        flags += _vec_flags("-spindle_axis", nb_from_dials(spindle))
    if exp.scan is not None:
        flags += ["-phi", _fmt(nominal_phi_deg(exp, image_index)), "-osc", _fmt(scan_oscillation(exp.scan, path)[1])]
    return flags


def _tensor(sim, value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=sim.dtype, device=sim.device)


def _params(sim, values: dict) -> dict[str, torch.Tensor]:
    # tensors of the simulator's dtype: a Python float would pass through float32 (torch's default dtype)
    names = set(sim.parameter_names())  # the canonical names, and a multi-panel detector's per-panel names
    return sim.parameters_dict(**{k: _tensor(sim, float(v)) for k, v in values.items() if k in names})


def refined_document(exp: DialsExperiment, sim, values: dict, image_index: int = 0,
                     panels: list[dict] | None = None) -> dict:
    """The experiment's document with the geometry of ``sim`` at parameter ``values`` (canonical names; the
    simulator's own values for those left out): beam direction, wavelength and polarization fraction,
    the panel's origin and axes, the crystal's real-space vectors at the goniometer datum.

    ``sim`` must have been built from :func:`experiment_flags` of ``exp`` (maybe with more flags);
    ``image_index`` as given there.  ``panels``: the fields of every panel of a multi-panel detector
    (:func:`nbtorch.dials.panels.refined_panels_document`), written instead of the one panel's.
    """
    multi = sim.panel_layout is not None
    with torch.no_grad():
        p = _params(sim, values)
        geom = sim.geometry(p, panel=0) if multi else sim.geometry(p)
        setup = sim.setup
        deg = math.pi / 180.0
        real, _ = sim.crystal_vectors(p)
        # a refined phi0 rotates the crystal about the spindle; the datum is the nominal angle's
        turn = (p["phi0"] - nominal_phi_deg(exp, image_index)) * deg
        rot = rotation_matrix_axis_angle(_tensor(sim, setup.spindle), turn)
        real = real @ rot.transpose(-1, -2)
        to_np = [t.detach().cpu().double().numpy() for t in (geom.pix0, geom.fdet, geom.sdet, geom.beam, real)]
    pix0_m, f, s, b, real_nb = to_np
    datum, _ = _goniometer_setting(exp)
    real_d = dials_from_nb(real_nb) @ np.linalg.inv(datum).T
    kahn = float(p["polarization"])
    beam = {"direction": [float(v) for v in dials_from_nb(-b)], "wavelength": float(p["wavelength"]),
            "polarization_fraction": 0.5 * (1.0 + kahn)}
    f_d, s_d, o_d = dials_from_nb(f), dials_from_nb(s), dials_from_nb(pix0_m * 1000.0)
    if "hierarchy" in exp.detector:  # written local to the panel's group, as dxtbx reads it
        f_d, s_d, o_d = local_frame(hierarchy_walk(exp.detector)[0][0], f_d, s_d, o_d)
    panel = {"origin": [float(v) for v in o_d], "fast_axis": [float(v) for v in f_d],
             "slow_axis": [float(v) for v in s_d]}
    crystal = {k: [float(v) for v in real_d[i]] for i, k in enumerate(("real_space_a", "real_space_b", "real_space_c"))}
    return updated_document(exp, beam, panel if panels is None else panels, crystal)


def still_experiment(sim, image_path: str = "", hall_symbol: str = " P 1") -> DialsExperiment:
    """A DIALS still experiment (beam, one-panel detector, crystal; no goniometer or scan) shaped for
    :func:`refined_document`, for a ``sim`` not built from a ``.expt``: its fields are placeholders that
    :func:`refined_document` overwrites with the simulator's geometry, except the panel's size and pixel
    size, the beam's polarization normal (from the simulator's E-vector) and the space group
    (``hall_symbol``, e.g. ``" P 4abw 2nw"`` for P41212).
    """
    setup = sim.setup
    ny, nx = (int(v) for v in sim.shape)
    pixel_mm = float(setup.pixel_m) * 1000.0
    direction = dials_from_nb(-np.asarray(setup.beam, dtype=np.float64))
    e_vec = dials_from_nb(np.asarray(setup.polar_axis, dtype=np.float64))
    normal = _unit(np.cross(direction, e_vec))
    zero = [0.0, 0.0, 0.0]
    document = {
        "__id__": "ExperimentList",
        "experiment": [{"__id__": "Experiment", "identifier": "", "beam": 0, "detector": 0, "crystal": 0,
                        "imageset": 0}],
        "imageset": [{"__id__": "ImageSet", "images": [str(image_path)] if image_path else [], "mask": "",
                      "gain": "", "pedestal": "", "dx": "", "dy": "", "params": {}}],
        "beam": [{"direction": list(direction), "wavelength": 1.0, "divergence": 0.0, "sigma_divergence": 0.0,
                  "polarization_normal": [float(v) for v in normal], "polarization_fraction": 0.5,
                  "flux": 0.0, "transmission": 1.0}],
        "detector": [{"panels": [{"name": "Panel", "type": "SENSOR_PAD", "fast_axis": [1.0, 0.0, 0.0],
                                  "slow_axis": [0.0, -1.0, 0.0], "origin": zero, "raw_image_offset": [0, 0],
                                  "image_size": [nx, ny], "pixel_size": [pixel_mm, pixel_mm],
                                  "trusted_range": [-1.0, 1.0e9], "thickness": 0.0, "material": "", "mu": 0.0,
                                  "identifier": "", "gain": 1.0, "pedestal": 0.0,
                                  "px_mm_strategy": {"type": "SimplePxMmStrategy"}}]}],
        "crystal": [{"__id__": "crystal", "real_space_a": zero, "real_space_b": zero, "real_space_c": zero,
                     "space_group_hall_symbol": hall_symbol}],
    }
    return DialsExperiment(path=str(image_path), document=document, index=0, identifier="",
                           beam=document["beam"][0], detector=document["detector"][0],
                           crystal=document["crystal"][0], goniometer=None, scan=None)


def bragg_positions_px(sim, values: dict, hkl, phi_deg, delpsi_rad=None, panel: int | None = None) -> np.ndarray:
    """Where the Bragg reflections ``hkl`` (n, 3) hit the detector of ``sim`` at parameter ``values``, with the
    crystal turned to spindle angle ``phi_deg`` (scalar or (n,)) instead of ``phi0``: ``(n, 2)`` pixel
    coordinates (x fast, y slow; pixel centres at ``i + 0.5``, as DIALS' ``xyzcal.px``), NaN where the
    diffracted ray misses the detector plane.

    Analytic, nanoBragg frame: ``S = h a* + k b* + l c*`` (rotated), ray ``d = b/λ + S``, plane through
    ``pix0`` with normal ``o``; the hit is written in the (maybe skew) fast and slow axes.
    ``delpsi_rad`` (n,) turns each ``S`` about ``unit(S × s0)`` first, as DIALS' stills predictor puts
    the reciprocal-lattice point on the Ewald sphere (its ``delpsical.rad`` column).
    ``panel``: for a multi-panel simulator, the coordinates in that panel (its pixels; the plane of the panel).
    """
    pixel_m = sim.setup.pixel_m if panel is None else sim.panel_layout.panels[panel].detector.pixel_m
    with torch.no_grad():
        p = _params(sim, values)
        geom = sim.geometry(p) if panel is None else sim.geometry(p, panel=panel)
        setup = sim.setup
        deg = math.pi / 180.0
        _, recip = sim.crystal_vectors(p)
        hkl_t = _tensor(sim, np.asarray(hkl, dtype=np.float64))
        phi = _tensor(sim, np.broadcast_to(np.asarray(phi_deg, dtype=np.float64), (len(hkl_t),)).copy()) * deg
        rot = rotation_matrix_axis_angle(_tensor(sim, setup.spindle).expand(len(phi), 3), phi)  # (n, 3, 3)
        S = torch.einsum("nij,nj->ni", rot, hkl_t @ recip)
        s0 = geom.beam / p["wavelength"]
        if delpsi_rad is not None:
            axis = torch.linalg.cross(S, s0.expand_as(S), dim=-1)
            axis = axis / torch.linalg.vector_norm(axis, dim=-1, keepdim=True)
            S = torch.einsum("nij,nj->ni", rotation_matrix_axis_angle(axis, _tensor(sim, np.asarray(delpsi_rad))), S)
        d = s0 + S
        t = (geom.pix0 * geom.odet).sum() / (d * geom.odet).sum(-1)
        rel = t[:, None] * d - geom.pix0
        basis = torch.stack([geom.fdet, geom.sdet, geom.odet], dim=1)
        fs = torch.linalg.solve(basis, rel.T).T[:, :2] / pixel_m
        fs[t <= 0] = float("nan")
    return fs.cpu().double().numpy()


def _beam_geometry(sim, p):
    return sim.geometry(p, panel=0) if sim.panel_layout is not None else sim.geometry(p)  # panels share the beam


def stills_delpsi_rad(sim, values: dict, hkl) -> np.ndarray:
    """DIALS's Ewald offset of a still (its ``delpsical.rad``): for each reflection ``hkl`` (n, 3) the angle
    (rad) that turns its reciprocal-lattice vector ``q`` about ``e1 = unit(q × s0)`` onto the Ewald sphere, the
    crystal at parameter ``values`` (phi 0, no mosaic).  Rotating about ``q × s0`` keeps ``|q|`` and tilts ``q``
    towards ``s0``; on the sphere ``angle(q', s0) = acos(-|q| / (2|s0|))``, so ``delpsi = angle(q, s0) -
    acos(-|q| / (2|s0|))`` (the smaller of the two turns; NaN where ``|q| > 2|s0|``).  With it,
    :func:`bragg_positions_px` gives DIALS's stills prediction (``xyzcal``)."""
    with torch.no_grad():
        p = _params(sim, values)
        geom = _beam_geometry(sim, p)
        _, recip = sim.crystal_vectors(p)
        q = _tensor(sim, np.asarray(hkl, dtype=np.float64)).reshape(-1, 3) @ recip
        s0 = geom.beam / p["wavelength"]
        q_len, s0_len = torch.linalg.vector_norm(q, dim=-1), torch.linalg.vector_norm(s0)
        angle = torch.arccos(torch.clamp((q @ s0) / (q_len * s0_len), -1.0, 1.0))
        on_sphere = torch.arccos(-q_len / (2.0 * s0_len))
    return (angle - on_sphere).cpu().double().numpy()


def ewald_orientation_deg(sim, values: dict, hkl, delpsi_rad) -> np.ndarray:
    """``(n, 3)`` values of ``orient_x, orient_y, orient_z`` (deg) that turn the crystal of ``sim`` at ``values``
    by each reflection's ``delpsi_rad`` about its ``unit(q × s0)`` (as :func:`stills_delpsi_rad`), composed
    with the orientation deltas already in ``values``: rendered so, reflection ``j`` lies on the Ewald
    sphere and its spot sits where DIALS's stills predictor puts it."""
    with torch.no_grad():
        p = _params(sim, values)
        geom = _beam_geometry(sim, p)
        _, recip = sim.crystal_vectors(p)
        q = _tensor(sim, np.asarray(hkl, dtype=np.float64)).reshape(-1, 3) @ recip
        axis = torch.linalg.cross(q, (geom.beam / p["wavelength"]).expand_as(q), dim=-1)
        axis = axis / torch.linalg.vector_norm(axis, dim=-1, keepdim=True)
        turn = rotation_matrix_axis_angle(axis, _tensor(sim, np.asarray(delpsi_rad, dtype=np.float64)))
        deg = math.pi / 180.0
        now = rotation_matrix_xyz(p["orient_x"] * deg, p["orient_y"] * deg, p["orient_z"] * deg)
        total = (turn @ now).cpu().double().numpy()
    return np.array([misset_from_rotation_deg(m) for m in total])
