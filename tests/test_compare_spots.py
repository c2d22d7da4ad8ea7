"""scripts/peer/compare_spots.py: DIALS's spot residuals beside nbtorch's on the same spots, also when nbtorch's
observed spots came from a .refl (x, y and the frame z: issue #44's broadcast error)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from nbtorch.io.dials import write_refl

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peer" / "compare_spots.py"


@pytest.mark.parametrize("columns", [2, 3])
def test_shared_spots_are_compared_whatever_the_observed_columns(tmp_path, capsys, columns):
    rng = np.random.default_rng(0)
    xyz = np.c_[rng.uniform(10, 500, size=(12, 2)), np.zeros(12)]
    dials_cal = xyz + np.array([0.3, 0.0, 0.0])  # DIALS's predictions 0.3 px off
    write_refl(tmp_path / "dials.refl", {"xyzobs.px.value": ("vec3<double>", xyz),
                                         "xyzcal.px": ("vec3<double>", dials_cal),
                                         "flags": ("std::size_t", np.full(12, 1 << 3, dtype=np.uint64)),
                                         "id": ("int", np.zeros(12, dtype=np.int32))}, {0: "still"})
    observed = xyz[:10, :columns]  # nbtorch's spots: 10 of DIALS's, its predictions 0.1 px off
    predicted = [list(p) for p in (xyz[:10, :2] + np.array([0.0, 0.1]))]
    (tmp_path / "result.json").write_text(json.dumps({"spots": {"observed": observed.tolist(),
                                                                "predicted_final": predicted}}))
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main([str(tmp_path / "dials.refl"), str(tmp_path / "result.json")]) == 0
    out = capsys.readouterr().out
    assert "| DIALS, shared spots | 10 | 0.300 |" in out and "| nbtorch, shared spots | 10 | 0.100 |" in out, out
