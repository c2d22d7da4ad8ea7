"""``nbtorch-refine --images ... --joint --screen``: a serial joint refinement (:func:`refine.many.serial.refine_serial`).

::

    nbtorch-refine --images 'run7_*.cbf' --model @{stem}.model --joint --screen --out-dir out/run7
    nbtorch-refine --images 'run7_*.cbf' 'run8_*.cbf' --model @{stem}.model --joint --add-to out/run7/joint.h5 \\
        --out-dir out/run7-8

``--screen`` refines the images in rounds and drops the ones that do not fit by the rule of
:mod:`refine.many.screening` (a NaN loss, a fit far worse than the others, no diffraction); the run goes on
without them.  Each dropped image is printed with its reason, listed in ``joint.json`` (section ``serial``) and
has its row in ``joint.h5`` (group ``serial``, :mod:`refine.many.serial_file`, with the images' file names).
``--add-to FILE`` (implies ``--screen``) continues a finished screened run: its images must come first in
``--images``, in the same order; they start from their refined values, the shared names from its shared values,
the images it dropped stay dropped, the new images start from their own models.  The file is checked before any
image is loaded (:func:`previous_run`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write
from refine.many.serial import SerialResult, refine_serial
from refine.many.serial_file import load_serial_h5, save_serial_h5
from refine.output.results import jsonable

__all__ = ["previous_run", "refine_screened", "serial_document", "write_serial", "dropped_lines"]

#: the reason of an image that could not be prepared (read, its pixels chosen, its starting scale estimated)
FAILED_START = "failed start"


def _read(path: Path) -> dict:
    """:func:`load_serial_h5` with its errors naming ``--add-to``."""
    if not path.is_file():
        raise InputError(f"--add-to: {path} not found (give a finished --screen run's OUT_DIR/joint.h5)")
    try:
        return load_serial_h5(path)
    except InputError as exc:
        raise InputError(f"--add-to: {str(exc).removeprefix('previous: ')}") from None
    except (KeyError, ValueError, OSError, TypeError) as exc:
        raise InputError(f"--add-to: {path} is not a joint result file of nbtorch-refine ({exc})") from None


def previous_run(path: str, images: Sequence[str], shared_names: Sequence[str], per_image_names: Sequence[str],
                 symmetry: str) -> dict:
    """The finished run of ``--add-to`` (:func:`load_serial_h5`), checked against this run before any image is
    loaded: not more images than now, its images (by file name) the first ones now, the same shared and
    per-image names and crystal system."""
    p = Path(path)
    prev = _read(p)
    m, n = prev["n_images"], len(images)
    if m > n:
        raise InputError(f"--add-to: {p} has {m} images, more than the {n} given now (give its images first, then the "
                         "new ones)")
    for k, (old, new) in enumerate(zip(prev["sources"] or (), images)):
        if Path(old).name != Path(new).name:
            raise InputError(f"--add-to: {p} was refined with {Path(old).name} as image {k + 1}, now {Path(new).name} "
                             "(give its images first, in the same order, then the new ones)")
    differs = [what for what, old, new in (
        ("shared names", list(prev["shared_names"][:len(shared_names)]), list(shared_names)),
        ("per-image names", list(prev["per_image_names"]), list(per_image_names)),
        ("crystal system", prev["symmetry"], symmetry)) if old != new]
    if differs:
        raise InputError(f"--add-to: {p} was written for another joint problem (differs: {', '.join(differs)})")
    return prev


def _subset_previous(previous: dict | None, keep: list[int]) -> dict | None:
    """The ``--add-to`` run renumbered to the images that could be prepared now (``keep``, in order)."""
    if previous is None:
        return None
    pos = {i: j for j, i in enumerate(keep)}
    return {**previous, "n_images": sum(1 for i in keep if i < previous["n_images"]),
            "images": {pos[i]: v for i, v in previous["images"].items() if i in pos},
            "dropped": {pos[i]: d for i, d in previous["dropped"].items() if i in pos}}


def refine_screened(sims: list, pixels: list, starts: list, failed: dict[int, str], previous: dict | None,
                    held: Sequence[int], **joint_kw) -> SerialResult:
    """:func:`refine_serial` over the images that could be prepared; the ``failed`` ones (``{index: message}``, of
    every process) listed as dropped before round 1 (round 0, reason ``failed start (message)``); indices are the
    positions in ``--images``; ``held``: the ones this process loaded (the others' ``sims``, ``pixels`` and
    ``starts`` may be None), which it holds through every round."""
    n = len(sims)
    keep = [i for i in range(n) if i not in failed]
    if not keep:
        first = min(failed)
        raise InputError(f"--images: no image could be prepared (image {first + 1}: {failed[first]})")
    mine = set(held)
    res = refine_serial([sims[i] for i in keep], [pixels[i] for i in keep], image_starts=[starts[i] for i in keep],
                        previous=_subset_previous(previous, keep), local_images=[j for j, i in enumerate(keep)
                                                                                 if i in mine], **joint_kw)
    dropped = {keep[j]: d for j, d in res.dropped.items()}
    dropped.update({i: {"reason": f"{FAILED_START} ({msg})", "round": 0, "values": {}, "fit": {}}
                    for i, msg in failed.items()})
    rounds = tuple({**r, "dropped": [keep[j] for j in r["dropped"]]} for r in res.rounds)
    prev = {"n_images": previous["n_images"]} if previous is not None else {}
    return SerialResult(res.joint, n, tuple(keep[j] for j in res.used), dict(sorted(dropped.items())), rounds,
                        res.rule, res.wall_s, prev)


def serial_document(result: SerialResult, images: Sequence[str], added_to: str | None = None) -> dict:
    """``joint.json``'s section ``serial``: how many images were used and dropped, and each dropped one's file,
    round and reason."""
    names = [Path(i).name for i in images]
    return {"n_images": result.n_images, "n_used": len(result.used), "n_dropped": len(result.dropped),
            "summary": result.summary(), "rule": result.rule, "rounds": list(result.rounds),
            "used": [names[i] for i in result.used],
            "dropped": [{"image": names[i], "index": i, "round": d.get("round", 0), "reason": d["reason"]}
                        for i, d in result.dropped.items()],
            "added_to": added_to, "previous_images": result.previous.get("n_images")}


def write_serial(result: SerialResult, images: Sequence[str], out_dir: Path, added_to: str | None = None
                 ) -> list[str]:
    """``OUT_DIR/joint.json`` (the last round's joint result and the section ``serial``) and ``OUT_DIR/joint.h5``
    (:func:`save_serial_h5`, with the images' file names); the paths written."""
    doc = jsonable(result.joint.to_json_dict())
    doc["serial"] = jsonable(serial_document(result, images, added_to))
    json_path = out_dir / "joint.json"
    with atomic_write(json_path, "w") as fh:
        fh.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    h5_path = save_serial_h5(result, out_dir / "joint.h5", sources=[Path(i).name for i in images])
    return [str(json_path), str(h5_path)]


def dropped_lines(result: SerialResult, images: Sequence[str]) -> list[str]:
    """One printed line per dropped image (its reason), then the count of images used and dropped and why."""
    lines = [f"  {Path(images[i]).name}: dropped in round {d.get('round', 0)}: {d['reason']}"
             for i, d in result.dropped.items()]
    return lines + [result.summary()]
