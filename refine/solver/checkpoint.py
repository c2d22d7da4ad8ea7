"""Checkpoints: the state of a staged refinement in one HDF5 file, written atomically.

A checkpoint is written every ``checkpoint_every`` steps, at the end of every
stage and on Ctrl-C, always at a step boundary, so ``refine(..., resume=path)``
continues with exactly the numbers an uninterrupted run would have used and
ends with the same result.

Layout (``format = "nbtorch-refine-checkpoint"``, ``version = 1``)::

    attrs    stage_index, stage_name, stage_step, step (global), elapsed_s, loss_initial, fingerprint (JSON)
    raw      (P,) raw parameters of the current stage (absent at a stage boundary)
    names    (P,) their names
    state    uint8 bytes of ``torch.save`` of the full state: plain containers and tensors only,
             read back with ``torch.load(weights_only=True)``

The full state holds the stage's starting values, the loop state (raw
parameters, loss, gradient, the optimiser's ``state_dict``, counters), the
run history so far, the finished stages' summaries, the initial values and
loss, and a fingerprint of the problem (image shape and checksum, stage
names, free names) that :func:`read_checkpoint`'s caller checks before resuming.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_output_path

__all__ = ["RunCheckpoint", "write_checkpoint", "read_checkpoint", "write_state_file", "read_state_file", "FORMAT",
           "VERSION"]

FORMAT = "nbtorch-refine-checkpoint"
VERSION = 1


@dataclass
class RunCheckpoint:
    """The state of a run at a step boundary.

    Attributes:
        stage_index: the stage being run (or about to start, when ``loop`` is None).
        stage_values: every base value at that stage's start.
        loop: :meth:`refine.solver.loop.LoopState.to_dict` of the stage, or None at a stage boundary.
        history: run history so far (column -> list).
        summaries: finished stages (``StageSummary.to_dict()`` plus ``names``).
        initial_values: every base value at the run's start.
        loss_initial: loss of the full image at the start.
        elapsed_s: wall time spent so far.
        fingerprint: identifies the problem and the plan (checked on resume).
        names: free names of the current stage.
        precond: the stage's preconditioner ``{"raw0": (P,), "A": (P, P)}`` (None at a stage boundary).
        memory: at a stage boundary, the finished stage's ``[names, strategy memory]`` that the next
            stage may start from (``refine.solver.runner.RunState.memory``; None inside a stage, whose loop state holds it).
    """

    stage_index: int
    stage_values: dict
    loop: dict | None
    history: dict
    summaries: list
    initial_values: dict
    loss_initial: float
    elapsed_s: float
    fingerprint: dict
    names: list = field(default_factory=list)
    precond: dict | None = None
    memory: list | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def write_checkpoint(path: str | Path, ckpt: RunCheckpoint) -> Path:
    """Write ``ckpt`` to ``path`` atomically (an existing file is replaced only when complete)."""
    loop = ckpt.loop
    attrs = {"stage_index": ckpt.stage_index, "stage_step": -1 if loop is None else int(loop["step"]),
             "step": len(ckpt.history.get("step", [])) - 1, "elapsed_s": float(ckpt.elapsed_s),
             "loss_initial": float(ckpt.loss_initial), "fingerprint": json.dumps(ckpt.fingerprint)}
    arrays = {} if loop is None else {"raw": loop["raw"].detach().cpu().numpy(),
                                      "names": np.array([n.encode() for n in ckpt.names])}
    return write_state_file(path, FORMAT, VERSION, attrs, arrays, ckpt.to_dict())


def write_state_file(path: str | Path, fmt: str, version: int, attrs: dict[str, Any], arrays: dict[str, Any],
                     state: dict[str, Any]) -> Path:
    """The HDF5 layout of every checkpoint, written atomically: attributes ``format``, ``version`` and
    ``attrs`` (for people and h5dump), datasets ``arrays``, and ``state`` (``torch.save`` bytes of ``state``:
    plain containers and tensors only)."""
    import h5py

    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = np.frombuffer(buf.getvalue(), dtype=np.uint8)
    with atomic_output_path(path) as tmp:
        with h5py.File(tmp, "w") as h5:
            h5.attrs["format"] = fmt
            h5.attrs["version"] = version
            for k, v in attrs.items():
                h5.attrs[k] = v
            for k, v in arrays.items():
                h5.create_dataset(k, data=v)
            h5.create_dataset("state", data=blob)
    return path


def read_checkpoint(path: str | Path) -> RunCheckpoint:
    """Read a checkpoint written by :func:`write_checkpoint`.

    Raises:
        InputError: the file is missing, not a checkpoint, or of another version.
    """
    state = read_state_file(path, FORMAT, VERSION, "an nbtorch refinement checkpoint")
    try:
        return RunCheckpoint(**state)
    except TypeError as exc:
        raise InputError(f"{path}: damaged checkpoint state ({_first_line(exc)}); delete it to start again") from None


def read_state_file(path: str | Path, fmt: str, version: int, what: str) -> dict[str, Any]:
    """The ``state`` dict of a file written by :func:`write_state_file` with ``fmt`` and ``version``
    (``what``: the kind of file, for the errors).

    Raises:
        InputError: the file is missing, damaged, not of format ``fmt``, or of another version.
    """
    import h5py

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: checkpoint file not found")
    try:
        with h5py.File(path, "r") as h5:
            if h5.attrs.get("format") != fmt:
                raise InputError(f"{path}: not {what}")
            if int(h5.attrs.get("version", -1)) != version:
                raise InputError(f"{path}: checkpoint version {h5.attrs.get('version')} is not {version}")
            blob = h5["state"][()].tobytes()
    except InputError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as exc:  # libhdf5 on a damaged file
        raise InputError(f"{path}: cannot read checkpoint: {_first_line(exc)}") from None
    try:
        state = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load of damaged bytes raises many kinds (zip, pickle, ...)
        raise InputError(f"{path}: damaged checkpoint state ({type(exc).__name__}: {_first_line(exc)}); "
                         "delete it to start again") from None
    if not isinstance(state, dict):
        raise InputError(f"{path}: damaged checkpoint state (not a dict); delete it to start again")
    return state


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
