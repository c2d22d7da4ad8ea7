"""Compiled kernels that a new process loads instead of tracing: torch's precompile (AOT) API.

A ``torch.compile`` wrapper re-runs Dynamo in every new process: it traces the kernel's Python
(the pixel geometry, the hot loop, the analytic backward) into a graph, then looks the graph up in
Inductor's and AOTAutograd's on-disk caches.  On the refinement tutorial that is ~1-2 s per graph
(six graphs), which Inductor's cache cannot remove: its key is the traced graph.

:class:`PrecompiledKernel` uses PyTorch's own precompile instead
(``torch.compile(...).aot_compile(((args), {}))``, ``AOTCompiledFunction.save_compiled_function`` and
``torch.compiler.load_compiled_function``): the first call with a given kind of arguments compiles
ahead of time, as ``torch.compile`` would, and torch writes the result (graph, guards, the compiled
forward and backward) to one file; a later process with the same kind of arguments loads that file,
checks torch's guards on the actual arguments and runs it, with no tracing.  Nothing of the
serialization is ours: we only choose the file name,

    ``$NBTORCH_CACHE_DIR/precompiled/torch-<version>/<digest>.bin``

where the digest covers the kernel's key (device, dtype, kernel options, tile shape ...), its Inductor
options and the kind of arguments (per tensor: dtype, shape, strides, requires_grad; grad mode; the
other values).  A loaded file is used only if the source of every module Dynamo traced into it (torch
records them) is unchanged and torch's guards accept the arguments (an edited kernel never runs stale).
torch writes the file atomically (a temporary file, then ``os.replace``), so processes sharing a
cache folder at most compile the same kernel twice.  A file that fails to load, is stale, or whose
guards reject the arguments, is compiled again and replaced; where precompile fails (a torch that lacks it,
arguments it cannot serialize) the kernel runs through the plain ``torch.compile`` wrapper.

The compiled C++ itself stays in Inductor's cache (``$NBTORCH_CACHE_DIR/inductor``): loading a
precompiled kernel whose shared library was deleted rebuilds it from the saved source (a C++
compile, no tracing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from nbtorch.runtime.cache import cache_dir

log = logging.getLogger(__name__)

_RESTARTS = 5  # traces of one precompile at most (Dynamo's restarts of its analysis)


@contextlib.contextmanager
def _quiet_guards():
    """Dynamo's guard builder reads ``.grad`` of non-leaf tensor arguments, which warns once per process
    (harmless: a guard, not a gradient); the warning would reach a command's output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf",
                                category=UserWarning)
        yield


def sources_current(variant: Any) -> bool:
    """Whether every module whose code Dynamo traced into ``variant`` (torch records each one's source when it
    compiles) still has that source: an edited kernel, or an edited constant beside it, never loads."""
    import importlib
    import inspect
    import sys

    for src in variant.source_info().inlined_sources:
        try:
            module = sys.modules.get(src.module) or importlib.import_module(src.module)
            if inspect.getsource(module) != src.content:
                return False
        except (ImportError, OSError, TypeError):
            return False
    return True


def precompile_dir() -> Path:
    """Where precompiled kernels live: ``$NBTORCH_CACHE_DIR/precompiled/torch-<version>``."""
    return cache_dir() / "precompiled" / f"torch-{torch.__version__}"


def describe(value: Any) -> Any:
    """What torch's guards look at in ``value``, as plain data: tensors by dtype, device, shape, strides and
    requires_grad; dataclasses, tuples, lists and dicts element by element; anything else by ``repr``."""
    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype), str(value.device), tuple(value.shape), value.stride(), value.requires_grad)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                tuple((f.name, describe(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(describe(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), describe(v)) for k, v in value.items()))
    return repr(value)


class PrecompiledKernel:
    """``compiled`` (a ``torch.compile`` wrapper of ``fn``) with precompiled variants loaded from or saved to
    :func:`precompile_dir`; see the module docstring.  ``key``: the caller's kernel key; ``options``: the
    Inductor options of ``compiled`` (part of the file name)."""

    def __init__(self, compiled: Callable, fn: Callable, key: tuple, options: dict) -> None:
        self.compiled, self.fn, self.options = compiled, fn, dict(options)
        self._name = hashlib.sha256(repr((key, sorted(options.items()), fn.__module__, fn.__qualname__))
                                    .encode()).hexdigest()
        self._variants: dict[str, Any] = {}  # argument digest -> AOTCompiledFunction, or None: plain wrapper
        self._in_use: list[tuple[bool, Any]] = []  # (grad mode, variant) of the variants found so far
        self._replaced: Any = None  # the variant a recompile just replaced
        self._lock = threading.Lock()
        self.loaded = 0  # variants read from disk (tests, logs)
        self.saved = 0  # variants compiled and written by this process

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # fast path: the variants in use, chosen by torch's guards (~10 us a call, where describing the
        # arguments for the file name costs ~0.1 ms: a tutorial evaluation makes ~80 kernel calls)
        grad = torch.is_grad_enabled()
        for with_grad, variant in self._in_use:
            if with_grad == grad and variant.guard_check(*args, **kwargs):
                return variant.fn(*args, **kwargs)
        digest = self._argument_digest(args, kwargs)
        variant = self._variants.get(digest, False)
        if variant is False or (variant is not None and not variant.guard_check(*args, **kwargs)):
            with self._lock:
                variant = self._variant(digest, args, kwargs)
                if variant is not None:
                    self._in_use = [(g, v) for g, v in self._in_use if v is not self._replaced] + [(grad, variant)]
        if variant is None:
            return self.compiled(*args, **kwargs)
        return variant.fn(*args, **kwargs)

    def _argument_digest(self, args: tuple, kwargs: dict) -> str:
        # the thread count too: Inductor writes it into the generated C++ (a kernel compiled by a process with
        # one thread runs on one thread wherever it is loaded)
        what = (self._name, torch.is_grad_enabled(), torch.get_num_threads(), describe(args), describe(kwargs))
        return hashlib.sha256(repr(what).encode()).hexdigest()[:32]

    def path(self, digest: str) -> Path:
        return precompile_dir() / f"{digest}.bin"

    def _variant(self, digest: str, args: tuple, kwargs: dict):
        """Load the variant for these arguments, or compile and save it (None: use the plain wrapper)."""
        if not hasattr(self.compiled, "aot_compile"):
            self._variants[digest] = None
            return None
        path = self.path(digest)
        self._replaced = self._variants.get(digest)
        if digest not in self._variants and path.is_file():
            try:
                # the kernel's Inductor options also shape the C++ build of the loaded code (e.g. FMA contraction):
                # without them the shared library would be rebuilt with other flags
                import torch._inductor.config as inductor_config  # here: importing Inductor costs ~1 s

                with path.open("rb") as fh, inductor_config.patch(self.options), _quiet_guards():
                    variant = torch.compiler.load_compiled_function(fh, f_globals=self.fn.__globals__)
                if not sources_current(variant):
                    log.debug("precompiled %s in %s: its source changed; compiling", self.fn.__qualname__, path)
                elif variant.guard_check(*args, **kwargs):
                    self._variants[digest] = variant
                    self.loaded += 1
                    log.debug("loaded precompiled %s from %s", self.fn.__qualname__, path)
                    return variant
                else:
                    log.debug("precompiled %s in %s: guards reject these arguments; compiling", self.fn.__qualname__,
                              path)
            except Exception as exc:  # a damaged or incompatible file: compile again
                log.debug("cannot load precompiled %s (%s: %s); compiling", path, type(exc).__name__, exc)
        try:
            variant = self._aot_compile(args, kwargs)
        except Exception as exc:  # precompile cannot handle this call: the plain wrapper can
            log.debug("precompile of %s failed (%s: %s); using torch.compile", self.fn.__qualname__,
                      type(exc).__name__, exc)
            self._variants[digest] = None
            return None
        self._variants[digest] = variant
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            variant.save_compiled_function(str(path))  # atomic: temporary file, then os.replace
            self.saved += 1
        except Exception as exc:  # unserializable or unwritable: still usable in this process
            log.debug("cannot save precompiled %s to %s (%s: %s)", self.fn.__qualname__, path,
                      type(exc).__name__, exc)
        return variant

    def _aot_compile(self, args: tuple, kwargs: dict):
        """``aot_compile`` of these arguments.  Where Dynamo asks to trace again (it turns a Python float into a
        tensor input and restarts: ``torch.compile`` retries by itself, ``aot_compile`` raises), trace again."""
        from torch._dynamo.exc import RestartAnalysis

        for attempt in range(_RESTARTS):
            try:
                with _quiet_guards():
                    return self.compiled.aot_compile((args, kwargs))
            except RestartAnalysis:
                if attempt == _RESTARTS - 1:
                    raise
                log.debug("precompile of %s: Dynamo restarts its analysis", self.fn.__qualname__)
        raise AssertionError("unreachable")
