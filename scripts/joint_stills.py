"""Joint refinement of synthetic stills of one crystal (refine.many.joint), in one process or under torchrun.

::

    python scripts/joint_stills.py --stills 16 --size 48 --out out/joint16.json [--singles]
    torchrun --nproc-per-node 2 scripts/joint_stills.py --stills 16 --size 48 --out out/joint16_2p.json

Each process builds only its share of the stills (:func:`refine.many.joint.image_shard`).  The stills are
:func:`refine.inputs.problems.make_stills` of ``--problem``: the start has the bank's cell (+1 %), orientation
(0.3 deg) and scale (x3) errors, the beam centre, distance, mosaic spread and N at the truth (not refined).
Process 0 writes ``--out``: the joint result, the truth, the rms cell error (over the free cell values of the
crystal system) and, with ``--singles``, that of :func:`refine.refine` on each still alone (same free names).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refine.many.joint import DEFAULT_CONVERGENCE, image_shard, refine_joint, save_joint_json  # noqa: E402
from refine.fitting.parameters import SYMMETRIES  # noqa: E402
from refine.inputs.problems import make_stills  # noqa: E402
from refine.output.results import jsonable  # noqa: E402
from refine.fitting.structure_factors import AmplitudeOptions  # noqa: E402

#: values the stills' starts take from the truth (not refined here)
KNOWN = ("beam_x", "beam_y", "mosaic_spread", "N_a", "N_b", "N_c", "distance")


def image_start(p) -> dict:
    """A still's start: its orientation and scale from the bank's start, the rest from the truth."""
    return {**{k: p.start[k] for k in ("misset_x", "misset_y", "misset_z", "scale")}, **{k: p.truth[k] for k in KNOWN}}


def cell_error(values: dict, truth: dict, symmetry: str) -> float:
    """rms over the free cell values of ``symmetry`` of (refined - truth)."""
    names = SYMMETRIES[symmetry]
    return math.sqrt(sum((values[k] - truth[k]) ** 2 for k in names) / len(names))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", default="orthorhombic_xds")
    ap.add_argument("--stills", type=int, default=16)
    ap.add_argument("--size", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--singles", action="store_true", help="also refine each still alone (one process only)")
    ap.add_argument("--space-group", help="also refine the structure factors, shared by the stills, in this space "
                                          "group (EM start, 30 photons to be refined; refine.many.amplitudes)")
    ap.add_argument("--information", choices=("auto", "dense", "diagonal"), default="auto",
                    help="with --space-group: the amplitudes' information (AmplitudeOptions.information); diagonal: "
                         "the model does not interpolate the structure factors (-nointerpolate)")
    ap.add_argument("--max-steps", type=int, help="the joint loop's step limit (default: refine.many.joint's)")
    ap.add_argument("--checkpoint", help="the joint run's checkpoint file (written every 2 steps)")
    ap.add_argument("--resume", help="continue from this checkpoint (written by any number of processes)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    shard = image_shard(a.stills)
    stills = make_stills(a.problem, a.stills, a.size, seed=a.seed, indices=shard)
    ref = next(p for p in stills if p is not None)
    symmetry = ref.symmetry
    # the shared start: the bank's perturbed cell (every still's start has the same one)
    start = {k: ref.start[k] for k in SYMMETRIES[symmetry]}
    amplitudes = None if a.space_group is None else AmplitudeOptions(a.space_group, start="estimate",
                                                                     min_photons=30.0, information=a.information)
    if a.information == "diagonal":
        stills = [None if p is None else dataclasses.replace(p, args=tuple(p.args) + ("-nointerpolate",))
                  for p in stills]
    conv = None if a.max_steps is None else DEFAULT_CONVERGENCE.replace(max_steps=a.max_steps)
    result = refine_joint([p.simulator() if p is not None else None for p in stills],
                          [p.observed if p is not None else None for p in stills], symmetry=symmetry,
                          start=start, image_starts=[image_start(p) if p is not None else None for p in stills],
                          structure_factors=amplitudes, convergence=conv, checkpoint=a.checkpoint,
                          checkpoint_every=2, resume=a.resume)
    wall = time.monotonic() - t0
    if result.world_size > 1:
        import torch.distributed as dist

        rank = dist.get_rank()
    else:
        rank = 0
    doc = {"problem": a.problem, "n": a.stills, "size": a.size, "seed": a.seed, "wall_s": wall,
           "world_size": result.world_size, "truth": {k: ref.truth[k] for k in SYMMETRIES[symmetry]},
           "joint_cell_error": cell_error(result.shared, ref.truth, symmetry),
           "joint": result.to_json_dict()}
    if a.singles and result.world_size == 1:
        from refine import refine

        singles = []
        for p in stills:
            t = time.monotonic()
            r = refine(p.simulator(), p.observed, start=image_start(p), free=("scale", "background", "orientation",
                                                                              "cell"), symmetry=symmetry, progress=False)
            singles.append({"status": r.status.value, "steps": r.steps, "wall_s": time.monotonic() - t,
                            "cell": {k: r.params[k] for k in SYMMETRIES[symmetry]},
                            "esds": {k: r.esds.get(k) for k in SYMMETRIES[symmetry]},
                            "fisher_esds": {k: r.esd_kinds.get("fisher", {}).get(k) for k in SYMMETRIES[symmetry]},
                            "cell_error": cell_error(r.params, ref.truth, symmetry)})
        doc["singles"] = singles
        errs = [s["cell_error"] for s in singles]
        doc["single_cell_error_rms"] = math.sqrt(sum(e * e for e in errs) / len(errs))
        doc["single_cell_error_mean"] = sum(errs) / len(errs)
    if rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(jsonable(doc), indent=1) + "\n")
        save_joint_json(result, Path(a.out).with_suffix(".result.json"))
        print(result.summary())
        print(f"wall {wall:.1f} s, joint cell error {doc['joint_cell_error']:.3g} A")
    if result.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
