"""experiments.mosaic_convergence: one refinement per (mosaic model, domain count), resumable, and its table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.mosaic_convergence import main, table, with_shifts
from nbtorch import Simulator, config_from_args
from nbtorch.io.smv import write_smv

MODEL = ("-cell 30 30 40 90 90 90 -misset 10 20 30 -N 8 -default_F 100 -mosaic 0.3 -oversample 1 -lambda 1.0 "
         "-distance 40 -pixel 0.1 -detpixels 32 -Xbeam 1.63 -Ybeam 1.58")


def test_shifts_are_from_the_largest_count_of_the_same_model():
    rows = [{"model": "ball", "domains": d, "loss": 1.0, "excess": None, "spot_rms_px": None, "steps": 1,
             "wall_s": 1.0, "status": "converged", "cell_a": a, "cell_a_esd": 0.1}
            for d, a in ((10, 1.2), (20, 1.05), (40, 1.0))]
    with_shifts(rows)
    assert [r["cell_a_shift_esd"] for r in rows] == pytest.approx([2.0, 0.5, 0.0])
    text = table(rows)
    assert text.count("\n") == 4 and "| ball | 10 |" in text and "+2.00" in text


def _refine_args(tmp_path, seed: int, steps: int) -> list[str]:
    """A noisy image of MODEL at 40 domains, and the refinement's command line for it."""
    sim = Simulator(config_from_args(f"{MODEL} -mosaic_dom 40".split()), compile=False)
    image = np.random.default_rng(seed).poisson(sim().detach().numpy() * 2.0 + 3.0).astype(np.float32)
    write_smv(tmp_path / "obs.img", image, {"PIXEL_SIZE": "0.1"})
    return ["--image", str(tmp_path / "obs.img"), "--model", MODEL, "--refine", "scale,background,cell",
            "--max-steps", str(steps), "--no-compile"]


def test_runs_each_pair_once_and_tabulates(tmp_path, capsys):
    refine = _refine_args(tmp_path, 2, 3)
    out = tmp_path / "conv"
    assert main(["--out-dir", str(out), "--counts", "2", "4", "--models", "ball", "--", *refine]) == 0
    first = {d: (out / f"ball-{d}" / "result.json").stat().st_mtime_ns for d in (2, 4)}
    rows = json.loads((out / "table.json").read_text())
    assert [(r["model"], r["domains"]) for r in rows] == [("ball", 2), ("ball", 4)]
    doc = json.loads((out / "ball-2" / "result.json").read_text())
    flags = doc["input"]["model"]
    assert "-mosaic_model ball -mosaic_dom 2" in (flags if isinstance(flags, str) else " ".join(flags))
    # resumed: the finished runs are not run again; --table-only runs nothing new
    assert main(["--out-dir", str(out), "--counts", "2", "4", "8", "--models", "ball", "--table-only", "--",
                 *refine]) == 0
    assert {d: (out / f"ball-{d}" / "result.json").stat().st_mtime_ns for d in (2, 4)} == first
    assert not (out / "ball-8").exists()
    assert "| ball | 4 |" in (out / "table.md").read_text()


def test_bad_counts_are_refused(tmp_path, capsys):
    assert main(["--out-dir", str(tmp_path / "o"), "--counts", "0", "--", "--problem", "cubic_mosflm"]) == 2
    err = capsys.readouterr().err
    assert "--counts: each count must be at least 2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_turned_sets_are_run_apart_and_their_spread_tabulated(tmp_path):
    refine = _refine_args(tmp_path, 3, 2)
    out = tmp_path / "conv"
    assert main(["--out-dir", str(out), "--counts", "4", "--models", "ball", "--turns", "0", "2", "--",
                 *refine]) == 0
    flags = [json.loads((out / d / "result.json").read_text())["input"]["model"] for d in ("ball-4", "ball-4-t2")]
    flags = [f if isinstance(f, str) else " ".join(f) for f in flags]
    assert "-mosaic_turn" not in flags[0] and flags[1].endswith("-mosaic_dom 4 -mosaic_turn 2")
    rows = json.loads((out / "table.json").read_text())
    assert [(r["domains"], r["turn"]) for r in rows] == [(4, 0), (4, 2)]
    assert rows[0]["cell_a"] != rows[1]["cell_a"]  # the turn changed the model
    text = (out / "table.md").read_text()
    assert "ball 4 over 2 turns: cell_a sd" in text and "| ball | 4 | 2 |" in text


def test_negative_turns_are_refused(tmp_path, capsys):
    assert main(["--out-dir", str(tmp_path / "o"), "--turns", "-1", "--", "--problem", "cubic_mosflm"]) == 2
    err = capsys.readouterr().err
    assert "--turns: each turn must be 0 or more" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
