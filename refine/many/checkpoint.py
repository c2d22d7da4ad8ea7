"""Checkpoints of a joint refinement (:func:`refine.many.joint.refine_joint`): the whole state in one HDF5 file.

A joint run with ``checkpoint=PATH`` writes the file every ``checkpoint_every`` steps, when the loop ends
(before the esds) and on Ctrl-C, always at a step boundary.  The file holds everything the loop needs to go on
exactly as an uninterrupted run would: the raw vector ``[shared, image 0's own, image 1's own, ...]`` with the
loss, gradient and LBFGS (or Adam) state there, the step and evaluation counts, the history, the images' losses,
the preconditioner, and the loop's status once it has ended.  Each process holds only its part of the vectors
(:mod:`refine.many.sharded`) and of the per-image rows (:class:`ImageRows`), so the file is written in turns:
process 0 writes everything else and the shared parts into ``PATH.writing``, then each process its images' rows,
then process 0 renames it to ``PATH`` (a reader never sees a half-written file).  A resume reads in each process
the rows of the images it holds, whatever the number of processes that wrote them.  ``resume=PATH`` continues from it; under a torchrun restart
(``TORCHELASTIC_RESTART_COUNT`` > 0, :func:`refine.many.batch.restart_count`) an existing checkpoint is resumed without
being asked, so ``torchrun --max-restarts N`` brings a job whose worker died back to its last checkpoint.

Layout (``format = "nbtorch-refine-joint-checkpoint"``, ``version = 2``)::

    attrs             step, status ("" while running), n_images, n_shared and n_own (a raw vector's lengths),
                      world_size, elapsed_s, fingerprint (JSON)
    state             uint8 bytes of ``torch.save`` of :meth:`JointCheckpoint.to_dict`, each split vector and
                      per-image array replaced by ``{"__part__": j, "shared": ..., "row_shape": ...}``
    parts/j/shared    (S,) part ``j``'s shared numbers (a split vector's)
    parts/j/rows      (n, *row_shape) part ``j``'s row of every image

The **fingerprint** (:func:`joint_fingerprint`) names the images (a SHA-1 of each image's fitted pixels and
mask), every image's starting values (a SHA-1 of each image's), the shared and per-image names, symmetry,
background, loss, step rule and preconditioner.  A resume whose fingerprint differs is refused with one line naming what differs;
the stopping rules (``max_steps``, tolerances), ``esds`` and the number of processes may change, so a run
stopped at its step limit can be continued with more steps.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.many.sharded import ShardedVector
from refine.solver.checkpoint import read_state_file
from refine.solver.loop import LoopState, Status

__all__ = ["JointCheckpoint", "ImageRows", "Shards", "write_joint_checkpoint", "read_joint_checkpoint", "joint_fingerprint", "start_digest",
           "fingerprint_difference", "FORMAT", "VERSION"]

FORMAT = "nbtorch-refine-joint-checkpoint"
VERSION = 2
#: bytes of an image's SHA-1 digest (gathered as one float per byte: exact in an all_reduce)
DIGEST_BYTES = 20


@dataclass
class JointCheckpoint:
    """The state of a joint run at a step boundary.

    Attributes:
        loop: :meth:`refine.solver.loop.LoopState.to_dict` (raw vector in the loop's coordinates, loss, gradient,
            optimiser state, counters, history).
        image_losses: this process's images' losses at ``loop["raw"]`` (None when not known; written as
            :class:`ImageRows`).
        precond: the preconditioner (:func:`refine.many.joint_precondition.precond_state`).
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


@dataclass(frozen=True)
class ImageRows:
    """A per-image array of a checkpoint's state: one row per image this process holds (increasing order)."""

    rows: Tensor


@dataclass(frozen=True)
class Shards:
    """How a process's state sits in the whole: the images it holds (increasing), the number of images (-1: any,
    with no images held: the file's shared parts only), the shared and own lengths of a raw vector, and the type
    of its part of one (:mod:`refine.many.sharded`)."""

    images: tuple[int, ...]
    n: int
    S: int
    K: int
    vector: type | None = None

    def split(self, obj: Any, parts: list) -> Any:
        """``obj`` with each split vector and :class:`ImageRows` replaced by a marker; their parts in ``parts``
        as ``(shared or None, rows (held, *row_shape))``."""
        if isinstance(obj, ShardedVector):
            local = obj.detach().as_subclass(Tensor).cpu()
            parts.append((local[:self.S], local[self.S:].reshape(len(self.images), self.K)))
            return {"__part__": len(parts) - 1, "shared": True, "row_shape": [self.K]}
        if isinstance(obj, ImageRows):
            parts.append((None, obj.rows.detach().cpu()))
            return {"__part__": len(parts) - 1, "shared": False, "row_shape": list(obj.rows.shape[1:])}
        if isinstance(obj, dict):
            return {k: self.split(v, parts) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.split(v, parts) for v in obj)
        return obj

    def join(self, obj: Any, h5) -> Any:
        """The inverse of :meth:`split` from the file ``h5``: this process's rows of each part."""
        if isinstance(obj, dict) and "__part__" in obj:
            group = h5[f"parts/{int(obj['__part__'])}"]
            rows = torch.as_tensor(self._rows(group["rows"]))
            if not obj["shared"]:
                return rows
            shared = torch.as_tensor(group["shared"][()])
            local = torch.cat([shared, rows.reshape(-1).to(shared.dtype)])
            return local.as_subclass(self.vector) if self.vector is not None else local
        if isinstance(obj, dict):
            return {k: self.join(v, h5) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.join(v, h5) for v in obj)
        return obj

    def _where(self) -> slice | list[int]:
        """This process's rows of a part: a slice when its images are contiguous (one HDF5 hyperslab)."""
        images = list(self.images)
        if images and images == list(range(images[0], images[-1] + 1)):
            return slice(images[0], images[-1] + 1)
        return images

    def _rows(self, dataset):
        if self.n >= 0 and dataset.shape[0] != self.n:
            raise ValueError(f"{dataset.name} has {dataset.shape[0]} image rows, expected {self.n}")
        if not self.images:
            return np.zeros((0, *dataset.shape[1:]), dtype=dataset.dtype)
        return dataset[self._where()]

    def write_rows(self, h5, parts: list) -> None:
        if not self.images:
            return
        where = self._where()
        for j, (_, rows) in enumerate(parts):
            h5[f"parts/{j}/rows"][where] = rows.numpy()


def write_joint_checkpoint(path: str | Path, ckpt: JointCheckpoint, shards: Shards, comm=None) -> Path:
    """Write ``ckpt`` to ``path`` from every process in turn (module docstring); ``comm``: the processes
    (:class:`refine.many.distributed.Comm`; None: this process alone).  An existing file is replaced only
    when complete."""
    import h5py

    path = Path(path)
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world)
    parts: list = []
    skeleton = shards.split(ckpt.to_dict(), parts)
    tmp = path.with_name(path.name + ".writing")
    if rank == 0:
        buf = io.BytesIO()
        torch.save(skeleton, buf)
        attrs = {"step": ckpt.step, "status": ckpt.status or "", "n_images": int(shards.n), "n_shared": int(shards.S), "n_own": int(shards.K),
                 "world_size": int(ckpt.world_size), "elapsed_s": float(ckpt.elapsed_s),
                 "fingerprint": json.dumps(ckpt.fingerprint)}
        with h5py.File(tmp, "w") as h5:
            h5.attrs["format"], h5.attrs["version"] = FORMAT, VERSION
            for k, v in attrs.items():
                h5.attrs[k] = v
            h5.create_dataset("state", data=np.frombuffer(buf.getvalue(), dtype=np.uint8))
            for j, (shared, rows) in enumerate(parts):
                if shared is not None:
                    h5.create_dataset(f"parts/{j}/shared", data=shared.numpy())
                h5.create_dataset(f"parts/{j}/rows", shape=(shards.n, *rows.shape[1:]),
                                  dtype=rows.numpy().dtype, fillvalue=np.nan)
            shards.write_rows(h5, parts)
    for turn in range(1, world):
        comm.barrier()
        if rank == turn:
            with h5py.File(tmp, "r+") as h5:
                shards.write_rows(h5, parts)
    if comm is not None:
        comm.barrier()
    if rank == 0:
        os.replace(tmp, path)
    return path


def read_joint_checkpoint(path: str | Path, shards: Shards | None = None) -> JointCheckpoint:
    """Read a checkpoint written by :func:`write_joint_checkpoint`: this process's rows of it (``shards``; None:
    every image's, as one process holding all of them would).

    Raises:
        InputError: the file is missing, damaged, not a joint checkpoint (e.g. a single run's), or of
            another version.
    """
    import h5py

    state = read_state_file(path, FORMAT, VERSION, "an nbtorch joint refinement checkpoint")
    try:
        with h5py.File(path, "r") as h5:
            if shards is None:
                n = int(h5.attrs["n_images"])
                shards = Shards(tuple(range(n)), n, int(h5.attrs["n_shared"]), int(h5.attrs["n_own"]))
            state = shards.join(state, h5)
        ckpt = JointCheckpoint(**state)
        ckpt.loop_state()
    except (TypeError, KeyError, ValueError, OSError) as exc:
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

