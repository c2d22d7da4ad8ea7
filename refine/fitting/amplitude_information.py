"""The Fisher information of each refined amplitude on one image, without one pass per amplitude.

A joint refinement of many stills with shared structure factors (:mod:`refine.many.sparse_amplitudes`) needs,
for every still, how much its pixels tell about each amplitude: the diagonal of the still's Fisher matrix in
the amplitudes, ``I_h = sum_p w_p (d mu_p / d F_h)^2 / mu_p`` (``mu_p`` the model photons of fitted pixel
``p``, ``w_p`` its weight).  Built column by column that is one derivative pass per amplitude and still (hundreds);
here it takes **eight**, whatever the number of amplitudes, from two facts of the model:

* every evaluation of the kernel (sub-pixel, mosaic domain, phi step, source, sensor layer) reads **one** table
  entry, that of its nearest reflection, and adds ``F_e^2`` times a lattice term: the photons ``mu_p`` are
  ``b_p + sum_e F_e^2 G_pe`` with ``b_p`` the background and ``G_pe >= 0``;
* the evaluations of one pixel lie close together in reciprocal space (much less than one reflection apart),
  so the entries one pixel reads differ by at most 1 in each index.

So the table's entries fall into **8 classes** by the parity of ``(h, k, l)`` (:func:`entry_classes`), and in any
pixel at most one entry of a class has photons.  For class ``c``, the model with only that class's entries
(the others set to 0) gives its photons ``B_c(p) = mu_c(p) - mu_0(p)`` (``mu_0``: every entry 0), which in a
pixel are those of its one entry ``e``: ``F_e^2 G_pe``; and one backward pass of ``sum_p v_p mu_c(p)`` with
``v_p = 2 w_p B_c(p) / mu_p`` gives, for each entry ``e`` of the class, ``sum_p v_p 2 F_e G_pe = F_e I_e``.
An amplitude's information is the sum over the entries that follow it (its symmetry equivalents and, tied,
Friedel mates: far apart on the detector, so they share no pixel).  Exact for a model that meets the two facts
(the test compares it with the column-by-column matrix); the off-diagonal terms (neighbouring reflections that
share a pixel, an amplitude and the geometry) are left out by construction.  Entries outside the table (the
model's ``default_F``) and the background are in ``mu_0`` and cancel.  Units: ``F`` in electrons, the
information per electron squared.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["entry_classes", "amplitude_information", "CLASSES"]

#: the number of classes: the parities of h, k and l
CLASSES = 8


def entry_classes(shape: tuple[int, int, int], hkl_min) -> np.ndarray:
    """(nh, nk, nl) int: the class ``4 (h mod 2) + 2 (k mod 2) + (l mod 2)`` of every table entry, whose indices
    are ``hkl_min + position``."""
    h, k, l = (np.arange(n) + int(lo) for n, lo in zip(shape, hkl_min))
    return (4 * (h[:, None, None] % 2) + 2 * (k[None, :, None] % 2) + (l[None, None, :] % 2)).astype(np.int64)


def amplitude_information(objective, table, values) -> Tensor:
    """(A,) float64: the Fisher information of each of ``table``'s free amplitudes on ``objective``'s fitted
    pixels at ``values`` (physical units; the module docstring).  ``objective``: an
    :class:`~refine.fitting.objective.ImageObjective` holding ``table``; ``values``: every name, the amplitudes
    included (floats or tensors)."""
    dtype, dev = objective.dtype, objective.device
    with torch.no_grad():
        grid = table.grid(values, dtype, dev).detach()
        mu, _, w = objective.pixels(values, grid)
        mu0, _, _ = objective.pixels(values, torch.zeros_like(grid))
    mu, mu0, w = mu.detach(), mu0.detach(), w.detach()
    fit = w > 0
    classes = torch.as_tensor(entry_classes(tuple(grid.shape), table.hkl_min), device=dev)
    per_entry = torch.zeros_like(grid)
    for c in range(CLASSES):
        mask = classes == c
        if not bool((mask & (grid != 0)).any()):
            continue
        leaf = torch.where(mask, grid, torch.zeros_like(grid)).requires_grad_(True)
        with torch.enable_grad():
            mu_c, _, _ = objective.pixels(values, leaf)
            bragg = (mu_c.detach() - mu0).clamp(min=0.0)
            v = torch.where(fit, 2.0 * w * bragg / torch.clamp(mu, min=1e-12), torch.zeros_like(mu))
            (g,) = torch.autograd.grad(mu_c, leaf, grad_outputs=v, allow_unused=True)
        if g is None:
            continue
        safe = torch.where(grid != 0, grid, torch.ones_like(grid))
        per_entry = torch.where(mask & (grid != 0), g.detach() / safe, per_entry)
    index = torch.as_tensor(table.index.reshape(-1), device=dev)
    follows = index >= 0
    out = torch.zeros(len(table.names), dtype=torch.float64, device=dev)
    out.index_add_(0, index[follows], per_entry.reshape(-1)[follows].to(torch.float64))
    return out.cpu()
