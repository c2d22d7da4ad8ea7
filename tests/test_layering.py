"""The import rules of docs/architecture.md, checked on every module's source (``ast``, nothing is imported):

* ``nbtorch.physics`` imports torch, the standard library and itself only (pure tensor functions);
* ``nbtorch.io`` never imports torch (file formats are numpy; optional readers: h5py, hdf5plugin, fabio, gemmi,
  msgpack, tomli);
* ``nbtorch`` never imports ``refine``, ``losses`` or ``experiments``; ``losses`` never imports ``refine`` or
  ``experiments``; ``refine`` never imports ``experiments``; nothing in the packages imports ``experiments`` but
  ``experiments`` itself.

Function-level (lazy) imports count as much as top-level ones.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nbtorch", "refine", "losses", "experiments")
IO_THIRD_PARTY = {"numpy", "h5py", "hdf5plugin", "fabio", "gemmi", "msgpack", "tomli"}


def imports_of(path: Path, module: str) -> list[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved against ``module``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                out.append(".".join(base + ([node.module] if node.module else [])))
            else:
                out.append(node.module)
    return out


def rule_violations(module: str, imported: str) -> str | None:
    """Why ``module`` may not import ``imported`` (None: allowed)."""
    top = imported.split(".")[0]
    if top in sys.stdlib_module_names or top == "__future__":
        return None
    if module.startswith("nbtorch.physics"):
        if top == "torch" or imported.startswith("nbtorch.physics"):
            return None
        return "nbtorch.physics imports only torch, the standard library and nbtorch.physics"
    if module.startswith("nbtorch.io"):
        if top == "torch":
            return "nbtorch.io never imports torch"
        if top in IO_THIRD_PARTY or imported.startswith("nbtorch.io") or imported == "nbtorch.errors":
            return None
        return "nbtorch.io imports numpy, optional file-format libraries, nbtorch.io and nbtorch.errors only"
    if top == "experiments" and not module.startswith("experiments"):
        return "nothing imports experiments"
    if module.startswith("nbtorch") and top in ("refine", "losses"):
        return "nbtorch never imports refine or losses"
    if module.startswith("losses") and top == "refine":
        return "losses never imports refine"
    return None


def violations(root: Path) -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            for imported in imports_of(path, module):
                why = rule_violations(module, imported)
                if why:
                    out.append(f"{path.relative_to(root)}: imports {imported}: {why}")
    return out


def test_the_packages_keep_the_layering():
    assert violations(ROOT) == []


@pytest.mark.parametrize("module, source, message", [
    ("nbtorch/physics/bad.py", "import numpy\n", "nbtorch.physics imports only torch"),
    ("nbtorch/physics/bad.py", "from nbtorch.io import hkl\n", "nbtorch.physics imports only torch"),
    ("nbtorch/io/bad.py", "def f():\n    import torch\n", "nbtorch.io never imports torch"),
    ("nbtorch/bad.py", "from refine.solver.runner import refine\n", "nbtorch never imports refine or losses"),
    ("nbtorch/bad.py", "import losses\n", "nbtorch never imports refine or losses"),
    ("losses/bad.py", "from refine import x\n", "losses never imports refine"),
    ("refine/bad.py", "from experiments.cli import Parser\n", "nothing imports experiments"),
    ("refine/sub/bad.py", "from ...experiments import x\n", "nothing imports experiments"),
])
def test_the_checker_finds_each_kind_of_violation(tmp_path, module, source, message):
    for package in PACKAGES:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and message in found[0], found


def test_allowed_imports_pass(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
    (tmp_path / "nbtorch" / "physics").mkdir()
    (tmp_path / "nbtorch" / "physics" / "ok.py").write_text("import math\nimport torch\nfrom . import rotation\n")
    (tmp_path / "nbtorch" / "io").mkdir()
    (tmp_path / "nbtorch" / "io" / "ok.py").write_text("import numpy\nfrom nbtorch.errors import InputError\n")
    (tmp_path / "refine" / "ok.py").write_text("import torch\nfrom nbtorch import Simulator\nfrom losses import x\n")
    (tmp_path / "experiments" / "ok.py").write_text("from experiments.cli import Parser\nimport refine\n")
    assert violations(tmp_path) == []
