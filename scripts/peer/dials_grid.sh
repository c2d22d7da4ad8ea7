#!/usr/bin/env bash
# dials.stills_process on stills of the thaumatin grid scan (dials/data-files `thaumatin_grid/`, Pilatus3 6M),
# timed, as the serial peer beside nbtorch: one .expt/.refl pair per still and one composite pair of all of them.
# Opt-in: never run by CI or the tests.  Needs the DIALS that scripts/peer/build_dials.sh built.
#
#   usage: scripts/peer/dials_grid.sh DIALS_TARGET_DIR GRID_DIR OUT_DIR [STILL ...]
#
# GRID_DIR holds thau_3_2_NNNN.cbf.bz2 (a checkout of dials/data-files' thaumatin_grid/); STILL are the four-digit
# numbers to process (default 0001 ... 0008: the project keeps the others back).  OUT_DIR gets:
#   images/thau_3_2_NNNN.cbf           the stills, decompressed (DIALS reads plain CBF)
#   single/idx-thau_3_2_NNNN_refined.expt, _indexed.refl    one pair per still (composite_output=False)
#   composite/idx-0000_refined.expt, idx-0000_indexed.refl  every still in one pair (composite_output=True)
#   time_single.txt, time_composite.txt                     GNU time: wall, user and system seconds
#   summary.txt                                             per still: spots used, rms x/y/total, delpsi
# Then, for example:
#   .venv/bin/nbtorch-refine --image OUT/images/thau_3_2_0003.cbf --expt OUT/single/idx-thau_3_2_0003_refined.expt \
#       --refl OUT/single/idx-thau_3_2_0003_indexed.refl --out-dir out/grid_0003
#   .venv/bin/nbtorch-refine --expt OUT/composite/idx-0000_refined.expt --refl OUT/composite/idx-0000_indexed.refl \
#       --joint --out-dir out/grid_joint
set -euo pipefail

TARGET=$(realpath -m "${1:?usage: dials_grid.sh DIALS_TARGET_DIR GRID_DIR OUT_DIR [STILL ...]}")
GRID=$(realpath -m "${2:?usage: dials_grid.sh DIALS_TARGET_DIR GRID_DIR OUT_DIR [STILL ...]}")
OUT=$(realpath -m "${3:?usage: dials_grid.sh DIALS_TARGET_DIR GRID_DIR OUT_DIR [STILL ...]}")
shift 3
STILLS=("$@")
[ "${#STILLS[@]}" -gt 0 ] || STILLS=(0001 0002 0003 0004 0005 0006 0007 0008)
P=$TARGET/venv/bin/python
HERE=$(cd "$(dirname "$0")" && pwd)
say() { echo "dials_grid: $*" >&2; }
"$P" -c "import dials.command_line.stills_process" 2>/dev/null \
    || { say "no DIALS in $TARGET/venv (run scripts/peer/build_dials.sh $TARGET first)"; exit 2; }
for n in "${STILLS[@]}"; do
    [ -f "$GRID/thau_3_2_$n.cbf.bz2" ] || { say "no $GRID/thau_3_2_$n.cbf.bz2"; exit 2; }
done
export PATH=$TARGET/venv/bin:$PATH
mkdir -p "$OUT/images" "$OUT/single" "$OUT/composite"
images=()
for n in "${STILLS[@]}"; do
    f=$OUT/images/thau_3_2_$n.cbf
    [ -f "$f" ] || bzcat "$GRID/thau_3_2_$n.cbf.bz2" > "$f"
    images+=("$f")
done

# The header geometry as DIALS imports it; the known symmetry, as a user of a grid scan of one crystal gives it.
phil() {
    cat <<PHIL
indexing.known_symmetry.space_group = P41212
indexing.known_symmetry.unit_cell = 57.8,57.8,150.2,90,90,90
output.composite_output = $1
dispatch.integrate = False
mp.nproc = 1
PHIL
}
for mode in single composite; do
    cd "$OUT/$mode"
    phil "$([ "$mode" = composite ] && echo True || echo False)" > stills.phil
    say "dials.stills_process ($mode output) on ${#images[@]} stills"
    /usr/bin/time -f "wall %e s, user %U s, system %S s" -o "$OUT/time_$mode.txt" \
        dials.stills_process "${images[@]}" stills.phil > stills_process.log 2>&1
done

summary=$OUT/summary.txt
{
    echo "dials.stills_process on ${#images[@]} stills: single $(cat "$OUT/time_single.txt"); composite $(cat "$OUT/time_composite.txt")"
    args=()
    for n in "${STILLS[@]}"; do args+=("$n=$OUT/single/idx-thau_3_2_${n}_indexed.refl"); done
    "$P" "$HERE/dials_rmsd.py" "${args[@]}"
} > "$summary"
cat "$summary"
