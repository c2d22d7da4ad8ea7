"""Many images: independent runs (batch) and joint refinement of stills or rotation series with shared parameters, its esds, amplitudes and checkpoints."""
