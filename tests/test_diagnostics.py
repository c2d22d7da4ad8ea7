"""Diagnostics hooks (``nbtorch.diagnostics``, docs/diagnostics.md): ``every`` and ``min_interval_s`` against a fake
clock (the module's ``time``, replaced; nothing sleeps), ``logging_hook`` through caplog, and the page's example."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nbtorch import Simulator, config_from_args, diagnostics
from nbtorch.diagnostics import DiagnosticsHooks, logging_hook

DOCS = Path(__file__).resolve().parents[1] / "docs"
SMALL = ("-cell 100 100 100 90 90 90 -N 5 -lambda 6.2 -default_F 100 -distance 100 -pixel 0.1 -detpixels 24 "
         "-oversample 1").split()
DIAG = {"image_max": torch.tensor(2.5)}


@pytest.fixture
def clock(monkeypatch):
    """The diagnostics module's clock, set by hand: ``clock.now = 12.0``."""
    fake = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(diagnostics, "time", SimpleNamespace(monotonic=lambda: fake.now))
    return fake


def _deliveries(hooks: DiagnosticsHooks, clock, times: list[float], **subscribe) -> list[float]:
    got: list[float] = []
    hooks.subscribe(lambda d: got.append(clock.now), **subscribe)
    for t in times:
        clock.now = t
        hooks.emit(DIAG)
    return got


def test_min_interval_skips_renders_inside_the_interval(clock):
    got = _deliveries(DiagnosticsHooks(), clock, [1000.0, 1005.0, 1009.999, 1010.0, 1015.0, 1025.0, 1025.5],
                      min_interval_s=10.0)
    assert got == [1000.0, 1010.0, 1025.0]  # the interval counts from the last delivery; skipped ones are dropped


def test_every_and_min_interval_together(clock):
    """Due by ``every`` (renders 1, 3, 5, 7, 9: t = 0, 2, 4, 31, 60) and by the clock: a due render inside the interval is skipped,
    not deferred to the next render."""
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 30.0, 31.0, 32.0, 60.0, 61.0]
    got = _deliveries(DiagnosticsHooks(), clock, times, every=2, min_interval_s=10.0)
    assert got == [0.0, 31.0, 60.0]


def test_subscribers_keep_their_own_counts_and_clocks(clock):
    hooks = DiagnosticsHooks()
    fast, slow = [], []
    hooks.subscribe(lambda d: fast.append(d))
    hooks.subscribe(lambda d: slow.append(clock.now), min_interval_s=5.0)
    for t in (0.0, 1.0, 6.0):
        clock.now = t
        hooks.emit({"image_max": torch.tensor(1.0, requires_grad=True) * 2})
    assert len(fast) == 3 and slow == [0.0, 6.0]
    assert all(not v.requires_grad for d in fast for v in d.values())  # detached


def test_no_subscriber_reads_nothing_and_unsubscribe_stops():
    class Untouchable(dict):
        def items(self):
            raise AssertionError("read without a subscriber")

    hooks = DiagnosticsHooks()
    hooks.emit(Untouchable())
    got = []
    handle = hooks.subscribe(got.append)
    hooks.emit(DIAG)
    hooks.unsubscribe(handle)
    hooks.unsubscribe(handle)  # unknown handles are ignored
    hooks.emit(DIAG)
    assert len(got) == 1 and len(hooks) == 0
    with pytest.raises(ValueError, match="every"):
        hooks.subscribe(got.append, every=0)


# --- logging_hook -----------------------------------------------------------------------------------------------
def test_logging_hook_logs_one_line_on_the_given_logger(caplog):
    hook = logging_hook(logging.getLogger("test.diagnostics"), level=logging.WARNING)
    with caplog.at_level(logging.WARNING, logger="test.diagnostics"):
        hook({"image_max": torch.tensor(154.65234), "hkl0_min": torch.tensor([-3.0, -0.0, 2.0]),
              "n": torch.tensor([7], dtype=torch.int64)})
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("test.diagnostics", logging.WARNING, "diagnostics: image_max=154.652 hkl0_min=[-3, 0, 2] n=[7]")]


def test_logging_hook_default_logger_and_a_disabled_level(caplog):
    class Unread:
        def detach(self):
            raise AssertionError("tensor read although the level is disabled")

    hook = logging_hook()  # nbtorch.diagnostics at INFO
    with caplog.at_level(logging.WARNING, logger="nbtorch.diagnostics"):
        hook({"image_max": Unread()})
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger="nbtorch.diagnostics"):
        hook(DIAG)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("nbtorch.diagnostics", logging.INFO, "diagnostics: image_max=2.5")]


def test_logging_hook_on_a_simulator(caplog, clock):
    """Subscribed to a simulator: one line per delivered render, with the lookup statistics and the image's."""
    sim = Simulator(config_from_args(SMALL), compile=False)
    sim.diagnostics.subscribe(logging_hook(), every=2, min_interval_s=1.0)
    with caplog.at_level(logging.INFO, logger="nbtorch.diagnostics"):
        images = []
        for t in (0.0, 0.5, 0.6, 5.0, 6.0):  # renders 1, 3 and 5 are due by every=2; render 3 is inside 1 s
            clock.now = t
            images.append(sim())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    for line in lines:
        assert re.fullmatch(r"diagnostics: fraction_default_F=1 hkl0_min=\[\S+, \S+, \S+\] hkl0_max=\[\S+, \S+, \S+\] "
                            r"image_max=\S+ image_mean=\S+ image_sum=\S+", line), line
    assert f"image_max={float(images[0].max()):.6g} " in lines[0]


# --- the page ---------------------------------------------------------------------------------------------------
def test_diagnostics_page_is_linked_and_its_example_runs(caplog, monkeypatch):
    page = (DOCS / "diagnostics.md").read_text(encoding="utf-8")
    linked = [p.name for p in DOCS.glob("*.md") if p.name != "diagnostics.md" and "diagnostics.md" in p.read_text()]
    assert linked, "docs/diagnostics.md is linked from no other docs page"
    for key in ("fraction_default_F", "hkl0_min", "image_max", "min_interval_s", "every", "logging_hook"):
        assert key in page, key
    (example,) = re.findall(r"```python\n(.*?)```", page, re.S)
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # the test's logging configuration stays
    with caplog.at_level(logging.INFO, logger="nbtorch.diagnostics"):
        exec(compile(example, "docs/diagnostics.md", "exec"), {})
    assert 1 <= len(caplog.records) <= 2 and caplog.records[0].getMessage().startswith("diagnostics: ")
