"""A process's passes over its stills hand freed memory back as they go.

Each pass of a joint run over the stills a process holds (the candidates' photons, the EM start, the
preconditioner, every loss and gradient, the esds) makes each still's intermediates (megabytes) between the small
objects the process keeps.  The C heap then grows by about a megabyte a still on the first pass while the live data
do not; :func:`released` walks the stills and trims the heap every :data:`RELEASE_EVERY` of them
(:func:`nbtorch.runtime.policy.release_free_memory`), so that a process holding thousands of stills stays near
its live size (docs/log.md, "ten thousand amplitudes in a process").
"""

from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

from nbtorch.runtime.policy import release_free_memory

__all__ = ["RELEASE_EVERY", "released"]

#: stills between two trims: a trim costs milliseconds, a still's evaluation tens of them
RELEASE_EVERY = 16

T = TypeVar("T")


def released(items: Iterable[T], every: int = RELEASE_EVERY) -> Iterator[T]:
    """``items`` one by one, the heap trimmed after every ``every`` of them and after the last."""
    k = 0
    for k, item in enumerate(items, 1):
        yield item
        if k % every == 0:
            release_free_memory()
    if k % every:
        release_free_memory()
