"""nbtorch.runtime.vec_isa: Inductor's vector-ISA probe once per machine (a record of its verdict), not once per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="the record is kept on x86-64 Linux only")

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, sys
import nbtorch.runtime.cache as cache
cache.configure_inductor_cache()
import torch._inductor.config as c, torch._inductor.cpu_vec_isa as m
print(json.dumps({"ok": c.cpp.vec_isa_ok, "valid": [str(i) for i in m.valid_vec_isa_list()],
                  "pick": str(m.pick_vec_isa())}))
"""


def _process(cache: Path, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "NBTORCH_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_trusts_the_first_ones_probe(tmp_path):
    first = _process(tmp_path)
    records = list((tmp_path / "vec-isa").glob("*.json"))
    assert first["ok"] is None and len(records) == 1  # probed, verdict written
    assert json.loads(records[0].read_text()) == first["valid"]
    second = _process(tmp_path)
    assert second == {**first, "ok": True}  # no probe, the same ISAs and the same choice (so the same code)
    assert _process(tmp_path, NBTORCH_TRUST_VEC_ISA="0")["ok"] is None  # switched off: probes again


@pytest.fixture
def fresh(monkeypatch):
    """A process state without a verdict: nbtorch.runtime.vec_isa's answer and Inductor's switch reset afterwards."""
    import torch._inductor.config as inductor_config
    import torch._inductor.cpu_vec_isa as isa_module

    import nbtorch.runtime.vec_isa as vec_isa

    monkeypatch.setattr(vec_isa, "_done", None)
    monkeypatch.delenv(vec_isa.TRUST_ENV, raising=False)
    with inductor_config.patch({"cpp.vec_isa_ok": None}):  # torch's own config patch (restored on exit)
        yield vec_isa, isa_module, inductor_config


def test_no_record_when_the_probe_rejects_an_isa(tmp_path, fresh, monkeypatch):
    vec_isa, isa_module, inductor_config = fresh
    listed = vec_isa._listed(isa_module)
    monkeypatch.setattr(isa_module, "valid_vec_isa_list", lambda: [i for i in isa_module.supported_vec_isa_list
                                                                   if str(i) in listed[1:]])
    assert vec_isa.trust_vec_isa_probe(tmp_path) is False
    assert not (tmp_path / "vec-isa").exists() and inductor_config.cpp.vec_isa_ok is None


def test_a_damaged_or_other_record_is_not_trusted(tmp_path, fresh):
    vec_isa, isa_module, inductor_config = fresh
    path = vec_isa.record_path(tmp_path, vec_isa._listed(isa_module), vec_isa._compiler_identity())
    path.parent.mkdir(parents=True)
    # a damaged record, and another machine's (a list that is not this one's: ["avx2"] alone is this one's on a
    # processor without AVX-512)
    for text in ("{not json", json.dumps(vec_isa._listed(isa_module) + ["not-an-isa"])):
        path.write_text(text)
        vec_isa._done = None
        assert vec_isa.trust_vec_isa_probe(tmp_path) is False and inductor_config.cpp.vec_isa_ok is None
    assert json.loads(path.read_text()) == vec_isa._listed(isa_module)  # the probe passed: rewritten
    vec_isa._done = None
    assert vec_isa.trust_vec_isa_probe(tmp_path) is True and inductor_config.cpp.vec_isa_ok is True


def test_the_users_switch_and_the_environment_are_left_alone(tmp_path, fresh, monkeypatch):
    vec_isa, _, inductor_config = fresh
    inductor_config.cpp.vec_isa_ok = False
    assert vec_isa.trust_vec_isa_probe(tmp_path) is False and inductor_config.cpp.vec_isa_ok is False
    assert not (tmp_path / "vec-isa").exists()
    vec_isa._done = None
    inductor_config.cpp.vec_isa_ok = None
    monkeypatch.setenv(vec_isa.TRUST_ENV, "0")
    assert vec_isa.trust_vec_isa_probe(tmp_path) is False and not (tmp_path / "vec-isa").exists()


def test_torch_switch_is_restored_after_the_tests():
    import torch._inductor.config as inductor_config

    assert inductor_config.cpp.vec_isa_ok in (None, True)  # still there: the fixture undid its patch
