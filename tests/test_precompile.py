"""Compiled kernels saved and loaded with torch's precompile API (nbtorch.runtime.precompile)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nbtorch.runtime import policy as runtime
from nbtorch.runtime import precompile

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Opt:
    steps: int = 2


def toy(x: torch.Tensor, w: torch.Tensor, opt: Opt) -> torch.Tensor:
    y = x * w
    for _ in range(opt.steps):
        y = torch.sin(y) * x + 0.5
    return y.sum(0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_KERNELS", {})
    monkeypatch.setattr(runtime, "PRECOMPILE", True)
    monkeypatch.delenv(runtime.PRECOMPILE_ENV, raising=False)
    for name in runtime.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_describe_sees_what_guards_see():
    x = torch.zeros(4, 3, dtype=torch.float64)
    base = precompile.describe((x, Opt()))
    assert precompile.describe((x.clone(), Opt())) == base  # values do not matter
    for other in ((x.float(), Opt()), (x.t(), Opt()), (x.requires_grad_(True), Opt()), (x[:2], Opt()),
                  (torch.zeros(4, 3, dtype=torch.float64), Opt(steps=3))):
        assert precompile.describe(other) != base


def test_saved_then_loaded_with_the_same_results(cache):
    """The first call compiles and saves one file per kind of arguments; a second kernel object (as in a new
    process) loads them, traces nothing, and gives the same values and gradients."""
    from torch._dynamo.utils import counters

    x = torch.linspace(0.1, 2.0, 48, dtype=torch.float64).reshape(16, 3)
    w = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    kernel = runtime.compiled_kernel(("toy", 1), toy)
    assert isinstance(kernel, precompile.PrecompiledKernel)
    with torch.no_grad():
        plain = kernel(x, w, Opt())
    out = kernel(x, w, Opt())
    (grad,) = torch.autograd.grad(out.sum(), w)
    assert kernel.saved == 2 and kernel.loaded == 0  # without and with gradients
    files = sorted(precompile.precompile_dir().glob("*.bin"))
    assert len(files) == 2

    runtime._KERNELS.clear()
    fresh = runtime.compiled_kernel(("toy", 1), toy)
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        plain2 = fresh(x, w, Opt())
    out2 = fresh(x, w, Opt())
    (grad2,) = torch.autograd.grad(out2.sum(), w)
    assert fresh.loaded == 2 and fresh.saved == 0
    assert counters["stats"]["unique_graphs"] == before, "a loaded kernel traced again"
    assert torch.equal(plain2, plain) and torch.equal(out2, out) and torch.equal(grad2, grad)
    torch.testing.assert_close(out, toy(x, w, Opt()), rtol=1e-12, atol=1e-12)

    def no_digest(*_):  # a variant in use is found by torch's guards alone (no describing of the arguments)
        raise AssertionError("slow path taken")

    fresh._argument_digest = no_digest
    with torch.no_grad():
        assert torch.equal(fresh(x, w, Opt()), plain)
    assert torch.equal(fresh(x, w, Opt()), out)


def test_other_arguments_another_file_and_guards_checked(cache):
    x = torch.ones(8, 3, dtype=torch.float64)
    w = torch.ones(3, dtype=torch.float64)
    kernel = runtime.compiled_kernel(("toy", 2), toy)
    with torch.no_grad():
        kernel(x, w, Opt(steps=1))
        kernel(x, w, Opt(steps=3))  # another constant: another variant, not a wrong result
        torch.testing.assert_close(kernel(x, w, Opt(steps=3)), toy(x, w, Opt(steps=3)))
    assert kernel.saved == 2


def test_damaged_file_is_compiled_again(cache):
    x = torch.ones(8, 3, dtype=torch.float64)
    w = torch.ones(3, dtype=torch.float64)
    with torch.no_grad():
        runtime.compiled_kernel(("toy", 3), toy)(x, w, Opt())
        (path,) = precompile.precompile_dir().glob("*.bin")
        path.write_bytes(b"not a precompiled kernel")
        runtime._KERNELS.clear()
        kernel = runtime.compiled_kernel(("toy", 3), toy)
        torch.testing.assert_close(kernel(x, w, Opt()), toy(x, w, Opt()))
    assert kernel.loaded == 0 and kernel.saved == 1
    assert path.read_bytes() != b"not a precompiled kernel"


def test_eager_and_disable_never_meet_a_precompiled_kernel(cache, monkeypatch):
    import nbtorch
    from nbtorch import Simulator, config_from_args

    args = "-cell 70 80 90 75 85 95 -N 5 -lambda 1 -default_F 100 -distance 100 -detpixels 8 -pixel 0.6".split()
    with nbtorch.eager():
        Simulator(config_from_args(args), dtype=torch.float64)()
    monkeypatch.setenv("NANOBRAGG_DISABLE_COMPILE", "1")
    Simulator(config_from_args(args), dtype=torch.float64)()
    assert runtime.cached_kernel_keys() == []
    assert not precompile.precompile_dir().exists()


SCRIPT = """
import json, sys, torch
from nbtorch import Simulator, config_from_args
from nbtorch.runtime import policy as runtime
from torch._dynamo.utils import counters
args = "-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1 -default_F 100 -distance 100 -detpixels 16 -pixel 0.6"
sim = Simulator(config_from_args(args.split()), dtype=torch.float64, compile=True)
a = torch.tensor(70.0, dtype=torch.float64, requires_grad=True)
img = sim(cell_a=a)
img.sum().backward()
with torch.no_grad():
    plain = sim()
print(json.dumps({"image": img.detach().flatten().tolist(), "plain": plain.flatten().tolist(), "grad": a.grad.item(),
                  "loaded": sum(k.loaded for k in runtime._KERNELS.values()),
                  "saved": sum(k.saved for k in runtime._KERNELS.values()),
                  "graphs": counters["stats"]["unique_graphs"], "mode": sim.compile_mode}))
"""


def _process(cache_dir: Path) -> dict:
    env = {**os.environ, "NBTORCH_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    env.pop(runtime.PRECOMPILE_ENV, None)
    for name in runtime.ENV_VARS + ("TORCHINDUCTOR_CACHE_DIR",):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_simulator_second_process_loads_instead_of_tracing(tmp_path):
    """A new process with a warm cache runs the simulator's compiled stages (forward and the analytic
    backward) without tracing one graph, bit-identical to the process that compiled them."""
    first = _process(tmp_path)
    assert first["mode"] == "compiled" and first["saved"] >= 5 and first["loaded"] == 0
    second = _process(tmp_path)
    assert second["mode"] == "compiled"
    assert second["saved"] == 0 and second["loaded"] == first["saved"] and second["graphs"] == 0
    for name in ("image", "plain", "grad"):
        assert second[name] == first[name], name


def test_edited_source_is_never_loaded(cache, monkeypatch):
    """A kernel whose module changed (here a constant beside the function) compiles again: the stale file's
    recorded source no longer matches."""
    import importlib

    mod = cache / "edited_kernel.py"
    mod.write_text("import torch\nK = 2.0\n\ndef f(x):\n    return torch.sin(x) * K\n")
    monkeypatch.syspath_prepend(str(cache))
    import edited_kernel

    x = torch.linspace(0, 1, 8, dtype=torch.float64)
    with torch.no_grad():
        runtime.compiled_kernel(("edited",), edited_kernel.f)(x)
        mod.write_text("import torch\nK = 3.0\n\ndef f(x):\n    return torch.sin(x) * K\n")
        importlib.reload(edited_kernel)
        runtime._KERNELS.clear()
        kernel = runtime.compiled_kernel(("edited",), edited_kernel.f)
        torch.testing.assert_close(kernel(x), torch.sin(x) * 3.0)
    assert kernel.loaded == 0 and kernel.saved == 1


def test_thread_count_is_part_of_the_file_name(cache):
    """Inductor writes the thread count into the C++ it generates: a kernel saved by a one-thread process must
    not be loaded by a two-thread one (it ran the 1024^2 cubic forward at half speed)."""
    x = torch.ones(8, 3, dtype=torch.float64)
    w = torch.ones(3, dtype=torch.float64)
    kernel = runtime.compiled_kernel(("toy", 3), toy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel._argument_digest((x, w, Opt()), {})
        torch.set_num_threads(2)
        two = kernel._argument_digest((x, w, Opt()), {})
    finally:
        torch.set_num_threads(before)
    assert one != two


def test_precompile_environment_switch(cache, monkeypatch):
    monkeypatch.setenv(runtime.PRECOMPILE_ENV, "0")
    assert not runtime.precompile_enabled()
    assert not isinstance(runtime.compiled_kernel(("toy", 4), toy), precompile.PrecompiledKernel)
    monkeypatch.setenv(runtime.PRECOMPILE_ENV, "1")
    assert isinstance(runtime.compiled_kernel(("toy", 5), toy), precompile.PrecompiledKernel)
    monkeypatch.setenv(runtime.PRECOMPILE_ENV, "yes")
    with pytest.raises(Exception, match=r"^NBTORCH_PRECOMPILE: expected 0 or 1, got 'yes'$"):
        runtime.precompile_enabled()
