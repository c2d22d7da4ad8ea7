"""Tests for nbtorch.io.dials: DIALS .expt (JSON) and .refl (msgpack) without dxtbx, on real DIALS files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.dials import read_expt, read_refl, updated_document, write_expt, write_refl

DATA = Path(__file__).resolve().parents[1] / "data" / "dials"
STILLS = DATA / "cunir_ssx_indexed"
SCAN = DATA / "centroid_rotation_indexed"


def _error(call, *fragments: str) -> str:
    with pytest.raises(InputError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_read_stills_experiment() -> None:
    exp = read_expt(STILLS.with_suffix(".expt"), 1)
    assert exp.n_experiments() == 5 and exp.index == 1
    assert exp.identifier == "c4fc52a7-327f-4475-93d1-187bb796f907"
    assert exp.goniometer is None and exp.scan is None
    assert exp.panel["image_size"] == [2463, 2527] and exp.beam["wavelength"] == pytest.approx(1.37611)
    assert exp.crystal["space_group_hall_symbol"].strip() == "P 2ac 2ab 3"


def test_read_scan_experiment() -> None:
    exp = read_expt(SCAN.with_suffix(".expt"))
    assert exp.scan["oscillation"] == [0.0, 0.2] and exp.goniometer["rotation_axis"][0] == 1.0


def test_read_refl_columns_and_experiment_selection() -> None:
    path = STILLS.with_suffix(".refl")
    everything = read_refl(path, ("xyzobs.px.value", "id", "miller_index", "flags"))
    assert everything["xyzobs.px.value"].shape == (360, 3) and everything["xyzobs.px.value"].dtype == np.float64
    assert everything["miller_index"].dtype == np.int32 and everything["flags"].dtype == np.uint64
    one = read_refl(path, ("xyzobs.px.value",), experiment_id=1)
    assert set(one) == {"xyzobs.px.value"}
    assert np.array_equal(one["xyzobs.px.value"], everything["xyzobs.px.value"][everything["id"] == 1])
    # spot centroids lie on the detector, in pixels (x fast < 2463, y slow < 2527)
    xy = one["xyzobs.px.value"][:, :2]
    assert np.all((xy > 0) & (xy < [2463, 2527]))


def test_write_refl_round_trip(tmp_path: Path) -> None:
    cols = read_refl(SCAN.with_suffix(".refl"), ("xyzcal.px", "miller_index", "id", "flags"))
    out = tmp_path / "cut.refl"
    write_refl(out, {"xyzcal.px": ("vec3<double>", cols["xyzcal.px"][:5]),
                     "miller_index": ("cctbx::miller::index<>", cols["miller_index"][:5]),
                     "id": ("int", cols["id"][:5]), "flags": ("std::size_t", cols["flags"][:5])}, {0: "abc"})
    back = read_refl(out, ("xyzcal.px", "miller_index", "id", "flags"))
    for name in back:
        assert np.array_equal(back[name], cols[name][:5])


def test_write_expt_keeps_the_document(tmp_path: Path) -> None:
    exp = read_expt(STILLS.with_suffix(".expt"), 2)
    doc = updated_document(exp, {"wavelength": 1.5}, {"origin": [1.0, 2.0, 3.0]}, {"real_space_a": [10.0, 0.0, 0.0]})
    out = tmp_path / "out.expt"
    write_expt(out, doc)
    back = read_expt(out, 2)
    assert back.beam["wavelength"] == 1.5 and back.panel["origin"] == [1.0, 2.0, 3.0]
    assert back.crystal["real_space_a"] == [10.0, 0.0, 0.0] and "B_covariance" not in back.crystal
    assert back.crystal["real_space_b"] == exp.crystal["real_space_b"]
    assert back.document["imageset"] == exp.document["imageset"]  # the rest untouched
    assert read_expt(STILLS.with_suffix(".expt"), 2).beam["wavelength"] != 1.5  # the input is not changed


def test_expt_errors(tmp_path: Path) -> None:
    _error(lambda: read_expt(tmp_path / "missing.expt"), "missing.expt", "not found")
    bad = tmp_path / "bad.expt"
    bad.write_text("{not json")
    _error(lambda: read_expt(bad), "bad.expt", "not JSON")
    bad.write_text('{"experiment": []}')
    _error(lambda: read_expt(bad), "no experiment")
    _error(lambda: read_expt(STILLS.with_suffix(".expt"), 5), "no experiment 5", "0..4")
    doc = json.loads(SCAN.with_suffix(".expt").read_text())
    doc["detector"][0]["panels"].append(doc["detector"][0]["panels"][0])
    bad.write_text(json.dumps(doc))
    _error(lambda: read_expt(bad), "multi-panel detector (2 panels)")
    doc = json.loads(SCAN.with_suffix(".expt").read_text())
    del doc["crystal"][0]["real_space_b"]
    bad.write_text(json.dumps(doc))
    _error(lambda: read_expt(bad), "crystal 'real_space_b' missing")
    doc = json.loads(SCAN.with_suffix(".expt").read_text())
    del doc["experiment"][0]["crystal"]
    bad.write_text(json.dumps(doc))
    _error(lambda: read_expt(bad), "no crystal model")


def test_refl_errors(tmp_path: Path) -> None:
    _error(lambda: read_refl(tmp_path / "none.refl"), "none.refl", "not found")
    bad = tmp_path / "bad.refl"
    bad.write_bytes(b"\x80\x04 pickle, not msgpack")
    _error(lambda: read_refl(bad), "bad.refl", "not a DIALS .refl")
    _error(lambda: read_refl(SCAN.with_suffix(".refl"), ("xyzobs.px.value", "no_such_column")),
           "no 'no_such_column' column")
    _error(lambda: read_refl(SCAN.with_suffix(".refl"), experiment_id=3), "no reflections of experiment 3")
