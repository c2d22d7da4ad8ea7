"""refine.many.memory: a pass over the stills trims the C heap every few stills and after the last
(nbtorch.runtime.policy.release_free_memory), and the trim can be turned off."""

from __future__ import annotations

import sys

import pytest

from nbtorch.runtime import policy
from refine.many import memory


def test_released_yields_every_item_and_trims_every_few(monkeypatch):
    calls = []
    seen = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: calls.append(len(seen)))
    for item in memory.released(range(10), every=4):
        seen.append(item)
    assert seen == list(range(10)) and calls == [4, 8, 10]
    calls.clear()
    seen.clear()
    assert list(memory.released([], every=4)) == [] and calls == []
    for item in memory.released(range(8), every=4):
        seen.append(item)
    assert calls == [4, 8]  # no second trim after a last item that ended a group


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_free_memory_runs_on_glibc_unless_turned_off(monkeypatch):
    monkeypatch.delenv("NBTORCH_TUNE_MALLOC", raising=False)
    ran = policy.release_free_memory()
    assert ran is (policy._LIBC[0] is not None)
    monkeypatch.setenv("NBTORCH_TUNE_MALLOC", "0")
    assert policy.release_free_memory() is False
