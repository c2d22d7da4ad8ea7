"""Inductor's vector-ISA probe once per machine, not once per process.

Before a process's first compiled CPU kernel (built or loaded from the cache), Inductor checks each vector
instruction set that ``/proc/cpuinfo`` lists (avx2, avx512, ...: ``torch._inductor.cpu_vec_isa``): it builds a
tiny library with that ISA's compiler flags and ``dlopen``s it in a child Python.  On the project's 2-core
machine that is ~1.5 s per process (four ISAs), paid by every compiled run even when every kernel is cached.

:func:`trust_vec_isa_probe` keeps the probe's verdict: a process that ran it, and found every listed ISA good,
writes a record under ``$NBTORCH_CACHE_DIR/vec-isa/``, named by a digest of what the verdict depends on (torch's
version, the Python, the C++ compiler file, the CPU's ISA flags).  A later process with the same digest sets
Inductor's own switch ``cpp.vec_isa_ok = True`` (trust ``/proc/cpuinfo``, skip the builds and child Pythons),
which gives the same ISA list and so the same chosen ISA and generated code.  Where the probe rejected an ISA no
record is written, and every process probes as before; a value of ``cpp.vec_isa_ok`` set by the user is left
alone; other machines than x86-64 Linux are left alone.  ``NBTORCH_TRUST_VEC_ISA=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = ["trust_vec_isa_probe", "record_path", "TRUST_ENV"]

#: ``0`` turns the record off (every process probes)
TRUST_ENV = "NBTORCH_TRUST_VEC_ISA"
_done: bool | None = None  # this process's answer


def _listed(isa_module) -> list[str]:
    """The ISAs Inductor knows that ``/proc/cpuinfo`` lists, in Inductor's order of preference."""
    flags = isa_module.x86_isa_checker()
    return [str(isa) for isa in isa_module.supported_vec_isa_list if all(f in flags for f in str(isa).split())]


def _compiler_identity() -> list:
    """Path, size and modification time of the C++ compiler Inductor runs (a replaced compiler: a new record)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        name = get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - torch internals move between versions: then no record
        log.debug("no C++ compiler name from Inductor (%s: %s)", type(exc).__name__, exc)
        return []
    path = shutil.which(name) or name
    try:
        st = os.stat(os.path.realpath(path))
    except OSError:
        return []
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def record_path(cache: Path, listed: list[str], compiler: list) -> Path:
    """The record file of this torch, Python, compiler and list of ISAs under the cache folder ``cache``."""
    what = [torch.__version__, sys.executable, compiler, listed]
    return cache / "vec-isa" / f"{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]}.json"


def trust_vec_isa_probe(cache: Path) -> bool:
    """Skip Inductor's ISA probe when a record under ``cache`` says an earlier process passed it (module
    docstring); otherwise run the probe now (it would run before the first kernel anyway) and write the record
    when every listed ISA passed.  Returns whether this process skips the probe.  Idempotent."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get(TRUST_ENV, "1").strip() == "0":
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        import torch._inductor.config as inductor_config
        import torch._inductor.cpu_vec_isa as isa_module

        if inductor_config.cpp.vec_isa_ok is not None:  # the user decided
            return False
        listed, compiler = _listed(isa_module), _compiler_identity()
    except Exception as exc:  # noqa: BLE001 - torch internals move between versions: probe as torch does
        log.debug("vector-ISA record unavailable (%s: %s)", type(exc).__name__, exc)
        return False
    if not listed or not compiler:
        return False
    path = record_path(cache, listed, compiler)
    try:
        if json.loads(path.read_text()) == listed:
            inductor_config.cpp.vec_isa_ok = True
            _done = True
            log.debug("vector ISAs %s trusted from %s (no probe)", listed, path)
            return True
    except (OSError, ValueError):
        pass  # no record (or a damaged one): probe, then write it
    valid = [str(isa) for isa in isa_module.valid_vec_isa_list()]
    if valid != listed:
        log.debug("the vector-ISA probe rejected %s: no record", sorted(set(listed) - set(valid)))
        return False
    try:  # atomically: a temporary file in the same folder, then os.replace
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as fh:
            json.dump(listed, fh)
        os.replace(fh.name, path)
    except OSError as exc:
        log.debug("cannot write the vector-ISA record %s (%s)", path, exc)
    return False
