"""Measure a serial joint refinement at scale: ``n`` synthetic stills (:mod:`experiments.serial_data`), one process
or several under torchrun.

::

    python -m experiments.serial_scale --stills 1000 --out out/serial1000.json [--h5 out/serial1000.h5]
    torchrun --nproc-per-node 2 -m experiments.serial_scale --stills 1000 --out out/serial1000_2p.json

Every process draws the whole set from ``--seed`` (the same bits in each) but keeps only its own block of it
(:func:`refine.many.distributed.image_shard`: the observed counts and simulators of those images), which it holds
through every round of :func:`refine.many.serial.refine_serial` (``local_images``).  Process 0 writes
``--out``: wall seconds (generation and refinement apart), the peak resident memory (MiB) and CPU seconds (the
whole process: generation included) of every process, the
load average before and after, the shared cell, its esds and error against the truth, the rounds, the images
dropped (with their reasons) against the bad images of the set, and every image's final values (for comparing
1 and 2 processes bit for bit); ``--h5``: the serial result file (:func:`refine.many.serial_file.save_serial_h5`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from experiments.serial_data import make_serial
from refine.many.batch import end_process_group
from refine.many.distributed import Comm, image_shard
from refine.many.serial import refine_serial
from refine.many.serial_file import save_serial_h5
from refine.output.results import jsonable

__all__ = ["main", "measure"]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure(n: int, seed: int, bad_fraction: float, h5: str | None = None) -> dict:
    """One measured run (every process calls it; every process gets the document)."""
    load0 = os.getloadavg()
    comm = Comm()
    t0 = time.monotonic()
    mine = list(image_shard(n, comm.rank, comm.world))
    ds = make_serial(n, np.random.default_rng(seed), bad_fraction=bad_fraction, keep=mine)
    t1 = time.monotonic()
    result = refine_serial(ds.simulators(mine), ds.observed(), image_starts=ds.image_starts(), start=ds.shared_start,
                           symmetry=ds.symmetry, local_images=mine)
    t2 = time.monotonic()
    peaks = comm.gather({comm.rank: torch.tensor([_peak_mib()])}, comm.world, (1,), torch.float64)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = comm.gather({comm.rank: torch.tensor([usage.ru_utime + usage.ru_stime])}, comm.world, (1,), torch.float64)
    truth = ds.shared_truth
    names = [k for k in result.joint.shared_names]
    doc = {"n": n, "seed": seed, "bad_fraction": bad_fraction, "world_size": comm.world,
           "generate_s": t1 - t0, "refine_s": t2 - t1, "peak_mib": peaks.reshape(-1).tolist(),
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
    ap.add_argument("--max-dense", type=int, help="raw parameters above which the preconditioner and esds take the "
                                                   "arrowhead (Schur complement) path (default: refine.many.esds's "
                                                   "MAX_DENSE); 0 exercises it on a small set")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if a.max_dense is not None:
        import refine.many.esds
        import refine.many.joint

        refine.many.esds.MAX_DENSE = refine.many.joint.MAX_DENSE = a.max_dense
    doc = measure(a.stills, a.seed, a.bad_fraction, a.h5)
    comm = Comm()
    if comm.rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(jsonable(doc), indent=1) + "\n")
        print(doc["summary"])
        print(f"n {a.stills}, {comm.world} processes: generate {doc['generate_s']:.1f} s, refine {doc['refine_s']:.1f} s, "
              f"peak {max(doc['peak_mib']):.0f} MiB per process, load {doc['load_before'][0]:.1f}")
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
