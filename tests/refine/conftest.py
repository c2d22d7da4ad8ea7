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


@pytest.fixture
def joint_stills_docs(tmp_path):
    """``run(*args) -> (one, two)``: ``scripts/joint_stills.py`` with ``args`` run by one process and by two
    (torchrun, gloo on loopback), each run's ``joint`` document (its JSON result)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "NANOBRAGG_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1", "NBTORCH_CACHE_DIR": str(tmp_path / "cache")}

    def run(*args: str) -> tuple[dict, dict]:
        docs = []
        for processes in (1, 2):
            out = tmp_path / f"p{processes}.json"
            argv = [str(root / "scripts" / "joint_stills.py"), *args, "--out", str(out)]
            cmd = [sys.executable, *argv] if processes == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(29500 + (os.getpid() + len(docs) + hash(args) % 97) % 1000), *argv]
            done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            docs.append(json.loads(out.read_text())["joint"])
        return docs[0], docs[1]

    return run
