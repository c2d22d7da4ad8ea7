"""The merges to beat against the refined amplitudes, on a synthetic serial set with known amplitudes.

::

    python -m experiments.merge_compare --stills 100 --out out/merge100.json [--anomalous] [--no-amplitudes]

Draws ``--stills`` stills (:mod:`experiments.serial_amplitudes`), then integrates every still's predicted spots
(:mod:`experiments.spot_integration`) with the refinement's model (coarser mosaic, no sub-pixels, no amplitude
table) and merges them (:mod:`experiments.merging`: the plain mean and the partiality-corrected mean, each tied
and anomalous) at three geometries:

1. **true**: each still's true values (scale included);
2. **start**: the indexer's start (scale 1, the start cell); its tied partiality-corrected merge is the
   *reference* the geometry is refined against (``--no-reference``: one amplitude ``MEAN_F`` for every
   reflection);
3. **refined**: a joint refinement (:func:`refine.many.joint.refine_joint`; shared cell, per still scale,
   background and orientation, from the start, the model holding the reference).

Then (unless ``--no-amplitudes``) the joint amplitude refinement from the refined geometry
(``structure_factors=AmplitudeOptions(P 4, start="file", anomalous=--anomalous)``, ``geometry_first=False``), the
model holding the refined geometry's partiality-corrected merge as its start (``--no-reference``: the ``estimate``
start from one F), with its wall time and the process's peak resident memory.

The refinements' kernels are compiled when a refinement of all the stills would compile them
(:func:`nbtorch.runtime.policy.compile_policy`, the stills' evaluations together: they share the kernels;
``--no-compile``: eager).  Each table is compared with the truth (:mod:`experiments.amplitude_metrics`): R and CC after one overall scale,
and the correlation of the anomalous differences.  ``--out`` (JSON, written once at the end) holds every row, the
geometry's errors, the observations per reflection, wall times and memory; one line per row is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from experiments.amplitude_metrics import anomalous_cc, compare
from experiments.merging import amplitudes, counts, merge_partiality, merge_plain, reference_grid
from experiments.reflection_keys import reflection_keys
from experiments.serial_amplitudes import MEAN_F, SPACE_GROUP, SYMMETRY, AmplitudeSet, make_amplitude_set
from experiments.spot_integration import integrate, pixel_indices, predict_spots, unit_image
from nbtorch.runtime import policy
from nbtorch.cli.support import run_main
from nbtorch.errors import InputError
from refine.fitting.structure_factors import AmplitudeOptions
from refine.inputs.problems import PEDESTAL, misorientation_deg
from refine.many.joint import DEFAULT_CONVERGENCE, refine_joint
from refine.output.results import jsonable

__all__ = ["main", "measure", "merge_rows", "integrate_set"]

_log = logging.getLogger(__name__)

#: a spot is predicted when its reflection at the mean amplitude puts this many photons on the detector
MIN_SPOT_PHOTONS = 10.0
PER_IMAGE = ("scale", "background", "orientation")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def integrate_set(ds: AmplitudeSet, values: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(hkl (n, 3), intensity (n,), model (n,))`` of every still's integrated spots at its ``values``."""
    hkl, inten, model = [], [], []
    for i, (im, sim, v) in enumerate(zip(ds.serial.images, ds.serial.simulators(), values)):
        if i and i % 100 == 0:
            _log.info("integrated %d of %d stills", i, len(values))
        px = pixel_indices(sim, v)
        unit = unit_image(sim, v)
        got = integrate(im.observed, predict_spots(px, unit, MIN_SPOT_PHOTONS / MEAN_F ** 2), px, unit,
                        pedestal=PEDESTAL)
        hkl.append(got.hkl)
        inten.append(got.intensity)
        model.append(got.model)
    return np.concatenate(hkl), np.concatenate(inten), np.concatenate(model)


def _row(method: str, geometry: str, tied: dict, anomalous: dict | None, ds: AmplitudeSet) -> dict:
    row = {"method": method, "geometry": geometry, **compare(tied, ds.truth.tied), "_tied": tied}
    if anomalous is not None:
        an = anomalous_cc(anomalous, ds.truth.anomalous, ds.truth.pairs, ds.truth.signal)
        row.update({"anomalous_" + k: v for k, v in an.items()})
    return row


def merge_rows(ds: AmplitudeSet, geometry: str, hkl: np.ndarray, intensity: np.ndarray,
               model: np.ndarray) -> tuple[list, dict]:
    """The two merges' rows (tied R and CC, anomalous CC) of one integration, and the tied partiality-corrected
    amplitudes (a reference for the next refinement)."""
    tied = reflection_keys(ds.space_group, hkl, False)
    anom = reflection_keys(ds.space_group, hkl, True)
    n_obs = list(counts(tied).values())
    corrected = amplitudes(merge_partiality(tied, intensity, model))
    rows = [_row("plain mean", geometry, amplitudes(merge_plain(tied, intensity)),
                 amplitudes(merge_plain(anom, intensity)), ds),
            _row("partiality-corrected", geometry, corrected, amplitudes(merge_partiality(anom, intensity, model)), ds)]
    for r in rows:
        r.update(observations=len(tied), obs_per_reflection_median=float(np.median(n_obs)) if n_obs else 0.0)
    return rows, corrected


def _on_common_reflections(rows: list, ds: AmplitudeSet) -> list:
    """The rows with ``R_common``, ``CC_common`` and ``n_common``: each table compared on the reflections every
    row's table holds (a refinement may hold reflections a merge does not see)."""
    common = set.intersection(*(set(r["_tied"]) for r in rows))
    out = []
    for r in rows:
        got = compare({k: v for k, v in r.pop("_tied").items() if k in common}, ds.truth.tied)
        out.append({**r, "n_common": got["n"], "R_common": got["R"], "CC_common": got["CC"]})
    return out


def _simulators(ds: AmplitudeSet, reference: dict | None, compile: bool | None = None) -> list:
    """The refinement's model of every still, holding ``reference`` (tied amplitudes; ``MEAN_F`` elsewhere) if
    given; compiled or not by ``compile`` (None: :func:`nbtorch.runtime.policy.compile_policy` for a refinement
    whose model evaluation is every still's: the stills share their compiled kernels)."""
    sims = ds.serial.simulators()
    if reference is not None:
        grid, lo = reference_grid(reference, ds.space_group, (ds.truth.grid.shape[0] - 1) // 2, MEAN_F)
        sims = [s.with_structure_factors(grid, lo) for s in sims]
    per_image = math.prod(sims[0].shape) * sims[0].evaluations_per_pixel()
    decision = policy.compile_policy("refinement", len(sims) * per_image, explicit=compile)
    for s in sims:
        s.set_compile(*decision)
    return sims


def _geometry_errors(ds: AmplitudeSet, values: list[dict]) -> dict:
    mis = [misorientation_deg([im.truth[m] for m in ("misset_x", "misset_y", "misset_z")],
                              [v[m] for m in ("misset_x", "misset_y", "misset_z")])
           for im, v in zip(ds.serial.images, values)]
    scale = [v["scale"] / im.truth["scale"] for im, v in zip(ds.serial.images, values)]
    return {"misorientation_deg_median": float(np.median(mis)), "misorientation_deg_max": float(np.max(mis)),
            "cell_error_A": {k: values[0][k] - ds.serial.shared_truth[k] for k in ("cell_a", "cell_c")},
            "scale_ratio_rel_spread": float(np.std(np.log(scale)))}


def _refined_table(result) -> dict:
    return {(int(h), int(k), int(l)): float(F) for h, k, l, _, F, _, free in result.structure_factors["reflections"]
            if free}


def _tie(table: dict, ds: AmplitudeSet) -> dict:
    """A table with F(+) and F(-) apart, tied: ``sqrt((F+^2 + F-^2) / 2)`` where both are there, else the one."""
    out = dict(table)
    for p, m in ds.truth.pairs:
        if p in table and m in table:
            out[p] = math.sqrt(0.5 * (table[p] ** 2 + table[m] ** 2))
        elif m in table:
            out[p] = table[m]
        out.pop(m, None)
    return out


def _refine_amplitudes(ds: AmplitudeSet, sims: list, shared: dict, refined: list, anomalous: bool, start: str,
                       steps: int) -> dict:
    """The joint amplitude refinement from the refined geometry: its row (R, CC, anomalous CC, wall, memory)."""
    rss0 = _peak_mib()
    t0 = time.monotonic()
    amp = refine_joint(sims, ds.serial.observed(), shared=("cell",), per_image=PER_IMAGE, symmetry=SYMMETRY,
                       start=shared, image_starts=refined, esds=False,
                       structure_factors=AmplitudeOptions(SPACE_GROUP, start=start, anomalous=anomalous),
                       geometry_first=False, convergence=DEFAULT_CONVERGENCE.replace(max_steps=steps))
    wall = time.monotonic() - t0
    table = _refined_table(amp)
    row = _row("refined amplitudes", "refined", _tie(table, ds) if anomalous else table,
               table if anomalous else None, ds)
    row.update(amplitudes=len(table), start=start, anomalous_refined=anomalous, steps=amp.steps, status=amp.message,
               wall_s=wall, peak_mib=_peak_mib(), peak_mib_before=rss0)
    return row


def measure(n: int, seed: int, *, size: int = 96, refine_amplitudes: bool = True, anomalous: bool = False,
            reference: bool = True, max_steps: int = 100, amplitude_steps: int = 100, truth_domains: int = 40,
            compile: bool | None = None) -> dict:
    """One comparison (module docstring): the JSON document; ``compile``: the refinements' kernels compiled or not
    (None: as a refinement of all the stills would choose)."""
    t0 = time.monotonic()
    ds = make_amplitude_set(n, np.random.default_rng(seed), size=size, truth_domains=truth_domains)
    t1 = time.monotonic()
    rows, _ = merge_rows(ds, "true", *integrate_set(ds, [im.truth for im in ds.serial.images]))
    start = [{**ds.serial.shared_start, **im.start} for im in ds.serial.images]
    start_rows, first = merge_rows(ds, "start", *integrate_set(ds, start))
    t2 = time.monotonic()
    sims = _simulators(ds, first if reference else None, compile)
    geo = refine_joint(sims, ds.serial.observed(), shared=("cell",),
                       per_image=PER_IMAGE, symmetry=SYMMETRY, start=ds.serial.shared_start,
                       image_starts=ds.serial.image_starts(), esds=False,
                       convergence=DEFAULT_CONVERGENCE.replace(max_steps=max_steps))
    refined = [{**im.start, **geo.shared, **geo.images[i]} for i, im in enumerate(ds.serial.images)]
    t3 = time.monotonic()
    refined_rows, best = merge_rows(ds, "refined", *integrate_set(ds, refined))
    rows += start_rows + refined_rows
    doc = {"stills": n, "seed": seed, "size": size, "space_group": SPACE_GROUP, "truth_domains": truth_domains,
           "reference": "the partiality-corrected merge at the start geometry" if reference else f"F = {MEAN_F:g} for all",
           "unique_reflections_true": len(ds.truth.tied), "anomalous_signal_pairs": len(ds.truth.signal),
           "generate_s": t1 - t0, "merge_s": t2 - t1, "geometry_s": t3 - t2,
           "geometry": {"status": geo.message, "steps": geo.steps, "start": _geometry_errors(ds, start),
                        **_geometry_errors(ds, refined)},
           "threads": torch.get_num_threads(), "kernel": f"{sims[0].compile_mode} ({sims[0].compile_reason})",
           "peak_mib_before_amplitudes": _peak_mib()}
    if refine_amplitudes:
        rows.append(_refine_amplitudes(ds, _simulators(ds, best if reference else None, compile), geo.shared, refined,
                                       anomalous, "file" if reference else "estimate", amplitude_steps))
    doc["rows"] = _on_common_reflections(rows, ds)
    doc["wall_s"] = time.monotonic() - t0
    return doc


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stills", type=int, required=True, help="number of stills")
    ap.add_argument("--out", required=True, help="the JSON of the comparison (its folder must exist)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--size", type=int, default=96, help="detector side (pixels; default 96)")
    ap.add_argument("--max-steps", type=int, default=100, help="the geometry refinement's step limit")
    ap.add_argument("--amplitude-steps", type=int, default=100, help="the amplitude refinement's step limit")
    ap.add_argument("--no-amplitudes", action="store_true", help="skip the joint amplitude refinement")
    ap.add_argument("--anomalous", action="store_true", help="refine F(+) and F(-) apart")
    ap.add_argument("--no-reference", action="store_true", help="refine the geometry with one F for every reflection "
                                                                "(default: the partiality-corrected merge at the start)")
    ap.add_argument("--no-compile", action="store_true", help="eager kernels (default: compiled when a refinement of "
                                                              "all the stills would compile)")
    ap.add_argument("--log", action="store_true", help="the refinements' log lines on stderr, with times")
    ap.add_argument("--truth-domains", type=int, default=40, help="mosaic domains of the truth images (default 40)")
    return ap


def _run(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    for name, value, low in (("--stills", a.stills, 1), ("--size", a.size, 16), ("--max-steps", a.max_steps, 1),
                             ("--amplitude-steps", a.amplitude_steps, 1), ("--truth-domains", a.truth_domains, 1)):
        if value < low:
            raise InputError(f"{name}: expected an integer >= {low}, got {value}")
    out = Path(a.out)
    if not out.parent.is_dir():
        raise InputError(f"--out: the folder {str(out.parent)!r} does not exist")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if a.log:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    doc = measure(a.stills, a.seed, size=a.size, refine_amplitudes=not a.no_amplitudes, anomalous=a.anomalous,
                  reference=not a.no_reference,
                  max_steps=a.max_steps, amplitude_steps=a.amplitude_steps, truth_domains=a.truth_domains,
                  compile=False if a.no_compile else None)
    out.write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    for r in doc["rows"]:
        print(f"{r['method']:>22} ({r['geometry']:>7} geometry): n {r['n']:5d}  R {r['R']:.4f}  CC {r['CC']:.4f}  "
              f"(on the {r['n_common']} common: R {r['R_common']:.4f}  CC {r['CC_common']:.4f})  "
              f"anomalous CC {r.get('anomalous_CC', math.nan):.3f} (pairs with signal {r.get('anomalous_CC_signal', math.nan):.3f})")
    print(f"{a.stills} stills: {doc['wall_s']:.1f} s (generate {doc['generate_s']:.1f}, geometry {doc['geometry_s']:.1f}); "
          f"wrote {out}")
    return 0


def main(argv=None) -> int:
    """The command: bad input is one line and exit status 2 (:func:`nbtorch.cli.support.run_main`)."""
    return run_main("merge_compare", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
