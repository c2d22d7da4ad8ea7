"""scripts/peer/compare_spots.py: DIALS's spot residuals beside nbtorch's on the same spots, per still: one result
(also when nbtorch's observed spots came from a .refl, x, y and the frame z), and every still of an
independent-mode folder against a composite DIALS file."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from nbtorch.io.dials import write_refl

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peer" / "compare_spots.py"


def _dials_refl(path: Path, xyz: np.ndarray, ids: np.ndarray, offsets: dict[int, float]) -> None:
    """DIALS's reflections: its predictions ``offsets[id]`` px off in x; every row used in refinement."""
    cal = xyz + np.array([[offsets[int(i)], 0.0, 0.0] for i in ids])
    write_refl(path, {"xyzobs.px.value": ("vec3<double>", xyz), "xyzcal.px": ("vec3<double>", cal),
                      "flags": ("std::size_t", np.full(len(xyz), 1 << 3, dtype=np.uint64)),
                      "id": ("int", ids.astype(np.int32))}, {int(i): f"still{i}" for i in np.unique(ids)})


def _result(path: Path, observed: np.ndarray, dy: float, expt_index: int | None = None) -> None:
    predicted = [list(p) for p in (observed[:, :2] + np.array([0.0, dy]))]
    doc = {"spots": {"observed": observed.tolist(), "predicted_final": predicted}}
    if expt_index is not None:
        doc["input"] = {"expt_index": expt_index}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _row(out: str, still: str) -> list[str]:
    return [c.strip() for c in next(line for line in out.splitlines() if line.startswith(f"| {still} |")).split("|")[1:-1]]


@pytest.mark.parametrize("columns", [2, 3])
def test_shared_spots_are_compared_whatever_the_observed_columns(tmp_path, capsys, columns):
    rng = np.random.default_rng(0)
    xyz = np.c_[rng.uniform(10, 500, size=(12, 2)), np.zeros(12)]
    _dials_refl(tmp_path / "dials.refl", xyz, np.zeros(12), {0: 0.3})  # DIALS's predictions 0.3 px off
    _result(tmp_path / "result.json", xyz[:10, :columns], 0.1)  # nbtorch: 10 of DIALS's spots, 0.1 px off
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main([str(tmp_path / "dials.refl"), str(tmp_path / "result.json")]) == 0
    row = _row(capsys.readouterr().out, "result.json")
    assert row[1:] == ["12", "0.300", "10", "0.100", "10", "0.300", "0.100"], row


def test_each_still_of_an_out_dir_meets_its_own_experiments_spots(tmp_path, capsys):
    """Two stills in one composite .refl, each nbtorch folder records its experiment: each is compared with its own
    rows only (the spots of both stills sit at the same pixels, so a comparison across stills would share them)."""
    rng = np.random.default_rng(1)
    xy = np.c_[rng.uniform(10, 500, size=(8, 2)), np.zeros(8)]
    _dials_refl(tmp_path / "composite.refl", np.r_[xy, xy], np.r_[np.zeros(8), np.ones(8)], {0: 0.2, 1: 0.6})
    _result(tmp_path / "out" / "a" / "result.json", xy[:6], 0.1, expt_index=0)
    _result(tmp_path / "out" / "b" / "result.json", xy[:4], 0.4, expt_index=1)
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main([str(tmp_path / "composite.refl"), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert _row(out, "a")[1:] == ["8", "0.200", "6", "0.100", "6", "0.200", "0.100"], out
    assert _row(out, "b")[1:] == ["8", "0.600", "4", "0.400", "4", "0.600", "0.400"], out
    total = _row(out, "all")
    assert total[1] == "16" and total[5] == "10" and float(total[7]) == pytest.approx(np.sqrt((6 * 0.01 + 4 * 0.16) / 10), abs=1e-3)
    # --id picks the experiment of a result that does not record one
    _result(tmp_path / "plain.json", xy[:4], 0.0)
    assert main([str(tmp_path / "composite.refl"), str(tmp_path / "plain.json"), "--id", "1"]) == 0
    assert _row(capsys.readouterr().out, "plain.json")[1:3] == ["8", "0.600"]


def test_a_folder_without_results_is_refused_in_one_line(tmp_path, capsys):
    _dials_refl(tmp_path / "d.refl", np.zeros((2, 3)), np.zeros(2), {0: 0.1})
    (tmp_path / "empty").mkdir()
    assert runpy.run_path(str(SCRIPT))["main"]([str(tmp_path / "d.refl"), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no */result.json" in err, err


def test_a_refined_refl_is_compared_experiment_by_experiment(tmp_path, capsys):
    """nbtorch's combined output (refined.refl: observed spots and refined predictions, by id) against DIALS's."""
    rng = np.random.default_rng(2)
    xy = np.c_[rng.uniform(10, 500, size=(6, 2)), np.zeros(6)]
    ids = np.r_[np.zeros(6), np.ones(6)]
    _dials_refl(tmp_path / "dials.refl", np.r_[xy, xy], ids, {0: 0.5, 1: 0.5})
    _dials_refl(tmp_path / "refined.refl", np.r_[xy, xy], ids, {0: 0.1, 1: 0.3})
    assert runpy.run_path(str(SCRIPT))["main"]([str(tmp_path / "dials.refl"), str(tmp_path / "refined.refl")]) == 0
    out = capsys.readouterr().out
    assert _row(out, "experiment 0")[1:] == ["6", "0.500", "6", "0.100", "6", "0.500", "0.100"], out
    assert _row(out, "experiment 1")[7] == "0.300"
