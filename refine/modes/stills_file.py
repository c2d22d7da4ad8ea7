"""The stills of one DIALS file refined jointly, and the refined ``.expt`` of all of them (issue #44)::

    nbtorch-refine --expt indexed.expt --refl indexed.refl --joint --out-dir out/joint
    nbtorch-refine --expt indexed.expt --refl indexed.refl --out-dir out/stills

``--joint`` with ``--expt`` and ``--refl`` of many still experiments (no ``--image``; ``--images`` relocates the
images, one per experiment) refines the file's stills together (:func:`refine.modes.joint.run_joint`): image ``i`` is
experiment ``i``'s image, read and checked as :mod:`refine.many.dials_stills` reads them (a missing image refused in
one line before any work, or left out with ``--skip-missing``), each prepared as ``--image IMAGE --expt FILE
--expt-index i --refl FILE`` (:func:`still_images`: the per-image fields :func:`refine.modes.joint.image_args` takes).

Both modes write ``OUT_DIR/refined.expt`` (:func:`combined_document`) and ``OUT_DIR/refined.refl``
(:mod:`refine.output.refined_refl`: the observed spots with the refined predictions): the ``--expt`` document with every experiment
(identifiers, imagesets and the other models kept; the images' paths made absolute, those ``--images`` gave
written in), each refined experiment's crystal, beam and detector replaced by
its refined ones; models that came out equal (a shared detector of a joint run) are written once.  Independent mode
takes each still's from its ``OUT_DIR/<name>/refined.expt`` (its ``--expt-out``); an experiment that did not refine
keeps its input models.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from nbtorch.errors import InputError
from refine.modes.job import Job
from refine.many.batch import expand_image_list, item_folder
from refine.modes.independent import many_dials_stills, run_stills_of_file, stills_of_file
from refine.many.dials_stills import (check_one_space_group, experiment_count, pairs_stills, still_items,
                                      stills_phrase)
from refine.many.distributed import Comm
from refine.output.refined_refl import write_refined_refls

__all__ = ["STILLS_SHARED", "stills_shared", "joint_stills", "still_images", "refined_part", "combined_document",
           "concatenated", "write_joint_expt", "write_joint_refl", "run_stills_independent"]

KINDS = ("beam", "detector", "crystal")


#: ``--shared`` of a joint run of one DIALS file's stills: the cell and the detector distance.  The stills share one
#: detector, and a still measures the cell only over the distance (docs/still-from-dials.md): held at the file's
#: value, the distance's error becomes the cell's (1 % on the thaumatin stills at their header distance)
STILLS_SHARED = ("cell", "distance")


def stills_shared(say: Callable[[str], None]) -> tuple[str, ...]:
    """:data:`STILLS_SHARED`, said in the run's first lines."""
    say("  shared: cell and distance (one detector for every still; a still measures the cell over the distance, so "
        "a distance held at the file's would put its error into the cell; --shared cell holds it)")
    return STILLS_SHARED


def joint_stills(args: Job) -> bool:
    """Whether ``args`` ask for the stills of one DIALS file refined jointly: ``--joint`` (not ``--rotation-series``)
    with the ``--expt``/``--refl`` that :func:`refine.modes.independent.many_dials_stills` takes."""
    return bool(args.many.joint and not args.many.rotation_series
                and many_dials_stills(args.with_fields(joint=False)))


def still_images(args: Job, say: Callable[[str], None] = print
                 ) -> tuple[list[str], list[dict], list[tuple[str, str]]]:
    """``(images, per-image fields, skipped)`` of the ``--expt`` stills for :func:`refine.modes.joint.run_joint`: each
    experiment's image (``--images`` in experiment order where given) and ``{"expt_index": k, "frame": ...}``;
    checked before any work (:func:`refine.many.dials_stills.still_items`), a missing image left out with
    ``--skip-missing`` (said; ``skipped``: its label and reason, for the summary table).

    Raises:
        InputError: as :mod:`refine.many.dials_stills` (one line naming the input); crystals of different space
        groups (:func:`~refine.many.dials_stills.check_one_space_group`).
    """
    expt, pairs = args.dials.expt, args.dials_pairs
    stills = pairs_stills(pairs, expand_image_list(args.images) if args.images else None)
    check_one_space_group(stills, expt)
    items = still_items(stills, expt, args.many.skip_missing, args.image.dataset, own_files=len(pairs) > 1)
    for item in items:
        if item.skipped is not None:
            say(f"  skipped: {item.row_label}: {item.skipped}")
    kept = [item for item in items if item.skipped is None]
    if not kept:
        raise InputError(f"--expt {expt}: none of its {len(items)} experiments' images is here (--skip-missing)")
    say(f"nbtorch-refine: {stills_phrase(stills, pairs, len(kept))}, refined jointly")
    return ([item.image for item in kept], [dict(item.fields) for item in kept],
            [(item.row_label, item.skipped) for item in items if item.skipped is not None])


def refined_part(args: Job, sim, values: dict) -> dict:
    """``{"beam", "detector", "crystal"}`` of experiment ``--expt-index`` with ``sim``'s geometry at ``values``
    (``args``: the image's single-run options; a multi-panel detector with every panel)."""
    from nbtorch.dials.geometry import refined_document
    from nbtorch.dials.panels import refined_panels_document
    from refine.inputs.dials import image_index, read_experiment

    dials = args.dials_files
    exp = read_experiment(dials)
    write = refined_panels_document if sim.panel_layout is not None else refined_document
    return _part(write(exp, sim, dict(values), image_index(dials)), exp.index)


def _part(document: dict, index: int) -> dict:
    exp = document["experiment"][index]
    return {kind: copy.deepcopy(document[kind][exp[kind]]) for kind in KINDS}


def combined_document(document: dict, parts: dict[int, dict]) -> dict:
    """A copy of ``document`` with experiment ``k``'s beam, detector and crystal those of ``parts[k]``
    (:func:`refined_part`); equal models written once, and those no experiment uses dropped."""
    doc = copy.deepcopy(document)
    for k, part in parts.items():
        exp = doc["experiment"][k]
        for kind in KINDS:
            doc[kind].append(copy.deepcopy(part[kind]))
            exp[kind] = len(doc[kind]) - 1
    for kind in KINDS:
        models: list = []
        for exp in doc["experiment"]:
            if exp.get(kind) is None:
                continue
            model = doc[kind][exp[kind]]
            if model not in models:
                models.append(model)
            exp[kind] = models.index(model)
        doc[kind] = models
    return doc


def _image_paths(doc: dict, folder: str, images: dict[int, str]) -> None:
    """Each imageset's files as absolute paths (the output is in another folder than the ``.expt``), experiment
    ``k``'s the image it was refined from (``images[k]``: as relocated by ``--images``) where it names one file."""
    def absolute(p):
        return os.path.abspath(os.path.join(folder, p)) if isinstance(p, str) and p else p

    for k, exp in enumerate(doc["experiment"]):
        ref = exp.get("imageset")
        iset = doc.get("imageset", [])[ref] if isinstance(ref, int) and ref < len(doc.get("imageset", [])) else None
        if not isinstance(iset, dict):
            continue
        files = iset.get("images") or []
        if k in images and len(files) == 1:
            iset["images"] = [os.path.abspath(images[k])]
        elif isinstance(files, list):
            iset["images"] = [absolute(f) for f in files]
        if iset.get("template"):
            iset["template"] = os.path.abspath(images[k]) if k in images and not files else absolute(iset["template"])


def concatenated(documents: Sequence[dict]) -> tuple[dict, list[int]]:
    """One ExperimentList of ``documents``: their experiments in order, each model list (``beam``, ``imageset``, ...)
    concatenated and each experiment's references offset (identifiers kept), and the place of each document's first
    experiment in it.  One document is itself; several are changed (give copies)."""
    if len(documents) == 1:
        return documents[0], [0]
    out: dict = {k: v for k, v in documents[0].items() if not isinstance(v, list)}
    firsts = []
    for doc in documents:
        firsts.append(len(out.get("experiment", [])))
        offsets = {k: len(out.get(k, [])) for k, v in doc.items() if isinstance(v, list)}
        for exp in doc.get("experiment", []):
            for kind, ref in exp.items():
                if kind in offsets and kind != "experiment" and type(ref) is int:
                    exp[kind] = ref + offsets[kind]
        for k, v in doc.items():
            if isinstance(v, list):
                out.setdefault(k, []).extend(v)
    return out, firsts


def _write(pairs: Sequence[tuple[str, str]], parts: dict[tuple[int, int], dict], path: Path,
           images: dict[tuple[int, int], str]) -> Path:
    """``path``: :func:`combined_document` of the pairs' ``.expt`` files (:func:`concatenated`) with ``parts``, their
    images' paths absolute (:func:`_image_paths`, each from its own ``.expt``'s folder); ``parts`` and ``images`` by
    ``(pair, experiment)``."""
    from nbtorch.io.dials import read_expt, write_expt

    docs = []
    for j, (expt, _) in enumerate(pairs):
        doc = copy.deepcopy(read_expt(expt, 0, multi_panel=True).document)
        _image_paths(doc, os.path.dirname(os.path.abspath(expt)), {k: im for (p, k), im in images.items() if p == j})
        docs.append(doc)
    doc, firsts = concatenated(docs)
    write_expt(path, combined_document(doc, {firsts[j] + k: part for (j, k), part in parts.items()}))
    return path


def _key(args: Job, one: Job) -> tuple[int, int]:
    """``(pair, experiment)`` of a still's single-run options ``one`` among the pairs of ``args``."""
    expts = [expt for expt, _ in args.dials_pairs]
    return (expts.index(one.dials.expt) if one.dials.expt in expts else 0), int(one.dials.expt_index)


def _firsts(pairs: Sequence[tuple[str, str]]) -> list[int]:
    """The place of each pair's first experiment in the pairs' experiments together."""
    counts = [experiment_count(expt) for expt, _ in pairs[:-1]] if len(pairs) > 1 else []
    return [int(n) for n in np.cumsum([0, *counts])]


def write_joint_expt(args: Job, out_dir: Path, values: dict[int, dict], sims: list, image_args: list) -> Path | None:
    """A joint run's ``OUT_DIR/refined.expt``: every process its held images' parts (``values``: image -> refined
    values; ``image_args``: each image's single-run options), gathered; process 0 writes (the path; None elsewhere)."""
    local = {i: refined_part(image_args[i], sims[i], values[i]) for i in values if sims[i] is not None}
    comm = Comm()
    gathered = comm.gather_objects(local, len(sims))
    if comm.rank != 0:
        return None
    parts = {_key(args, image_args[i]): part for i, part in enumerate(gathered) if part is not None}
    images = {_key(args, a): a.image.image for a in image_args}
    return _write(args.dials_pairs, parts, out_dir / "refined.expt", images)


def write_joint_refl(args: Job, out_dir: Path, values: dict[int, dict], sims: list, spots: list,
                     image_args: list, predicted: dict | None = None) -> Path | None:
    """A joint run's ``OUT_DIR/refined.refl`` (:mod:`refine.output.refined_refl`): every process predicts its held
    images' observed spots at their refined values (``predicted``: those the spot report rendered already, by
    image position), gathered; process 0 writes (the path; None elsewhere)."""
    from nbtorch import eager
    from refine.inputs.spots import spot_offsets

    local, predicted = {}, predicted or {}
    for i in values:
        if sims[i] is not None and spots[i] is not None and len(spots[i]):
            if i in predicted:
                local[i] = (spots[i], predicted[i])
                continue
            with eager():  # a few renders of small windows
                local[i] = (spots[i], spot_offsets(sims[i], dict(values[i]), spots[i]).predicted)
    comm = Comm()
    gathered = comm.gather_objects(local, len(sims))
    if comm.rank != 0:
        return None
    predicted = {_key(args, image_args[i]): p for i, p in enumerate(gathered) if p is not None}
    if not predicted:
        return None
    pairs = args.dials_pairs
    write_refined_refls([refl for _, refl in pairs], _firsts(pairs), predicted, out_dir / "refined.refl")
    return out_dir / "refined.refl"


def run_stills_independent(args: Job, run_one: Callable[[Job], int],
                           say: Callable[[str], None] = print) -> int:
    """:func:`refine.many.dials_stills.run_dials_stills`, each still also writing its ``--expt-out``
    (``OUT_DIR/<name>/refined.expt``), then ``OUT_DIR/refined.expt`` of all (process 0); the exit status."""
    def one(a: Job) -> int:
        return run_one(a.with_fields(expt_out=str(Path(a.output.out).parent / "refined.expt")))

    stills, items = stills_of_file(args)  # read and checked once: the runs and the combined files use them
    code = run_stills_of_file(args, one, say, (stills, items))
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return code
    from nbtorch.io.dials import read_expt

    pairs, out_dir = args.dials_pairs, Path(args.many.out_dir or "out/batch")
    parts, predicted = {}, {}
    for s, item in zip(stills, items):
        folder = item_folder(item, out_dir)
        done = folder / "refined.expt"
        if item.skipped is None and done.is_file() and (folder / "result.json").is_file():
            parts[s.pair, s.index] = _part(read_expt(done, s.index, multi_panel=True).document, s.index)
            spots = json.loads((folder / "result.json").read_text()).get("spots") or {}
            if spots.get("predicted_final") is not None:
                predicted[s.pair, s.index] = (spots["observed"], [[np.nan if v is None else v for v in p[:2]]
                                                                  for p in spots["predicted_final"]])
    path = _write(pairs, parts, out_dir / "refined.expt", {(s.pair, s.index): s.image for s in stills if s.image})
    say(f"refined experiments ({len(parts)} of {len(stills)} refined, the others as given): {path}")
    if predicted:
        counts = write_refined_refls([refl for _, refl in pairs], _firsts(pairs), predicted, out_dir / "refined.refl")
        say(f"refined predictions ({sum(counts.values())} reflections of {len(counts)} stills): "
            f"{out_dir / 'refined.refl'}")
    return code
