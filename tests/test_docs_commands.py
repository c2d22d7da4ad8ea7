"""The commands and paths the documentation names work (issue #47).

* Every ``nbtorch-refine``, ``nbtorch`` and ``python -m experiments.<name>`` command of README.md and docs/*.md
  (``` blocks and inline `...` spans; backslash continuations; ``.venv/bin/``, ``torchrun ... -m refine.cli``)
  is parsed by the real parser: :func:`refine.cli.parser.parse_namespace` (``--model``'s flags by
  :func:`nbtorch.cli.args.config_from_args`), :func:`nbtorch.cli.args.config_from_args`, each experiment's
  ``build_parser()``.  Every option must exist and every value be valid; files the options name need not
  exist (the parsers read none but ``--config`` and ``@FILE``, which must exist when they are the repository's).
* Every repository path a page names exists, and every example config under ``examples/`` parses.

docs/log.md is dated history, left as written.  Nothing here refines or simulates: seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from nbtorch.cli.args import config_from_args
from nbtorch.cli.support import expand_argument_files
from nbtorch.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "log.md")

#: top-level folders of the repository: a path starting with one of them names a repository file
REPO_DIRS = ("nbtorch", "refine", "losses", "experiments", "examples", "scripts", "tests", "docs")

#: ``@FILE`` names in the pages that are the reader's own files, not the repository's (illustrations)
READERS_FILES = {
    "stills.txt",     # a list of the reader's images (--images @stills.txt)
    "{stem}.model",   # one model per image, the --images template (docs/many-stills.md)
    "start.model",    # the reader's starting model of a sweep
    "nope.txt",       # docs/bad-inputs.md: the missing argument file whose error is shown
}

#: placeholders standing for a value: FILE, DIR, N, NAME, <flags>, ... ({stem} templates are values as they are)
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|<[^>]*>|\.\.\.)$")


# ------------------------------------------------------------------------------ finding the commands


def split_page(text: str) -> tuple[list[str], str]:
    """The ``` blocks of a page and the rest of its text (prose, with its inline spans)."""
    fence = r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```"  # a fence may be indented (in a list item)
    blocks = re.findall(fence, text, flags=re.M | re.S)
    prose = re.sub(fence, "", text, flags=re.M | re.S)
    return blocks, prose


def block_lines(block: str) -> list[str]:
    """The logical lines of a block: backslash continuations joined, and lines inside a quoted value
    (``--model "-mat ...`` over three lines); a ``$ `` prompt taken off."""
    out: list[str] = []
    pending = ""
    for line in re.sub(r"\\\n", " ", block).splitlines():
        line = (pending + " " + line.strip()).strip() if pending else line.strip()
        if line.count('"') % 2 and _START.search(line):  # an open quote: the value goes on
            pending = line
            continue
        pending = ""
        out.append(line[2:] if line.startswith("$ ") else line)
    return out + ([pending] if pending else [])


def inline_spans(prose: str) -> list[str]:
    """The inline code spans of prose (they may run over a line break)."""
    return [re.sub(r"\s+", " ", s).strip() for s in re.findall(r"`([^`]+)`", prose)]


#: a command's one-line error (``nbtorch-refine: error: ...``), the line after a command shown refused
_ERROR_LINE = re.compile(r"^(?:nbtorch-refine|nbtorch|python -m [\w.]+): error: ")

_START = re.compile(r"(?:^|\s)((?:\.venv/bin/)?(?:nbtorch-refine|nbtorch|torchrun|python)\b)")


def command_of(line: str) -> tuple[str, list[str]] | None:
    """``(kind, arguments)`` of the command a line or span runs, or None: kind ``refine`` (nbtorch-refine,
    ``torchrun ... -m refine.cli``), ``nbtorch`` or ``experiments.NAME``.  Optional ``[...]`` parts and
    ``<...>`` placeholders are left out; a trailing ``# comment`` too."""
    head = line.split()[0] if line.split() else ""
    if re.match(r"^[A-Z_]+=\S*$", head):  # an environment variable before the command
        line = line[len(head):].strip()
    if line.startswith("srun "):
        line = line[5:].strip()
    if not _START.match(line):
        return None
    if re.match(r"^(?:\.venv/bin/)?(?:nbtorch-refine|nbtorch|python -m [\w.]+)\s*(?::|\((?:spec|C) )", line):
        return None  # output lines: "nbtorch-refine: ...", "nbtorch (spec mode, ...): ..."
    text = line
    while True:  # optional parts, innermost first; a '[' starts a word (not -hkl[...] or $([ ... ]))
        shorter = re.sub(r"(^|\s)\[[^\[\]]*\]", r"\1", text)
        if shorter == text:
            break
        text = shorter
    text = re.sub(r"<[^<>]*>", "", text)
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    prog = tokens[0].removeprefix(".venv/bin/")
    if prog == "nbtorch-refine":
        return "refine", tokens[1:]
    if prog == "nbtorch":
        return "nbtorch", tokens[1:]
    if prog == "python" and tokens[1:2] == ["-m"] and len(tokens) > 2 and tokens[2].startswith("experiments."):
        return tokens[2], tokens[3:]
    if prog == "torchrun" and "-m" in tokens:
        at = tokens.index("-m")
        if tokens[at + 1:at + 2] == ["refine.cli"]:
            return "refine", tokens[at + 2:]
        if tokens[at + 1:at + 2] and tokens[at + 1].startswith("experiments."):
            return tokens[at + 1], tokens[at + 2:]
    return None


def commands_of(text: str) -> list[tuple[str, str, list[str], bool]]:
    """``(where, kind, arguments, fragment)`` of every command of a page; ``fragment``: an inline span, which
    may name an option without its value (`nbtorch-refine --expt`)."""
    blocks, prose = split_page(text)
    found = []
    for block in blocks:
        lines = block_lines(block) + [""]
        for line, after in zip(lines, lines[1:]):
            cmd = command_of(line)
            if cmd and not _ERROR_LINE.match(after):  # a command shown with its error is an example of bad input
                found.append((line, *cmd, False))
    for span in inline_spans(prose):
        cmd = command_of(span)
        if cmd and cmd[1]:  # `nbtorch-refine` alone names the command
            found.append((span, *cmd, True))
    return found


# ------------------------------------------------------------------------------ checking them


def _is_placeholder(token: str) -> bool:
    return bool(PLACEHOLDER.match(token))


def _dummy(action: argparse.Action) -> str:
    """A value ``action`` accepts, standing for a placeholder (``--wedges N``)."""
    if action.choices:
        return str(next(iter(action.choices)))
    for candidate in ("1", "x"):
        try:
            if action.type is None or callable(action.type) and action.type(candidate) is not None:
                return candidate
        except (ValueError, TypeError, argparse.ArgumentTypeError, InputError):
            continue
    return "1"


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _argument_files(tokens: list[str], where: str) -> list[str]:
    """``tokens`` with the repository's ``@FILE`` expanded and the reader's own (:data:`READERS_FILES`) left out."""
    out = []
    for tok in tokens:
        if tok.startswith("@") and len(tok) > 1:
            name = tok[1:]
            if (ROOT / name).is_file():
                out += expand_argument_files(["@" + str(ROOT / name)])
                continue
            if name in READERS_FILES or _is_placeholder(name):
                continue
            raise InputError(f"{where}: argument file {tok} is neither in the repository nor a reader's file")
        out.append(tok)
    return out


def check_model_flags(value: str, where: str = "--model") -> None:
    """``--model``'s value (or an ``nbtorch`` command line) parses as nanoBragg flags: ``...`` and placeholders
    left out, the repository's ``@FILE`` expanded, the files the flags name not read (``-img``/``-mask``)."""
    tokens = [t for t in _argument_files(shlex.split(value), where) if t != "..."]
    for flag in ("-img", "-mask"):  # their headers are read while parsing: the file is the reader's
        while flag in tokens:
            at = tokens.index(flag)
            del tokens[at:at + 2]
    config_from_args(tokens)


def _prepare(tokens: list[str], parser: argparse.ArgumentParser, fragment: bool) -> list[str]:
    """The arguments as the parser should see them: placeholders replaced by a valid value, ``...`` standing for
    more arguments left out, ``--config`` of a reader's file left out (of the repository's: its full path);
    in a fragment, an option named without its value only checked to exist."""
    actions = parser._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        name = tok.split("=", 1)[0]
        if tok.startswith("--") and name in actions and "=" not in tok and _takes_value(actions[name]):
            action = actions[name]
            values = []
            j = i + 1
            limit = action.nargs if isinstance(action.nargs, int) else (1 if action.nargs in (None, "?") else 10**6)
            while j < len(tokens) and len(values) < limit and not (tokens[j].startswith("--") or
                                                                    tokens[j] == "--"):
                values.append(tokens[j])
                j += 1
            if not values and fragment:
                i = j  # `nbtorch-refine --expt`: the option named, its value left to the prose
                continue
            values = [_dummy(action) if _is_placeholder(v) else v for v in values]
            if name == "--config" and values:
                path = ROOT / values[0]
                if path.is_file():
                    values[0] = str(path)
                elif values[0].split("/")[0] in REPO_DIRS:
                    raise InputError(f"--config {values[0]}: no such file in the repository")
                else:  # the reader's config (still.toml, a sweep's best.toml)
                    i = j
                    continue
            out += [tok, *values]
            i = j
            continue
        if tok != "..." and not re.match(r"^\$\w+$", tok):  # `... $resume`: a shell variable's words
            out.append(tok)
        i += 1
    return out


def check_refine(tokens: list[str], fragment: bool = False, parser: argparse.ArgumentParser | None = None,
                 where: str = "") -> argparse.Namespace:
    """nbtorch-refine's arguments parse (``parser``: one built by :func:`refine.cli.parser.build_parser`)."""
    from refine.cli.parser import build_parser, parse_namespace

    parser = parser if parser is not None else build_parser()
    ns = parse_namespace(_prepare(tokens, parser, fragment), parser)
    if getattr(ns, "model", None):
        check_model_flags(ns.model, f"{where} --model")
    return ns


def _argparse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, argparse's exit turned into an :class:`InputError`."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        raise InputError(err.getvalue().strip().splitlines()[-1].split(": error: ", 1)[-1]) from None


def check_experiment(module: str, tokens: list[str], fragment: bool = False) -> None:
    """``python -m experiments.NAME`` arguments parse by the script's own parser (and nbtorch-refine's where it
    takes its options)."""
    if module == "experiments.sweep":
        from experiments.sweep import build_parser
        parser = build_parser()
        check_refine(tokens, fragment, parser)
        from experiments.sweep import parse_args  # the script's own checks (--grace, --sampler-seed ...)
        parse_args(_prepare(tokens, parser, fragment))
    elif module == "experiments.stage_a_mapping":
        from experiments.stage_a_mapping import build_parser
        check_refine(tokens, fragment, build_parser())
    elif module == "experiments.mosaic_convergence":
        from experiments.mosaic_convergence import build_parser
        own, rest = (tokens[:tokens.index("--")], tokens[tokens.index("--") + 1:]) if "--" in tokens else (tokens, [])
        parser = build_parser()
        _argparse(parser, _prepare(own, parser, fragment))
        if rest:
            check_refine(rest, fragment)
    elif module in ("experiments.wedge_calibration", "experiments.serial_scale", "experiments.parity_report",
                    "experiments.merge_compare"):
        import importlib
        parser = importlib.import_module(module).build_parser()
        _argparse(parser, _prepare(tokens, parser, fragment))
    else:
        raise InputError(f"python -m {module}: no such experiment")


def check_command(kind: str, tokens: list[str], fragment: bool = False) -> str | None:
    """None if the command parses, else the parser's message."""
    if "--help" in tokens or "-h" in tokens:  # `nbtorch-refine --help`: the other options are checked
        tokens, fragment = [t for t in tokens if t not in ("--help", "-h")], True
    try:
        if kind == "refine":
            check_refine(tokens, fragment)
        elif kind == "nbtorch":
            check_model_flags(shlex.join(tokens), "nbtorch")
        else:
            check_experiment(kind, tokens, fragment)
    except (InputError, OSError) as exc:
        if fragment and str(exc).startswith("the following arguments are required"):
            return None  # a span in prose shows some of a command's options (`... --stills N --bad-fraction 0.03`)
        return str(exc)
    return None


def check_commands(text: str) -> list[str]:
    """One line per command of ``text`` (a page) that does not parse."""
    return [f"{where}\n    -> {msg}" for where, kind, tokens, fragment in commands_of(text)
            if (msg := check_command(kind, tokens, fragment))]


# ------------------------------------------------------------------------------ paths


_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*{}-]*[\w*}/])" % "|".join(REPO_DIRS))


def named_paths(text: str) -> list[str]:
    """The repository paths a page names (``refine/inputs/dials.py``, ``tests/x.py::test_y``, ``scripts/peer/...``),
    with markdown links' targets (relative to the page's folder: returned as ``./target`` for the caller)."""
    paths = [m.group(1) for m in _PATH.finditer(text)]
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    return paths + ["./" + link for link in links if "://" not in link]


def missing_paths(text: str, page_dir: Path = ROOT) -> list[str]:
    """The paths of :func:`named_paths` that exist nowhere (links: relative to ``page_dir``)."""
    missing = []
    for path in named_paths(text):
        base = page_dir if path.startswith("./") else ROOT
        clean = path.removeprefix("./").split("::")[0]
        clean = re.sub(r"/\.\.\.?$", "", clean).rstrip(".")  # scripts/peer/... names the folder
        if any(c in clean for c in "*{"):
            if not list(base.glob(re.sub(r"\{[^}]*\}", "*", clean))):
                missing.append(path)
        elif not (base / clean).exists():
            missing.append(path)
    return missing


#: absolute paths that are not this project's machines': the conda build's paths a dxtbx wheel records (docs/formats.md)
OTHERS_PATHS = ("/home/conda/feedstock_root/",)


def machine_paths(text: str) -> list[str]:
    """Absolute paths of one machine (``/work/...``, ``/home/user/...``) a page names."""
    found = re.findall(r"(?<![\w.])/(?:work|home|Users|scratch)/[\w./-]+", text)
    return [p for p in found if not p.startswith(OTHERS_PATHS)]


# ------------------------------------------------------------------------------ the tests


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_command_parses(page):
    bad = check_commands(page.read_text())
    assert not bad, f"{_page_id(page)}: commands the parsers refuse:\n" + "\n".join(bad)


def test_the_pages_have_commands():
    """The extraction finds the commands (an empty list would pass the test above vacuously)."""
    kinds = {kind for page in PAGES for _, kind, _, _ in commands_of(page.read_text())}
    assert {"refine", "nbtorch", "experiments.sweep", "experiments.stage_a_mapping",
            "experiments.mosaic_convergence", "experiments.wedge_calibration", "experiments.serial_scale"} <= kinds


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_named_path_exists(page):
    text = page.read_text()
    missing = missing_paths(text, page.parent)
    assert not missing, f"{_page_id(page)} names paths that do not exist: {missing}"
    assert not machine_paths(text), f"{_page_id(page)} names one machine's paths: {machine_paths(text)}"


def test_readme_indexes_every_page():
    readme = (ROOT / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not unlisted, f"README.md's documentation index leaves out {unlisted}"


@pytest.mark.parametrize("config", sorted((ROOT / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_parse(config):
    check_refine(["--config", str(config.relative_to(ROOT))])


@pytest.mark.parametrize("args", sorted((ROOT / "examples").glob("*.args")), ids=lambda p: p.name)
def test_example_argument_files_parse(args):
    check_model_flags(f"@{args.relative_to(ROOT)}")


def test_thaumatin_args_is_the_tutorial_model():
    """examples/thaumatin_still.args (``--model "@examples/thaumatin_still.args -hkl ..."``) is the tutorial
    config's model, flag for flag."""
    from nbtorch.io import read_toml

    model = read_toml(str(ROOT / "examples" / "thaumatin_still.toml"), "--config")["model"]
    args = (ROOT / "examples" / "thaumatin_still.args").read_text()
    assert shlex.split(args, comments=True) == shlex.split(model)


def test_stage_a_help_gives_its_learning_rate():
    from experiments.stage_a_mapping import _learning_rate, build_parser

    text = build_parser().format_help()
    assert f"default {_learning_rate(None):g}" in re.sub(r"\s+", " ", text.split("--lr LR", 2)[-1])[:80]


# ------------------------------------------------------------------------------ the test of the test


def test_checker_finds_a_misspelt_option():
    page = "Run\n\n```bash\n.venv/bin/nbtorch-refine --images 'a_*.cbf' --model @{stem}.model \\\n" \
           "    --rotation-serie --out-dir out/x\n```\n"
    bad = check_commands(page)
    assert len(bad) == 1 and "--rotation-serie" in bad[0]
    assert check_commands(page.replace("--rotation-serie", "--rotation-series")) == []
    assert check_commands("see `nbtorch-refine --frobnicate 3`") != []
    assert check_commands("see `nbtorch-refine --expt` and `nbtorch-refine --images ... --joint`") == []


def test_checker_finds_bad_values_and_flags():
    assert check_commands("```\nnbtorch -cell 70 80 90 75 85 95 -N five\n```") != []
    assert check_commands("```\nnbtorch -cel 70 -N 5\n```") != []
    assert check_commands("```\nnbtorch ... -c_parity -N 5   # a comment\n```") == []
    assert check_commands("```\nnbtorch-refine --image x.cbf --model \"-N 5 -mosiac 0.3\"\n```") != []
    assert check_commands("```\nnbtorch-refine --image x.cbf --model \"@nowhere.args -N 5\"\n```") != []
    assert check_commands("```\npython -m experiments.sweep --n-trials 0\n```") != []
    assert check_commands("```\npython -m experiments.sweep --n-trials N [--storage URL]\n```") == []
    assert check_commands("`python -m experiments.wedge_calibration --out-dir DIR --variants dial`") != []
    assert check_commands("`python -m experiments.nope --x`") != []
    shown = "```\n$ python -m experiments.sweep --n-trials 0\npython -m experiments.sweep: error: argument --n-trials\n```"
    assert check_commands(shown) == []  # bad input shown with its error


def test_checker_finds_a_missing_path():
    assert missing_paths("the reader is `refine/inputs/dials.py`") == []
    assert missing_paths("the reader is `refine/inputs/dial.py`") == ["refine/inputs/dial.py"]
    assert missing_paths("`tests/test_docs_commands.py::test_x`, scripts/peer/...") == []
    assert missing_paths("[the log](log.md#2026-11-27)", ROOT / "docs") == []
    assert missing_paths("[the log](logs.md)", ROOT / "docs") == ["./logs.md"]
    assert machine_paths("TensorBoard logs: /work/main/out/main/runs") == ["/work/main/out/main/runs"]
    assert machine_paths("sqlite:////work/main/out/sweep.db") == ["/work/main/out/sweep.db"]
    assert machine_paths("out/main/runs, ../shared/real/x and https://example.org/work/x") == []
