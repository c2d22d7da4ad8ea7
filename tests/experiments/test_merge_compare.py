"""The comparison driver (experiments.merge_compare): a tiny end-to-end run (4 stills of 48 x 48 pixels, short
refinements), its refusals (one line, exit 2, nothing written) and, marked slow, the 100-still comparison."""

from __future__ import annotations

import json
import os

import pytest
import torch

from experiments.merge_compare import main, measure

pytest.importorskip("gemmi")

TINY = ["--stills", "4", "--size", "48", "--truth-domains", "6", "--max-steps", "5", "--amplitude-steps", "3"]


def test_tiny_comparison_end_to_end(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "cmp.json"
    assert main([*TINY, "--anomalous", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["method"], r["geometry"]): r for r in doc["rows"]}
    assert set(rows) == {("plain mean", "true"), ("partiality-corrected", "true"), ("plain mean", "refined"),
                         ("partiality-corrected", "refined"), ("refined amplitudes", "refined")}
    for r in rows.values():
        assert r["n"] > 5 and 0.0 <= r["R"] < 1.0 and -1.0 <= r["CC"] <= 1.0 and "anomalous_n_pairs" in r
    amp = rows["refined amplitudes", "refined"]
    assert amp["amplitudes"] > 0 and amp["steps"] <= 3 and amp["wall_s"] > 0 and amp["peak_mib"] >= amp["peak_mib_before"]
    assert doc["stills"] == 4 and doc["geometry"]["misorientation_deg_max"] < 1.0
    printed = capsys.readouterr().out
    assert "partiality-corrected (   true geometry)" in printed and f"wrote {out}" in printed


def test_same_seed_same_merges():
    torch.set_num_threads(1)
    a = measure(2, 3, size=48, refine_amplitudes=False, max_steps=2, truth_domains=4)
    b = measure(2, 3, size=48, refine_amplitudes=False, max_steps=2, truth_domains=4)
    assert a["rows"] == b["rows"]


@pytest.mark.parametrize("argv, message", [
    (["--stills", "0"], "--stills: expected an integer >= 1, got 0"),
    (["--stills", "2", "--size", "8"], "--size: expected an integer >= 16, got 8"),
    (["--stills", "2", "--max-steps", "0"], "--max-steps: expected an integer >= 1, got 0"),
])
def test_bad_input_is_one_line_and_nothing_written(tmp_path, capsys, argv, message):
    out = tmp_path / "x.json"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(message) and "\n" not in err and not out.exists()


def test_an_output_in_a_missing_folder_is_refused(tmp_path, capsys):
    assert main(["--stills", "2", "--out", str(tmp_path / "nope" / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out: the folder" in err and "does not exist" in err and not (tmp_path / "nope").exists()


@pytest.mark.slow
def test_100_stills_partiality_corrected_mean_beats_the_plain_mean(tmp_path):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    doc = measure(100, 1, refine_amplitudes=False)
    rows = {(r["method"], r["geometry"]): r for r in doc["rows"]}
    for geometry in ("true", "refined"):
        plain, corrected = rows["plain mean", geometry], rows["partiality-corrected", geometry]
        assert corrected["R"] < 0.6 * plain["R"] and corrected["CC"] > plain["CC"], geometry
        assert 5 <= corrected["obs_per_reflection_median"] <= 50
    assert rows["partiality-corrected", "true"]["anomalous_CC_signal"] > 0.5
