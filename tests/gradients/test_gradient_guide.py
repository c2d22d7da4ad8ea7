"""docs/gradients.md, "Writing a new gradient test": the guidance is there and its example test passes as written."""

from __future__ import annotations

import re
from pathlib import Path

from gradient_probes import one_thread_eager  # noqa: F401  (autouse fixture)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "gradients.md"
HEADING = "## Writing a new gradient test"


def _section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    assert HEADING in text, f"{PAGE.name}: no section {HEADING!r}"
    return text.split(HEADING, 1)[1].split("\n## ", 1)[0]


def test_the_guide_says_eager_float64_and_never_compiled():
    section = _section()
    for words in ("**eager**", "**never compiled**", "**float64**", "nbtorch.eager()", "compile=False",
                  "test_compiled.py", "gradgradcheck"):
        assert words in section, words


def test_the_guides_example_passes():
    (example,) = re.findall(r"```python\n(.*?)```", _section(), re.S)
    namespace: dict = {}
    exec(compile(example, f"{PAGE.name} example", "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert len(tests) == 1
    tests[0]()
