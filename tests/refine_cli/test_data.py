"""refine.inputs.images.load_image: every format, its header geometry, and the masks."""

from __future__ import annotations

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io import write_cbf, write_h5, write_raw_float, write_smv
from nbtorch.io.images import detect_format
from refine.inputs.images import load_image, load_mask


def _image(shape=(6, 8), seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 100, size=shape).astype(np.int32)


CBF_HEADER = {"wavelength_A": 0.96859, "distance_mm": 351.0, "beam_x_px": 3.5, "beam_y_px": 2.25,
              "pixel_size_mm": 0.172, "count_cutoff": 1000}


@pytest.mark.parametrize("suffix", [".cbf", ".cbf.bz2", ".cbf.gz"])
def test_cbf_image_header_and_value_masks(tmp_path, suffix):
    img = _image()
    img[0, :] = -1  # module gap
    img[1, 1] = -2  # bad pixel
    img[2, 2] = 1000  # at the count cutoff: saturated
    path = tmp_path / f"x{suffix}"
    write_cbf(path, img, CBF_HEADER)
    m = load_image(path)
    assert m.format == "cbf"
    assert m.image.dtype == np.float64 and m.image.shape == (6, 8)
    np.testing.assert_array_equal(m.image, img)
    assert m.geometry == {"wavelength_A": 0.96859, "distance_mm": 351.0, "pixel_mm": 0.172, "beam_x_px": 3.5,
                          "beam_y_px": 2.25, "saturation": 1000.0}
    assert not m.mask[0].any() and not m.mask[1, 1] and not m.mask[2, 2]
    assert m.mask.sum() == 48 - 8 - 1 - 1
    assert m.masked == {"negative": 9, "saturated": 1}


def test_saturation_override(tmp_path):
    img = _image()
    write_cbf(tmp_path / "x.cbf", img, CBF_HEADER)
    m = load_image(tmp_path / "x.cbf", saturation=50)
    assert m.mask.sum() == (img < 50).sum()
    assert m.geometry["saturation"] == 50.0


def test_smv_written_by_nbtorch_header(tmp_path):
    img = _image().astype(np.uint16)
    img[3, 3] = 65535
    header = {"PIXEL_SIZE": 0.1, "DISTANCE": 100.0, "WAVELENGTH": 1.2, "DENZO_X_BEAM": 0.25, "DENZO_Y_BEAM": 0.45}
    write_smv(tmp_path / "x.img", img, header)
    m = load_image(tmp_path / "x.img")
    assert m.format == "smv"
    assert m.geometry["pixel_mm"] == 0.1 and m.geometry["distance_mm"] == 100.0 and m.geometry["wavelength_A"] == 1.2
    assert m.geometry["beam_x_px"] == pytest.approx(4.5) and m.geometry["beam_y_px"] == pytest.approx(2.5)
    assert m.geometry["saturation"] == 65535.0  # unsigned 16 bit
    assert not m.mask[3, 3] and m.mask.sum() == 47


def test_smv_adsc_beam_centre(tmp_path):
    """ADSC headers: BEAM_CENTER_X is along slow, BEAM_CENTER_Y along fast (as DIALS reads them)."""
    write_smv(tmp_path / "a.img", _image().astype(np.uint16),
              {"PIXEL_SIZE": 0.1, "BEAM_CENTER_X": 0.3, "BEAM_CENTER_Y": 0.5})
    g = load_image(tmp_path / "a.img").geometry
    assert g["beam_x_px"] == pytest.approx(5.0) and g["beam_y_px"] == pytest.approx(3.0)


def test_hdf5_frames_geometry_and_pixel_mask(tmp_path):
    import h5py

    stack = np.stack([_image(seed=s) for s in range(3)]).astype(np.float32)
    geo = {"distance_mm": 120.0, "beam_center_x_mm": 0.4, "beam_center_y_mm": 0.3, "pixel_size_mm": 0.1,
           "wavelength_A": 0.9}
    path = tmp_path / "x.nxs"
    write_h5(path, stack, geometry=geo)
    with h5py.File(path, "a") as f:  # NXmx extras a real file may carry
        det = f["/entry/instrument/detector"]
        det.create_dataset("saturation_value", data=90)
        pm = np.zeros((6, 8), dtype=np.uint32)
        pm[5, 7] = 1
        det.create_dataset("pixel_mask", data=pm)
    m = load_image(path, frame=2)
    assert m.format == "hdf5"
    np.testing.assert_array_equal(m.image, stack[2])
    assert m.geometry["distance_mm"] == 120.0 and m.geometry["wavelength_A"] == 0.9 and m.geometry["pixel_mm"] == 0.1
    assert m.geometry["beam_x_px"] == pytest.approx(4.0) and m.geometry["beam_y_px"] == pytest.approx(3.0)
    assert not m.mask[5, 7]
    assert m.mask.sum() == ((stack[2] < 90).sum() - (stack[2][5, 7] < 90))
    with pytest.raises(InputError, match="3 frames"):
        load_image(path)
    with pytest.raises(InputError, match="out of range"):
        load_image(path, frame=3)


def test_raw_needs_shape_and_checks_size(tmp_path):
    img = _image().astype(np.float32)
    write_raw_float(tmp_path / "x.bin", img)
    m = load_image(tmp_path / "x.bin", shape=(6, 8))
    assert m.format == "raw" and m.geometry == {}
    np.testing.assert_array_equal(m.image, img)
    with pytest.raises(InputError, match="shape"):
        load_image(tmp_path / "x.bin")
    with pytest.raises(InputError, match="expected 96 bytes"):
        load_image(tmp_path / "x.bin", shape=(6, 4))


def test_nan_is_an_error_unless_masked(tmp_path):
    img = _image().astype(np.float32)
    img[2, 3] = np.nan
    write_raw_float(tmp_path / "n.bin", img)
    with pytest.raises(InputError, match="1 NaN/Inf"):
        load_image(tmp_path / "n.bin", shape=(6, 8))
    m = load_image(tmp_path / "n.bin", shape=(6, 8), nonfinite="mask")
    assert not m.mask[2, 3] and m.mask.sum() == 47 and m.masked == {"nonfinite": 1}


def test_mask_file_nonzero_means_use(tmp_path):
    img = _image()
    write_cbf(tmp_path / "x.cbf", img, CBF_HEADER)
    keep = np.ones((6, 8), dtype=np.uint16)
    keep[:, :2] = 0
    write_smv(tmp_path / "mask.img", keep)
    m = load_image(tmp_path / "x.cbf", mask=tmp_path / "mask.img", saturation=10**6)
    assert not m.mask[:, :2].any() and m.mask[:, 2:].all()
    assert m.masked == {"mask_file": 12}
    np.testing.assert_array_equal(load_mask(tmp_path / "mask.img", (6, 8)), keep != 0)
    write_smv(tmp_path / "small.img", keep[:, :4])
    with pytest.raises(InputError, match="mask is 6 x 4"):
        load_image(tmp_path / "x.cbf", mask=tmp_path / "small.img")


def test_all_masked_and_missing_and_unknown(tmp_path):
    write_cbf(tmp_path / "gaps.cbf", -np.ones((4, 4), dtype=np.int32), CBF_HEADER)
    with pytest.raises(InputError, match="every pixel is masked"):
        load_image(tmp_path / "gaps.cbf")
    with pytest.raises(InputError, match="not found"):
        load_image(tmp_path / "nothing.cbf")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InputError, match="cannot tell the image format"):
        load_image(tmp_path / "notes.txt")


def test_detect_format_by_magic(tmp_path):
    img = _image()
    write_cbf(tmp_path / "a.cbf", img)
    (tmp_path / "a.cbf").rename(tmp_path / "a.dat")
    assert detect_format(tmp_path / "a.dat") == "cbf"
    write_h5(tmp_path / "b.h5", img)
    (tmp_path / "b.h5").rename(tmp_path / "b.dat")
    assert detect_format(tmp_path / "b.dat") == "hdf5"
    write_smv(tmp_path / "c.img", img.astype(np.uint16))
    (tmp_path / "c.img").rename(tmp_path / "c.dat")
    assert detect_format(tmp_path / "c.dat") == "smv"
