"""The distributions over many stills (:mod:`refine.output.stills_report`): which histograms a page holds, and
independent mode's ``summary.html`` opened in a real browser (headless Chromium, as test_html_report.py does)."""

from __future__ import annotations

import base64
import os
import re
import tempfile

import numpy as np
import pytest

from refine.many.batch import SUMMARY_COLUMNS
from refine.output.stills_report import distribution_sections, render_summary_report, write_summary_report
from test_html_report import _chromium, images_drawn

pytest.importorskip("matplotlib", reason="the histograms need matplotlib (pip install 'nbtorch[report]')")

_HIST = re.compile(r'<img alt="histogram of (\w+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


def _rows(n: int = 40) -> list[dict]:
    """``n`` refined stills of a monoclinic cell (a, b, c and beta differ from still to still; alpha, gamma 90),
    one failed and one skipped."""
    rng = np.random.default_rng(0)
    rows = []
    for k in range(n):
        row = {c: float("nan") for c in SUMMARY_COLUMNS}
        row.update(image=f"s{k}.cbf", status="converged", reason="", folder=f"out/s{k}", cell_a=60 + rng.normal(0, .2),
                   cell_b=70 + rng.normal(0, .2), cell_c=80 + rng.normal(0, .3), cell_alpha=90.0,
                   cell_beta=101 + rng.normal(0, .1), cell_gamma=90.0, scale=1.0, spot_rms_px_final=rng.gamma(4, .2))
        rows.append(row)
    rows[3].update(status="error", reason="no spots", cell_a=float("nan"))
    rows[4].update(status="skipped", reason="experiment 4: image not found")
    return rows


def test_a_histogram_for_each_value_that_differs():
    """a, b, c, beta and the spot rms differ among the refined stills: one embedded PNG each; the fixed angles
    none; a shared (equal) value none; a NaN (a still without the value) is left out of its histogram."""
    rows = _rows()
    page = render_summary_report(rows, "stills")
    found = _HIST.findall(page)
    assert [name for name, _ in found] == ["cell_a", "cell_b", "cell_c", "cell_beta", "spot_rms"]
    for _, data in found:
        png = base64.b64decode(data)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 3000
    assert "38 of 40 stills refined, 1 failed, 1 skipped" in page
    assert page.count("<tr>") == 41 and "experiment 4: image not found" in page
    assert not re.search(r"(src|href)=\"(?!data:)", page) and "<script" not in page  # offline, no scripts
    assert distribution_sections({"cell_a": [60.0] * 5, "cell_c": [80.0, 80.0]}) == ""  # a shared cell: one value
    assert [n for n, _ in _HIST.findall(distribution_sections({"cell_a": [60.0, np.nan, 60.5]}))] == ["cell_a"]


def test_summary_page_loads_in_a_real_browser(tmp_path):
    """Headless Chromium opens summary.html: every histogram decodes and is drawn wider than 100 px."""
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing in CI: scripts/bootstrap.sh should install Debian's chromium")
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium); the browser check did not run")
    page = write_summary_report(tmp_path / "summary.html", _rows()).read_text()
    dom = images_drawn(browser, page, tmp_path, tempfile.mkdtemp(dir=tmp_path))
    assert 'data-check="loaded 5 of 5"' in dom.stdout, dom.stderr[-2000:]
