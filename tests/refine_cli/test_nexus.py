"""NeXus NXmx / Eiger masters (issue #18): bitshuffle-LZ4 data files through hdf5plugin, the frames of a master's
data_000001 ... links, detector two-theta and the frame's rotation from the NXtransformations, and what the
starting model makes of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from refine.inputs.images import load_image
from refine.inputs.start_model import model_config

from cli_helpers import CRYSTAL

h5py = pytest.importorskip("h5py")
hdf5plugin = pytest.importorskip("hdf5plugin")

ROOT = Path(__file__).resolve().parents[2]


def _note(notes, start):
    found = [n for n in notes if n.startswith(start)]
    assert len(found) == 1, (start, notes)
    return found[0]


def _axis(group, name, values, kind, vector, depends_on, units="deg"):
    node = group.create_dataset(name, data=np.asarray(values, dtype=np.float64))
    node.attrs.update({"transformation_type": kind, "vector": np.asarray(vector, dtype=np.float64),
                       "depends_on": depends_on, "units": units})
    return node


def write_master(tmp_path, frames, two_theta=15.0, increment=0.5, data_files=2):
    """An Eiger-style master: data in ``data_files`` bitshuffle-LZ4 files linked as data_000001 ..., geometry
    in NXmx fields (metres, pixels) and NXtransformations (detector det_z then two_theta; sample omega, chi)."""
    for i, part in enumerate(np.array_split(frames, data_files), start=1):
        with h5py.File(tmp_path / f"x_data_{i:06d}.h5", "w") as f:
            f.create_dataset("entry/data/data", data=part, chunks=(1, *part.shape[1:]),
                             **hdf5plugin.Bitshuffle(nelems=0, cname="lz4"))
    with h5py.File(tmp_path / "x_master.h5", "w") as f:
        for i in range(1, data_files + 1):
            f[f"entry/data/data_{i:06d}"] = h5py.ExternalLink(f"x_data_{i:06d}.h5", "/entry/data/data")
        det = f.create_group("entry/instrument/detector")
        for name, value, units in (("x_pixel_size", 0.2e-3, "m"), ("y_pixel_size", 0.2e-3, "m"),
                                   ("beam_center_x", 21.5, "pixels"), ("beam_center_y", 17.0, "pixels"),
                                   ("sensor_thickness", 0.45e-3, "m")):
            det.create_dataset(name, data=value).attrs["units"] = units
        det.create_dataset("sensor_material", data="Silicon")
        det.create_dataset("saturation_value", data=3900)
        det.create_dataset("depends_on", data="/entry/instrument/detector/transformations/det_z")
        tr = det.create_group("transformations")
        _axis(tr, "det_z", [80.0], "translation", (0, 0, 1), "/entry/instrument/detector/transformations/two_theta",
              units="mm")
        _axis(tr, "two_theta", [two_theta], "rotation", (1, 0, 0), ".")
        f.create_dataset("entry/instrument/beam/incident_wavelength", data=1.3).attrs["units"] = "angstrom"
        sample = f.create_group("entry/sample")
        sample.create_dataset("depends_on", data="/entry/sample/transformations/omega")
        st = sample.create_group("transformations")
        omega = increment * np.arange(len(frames))
        _axis(st, "omega", omega, "rotation", (-1, 0, 0), "/entry/sample/transformations/chi")
        st.create_dataset("omega_increment_set", data=increment).attrs["units"] = "deg"
        _axis(st, "chi", [10.0], "rotation", (0, 0, 1), ".")
    return tmp_path / "x_master.h5"


def _frames(n=4):
    return np.random.default_rng(3).integers(0, 4000, size=(n, 36, 40)).astype(np.uint32)


def test_compressed_master_frames_and_geometry(tmp_path):
    frames = _frames()
    path = write_master(tmp_path, frames)
    for i in range(4):
        np.testing.assert_array_equal(load_image(path, frame=i).image, frames[i])
    obs = load_image(path, frame=2)
    assert obs.format == "hdf5" and obs.geometry["saturation"] == 3900
    assert obs.geometry == pytest.approx({"wavelength_A": 1.3, "distance_mm": 80.0, "pixel_mm": 0.2, "beam_x_px": 21.5,
                                          "beam_y_px": 17.0, "sensor_thickness_mm": 0.45, "twotheta_deg": 15.0,
                                          "phi_deg": 1.0, "osc_deg": 0.5, "saturation": 3900})
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert (cfg.wavelength_A, cfg.distance_mm, cfg.pixel_mm, cfg.twotheta_deg) == (1.3, 80.0, 0.2, 15.0)
    assert (cfg.phi_deg, cfg.osc_deg, cfg.phisteps) == (1.0, 0.5, 25)
    assert cfg.detector_thick_um == pytest.approx(450.0)
    assert "as -twotheta 15" in _note(notes, "two_theta 15 deg from the header")
    _note(notes, "rotation omega 1 deg, omega_increment_set 0.5 deg from the header as -phi 1 -osc 0.5")
    assert "not used (goniometer setting" in _note(notes, "chi 10 deg from the header")
    assert "not used (the model rotates about its spindle axis" in _note(notes, "omega vector (-1, 0, 0)")
    assert "two-theta axis" in _note(notes, "two_theta vector (1, 0, 0)")
    _note(notes, "saturation_value 3900 counts from the header: pixels at or above it are masked")
    with pytest.raises(InputError, match="holds 4 frames"):
        load_image(path)
    with pytest.raises(InputError, match="frame 4 out of range"):
        load_image(path, frame=4)


def test_a_nexus_still_and_a_dectris_goniometer(tmp_path):
    path = write_master(tmp_path, _frames(1), two_theta=0.0, increment=0.0, data_files=1)
    obs = load_image(path)
    assert (obs.geometry["phi_deg"], obs.geometry["osc_deg"], obs.geometry["twotheta_deg"]) == (0.0, 0.0, 0.0)
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert (cfg.phi_deg, cfg.osc_deg or 0, cfg.twotheta_deg) == (0, 0, 0)
    assert "not used (a still" in _note(notes, "omega 0 deg, omega_increment_set 0 deg from the header")
    with h5py.File(path, "a") as f:  # older Dectris firmware: no transformations, a goniometer group
        del f["entry/sample"]
        f.create_dataset("entry/sample/goniometer/omega", data=[30.0]).attrs["units"] = "deg"
        f.create_dataset("entry/sample/goniometer/omega_range_average", data=0.1).attrs["units"] = "deg"
        del f["entry/instrument/detector/depends_on"]
        f["entry/instrument/detector/distance"] = 0.09
        f["entry/instrument/detector/distance"].attrs["units"] = "m"
    g = load_image(path).geometry
    assert (g["phi_deg"], g["osc_deg"], g["distance_mm"]) == (30.0, 0.1, 90.0) and "twotheta_deg" not in g


def test_master_without_its_data_files_or_filters(tmp_path):
    path = write_master(tmp_path, _frames())
    script = ("import sys; sys.modules['hdf5plugin'] = None\n"  # as if nbtorch[formats] were not installed
              "from refine.inputs.images import load_image\nfrom nbtorch.errors import InputError\n"
              f"try:\n    load_image({str(path)!r}, frame=0)\nexcept InputError as exc:\n    print(exc)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HDF5_PLUGIN_PATH": str(tmp_path / "none")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip().endswith("which this h5py cannot decode: pip install 'nbtorch[formats]' (hdf5plugin)"), \
        out.stdout + out.stderr
    assert out.stdout.count("\n") == 1 and str(path) in out.stdout
    os.remove(tmp_path / "x_data_000002.h5")
    with pytest.raises(InputError, match="data_000002 links to a data file that cannot be opened"):
        load_image(path, frame=0)


def _stokes(path, stokes):
    with h5py.File(path, "a") as f:
        f.create_dataset("entry/instrument/beam/incident_polarization_stokes", data=np.asarray(stokes, dtype=float))
    return path


def test_nexus_polarization_along_the_e_vector(tmp_path):
    path = _stokes(write_master(tmp_path, _frames(2)), [[1, 0.98, 0, 0], [1, -0.5, 0, 0.1]])
    obs = load_image(path, frame=0)
    assert obs.geometry["polarization_fraction"] == pytest.approx(0.99)
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert cfg.polarization == pytest.approx(0.98) and cfg.convention == "xds"
    assert _note(notes, "incident_polarization_stokes (1, 0.98, 0, 0) from the header") == (
        "incident_polarization_stokes (1, 0.98, 0, 0) from the header as -polar 0.98 (Kahn factor S1/S0: linear "
        "polarisation 0.98 along the model's E-vector (1, 0, 0), NeXus x)")
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", load_image(path, frame=1))  # the frame's row: across, circular
    assert cfg.polarization == pytest.approx(-0.5)
    note = _note(notes, "incident_polarization_stokes (1, -0.5, 0, 0.1) from the header as -polar -0.5")
    assert "across (at 90 deg to) the model's E-vector" in note and "S3/S0 0.1, the circular part" in note
    _, _, notes = model_config(f"-xds {CRYSTAL} -nopolar", obs)
    assert _note(notes, "incident_polarization_stokes").endswith("not used (--model gives -nopolar)")


def test_nexus_polarization_turned(tmp_path):
    """E-vector at 45 deg from NeXus x towards y: a CUSTOM model turns its E-vector about the beam; a fixed
    convention keeps it, takes S1/S0 and says S2 is not used."""
    obs = load_image(_stokes(write_master(tmp_path, _frames(1), data_files=1), [2, 0, 1.8, 0]))
    assert obs.geometry["polarization_angle_deg"] == pytest.approx(45.0)
    cfg, _, notes = model_config(f"-fdet_vector 0 0 1 -sdet_vector 0 -1 0 {CRYSTAL}", obs)  # CUSTOM, MOSFLM's axes
    assert cfg.convention == "custom" and cfg.polarization == pytest.approx(0.9)
    # MOSFLM frame: NeXus x is -z, y is y; E = cos45 x + sin45 y is the axis (0, -1, 1)/sqrt2 turned from (0, 0, 1)
    np.testing.assert_allclose(cfg.polar_vector, (0.0, -0.5 ** 0.5, 0.5 ** 0.5), atol=1e-9)
    assert "at 45 deg from the model's (0, 0, 1), NeXus x, about the beam (1, 0, 0)" in \
        _note(notes, "incident_polarization_stokes (2, 0, 1.8, 0) from the header as -polar 0.9 -polar_vector")
    cfg, _, notes = model_config(f"-mosflm {CRYSTAL}", obs)
    assert cfg.convention == "mosflm" and cfg.polarization == 0 and cfg.polar_vector is None
    _note(notes, "incident_polarization_stokes (2, 0, 1.8, 0) from the header as -polar 0 (Kahn factor S1/S0")
    assert "the mosflm convention fixes the E-vector" in _note(notes, "incident_polarization_stokes S2/S0 0.9")


@pytest.mark.parametrize("stokes, why", [([1, 2, 0, 0], "exceeds S0"), ([0, 0, 0, 0], "S0, the intensity"),
                                         ([1, 0, 0], "a Stokes vector has 4 values")])
def test_nexus_polarization_that_is_not_one(tmp_path, stokes, why):
    obs = load_image(_stokes(write_master(tmp_path, _frames(1), data_files=1), stokes))
    assert "polarization_fraction" not in obs.geometry
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert cfg.polarization == 0 and why in _note(notes, "incident_polarization_stokes")


def test_nexus_rectangular_pixels_are_said(tmp_path):
    path = write_master(tmp_path, _frames(1), data_files=1)
    with h5py.File(path, "a") as f:
        f["entry/instrument/detector/y_pixel_size"][()] = 0.1e-3
    obs = load_image(path)
    assert obs.geometry["pixel_mm"] == pytest.approx(0.2)
    _, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert "not used (the model's pixels are square (-pixel): x_pixel_size is taken" in \
        _note(notes, "y_pixel_size 0.1 mm from the header")
