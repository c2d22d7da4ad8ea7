"""Rotation matrices for code outside the physics (the refinement, DIALS geometry): the physics' own functions,
named here so that ``refine`` reaches them through nbtorch's public modules and never imports
``nbtorch.physics`` (docs/architecture.md).

* :func:`rotation_matrix_xyz` — ``R = Rz(z) @ Ry(y) @ Rx(x)`` from angles in radians (nanoBragg's ``-misset``
  order), right-handed, active rotations of column vectors;
* :func:`rotation_matrix_axis_angle` — rotation by ``angle`` (radians, right-handed) about a unit ``axis``.
"""

from nbtorch.physics.rotation import rotation_matrix_axis_angle, rotation_matrix_xyz

__all__ = ["rotation_matrix_xyz", "rotation_matrix_axis_angle"]
