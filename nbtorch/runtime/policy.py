"""Runtime: the one place that decides between eager and ``torch.compile``.

:func:`compile_policy` decides, per simulator and purpose (never at import time), in this order:

1. inside :func:`eager` (e.g. gradient tests): eager, always;
2. purpose ``esds``: eager: the uncertainty estimate's Jacobian is forward-mode autograd
   (:func:`refine.quality.uncertainty.pixel_jacobian`), whose tangents a compiled graph drops; purpose
   ``jacobian`` (asked by :func:`~refine.quality.uncertainty.pixel_jacobian` before it enters :func:`eager`):
   its tiles go through the compiled forward-mode kernels of :mod:`nbtorch.physics.jacobian` unless rule
   1 or 4 says eager (from :data:`nbtorch.physics.kernel.JACOBIAN_TILE_EVALUATIONS` evaluations per tile);
3. an explicit ``compile=True/False`` argument (``-compile``, ``--compile``, ``--no-compile``) wins;
4. ``NANOBRAGG_DISABLE_COMPILE=1`` or ``NANOBRAG_DISABLE_COMPILE=1`` (both spellings) selects eager, on
   CPU and CUDA alike; ``0`` or unset means no objection.  Any other value is an error naming the variable;
5. by workload: a compile costs ~15-25 s (forward) to ~1-2 min (with the analytic backward) on a
   2-core CPU, once per kernel shape (then Inductor's on-disk cache), so it must pay for itself:

   * ``simulator`` (a :class:`~nbtorch.Simulator` built from Python): compiled (the library default);
   * ``one-shot`` (the ``nbtorch`` command: one image): compiled from :data:`ONE_SHOT_EVALUATIONS`
     evaluations (pixels x sub-pixels x sources x phi x mosaic) on, where eager takes longer than the
     compile;
   * ``refinement`` (each loss-and-gradient evaluation of ``nbtorch-refine``): compiled from
     :data:`REFINEMENT_EVALUATIONS` evaluations per model evaluation on: a refinement evaluates the model
     hundreds of times, so a smaller job already amortises the compile.

Compiled kernels are shared across simulators: :func:`compiled_kernel` keeps
one ``torch.compile(fullgraph=True, dynamic=False)`` wrapper per key (device
type and index, dtype, the kernel's static options, tile shape ...), never per
parameter value, so a second simulator with the same key compiles nothing and
changing parameter values (tensors) between calls triggers no recompile.

If compilation fails the caller falls back to eager once, logs one warning and
records why (``Simulator.compile_mode``, ``Simulator.compile_reason``).

Inductor's on-disk cache makes a second process start fast: it lives in
``$NBTORCH_CACHE_DIR/inductor`` (default ``~/.cache/nbtorch/inductor``) unless
``TORCHINDUCTOR_CACHE_DIR`` is already set (:mod:`nbtorch.runtime.cache`, which also says, before the first compile on
an empty cache, that it is compiling and for about how long).  Each compiled kernel is also saved with
torch's precompile API (:mod:`nbtorch.runtime.precompile`, ``$NBTORCH_CACHE_DIR/precompiled``), so that a
new process loads it without tracing (:data:`PRECOMPILE`; ``NBTORCH_PRECOMPILE=0`` turns it off).  The policy above is unchanged: it
decides whether a kernel is compiled; precompile only decides how a compiled kernel is obtained.

Every compiled callable comes from here: :func:`compiled_kernel` (the simulator's stages) and :func:`compiled`
(a caller's own function, e.g. the refinement's loss with ``compile_loss``); the esds' forward-mode kernels are
compiled by :mod:`nbtorch.runtime.jacobian_kernels` when :func:`compile_policy` (purpose ``jacobian``) allows it.  The
only other switch is the physics' own context variable of :func:`nbtorch.physics.kernel.analytic_jvp`, which
carries the runner of those kernels into the eager physics (it stays in the physics: see that module).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Callable, Iterator

import torch

from nbtorch.runtime.cache import configure_inductor_cache
from nbtorch.errors import InputError
from nbtorch.runtime.precompile import PrecompiledKernel

log = logging.getLogger(__name__)

ENV_VARS = ("NANOBRAGG_DISABLE_COMPILE", "NANOBRAG_DISABLE_COMPILE")
_state = threading.local()
_KERNELS: dict[tuple, Callable] = {}
_LOCK = threading.Lock()
#: save and load compiled kernels with torch's precompile API (:mod:`nbtorch.runtime.precompile`); False (or the
#: environment variable ``NBTORCH_PRECOMPILE=0``): plain ``torch.compile`` wrappers, which trace in every process
PRECOMPILE = True
PRECOMPILE_ENV = "NBTORCH_PRECOMPILE"
#: Inductor options of every compiled kernel (the simulator's and the esds' Jacobian's): fused multiply-adds in
#: the generated C++ (Inductor's default forbids contraction): ~15 % faster on the hot loop, rounding
#: differences only (see docs/performance.md)
INDUCTOR_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}


def precompile_enabled() -> bool:
    """:data:`PRECOMPILE`, unless ``NBTORCH_PRECOMPILE=0`` (``1`` or unset: on; any other value is an error)."""
    value = os.environ.get(PRECOMPILE_ENV, "1").strip()
    if value not in ("0", "1"):
        raise InputError(f"{PRECOMPILE_ENV}: expected 0 or 1, got {value!r}")
    return PRECOMPILE and value == "1"


def _eager_depth() -> int:
    return getattr(_state, "eager_depth", 0)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Force eager execution for every simulator created or run inside the block.

    gradcheck/gradgradcheck must never meet a compiled graph: the gradient tests
    run under ``with nbtorch.eager():``.
    """
    _state.eager_depth = _eager_depth() + 1
    try:
        yield
    finally:
        _state.eager_depth = _eager_depth() - 1


def in_eager_block() -> bool:
    return _eager_depth() > 0


def env_disables_compile() -> bool:
    """True when either spelling of the disable variable is ``1``; error for other values."""
    disabled = False
    for name in ENV_VARS:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        value = raw.strip()
        if value == "1":
            disabled = True
        elif value != "0":
            raise InputError(f"environment variable {name}={raw!r}: expected 1 (disable torch.compile) or 0")
    return disabled


#: one image (``nbtorch`` command): compile from this many evaluations on (eager below: ~20 s of compile)
ONE_SHOT_EVALUATIONS = 50_000_000
#: one model evaluation of a refinement: compile from this many evaluations on (the ~1 min compile pays off
#: over the hundreds of evaluations of a refinement)
REFINEMENT_EVALUATIONS = 200_000
PURPOSES = ("simulator", "one-shot", "refinement", "esds", "jacobian")


def compile_policy(purpose: str = "simulator", evaluations: float | None = None,
                   explicit: bool | None = None) -> tuple[bool, str]:
    """``(compile?, why)`` for a simulator used for ``purpose`` with ``evaluations`` per model evaluation
    (``one-shot`` and ``refinement`` need it); ``explicit`` is the user's ``compile=``/flag (None: not given).
    The rules are the module docstring's."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose: expected one of {', '.join(PURPOSES)}, got {purpose!r}")
    if purpose in ("one-shot", "refinement") and evaluations is None:
        raise ValueError(f"compile_policy: purpose {purpose!r} needs the number of evaluations")
    if in_eager_block():
        return False, "inside nbtorch.eager()"
    if purpose == "esds":
        return False, "eager for the uncertainty estimate (forward-mode derivatives)"
    if purpose == "jacobian":
        if env_disables_compile():
            return False, "environment variable"
        return True, "compiled forward-mode kernels for large tiles (nbtorch.physics.jacobian)"
    if explicit is not None:
        return bool(explicit), f"compile={bool(explicit)} requested"
    if env_disables_compile():
        return False, "environment variable"
    if purpose == "simulator":
        return True, "default (compile on)"
    threshold = ONE_SHOT_EVALUATIONS if purpose == "one-shot" else REFINEMENT_EVALUATIONS
    big = evaluations >= threshold
    return big, f"{purpose}: {evaluations:.3g} evaluations {'>=' if big else '<'} {threshold:.3g}"


def check_device(device: str, flag: str) -> None:
    """Raise :class:`InputError` (naming the command-line ``flag``) unless ``device`` is ``cpu`` or an
    available ``cuda[:N]``."""
    if device != "cpu" and not device.startswith("cuda"):
        raise InputError(f"{flag}: expected cpu or cuda[:N], got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"{flag} {device}: CUDA is not available on this machine")


#: glibc ``mallopt`` settings of :func:`tune_allocator`: buffers up to 256 MB from the heap, and up to 1 GB of
#: freed heap kept for reuse (``M_MMAP_THRESHOLD`` = -3, ``M_TRIM_THRESHOLD`` = -1 in ``malloc.h``)
_MALLOPT = ((-3, 256 << 20), (-1, 1 << 30))


def tune_allocator() -> bool:
    """Let glibc's malloc reuse large freed CPU buffers instead of returning them to the system (Linux only;
    ``NBTORCH_TUNE_MALLOC=0`` leaves the allocator alone).  Returns whether the settings took.

    A kernel's intermediate images (megabytes each) are allocated and freed at every call.  By default glibc
    serves such sizes with ``mmap`` and unmaps them on free (its threshold adapts, but not for every size), so
    the next call's buffers are fresh pages that fault in as the kernel writes them: on the 1024² cubic
    forward that was thousands of page faults and up to half the time of the call, and how many depended on the
    order of the allocations (the precompiled and the traced kernel differ there).  With large buffers from the
    heap and the freed heap kept, the same pages serve every call.  The cost: freed memory (up to 1 GB) stays
    with the process.  The commands (``nbtorch``, ``nbtorch-refine``) and the benchmark harnesses call this
    at start; a Python program may call it itself.  The same effect from outside the process:
    ``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824``.
    """
    if os.environ.get("NBTORCH_TUNE_MALLOC", "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    import ctypes  # noqa: PLC0415 - only here

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = all(mallopt(option, value) == 1 for option, value in _MALLOPT)
    log.debug("malloc tuned for reuse of large buffers: %s", ok)
    return ok


_LIBC: list = []


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; Linux only,
    ``NBTORCH_TUNE_MALLOC=0`` leaves the allocator alone).  Returns whether it ran.

    A process that passes over thousands of small images (:mod:`refine.many`) makes each image's megabyte-sized
    intermediates between the small objects it keeps; glibc cannot always fit the next image's buffers into the
    holes left, so the heap grows by about a megabyte an image on the first pass though the live data do not (a
    128 x 128 still of a 10^4-amplitude run: 1.5 MB per still over 300 stills, 0.1 MB of it live).  Trimming
    every few images gives those pages back (the heap's address range stays; its pages come back when written)
    and costs milliseconds (:func:`refine.many.memory.released`)."""
    if os.environ.get("NBTORCH_TUNE_MALLOC", "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    if not _LIBC:
        import ctypes  # noqa: PLC0415 - only here

        try:
            _LIBC.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except (OSError, AttributeError):  # not glibc
            _LIBC.append(None)
    if _LIBC[0] is None:
        return False
    _LIBC[0](0)
    return True


def compiled_kernel(key: tuple, fn: Callable, options: dict | None = None) -> Callable:
    """The shared compiled wrapper of ``fn`` for ``key`` (created on first use).

    ``options``: extra Inductor options for this function (part of what the caller's
    ``key`` must distinguish); those this torch lacks are dropped (tuning, never semantics).
    """
    with _LOCK:
        kernel = _KERNELS.get(key)
        if kernel is None:
            configure_inductor_cache()
            # one code object serves every key: allow enough guarded entries
            limit = max(64, getattr(torch._dynamo.config, "cache_size_limit", 8))
            torch._dynamo.config.cache_size_limit = limit
            if hasattr(torch._dynamo.config, "recompile_limit"):
                torch._dynamo.config.recompile_limit = limit
            inductor_options = {**INDUCTOR_OPTIONS, **_known_inductor_options(options or {})}
            kernel = torch.compile(fn, fullgraph=True, dynamic=False, options=inductor_options)
            if precompile_enabled():  # a new process loads the compiled kernel instead of tracing it (nbtorch.runtime.precompile)
                kernel = PrecompiledKernel(kernel, fn, key, inductor_options)
            _KERNELS[key] = kernel
        return kernel


def compiled(fn: Callable, *, fullgraph: bool = True) -> Callable:
    """``torch.compile(fn, fullgraph=fullgraph)`` for a caller's own function (the refinement's loss with
    ``compile_loss=True``: an explicit request, rule 3 of the module docstring), with Inductor's cache in the
    nbtorch cache folder (:func:`nbtorch.runtime.cache.configure_inductor_cache`).  Not shared between calls (the
    function is the caller's), Inductor's default options."""
    configure_inductor_cache()
    return torch.compile(fn, fullgraph=fullgraph)


def _known_inductor_options(options: dict) -> dict:
    """``options`` less the keys this torch's Inductor does not have."""
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    dropped = [k for k in options if k not in known]
    if dropped:
        log.debug("Inductor of torch %s lacks options %s; compiling without them", torch.__version__, dropped)
    return {k: v for k, v in options.items() if k in known}


def cached_kernel_keys() -> list[tuple]:
    with _LOCK:
        return list(_KERNELS)
