"""nbtorch-refine --background: bad settings are one line, exit 2, nothing written; the resolution and planes
backgrounds run end to end and report their knots."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import SMALL_MODEL, simulate
from nbtorch.io import write_cbf


@pytest.fixture
def still(tmp_path):
    """A simulated 32 x 32 still with a background and three spot positions."""
    write_cbf(tmp_path / "ok.cbf", simulate(SMALL_MODEL, background=8.0), {"pixel_size_mm": 0.1})
    (tmp_path / "spots.txt").write_text("x y\n7.5 9.5\n20.5 3.5\n16.5 16.5\n")
    return tmp_path


CASES = {
    "negative knot count": (["--background", "resolution:-3"], "--background: resolution:-3: the knot count must be 2"),
    "unknown kind": (["--background", "wavy"], "--background: unknown kind 'wavy'"),
    "planes without spots": (["--background", "planes"], "--background planes: needs observed spots"),
    "planes without a window": (["--background", "planes", "--spots", "spots.txt"], "needs --spot-window"),
    "window larger than the image": (["--background", "planes", "--spots", "spots.txt", "--spot-window", "20"],
                                     "a window of 41 px is larger than the image (32 x 32 px)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_background_is_one_line_exit_2(refine_cli, still, case):
    argv, expected = CASES[case]
    r = refine_cli("--image", "ok.cbf", "--model", SMALL_MODEL, *argv)
    assert r.code == 2, (r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nbtorch-refine: error: "), r.err
    assert expected in lines[0]
    assert not (r.tmp / "result.h5").exists() and not (r.tmp / "result.json").exists()


def test_joint_refuses_a_background_it_cannot_fit(refine_cli, still):
    r = refine_cli("--images", "ok.cbf", "ok.cbf", "--joint", "--model", SMALL_MODEL, "--background", "resolution:3",
                   "--out-dir", "joint")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert "a joint refinement fits constant or planar backgrounds only" in r.err
    assert not (r.tmp / "joint").exists()


@pytest.mark.parametrize("background, names", [("resolution:3", ["background_0", "background_1", "background_2"]),
                                               ("planes", ["background"])])
def test_backgrounds_run_and_report(refine_cli, still, background, names):
    r = refine_cli("--image", "ok.cbf", "--model", SMALL_MODEL, "--refine", "scale,background", "--spots",
                   "spots.txt", "--spot-window", "4", "--background", background, "--no-esds")
    assert r.code == 0, r.err
    result = json.loads((r.tmp / "result.json").read_text())
    assert [n for n in result["params"] if n.startswith("background")] == names
    assert result["hparams"]["background"] == background
    assert np.isfinite(result["fit"]["excess"])
    assert "background: " in r.out
