"""Measure a serial joint refinement at scale: ``n`` synthetic stills (:mod:`experiments.serial_data`), one process
or several under torchrun.

::

    python -m experiments.serial_scale --stills 1000 --out out/serial1000.json [--h5 out/serial1000.h5]
    torchrun --nproc-per-node 2 -m experiments.serial_scale --stills 1000 --out out/serial1000_2p.json

Every process draws only its own block of the set (:func:`refine.many.distributed.image_shard`; each still from
its own seed, so the set is the same bits for any number of processes), which it holds through every round of
:func:`refine.many.serial.refine_serial` (``local_images``).  ``--size``, ``--max-steps``, ``--screen-steps`` and
``--max-rounds`` make a short run that measures memory.  Process 0 writes
``--out``: wall seconds (generation and refinement apart), the peak resident memory (MiB), the resident memory
before drawing (``base_mib``: torch and the model) and CPU seconds (the
whole process: generation included) of every process, the
load average before and after, the shared cell, its esds and error against the truth, the rounds, the images
dropped (with their reasons) against the bad images of the set, and every image's final values (for comparing
1 and 2 processes bit for bit); ``--h5``: the serial result file (:func:`refine.many.serial_file.save_serial_h5`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from experiments.serial_data import make_serial
from nbtorch.cli.support import run_main
from nbtorch.errors import InputError
from refine.many.batch import end_process_group
from refine.many.distributed import Comm, image_shard
from refine.many.joint import DEFAULT_CONVERGENCE
from refine.many.serial import refine_serial
from refine.many.serial_file import save_serial_h5
from refine.output.results import jsonable

__all__ = ["main", "measure"]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _resident_mib() -> float:
    """The resident memory now (MiB; Linux)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2.0 ** 20
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return math.nan


def measure(n: int, seed: int, bad_fraction: float, h5: str | None = None, *, size: int = 64,
            max_steps: int | None = None, screen_steps: int = 12, max_rounds: int = 3) -> dict:
    """One measured run (every process calls it; every process gets the document)."""
    load0 = os.getloadavg()
    comm = Comm()
    base = _resident_mib()
    t0 = time.monotonic()
    mine = list(image_shard(n, comm.rank, comm.world))
    ds = make_serial(n, np.random.default_rng(seed), size=size, bad_fraction=bad_fraction, keep=mine)
    t1 = time.monotonic()
    kw = {} if max_steps is None else {"convergence": DEFAULT_CONVERGENCE.replace(max_steps=max_steps)}
    result = refine_serial(ds.simulators(mine), ds.observed(), image_starts=ds.image_starts(), start=ds.shared_start,
                           symmetry=ds.symmetry, local_images=mine, screen_steps=screen_steps, max_rounds=max_rounds,
                           **kw)
    t2 = time.monotonic()
    peaks = comm.gather({comm.rank: torch.tensor([_peak_mib()])}, comm.world, (1,), torch.float64)
    bases = comm.gather({comm.rank: torch.tensor([base])}, comm.world, (1,), torch.float64)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = comm.gather({comm.rank: torch.tensor([usage.ru_utime + usage.ru_stime])}, comm.world, (1,), torch.float64)
    truth = ds.shared_truth
    names = [k for k in result.joint.shared_names]
    doc = {"n": n, "seed": seed, "bad_fraction": bad_fraction, "world_size": comm.world, "size": size,
           "max_steps": max_steps, "screen_steps": screen_steps, "max_rounds": max_rounds,
           "generate_s": t1 - t0, "refine_s": t2 - t1, "peak_mib": peaks.reshape(-1).tolist(),
           "base_mib": bases.reshape(-1).tolist(),
           "cpu_s": cpu.reshape(-1).tolist(),
           "load_before": load0, "load_after": os.getloadavg(), "threads": torch.get_num_threads(),
           "truth": {k: truth[k] for k in names}, "shared": result.shared, "shared_esds": result.shared_esds,
           "fisher_esds": result.joint.esds_by_kind.get("fisher", {}).get("shared", {}),
           "error_over_esd": {k: (result.shared[k] - truth[k]) / result.shared_esds[k] for k in names},
           "rounds": list(result.rounds), "summary": result.summary(),
           "dropped": {str(i): d["reason"] for i, d in result.dropped.items()},
           "bad": {str(i): k for i, k in ds.bad().items()}, "used": list(result.used),
           "images": list(result.joint.images), "image_esds": list(result.joint.image_esds),
           "loss_final": result.joint.loss_final}
    if h5 and comm.rank == 0:
        save_serial_h5(result, h5)
    return doc


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stills", type=int, required=True, help="number of stills")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bad-fraction", type=float, default=0.03)
    ap.add_argument("--out", required=True, help="JSON of the measurement (process 0)")
    ap.add_argument("--h5", help="the serial result file (process 0)")
    ap.add_argument("--size", type=int, default=64, help="detector side (pixels; default 64)")
    ap.add_argument("--max-steps", type=int, help="step limit of every round (default: the joint default)")
    ap.add_argument("--screen-steps", type=int, default=12, help="round 1's step limit (default 12)")
    ap.add_argument("--max-rounds", type=int, default=3, help="at most this many rounds (>= 2; default 3)")
    ap.add_argument("--max-dense", type=int, help="raw parameters above which the esds take the arrowhead (Schur "
                                                   "complement) path (default: refine.many.esds's MAX_DENSE); 0 "
                                                   "exercises it on a small set")
    return ap


def _run(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if a.max_dense is not None:
        import refine.many.esds
        import refine.many.joint

        refine.many.esds.MAX_DENSE = refine.many.joint.MAX_DENSE = a.max_dense
    if a.max_steps is not None and a.max_steps < 1:
        raise InputError(f"--max-steps: expected an integer >= 1, got {a.max_steps}")
    try:
        doc = measure(a.stills, a.seed, a.bad_fraction, a.h5, size=a.size, max_steps=a.max_steps,
                      screen_steps=a.screen_steps, max_rounds=a.max_rounds)
    except InputError:
        end_process_group()
        raise
    comm = Comm()
    if comm.rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(jsonable(doc), indent=1) + "\n")
        print(doc["summary"])
        held = max(p - b for p, b in zip(doc["peak_mib"], doc["base_mib"]))
        print(f"n {a.stills}, {comm.world} processes: generate {doc['generate_s']:.1f} s, refine {doc['refine_s']:.1f} s, "
              f"peak {max(doc['peak_mib']):.0f} MiB per process ({held:.0f} MiB above the start), "
              f"load {doc['load_before'][0]:.1f}")
    end_process_group()
    return 0


def main(argv=None) -> int:
    """The command: bad input is one line and exit status 2 (:func:`nbtorch.cli.support.run_main`)."""
    return run_main("serial_scale", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
