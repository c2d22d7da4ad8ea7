"""Refinement benchmark harness: ``python -m refine.tools.bench``.

::

    python -m refine.tools.bench [--repeats 10] [--esd-repeats 3] [--main-job] [--profile N] \\
        [--fractions 1/8,1/4,1/2,1] [--json out.json] [-- <nbtorch-refine arguments>]

Times what a user of the refinement waits for, on the objective a ``nbtorch-refine`` run fits: the
arguments after ``--`` (default: the real-data tutorial, ``--config examples/thaumatin_still.toml``) are
parsed and prepared by the command's own steps (:func:`refine.modes.single.prepare`, :func:`refine.solver.plan.make_plan`,
:func:`refine.solver.runner.stage_objective` of the last stage and :func:`refine.solver.runner.whole_image_objective`), so
the pixels, the simulator (tiles, compile mode, sensor layers, dtype) and the loss are the run's.  Measured,
each the median and minimum of ``--repeats`` warm repeats after one untimed warm-up (whose time, compiles or
cache loading included, is reported as ``first_s``):

* ``loss_grad``: one loss-and-gradient evaluation of the last stage's objective with respect to the raw
  parameters of its free names (what the loop calls: on a GPU replayed from the stage's CUDA graph,
  :mod:`refine.solver.graphed`; a run with ``--refine`` has no preconditioner); ``cuda_graph`` says whether the
  graph was captured, and on a GPU ``loss_grad_plain`` is the same evaluation launched kernel by kernel;
* ``forward``: the simulator alone on the fitted pixels (:meth:`nbtorch.Simulator.render_pixels`, no gradient);
* ``loss``: the objective's loss without gradient;
* ``esds``: :func:`refine.quality.uncertainty.estimate_uncertainties` on the whole fitted image as
  :func:`refine.solver.finalise.finalise` calls it (the simulator switched to the esds' compile policy first, as the
  command does), ``--esd-repeats`` times;
* with ``--main-job``: the README's main job (``scripts/main.sh``'s command) in a subprocess on the same
  device (``--device``), its own "in all" time and the subprocess's wall time;
* ``operators_per_call`` of ``loss_grad``, ``loss`` and ``forward``: one warm call under the torch profiler
  (:func:`nbtorch.tools.costs.operator_counts`: aten operators that no other operator called, on a GPU each at least
  one kernel launch; ``compiled_graphs_per_call``; ``device_kernels_per_call``, the kernels that ran on a GPU);
* with ``--fractions``: ``loss_grad`` and ``forward`` again on evenly spread fractions of the fitted pixels
  (:func:`refine.tools.costs.subset`: the simulator computes only those), and ``fixed_cost``: the least-squares
  line time = ``fixed_s`` + ``ns_per_sample`` x pixel-evaluations through their medians
  (:func:`nbtorch.tools.costs.fit_fixed_cost`): what a call costs whatever its size, and each pixel-evaluation.

On a GPU (``-- --device cuda ...``) every timed call ends with ``torch.cuda.synchronize()``.  Each
evaluation's time is also given per lattice-factor evaluation: time / (pixels x evaluations per pixel).
``--profile N`` prints the torch profiler's table of N loss-and-gradient evaluations.  The first JSON record
describes the machine (processor, cores, torch, threads, load average before and after, date).  Nothing
here is a unit-test assertion; ratios are only meaningful within one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from nbtorch.runtime import policy as runtime
from nbtorch.cli.support import run_main
from nbtorch.errors import InputError
from refine.solver.precondition import LinearPreconditioner
from refine.solver.graphed import loss_and_gradient
from refine.solver.runner import stage_function
from nbtorch.tools.costs import fit_fixed_cost, operator_counts
from refine.tools.costs import parse_fractions, subset

__all__ = ["main", "build_objective", "measure", "machine_record", "main_job_seconds", "TUTORIAL_ARGS",
           "MAIN_JOB_ARGS"]

log = logging.getLogger(__name__)

TUTORIAL_ARGS = ("--config", "examples/thaumatin_still.toml")
#: scripts/main.sh's refinement (the README's main job)
MAIN_JOB_ARGS = ("--problem", "tetragonal_mosflm", "--size", "64", "--refine",
                 "scale,background,orientation,beam_centre,cell,mosaic", "--coarse", "--max-steps", "100")


class Bench:
    """The objects measured: the simulator, the last stage's objective and parameter map, the whole image's
    objective (the esds') and the final parameter map of the esds."""

    def __init__(self, argv: Sequence[str]) -> None:
        from refine.cli.parser import parse_args
        from refine.modes.single import plan_arguments, prepare
        from refine.fitting.parameters import ParameterMap
        from refine.solver.plan import make_plan
        from refine.solver.runner import stage_objective, whole_image_objective

        args = parse_args(list(argv))
        prepared = prepare(args, lambda text: log.info("%s", text))
        self.sim = prepared.sim
        self.plan = make_plan(prepared.sim, prepared.inputs.observed, **plan_arguments(prepared.args or args, prepared))
        stage, names = self.plan.stages[-1]
        self.objective = stage_objective(self.plan, stage, names, self.plan.start)
        self.pmap = ParameterMap(self.plan.space, self.plan.start, names)
        self.raw = self.pmap.raw0(self.sim.dtype)
        # the loop's own function (on a GPU: its loss and gradient replayed from a CUDA graph), at raw = raw0 + z
        self.pre = LinearPreconditioner.identity(self.raw)
        self.fn = self.stage_function()
        _, self.whole = whole_image_objective(self.plan)
        self.esd_map = ParameterMap(self.plan.space, self.plan.start, self.plan.names)
        self.pixels = int(self.objective.view.mask.sum())
        self.evaluations_per_pixel = self.sim.evaluations_per_pixel()
        self.dtype = str(self.sim.dtype).replace("torch.", "")

    def stage_function(self):
        """The loop's function of this objective (:func:`refine.solver.runner.stage_function`)."""
        return stage_function(self.objective, self.pmap, self.pre, "last")

    def loss_grad(self) -> tuple[Tensor, Tensor]:
        """One loss and its gradient with respect to the raw parameters, as :mod:`refine.solver.loop` evaluates it
        (on a GPU through the stage's CUDA graph, :mod:`refine.solver.graphed`)."""
        z = (self.raw - self.pre.raw0).detach()
        value_and_grad = getattr(self.fn, "value_and_grad", None)
        if value_and_grad is not None:
            loss, grad, _ = value_and_grad(z)
            return loss, grad
        return self.loss_grad_plain()

    def loss_grad_plain(self) -> tuple[Tensor, Tensor]:
        """:meth:`loss_grad` without a CUDA graph: the stage's function, each kernel launched by itself."""
        plain = getattr(self.fn, "fn", self.fn)  # a GraphedObjective's own function takes a device vector
        both, _ = loss_and_gradient(plain, (self.raw - self.pre.raw0).to(self.sim.device))
        return both[0], both[1:]

    def graph_status(self) -> str:
        """The CUDA graph of the loss and gradient: ``captured``, ``not captured: <why>``, or ``not used`` (a CPU,
        or graphs turned off)."""
        graphed = getattr(self.fn, "graphed", None)
        if graphed is None:
            return "not used"
        return "captured" if graphed.captured else f"not captured: {graphed.failure or 'not called'}"

    def loss(self) -> Tensor:
        with torch.no_grad():
            return self.objective.evaluate(self.pmap.expand(self.pmap.physical(self.raw)))[0]

    def forward(self) -> Tensor:
        with torch.no_grad():
            values = self.pmap.expand(self.pmap.physical(self.raw))
            return self.sim.render_pixels(roi=self.objective.view.roi, **self.objective.render_overrides(values))[0]

    def esds(self):
        from refine.quality.uncertainty import estimate_uncertainties

        return estimate_uncertainties(self.whole, self.esd_map, self.esd_map.raw0(self.sim.dtype))



def build_objective(argv: Sequence[str]) -> Bench:
    """The :class:`Bench` of the ``nbtorch-refine`` arguments ``argv``."""
    return Bench(argv)


def measure(fn: Callable[[], object], repeats: int, device: torch.device | str = "cpu") -> dict:
    """``first_s`` (the warm-up call, not in the statistics) and the median/min/max wall time of ``repeats``
    calls, and their median process CPU time (all threads; less sensitive than wall time to other jobs on a
    shared machine), in seconds.  On a CUDA ``device`` each call ends with a synchronisation, so a time is
    the GPU's work and not only its launch."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"first_s": first, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "cpu_median_s": statistics.median(cpu), "repeats": repeats}


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_record() -> dict:
    """Processor, cores, torch, threads, load average (1, 5, 15 min) and date of this run."""
    return {"machine": platform.machine(), "processor": _processor(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg()), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


_IN_ALL = re.compile(r"\(([0-9.]+) s in all\)")


def main_job_seconds(extra: Sequence[str] = (), timeout_s: float = 1800.0, threads: int | None = None) -> dict:
    """Run the README's main job (:data:`MAIN_JOB_ARGS`) in a subprocess (with ``threads``: that many torch/OpenMP
    threads, ``OMP_NUM_THREADS``); its "in all" time and wall time."""
    env = dict(os.environ) if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        # not --quiet: the "(... s in all)" line is printed output
        cmd = [sys.executable, "-m", "refine.cli", *MAIN_JOB_ARGS, *extra, "--out", str(Path(tmp) / "result.h5")]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"main job exited with status {done.returncode}: {done.stderr.strip()[-500:]}")
    found = _IN_ALL.findall(done.stdout + done.stderr)
    return {"in_all_s": float(found[-1]) if found else None, "wall_s": wall, "command": " ".join(cmd[1:])}


def _row(name: str, rec: dict, evaluations: int) -> str:
    ns = rec["median_s"] / evaluations * 1e9
    return (f"| {name} | {rec['median_s'] * 1e3:.1f} | {rec['min_s'] * 1e3:.1f} | {rec['first_s'] * 1e3:.0f} | "
            f"{ns:.1f} | {rec['min_s'] / evaluations * 1e9:.1f} | {rec['cpu_median_s'] * 1e3:.1f} |")


def table(records: dict) -> str:
    """The Markdown table of a run's records."""
    evaluations = records["pixels"] * records["evaluations_per_pixel"]
    lines = ["| measured | median ms | min ms | first ms | ns/evaluation (median) | ns/evaluation (min) | CPU ms "
             "(median, all threads) |", "|---|---|---|---|---|---|---|"]
    for name in ("loss_grad", "loss_grad_plain", "loss", "forward", "esds"):
        if name in records:
            lines.append(_row(name, records[name], evaluations))
    if "main_job" in records:
        m = records["main_job"]
        lines.append(f"| main job (subprocess) | in all {m['in_all_s']} s | wall {m['wall_s']:.1f} s | | | | |")
    return "\n".join(lines)


def operators_line(records: dict) -> str:
    """The operators per call of each evaluation measured (torch profiler)."""
    parts = []
    for name in ("loss_grad", "loss", "forward"):
        r = records.get(name, {})
        if "operators_per_call" in r:
            device = f", {r['device_kernels_per_call']} device kernels" if r["device_kernels_per_call"] else ""
            parts.append(f"{name} {r['operators_per_call']} ({r['compiled_graphs_per_call']} compiled graphs{device})")
    return "operators per call (torch profiler, aten operators not called by another): " + ", ".join(parts)


def fractions_table(records: dict) -> str:
    """The times at each size of ``--fractions`` and the fixed cost and cost per pixel-evaluation fitted to them."""
    lines = ["| fraction | pixels | pixel-evaluations | loss_grad median ms | forward median ms |",
             "|---|---|---|---|---|"]
    for r in records["fractions"]:
        lines.append(f"| {r['fraction']:.4g} | {r['pixels']} | {r['samples']} | "
                     f"{r['loss_grad']['median_s'] * 1e3:.2f} | {r['forward']['median_s'] * 1e3:.2f} |")
    fits = records["fixed_cost"]
    lines.append("fixed cost per call + cost per pixel-evaluation (least squares through the medians): " + ", ".join(
        f"{name} {f['fixed_s'] * 1e3:.2f} ms + {f['ns_per_sample']:.2f} ns" for name, f in fits.items()))
    return "\n".join(lines)


def fraction_records(bench: Bench, fractions, repeats: int, device) -> tuple[list[dict], dict]:
    """``loss_grad`` and ``forward`` of ``bench`` cut to each of ``fractions`` of its fitted pixels, and the fixed
    cost and cost per pixel-evaluation fitted to their medians (the module docstring)."""
    out = []
    for fraction in fractions:
        part = subset(bench, fraction)
        samples = part.pixels * part.evaluations_per_pixel
        out.append({"fraction": fraction, "pixels": part.pixels, "samples": samples,
                    "loss_grad": measure(part.loss_grad, repeats, device),
                    "forward": measure(part.forward, repeats, device)})
        log.info("--fractions %.4g: %d pixels", fraction, part.pixels)
    fits = {name: fit_fixed_cost([r["samples"] for r in out], [r[name]["median_s"] for r in out])
            for name in ("loss_grad", "forward")}
    return out, fits


def run(ns: argparse.Namespace, refine_args: Sequence[str]) -> dict:
    """Every measurement of one harness run, as one dict (see the module docstring)."""
    before = machine_record()
    t0 = time.perf_counter()
    bench = build_objective(refine_args)
    rec: dict = {"refine_args": list(refine_args), "setup_s": time.perf_counter() - t0,
                 "pixels": bench.pixels, "evaluations_per_pixel": bench.evaluations_per_pixel, "dtype": bench.dtype,
                 "thicksteps": bench.sim.setup.thicksteps, "compile_mode": bench.sim.compile_mode,
                 "free": list(bench.pmap.names)}
    device = bench.sim.device
    rec["device"] = str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})"
    rec["loss_grad"] = measure(bench.loss_grad, ns.repeats, device)
    rec["cuda_graph"] = bench.graph_status()
    if rec["cuda_graph"] != "not used":  # the same evaluation launched kernel by kernel
        rec["loss_grad_plain"] = measure(bench.loss_grad_plain, ns.repeats, device)
    rec["loss"] = measure(bench.loss, ns.repeats, device)
    rec["forward"] = measure(bench.forward, ns.repeats, device)
    for name, fn in (("loss_grad", bench.loss_grad), ("loss", bench.loss), ("forward", bench.forward)):
        counts = operator_counts(fn, device)  # warm: measured above
        rec[name].update({f"{key}_per_call": value for key, value in counts.items()})
    if ns.fractions:
        rec["fractions"], rec["fixed_cost"] = fraction_records(bench, ns.fractions, ns.repeats, device)
    if ns.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(ns.profile):
                bench.loss_grad()
        rec["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    if ns.esd_repeats:
        bench.sim.set_compile(*runtime.compile_policy("esds"))  # as the command's last stage does
        rec["esds"] = measure(bench.esds, ns.esd_repeats, device)
    if ns.main_job:  # on the bench's device
        rec["main_job"] = main_job_seconds(("--device", str(device)), threads=ns.threads)
    evaluations = bench.pixels * bench.evaluations_per_pixel
    for name in ("loss_grad", "loss_grad_plain", "loss", "forward", "esds"):
        if name in rec:
            rec[name]["ns_per_evaluation"] = rec[name]["median_s"] / evaluations * 1e9
            rec[name]["ns_per_evaluation_min"] = rec[name]["min_s"] / evaluations * 1e9
    after = machine_record()
    return {**before, "load_average_after": after["load_average"], **rec}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m refine.tools.bench", description="refinement benchmark harness "
                                 "(arguments after -- are nbtorch-refine's; default: the thaumatin tutorial)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats of each evaluation (default %(default)s)")
    ap.add_argument("--esd-repeats", type=int, default=3, help="timed esd estimates (0: none; default %(default)s)")
    ap.add_argument("--main-job", action="store_true", help="also time the README's main job in a subprocess")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the torch profiler's table of N loss-and-gradient evaluations")
    ap.add_argument("--threads", type=int, help="torch threads, also the main job's (default: torch's)")
    ap.add_argument("--fractions", metavar="FRACTIONS",
                    help="also time loss_grad and forward on these fractions of the fitted pixels (e.g. 1/8,1/4,1/2,1) "
                         "and fit the fixed cost per call and the cost per pixel-evaluation")
    ap.add_argument("--json", help="write the records to this file")
    return ap


def _run(argv: list[str]) -> int:
    own, refine_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ns = build_parser().parse_args(own)
    if ns.repeats < 1 or ns.esd_repeats < 0 or ns.profile < 0 or (ns.threads is not None and ns.threads < 1):
        raise InputError("--repeats and --threads must be >= 1, --esd-repeats and --profile >= 0")
    ns.fractions = parse_fractions(ns.fractions) if ns.fractions is not None else None
    if ns.threads:
        torch.set_num_threads(ns.threads)
    runtime.tune_allocator()  # as the commands do
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rec = run(ns, refine_args or list(TUTORIAL_ARGS))
    profile = rec.pop("profile", None)
    if profile:
        print(profile)
    print(f"{rec['date']}, {rec['processor']} ({rec['cpu_count']} cores), torch {rec['torch']}, {rec['threads']} "
          f"threads, load average {rec['load_average'][0]:.2f} -> {rec['load_average_after'][0]:.2f}")
    print(f"{' '.join(rec['refine_args'])}: {rec['pixels']} pixels x {rec['evaluations_per_pixel']} evaluations, "
          f"{rec['dtype']}, {rec['compile_mode']}, {rec['device']}, {len(rec['free'])} free, set-up "
          f"{rec['setup_s']:.1f} s")
    print(table(rec))
    print(f"CUDA graph of the loss and gradient: {rec['cuda_graph']}")
    print(operators_line(rec))
    if "fractions" in rec:
        print(fractions_table(rec))
    if ns.json:
        from nbtorch.io.atomic import atomic_write

        with atomic_write(ns.json, "w") as fh:
            json.dump(rec, fh, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m refine.tools.bench``; bad input: one line, status 2."""
    return run_main("python -m refine.tools.bench", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
