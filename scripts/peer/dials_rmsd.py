"""DIALS's rms of observed against predicted centroids over the reflections it refined, per file (opt-in peer helper;
run with DIALS's Python: scripts/peer/dials_peer.sh and dials_grid.sh).

    DIALS_PYTHON scripts/peer/dials_rmsd.py LABEL=idx-..._indexed.refl ...

Prints one line per file: the spots used in refinement, the rms in x, y and total (px) and the rms delpsi (deg).
"""

import math
import os
import sys

from dials.array_family import flex

for arg in sys.argv[1:]:
    label, _, path = arg.rpartition("=")
    if not os.path.exists(path):
        print(f"{label or path}: not indexed")
        continue
    r = flex.reflection_table.from_file(path)
    used = r.select(r.get_flags(r.flags.used_in_refinement))
    ox, oy, _ = used["xyzobs.px.value"].parts()
    cx, cy, _ = used["xyzcal.px"].parts()
    dx, dy = ox - cx, oy - cy
    print(f"{label or path}: spots used {len(used)}; rms x {math.sqrt(flex.mean(dx * dx)):.3f} px, "
          f"y {math.sqrt(flex.mean(dy * dy)):.3f} px, total {math.sqrt(flex.mean(dx * dx + dy * dy)):.3f} px; "
          f"delpsi {math.degrees(math.sqrt(flex.mean(flex.pow2(used['delpsical.rad'])))):.3f} deg")
