"""A joint run's checkpoints (:mod:`refine.many.joint`, ``checkpoint=``/``resume=``; the file format is
:mod:`refine.many.checkpoint`): the saver every process waits on, the point a run resumes from, and the start of a
run (fresh or resumed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.many.batch import restart_count
from refine.many.checkpoint import (DIGEST_BYTES, ImageRows, JointCheckpoint, Shards, fingerprint_difference, joint_fingerprint,
                                    read_joint_checkpoint, start_digest, write_joint_checkpoint)
from refine.many.distributed import Comm
from refine.solver.loop import LoopState, Status
from refine.solver.precondition import LinearPreconditioner
from refine.solver.runner import RunClock
from refine.solver.strategies import AbstractStrategy
from refine.many.joint_precondition import joint_preconditioner, precond_from_state, precond_state
from refine.many.joint_problem import JointProblem


log = logging.getLogger(__name__)



def start_or_resume(problem: JointProblem, step_rule: AbstractStrategy, precondition: str | None, checkpoint,
                     checkpoint_every: int, resume, on_checkpoint, t0: float
                     ) -> tuple["JointCheckpoints", JointCheckpoint | None]:
    """The run's checkpoints and the checkpoint it continues from (or None); the preconditioner: the resumed
    one, else the joint Fisher matrix's at the start."""
    p = problem
    digests = p.comm.gather({im.index: torch.cat([im.digest, start_digest(p.starts[im.index])]) for im in p.joint.images},
                            p.joint.n, (2 * DIGEST_BYTES,), torch.float64)
    fingerprint = joint_fingerprint(
        digests[:, :DIGEST_BYTES], digests[:, DIGEST_BYTES:], shared=list(p.shared_names), per_image=list(p.per_names), symmetry=p.space.symmetry,
        background=p.space.background, loss=p.loss_name, strategy=step_rule.hparams(), precondition=precondition,
        **({"structure_factors": p.amps.fingerprint()} if p.amps is not None else {}),
        **({"priors": {k: list(v) for k, v in sorted(p.priors.items())}} if p.priors else {}))
    shards = Shards(tuple(sorted(p.joint.slots)), p.joint.n, p.joint.S, p.joint.K, p.joint.vector)
    saver = JointCheckpoints(checkpoint, checkpoint_every, p.comm, fingerprint, on_checkpoint, t0, shards)
    resumed = _resume_point(p.comm, checkpoint, resume, fingerprint, shards)
    saver.pre = (joint_preconditioner(precondition, p.joint, p.raw0) if resumed is None
                 else precond_from_state(resumed.precond))
    saver.clock.before_s = resumed.elapsed_s if resumed is not None else 0.0
    return saver, resumed


# -- checkpoints ----------------------------------------------------------------------------------------
class JointCheckpoints:
    """The run's checkpoints (:mod:`refine.many.checkpoint`): every process writes its part of each in turn
    (``wait=False``, on Ctrl-C: still in turn, each process having been interrupted); then every process calls
    ``on_checkpoint``."""

    def __init__(self, path: str | Path | None, every: int, comm: Comm, fingerprint: dict,
                 on_checkpoint: Callable[[int, Path], None] | None, t0: float, shards: Shards) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InputError(f"checkpoint_every: expected an integer >= 1, got {every!r}")
        self.path = None if path is None else Path(path)
        self.every, self.comm, self.fingerprint, self.on_checkpoint = every, comm, fingerprint, on_checkpoint
        self.shards = shards
        #: the run's wall time since ``t0`` (the attempts before a resume added once known)
        self.clock = RunClock(started=t0)
        #: the loop's preconditioner (set once known)
        self.pre: LinearPreconditioner | None = None
        if self.path is not None:
            comm.on_rank0(self._check_path)

    def _check_path(self) -> None:
        if self.path.is_dir():
            raise InputError(f"checkpoint {self.path}: is a directory; give a file name such as joint.ckpt.h5")
        if not self.path.absolute().parent.is_dir():
            raise InputError(f"checkpoint {self.path}: folder {self.path.absolute().parent} does not exist")

    def save(self, state: LoopState, status: Status | None = None, message: str = "", wait: bool = True) -> Path | None:
        """Write ``state`` (and the loop's end, ``status``), every process its part; ``wait=False``: no callback
        (Ctrl-C)."""
        if self.path is None:
            return None
        losses = ImageRows(state.aux.detach().clone()) if isinstance(state.aux, Tensor) else None
        write_joint_checkpoint(self.path, JointCheckpoint(
            loop=state.to_dict(), image_losses=losses, precond=precond_state(self.pre),
            status=None if status is None else status.value, message=message, elapsed_s=self.clock.elapsed(),
            fingerprint=self.fingerprint, world_size=self.comm.world), self.shards, self.comm)
        if self.comm.rank == 0:
            log.info("joint: checkpoint at step %d written to %s", state.step, self.path)
        if wait:
            if self.on_checkpoint is not None:
                self.on_checkpoint(state.step, self.path)
        return self.path


def _resume_point(comm: Comm, checkpoint: str | Path | None, resume: str | Path | None,
                  fingerprint: dict, shards: Shards) -> JointCheckpoint | None:
    """The checkpoint to continue from (checked by process 0; each process reads its images' rows), or None.

    ``resume``: that file, refused when missing, damaged or of another problem.  Without it, under a torchrun
    restart: ``checkpoint`` when it exists and is of this problem (else a fresh start, with a warning)."""
    auto = resume is None and checkpoint is not None and restart_count() > 0
    if resume is None and not auto:
        return None
    path = Path(resume if resume is not None else checkpoint)

    def read() -> bool:
        if auto and not path.is_file():
            log.info("joint: torchrun restart %d, no checkpoint %s yet: starting afresh", restart_count(), path)
            return False
        try:
            ckpt = read_joint_checkpoint(path, Shards((), -1, shards.S, shards.K))  # no image's rows
        except InputError as exc:
            if not auto:
                raise InputError(f"resume: {exc}") from None
            log.warning("joint: torchrun restart: %s; starting afresh", exc)
            return False
        differs = fingerprint_difference(ckpt.fingerprint, fingerprint)
        if differs:
            message = f"resume: {path} was written for another joint problem or settings (differs: {differs})"
            if not auto:
                raise InputError(message)
            log.warning("joint: torchrun restart: %s; starting afresh", message)
            return False
        log.info("joint: resuming from %s at step %d", path, ckpt.step)
        return True

    if not comm.on_rank0(read):
        return None
    try:
        return read_joint_checkpoint(path, shards)
    except InputError as exc:  # process 0 read it a moment ago: the file changed under the run
        raise InputError(f"resume: {exc}") from None
