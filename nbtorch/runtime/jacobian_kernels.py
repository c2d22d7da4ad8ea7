"""Compiling and caching the forward-mode kernels of the esds' Jacobian (:mod:`nbtorch.physics.jacobian`).

:func:`run` is the runner :func:`refine.quality.uncertainty.pixel_jacobian` hands to
:func:`nbtorch.physics.kernel.analytic_jvp` when :func:`nbtorch.runtime.policy.compile_policy` allows compiling
(purpose ``jacobian``): the physics defines the two kernels' functions (the tile's photons and its tangents)
and stays free of compiling and caching; this module traces them to plain ATen graphs (``make_fx``),
compiles them with Inductor's standalone API (``torch._inductor.standalone_compile``: ``torch.func`` inside a
``torch.compile`` graph leaves guards torch's precompile cannot save, so every process would trace again,
~10-40 s), and keeps each compiled artifact with torch's own ``CompiledArtifact.save``/``load`` in
``$NBTORCH_CACHE_DIR/precompiled/torch-<version>/jacobian-<kind>-<digest>.bin``, the digest covering the
arguments' kind, the static options, the Inductor options, the thread count and the source of every
``nbtorch.physics`` module (an edited kernel never loads).  ``NBTORCH_PRECOMPILE=0``: compiled in each
process, nothing saved or loaded.  A failing compile logs one warning and :func:`run` returns None from then
on (the physics runs the same functions eagerly).

:func:`forward_mode` is the door for callers outside nbtorch (:func:`refine.quality.uncertainty.pixel_jacobian`):
inside it the simulator runs eagerly with the analytic forward-mode derivative, and its large tiles go through
these kernels where :func:`nbtorch.runtime.policy.compile_policy` (purpose ``jacobian``) allows compiling; tiles of
fewer than :data:`JACOBIAN_TILE_EVALUATIONS` evaluations stay eager.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from nbtorch.runtime import policy as runtime
from nbtorch.runtime.cache import configure_inductor_cache
from nbtorch.physics import jacobian as physics_jacobian
from nbtorch.physics.kernel import JACOBIAN_TILE_EVALUATIONS, analytic_jvp
from nbtorch.runtime.precompile import describe, precompile_dir

__all__ = ["run", "forward_mode", "JACOBIAN_TILE_EVALUATIONS"]

log = logging.getLogger(__name__)

_ARTIFACTS: dict[tuple, Callable] = {}
_LOCK = threading.Lock()
_FAILED: list[str] = []  # why compiling failed (then eager, warned once)


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """Digest of the source of every ``nbtorch.physics`` module (what the kernels trace)."""
    h = hashlib.sha256()
    for path in sorted(Path(physics_jacobian.__file__).parent.glob("*.py")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _digest(kind: str, static, args: Sequence[Tensor]) -> str:
    what = (kind, torch.__version__, repr(static), sorted(runtime.INDUCTOR_OPTIONS.items()),
            torch.get_num_threads(), describe(tuple(args)), _source_digest())
    return hashlib.sha256(repr(what).encode()).hexdigest()[:32]


def _compile(kind: str, static, args: list[Tensor]) -> Callable:
    """The compiled ``kind`` kernel for these arguments: loaded from the cache folder, or traced, compiled and
    saved (module docstring)."""
    import torch._inductor.config as inductor_config
    from torch.fx.experimental.proxy_tensor import make_fx

    configure_inductor_cache()
    save = runtime.precompile_enabled()
    digest = _digest(kind, static, args)
    path = precompile_dir() / f"jacobian-{kind}-{digest}.bin"
    with inductor_config.patch(runtime.INDUCTOR_OPTIONS):
        if save and path.is_file():
            try:
                artifact = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
                log.debug("loaded the compiled %s kernel of the Jacobian from %s", kind, path)
                return artifact
            except Exception as exc:  # damaged or incompatible: compile again
                log.debug("cannot load %s (%s: %s); compiling", path, type(exc).__name__, exc)
        with torch.no_grad():
            graph = make_fx(functools.partial(physics_jacobian.KERNEL_FUNCTIONS[kind], static))(*args)
        artifact = torch._inductor.standalone_compile(graph, args, dynamic_shapes="from_example_inputs")
    if save:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
            artifact.save(path=str(tmp), format="binary")
            tmp.replace(path)
        except Exception as exc:  # unwritable: still usable in this process
            log.debug("cannot save the compiled %s kernel to %s (%s: %s)", kind, path, type(exc).__name__, exc)
    return artifact


def run(kind: str, static, args: list[Tensor]) -> Tensor | None:
    """``KERNEL_FUNCTIONS[kind](static, *args)`` (:mod:`nbtorch.physics.jacobian`) through its compiled kernel;
    None where compiling failed (the caller then runs the function eagerly).  The runner :func:`refine.quality.uncertainty.pixel_jacobian` gives
    :func:`~nbtorch.physics.kernel.analytic_jvp`."""
    if not _FAILED:
        # cheap in-process key (the digest, which describes every argument, only on a miss)
        key = (kind, static, torch.get_num_threads(),
               tuple((t.dtype, t.device, tuple(t.shape), t.stride()) for t in args))
        kernel = _ARTIFACTS.get(key)
        if kernel is None:
            with _LOCK:
                kernel = _ARTIFACTS.get(key)
                if kernel is None:
                    try:
                        kernel = _compile(kind, static, args)
                    except Exception as exc:  # compile problems: the same functions eagerly
                        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        log.warning("compiling the esds' Jacobian kernel failed, running it eagerly: %s", reason)
                        _FAILED.append(reason)
                    else:
                        _ARTIFACTS[key] = kernel
        if kernel is not None:
            out = kernel(*args)
            return out[0] if isinstance(out, (list, tuple)) else out
    return None


@contextlib.contextmanager
def forward_mode() -> Iterator[None]:
    """Forward-mode derivatives through the simulator (``torch.func.jacfwd``): eager (:func:`nbtorch.eager`), the
    hot loop through its analytic ``jvp`` (:func:`nbtorch.physics.kernel.analytic_jvp`), and large tiles through
    the compiled kernels of :func:`run` unless :func:`nbtorch.runtime.policy.compile_policy` (purpose ``jacobian``,
    asked before entering ``eager()``, which would say no) says eager."""
    compiled, _ = runtime.compile_policy("jacobian")
    with runtime.eager(), analytic_jvp(run if compiled else None):
        yield
