"""Bad input: one-line errors naming the input, exit status 2, and no output file."""

from __future__ import annotations

import os

import pytest

from nbtorch import InputError, Simulator, config_from_args
from nbtorch.cli.main import main

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
        ("-mosaic_abc 0.1 -0.2 0.3", "-mosaic_abc: expected three finite spreads >= 0 (deg), got 0.1 -0.2 0.3"),
        ("-mosaic_abc 0.1 inf 0.3", "-mosaic_abc: expected three finite spreads"),
        ("-mosaic_abc 0.1 0.2 0.3 -c_parity", "-mosaic_abc: the anisotropic mosaic is a spec-mode model"),
        ("-water 1e308", "-water: 1e+308 µm is too thick"),  # found by the fuzz test (seed 3)
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


# --- values that are flags, negative numbers, the flag named in messages -------------------------
def test_negative_numbers_and_dash_file_names_are_values():
    """Only a known flag is refused as a text value: negative numbers and other '-' names are values."""
    cfg = config_from_args(["-Xbeam", "-3", "-floatfile", "-f.bin", "-misset", "-1", "-2", "-3"])
    assert cfg.Xbeam_mm == -3 and cfg.floatfile == "-f.bin" and cfg.misset_deg == (-1, -2, -3)


@pytest.mark.parametrize("flag", ["-floatfile", "-intfile", "-noisefile", "-pgmfile", "-h5file", "-hkl", "-mat",
                                  "-dump", "-sourcefile", "-img", "-mask", "-device", "-dtype"])
def test_text_value_is_not_the_next_flag_nor_empty(flag):
    with pytest.raises(InputError, match=f"^{flag}: expected .*got the flag -nonoise"):
        config_from_args([flag, "-nonoise"])
    with pytest.raises(InputError, match=f"^{flag}: expected .*empty"):
        config_from_args([flag, ""])


def test_config_records_the_flag_that_set_each_field():
    cfg = config_from_args("-Na 2 -N 3 -detpixels 8 -divergence 1 -detsize 10 -pixel 0.1".split())
    assert cfg.flags["N_a"] == cfg.flags["N_c"] == "-N" and cfg.flags["fpixels"] == "-detpixels"
    assert cfg.flags["vdivrange_mrad"] == "-divergence" and cfg.flags["detsize_s_mm"] == "-detsize"
    assert config_from_args(["-N", "3", "-Na", "2"]).flags["N_a"] == "-Na"


# --- the automatic oversample bound ----------------------------------------------------------------
def test_automatic_oversample_limit_is_inclusive():
    """ceil(3 N a / (lambda d / p)) = ceil(0.3 N) here: N 333 gives 100 (allowed), N 334 gives 101."""
    from nbtorch.rules.resolve import MAX_AUTO_OVERSAMPLE, resolve

    assert MAX_AUTO_OVERSAMPLE == 100
    base = GOOD + "-pixel 0.1 -distance 100 -lambda 1 -detpixels 4".split()
    assert resolve(config_from_args(base + ["-N", "333"])).oversample == 100
    with pytest.raises(InputError, match="automatic value 101 "):
        resolve(config_from_args(base + ["-N", "334"]))
    assert resolve(config_from_args(base + ["-N", "334", "-oversample", "2"])).oversample == 2


# --- running out of memory: one line naming the cause, never a traceback ----------------------------
def test_hkl_grid_that_does_not_fit_in_memory(tmp_path, monkeypatch, capsys):
    """A stray reflection far from the others: under the cell limit, but the grid cannot be allocated."""
    import numpy as np

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stray.hkl").write_text("0 0 0 10\n1 0 0 5\n799 799 799 5\n")
    real_full = np.full

    def full(shape, *args, **kwargs):
        if np.prod(shape) > 10**8:
            raise MemoryError(f"Unable to allocate 3.81 GiB for an array with shape {shape}")
        return real_full(shape, *args, **kwargs)

    monkeypatch.setattr(np, "full", full)
    rc = main(GOOD + ["-hkl", "stray.hkl"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("nbtorch: error: stray.hkl: not enough memory") and err.count("\n") == 1
    assert "h 0..799, k 0..799, l 0..799" in err and "512000000 cells" in err and "4.1 GB" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stray.hkl"]


@pytest.mark.parametrize("exc", [
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 115200000000 bytes. "
                 "Error code 12 (Cannot allocate memory)"),
    MemoryError("Unable to allocate 8.00 GiB for an array"),
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"),
])
def test_allocation_failure_while_rendering_is_one_line(tmp_path, monkeypatch, capsys, exc):
    monkeypatch.chdir(tmp_path)

    def render(self, *args, **kwargs):
        raise exc

    monkeypatch.setattr(Simulator, "render", render)
    rc = main(GOOD + ["-oversample", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("nbtorch: error: out of memory while rendering") and err.count("\n") == 1
    assert "oversample 2" in err and "256 pixels" in err and str(exc).split(".")[0] in err
    assert list(tmp_path.iterdir()) == []


def test_allocation_failure_names_the_structure_factor_grid(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.hkl").write_text("-2 0 1 10\n3 4 5 5\n")

    def render(self, *args, **kwargs):
        raise MemoryError("Unable to allocate 8.00 GiB for an array")

    monkeypatch.setattr(Simulator, "render", render)
    rc = main(GOOD + ["-hkl", "small.hkl"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("nbtorch: error: out of memory while rendering") and err.count("\n") == 1
    assert "structure-factor grid: index ranges h -2..3, k 0..4, l 1..5 need a grid of 150 cells" in err


def test_other_runtime_errors_are_not_hidden(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def render(self, *args, **kwargs):
        raise RuntimeError("some bug")

    monkeypatch.setattr(Simulator, "render", render)
    with pytest.raises(RuntimeError, match="some bug"):
        main(GOOD)
