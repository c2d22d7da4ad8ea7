"""TIFF, Pilatus TIFF, MarCCD/Rayonix and mar345 images through fabio (issue #18): pixels, header geometry,
the starting model's flags and notes, malformed files (written in tmp_path by tests/detector_files.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.images import detect_format
from refine.inputs.images import load_image
from refine.inputs.start_model import model_config

from cli_helpers import CRYSTAL, simulate

fabio = pytest.importorskip("fabio")

from detector_files import MARCCD, PILATUS_LINES, write_mar345, write_marccd, write_tiff  # noqa: E402

def _pixels(shape=(36, 40), dtype=np.uint16, seed=0):
    return np.random.default_rng(seed).integers(0, 4000, size=shape).astype(dtype)


def _note(notes, start):
    found = [n for n in notes if n.startswith(start)]
    assert len(found) == 1, (start, notes)
    return found[0]


GEOMETRY = {"wavelength_A": 1.3, "distance_mm": 80.0, "pixel_mm": 0.2, "beam_x_px": 21.5, "beam_y_px": 17.0,
            "phi_deg": 10.0}


def _model_takes_the_header(obs):
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert (cfg.wavelength_A, cfg.distance_mm, cfg.pixel_mm) == (1.3, 80.0, 0.2)
    assert (cfg.ORGX, cfg.ORGY) == (pytest.approx(22.0), pytest.approx(17.5))  # Fbeam/p + 1/2, Sbeam/p + 1/2
    assert (cfg.fpixels, cfg.spixels) == (40, 36)
    assert (cfg.phi_deg, cfg.osc_deg, cfg.phisteps) == (10.0, pytest.approx(0.1), 5)
    return cfg, notes


def test_plain_tiff_pixels_and_no_geometry(tmp_path):
    img = _pixels()
    write_tiff(tmp_path / "x.tif", img)
    obs = load_image(tmp_path / "x.tif")
    assert obs.format == "tiff" and obs.geometry == {}
    np.testing.assert_array_equal(obs.image, img)
    _, _, notes = model_config(f"-xds {CRYSTAL} -lambda 1 -distance 80 -pixel 0.2", obs)
    assert "the TIFF tags give no geometry" in _note(notes, "the TIFF tags")
    assert "not used (exposure, counting, provenance" in _note(notes, "date ")  # the TIFF's DateTime tag


def test_pilatus_tiff_header_is_the_cbf_header(tmp_path):
    img = _pixels(dtype=np.int32)
    img[3, :] = -1  # module gap
    write_tiff(tmp_path / "x.tif", img, PILATUS_LINES)
    obs = load_image(tmp_path / "x.tif")
    assert obs.format == "tiff" and obs.masked["negative"] == 40
    np.testing.assert_array_equal(obs.image, img)
    assert {k: obs.geometry[k] for k in GEOMETRY} == GEOMETRY
    assert (obs.geometry["osc_deg"], obs.geometry["polarization_fraction"]) == (0.1, 0.99)
    cfg, notes = _model_takes_the_header(obs)
    assert cfg.polarization == pytest.approx(0.98) and cfg.detector_thick_um == pytest.approx(450.0)
    _note(notes, "rotation Start_angle 10 deg, Angle_increment 0.1 deg from the header as -phi 10")
    assert "not used (goniometer setting" in _note(notes, "Kappa 5.0000 deg. from the header")
    assert "sensor parallax: Silicon 450 um" in _note(notes, "sensor parallax")


@pytest.mark.parametrize("name", ["x.mccd", "x.rx", "x.tif"])
def test_marccd_rayonix_geometry(tmp_path, name):
    img = _pixels()
    write_marccd(tmp_path / name, img, MARCCD)
    obs = load_image(tmp_path / name)
    assert obs.format == "marccd"
    np.testing.assert_array_equal(obs.image, img)
    assert {k: obs.geometry[k] for k in GEOMETRY} == pytest.approx(GEOMETRY)
    assert obs.geometry["saturation"] == 3900 and obs.masked["saturated"] == int((img >= 3900).sum())
    cfg, notes = _model_takes_the_header(obs)
    assert cfg.twotheta_deg == 0 and cfg.detector_rotx_deg == 0
    _note(notes, "rotation start_phi 10 deg, rotation_range 0.1 deg from the header as -phi 10 -osc 0.1")
    assert _note(notes, "saturated_value 3900 counts") == \
        "saturated_value 3900 counts from the header: pixels at or above it are masked"
    assert "not used (goniometer setting" in _note(notes, "start_omega 3 deg from the header")
    assert "not used (a detector rotation belongs in --model" in _note(notes, "detector_rotx 0.5 deg")
    assert "not used (the model rotates about its spindle axis" in _note(notes, "rotation_axis 4 (phi)")
    assert "mean_bias 10000" in _note(notes, "exposure_time 1000 ms; mean_bias 10000 from the header: not used")
    assert _note(notes, "start_twotheta 0 deg") == "start_twotheta 0 deg from the header: the detector is normal to the beam"


def test_marccd_two_theta_swings_the_detector(tmp_path):
    write_marccd(tmp_path / "x.mccd", _pixels(), {**MARCCD, "start_twotheta": 15000})
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", load_image(tmp_path / "x.mccd"))
    assert cfg.twotheta_deg == 15.0
    assert "as -twotheta 15" in _note(notes, "start_twotheta 15 deg from the header")


def test_mar345_geometry(tmp_path):
    img = _pixels(shape=(40, 40), dtype=np.int32)
    img[5, 7], img[20, 3] = 70000, 250000  # above 65535: the overflow records (32768..65535: fabio's writer fails)
    write_mar345(tmp_path / "x.mar2300", img, {"CHI": "2.5"})
    assert detect_format(tmp_path / "x.mar2300") == "mar345"
    (tmp_path / "x.mar2300").rename(tmp_path / "x.img.dat")  # told by its first bytes too
    obs = load_image(tmp_path / "x.img.dat")
    assert obs.format == "mar345"
    np.testing.assert_array_equal(obs.image, img)
    assert obs.geometry == pytest.approx({**GEOMETRY, "beam_x_px": 21.5, "beam_y_px": 17.0, "osc_deg": 0.1,
                                          "twotheta_deg": 0.0, "pixel_mm": 0.2})
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert (cfg.fpixels, cfg.spixels, cfg.phi_deg, cfg.osc_deg) == (40, 40, 10.0, pytest.approx(0.1))
    _note(notes, "rotation PHI_START 10 deg, PHI_END - PHI_START 0.1 deg from the header as -phi 10")
    assert "not used (goniometer setting" in _note(notes, "CHI 2.5 deg from the header")
    assert "TIME 60.0" in _note(notes, "PROGRAM FabIO")


def test_refinement_of_a_rayonix_image_takes_its_header(refine_cli, tmp_path):
    """nbtorch-refine on a MarCCD/Rayonix image: the model leaves the geometry to the MAR header."""
    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 32 -Xbeam 1.63 -Ybeam 1.58"
    img = simulate(f"{CRYSTAL} {geometry}").astype(np.uint16)
    write_marccd(tmp_path / "obs.mccd", img, {"xtal_to_detector": 40000, "pixelsize_x": 100000, "pixelsize_y": 100000,
                                              "source_wavelength": 100000, "beam_x": 16300, "beam_y": 16800,
                                              "saturated_value": 65535, "rotation_axis": 4, "rotation_range": 0})
    r = refine_cli("--image", "obs.mccd", "--model", CRYSTAL, "--refine", "scale,background,cell", "--max-steps", "3",
                   "--subsample", "0.9", "--dmin", "1.5")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["input"]["format"] == "marccd"
    assert doc["input"]["geometry"]["distance_mm"] == 40.0 and doc["input"]["geometry"]["wavelength_A"] == 1.0
    assert doc["params"]["distance"] == 40.0 and doc["params"]["beam_x"] == pytest.approx(1.63)
    assert "distance 40 mm from the header" in r.out and "not used (a still" in r.out


def test_a_still_from_marccd(tmp_path):
    write_marccd(tmp_path / "x.mccd", _pixels(), {**MARCCD, "rotation_axis": 0, "rotation_range": 0,
                                                  "start_phi": 0, "end_phi": 0, "start_omega": 0})
    obs = load_image(tmp_path / "x.mccd")
    assert obs.geometry["osc_deg"] == 0 and "phi_deg" not in obs.geometry
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert (cfg.phi_deg, cfg.osc_deg or 0) == (0, 0)
    assert "not used (a still" in _note(notes, "rotation_range 0 deg from the header")


def test_malformed_files_are_one_line_errors(tmp_path):
    write_tiff(tmp_path / "x.tif", _pixels())
    data = (tmp_path / "x.tif").read_bytes()
    (tmp_path / "cut.tif").write_bytes(data[:40])
    (tmp_path / "fake.tif").write_bytes(b"not a tiff at all")
    write_marccd(tmp_path / "x.mccd", _pixels(), MARCCD)
    (tmp_path / "cut.mccd").write_bytes((tmp_path / "x.mccd").read_bytes()[:3000])
    write_mar345(tmp_path / "x.mar2300", _pixels(shape=(40, 40), dtype=np.int32))
    # cut in the header (fabio decodes a packed stream cut short without a word: docs/formats.md)
    (tmp_path / "cut.mar2300").write_bytes((tmp_path / "x.mar2300").read_bytes()[:2000])
    for name in ("cut.tif", "fake.tif", "cut.mccd", "cut.mar2300"):
        with pytest.raises(InputError) as err:
            load_image(tmp_path / name)
        message = str(err.value)
        assert "\n" not in message and message.startswith(str(tmp_path / name)), message


def test_without_fabio_the_error_says_what_to_install(tmp_path, monkeypatch):
    write_tiff(tmp_path / "x.tif", _pixels())
    monkeypatch.setitem(sys.modules, "fabio", None)  # import fabio raises ImportError
    with pytest.raises(InputError, match=r"x.tif: reading TIFF images needs fabio: pip install 'nbtorch\[formats\]'"):
        load_image(tmp_path / "x.tif")


@pytest.mark.parametrize("name, fmt", [("x.tif", "tiff"), ("x.mccd", "marccd"), ("x.mar2300", "mar345"),
                                       ("p.tif", "tiff")])
@pytest.mark.parametrize("suffix, compress", [(".gz", "gzip"), (".bz2", "bz2"), ("", "bz2")])
def test_compressed_tiff_marccd_mar345(tmp_path, capfd, name, fmt, suffix, compress):
    """A file compressed as a whole (gzip, bzip2) is told by its decompressed first bytes and read through fabio
    from memory (fabio 2026.6 would print a debug line to stdout decompressing a TIFF itself)."""
    import bz2
    import gzip

    img = _pixels(shape=(40, 40), dtype=np.int32)
    plain = tmp_path / name
    if fmt == "tiff":
        write_tiff(plain, img, PILATUS_LINES if name.startswith("p") else None)
    elif fmt == "marccd":
        write_marccd(plain, img.astype(np.uint16), MARCCD)
    else:
        write_mar345(plain, img)
    packed = tmp_path / ("packed" + (name[1:] + suffix if suffix else ".dat"))  # no suffix: told by the bytes
    packed.write_bytes((gzip.compress if compress == "gzip" else bz2.compress)(plain.read_bytes()))
    capfd.readouterr()
    assert detect_format(packed) == fmt
    obs, ref = load_image(packed), load_image(plain)
    assert obs.format == ref.format == fmt
    np.testing.assert_array_equal(obs.image, ref.image)
    assert obs.geometry == ref.geometry
    assert model_config(f"-xds {CRYSTAL} -lambda 1 -distance 80 -pixel 0.2", obs)[2] == \
        model_config(f"-xds {CRYSTAL} -lambda 1 -distance 80 -pixel 0.2", ref)[2]
    assert capfd.readouterr().out == ""


def test_damaged_compressed_files_are_one_line_errors(tmp_path):
    import bz2
    import gzip

    write_tiff(tmp_path / "x.tif", _pixels())
    data = (tmp_path / "x.tif").read_bytes()
    (tmp_path / "cut.tif.gz").write_bytes(gzip.compress(data)[:12])
    (tmp_path / "bad.tif.bz2").write_bytes(b"BZh9" + b"\x00" * 64)
    (tmp_path / "text.tif.gz").write_bytes(gzip.compress(b"hello, not an image" * 10))
    from nbtorch.io import write_smv

    write_smv(tmp_path / "x.img", _pixels(), {"PIXEL_SIZE": 0.1})
    (tmp_path / "x.img.bz2").write_bytes(bz2.compress((tmp_path / "x.img").read_bytes()))
    for name, why in (("cut.tif.gz", "cannot decompress the gzip file"), ("bad.tif.bz2", "cannot decompress the bzip2"),
                      ("text.tif.gz", "the decompressed file is not a TIFF file"),
                      ("x.img.bz2", "a bzip2-compressed SMV file: decompress it first (bunzip2 -k)")):
        with pytest.raises(InputError) as err:
            load_image(tmp_path / name)
        message = str(err.value)
        assert "\n" not in message and message.startswith(str(tmp_path / name)) and why in message, message
