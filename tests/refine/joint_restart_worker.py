"""A torchrun worker of tests/refine/test_joint.py::test_torchrun_restarts_a_killed_worker_from_the_checkpoint.

::

    torchrun --nproc-per-node 2 --max-restarts 1 joint_restart_worker.py --stills 4 --size 32 --seed 1 \
        --checkpoint joint.ckpt.h5 --every 2 --kill-rank 1 --kill-step 2 --out result.json --attempts attempts.txt

A joint refinement of :func:`refine.inputs.problems.make_stills` (each process builds its share) with a checkpoint
every ``--every`` steps.  On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) process ``--kill-rank``
sends itself SIGKILL right after the checkpoint of step ``--kill-step`` is complete; torchrun then stops the
other process and starts both again, and :func:`refine.many.joint.refine_joint` resumes from the checkpoint by
itself.  Every process appends ``<restart count> <rank>`` to ``--attempts`` when it starts; process 0 writes
the result's JSON document to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch.distributed as dist  # noqa: E402

from joint_stills import image_start  # noqa: E402
from refine.many.batch import restart_count  # noqa: E402
from refine.many.joint import image_shard, refine_joint  # noqa: E402
from refine.fitting.parameters import SYMMETRIES  # noqa: E402
from refine.inputs.problems import make_stills  # noqa: E402
from refine.output.results import jsonable  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("--stills", "--size", "--seed", "--every", "--kill-rank", "--kill-step"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--checkpoint", "--out", "--attempts"):
        ap.add_argument(name, required=True)
    a = ap.parse_args()
    shard = image_shard(a.stills)  # sets up the gloo group
    rank = dist.get_rank()
    with open(a.attempts, "a") as fh:
        fh.write(f"{restart_count()} {rank}\n")

    def kill_once(step: int, path: Path) -> None:
        if restart_count() == 0 and rank == a.kill_rank and step >= a.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    stills = make_stills("orthorhombic_xds", a.stills, a.size, seed=a.seed, indices=shard)
    ref = next(p for p in stills if p is not None)
    result = refine_joint([p.simulator() if p is not None else None for p in stills],
                          [p.observed if p is not None else None for p in stills], symmetry=ref.symmetry,
                          start={k: ref.start[k] for k in SYMMETRIES[ref.symmetry]},
                          image_starts=[image_start(p) if p is not None else None for p in stills],
                          checkpoint=a.checkpoint, checkpoint_every=a.every, on_checkpoint=kill_once)
    if rank == 0:
        Path(a.out).write_text(json.dumps(jsonable(result.to_json_dict())) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main())
