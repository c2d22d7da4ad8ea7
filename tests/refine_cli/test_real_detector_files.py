"""The image readers on REAL detector files (tests/data/images/README.md: where each comes from).

The expected header values are hard-coded from each file's own header as fabio / h5py / the text header print it:
SMV and mini-CBF: the ASCII header lines (quoted beside each number); MarCCD: ``fabio.marccdimage.MarccdImage().
readheader(...)`` (the MAR frame header at byte 1024); Eiger: ``h5py`` on the master's NXmx fields.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from refine.inputs.images import load_image
from refine.inputs.start_model import header_flags

pytest.importorskip("fabio")
h5py = pytest.importorskip("h5py")

IMAGES = Path(__file__).resolve().parents[1] / "data" / "images"
CRYSTAL = ["-cell", "50", "50", "50", "90", "90", "90", "-N", "5", "-default_F", "100", "-oversample", "1"]


def _notes(obs):
    return header_flags(CRYSTAL, obs)[1]


def _every_field_said(obs, notes):
    """Every non-zero header value of a fabio/SMV reader is taken (``labels``) or said not used (``unused``), and
    every unused one is in a note."""
    labels = {part for label in obs.header["labels"].values()
              for part in (label if isinstance(label, tuple) else (label,)) for part in str(part).split(" - ")}
    text = "\n".join(notes)
    for key, value in obs.header["fields"].items():
        if value in (0, "", None):
            continue
        assert key in labels or key in obs.header["unused"], key
    for key in obs.header["unused"]:
        assert key in text, key


def test_smv_timepix():
    obs = load_image(IMAGES / "TIMEPIX_SU_512-stdgoni_0001.img")
    assert (obs.format, obs.shape, obs.image.dtype) == ("smv", (512, 512), np.float64)
    assert obs.mask.all() and obs.masked == {}
    assert (obs.image.max(), np.median(obs.image), obs.image.min()) == (11810.0, 6.0, 0.0)
    geo = obs.geometry
    assert geo["pixel_mm"] == 0.055                        # PIXEL_SIZE=0.05500;
    assert geo["distance_mm"] == 531.85                    # DISTANCE=531.85;
    assert geo["wavelength_A"] == 0.0251                   # WAVELENGTH=0.025100;
    assert geo["beam_x_px"] == pytest.approx(13.20 / 0.055)  # DENZO_Y_BEAM=13.20; (mm along fast) = BEAM_CENTER_Y=240
    assert geo["beam_y_px"] == pytest.approx(13.53 / 0.055)  # DENZO_X_BEAM=13.53; = BEAM_CENTER_X=246
    assert (geo["phi_deg"], geo["osc_deg"], geo["twotheta_deg"]) == (65.4, 0.23, 0.0)  # OSC_START, OSC_RANGE, TWOTHETA
    assert geo["saturation"] == 65535.0                    # TYPE=unsigned_short, no saturation key
    notes = _notes(obs)
    _every_field_said(obs, notes)
    assert any(n.startswith("distance 531.85 mm from the header (DISTANCE)") for n in notes)


def test_mini_cbf_eiger16m_converted():
    obs = load_image(IMAGES / "dlsnxs2cbf_therm_0001.cbf.gz")
    assert (obs.format, obs.shape) == ("cbf", (4362, 4148))  # X-Binary-Size-Second-Dimension / -Fastest-Dimension
    assert obs.masked == {"negative": 1253320}             # the module gaps (-1)
    assert obs.image[obs.mask].max() == 404.0 and obs.image[obs.mask].sum() == 45043.0
    geo = obs.geometry
    assert geo["wavelength_A"] == 0.98027                  # Wavelength 0.98027 A
    assert geo["distance_mm"] == pytest.approx(213.96)     # Detector_distance 0.21396 m
    assert (geo["beam_x_px"], geo["beam_y_px"]) == (2216.06, 2300.41)  # Beam_xy (2216.06, 2300.41) pixels
    assert geo["pixel_mm"] == pytest.approx(0.075)         # Pixel_size 75e-6 m x 75e-6 m
    assert geo["saturation"] == 65535.0                    # Count_cutoff 65535 counts
    assert (geo["phi_deg"], geo["osc_deg"], geo["twotheta_deg"]) == (174.0, 0.25, 0.0)
    assert geo["polarization_fraction"] == 0.99 and geo["sensor_thickness_mm"] == pytest.approx(0.45)
    text = "\n".join(_notes(obs))
    for key in obs.header["pilatus"]:                      # every Pilatus header line has a note
        if not key.startswith("#") and "thickness" not in str(obs.header["pilatus"][key]):
            assert key in text or key in ("Pixel_size", "Wavelength", "Detector_distance", "Beam_xy", "Start_angle",
                                          "Angle_increment", "Polarization", "Count_cutoff"), key


def test_marccd():
    obs = load_image(IMAGES / "somedata_0001.mccd.bz2")
    assert (obs.format, obs.shape) == ("marccd", (1024, 1024))
    fields = obs.header["fields"]
    # the pixels against the detector's own statistics in the header (min = 10, max = 20721, over the round
    # detector's face: the 227049 pixels of the corners outside it are 0)
    face = obs.image[obs.image > 0]
    assert (face.min(), face.max()) == (fields["min"], fields["max"]) == (10, 20721)
    assert int((obs.image == 0).sum()) == 227049 and obs.image[0, 0] == 0.0
    assert obs.mask.all()
    geo = obs.geometry
    assert geo["pixel_mm"] == pytest.approx(0.15788)       # pixelsize_x = 157880 (nm)
    assert geo["wavelength_A"] == pytest.approx(1.03318)   # source_wavelength = 103318 (1e-5 A)
    assert (geo["beam_x_px"], geo["beam_y_px"]) == (522.549, 522.549)  # beam_x = beam_y = 522549 (1e-3 px)
    assert geo["saturation"] == 65535.0                    # saturated_value = 65535
    assert (geo["phi_deg"], geo["osc_deg"], geo["twotheta_deg"]) == (0.0, 0.0, 0.0)  # rotation_range 0: a still
    assert "distance_mm" not in geo                        # xtal_to_detector = 0: not recorded
    notes = _notes(obs)
    _every_field_said(obs, notes)
    assert any(n.startswith("xtal_to_detector 0 mm from the header: not used (no distance recorded") for n in notes)


def test_plain_tiff():
    obs = load_image(IMAGES / "oPPA_5grains_0001.tif.bz2")
    assert (obs.format, obs.shape, obs.geometry) == ("tiff", (2048, 2048), {})
    assert obs.image.max() == 2979.0 and np.median(obs.image) == 10.0 and obs.mask.all()
    notes = _notes(obs)
    _every_field_said(obs, notes)
    assert notes[-1].startswith("the TIFF tags give no geometry")


def test_eiger_master_without_its_data_file_is_one_line():
    with pytest.raises(InputError) as err:
        load_image(IMAGES / "dectris_eiger_master.h5")
    assert "data_000001" in str(err.value) and "\n" not in str(err.value)


def test_eiger_master_header(tmp_path):
    """The real master's header with a data file written here (the real one is not in tests/data/images)."""
    shutil.copy(IMAGES / "dectris_eiger_master.h5", tmp_path)
    pixels = np.random.default_rng(0).poisson(2.0, (1, 3269, 3110)).astype(np.uint16)
    pixels[0, 0, 0] = 12440                                # at the count cutoff: masked
    with h5py.File(tmp_path / "dectris_eiger_data_000001.h5", "w") as f:
        f.create_dataset("entry/data/data", data=pixels, chunks=(1, 3269, 3110), compression="gzip")
    obs = load_image(tmp_path / "dectris_eiger_master.h5")
    assert (obs.format, obs.shape) == ("hdf5", (3269, 3110))  # detectorSpecific/y_pixels_in_detector, x_...
    assert obs.masked == {"saturated": 1}                  # detectorSpecific/pixel_mask is all 0 (good) here
    geo = obs.geometry
    assert geo["wavelength_A"] == pytest.approx(0.9801122, rel=1e-6)  # beam/incident_wavelength (angstrom)
    assert geo["distance_mm"] == pytest.approx(134.255)    # detector/detector_distance 0.134255 m
    assert geo["pixel_mm"] == pytest.approx(0.075)         # detector/x_pixel_size 7.5e-05 m
    assert (geo["beam_x_px"], geo["beam_y_px"]) == pytest.approx((1607.415, 1586.4314))  # beam_center_x/y (pixel)
    assert geo["saturation"] == 12440.0                    # detectorSpecific/countrate_correction_count_cutoff
    assert (geo["phi_deg"], geo["osc_deg"], geo["twotheta_deg"]) == (0.0, 0.5, 0.0)  # omega, omega_increment
    assert geo["sensor_thickness_mm"] == pytest.approx(0.45)  # sensor_thickness 0.00045 m (Si)
    text = "\n".join(_notes(obs))
    taken = {"distance", "beam_center_x", "beam_center_y", "x_pixel_size", "y_pixel_size", "sensor_thickness",
             "sensor_material", "detector_distance", "incident_wavelength", "pixel_mask", "omega", "omega_increment",
             "two_theta", "countrate_correction_count_cutoff"}
    with h5py.File(IMAGES / "dectris_eiger_master.h5", "r") as f:  # every dataset is used or said not to be
        names = []
        f["entry"].visit(names.append)
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if ("detectorModule_" in name or base in taken or not isinstance(f["entry"].get(name), h5py.Dataset)
                    or name.startswith("data/")):
                continue
            assert name.split("/", 2)[-1] in text, name
    assert "detectorModule_* 36 groups" in text and "photon_energy 12650 eV" in text


def test_refinement_runs_on_the_real_smv(refine_cli):
    image = IMAGES / "TIMEPIX_SU_512-stdgoni_0001.img"
    r = refine_cli("--image", image, "--model", " ".join(CRYSTAL), "--refine", "scale,background", "--max-steps", "2",
                   "--roi", "300", "331", "300", "331")
    assert r.code == 0, r.err
    doc = json.loads((r.tmp / "result.json").read_text())
    assert doc["input"]["format"] == "smv" and doc["input"]["geometry"]["distance_mm"] == 531.85
    assert doc["params"]["distance"] == 531.85 and "beam centre (240, 246) px" in r.out
