#!/usr/bin/env bash
# DIALS on the project's real data, as the peer beside nbtorch's numbers (issue 33, item 6): both thaumatin
# stills through dials.stills_process (spot finding, indexing with the known symmetry, stills refinement),
# and the L-cysteine 0.1 deg wedge through dials.refine (scan-static) from DIALS's own integrated model.
# Opt-in: never run by CI or the tests.  Needs the DIALS that scripts/peer/build_dials.sh built.
#
#   usage: scripts/peer/dials_peer.sh DIALS_TARGET_DIR OUT_DIR [SHARED_DIR]
#
# SHARED_DIR defaults to ../shared (the project's reference data).  OUT_DIR gets one folder per job
# (thaumatin/, lcysteine/) with DIALS's files and logs, and summary.txt: each still's cell (dials.show, esds
# in brackets) and each run's RMSD table.  Compare spot by spot with nbtorch's result.json:
#   .venv/bin/python scripts/peer/compare_spots.py OUT_DIR/thaumatin/idx-thau_3_2_0003_indexed.refl \
#       out/thaumatin/result.json
# The L-cysteine wedge has 21 strong spots over 10 images: too few for DIALS' indexers (dials.index finds no
# lattice, with or without the known cell), so DIALS refines the model it integrated (23_integrated.expt)
# against the strong spots of 23_integrated.refl: all models free, and the crystal alone (beam and detector
# fixed, as nbtorch's rotation command).
set -euo pipefail

TARGET=$(realpath -m "${1:?usage: dials_peer.sh DIALS_TARGET_DIR OUT_DIR [SHARED_DIR]}")
OUT=$(realpath -m "${2:?usage: dials_peer.sh DIALS_TARGET_DIR OUT_DIR [SHARED_DIR]}")
SHARED=$(realpath -m "${3:-$(dirname "$0")/../../../shared}")
P=$TARGET/venv/bin/python
HERE=$(cd "$(dirname "$0")" && pwd)
say() { echo "dials_peer: $*" >&2; }
"$P" -c "import dials.command_line.stills_process" 2>/dev/null \
    || { say "no DIALS in $TARGET/venv (run scripts/peer/build_dials.sh $TARGET first)"; exit 2; }
THAU=$SHARED/real/thaumatin_i24_still
LCYS=$SHARED/real/lcysteine_i19_sweep2
[ -f "$THAU/thau_3_2_0003.cbf.bz2" ] && [ -f "$LCYS/23_integrated.expt" ] \
    || { say "no thaumatin stills or L-cysteine sweep under $SHARED/real"; exit 2; }
export PATH=$TARGET/venv/bin:$PATH
mkdir -p "$OUT/thaumatin" "$OUT/lcysteine"
summary=$OUT/summary.txt
: > "$summary"

# 1. Thaumatin stills: the header geometry (distance 351 mm) as DIALS imports it, the known symmetry.
cd "$OUT/thaumatin"
for n in 3 4; do
    [ -f "thau_3_2_000$n.cbf" ] || bzcat "$THAU/thau_3_2_000$n.cbf.bz2" > "thau_3_2_000$n.cbf"
done
cat > stills.phil <<'PHIL'
indexing.known_symmetry.space_group = P41212
indexing.known_symmetry.unit_cell = 57.8,57.8,150.2,90,90,90
output.composite_output = False
dispatch.integrate = False
mp.nproc = 1
PHIL
say "dials.stills_process on both thaumatin stills"
dials.stills_process thau_3_2_0003.cbf thau_3_2_0004.cbf stills.phil > stills_process.log 2>&1
for n in 3 4; do
    {
        echo "== thaumatin still 000$n (dials.stills_process)"
        dials.show "idx-thau_3_2_000${n}_refined.expt" 2>/dev/null | grep -E "Unit cell|distance:" || true
        "$P" "$HERE/dials_rmsd.py" "idx-thau_3_2_000${n}_indexed.refl"
    } >> "$summary"
done

# 2. L-cysteine wedge: DIALS's integrated model refined against the strong spots (scan-static).
cd "$OUT/lcysteine"
"$P" - "$LCYS/23_integrated.refl" <<'PY'
import sys
from dials.array_family import flex
r = flex.reflection_table.from_file(sys.argv[1])
r.select(r.get_flags(r.flags.strong)).as_file("strong.refl")
PY
for job in all crystal; do
    fix=""
    [ "$job" = crystal ] && fix="detector.fix=all beam.fix=all"
    say "dials.refine ($job) on the L-cysteine wedge"
    # shellcheck disable=SC2086
    dials.refine "$LCYS/23_integrated.expt" strong.refl scan_varying=False $fix \
        output.experiments="refined_$job.expt" output.reflections="refined_$job.refl" > "refine_$job.log" 2>&1
    {
        echo "== L-cysteine wedge, dials.refine, $job free"
        grep -E "parameters to refine" "refine_$job.log" || true
        echo "  RMSD x (px), y (px), phi (images), over the reflections used:"
        grep -A6 "RMSDs by experiment" "refine_$job.log" | grep -E '^\|[[:space:]]+0 ' || true
        dials.show "refined_$job.expt" 2>/dev/null | grep -E "Unit cell" || true
    } >> "$summary"
done
cat "$summary"
