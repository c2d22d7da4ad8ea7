#!/usr/bin/env bash
# Build DIALS' dxtbx from its public source against the pip cctbx-base wheel, so that a plain Python has
# `from dxtbx.model.experiment_list import ExperimentListFactory` (the reader of every DIALS program).
# Opt-in: never run by CI or the tests.  Its Python is what NBTORCH_DXTBX_PYTHON names for the opt-in tests
# (docs/formats.md).
#
#   usage: scripts/peer/build_dxtbx.sh TARGET_DIR [DXTBX_SOURCE_DIR]
#
# TARGET_DIR gets venv/ (Python + cctbx-base==2025.11 + dxtbx), build/dxtbx/ (the CMake build) and deps/.
# DXTBX_SOURCE_DIR (default TARGET_DIR/src/dxtbx) is a checkout of the public cctbx/dxtbx repository that
# you fetched yourself (tested: commit 59ea1c67); the script never downloads source code.
# It downloads from PyPI only (cctbx-base, boost-headers, pybind11, hatchling and dxtbx's pure-Python
# dependencies) and from Debian (libhdf5-dev, with apt-get when run as root; else install it yourself).
# Idempotent: every step is skipped when done; rerunning rebuilds only what changed.
#
# Why these pieces: the cctbx-base 2025.11 wheel bundles Boost 1.86's libboost_python311 (in cctbx_base.libs,
# under an auditwheel-mangled name) but no Boost headers; Debian 12 has Boost 1.74.  PyPI's boost-headers
# 1.85.0.post1 is used: Boost.Python's headers and sources are identical in 1.85.0 and 1.86.0 (no commit
# between the two tags of boostorg/python), so extensions compiled with them match the wheel's library.
#
# Time here (2 shared cores, load ~18, `nice -n 15`, 2 jobs): see docs/log.md (2026-11-27).
# Environment: PYTHON (a CPython 3.11 for the venv, default python3.11), JOBS (default 2), NICE (default 15).
set -euo pipefail

TARGET=$(realpath -m "${1:?usage: build_dxtbx.sh TARGET_DIR [DXTBX_SOURCE_DIR]}")
SRC=$(realpath -m "${2:-$TARGET/src/dxtbx}")
PY=${PYTHON:-python3.11}
JOBS=${JOBS:-2}
NICE=${NICE:-15}
VENV=$TARGET/venv
BUILD=$TARGET/build/dxtbx

say() { echo "build_dxtbx: $*" >&2; }
[ -f "$SRC/CMakeLists.txt" ] && [ -d "$SRC/src/dxtbx" ] \
    || { say "no dxtbx source at $SRC (give a checkout of cctbx/dxtbx as the second argument)"; exit 2; }
mkdir -p "$TARGET"

# 1. System packages (Debian): compiler, CMake, Ninja, HDF5's headers.
need=()
for pkg in g++ cmake ninja-build libhdf5-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        say "apt-get install ${need[*]}"
        apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
    else
        say "missing Debian packages: ${need[*]} (install them, then rerun)"; exit 2
    fi
fi

# 2. The Python environment: cctbx-base from PyPI, the build helpers, dxtbx's run-time dependencies.
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
P=$VENV/bin/python
if ! "$P" -c "import boost_headers, pybind11, hatchling, h5py, pycbf, nxmx, cctbx" >/dev/null 2>&1; then
    say "pip install cctbx-base and the build/run dependencies"
    "$P" -m pip install -q "cctbx-base==2025.11" "boost-headers==1.85.0.post1" "pybind11==2.13.6" hatchling \
        h5py hdf5plugin natsort ordered-set pint tqdm "nxmx>=0.0.6" mrcfile python-dateutil pycbf
fi
SITE=$("$P" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
BOOST_INC=$("$P" -c "import boost_headers; print(boost_headers.get_include())")
BOOST_PY=$(ls "$SITE"/cctbx_base.libs/libboost_python311-*.so.1.86.0 2>/dev/null | head -1)
[ -n "$BOOST_PY" ] || { say "no libboost_python311 (1.86) in $SITE/cctbx_base.libs: not the cctbx-base 2025.11 wheel?"; exit 2; }

# 3. The headers that a cctbx build generates: the wheel ships neither them nor the build's include/ folder.
# scitbx/array_family's algebras, reductions and flex_fwd.h: by the generators the wheel ships.
GEN=$TARGET/deps/include/scitbx/array_family
if [ ! -f "$GEN/boost_python/flex_fwd.h" ]; then
    mkdir -p "$GEN/detail" "$GEN/boost_python"
    "$P" -c "import sys
from scitbx.source_generators.array_family import generate_all
from scitbx.source_generators import flex_fwd_h
generate_all.refresh(array_family=sys.argv[1])
flex_fwd_h.run(sys.argv[1] + '/boost_python')" "$GEN" >/dev/null
fi
# boost_adaptbx/type_id_eq.h: which unsigned type size_t is (cctbx's SConscript asks the compiler the same).
TID=$TARGET/deps/include/boost_adaptbx/type_id_eq.h
if [ ! -f "$TID" ]; then
    mkdir -p "$(dirname "$TID")"
    probe=$TARGET/deps/size_t_probe
    printf '%s\n' '#include <cstddef>' '#include <cstdio>' '#include <typeinfo>' \
        'int main() { const char *n = typeid(std::size_t) == typeid(unsigned long) ? "UNSIGNED_LONG"' \
        '  : typeid(std::size_t) == typeid(unsigned long long) ? "UNSIGNED_LONG_LONG"' \
        '  : typeid(std::size_t) == typeid(unsigned) ? "UNSIGNED" : "UNSIGNED_SHORT";' \
        '  std::printf("%s", n); return 0; }' > "$probe.cpp"
    g++ -o "$probe" "$probe.cpp"
    printf '%s\n' '// written by build_dxtbx.sh' '#ifndef BOOST_ADAPTBX_TYPE_ID_EQ_H' '#define BOOST_ADAPTBX_TYPE_ID_EQ_H' \
        "#define BOOST_ADAPTBX_TYPE_ID_SIZE_T_EQ_$("$probe")" '#endif' > "$TID"
fi

# 4. The CCTBX and Boost.Python targets.  The wheel's libtbx_env names the conda build's paths for every module
# (/home/conda/feedstock_root/...), so FindCCTBX's own targets point nowhere; targets defined before it
# (CMAKE_PROJECT_INCLUDE) are taken as found.  Headers: site-packages; libraries: the wheel's own copies in
# cctbx_base.libs (the ones its extensions load, so one Boost.Python registry serves both).  Boost::python
# likewise: FindBoost names its target Boost::python311, and dxtbx's fallback would link "-lpython311".
LIBS=$SITE/cctbx_base.libs
mkdir -p "$TARGET/deps"
cat > "$TARGET/deps/cctbx_wheel_targets.cmake" <<CMAKE
# Written by build_dxtbx.sh: CCTBX targets for the pip cctbx-base wheel in $SITE.
foreach(_m scitbx cctbx)
  add_library(CCTBX::\${_m} INTERFACE IMPORTED)
  target_include_directories(CCTBX::\${_m} INTERFACE "$SITE" "$TARGET/deps/include")
endforeach()
target_link_libraries(CCTBX::cctbx INTERFACE "$(ls "$LIBS"/libcctbx-*.so)")
add_library(CCTBX::scitbx::boost_python INTERFACE IMPORTED)
target_link_libraries(CCTBX::scitbx::boost_python INTERFACE CCTBX::scitbx "$(ls "$LIBS"/libscitbx_boost_python-*.so)")
add_library(Boost::python INTERFACE IMPORTED)
target_include_directories(Boost::python INTERFACE "$BOOST_INC")
target_link_libraries(Boost::python INTERFACE "$BOOST_PY")
CMAKE
cat > "$TARGET/deps/dxtbx_project.cmake" <<CMAKE
# Written by build_dxtbx.sh: included by dxtbx's project() (CMAKE_PROJECT_INCLUDE).
include("$TARGET/deps/cctbx_wheel_targets.cmake")
# Build time: dxtbx_model_ext's 16 Boost.Python sources each parse the same headers, so they are compiled as
# 2 unity batches; the model, masking and flumpy modules at -O0 (DXTBX_OPT, default -O0: reading and writing
# models is not where time goes; these options replace the targets' own, which only colour the diagnostics and
# quiet two warnings).  Set when the source tree has been read (deferred call).
cmake_language(DEFER DIRECTORY "\${CMAKE_SOURCE_DIR}" CALL set_target_properties dxtbx_model_ext PROPERTIES
               UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
cmake_language(DEFER DIRECTORY "\${CMAKE_SOURCE_DIR}" CALL set_target_properties dxtbx_model_ext dxtbx_masking_ext
               dxtbx_flumpy PROPERTIES COMPILE_OPTIONS ${DXTBX_OPT:--O0})
CMAKE

# 5. Configure and build dxtbx's extensions (22 C++ translation units).
say "configuring $BUILD"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$P" \
    -Dpybind11_DIR="$("$P" -m pybind11 --cmakedir)" \
    -DBoost_NO_BOOST_CMAKE=ON -DBoost_NO_SYSTEM_PATHS=ON -DBoost_INCLUDE_DIR="$BOOST_INC" \
    -DBoost_PYTHON311_LIBRARY_RELEASE="$BOOST_PY" \
    -DCMAKE_PROJECT_INCLUDE="$TARGET/deps/dxtbx_project.cmake" \
    -DCMAKE_INSTALL_RPATH='$ORIGIN/cctbx_base.libs' >/dev/null
start=$(date +%s)
nice -n "$NICE" cmake --build "$BUILD" -j "$JOBS"
say "compiled in $(( $(date +%s) - start )) s"
cmake --install "$BUILD" >/dev/null   # the extension modules into the venv's site-packages

# 6. The Python package (with its dxtbx.format entry points) into the venv.
if ! "$P" -c "import dxtbx, importlib.metadata as m; m.version('dxtbx')" >/dev/null 2>&1; then
    say "pip install the dxtbx Python package"
    "$P" -m pip install -q --no-deps --no-build-isolation "$SRC"
fi

"$P" -c "from dxtbx.model.experiment_list import ExperimentListFactory" \
    && say "done: NBTORCH_DXTBX_PYTHON=$P"
