"""Refine one still from DIALS files (``dials.stills_process``'s ``.expt`` and ``.refl``, and the image) from Python.

    python examples/python/refine_still_from_dials.py IMAGE EXPT REFL [--max-steps N] [--no-esds]

does what ``nbtorch-refine --image IMAGE --expt EXPT --refl REFL --out out/still/result.h5`` does, and prints what it
prints: the still's defaults (spot windows, refined names), the fit, the result table (docs/python.md).
"""

import argparse

from refine import Measurement, Settings, refine_still

p = argparse.ArgumentParser()
p.add_argument("image")
p.add_argument("expt")
p.add_argument("refl")
p.add_argument("--max-steps", type=int)
p.add_argument("--no-esds", action="store_true")
a = p.parse_args()

measurement = Measurement.from_dials(a.expt, a.refl, image=a.image)   # the experiment, its spots, the image
settings = Settings.of(out="out/still/result.h5", max_steps=a.max_steps, no_esds=a.no_esds)
result = refine_still(measurement, settings, say=print)  # a RefinementResult
raise SystemExit(0 if result.status.ok else 1)
