"""The detector's geometry and conventions: beam centres, detector axes, rotations for code outside the physics, multi-panel layouts."""
