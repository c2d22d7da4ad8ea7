"""The HTML report (``nbtorch-refine --report``, :mod:`refine.output.html_report`): content, self-containment, and a
real browser (headless Chromium) that loads every figure."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from nbtorch.errors import InputError
from refine.output.html_report import load_report_data, main as report_main, render_report

pytest.importorskip("matplotlib", reason="the report needs matplotlib (pip install 'nbtorch[report]')")

_IMG = re.compile(r'<img alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')
_SECTIONS = ("Parameters", "Loss and parameters per step", "Observed, model and residual", "Spot offsets",
             "Residuals", "What the model misses", "Correlations")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One short synthetic refinement with a spot list, its result.h5 and report.html."""
    from refine.cli.main import main

    tmp = tmp_path_factory.mktemp("report")
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        # --adc-offset 0: the bank's 40-count pedestal kept as photons; taken off, the background is 5 photons and
        # every pixel of this 4-unit-cell crystal's image lies within 5 px of a spot or of model signal >= 3 sqrt(5),
        # which leaves no pixel "between spots" for the report's background figure
        code = main(["--problem", "tetragonal_mosflm", "--size", "48", "--refine", "scale,background,beam_centre,cell",
                     "--max-steps", "8", "--spots", "find", "--no-compile", "--quiet", "--report", "report.html",
                     "--adc-offset", "0"])
    finally:
        os.chdir(cwd)
    assert code in (0, 1)
    return tmp


def test_report_is_self_contained_and_complete(finished_run):
    page = (finished_run / "report.html").read_text()
    imgs = _IMG.findall(page)
    # history, crops, spot offsets, residual histogram, what the model misses, correlation matrix
    assert [alt for alt, _ in imgs] == ["loss and parameters per step", "observed, model and residual crops",
                                        "spot offsets across the detector", "histogram of normalised residuals",
                                        "stacked spot profile", "background between spots against resolution",
                                        "correlation matrix"]
    for _, data in imgs:
        png = base64.b64decode(data)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert page.count("<img") == len(imgs)  # every image is an embedded PNG
    assert not re.search(r"(src|href)=\"(?!data:)", page)  # nothing loaded from elsewhere
    assert "<script" not in page
    for section in _SECTIONS:
        assert f"<h2>{section}</h2>" in page
    # the parameter table is the printed one: every refined name with start, refined and esd
    for name in ("cell_a", "cell_c", "beam_x", "beam_y", "scale", "background"):
        assert f"<td>{name}</td>" in page
    assert "<th>truth</th>" in page


def test_result_files_hold_what_the_model_misses(finished_run):
    """sigZ beside the fit excess, the stacked spot profile and the background between spots, in result.json and
    result.h5 (refine.quality.misfit), and sigZ in the report's summary."""
    import json

    import h5py
    import numpy as np

    doc = json.loads((finished_run / "result.json").read_text())
    diag = doc["diagnostics"]
    assert diag["sigZ"] > 0 and diag["z_pixels"] == doc["fit"]["pixels"]
    profile = diag["profile"]
    assert profile["spots"] > 0 and np.shape(profile["stack_observed"]) == (11, 11)
    assert np.allclose(np.subtract(profile["stack_observed"], profile["stack_model"]), profile["stack_difference"])
    for side in ("observed", "model"):
        assert {"peak_per_spot", "rms_radius_px", "rms_radial_px", "rms_tangential_px"} <= set(profile[side])
    table = diag["background_by_resolution"]
    assert table["pixels"] == sum(b["pixels"] for b in table["bins"]) > 0
    with h5py.File(finished_run / "result.h5", "r") as h5:
        assert h5["diagnostics"].attrs["sigZ"] == pytest.approx(diag["sigZ"])
        assert h5["diagnostics/profile/difference"].shape == (11, 11)
        assert len(h5["diagnostics/background_by_resolution/observed"]) == len(table["bins"])
    page = (finished_run / "report.html").read_text()
    assert f"misfit: sigZ {diag['sigZ']:.3g}" in page


def test_report_from_saved_result_matches(finished_run, tmp_path):
    assert report_main([str(finished_run / "result.h5"), str(tmp_path / "again.html")]) == 0
    again = (tmp_path / "again.html").read_text()
    first = (finished_run / "report.html").read_text()
    assert _IMG.findall(again)[0][0] == _IMG.findall(first)[0][0]
    assert again.split("<h2>Parameters</h2>")[1].split("</table>")[0] == \
        first.split("<h2>Parameters</h2>")[1].split("</table>")[0]


def test_report_without_spots_or_esds(tmp_path):
    """A run with no spot list and no esds still gives a complete page, without the sections it lacks."""
    data = load_report_data_for_test(tmp_path)
    page = render_report(data)
    assert "<h2>Spot offsets</h2>" not in page and "<h2>What the model misses</h2>" not in page
    assert "No uncertainties were estimated" in page
    assert set(data["json"]["diagnostics"]) == {"sigZ", "sigZ_robust", "mean_z", "fraction_z_above_5", "z_pixels"}
    assert len(_IMG.findall(page)) == 3


def load_report_data_for_test(tmp_path: Path) -> dict:
    from refine.cli.main import main

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["--problem", "cubic_mosflm", "--size", "32", "--refine", "scale,background", "--max-steps", "3",
                     "--no-esds", "--no-compile", "--quiet"]) in (0, 1)
    finally:
        os.chdir(cwd)
    return load_report_data(tmp_path / "result.h5")


def test_bad_result_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "not_a_result.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    with pytest.raises(InputError, match="not_a_result.h5: not an nbtorch-refine result file"):
        load_report_data(bad)
    assert report_main([str(tmp_path / "missing.h5"), str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m refine.output.html_report: error: {tmp_path / 'missing.h5'}: result file not found"]
    assert not (tmp_path / "r.html").exists()


def test_report_option_refuses_overwriting_an_input(refine_cli):
    run = refine_cli("--problem", "cubic_mosflm", "--size", "32", "--refine", "scale", "--report", "result.h5")
    assert run.code == 2
    assert "both name result.h5" in run.err


# ------------------------------------------------------------------------------------------ real browser

def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def images_drawn(browser: str, page: str, tmp_path, profile: str) -> subprocess.CompletedProcess:
    """Headless ``browser`` on a copy of ``page`` with a check script: its dumped DOM's body carries
    ``data-check="loaded K of N"``, K the images that decoded (naturalWidth > 0) and are drawn wider than 100 px."""
    probe = ("<script>window.addEventListener('load', () => { const imgs = [...document.images]; "
             "const ok = imgs.filter(i => i.complete && i.naturalWidth > 0 && i.getBoundingClientRect().width > 100);"
             " document.body.setAttribute('data-check', `loaded ${ok.length} of ${imgs.length}`); });</script>")
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(page.replace("</body>", probe + "</body>"))
    return subprocess.run([browser, *_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000",
                           "--dump-dom", probe_page.as_uri()], capture_output=True, text=True, timeout=120)


def test_report_loads_in_a_real_browser(finished_run, tmp_path):
    """Headless Chromium opens the page: every figure decodes (naturalWidth > 0) and the screenshot is not
    blank.  The check script is added to a copy of the page; the report itself has no script."""
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing in CI: scripts/bootstrap.sh should install Debian's chromium")
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium); the browser check did not run")
    page = (finished_run / "report.html").read_text()
    profile = tempfile.mkdtemp(dir=tmp_path)
    dom = images_drawn(browser, page, tmp_path, profile)
    n = len(_IMG.findall(page))
    assert f'data-check="loaded {n} of {n}"' in dom.stdout, dom.stderr[-2000:]
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *_FLAGS, f"--user-data-dir={profile}", "--window-size=1300,2400",
                    f"--screenshot={shot}", (finished_run / "report.html").as_uri()],
                   capture_output=True, text=True, timeout=120)
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1300)
    assert pixels.std() > 0.05  # not a blank page
    assert (pixels.mean(axis=2) < 0.5).mean() > 0.005  # text and figures drawn


def test_summary_shows_the_spot_noise_floor():
    from refine.output.html_report import _summary

    spots = {"n": 10, "matched_start": 8, "matched_final": 9, "rms_px_start_common": 3.0, "rms_px_final_common": 1.0,
             "n_common": 8, "rms_px_final": 1.1, "rms_px_floor": 0.123, "floor_realisations": 5, "floor_spots": 9,
             "rms_px_procedure": 0.6}
    # the page says what the printed line says (refine.output.report.floor_line)
    assert "noise floor 0.123 px (5 Poisson draws of the refined model, 9 spots); finder vs model centroid 0.6 px" \
        in _summary({"spots": spots})
    assert "like for like" not in _summary({"spots": spots})  # a result written before the like-for-like offsets
    assert ("like for like (the finder&#x27;s centroids of the model&#x27;s spots against the observed): 0.95 px over "
            "those 9") in _summary({"spots": {**spots, "rms_px_finder": 0.95}})
    assert "noise floor" not in _summary({"spots": {**spots, "rms_px_floor": None}})
