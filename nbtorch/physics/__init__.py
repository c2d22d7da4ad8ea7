"""Pure tensor functions for the nanoBragg physics.

Every function here takes tensors and returns tensors: no I/O, no config
objects, no hidden random state.  They are device and dtype neutral
(float32 and float64) and differentiable wherever the physics is continuous.

Frames and units (see ``docs/conventions.md``):

* lab frame: right-handed, the convention's beam vector ``b`` points from the
  source through the sample; vectors are 3-vectors in the last dimension;
* lengths inside the kernel are metres, crystal vectors Angstrom (converted
  once where they meet the scattering vector), angles radians.
"""

from nbtorch.physics.rotation import (
    rotate_axis,
    rotation_matrix_axis_angle,
    rotation_matrix_xyz,
)
from nbtorch.physics.crystal import (
    cell_from_vectors,
    crystal_real_and_reciprocal,
    reciprocal_basis_from_cell,
)
from nbtorch.physics.lattice import lattice_factor, sinc3_from_sq, sincg
from nbtorch.physics.structure import structure_factor
from nbtorch.physics.polarization import kahn_polarization
from nbtorch.physics.detector import DetectorGeometry, detector_geometry, subpixel_positions

__all__ = [
    "rotate_axis",
    "rotation_matrix_axis_angle",
    "rotation_matrix_xyz",
    "cell_from_vectors",
    "crystal_real_and_reciprocal",
    "reciprocal_basis_from_cell",
    "lattice_factor",
    "sinc3_from_sq",
    "sincg",
    "structure_factor",
    "kahn_polarization",
    "DetectorGeometry",
    "detector_geometry",
    "subpixel_positions",
]
