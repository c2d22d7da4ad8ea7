"""The refined cell against the mosaic domains: one ``nbtorch-refine`` run per (mosaic model, domain count).

    python -m experiments.mosaic_convergence --out-dir out/mosaic/0003 --counts 4 8 16 32 64 \\
        --models gaussian random -- --config examples/thaumatin_still.toml

Everything after ``--`` is the refinement's own command line (a config, or a DIALS sweep's natural command); each run
adds ``-mosaic_model MODEL -mosaic_dom COUNT`` to its starting model (after the config's ``model`` flags, so that they
replace its count) and writes ``OUT_DIR/MODEL-COUNT/result.json`` (``joint.json`` for a run of several images).  With
``--turns 0 1 2 3`` each count is also refined with its set turned (``-mosaic_turn``, folders ``MODEL-COUNT-tTURN``),
and the table ends with each count's standard deviation of the cell over the turns.  A run whose ``result.json``
exists is not run again (interrupt and resume at will).  The table printed at the end (and written to ``OUT_DIR/table.md`` and
``table.json``): loss, fit excess, spot rms, steps, wall time and the cell with its esd for each run, and each cell
axis's distance from the largest count of the same model in units of the run's esd (``shift/esd``): the issue's
criterion is that the default count stays within 0.3 esd of the large-count limit.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from nbtorch.cli.support import Printer, run_main
from nbtorch.errors import InputError
from nbtorch.io import read_toml

CELL = ("cell_a", "cell_b", "cell_c")


def _base_model(refine_args: list[str]) -> str:
    """The starting model's flags of the refinement's command line: its ``--model``, else its config's ``model``."""
    if "--model" in refine_args:
        return refine_args[refine_args.index("--model") + 1]
    if "--config" in refine_args:
        return str(read_toml(refine_args[refine_args.index("--config") + 1], "--config").get("model", ""))
    return ""


def _without(args: list[str], option: str) -> list[str]:
    out, skip = [], False
    for tok in args:
        if skip:
            skip = False
        elif tok == option:
            skip = True
        else:
            out.append(tok)
    return out


def run_one(refine_args: list[str], model: str, count: int, run_dir: Path, say, turn: int = 0) -> dict:
    """One refinement with the mosaic set (model, count), turned by ``-mosaic_turn turn`` when not 0; its result.json
    (run only when absent)."""
    many = "--images" in refine_args  # a joint run or a sweep: joint.json in its --out-dir
    result = run_dir / ("joint.json" if many else "result.json")
    if not result.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        flags = f"{_base_model(refine_args)} -mosaic_model {model} -mosaic_dom {count}".strip()
        flags += f" -mosaic_turn {turn}" if turn else ""
        out = ["--out-dir", str(run_dir)] if many else ["--out", str(run_dir / "result.h5"), "--logdir",
                                                         str(run_dir / "runs")]
        argv = [sys.executable, "-m", "refine.cli", *_without(refine_args, "--model"), "--model", flags, *out]
        say(f"run {model} {count}{f' turn {turn}' if turn else ''}: {shlex.join(argv[3:])}")
        t0 = time.monotonic()
        with open(run_dir / "stdout.txt", "w") as log:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not result.exists():
            raise RuntimeError(f"{model} {count}: nbtorch-refine exited {rc} (see {run_dir / 'stdout.txt'})")
        say(f"  done in {time.monotonic() - t0:.0f} s")
    return json.loads(result.read_text())


def run_name(model: str, count: int, turn: int = 0) -> str:
    """A run's folder: ``MODEL-COUNT``, and ``-tTURN`` for a turned set."""
    return f"{model}-{count}" + (f"-t{turn}" if turn else "")


def row_of(model: str, count: int, res: dict, turn: int = 0) -> dict:
    fit, spots = res.get("fit") or {}, res.get("spots") or {}
    row = {"model": model, "domains": count, "turn": turn, "loss": res["loss_final"], "steps": res["steps"], "wall_s": res["wall_s"],
           "status": res["status"], "excess": fit.get("excess"), "spot_rms_px": spots.get("rms_px_final"),
           "like_for_like_px": spots.get("rms_px_finder")}
    for name in CELL:
        if name in res["params"]:
            row[name], row[f"{name}_esd"] = res["params"][name], (res.get("esds") or {}).get(name)
    return row


def with_shifts(rows: list[dict]) -> list[dict]:
    """Each row's cell distance from its model's largest count (its set as built, else its first turn), in the row's
    esds."""
    for model in {r["model"] for r in rows}:
        mine = [r for r in rows if r["model"] == model]
        limit = max(mine, key=lambda r: (r["domains"], -r.get("turn", 0)))
        for r in mine:
            for name in CELL:
                esd = r.get(f"{name}_esd")
                if name in r and esd:
                    r[f"{name}_shift_esd"] = (r[name] - limit[name]) / esd
    return rows


def table(rows: list[dict]) -> str:
    names = [n for n in CELL if any(n in r for r in rows)]
    if all(r.get("cell_b") == r.get("cell_a") for r in rows):  # a tetragonal or cubic cell: b is a
        names = [n for n in names if n != "cell_b"]
    head = ["model", "domains", "turn", "loss", "excess", "spots (px)", "like for like (px)", "steps", "wall (s)"]
    head += [f"{n} (A)" for n in names] + [f"{n} shift/esd" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(v, fmt):
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    for r in sorted(rows, key=lambda r: (r["model"], r["domains"], r.get("turn", 0))):
        cells = [r["model"], str(r["domains"]), str(r.get("turn", 0)), num(r["loss"], ".6g"), num(r["excess"], ".3g"),
                 num(r["spot_rms_px"], ".3f"), num(r.get("like_for_like_px"), ".3f"), str(r["steps"]),
                 num(r["wall_s"], ".0f")]
        cells += [f"{num(r.get(n), '.4f')} ({num(r.get(n + '_esd'), '.4f')})" for n in names]
        cells += [num(r.get(f"{n}_shift_esd"), "+.2f") for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + turn_spreads(rows, names))


def turn_spreads(rows: list[dict], names: Sequence[str]) -> list[str]:
    """One line per (model, count) refined with two turns or more: each cell value's standard deviation over the
    turns, in Angstrom and in the turns' mean esd (how much the cell depends on where the domains lie)."""
    out = []
    for key in sorted({(r["model"], r["domains"]) for r in rows}):
        same = [r for r in rows if (r["model"], r["domains"]) == key]
        if len(same) < 2:
            continue
        parts = []
        for n in names:
            values = [r[n] for r in same if n in r]
            esds = [r.get(f"{n}_esd") for r in same if r.get(f"{n}_esd")]
            if len(values) < 2:
                continue
            sd = statistics.stdev(values)
            parts.append(f"{n} sd {sd:.4f} A" + (f" ({sd / statistics.fmean(esds):.2f} esd)" if esds else ""))
        out.append(f"\n{key[0]} {key[1]} over {len(same)} turns: " + ", ".join(parts))
    return out


PROG = "python -m experiments.mosaic_convergence"


def build_parser() -> argparse.ArgumentParser:
    """The script's own options (those before ``--``; nbtorch-refine's arguments follow ``--``)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", required=True, help="one folder per run, and the table")
    p.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="domain counts (default %(default)s)")
    p.add_argument("--models", nargs="+", default=["ball", "random"], help="mosaic models (default %(default)s)")
    p.add_argument("--turns", type=int, nargs="+", default=[0],
                   help="-mosaic_turn of each run (default 0: the set as built); two or more give each count's spread "
                        "over turned sets")
    p.add_argument("--table-only", action="store_true", help="run nothing: tabulate the runs already in --out-dir")
    return p


def _run(argv: list[str]) -> int:
    refine_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(own)
    if not refine_args:
        raise InputError("give the refinement's command line after --")
    if any(t < 0 for t in args.turns):
        raise InputError(f"--turns: each turn must be 0 or more, got {' '.join(map(str, args.turns))}")
    if any(c < 2 for c in args.counts):
        raise InputError(f"--counts: each count must be at least 2, got {' '.join(map(str, args.counts))}")
    out = Printer()
    many = "--images" in refine_args
    runs = [(m, c, t) for m in args.models for c in args.counts for t in args.turns
            if not args.table_only
            or (Path(args.out_dir) / run_name(m, c, t) / ("joint.json" if many else "result.json")).exists()]
    try:
        rows = [row_of(m, c, run_one(refine_args, m, c, Path(args.out_dir) / run_name(m, c, t), out, t), t)
                for m, c, t in runs]
    except RuntimeError as exc:  # a run that failed: its own output says why
        out(f"{PROG}: {exc}")
        return 1
    text = table(with_shifts(rows))
    Path(args.out_dir, "table.md").write_text(text + "\n")
    Path(args.out_dir, "table.json").write_text(json.dumps(rows, indent=1))
    out(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command: bad input is one line and exit status 2 (:func:`nbtorch.cli.support.run_main`)."""
    return run_main(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
