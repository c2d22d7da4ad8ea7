"""The plumbing shared by the command lines (nbtorch.cli.support): printer, parser, @FILE argument files,
output checks; and ``nbtorch @FILE``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from nbtorch.cli.main import main
from nbtorch.cli.support import (Parser, Printer, check_output_dir, check_outputs, expand_argument_files,
                                 make_output_dir, read_argument_file, run_main)
from nbtorch.errors import InputError
from nbtorch.io.raw import read_raw_float

SMALL = "-cell 100 100 100 90 90 90 -default_F 10 -N 3 -detpixels 16 -pixel 0.1 -distance 100 -noprogress"
QUIET_OUTPUTS = ["-nonoise", "-nopgm"]


# --- printer, parser, run_main -----------------------------------------------------------------------


def test_printer_prints_and_is_quiet_on_request(capsys):
    Printer()("a", 1)
    Printer(quiet=True)("hidden")
    assert capsys.readouterr().out == "a 1\n"


def test_printer_survives_a_closed_pipe(monkeypatch):
    class Closed:
        def write(self, text):
            raise BrokenPipeError

        def flush(self):
            raise BrokenPipeError

    monkeypatch.setattr(sys, "stdout", Closed())
    say = Printer()
    say("lost")  # no exception
    assert say.quiet and sys.stdout is not None
    say("also lost")


def test_parser_errors_are_one_line_input_errors():
    p = Parser(prog="x")
    p.add_argument("--count", type=int)
    with pytest.raises(InputError, match="--count") as info:
        p.parse_args(["--count", "many"])
    assert "\n" not in str(info.value)
    with pytest.raises(InputError, match="unrecognized"):
        p.parse_args(["--cou", "3"])  # no abbreviations


def test_run_main_prints_input_errors_on_one_line(capsys):
    def body(argv):
        raise InputError(f"bad {argv[0]}")

    assert run_main("prog", body, ["thing"]) == 2
    assert capsys.readouterr().err == "prog: error: bad thing\n"


def test_run_main_explains_other_failures_and_ctrl_c(capsys):
    """``explain`` turns a failure it recognises into the same one line (status 2) and lets others through;
    ``interrupted`` turns Ctrl-C into ``PROG: interrupted...`` (130); without it Ctrl-C propagates."""
    def oom(argv):
        raise MemoryError("cannot allocate")

    def explain(exc):
        return f"out of memory ({exc})" if isinstance(exc, MemoryError) else None

    assert run_main("prog", oom, [], explain=explain) == 2
    assert capsys.readouterr().err == "prog: error: out of memory (cannot allocate)\n"

    def broken(argv):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        run_main("prog", broken, [], explain=explain)

    def ctrl_c(argv):
        raise KeyboardInterrupt

    assert run_main("prog", ctrl_c, [], interrupted=lambda exc: "; resume with --resume") == 130
    assert capsys.readouterr().err == "prog: interrupted; resume with --resume\n"
    with pytest.raises(KeyboardInterrupt):
        run_main("prog", ctrl_c, [])


# --- argument files -------------------------------------------------------------------------------------


def test_argument_file_tokens_comments_and_quotes(tmp_path):
    f = tmp_path / "flags.txt"
    f.write_text("# geometry\n-distance 100   -pixel 0.1\n\n-floatfile 'my image.bin'  # trailing comment\n")
    assert read_argument_file(f, "x") == ["-distance", "100", "-pixel", "0.1", "-floatfile", "my image.bin"]


def test_argument_files_expand_in_place(tmp_path):
    (tmp_path / "a.txt").write_text("-N 5\n-mat m.mat\n")
    (tmp_path / "m.mat").write_text("")
    got = expand_argument_files(["-cell", "1", f"@{tmp_path / 'a.txt'}", "-pixel", "2"], path_flags=("-mat",))
    assert got == ["-cell", "1", "-N", "5", "-mat", str((tmp_path / "m.mat").resolve()), "-pixel", "2"]


@pytest.mark.parametrize("make, needle", [
    (lambda d: None, "argument file {d}/none.txt not found"),
    (lambda d: (d / "none.txt").mkdir(), "argument file {d}/none.txt is a directory"),
    (lambda d: (d / "none.txt").write_text("-cell 'unbalanced\n"), "cannot split argument file {d}/none.txt"),
    (lambda d: (d / "none.txt").write_bytes(b"\xff\xfe\x00bad"), "cannot read argument file {d}/none.txt"),
])
def test_bad_argument_file_is_one_line_naming_it(tmp_path, make, needle):
    make(tmp_path)
    with pytest.raises(InputError) as info:
        expand_argument_files([f"@{tmp_path}/none.txt"], "--model")
    text = str(info.value)
    assert text.startswith(f"--model @{tmp_path}/none.txt: ") and needle.format(d=tmp_path) in text
    assert "\n" not in text


def test_nbtorch_reads_flags_from_an_argument_file(workdir, capsys):
    text = "# the crystal\n" + SMALL.replace(" -N 3", "\n-N 3\n") + "\n-floatfile 'a b.bin'  # quoted\n"
    (workdir / "flags.txt").write_text(text)
    assert main(["@flags.txt", "-N", "2", *QUIET_OUTPUTS]) == 0  # the command line after the file wins
    assert main([*SMALL.split(), "-N", "2", "-floatfile", "ref.bin", *QUIET_OUTPUTS]) == 0
    np.testing.assert_array_equal(read_raw_float("a b.bin", (16, 16)), read_raw_float("ref.bin", (16, 16)))


def test_nbtorch_missing_argument_file_is_one_line_error(workdir, capsys):
    assert main(["@nope.txt", "-N", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "nbtorch: error: @nope.txt: argument file nope.txt not found\n"
    assert os.listdir(workdir) == []


def test_nbtorch_does_not_overwrite_its_argument_file(workdir, capsys):
    (workdir / "flags.txt").write_text(SMALL)
    assert main(["@flags.txt", "-floatfile", "flags.txt", *QUIET_OUTPUTS]) == 2
    assert "-floatfile flags.txt: would overwrite the @flags.txt input file" in capsys.readouterr().err
    assert (workdir / "flags.txt").read_text() == SMALL


# --- output checks --------------------------------------------------------------------------------------


def test_output_checks(workdir):
    (workdir / "in.txt").write_text("x")
    (workdir / "dir").mkdir()
    cases = [
        ([("-a", "in.txt")], [("-i", "in.txt")], {}, "-a in.txt: would overwrite the -i input file"),
        ([("-a", "o.bin"), ("-b", "./o.bin")], [], {}, "-a and -b both name ./o.bin"),
        ([("-a", "dir")], [], {}, "-a dir: is a directory"),
        ([("-a", "in.txt/o.bin")], [], {}, "-a in.txt/o.bin: in.txt is not a directory"),
        ([("-a", "no/o.bin")], [], {}, "-a no/o.bin: directory no does not exist"),
        ([("-a", "in.txt/x/o.bin")], [], {"make_missing": True}, "in.txt is not a directory"),
        ([("--logdir", "in.txt")], [], {"folders": ("--logdir",)}, "--logdir in.txt: exists and is not a directory"),
    ]
    for outputs, inputs, options, message in cases:
        with pytest.raises(InputError, match=message.replace(".", r"\.")):
            check_outputs(outputs, inputs, **options)
    assert check_outputs({"-a": "no/deeper/o.bin", "-b": None}, make_missing=True) == [Path("no/deeper")]
    assert check_outputs([("--logdir", "new/logs")], folders=("--logdir",), make_missing=True) == []
    assert sorted(os.listdir(workdir)) == ["dir", "in.txt"]  # nothing created


def test_output_dir_checked_then_made(workdir):
    (workdir / "f").write_text("")
    with pytest.raises(InputError, match="--outdir f: exists and is not a directory"):
        check_output_dir("f")
    assert not (workdir / "a").exists() and check_output_dir("a/b").name == "b"
    assert make_output_dir("a/b", "--out").is_dir()


# --- the tools' old module paths ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bench", "gradcheck_report"])
def test_tool_shims_run_the_tools(name):
    """``python -m nbtorch.bench`` and ``python -m nbtorch.gradcheck_report`` run nbtorch.tools' main."""
    import importlib

    shim, tool = importlib.import_module(f"nbtorch.{name}"), importlib.import_module(f"nbtorch.tools.{name}")
    assert shim.main is tool.main
