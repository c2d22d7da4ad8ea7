"""Does the refined cell still move with the mosaic domain count?  One Newton step towards twice the count.

A refinement's model sums each pixel over ``M`` mosaic domains (an even set, or the C's random draw).  Where ``M`` is
too small for the crystal (very sharp spots, a count capped by the user) the refined values depend on ``M``.  Rather
than refine again, this module asks what the loss at ``2 M`` domains wants: the gradient of the loss at the refined
values with ``2 M`` domains minus the gradient with ``M`` (zero where the count is converged), and the Newton step
``delta = -F^-1 (g_2M - g_M)`` with ``F`` the run's Fisher information (the loss is the half deviance: ``F`` is its
expected curvature).  ``delta`` is how far the refinement would move at ``2 M``; the run warns where a cell length
or angle would move by more than its esd (:data:`MAX_SHIFT_ESD`).

The ``2 M`` model is evaluated as the mean of two halves of ``M`` domains each (:meth:`nbtorch.Simulator.
with_mosaic_domains` with ``parts=2``): the model photons are linear in the simulated image, and each half runs the
run's own compiled kernel.  A joint run (many images, shared names) reduces each image's own names first (the
Schur complement of the arrowhead Fisher matrix, :func:`shared_shift`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from nbtorch.runtime import policy as runtime
from refine.fitting.objective import ImageObjective
from refine.fitting.parameters import ParameterMap

__all__ = ["MAX_SHIFT_ESD", "CELL_NAMES", "DomainCountCheck", "CountProbe", "count_gradient", "single_shift",
           "single_check", "secant_factor", "reduced_terms", "shared_shift", "check_names"]

log = logging.getLogger(__name__)

#: the largest shift (in esds) of a cell parameter towards twice the domain count that a run accepts without a warning
MAX_SHIFT_ESD = 1.0
#: the names whose shift is checked
CELL_NAMES = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")


@dataclass(frozen=True)
class DomainCountCheck:
    """What twice the domain count would do to the refined cell: ``domains`` of the run, ``shift`` (name -> the
    step's change, the name's units), ``shift_esd`` (name -> that change over the run's esd) and ``secant`` (the
    step's length in Fisher steps, from the loss's slope along it)."""

    domains: int
    shift: dict
    shift_esd: dict
    secant: float = 1.0

    @property
    def warning(self) -> str | None:
        worst = max(self.shift_esd.items(), key=lambda kv: abs(kv[1]), default=None)
        if worst is None or abs(worst[1]) <= MAX_SHIFT_ESD:
            return None
        return (f"the cell still moves with the mosaic domain count: at {2 * self.domains} domains instead of "
                f"{self.domains} {worst[0]} would move by {self.shift[worst[0]]:+.4g} ({worst[1]:+.1f} esd); "
                f"refine with more domains (--model \"-mosaic_dom {2 * self.domains}\")")

    def to_dict(self) -> dict:
        return {"domains": self.domains, "check_domains": 2 * self.domains, "shift": dict(self.shift),
                "shift_esd": dict(self.shift_esd), "secant": self.secant, "max_shift_esd": MAX_SHIFT_ESD,
                "warning": self.warning}


def _values(pmap: ParameterMap, theta: Tensor) -> dict:
    return pmap.expand({n: theta[i] for i, n in enumerate(pmap.names)})


#: lattice-factor evaluations per row block of an eager check (about 1 GB of autograd graph, both halves)
EAGER_BLOCK_EVALUATIONS = 1 << 19


def _loss(objective: ImageObjective, parts: Sequence[ImageObjective], values: Mapping) -> Tensor:
    """The loss without priors (they cancel in the difference) of the mean model of ``parts``."""
    model, observed, weights = parts[0].pixels(values)
    for h in parts[1:]:
        model = model + h.pixels(values)[0]
    return objective.loss_fn(model / len(parts), observed, weights)


def _row_blocks(objective: ImageObjective, evaluations_per_pixel: int, compiled: bool) -> list[ImageObjective]:
    """The objective whole (compiled kernels: their autograd graph is small), or in blocks of whole rows of at most
    :data:`EAGER_BLOCK_EVALUATIONS` evaluations (eager: its graph holds every intermediate)."""
    if compiled or not objective.sparse or objective.view.bin != 1:
        return [objective]
    rows = objective.view.shape[0]
    per_row = max(objective.n_pixels / rows, 1.0)
    step = max(1, int(EAGER_BLOCK_EVALUATIONS / (per_row * evaluations_per_pixel)))
    return [objective.rows(r, min(r + step, rows)) for r in range(0, rows, step)]


class CountProbe:
    """The loss gradients of one image's objective with its own ``M`` mosaic domains and with ``2 M`` (the mean of
    two halves of ``M``), at any physical values ``theta`` of ``pmap.names``; ``None``-like (:attr:`active` False)
    when the model has no mosaic (one domain, or no spread).

    The simulators run as a refinement of these pixels would (:func:`nbtorch.runtime.policy.compile_policy`, whatever the
    objective's simulator was last switched to): the halves of ``2 M`` reuse the run's compiled kernel of ``M``."""

    def __init__(self, objective: ImageObjective, pmap: ParameterMap) -> None:
        self.objective, self.pmap = objective, pmap
        sim = objective.sim
        sampling = sim.setup.sampling
        self.domains = len(sampling.mosaic_fractions)
        self.active = self.domains >= 2 and (sampling.mosaic_spread_deg > 0 or sampling.mosaic_anisotropic)
        if not self.active:
            return
        per_pixel = sim.evaluations_per_pixel()
        compiled, why = runtime.compile_policy("refinement", objective.n_pixels * per_pixel)
        self.sims = [sim.with_mosaic_domains(self.domains)] + [
            sim.with_mosaic_domains(2 * self.domains, part, 2) for part in (0, 1)]
        for s in self.sims:
            s.set_compile(compiled, why)
        self.blocks = _row_blocks(objective, per_pixel, self.sims[0].compile_mode == "compiled")

    def gradients(self, theta: Tensor, own: bool = True) -> tuple[Tensor | None, Tensor]:
        """``(g_M, g_2M)`` at ``theta`` (float64; ``g_M`` None when ``own`` is False)."""
        g_own = torch.zeros(theta.shape, dtype=torch.float64) if own else None
        g_two = torch.zeros(theta.shape, dtype=torch.float64)
        for block in self.blocks:
            mine, *halves = (block.with_simulator(s) for s in self.sims)
            for target, parts in ((g_own, (mine,)), (g_two, halves)):
                if target is None:
                    continue
                th = theta.detach().clone().requires_grad_(True)
                loss = _loss(block, parts, _values(self.pmap, th))
                target += torch.autograd.grad(loss, th)[0].detach().to(torch.float64).cpu()
        return g_own, g_two


def count_gradient(objective: ImageObjective, pmap: ParameterMap, theta: Tensor) -> Tensor | None:
    """(P,) the gradient of the loss at ``theta`` (physical values of ``pmap.names``) with twice the simulator's mosaic
    domains minus with its own count; None when the model has no mosaic (one domain, or no spread)."""
    probe = CountProbe(objective, pmap)
    if not probe.active:
        return None
    g_own, g_two = probe.gradients(theta)
    return g_two - g_own


def secant_factor(slope_start: float, slope_end: float) -> float:
    """The step along a descent direction ``d`` to the minimum of a quadratic with directional slopes ``slope_start``
    (< 0) at 0 and ``slope_end`` at 1 (``d . g``): ``-slope_start / (slope_end - slope_start)``, in ``[0, 4]``; 1 (the
    Newton step) where the slopes show no positive curvature along ``d``."""
    curvature = slope_end - slope_start
    if not curvature > 0:
        return 1.0
    return float(min(max(-slope_start / curvature, 0.0), 4.0))


def single_check(objective: ImageObjective, pmap: ParameterMap, theta: Tensor, information: Tensor,
                 esds: Mapping[str, float]) -> "DomainCountCheck | None":
    """The check of a single image's refinement: the Fisher step ``d = -F^+ (g_2M - g_M)``, then the loss at
    ``2 M`` along ``d`` (one more gradient there): the secant of its slope gives the step's true length where the
    model misses part of the image (the loss's curvature is then not the Fisher matrix)."""
    probe = CountProbe(objective, pmap)
    if not probe.active:
        return None
    g_own, g_two = probe.gradients(theta)
    diff = g_two - g_own
    d = single_shift(information, diff)
    _, g_end = probe.gradients(theta.to(torch.float64) + d.to(theta.dtype), own=False)
    alpha = secant_factor(float(d @ diff), float(d @ (g_end - g_own)))
    return check_names(pmap.names, alpha * d, esds, probe.domains, alpha)


def single_shift(information: Tensor, gradient: Tensor) -> Tensor:
    """The Newton step ``-F^+ g`` (pseudo-inverse: a blind direction does not move)."""
    return -(torch.linalg.pinv(information.to(torch.float64)) @ gradient.to(torch.float64))


def reduced_terms(information: Tensor, gradient: Tensor, n_shared: int) -> tuple[Tensor, Tensor]:
    """One image's part of a joint run's shared Newton step: its ``[shared, own]`` Fisher block ``F`` and gradient
    ``g`` with the own names eliminated, ``(A - B D^+ B^T, g_s - B D^+ g_o)`` (``A``, ``B``, ``D``: F's shared,
    shared-own and own blocks)."""
    F, grad = information.to(torch.float64), gradient.to(torch.float64)
    A, B, D = F[:n_shared, :n_shared], F[:n_shared, n_shared:], F[n_shared:, n_shared:]
    if not D.numel():
        return A, grad[:n_shared]
    Dp = torch.linalg.pinv(D)
    return A - B @ Dp @ B.T, grad[:n_shared] - B @ Dp @ grad[n_shared:]


def shared_shift(terms: Sequence[tuple[Tensor, Tensor]], extra: Tensor | None = None) -> Tensor:
    """The shared names' Newton step of a joint run from every image's :func:`reduced_terms`: ``-S^+ g~`` with
    ``S`` and ``g~`` their sums (``extra``: curvature added to ``S``, the shared restraints)."""
    S = sum(t[0] for t in terms)
    g = sum(t[1] for t in terms)
    if extra is not None:
        S = S + extra.to(torch.float64)
    return -(torch.linalg.pinv(S) @ g)


def check_names(names: Sequence[str], shift: Tensor, esds: Mapping[str, float], domains: int,
                alpha: float = 1.0) -> DomainCountCheck:
    """The check of the cell names among ``names`` (the order of ``shift``), against the run's ``esds``."""
    out, over = {}, {}
    for i, name in enumerate(names):
        if name in CELL_NAMES:
            out[name] = float(shift[i])
            esd = esds.get(name)
            if esd and esd > 0:
                over[name] = out[name] / float(esd)
    check = DomainCountCheck(int(domains), out, over, float(alpha))
    log.info("domain count check (%d -> %d domains): %s", domains, 2 * domains,
             ", ".join(f"{n} {over.get(n, float('nan')):+.2f} esd" for n in out) or "no cell name refined")
    return check
