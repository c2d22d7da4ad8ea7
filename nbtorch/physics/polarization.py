"""Kahn polarization factor.

``P = 1/2 (1 + cos^2 2theta - K cos 2psi sin^2 2theta)`` with ``K`` the Kahn
factor (``-polar``; 0 = unpolarized, the C default), ``2theta`` the angle between
incident and diffracted rays and ``psi`` the azimuth of the diffracted ray about
the beam measured from the E-vector (``polar_vector``).

Written without atan2: with ``e = d.E_in`` and ``b = d.B_in`` (components of
the unit diffracted ray on the incident E and B directions),
``cos 2psi sin^2 2theta = e^2 - b^2``, so P is smooth everywhere, the direct
beam included.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _unit(v: Tensor) -> Tensor:
    return v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)


def polarization_basis(incident: Tensor, polar_axis: Tensor) -> tuple[Tensor, Tensor]:
    """Unit E and B directions ``(e_in, b_in)`` (..., 3) of incident rays (..., 3) for the E-vector ``polar_axis`` (3,)."""
    b_in = _unit(torch.linalg.cross(polar_axis.expand_as(incident), incident, dim=-1))
    e_in = _unit(torch.linalg.cross(incident, b_in, dim=-1))
    return e_in, b_in


def kahn_from_projections(cos2t: Tensor, e: Tensor, b: Tensor, kahn: Tensor) -> Tensor:
    """The factor from the diffracted ray's projections on the incident ray (``cos2t``), E (``e``) and B (``b``)."""
    return 0.5 * (1.0 + cos2t * cos2t - kahn * (e * e - b * b))


def kahn_polarization(incident: Tensor, diffracted: Tensor, polar_axis: Tensor, kahn: Tensor) -> Tensor:
    """Polarization factor.

    Arguments:
        incident: (..., 3) unit vector along the incident ray (source -> sample).
        diffracted: (..., 3) unit vector sample -> pixel.
        polar_axis: (3,) E-vector direction of the incident beam.
        kahn: Kahn factor K (scalar tensor).

    Returns: (...) factor.
    """
    e_in, b_in = polarization_basis(incident, polar_axis)
    return kahn_from_projections((incident * diffracted).sum(-1), (diffracted * e_in).sum(-1),
                                 (diffracted * b_in).sum(-1), kahn)
