"""The refinement layer: fitting simulator parameters to observed images.

At present this package provides only the parameter transforms of
:mod:`refine.transforms` (unconstrained raw tensor <-> physical value, with a
per-parameter scale, and :func:`default_transform` for the canonical simulator
parameters).  The losses live in the separate :mod:`losses` package.  There is
no optimizer loop here yet.
"""

from __future__ import annotations

from refine.transforms import (
    TRANSFORM_NAMES,
    Bounded,
    Identity,
    LogPositive,
    Positive,
    Transform,
    default_transform,
)

__all__ = [
    "Transform",
    "Identity",
    "Positive",
    "LogPositive",
    "Bounded",
    "default_transform",
    "TRANSFORM_NAMES",
]
