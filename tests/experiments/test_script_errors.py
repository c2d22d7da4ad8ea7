"""Bad input to the experiment scripts: one line ``PROG: error: ...`` on stderr, exit status 2, nothing written.

Every case fails before anything is simulated or compiled (milliseconds each), in-process via ``main(argv)``.
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
    (tmp_path / "afile").write_text("not a folder\n")
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


COMMON = [  # (argv, expected fragments of the message): both scripts
    (["--problem", "nonesuch"], ["--problem: unknown name 'nonesuch'"]),
    (["--size", "0"], ["--size: expected an integer >= 16, got 0"]),
    (["--size", "x"], ["--size", "'x'"]),
    (["--image", "{tmp}/nope.cbf", "--model", MODEL], ["nope.cbf", "not found"]),
    (["--image", "{tmp}/obs.img"], ["--image and --model go together"]),
    (["--model", MODEL], ["--image and --model go together"]),
    (["--image", "{tmp}/obs.img", "--model", MODEL], ["--image {tmp}/obs.img", "24 x 20", "32 x 32"]),
    (["--image", "{tmp}/obs.img", "--model", "-cell 'x"], ["--model", "quotation"]),
    (["--outdir", "{tmp}/afile"], ["--outdir {tmp}/afile", "not a directory"]),
    (["--outdir", "{tmp}/afile/sub"], ["--outdir {tmp}/afile/sub", "not a directory"]),
    (["--steps", "0"], ["--steps", "must be >= 1, got 0"]),
    (["--steps", "-1"], ["--steps", "must be >= 1, got -1"]),
    (["--steps", "1.5"], ["--steps", "integer"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
]

STAGE_A = COMMON + [
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--lr", "inf"], ["--lr", "inf"]),
    (["--lr", "0"], ["--lr", "> 0"]),
    (["--lr", "-0.1"], ["--lr", "> 0"]),
    (["--lr", "x"], ["--lr", "'x'"]),
    (["--rtol", "0"], ["--rtol", "> 0"]),
    (["--rtol", "nan"], ["--rtol", "nan"]),
    (["--phases", "1,7"], ["--phases"]),
    (["--phases", ""], ["--phases"]),
    (["--dtype", "float16"], ["--dtype", "float16"]),
    (["--symmetry", "pentagonal"], ["--symmetry", "pentagonal"]),
    (["--device", "tpu"], ["--device", "tpu"]),
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
    (["--seed", str(2**32 - 1), "--workers", "2"], ["--seed", "<="]),
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
