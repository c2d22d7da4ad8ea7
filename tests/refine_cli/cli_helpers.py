"""Helpers of the nbtorch-refine tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import numpy as np

#: a small starting model (MOSFLM, 32 x 32 pixels of 0.1 mm) and its geometry
SMALL_MODEL = ("-cell 30 30 40 90 90 90 -misset 10 20 30 -N 5 -default_F 100 -lambda 1.0 -distance 40 "
               "-pixel 0.1 -detpixels 32 -mosaic 0.2 -mosaic_dom 2 -oversample 1")
CRYSTAL = "-cell 30 30 40 90 90 90 -misset 10 20 30 -N 5 -default_F 100 -mosaic 0.2 -mosaic_dom 2 -oversample 1"


def simulate(flags: str, scale: float = 1.0, background: float = 5.0, seed: int = 1) -> np.ndarray:
    """A noisy 'measured' image: Poisson(scale * model + background)."""
    import torch

    from nbtorch import Simulator, config_from_args

    sim = Simulator(config_from_args(flags.split()), compile=False)
    with torch.no_grad():
        img = sim().numpy()
    return np.random.default_rng(seed).poisson(scale * img + background).astype(np.int32)
