"""``nbtorch-refine``'s entry point: parse at the door (argv -> a measurement and its settings,
:mod:`refine.cli.options`), then the single, independent or joint run of :mod:`refine.modes.entry`.

A refinement that ends diverged or failed still writes its files and exits with status 1; bad input (a missing
file, an image whose shape is not the model's detector, an unknown parameter name, an all-masked image, NaN
pixels, a bad option) prints one line ``nbtorch-refine: error: ...`` on stderr and exits with status 2 before
anything is written; Ctrl-C writes the checkpoint and exits with status 130.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Sequence

from nbtorch.runtime import policy as runtime
from nbtorch.cli.support import Printer, run_main
from refine.cli.options import PROG, Options
from refine.cli.parser import parse_args
from refine.modes.entry import run_job
from refine.solver.runner import RefinementInterrupted

__all__ = ["main", "dispatch"]


def dispatch(args: Options) -> int:
    """Joint (many images, or many stills of one DIALS file), independent (the same) or single mode
    (:func:`refine.modes.entry.run_job`, the library's front door); returns the exit status."""
    return run_job(args, Printer(args.output.quiet))


def _run(argv: list[str]) -> int:
    """Parse at the door, then run; ``--no-compile``: nothing compiled, the esds' forward-mode kernels
    (:mod:`refine.quality.uncertainty`) included."""
    runtime.tune_allocator()
    args = parse_args(argv)
    with runtime.eager() if args.compute.compile is False else contextlib.nullcontext():
        return dispatch(args)


def _interrupted(exc: KeyboardInterrupt) -> str:
    """What follows ``nbtorch-refine: interrupted``: where the checkpoint is and how to go on."""
    if isinstance(exc, RefinementInterrupted) and exc.checkpoint is not None:
        return f"; continue with the same command and --resume (checkpoint {exc.checkpoint})"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nbtorch-refine``; returns the exit status (bad input: one line, 2; Ctrl-C: 130)."""
    return run_main(PROG, _run, argv, interrupted=_interrupted)


if __name__ == "__main__":
    sys.exit(main())
