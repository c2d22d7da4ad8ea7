"""The import rules of docs/architecture.md, checked on every module's source (``ast``, nothing is imported):

* ``nbtorch.physics`` imports torch, the standard library and itself only (pure tensor functions);
* ``nbtorch.io`` never imports torch (file formats are numpy; optional readers: h5py, hdf5plugin, fabio, pycbf, gemmi,
  msgpack, tomli);
* ``nbtorch`` never imports ``refine``, ``losses`` or ``experiments``; ``losses`` never imports ``refine`` or
  ``experiments``; ``refine`` never imports ``experiments``; nothing in the packages imports ``experiments`` but
  ``experiments`` itself;
* ``refine`` reaches the physics only through the Simulator and nbtorch's public modules: never
  ``nbtorch.physics``;
* no import cycle between modules; no private name (``_x``) of one module imported or used by another;
* at most 12 modules directly in ``refine/`` (the rest live in its rooms; ``nbtorch/``'s in tests/test_code_shape.py); no function parameter typed
  ``argparse.Namespace`` outside the command-line modules;
* the command line's options (``refine.cli.options.Options``) stay at the door: nothing but the command-line modules
  (``refine.cli``, ``refine.tools``, ``nbtorch.cli``, ``nbtorch.tools``, ``experiments``) imports ``refine.cli``, not even
  for a type; the library takes typed values (:class:`refine.inputs.measurement.DialsFiles`, settings, arrays).

Function-level (lazy) imports count as much as top-level ones; imports under ``if TYPE_CHECKING:`` (types
only, never run) do not count for cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nbtorch", "refine", "losses", "experiments")
IO_THIRD_PARTY = {"numpy", "h5py", "hdf5plugin", "fabio", "gemmi", "msgpack", "tomli", "pycbf"}


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
    if module.startswith("refine") and imported.startswith("nbtorch.physics"):
        return "refine reaches the physics only through the Simulator (never nbtorch.physics)"
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
    ("refine/bad.py", "from nbtorch.physics.rotation import rotation_matrix_xyz\n", "only through the Simulator"),
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


# ------------------------------------------------------------------------------ the module graph


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of the statements under ``if TYPE_CHECKING:`` (imports for annotations only; lines, not node
    ids: :func:`_bindings` walks a tree of its own)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(range(child.lineno, child.end_lineno + 1))
    return skip


def _bindings(module: str, path: Path, modules: dict[str, Path]):
    """Yield ``(node, base, name, bound, target)`` per imported name: ``base`` the module imported from, ``name``
    as imported, ``bound`` the local name, ``target`` the project module the name is (or lives in; None outside
    the project)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name, a.name, a.asname or a.name, a.name if a.name in modules else None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                target = full if full in modules else base if base in modules else None
                yield node, base, a.name, a.asname or a.name, target


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports (lazy imports included, TYPE_CHECKING imports not)."""
    modules = project_modules(root)
    graph = {}
    for module, path in modules.items():
        skip = _type_checking_only(ast.parse(path.read_text()))
        graph[module] = {t for node, _, _, _, t in _bindings(module, path, modules)
                         if t is not None and t != module and node.lineno not in skip}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def private_uses(root: Path) -> list[str]:
    """``module: name`` for each private name of another project module imported or read as an attribute."""
    modules = project_modules(root)
    out = []
    for module, path in modules.items():
        aliases = {}
        for node, base, name, bound, target in _bindings(module, path, modules):
            if target is None:
                continue
            if target == f"{base}.{name}" or isinstance(node, ast.Import):
                aliases[bound] = target  # a module bound to a name
            elif target != module and name.startswith("_") and not name.startswith("__"):
                out.append(f"{module}: imports {base}.{name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != module and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                out.append(f"{module}: uses {aliases[node.value.id]}.{node.attr}")
    return sorted(set(out))


def test_no_import_cycle():
    assert cycles(import_graph(ROOT)) == []


def test_no_private_name_crosses_modules():
    assert private_uses(ROOT) == []


def test_the_graph_checks_find_what_they_look_for(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
    (tmp_path / "refine" / "a.py").write_text("from refine.b import f\n")
    (tmp_path / "refine" / "b.py").write_text("def f():\n    from refine.c import _g\n")
    (tmp_path / "refine" / "c.py").write_text("import refine.a as a\nx = a._y\n")
    (tmp_path / "refine" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from refine.a import f\n")
    assert cycles(import_graph(tmp_path)) == [["refine.a", "refine.b", "refine.c"]]
    assert private_uses(tmp_path) == ["refine.b: imports refine.c._g", "refine.c: uses refine.a._y"]


# command-line modules: they turn argv into typed values, so they alone may take an argparse Namespace
CLI_MODULES = ("refine.cli.", "nbtorch.cli.", "nbtorch.tools.", "refine.tools.", "experiments.")


def test_refine_keeps_its_rooms():
    """At most 12 modules directly in refine/ (today the front door, ``__init__``, and ``settings``); the rest in
    rooms."""
    top = sorted(p.name for p in (ROOT / "refine").glob("*.py"))
    assert len(top) <= 12, top


def test_no_namespace_parameter_outside_the_command_lines():
    found = []
    for module, path in project_modules(ROOT).items():
        if module.startswith(CLI_MODULES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.annotation is not None and "Namespace" in ast.unparse(a.annotation):
                        found.append(f"{module}.{node.name}({a.arg})")
    assert found == []


def cli_imports(root: Path) -> list[str]:
    """``module: imports name`` for each import of ``refine.cli`` (types under ``TYPE_CHECKING`` included) by a module
    that is not a command line's."""
    modules = project_modules(root)
    out = []
    for module, path in modules.items():
        if module.startswith(CLI_MODULES):
            continue
        for _, base, name, _, _ in _bindings(module, path, modules):
            full = f"{base}.{name}"
            if base == "refine.cli" or base.startswith("refine.cli.") or full == "refine.cli":
                out.append(f"{module}: imports {full}")
    return sorted(set(out))


def test_the_command_line_options_stay_at_the_door():
    assert cli_imports(ROOT) == []


def test_the_door_check_finds_an_options_import(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
    (tmp_path / "refine" / "cli").mkdir()
    (tmp_path / "refine" / "cli" / "options.py").write_text("class Options: ...\n")
    (tmp_path / "refine" / "cli" / "run.py").write_text("from refine.cli.options import Options\n")
    (tmp_path / "refine" / "inputs").mkdir()
    (tmp_path / "refine" / "inputs" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from refine.cli.options import Options\n")
    (tmp_path / "refine" / "many").mkdir()
    (tmp_path / "refine" / "many" / "bad.py").write_text("def f():\n    from ..cli import single\n")
    (tmp_path / "experiments" / "script.py").write_text("from refine.cli.options import Options\n")
    assert cli_imports(tmp_path) == ["refine.inputs.bad: imports refine.cli.options.Options",
                                     "refine.many.bad: imports refine.cli.single"]
