"""Tests for nbtorch.io.cbf: Pilatus mini-CBF with byte-offset compression."""

from __future__ import annotations

import bz2
import sys
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.cbf import decode_byte_offset, encode_byte_offset, read_cbf, write_cbf

REAL = Path(__file__).resolve().parents[2].parent / "shared" / "real" / "thaumatin_i24_still"
THAU = REAL / "thau_3_2_0003.cbf.bz2"
needs_real = pytest.mark.skipif(not THAU.is_file(), reason=f"real Pilatus image not found at {THAU}")


def _reference_decode(data: bytes, n: int) -> list[int]:
    """Straightforward sequential byte-offset decoder, as an independent check."""
    out, value, pos = [], 0, 0
    while len(out) < n:
        delta = int.from_bytes(data[pos:pos + 1], "little", signed=True)
        pos += 1
        if delta == -128:
            delta = int.from_bytes(data[pos:pos + 2], "little", signed=True)
            pos += 2
            if delta == -32768:
                delta = int.from_bytes(data[pos:pos + 4], "little", signed=True)
                pos += 4
                if delta == -(2**31):
                    delta = int.from_bytes(data[pos:pos + 8], "little", signed=True)
                    pos += 8
        value += delta
        out.append(value)
    return out


@needs_real
def test_real_thaumatin_image() -> None:
    image, header = read_cbf(THAU)
    assert image.shape == (2527, 2463) and image.dtype == np.int32
    assert int(np.count_nonzero(image == -1)) == 526101
    assert int(np.count_nonzero(image == -2)) == 625
    assert int(image.max()) == 1046527
    assert header["wavelength_A"] == 0.96859
    assert header["distance_mm"] == 351.0
    assert (header["beam_x_px"], header["beam_y_px"]) == (1261.61, 1306.96)
    assert header["pixel_size_mm"] == 0.172 and header["pixel_size_slow_mm"] == 0.172
    assert header["count_cutoff"] == 115897
    assert header["polarization"] == 0.99 and header["exposure_time_s"] == 0.019
    assert header["angle_increment_deg"] == 0.0 and header["sensor_thickness_mm"] == 0.45
    assert header["detector"].startswith("PILATUS3 6M")
    assert header["binary"]["X-Binary-Number-of-Elements"] == "6224001"



@needs_real
def test_real_header_can_be_written_back(tmp_path: Path) -> None:
    _, header = read_cbf(THAU)
    write_cbf(tmp_path / "small.cbf", np.zeros((4, 5), np.int32), header)
    _, back = read_cbf(tmp_path / "small.cbf")
    for key, value in header.items():
        if key not in ("pilatus", "binary"):
            assert back[key] == value, key


@needs_real
def test_real_image_decodes_in_whole_array_steps() -> None:
    data = bz2.decompress(THAU.read_bytes())
    start = data.index(b"\x0c\x1a\x04\xd5") + 4
    payload = data[start:start + 6226539]
    events = [0]

    def count(frame, event, arg):  # every Python and C call the decode makes
        events[0] += 1

    sys.setprofile(count)
    try:
        values = decode_byte_offset(payload, 6224001)
    finally:
        sys.setprofile(None)
    assert values.size == 6224001
    # whole-array numpy steps: a few hundred calls (a loop over the pointer-doubling steps, log2 of the escapes);
    # a per-value or per-escape Python loop would make millions
    assert events[0] < 5_000, f"byte-offset decode made {events[0]} calls (vectorisation lost?)"
    # spot-check the start against a sequential decode of the first bytes
    assert values[:5000].tolist() == _reference_decode(payload, 5000)


def test_codec_against_reference_on_hostile_data() -> None:
    rng = np.random.default_rng(7)
    edges = [0, 127, -127, 128, -128, 32767, -32767, 32768, -32768, 2**31 - 1, -(2**31), 0x80, 0x8080, -32640]
    values = np.concatenate([
        np.array(edges, dtype=np.int64),
        rng.integers(-(2**31), 2**31, 300),  # big jumps: int32 and int64 escapes
        rng.integers(-200, 200, 300),
        np.cumsum(rng.choice([128, -32640, 0x8080, 0x80, -128, 1], 300)),  # payload bytes equal to 0x80
    ])
    values = np.clip(values, -(2**31), 2**31 - 1)
    encoded = encode_byte_offset(values)
    assert _reference_decode(encoded, values.size) == values.tolist()
    assert np.array_equal(decode_byte_offset(encoded, values.size), values)


@pytest.mark.parametrize("suffix", [".cbf", ".cbf.bz2", ".cbf.gz"])
def test_roundtrip_random_int32(tmp_path: Path, suffix: str) -> None:
    rng = np.random.default_rng(11)
    image = rng.integers(-5, 50, size=(37, 53)).astype(np.int32)
    image[3, 4] = 2**31 - 1
    image[3, 5] = -(2**31)  # a jump of 2**32 - 1 needs the 64-bit escape
    image[10] = rng.integers(-(2**31), 2**31 - 1, 53)
    header = {"wavelength_A": 0.96859, "distance_mm": 351.0, "beam_x_px": 12.5, "beam_y_px": 20.25,
              "pixel_size_mm": 0.172, "count_cutoff": 115897, "exposure_time_s": 0.019}
    path = tmp_path / f"img{suffix}"
    write_cbf(path, image, header)
    back, read_header = read_cbf(path)
    assert back.dtype == np.int32 and np.array_equal(back, image)
    for key, value in header.items():
        assert read_header[key] == pytest.approx(value, rel=1e-12)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _error(path: Path, *fragments: str) -> None:
    with pytest.raises(InputError) as info:
        read_cbf(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_read_errors(tmp_path: Path) -> None:
    _error(tmp_path / "none.cbf", "not found")
    (tmp_path / "text.cbf").write_text("hello\n")
    _error(tmp_path / "text.cbf", "not a CBF file")
    good = tmp_path / "good.cbf"
    write_cbf(good, np.arange(100, dtype=np.int32).reshape(10, 10) * 1000)
    data = good.read_bytes()
    start = data.index(b"\x0c\x1a\x04\xd5") + 4
    (tmp_path / "trunc.cbf").write_bytes(data[:start + 20])
    _error(tmp_path / "trunc.cbf", "truncated")
    flipped = bytearray(data)
    flipped[start + 5] ^= 0x01
    (tmp_path / "md5.cbf").write_bytes(bytes(flipped))
    _error(tmp_path / "md5.cbf", "Content-MD5")
    (tmp_path / "packed.cbf").write_bytes(data.replace(b"x-CBF_BYTE_OFFSET", b"x-CBF_PACKED_V2__"))
    _error(tmp_path / "packed.cbf", "CBF")  # CBFlib (child process): "CBFlib cannot decode", or "needs ... pycbf"
    (tmp_path / "dims.cbf").write_bytes(data.replace(b"Fastest-Dimension: 10", b"Fastest-Dimension: 11"))
    _error(tmp_path / "dims.cbf", "do not match")
    (tmp_path / "nodim.cbf").write_bytes(data.replace(b"X-Binary-Size-Second-Dimension", b"X-Other"))
    _error(tmp_path / "nodim.cbf", "X-Binary-Size-Second-Dimension")
    (tmp_path / "bad.cbf.bz2").write_bytes(b"BZh91AY&SYgarbage")
    _error(tmp_path / "bad.cbf.bz2", "corrupt compressed")


def test_too_few_values_in_stream() -> None:
    encoded = encode_byte_offset(np.arange(10))
    with pytest.raises(InputError, match="hold 10 values, expected 11"):
        decode_byte_offset(encoded, 11, "x.cbf")
    with pytest.raises(InputError, match="truncated"):
        decode_byte_offset(encode_byte_offset(np.array([0, 2**40]))[:-3], 2, "x.cbf")


def test_write_errors_leave_nothing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="integer"):
        write_cbf(tmp_path / "a.cbf", np.zeros((3, 3), dtype=np.float32))
    with pytest.raises(InputError, match="32-bit"):
        write_cbf(tmp_path / "b.cbf", np.full((3, 3), 2**40))
    with pytest.raises(InputError, match="unknown CBF header field"):
        write_cbf(tmp_path / "c.cbf", np.zeros((3, 3), np.int32), {"colour": 3})
    with pytest.raises(InputError, match="beam_y_px"):
        write_cbf(tmp_path / "d.cbf", np.zeros((3, 3), np.int32), {"beam_x_px": 3.0})
    assert list(tmp_path.iterdir()) == []


def test_packed_mini_cbf_is_decoded_by_cbflib(tmp_path: Path) -> None:
    """A Pilatus mini-CBF that CBFlib rewrote in its packed compression reads as the same image and header."""
    pytest.importorskip("pycbf")
    from cbflib_files import cbflib_copy

    image = (np.arange(30 * 20).reshape(30, 20) % 97 * 50 - 3).astype(np.int32)
    source = tmp_path / "byte_offset.cbf"
    write_cbf(source, image, {"wavelength_A": 0.9795, "distance_mm": 351.0, "pixel_size_mm": 0.172,
                              "beam_x_px": 10.5, "beam_y_px": 15.2})
    packed = cbflib_copy(source, tmp_path / "packed.cbf", "CBF_PACKED_V2")
    got, header = read_cbf(packed)
    assert got.dtype == np.int32 and np.array_equal(got, image)
    assert (header["wavelength_A"], header["distance_mm"], header["beam_x_px"]) == (0.9795, 351.0, 10.5)
