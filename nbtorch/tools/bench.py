"""Benchmark harness: ``python -m nbtorch.tools.bench``.

::

    python -m nbtorch.tools.bench --sizes 256,512,1024 --case cubic|heavy --device cpu --dtype float32 \\
        --iterations 5 [--disable-compile] [--c-bin PATH] [--grad] [--threads N] --json out.json

Cases: ``cubic`` is the 100 A cubic cell, N 5, lambda 6.2 A, 100 mm, 0.1 mm
pixels, default_F 100; ``heavy`` adds ``-mosaic 0.5 -mosaic_dom 10
-mosaic_seed 1 -phi 10 -osc 0.3 -phisteps 3 -oversample 1`` (30 evaluations
per pixel).  The first JSON record describes the machine; then one record per
size with ``compile_mode``, ``cold_s``, ``warm_s`` (median) and min/max,
``construct_s`` (a second simulator with the same key), ``grad_s``
(forward+backward of a scalar loss w.r.t. the cell and detector parameters,
median of ``max(3, iterations)`` warm runs; ``grad_min_s``) with ``--grad``,
``peak_rss_mb``, and with ``--c-bin`` the C program's time on the same
arguments and thread count (``c_s``), ``speedup_vs_c`` and ``corr_vs_c``.  Ratios come from one run on one machine; nothing here is a
unit-test assertion.

``--panels N`` renders each size as N panels of ``size/N`` rows (:meth:`nbtorch.Simulator.from_panels`), placed
where those rows of the one panel lie, so the image is the one panel's: the record adds ``panels``,
``single_warm_s`` (the one panel, timed the same way in the same run), ``panels_over_single`` (warm time ratio)
and ``max_abs_diff_vs_single``; with ``--c-bin`` the C program also runs once per panel on that panel's own
arguments (:func:`panel_args`): ``c_panels_s`` (the sum), ``speedup_vs_c_panels``, ``corr_vs_c_panels`` and
``c_panels_over_c`` (the C's own cost of N panels over its one panel).

``--disable-compile`` runs eager: :func:`compile_env` sets ``NANOBRAGG_DISABLE_COMPILE=1`` only while a size is
measured and then restores the caller's environment exactly (set or unset); every record says what ran
(``compile_mode``, ``compile_reason``), so a shell that already sets the variable shows up as ``eager`` there.
Every record has ``operators_per_call``, ``compiled_graphs_per_call`` and ``device_kernels_per_call`` (one warm
forward under the torch profiler: :func:`nbtorch.tools.costs.operator_counts`; on a GPU the kernels launched).
With two sizes or more the header gets ``fixed_cost``: the fixed cost of a call and the cost of each evaluation,
fitted through the sizes' medians (:func:`nbtorch.tools.costs.fit_fixed_cost`) for the forward, the gradient
(``--grad``) and the CUDA graph's replay.  ``--cuda-graph`` (a GPU) also times the forward replayed from a CUDA
graph (:mod:`nbtorch.runtime.cuda_graph`): ``graph_warm_s``, ``graph_warm_min_s``, ``graph_max_abs_diff`` (against
the plain forward's image), or ``graph_failure``.
``--profile N`` also runs N forward evaluations (no gradient) of each size under the torch profiler, after the
timed ones, and prints its table (sorted by self CPU time; CUDA time too on a GPU) below that size's JSON line;
the record gets ``profile_evaluations``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nbtorch.runtime import policy as runtime
from nbtorch.tools.costs import fit_fixed_cost, operator_counts

CASES = {
    "cubic": "-cell 100 100 100 90 90 90 -N 5 -lambda 6.2 -distance 100 -pixel 0.1 -default_F 100",
    "heavy": "-cell 100 100 100 90 90 90 -N 5 -lambda 6.2 -distance 100 -pixel 0.1 -default_F 100 "
             "-mosaic 0.5 -mosaic_dom 10 -mosaic_seed 1 -phi 10 -osc 0.3 -phisteps 3 -oversample 1",
}
GRAD_PARAMS = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma",
               "distance", "beam_x", "beam_y", "detector_rotx", "detector_roty", "detector_rotz", "twotheta")


@contextlib.contextmanager
def compile_env(disable: bool):
    """Set NANOBRAGG_DISABLE_COMPILE=1 while building simulators; restore the caller's environment exactly."""
    name = "NANOBRAGG_DISABLE_COMPILE"
    before = os.environ.get(name)
    if disable:
        os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def case_args(case: str, size: int) -> list[str]:
    return CASES[case].split() + ["-detpixels", str(size)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_c(c_bin: str, args: list[str], threads: int) -> tuple[float, np.ndarray]:
    """Time the C program on the same arguments and threads; return (seconds, image)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [c_bin, *args, "-floatfile", "c.bin", "-nonoise", "-nopgm", "-noprogress", "-intfile", "c.img"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True)
        seconds = time.perf_counter() - t0
        return seconds, np.fromfile(Path(tmp) / "c.bin", "<f4")


def profile_forward(sim, evaluations: int, device: str) -> str:
    """The torch profiler's table (40 rows, by self CPU time) of ``evaluations`` forward calls without gradient."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(evaluations):
            with torch.no_grad():
                sim()
        _sync(device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)


def panel_args(args: list[str], size: int, panels: int) -> list[list[str]]:
    """Each panel's own nanoBragg arguments: the ``size`` x ``size`` detector of ``args`` as ``panels`` panels of
    ``size / panels`` rows, each placed where its rows of the one panel lie (the slow beam-centre offset shifted
    by the rows above it).  The same lines drive the simulator (:func:`panel_simulator`) and the C program run
    panel by panel (``--c-bin``)."""
    from nbtorch import Simulator, config_from_args

    if size % panels:
        raise ValueError(f"--panels {panels} does not divide size {size}")
    one = Simulator(config_from_args(args))
    rows, pixel_mm = size // panels, one.setup.pixel_m * 1000.0
    if one.setup.convention != "mosflm":
        raise ValueError("--panels needs the MOSFLM convention of the cases")
    bx, by = float(one.beam_x), float(one.beam_y)  # MOSFLM: beam_x along slow, beam_y along fast (mm)
    return [args + ["-detpixels_s", str(rows), "-Xbeam", repr(bx - i * rows * pixel_mm), "-Ybeam", repr(by)]
            for i in range(panels)]


def panel_simulator(args: list[str], size: int, panels: int, **kwargs):
    """The detector of :func:`panel_args` as one multi-panel simulator."""
    from nbtorch import Simulator, config_from_args

    return Simulator.from_panels([config_from_args(a) for a in panel_args(args, size, panels)], **kwargs)


def _time_forward(sim, ns) -> tuple[float, list[float], torch.Tensor]:
    """``(cold s, warm s of each iteration, image)`` of forward calls without gradient (``sim``: a simulator, or any
    call that returns the image)."""
    t0 = time.perf_counter()
    img = _forward(sim)
    _sync(ns.device)
    cold = time.perf_counter() - t0
    times = []
    for _ in range(ns.iterations):
        t0 = time.perf_counter()
        img = _forward(sim)
        _sync(ns.device)
        times.append(time.perf_counter() - t0)
    return cold, times, img


def _forward(sim, **overrides):
    with torch.no_grad():
        return sim(**overrides)


def _graph_forward(sim, ns, img: torch.Tensor) -> dict:
    """The forward replayed from a CUDA graph (:class:`nbtorch.runtime.cuda_graph.GraphedFunction`, the distance an
    input): ``graph_warm_s`` (median of ``--iterations``), ``graph_warm_min_s``, ``graph_max_abs_diff`` from the
    plain image, or ``graph_failure``."""
    from nbtorch.runtime.cuda_graph import GraphedFunction

    graphed = GraphedFunction(lambda distance: (_forward(sim, distance=distance),), "forward")
    distance = sim.distance.detach().clone()
    _, times, out = _time_forward(lambda: graphed(distance)[0], ns)  # the cold call captures
    if not graphed.captured:
        return {"graph_failure": graphed.failure}
    return {"graph_warm_s": statistics.median(times), "graph_warm_min_s": min(times),
            "graph_max_abs_diff": float((out - img).abs().max())}


def fixed_cost_record(records: list[dict]) -> dict:
    """The fixed cost per call and the cost per evaluation (:func:`nbtorch.tools.costs.fit_fixed_cost`) of the
    forward (``warm_s``), and of the gradient (``grad_s``) and the CUDA graph's replay (``graph_warm_s``) where
    measured, through the sizes' medians; empty for fewer than two sizes."""
    out = {}
    for key in ("warm_s", "grad_s", "graph_warm_s"):
        rows = [r for r in records if key in r]
        if len({r["evaluations"] for r in rows}) >= 2:
            out[key] = fit_fixed_cost([r["evaluations"] for r in rows], [r[key] for r in rows])
    return out


def bench_size(ns, size: int) -> dict:
    from nbtorch import Simulator, config_from_args

    dtype = torch.float32 if ns.dtype == "float32" else torch.float64
    args = case_args(ns.case, size) + (["-c_parity"] if ns.c_parity else [])
    cfg = config_from_args(args)
    rec: dict = {"size": size, "case": ns.case, "dtype": ns.dtype, "device": ns.device}
    with compile_env(ns.disable_compile):
        if ns.panels > 1:
            single = Simulator(cfg, dtype=dtype, device=ns.device)
            _, single_times, single_img = _time_forward(single, ns)
            sim = panel_simulator(args, size, ns.panels, dtype=dtype, device=ns.device)
        else:
            sim = Simulator(cfg, dtype=dtype, device=ns.device)
        rec["cold_s"], times, img = _time_forward(sim, ns)
        rec.update(warm_s=statistics.median(times), warm_min_s=min(times), warm_max_s=max(times))
        if ns.panels > 1:
            rec.update(panels=ns.panels, single_warm_s=statistics.median(single_times),
                       panels_over_single=statistics.median(times) / statistics.median(single_times),
                       max_abs_diff_vs_single=float((img - single_img).abs().max()))
        rec["compile_mode"] = sim.compile_mode
        rec["compile_reason"] = sim.compile_reason
        t0 = time.perf_counter()
        Simulator(cfg, dtype=dtype, device=ns.device)
        rec["construct_s"] = time.perf_counter() - t0
        rec["evaluations"] = size * size * sim.evaluations_per_pixel()
        rec["ns_per_evaluation"] = rec["warm_s"] / rec["evaluations"] * 1e9
        if ns.grad:
            params = {n: getattr(sim, n).detach().clone().to(dtype).requires_grad_(True) for n in GRAD_PARAMS}
            t0 = time.perf_counter()
            loss = sim(**params).square().mean()
            loss.backward()
            _sync(ns.device)
            grad_times = []
            for _ in range(max(3, ns.iterations)):
                t0 = time.perf_counter()
                loss = sim(**params).square().mean()
                loss.backward()
                _sync(ns.device)
                grad_times.append(time.perf_counter() - t0)
            rec["grad_s"] = statistics.median(grad_times)
            rec["grad_min_s"] = min(grad_times)
            rec["grad_over_forward"] = rec["grad_s"] / rec["warm_s"]
        counts = operator_counts(lambda: _forward(sim), ns.device)  # warm: timed above
        rec.update({f"{key}_per_call": value for key, value in counts.items()})
        if ns.cuda_graph:
            rec.update(_graph_forward(sim, ns, img))
        if ns.profile:
            rec["profile_evaluations"] = ns.profile
            rec["profile"] = profile_forward(sim, ns.profile, ns.device)
    rec["peak_rss_mb"] = peak_rss_mb()
    c_cmd = "nanoBragg " + " ".join(shlex.quote(a) for a in case_args(ns.case, size)) + " -floatfile c.bin -nonoise -nopgm"
    rec["c_command"] = f"OMP_NUM_THREADS={ns.threads} {c_cmd}"
    if ns.c_bin:
        c_s, c_img = run_c(ns.c_bin, case_args(ns.case, size), ns.threads)
        ours = img.detach().double().cpu().numpy().ravel()
        rec.update(c_s=c_s, speedup_vs_c=c_s / rec["warm_s"], corr_vs_c=float(np.corrcoef(ours, c_img)[0, 1]))
        if ns.panels > 1:  # the C program has one panel: run it once per panel, as a user of several panels would
            runs = [run_c(ns.c_bin, a, ns.threads) for a in panel_args(case_args(ns.case, size), size, ns.panels)]
            c_panels_s, c_panels = sum(r[0] for r in runs), np.concatenate([r[1] for r in runs])
            rec.update(c_panels_s=c_panels_s, speedup_vs_c_panels=c_panels_s / rec["warm_s"],
                       corr_vs_c_panels=float(np.corrcoef(ours, c_panels)[0, 1]), c_panels_over_c=c_panels_s / c_s)
    return rec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nbtorch.tools.bench", description="nbtorch benchmark harness")
    ap.add_argument("--sizes", default="256,512,1024", help="detector sizes in pixels, comma-separated")
    ap.add_argument("--case", choices=sorted(CASES), default="cubic",
                    help="cubic (1 evaluation per pixel) or heavy (mosaic domains, phi steps: 30)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="simulator dtype")
    ap.add_argument("--iterations", type=int, default=5, help="timed warm forward calls per size (default %(default)s)")
    ap.add_argument("--disable-compile", action="store_true",
                    help="run eager: NANOBRAGG_DISABLE_COMPILE=1 while each size is measured, the caller's "
                         "environment restored after")
    ap.add_argument("--c-bin", default=None, help="path to a C nanoBragg build to compare against")
    ap.add_argument("--c-parity", action="store_true", help="simulate with -c_parity (mosaic domains etc. as the C)")
    ap.add_argument("--grad", action="store_true", help="also time forward+backward of a scalar loss")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the torch profiler's table of N forward evaluations of each size")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: torch's)")
    ap.add_argument("--panels", type=int, default=1, metavar="N",
                    help="render each size as N panels (size/N rows each) and compare with the one panel")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="on a GPU: also time the forward replayed from a CUDA graph")
    ap.add_argument("--json", default=None, help="also write every record to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        sizes = [int(s) for s in ns.sizes.split(",") if s]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        print(f"bench: --sizes must be comma-separated positive integers, got {ns.sizes!r}", file=sys.stderr)
        return 2
    if ns.panels < 1 or any(s % ns.panels for s in sizes):
        print(f"bench: --panels must be >= 1 and divide every size, got {ns.panels}", file=sys.stderr)
        return 2
    if ns.cuda_graph and not ns.device.startswith("cuda"):
        print(f"bench: --cuda-graph needs a CUDA --device, got {ns.device!r}", file=sys.stderr)
        return 2
    if ns.iterations < 1 or ns.profile < 0 or ns.threads < 1:
        print("bench: --iterations and --threads must be >= 1, --profile >= 0", file=sys.stderr)
        return 2
    if ns.c_bin and not os.access(ns.c_bin, os.X_OK):
        print(f"bench: --c-bin {ns.c_bin}: not an executable file", file=sys.stderr)
        return 2
    torch.set_num_threads(ns.threads)
    runtime.tune_allocator()  # as the commands do
    header = {
        "machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
        "torch": torch.__version__, "threads": ns.threads, "cpu_count": os.cpu_count(),
        "device_name": torch.cuda.get_device_name(0) if ns.device.startswith("cuda") else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d"),
    }
    records = [header]
    print(json.dumps(header))
    for size in sizes:
        rec = bench_size(ns, size)
        table = rec.pop("profile", None)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if table:
            print(f"torch profiler, {ns.profile} forward evaluations, {ns.case} {size}x{size}:\n{table}", flush=True)
    fits = fixed_cost_record(records[1:])
    if fits:
        header["fixed_cost"] = fits
        print("fixed cost per call + cost per evaluation (least squares through the sizes' medians): " + ", ".join(
            f"{key} {f['fixed_s'] * 1e3:.3f} ms + {f['ns_per_sample']:.4f} ns" for key, f in fits.items()), flush=True)
    if ns.json:
        from nbtorch.io.atomic import atomic_write

        with atomic_write(ns.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
