"""Command-line plumbing shared by the experiment scripts: one-line errors, exit status 2.

As for ``nbtorch-refine``: every problem with the input (a flag, a value, a file) is an
:class:`nbtorch.errors.InputError`; :func:`run_main` prints it as ``PROG: error: ...`` on stderr
and returns 2.  The scripts check their arguments before anything is simulated, compiled or
written (:func:`check_outdir` checks the output folder without creating it, :func:`make_outdir`
creates it once everything else has passed).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

from nbtorch.errors import InputError
from nbtorch.io.atomic import check_directory_can_be_made

__all__ = ["Parser", "run_main", "int_at_least", "positive_float", "check_outdir", "make_outdir"]


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one-line :class:`InputError` (no usage block, exit 2 in :func:`run_main`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(message)


def run_main(prog: str, body: Callable[[list[str]], int], argv: Sequence[str] | None) -> int:
    """``body(argv)`` with :class:`InputError` printed as ``PROG: error: ...`` (status 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return body(argv)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
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


def check_outdir(path: str | Path, flag: str = "--outdir") -> Path:
    """Refuse an output folder that cannot be made or written; creates nothing."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{flag} {path}: exists and is not a directory")
    check_directory_can_be_made(p, f"{flag} {path}")
    return p


def make_outdir(path: str | Path, flag: str = "--outdir") -> Path:
    """Create the output folder (and its parents); an OS error becomes an :class:`InputError`."""
    p = check_outdir(path, flag)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot make the directory: {exc.strerror or exc}") from None
    return p
