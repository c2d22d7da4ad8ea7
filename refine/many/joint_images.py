"""The images of a joint run and its loss (:mod:`refine.many.joint`): each image's fitted pixels, starting
values and map ``[shared, own]`` (:class:`JointImage`), and the joint loss and gradient summed over the images of
every process (:class:`Joint`, :class:`JointLoss`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.simulator import Simulator
from refine.fitting.objective import ImageObjective, LossFn
from refine.fitting.parameters import BASE_NAMES, ParameterMap, ParameterSpace
from refine.fitting.transforms import Held
from refine.many.amplitudes import PreparedImage
from refine.many.distributed import Comm
from refine.many.exact_sum import ExactSum
from refine.many.memory import released
from refine.many.sharded import sharded_type
from refine.many.pixel_table import FittedPixels, StoredPixels
from refine.solver.plan import observed_pixels, starting_values


log = logging.getLogger(__name__)

#: images whose loss and gradient rows are held at once in an evaluation (their shared parts are summed exactly)
ROW_CHUNK = 32



# -- the images -----------------------------------------------------------------------------------------
@dataclass
class JointImage:
    """One image this process holds: its index, prepared pixels (whose objective it evaluates) and map
    ``[shared, own]``."""

    index: int
    prepared: PreparedImage
    pmap: ParameterMap
    start: dict
    digest: Tensor

    @property
    def objective(self) -> ImageObjective:
        """The image's objective on its fitted pixels (:attr:`PreparedImage.objective`: read from the file at each
        use while the pixels are stored)."""
        return self.prepared.objective


def fitted_pixels(index: int, sim: Simulator, observed, mask) -> FittedPixels | StoredPixels:
    """The image's fitted pixels: ``observed`` itself when it is :class:`~refine.many.pixel_table.FittedPixels` or
    :class:`~refine.many.pixel_table.StoredPixels` (less any the model's own ``-mask`` excludes), else the usable
    pixels of the dense image (:func:`refine.solver.plan.observed_pixels`)."""
    if not isinstance(observed, (FittedPixels, StoredPixels)):
        obs, valid = observed_pixels(sim, observed, mask)
        return FittedPixels.from_image(obs, valid, source=f"image {index}")
    if mask is not None:
        raise InputError(f"masks[{index}]: give None for fitted pixels (they are the pixels to fit)")
    if tuple(observed.shape) != tuple(sim.shape):
        raise InputError(f"observed_images[{index}]: fitted pixels of a {tuple(observed.shape)} detector, the model's "
                         f"is {tuple(sim.shape)} (slow, fast)")
    if sim.setup.pixel_mask is None:
        return observed
    px = observed.load()
    keep = torch.as_tensor(np.asarray(sim.setup.pixel_mask, dtype=bool)).reshape(-1)[px.index.cpu()]
    if bool(keep.all()):
        return observed
    log.info("image %d: %d fitted pixels lie under the model's -mask and are left out", index, int((~keep).sum()))
    keep = keep.to(px.index.device)
    return FittedPixels(px.shape, px.index[keep], px.observed[keep], px.source)


def prepare_image(index: int, sim: Simulator, observed, mask, start: Mapping[str, float] | None, shared_start: dict,
             space: ParameterSpace, loss_fn: LossFn) -> PreparedImage:
    """One image's pixels and starting values (the shared names at the shared start)."""
    if not isinstance(sim, Simulator):
        raise InputError(f"simulators[{index}]: expected a Simulator, got {type(sim).__name__}")
    pixels = fitted_pixels(index, sim, observed, mask)
    px = pixels.load().to(sim.dtype, sim.device)
    values = starting_values(sim, px.observed, torch.ones_like(px.observed, dtype=torch.bool), start)
    values.update(shared_start)
    try:
        space.check_start(values)
    except InputError as exc:
        raise InputError(f"image {index}: {exc}") from None
    return PreparedImage(index, sim, px if isinstance(pixels, FittedPixels) else pixels, values, px.digest(), loss_fn)


def share_tables(prepared: list[PreparedImage]) -> None:
    """The last image's simulator holds the structure-factor table of an earlier one when they are equal
    (:meth:`nbtorch.Simulator.sharing_structure_factors`): one copy per process for images of one crystal."""
    last, tried = prepared[-1], set()
    for im in prepared[:-1]:
        if im.sim.F_grid is None or id(im.sim.F_grid) in tried:  # each distinct table once
            continue
        tried.add(id(im.sim.F_grid))
        shared = last.sim.sharing_structure_factors(im.sim)
        if shared is not last.sim:
            last.sim = shared
            return


def joint_image(im: PreparedImage, space: ParameterSpace, names: tuple[str, ...], hold_scale: bool,
                share=None) -> JointImage:
    """The image's map (its objective is the prepared image's: the shared table's, when the structure factors
    are refined); with ``hold_scale`` (image 0 next to shared structure factors) its scale keeps its start
    (:class:`Held`); ``share``: :class:`~refine.fitting.parameters.ParameterMap`'s (another image's map and the
    shared names, whose transform objects this map takes)."""
    pmap = ParameterMap(space, im.values, names, share=share)
    if hold_scale and "scale" in names:
        pmap.transforms[names.index("scale")] = Held(im.values["scale"])
    return JointImage(im.index, im, pmap, im.values, im.digest)


class Joint:
    """The joint loss and gradient over the images of every process (:mod:`refine.many.joint`'s docstring).

    The raw vector a process works on is its part of the whole (:mod:`refine.many.sharded`):
    ``[shared (S), its images' own parts (K each, in increasing image order)]``.  The loss and the shared
    gradient are exact sums over every process's images (:mod:`refine.many.exact_sum`: the same bits for any
    number of processes); each image's own gradient stays on its process."""

    def __init__(self, images: Sequence[JointImage], n: int, n_shared: int, n_own: int, comm: Comm,
                 dtype: torch.dtype) -> None:
        self.images, self.n, self.S, self.K, self.comm, self.dtype = images, n, n_shared, n_own, comm, dtype
        #: each held image's place among this process's own parts (its images in increasing order)
        self.slots = {im.index: k for k, im in enumerate(sorted(images, key=lambda im: im.index))}
        #: the type of this process's part of a raw vector (its reductions are over every process)
        self.vector = sharded_type(comm.layout(n_shared))
        #: ``raw[:S] -> (loss, gradient (S,))`` added once to the sum over images (the amplitude restraint)
        self.extra: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
        #: raw positions of the whole vector that are not refined (image 0's held scale): left out of the esds
        self.held: list[int] = []
        #: ``(raw[:S], raw_units) -> (S, S)``: the restraint's curvature on the shared names (physical units, or
        #: raw ones for the preconditioner)
        self.curvature: Callable[[Tensor, bool], Tensor] | None = None
        #: the many shared amplitudes' diagonal treatment (:class:`refine.many.sparse_amplitudes.AmplitudeTail`),
        #: or None: every shared name in the dense blocks
        self.tail = None

    def local(self, shared: Tensor, own: Mapping[int, Tensor]) -> Tensor:
        """This process's part of a raw vector: ``shared`` (S,) and each held image's own (K,) values."""
        parts = [shared.reshape(-1)] + [own[i].reshape(-1) for i in sorted(self.slots)]
        return torch.cat([p.as_subclass(Tensor) for p in parts]).as_subclass(self.vector)

    def image_raw(self, raw: Tensor, i: int) -> Tensor:
        """Image ``i``'s ``[shared, own]`` raw values from this process's part ``raw`` (``i`` held here)."""
        lo = self.S + self.slots[i] * self.K
        return torch.cat([raw[:self.S], raw[lo:lo + self.K]]).as_subclass(Tensor)

    def held_local(self) -> list[int]:
        """The held positions (:attr:`held`) that lie in this process's part, as positions in it."""
        out = []
        for h in self.held:
            i, k = divmod(h - self.S, self.K) if h >= self.S else (None, h)
            if i is None:
                out.append(k)
            elif i in self.slots:
                out.append(self.S + self.slots[i] * self.K + k)
        return out

    def rows(self, raw: Tensor, images: Sequence[JointImage] | None = None) -> Tensor:
        """(images, 1 + S + K): each image's loss and gradient in ``[shared, own]`` (``images``: some of this
        process's, default all, in the order of their slots); NaN where an image failed."""
        images = sorted(self.images if images is None else images, key=lambda im: self.slots[im.index])
        place = {im.index: k for k, im in enumerate(images)}
        out = torch.zeros((len(images), 1 + self.S + self.K), dtype=self.dtype)
        for im in images:
            r = self.image_raw(raw.detach(), im.index).clone().requires_grad_(True)
            try:
                with torch.enable_grad():
                    loss, _ = im.objective.evaluate(im.pmap.expand(im.pmap.physical_block(r)))
                    (g,) = torch.autograd.grad(loss, r, allow_unused=True)
                g = torch.zeros_like(r) if g is None else g
                # the loss on the model's device (a GPU), the gradient beside the raw values (the CPU)
                out[place[im.index]] = torch.cat([loss.detach().reshape(1).to(g.device), g.detach()]).cpu()
            except Exception:  # noqa: BLE001 - every process must stop together: NaN tells them
                log.exception("image %d: evaluating the model failed", im.index)
                out[place[im.index]] = math.nan
        return out

    def loss_and_grad(self, raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(joint loss, this process's part of the joint gradient, its images' losses (held,)): the loss and the
        shared gradient summed exactly over every process's images."""
        # image by chunk: the (images, S) shared rows are never all held (many amplitudes among the shared names)
        images = sorted(self.images, key=lambda im: self.slots[im.index])
        summed, own = ExactSum(1 + self.S), torch.zeros(len(images), self.K, dtype=self.dtype)
        losses = torch.zeros(len(images), dtype=self.dtype)
        for c in released(range(0, len(images), ROW_CHUNK), every=1):  # the heap trimmed after each chunk
            rows = self.rows(raw, images[c:c + ROW_CHUNK])
            summed.add(rows[:, :1 + self.S])
            own[c:c + rows.shape[0]], losses[c:c + rows.shape[0]] = rows[:, 1 + self.S:], rows[:, 0]
        total = summed.total(self.vector.layout.reduce_sum)
        loss = total[0].to(self.dtype)
        grad = torch.cat([total[1:].to(self.dtype), own.reshape(-1)])
        if self.extra is not None:
            term, g = self.extra(raw.detach().as_subclass(Tensor)[:self.S])
            loss = loss + term.to(loss.dtype)
            grad[:self.S] += g.to(grad.dtype)
        return loss, grad.as_subclass(self.vector), losses

    def image_losses(self, losses: Tensor) -> Tensor:
        """(n,): every image's loss from each process's :meth:`loss_and_grad` losses (one gather at the end)."""
        local = {i: losses[k].reshape(1) for i, k in self.slots.items()}
        return self.comm.gather(local, self.n, (1,), torch.float64).reshape(-1)


class JointLoss(torch.autograd.Function):
    """``raw -> joint loss``: the forward pass computes the loss and the all-reduced gradient, the backward
    pass hands the stored gradient back (every process gets the same)."""

    @staticmethod
    def forward(ctx, raw: Tensor, joint: Joint, out: list) -> Tensor:  # type: ignore[override]
        loss, grad, losses = joint.loss_and_grad(raw.detach())
        ctx.save_for_backward(grad)
        out.append(losses)
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return g * grad, None, None


def image_values(comm: Comm, local: Mapping[int, Mapping[str, float]], i: int) -> dict:
    """Image ``i``'s base values in every process (``local``: this process's images' values, by index)."""
    rows = {0: torch.tensor([local[i][k] for k in BASE_NAMES], dtype=torch.float64)} if i in local else {}
    return {k: float(x) for k, x in zip(BASE_NAMES, comm.gather(rows, 1, (len(BASE_NAMES),), torch.float64)[0])}
