"""docs/simulator.md documents every flag the parser accepts."""

from __future__ import annotations

import re
from pathlib import Path

from nbtorch.cli.args import flag_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "simulator.md"


def test_every_flag_is_documented():
    text = DOC.read_text()
    documented = set(re.findall(r"`(-[A-Za-z_0-9]+)`", text))
    missing = [f for f in flag_names() if f not in documented]
    assert not missing, f"flags missing from docs/simulator.md: {missing}"


def test_documented_flags_exist_or_are_listed_as_unsupported():
    text = DOC.read_text()
    tables = text.split("### C flags not accepted")[0].split("## Flags", 1)[1]
    rows = [line for line in tables.splitlines() if line.startswith("| `-")]
    first_cells = [re.findall(r"`(-[A-Za-z_0-9]+)`", row.split("|")[1]) for row in rows]
    unknown = sorted({f for cell in first_cells for f in cell} - set(flag_names()))
    assert not unknown, f"docs/simulator.md documents flags the parser does not accept: {unknown}"
