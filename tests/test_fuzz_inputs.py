"""Fuzz the file readers and the argument parsers with damaged real inputs (issue #20).

Every reader is given seeded random truncations, byte flips, byte insertions
and deletions of a small real input file; each parser gets random token lists
built from its own flags and awkward values.  The contract checked for every
case: the call either returns (a correct read, or a mutation that kept the
meaning) or raises :class:`nbtorch.errors.InputError` whose message is one
line -- never another exception type (IndexError, struct.error,
UnicodeDecodeError, OverflowError, KeyError, ...) and never a hang (each case
runs under a wall-clock alarm).

The mutations are deterministic (fixed seeds).  ``NBTORCH_FUZZ_N`` scales the
number of mutants per input (default 5, which keeps the file at a few seconds
of the default suite); ``NBTORCH_FUZZ_SEED`` changes the seed for exploratory
runs, e.g. ``NBTORCH_FUZZ_N=20 NBTORCH_FUZZ_SEED=7 pytest tests/test_fuzz_inputs.py``.
Cases the fuzzer once found are kept as regressions at the end of the file.
"""

from __future__ import annotations

import bz2
import contextlib
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from golden import GOLDEN
from nbtorch.errors import InputError

SCALE = max(1, int(os.environ.get("NBTORCH_FUZZ_N", "5")))
SEED = int(os.environ.get("NBTORCH_FUZZ_SEED", "20"))
CASE_SECONDS = 5.0  # one read or parse taking longer than this counts as a hang
REAL_CBF = GOLDEN.parent / "real" / "thaumatin_i24_still" / "thau_3_2_0003.cbf.bz2"

# bytes a mutation likes to insert: digits, signs, separators, NUL, non-UTF-8, line ends
_INTERESTING = b"0123456789-+.eE#;:=, \t\n\r\x00\x80\xff\x0c\x1a{}[]\"'nN"


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise :class:`_Hang` if the block runs longer than ``seconds`` (POSIX main thread only)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def _alarm(signum, frame):
        raise _Hang(f"no answer within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _outcome(call, *args, **kwargs) -> str | None:
    """None if ``call`` returned or raised a one-line InputError; otherwise what went wrong."""
    start = time.perf_counter()
    try:
        with _time_limit(CASE_SECONDS):
            call(*args, **kwargs)
    except InputError as exc:
        message = str(exc)
        if not message or "\n" in message or "\r" in message:
            return f"InputError without a one-line message: {message!r}"
        return None
    except _Hang as exc:
        return f"hang: {exc}"
    except Exception as exc:  # noqa: BLE001 - the point of the test
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    if time.perf_counter() - start > CASE_SECONDS:
        return "too slow"
    return None


def _mutants(data: bytes, rng: random.Random, n: int, head: int = 0) -> list[tuple[str, bytes]]:
    """``n`` damaged copies of ``data``: truncations, flips, insertions, deletions.

    ``head`` > 0 sends half of the positions into the first ``head`` bytes (a
    binary file's header, where most of the parsing happens).
    """
    out: list[tuple[str, bytes]] = []
    size = len(data)

    def pos(extra: int = 0) -> int:
        if head and rng.random() < 0.5:
            return rng.randrange(min(head, size) + extra)
        return rng.randrange(size + extra)

    def byte() -> int:
        return rng.choice(_INTERESTING) if rng.random() < 0.6 else rng.randrange(256)

    for _ in range(n):
        kind = rng.choice(("truncate", "flip", "flip", "insert", "delete"))
        if kind == "truncate":
            at = pos()
            out.append((f"truncated at {at}", data[:at]))
        elif kind == "flip":
            buf = bytearray(data)
            where = sorted({pos() for _ in range(rng.randint(1, 3))})
            for at in where:
                buf[at] = byte() if rng.random() < 0.5 else buf[at] ^ (1 << rng.randrange(8))
            out.append((f"bytes changed at {where}", bytes(buf)))
        elif kind == "insert":
            at = pos(1)
            ins = bytes(byte() for _ in range(rng.randint(1, 4)))
            out.append((f"{ins!r} inserted at {at}", data[:at] + ins + data[at:]))
        else:
            at = pos()
            k = rng.randint(1, 8)
            out.append((f"{k} bytes deleted at {at}", data[:at] + data[at + k:]))
    return out


def _fuzz_file(tmp_path: Path, name: str, data: bytes, reader, n: int, seed_offset: int, head: int = 0) -> None:
    """Write each mutant of ``data`` to ``tmp_path/name`` and read it with ``reader(path)``."""
    rng = random.Random(SEED * 1000 + seed_offset)
    path = tmp_path / name
    problems = []
    assert _outcome(reader, _write(path, data)) is None, "the undamaged input must read"
    for what, mutant in _mutants(data, rng, n * SCALE, head):
        problem = _outcome(reader, _write(path, mutant))
        if problem:
            problems.append(f"{name} {what}: {problem}")
    assert not problems, f"{len(problems)} bad outcomes:\n" + "\n".join(problems[:20])


def _write(path: Path, data: bytes) -> Path:
    path.unlink(missing_ok=True)  # a fresh file: rewriting one in place is slow on some file systems
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------------------ inputs


def _hkl_text() -> bytes:
    lines = (GOLDEN / "hkl_file" / "P1.hkl").read_bytes().splitlines(keepends=True)
    return b"".join(lines[:40])


def _smv_bytes(tmp_path: Path) -> bytes:
    from nbtorch.io.smv import smv_header_from_geometry, write_smv

    header = smv_header_from_geometry(
        fpixels=32, spixels=32, pixel_mm=0.1, distance_mm=100.0, wavelength_A=1.0, beam_center_x_mm=1.6,
        beam_center_y_mm=1.6, adxv_x=1.6, adxv_y=1.6, mosflm_x=1.6, mosflm_y=1.6, denzo_x=1.6, denzo_y=1.6,
        dials_origin=(-1.6, 1.6, -100.0), xds_orgx=16.0, xds_orgy=16.0, close_distance_mm=100.0, phi_deg=0.0,
        osc_start_deg=0.0, osc_range_deg=0.0, twotheta_deg=0.0)
    image = (np.arange(32 * 32).reshape(32, 32) % 500).astype(np.uint16)
    path = tmp_path / "src.img"
    write_smv(path, image, header)
    return path.read_bytes()


def _cbf_bytes(tmp_path: Path, md5: bool = True) -> bytes:
    from nbtorch.io.cbf import write_cbf

    rng = np.random.default_rng(3)
    image = rng.poisson(3.0, size=(24, 20)).astype(np.int32)
    image[5, 7] = 40000  # a 2-byte escape
    image[6, 8] = 3_000_000  # a 4-byte escape
    image[0, :4] = -1
    header = {"wavelength_A": 0.96859, "distance_mm": 351.0, "beam_x_px": 10.5, "beam_y_px": 12.25,
              "pixel_size_mm": 0.172, "count_cutoff": 1048576, "exposure_time_s": 0.04, "start_angle_deg": 0.0,
              "angle_increment_deg": 0.0, "sensor_thickness_mm": 0.45}
    path = tmp_path / "src.cbf"
    write_cbf(path, image, header)
    data = path.read_bytes()
    if not md5:
        start = data.index(b"Content-MD5:")
        data = data[:start] + data[data.index(b"\r\n", start) + 2:]
    return data


def _h5_bytes(tmp_path: Path) -> bytes:
    from nbtorch.io.hdf5 import write_h5

    path = tmp_path / "src.h5"
    image = (np.arange(16 * 16).reshape(16, 16) % 50).astype(np.float32)
    write_h5(path, image, attrs={"program": "fuzz"},
             geometry={"wavelength_A": 1.0, "distance_mm": 100.0, "pixel_size_mm": 0.1, "beam_center_x_mm": 0.8,
                       "beam_center_y_mm": 0.8})
    return path.read_bytes()


# ------------------------------------------------------------------------------ file readers


def test_fuzz_hkl(tmp_path):
    from nbtorch.io.hkl import read_hkl

    _fuzz_file(tmp_path, "P1.hkl", _hkl_text(), read_hkl, 60, 1)


def test_fuzz_fdump(tmp_path):
    from nbtorch.io.hkl import read_fdump, write_fdump

    src = tmp_path / "src.bin"
    write_fdump(src, np.arange(27, dtype=float).reshape(3, 3, 3), (-1, -1, -1))
    _fuzz_file(tmp_path, "Fdump.bin", src.read_bytes(), read_fdump, 40, 2, head=24)


def test_fuzz_matrix(tmp_path):
    from nbtorch.io.matrix import read_mosflm_matrix

    _fuzz_file(tmp_path, "A.mat", (GOLDEN / "mat_file" / "A.mat").read_bytes(), read_mosflm_matrix, 60, 3)


def test_fuzz_sourcefile(tmp_path):
    from nbtorch.io.sources import read_sourcefile

    _fuzz_file(tmp_path, "sources.txt", (GOLDEN / "sourcefile" / "sources.txt").read_bytes(), read_sourcefile, 60, 4)


def test_fuzz_spot_list(tmp_path):
    from refine.inputs.spots import read_spot_list

    data = b"# x y intensity\n10.5 12.25 300\n 3.0\t4.0\n\n17.75 1.5 20 # strong\n"
    _fuzz_file(tmp_path, "spots.txt", data, read_spot_list, 60, 5)


def test_fuzz_smv(tmp_path):
    from nbtorch.io.smv import read_smv
    from refine.inputs.images import load_image

    data = _smv_bytes(tmp_path)
    _fuzz_file(tmp_path, "image.img", data, read_smv, 50, 6, head=512)
    _fuzz_file(tmp_path, "image.img", data, load_image, 50, 7, head=512)


def test_fuzz_cbf(tmp_path):
    from nbtorch.io.cbf import read_cbf
    from refine.inputs.images import load_image

    data = _cbf_bytes(tmp_path)
    head = data.index(b"\x0c\x1a\x04\xd5")
    _fuzz_file(tmp_path, "image.cbf", data, read_cbf, 40, 8, head=head)
    # without Content-MD5 the damage reaches the byte-offset decoder
    bare = _cbf_bytes(tmp_path, md5=False)
    _fuzz_file(tmp_path, "image.cbf", bare, load_image, 40, 9, head=head)
    _fuzz_file(tmp_path, "image.cbf.bz2", bz2.compress(bare), read_cbf, 20, 10)


def test_fuzz_byte_offset_decoder():
    from nbtorch.io.cbf import decode_byte_offset

    rng = random.Random(SEED * 1000 + 11)
    problems = []
    for i in range(200 * SCALE):
        n = rng.randint(0, 40)
        data = bytes(rng.choice(b"\x80\x00\x7f\x01\xff") if rng.random() < 0.5 else rng.randrange(256)
                     for _ in range(rng.randint(0, 60)))
        problem = _outcome(decode_byte_offset, data, n, "x.cbf")
        if problem:
            problems.append(f"{data!r} n={n}: {problem}")
    assert not problems, "\n".join(problems[:20])


@pytest.mark.skipif(not REAL_CBF.exists(), reason=f"{REAL_CBF} not found")
def test_fuzz_real_cbf_header(tmp_path):
    """The real Pilatus header (text before the binary marker) with a small damaged payload."""
    from nbtorch.io.cbf import read_cbf

    with bz2.open(REAL_CBF) as fh:
        start = fh.read(16384)
    head = start.index(b"\x0c\x1a\x04\xd5") + 4
    data = start[:head] + bytes(200)  # far fewer bytes than X-Binary-Size: a truncated file
    _fuzz_file(tmp_path, "thau.cbf", data, read_cbf, 40, 12, head=head)


def test_fuzz_hdf5(tmp_path):
    pytest.importorskip("h5py")
    from refine.inputs.images import load_image

    data = _h5_bytes(tmp_path)
    _fuzz_file(tmp_path, "image.h5", data, load_image, 40, 13, head=2048)


def test_fuzz_pgm(tmp_path):
    from nbtorch.io.pgm import read_pgm, write_pgm

    src = tmp_path / "src.pgm"
    write_pgm(src, np.arange(64, dtype=float).reshape(8, 8), scale=1.0)
    _fuzz_file(tmp_path, "image.pgm", src.read_bytes(), read_pgm, 40, 14, head=20)


def test_fuzz_raw(tmp_path):
    from refine.inputs.images import load_image

    src = tmp_path / "src.bin"
    np.arange(64, dtype="<f4").tofile(src)
    _fuzz_file(tmp_path, "image.bin", src.read_bytes(), lambda p: load_image(p, shape=(8, 8)), 30, 15)


DATA = Path(__file__).parent / "data" / "structure_factors"


@pytest.mark.parametrize("name, head", [("5e5z.mtz", 400), ("4aap-sf-subset.cif", 0)])
def test_fuzz_reflection_files(tmp_path, name, head):
    pytest.importorskip("gemmi")
    from nbtorch.io.reflections import read_reflection_file

    data = (DATA / name).read_bytes()
    if name.endswith(".mtz"):  # the header and history sit at the end of an MTZ file
        head = 0
    _fuzz_file(tmp_path, name, data, read_reflection_file, 12, 19, head=head)


def test_fuzz_checkpoint(tmp_path):
    """A damaged refinement checkpoint (the file --resume reads)."""
    pytest.importorskip("h5py")
    from refine.solver.checkpoint import read_checkpoint

    src = _checkpoint(tmp_path)
    _fuzz_file(tmp_path, "run.ckpt.h5", src.read_bytes(), read_checkpoint, 12, 20, head=2048)


# ------------------------------------------------------------------------------ config files and parsers

REFINE_TOML = b"""# nbtorch-refine options
image = "image.cbf"
model = "-cell 58 58 151 90 90 90 -N 10 -default_F 100"
refine = ["orientation", "cell"]
fix = "distance"
max_steps = 20
lr = 0.5
roi = [0, 31, 0, 31]
shape = [32, 32]
mask_nan = true
start = { beam_x = 10.5, distance = 100 }

[[stages]]
name = "coarse"
free = ["orientation"]
max_steps = 5
"""


def test_fuzz_refine_config(tmp_path):
    from refine.cli.parser import parse_args

    _fuzz_file(tmp_path, "refine.toml", REFINE_TOML, lambda p: parse_args(["--config", str(p)]), 60, 16)


def _random_tokens(rng: random.Random, flags: list[str], values: list[str]) -> list[str]:
    tokens: list[str] = []
    for _ in range(rng.randint(0, 6)):
        r = rng.random()
        if r < 0.7:
            tokens.append(rng.choice(flags))
        elif r < 0.8:
            tokens.append(rng.choice(("-", "--", "-x", "--bogus", "stray", "")))
        for _ in range(rng.choice((0, 1, 1, 2, 3, 4, 6))):
            tokens.append(rng.choice(values))
    return tokens


_VALUES = ["0", "1", "-1", "2", "3", "16", "100", "0.5", "-0.0", "1e308", "1e999", "-1e999", "nan", "inf", "-inf",
           "1e-320", "99999999999999999999", "abc", "", " ", "1,2", "x=1", "beam", "sample", "random", "spec",
           "c-parity", "\u00e9", "--", "-", "@", "1:2", "cuda", "stage_a", "orientation", "mosflm"]


def test_fuzz_nbtorch_arguments(tmp_path, monkeypatch):
    """Random nanoBragg flag lists: parse (config_from_args) and resolve the geometry (setup.resolve)."""
    from nbtorch.cli.args import config_from_args, flag_names
    from nbtorch.rules.resolve import resolve

    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "P1.hkl", _hkl_text())
    _write(tmp_path / "A.mat", (GOLDEN / "mat_file" / "A.mat").read_bytes())
    _write(tmp_path / "sources.txt", (GOLDEN / "sourcefile" / "sources.txt").read_bytes())
    _write(tmp_path / "x.img", _smv_bytes(tmp_path))
    flags = flag_names()
    values = _VALUES + ["P1.hkl", "A.mat", "sources.txt", "x.img", "missing.hkl", "."]
    base = "-cell 70 80 90 75 85 95 -N 2 -lambda 1 -distance 100 -detpixels 16 -pixel 0.1 -default_F 10".split()
    rng = random.Random(SEED * 1000 + 17)
    problems = []

    def parse_and_resolve(argv):
        resolve(config_from_args(argv))

    for _ in range(300 * SCALE):
        argv = _random_tokens(rng, flags, values)
        if rng.random() < 0.7:
            argv = base + argv
        problem = _outcome(parse_and_resolve, argv)
        if problem:
            problems.append(f"{argv}: {problem}")
    assert not problems, f"{len(problems)} bad outcomes:\n" + "\n".join(problems[:20])


def test_fuzz_refine_arguments(tmp_path, monkeypatch):
    """Random nbtorch-refine option lists through refine.cli.parser.parse_args."""
    from refine.cli.parser import build_parser, parse_args

    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "refine.toml", REFINE_TOML)
    _write(tmp_path / "bad.toml", b"lr = [\n")
    flags = [f for a in build_parser()._actions for f in a.option_strings if f not in ("-h", "--help")]
    values = _VALUES + ["refine.toml", "bad.toml", "missing.toml", "lbfgs", "adam", "planar", "full", "none",
                        "distance=1", "beam_x=1:2", "float32", "find"]
    rng = random.Random(SEED * 1000 + 18)
    problems = []
    for _ in range(300 * SCALE):
        argv = _random_tokens(rng, flags, values)
        problem = _outcome(parse_args, argv)
        if problem:
            problems.append(f"{argv}: {problem}")
    assert not problems, f"{len(problems)} bad outcomes:\n" + "\n".join(problems[:20])


# ------------------------------------------------------------------------------ regressions found by the fuzzer


def test_cbf_header_number_overflowing_to_infinity_is_skipped_with_a_warning(tmp_path, caplog):
    """``# Count_cutoff 1e999 counts`` once raised OverflowError (int(inf)); now the line is skipped, as any
    other unparseable header line is, with a warning naming the file."""
    from nbtorch.io.cbf import read_cbf

    data = _cbf_bytes(tmp_path).replace(b"# Count_cutoff 1048576", b"# Count_cutoff 1e999")
    data = data.replace(b"# Wavelength 0.96859", b"# Wavelength 1e999")
    data = data.replace(b"# Beam_xy (10.5, 12.25)", b"# Beam_xy (1e999, 12.25)")
    path = _write(tmp_path / "inf.cbf", data)
    with caplog.at_level("WARNING"):
        image, header = read_cbf(path)
    assert image.shape == (24, 20)
    assert "count_cutoff" not in header and "wavelength_A" not in header and "beam_x_px" not in header
    assert header["distance_mm"] == 351.0
    assert "inf.cbf: cannot parse header line" in caplog.text


@pytest.mark.parametrize("signature", [b"SNOD", b"TREE", b"HEAP"])
def test_hdf5_damaged_inside_is_a_one_line_input_error(tmp_path, signature):
    """A damaged B-tree, symbol-table node or local heap once escaped as RuntimeError or KeyError from
    libhdf5 (after the file opened); now every such read is a one-line InputError naming the file."""
    pytest.importorskip("h5py")
    from nbtorch.io.hdf5 import read_h5_image
    from refine.inputs.images import load_image

    data = _h5_bytes(tmp_path)
    starts = [i for i in range(len(data)) if data.startswith(signature, i)]
    assert starts
    messages = set()
    for start in starts:
        path = _write(tmp_path / "damaged.h5", data[:start] + b"XXXX" + data[start + 4:])
        for reader in (read_h5_image, load_image):
            try:
                reader(path)
            except InputError as exc:
                assert "\n" not in str(exc) and str(path) in str(exc)
                messages.add(str(exc).split(": ", 1)[1])
    assert messages  # at least one of the damaged copies is refused


def test_mtz_with_an_undecodable_column_label_is_a_one_line_input_error(tmp_path):
    """A damaged byte in an MTZ column label once escaped as UnicodeDecodeError."""
    pytest.importorskip("gemmi")
    from nbtorch.io.reflections import read_reflection_file

    data = (DATA / "5e5z.mtz").read_bytes()
    at = data.index(b"COLUMN ") + len(b"COLUMN ")
    path = _write(tmp_path / "label.mtz", data[:at] + b"\x98" + data[at + 1:])
    with pytest.raises(InputError, match=r"label.mtz: damaged structure-factor file \(UnicodeDecodeError: "):
        read_reflection_file(path)


def _checkpoint(tmp_path: Path) -> Path:
    import torch

    from refine.solver.checkpoint import RunCheckpoint, write_checkpoint

    ckpt = RunCheckpoint(stage_index=1, stage_values={"distance": 100.0}, history={"step": [0, 1], "loss": [2.0, 1.0]},
                         loop={"step": 3, "raw": torch.tensor([0.5, -0.25], dtype=torch.float64)}, summaries=[],
                         initial_values={"distance": 100.0}, loss_initial=2.0, elapsed_s=1.5,
                         fingerprint={"image": "x.cbf"}, names=["beam_x", "beam_y"])
    return write_checkpoint(tmp_path / "src.ckpt.h5", ckpt)


def test_checkpoint_with_damaged_state_is_a_one_line_input_error(tmp_path):
    """Damaged bytes of the saved state once escaped from torch.load as RuntimeError; a checkpoint without
    its state dataset as KeyError."""
    h5py = pytest.importorskip("h5py")
    from refine.solver.checkpoint import read_checkpoint

    data = _checkpoint(tmp_path).read_bytes()
    name = b"archive/.storage_alignmentPK"  # a name in the zip's central directory
    path = _write(tmp_path / "run.ckpt.h5", data.replace(name, b"archiwe" + name[7:]))
    with pytest.raises(InputError, match=r"run.ckpt.h5: damaged checkpoint state \(RuntimeError: .*delete it"):
        read_checkpoint(path)
    with h5py.File(path, "a") as h5:
        del h5["state"]
    with pytest.raises(InputError, match=r"run.ckpt.h5: cannot read checkpoint: .*state"):
        read_checkpoint(path)


def test_mtz_with_non_integer_miller_indices_is_a_one_line_input_error(tmp_path):
    """A damaged H column (NaN) once escaped as a RuntimeWarning from the integer cast."""
    gemmi = pytest.importorskip("gemmi")
    from nbtorch.io.reflections import read_reflection_file

    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup("P 1")
    mtz.set_cell_for_all(gemmi.UnitCell(50, 60, 70, 90, 90, 90))
    mtz.add_dataset("test")
    mtz.add_column("FP", "F")
    mtz.set_data(np.array([[1, 2, 3, 10.0], [np.nan, 0, 1, 5.0]], dtype=np.float32))
    mtz.write_to_file(str(tmp_path / "nan_h.mtz"))
    with pytest.raises(InputError, match=r"nan_h.mtz: damaged structure-factor file \(Miller indices H K L"):
        read_reflection_file(tmp_path / "nan_h.mtz")
