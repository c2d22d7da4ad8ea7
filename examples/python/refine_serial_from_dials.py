"""Refine a serial set from DIALS files (``dials.ssx_index``'s ``.expt`` of many stills and its ``.refl``) from
Python: the stills together in rounds, one shared cell, the stills that do not fit dropped with their reasons.

    python examples/python/refine_serial_from_dials.py EXPT REFL [--max-steps N]

does what ``nbtorch-refine --expt EXPT --refl REFL --joint --screen --out-dir out/serial`` does, and prints what it
prints (docs/python.md); each still's image is the one its experiment names.
"""

import argparse

from refine import Measurement, Settings, refine_serial

p = argparse.ArgumentParser()
p.add_argument("expt")
p.add_argument("refl")
p.add_argument("--max-steps", type=int)
p.add_argument("--no-esds", action="store_true")
a = p.parse_args()

measurement = Measurement.from_dials(a.expt, a.refl)            # every still of the file, its image and spots
settings = Settings.of(out_dir="out/serial", max_steps=a.max_steps, no_esds=a.no_esds)
result = refine_serial(measurement, settings, say=print)  # a SerialResult: result.joint, result.dropped
print(f"used {len(result.used)} of {len(result.used) + len(result.dropped)} stills")
raise SystemExit(0 if result.joint.status.ok else 1)
