"""Independent mode: each image of the measurement's ``images`` (``--images``; or each still of one DIALS file) refined
on its own by :func:`refine.modes.single.run`, through :func:`refine.many.batch.run_batch` and
:func:`refine.many.dials_stills.run_dials_stills`; here the job becomes each image's job (:func:`per_image_args`: its
folder's outputs, ``{stem}`` filled in).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from refine.modes.job import Job
from refine.many.batch import PER_IMAGE_OPTIONS, BatchItem, expand_image_list, image_stem, run_batch
from refine.many.dials_stills import DialsStill, experiment_count, pairs_stills, run_dials_stills, still_items

__all__ = ["per_image_args", "many_dials_stills", "run_independent", "stills_of_file", "run_stills_of_file"]


def per_image_args(args: Job, image: str, out_dir: Path, name: str | None = None, **fields) -> Job:
    """The single-image options of ``image``: its folder's output paths (``out_dir/name``, default the image's stem),
    ``{stem}`` (``name``) filled in and the ``fields`` set."""
    stem = name or image_stem(image)
    folder = out_dir / stem
    checkpoint = str(folder / "result.ckpt.h5")
    named = {name: args.get(name).replace("{stem}", stem) for name in PER_IMAGE_OPTIONS
             if isinstance(args.get(name), str) and "{stem}" in args.get(name)}
    return args.with_fields(
        image=image, images=None, problem=None, out=str(folder / "result.h5"), json=str(folder / "result.json"),
        checkpoint=checkpoint, logdir=str(folder / "runs") if args.output.logdir else None,
        report=str(folder / "report.html") if args.output.report else None,
        hkl_out=str(folder / "result.hkl") if args.output.hkl_out else None,  # else --out's .hkl
        quiet=True, resume=bool(args.output.resume) and Path(checkpoint).is_file(), **named, **fields)


def many_dials_stills(args: Job) -> bool:
    """Whether ``args`` ask for the stills of DIALS files: ``--expt`` and ``--refl`` without ``--image`` (nor
    ``--problem``, ``--joint``); with ``--images``, several pairs or an ``--expt`` (no ``{stem}``) of more than one
    experiment."""
    if not (args.dials.expt and args.dials.refl) or args.image.image or args.model.problem or args.many.joint:
        return False
    if not args.images or args.measurement.more_pairs:
        return True
    if "{stem}" in args.dials.expt or "{stem}" in args.dials.refl:
        return False
    return experiment_count(args.dials.expt) > 1


def _one(args: Job, run_one: Callable[[Job], int]) -> Callable[[BatchItem, Path], int]:
    """``run_one`` of an item's own options (:func:`per_image_args`)."""
    def one(item: BatchItem, folder: Path) -> int:
        return run_one(per_image_args(args, item.image, folder.parent, item.name, **item.fields))
    return one


def run_independent(args: Job, run_one: Callable[[Job], int], say: Callable[[str], None] = print) -> int:
    """Every image of ``--images`` refined on its own with ``run_one`` (:func:`refine.modes.single.run`); the exit
    status."""
    items = [BatchItem(image, image_stem(image)) for image in expand_image_list(args.images)]
    return run_batch(items, _one(args, run_one), args.many.out_dir or "out/batch", say, redo=args.many.redo,
                     quiet=args.output.quiet)


def stills_of_file(args: Job) -> tuple[list[DialsStill], list[BatchItem]]:
    """The stills of ``--expt``/``--refl`` (every pair's; ``--images`` relocating them) and independent mode's runs of
    them, each image checked before any work (:func:`refine.many.dials_stills.still_items`; of several pairs, each
    run with its own pair's files)."""
    pairs = args.dials_pairs
    stills = pairs_stills(pairs, expand_image_list(args.images) if args.images else None)
    return stills, still_items(stills, args.dials.expt, args.many.skip_missing, args.image.dataset,
                               own_files=len(pairs) > 1)


def run_stills_of_file(args: Job, run_one: Callable[[Job], int], say: Callable[[str], None] = print,
                       prepared: tuple[list[DialsStill], list[BatchItem]] | None = None) -> int:
    """Every still of ``--expt``/``--refl`` (every pair's) refined on its own with ``run_one`` (``prepared``:
    :func:`stills_of_file`'s result, read here when not given); the exit status."""
    stills, items = prepared or stills_of_file(args)
    return run_dials_stills(args.dials_pairs, stills, items, _one(args, run_one),
                            args.many.out_dir or "out/batch", say, redo=args.many.redo, quiet=args.output.quiet)
