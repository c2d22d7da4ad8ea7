"""Measure what one process of a many-still serial run holds: ``--hold k`` stills of ``--stills n``, the other
processes stood in (:class:`StandIn`), so that a set of 10^5 stills costs only this process's k.

::

    python -m experiments.process_memory --stills 10000 --hold 4 --out out/mem_10000_4.json
    python -m experiments.process_memory --stills 10000 --hold 100 --amplitudes --out out/mem_amp.json
    python -m experiments.process_memory --stills 10000 --hold 2500 --processes 4 --amplitudes --size 128 --distance 15 \
        --max-steps 2 --out out/mem_amp_1e4.json   # ~10^4 amplitudes
    torchrun --nproc-per-node 4 -m experiments.process_memory --stills 400 --amplitudes --out out/mem_amp_4p.json

With ``--amplitudes`` the run is a joint refinement of shared amplitudes (:func:`measure_amplitudes`).

The process draws its k stills (:func:`experiments.serial_data.make_serial`'s ``keep``) and runs
:func:`refine.many.serial.refine_serial` on them (two rounds, 1 and ``--max-steps`` steps) with
:class:`StandIn` as its process group: every gathered row of an image it does not hold is a copy of its own first
row, so every array, list and gather has the size it has in a real run of ``n`` stills while only k are
simulated (the refined values mean nothing).  It writes ``--out``: the resident memory before drawing
(``base_mib``: torch and the model), the peak (``peak_mib``), their difference (``held_mib``) and the bytes of the
raw vector (its length times 8; the step rule keeps up to 20 pairs of such vectors).  One configuration per process: the peak is the whole
process's.
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
from nbtorch.cli.support import run_main
from nbtorch.errors import InputError
from refine.many.batch import end_process_group
from refine.many.distributed import Comm, image_shard
from refine.many.joint import DEFAULT_CONVERGENCE
from refine.many.serial import refine_serial
from refine.output.results import jsonable

__all__ = ["StandIn", "measure", "measure_amplitudes", "main"]


class StandIn(Comm):
    """Process ``rank`` of ``world`` without a process group: the rows of the images it does not hold are copies
    of its own first row (sizes as in a real run; values meaningless)."""

    def __init__(self, world: int = 2, rank: int = 0) -> None:
        self.dist, self.rank, self.world = None, rank, world

    def gather(self, rows, n, shape, dtype):
        out = torch.zeros((n, *shape), dtype=dtype)
        for i, row in rows.items():
            out[i] = row.detach().to(dtype=dtype, device="cpu").reshape(shape)
        if rows:
            others = torch.ones(n, dtype=torch.bool)
            others[list(rows)] = False
            out[others] = out[min(rows)].clone()
        return out

    def gather_objects(self, local, n):
        first = next(iter(local.values()), None)
        return [local.get(i, first) for i in range(n)]


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2.0 ** 20


def measure(n: int, hold: int, *, seed: int = 1, size: int = 16, screen_steps: int = 1, max_steps: int = 25) -> dict:
    """One process holding the first ``hold`` of ``n`` stills (module docstring)."""
    if not 1 <= hold <= n:
        raise InputError(f"hold: expected an integer in [1, {n}], got {hold}")
    base = _resident_mib()
    t0 = time.monotonic()
    ds = make_serial(n, np.random.default_rng(seed), size=size, keep=range(hold))
    result = refine_serial(ds.simulators(range(hold)), ds.observed(), image_starts=ds.image_starts(),
                           start=ds.shared_start, symmetry=ds.symmetry, local_images=range(hold), max_rounds=2,
                           screen_steps=screen_steps, convergence=DEFAULT_CONVERGENCE.replace(max_steps=max_steps),
                           comm=StandIn())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    n_raw = len(result.joint.shared_names) + len(result.joint.images) * len(result.joint.per_image_names)
    return {"n": n, "hold": hold, "size": size, "screen_steps": screen_steps, "max_steps": max_steps,
            "base_mib": base, "peak_mib": peak, "held_mib": peak - base, "raw_vector_bytes": 8 * n_raw,
            "wall_s": time.monotonic() - t0}


def measure_amplitudes(n: int, hold: int, *, seed: int = 1, size: int = 96, max_steps: int = 25,
                       distance_mm: float = 40.0, processes: int = 2) -> dict:
    """``--amplitudes``: one process (of ``processes``) holding the first ``hold`` of ``n`` stills of
    :func:`experiments.serial_amplitudes.make_amplitude_set` (``size`` pixels a side at ``distance_mm``; truth of one
    domain, no sub-pixels: the memory, not the numbers, is measured) in a joint run of the shared amplitudes
    (``start="estimate"``, the treatment ``auto`` picks), the cell, and each still's scale, background and
    orientation, ``max_steps`` steps, no esds.  Each still is kept as its fitted pixels (all of them), as a joint
    run from image files keeps it, not as a dense image.  The candidates are those of the held stills (the stood-in ones
    repeat the first's): hold a few thousand stills for the whole set's.

    Under torchrun (``WORLD_SIZE`` > 1) nothing is stood in: each process draws and holds its own block of the
    stills (:func:`refine.many.distributed.image_shard`; ``hold`` and ``processes`` are then the run's), and every
    process's peak and wall are in ``per_process`` (``peak_mib``, ``held_mib``, ``wall_s``: the largest)."""
    from experiments.serial_amplitudes import SPACE_GROUP, SYMMETRY, make_amplitude_set  # noqa: PLC0415
    from refine.fitting.structure_factors import AmplitudeOptions  # noqa: PLC0415
    from refine.many.joint import refine_joint  # noqa: PLC0415

    comm = Comm()
    if comm.world > 1:
        local, processes = image_shard(n, comm.rank, comm.world), comm.world
    else:
        if not 1 <= hold <= n:
            raise InputError(f"hold: expected an integer in [1, {n}], got {hold}")
        local, comm = range(hold), StandIn(processes)
    base = _resident_mib()
    t0 = time.monotonic()
    ds = make_amplitude_set(n, np.random.default_rng(seed), size=size, distance_mm=distance_mm, keep=local,
                            truth_domains=1, truth_oversample=1, as_pixels=True)
    s = ds.serial
    result = refine_joint(s.simulators(), s.observed(), shared=("cell",),
                          per_image=("scale", "background", "orientation"), symmetry=SYMMETRY, start=s.shared_start,
                          image_starts=s.image_starts(), esds=False, geometry_first=False, local_images=local,
                          structure_factors=AmplitudeOptions(SPACE_GROUP, start="estimate"),
                          convergence=DEFAULT_CONVERGENCE.replace(max_steps=max_steps), comm=comm)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    own = {"rank": comm.rank, "hold": len(local), "base_mib": base, "peak_mib": peak, "held_mib": peak - base,
           "wall_s": time.monotonic() - t0}
    per_process = comm.gather_objects({comm.rank: own}, comm.world) if comm.dist is not None else [own]
    sf = result.structure_factors
    return {"n": n, "hold": len(local), "size": size, "distance_mm": distance_mm, "processes": processes,
            "stood_in": comm.dist is None and processes > 1, "max_steps": max_steps, "amplitudes": sf["n_free"],
            "candidates": sf["n_free"] + sf["n_held"], "information": sf.get("information"), "base_mib": base,
            "peak_mib": max(p["peak_mib"] for p in per_process), "held_mib": max(p["held_mib"] for p in per_process),
            "raw_vector_bytes": 8 * (len(result.shared_names) + len(local) * len(result.per_image_names)),
            "steps": result.steps, "loss_final": result.loss_final, "wall_s": max(p["wall_s"] for p in per_process),
            "per_process": per_process}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stills", type=int, required=True, help="stills in the whole set")
    ap.add_argument("--hold", type=int, default=4, help="stills this process holds (default 4; under torchrun: its "
                                                        "block of the stills)")
    ap.add_argument("--size", type=int, help="detector side (pixels; default 16, 96 with --amplitudes)")
    ap.add_argument("--max-steps", type=int, default=25, help="round 2's step limit (default 25: the step rule's "
                                                               "20 curvature pairs filled)")
    ap.add_argument("--amplitudes", action="store_true", help="a joint run of shared amplitudes on the stills of "
                                                                  "experiments.serial_amplitudes (--size default 96)")
    ap.add_argument("--distance", type=float, default=40.0, help="--amplitudes: detector distance (mm; default 40)")
    ap.add_argument("--processes", type=int, default=2, help="--amplitudes: processes of the run, this one the "
                                                             "first (default 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON of the measurement")
    return ap


def _run(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if a.max_steps < 1:
        raise InputError(f"--max-steps: expected an integer >= 1, got {a.max_steps}")
    if not a.distance > 0 or a.processes < 1:
        raise InputError(f"--distance, --processes: expected a distance > 0 and at least 1 process, got "
                         f"{a.distance:g} and {a.processes}")
    torchrun = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    if torchrun and not a.amplitudes:
        raise InputError("torchrun: only --amplitudes runs as several real processes (the serial run stands them in)")
    if a.amplitudes:
        doc = measure_amplitudes(a.stills, a.hold, seed=a.seed, size=a.size or 96, max_steps=a.max_steps,
                                 distance_mm=a.distance, processes=a.processes)
    else:
        doc = measure(a.stills, a.hold, seed=a.seed, size=a.size or 16, max_steps=a.max_steps)
    if int(os.environ.get("RANK", "0") or 0) == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(jsonable(doc), indent=1) + "\n")
        of = f" ({doc['processes']} processes)" if "processes" in doc else ""
        print(f"{a.stills} stills, {doc['hold']} held{of}: peak {doc['peak_mib']:.0f} MiB, {doc['held_mib']:.1f} MiB "
              f"above the start, {doc['wall_s']:.0f} s")
    end_process_group()  # under torchrun: after a barrier (a no-op for one process)
    return 0


def main(argv=None) -> int:
    """The command: bad input is one line and exit status 2 (:func:`nbtorch.cli.support.run_main`)."""
    return run_main("process_memory", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
