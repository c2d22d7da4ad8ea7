"""The user pages stay readable and current: sizes, no development history, one value per figure.

* every page of README.md and docs/ but the log under :data:`MAX_LINES` lines, all of them together under
  :data:`MAX_WORDS` words (the guide is read in an hour);
* no word of how the project was developed outside docs/log.md: issue numbers, sessions, commits and builds,
  dates (except in a link to the log), "no longer", "previously", ... (:data:`HISTORY`);
* a figure quoted on two pages is the same on both: a value quoted with its esd (``57.815 ± 0.046``) has one esd
  everywhere, and the figures of :data:`FIGURES` (the main job's steps, the sweep's cell, ...) one value;
* docs/options.md is what the parser makes (``scripts/options_page.py --check``), and ``--help`` says what the
  defaults become with ``--expt``.

Each checker is tested on a page made to fail it.  Reads text only: seconds.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "docs" / "log.md"
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p != LOG)

MAX_LINES = 350
MAX_WORDS = 30_000

#: how the project was developed: words for the log only
HISTORY = [
    (re.compile(r"\b[Ii]ssues?\b(?! (?:a|one|the)? ?warning)"), "an issue"),
    (re.compile(r"(?<![\w&])#\d{1,3}\b"), "an issue number"),
    (re.compile(r"\bsessions?\b", re.I), "a session"),
    (re.compile(r"\b(?:commit|build) [0-9a-f]{7,40}\b"), "a commit"),
    (re.compile(r"\bno longer\b|\bpreviously\b|\bused to be\b|\bthe old default\b|\bas it was then\b|\bthis change\b",
                re.I), "a 'before'"),
    (re.compile(r"\bbefore 20\d\d\b", re.I), "a 'before'"),
]
#: a date: allowed only as a link target into the log (``log.md#2026-11-29``)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LOG_LINK = re.compile(r"\]\((?:docs/)?log\.md#[^)]*\)")


def history_words(text: str) -> list[str]:
    """The development history a page's text mentions: ``'line N: <what>: <excerpt>'``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        bare = LOG_LINK.sub("](log.md)", line)
        for pattern, what in HISTORY + [(DATE, "a date")]:
            m = pattern.search(bare)
            if m:
                found.append(f"line {number}: {what}: {bare[max(0, m.start() - 30):m.end() + 30]!r}")
    return found


#: ``value ± esd`` (also ``value +/- esd``)
WITH_ESD = re.compile(r"(?<![\d.])(-?\d+\.\d+) ?(?:±|\+/-) ?(\d+\.?\d*(?:e-?\d+)?)")
#: ``value(esd)``, the esd in units of the value's last digits: 57.881(31) is 57.881 ± 0.031
WITH_DIGITS = re.compile(r"(?<![\d.])(-?\d+\.(\d+))\((\d+)\)")


def quoted_esds(text: str) -> list[tuple[str, float]]:
    """``(value, esd)`` of every value quoted with an esd, in either style."""
    found = [(value, float(esd)) for value, esd in WITH_ESD.findall(text)]
    found += [(value, int(esd) * 10.0 ** -len(decimals)) for value, decimals, esd in WITH_DIGITS.findall(text)]
    return found

#: figures quoted on several pages: name -> a pattern whose groups are the figure (its context makes it that one)
FIGURES = {
    "the main job's steps and evaluations": re.compile(r"loss: 1\.66534e\+07 -> [\d.]+ in (\d+) steps \((\d+) evaluations\)"),
    "the sweep's natural command against the full-data cell (%)": re.compile(
        r"natural command[^\n|]*\|\s*\**\s*([−+-]0\.\d+)[^,\n]*,\s*([−+-]0\.\d+)[^,\n]*,\s*([−+-]0\.\d+)"),
    "the thaumatin spots beside DIALS (px)": re.compile(r"0\.96 ?/ ?0\.98 px.{0,80}?(\d\.\d\d) ?/ ?(\d\.\d\d) px", re.S),
}


def figures_of(texts: dict[str, str]) -> list[str]:
    """Disagreements between pages: a value with two esds, or one of :data:`FIGURES` with two values."""
    problems = []
    esds: dict[str, dict[float, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, text in texts.items():
        for value, esd in quoted_esds(text):
            if len(value.split(".")[1]) >= 3:  # 57.815 ± 0.046; not 0.5 ± 0.1 of a rule of thumb
                esds[value][round(esd, 12)].add(name)
    for value, by_esd in esds.items():
        if len(by_esd) > 1:
            pages = {p for names in by_esd.values() for p in names}
            if len(pages) > 1:
                problems.append(f"{value} quoted with esds {sorted(by_esd)} on {sorted(pages)}")
    for figure, pattern in FIGURES.items():
        seen: dict[tuple, set[str]] = defaultdict(set)
        for name, text in texts.items():
            for m in pattern.finditer(text):
                seen[tuple(g.replace("−", "-") for g in m.groups())].add(name)
        if len(seen) > 1:
            problems.append(f"{figure}: {dict((k, sorted(v)) for k, v in seen.items())}")
    return problems


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def too_long(text: str) -> int | None:
    """The page's line count when it is :data:`MAX_LINES` or more (None: short enough)."""
    lines = text.count("\n")
    return lines if lines >= MAX_LINES else None


def too_many_words(texts: dict[str, str]) -> str | None:
    """What is too long when the pages together hold :data:`MAX_WORDS` words or more (None: they read in an hour)."""
    counts = {name: len(text.split()) for name, text in texts.items()}
    total = sum(counts.values())
    if total < MAX_WORDS:
        return None
    biggest = ", ".join(f"{n} {w}" for n, w in sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    return f"{total} words outside the log (under {MAX_WORDS}); the longest: {biggest}"


# ------------------------------------------------------------------------------ the pages


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_is_short(page):
    lines = too_long(page.read_text(encoding="utf-8"))
    assert lines is None, f"{_name(page)}: {lines} lines (at most {MAX_LINES - 1}; research notes go to docs/log.md)"


def test_pages_read_in_an_hour():
    problem = too_many_words({_name(p): p.read_text(encoding="utf-8") for p in PAGES})
    assert problem is None, problem


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_has_no_development_history(page):
    found = history_words(page.read_text(encoding="utf-8"))
    assert not found, f"{_name(page)}: " + "; ".join(found[:5])


def test_every_figure_is_quoted():
    """The figures' patterns find what they stand for (a pattern that finds nothing would check nothing)."""
    texts = {_name(p): p.read_text(encoding="utf-8") for p in PAGES}
    for figure, pattern in FIGURES.items():
        assert any(pattern.search(t) for t in texts.values()), f"no page quotes {figure}"


def test_a_figure_has_one_value():
    problems = figures_of({_name(p): p.read_text(encoding="utf-8") for p in PAGES})
    assert not problems, "; ".join(problems)


def test_options_page_is_current():
    import runpy

    page = runpy.run_path(str(ROOT / "scripts" / "options_page.py"))
    assert (ROOT / "docs" / "options.md").read_text(encoding="utf-8") == page["render"](), \
        "docs/options.md is not what the parser makes: run python scripts/options_page.py"


def test_help_says_what_expt_changes():
    from refine.cli.parser import build_parser

    helps = {o: a.help for a in build_parser()._actions for o in a.option_strings}
    for option in ("--model", "--refine", "--symmetry", "--spot-window", "--subsample", "--fix", "--shared",
                   "--per-image", "--geometry-prior"):
        assert "--expt" in helps[option], f"{option}'s help does not say what its default becomes with --expt"


# ------------------------------------------------------------------------------ the checkers fail


def test_history_checker_finds_history():
    page = ("A line.\nThe default before 2026-11-27 was 10 (issue #45).\nSee [the log](log.md#2026-11-29).\n"
            "As it was then, build fba3412 printed it.\n")
    found = history_words(page)
    assert any(f.startswith("line 2: an issue") for f in found)
    assert any(f.startswith("line 2: a date") for f in found)
    assert not any(f.startswith("line 3") for f in found), "a link into the log is allowed"
    assert any(f.startswith("line 4: a commit") for f in found) and any("'before'" in f for f in found)
    assert not history_words("The run says so in one warning line; the spots of each image.\n")


def test_figure_checker_finds_two_values():
    pages = {"a.md": "a = 57.815 ± 0.046 Å", "b.md": "the cell 57.815 ± 0.031 Å"}
    assert figures_of(pages) and "57.815" in figures_of(pages)[0]
    assert not figures_of({"a.md": "a = 57.815 ± 0.046 Å", "b.md": "a = 57.815 ± 0.046 Å"})
    assert not figures_of({"a.md": "a = 57.815 ± 0.046 Å", "b.md": "a, c: 57.815(46), 150.54(13)"})
    assert figures_of({"a.md": "a = 57.815 ± 0.046 Å", "b.md": "a, c: 57.815(31), 150.54(13)"})
    sweep = "| the natural command (above) | {} % |"
    assert figures_of({"a.md": sweep.format("−0.086, +0.037, +0.079"),
                       "b.md": "| nbtorch, natural command | -0.086 (0.11), +0.037 (0.09), +0.070 (0.05) % |"})
    steps = "loss: 1.66534e+07 -> 2092.62 in {} steps (164 evaluations)"
    assert figures_of({"README.md": steps.format(140), "docs/python.md": steps.format(151)})


def test_size_checks_fail_on_a_long_page():
    assert too_long("line\n" * MAX_LINES) == MAX_LINES and too_long("line\n" * (MAX_LINES - 1)) is None
    half = "word " * (MAX_WORDS // 2)
    assert too_many_words({"a.md": half, "b.md": half}).startswith(f"{MAX_WORDS} words outside the log")
    assert too_many_words({"a.md": half, "b.md": "word"}) is None


# ------------------------------------------------------------------------------ links between the pages

LINK = re.compile(r"\]\(([^)\s]+?\.md)(?:#([^)\s]+))?\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces as -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), defaultdict(int)
    blocks_out = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.M | re.S)
    for line in blocks_out.splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            base = slug(m.group(1))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def broken_links(page: Path) -> list[str]:
    """The links of ``page`` to a page that does not exist or to a heading the target does not have."""
    broken = []
    text = page.read_text(encoding="utf-8")
    for target, anchor in LINK.findall(text):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        if not path.is_file():
            broken.append(f"{target}: no such page")
        elif anchor and anchor not in anchors(path.read_text(encoding="utf-8")):
            broken.append(f"{target}#{anchor}: no such heading")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_reach_a_page_and_a_heading(page):
    broken = broken_links(page)
    assert not broken, f"{_name(page)}: " + "; ".join(sorted(set(broken)))


def test_link_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## The `--joint` mode: two images\n\n[x](b.md) [y](a.md#nope)\n"
                                   "[z](a.md#the---joint-mode-two-images) [t](a.md#title)\n")
    assert sorted(broken_links(tmp_path / "a.md")) == ["a.md#nope: no such heading", "b.md: no such page"]
