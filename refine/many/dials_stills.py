"""Many stills of one DIALS file, each refined on its own (issue #44)::

    nbtorch-refine --expt indexed.expt --refl indexed.refl --out-dir out/stills
    nbtorch-refine --expt indexed.expt --refl indexed.refl --images 'moved/*.cbf' --out-dir out/stills
    nbtorch-refine --expt indexed.expt --refl indexed.refl --out-dir out/stills --skip-missing

DIALS leaves serial data (``dials.ssx_index``, ``dials.stills_process``) as one ``.expt`` of many experiments and one
``.refl`` whose ``id`` column names each reflection's experiment.  Every experiment is one still: its image is the
one its imageset names (:func:`nbtorch.io.dials.experiment_image`: a file, or frame ``k`` of an HDF5 master through
``single_file_indices``; a relative path from the ``.expt``'s folder, as dxtbx reads it), or the experiment's entry
of ``--images`` (one per experiment, in their order, to give images that moved); its crystal is the starting
model and its reflections the ``.refl`` rows of its ``id``.  Each is refined as ``--image IMAGE --expt FILE
--expt-index K --refl FILE`` would be, with the still defaults (:mod:`refine.inputs.still_defaults`), through
independent mode (:func:`refine.many.batch.run_batch`): results in ``OUT_DIR/<identifier>/`` (the experiment's
``identifier``; its place where the identifiers are not all distinct file names) and ``summary.csv``/``summary.h5``.
Several ``.expt``/``.refl`` pairs (:mod:`refine.inputs.dials_pairs`) are one set: :func:`pairs_stills` reads every
experiment of every pair, in pair order then experiment order, each still refined from its own pair's files.

Before any work every experiment is checked, and bad input is one line (an :class:`~nbtorch.errors.InputError`,
exit 2, nothing written): an experiment without a crystal or with a scan, a ``.refl`` id that names no experiment
(``-1``, DIALS's unindexed reflections, is ignored), an imageset of several images, a frame past the end of its HDF5
file, crystals of different space groups in a joint run (:func:`check_one_space_group`), and an image that is not
there (the first one named, with the count of the others) unless ``skip_missing``: then those experiments are
skipped, each listed with its reason in the summary (status ``skipped``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from nbtorch.errors import InputError
from refine.many.batch import BatchItem, run_batch

__all__ = ["DialsStill", "read_dials_stills", "relocate_images", "still_items", "experiment_count",
           "run_dials_stills", "file_stills", "pairs_stills", "stills_phrase", "space_group_name",
           "check_one_space_group"]

log = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class DialsStill:
    """One experiment of a serial ``.expt``: its index (the ``id`` of its reflections), identifier, image file and
    frame (None: the file's only image), how many reflections the ``.refl`` gives it, its crystal's space group
    (:func:`space_group_name`), its ``.expt`` and ``.refl`` and their pair's place among several
    (:func:`pairs_stills`)."""

    index: int
    identifier: str
    image: str | None
    frame: int | None
    reflections: int
    space_group: str = ""
    expt: str = ""
    refl: str = ""
    pair: int = 0

    @property
    def label(self) -> str:
        """The image as the summary names it (``file`` or ``file frame k``)."""
        image = self.image or f"experiment {self.index} (no image named)"
        return image if self.frame is None else f"{image} frame {self.frame}"


def _experiment(expt: str, index: int, document: dict | None):
    """Experiment ``index`` of ``expt`` read and checked as a still with a crystal (errors name ``--expt``)."""
    from nbtorch.io.dials import read_expt

    if document is not None:
        exp = document["experiment"][index]
        ident = f" ({exp['identifier']})" if isinstance(exp, dict) and exp.get("identifier") else ""
        if isinstance(exp, dict) and exp.get("crystal") is None:
            raise InputError(f"--expt {expt}: experiment {index}{ident} has no crystal (not indexed); every "
                             "experiment of the file is refined from its crystal")
    try:
        out = read_expt(expt, index, multi_panel=True, document=document)
    except InputError as exc:
        raise InputError(f"--expt {exc}") from None
    if out.scan is not None:
        raise InputError(f"--expt {expt}: experiment {index} is a rotation scan, not a still (a sweep: --images ... "
                         "--rotation-series)")
    return out


def _reflection_counts(refl: str, expt: str, n: int) -> np.ndarray:
    """Reflections per experiment (``id`` column; ``-1``, unindexed, ignored); an id naming no experiment refused."""
    from nbtorch.io.dials import read_refl

    try:
        ids = read_refl(refl, ("id",))["id"].astype(np.int64)
    except InputError as exc:
        raise InputError(f"--refl {exc}") from None
    bad = ids[(ids < -1) | (ids >= n)]
    if len(bad):
        raise InputError(f"--refl {refl}: reflection id {int(bad[0])} names no experiment of --expt {expt} (it has "
                         f"{n}: ids 0..{n - 1}; {len(bad)} such rows)")
    return np.bincount(ids[ids >= 0], minlength=n)


def read_dials_stills(expt: str, refl: str) -> list[DialsStill]:
    """Every experiment of ``expt`` as a :class:`DialsStill` (checked: a still with a crystal, its image named
    by one file), with its count of ``refl`` reflections.

    Raises:
        InputError: one line naming the file and the experiment (module docstring).
    """
    from nbtorch.io.dials import experiment_image

    first = _experiment(expt, 0, None)
    n = first.n_experiments()
    counts = _reflection_counts(refl, expt, n)
    stills = []
    for k in range(n):
        exp = first if k == 0 else _experiment(expt, k, first.document)
        try:
            image, frame = experiment_image(exp)
        except InputError as exc:
            raise InputError(f"--expt {exc}") from None
        group = space_group_name(exp.crystal.get("space_group_hall_symbol"))
        stills.append(DialsStill(k, exp.identifier, image, frame, int(counts[k]), group, str(expt), str(refl)))
    log.info("%s: %d still experiments, %d indexed reflections", expt, n, int(counts.sum()))
    return stills


def space_group_name(hall) -> str:
    """A crystal's space group by its Hermann-Mauguin name (gemmi; its Hall symbol where gemmi cannot say)."""
    text = str(hall or "P 1").strip()
    try:
        import gemmi

        return gemmi.find_spacegroup_by_ops(gemmi.symops_from_hall(text)).hm
    except (ImportError, RuntimeError, ValueError, TypeError, AttributeError):
        return text


def check_one_space_group(stills: Sequence[DialsStill], expt: str) -> None:
    """A joint run's stills: every crystal in one space group (a joint run refines one cell in one symmetry).

    Raises:
        InputError: one line naming the first two experiments whose groups differ and the count of each group.
    """
    groups: dict[str, list[DialsStill]] = {}
    for s in stills:
        groups.setdefault(s.space_group, []).append(s)
    if len(groups) > 1:
        (g0, [s0, *_]), (g1, [s1, *_]) = list(groups.items())[:2]
        counts = ", ".join(f"{len(v)} {g}" for g, v in groups.items())
        which = (f"--expt {expt}: experiments {s0.index} ({g0}) and {s1.index} ({g1})" if s0.expt == s1.expt else
                 f"--expt {s0.expt} experiment {s0.index} ({g0}) and --expt {s1.expt} experiment {s1.index} ({g1})")
        raise InputError(f"{which} are in different space groups ({counts}); a joint run refines one cell: refine "
                         "them without --joint, or one group a run")


def relocate_images(stills: Sequence[DialsStill], images: Sequence[str], expt: str) -> list[DialsStill]:
    """``stills`` with the images ``images`` (one per experiment, in order; frames kept)."""
    if len(images) != len(stills):
        raise InputError(f"--images: {len(images)} images for the {len(stills)} experiments of --expt {expt}; give "
                         "one per experiment, in their order")
    return [replace(s, image=str(image)) for s, image in zip(stills, images)]


def _folder_names(stills: Sequence[DialsStill]) -> list[str]:
    """The experiments' identifiers where all are distinct file names, else their places in ``stills`` (of one
    file: their indices)."""
    names = [s.identifier for s in stills]
    if all(_SAFE_NAME.fullmatch(n) for n in names) and len(set(names)) == len(names):
        return names
    return [str(i) for i in range(len(stills))]


def _check_frame(still: DialsStill, expt: str, dataset: str) -> None:
    """A frame of an HDF5 file that the file holds."""
    from nbtorch.io.hdf5 import h5_frame_count
    from nbtorch.io.images import detect_format

    if still.frame is None or detect_format(still.image) != "hdf5":
        return
    count = h5_frame_count(still.image, dataset)
    if still.frame >= count:
        raise InputError(f"--expt {expt}: experiment {still.index}: frame {still.frame} of {still.image} does not "
                         f"exist (its {dataset} holds {count} frames)")


def still_items(stills: Sequence[DialsStill], expt: str, skip_missing: bool = False,
                dataset: str = "/entry/data/data", own_files: bool = False) -> list[BatchItem]:
    """Independent mode's runs of ``stills``: each image checked before any work (module docstring); ``own_files``
    (stills of several pairs): each item's ``fields`` also its ``expt`` and ``refl`` (and no ``more_pairs``).

    Raises:
        InputError: an image not there (unless ``skip_missing``), a frame past the end of its file.
    """
    missing = [s for s in stills if s.image is None or not Path(s.image).is_file()]
    if missing and not skip_missing:
        s = missing[0]
        more = f" (and {len(missing) - 1} more of the {len(stills)} experiments)" if len(missing) > 1 else ""
        where = f"image {s.image} not found" if s.image else "names no image"
        raise InputError(f"--expt {s.expt or expt}: experiment {s.index}{f' ({s.identifier})' if s.identifier else ''}"
                         f": {where}{more}; --images gives the images' places, --skip-missing skips them")
    items = []
    for s, name in zip(stills, _folder_names(stills)):
        skipped = None
        if s in missing:
            skipped = f"experiment {s.index}: " + ("image not found" if s.image else "names no image")
        else:
            _check_frame(s, s.expt or expt, dataset)
        files = {"expt": s.expt, "refl": s.refl, "more_pairs": ()} if own_files else {}
        fields = {**files, "expt_index": s.index, **({"frame": s.frame} if s.frame is not None else {})}
        items.append(BatchItem(image=s.image or "", name=name, fields=fields, label=s.label, skipped=skipped))
    return items


def experiment_count(expt: str) -> int:
    """How many experiments ``expt`` holds (errors name ``--expt``)."""
    from nbtorch.io.dials import read_expt

    try:
        return read_expt(expt, 0, multi_panel=True).n_experiments()
    except InputError as exc:
        raise InputError(f"--expt {exc}") from None


def file_stills(expt: str, refl: str, images: Sequence[str] | None = None) -> list[DialsStill]:
    """The stills of ``expt``/``refl`` (:func:`read_dials_stills`), ``images`` the experiments' images where given
    (:func:`relocate_images`)."""
    stills = read_dials_stills(expt, refl)
    return relocate_images(stills, images, expt) if images else stills


def pairs_stills(pairs: Sequence[tuple[str, str]], images: Sequence[str] | None = None) -> list[DialsStill]:
    """The stills of every ``.expt``/``.refl`` pair (:func:`read_dials_stills`), in pair order then experiment order,
    each with its pair's place; ``images`` the experiments' images in that order where given. One pair:
    :func:`file_stills`."""
    if len(pairs) == 1:
        return file_stills(*pairs[0], images)
    stills = [replace(s, pair=j) for j, (expt, refl) in enumerate(pairs) for s in read_dials_stills(expt, refl)]
    if images and len(images) != len(stills):
        raise InputError(f"--images: {len(images)} images for the {len(stills)} experiments of the {len(pairs)} --expt "
                         "files; give one per experiment, in pair then experiment order")
    return relocate_images(stills, images, pairs[0][0]) if images else stills


def stills_phrase(stills: Sequence[DialsStill], pairs: Sequence[tuple[str, str]], count: int | None = None) -> str:
    """``N stills of --expt FILE (R reflections in --refl FILE)``, or of several pairs, for the run's first line
    (``count``: N, default every still)."""
    n, r = len(stills) if count is None else count, sum(s.reflections for s in stills)
    if len(pairs) == 1:
        return f"{n} stills of --expt {pairs[0][0]} ({r} reflections in --refl {pairs[0][1]})"
    return f"{n} stills of {len(pairs)} --expt/--refl pairs ({r} reflections)"


def run_dials_stills(pairs: Sequence[tuple[str, str]], stills: Sequence[DialsStill], items: Sequence[BatchItem],
                     run_one: Callable[[BatchItem, Path], int], out_dir: str | Path = "out/batch",
                     say: Callable[[str], None] = print, *, redo: bool = False, quiet: bool = False) -> int:
    """Refine every still of the ``.expt``/``.refl`` ``pairs`` on its own (:func:`refine.many.batch.run_batch`):
    ``items``, those of ``stills`` (:func:`still_items`: each item's ``fields`` its ``expt_index`` and ``frame``);
    the exit status."""
    say(f"nbtorch-refine: {stills_phrase(stills, pairs)}, each refined on its own")
    return run_batch(items, run_one, out_dir, say, redo=redo, quiet=quiet)
