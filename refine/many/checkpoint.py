"""Checkpoints of a joint refinement (:func:`refine.many.joint.refine_joint`): the whole state in one HDF5 file.

A joint run with ``checkpoint=PATH`` writes the file every ``checkpoint_every`` steps, when the loop ends
(before the esds) and on Ctrl-C, always at a step boundary and always from process 0 only (atomically:
:func:`refine.solver.checkpoint.write_state_file`, the layout of a single run's checkpoint).  The file holds
everything the loop needs to go on exactly as an uninterrupted run would: the whole raw vector
``[shared, image 0's own, image 1's own, ...]`` with the loss, gradient and LBFGS (or Adam) state there,
the step and evaluation counts, the history, the images' losses, the preconditioner, and the loop's status
once it has ended.  ``resume=PATH`` continues from it; under a torchrun restart
(``TORCHELASTIC_RESTART_COUNT`` > 0, :func:`refine.many.batch.restart_count`) an existing checkpoint is resumed without
being asked, so ``torchrun --max-restarts N`` brings a job whose worker died back to its last checkpoint.

Layout (``format = "nbtorch-refine-joint-checkpoint"``, ``version = 1``)::

    attrs    step, status ("" while running), n_images, world_size, elapsed_s, fingerprint (JSON)
    raw      (P,) the whole raw vector (preconditioned coordinates of the loop)
    state    uint8 bytes of ``torch.save`` of :meth:`JointCheckpoint.to_dict`

The **fingerprint** (:func:`joint_fingerprint`) names the images (a SHA-1 of each image's fitted pixels and
mask), every image's starting values (a SHA-1 of each image's), the shared and per-image names, symmetry,
background, loss, step rule and preconditioner.  A resume whose fingerprint differs is refused with one line naming what differs;
the stopping rules (``max_steps``, tolerances), ``esds`` and the number of processes may change, so a run
stopped at its step limit can be continued with more steps.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.solver.checkpoint import read_state_file, write_state_file
from refine.solver.loop import LoopState, Status

__all__ = ["JointCheckpoint", "write_joint_checkpoint", "read_joint_checkpoint", "joint_fingerprint", "start_digest",
           "fingerprint_difference", "FORMAT", "VERSION"]

FORMAT = "nbtorch-refine-joint-checkpoint"
VERSION = 1
#: bytes of an image's SHA-1 digest (gathered as one float per byte: exact in an all_reduce)
DIGEST_BYTES = 20


@dataclass
class JointCheckpoint:
    """The state of a joint run at a step boundary.

    Attributes:
        loop: :meth:`refine.solver.loop.LoopState.to_dict` (raw vector in the loop's coordinates, loss, gradient,
            optimiser state, counters, history).
        image_losses: (n,) each image's loss at ``loop["raw"]`` (None when not known).
        precond: the preconditioner ``{"raw0": (P,), "A": (P, P)}``: raw = raw0 + A z.
        status, message: the loop's end (``status`` None while it is running).
        elapsed_s: wall seconds of the run so far (all attempts).
        fingerprint: :func:`joint_fingerprint` of the problem and settings.
        world_size: processes of the run that wrote it (information only).
    """

    loop: dict
    image_losses: Tensor | None
    precond: dict
    status: str | None
    message: str
    elapsed_s: float
    fingerprint: dict
    world_size: int = 1

    @property
    def step(self) -> int:
        return int(self.loop["step"])

    @property
    def finished(self) -> bool:
        """The loop ended for good (converged, diverged, failed, no step): a resume only finalises.  A loop
        stopped by its step limit or time budget goes on under new stopping rules."""
        return self.status is not None and Status(self.status) not in (Status.MAX_STEPS, Status.TIME_BUDGET)

    def loop_state(self) -> LoopState:
        """The loop state to resume (its ``aux`` the images' losses)."""
        state = LoopState.from_dict(self.loop)
        state.aux = self.image_losses
        return state

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def write_joint_checkpoint(path: str | Path, ckpt: JointCheckpoint) -> Path:
    """Write ``ckpt`` to ``path`` atomically (an existing file is replaced only when complete)."""
    attrs = {"step": ckpt.step, "status": ckpt.status or "", "n_images": int(ckpt.fingerprint.get("n_images", 0)),
             "world_size": int(ckpt.world_size), "elapsed_s": float(ckpt.elapsed_s),
             "fingerprint": json.dumps(ckpt.fingerprint)}
    return write_state_file(path, FORMAT, VERSION, attrs, {"raw": ckpt.loop["raw"].detach().cpu().numpy()},
                            ckpt.to_dict())


def read_joint_checkpoint(path: str | Path) -> JointCheckpoint:
    """Read a checkpoint written by :func:`write_joint_checkpoint`.

    Raises:
        InputError: the file is missing, damaged, not a joint checkpoint (e.g. a single run's), or of
            another version.
    """
    state = read_state_file(path, FORMAT, VERSION, "an nbtorch joint refinement checkpoint")
    try:
        ckpt = JointCheckpoint(**state)
        ckpt.loop_state()
    except (TypeError, KeyError, ValueError) as exc:
        raise InputError(f"{path}: damaged joint checkpoint state ({type(exc).__name__}: {exc}); "
                         "delete it to start again") from None
    return ckpt


def start_digest(values: Mapping[str, float]) -> Tensor:
    """(20,) float64: the SHA-1 bytes of one image's starting values (:func:`joint_fingerprint`)."""
    text = json.dumps({k: float(v) for k, v in sorted(values.items())})
    return torch.tensor(list(hashlib.sha1(text.encode()).digest()), dtype=torch.float64)


def joint_fingerprint(digests: Tensor, start_digests: Tensor, **settings: Any) -> dict:
    """What a checkpoint must match to be resumed: the images (``digests``: (n, 20), one
    :meth:`refine.many.pixel_table.FittedPixels.digest` per image), their starting values (``start_digests``: (n, 20),
    one :func:`start_digest` per image) and ``settings`` (names, symmetry, ...; plain JSON values)."""
    images = hashlib.sha1(bytes(int(b) for b in digests.reshape(-1).tolist())).hexdigest()
    starts = hashlib.sha1(bytes(int(b) for b in start_digests.reshape(-1).tolist())).hexdigest()
    return {"n_images": int(digests.shape[0]), "images_sha1": images, "starts_sha1": starts,
            **{k: v for k, v in sorted(settings.items())}}


#: how each fingerprint key is named in the refusal
_WHAT = {"n_images": "number of images", "images_sha1": "images (pixels or masks)",
         "starts_sha1": "starting values", "shared": "shared names", "per_image": "per-image names"}


def fingerprint_difference(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """``""`` when the fingerprints match, else what differs, in words (``"symmetry, starting values"``)."""
    keys = [k for k in dict.fromkeys([*now, *saved]) if saved.get(k) != now.get(k)]
    return ", ".join(_WHAT.get(k, k) for k in keys)

