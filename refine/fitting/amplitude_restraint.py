"""The amplitudes' restraint (:class:`AmplitudeRestraint`): each refined amplitude towards the mean of its
resolution bin, and each anomalous pair's difference towards 0 (``--f-restraint``, ``--anomalous-restraint``;
:mod:`refine.fitting.structure_factors`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError

if TYPE_CHECKING:  # the table's module names this class: no import at run time
    from refine.fitting.structure_factors import AmplitudeTable

__all__ = ["AmplitudeRestraint"]


class AmplitudeRestraint:
    """``0.5 sum_r ((F_r - <F>_bin(r)) / (sigma <F>_bin(r)))^2`` over the free amplitudes, and the anomalous
    pairs' term (module docstring): ``0.5 |residuals|^2``.

    Arguments:
        table: the run's :class:`AmplitudeTable` (its ``d_A`` bins the reflections).
        sigma: the relative width (e.g. 0.5: an amplitude may differ from its bin's mean by 50 % at one sigma);
            None: no bin term.
        per_bin, max_bins: about ``per_bin`` reflections per resolution bin, at most ``max_bins`` bins.
        anomalous_sigma: the relative width of ``F+ - F-`` of each pair (of :meth:`~refine.fitting.structure_factors.AmplitudeTable.pairs`); None: none.
    """

    def __init__(self, table: AmplitudeTable, sigma: float | None, per_bin: int = 20, max_bins: int = 10, *,
                 anomalous_sigma: float | None = None) -> None:
        for what, x in (("sigma", sigma), ("anomalous sigma", anomalous_sigma)):
            if x is not None and not (math.isfinite(x) and x > 0):
                raise InputError(f"structure-factor restraint: {what} must be > 0, got {x!r}")
        if sigma is None and anomalous_sigma is None:
            raise InputError("structure-factor restraint: give sigma, anomalous_sigma or both")
        n = len(table.names)
        self.table, self.sigma, self.anomalous_sigma = table, sigma, anomalous_sigma
        pairs = table.pairs() if anomalous_sigma is not None else []
        self.plus = torch.as_tensor([i for i, _ in pairs], dtype=torch.int64)
        self.minus = torch.as_tensor([j for _, j in pairs], dtype=torch.int64)
        self.n_bins = max(1, min(int(max_bins), n // max(int(per_bin), 1)))
        bins = np.zeros(n, dtype=np.int64)
        bins[np.argsort(-table.d_A, kind="stable")] = np.arange(n) * self.n_bins // max(n, 1)
        self.bins = torch.as_tensor(bins)
        self.counts = torch.bincount(self.bins, minlength=self.n_bins).to(torch.float64)
        self._on: dict = {}

    def _index_tensors(self, F: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(bins, counts, plus, minus)`` on ``F``'s device (counts in its dtype), copied there once: an
        evaluation on a GPU copies nothing from the host (a CUDA graph's capture forbids it)."""
        key = (str(F.device), F.dtype)
        if key not in self._on:
            self._on[key] = (self.bins.to(F.device), self.counts.to(F), self.plus.to(F.device), self.minus.to(F.device))
        return self._on[key]

    def residuals(self, F: Tensor) -> Tensor:
        """``(F - <F>_bin) / (sigma <F>_bin)`` (n,) of the amplitude vector ``F``, then each anomalous pair's
        ``(F+ - F-) / (anomalous_sigma (F+ + F-) / 2)``."""
        parts = []
        bins, counts, plus, minus = self._index_tensors(F)
        if self.sigma is not None:
            sums = F.new_zeros(self.n_bins).index_add(0, bins, F)
            mean = (sums / counts)[bins]
            parts.append((F - mean) / (self.sigma * mean))
        if self.anomalous_sigma is not None:
            fp, fm = F[plus], F[minus]
            parts.append((fp - fm) / (self.anomalous_sigma * 0.5 * (fp + fm)))
        return torch.cat(parts)

    def __call__(self, values: Mapping[str, Tensor | float], dtype: torch.dtype, device) -> Tensor:
        return 0.5 * (self.residuals(self.table.vector(values, dtype, device)) ** 2).sum()

    def jacobian(self, F: Tensor) -> Tensor:
        """(n, n) the residuals' Jacobian ``R`` at the amplitudes ``F`` (all of the table's)."""
        return torch.autograd.functional.jacobian(self.residuals, F.detach())

    def curvature(self, F: Tensor) -> Tensor:
        """(n, n) the Gauss-Newton curvature ``R^T R`` at amplitudes ``F``."""
        R = self.jacobian(F)
        return R.T @ R

    def curvature_diagonal(self, F: Tensor) -> Tensor:
        """(n,) the diagonal of :meth:`curvature` in closed form, without the (n, n) matrix (a bin's mean ``m``
        of ``k`` amplitudes with ``sum F^2 = Q``: ``1 / (s m)^2 - 2 F_j / (s^2 m^3 k) + Q / (s^2 m^4 k^2)``; a
        pair's ``(4 F_-/ (s_a (F_+ + F_-)^2))^2`` for ``F_+`` and ``(4 F_+ / ...)^2`` for ``F_-``)."""
        F = F.detach().to(torch.float64)
        out = torch.zeros_like(F)
        if self.sigma is not None:
            bins, k, s = self.bins.to(F.device), self.counts.to(F), self.sigma
            m = (F.new_zeros(self.n_bins).index_add(0, bins, F) / k)[bins]
            Q = F.new_zeros(self.n_bins).index_add(0, bins, F * F)[bins]
            kb = k[bins]
            out = out + 1.0 / (s * m) ** 2 - 2.0 * F / (s * s * m ** 3 * kb) + Q / (s * s * m ** 4 * kb * kb)
        if self.anomalous_sigma is not None and self.plus.numel():
            plus, minus = self.plus.to(F.device), self.minus.to(F.device)
            fp, fm = F[plus], F[minus]
            d = self.anomalous_sigma * (fp + fm) ** 2
            out = out.index_add(0, plus, (4.0 * fm / d) ** 2).index_add(0, minus, (4.0 * fp / d) ** 2)
        return out
