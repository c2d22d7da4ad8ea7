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

from nbtorch import runtime
from nbtorch.cli_support import Printer
from nbtorch.errors import InputError
from refine.cli.joint import run_joint
from refine.cli.options import PROG, Options
from refine.cli.parser import parse_args
from refine.cli.single import run
from refine.many.batch import run_batch
from refine.solver.runner import RefinementInterrupted

__all__ = ["main", "dispatch"]


def dispatch(args: Options) -> int:
    """Joint, independent or single mode; returns the exit status."""
    if args.many.images and args.many.joint:
        return run_joint(args, Printer(args.output.quiet))
    if args.many.images:
        return run_batch(args, run, Printer(args.output.quiet))
    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nbtorch-refine``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    runtime.tune_allocator()
    try:
        args = parse_args(argv)
        # --no-compile: nothing compiled, the esds' forward-mode kernels (refine.quality.uncertainty) included
        with runtime.eager() if args.compute.compile is False else contextlib.nullcontext():
            return dispatch(args)
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        where = ""
        if isinstance(exc, RefinementInterrupted) and exc.checkpoint is not None:
            where = f"; continue with the same command and --resume (checkpoint {exc.checkpoint})"
        print(f"{PROG}: interrupted{where}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
