#!/usr/bin/env bash
# Build DIALS from its public source against the pip cctbx-base wheel and the dxtbx that
# scripts/peer/build_dxtbx.sh built in the same TARGET_DIR, so that its venv runs
# `python -m dials.command_line.find_spots` (index, refine ...): the peer of issue 33, item 6.
# Opt-in: never run by CI or the tests.
#
#   usage: scripts/peer/build_dials.sh TARGET_DIR [DIALS_SOURCE_DIR]        build (idempotent)
#          ESTIMATE=1 scripts/peer/build_dials.sh TARGET_DIR [...]          configure, count the translation
#                                                                          units and time two of them
#
# DIALS_SOURCE_DIR (default TARGET_DIR/src/dials) is a checkout of the public dials/dials repository that you
# fetched yourself (tried: commit c054ebea); the script never downloads source code.  It downloads from PyPI
# (DIALS' pure-Python run-time dependencies) and from Debian: libmsgpack-cxx-dev, unpacked into TARGET_DIR/deps
# with `apt-get download` rather than installed, because installing it pulls Debian's Boost 1.74 headers.
# OpenMP is GCC's own.  Boost.Thread, like Boost.Python, is the wheel's 1.86 library compiled against
# boost-headers 1.85 (boostorg/thread has no commit between the 1.85.0 and 1.86.0 tags either).
#
# Time here (2026-11-27, 2 cores shared with ~30 runnable processes, compiles at `nice -n 15`): configure ~1 min;
# 3 of the 113 translation units timed (ESTIMATE=1 and one by hand): 7, 16 and 26 s of CPU (-O3, 1.0-1.5 GB each)
# but 460-1180 s of wall time each (each compiler got 1.4-3.5 % of a core).  The full build (~30 min of CPU by
# that mean) was stopped after 13 min with 11 units compiled (none failed) and 4 modules linked and importing:
# ~10 h at this load, ~15-20 min on 2 idle cores.  docs/log.md, 2026-11-27.
# Environment: JOBS (default 2), NICE (default 15), ESTIMATE (1: configure and time two units only;
# configure: configure and count only).
set -euo pipefail

TARGET=$(realpath -m "${1:?usage: build_dials.sh TARGET_DIR [DIALS_SOURCE_DIR]}")
SRC=$(realpath -m "${2:-$TARGET/src/dials}")
JOBS=${JOBS:-2}
NICE=${NICE:-15}
VENV=$TARGET/venv
P=$VENV/bin/python
BUILD=$TARGET/build/dials
say() { echo "build_dials: $*" >&2; }

[ -f "$SRC/CMakeLists.txt" ] && [ -d "$SRC/src/dials" ] \
    || { say "no DIALS source at $SRC (give a checkout of dials/dials as the second argument)"; exit 2; }
[ -f "$TARGET/deps/cctbx_wheel_targets.cmake" ] && "$P" -c "import dxtbx.model" 2>/dev/null \
    || { say "run scripts/peer/build_dxtbx.sh $TARGET first (no dxtbx in $VENV)"; exit 2; }

# 1. msgpack-cxx's headers (Debian), unpacked only.
MSGPACK=$TARGET/deps/msgpack
if [ ! -f "$MSGPACK/usr/include/msgpack.hpp" ]; then
    mkdir -p "$TARGET/deps/deb" && (cd "$TARGET/deps/deb" && apt-get download libmsgpack-cxx-dev >/dev/null)
    dpkg-deb -x "$(ls "$TARGET"/deps/deb/libmsgpack-cxx-dev_*.deb | tail -1)" "$MSGPACK"
fi

# 1b. Eigen's headers (Debian libeigen3-dev, unpacked only): the time-of-flight integrator includes <eigen3/Eigen/Dense>.
EIGEN=$TARGET/deps/eigen
if [ ! -f "$EIGEN/usr/include/eigen3/Eigen/Dense" ]; then
    mkdir -p "$TARGET/deps/deb" && (cd "$TARGET/deps/deb" && apt-get download libeigen3-dev >/dev/null)
    dpkg-deb -x "$(ls "$TARGET"/deps/deb/libeigen3-dev_*.deb | tail -1)" "$EIGEN"
fi

# 2. DIALS' run-time Python dependencies (PyPI).
if ! "$P" -c "import psutil, tabulate, jinja2, msgpack, ordered_set, pandas, scipy, h5py, natsort, tqdm, matplotlib, gemmi" \
        >/dev/null 2>&1; then
    "$P" -m pip install -q psutil tabulate jinja2 msgpack ordered-set pandas scipy h5py natsort tqdm matplotlib gemmi
fi

# 3. The targets DIALS' CMakeLists asks for, as for dxtbx (build_dxtbx.sh, step 4) plus annlib, ccp4io,
# Boost.Thread, msgpack-cxx and DXTBX (the installed package's headers).
SITE=$("$P" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
LIBS=$SITE/cctbx_base.libs
BOOST_INC=$("$P" -c "import boost_headers; print(boost_headers.get_include())")
BOOST_PY=$(ls "$LIBS"/libboost_python311-*.so.1.86.0 | head -1)
BOOST_THREAD=$(ls "$LIBS"/libboost_thread-*.so.1.86.0 | head -1)
cat > "$TARGET/deps/dials_wheel_targets.cmake" <<CMAKE
# Written by build_dials.sh.
include("$TARGET/deps/cctbx_wheel_targets.cmake")
add_library(CCTBX::annlib INTERFACE IMPORTED)
target_include_directories(CCTBX::annlib INTERFACE "$SITE/annlib/include" "$SITE/annlib_adaptbx/include" "$SITE"
    "$SITE/libtbx/core/share/cctbx/annlib_adaptbx/include")  # ANNSELF_INCLUDE/ANN.h (the indexing module)
target_link_libraries(CCTBX::annlib INTERFACE "$(ls "$LIBS"/libann_cctbx-*.so)")
add_library(CCTBX::ccp4io INTERFACE IMPORTED)
target_include_directories(CCTBX::ccp4io INTERFACE "$SITE/ccp4io/libccp4/ccp4" "$SITE")
# dials_util_ext writes MTZ files through iotbx::mtz: the wheel's libiotbx_mtz holds CCP4's MTZ library too.
target_link_libraries(CCTBX::ccp4io INTERFACE "$(ls "$LIBS"/libiotbx_mtz-*.so)")
add_library(Boost::thread INTERFACE IMPORTED)
target_include_directories(Boost::thread INTERFACE "$BOOST_INC")
target_link_libraries(Boost::thread INTERFACE "$BOOST_THREAD")
add_library(msgpack-cxx INTERFACE IMPORTED)
target_include_directories(msgpack-cxx INTERFACE "$MSGPACK/usr/include")
target_compile_definitions(msgpack-cxx INTERFACE MSGPACK_DEFAULT_API_VERSION=3)
add_library(DXTBX::DXTBX INTERFACE IMPORTED)
target_include_directories(DXTBX::DXTBX INTERFACE "$SITE" "$EIGEN/usr/include")
CMAKE

# 4. Configure.
say "configuring $BUILD"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$P" \
    -DBoost_NO_BOOST_CMAKE=ON -DBoost_NO_SYSTEM_PATHS=ON -DBoost_INCLUDE_DIR="$BOOST_INC" \
    -DBoost_PYTHON311_LIBRARY_RELEASE="$BOOST_PY" -DBoost_THREAD_LIBRARY_RELEASE="$BOOST_THREAD" \
    -Dmsgpack-cxx_DIR="$MSGPACK/usr/lib/x86_64-linux-gnu/cmake/msgpackc-cxx" \
    -DCMAKE_PROJECT_INCLUDE="$TARGET/deps/dials_wheel_targets.cmake" \
    -DCMAKE_INSTALL_RPATH='$ORIGIN/cctbx_base.libs' >/dev/null
units=$(grep -c '^build [^ ]*\.o: CXX_COMPILER' "$BUILD/build.ninja" || true)
say "$units C++ translation units"

[ "${ESTIMATE:-0}" = configure ] && exit 0
if [ "${ESTIMATE:-0}" = 1 ]; then
    # A heavy unit (the reflection table's bindings) and a light one, side by side, in CPU seconds.
    for obj in \
        src/dials/array_family/CMakeFiles/dials_array_family_flex_ext.dir/boost_python/flex_reflection_table.cc.o \
        src/dials/algorithms/spot_finding/CMakeFiles/dials_algorithms_spot_finding_ext.dir/boost_python/spot_finding_ext.cc.o; do
        rm -f "$BUILD/$obj"
        cmd=$(ninja -C "$BUILD" -t commands "$obj" | tail -1)
        (cd "$BUILD" && /usr/bin/time -f "build_dials: $(basename "$obj"): %U s user, %S s system, %e s wall, %M kB" \
            nice -n "$NICE" sh -c "$cmd") &
    done
    wait
    exit 0
fi

start=$(date +%s)
nice -n "$NICE" cmake --build "$BUILD" -j "$JOBS" -- -k 0   # -k 0: report every failing unit in one go
say "compiled in $(( $(date +%s) - start )) s"
cmake --install "$BUILD" >/dev/null

# 5. The Python package, with the entry points (index methods, profile models ...) DIALS looks up.
if ! "$P" -c "import importlib.metadata as m; m.version('dials')" >/dev/null 2>&1; then
    "$P" -m pip install -q wheel   # DIALS' setup.py builds its editable metadata with bdist_wheel
    (cd "$SRC" && "$P" -m pip install -q --no-deps --no-build-isolation -e .)
fi
"$P" -c "import dials.command_line.find_spots" && say "done: $P -m dials.command_line.find_spots ..."
