"""Do a rotation wedge's cell esds cover its error?  Synthetic narrow wedges from DIALS-like files with a known truth,
refined with the natural command (``nbtorch-refine --images ... --expt --refl --rotation-series``).

    python -m experiments.wedge_calibration --out-dir out/wedges [--wedges 24] [--variants dials held free]

Each wedge (:data:`WEDGES`: three crystals, two wedge widths, two panel sizes, seeds) is a DIALS experiment (a panel of
0.1 mm pixels normal to the beam at 25 mm, its centre 6.7 mm off the beam; one scan axis; a random crystal orientation),
its images simulated from the truth with Poisson noise, and a ``.refl`` of the reflections crossing the sphere during
the scan at their true centroids plus the scatter of a spot finder's (0.25 px, 0.25 frames).  DIALS's model, written
into the ``.expt``, is what DIALS's refinement makes of those spots: the cell, orientation, distance and beam centre
fitted to them from the truth (:func:`refine.inputs.spot_start.align_to_spots`), so its geometry and cell are off
together, as DIALS's are, and it predicts its spots well.  The crystal model the refinement uses is the simulation's
(``--model``): the only errors are the noise and DIALS's model.

Variants (``--variants``): ``dials`` (the default: DIALS's geometry as a prior), ``held`` (``--shared
cell,orientation``: DIALS's geometry held) and ``free`` (``--geometry-prior none``: refined without a prior).  For each
run the cell's error over its esd (``z``) per distinct axis; the table (``OUT_DIR/table.md``, ``rows.json``): per
variant the rms of ``z``, its largest ``|z|``, the rms relative error and the median steps.  A finished run
(``OUT_DIR/WEDGE/VARIANT/joint.json``) is not run again: interrupt and resume at will.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nbtorch.cli.support import Printer, run_main
from nbtorch.errors import InputError

PROG = "python -m experiments.wedge_calibration"
#: the refinement's (and the simulation's) crystal model: small domains, broad spots, few domains (fast)
CRYSTAL = "-N 2 -default_F 100 -mosaic 0.2 -mosaic_dom 4 -oversample 1 -phisteps 5"
DISTANCE_MM, OFFSET_MM, PIXEL_MM, START_DEG = 25.0, 6.7, 0.1, 10.0
#: the centroid scatter of the ``.refl``'s observed spots (pixels, frames)
SCATTER = 0.25
VARIANTS = {"dials": [], "held": ["--shared", "cell,orientation"], "free": ["--geometry-prior", "none"],
            "one_f": ["--no-structure-factors"]}
#: the truths of the amplitudes: one F for every reflection, or F drawn from Wilson's distribution
TRUTH_F = ("constant", "wilson")
#: the largest Miller index of a Wilson truth's table (the panels see d* up to 0.45 1/A: 41 for 90 A)
MAX_INDEX = 42
AXES = {"tetragonal": ("cell_a", "cell_c"), "orthorhombic": ("cell_a", "cell_b", "cell_c"), "cubic": ("cell_a",)}


@dataclass(frozen=True)
class Wedge:
    """One synthetic wedge: its crystal (cell in A, crystal system), ``n_images`` of ``osc_deg``, a square panel of
    ``size`` pixels, and the seed of its orientation, noise and DIALS's geometry."""

    name: str
    cell: tuple[float, float, float]
    symmetry: str
    n_images: int
    osc_deg: float
    size: int
    seed: int


def _wedges() -> list[Wedge]:
    crystals = [((80.0, 80.0, 100.0), "tetragonal"), ((70.0, 85.0, 95.0), "orthorhombic"), ((90.0, 90.0, 90.0), "cubic")]
    out = []
    for seed in range(2):
        for ci, (cell, sym) in enumerate(crystals):
            for n, osc in ((3, 0.5), (4, 0.25)):
                for size in (44, 56):
                    out.append(Wedge(f"{sym[:4]}-{n}x{osc:g}-{size}px-s{seed}", cell, sym, n, osc, size,
                                     1000 * seed + 100 * ci + 10 * n + size))
    return out


#: the set: 3 crystals x 2 widths x 2 panel sizes x 2 seeds
WEDGES = _wedges()


def rotation(axis, angle_deg: float) -> np.ndarray:
    """The rotation matrix by ``angle_deg`` about ``axis`` (right-handed; Rodrigues)."""
    k = np.asarray(axis, dtype=float) / np.linalg.norm(axis)
    a = math.radians(angle_deg)
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + math.sin(a) * kx + (1 - math.cos(a)) * kx @ kx


def one_panel_sweep(identifier: str, template: str, size: int, pixel_mm: float, origin, profile: bool = False) -> dict:
    """The experiment list's experiment, image set (``template``), beam (1 A along +z) and one square panel (``size``
    pixels of ``pixel_mm``; fast +x, slow -y; ``origin`` in mm) in dxtbx's layout; ``profile``: the experiment names
    profile 0."""
    return {
        "__id__": "ExperimentList",
        "experiment": [{"__id__": "Experiment", "identifier": identifier, "beam": 0, "detector": 0, "goniometer": 0,
                        "scan": 0, "crystal": 0, **({"profile": 0} if profile else {}), "imageset": 0}],
        "imageset": [{"__id__": "ImageSequence", "template": template, "mask": "", "gain": "", "pedestal": "",
                      "dx": "", "dy": "", "params": {}}],
        "beam": [{"direction": [0.0, 0.0, 1.0], "wavelength": 1.0, "divergence": 0.0, "sigma_divergence": 0.0,
                  "polarization_normal": [0.0, 1.0, 0.0], "polarization_fraction": 0.999, "flux": 0.0,
                  "transmission": 1.0}],
        "detector": [{"panels": [{"name": "Panel", "type": "SENSOR_PAD", "fast_axis": [1.0, 0.0, 0.0],
                                  "slow_axis": [0.0, -1.0, 0.0], "origin": [float(v) for v in origin],
                                  "raw_image_offset": [0, 0], "image_size": [size, size],
                                  "pixel_size": [pixel_mm, pixel_mm], "trusted_range": [-1.0, 1e9], "thickness": 0.0,
                                  "material": "", "mu": 0.0, "identifier": "", "mask": [], "gain": 1.0,
                                  "pedestal": 0.0, "px_mm_strategy": {"type": "SimplePxMmStrategy"}}]}],
    }


def document(w: Wedge) -> dict:
    """The wedge's true DIALS ExperimentList (dxtbx's layout)."""
    rng = np.random.default_rng(w.seed)
    q = rng.normal(size=4)
    q /= np.linalg.norm(q)
    a, b, c, d = q
    u = np.array([[a*a+b*b-c*c-d*d, 2*(b*c-a*d), 2*(b*d+a*c)], [2*(b*c+a*d), a*a-b*b+c*c-d*d, 2*(c*d-a*b)],
                  [2*(b*d-a*c), 2*(c*d+a*b), a*a-b*b-c*c+d*d]])
    real = (u @ np.diag(w.cell)).T
    half = w.size * PIXEL_MM / 2
    hall = {"tetragonal": " P 4 2", "orthorhombic": " P 2 2", "cubic": " P 2 2 3"}[w.symmetry]
    return {
        **one_panel_sweep(w.name, "wedge_#####.cbf", w.size, PIXEL_MM, [OFFSET_MM - half, half, -DISTANCE_MM]),
        "goniometer": [{"axes": [[1.0, 0.0, 0.0]], "angles": [0.0], "names": ["GON_OMEGA"], "scan_axis": 0}],
        "scan": [{"image_range": [1, w.n_images], "batch_offset": 0, "oscillation": [START_DEG, w.osc_deg],
                  "exposure_time": [0.1] * w.n_images, "epochs": [0.0] * w.n_images, "valid_image_ranges": {}}],
        "crystal": [{"__id__": "crystal", "real_space_a": list(real[0]), "real_space_b": list(real[1]),
                     "real_space_c": list(real[2]), "space_group_hall_symbol": hall}],
    }


def sphere_crossings(doc: dict, axis, start_deg: float, width_deg: float, n_images: int, fixed=None,
                     dstar=(0.1, 0.45), max_index: int = 25) -> tuple[np.ndarray, np.ndarray]:
    """``(hkl, xyz)``: the reflections (``dstar`` 1/A, indices to ``max_index``) that cross the Ewald sphere while the
    crystal turns about ``axis`` from ``start_deg`` through ``n_images`` of ``width_deg`` (after the ``fixed``
    rotation), each at its crossing (x, y pixels, z frames) and on the document's one panel (2 pixels from its
    edges), from the document alone (DIALS's frame; no nbtorch code): an ideal ``.refl`` of indexed spots."""
    panel, beam = doc["detector"][0]["panels"][0], doc["beam"][0]
    pixel_mm, size = float(panel["pixel_size"][0]), panel["image_size"]
    real = np.array([doc["crystal"][0][k] for k in ("real_space_a", "real_space_b", "real_space_c")])
    recip0 = (np.eye(3) if fixed is None else fixed) @ np.linalg.inv(real)  # columns a*, b*, c* at the datum
    s0 = -np.asarray(beam["direction"]) / beam["wavelength"]
    f, sl, origin = (np.asarray(panel[k]) for k in ("fast_axis", "slow_axis", "origin"))
    normal = np.cross(f, sl)
    frames = np.linspace(0.0, n_images, 40 * n_images + 1)
    turns = np.stack([rotation(axis, start_deg + z * width_deg) for z in frames])
    grid = np.array(np.meshgrid(*[np.arange(-max_index, max_index + 1)] * 3)).reshape(3, -1).T
    lengths = np.linalg.norm(grid @ recip0.T, axis=1)
    grid = grid[(lengths > dstar[0]) & (lengths < dstar[1])]
    r = np.einsum("fij,nj->fni", turns, grid @ recip0.T)
    g = 2 * r @ s0 + (r * r).sum(-1)  # zero on the sphere
    hkl_out, xyz_out = [], []
    for i, n in zip(*np.nonzero(np.sign(g[:-1]) != np.sign(g[1:]))):
        z = frames[i] - g[i, n] * (frames[i + 1] - frames[i]) / (g[i + 1, n] - g[i, n])
        s1 = s0 + rotation(axis, start_deg + z * width_deg) @ recip0 @ grid[n]
        if s1 @ normal <= 0:
            continue
        t = (origin @ normal) / (s1 @ normal)
        x, y = np.linalg.solve(np.stack([f, sl, normal], 1), t * s1 - origin)[:2] / pixel_mm
        if 2 <= x <= size[0] - 2 and 2 <= y <= size[1] - 2:
            hkl_out.append(grid[n])
            xyz_out.append((x, y, z))
    return np.asarray(hkl_out, dtype=np.int32).reshape(-1, 3), np.asarray(xyz_out).reshape(-1, 3)


def reflections(doc: dict, w: Wedge) -> tuple[np.ndarray, np.ndarray]:
    """The wedge's indexed spots at their true centroids (:func:`sphere_crossings` about its scan axis, +x)."""
    return sphere_crossings(doc, [1, 0, 0], START_DEG, w.osc_deg, w.n_images)


def _spot_columns(hkl: np.ndarray, xyz: np.ndarray, rng: np.random.Generator) -> dict:
    """The ``.refl`` columns of the indexed spots: observed centroids with a spot finder's scatter, the true ones as
    DIALS's predictions, shoeboxes of 7 x 7 pixels over 3 frames."""
    n = len(xyz)
    observed = xyz + rng.normal(scale=SCATTER, size=xyz.shape)
    bbox = np.c_[np.floor(xyz[:, 0]) - 3, np.floor(xyz[:, 0]) + 4, np.floor(xyz[:, 1]) - 3, np.floor(xyz[:, 1]) + 4,
                 np.floor(xyz[:, 2]) - 1, np.floor(xyz[:, 2]) + 2].astype(np.int32)
    return {"xyzobs.px.value": ("vec3<double>", observed), "xyzcal.px": ("vec3<double>", xyz),
            "bbox": ("int6", bbox), "miller_index": ("cctbx::miller::index<>", hkl),
            "flags": ("std::size_t", np.full(n, 1 << 5, dtype=np.uint64)), "id": ("int", np.zeros(n, dtype=np.int32))}


def _dials_model(truth_expt: Path, w: Wedge, hkl: np.ndarray, observed: np.ndarray) -> tuple[dict, dict]:
    """DIALS's model: the cell, orientation, distance and beam centre fitted to the noisy spots from the truth, as
    DIALS's refinement fits them (:func:`refine.inputs.spot_start.align_to_spots`); ``(its document, its values)``."""
    from nbtorch import Simulator, config_from_args
    from nbtorch.dials.geometry import experiment_flags, refined_document
    from nbtorch.io.dials import read_expt
    from refine.inputs.spot_start import align_to_spots
    from refine.solver.plan import model_values

    exp = read_expt(truth_expt)
    sim = Simulator(config_from_args(experiment_flags(exp, 0) + CRYSTAL.split()), compile=False)
    values = model_values(sim)
    phi = START_DEG + observed[:, 2] * w.osc_deg
    fit = align_to_spots(sim, values, hkl, observed, phi, w.osc_deg, w.symmetry,
                         names=("cell", "orientation", "distance", "beam_centre"))
    model = {**values, **fit.values}
    return refined_document(exp, sim, model), {k: model[k] for k in ("cell_a", "cell_b", "cell_c", "distance",
                                                                     "beam_x", "beam_y")}


def _canonical(hkl: np.ndarray, symmetry: str) -> np.ndarray:
    """Each reflection's representative under the point group of the wedge's space group with Friedel's law (422,
    222 or 23): equivalent reflections share it."""
    a = np.abs(hkl)
    if symmetry == "tetragonal":
        return np.c_[a[:, :2].max(1), a[:, :2].min(1), a[:, 2]]
    if symmetry == "cubic":  # the three cyclic permutations: the largest as the representative
        perms = np.stack([a, a[:, [1, 2, 0]], a[:, [2, 0, 1]]])
        keys = (perms * np.array([10000, 100, 1])).sum(-1)
        return perms[keys.argmax(0), np.arange(len(a))]
    return a


def wilson_table(w: Wedge):
    """The wedge's true amplitudes: F = 100 sqrt(E), E exponential (acentric Wilson statistics, mean F^2 = 100^2),
    one draw per symmetry-unique reflection, every index to :data:`MAX_INDEX`."""
    from nbtorch.io.hkl import HKLTable

    r = np.arange(-MAX_INDEX, MAX_INDEX + 1)
    hkl = np.array(np.meshgrid(r, r, r, indexing="ij")).reshape(3, -1).T
    unique, inverse = np.unique(_canonical(hkl, w.symmetry), axis=0, return_inverse=True)
    draws = 100.0 * np.sqrt(np.random.default_rng(w.seed + 11).exponential(size=len(unique)))
    F = draws[inverse.reshape(-1)]
    return HKLTable(hkl[:, 0], hkl[:, 1], hkl[:, 2], F, source=f"{w.name} truth")


def make_wedge(w: Wedge, folder: Path, truth_f: str = "constant") -> dict:
    """The wedge's files in ``folder``: images ``wedge_#####.cbf`` of the truth (``truth_f``: one F, or
    :func:`wilson_table`'s, written to ``truth.hkl``), ``dials.expt`` (DIALS's model), ``dials.refl``, and
    ``truth.json`` (the cell, the spot count, DIALS's cell and geometry)."""
    import torch

    from nbtorch import Simulator, config_from_args
    from nbtorch.dials.geometry import experiment_flags
    from nbtorch.io import write_cbf
    from nbtorch.io.dials import read_expt, write_refl

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(w.seed + 7)
    truth = document(w)
    (folder / "truth.expt").write_text(json.dumps(truth))
    exp = read_expt(folder / "truth.expt")
    crystal = CRYSTAL.split()
    if truth_f == "wilson":
        from nbtorch.io.hkl import write_hkl

        write_hkl(folder / "truth.hkl", wilson_table(w))
        crystal += ["-hkl", str(folder / "truth.hkl")]
    for k in range(w.n_images):
        sim = Simulator(config_from_args(experiment_flags(exp, k) + crystal), compile=False)
        with torch.no_grad():
            img = sim().numpy()
        write_cbf(folder / f"wedge_{k + 1:05d}.cbf", rng.poisson(20.0 * img + 2.0).astype(np.int32),
                  {"pixel_size_mm": PIXEL_MM})
    hkl, xyz = reflections(truth, w)
    columns = _spot_columns(hkl, xyz, rng)
    write_refl(folder / "dials.refl", columns, {0: w.name})
    doc, dials = _dials_model(folder / "truth.expt", w, hkl.astype(float), columns["xyzobs.px.value"][1])
    (folder / "dials.expt").write_text(json.dumps(doc))
    info = {"cell": list(w.cell), "symmetry": w.symmetry, "spots": int(len(hkl)), "dials": dials, "truth_f": truth_f}
    (folder / "truth.json").write_text(json.dumps(info))
    return info


def run_variant(w: Wedge, folder: Path, variant: str, truth_f: str = "constant") -> dict:
    """The natural command on the wedge's files (with the variant's flags; one F, the truth's, unless the truth's
    amplitudes are Wilson's); its ``joint.json`` (run when absent)."""
    from refine.cli.main import main

    out = folder / variant
    result = out / "joint.json"
    if not result.exists():
        argv = ["--images", str(folder / "wedge_*.cbf"), "--expt", str(folder / "dials.expt"), "--refl",
                str(folder / "dials.refl"), "--rotation-series", "--model", CRYSTAL, "--symmetry", w.symmetry,
                "--out-dir", str(out), "--quiet", *VARIANTS[variant]]
        if truth_f == "constant" and "--no-structure-factors" not in argv:
            argv.append("--no-structure-factors")
        code = main(argv)
        if not result.exists():
            raise RuntimeError(f"{w.name} {variant}: nbtorch-refine exited {code} without {result}")
    return json.loads(result.read_text())


def row_of(w: Wedge, variant: str, info: dict, res: dict) -> dict:
    """One run's row: per distinct axis the relative error and error / esd (``z``), the distance's error."""
    row = {"wedge": w.name, "variant": variant, "spots": info["spots"], "status": res["status"], "steps": res["steps"]}
    for axis, truth in zip(("cell_a", "cell_b", "cell_c"), w.cell):
        if axis in AXES[w.symmetry]:
            value, esd = res["shared"][axis], res["shared_esds"].get(axis, math.nan)
            row[f"{axis}_rel"] = (value - truth) / truth
            row[f"{axis}_z"] = (value - truth) / esd if esd and esd > 0 else math.nan
    row["dials_distance_err_mm"] = info["dials"]["distance"] - DISTANCE_MM
    row["distance_err_mm"] = res["shared"].get("distance", info["dials"]["distance"]) - DISTANCE_MM
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per variant: the wedges, rms and largest ``|z|`` over every axis, the rms relative error, the median steps."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        z = np.array([v for r in mine for k, v in r.items() if k.endswith("_z")], dtype=float)
        rel = np.array([v for r in mine for k, v in r.items() if k.endswith("_rel")], dtype=float)
        out.append({"variant": variant, "wedges": len(mine), "axes": int(z.size),
                    "rms_z": float(np.sqrt(np.nanmean(z ** 2))) if z.size else math.nan,
                    "max_abs_z": float(np.nanmax(np.abs(z))) if z.size else math.nan,
                    "rms_rel_pct": 100.0 * float(np.sqrt(np.mean(rel ** 2))) if rel.size else math.nan,
                    "median_steps": float(np.median([r["steps"] for r in mine])),
                    "converged": sum(r["status"] == "converged" for r in mine)})
    return out


def table(stats: list[dict]) -> str:
    head = "| variant | wedges | axes | rms error/esd | largest |error|/esd | rms error (%) | median steps | converged |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for s in stats:
        lines.append(f"| {s['variant']} | {s['wedges']} | {s['axes']} | {s['rms_z']:.2f} | {s['max_abs_z']:.2f} | "
                     f"{s['rms_rel_pct']:.3f} | {s['median_steps']:.0f} | {s['converged']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", required=True, help="one folder per wedge (its files and one folder per variant)")
    p.add_argument("--wedges", type=int, default=len(WEDGES), help=f"the first N of the {len(WEDGES)} wedges "
                   "(default all)")
    p.add_argument("--variants", nargs="+", default=["dials"], choices=sorted(VARIANTS),
                   help="dials (the default command), held, free (the geometry), one_f (no amplitudes) "
                        "(default %(default)s)")
    p.add_argument("--truth-f", choices=TRUTH_F, default="constant", help="the simulation's amplitudes: constant "
                   "(one F; the runs then refine one F) or wilson (drawn per unique reflection; the runs refine one "
                   "amplitude per reflection, the default, unless one_f) (default %(default)s)")
    return p


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.wedges <= len(WEDGES):
        raise InputError(f"--wedges: expected 1..{len(WEDGES)}, got {args.wedges}")
    say, root, rows = Printer(), Path(args.out_dir), []
    for w in WEDGES[:args.wedges]:
        folder = root / w.name
        info = json.loads((folder / "truth.json").read_text()) if (folder / "truth.json").exists() \
            else make_wedge(w, folder, args.truth_f)
        if info.get("truth_f", "constant") != args.truth_f:
            raise InputError(f"--truth-f {args.truth_f}: {folder} holds a wedge with {info.get('truth_f')} "
                             "amplitudes; give another --out-dir")
        for variant in args.variants:
            row = row_of(w, variant, info, run_variant(w, folder, variant, args.truth_f))
            rows.append(row)
            say(f"{w.name} {variant}: {info['spots']} spots, {row['steps']} steps, error/esd "
                + " ".join(f"{k[5]} {v:+.2f}" for k, v in row.items() if k.endswith("_z")))
    stats = summary(rows)
    (root / "rows.json").write_text(json.dumps({"rows": rows, "summary": stats}, indent=1))
    (root / "table.md").write_text(table(stats) + "\n")
    say(table(stats))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
