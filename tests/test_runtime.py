"""Compile guard, shared compiled kernels and Dynamo-safe diagnostics."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch

import nbtorch
from nbtorch import InputError, Simulator, config_from_args
from nbtorch.runtime import policy as runtime

SMALL = "-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1 -default_F 100 -distance 100 -detpixels 24 -pixel 0.6".split()


def make(**kw) -> Simulator:
    return Simulator(config_from_args(SMALL), dtype=torch.float32, **kw)


@pytest.fixture
def no_env(monkeypatch):
    for name in runtime.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def compile_spy(monkeypatch):
    calls = []

    def spy(fn, **kw):
        calls.append(kw)
        return fn  # behaves like eager, but records that compile was asked for

    monkeypatch.setattr(runtime.torch, "compile", spy)
    monkeypatch.setattr(runtime, "_KERNELS", {})
    return calls


@pytest.mark.parametrize("name", runtime.ENV_VARS)
@pytest.mark.parametrize("value, expected", [("1", "eager"), ("0", "compiled"), (None, "compiled")])
def test_env_spellings_select_path(no_env, compile_spy, name, value, expected):
    if value is not None:
        no_env.setenv(name, value)
    sim = make()
    assert sim.compile_mode == expected
    sim()
    if expected == "eager":
        assert compile_spy == [], "torch.compile must not be called in eager mode"
    else:
        assert compile_spy and compile_spy[0]["fullgraph"] is True


@pytest.mark.parametrize("name", runtime.ENV_VARS)
def test_bad_env_value_is_an_error(no_env, name):
    no_env.setenv(name, "yes")
    with pytest.raises(InputError, match=name):
        make()


def test_explicit_argument_wins(no_env, compile_spy):
    no_env.setenv("NANOBRAGG_DISABLE_COMPILE", "1")
    assert make(compile=True).compile_mode == "compiled"
    no_env.delenv("NANOBRAGG_DISABLE_COMPILE")
    assert make(compile=False).compile_mode == "eager"


def test_eager_context_forces_eager(no_env, compile_spy):
    with nbtorch.eager():
        sim = make(compile=True)
        assert sim.compile_mode == "eager"
        sim()
    assert compile_spy == []
    # a compiled simulator run inside eager() also runs eagerly
    sim = make(compile=True)
    with nbtorch.eager():
        sim()
    assert compile_spy == []


def test_compile_failure_falls_back_once(no_env, monkeypatch, caplog):
    def broken(key, fn, options=None):
        def kernel(*a, **k):
            raise RuntimeError("inductor exploded")

        return kernel

    monkeypatch.setattr(runtime, "compiled_kernel", broken)
    sim = make(compile=True)
    with caplog.at_level(logging.WARNING, logger="nbtorch.rendering"):
        img = sim()
        sim()
    assert sim.compile_mode == "eager"
    assert "inductor exploded" in sim.compile_reason
    warnings = [r for r in caplog.records if "falling back to eager" in r.getMessage()]
    assert len(warnings) == 1
    assert torch.equal(img, make(compile=False)())


def test_diagnostics_hooks_rate_limited_and_noop_by_default():
    sim = make(compile=False)
    assert len(sim.diagnostics) == 0
    sim()  # no subscriber: nothing happens
    got = []
    sim.diagnostics.subscribe(got.append, every=2)
    for _ in range(4):
        sim()
    assert len(got) == 2
    d = got[0]
    assert {"fraction_default_F", "hkl0_min", "hkl0_max", "image_max"} <= set(d)
    assert float(d["image_max"]) > 0


# --- real compilation (one small problem; each graph compiles once per session) ----------
@pytest.fixture(scope="module")
def compiled_pair():
    torch._dynamo.reset()
    runtime._KERNELS.clear()
    sim_c = Simulator(config_from_args(SMALL), dtype=torch.float32, compile=True)
    got = []
    sim_c.diagnostics.subscribe(got.append)
    img_c = sim_c()
    sim_e = Simulator(config_from_args(SMALL), dtype=torch.float32, compile=False)
    return sim_c, img_c, sim_e(), got


def test_compiled_matches_eager(compiled_pair):
    sim_c, img_c, img_e, _ = compiled_pair
    assert sim_c.compile_mode == "compiled", sim_c.compile_reason
    assert img_e.max() > 0
    corr = np.corrcoef(img_c.double().numpy().ravel(), img_e.double().numpy().ravel())[0, 1]
    assert corr >= 0.999999


def test_hook_receives_values_with_fullgraph(compiled_pair):
    _, img_c, _, got = compiled_pair
    assert got and float(got[0]["image_max"]) == pytest.approx(float(img_c.max()))


def test_shared_kernel_no_recompile(compiled_pair):
    from torch._dynamo.utils import counters

    sim_c = compiled_pair[0]
    before = counters["stats"]["unique_graphs"]
    kernels = len(runtime.cached_kernel_keys())
    sim2 = Simulator(config_from_args(SMALL), dtype=torch.float32, compile=True)
    sim2.diagnostics.subscribe(lambda d: None)  # the same kernel variant as sim_c (diagnostics on)
    sim2()
    sim2(cell_a=torch.tensor(70.5), distance=torch.tensor(101.0))  # new values, same graph
    sim_c(misset_x=torch.tensor(11.0))
    assert counters["stats"]["unique_graphs"] == before, "a parameter change or a same-key simulator recompiled"
    keys = runtime.cached_kernel_keys()
    assert len(keys) == kernels, "a same-key simulator made kernels of its own"
    from nbtorch.rendering import tile_pixels

    tile = tile_pixels(24 * 24, sim2.max_evals_per_tile // sim2.evaluations_per_pixel(), True)  # 640: bucketed
    assert all(sim2._kernel_key(tile, False) + stage in keys
               for stage in (("tile_pixel_terms",), ("orientation_sum",), ("orientation_sum", "autograd"),
                             ("square_sum_backward",), ("combine",)))


def test_hot_loop_fusion_options(no_env, compile_spy):
    """Only the hot loop's forward gets the raised fusion thresholds; options this torch lacks are dropped."""
    from nbtorch.rendering import FUSE_HOT_LOOP

    make(compile=True)()
    opts = [kw["options"] for kw in compile_spy]
    # tile_pixel_terms, orientation_sum with autograd, without, square_sum_backward, combine
    assert len(opts) == 5
    assert sum(all(o.get(k) == v for k, v in FUSE_HOT_LOOP.items()) for o in opts) == 1
    assert all(o["cpp.enable_floating_point_contract_flag"] == "fast" for o in opts)
    assert runtime._known_inductor_options({"realize_reads_threshold": 7, "no_such_option": 1}) == {
        "realize_reads_threshold": 7}


def test_fusion_options_only_for_the_square_nearest_loop():
    """Tricubic interpolation or another crystal shape: the hot stage keeps Inductor's default thresholds."""
    import dataclasses

    assert make()._fuses_hot_loop()
    for extra in (["-round_xtal"], ["-gauss_xtal"]):
        assert not Simulator(config_from_args(SMALL + extra), dtype=torch.float32)._fuses_hot_loop()
    sim = make()
    sim.options = dataclasses.replace(sim.options, interpolate=True)  # as with -interpolate and an HKL table
    assert not sim._fuses_hot_loop()


def test_check_device_names_the_flag():
    runtime.check_device("cpu", "--device")
    with pytest.raises(InputError, match=r"^--device: expected cpu or cuda\[:N\], got 'tpu'$"):
        runtime.check_device("tpu", "--device")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match=r"^-device cuda:1: CUDA is not available on this machine$"):
            runtime.check_device("cuda:1", "-device")


# ------------------------------------------------------------------------------ one compile policy

@pytest.mark.parametrize("purpose, evaluations, explicit, env, expected", [
    ("simulator", None, None, None, True),
    ("simulator", None, False, None, False),
    ("simulator", None, None, "NANOBRAGG_DISABLE_COMPILE", False),
    ("simulator", None, None, "NANOBRAG_DISABLE_COMPILE", False),
    ("simulator", None, True, "NANOBRAGG_DISABLE_COMPILE", True),  # an explicit request wins over the environment
    ("one-shot", 49_999_999, None, None, False),
    ("one-shot", 50_000_000, None, None, True),
    ("one-shot", 1e9, None, "NANOBRAG_DISABLE_COMPILE", False),
    ("one-shot", 10, True, None, True),
    ("refinement", 199_999, None, None, False),
    ("refinement", 200_000, None, None, True),
    ("refinement", 1e7, False, None, False),
    ("refinement", 1e7, None, "NANOBRAGG_DISABLE_COMPILE", False),
    ("esds", None, True, None, False),  # forward-mode tangents never meet a compiled graph, whatever is asked
])
def test_compile_policy(monkeypatch, purpose, evaluations, explicit, env, expected):
    from nbtorch.runtime.policy import compile_policy

    for name in runtime.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    if env:
        monkeypatch.setenv(env, "1")
    decision, why = compile_policy(purpose, evaluations, explicit)
    assert decision is expected and why


def test_compile_policy_inside_eager_and_bad_purpose():
    from nbtorch.runtime.policy import compile_policy

    with nbtorch.eager():
        assert compile_policy("one-shot", 1e12, explicit=True) == (False, "inside nbtorch.eager()")
        assert compile_policy("simulator", explicit=True)[0] is False
    with pytest.raises(ValueError, match="purpose"):
        compile_policy("training")
    with pytest.raises(ValueError, match="needs the number of evaluations"):
        compile_policy("refinement")


def test_every_command_decides_through_the_policy():
    """No command line keeps its own threshold or rule: the thresholds live in nbtorch.runtime.policy only."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in list((root / "refine").rglob("*.py")) + list((root / "nbtorch").rglob("*.py")) + \
            list((root / "experiments").glob("*.py")):
        if path == root / "nbtorch" / "runtime" / "policy.py":
            continue
        text = path.read_text()
        for literal in ("50_000_000", "5e7", "200_000", "2e5"):
            assert literal not in text, f"{path.name} has its own compile threshold {literal}"


_FAULTS = """
import resource, sys, torch
from nbtorch import Simulator, config_from_args
from nbtorch.runtime import policy as runtime
tuned = runtime.tune_allocator() if sys.argv[1] == "tune" else None
cfg = config_from_args("-cell 100 100 100 90 90 90 -N 5 -lambda 6.2 -distance 100 -pixel 0.1 -default_F 100 "
                       "-detpixels 512".split())
sim = Simulator(cfg, dtype=torch.float32, compile=False)
with torch.no_grad():
    for _ in range(6):  # to the heap's steady state (tuned, it stops growing after a few calls)
        sim()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        sim()
print(tuned, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 4)
"""


_BIG_BUFFER = """
import resource, sys, torch
from nbtorch.runtime import policy as runtime
tuned = runtime.tune_allocator() if sys.argv[1] == "tune" else None
n = 16 << 20  # 64 MB of float32: above glibc's largest adaptive mmap threshold (32 MB on 64-bit)
torch.empty(n).fill_(1.0)
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(n).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(tuned, min(faults))
"""


def _run_probe(script: str, mode: str, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is for Linux")
def test_tune_allocator_serves_a_freed_big_buffer_from_the_heap():
    """A 64 MB buffer allocated, written and freed again and again: glibc by default always maps it fresh
    (above its largest adaptive threshold), so every write faults in all 16 384 pages; tuned, the freed heap
    serves the next one (the fewest faults of three calls: 0 measured)."""
    pages = (64 << 20) // resource.getpagesize()
    plain_flag, plain = _run_probe(_BIG_BUFFER, "plain")
    tuned_flag, tuned = _run_probe(_BIG_BUFFER, "tune")
    off_flag, off = _run_probe(_BIG_BUFFER, "tune", {"NBTORCH_TUNE_MALLOC": "0"})
    assert (plain_flag, tuned_flag, off_flag) == ("None", "True", "False")
    assert plain >= 0.9 * pages and off >= 0.9 * pages, (plain, off, pages)
    assert tuned <= 0.05 * pages, (tuned, pages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is for Linux")
def test_tune_allocator_reuses_the_forward_buffers():
    """The 512² forward again and again, tuned: the freed heap serves the next call (0 page faults per call in
    ten runs here, 576 seen on a CI machine; untuned it varies with the process's allocation history, 824 to
    26 500, so it is not compared: the 64 MB test above tells the two apart)."""
    flag, tuned = _run_probe(_FAULTS, "tune")
    assert flag == "True" and tuned < 1_000, tuned
