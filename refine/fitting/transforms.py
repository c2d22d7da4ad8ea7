"""Invertible parameter transforms: unconstrained raw tensor <-> physical value.

A refiner optimizes a *raw* tensor; ``transform(raw)`` (``forward``) gives the
physical value handed to the simulator and ``transform.inverse(value)`` gives
the raw tensor for a starting value.  Each transform has a ``scale`` (in the
parameter's units) chosen so that a raw step of about 1 is a typical
refinement step.  All are elementwise and work on any shape and floating dtype;
``forward(inverse(v)) == v`` to ~1e-12 relative in float64 for ``v`` inside the
domain.

=========================  =====================================  ==================
transform                  value = forward(raw)                   domain of value
=========================  =====================================  ==================
``Identity(s, o)``         ``o + s * raw``                        all reals
``Positive(s)``            ``s * softplus(raw)``                  ``> 0``
``LogPositive(s)``         ``s * exp(raw)``                       ``> 0``
``Bounded(lo, hi)``        ``lo + (hi - lo) * sigmoid(raw)``      ``(lo, hi)``
``Multiplicative(r, s)``   ``r * exp(s * raw)``                   ``> 0``
=========================  =====================================  ==================

``Multiplicative(reference, step)`` is the refiner's transform for positive
quantities (:mod:`refine.fitting.parameters`): raw 0 is the reference (starting)
value and a raw step of 1 multiplies the value by ``e^step`` (about
``1 + step``), so ``step = 0.01`` makes one raw unit a 1% change; ``Multiplicative(r, s, L)``
saturates the exponent at ``+-L`` (``r * exp(L tanh(s * raw / L))``: a structure factor's).

``softplus(x) = log(1 + e^x)`` and its inverse ``log(e^y - 1)`` are computed
in overflow-free forms (``max(x, 0) + log1p(e^-|x|)`` and
``y + log(-expm1(-y))``), exact for large arguments as well (torch's own
softplus switches to ``x`` above 20, an error of 2e-9).  ``Positive`` behaves
like ``s * raw`` for large raw and like ``s * e^raw`` for very negative raw.
``inverse`` raises :class:`~nbtorch.errors.InputError` (a ``ValueError``) for
values outside the open domain (they would map to an infinite raw value).

:func:`default_transform` picks a transform for each canonical simulator
parameter (units as in :mod:`nbtorch.rules.resolve`); ``v`` is the starting value:

=====================================  =========================================
parameter                              transform
=====================================  =========================================
cell_a cell_b cell_c (A)               ``Positive(v)``
N_a N_b N_c                            ``Positive(v)``
N_d N_e N_f (off-diagonal sizes)       ``Identity(0.5, v)`` (either sign; unit cells)
distance (mm)                          ``Positive(v)``
wavelength (A)                         ``Positive(v)``
dispersion (%), divergence_h/_v (mrad) ``Positive(v)``
mosaic_spread (deg)                    ``Positive(max(v, 0.05))``
mosaic_spread_a/b/c (deg)              ``Positive(max(v, 0.05))`` (the anisotropic mosaic)
fluence (photons/m^2)                  ``LogPositive(v)`` (raw step 1 = factor e)
cell_alpha cell_beta cell_gamma (deg)  ``Identity(0.05, v)``
misset_x misset_y misset_z (deg)       ``Identity(0.02, v)``
phi0 (deg)                             ``Identity(0.02, v)``
detector_rotx/roty/rotz (deg)          ``Identity(0.05, v)``
twotheta (deg)                         ``Identity(0.05, v)``
beam_x beam_y (mm)                     ``Identity(0.1, v)``
polarization (Kahn factor K)           ``Bounded(-1, 1)``
default_F                              ``Identity(max(abs(v), 1), v)``
=====================================  =========================================

Rationale: positive-only quantities use softplus (well conditioned near the
start value, no exponential blow-up for large steps) with ``scale = v`` so a
raw step of 1 changes them by tens of percent; fluence spans orders of
magnitude and is refined in log space.  Angles are additive; the
orientation angles (misset, phi0) get 0.02 deg because spot positions are most
sensitive to them, the cell and detector angles 0.05 deg.  Identity transforms
use ``offset = v`` so the raw value starts at 0.  The Kahn factor lies in
``[-1, 1]`` (0 = unpolarized, the default, and 1 = fully polarized are both
physical) so ``Bounded(-1, 1)`` keeps the default 0 in the interior; a
``Bounded(0, 1)`` would map it to raw = -inf.  Positive parameters need a
starting value > 0; ``mosaic_spread`` 0 is rejected because the simulator
then uses a single unrotated domain, so the spread has no effect and no
gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from nbtorch.errors import InputError

__all__ = [
    "Transform", "Identity", "Positive", "LogPositive", "Bounded", "Multiplicative", "Held",
    "default_transform", "TRANSFORM_NAMES", "SharedHead", "multiplicative",
]


def _finite(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v):
        raise InputError(f"{name}: must be finite, got {value!r}")
    return v


def _positive(name: str, value: float) -> float:
    v = _finite(name, value)
    if v <= 0:
        raise InputError(f"{name}: must be > 0, got {value!r}")
    return v


def _floating(name: str, x: Tensor) -> Tensor:
    x = torch.as_tensor(x)
    if not x.is_floating_point():
        raise InputError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    return x


def softplus(x: Tensor) -> Tensor:
    """``log(1 + e^x)`` without overflow and without torch's linear cut-off at 20."""
    neg = torch.clamp(x, max=0.0)
    pos = torch.clamp(x, min=0.0)
    return torch.where(x > 0, x + torch.log1p(torch.exp(-pos)), torch.log1p(torch.exp(neg)))


def softplus_inverse(y: Tensor) -> Tensor:
    """``log(e^y - 1)`` for ``y > 0``, as ``y + log(-expm1(-y))`` (no overflow for large y)."""
    return y + torch.log(-torch.expm1(-y))


class Transform(nn.Module):
    """Base class: ``forward(raw) -> value``, ``inverse(value) -> raw``, attribute ``scale``."""

    scale: float

    def forward(self, raw: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def inverse(self, value: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class Identity(Transform):
    """``value = offset + scale * raw`` (unconstrained)."""

    def __init__(self, scale: float = 1.0, offset: float = 0.0) -> None:
        super().__init__()
        self.scale = _positive("scale", scale)
        self.offset = _finite("offset", offset)

    def forward(self, raw: Tensor) -> Tensor:
        return self.offset + self.scale * _floating("raw", raw)

    def inverse(self, value: Tensor) -> Tensor:
        return (_floating("value", value) - self.offset) / self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}, offset={self.offset}"


class Positive(Transform):
    """``value = scale * softplus(raw)`` (> 0); ``raw = log(expm1(value / scale))``."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = _positive("scale", scale)

    def forward(self, raw: Tensor) -> Tensor:
        return self.scale * softplus(_floating("raw", raw))

    def inverse(self, value: Tensor) -> Tensor:
        value = _floating("value", value)
        if not bool((value > 0).all()):
            raise InputError("value: Positive.inverse needs values > 0")
        return softplus_inverse(value / self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class LogPositive(Transform):
    """``value = scale * exp(raw)`` (> 0); ``raw = log(value / scale)``."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = _positive("scale", scale)

    def forward(self, raw: Tensor) -> Tensor:
        return self.scale * torch.exp(_floating("raw", raw))

    def inverse(self, value: Tensor) -> Tensor:
        value = _floating("value", value)
        if not bool((value > 0).all()):
            raise InputError("value: LogPositive.inverse needs values > 0")
        return torch.log(value / self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class Bounded(Transform):
    """``value = low + (high - low) * sigmoid(raw)`` in ``(low, high)``; ``scale = high - low``."""

    def __init__(self, low: float, high: float) -> None:
        super().__init__()
        self.low = _finite("low", low)
        self.high = _finite("high", high)
        if not self.high > self.low:
            raise InputError(f"high: must be > low, got low={low!r}, high={high!r}")
        self.scale = self.high - self.low

    def forward(self, raw: Tensor) -> Tensor:
        return self.low + self.scale * torch.sigmoid(_floating("raw", raw))

    def inverse(self, value: Tensor) -> Tensor:
        value = _floating("value", value)
        if not bool(((value > self.low) & (value < self.high)).all()):
            raise InputError(f"value: Bounded.inverse needs values strictly inside ({self.low}, {self.high})")
        # logit(u) with u = (v - low) / (high - low), written as log(v - low) - log(high - v)
        # so both ends keep full relative precision
        return torch.log(value - self.low) - torch.log(self.high - value)

    def extra_repr(self) -> str:
        return f"low={self.low}, high={self.high}"


def multiplicative(raw: Tensor, reference: float | Tensor, step: float, limit: float | None) -> Tensor:
    """:class:`Multiplicative`'s value ``reference * exp(limit * tanh(step * raw / limit))`` (without ``limit``:
    ``reference * exp(step * raw)``); ``reference`` a number, or a tensor of ``raw``'s shape (a run of amplitudes
    at once, :class:`~refine.fitting.amplitude_values.AmplitudeBlock`)."""
    x = step * raw
    if limit is not None:
        x = limit * torch.tanh(x / limit)
    return reference * torch.exp(x)


class Multiplicative(Transform):
    """``value = reference * exp(step * raw)`` (> 0); ``raw = log(value / reference) / step``.

    A raw step of 1 multiplies the value by ``e^step``; ``scale = reference * step``
    (the change per raw unit at raw = 0).  With ``limit`` the exponent saturates smoothly,
    ``value = reference * exp(limit * tanh(step * raw / limit))``: the value stays within
    ``e^limit`` of the reference either way, so that no trial step of a line search, however
    long, overflows to Inf (a refined structure factor; the exponent is ``step * raw`` to
    0.1 % up to a third of ``limit``).
    """

    def __init__(self, reference: float, step: float = 0.01, limit: float | None = None) -> None:
        super().__init__()
        self.reference = _positive("reference", reference)
        self.step = _positive("step", step)
        self.limit = None if limit is None else _positive("limit", limit)
        self.scale = self.reference * self.step

    def forward(self, raw: Tensor) -> Tensor:
        return multiplicative(_floating("raw", raw), self.reference, self.step, self.limit)

    def inverse(self, value: Tensor) -> Tensor:
        value = _floating("value", value)
        if not bool((value > 0).all()):
            raise InputError("value: Multiplicative.inverse needs values > 0")
        x = torch.log(value / self.reference)
        if self.limit is not None:
            if not bool((x.abs() < self.limit).all()):
                raise InputError(f"value: Multiplicative.inverse needs values within e^{self.limit:g} of "
                                 f"{self.reference:g}")
            x = self.limit * torch.atanh(x / self.limit)
        return x / self.step

    def extra_repr(self) -> str:
        return f"reference={self.reference}, step={self.step}" + (
            "" if self.limit is None else f", limit={self.limit}")


class Held(Transform):
    """``value = value0`` whatever ``raw`` (its gradient 0): a name that keeps its place in a raw vector but is
    not refined (a joint refinement's image-0 scale next to shared structure factors, :mod:`refine.many.joint`)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = _finite("value", value)
        self.scale = 1.0

    def forward(self, raw: Tensor) -> Tensor:
        raw = _floating("raw", raw)
        return raw * 0.0 + self.value

    def inverse(self, value: Tensor) -> Tensor:
        return torch.zeros_like(_floating("value", value))

    def extra_repr(self) -> str:
        return f"value={self.value}"


_POSITIVE = ("cell_a", "cell_b", "cell_c", "N_a", "N_b", "N_c", "distance", "wavelength", "dispersion", "divergence_h",
             "divergence_v")
_ANGLE_SCALES = {
    "cell_alpha": 0.05, "cell_beta": 0.05, "cell_gamma": 0.05,
    "misset_x": 0.02, "misset_y": 0.02, "misset_z": 0.02, "phi0": 0.02,
    "detector_rotx": 0.05, "detector_roty": 0.05, "detector_rotz": 0.05, "twotheta": 0.05,
    "beam_x": 0.1, "beam_y": 0.1,
}
#: the off-diagonal crystal sizes of -gauss_aniso_xtal (unit cells, either sign): additive
_OFF_DIAGONAL_SCALES = {"N_d": 0.5, "N_e": 0.5, "N_f": 0.5}
MOSAIC_SCALE_MIN_DEG = 0.05
_SPREADS = ("mosaic_spread", "mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c")
TRANSFORM_NAMES = (*_POSITIVE, *_ANGLE_SCALES, *_OFF_DIAGONAL_SCALES, *_SPREADS, "fluence", "polarization",
                   "default_F")


def default_transform(name: str, value: float | Tensor) -> Transform:
    """A sensible transform for canonical parameter ``name`` starting at ``value`` (see module docstring).

    Arguments:
        name: canonical simulator parameter name (``nbtorch.rules.resolve.PARAMETER_NAMES``).
        value: starting value in the parameter's units (a number or a 1-element tensor).

    Raises ``InputError`` (``ValueError``) for an unknown name, a non-finite
    value, or a non-positive value of a positive parameter.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise InputError(f"value: expected a single number for {name}, got shape {tuple(value.shape)}")
        value = value.item()
    if name not in TRANSFORM_NAMES:
        raise InputError(f"name: unknown parameter {name!r}; valid names: {', '.join(TRANSFORM_NAMES)}")
    v = _finite(f"value ({name})", value)
    if name in _POSITIVE:
        return Positive(_positive(f"value ({name})", v))
    if name in _SPREADS:
        return Positive(max(_positive(f"value ({name})", v), MOSAIC_SCALE_MIN_DEG))
    if name == "fluence":
        return LogPositive(_positive(f"value ({name})", v))
    if name in _ANGLE_SCALES:
        return Identity(_ANGLE_SCALES[name], v)
    if name in _OFF_DIAGONAL_SCALES:
        return Identity(_OFF_DIAGONAL_SCALES[name], v)
    if name == "polarization":
        if not -1.0 < v < 1.0:
            raise InputError(f"value (polarization): Kahn factor must be inside (-1, 1), got {value!r}")
        return Bounded(-1.0, 1.0)
    return Identity(max(abs(v), 1.0), v)  # default_F


class SharedHead(Sequence):
    """A map's transforms: the first ``n`` of another map's (``head``, shared and never replaced), then its own
    (a list; ``seq[i] = t`` replaces one of them).  Index, slice, iterate and ``len`` as a list."""

    #: shorter runs of shared transforms are copied into a plain list
    WORTH = 16
    __slots__ = ("head", "n", "own")

    def __init__(self, head: Sequence[Transform], n: int, own: list) -> None:
        self.head, self.n, self.own = head, int(n), own

    @classmethod
    def over(cls, head: Sequence[Transform], mine: list) -> "SharedHead | list":
        """``mine`` over the run of its leading objects that are ``head``'s at the same places, when that run is
        at least :attr:`WORTH` long; else ``mine``."""
        n = 0
        while n < min(len(mine), len(head)) and mine[n] is head[n]:
            n += 1
        return cls(head, n, mine[n:]) if n >= cls.WORTH else mine

    def __len__(self) -> int:
        return self.n + len(self.own)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        j = i + len(self) if i < 0 else i
        if not 0 <= j < len(self):
            raise IndexError(f"transform {i} of {len(self)}")
        return self.head[j] if j < self.n else self.own[j - self.n]

    def __setitem__(self, i: int, value: Transform) -> None:
        j = i + len(self) if i < 0 else i
        if not self.n <= j < len(self):
            raise IndexError(f"transform {i}: only a map's own transforms ({self.n}..{len(self) - 1}) are replaced")
        self.own[j - self.n] = value

    def __iter__(self):
        yield from (self.head[j] for j in range(self.n))
        yield from self.own
