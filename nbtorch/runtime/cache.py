"""The cache folder: what nbtorch computes once per machine and keeps on disk.

``$NBTORCH_CACHE_DIR`` (default ``~/.cache/nbtorch``, :func:`cache_dir`) holds

* ``inductor/``: Inductor's on-disk cache of compiled C++ (unless ``TORCHINDUCTOR_CACHE_DIR`` is already set),
  pointed at by :func:`configure_inductor_cache` before the first kernel is compiled;
* ``precompiled/``: compiled kernels saved with torch's precompile API (:mod:`nbtorch.runtime.precompile`,
  :mod:`nbtorch.runtime.jacobian_kernels`);
* ``vec-isa/``: the verdict of Inductor's vector-ISA probe (:mod:`nbtorch.runtime.vec_isa`);
* ``problems/``: generated test problems (:mod:`refine.inputs.problems`).

Whether to compile is :mod:`nbtorch.runtime.policy`'s decision; this module only says where the results go.

A first compile on an empty cache takes minutes (the kernels, their analytic backward and the esds'
forward-mode kernels: about two minutes on a 2-core CPU) and prints nothing of its own, so
:func:`configure_inductor_cache` says so once, through ``logging`` (a WARNING of ``nbtorch.runtime.cache``, which the
commands show on stderr), before the compile starts: when Inductor's cache folder is missing or empty, at most
once per process (:data:`FIRST_RUN_MESSAGE`).  A later process finds the folder filled and says nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["cache_dir", "configure_inductor_cache", "FIRST_RUN_MESSAGE"]

#: said (``%s``: the folder) before the first compile on an empty cache
FIRST_RUN_MESSAGE = ("nbtorch: first run on this machine: compiling the kernels into %s "
                     "(about 2 minutes, once; later runs load them from there)")
_announced = False  # this process said FIRST_RUN_MESSAGE


def cache_dir() -> Path:
    """The nbtorch cache folder: ``$NBTORCH_CACHE_DIR``, default ``~/.cache/nbtorch`` (compiled kernels,
    precompiled kernels, generated test problems)."""
    return Path(os.environ.get("NBTORCH_CACHE_DIR", Path.home() / ".cache" / "nbtorch"))


def _is_empty(path: Path) -> bool:
    """True when ``path`` is missing or an empty folder (unreadable: not empty, say nothing)."""
    try:
        return not path.exists() or not any(path.iterdir())
    except OSError:
        return False


def _announce_first_compile(path: Path, empty: bool) -> None:
    """Say :data:`FIRST_RUN_MESSAGE` once per process when the compiled-code folder ``path`` was ``empty``."""
    global _announced
    if empty and not _announced:
        _announced = True
        log.warning(FIRST_RUN_MESSAGE, path)


def configure_inductor_cache() -> Path:
    """Point Inductor's on-disk cache at the nbtorch cache folder (unless the user chose one), and skip its
    per-process vector-ISA probe where an earlier process's verdict is recorded (:mod:`nbtorch.runtime.vec_isa`).
    Called before a kernel is compiled; says :data:`FIRST_RUN_MESSAGE` when that folder is still empty."""
    from nbtorch.runtime.vec_isa import trust_vec_isa_probe

    trust_vec_isa_probe(cache_dir())
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        path = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        _announce_first_compile(path, _is_empty(path))
        return path
    path = cache_dir() / "inductor"
    empty = _is_empty(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # read-only home: keep torch's default
        log.debug("cannot create %s (%s); using torch's default Inductor cache", path, exc)
        return path
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    _announce_first_compile(path, empty)
    return path
