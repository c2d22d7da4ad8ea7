"""The committed reproduction of docs/validation.md's "60 modules" (issue 35):
examples/thaumatin_modules.toml refines the tutorial's crystal with the detector's panel groups, one setting for
both groupings, and scripts/peer/thaumatin_modules.sh (the DIALS steps and the four runs) refuses cleanly without
DIALS.  The runs themselves need DIALS's 60-panel experiment, which the reference data do not hold."""

from __future__ import annotations

import shlex
import subprocess
import tomllib
from pathlib import Path

from refine.cli.parser import parse_args

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "thaumatin_modules.toml"


def test_multi_panel_thaumatin_config_is_the_tutorials_crystal_with_the_panel_groups_free():
    args = parse_args(["--config", str(CONFIG)])
    assert args.dials.panel_groups == 0 and args.dials.expt.endswith(".expt") and args.dials.refl.endswith(".refl")
    assert set(args.fit.refine) == {"scale", "background", "orientation", "cell", "mosaic", "panels"}
    assert args.fit.symmetry == "P41212" and args.pixels.too_few_spots == "warn"
    tutorial = tomllib.loads((ROOT / "examples" / "thaumatin_still.toml").read_text())
    assert args.pixels.spot_window == tutorial["spot_window"] and args.pixels.subsample == tutorial["subsample"]
    # the crystal flags of the tutorial's model (its geometry flags come from the .expt here)
    flags = shlex.split(tutorial["model"])
    crystal = {f: flags[flags.index(f) + 1] for f in ("-N", "-mosaic", "-default_F", "-oversample")}
    mine = shlex.split(args.model.model)
    assert {f: mine[mine.index(f) + 1] for f in crystal} == crystal
    assert "-mosaic_dom" not in flags and "-mosaic_dom" not in mine  # both: the measured images' default count
    assert parse_args(["--config", str(CONFIG), "--panel-groups", "1"]).dials.panel_groups == 1


def test_multi_panel_thaumatin_script_refuses_without_dials(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "peer" / "thaumatin_modules.sh"), str(tmp_path / "none"),
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "no DIALS in" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
