"""What a process of a many-still joint run holds for the images it does not hold: a few numbers a still.

One process of two holds k = 4 stills of n = 40 and of n = 4000 (a stand-in for the process group,
:class:`experiments.process_memory.StandIn`, hands it the other process's rows as copies of its own: the same sizes,
no second process). Measured: the bytes it holds (Python objects and numpy arrays by ``tracemalloc``, torch tensors
reachable from the run by their storages) when the joint loop starts (the problem, its part of the raw start and of
the arrowhead preconditioner), after a serial run (its result: every image's values, esds and fit), and after a
serial run whose last round took 6 steps (its result and that round's loop state: the step rule's vectors and
curvature pairs).  Each must grow by less than 500 bytes per still of the whole set (69, 347 and 349 bytes
measured).  The build that held every still's starting values, maps and result rows as dicts in every process gave
3483 and 4696 bytes; the one whose step rule worked on the whole raw vector in every process gave 2062 bytes after
6 steps (and ~12 kB after 20 pairs); both fail it.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
import torch

import refine.many.esds as esds_module
import refine.many.joint as joint_module
from experiments.process_memory import StandIn
from experiments.serial_data import make_serial
from refine.many.joint import DEFAULT_CONVERGENCE
from refine.many.serial import refine_serial
from memory_walk import held_storages

K, SIZE, BOUND = 4, 16, 500


def _tensor_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` (numpy arrays: tracemalloc counts them)."""
    return sum(b for b, _ in held_storages(*roots, arrays=False, modules=False).values())


class _Stop(Exception):
    pass


def _run(n: int, monkeypatch, stop_at_loop: bool, steps: int = 1) -> int:
    """Bytes one process holding the first K of ``n`` stills holds at the loop's start or after the serial run
    (its result, and the last round's loop state: the step rule's vectors and curvature pairs)."""
    for module in (esds_module, joint_module):
        monkeypatch.setattr(module, "MAX_DENSE", 0)  # the esds by blocks: as above 800 stills
    ds = make_serial(n, np.random.default_rng(4), size=SIZE, bad_fraction=0.0, keep=range(K))
    sims, observed, starts = ds.simulators(range(K)), ds.observed(), ds.image_starts()
    seen = {}
    if stop_at_loop:
        def capture(joint, pre, *args, **kwargs):
            seen["roots"] = (joint, pre)
            seen["bytes"] = tracemalloc.get_traced_memory()[0]
            raise _Stop
        monkeypatch.setattr(joint_module, "_run_loop", capture)
    else:
        run_loop = joint_module._run_loop

        def keep_loop(*args, **kwargs):
            seen["loop"] = run_loop(*args, **kwargs)
            return seen["loop"]
        monkeypatch.setattr(joint_module, "_run_loop", keep_loop)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    try:
        result = refine_serial(sims, observed, image_starts=starts, start=ds.shared_start, symmetry=ds.symmetry,
                               local_images=range(K), max_rounds=2, screen_steps=1, comm=StandIn(),
                               convergence=DEFAULT_CONVERGENCE.replace(max_steps=steps))
        gc.collect()
        seen["bytes"], seen["roots"] = tracemalloc.get_traced_memory()[0], (result, seen["loop"])
    except _Stop:
        pass
    finally:
        tracemalloc.stop()
    return seen["bytes"] - before + _tensor_bytes(*seen["roots"])


@pytest.mark.parametrize("stop_at_loop,steps", [(True, 1), (False, 1), (False, 6)],
                         ids=["problem_at_loop_start", "serial_result", "result_and_step_rule_after_6_steps"])
def test_a_process_holds_a_few_numbers_per_still_of_the_whole_set(monkeypatch, stop_at_loop, steps):
    torch.set_num_threads(1)
    _run(K, monkeypatch, stop_at_loop, steps)  # warm: imports and caches
    small = _run(40, monkeypatch, stop_at_loop, steps)
    large = _run(4000, monkeypatch, stop_at_loop, steps)
    per_still = (large - small) / (4000 - 40)
    print(f"held: {small} B for 40 stills, {large} B for 4000: {per_still:.0f} B per still")
    assert per_still < BOUND, per_still


def test_the_generator_draws_only_the_kept_stills():
    # one process's share of a large set costs its own stills: n entries of None and a kind each
    gc.collect()
    tracemalloc.start()
    make_serial(4, np.random.default_rng(4), size=SIZE, bad_fraction=0.0)  # warm
    base = tracemalloc.get_traced_memory()[0]
    small = make_serial(40, np.random.default_rng(4), size=SIZE, keep=range(K))
    mid = tracemalloc.get_traced_memory()[0]
    large = make_serial(20000, np.random.default_rng(4), size=SIZE, keep=range(K))
    end = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_still = ((end - mid) - (mid - base)) / (20000 - 40)
    assert per_still < 40, per_still
    assert sum(im is not None for im in large.images) == K and len(large) == 20000 and len(small) == 40


def test_the_amplitude_harness_under_torchrun_holds_each_process_block(tmp_path):
    """``experiments.process_memory --amplitudes`` under torchrun: two real processes, each holding its block of
    the stills, end on the bits of one process holding them all, and report each process's peak and wall."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "NANOBRAGG_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1", "NBTORCH_CACHE_DIR": str(tmp_path / "cache")}
    args = ["-m", "experiments.process_memory", "--stills", "4", "--size", "32", "--amplitudes", "--max-steps", "3"]
    one = subprocess.run([sys.executable, *args, "--hold", "4", "--processes", "1", "--out", str(tmp_path / "p1.json")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(29500 + os.getpid() % 997), *args,
                          "--out", str(tmp_path / "p2.json")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads((tmp_path / f"p{p}.json").read_text()) for p in (1, 2))
    assert a["processes"] == 1 and b["processes"] == 2 and not b["stood_in"]
    assert [p["hold"] for p in b["per_process"]] == [2, 2] and a["per_process"][0]["hold"] == 4
    assert a["amplitudes"] == b["amplitudes"] > 5 and a["steps"] == b["steps"]
    assert a["loss_final"] == b["loss_final"]
    assert b["peak_mib"] == max(p["peak_mib"] for p in b["per_process"]) > 0
