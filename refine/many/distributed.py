"""The processes of a joint refinement (:mod:`refine.many.joint`): :class:`Comm` and :func:`image_shard`.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every process joins one gloo group (:func:`refine.many.batch.process_group`);
process ``r`` of ``W`` holds the contiguous block :func:`image_shard` of the images, or the images a caller names
(:func:`held_images`: every image held by exactly one process, any assignment).  :class:`Comm` gathers rows
of per-image values exactly (each row is non-zero in the one process that holds its image, so the all_reduce sum
is that row, bit for bit), runs a check on process 0 only and hands its answer (or its one-line
:class:`~nbtorch.errors.InputError`) to every process.  A collective that fails because another process died
raises :class:`~refine.solver.loop.LoopAborted`.  Without torchrun there is one process and nothing is sent.
:func:`process_device` gives each process its GPU (``--device``).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.many.batch import process_group
from refine.many.sharded import ShardedLayout
from refine.solver.loop import LoopAborted

__all__ = ["Comm", "image_shard", "held_images", "process_device"]


class Comm:
    """The process group (or none): rank, world size and the exact gather of per-image rows."""

    def __init__(self) -> None:
        self.dist = None
        self.rank, self.world = 0, 1
        initialised = False
        try:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
        except ImportError:  # pragma: no cover - torch without distributed
            dist = None
        if initialised:
            self.dist = dist
        elif int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            _, _, self.dist = process_group()
        if self.dist is not None:
            self.rank, self.world = self.dist.get_rank(), self.dist.get_world_size()
            if self.world == 1:
                self.dist = None

    def gather(self, rows: Mapping[int, Tensor], n: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """(n, *shape): row ``i`` from the process that holds image ``i`` (exact: the others add zeros)."""
        out = torch.zeros((n, *shape), dtype=dtype)
        for i, row in rows.items():
            out[i] = row.detach().to(dtype=dtype, device="cpu").reshape(shape)
        if self.dist is not None:
            self._collective(self.dist.all_reduce, out)
        return out

    def gather_objects(self, local: Mapping[int, Any], n: int) -> list:
        """``[object of image i for i in range(n)]`` (picklable) from the processes that hold them."""
        parts = [dict(local)]
        if self.dist is not None:
            parts = [None] * self.world
            self._collective(self.dist.all_gather_object, parts, dict(local))
        out: list = [None] * n
        for part in parts:
            for i, obj in part.items():
                out[i] = obj
        return out

    def layout(self, shared: int) -> ShardedLayout:
        """The :class:`~refine.many.sharded.ShardedLayout` of a vector ``[shared (shared), own parts]`` over these
        processes (the shared part counted by process 0)."""
        if self.dist is None:
            return ShardedLayout(shared, True)
        ops = self.dist.ReduceOp

        def reduce(op):
            return lambda t: self._collective(lambda x: self.dist.all_reduce(x, op=op), t)
        return ShardedLayout(shared, self.rank == 0, reduce(ops.SUM), reduce(ops.MAX), reduce(ops.MIN))

    def barrier(self) -> None:
        """Wait for every process."""
        if self.dist is not None:
            self._collective(self.dist.barrier)

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run by process 0 only; every process gets its value, or raises its :class:`InputError`."""
        value, error = None, None
        if self.rank == 0:
            try:
                value = fn()
            except InputError as exc:
                error = str(exc)
        if self.dist is not None:
            box = [(value, error)]
            self._collective(self.dist.broadcast_object_list, box, src=0)
            value, error = box[0]
        if error is not None:
            raise InputError(error)
        return value

    @staticmethod
    def _collective(op: Callable, *args: Any, **kw: Any) -> None:
        """A collective operation; its failure (another process died) ends the run: :class:`LoopAborted`."""
        try:
            op(*args, **kw)
        except RuntimeError as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise LoopAborted(f"the process group failed (another process probably died): {reason}") from exc


def image_shard(n: int, rank: int | None = None, world: int | None = None) -> range:
    """The images process ``rank`` of ``world`` holds: a contiguous block (default: this process, under
    torchrun after setting up the gloo group; else every image)."""
    if rank is None or world is None:
        comm = Comm()
        rank, world = comm.rank, comm.world
    return range(n * rank // world, n * (rank + 1) // world)


def held_images(comm: Comm, n: int, local=None, what: str = "local_images") -> list[int]:
    """The images this process holds, sorted: ``local`` (positions ``0 <= i < n``), checked so that every image
    is held by exactly one process (one all_reduce of ``n`` counts, so every process raises the same one-line
    :class:`~nbtorch.errors.InputError`); ``None``: :func:`image_shard`."""
    if local is None:
        return list(image_shard(n, comm.rank, comm.world))
    try:
        held = sorted(int(i) for i in local)
    except (TypeError, ValueError):
        raise InputError(f"{what}: expected image positions (integers), got {local!r}") from None
    bad = [i for i in held if not 0 <= i < n]
    if bad:
        raise InputError(f"{what}: image {bad[0]} is not among the {n} images")
    twice = sorted(i for i, count in Counter(held).items() if count > 1)
    if twice:
        raise InputError(f"{what}: image {twice[0]} is named twice")
    counts = comm.gather({i: torch.ones(1, dtype=torch.float64) for i in held}, n, (1,), torch.float64).reshape(-1)
    wrong = torch.nonzero(counts != 1.0).reshape(-1).tolist()
    if wrong:
        raise InputError(f"{what}: image {wrong[0]} is held by {int(counts[wrong[0]])} processes (each image by "
                         f"exactly one; {len(wrong)} images wrong)")
    return held


def process_device(device: str, local_rank: str | None = None, count: int | None = None) -> str:
    """The device of this process from ``--device``: ``cpu``; an explicit ``cuda:N`` as given; ``cuda`` under
    torchrun (``local_rank``, default ``LOCAL_RANK``) the GPU of the local rank, ``cuda:LOCAL_RANK``, else ``cuda``;
    a list ``cuda:0,cuda:2`` the entry ``LOCAL_RANK`` mod its length (one process: the first).  ``count``: the
    GPUs there are (default ``torch.cuda.device_count()``).

    Raises:
        InputError: one line naming ``--device``: not ``cpu`` or ``cuda[:N]``, no CUDA, or a GPU not there.
    """
    text = str(device).strip()
    entries = [e.strip() for e in text.split(",")]
    if text == "cpu":
        return "cpu"
    bad = [e for e in entries if not (e == "cuda" or (e.startswith("cuda:") and e[5:].isdigit()))]
    if bad:
        raise InputError(f"--device {text}: expected cpu, cuda, cuda:N or a list of cuda:N (cuda:0,cuda:2), got {bad[0]!r}")
    local_rank = os.environ.get("LOCAL_RANK") if local_rank is None else local_rank
    rank = int(local_rank) if str(local_rank or "").strip().isdigit() else None
    if len(entries) > 1:
        chosen = entries[(rank or 0) % len(entries)]
    else:
        chosen = f"cuda:{rank}" if text == "cuda" and rank is not None else text
    if not torch.cuda.is_available():
        raise InputError(f"--device {text}: CUDA is not available on this machine")
    count = torch.cuda.device_count() if count is None else count
    index = int(chosen[5:]) if ":" in chosen else 0
    if index >= count:
        where = f" (local rank {rank})" if chosen != text and rank is not None else ""
        raise InputError(f"--device {text}: {chosen}{where} is not on this machine, which has {count} GPUs "
                         f"(cuda:0..cuda:{count - 1})" if count else f"--device {text}: this machine has no GPU")
    return chosen
