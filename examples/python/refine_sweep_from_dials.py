"""Refine a rotation sweep from DIALS files (``dials.index``/``dials.refine``'s ``.expt`` and ``.refl``, the images of
the scan) from Python: one crystal turning, its cell and orientation shared by the images.

    python examples/python/refine_sweep_from_dials.py EXPT REFL 'IMAGES*.cbf' [--model FLAGS] [--max-steps N]

does what ``nbtorch-refine --images 'IMAGES*.cbf' --expt EXPT --refl REFL --rotation-series --out-dir out/sweep``
does, and prints what it prints (docs/python.md).
"""

import argparse

from refine import Measurement, Settings, refine_rotation_series

p = argparse.ArgumentParser()
p.add_argument("expt")
p.add_argument("refl")
p.add_argument("images", nargs="+")
p.add_argument("--model", help="nanoBragg flags after the experiment's (e.g. -default_F 100)")
p.add_argument("--max-steps", type=int)
p.add_argument("--no-esds", action="store_true")
a = p.parse_args()

measurement = Measurement.from_dials(a.expt, a.refl, images=a.images, model=a.model)  # each image matched to the scan
settings = Settings.of(out_dir="out/sweep", max_steps=a.max_steps, no_esds=a.no_esds)
result = refine_rotation_series(measurement, settings, say=print)  # a JointResult
print("shared:", ", ".join(f"{k} {v:.5g}" for k, v in result.shared.items() if k.startswith("cell_")))
raise SystemExit(0 if result.status.ok else 1)
