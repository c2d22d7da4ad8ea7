"""Fixtures for the refinement tests.

The refinement problems are small (64 x 64 pixels): per-operation threading
overhead then dominates, and one thread is several times faster than two on a
busy 2-core machine.  Every test here runs with one intra-op thread (restored
afterwards, so other test folders are unaffected).  The synthetic problems
are cached per (name, size) for the session: building one costs a simulation.
"""

from __future__ import annotations

import pytest
import torch

from refine.inputs.problems import make_problem

_PROBLEMS: dict = {}


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="session")
def problem_cache(tmp_path_factory):
    """``get(name, size)`` -> the cached :class:`refine.inputs.problems.Problem` (F tables in a temp dir)."""
    directory = tmp_path_factory.mktemp("problems")

    def get(name: str, size: int = 64):
        key = (name, size)
        if key not in _PROBLEMS:
            old = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                _PROBLEMS[key] = make_problem(name, size, directory=directory)
            finally:
                torch.set_num_threads(old)
        return _PROBLEMS[key]

    return get
