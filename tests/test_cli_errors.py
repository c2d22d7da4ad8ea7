"""Bad input through the command: one line naming the flag or file (and line), exit 2, no file written."""

from __future__ import annotations

import os

import numpy as np
import pytest

from nbtorch.cli.main import main
from nbtorch.io.smv import write_smv

BASE = "-cell 100 100 100 90 90 90 -default_F 10 -N 3 -detpixels 16 -pixel 0.1 -distance 100 -noprogress".split()

INPUTS = {
    "bad.hkl": "1 2 3 10\n1 2 x 5\n",
    "short.hkl": "1 2 3 10\n0 0 1\n",
    "frac.hkl": "1 2 3 10\n0 0 1.5 4\n",
    "eight.mat": "0.01 0 0\n0 0.01 0\n0 0\n",
    "singular.mat": "0.01 0 0\n0.01 0 0\n0 0 0.01\n",
    "text.mat": "0.01 0 0\n0 0.01 zero\n0 0 0.01\n",
    "bad_sources.txt": "-10 0 0 1 1e-10\n-10 0 0 1 abc\n",
    "neg_lambda_sources.txt": "-10 0 0 1 1e-10\n\n-10 0 0 1 -1e-10\n",
    "notsmv.img": "this is not an SMV image\n",
    "tiny.mat": "1e-30 0 0\n0 1e-30 0\n0 0 1e-30\n",
}


@pytest.fixture
def workdir(tmp_path):
    old = os.getcwd()
    os.chdir(tmp_path)
    for name, text in INPUTS.items():
        (tmp_path / name).write_text(text)
    write_smv(tmp_path / "mask8.img", np.ones((8, 8), dtype=np.uint16), {"PIXEL_SIZE": "0.1"})
    yield tmp_path
    os.chdir(old)


CASES = [
    # files: malformed, missing, non-3x3 / singular matrix
    ("-hkl bad.hkl", ["bad.hkl", "line 2"]),
    ("-hkl short.hkl", ["short.hkl", "line 2", "expected 4 fields"]),
    ("-hkl frac.hkl", ["frac.hkl", "line 2", "integer"]),
    ("-hkl missing.hkl", ["missing.hkl", "not found"]),
    ("-mat eight.mat -cell_drop", ["eight.mat", "expected 9 numbers"]),
    ("-mat singular.mat -cell_drop", ["singular.mat", "singular"]),
    ("-mat text.mat -cell_drop", ["text.mat", "line 2"]),
    ("-mat missing.mat -cell_drop", ["missing.mat", "not found"]),
    ("-sourcefile bad_sources.txt", ["bad_sources.txt", "line 2"]),
    ("-sourcefile neg_lambda_sources.txt", ["neg_lambda_sources.txt", "line 3", "lambda"]),
    ("-sourcefile missing.txt", ["missing.txt", "not found"]),
    ("-img missing.img", ["-img", "missing.img"]),
    ("-img notsmv.img", ["-img", "notsmv.img", "not an SMV"]),
    ("-mask missing.img", ["-mask", "missing.img"]),
    ("-mask mask8.img -detpixels 16", ["-mask", "mask8.img", "8 x 8", "16 x 16"]),
    ("-dump missing.bin", ["-dump", "missing.bin", "not found"]),
    # impossible cells
    ("-cell 10 10 10 120 120 130", ["-cell", "do not make a unit cell"]),
    ("-cell 10 10 10 90 90 180", ["-cell gamma", "between 0 and 180"]),
    ("-cell -5 10 10 90 90 90", ["-cell a", "positive"]),
    # zero or negative sizes, counts, wavelength
    ("-pixel 0", ["-pixel", "positive"]),
    ("-pixel -0.1", ["-pixel", "positive"]),
    ("-detpixels 0", ["-detpixels", "positive"]),
    ("-detsize -5 -detpixels_drop", ["-detsize", "positive"]),
    ("-distance -5", ["-distance", "positive"]),
    ("-N -1", ["-N", "non-negative"]),
    ("-oversample 0", ["-oversample", "positive"]),
    ("-dispsteps -1", ["-dispsteps", "negative"]),
    ("-phisteps -2", ["-phisteps", "negative"]),
    ("-mosaic_dom -1", ["-mosaic_dom", "negative"]),
    ("-mosaic 0.2 -mosaic_model sphere", ["-mosaic_model", "unknown model 'sphere'"]),
    ("-mosaic 0.2 -mosaic_model ball -mosaic_seed 4", ["-mosaic_seed", "takes no seed"]),
    ("-mosaic 0.2 -mosaic_turn -1", ["-mosaic_turn", "expected a turn index 0 to 1000"]),
    ("-mosaic 0.2 -mosaic_model random -mosaic_turn 3", ["-mosaic_turn", "turns an even mosaic set"]),
    ("-mosaic 0.2 -mosaic_dom 0", ["-mosaic_dom", "1 to 100000 domains"]),
    ("-lambda 0", ["-lambda", "positive"]),
    ("-lambda -1", ["-lambda", "positive"]),
    ("-energy 0", ["-energy", "positive"]),
    ("-energy -8000", ["-energy", "positive"]),
    ("-water -1", ["-water", "non-negative"]),
    ("-fluence 0", ["-fluence", "positive"]),
    ("-detector_thick -10", ["-detector_thick", "non-negative"]),
    ("-mosaic -0.5", ["-mosaic", "non-negative"]),
    # regions and pixels outside the detector
    ("-roi 0 16 0 15", ["-roi", "outside"]),
    ("-roi 10 5 0 15", ["-roi", "empty"]),
    ("-printout_pixel 20 3", ["-printout_pixel", "20 3"]),
    # conflicting flags
    ("-mat singular.mat", ["-cell and -mat"]),
    ("-nonoise -noisefile n.img", ["-nonoise", "-noisefile"]),
    ("-noisefile n.img -nonoise", ["-nonoise", "-noisefile"]),
    ("-nopgm -pgmfile p.pgm", ["-nopgm", "-pgmfile"]),
    ("-pgmscale 2 -nopgm", ["-nopgm", "-pgmscale"]),
    ("-intfile same.img -noisefile same.img", ["-intfile", "-noisefile", "same.img"]),
    ("-hkl bad.hkl -dump bad.hkl", ["-dump", "bad.hkl", "overwrite", "-hkl"]),
    ("-mask mask8.img -detpixels 8 -intfile mask8.img", ["-intfile", "mask8.img", "overwrite", "-mask"]),
    ("-misset random", ["-misset random", "-misset_seed"]),
    # malformed flags and values, outputs that cannot be written
    ("-bogus", ["unknown flag -bogus"]),
    ("-distance", ["-distance", "expected a value"]),
    ("-distance far", ["-distance", "expected a number"]),
    ("-detpixels 2.5", ["-detpixels", "integer"]),
    ("-dtype float16", ["-dtype", "float16"]),
    ("-floatfile nodir/out.bin", ["-floatfile", "nodir", "does not exist"]),
    ("-h5file nodir/out.h5", ["-h5file", "nodir"]),
    ("-floatfile bad.hkl/out.bin", ["-floatfile bad.hkl/out.bin: bad.hkl is not a directory"]),
    # a text value is never the next flag, nor empty
    ("-floatfile -nonoise", ["-floatfile: expected a file name, got the flag -nonoise"]),
    ("-floatfile -intfile i.img", ["-floatfile: expected a file name, got the flag -intfile"]),
    ("-hkl -default_F 3", ["-hkl: expected a file name, got the flag -default_F"]),
    ("-dtype -cell", ["-dtype: expected a value, got the flag -cell"]),
    ("-floatfile <empty>", ["-floatfile: expected a file name, got an empty name"]),
    ("-intfile <blank>", ["-intfile: expected a file name, got an empty name"]),
    ("-h5file <empty>", ["-h5file", "empty"]),
    ("-hkl <empty>", ["-hkl", "empty"]),
    # the automatic oversample (the C's rule) is bounded; so are the samples of one pixel
    ("-N 100000", ["-oversample", "automatic value 30000", "crystal size 1000 um", "distance 100 mm",
                   "pixel 0.1 mm", "limit of 100", "units", "give -oversample explicitly"]),
    ("-cell 1e8 1e8 1e8 90 90 90", ["-oversample", "automatic value 900000", "limit of 100"]),
    ("-curved_det -distance 0.001", ["-oversample", "automatic value 90001", "distance 0.001 mm"]),
    ("-distance 0.1", ["-oversample", "automatic value 900", "distance 0.1 mm"]),
    ("-pixel 172", ["-oversample", "automatic value 1548", "pixel 172 mm"]),
    ("-mat tiny.mat -cell_drop", ["-oversample", "automatic value 9e+27"]),
    ("-oversample 100000", ["-oversample 100000", "samples per pixel", "limit of 1048576", "GB"]),
    ("-oversample 1025", ["-oversample 1025", "samples per pixel"]),
    ("-oversample 300 -detector_thick 100 -thicksteps 20", ["-oversample 300", "20 sensor layers", "-thicksteps"]),
    ("-N 40 -divergence 1 -divsteps 90 -square_div", ["sampling:", "12^2 sub-pixels", "8100 sources", "per pixel"]),
    # negative beam intensities
    ("-flux -5", ["-flux", "non-negative"]),
    ("-flux 1e12 -exposure -1", ["-exposure", "non-negative"]),
    ("-exposure -1", ["-exposure", "non-negative"]),
    ("-flux 1e12 -exposure 0", ["-exposure", "positive to compute the fluence from -flux"]),
    ("-flux 1e12 -beamsize -0.1", ["-beamsize", "non-negative"]),
    ("-flux 1e12 -beamsize 0", ["-beamsize", "positive to compute the fluence from -flux"]),
    ("-fluence -1e24", ["-fluence", "positive"]),
    ("-source_distance -5", ["-source_distance", "positive"]),
    # a dispersion that makes a wavelength zero or negative
    ("-dispersion 300 -dispsteps 3", ["-dispersion 300", "-0.5 A", "below 200%"]),
    ("-dispersion 200 -dispsteps 2", ["-dispersion 200", "below 200%"]),
    # parallel or zero detector axes
    ("-fdet_vector 0 0 1 -sdet_vector 0 0 1", ["-fdet_vector 0 0 1 and -sdet_vector 0 0 1", "parallel"]),
    ("-fdet_vector 0 0 1 -sdet_vector 0 0 -2", ["-fdet_vector", "-sdet_vector", "parallel"]),
    ("-fdet_vector 0 -1 0", ["-fdet_vector 0 -1 0", "default -sdet_vector", "parallel", "give -sdet_vector"]),
    ("-fdet_vector 0 0 1 -odet_vector 0 0 1", ["-fdet_vector", "-odet_vector", "parallel"]),
    ("-sdet_vector 0 0 0", ["-sdet_vector", "non-zero"]),
    # the message names the flag that was typed
    ("-N -3", ["-N: must be non-negative"]),
    ("-Nb -3", ["-Nb: must be non-negative"]),
    ("-divergence -1", ["-divergence: must be non-negative"]),
    ("-detpixels -5", ["-detpixels: must be a positive count"]),
    ("-detpixels_x 0", ["-detpixels_x: must be a positive count"]),
    ("-detsize 0 -detpixels_drop", ["-detsize: must be positive"]),
    ("-divsteps -2", ["-divsteps: must not be negative"]),
    ("-mosaic_spread -1", ["-mosaic_spread: must be non-negative"]),
    ("-mosaic_abc 0.1 -0.2 0.3", ["-mosaic_abc: expected three finite spreads >= 0 (deg), got 0.1 -0.2 0.3"]),
    ("-mosaic_abc 0.1 0.2 0.3 -c_parity", ["-mosaic_abc: the anisotropic mosaic is a spec-mode model"]),
    ("-wavelength 0", ["-wavelength: must be positive"]),
    ("-beam_vector 0 0 1", ["-beam_vector 0 0 1", "parallel to the default polarization vector", "give -polar_vector"]),
    ("-polar_vector 1 0 0", ["-polar_vector 1 0 0", "parallel to the beam"]),
    ("-beam_vector 0 0 1 -polar_vector 0 0 3", ["-polar_vector 0 0 3 and -beam_vector 0 0 1", "parallel"]),
    # the anisotropic Gaussian crystal: a size matrix that is no crystal, off-diagonal sizes without the shape
    ("-gauss_aniso_xtal -Nd 4", ["-gauss_aniso_xtal: the size matrix", "[[3 4 0] [4 3 0] [0 0 3]]",
                                 "not positive definite", "eigenvalues -1 3 7"]),
    ("-gauss_aniso_xtal -Nd 3 -Ne 3 -Nf 3", ["-gauss_aniso_xtal", "not positive definite"]),
    ("-Nd 2", ["-Nd 2: the off-diagonal crystal sizes act only with -gauss_aniso_xtal (the crystal shape is square)"]),
    ("-gauss_aniso_xtal -Ne inf", ["-Ne: value is not finite"]),
    ("-gauss_aniso_xtal -Nf abc", ["-Nf: expected a number, got 'abc'"]),
    ("-gaussaniso_xtal", ["unknown flag -gaussaniso_xtal"]),
]


def _argv(extra: str) -> list[str]:
    argv = list(BASE)
    tokens = [{"<empty>": "", "<blank>": " "}.get(t, t) for t in extra.split()]
    if "-cell_drop" in tokens:  # a matrix file replaces -cell
        tokens.remove("-cell_drop")
        argv = argv[7:]
    if "-detpixels_drop" in tokens:
        tokens.remove("-detpixels_drop")
        k = argv.index("-detpixels")
        del argv[k:k + 2]
    return argv + tokens


@pytest.mark.parametrize("extra, needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_exit_2_no_output(workdir, capsys, extra, needles):
    before = sorted(p.name for p in workdir.iterdir())
    rc = main(_argv(extra))
    out, err = capsys.readouterr()
    assert rc == 2, out
    assert err.startswith("nbtorch: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert sorted(p.name for p in workdir.iterdir()) == before
    assert not any(name.endswith(".tmp") for name in os.listdir(workdir))


def test_good_base_command_runs(workdir, capsys):
    """The base command of the table is valid: each error above comes from its own flag."""
    assert main(BASE + ["-nonoise", "-nopgm"]) == 0
    assert {"floatimage.bin", "intimage.img"} <= {p.name for p in workdir.iterdir()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_interrupted_run_leaves_no_partial_file(workdir, monkeypatch, capsys):
    """An interrupt while a file is being written leaves no output (not even those before it) nor a temporary file."""
    import nbtorch.io.atomic as atomic

    real_fsync = atomic.os.fsync
    hit = []

    def fsync(fd):
        if ".i.img." in os.readlink(f"/proc/self/fd/{fd}"):  # the int image's temporary file, written
            hit.append(fd)
            raise KeyboardInterrupt
        return real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    before = set(os.listdir(workdir))
    rc = main(BASE + ["-nonoise", "-nopgm", "-floatfile", "f.bin", "-intfile", "i.img"])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    new = set(os.listdir(workdir)) - before
    assert hit and new == set()  # the outputs are written together (#20 point 3)
