"""``nbtorch-refine``'s entry point: parse at the door, then the single, independent or joint run.

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
from refine.cli.joint import run_joint
from refine.cli.options import PROG, Options
from refine.cli.parser import parse_args
from nbtorch.errors import InputError
from refine.cli.single import run
from refine.cli.stills_file import joint_stills, run_stills_independent, still_images
from refine.many.batch import run_batch
from refine.many.dials_stills import many_dials_stills
from refine.solver.runner import RefinementInterrupted

__all__ = ["main", "dispatch"]


def dispatch(args: Options) -> int:
    """Joint (many images, or many stills of one DIALS file), independent (the same) or single mode; returns the
    exit status."""
    stills = joint_stills(args) or many_dials_stills(args)
    if stills and args.dials.expt_out:
        raise InputError(f"--expt-out {args.dials.expt_out}: the stills of one DIALS file are written together, "
                         "every experiment refined, to OUT_DIR/refined.expt")
    if joint_stills(args):
        say = Printer(args.output.quiet)
        return run_joint(args, say, still_images(args, say))
    if args.many.images and args.many.joint:
        return run_joint(args, Printer(args.output.quiet))
    if many_dials_stills(args):
        return run_stills_independent(args, run, Printer(args.output.quiet))
    if args.many.images:
        return run_batch(args, run, Printer(args.output.quiet))
    return run(args)


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
