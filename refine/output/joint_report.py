"""One self-contained HTML page of a joint run (``nbtorch-refine --images ... --joint|--rotation-series --report
FILE``): what the page of a single run (:mod:`refine.output.html_report`) says, with one row per image.

* the run: status and message, the fit against shot noise and the spot rms over every image, the warnings;
* the shared values (start, refined, esd);
* one row per image: its rotation start (``phi0``), scale, background, final loss, fit excess, observed spots,
  matched spots and their rms offset at the start and at the end (:mod:`refine.many.image_reports`);
* a figure of the per-image spot rms (start, end) and fit excess (matplotlib, embedded as a PNG data URI);
* the histograms of the images' cells, where they differ (a cell per image), and of their final spot rms
  (:func:`refine.output.stills_report.distribution_sections`).
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Sequence

from nbtorch.io.atomic import atomic_write
from refine.output import figures
from refine.output.results import JointResult
from refine.output.stills_report import DISTRIBUTIONS, distribution_sections

__all__ = ["render_joint_report", "write_joint_report"]

_CSS = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.2em 0.7em; border-bottom: 1px solid #e4e4e4; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.ok { color: #1a7f1a; font-weight: bold; } .bad { color: #b00020; font-weight: bold; }
.warn { background: #fff4d6; border-left: 4px solid #e0a800; padding: 0.4em 0.8em; margin: 0.4em 0; }
img { max-width: 100%; height: auto; }
"""


def _num(value, fmt: str = ".4g") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def _float(value) -> float:
    return math.nan if value is None else float(value)


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
    return ("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + rows + "</tbody></table>")


def _image_rows(result: JointResult, names: Sequence[str]) -> list[list[str]]:
    rows = []
    for i, name in enumerate(names):
        p = result.images[i]
        fit = result.image_fit[i] if result.image_fit else {}
        s = result.image_spots[i] if result.image_spots else {}
        rows.append([name, _num(p.get("phi0"), ".4f"), _num(p.get("scale")), _num(p.get("background")),
                     _num(result.image_losses[i], ".6g"), _num(fit.get("excess"), ".3g"), str(s.get("n", "-")),
                     str(s.get("matched_final", "-")), _num(s.get("rms_px_start_common"), ".3g"),
                     _num(s.get("rms_px_final_common"), ".3g")])
    return rows


def _figure(result: JointResult) -> str:
    """Per-image spot rms (start, end) and fit excess; empty without matplotlib or per-image reports."""
    if not result.image_spots and not result.image_fit:
        return ""
    try:
        import matplotlib
    except ImportError:
        return ""
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    x = list(range(result.n_images))
    if result.image_spots:
        for key, label in (("rms_px_start_common", "start"), ("rms_px_final_common", "refined")):
            ax1.plot(x, [s.get(key) if s.get(key) is not None else math.nan for s in result.image_spots], "o-", label=label)
        ax1.set(xlabel="image", ylabel="spot rms (px)", title="observed - model spots")
        ax1.legend()
    if result.image_fit:
        ax2.plot(x, [f["excess"] for f in result.image_fit], "s-")
        ax2.axhline(1.0, color="grey", lw=0.8)
        ax2.set(xlabel="image", ylabel="loss / shot-noise expectation", title="fit excess")
    data = base64.b64encode(figures.png_bytes(fig)).decode("ascii")
    return f'<figure><img alt="per-image spot rms and fit" src="data:image/png;base64,{data}"></figure>'


def render_joint_report(result: JointResult, image_names: Sequence[str], title: str = "nbtorch-refine joint run") -> str:
    """The page (HTML text) of ``result``; ``image_names`` label its images."""
    ok = result.status.ok
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<p><span class='{'ok' if ok else 'bad'}'>status: {html.escape(result.status.value)}</span> "
             f"({html.escape(result.message)}); {result.n_images} images, {result.steps} steps, {result.wall_s:.1f} s; "
             f"loss {result.loss_initial:.6g} &rarr; {result.loss_final:.6g}</p>"]
    if result.fit:
        parts.append(f"<p>fit: final loss {result.fit['excess']:.3g}&times; the shot-noise expectation over "
                     f"{result.fit['pixels']} pixels (about 1 = a fit to the noise level)</p>")
    if result.spots:
        s = result.spots
        parts.append(f"<p>spots: rms {_num(s['rms_px_start_common'], '.3g')} px &rarr; "
                     f"{_num(s['rms_px_final_common'], '.3g')} px over the {s['n_common']} spots matched before and "
                     f"after ({s['matched_final']} of {s['n']} matched at the end)</p>")
    parts += [f"<p class='warn'>warning: {html.escape(w)}</p>" for w in result.warnings]
    parts.append("<h2>Shared values</h2>" + _table(
        ["name", "start", "refined", "esd", "unit"],
        [[n, _num(result.initial_shared.get(n), ".6f"), _num(v, ".6f"), _num(result.shared_esds.get(n), ".2g"),
          result.units.get(n, "")] for n, v in result.shared.items()]))
    parts.append("<h2>Images</h2>" + _table(
        ["image", "phi0 (deg)", "scale", "background", "loss", "fit excess", "spots", "matched", "rms start (px)",
         "rms final (px)"], _image_rows(result, image_names)) + _figure(result))
    columns = {n: [p.get(n, math.nan) for p in result.images] for n in DISTRIBUTIONS if n.startswith("cell_")}
    columns["spot_rms"] = [_float(s.get("rms_px_final_common")) for s in result.image_spots or ()]
    figures_html = distribution_sections(columns)
    if figures_html:
        parts.append("<h2>Distributions over the images</h2>" + figures_html)
    return "".join(parts) + "</body></html>"


def write_joint_report(path: str | Path, result: JointResult, image_names: Sequence[str]) -> Path:
    """Write :func:`render_joint_report` to ``path`` atomically."""
    text = render_joint_report(result, image_names, f"nbtorch-refine: {len(image_names)} images jointly")
    with atomic_write(path, "w") as fh:
        fh.write(text)
    return Path(path)
