"""X-ray attenuation in a silicon sensor: the ``-detector_abs`` depth for a measured image's parallax.

A photon enters a pixel's sensor at an angle and is absorbed at some depth, so a spot is displaced
away from the beam (parallax) and widened.  nanoBragg models it with ``-detector_thick`` (sensor
thickness, µm), ``-detector_abs`` (attenuation depth ``1/mu``, µm) and ``-detector_thicksteps``
(layers).  :func:`silicon_attenuation_length_um` gives ``1/mu`` of silicon at a wavelength.

Numbers: the total mass attenuation coefficient ``mu/rho`` of silicon (Z = 14, with coherent
scattering) from J. H. Hubbell and S. M. Seltzer, *Tables of X-Ray Mass Attenuation Coefficients and
Mass Energy-Absorption Coefficients*, NIST Standard Reference Database 126 (NISTIR 5632),
https://physics.nist.gov/PhysRefData/XrayMassCoef/ElemTab/z14.html , at the tabulated energies above
the K edge (1.8389 keV) up to 100 keV, interpolated linearly in ``log(mu/rho)`` against ``log(E)``
(the coefficient follows a power law between the grid points; within a few per cent of XCOM).  Density
2.33 g/cm³.  ``mu = (mu/rho) * rho``; the attenuation length is ``1/mu``.  At 12.8 keV (0.9686 Å)
this gives mu/rho = 16.4 cm²/g, 1/mu = 261 µm: a 450 µm Pilatus sensor absorbs 82 % of the photons.
"""

from __future__ import annotations

import math

import numpy as np

from nbtorch.errors import InputError

__all__ = ["SILICON_MU_RHO", "SILICON_DENSITY", "HC_KEV_A", "silicon_mu_rho", "silicon_attenuation_length_um",
           "DEFAULT_THICKSTEPS"]

#: (photon energy keV, mu/rho cm^2/g) of silicon, NIST SRD 126 (Hubbell & Seltzer), above the K edge
SILICON_MU_RHO = (
    (2.0, 2777.0), (3.0, 978.4), (4.0, 452.9), (5.0, 245.0), (6.0, 147.0), (8.0, 64.68), (10.0, 33.89),
    (15.0, 10.34), (20.0, 4.464), (30.0, 1.436), (40.0, 0.7012), (50.0, 0.4385), (60.0, 0.3207),
    (80.0, 0.2228), (100.0, 0.1835),
)
#: g/cm^3 (NIST SRD 126, Table 1)
SILICON_DENSITY = 2.33
#: h c in keV Å (CODATA 2018): E[keV] = HC_KEV_A / lambda[Å]
HC_KEV_A = 12.398419843320026
#: sensor layers of the parallax model (``-detector_thicksteps``): 3 resolve the depth profile of a
#: 300-1000 µm sensor at 8-20 keV to a small fraction of a pixel, at 3x the cost of a flat detector
DEFAULT_THICKSTEPS = 3


def silicon_mu_rho(energy_keV: float) -> float:
    """Mass attenuation coefficient of silicon (cm²/g) at ``energy_keV`` (2-100 keV, log-log interpolated).

    Raises:
        InputError: an energy outside the table.
    """
    e = np.array([p[0] for p in SILICON_MU_RHO])
    m = np.array([p[1] for p in SILICON_MU_RHO])
    if not (math.isfinite(energy_keV) and e[0] <= energy_keV <= e[-1]):
        raise InputError(f"photon energy {energy_keV:.4g} keV is outside the silicon attenuation table "
                         f"({e[0]:g}-{e[-1]:g} keV)")
    return float(np.exp(np.interp(math.log(energy_keV), np.log(e), np.log(m))))


def silicon_attenuation_length_um(wavelength_A: float) -> float:
    """Attenuation length ``1/mu`` of silicon (µm) at ``wavelength_A`` (Å): nanoBragg's ``-detector_abs``.

    Raises:
        InputError: a wavelength that is not positive or whose energy is outside 2-100 keV.
    """
    if not (math.isfinite(wavelength_A) and wavelength_A > 0):
        raise InputError(f"wavelength {wavelength_A!r} A: cannot give a silicon attenuation length")
    mu_per_cm = silicon_mu_rho(HC_KEV_A / wavelength_A) * SILICON_DENSITY
    return 1e4 / mu_per_cm
