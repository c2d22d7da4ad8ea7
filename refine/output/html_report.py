"""One self-contained HTML page of a finished refinement: the record a user keeps and sends on.

``nbtorch-refine ... --report report.html`` writes it at the end of a run; for a run already done::

    python -m refine.output.html_report out/thaumatin/result.h5 report.html

The page reads everything from ``result.h5`` (:func:`refine.output.results.load_h5` plus the ``spots`` and
``truth`` groups that ``nbtorch-refine`` adds) and holds, with every figure embedded as a PNG data
URI (no network, no scripts, no files beside it):

* the run: status and message, warnings, the fit against shot noise, the spot rms, the command;
* the parameter table (start, refined, esd; truth for a synthetic problem), as the command prints it;
* the loss and every free parameter per step (:func:`refine.output.figures.history_figure`);
* observed / model / residual crops with observed and model spots (:func:`refine.output.figures.crop_figure`);
* the observed -> model spot offsets across the detector (:func:`refine.output.figures.offsets_figure`);
* the histogram of normalised residuals (:func:`refine.output.figures.residual_histogram`);
* what the model misses (``diagnostics``, :mod:`refine.quality.misfit`): sigZ beside the fit excess, and with a
  spot list the stacked spot profile (:func:`refine.output.figures.spot_profile_figure`) and the background between
  spots against resolution (:func:`refine.output.figures.background_figure`);
* the correlation matrix (:func:`refine.output.figures.correlation_figure`).

TensorBoard (``--logdir``) is for watching a run live; this page is the run's record.
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from nbtorch.cli.support import run_main
from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write
from refine.output import figures
from refine.output.report import ESD_NOTE, floor_line, misfit_lines, parameter_rows
from refine.output.results import load_h5
from refine.fitting.structure_factors import is_amplitude

PROG = "python -m refine.output.html_report"

__all__ = ["load_report_data", "render_report", "write_report", "main"]

_CSS = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.2em 0.7em; border-bottom: 1px solid #e4e4e4; text-align: right; }
th:nth-child(-n+2), td:nth-child(-n+2) { text-align: left; }
.status { font-weight: bold; } .ok { color: #1a7f1a; } .bad { color: #b00020; }
.warn { background: #fff4d6; border-left: 4px solid #e0a800; padding: 0.4em 0.8em; margin: 0.4em 0; }
figure { margin: 0.8em 0; } figcaption { font-size: 0.85em; color: #555; max-width: 60em; }
img { max-width: 100%; height: auto; }
code { background: #f3f3f3; padding: 0 0.2em; font-size: 0.85em; word-break: break-all; }
"""


def load_report_data(path: str | Path) -> dict[str, Any]:
    """``result.h5`` as :func:`~refine.output.results.load_h5` reads it, plus ``spots`` and ``truth`` (empty dicts
    when the run had none).  Raises InputError when the file is not a refinement result."""
    import h5py

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: result file not found")
    try:
        data = load_h5(path)
        with h5py.File(path, "r") as h5:
            data["spots"] = {k: h5["spots"][k][()] for k in h5["spots"]} if "spots" in h5 else {}
            data["truth"] = {k: float(h5["truth"][k][()]) for k in h5["truth"]} if "truth" in h5 else {}
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"{path}: not an nbtorch-refine result file ({exc})") from None
    return data


def _img(fig, alt: str) -> str:
    data = base64.b64encode(figures.png_bytes(fig)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _figure(fig, alt: str, caption: str) -> str:
    return f"<figure>{_img(fig, alt)}<figcaption>{caption}</figcaption></figure>"


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
    return ("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + rows + "</tbody></table>")


def _summary(doc: dict) -> str:
    status = str(doc.get("status", "?"))
    ok = status in ("converged", "max_steps")
    parts = [f'<p><span class="status {"ok" if ok else "bad"}">status: {html.escape(status)}</span> '
             f'({html.escape(str(doc.get("message", "")))})</p>',
             f'<p>loss {doc.get("loss_initial", float("nan")):.6g} &rarr; {doc.get("loss_final", float("nan")):.6g} '
             f'in {doc.get("steps", 0)} steps ({doc.get("evaluations", 0)} evaluations), '
             f'{doc.get("wall_s", 0.0):.1f} s</p>']
    fit = doc.get("fit") or {}
    if fit.get("excess") is not None:
        parts.append(f"<p>fit: final loss {fit['excess']:.3g}&times; the shot-noise expectation of the refined "
                     "model (about 1 = a fit to the noise level)</p>")
    parts += [f"<p>{html.escape(line)}</p>" for line in misfit_lines(fit, doc.get("diagnostics") or {})[:1]]
    spots = doc.get("spots") or {}
    if spots.get("rms_px_final") is not None:
        parts.append(f"<p>spots: rms offset {spots.get('rms_px_start_common', float('nan')):.3g} px &rarr; "
                     f"{spots.get('rms_px_final_common', float('nan')):.3g} px over the {spots.get('n_common', 0)} "
                     f"spots matched before and after ({spots.get('matched_start', 0)} &rarr; "
                     f"{spots.get('matched_final', 0)} of {spots.get('n', 0)} matched)</p>")
        if spots.get("rms_px_floor") is not None:
            parts.append(f"<p>{html.escape(floor_line(spots))}</p>")
    parts += [f'<p class="warn">warning: {html.escape(w)}</p>' for w in doc.get("warnings", [])]
    if doc.get("command"):
        parts.append(f"<p>command: <code>{html.escape(str(doc['command']))}</code></p>")
    source = (doc.get("input") or {}).get("image") or (doc.get("input") or {}).get("problem")
    if source:
        parts.append(f"<p>input: <code>{html.escape(str(source))}</code></p>")
    return "".join(parts)


def _structure_factor_summary(doc: dict) -> str:
    """One paragraph on the refined amplitudes (all of them: result.json's ``structure_factors``)."""
    sf = doc.get("structure_factors") or {}
    rows = sf.get("reflections") or []
    if not rows:
        return "<p>No amplitude was refined.</p>"
    rows = [r for r in rows if r[6]]  # the refined ones
    if not rows:
        return "<p>No amplitude was refined.</p>"
    F = np.array([r[4] for r in rows], float)
    esd = np.array([np.nan if r[5] is None else r[5] for r in rows], float)
    rel = esd / np.where(F > 0, F, np.nan)
    return (f"<p>{len(rows)} amplitudes refined ({sf.get('n_held', 0)} held: too faint) in {html.escape(str(sf.get('space_group', '')))} (start: "
            f"{html.escape(str(sf.get('start', '')))}): median F {np.nanmedian(F):.4g}, median relative esd "
            f"{np.nanmedian(rel):.3g}; every value is in result.json (structure_factors) and the HKL file.</p>")


def _misfit_sections(diagnostics: dict) -> list[str]:
    """The stacked spot profile and the background between spots (runs with observed spots only)."""
    profile, table = diagnostics.get("profile") or {}, diagnostics.get("background_by_resolution") or {}
    out = []
    if profile.get("spots"):
        out.append(_figure(
            figures.spot_profile_figure(profile), "stacked spot profile",
            f"Observed and model photons summed over {profile['spots']} matched spots, each sampled on its observed "
            "centroid in its own frame (columns: radial, outward from the direct beam; rows: tangential), their "
            "difference, and both averaged over the azimuth. A model spot broader or offset from the observed one "
            "leaves a ring or a dipole in the difference."))
    if table.get("pixels"):
        out.append(_figure(
            figures.background_figure(table), "background between spots against resolution",
            f"Mean observed and model photons per fitted pixel farther than {table['exclude_px']} px from every "
            "observed spot and every pixel where the model has a spot, in resolution bins of equal pixel counts."))
    lines = misfit_lines({}, diagnostics)[1:]
    return (["<h2>What the model misses</h2>"] + [f"<p>{html.escape(line)}</p>" for line in lines] + out) if out else []


def render_report(data: dict[str, Any], title: str = "nbtorch-refine report") -> str:
    """The HTML page (a string) for ``data`` from :func:`load_report_data`."""
    doc = data["json"]
    free = list(doc.get("free", []))
    units = doc.get("units", {})
    ns = SimpleNamespace(params=doc.get("params", {}), initial_params=doc.get("initial_params", {}),
                         esds=doc.get("esds", {}), free=free, units=units, esd_kinds=doc.get("esds_by_kind") or {})
    head, body = parameter_rows(ns, data.get("truth") or None)
    images = data["images"]
    observed, model = np.asarray(images["observed"], float), np.asarray(images["model"], float)
    mask = np.asarray(images["mask"], bool)
    spots = data.get("spots") or {}
    obs_spots = spots.get("observed")
    shape = observed.shape
    half = max(8, min(24, min(shape) // 4))
    centres = figures.crop_centres(shape, mask, model, obs_spots, count=3, half=half)
    history = data["history"]
    hist_names = [n for n in free if n in history["params"]]
    if "orient_x" in free:  # the orientation is refined as small rotations; misset_x/y/z is what users read
        hist_names += [n for n in ("misset_x", "misset_y", "misset_z") if n in history["params"]]
    stage_names = [s.get("name", "") for s in doc.get("stages", [])]
    sections = [
        f"<h1>{html.escape(title)}</h1>", _summary(doc),
        "<h2>Parameters</h2>", _table(head, body),
        f"<p>{html.escape(ESD_NOTE)}</p>" if ns.esd_kinds else "",
        "<h2>Loss and parameters per step</h2>",
        _figure(figures.history_figure(history, hist_names, stage_names, units), "loss and parameters per step",
                "The loss (log scale) and each free parameter after every step; dashed lines: stage starts."),
        "<h2>Observed, model and residual</h2>",
        _figure(figures.crop_figure(observed, model, mask, centres, half, obs_spots, spots.get("predicted_final")),
                "observed, model and residual crops",
                "Crops of the observed image, the refined model and their difference (photons); grey: pixels not "
                "fitted. Green squares: observed spots; red crosses: the refined model's spots."),
    ]
    if obs_spots is not None and spots.get("predicted_final") is not None:
        sections += ["<h2>Spot offsets</h2>", _figure(
            figures.offsets_figure(shape, obs_spots, spots["predicted_final"], spots.get("predicted_start")),
            "spot offsets across the detector",
            "From each observed spot to the model's spot beside it, at the start and refined; arrows magnified "
            "by the factor in the title, coloured by offset.")]
    sections += [
        "<h2>Residuals</h2>",
        _figure(figures.residual_histogram(observed, model, mask), "histogram of normalised residuals",
                "(observed - model) / sqrt(model) over the fitted pixels: shot noise alone gives the unit normal; "
                "wide tails mean the model lacks something the image has."),
    ]
    sections += _misfit_sections(doc.get("diagnostics") or {})
    corr = np.asarray(data.get("correlation", np.zeros((0, 0))))
    names = list(data.get("names", free))
    keep = [i for i, n in enumerate(names) if not is_amplitude(n)]  # hundreds of amplitudes: their own section
    if len(keep) < len(names) and corr.size:
        corr, names = corr[np.ix_(keep, keep)], [names[i] for i in keep]
        sections += ["<h2>Structure factors</h2>", _structure_factor_summary(doc)]
    if corr.size:
        sections += ["<h2>Correlations</h2>", _figure(
            figures.correlation_figure(names, corr), "correlation matrix",
            "Correlation of the free parameters at the refined point (from the Fisher information).")]
    else:
        sections += ["<h2>Correlations</h2>", "<p>No uncertainties were estimated in this run (--no-esds).</p>"]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(sections) + "\n</body></html>\n")


def write_report(path: str | Path, result_h5: str | Path, title: str | None = None) -> Path:
    """Write the page for ``result_h5`` to ``path`` atomically."""
    data = load_report_data(result_h5)
    page = render_report(data, title or f"nbtorch-refine report: {Path(result_h5).name}")
    with atomic_write(path, "w") as fh:
        fh.write(page)
    return Path(path)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("result", help="result.h5 written by nbtorch-refine")
    p.add_argument("report", help="HTML file to write")
    args = p.parse_args(argv)
    write_report(args.report, args.result)
    print(f"wrote {args.report}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m refine.output.html_report RESULT.h5 REPORT.html``; bad input: one line on stderr, status 2
    (:func:`nbtorch.cli.support.run_main`)."""
    return run_main(PROG, _main, argv)

if __name__ == "__main__":
    sys.exit(main())
