"""Bad input: one-line errors naming the input, exit status 2, and no output file."""

from __future__ import annotations

import os

import pytest

from nbtorch import InputError, Simulator, config_from_args
from nbtorch.cli import main

GOOD = "-cell 100 100 100 90 90 90 -default_F 10 -N 3 -detpixels 16 -nonoise -nopgm".split()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["-bogus"], "unknown flag -bogus"),
        (["-cell", "100", "-distance"], "-distance: expected a value"),
        (["-distance", "abc"], "-distance: expected a number"),
        (["-detpixels", "2.5"], "-detpixels: expected an integer"),
        (["-pivot", "middle"], "-pivot"),
        (["-misset", "1", "2"], "-misset"),
        (["-lambda", "nan"], "-lambda: value is NaN"),
        (["stray"], "unexpected argument"),
    ],
)
def test_parse_errors(argv, needle):
    with pytest.raises(InputError, match=needle.replace("(", r"\(")):
        config_from_args(argv)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ("-cell 10 10 10 120 120 130", "do not make a unit cell"),
        ("-cell -5 10 10 90 90 90", "-cell a: must be positive"),
        ("-lambda 0", "-lambda: must be positive"),
        ("-pixel -0.1", "-pixel: must be positive"),
        ("-distance 0", "-distance: must be positive"),
        ("-roi 0 99 0 5", "-roi 0 99 0 5: outside"),
        ("-N -2", "-N"),
        ("-oversample 0", "-oversample: must be a positive count"),
        ("-hkl /nonexistent/file.hkl", "/nonexistent/file.hkl"),
        ("-mosaic -1", "-mosaic: must be non-negative"),
    ],
)
def test_setup_errors(extra, needle):
    argv = GOOD + extra.split()
    with pytest.raises(InputError) as info:
        Simulator(config_from_args(argv))
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_no_crystal_is_an_error():
    with pytest.raises(InputError, match="no crystal"):
        Simulator(config_from_args(["-default_F", "1"]))


def test_cli_error_exit_code_and_no_files(tmp_path, capsys):
    os.chdir(tmp_path)
    rc = main(GOOD + ["-roi", "0", "99", "0", "5", "-floatfile", "out.bin", "-intfile", "out.img"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("nbtorch: error:") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_hkl_line(tmp_path, capsys):
    os.chdir(tmp_path)
    (tmp_path / "bad.hkl").write_text("1 2 3 10\n1 2 x 5\n")
    rc = main(GOOD + ["-hkl", "bad.hkl"])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.hkl" in err and "line 2" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.hkl"]


def test_cli_writes_default_outputs(tmp_path):
    os.chdir(tmp_path)
    assert main(GOOD[:-2]) == 0  # noise and pgm on
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["floatimage.bin", "image.pgm", "intimage.img", "noiseimage.img"]
