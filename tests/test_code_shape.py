"""The shape of the code (issue #31), checked on the sources with ``ast`` (nothing is imported):

* no function (or method) in ``nbtorch/`` or ``refine/`` is longer than 80 lines, except the option tables of
  :data:`OPTION_TABLES`;
* no module in ``nbtorch/`` or ``refine/`` is longer than 600 lines (issue #46), except those of
  :data:`MODULES_TO_SPLIT` (each still over it: split it, then strike it off);
* ``nbtorch``'s import graph has no cycle (function-level imports count), in particular neither
  ``nbtorch.runtime.policy`` <-> ``nbtorch.runtime.precompile`` nor ``nbtorch.physics.kernel`` <-> ``nbtorch.physics.jacobian``;
* one home per concept: ``torch.compile`` is called in :mod:`nbtorch.runtime.policy` only (the compile policy's one
  decision point); image formats are told in :mod:`nbtorch.io.images` only; the "``PROG: error: ...``, exit 2"
  wrapper is :func:`nbtorch.cli.support.run_main` only; the beam-centre conventions' rules live in
  :mod:`nbtorch.geometry.beam_centre` (the DIALS frame in :mod:`nbtorch.dials.geometry`);
* ``nbtorch/`` keeps its rooms: at most 12 modules directly in it (:data:`NBTORCH_ROOMS` hold the rest);
* module names say what they hold: no ``nbtorch.setup`` (configuration resolution is ``nbtorch.rules.resolve``), no
  ``experiments.imagefile`` (the PNG writer is ``experiments.png``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
#: functions that are option tables (one ``add_argument`` after another), allowed to be longer
OPTION_TABLES = {"refine/cli/parser.py::build_parser"}


def _sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def long_functions(paths, limit: int = MAX_LINES, root: Path = ROOT) -> list[str]:
    """``path::name (n lines)`` (path relative to ``root``) of every function longer than ``limit`` lines
    (decorators not counted)."""
    out = []
    for path in paths:
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root).as_posix()}::{node.name} ({n} lines)")
    return out


def test_no_function_over_80_lines():
    found = [f for f in long_functions(_sources("nbtorch", "refine")) if f.split(" (")[0] not in OPTION_TABLES]
    assert found == []


def test_the_length_check_counts_lines(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 80)
    assert long_functions([path], root=tmp_path) == ["m.py::long (81 lines)"]


# ------------------------------------------------------------------------------ module length
MAX_MODULE_LINES = 600
#: modules still over MAX_MODULE_LINES, not yet split by job (issue #46)
MODULES_TO_SPLIT: set[str] = set()


def long_modules(paths, limit: int = MAX_MODULE_LINES, root: Path = ROOT) -> list[str]:
    """``path (n lines)`` (path relative to ``root``) of every module longer than ``limit`` lines."""
    out = []
    for path in paths:
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root).as_posix()} ({n} lines)")
    return out


def test_no_module_over_600_lines():
    found = [m for m in long_modules(_sources("nbtorch", "refine")) if m.split(" (")[0] not in MODULES_TO_SPLIT]
    assert found == []


def test_the_modules_to_split_are_still_long():
    """An entry of :data:`MODULES_TO_SPLIT` leaves it once its module is split."""
    long = {m.split(" (")[0] for m in long_modules(_sources("nbtorch", "refine"))}
    assert MODULES_TO_SPLIT <= long


def test_the_module_length_check_counts_lines(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * 600)
    (tmp_path / "long.py").write_text("x = 1\n" * 601)
    assert long_modules(sorted(tmp_path.glob("*.py")), root=tmp_path) == ["long.py (601 lines)"]


# ------------------------------------------------------------------------------ import cycles
# the rule (no cycle anywhere in the packages) and its checker live in tests/test_layering.py


@pytest.mark.parametrize("module, never", [("nbtorch.runtime.precompile", "nbtorch.runtime.policy"),
                                           ("nbtorch.physics.kernel", "nbtorch.physics.jacobian"),
                                           ("nbtorch.runtime.cache", "nbtorch.runtime.policy")])
def test_the_former_cycles_stay_broken(module, never):
    from test_layering import import_graph

    assert never not in import_graph(ROOT)[module]


# ------------------------------------------------------------------------------ one home per concept


def _calls(path: Path, dotted: str) -> list[int]:
    """Lines where ``path`` calls ``dotted`` (e.g. ``torch.compile``) by that name."""
    return [node.lineno for node in ast.walk(_tree(path))
            if isinstance(node, ast.Call) and ast.unparse(node.func) == dotted]


def test_torch_compile_is_called_by_the_runtime_only():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in _sources("nbtorch", "refine", "losses", "experiments")
             for line in _calls(p, "torch.compile")]
    assert found and all(f.startswith("nbtorch/runtime/policy.py:") for f in found), found


def _defines(path: Path, name: str) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(_tree(path)))


@pytest.mark.parametrize("name, home", [
    ("detect_format", "nbtorch/io/images.py"),
    ("run_main", "nbtorch/cli/support.py"),
    ("close_point_m", "nbtorch/geometry/beam_centre.py"),
    ("header_beam_offsets", "nbtorch/geometry/beam_centre.py"),
    ("swung_beam_spot_m", "nbtorch/geometry/beam_centre.py"),
    ("dials_from_nb", "nbtorch/dials/geometry.py"),
    ("dials_origin_mm", "nbtorch/dials/geometry.py"),
    ("configure_inductor_cache", "nbtorch/runtime/cache.py"),
    ("cache_dir", "nbtorch/runtime/cache.py"),
    ("fit_scale_background", "refine/inputs/scale_start.py"),
    ("crystal_system", "refine/fitting/space_groups.py"),
])
def test_one_home(name, home):
    homes = [p.relative_to(ROOT).as_posix() for p in _sources("nbtorch", "refine", "losses", "experiments")
             if _defines(p, name)]
    assert homes == [home]


def _own_exit_2(path: Path) -> bool:
    """Whether ``path`` has an ``except ...InputError...:`` handler that returns 2 itself."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ExceptHandler) and node.type is not None and "InputError" in ast.unparse(node.type):
            if any(isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and n.value.value == 2
                   for n in ast.walk(node)):
                return True
    return False


def test_bad_input_exit_2_goes_through_run_main():
    found = [p.relative_to(ROOT).as_posix() for p in _sources("nbtorch", "refine", "experiments") if _own_exit_2(p)]
    assert set(found) == {"nbtorch/cli/support.py"}


def test_no_hand_coded_beam_centre_rules_in_the_command():
    """nbtorch.cli.main asks nbtorch.geometry.beam_centre and nbtorch.dials.geometry (no half pixels or axis swaps of its own)."""
    text = (ROOT / "nbtorch" / "cli" / "main.py").read_text()
    assert "close_point_m(" in text and "dials_origin_mm(" in text
    assert "-1000 * pix0" not in text and "close_from_org_m(" not in text


@pytest.mark.parametrize("gone, now", [("nbtorch/setup.py", "nbtorch/rules/resolve.py"),
                                       ("experiments/imagefile.py", "experiments/png.py")])
def test_names_say_what_the_module_holds(gone, now):
    assert not (ROOT / gone).exists() and (ROOT / now).is_file()
    old = gone.removesuffix(".py").replace("/", ".")
    users = [p.relative_to(ROOT).as_posix() for p in _sources("nbtorch", "refine", "losses", "experiments", "tests")
             if old in p.read_text() and p.name != "test_code_shape.py"]
    assert users == []


# ------------------------------------------------------------------------------ rooms
MAX_TOP_MODULES = 12
#: nbtorch's rooms, each a package by job (docs/architecture.md)
NBTORCH_ROOMS = ("geometry", "sampling", "rules", "runtime", "cli", "dials", "physics", "io", "tools")


def top_modules(package: Path) -> list[str]:
    """The modules directly in ``package`` (not in its rooms)."""
    return sorted(p.name for p in package.glob("*.py"))


def test_nbtorch_keeps_its_rooms():
    top = top_modules(ROOT / "nbtorch")
    assert len(top) <= MAX_TOP_MODULES, top
    assert all((ROOT / "nbtorch" / room / "__init__.py").is_file() for room in NBTORCH_ROOMS)


def test_the_room_check_counts_modules(tmp_path):
    for i in range(MAX_TOP_MODULES + 1):
        (tmp_path / f"m{i}.py").write_text("")
    (tmp_path / "room").mkdir()
    (tmp_path / "room" / "inner.py").write_text("")
    assert len(top_modules(tmp_path)) == MAX_TOP_MODULES + 1
