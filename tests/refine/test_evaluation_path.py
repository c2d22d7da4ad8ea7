"""One loss-and-gradient evaluation of a compiled refinement (what the loop repeats, issue #49) adds, after a
warm-up evaluation: no graph, no graph break, no recompile at other parameter values, and no read of a tensor
into Python by the project's code (on a GPU each such read waits for the device: the loop reads the one loss
it needs itself, outside the evaluation).

The objective is the one ``nbtorch-refine`` fits (built by :mod:`refine.tools.bench` through the command's own
steps).  Its free names, problem and size are those of ``tests/refine/test_callbacks.py``'s compiled refinement,
so in one pytest process the kernels compiled there serve this test too (alone, it compiles them: ~1-2 min on an
empty compile cache, seconds on a warm one).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import nbtorch
from refine.tools import bench

ARGS = ["--problem", "cubic_mosflm", "--size", "32", "--compile", "--refine",
        "scale,background,orientation,beam_centre,cell"]
REPOSITORY = Path(nbtorch.__file__).resolve().parents[1]
#: the Tensor methods that copy a value to Python (on a GPU: wait for the device, then copy)
HOST_READS = ("item", "tolist", "numpy", "__array__", "cpu", "__float__", "__int__", "__bool__", "__index__",
              "__format__")


@contextlib.contextmanager
def host_reads():
    """The list of ``(method, file:line)`` of every call of a :data:`HOST_READS` method made directly by this
    repository's code while inside (calls from torch's own code, e.g. a compiled graph's guards, are not the
    project's: they do not count)."""
    calls: list[tuple[str, str]] = []
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    own = {name for name in HOST_READS if name in vars(torch.Tensor)}  # the others are TensorBase's

    def recording(name, method):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            source = Path(caller.f_code.co_filename)  # "<string>" for code torch generates (a graph's guards)
            if source.is_file() and source.resolve().is_relative_to(REPOSITORY):
                calls.append((name, f"{caller.f_code.co_filename}:{caller.f_lineno}"))
            return method(self, *args, **kwargs)
        return wrapper

    for name, method in saved.items():
        setattr(torch.Tensor, name, recording(name, method))
    try:
        yield calls
    finally:
        for name, method in saved.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)


def test_the_recorder_sees_a_read_by_project_code():
    x = torch.ones(3, dtype=torch.float64)
    with host_reads() as calls:
        float(x.sum())
        x.tolist()
        bool(x.any())
        torch.isfinite(x).all()  # no read
    assert [name for name, _ in calls] == ["__float__", "tolist", "__bool__"]
    assert all(Path(where.rsplit(":", 1)[0]).resolve() == Path(__file__).resolve() for _, where in calls)


def test_a_fixed_width_override_is_checked_without_a_tensor(problem_cache):
    """The simulator checks the beam's widths at every evaluation: a refinement passes them as plain numbers,
    which it compares as they are (it used to make a tensor of each and read it back)."""
    sim = problem_cache("cubic_mosflm", 32).simulator()
    with host_reads() as calls:
        sim.parameters_dict(dispersion=0.0, divergence_h=0.0, divergence_v=0.0)
    assert calls == []


def test_a_multi_panel_simulator_reads_its_plain_geometry_once():
    """A multi-panel simulator accepts a plain geometry name (``distance``) only at its own value, which it reads
    from the device once per buffer version, not at every evaluation."""
    from nbtorch import Simulator, config_from_args
    from nbtorch.errors import InputError

    base = "-cell 70 80 90 75 85 95 -N 5 -lambda 1.0 -default_F 100 -pixel 0.1 -detpixels_f 8 -detpixels_s 6".split()
    sim = Simulator.from_panels([config_from_args(base + ["-distance", d]) for d in ("100", "105")])
    plain = {n: float(getattr(sim, n)) for n in ("distance", "beam_x", "beam_y")}
    sim.parameters_dict(**plain)  # the first call reads the buffers
    with host_reads() as calls:
        sim.parameters_dict(**plain)
    assert calls == []
    sim.distance.add_(1.0)  # a new version of the buffer is read again
    with pytest.raises(InputError, match="per-panel geometry names"):
        sim.parameters_dict(**plain)


def test_one_loss_and_gradient_has_no_recompile_graph_break_or_host_read():
    from torch._dynamo.utils import counters

    b = bench.build_objective(ARGS)
    assert b.sim.compile_mode == "compiled", b.sim.compile_reason
    raw0 = b.raw.clone()
    b.loss_grad()  # warm-up: compiles, or reuses the kernels of an earlier test
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    losses = []
    with torch._dynamo.config.patch(error_on_recompile=True), host_reads() as calls:
        for shift in (0.01, -0.02, 0.05):  # raw units: other parameter values, the same graphs
            b.raw = raw0 + shift
            loss, grad = b.loss_grad()
            losses.append(loss)
    assert calls == [], f"tensors read into Python inside the evaluation: {calls}"
    # a recompile (an error here) or a graph break would have sent the simulator to eager (Simulator._run_kernel)
    assert b.sim.compile_mode == "compiled", b.sim.compile_reason
    assert counters["stats"]["unique_graphs"] == graphs, "an evaluation at other parameter values compiled a graph"
    assert dict(counters["graph_break"]) == breaks, "a graph break"
    assert len({float(v) for v in losses}) == 3 and bool(torch.isfinite(grad).all()) and bool(grad.abs().max() > 0)
