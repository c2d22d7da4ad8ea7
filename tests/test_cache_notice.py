"""nbtorch.runtime.cache: a first compile on an empty cache says, before it starts, that it compiles and for about how long;
once per cache folder (a second process with the same folder says nothing), through ``logging`` (a WARNING, which
the commands show on stderr without any logging set-up)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbtorch.runtime import cache
from nbtorch.runtime import policy as runtime

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "first run on this machine: compiling the kernels into"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty cache folder for this process: no Inductor folder chosen, nothing said yet, no ISA probe."""
    monkeypatch.setenv("NBTORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test
    monkeypatch.setattr(cache, "_announced", False)
    import nbtorch.runtime.vec_isa

    monkeypatch.setattr(nbtorch.runtime.vec_isa, "trust_vec_isa_probe", lambda folder: False)
    return tmp_path


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nbtorch.runtime.cache" and NOTICE in r.getMessage()]


def test_empty_cache_says_so_once(empty_cache, caplog):
    caplog.set_level(logging.WARNING, logger="nbtorch.runtime.cache")
    path = cache.configure_inductor_cache()
    assert path == empty_cache / "inductor" and path.is_dir()
    (said,) = _notices(caplog)
    assert str(path) in said and "about 2 minutes" in said
    cache.configure_inductor_cache()  # the next kernel of the same process
    assert len(_notices(caplog)) == 1


def test_filled_cache_says_nothing(empty_cache, caplog):
    caplog.set_level(logging.WARNING, logger="nbtorch.runtime.cache")
    (empty_cache / "inductor").mkdir()
    (empty_cache / "inductor" / "compiled").write_text("x")  # what an earlier run left
    cache.configure_inductor_cache()
    assert _notices(caplog) == []


def test_said_before_the_kernel_is_compiled(empty_cache, caplog, monkeypatch):
    """runtime.compiled_kernel says it when it makes the wrapper, before the first call compiles anything."""
    caplog.set_level(logging.WARNING, logger="nbtorch.runtime.cache")
    monkeypatch.setattr(runtime, "_KERNELS", {})
    compiled = []
    monkeypatch.setattr(runtime.torch, "compile", lambda fn, **kw: compiled.append(len(_notices(caplog))) or fn)
    runtime.compiled_kernel(("notice",), lambda x: x)
    assert compiled == [1]


def _process(folder: Path) -> str:
    env = {**os.environ, "NBTORCH_CACHE_DIR": str(folder), "PYTHONPATH": str(ROOT), "NBTORCH_TRUST_VEC_ISA": "0"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", "from nbtorch.runtime.cache import configure_inductor_cache\n"
                           "configure_inductor_cache()\nconfigure_inductor_cache()"],
                          env=env, capture_output=True, text=True, timeout=300, check=True)
    return done.stderr


def test_first_process_says_it_on_stderr_the_second_does_not(tmp_path):
    first = _process(tmp_path)
    assert first.count(NOTICE) == 1 and str(tmp_path / "inductor") in first
    (tmp_path / "inductor" / "compiled").write_text("x")  # the first run compiled something there
    assert NOTICE not in _process(tmp_path)
