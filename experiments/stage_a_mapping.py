"""Stage-A mapping debug script: five phases from forward sanity to compiled-vs-eager trajectories.

Usage::

    python -m experiments.stage_a_mapping --phases 1,2,3,4,5 [--problem NAME --size N]
        [--image OBS --model "<nanoBragg flags>"] [--outdir DIR] [--device cpu] [--dtype float64]
        [--steps 2] [--lr 0.05] [--coarse] [--rtol 1e-6]

Without ``--image`` a problem of the bank (known truth) is refined.  Phases:

1. setup and forward sanity: resolved geometry, image statistics, HKL lookup diagnostics,
   ``phase1_observed_model.png`` (observed | model at the start, log scale);
2. mapping and gradients: raw <-> physical round trip of every Stage-A parameter and
   d loss / d raw by autograd against central finite differences (``phase2_gradients.tsv``);
3. a short eager Adam Stage-A run with TensorBoard logging (``tb/phase3``, ``phase3_history.json``);
4. the same run with the kernel compiled and the diagnostics and TensorBoard hooks active: no
   Dynamo error, no graph break (``NANOBRAGG_DISABLE_COMPILE=1`` / ``NANOBRAG_DISABLE_COMPILE=1``:
   it runs eager and says so);
5. phases 3 and 4 compared step by step (loss and every parameter, ``--rtol``), rerunning either
   when it was not requested; every verdict goes to ``summary.json``.

Exit status 0 only when every requested phase passed; bad input (a flag, a value, a file) is one
line ``... error: ...`` on stderr and exit status 2, before anything is simulated or written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

import nbtorch
from experiments.png import write_png_pair
from experiments.workload import Workload, load_workload
from nbtorch import runtime
from nbtorch.cli_support import Parser, check_output_dir, int_at_least, make_output_dir, positive_float, run_main
from nbtorch.parameters import PARAMETER_NAMES
from nbtorch.simulator import ORIENTATION_DELTAS
from refine import Adam, TensorBoardCallback, refine, stage_a
from refine.fitting.objective import ImageObjective, make_view, poisson_deviance
from refine.fitting.parameters import SYMMETRIES, ParameterMap, ParameterSpace

__all__ = ["main", "run_phases"]

STAGE_A_GROUPS = ("scale", "background", "orientation", "beam_x", "beam_y", "cell", "distance", "mosaic")


def _verdict(ok: bool, text: str, **extra) -> dict:
    return {"passed": bool(ok), "verdict": ("PASS: " if ok else "FAIL: ") + text, **extra}


# ---------------------------------------------------------------------------------- phase 1
def phase1(w: Workload, outdir: Path) -> dict:
    sim = w.simulator(compile=False)
    s = sim.setup
    p = {k: float(v) for k, v in s.params.items()}
    values = {**p, **w.start}
    geometry = {
        "convention": s.convention, "pivot": s.pivot, "shape_slow_fast": list(sim.shape),
        "pixel_mm": s.pixel_m * 1e3, "distance_mm": p.get("distance"), "beam_x_mm": p.get("beam_x"),
        "beam_y_mm": p.get("beam_y"), "wavelength_A": p.get("wavelength"), "twotheta_deg": p.get("twotheta"),
        "beam": s.beam.tolist(), "fdet": s.fdet.tolist(), "sdet": s.sdet.tolist(), "odet": s.odet.tolist(),
        "roi": list(s.roi), "oversample": s.oversample, "mosaic_domains": len(s.mosaic_fractions),
    }
    with torch.no_grad(), nbtorch.eager():
        image, diag = sim.render(diagnostics=True, **{k: torch.tensor(values[k], dtype=sim.dtype) for k in p})
    model = image.double().cpu().numpy() * float(values.get("scale", 1.0)) + float(
        values.get("background", np.median(w.observed)))
    obs = w.observed

    def stats(a):
        a = np.asarray(a, dtype=np.float64)
        f = a[np.isfinite(a)]
        return {"min": float(f.min()), "max": float(f.max()), "mean": float(f.mean()), "median": float(np.median(f)),
                "finite_fraction": float(f.size / a.size)}

    hkl = {"fraction_default_F": float(diag["fraction_default_F"]),
           "hkl0_min": diag["hkl0_min"].tolist(), "hkl0_max": diag["hkl0_max"].tolist()}
    if s.hkl_min is not None:
        lo, hi = np.asarray(s.hkl_min), np.asarray(s.hkl_max)
        hkl.update(table_min=lo.tolist(), table_max=hi.tolist(),
                   out_of_range=bool((np.asarray(hkl["hkl0_min"]) < lo).any() or (np.asarray(hkl["hkl0_max"]) > hi).any()))
    png = write_png_pair(outdir / "phase1_observed_model.png", obs, model)
    ok = (np.isfinite(model).all() and stats(obs)["finite_fraction"] > 0 and model.max() > model.min()
          and hkl["fraction_default_F"] < 1.0 and not hkl.get("out_of_range", False))
    out = _verdict(ok, f"forward finite, model range {model.min():.4g}..{model.max():.4g}, "
                       f"{100 * hkl['fraction_default_F']:.2f}% of lookups defaulted"
                       + (", Miller indices beyond the table" if hkl.get("out_of_range") else ""),
                   geometry=geometry, observed=stats(obs), model=stats(model), hkl=hkl, png=str(png))
    (outdir / "phase1.json").write_text(json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------------- phase 2
def _objective(w: Workload, sim):
    """(ParameterMap over the Stage-A names, raw -> loss) at the start, full image, Poisson loss."""
    obs = torch.as_tensor(w.observed, dtype=sim.dtype, device=sim.device)
    valid = torch.isfinite(obs) & (obs >= 0)
    obs = torch.where(valid, obs, torch.zeros((), dtype=obs.dtype))
    values = {n: float(sim.setup.params[n]) for n in PARAMETER_NAMES}
    values.update({n: 0.0 for n in ORIENTATION_DELTAS})
    values.update({"scale": 1.0, "background": float(obs[valid].median()), "background_x": 0.0, "background_y": 0.0})
    values.update({k: float(v) for k, v in w.start.items()})
    space = ParameterSpace(symmetry=w.symmetry, fixed=w.fixed, pixel_mm=sim.setup.pixel_m * 1e3)
    names = space.expand(g for g in STAGE_A_GROUPS if g not in w.fixed)
    pm = ParameterMap(space, values, names)
    objective = ImageObjective(sim, obs, make_view(sim, values, valid), poisson_deviance)
    return pm, (lambda raw: objective(pm.expand(pm.physical(raw)))[0])


def phase2(w: Workload, outdir: Path, h: float = 1e-4, tol: float = 2e-3) -> dict:
    with nbtorch.eager():
        sim = w.simulator(compile=False)
        pm, f = _objective(w, sim)
        raw0 = pm.raw0(sim.dtype)
        # round trip: raw -> physical -> raw at the start and at a random nearby point
        gen = torch.Generator().manual_seed(0)
        trip = 0.0
        for raw in (raw0, raw0 + 0.3 * torch.randn(raw0.shape, generator=gen, dtype=raw0.dtype)):
            back = pm.raw_from(pm.physical_floats(raw), sim.dtype)
            trip = max(trip, float((back - raw).abs().max()))
        start_phys = pm.physical_floats(raw0)
        start_ok = all(abs(start_phys[n] - pm.start_value(n)) <= 1e-9 * max(1.0, abs(pm.start_value(n)))
                       for n in pm.names)
        x = raw0.clone().requires_grad_(True)
        loss = f(x)
        (grad,) = torch.autograd.grad(loss, x)
        rows, worst = [], 0.0
        gscale = float(grad.abs().max()) or 1.0
        with torch.no_grad():
            for i, n in enumerate(pm.names):
                e = torch.zeros_like(raw0)
                e[i] = h
                fd = (float(f(raw0 + e)) - float(f(raw0 - e))) / (2 * h)
                g = float(grad[i])
                err = abs(g - fd) / max(abs(fd), abs(g), 1e-3 * gscale)
                worst = max(worst, err)
                rows.append({"name": n, "physical": start_phys[n], "raw": float(raw0[i]),
                             "transform": type(pm.transforms[i]).__name__, "autograd": g, "finite_diff": fd,
                             "rel_error": err})
    eps = 1e-12 if sim.dtype == torch.float64 else 1e-5
    tol = tol if sim.dtype == torch.float64 else max(tol, 5e-2)
    lines = ["name\ttransform\tphysical\traw\tautograd\tfinite_diff\trel_error"]
    lines += [f"{r['name']}\t{r['transform']}\t{r['physical']:.10g}\t{r['raw']:.6g}\t{r['autograd']:.8g}\t"
              f"{r['finite_diff']:.8g}\t{r['rel_error']:.2e}" for r in rows]
    (outdir / "phase2_gradients.tsv").write_text("\n".join(lines) + "\n")
    print("  " + "\n  ".join(lines))
    ok = trip <= eps and start_ok and worst <= tol and math.isfinite(float(loss.detach()))
    out = _verdict(ok, f"{len(rows)} parameters, round trip max |raw error| {trip:.1e}, "
                       f"worst gradient relative error {worst:.1e} (tolerance {tol:.0e})",
                   round_trip_max_error=trip, start_maps_to_start=start_ok, worst_rel_error=worst, table=rows)
    (outdir / "phase2.json").write_text(json.dumps(out, indent=1))
    return out


# ------------------------------------------------------------------------------ phases 3, 4
def _run(w: Workload, outdir: Path, label: str, compile: bool | None, steps: int, lr: float, coarse: bool) -> dict:
    from torch._dynamo.utils import counters  # lazy: torch._dynamo costs seconds of startup, phases 3-4 only

    stages = stage_a(Adam(lr=lr, schedule="constant"), max_steps=steps, final_steps=steps, coarse=coarse)
    sim = w.simulator(compile=compile)
    seen: list[float] = []
    sim.diagnostics.subscribe(lambda d: seen.append(float(d["fraction_default_F"])))
    warnings: list[str] = []

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    grab = _Grab(logging.WARNING)
    logging.getLogger("nbtorch").addHandler(grab)
    counters.clear()
    t0 = time.perf_counter()
    try:
        result = refine(sim, w.observed, **w.refine_kwargs(), stages=stages, progress=False, esds=False,
                        callbacks=[TensorBoardCallback(logdir=str(outdir / "tb" / label), every=max(1, steps))])
    finally:
        logging.getLogger("nbtorch").removeHandler(grab)
    wall = time.perf_counter() - t0
    breaks = {str(k): int(v) for k, v in counters.get("graph_break", {}).items()}
    hist = {"loss": [float(v) for v in result.history["loss"]], "step": list(result.history["step"]),
            "stage": list(result.history["stage"]),
            "params": {k: [float(x) for x in v] for k, v in result.history["params"].items()}}
    run = {"compile_mode": sim.compile_mode, "compile_reason": getattr(sim, "compile_reason", ""),
           "graph_breaks": breaks, "warnings": warnings, "status": result.status.value, "message": result.message,
           "steps": result.steps, "loss_initial": result.loss_initial, "loss_final": result.loss_final,
           "wall_s": wall, "diagnostics_calls": len(seen), "history": hist}
    (outdir / f"{label}_history.json").write_text(json.dumps(run, indent=1))
    return run


def phase3(w: Workload, outdir: Path, steps: int, lr: float, coarse: bool) -> dict:
    with nbtorch.eager():
        run = _run(w, outdir, "phase3", False, steps, lr, coarse)
    ok = run["status"] != "failed" and all(math.isfinite(v) for v in run["history"]["loss"]) and run["steps"] > 0
    return _verdict(ok, f"eager Adam: {run['steps']} steps, loss {run['loss_initial']:.6g} -> {run['loss_final']:.6g} "
                        f"({run['status']}), {run['wall_s']:.1f} s, TensorBoard in {outdir / 'tb' / 'phase3'}", run=run)


def phase4(w: Workload, outdir: Path, steps: int, lr: float, coarse: bool) -> dict:
    disabled = runtime.env_disables_compile()
    run = _run(w, outdir, "phase4", None, steps, lr, coarse)
    finite = run["status"] != "failed" and all(math.isfinite(v) for v in run["history"]["loss"])
    hooks = run["diagnostics_calls"] > 0
    if disabled:
        ok = finite and hooks and run["compile_mode"] == "eager"
        text = (f"ran eager: compile disabled by the environment ({'/'.join(runtime.ENV_VARS)}=1); "
                f"{run['steps']} steps, loss {run['loss_final']:.6g}")
    else:
        ok = finite and hooks and run["compile_mode"] == "compiled" and not run["graph_breaks"] and not any(
            "compile" in m for m in run["warnings"])
        text = (f"kernel {run['compile_mode']}, {sum(run['graph_breaks'].values())} graph breaks, "
                f"{run['diagnostics_calls']} diagnostics calls, {run['steps']} steps, loss {run['loss_final']:.6g}, "
                f"{run['wall_s']:.1f} s" + (f" ({run['compile_reason']})" if run["compile_mode"] != "compiled" else ""))
    return _verdict(ok, text, ran_eager=run["compile_mode"] == "eager", compile_disabled_by_env=disabled, run=run)


# ---------------------------------------------------------------------------------- phase 5
def phase5(r3: dict, r4: dict, outdir: Path, rtol: float, atol: float = 1e-9) -> dict:
    h3, h4 = r3["run"]["history"], r4["run"]["history"]
    worst_name, worst = "", 0.0
    n = min(len(h3["loss"]), len(h4["loss"]))
    same_len = len(h3["loss"]) == len(h4["loss"]) and set(h3["params"]) == set(h4["params"])
    series = [("loss", h3["loss"], h4["loss"])] + [(k, h3["params"][k], h4["params"].get(k, [])) for k in h3["params"]]
    for name, a, b in series:
        for i in range(min(len(a), len(b), n)):
            err = abs(a[i] - b[i]) / max(abs(a[i]), abs(b[i]), atol / rtol)
            if err > worst:
                worst_name, worst = f"{name} at step {i}", err
    ok = same_len and worst <= rtol and r3["passed"] and r4["passed"]
    mode = "eager" if r4.get("ran_eager") else "compiled"
    return _verdict(ok, f"{n} steps compared (eager vs {mode}): worst relative difference {worst:.1e}"
                        + (f" ({worst_name})" if worst_name else "") + f", tolerance {rtol:.0e}"
                        + ("" if same_len else "; the trajectories differ in length or parameters"),
                    worst_rel_diff=worst, worst_at=worst_name, steps_compared=n)


# ---------------------------------------------------------------------------------- driver
def run_phases(w: Workload, phases: list[int], outdir: Path, steps: int = 2, lr: float = 0.05, coarse: bool = False,
               rtol: float = 1e-6) -> dict:
    """Run ``phases`` (1-5) and return ``{phase: verdict dict}`` plus ``passed``; writes ``summary.json``."""
    outdir.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict] = {}
    extra: dict[str, dict] = {}
    for ph in phases:
        t0 = time.perf_counter()
        print(f"phase {ph}:", flush=True)
        if ph == 1:
            r = phase1(w, outdir)
        elif ph == 2:
            r = phase2(w, outdir)
        elif ph == 3:
            r = phase3(w, outdir, steps, lr, coarse)
        elif ph == 4:
            r = phase4(w, outdir, steps, lr, coarse)
        else:
            for need, fn in ((3, phase3), (4, phase4)):
                if need not in results and str(need) not in extra:
                    print(f"  (rerunning phase {need} for the comparison)", flush=True)
                    extra[str(need)] = fn(w, outdir, steps, lr, coarse)
            r = phase5(results.get(3) or extra["3"], results.get(4) or extra["4"], outdir, rtol)
        r["seconds"] = time.perf_counter() - t0
        results[ph] = r
        print(f"  {r['verdict']}", flush=True)
    passed = all(r["passed"] for r in results.values())
    summary = {"workload": w.label, "phases": phases, "passed": passed,
               "verdicts": {str(k): {"passed": v["passed"], "verdict": v["verdict"], "seconds": v["seconds"]}
                            for k, v in results.items()},
               "reruns_for_phase5": {k: {"passed": v["passed"], "verdict": v["verdict"]} for k, v in extra.items()}}
    (outdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return {"passed": passed, "results": results, "summary": summary}


def _phases(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated phase numbers 1-5, got {text!r}") from None
    if not out or any(p not in (1, 2, 3, 4, 5) for p in out):
        raise argparse.ArgumentTypeError(f"phases must be among 1,2,3,4,5, got {text!r}")
    return sorted(set(out))


PROG = "python -m experiments.stage_a_mapping"


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--phases", type=_phases, default=[1, 2, 3, 4, 5], help="comma-separated, default 1,2,3,4,5")
    ap.add_argument("--problem", default="cubic_mosflm", help="bank problem (without --image)")
    ap.add_argument("--size", type=int, default=32, help="detector pixels per side of --problem (default 32)")
    ap.add_argument("--image", help="observed image (any format nbtorch-refine reads)")
    ap.add_argument("--model", help="nanoBragg flags of the starting model (with --image)")
    ap.add_argument("--symmetry", choices=tuple(SYMMETRIES),
                    help="crystal system (default: the problem's, or triclinic)")
    ap.add_argument("--outdir", default="out/stage_a_mapping", help="artefacts folder (default %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    ap.add_argument("--steps", type=int_at_least(1), default=2, help="Adam steps per stage in phases 3-4 (default 2)")
    ap.add_argument("--lr", type=positive_float, default=0.05, help="Adam learning rate (default 0.05)")
    ap.add_argument("--coarse", action="store_true", help="use Stage-A's binned low-resolution views (more compiles)")
    ap.add_argument("--rtol", type=positive_float, help="phase 5 tolerance (default 1e-6 in float64, 1e-3 in float32)")
    return ap


def _main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    nbtorch.runtime.check_device(a.device, "--device")
    check_output_dir(a.outdir)
    w = load_workload(a.problem, a.size, a.image, a.model, a.symmetry, a.dtype, a.device)
    outdir = make_output_dir(a.outdir)
    rtol = a.rtol if a.rtol is not None else (1e-6 if a.dtype == "float64" else 1e-3)
    print(f"stage_a_mapping: {w.label}, phases {','.join(map(str, a.phases))}, {a.dtype} on {a.device}", flush=True)
    out = run_phases(w, a.phases, outdir, a.steps, a.lr, a.coarse, rtol)
    print(f"{'ALL PASSED' if out['passed'] else 'FAILED'}; summary: {outdir / 'summary.json'}")
    return 0 if out["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 all passed, 1 a phase failed, 2 bad input: one line on stderr)."""
    return run_main(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
