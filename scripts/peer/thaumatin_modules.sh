#!/usr/bin/env bash
# The thaumatin stills with the Pilatus3 6M as one rigid panel and as 60 modules, the crystal refined (issue 35;
# docs/validation.md, "60 modules").  Opt-in: needs the DIALS that
# scripts/peer/build_dials.sh built, for the 60-panel experiment and its indexed spots (never run by the tests).
#
#   usage: scripts/peer/thaumatin_modules.sh DIALS_TARGET_DIR [OUT_DIR] [SHARED_DIR]
#
# Run from the checkout.  OUT_DIR (default out/thaumatin_modules) gets dials/ (each still imported with
# format.multi_panel=True, i.e. 60 panels, and indexed by dials.stills_process with the known symmetry) and one
# nbtorch-refine result per still and grouping (s3_g0, s3_g1, s4_g0, s4_g1: g0 one rigid panel, g1 each module),
# all with examples/thaumatin_modules.toml; then a table of the results.  SHARED_DIR defaults to ../shared.
set -euo pipefail

TARGET=$(realpath -m "${1:?usage: thaumatin_modules.sh DIALS_TARGET_DIR [OUT_DIR] [SHARED_DIR]}")
OUT=$(realpath -m "${2:-out/thaumatin_modules}")
SHARED=$(realpath -m "${3:-../shared}")
HERE=$(pwd)
say() { echo "thaumatin_modules: $*" >&2; }
[ -x "$TARGET/venv/bin/dials.stills_process" ] \
    || { say "no DIALS in $TARGET/venv (run scripts/peer/build_dials.sh $TARGET first)"; exit 2; }
THAU=$SHARED/real/thaumatin_i24_still
[ -f "$THAU/thau_3_2_0003.cbf.bz2" ] || { say "no thaumatin stills under $SHARED/real"; exit 2; }
[ -f examples/thaumatin_modules.toml ] || { say "run from the nbtorch checkout"; exit 2; }
PY=${PYTHON:-$HERE/.venv/bin/python}
mkdir -p "$OUT/dials"
printf 'indexing.known_symmetry.space_group = P41212\nindexing.known_symmetry.unit_cell = 57.8,57.8,150.2,90,90,90\n'\
'output.composite_output = False\ndispatch.integrate = False\nmp.nproc = 1\n' > "$OUT/dials/stills.phil"
for n in 3 4; do
    (
        cd "$OUT/dials"
        [ -f "thau_3_2_000$n.cbf" ] || bzcat "$THAU/thau_3_2_000$n.cbf.bz2" > "thau_3_2_000$n.cbf"
        "$TARGET/venv/bin/dials.import" "thau_3_2_000$n.cbf" format.multi_panel=True \
            output.experiments="imported$n.expt" > "import$n.log"
        mkdir -p "mp$n" && cd "mp$n"
        "$TARGET/venv/bin/dials.stills_process" "../imported$n.expt" ../stills.phil > stills_process.log
    )
done
for n in 3 4; do
    for level in 0 1; do
        d=$OUT/dials
        "$PY" -m refine.cli --config examples/thaumatin_modules.toml --panel-groups "$level" \
            --expt "$d/mp$n/idx-thau_3_2_000${n}_refined.expt" --image "$d/thau_3_2_000$n.cbf" \
            --refl "$d/mp$n/idx-thau_3_2_000${n}_indexed.refl" --out "$OUT/s${n}_g$level/result.h5" \
            > "$OUT/s${n}_g$level.log"
    done
done
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| run | spot rms px (matched/n) | excess | sigZ | a (A) | c (A) | distance mm | steps | wall s |")
for run in sorted(Path(sys.argv[1]).glob("s*_g*/result.json")):
    r = json.loads(run.read_text())
    p, e, s = r["params"], r["esds"], r["spots"]
    d = [v for k, v in p.items() if k.startswith("distance_p")]
    cell = " | ".join(f"{p[k]:.3f} ± {e.get(k, float('nan')):.3f}" for k in ("cell_a", "cell_c"))
    print(f"| {run.parent.name} | {s['rms_px_final']:.3f} ({s['matched_final']}/{s['n']}) | {r['fit']['excess']:.1f} "
          f"| {r['diagnostics']['sigZ']:.1f} | {cell} | {min(d):.2f}-{max(d):.2f} | {r['steps']} {r['status']} "
          f"| {r['wall_s']:.0f} |")
PY
