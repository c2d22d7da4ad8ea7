"""Bad input to the experiment scripts: one line ``PROG: error: ...`` on stderr, exit status 2, nothing written.

Every case fails before anything is compiled or written (milliseconds each), in-process via ``main(argv)``.  The
scripts take nbtorch-refine's options through its own parser and preparation, so they fail with its messages.
"""

from __future__ import annotations

import numpy as np
import pytest

MODEL = "-cell 50 50 50 90 90 90 -default_F 100 -lambda 1 -distance 100 -pixel 0.1 -N 3 -detpixels 32"


@pytest.fixture
def files(tmp_path):
    """Input files for the table: a 24 x 20 image, a regular file, TOML search spaces."""
    from nbtorch.io.smv import write_smv

    write_smv(tmp_path / "obs.img", np.full((20, 24), 5.0, dtype=np.float32))
    write_smv(tmp_path / "obs32.img", np.full((32, 32), 5.0, dtype=np.float32))
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "unknown_key.toml").write_text('problem = "cubic_mosflm"\nbogus_option = 1\n')
    (tmp_path / "model_space.toml").write_text("mosaic_domains = [5, 10]\n")
    (tmp_path / "n_space.toml").write_text("[crystal_size]\nlow = 0\nhigh = 5\n")
    (tmp_path / "adir").mkdir()
    spaces = {
        "malformed": "optimizer = [\n",
        "unknown": "foo = 1\n",
        "reversed": "[lr]\nlow = 1.0\nhigh = 0.1\n",
        "log0": "[lr]\nlow = 0\nhigh = 1\nlog = true\n",
        "nan": "[lr]\nlow = nan\nhigh = 1\n",
        "nohigh": "[lr]\nlow = 0.1\n",
        "badkey": "[lr]\nlow = 0.1\nhigh = 1\nstep = 2\n",
        "badlog": "[lr]\nlow = 0.1\nhigh = 1\nlog = 1\n",
        "optimizer": 'optimizer = ["sgd"]\n',
        "loss": 'loss = ["nope"]\n',
        "empty": "schedule = []\n",
        "range": "[optimizer]\nlow = 1\nhigh = 2\n",
        "scalar": 'lr = "fast"\n',
        "history": "[history_size]\nlow = 2.5\nhigh = 5\n",
        "history0": "history_size = [0, 5]\n",
        "lrlist": "lr = [0.1, -1.0]\n",
    }
    for name, text in spaces.items():
        (tmp_path / f"{name}.toml").write_text(text)
    return tmp_path


def _check(main, argv, files, capsys, prog, expected):
    out = files / "out"
    before = sorted(p.name for p in files.iterdir())
    args = [a.replace("{tmp}", str(files)) for a in argv]
    if "--outdir" not in argv:
        args += ["--outdir", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text.replace("{tmp}", str(files)) in err, err
    assert sorted(p.name for p in files.iterdir()) == before  # nothing written (no out/, no database)
    assert (files / "afile").read_text() == "not a folder\n"


COMMON = [  # (argv, expected fragments of the message): both scripts, nbtorch-refine's checks and messages
    (["--problem", "nonesuch"], ["--problem: unknown name 'nonesuch'"]),
    (["--size", "0"], ["--size: expected an integer >= 16, got 0"]),
    (["--size", "x"], ["--size", "'x'"]),
    (["--image", "{tmp}/nope.cbf", "--model", MODEL], ["nope.cbf", "not found"]),
    (["--image", "{tmp}/obs.img"], ["--model", "required with --image"]),
    (["--model", MODEL], ["give exactly one of --image", "--problem"]),
    (["--image", "{tmp}/obs.img", "--model", MODEL], ["{tmp}/obs.img", "24 x 20", "32 x 32"]),
    (["--image", "{tmp}/obs.img", "--model", "-cell 'x"], ["--model", "quotation"]),
    (["--outdir", "{tmp}/afile"], ["--outdir {tmp}/afile", "not a directory"]),
    (["--outdir", "{tmp}/afile/sub"], ["--outdir {tmp}/afile/sub", "not a directory"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["--config", "{tmp}/nope.toml"], ["--config {tmp}/nope.toml", "not found"]),
    (["--config", "{tmp}/unknown_key.toml"], ["--config {tmp}/unknown_key.toml", "unknown option 'bogus_option'"]),
    (["--images", "{tmp}/obs.img", "{tmp}/obs32.img"], ["--images", "one image"]),
    (["--resume"], ["--resume"]),
    (["--subsample", "2"], ["--subsample", "(0, 1]"]),
    (["--spot-window", "3"], ["--spot-window needs --spots"]),
    (["--fix", "nonsense"], ["--fix", "'nonsense'"]),
    (["--roi", "0", "999", "0", "5"], ["roi"]),
    (["--max-steps", "0"], ["--max-steps", "must be >= 1, got 0"]),
    (["--dtype", "float16"], ["--dtype", "float16"]),
    (["--symmetry", "pentagonal"], ["--symmetry", "pentagonal"]),
    (["--device", "tpu"], ["--device", "tpu"]),
]

STAGE_A = COMMON + [
    (["--steps", "0"], ["--steps", "must be >= 1, got 0"]),
    (["--steps", "-1"], ["--steps", "must be >= 1, got -1"]),
    (["--steps", "1.5"], ["--steps", "integer"]),
    (["--structure-factors", "--space-group", "P1"], ["--structure-factors"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--lr", "inf"], ["--lr", "inf"]),
    (["--lr", "0"], ["--lr", "> 0"]),
    (["--lr", "-0.1"], ["--lr", "> 0"]),
    (["--lr", "x"], ["--lr", "'x'"]),
    (["--rtol", "0"], ["--rtol", "> 0"]),
    (["--rtol", "nan"], ["--rtol", "nan"]),
    (["--phases", "1,7"], ["--phases"]),
    (["--phases", ""], ["--phases"]),
]


@pytest.mark.parametrize("argv,expected", STAGE_A, ids=[" ".join(a) for a, _ in STAGE_A])
def test_stage_a_mapping_bad_input(argv, expected, files, capsys):
    from experiments.stage_a_mapping import PROG, main

    _check(main, ["--phases", "1", *argv], files, capsys, PROG, expected)


def test_stage_a_mapping_cuda_unavailable(files, capsys, monkeypatch):
    import torch

    from experiments.stage_a_mapping import PROG, main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _check(main, ["--device", "cuda"], files, capsys, PROG, ["--device cuda", "not available"])


SWEEP = COMMON + [
    (["--n-trials", "0"], ["--n-trials", "must be >= 1, got 0"]),
    (["--n-trials", "-2"], ["--n-trials", "must be >= 1, got -2"]),
    (["--timeout", "-5"], ["--timeout", "> 0"]),
    (["--timeout", "0"], ["--timeout", "> 0"]),
    (["--timeout", "nan"], ["--timeout", "nan"]),
    (["--workers", "0"], ["--workers", "must be >= 1, got 0"]),
    (["--workers", "-3"], ["--workers", "must be >= 1"]),
    (["--heartbeat", "0"], ["--heartbeat", "must be >= 1"]),
    (["--grace", "0"], ["--grace", "must be >= 1"]),
    (["--grace", "-1"], ["--grace", "must be >= 1"]),
    (["--heartbeat", "5", "--grace", "5"], ["--grace 5", "greater than --heartbeat"]),
    (["--seed", "-1"], ["--seed", "must be >= 0"]),
    (["--sampler-seed", "-1"], ["--sampler-seed", "must be >= 0"]),
    (["--sampler-seed", str(2**32 - 1), "--workers", "2"], ["--sampler-seed", "<="]),
    (["--objective", "nope"], ["--objective", "'nope'"]),
    (["--objective", "spot_rms"], ["--objective spot_rms", "--spots"]),
    (["--objective", "loss"], ["--objective loss", "one loss"]),
    (["--objective", "excess"], ["--objective excess", "poisson"]),
    (["--image", "{tmp}/obs32.img", "--model", MODEL, "--objective", "error"], ["--objective error", "truth"]),
    (["--space", "{tmp}/model_space.toml"], ["mosaic_domains", "--problem"]),
    (["--image", "{tmp}/obs32.img", "--model", MODEL, "--space", "{tmp}/n_space.toml"],
     ["crystal_size.low", ">= 1, got 0"]),
    (["--study", " "], ["--study", "empty"]),
    (["--space", "{tmp}/nope.toml"], ["--space {tmp}/nope.toml", "not found"]),
    (["--space", "{tmp}/adir"], ["--space {tmp}/adir", "directory"]),
    (["--space", "{tmp}/malformed.toml"], ["--space {tmp}/malformed.toml", "not valid TOML"]),
    (["--space", "{tmp}/unknown.toml"], ["unknown name(s) foo", "valid: optimizer"]),
    (["--space", "{tmp}/reversed.toml"], ["lr", "low (1.0) is greater than high (0.1)"]),
    (["--space", "{tmp}/log0.toml"], ["lr.low", "> 0"]),
    (["--space", "{tmp}/nan.toml"], ["lr.low", "finite"]),
    (["--space", "{tmp}/nohigh.toml"], ["lr", "low and high"]),
    (["--space", "{tmp}/badkey.toml"], ["lr", "unknown key(s) step"]),
    (["--space", "{tmp}/badlog.toml"], ["lr", "log must be true or false"]),
    (["--space", "{tmp}/optimizer.toml"], ["optimizer", "'sgd'", "valid: adam, lbfgs"]),
    (["--space", "{tmp}/loss.toml"], ["loss", "'nope'", "poisson"]),
    (["--space", "{tmp}/empty.toml"], ["schedule", "empty list"]),
    (["--space", "{tmp}/range.toml"], ["optimizer", "a range is only for"]),
    (["--space", "{tmp}/scalar.toml"], ["lr", "'fast'"]),
    (["--space", "{tmp}/history.toml"], ["history_size.low", "integer"]),
    (["--space", "{tmp}/history0.toml"], ["history_size", ">= 1, got 0"]),
    (["--space", "{tmp}/lrlist.toml"], ["lr", "> 0, got -1.0"]),
    (["--storage", "bogus://x"], ["--storage bogus://x", "cannot open"]),
    (["--storage", "journal:{tmp}/missing/j.log"], ["--storage journal:{tmp}/missing/j.log", "cannot open"]),
    (["--storage", "sqlite:///{tmp}/missing/x.db"], ["--storage sqlite:///{tmp}/missing/x.db", "cannot open"]),
]


@pytest.mark.parametrize("argv,expected", SWEEP, ids=[" ".join(a) for a, _ in SWEEP])
def test_sweep_bad_input(argv, expected, files, capsys):
    pytest.importorskip("optuna")
    from experiments.sweep import PROG, main

    argv = argv if "--n-trials" in argv else ["--n-trials", "1", *argv]
    _check(main, argv, files, capsys, PROG, expected)


def test_sweep_missing_n_trials(files, capsys):
    pytest.importorskip("optuna")
    from experiments.sweep import PROG, main

    _check(main, [], files, capsys, PROG, ["--n-trials"])


def test_sweep_storage_not_a_database(files, capsys):
    """A storage that opens but holds no optuna schema (a text file as SQLite)."""
    pytest.importorskip("optuna")
    from experiments.sweep import PROG, main

    _check(main, ["--n-trials", "1", "--storage", f"sqlite:///{files / 'afile'}"], files, capsys, PROG,
           ["--storage sqlite:///", "afile"])


def test_sweep_space_accepts_the_documented_forms(tmp_path):
    pytest.importorskip("optuna")
    from experiments.sweep import DEFAULT_SPACE, check_space, load_space

    assert load_space(None)["optimizer"] == DEFAULT_SPACE["optimizer"]
    path = tmp_path / "space.toml"
    path.write_text('optimizer = ["adam"]\nschedule = ["single"]\nloss = ["poisson", "gaussian"]\n'
                    'precondition = ["none", "diagonal"]\nlr = [0.05, 0.1]\n[history_size]\nlow = 3\nhigh = 3\n')
    space = load_space(str(path))
    assert space["lr"] == [0.05, 0.1] and space["history_size"] == {"low": 3, "high": 3, "int": True}
    assert check_space(DEFAULT_SPACE) == DEFAULT_SPACE
    # a measured image: the Poisson loss only, and the starting model's mosaic domains and crystal size
    image = load_space(None, image=True)
    assert image["loss"] == ["poisson"] and image["mosaic_domains"] and image["crystal_size"]["int"] is True
    path.write_text("mosaic_domains = [10]\n[crystal_size]\nlow = 10\nhigh = 20\n")
    image = load_space(str(path), image=True)
    assert image["mosaic_domains"] == [10] and image["crystal_size"] == {"low": 10, "high": 20, "int": True}
