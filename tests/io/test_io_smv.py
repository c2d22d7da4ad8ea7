"""Tests for nbtorch.io.smv: SMV files and nanoBragg's int image, checked byte-for-byte against the C."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.smv import (
    format_smv_header,
    intfile_from_float,
    read_smv,
    roi_mask_from_bounds,
    smv_header_from_geometry,
    write_smv,
)

from golden import GOLDEN, needs_golden
INT_CASES = ["simple_cubic", "water_nonoise", "water_noise", "fluence", "flux"]


def _golden_float(case: str) -> np.ndarray:
    return np.fromfile(GOLDEN / case / "float.bin", dtype="<f4").reshape(256, 256)


def _arg(case: str, flag: str, default: float | None) -> float | None:
    args = shlex.split((GOLDEN / case / "args.txt").read_text())
    return float(args[args.index(flag) + 1]) if flag in args else default


def _c_geometry(wavelength_A: float) -> dict[str, str]:
    """The header values for a 256 x 0.1 mm MOSFLM detector at 100 mm, computed like the C (in metres)."""
    pixel = 0.0001
    detsize = 256 * pixel
    xbeam = ybeam = (detsize + pixel) / 2.0
    fbeam, sbeam = ybeam + 0.5 * pixel, xbeam + 0.5 * pixel
    distance = 0.1
    return smv_header_from_geometry(
        fpixels=256, spixels=256, pixel_mm=pixel * 1000.0, distance_mm=distance * 1000.0,
        wavelength_A=wavelength_A, beam_center_x_mm=xbeam * 1000.0, beam_center_y_mm=ybeam * 1000,
        adxv_x=fbeam * 1000.0, adxv_y=(detsize - sbeam) * 1000, mosflm_x=(sbeam - 0.5 * pixel) * 1000.0,
        mosflm_y=(fbeam - 0.5 * pixel) * 1000, denzo_x=sbeam * 1000.0, denzo_y=fbeam * 1000,
        dials_origin=(1000 * -fbeam, 1000 * sbeam, -1000 * distance), xds_orgx=fbeam / pixel + 0.5,
        xds_orgy=sbeam / pixel + 0.5, close_distance_mm=distance * 1000.0, phi_deg=0.0, osc_start_deg=0.0,
        osc_range_deg=0.0, twotheta_deg=0.0,
    )


@needs_golden
@pytest.mark.parametrize("case", ["simple_cubic", "water_nonoise", "fluence"])
def test_int_image_bit_exact_against_c(case: str, tmp_path: Path) -> None:
    golden = (GOLDEN / case / "int.img").read_bytes()
    scale = _arg(case, "-scale", None)
    adc = _arg(case, "-adc", 40.0)
    pixels, used = intfile_from_float(_golden_float(case), scale=scale, adc=adc)
    assert pixels.dtype == np.uint16
    assert np.array_equal(pixels, np.frombuffer(golden[512:], dtype="<u2").reshape(256, 256))
    if scale is not None:
        assert used == scale
    # header from the geometry, computed and formatted like the C: whole file byte-identical
    header = _c_geometry(_arg(case, "-lambda", 1.0))
    out = tmp_path / "int.img"
    write_smv(out, pixels, header)
    assert out.read_bytes() == golden


@needs_golden
@pytest.mark.parametrize("case", INT_CASES)
def test_read_and_rewrite_golden_smv_identically(case: str, tmp_path: Path) -> None:
    for name in ("int.img", "noise.img"):
        src = GOLDEN / case / name
        if not src.exists():
            continue
        image, header = read_smv(src)
        assert image.shape == (256, 256) and image.dtype == np.uint16
        assert header["SIZE1"] == "256" and header["DIALS_ORIGIN"] == "-12.9,12.9,-100"
        write_smv(tmp_path / name, image, header)
        assert (tmp_path / name).read_bytes() == src.read_bytes()


@needs_golden
def test_header_helper_matches_golden_text() -> None:
    header = format_smv_header(_c_geometry(6.2))
    assert header == (GOLDEN / "simple_cubic" / "int.img").read_bytes()[:512]
    assert b"DIALS_ORIGIN=-12.9,12.9,-100\nXDS_ORGX=129.5;" in header


def test_g_formatting_like_c() -> None:
    header = _c_geometry(1.0)
    assert header["BEAM_CENTER_X"] == "12.85"  # 12.850000000000001 with %g
    assert header["ADXV_CENTER_Y"] == "12.7"
    big = smv_header_from_geometry(**{**_kwargs(), "distance_mm": 1234567.0, "wavelength_A": 1e-7})
    assert big["DISTANCE"] == "1.23457e+06" and big["WAVELENGTH"] == "1e-07"


def _kwargs() -> dict:
    names = ["pixel_mm", "distance_mm", "wavelength_A", "beam_center_x_mm", "beam_center_y_mm", "adxv_x",
             "adxv_y", "mosflm_x", "mosflm_y", "denzo_x", "denzo_y", "xds_orgx", "xds_orgy",
             "close_distance_mm", "phi_deg", "osc_start_deg", "osc_range_deg", "twotheta_deg"]
    return {"fpixels": 4, "spixels": 3, "dials_origin": (0, 0, 0), **{n: 1.0 for n in names}}


@pytest.mark.parametrize("dtype,type_name", [("u2", "unsigned_short"), ("i4", "signed_int"),
                                             ("u4", "unsigned_int"), ("f4", "float")])
def test_roundtrip_types(tmp_path: Path, dtype: str, type_name: str) -> None:
    rng = np.random.default_rng(0)
    image = (rng.random((5, 7)) * 60000).astype(dtype)
    path = tmp_path / "x.img"
    write_smv(path, image, {"DISTANCE": 100.0, "BEAMLINE": "fake"})
    back, header = read_smv(path)
    assert header["TYPE"] == type_name and header["SIZE1"] == "7" and header["SIZE2"] == "5"
    assert header["DISTANCE"] == "100"
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, image)
    assert path.stat().st_size == 512 + image.nbytes


def test_encoding_keys_are_set_by_writer(tmp_path: Path) -> None:
    image = np.arange(6, dtype=np.uint16).reshape(2, 3)
    path = tmp_path / "x.img"
    write_smv(path, image, {"TYPE": "float", "BYTE_ORDER": "big_endian", "HEADER_BYTES": 1024, "PHI": 3.5})
    back, header = read_smv(path)
    assert header["TYPE"] == "unsigned_short" and header["BYTE_ORDER"] == "little_endian"
    assert header["HEADER_BYTES"] == "512" and header["PHI"] == "3.5"
    assert np.array_equal(back, image)


def test_read_big_endian(tmp_path: Path) -> None:
    image = np.arange(12, dtype=np.uint16).reshape(3, 4) * 300
    head = format_smv_header({"DIM": 2, "BYTE_ORDER": "big_endian", "TYPE": "unsigned_short",
                              "SIZE1": 4, "SIZE2": 3})
    path = tmp_path / "be.img"
    path.write_bytes(head + image.astype(">u2").tobytes())
    back, _ = read_smv(path)
    assert np.array_equal(back, image) and back.dtype.byteorder in ("=", "|")
    write_smv(tmp_path / "le.img", back, _)  # a big-endian header can be reused
    assert (tmp_path / "le.img").read_bytes()[512:] == image.astype("<u2").tobytes()


def _error(path: Path, *fragments: str) -> None:
    with pytest.raises(InputError) as info:
        read_smv(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for fragment in fragments:
        assert fragment in message, message


def test_read_errors(tmp_path: Path) -> None:
    _error(tmp_path / "none.img", "not found")
    good = tmp_path / "good.img"
    write_smv(good, np.zeros((4, 4), np.uint16))
    data = good.read_bytes()
    (tmp_path / "trunc.img").write_bytes(data[:-3])
    _error(tmp_path / "trunc.img", "truncated", "expected 32 bytes", "found 29")
    (tmp_path / "extra.img").write_bytes(data + b"xx")
    _error(tmp_path / "extra.img", "extra bytes")
    (tmp_path / "nohead.img").write_bytes(b"\x00" * 600)
    _error(tmp_path / "nohead.img", "not an SMV file")
    (tmp_path / "nosize.img").write_bytes(data.replace(b"SIZE1=4;", b"SIZEX=4;"))
    _error(tmp_path / "nosize.img", "no SIZE1")
    (tmp_path / "badsize.img").write_bytes(data.replace(b"SIZE2=4;", b"SIZE2=x;"))
    _error(tmp_path / "badsize.img", "SIZE2", "not an integer")
    (tmp_path / "type.img").write_bytes(data.replace(b"unsigned_short", b"complex_thing!"))
    _error(tmp_path / "type.img", "unsupported SMV TYPE")
    (tmp_path / "short.img").write_bytes(b"{\nHEADER_BYTES=512;\n")
    _error(tmp_path / "short.img", "HEADER_BYTES")
    (tmp_path / "open.img").write_bytes(data[:512].replace(b"}", b" ") + data[512:])
    _error(tmp_path / "open.img", "not closed")


def test_write_errors_leave_no_file(tmp_path: Path) -> None:
    image = np.zeros((3, 4), np.uint16)
    with pytest.raises(InputError, match="SIZE1"):
        write_smv(tmp_path / "a.img", image, {"SIZE1": 5})
    with pytest.raises(InputError, match="dtype"):
        write_smv(tmp_path / "d.img", image.astype(np.int64))
    with pytest.raises(InputError, match="2-D"):
        write_smv(tmp_path / "e.img", np.zeros(5, np.uint16))
    with pytest.raises(InputError, match="forbidden"):
        write_smv(tmp_path / "f.img", image, {"COMMENT": "a;b"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n_keys", [0, 10, 30, 60, 400])
def test_long_header_is_padded_to_a_multiple_of_512(tmp_path: Path, n_keys: int) -> None:
    image = (np.arange(12, dtype=np.uint16) * 1000).reshape(3, 4)
    extra = {f"KEY{i}": "x" * 20 for i in range(n_keys)}
    write_smv(tmp_path / "long.img", image, extra)
    data = (tmp_path / "long.img").read_bytes()
    text_end = data.index(b"}\f") + 2
    size = -(-text_end // 512) * 512
    assert data.startswith(b"{\nHEADER_BYTES=%d;\nDIM=2;\n" % size)
    assert len(data) == size + image.nbytes and data[text_end:size] == b" " * (size - text_end)
    assert (size == 512) == (n_keys <= 10)
    pixels, header = read_smv(tmp_path / "long.img")
    assert np.array_equal(pixels, image)
    assert header["HEADER_BYTES"] == str(size) and all(header[k] == v for k, v in extra.items())
    assert format_smv_header({**extra, "HEADER_BYTES": 99}).startswith(b"{\nHEADER_BYTES=%d;" % size)


def test_header_bytes_digits_are_counted() -> None:
    # around 10240 bytes the HEADER_BYTES line gains a digit, which may push the text past the size
    sizes = set()
    for filler in range(10180, 10260):
        head = format_smv_header({"DIM": "2", "A": "x" * filler})
        size = int(head[len(b"{\nHEADER_BYTES="):head.index(b";")])
        assert len(head) == size and size % 512 == 0 and head.index(b"}\f") + 2 <= size
        sizes.add(size)
    assert sizes == {10240, 10752}


def test_long_header_read_by_fabio(tmp_path: Path) -> None:
    fabio = pytest.importorskip("fabio")
    image = (np.arange(12, dtype=np.uint16) * 1000).reshape(3, 4)
    write_smv(tmp_path / "long.img", image, {f"KEY{i}": "x" * 20 for i in range(40)})
    assert np.array_equal(fabio.open(str(tmp_path / "long.img")).data, image)


def test_intfile_roi_clip_nan_and_scale() -> None:
    image = np.array([[0.0, 1.0, 2.0], [np.nan, -5.0, 1e9]], dtype=np.float32)
    mask = np.array([[True, True, False], [True, True, True]])
    pixels, used = intfile_from_float(image, scale=10.0, adc=40.0, roi_mask=mask)
    assert used == 10.0
    assert pixels.tolist() == [[40, 50, 0], [0, 0, 65535]]
    # automatic scale: 55000 / max over the ROI only
    pixels, used = intfile_from_float(np.array([[1.0, 100.0], [2.0, 3.0]]), roi_mask=np.array([[1, 0], [1, 1]]))
    assert used == 55000.0 / 3.0
    assert pixels[0, 1] == 0 and pixels[1, 1] == 55040
    # all-zero image: scale 1.0, pixels = adc
    pixels, used = intfile_from_float(np.zeros((2, 2)), adc=10.0)
    assert used == 1.0 and np.all(pixels == 10)
    # rounding half up through float32, as the C's floorf(test + 0.5)
    pixels, _ = intfile_from_float(np.array([[0.5, 1.49]]), scale=1.0, adc=0.0)
    assert pixels.tolist() == [[1, 1]]


def test_roi_mask_inclusive() -> None:
    mask = roi_mask_from_bounds((256, 256), 40, 200, 60, 180)
    assert mask.sum() == 161 * 121
    assert mask[60, 40] and mask[180, 200] and not mask[59, 40] and not mask[60, 201]
