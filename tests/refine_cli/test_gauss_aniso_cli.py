"""nbtorch-refine with the anisotropic Gaussian crystal: the off-diagonal sizes (group ``Ndef``) are refined, carry
esds (forward-mode Jacobian through the eager hot loop) and reach result.json under their canonical names."""

from __future__ import annotations

import math

from cli_helpers import SMALL_MODEL, simulate
from nbtorch.io import write_cbf

ANISO = SMALL_MODEL.replace("-N 5", "-gauss_aniso_xtal -Na 5 -Nb 5 -Nc 6")
TRUTH = {"N_d": 1.0, "N_e": -0.6, "N_f": 0.8}


def test_off_diagonal_sizes_are_refined_with_esds(refine_cli, tmp_path):
    flags = ANISO + " " + " ".join(f"-{n.replace('_', '')} {v}" for n, v in TRUTH.items())
    write_cbf(tmp_path / "obs.cbf", simulate(flags, scale=20.0, background=2.0, seed=3), {"pixel_size_mm": 0.1})
    r = refine_cli("--image", "obs.cbf", "--model", ANISO, "--refine", "scale,background,Ndef", "--max-steps", "40")
    assert r.code == 0, r.err
    out = r.json()
    assert set(TRUTH) <= set(out["free"])
    start_error = sum(v * v for v in TRUTH.values())
    final_error = sum((out["params"][n] - v) ** 2 for n, v in TRUTH.items())
    assert final_error < 0.1 * start_error, out["params"]
    for n in TRUTH:
        assert out["units"][n] == "unit cells"
        assert math.isfinite(out["esds"][n]) and out["esds"][n] > 0, out["esds"]
