"""Fixtures of the nbtorch-refine tests: run the command in-process, write small measured images."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from refine.cli.main import main


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Keep the synthetic problems' structure-factor files out of the home directory."""
    if "NBTORCH_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("NBTORCH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "nbtorch_cache"))


class Run:
    """Outcome of one ``nbtorch-refine`` call."""

    def __init__(self, code: int, out: str, err: str, tmp: Path) -> None:
        self.code, self.out, self.err, self.tmp = code, out, err, tmp

    def json(self, name: str = "result.json") -> dict:
        return json.loads((self.tmp / name).read_text())


@pytest.fixture
def refine_cli(tmp_path, capsys, monkeypatch):
    """``refine_cli(*argv)`` runs ``nbtorch-refine`` in ``tmp_path`` and returns a :class:`Run`."""
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> Run:
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err, tmp_path)

    return run


