"""Plumbing shared by the command lines: ``nbtorch``, ``nbtorch-refine`` and the experiment scripts.

* :class:`Printer`: ``print()`` that survives a closed stdout (``nbtorch ... | head``), with a quiet switch;
* :class:`Parser`: argparse whose errors are a one-line :class:`~nbtorch.errors.InputError` (no usage
  block; the commands print it as ``PROG: error: ...`` and exit with status 2), abbreviations off;
* :func:`run_main`: call a command's body, printing an :class:`InputError` (or an explained failure such as
  running out of memory) as that one line with status 2, and Ctrl-C as ``PROG: interrupted`` (130);
* :func:`expand_argument_files`: ``@FILE`` tokens replaced by the tokens of FILE (whitespace or newline
  separated, ``#`` comments, shell quotes);
* :func:`check_outputs`, :func:`check_output_dir`, :func:`make_output_dir`: refuse, before anything
  is computed or written, outputs that would overwrite an input, name one path twice, are folders
  (or files where a folder is wanted) or lie in a folder that is missing or not writable.

Argument types for argparse: :func:`int_at_least`, :func:`positive_float`.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from nbtorch.errors import InputError
from nbtorch.io.atomic import check_directory_can_be_made, check_not_inputs

__all__ = ["Printer", "Parser", "run_main", "int_at_least", "positive_float", "read_argument_file",
           "expand_argument_files", "check_outputs", "check_output_dir", "make_output_dir"]


class Printer:
    """``print()`` to stdout (flushed) that prints nothing when ``quiet``.

    A closed stdout (the reader of a pipe went away) turns the printer quiet and points
    ``sys.stdout`` at the null device, so that the run still writes its files and exits cleanly.
    """

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    def __call__(self, *parts: Any, **kwargs: Any) -> None:
        if self.quiet:
            return
        kwargs.setdefault("flush", True)
        try:
            print(*parts, **kwargs)
        except BrokenPipeError:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
            self.quiet = True


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one-line :class:`InputError` (abbreviated options refused)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(message)


def run_main(prog: str, body: Callable[[list[str]], int], argv: Sequence[str] | None = None, *,
             explain: Callable[[Exception], str | None] | None = None,
             interrupted: Callable[[KeyboardInterrupt], str] | None = None) -> int:
    """Run a command's ``body(argv)`` (``sys.argv[1:]`` when ``argv`` is None) and return its exit status: the one
    place where the commands turn bad input into one line on stderr and status 2.

    * an :class:`InputError` prints ``PROG: error: MESSAGE`` (status 2);
    * another exception for which ``explain(exc)`` gives a line (e.g. out of memory) prints ``PROG: error: LINE``
      (status 2); where ``explain`` is None or gives None, the exception propagates;
    * with ``interrupted``: Ctrl-C prints ``PROG: interrupted`` followed by ``interrupted(exc)`` (e.g. where a
      checkpoint was written; ``""`` for nothing), status 130; without, ``KeyboardInterrupt`` propagates.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return body(argv)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if interrupted is None:
            raise
        print(f"{prog}: interrupted{interrupted(exc)}", file=sys.stderr)
        return 130
    except Exception as exc:
        line = explain(exc) if explain is not None else None
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 2


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


# ------------------------------------------------------------------------------ @FILE argument files


def is_argument_file(token: str) -> bool:
    """``@FILE`` (an ``@`` followed by a name)."""
    return token.startswith("@") and len(token) > 1


def read_argument_file(path: str | os.PathLike[str], label: str) -> list[str]:
    """The tokens of an argument file: separated by blanks or newlines, ``#`` starts a comment, shell quotes
    group (``shlex``).  A missing, unreadable or unbalanced file is an :class:`InputError` starting with
    ``label``."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise InputError(f"{label}: argument file {path} not found") from None
    except IsADirectoryError:
        raise InputError(f"{label}: argument file {path} is a directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise InputError(f"{label}: cannot read argument file {path}: {why}") from None
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise InputError(f"{label}: cannot split argument file {path}: {exc}") from None


def expand_argument_files(tokens: Iterable[str], label: str = "", path_flags: Sequence[str] = ()) -> list[str]:
    """``tokens`` with every ``@FILE`` replaced, in place, by the tokens of FILE (:func:`read_argument_file`;
    an ``@`` inside a file is not expanded again).

    The value of a flag in ``path_flags`` read from FILE, when relative and missing from the working
    directory, is looked up beside FILE (an args file kept next to its matrix or HKL file).  Errors start
    with ``label`` (e.g. ``--model``) and the token.
    """
    out: list[str] = []
    for tok in tokens:
        if not is_argument_file(tok):
            out.append(tok)
            continue
        path = Path(tok[1:])
        inner = read_argument_file(path, f"{label} {tok}".strip())
        for i, t in enumerate(inner):
            if i > 0 and inner[i - 1] in path_flags and not os.path.isabs(t) and not os.path.exists(t):
                beside = path.parent / t
                if beside.exists():
                    t = str(beside.resolve())
            out.append(t)
    return out


def argument_files(tokens: Iterable[str], label: str = "") -> list[tuple[str, str]]:
    """``(label or @FILE, FILE)`` of the ``@FILE`` tokens: inputs that no output may overwrite."""
    return [(label or tok, tok[1:]) for tok in tokens if is_argument_file(tok)]


# ------------------------------------------------------------------------------ outputs


def check_outputs(outputs: Mapping[str, str | None] | Iterable[tuple[str, str | None]],
                  inputs: Iterable[tuple[str, str | None]] = (), *, folders: Sequence[str] = (),
                  make_missing: bool = False) -> list[Path]:
    """Refuse outputs that cannot be written, before anything is computed; creates nothing.

    ``outputs`` are ``(flag, path)`` pairs (or a mapping; empty paths are skipped): files, or folders
    for the flags in ``folders``.  Refused: an output that is one of ``inputs`` (it would be
    overwritten, :func:`nbtorch.io.atomic.check_not_inputs`), two flags naming one path, a file output
    that is a directory, a folder output that is a file, and a file whose folder is not a writable
    directory.  ``make_missing``: a missing folder is fine if it can be made (its nearest existing
    ancestor is a writable directory); else it must exist.  Returns the missing folders of file outputs,
    to create just before writing (folder outputs are left to their writer).
    """
    pairs = list(outputs.items()) if isinstance(outputs, Mapping) else list(outputs)
    pairs = [(flag, str(path)) for flag, path in pairs if path]
    check_not_inputs(inputs, pairs)
    seen: dict[str, str] = {}
    to_make: list[Path] = []
    for flag, path in pairs:
        label = f"{flag} {path}"
        key = os.path.abspath(path)
        if key in seen:
            raise InputError(f"{seen[key]} and {flag} both name {path}: give them different names")
        seen[key] = flag
        p = Path(path)
        if flag in folders:
            if p.exists() and not p.is_dir():
                raise InputError(f"{label}: exists and is not a directory")
            check_directory_can_be_made(p, label)
            continue
        if p.is_dir():
            raise InputError(f"{label}: is a directory")
        parent = p.parent if str(p.parent) else Path(".")
        if parent.exists() and not parent.is_dir():
            raise InputError(f"{label}: {parent} is not a directory")
        if make_missing:
            check_directory_can_be_made(parent, label)
            if not parent.exists():
                to_make.append(parent)
            continue
        if not parent.is_dir():
            raise InputError(f"{label}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise InputError(f"{label}: directory {parent} is not writable")
    return to_make


def check_output_dir(path: str | os.PathLike[str], flag: str = "--outdir") -> Path:
    """Refuse an output folder that cannot be made or written; creates nothing."""
    check_outputs([(flag, str(path))], folders=(flag,))
    return Path(path)


def make_output_dir(path: str | os.PathLike[str], flag: str = "--outdir") -> Path:
    """Create the output folder (and its parents) after :func:`check_output_dir`; an OS error becomes an
    :class:`InputError`."""
    p = check_output_dir(path, flag)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot make the directory: {exc.strerror or exc}") from None
    return p
