"""Command outputs: SMV/PGM/HDF5 round trips, the C's header and statistics, noise, printout, progress, -dump."""

from __future__ import annotations

import math
import os
import re
import sys

import numpy as np
import pytest

from golden import GOLDEN, golden_args, golden_cases
from nbtorch import Simulator, config_from_args
from nbtorch.cli import main as cli
from nbtorch.cli.main import main
from nbtorch.io import read_fdump, read_h5_image, read_pgm, read_raw_float, read_smv, write_hkl, HKLTable

SMALL = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1 -distance 100 -detpixels 48 -pixel 0.1 "
         "-default_F 100 -noprogress").split()



def _stdout_lines(text: str, prefixes=("solid angle", "max_I", "mean=", "intfile_scale", "photons on noise")):
    return [line for line in text.splitlines() if line.startswith(prefixes) or "photons on noise" in line]


# --- round trips through the project's readers -------------------------------------------------
def test_outputs_round_trip(workdir, capsys):
    argv = SMALL + ["-c_parity", "-seed", "7", "-floatfile", "f.bin", "-intfile", "i.img", "-noisefile", "n.img",
                    "-pgmfile", "p.pgm", "-h5file", "o.h5", "-scale", "3", "-adc", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    img = read_raw_float("f.bin", (48, 48)).astype(np.float64)
    assert img.max() > 0

    intimg, head = read_smv("i.img")
    expect = np.floor(np.clip(img * 3 + 20, 0, 65535) + 0.5)
    np.testing.assert_array_equal(intimg, expect.astype(np.uint16))
    assert head["SIZE1"] == "48" and head["SIZE2"] == "48" and head["PIXEL_SIZE"] == "0.1"
    assert "intfile_scale = 3" in out

    noise, nhead = read_smv("n.img")
    assert nhead == head  # same header keys and values as the int image
    assert noise.dtype == np.uint16 and noise.min() >= 20

    pgm = read_pgm("p.pgm")
    m = re.search(r"pgm_scale = (\S+)", out)
    scale = float(m.group(1))
    np.testing.assert_array_equal(pgm, np.minimum(255, img.astype(np.float32) * np.float32(scale)).astype(np.uint8))
    assert (workdir / "p.pgm").read_bytes().startswith(b"P5\n48 48\n# pixels scaled by ")

    h5img, meta = read_h5_image("o.h5")
    np.testing.assert_array_equal(h5img, img.astype(np.float32))
    sim = Simulator(config_from_args(argv))
    g = sim.geometry(sim.parameters_dict())
    assert meta["distance_mm"] == pytest.approx(100.0)
    assert meta["x_pixel_size_mm"] == meta["y_pixel_size_mm"] == pytest.approx(0.1)
    assert meta["wavelength_A"] == pytest.approx(1.0)
    assert meta["beam_center_x_mm"] == pytest.approx(float(g.Fbeam) * 1000)
    assert meta["beam_center_y_mm"] == pytest.approx(float(g.Sbeam) * 1000)
    geo = meta["nbtorch"]
    for key in ("pix0_vector_m", "fdet_vector", "sdet_vector", "odet_vector", "beam_vector", "convention", "pivot",
                "close_distance_mm", "oversample", "Xbeam_mm", "Ybeam_mm"):
        assert key in geo, key
    np.testing.assert_allclose(geo["pix0_vector_m"], g.pix0.numpy())
    assert meta["attrs"]["cell_a"] == pytest.approx(70.0) and meta["attrs"]["c_parity"]


def test_outputs_are_atomic_and_defaults(workdir):
    assert main(SMALL + ["-seed", "1"]) == 0
    names = sorted(p.name for p in workdir.iterdir())
    assert names == ["floatimage.bin", "image.pgm", "intimage.img", "noiseimage.img"]


@pytest.mark.parametrize("mode", [[], ["-c_parity"]])
def test_nonoise_writes_no_noise_image(workdir, capsys, mode):
    """The noise image is written by default (``noiseimage.img``, or the ``-noisefile``/``-noiseimage`` name);
    ``-nonoise`` writes none and draws no noise (the other outputs are unchanged)."""
    base = SMALL + mode + ["-seed", "3", "-nopgm"]
    runs = {"default": [], "-noisefile": ["-noisefile", "n.img"], "-noiseimage": ["-noiseimage", "m.img"],
            "-nonoise": ["-nonoise"]}
    names, printed, floats = {}, {}, {}
    for label, extra in runs.items():
        for p in workdir.iterdir():
            p.unlink()
        assert main(base + extra) == 0
        names[label] = sorted(p.name for p in workdir.iterdir())
        printed[label] = capsys.readouterr().out
        floats[label] = (workdir / "floatimage.bin").read_bytes()
    assert names == {"default": ["floatimage.bin", "intimage.img", "noiseimage.img"],
                     "-noisefile": ["floatimage.bin", "intimage.img", "n.img"],
                     "-noiseimage": ["floatimage.bin", "intimage.img", "m.img"],
                     "-nonoise": ["floatimage.bin", "intimage.img"]}
    assert "photons on noise image" in printed["default"] and "writing noiseimage.img" in printed["default"]
    assert "noise" not in printed["-nonoise"]
    assert len(set(floats.values())) == 1


# --- the C's header and statistics ---------------------------------------------------------------
HEADER_CASES = [c for c in ("simple_cubic", "water_nonoise") if c in golden_cases()]


@pytest.mark.parametrize("case", HEADER_CASES)
def test_smv_header_matches_golden(case, case_copy, capsys):
    folder = case_copy(case)
    (folder / "int.img").unlink()
    assert main(golden_args(case) + ["-c_parity"]) == 0
    ours_img, ours = read_smv(folder / "int.img")
    ref_img, ref = read_smv(GOLDEN / case / "int.img")
    assert list(ours.items()) == list(ref.items())
    np.testing.assert_array_equal(ours_img, ref_img)
    # the statistics lines, as the C prints them
    ours_lines = _stdout_lines(capsys.readouterr().out)
    ref_lines = _stdout_lines((GOLDEN / case / "stdout.txt").read_text())
    assert ours_lines == ref_lines


def test_statistics_match_golden_noise_case(case_copy, capsys):
    if "water_noise" not in golden_cases():
        pytest.skip("no water_noise golden case")
    folder = case_copy("water_noise")
    for name in ("int.img", "noise.img", "float.bin"):
        (folder / name).unlink()
    assert main(golden_args("water_noise") + ["-c_parity"]) == 0
    assert _stdout_lines(capsys.readouterr().out) == _stdout_lines((GOLDEN / "water_noise" / "stdout.txt").read_text())
    assert (folder / "noise.img").read_bytes() == (GOLDEN / "water_noise" / "noise.img").read_bytes()


def test_image_statistics_mask_and_roi():
    img = np.zeros((4, 5))
    img[1, 2] = 10.0
    img[2, 3] = 10.0
    mask = np.ones((4, 5), dtype=bool)
    mask[1, 2] = False
    st = cli.image_statistics(img, (1, 4, 0, 3), mask, c_parity=False, pixel_m=1e-4, oversample=2)
    assert st["max"] == 10.0 and st["n"] == 15
    assert (st["max_x"], st["max_y"]) == pytest.approx((3.5e-4, 2.5e-4))  # pixel centre
    st_c = cli.image_statistics(img, (1, 4, 0, 3), mask, c_parity=True, pixel_m=1e-4, oversample=2)
    assert (st_c["max_x"], st_c["max_y"]) == pytest.approx((3.75e-4, 2.75e-4))  # the C's last sub-pixel
    assert st_c["mean"] == pytest.approx(10 / 15) and st_c["rmsd"] != st["rmsd"]  # C: rmsd over the whole ROI


# --- noise ----------------------------------------------------------------------------------------
def test_spec_noise_is_poisson_and_deterministic():
    rng = np.random.default_rng(0)
    image = 50.0 + rng.uniform(-1, 1, size=(256, 256))
    inside = np.ones(image.shape, dtype=bool)
    noise, photons, overloads = cli.noise_image(image, 1234, 40.0, inside, c_parity=False)
    counts = noise.astype(np.float64) - 40.0
    assert abs(counts.mean() / image.mean() - 1) < 0.005
    assert abs(counts.var() / image.mean() - 1) < 0.03  # Poisson: variance = mean
    assert photons == counts.sum() and overloads == 0
    again, _, _ = cli.noise_image(image, 1234, 40.0, inside, c_parity=False)
    other, _, _ = cli.noise_image(image, 1235, 40.0, inside, c_parity=False)
    np.testing.assert_array_equal(noise, again)
    assert not np.array_equal(noise, other)


def test_spec_noise_through_the_command(workdir):
    argv = ("-cell 100 100 100 90 90 90 -default_F 7000 -N 1 -lambda 1 -distance 100 -detpixels 128 -nopgm "
            "-noprogress -seed 99 -adc 10 -floatfile f.bin").split()
    assert main(argv + ["-noisefile", "a.img"]) == 0
    assert main(argv + ["-noisefile", "b.img"]) == 0
    assert (workdir / "a.img").read_bytes() == (workdir / "b.img").read_bytes()  # deterministic for a seed
    img = read_raw_float("f.bin", (128, 128)).astype(np.float64)
    counts = read_smv("a.img")[0].astype(np.float64) - 10.0
    assert 40 < img.mean() < 60
    assert abs(counts.mean() / img.mean() - 1) < 0.005
    assert abs(((counts - img) ** 2).mean() / img.mean() - 1) < 0.05


# --- -printout ------------------------------------------------------------------------------------
def _reports(text: str) -> list[dict]:
    out = []
    for block in re.split(r"\n(?=\s*\d+\s+\d+ : stol)", text):
        m = re.search(r"(\d+)\s+(\d+) : stol", block)
        if not m:
            continue
        vals = {k: float(re.search(rf"^{k}\s+(\S+)", block, re.M).group(1))
                for k in ("I/steps", "polar", "omega", "capfrac", "pixel")}
        vals["I"] = float(re.search(r"I = (\S+)", block).group(1))
        vals["pixel_index"] = (int(m.group(1)), int(m.group(2)))
        out.append(vals)
    return out


@pytest.mark.parametrize("extra", ["", "-detector_thick 100 -detector_abs 50", "-polar 0.5 -water 0.5"])
def test_printout_pixel_reproduces_the_pixel(workdir, capsys, extra):
    """C parity: pixel = r_e^2 fluence I/steps polar omega capfrac, from the printed numbers."""
    argv = SMALL + ["-c_parity", "-nonoise", "-nopgm", "-printout_pixel", "30", "17"] + extra.split()
    assert main(argv) == 0
    reports = _reports(capsys.readouterr().out)
    assert len(reports) == 1
    r = reports[0]
    assert r["pixel_index"] == (30, 17)
    img = read_raw_float("floatimage.bin", (48, 48))
    assert r["pixel"] == pytest.approx(float(img[17, 30]), rel=1e-6)
    r_e2_fluence = 7.94079248018965e-30 * 125932015286227086360700780544.0
    assert r["I/steps"] * r["polar"] * r["omega"] * r["capfrac"] * r_e2_fluence == pytest.approx(r["pixel"], rel=1e-6)
    if "detector_thick" in extra:
        assert r["capfrac"] < 1


def test_printout_covers_the_roi(workdir, capsys):
    assert main(SMALL + ["-nonoise", "-nopgm", "-printout", "-roi", "10", "12", "20", "21"]) == 0
    reports = _reports(capsys.readouterr().out)
    assert [r["pixel_index"] for r in reports] == [(f, s) for s in (20, 21) for f in (10, 11, 12)]


# --- progress bar -----------------------------------------------------------------------------------
class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty
        self.text = []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text.append(s)
        return len(s)

    def flush(self):
        pass


@pytest.mark.parametrize("flags, tty, expected", [
    ([], True, True),
    (["-progress"], True, True),
    (["-noprogress"], True, False),
    ([], False, False),
    (["-progress"], False, False),
    (["-printout_pixel", "1", "1"], True, False),
])
def test_progress_only_on_a_terminal(workdir, monkeypatch, flags, tty, expected):
    seen = {}
    original = Simulator.render

    def spy(self, *args, **kwargs):
        seen["progress"] = kwargs.get("progress", False)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Simulator, "render", spy)
    monkeypatch.setattr(cli.sys, "stderr", _Stream(tty))
    argv = [a for a in SMALL if a != "-noprogress"] + ["-nonoise", "-nopgm"] + flags
    assert main(argv) == 0
    assert seen["progress"] is expected


# --- -pix0_vector_mm ----------------------------------------------------------------------------------
def test_pix0_vector_mm_is_pix0_vector_in_metres():
    base = "-cell 100 100 100 90 90 90 -default_F 10 -N 3 -detpixels 24 -distance 80".split()
    metres = config_from_args(base + ["-pix0_vector", "0.08", "0.0012", "-0.0012"])
    mm = config_from_args(base + ["-pix0_vector_mm", "80", "1.2", "-1.2"])
    assert mm.pix0_vector_m == pytest.approx(metres.pix0_vector_m)
    assert mm.replace(pix0_vector_m=None) == metres.replace(pix0_vector_m=None)
    assert mm.convention == "custom"
    a = Simulator(metres)().numpy()
    b = Simulator(mm)().numpy()
    np.testing.assert_array_equal(a, b)


# --- -dump ------------------------------------------------------------------------------------------
def test_dump_round_trip(workdir):
    h, k, l = np.meshgrid(*(np.arange(-4, 5),) * 3, indexing="ij")
    F = 10.0 + np.abs(h) + 2 * np.abs(k) + 3 * np.abs(l)
    write_hkl("P1.hkl", HKLTable(h=h.ravel(), k=k.ravel(), l=l.ravel(), F=F.ravel()))
    argv = ("-cell 100 100 100 90 90 90 -N 3 -lambda 1 -distance 100 -detpixels 32 -pixel 0.4 -nonoise -nopgm "
            "-noprogress -default_F 1").split()
    assert main(argv + ["-hkl", "P1.hkl", "-dump", "F.bin", "-floatfile", "a.bin"]) == 0
    grid, mins = read_fdump("F.bin")
    assert mins == (-4, -4, -4)
    np.testing.assert_array_equal(grid, F)
    assert main(argv + ["-dump", "F.bin", "-floatfile", "b.bin"]) == 0
    a, b = (workdir / "a.bin").read_bytes(), (workdir / "b.bin").read_bytes()
    assert a == b
    assert not (workdir / "Fdump.bin").exists()


def test_stray_fdump_is_never_read(workdir):
    from nbtorch.io import write_fdump

    write_fdump("Fdump.bin", np.full((3, 3, 3), 500.0), (-1, -1, -1))
    argv = ("-cell 100 100 100 90 90 90 -N 3 -distance 100 -detpixels 16 -pixel 0.4 -nonoise -nopgm -noprogress "
            "-default_F 10 -floatfile f.bin").split()
    assert main(argv) == 0
    sim = Simulator(config_from_args(argv))
    assert sim.setup.F_grid is None
    np.testing.assert_allclose(read_raw_float("f.bin", (16, 16)), sim().numpy().astype(np.float32))


# --- every output or none (#20 point 3) ------------------------------------------------------------
# CUSTOM vectors with many digits: the C's header text grows past 512 bytes
LONG_HEADER = ("-cell 70 80 90 75 85 95 -N 2 -lambda 1.0123456 -default_F 100 -distance 100.123456 -detpixels 32 "
               "-pixel 0.1 -fdet_vector 0.0523123456 -0.000012345 0.99863 -sdet_vector 0.0000123 -1.0 0.0000456 "
               "-odet_vector 0.99863 0.00001234 -0.0523 -beam_vector 0.99995 0.01 0.0000321 "
               "-pix0_vector_mm 100.123456 -1.2345678 -1.3456789 -phi 20.123456 -osc 0.1234567 "
               "-noprogress -seed 3").split()


@pytest.mark.parametrize("mode", [[], ["-c_parity"]])
def test_long_smv_header_is_valid(workdir, capsys, mode):
    argv = LONG_HEADER + mode + ["-floatfile", "t.bin", "-intfile", "t.img", "-noisefile", "n.img", "-scale", "7"]
    assert main(argv) == 0, capsys.readouterr().err
    img = read_raw_float("t.bin", (32, 32)).astype(np.float64)
    for name in ("t.img", "n.img"):
        data = (workdir / name).read_bytes()
        assert data.startswith(b"{\nHEADER_BYTES=1024;\n") and len(data) == 1024 + 32 * 32 * 2
        assert data.index(b"}\f") > 512 and data[data.index(b"}\f") + 2:1024].strip(b" ") == b""
    intimg, head = read_smv("t.img")
    np.testing.assert_array_equal(intimg, np.floor(np.clip(img * 7 + 40, 0, 65535) + 0.5).astype(np.uint16))
    assert head["HEADER_BYTES"] == "1024" and head["BEAMLINE"] == "fake" and head["SIZE1"] == "32"
    noise, nhead = read_smv("n.img")
    assert nhead == head and noise.shape == (32, 32)
    fabio = sys.modules.get("fabio")
    if fabio is not None:
        np.testing.assert_array_equal(fabio.open("t.img").data, intimg)


def test_failed_output_leaves_no_output(workdir, capsys, monkeypatch):
    # a folder that disappears during the run (check_outputs passed): the last output fails to be written
    monkeypatch.setattr(cli, "check_outputs", lambda *args, **kwargs: None)
    argv = SMALL + ["-seed", "1", "-floatfile", "f.bin", "-intfile", "i.img", "-pgmfile", "p.pgm",
                    "-noisefile", "gone/n.img"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbtorch: error: gone/n.img") and len(err.strip().splitlines()) == 1
    assert list(workdir.iterdir()) == []  # no output, no temporary file


def test_missing_folder_given_last_is_refused_before_writing(workdir, capsys):
    argv = SMALL + ["-seed", "1", "-floatfile", "f.bin", "-intfile", "i.img", "-h5file", "nowhere/o.h5"]
    assert main(argv) == 2
    assert "nowhere" in capsys.readouterr().err
    assert list(workdir.iterdir()) == []


def test_write_files_together_rolls_back(tmp_path):
    from nbtorch.errors import InputError
    from nbtorch.io.atomic import write_files_together

    (tmp_path / "old.bin").write_bytes(b"old")

    def broken(path):
        raise InputError(f"{path}: cannot write")

    with pytest.raises(InputError):
        write_files_together([(tmp_path / "a.bin", b"a"), (tmp_path / "old.bin", b"new"), (tmp_path / "c.h5", broken)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.bin"] and (tmp_path / "old.bin").read_bytes() == b"old"
    write_files_together([(tmp_path / "a.bin", b"a"), (tmp_path / "old.bin", b"new"),
                          (tmp_path / "c.txt", lambda p: open(p, "wb").write(b"c"))])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {"a.bin": b"a", "old.bin": b"new", "c.txt": b"c"}


# --- each distance under its own name (#20 point 5) -------------------------------------------------
@pytest.mark.parametrize("given", ["-close_distance", "-distance"])
def test_summary_names_both_distances(workdir, capsys, given):
    base = "-cell 70 80 90 75 85 95 -N 2 -default_F 100 -detpixels 16 -pixel 0.1 -detector_roty 30".split()
    argv = base + [given, "159.735", "-nonoise", "-nopgm", "-noprogress"]
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("detector distances:"))
    m = re.fullmatch(r"detector distances: close_distance (\S+) mm \((given; )?sample to the detector plane along "
                     r"its normal\), distance (\S+) mm \((given; )?sample to the detector plane along the beam\)", line)
    assert m, line
    close, dist = float(m.group(1)), float(m.group(3))
    ratio = math.cos(math.radians(30))  # the normal tilted by 30 degrees from the beam
    if given == "-close_distance":
        assert close == 159.735 and dist == pytest.approx(159.735 / ratio, rel=1e-5)
        assert m.group(2) and not m.group(4)
    else:
        assert dist == 159.735 and close == pytest.approx(159.735 * ratio, rel=1e-5)
        assert m.group(4) and not m.group(2)
    sim = Simulator(config_from_args(argv))
    g = sim.geometry(sim.parameters_dict())
    assert close == pytest.approx(float(g.close_distance) * 1000, rel=1e-5)
    assert dist == pytest.approx(float(g.distance) * 1000, rel=1e-5)
