"""The distributions over many stills, as cctbx.xfel users look at them, and independent mode's page of them.

``nbtorch-refine --images ... --out-dir DIR`` (and ``--expt many.expt --refl many.refl --out-dir DIR``) writes
``DIR/summary.html`` beside ``summary.csv`` (:func:`write_summary_report`): the count of stills refined, failed and
skipped, a histogram of each cell length and angle that differs among the refined stills and of their final spot
rms (:func:`distribution_sections`), and the table of the stills.  The joint run's page
(:mod:`refine.output.joint_report`) shows the same histograms of its images.  Every figure is an embedded PNG
(no network, no scripts); without matplotlib the page says so and holds the table only.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from nbtorch.io.atomic import atomic_write

__all__ = ["DISTRIBUTIONS", "distribution_sections", "render_summary_report", "write_summary_report"]

#: the values whose histograms are drawn: name -> (axis label, title)
DISTRIBUTIONS = {
    "cell_a": ("a (Å)", "cell a"), "cell_b": ("b (Å)", "cell b"), "cell_c": ("c (Å)", "cell c"),
    "cell_alpha": ("alpha (deg)", "cell alpha"), "cell_beta": ("beta (deg)", "cell beta"),
    "cell_gamma": ("gamma (deg)", "cell gamma"), "spot_rms": ("final spot rms (px)", "spot rms"),
}

_CSS = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { padding: 0.2em 0.6em; border-bottom: 1px solid #e4e4e4; text-align: right; }
th:first-child, td:first-child, td:last-child { text-align: left; }
.figs { display: flex; flex-wrap: wrap; gap: 0.5em; } figure { margin: 0.3em 0; }
img { max-width: 100%; height: auto; }
"""

_TABLE = (("image", "image"), ("status", "status"), ("a", "cell_a"), ("b", "cell_b"), ("c", "cell_c"),
          ("alpha", "cell_alpha"), ("beta", "cell_beta"), ("gamma", "cell_gamma"), ("scale", "scale"),
          ("rms start (px)", "spot_rms_px_start"), ("rms final (px)", "spot_rms_px_final"),
          ("fit excess", "fit_excess"), ("reason", "reason"))


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def distribution_sections(columns: Mapping[str, Sequence[float]]) -> str:
    """HTML figures: the histogram of each :data:`DISTRIBUTIONS` name of ``columns`` (name -> one value per still)
    whose finite values are not all the same (a cell refined per still; a shared or fixed one is one value), each
    an ``<img alt="histogram of NAME">``; empty without matplotlib or such a column."""
    if not _has_matplotlib():
        return "<p>The histograms need matplotlib (pip install 'nbtorch[report]').</p>"
    from refine.output import figures

    parts = []
    for name, (label, title) in DISTRIBUTIONS.items():
        v = np.asarray(columns.get(name, ()), dtype=float)
        finite = v[np.isfinite(v)]
        if finite.size < 2 or np.ptp(finite) == 0.0:
            continue
        data = base64.b64encode(figures.png_bytes(figures.distribution_figure(v, label, title))).decode("ascii")
        parts.append(f'<figure><img alt="histogram of {name}" src="data:image/png;base64,{data}"></figure>')
    return f"<div class='figs'>{''.join(parts)}</div>" if parts else ""


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if not math.isfinite(value) else f"{value:.5g}"
    return str(value)


def render_summary_report(rows: Sequence[Mapping], title: str) -> str:
    """The page of independent mode's summary ``rows`` (:func:`refine.many.batch.write_summary`'s rows)."""
    ok = [r for r in rows if r["status"] in ("converged", "max_steps")]
    skipped = sum(r["status"] == "skipped" for r in rows)
    columns = {name: [float(r[name]) for r in ok] for name in DISTRIBUTIONS if name.startswith("cell_")}
    columns["spot_rms"] = [float(r["spot_rms_px_final"]) for r in ok]
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r[key]))}</td>" for _, key in _TABLE) + "</tr>"
                   for r in rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in _TABLE)
    figs = distribution_sections(columns)
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>{len(ok)} of {len(rows)} stills refined, {len(rows) - len(ok) - skipped} failed, {skipped} skipped.</p>"
            "<h2>Distributions over the refined stills</h2>"
            + (figs or "<p>No value differs among the refined stills.</p>")
            + f"<h2>Stills</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>\n")


def write_summary_report(path: str | Path, rows: Sequence[Mapping], title: str = "nbtorch-refine: stills") -> Path:
    """Write :func:`render_summary_report` to ``path`` atomically."""
    text = render_summary_report(rows, title)
    with atomic_write(path, "w") as fh:
        fh.write(text)
    return Path(path)
