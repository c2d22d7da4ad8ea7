"""nbtorch-refine: every bad input is one line on stderr, exit status 2, and no output file."""

from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import CRYSTAL, SMALL_MODEL
from nbtorch.io import write_cbf, write_raw_float


@pytest.fixture
def images(tmp_path):
    """A valid 32 x 32 CBF, an all-gap CBF, a float image with a NaN, and a 40 x 40 CBF."""
    rng = np.random.default_rng(0)
    write_cbf(tmp_path / "ok.cbf", rng.integers(0, 10, (32, 32)).astype(np.int32), {"pixel_size_mm": 0.1})
    write_cbf(tmp_path / "gaps.cbf", -np.ones((32, 32), dtype=np.int32))
    nan = rng.random((32, 32)).astype(np.float32)
    nan[4, 5] = np.nan
    write_raw_float(tmp_path / "nan.bin", nan)
    write_cbf(tmp_path / "big.cbf", np.zeros((40, 40), dtype=np.int32))
    (tmp_path / "dials.txt").write_text("-2 1 3 0 33.0 7.5 9.5 0.5\n1 1 -4 0 12.0 20.5 3.5 0.5\n")  # h k l id I x y z
    (tmp_path / "two.txt").write_text("x y\n7.5 9.5\n20.5 3.5\n")  # two spots on the 32 x 32 detector
    (tmp_path / "off.txt").write_text("x y\n7.5 9.5\n33.5 3.5\n")  # the second spot is off the 32 x 32 detector
    return tmp_path


CASES = {
    "missing image": (["--image", "nope.cbf", "--model", SMALL_MODEL], "nope.cbf: image file not found"),
    "shape mismatch": (["--image", "big.cbf", "--model", SMALL_MODEL], "image is 40 x 40 pixels (fast x slow) but the "
                                                                        "model's detector is 32 x 32"),
    "unknown parameter": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--refine", "cell,wobble"],
                          "unknown parameter or group 'wobble'"),
    "tied cell value": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--symmetry", "tetragonal", "--refine", "cell_b"],
                        "cell_b is not a free cell value"),
    "all masked": (["--image", "gaps.cbf", "--model", SMALL_MODEL], "every pixel is masked"),
    "NaN pixels": (["--image", "nan.bin", "--shape", "32", "32", "--model", SMALL_MODEL], "1 NaN/Inf pixel(s)"),
    "raw without shape": (["--image", "nan.bin", "--model", SMALL_MODEL], "needs its shape (--shape SLOW FAST)"),
    "no model": (["--image", "ok.cbf"], "--model"),
    "spot columns without spots": (["--problem", "cubic_mosflm", "--size", "16", "--spot-columns", "x,y"],
                                   "--spot-columns names the columns of a --spots file"),
    "prior without sigma": (["--problem", "cubic_mosflm", "--size", "16", "--prior", "cell_a=5"],
                            "--prior cell_a: expected mean:sigma, got '5'"),
    "prior sigma zero": (["--problem", "cubic_mosflm", "--size", "16", "--prior", "cell_a=5:0"],
                         "--prior cell_a: sigma must be finite and > 0, got 0"),
    "prior unknown name": (["--problem", "cubic_mosflm", "--size", "16", "--prior", "wobble=1:2"],
                           "--prior: unknown parameter 'wobble'"),
    "bad model flag": (["--image", "ok.cbf", "--model", CRYSTAL + " -frobnicate 3"], "-frobnicate"),
    "image and problem": (["--image", "ok.cbf", "--problem", "cubic_mosflm"], "exactly one of --image"),
    "unknown problem": (["--problem", "nonesuch"], "--problem: unknown name 'nonesuch'"),
    "problem too small": (["--problem", "cubic_mosflm", "--size", "8"], "--size: expected an integer >= 16, got 8"),
    "unknown start name": (["--problem", "cubic_mosflm", "--size", "16", "--start", "cell_q=3"],
                           "unknown parameter 'cell_q'"),
    "bad start value": (["--problem", "cubic_mosflm", "--size", "16", "--start", "cell_a=big"], "not a number"),
    "unknown symmetry": (["--problem", "cubic_mosflm", "--size", "16", "--symmetry", "P99"], "unknown crystal system"),
    "unknown loss": (["--problem", "cubic_mosflm", "--size", "16", "--loss", "chi9"],
                     "unknown loss 'chi9'; valid: poisson, poisson_nll, gaussian, mse, huber, log, ncc"),
    "unknown option": (["--problem", "cubic_mosflm", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    "bad optimizer": (["--problem", "cubic_mosflm", "--optimizer", "sgd"], "invalid choice: 'sgd'"),
    "refine and stages": (["--problem", "cubic_mosflm", "--refine", "cell", "--stages", "stage_a"], "drop one"),
    "unknown schedule": (["--problem", "cubic_mosflm", "--stages", "stage_z"], "unknown schedule"),
    "bad roi": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--roi", "0", "40", "0", "10"], "--roi 0 40 0 10"),
    "bad subsample": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--subsample", "1.5"], "--subsample"),
    "resume without checkpoint": (["--problem", "cubic_mosflm", "--resume"], "checkpoint result.ckpt.h5 not found"),
    "missing config": (["--config", "none.toml"], "--config none.toml: file not found"),
    "output under a file": (["--problem", "cubic_mosflm", "--out", "ok.cbf/sub/r.h5"], "ok.cbf is not a directory"),
    "logdir is a file": (["--problem", "cubic_mosflm", "--logdir", "ok.cbf"], "exists and is not a directory"),
    "out is a directory": (["--problem", "cubic_mosflm", "--out", "."], "is a directory"),
    "missing mask": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--mask", "m.img"], "m.img: image file not found"),
    "out overwrites image": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--out", "ok.cbf"],
                             "--out ok.cbf: would overwrite the --image input file"),
    "json overwrites mask": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--mask", "big.cbf", "--json", "big.cbf"],
                             "--json big.cbf: would overwrite the --mask input file"),
    "json overwrites hkl": (["--image", "ok.cbf", "--model", SMALL_MODEL + " -hkl gaps.cbf", "--json", "./gaps.cbf"],
                            "would overwrite the --model -hkl input file"),
    "negative seed": (["--problem", "cubic_mosflm", "--subsample", "0.5", "--seed", "-1"], "--seed: must be >= 0"),
    "unknown device": (["--problem", "cubic_mosflm", "--device", "tpu"], "--device tpu: expected cpu, cuda, cuda:N or a list of cuda:N"),
    "impossible start angle": (["--problem", "cubic_mosflm", "--size", "16", "--symmetry", "triclinic",
                                "--start", "cell_alpha=180"],
                               "start: cell alpha: angle must be between 0 and 180"),
    "start angles no cell": (["--problem", "cubic_mosflm", "--size", "16", "--symmetry", "triclinic",
                              "--start", "cell_alpha=60,cell_beta=60,cell_gamma=130"], "do not make a unit cell"),
    "negative start N": (["--problem", "cubic_mosflm", "--size", "16", "--start", "N_a=-2"], "N_a=-2 is impossible"),
    "off-diagonal N without the shape": (["--problem", "cubic_mosflm", "--size", "16", "--refine", "scale,Ndef"],
                                         "N_d, N_e, N_f: the off-diagonal crystal sizes act only with "
                                         "-gauss_aniso_xtal in the model flags (the crystal shape is square)"),
    "size matrix not positive definite": (["--problem", "cubic_mosflm", "--size", "16", "--start", "N_d=30"],
                                          "start: N_a .. N_f: the size matrix [[Na Nd Nf] [Nd Nb Ne] [Nf Ne Nc]]"),
    "gauss_aniso size matrix": (["--image", "ok.cbf", "--model", SMALL_MODEL + " -gauss_aniso_xtal -Nd 5 -Ne 5",
                                 "--refine", "Ndef"], "-gauss_aniso_xtal: the size matrix"),
    "empty refine": (["--problem", "cubic_mosflm", "--refine", ","], "--refine: no names given"),
    "refine and fix": (["--problem", "cubic_mosflm", "--refine", "cell_a,scale", "--fix", "cell_a"],
                       "--refine and --fix both name cell_a"),
    "negative time budget": (["--problem", "cubic_mosflm", "--time-budget", "-5"], "--time-budget: must be a positive"),
    "zero checkpoint period": (["--problem", "cubic_mosflm", "--checkpoint-every", "0"], "--checkpoint-every"),
    "zero tb period": (["--problem", "cubic_mosflm", "--tb-every", "0"], "--tb-every: must be a positive"),
    "nan saturation": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--saturation", "nan"], "--saturation"),
    "dataset of a cbf": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--dataset", "/nope"],
                         "--dataset /nope: ok.cbf is a cbf file, not HDF5"),
    "bounds reversed": (["--problem", "cubic_mosflm", "--bounds", "cell_a=50:40"],
                        "--bounds cell_a: need finite low < high, got '50:40'"),
    "bounds not numbers": (["--problem", "cubic_mosflm", "--bounds", "cell_a=40"], "--bounds cell_a: expected low:high"),
    "bounds nan": (["--problem", "cubic_mosflm", "--bounds", "cell_a=nan:50"], "--bounds cell_a: need finite"),
    "too few spots": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--spots", "two.txt", "--too-few-spots", "fail",
                       "--start", "scale=1,background=1"],
                      "2 observed spots in the fitted region for 15 refined parameters"),
    "spot table without header": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--spots", "dials.txt"],
                                  "spot list dials.txt: 8 columns and no header naming them"),
    "spots off the detector": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--spots", "off.txt"],
                               "1 of 2 positions fall outside the 32 x 32 pixel detector (line 3: x=33.5, y=3.5"),
    "spot columns off the detector": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--spots", "dials.txt",
                                       "--spot-columns", "1,2"], "positions fall outside"),
    "spot columns unknown name": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--spots", "off.txt",
                                   "--spot-columns", "xobs,yobs"], "--spot-columns: no column 'xobs' in the header"),
    "dmin above dmax": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--dmin", "5", "--dmax", "2"], "--dmin 5"),
    "negative axis mosaic spread": (["--image", "ok.cbf", "--model", SMALL_MODEL + " -mosaic_abc 0.2 -0.1 0.2"],
                                    "-mosaic_abc: expected three finite spreads >= 0 (deg), got 0.2 -0.1 0.2"),
    "axis mosaic spread nan": (["--image", "ok.cbf", "--model", SMALL_MODEL + " -mosaic_abc 0.2 nan 0.2"],
                               "-mosaic_abc: value is NaN"),
    "axis mosaic spreads in c parity": (["--image", "ok.cbf", "--model", SMALL_MODEL + " -c_parity",
                                         "--refine", "mosaic_aniso,scale"],
                                        "mosaic_spread_a/b/c: the anisotropic mosaic is a spec-mode model"),
    "axis mosaic spread start": (["--problem", "cubic_mosflm", "--size", "16", "--refine", "mosaic_aniso",
                                  "--start", "mosaic_spread_b=-0.1"], "start: mosaic_spread_b=-0.1 is impossible"),
    # options of a measured image's file, given with a simulated problem: refused (they were taken and ignored)
    "frame of a problem": (["--problem", "cubic_mosflm", "--size", "16", "--frame", "3"],
                           "--frame: describes a measured --image file; --problem cubic_mosflm is simulated"),
    "mask of a problem": (["--problem", "cubic_mosflm", "--size", "16", "--mask", "ok.cbf"], "--mask: describes"),
    "saturation of a problem": (["--problem", "cubic_mosflm", "--size", "16", "--saturation", "100"],
                                "--saturation: describes"),
    "mask-nan of a problem": (["--problem", "cubic_mosflm", "--size", "16", "--mask-nan"], "--mask-nan: describes"),
    "expt-image without expt": (["--image", "ok.cbf", "--model", SMALL_MODEL, "--expt-image", "2"],
                                "--expt-image: the image of an --expt rotation scan that --image is; give --expt"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_error_is_one_line_exit_2(refine_cli, images, case):
    argv, expected = CASES[case]
    r = refine_cli(*argv)
    assert r.code == 2, (r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("nbtorch-refine: error: ")
    assert expected in lines[0]
    assert not (r.tmp / "result.h5").exists() and not (r.tmp / "result.json").exists()
    assert (r.tmp / "ok.cbf").read_bytes().startswith(b"###CBF"), "an input file was overwritten"


def test_bad_config_key(refine_cli, tmp_path):
    (tmp_path / "c.toml").write_text('problem = "cubic_mosflm"\nwobble = 3\n')
    r = refine_cli("--config", "c.toml")
    assert r.code == 2 and r.err.count("\n") == 1 and "unknown option 'wobble'" in r.err


def test_help_exits_0(refine_cli):
    with pytest.raises(SystemExit) as info:
        refine_cli("--help")
    assert info.value.code == 0
