"""What ``nbtorch-refine`` prints and writes: the start / refined / esd table and the two result files.

:func:`write_outputs` writes ``result.h5`` (:func:`refine.output.results.save_h5`) and ``result.json``
(:meth:`~refine.output.results.RefinementResult.to_json_dict`) atomically, both with the command's additions:
``command``, ``input`` (image, format, header geometry, masked-pixel counts, the model's full flags),
``truth`` (synthetic problems), ``spots`` (rms spot offsets before and after) and ``esd_extra``;
:func:`misfit_lines` says what the model misses (the result's ``diagnostics``) in words, :func:`floor_line` the spot
report's noise floor and like-for-like offsets.  The table and
the files take a joint result (:class:`~refine.output.results.JointResult`: its shared values) as well: the
result files have one schema (:mod:`refine.output.results`).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

import numpy as np

from nbtorch.io.atomic import atomic_output_path, atomic_write
from nbtorch.io.hkl import write_hkl
from nbtorch.parameters import PARAMETER_NAMES
from refine.fitting.background import is_knot
from refine.fitting.parameters import NUISANCE, is_panel_name
from refine.output.results import jsonable, save_h5

__all__ = ["results_table", "parameter_rows", "write_outputs", "ESD_NOTE", "misfit_lines"]


def _decimals(esd: float | None) -> int:
    if esd is None or not math.isfinite(esd) or esd <= 0:
        return 4
    return int(min(8, max(2, 1 - math.floor(math.log10(esd)))))


def _num(v: float | None, dec: int) -> str:
    if v is None or not isinstance(v, (int, float)) or not math.isfinite(v):
        return "-"
    if abs(v) >= 1e6:
        return f"{v:.6g}"
    return f"{v:.{dec}f}"


def results_table(result, truth: dict | None = None) -> str:
    """Start / refined / esd (and truth) of every parameter that was refined or follows a refined one."""
    head, body = parameter_rows(result, truth)
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def parameter_rows(result, truth: dict | None = None) -> tuple[list[str], list[list[str]]]:
    """The table's heading and rows as text (``result``: anything with ``params``, ``initial_params``,
    ``esds``, ``free`` and ``units``): the printed table and the HTML report share them."""
    rows = []
    changed = {n for n in result.params if n in result.initial_params
               and result.params[n] != result.initial_params[n]}
    for n in PARAMETER_NAMES + NUISANCE + tuple(k for k in result.params if is_knot(k) or is_panel_name(k)):
        if n in result.params and (n in result.esds or n in result.free or n in changed):
            rows.append(n)
    fisher = (getattr(result, "esd_kinds", None) or {}).get("fisher")
    head = ["parameter", "unit"] + (["truth"] if truth else []) + ["start", "refined", "esd"]
    if fisher:
        head.append("esd if right")  # the Fisher esd: what it would be if the model explained the image
    body = []
    for n in rows:
        e = result.esds.get(n)
        d = _decimals(e)
        line = [n, result.units.get(n, "")]
        if truth:
            line.append(_num(truth.get(n), d))
        line += [_num(result.initial_params.get(n), d), _num(result.params.get(n), d), _esd(e)]
        if fisher:
            line.append(_esd(fisher.get(n)))
        body.append(line)
    return head, body


def _esd(e: float | None) -> str:
    return f"{e:.2g}" if e is not None and math.isfinite(e) else "-"


#: printed under the table when it has both esd columns
ESD_NOTE = ("esd: robust (sandwich) esd, valid when the model misses part of the image; esd if right: the Fisher "
            "esd, which assumes the model explains the image (docs/esds-and-fit.md)")


def _pair(a, b, digits: int = 3) -> str:
    return f"{a:.{digits}g} vs {b:.{digits}g}" if a is not None and b is not None else "-"


def misfit_lines(fit: dict, diagnostics: dict) -> list[str]:
    """What the model misses (``diagnostics`` of a result, :mod:`refine.quality.misfit`) as printed lines: sigZ
    beside the fit excess and the stacked spot profile; the background between spots by resolution."""
    if diagnostics.get("sigZ") is None:
        return []
    excess = f"fit excess {fit['excess']:.3g}x; " if fit.get("excess") is not None else ""
    robust = diagnostics.get("sigZ_robust")
    line = (f"misfit: sigZ {diagnostics['sigZ']:.3g} ({'' if robust is None else f'robust {robust:.3g}; '}{excess}"
            f"{100.0 * diagnostics['fraction_z_above_5']:.2g}% of {diagnostics['z_pixels']} pixels |z| > 5)")
    profile = diagnostics.get("profile") or {}
    if profile.get("spots"):
        o, m = profile["observed"], profile["model"]
        tail = profile.get("excess_3to5_px")
        line += (f"; spot profile ({profile['spots']} spots): observed peak {o['peak_per_spot']:.3g}, model "
                 f"{m['peak_per_spot']:.3g} photons per spot, rms radius {_pair(o['rms_radius_px'], m['rms_radius_px'])} "
                 f"px (radial {_pair(o['rms_radial_px'], m['rms_radial_px'])}, tangential "
                 f"{_pair(o['rms_tangential_px'], m['rms_tangential_px'])})"
                 + (f", model {100.0 * tail:+.0f}% at 3-5 px" if tail is not None else ""))
        own = profile.get("model_own")
        if own and own.get("rms_radius_px") is not None:
            line += (f"; model about its own centroids ({profile['own_spots']} spots): peak "
                     f"{own['peak_per_spot']:.3g}, rms radius {own['rms_radius_px']:.3g} px (radial "
                     f"{own['rms_radial_px']:.3g}, tangential {own['rms_tangential_px']:.3g})")
    lines = [line]
    table = diagnostics.get("background_by_resolution") or {}
    if table.get("pixels"):
        bins = ", ".join(f"{_d(b['d_max_A'])}-{_d(b['d_min_A'])} A {b['observed_mean']:.3g}/{b['model_mean']:.3g}"
                         for b in table["bins"])
        lines.append(f"misfit: background between spots (> {table['exclude_px']} px from any; {table['pixels']} "
                     f"pixels, sigZ {table.get('sigZ') or math.nan:.3g}), observed/model photons per pixel: "
                     f"{table['observed_mean']:.3g}/{table['model_mean']:.3g}; by resolution {bins}")
    return lines


def _d(d_A: float | None) -> str:
    return "inf" if d_A is None or not math.isfinite(d_A) else f"{d_A:.3g}"


def write_outputs(result, h5_path: str, json_path: str, extra: dict, hkl_path: str | None = None,
                  mtz_path: str | None = None) -> None:
    """``result.h5`` and ``result.json`` (atomic; or ``joint.h5`` and ``joint.json`` of a joint result), with
    ``extra`` (input, truth, spots, ...) added to both; with ``hkl_path`` also the refined amplitudes as a
    nanoBragg ``-hkl`` file, with ``mtz_path`` as an MTZ file (:mod:`refine.output.amplitude_mtz`)."""
    doc = result.to_json_dict()
    doc.update(extra)
    text = json.dumps(jsonable(doc), indent=2, allow_nan=False)
    with atomic_output_path(h5_path) as tmp:
        save_h5(result, tmp)
        import h5py

        with h5py.File(tmp, "a") as h5:
            if "truth" in extra:
                t = h5.create_group("truth")
                for name, v in extra["truth"].items():
                    t.create_dataset(name, data=float(v)).attrs["units"] = result.units.get(name, "")
            if "spots" in extra:
                s = h5.create_group("spots")
                for key in ("observed", "predicted_start", "predicted_final"):
                    if key in extra["spots"]:
                        s.create_dataset(key, data=np.asarray(extra["spots"][key], dtype=np.float64))
            del h5["result_json"]
            h5.create_dataset("result_json", data=text)
    with atomic_write(json_path, "w") as fh:
        fh.write(text + "\n")
    if hkl_path is not None:
        write_hkl(hkl_path, result.hkl_table())
    if mtz_path is not None:
        from refine.output.amplitude_mtz import write_amplitude_mtz  # noqa: PLC0415 - gemmi: only when asked for

        write_amplitude_mtz(mtz_path, result)


def floor_line(s: Mapping[str, Any]) -> str:
    """The spot report's second line: the final rms, the noise floor, the two centroid procedures' difference
    and the like-for-like offsets (``spots`` of ``result.json``; :mod:`refine.quality.spot_floor`)."""
    head = f"spots: final rms {s['rms_px_final']:.3g} px over all {s['matched_final']} matched; "
    if not s.get("floor_spots"):
        return head + ("no noise floor: the spot finder finds none of the refined model's spots (too weak over "
                       "its background)")
    line = head + (f"noise floor {s['rms_px_floor']:.3g} px ({s['floor_realisations']} Poisson draws of the "
                   f"refined model, {s['floor_spots']} spots); finder vs model centroid {s['rms_px_procedure']:.3g} px")
    if s.get("rms_px_finder") is not None:  # results written before it lack it
        line += (f"; like for like (the finder's centroids of the model's spots against the observed): "
                 f"{s['rms_px_finder']:.3g} px over those {s['floor_spots']}")
    return line
