"""Shared fixtures of the gradient suite: one eager probe per case, one thread, float64.

(Not a conftest.py: tests/conftest.py is imported by name as ``conftest`` by other
test modules, and a second conftest.py would shadow it.)  Each test module does
``from gradient_probes import get_probe, one_thread_eager  # noqa: F401``.

Every simulator here is built with ``compile=False`` (and tests/conftest.py sets
``NANOBRAGG_DISABLE_COMPILE=1``): gradcheck must never meet a compiled graph.
The ROIs are 24-32 px, where intra-op threading costs more than it saves (and
makes timings erratic on a shared 2-core machine), so each module runs with one
thread and restores the caller's setting afterwards.
"""

from __future__ import annotations

import pytest
import torch

import nbtorch
from nbtorch.tools.gradcheck_report import CASES, GradientProbe

_PROBES: dict[str, GradientProbe] = {}


@pytest.fixture(autouse=True, scope="module")
def one_thread_eager():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with nbtorch.eager():
        yield
    torch.set_num_threads(threads)


def get_probe(name: str) -> GradientProbe:
    """The (cached) probe of a case in gradcheck_report.CASES: simulator, ROI with spots, weights."""
    if name not in _PROBES:
        _PROBES[name] = GradientProbe.from_case(CASES[name])
    return _PROBES[name]

