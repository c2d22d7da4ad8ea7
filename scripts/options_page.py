"""docs/options.md, generated from ``nbtorch-refine``'s parser: every option, its value, default and meaning.

::

    python scripts/options_page.py            # rewrite docs/options.md
    python scripts/options_page.py --check    # exit 1 when docs/options.md is not what the parser makes

tests/test_options_page.py runs the check, so the page cannot drift from ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refine.cli.parser import build_parser  # noqa: E402

PAGE = ROOT / "docs" / "options.md"

HEADER = """# `nbtorch-refine` options

Every option of `nbtorch-refine`, as `nbtorch-refine --help` gives it, in its groups.  This page is generated from
the parser (`python scripts/options_page.py`; a test checks that it is current), so it says what the command does.
Which defaults an `--expt`/`--refl` input changes is said in each option's meaning; the guide pages show them in
use: [a still from DIALS](still-from-dials.md), [a rotation sweep from DIALS](sweep-from-dials.md),
[many stills](many-stills.md).  A `--config FILE.toml` takes the same names (`spot_window = 5`, `refine = [...]`;
[still-from-images.md](still-from-images.md) shows one).  The simulator's nanoBragg flags (`--model "..."`) are on
[simulator.md](simulator.md).
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        return "`" + "\\|".join(str(c) for c in action.choices) + "`"
    if isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    if action.metavar:
        return str(action.metavar)
    name = action.dest.upper()
    return f"{name} ..." if action.nargs in ("+", "*") else name


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.default is False:
        return ""
    return f"`{action.default}`"


def render() -> str:
    parser = build_parser()
    lines = [HEADER]
    for group in parser._action_groups:  # argparse keeps --help's groups here only
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += ["", f"## {group.title[0].upper()}{group.title[1:]}", "",
                  "| option | value | default | meaning |", "|---|---|---|---|"]
        for a in actions:
            help_text = (a.help or "").replace("%(default)s", str(a.default))
            for said in (f" (default {a.default})", f", default {a.default})"):
                help_text = help_text.replace(said, "" if said.startswith(" (") else ")")
            names = ", ".join(f"`{o}`" for o in a.option_strings)
            lines.append(f"| {names} | {_value(a)} | {_default(a)} | {_cell(help_text)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/options.md is not current")
    a = p.parse_args(argv)
    text = render()
    if a.check:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(ROOT)} is not what the parser makes: run python scripts/options_page.py")
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
