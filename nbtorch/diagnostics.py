"""Dynamo-safe diagnostics: tensors returned beside the image, delivered to subscribers.

The kernel never prints or calls ``.item()``: it returns small tensors
(fraction of structure-factor lookups outside the HKL table, min/max h, k, l
touched, image max/mean/sum).  :class:`DiagnosticsHooks` hands them to
subscribers *after* the compiled region has run, rate-limited per subscriber;
with no subscriber it does nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

Hook = Callable[[dict[str, Tensor]], None]


@dataclass
class _Subscription:
    fn: Hook
    every: int = 1
    min_interval_s: float = 0.0
    calls: int = 0
    last_time: float = field(default=-float("inf"))


class DiagnosticsHooks:
    """Subscribers to a simulator's diagnostics (no-op until someone subscribes)."""

    def __init__(self) -> None:
        self._subs: dict[int, _Subscription] = {}
        self._next = 0

    def subscribe(self, fn: Hook, every: int = 1, min_interval_s: float = 0.0) -> int:
        """Call ``fn(diagnostics)`` on every ``every``-th render, at most once per ``min_interval_s``.

        Returns a handle for :meth:`unsubscribe`.
        """
        if every < 1:
            raise ValueError(f"every: must be >= 1, got {every}")
        handle = self._next
        self._next += 1
        self._subs[handle] = _Subscription(fn, every, min_interval_s)
        return handle

    def unsubscribe(self, handle: int) -> None:
        self._subs.pop(handle, None)

    def __len__(self) -> int:
        return len(self._subs)

    def emit(self, diagnostics: dict[str, Tensor]) -> None:
        """Deliver detached diagnostics to due subscribers (called outside compiled code)."""
        if not self._subs:
            return
        now = time.monotonic()
        payload = None
        for sub in list(self._subs.values()):
            sub.calls += 1
            if (sub.calls - 1) % sub.every or now - sub.last_time < sub.min_interval_s:
                continue
            if payload is None:
                payload = {k: v.detach() for k, v in diagnostics.items()}
            sub.last_time = now
            sub.fn(payload)


def logging_hook(logger: logging.Logger | None = None, level: int = logging.INFO) -> Hook:
    """A subscriber that logs the diagnostics as one line at ``level`` on ``logger`` (default the
    ``nbtorch.diagnostics`` logger): ``diagnostics: image_max=154.652 hkl0_min=[-3, 0, 2] ...``, every value
    ``%.6g``, in the order given.  Nothing is read from the tensors when the level is disabled."""
    logger = logger or logging.getLogger("nbtorch.diagnostics")

    def hook(diag: dict[str, Tensor]) -> None:
        if logger.isEnabledFor(level):
            parts = []
            for k, v in diag.items():
                values = [x + 0.0 for x in v.detach().cpu().double().reshape(-1).tolist()]  # + 0.0: no "-0"
                text = f"{values[0]:.6g}" if v.dim() == 0 else "[" + ", ".join(f"{x:.6g}" for x in values) + "]"
                parts.append(f"{k}={text}")
            logger.log(level, "diagnostics: %s", " ".join(parts))

    return hook


__all__ = ["DiagnosticsHooks", "logging_hook", "Hook"]
_ = torch  # torch is part of the public types above
