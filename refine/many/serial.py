"""A serial joint refinement: thousands of stills, the ones that do not fit dropped, more added later.

:func:`refine_serial` runs :func:`refine.many.joint.refine_joint` in **rounds**:

1. every image (without esds, at most ``screen_steps`` steps); the rule of :mod:`refine.many.screening` (its
   lenient first-round form) names the images that plainly do not fit;
2. the images kept, each from its values at the end of round 1 (the shared ones too), with esds; screened again;
   while images are dropped and ``max_rounds`` allows, once more.

The run goes on without the dropped images; each is listed with its reason and its values when dropped
(:class:`SerialResult`).  The last round always refines the kept images from the previous round's values, so
the shared values and esds are those of the kept images alone.  Everything is the same in every process, for
any number of processes and any assignment of the images to them (the rounds are :func:`refine_joint` runs,
whose results are; the rule is applied to gathered values), so 1 and 2 processes give the same bits.

**More images** (data arriving during a beam time): ``previous=`` a :class:`SerialResult` or its HDF5 file
(:func:`refine.many.serial_file.save_serial_h5`) of a finished run whose images are the first ones passed now:
those start from their refined values (the ones it dropped stay dropped, reason ``"dropped before: ..."``), the
shared names from its shared values, the new images from their own starts; then the rounds as above.

**Several processes** (torchrun): each process holds a fixed set of the images for the whole run (by default
:func:`refine.many.distributed.image_shard`'s contiguous block of all ``n``; ``local_images=`` names another) and
needs only their simulators and pixels (the others may be None): every round refines the used images of each
process's set (:func:`refine_joint`'s ``local_images``), so a process's memory is its share of the images however
many are dropped.  The steps wait for the slowest process: one whose set loses many images to the rule idles.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from nbtorch.errors import InputError
from refine.fitting.parameters import BASE_NAMES, ORIENTATION_DELTAS
from refine.many.distributed import Comm, held_images
from refine.many.joint import DEFAULT_CONVERGENCE, JointResult, refine_joint
from refine.many.screening import ScreeningRule, screen

__all__ = ["SerialResult", "refine_serial"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SerialResult:
    """A serial run: the last round's :class:`JointResult` over the ``used`` images (their indices in the
    run's list, in the joint result's order) and the ``dropped`` ones: ``{index: {"reason", "round",
    "values", "fit"}}`` (values and fit at the end of the round that dropped it).  ``rounds``: per round the
    images refined, steps, status, wall seconds and the indices it dropped."""

    joint: JointResult
    n_images: int
    used: tuple
    dropped: dict
    rounds: tuple
    rule: str
    wall_s: float
    previous: dict = field(default_factory=dict)

    @property
    def shared(self) -> dict:
        return self.joint.shared

    @property
    def shared_esds(self) -> dict:
        return self.joint.shared_esds

    def summary(self) -> str:
        """One paragraph: images used and dropped, and why."""
        reasons: dict[str, int] = {}
        for d in self.dropped.values():
            key = d["reason"].split(" (")[0]
            reasons[key] = reasons.get(key, 0) + 1
        why = "; ".join(f"{k}: {v}" for k, v in sorted(reasons.items())) or "none"
        esds = ", ".join(f"{k} {v:.6g} +- {self.shared_esds.get(k, math.nan):.2g}" for k, v in self.shared.items()
                         if k in self.joint.shared_names or k in self.shared_esds)
        return (f"{self.n_images} images: {len(self.used)} used, {len(self.dropped)} dropped ({why}); "
                f"{len(self.rounds)} rounds, {self.joint.status.value}; {esds}")


def _restart(values: Mapping[str, float]) -> dict:
    """A result's canonical values as a start: base names only, the orientation folded into the misset."""
    return {k: float(v) for k, v in values.items() if k in BASE_NAMES and k not in ORIENTATION_DELTAS}


def _previous(previous, n: int) -> tuple[dict, dict, dict, int]:
    """``(shared start, {index: start}, {index: dropped row}, its number of images)`` from a finished run
    (object or file)."""
    if previous is None:
        return {}, {}, {}, 0
    if isinstance(previous, (str, Path)):
        from refine.many.serial_file import load_serial_h5

        previous = load_serial_h5(previous)
    if isinstance(previous, SerialResult):
        if previous.n_images > n:
            raise InputError(f"previous: the finished run had {previous.n_images} images, more than the {n} given now")
        starts = {i: _restart(previous.joint.images[j]) for j, i in enumerate(previous.used)}
        return _restart(previous.joint.shared), starts, dict(previous.dropped), previous.n_images
    if not isinstance(previous, Mapping) or "shared" not in previous:
        raise InputError(f"previous: expected a SerialResult or its HDF5 file, got {type(previous).__name__}")
    m = int(previous["n_images"])
    if m > n:
        raise InputError(f"previous: the finished run had {m} images, more than the {n} given now")
    return (_restart(previous["shared"]), {int(i): _restart(v) for i, v in previous["images"].items()},
            {int(i): dict(v) for i, v in previous["dropped"].items()}, m)


def _round_rows(result: JointResult) -> tuple[list[float], list[float]]:
    """Each image's excess (or loss per fitted pixel without a Poisson fit) and scale."""
    if result.image_fit:
        excess = [float(f["excess"]) if math.isfinite(f["loss"]) else math.nan for f in result.image_fit]
    else:
        excess = list(result.image_losses)
    return excess, [float(v.get("scale", math.nan)) for v in result.images]


def refine_serial(simulators: Sequence[Any], observed_images: Sequence[Any], masks=None, *, image_starts=None,
                  start: Mapping[str, float] | None = None, rule: ScreeningRule = ScreeningRule(),
                  max_rounds: int = 3, screen_steps: int = 12, previous=None, esds: bool = True,
                  checkpoint: str | Path | None = None, local_images: Sequence[int] | None = None,
                  comm: Comm | None = None, **joint_kw: Any) -> SerialResult:
    """Refine the images in rounds, dropping those that do not fit (module docstring).

    Arguments:
        simulators, observed_images, masks, image_starts, start: as for :func:`refine_joint`; under torchrun only
            the images this process holds are used (the others may be None).
        rule: the :class:`ScreeningRule`; ``max_rounds``: at most this many joint loops (>= 2).
        screen_steps: round 1's step limit (it only has to tell the bad images from the good; a bad image slows
            a loop's convergence, so the full convergence is left to the rounds without it).
        previous: a finished :class:`SerialResult` (or its HDF5 file) whose images are the first ones here.
        checkpoint: round ``k``'s checkpoint is ``<stem>.round<k><suffix>`` beside it.
        local_images: the positions of the images this process holds through every round (each image in exactly
            one process; default :func:`~refine.many.distributed.image_shard`'s block of all ``n``).
        comm: the processes (default :class:`~refine.many.distributed.Comm`).
        joint_kw: the rest of :func:`refine_joint`'s arguments (``shared``, ``per_image``, ``symmetry``, ...).
    """
    t0 = time.monotonic()
    n = len(simulators)
    if len(observed_images) != n:
        raise InputError(f"observed_images: expected one image per simulator ({n}), got {len(observed_images)}")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 2:
        raise InputError(f"max_rounds: expected an integer >= 2, got {max_rounds!r}")
    if isinstance(screen_steps, bool) or not isinstance(screen_steps, int) or screen_steps < 1:
        raise InputError(f"screen_steps: expected an integer >= 1, got {screen_steps!r}")
    comm = comm or Comm()
    held = set(held_images(comm, n, local_images))
    shared0, prev_starts, dropped, n_previous = _previous(previous, n)
    dropped = {i: {**d, "reason": d["reason"] if d["reason"].startswith("dropped before")
                   else f"dropped before: {d['reason']}"} for i, d in dropped.items()}
    starts = [{**((image_starts[i] or {}) if image_starts is not None else {}), **prev_starts.pop(i, {})}
              if i in held else None for i in range(n)]  # this process's images' only
    shared_start = {**(start or {}), **shared0}
    used = [i for i in range(n) if i not in dropped]
    rounds: list[dict] = []
    result = None
    for k in range(max_rounds):
        if not used:
            raise InputError("images: every image was dropped; nothing to refine")
        kw = dict(joint_kw)
        if k == 0:
            conv = kw.get("convergence") or DEFAULT_CONVERGENCE
            kw["convergence"] = dataclasses.replace(conv, max_steps=min(conv.max_steps, screen_steps))
        kw["local_images"], kw["comm"] = [j for j, i in enumerate(used) if i in held], comm
        result = _one_round(k, simulators, observed_images, masks, used, starts, shared_start, esds and k > 0,
                            checkpoint, kw)
        excess, scale = _round_rows(result)
        drop = screen(excess, scale, rule.first_round() if k == 0 else rule) if k < max_rounds - 1 else {}
        rounds.append({"round": k + 1, "images": len(used), "steps": result.steps, "status": result.status.value,
                       "wall_s": result.wall_s, "dropped": [used[j] for j in sorted(drop)]})
        log.info("serial round %d: %d images, %s in %d steps, %d dropped", k + 1, len(used), result.status.value,
                 result.steps, len(drop))
        for j, reason in drop.items():
            dropped[used[j]] = {"reason": reason, "round": k + 1, "values": dict(result.images[j]),
                                "fit": dict(result.image_fit[j]) if result.image_fit else {}}
        for j, i in enumerate(used):
            if i in held:
                starts[i] = {**starts[i], **_restart(result.images[j])}
        shared_start = {**shared_start, **_restart(result.shared)}
        if k > 0 and not drop:
            break
        used = [i for i in used if i not in dropped]
    return SerialResult(result, n, tuple(used), dict(sorted(dropped.items())), tuple(rounds), rule.describe(),
                        time.monotonic() - t0, {"n_images": n_previous} if previous is not None else {})


def _one_round(k: int, simulators, observed_images, masks, used: list[int], starts: list, shared_start: dict,
               esds: bool, checkpoint, joint_kw: dict) -> JointResult:
    """Round ``k``'s :func:`refine_joint` over the ``used`` images."""
    ckpt = None
    if checkpoint is not None:
        path = Path(checkpoint)
        ckpt = path.with_name(f"{path.stem}.round{k + 1}{path.suffix or '.h5'}")
    return refine_joint([simulators[i] for i in used], [observed_images[i] for i in used],
                        None if masks is None else [masks[i] for i in used],
                        image_starts=[starts[i] for i in used], start=shared_start, esds=esds, checkpoint=ckpt,
                        **joint_kw)
