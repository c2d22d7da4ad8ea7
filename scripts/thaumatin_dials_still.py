"""The thaumatin still as dials.stills_process would leave it: a stills ``.expt`` (no scan) and an indexed ``.refl``.

::

    python scripts/thaumatin_dials_still.py [--data ../shared/real/thaumatin_i24_still] [--image 0003 [0004]] [--out-dir out/thaumatin_dials]
    nbtorch-refine --image $DATA/thau_3_2_0003.cbf.bz2 --expt out/thaumatin_dials/thau_3_2_0003.expt \\
        --refl out/thaumatin_dials/thau_3_2_0003.refl          # the natural command (docs/still-from-dials.md)

No DIALS output exists for these images here; this turns the data folder's own indexing (``*_solution.json``: beam,
detector, crystal vectors, all in the DIALS laboratory frame) and spot list (``*_spots.txt``) into the files
dials.stills_process writes after indexing and integration:

* ``.expt``: one still experiment (beam, one Pilatus panel whose origin is the indexing's, at the header distance,
  crystal with the P 41 21 2 Hall symbol, no goniometer or scan), with what stills processing adds: the crystal's
  mosaic model (``ML_domain_size_ang``, ``ML_half_mosaicity_deg``) and a ``gaussian_rs`` profile whose ``sigma_m`` is
  0 (DIALS computes none for a still);
* ``.refl``: the indexed spots (those the list flags indexed): ``miller_index``, ``xyzobs.px.value`` (z 0),
  ``xyzcal.px`` (the indexing's predictions), ``d``, ``intensity.sum.value``, ``flags`` (indexed, used in refinement,
  strong), ``id`` 0, ``panel`` 0.

How the stills values are estimated, as DIALS estimates them:

* ``sigma_b`` (DIALS's ``ComputeEsdBeamDivergence`` on the spot finder's shoeboxes): for each indexed spot, the
  pixels of an 11 x 11 box above its border's median by 3 sqrt(median) (the strong pixels); the count-weighted mean
  squared angle between their diffracted beams and the centroid's, over (sum - 1); ``sigma_b`` = the root of the
  mean over spots;
* the mosaic model (Sauter et al. 2014, DIALS's ``nave_parameters``): each indexed reflection's angle ``delta psi``
  from the Ewald sphere (the rotation about ``q x s0`` that puts ``q = A* h`` on it) lies within
  ``eta/2 + d / D`` of it; ``D`` and ``eta/2`` are those of the narrowest such band (least mean log width) that
  holds 95 % of the reflections.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbtorch.io.dials import write_expt, write_refl  # noqa: E402
from refine.inputs.images import load_image  # noqa: E402

#: DIALS reflection flags (``flex.reflection_table.flags``)
INDEXED, USED_IN_REFINEMENT, STRONG = 1 << 2, 1 << 3, 1 << 5
#: thaumatin's space group (Hall symbol, gemmi's for P 41 21 2)
HALL = " P 4abw 2nw"
#: silicon's attenuation coefficient (1/mm) at 12.8 keV (refine.inputs.sensor: 260.9 um)
MU_SI = 1.0 / 0.2609


def read_spots(path: Path) -> dict[str, np.ndarray]:
    """The indexed rows of a ``*_spots.txt``: x, y (px), summed counts, hkl, predicted x, y."""
    rows = [line.split() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    rows = [r for r in rows if r[4] == "1"]
    xy = np.array([[float(r[0]), float(r[1])] for r in rows])
    return {"xy": xy, "counts": np.array([float(r[2]) for r in rows]),
            "hkl": np.array([[int(r[5]), int(r[6]), int(r[7])] for r in rows], dtype=np.int32),
            "pred": np.array([[float(r[8]), float(r[9])] for r in rows])}


def pixel_lab(solution: dict, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Lab positions (mm) of detector points at pixel coordinates ``x`` (fast), ``y`` (slow)."""
    det = solution["detector"]
    px = det["pixel_size_mm"]
    origin, f, s = (np.asarray(det[k], dtype=float) for k in ("origin_mm_corner_of_pixel_0_0", "fast_axis",
                                                              "slow_axis"))
    return origin + (x * px)[..., None] * f + (y * px)[..., None] * s


def sigma_b_deg(image: np.ndarray, solution: dict, xy: np.ndarray, half: int = 5) -> float:
    """The module's ``sigma_b`` (deg) from the strong pixels about each spot."""
    variances = []
    for x, y in xy:
        i0, j0 = int(y) - half, int(x) - half
        if i0 < 0 or j0 < 0 or i0 + 2 * half + 1 > image.shape[0] or j0 + 2 * half + 1 > image.shape[1]:
            continue
        box = image[i0:i0 + 2 * half + 1, j0:j0 + 2 * half + 1].astype(float)
        border = np.r_[box[0], box[-1], box[1:-1, 0], box[1:-1, -1]]
        border = border[border >= 0]
        if not len(border) or (box < 0).any():
            continue
        bg = float(np.median(border))
        strong = box > bg + 3.0 * math.sqrt(max(bg, 1.0))
        if strong.sum() < 3:
            continue
        jj, ii = np.meshgrid(np.arange(j0, j0 + box.shape[1]) + 0.5, np.arange(i0, i0 + box.shape[0]) + 0.5)
        v = box[strong]
        s1 = pixel_lab(solution, jj[strong], ii[strong])
        s1 /= np.linalg.norm(s1, axis=1, keepdims=True)
        c = pixel_lab(solution, np.array(x), np.array(y))
        c = c / np.linalg.norm(c)
        angles = np.arccos(np.clip(s1 @ c, -1.0, 1.0))
        if v.sum() > 1:
            variances.append(float((v * angles ** 2).sum() / (v.sum() - 1)))
    return math.degrees(math.sqrt(float(np.mean(variances))))


def delta_psi(solution: dict, hkl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(delta psi (rad), d (A))`` of each reflection: the angle about ``q x s0`` from ``q = A* h`` to the sphere."""
    a_star = np.asarray(solution["crystal"]["reciprocal_matrix_Astar_columns_astar_bstar_cstar_per_A"])
    wavelength = solution["wavelength_A"]
    q = hkl @ a_star.T
    qn = np.linalg.norm(q, axis=1)
    beam = -np.asarray(solution["beam_propagation_unit_vector"], dtype=float)  # towards the source
    ideal = np.arccos(np.clip(qn * wavelength / 2.0, -1, 1))  # angle of q from the source direction on the sphere
    actual = np.arccos(np.clip(q @ beam / qn, -1, 1))
    return actual - ideal, 1.0 / qn


def mosaic_model(dpsi: np.ndarray, d: np.ndarray, keep: float = 0.95) -> tuple[float, float]:
    """``(domain size A, half mosaicity deg)``: the narrowest band ``|dpsi| <= eta/2 + d / D`` (least mean log width)
    that holds ``keep`` of the reflections."""
    best = None
    for inv_d in np.linspace(0.0, 2.0 * np.quantile(np.abs(dpsi) / d, keep), 400):
        half = max(float(np.quantile(np.abs(dpsi) - d * inv_d, keep)), 0.0)
        width = half + d * inv_d
        cost = float(np.mean(np.log(np.maximum(width, 1e-12))))
        if best is None or cost < best[0]:
            best = (cost, inv_d, half)
    _, inv_d, half = best
    return (1.0 / inv_d if inv_d > 0 else 1e5), math.degrees(half)


def experiment(solution: dict, image_name: str, sigma_b: float, size_a: float, half_deg: float) -> dict:
    """The still's ExperimentList document (dxtbx's layout)."""
    det, xtal = solution["detector"], solution["crystal"]
    nf, ns = det["image_size_fast_slow"]
    return {
        "__id__": "ExperimentList",
        "experiment": [{"__id__": "Experiment", "identifier": Path(image_name).name.split(".")[0], "beam": 0, "detector": 0,
                        "crystal": 0, "profile": 0, "imageset": 0}],
        "imageset": [{"__id__": "ImageSet", "images": [image_name], "mask": "", "gain": "", "pedestal": "", "dx": "",
                      "dy": "", "params": {}}],
        "beam": [{"direction": [0.0, 0.0, 1.0], "wavelength": solution["wavelength_A"], "divergence": 0.0,
                  "sigma_divergence": 0.0, "polarization_normal": [0.0, 1.0, 0.0], "polarization_fraction": 0.99,
                  "flux": 0.0, "transmission": 1.0}],
        "detector": [{"panels": [{"name": "Panel", "type": "SENSOR_PAD", "fast_axis": det["fast_axis"],
                                  "slow_axis": det["slow_axis"], "origin": det["origin_mm_corner_of_pixel_0_0"],
                                  "raw_image_offset": [0, 0], "image_size": [nf, ns],
                                  "pixel_size": [det["pixel_size_mm"]] * 2, "trusted_range": [-1.0, 115897.0],
                                  "thickness": 0.45, "material": "Si", "mu": MU_SI, "identifier": "", "mask": [],
                                  "gain": 1.0, "pedestal": 0.0,
                                  "px_mm_strategy": {"type": "ParallaxCorrectedPxMmStrategy"}}]}],
        "crystal": [{"__id__": "MosaicCrystalSauter2014", "real_space_a": xtal["real_space_a"],
                     "real_space_b": xtal["real_space_b"], "real_space_c": xtal["real_space_c"],
                     "space_group_hall_symbol": HALL, "ML_half_mosaicity_deg": half_deg,
                     "ML_domain_size_ang": size_a}],
        "profile": [{"__id__": "gaussian_rs", "n_sigma": 3.0, "sigma_b": sigma_b, "sigma_m": 0.0}],
    }


def still_files(data: Path, number: str) -> tuple[dict, dict[str, tuple[str, np.ndarray]], str]:
    """One still's experiment document, its reflection columns and a summary line."""
    stem = f"thau_3_2_{number}"
    solution = json.loads((data / f"{stem}_solution.json").read_text())
    spots = read_spots(data / f"{stem}_spots.txt")
    image = load_image(data / f"{stem}.cbf.bz2").image
    sigma_b = sigma_b_deg(image, solution, spots["xy"])
    dpsi, d = delta_psi(solution, spots["hkl"])
    size_a, half_deg = mosaic_model(dpsi, d)
    n = len(d)
    columns = {
        "miller_index": ("cctbx::miller::index<>", spots["hkl"]),
        "xyzobs.px.value": ("vec3<double>", np.c_[spots["xy"], np.zeros(n)]),
        "xyzcal.px": ("vec3<double>", np.c_[spots["pred"], np.zeros(n)]),
        "d": ("double", d), "intensity.sum.value": ("double", spots["counts"]),
        "flags": ("std::size_t", np.full(n, INDEXED | USED_IN_REFINEMENT | STRONG, dtype=np.uint64)),
        "id": ("int", np.zeros(n, dtype=np.int32)), "panel": ("std::size_t", np.zeros(n, dtype=np.uint64))}
    line = (f"{n} indexed reflections, sigma_b {sigma_b:.4g} deg, ML_domain_size_ang {size_a:.4g}, "
            f"ML_half_mosaicity_deg {half_deg:.4g} (|delta psi| median {math.degrees(float(np.median(np.abs(dpsi)))):.3g} deg)")
    image_path = str((data / f"{stem}.cbf.bz2").resolve())
    return experiment(solution, image_path, sigma_b, size_a, half_deg), columns, line


def combined(experiments: list[dict], tables: list[dict]) -> tuple[dict, dict]:
    """Several stills as one file pair, as dials.stills_process's composite output: experiment ``i`` with its own
    beam, detector, crystal, profile and imageset ``i``; its reflections ``id`` ``i``."""
    doc = {"__id__": "ExperimentList", "experiment": []}
    for key in ("imageset", "beam", "detector", "crystal", "profile"):
        doc[key] = [e[key][0] for e in experiments]
    for i, e in enumerate(experiments):
        entry = dict(e["experiment"][0])
        entry.update({key: i for key in ("beam", "detector", "crystal", "profile", "imageset")})
        doc["experiment"].append(entry)
    columns = {}
    for name, (kind, _) in tables[0].items():
        parts = [t[name][1] if name != "id" else np.full(len(t["d"][1]), i, dtype=np.int32)
                 for i, t in enumerate(tables)]
        columns[name] = (kind, np.concatenate(parts))
    return doc, columns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent / "shared/real/thaumatin_i24_still"))
    p.add_argument("--image", nargs="+", default=["0003"],
                   help="image numbers (0003, 0004); with several, also one file pair of them all: thau_3_2_stills")
    p.add_argument("--out-dir", default="out/thaumatin_dials")
    a = p.parse_args(argv)
    data, out = Path(a.data), Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    experiments, tables = [], []
    for number in a.image:
        stem = f"thau_3_2_{number}"
        doc, columns, line = still_files(data, number)
        write_expt(out / f"{stem}.expt", doc)
        write_refl(out / f"{stem}.refl", columns, {0: stem})
        print(f"wrote {out / (stem + '.expt')} and {out / (stem + '.refl')}: {line}")
        experiments.append(doc)
        tables.append(columns)
    if len(experiments) > 1:
        doc, columns = combined(experiments, tables)
        write_expt(out / "thau_3_2_stills.expt", doc)
        write_refl(out / "thau_3_2_stills.refl", columns,
                   {i: e["experiment"][0]["identifier"] for i, e in enumerate(experiments)})
        print(f"wrote {out / 'thau_3_2_stills.expt'} and {out / 'thau_3_2_stills.refl'}: {len(experiments)} "
              f"experiments, {len(columns['d'][1])} indexed reflections")
    return 0


if __name__ == "__main__":
    sys.exit(main())
