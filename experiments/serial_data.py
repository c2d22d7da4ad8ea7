"""Synthetic serial-crystallography data sets: many stills of one crystal form, some of them bad.

:func:`make_serial` draws ``n`` stills of the bank problem ``cubic_mosflm`` (:mod:`refine.inputs.problems`: cubic
cell 48 A, 0.1 mm pixels, 25 mm, random Wilson structure factors) on a ``size x size`` detector, every random
number from the ``numpy.random.Generator`` passed in (the same generator state gives the same set):

* orientation: misset angles uniform in [-180, 180) x [-60, 60) x [-180, 180) deg;
* scale: log-normal, ``exp(N(0, scale_spread))``; mosaic spread: ``0.8 deg x (1 + N(0, mosaic_spread))``
  (floored at 0.2 deg); background: ``5 photons x exp(N(0, background_spread))`` with shot noise, plus the
  40-count pedestal;
* ``observed = Poisson(scale x crystal + shot background) + pedestal``.

Each image draws from its own generator, seeded by one number drawn from ``rng`` and its index, so ``keep=``
(the images one process of a torchrun run holds) draws only the kept images, the same bits as in the whole set:
the others are None in :attr:`SerialSet.images` (their kinds are in :attr:`SerialSet.kinds`), so a process's
memory and time to draw are its share of the set.

The start of a good image is what an indexer gives: the orientation off by ``orientation_error_deg`` about a
random axis, scale 1, the beam centre, distance, N and the image's mosaic spread known (not refined); the
shared start is the cell ``x (1 + cell_error)``.  A fraction ``bad_fraction`` of the images is bad, in equal
parts (kinds, :data:`BAD_KINDS`):

* ``wrong_crystal``: another crystal form (cell x 1.1) in the same setting;
* ``garbage``: no crystal; bright blobs (ice, a shadow, a hit on the detector frame) on the background;
* ``failed_start``: good data whose start is 25 deg off in orientation (a wrong indexing solution).

:meth:`SerialSet.write` stores the images (``image_00000.npy``, photons + pedestal) and a ``manifest.json``
(kind, truth, start of each, the shared start and truth); :func:`load_serial` reads it back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nbtorch.cli.args import config_from_args
from nbtorch.errors import InputError
from nbtorch.parameters import PARAMETER_NAMES
from nbtorch.simulator import Simulator
from refine.fitting.parameters import misset_from_rotation, misset_rotation
from refine.inputs.problems import PEDESTAL, make_problem

__all__ = ["SerialImage", "SerialSet", "make_serial", "load_serial", "BAD_KINDS", "PROBLEM", "KNOWN", "turn_misset"]

PROBLEM = "cubic_mosflm"
BAD_KINDS = ("wrong_crystal", "garbage", "failed_start")
#: base names each image's start takes from its truth (not refined)
KNOWN = ("beam_x", "beam_y", "distance", "N_a", "N_b", "N_c", "mosaic_spread")
SHOT_BACKGROUND = 5.0
MOSAIC_DEG = 0.8


@dataclass(frozen=True)
class SerialImage:
    """One still: ``kind`` (``"good"`` or one of :data:`BAD_KINDS`), ``observed`` (slow, fast) counts, its
    ``truth`` and ``start`` (base values overriding the simulator's: :meth:`SerialSet.image_starts`)."""

    index: int
    kind: str
    observed: np.ndarray = field(repr=False)
    truth: dict = field(repr=False)
    start: dict = field(repr=False)


@dataclass(frozen=True)
class SerialSet:
    """A serial data set: the images (None where not drawn: :func:`make_serial`'s ``keep``), the nanoBragg flags of
    the common starting model, the crystal system, the shared start (the cell), the true shared values and every
    image's kind."""

    images: tuple
    args: tuple
    symmetry: str
    shared_start: dict
    shared_truth: dict
    kinds: tuple = ()

    def __post_init__(self) -> None:
        if not self.kinds:
            object.__setattr__(self, "kinds", tuple(im.kind for im in self.images))

    def __len__(self) -> int:
        return len(self.images)

    def simulators(self, indices=None) -> list:
        """One :class:`Simulator` per image (only ``indices``, default the drawn images; the others None)."""
        config = config_from_args(list(self.args))
        keep = {i for i, im in enumerate(self.images) if im is not None} if indices is None else set(indices)
        return [Simulator(config, dtype=torch.float64, compile=False) if i in keep else None
                for i in range(len(self))]

    def observed(self) -> list:
        """Each image's counts (None where not drawn)."""
        return [None if im is None else im.observed for im in self.images]

    def image_starts(self) -> list:
        """Each image's start (None where not drawn)."""
        return [None if im is None else dict(im.start) for im in self.images]

    def bad(self) -> dict:
        """``{index: kind}`` of the bad images."""
        return {i: kind for i, kind in enumerate(self.kinds) if kind != "good"}

    def subset(self, indices) -> "SerialSet":
        """The images ``indices`` (renumbered from 0, in that order; every one drawn)."""
        missing = [i for i in indices if self.images[i] is None]
        if missing:
            raise InputError(f"subset: image {missing[0]} was not drawn (make_serial's keep)")
        ims = tuple(SerialImage(j, self.images[i].kind, self.images[i].observed, self.images[i].truth,
                                self.images[i].start) for j, i in enumerate(indices))
        return SerialSet(ims, self.args, self.symmetry, self.shared_start, self.shared_truth)

    def write(self, directory: str | Path) -> Path:
        """``directory/manifest.json`` and one ``image_NNNNN.npy`` per image; returns the manifest's path."""
        missing = [i for i, im in enumerate(self.images) if im is None]
        if missing:
            raise InputError(f"write: image {missing[0]} was not drawn (make_serial's keep)")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for im in self.images:
            name = f"image_{im.index:05d}.npy"
            np.save(out / name, im.observed)
            rows.append({"file": name, "kind": im.kind, "truth": im.truth, "start": im.start})
        doc = {"format": "nbtorch-serial-set", "version": 1, "args": list(self.args), "symmetry": self.symmetry,
               "shared_start": self.shared_start, "shared_truth": self.shared_truth, "images": rows}
        path = out / "manifest.json"
        path.write_text(json.dumps(doc, indent=1))
        return path


def load_serial(manifest: str | Path) -> SerialSet:
    """Read a set written by :meth:`SerialSet.write`."""
    path = Path(manifest)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable serial manifest ({exc})") from None
    if doc.get("format") != "nbtorch-serial-set":
        raise InputError(f"{path}: not an nbtorch serial manifest (format {doc.get('format')!r})")
    ims = tuple(SerialImage(i, r["kind"], np.load(path.parent / r["file"]), r["truth"], r["start"])
                for i, r in enumerate(doc["images"]))
    return SerialSet(ims, tuple(doc["args"]), doc["symmetry"], doc["shared_start"], doc["shared_truth"])


def turn_misset(misset, angle_deg: float, rng: np.random.Generator) -> dict:
    """``misset`` (deg) turned by ``angle_deg`` about a random axis."""
    axis = rng.standard_normal(3)
    axis /= np.linalg.norm(axis)
    a = math.radians(angle_deg)
    K = torch.tensor([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]], dtype=torch.float64)
    R = torch.eye(3, dtype=torch.float64) + math.sin(a) * K + (1 - math.cos(a)) * K @ K
    m = torch.tensor(misset, dtype=torch.float64)
    return dict(zip(("misset_x", "misset_y", "misset_z"), (float(v) for v in misset_from_rotation(R @ misset_rotation(m), m))))


def _blobs(size: int, rng: np.random.Generator) -> np.ndarray:
    """(size, size) photons of a few bright Gaussian blobs and a streak: an image without a lattice."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    out = np.zeros((size, size))
    for _ in range(int(rng.integers(4, 9))):
        cy, cx, w, h = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(1.0, 4.0), rng.uniform(50, 400)
        out += h * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * w * w))
    row = int(rng.integers(0, size))
    out[row] += rng.uniform(20, 80)
    return out


def make_serial(n: int, rng: np.random.Generator, *, size: int = 64, bad_fraction: float = 0.05,
                scale_spread: float = 0.3, mosaic_spread: float = 0.1, background_spread: float = 0.3,
                cell_error: float = 0.005, orientation_error_deg: float = 0.2, keep=None) -> SerialSet:
    """``n`` stills (module docstring): which are bad and each image's seed from ``rng``, image ``i``'s random
    numbers from ``numpy.random.default_rng([seed, i])``; ``keep``: the indices drawn (default all; the same bits
    either way)."""
    if int(n) != n or n < 1:
        raise InputError(f"n: expected an integer >= 1, got {n!r}")
    if not 0.0 <= bad_fraction < 1.0:
        raise InputError(f"bad_fraction: expected a number in [0, 1), got {bad_fraction!r}")
    base = make_problem(PROBLEM, size)
    sim = Simulator(config_from_args(list(base.args)), dtype=torch.float64, compile=False)
    n_bad = int(round(bad_fraction * n))
    kinds = ["good"] * n
    for j, i in enumerate(rng.choice(n, size=n_bad, replace=False)):
        kinds[int(i)] = BAD_KINDS[j % len(BAD_KINDS)]
    cell = {k: base.truth[k] for k in ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")}
    seed = int(rng.integers(2 ** 63))
    kept = range(int(n)) if keep is None else sorted({int(i) for i in keep})
    images: list = [None] * int(n)
    for i in kept:
        if not 0 <= i < n:
            raise InputError(f"keep: image {i} is not among the {n} images")
        images[i] = _one(i, kinds[i], sim, base.truth, cell, np.random.default_rng([seed, i]), size, scale_spread,
                         mosaic_spread, background_spread, orientation_error_deg)
    start = {k: v * (1.0 + cell_error) if k in ("cell_a", "cell_b", "cell_c") else v for k, v in cell.items()}
    return SerialSet(tuple(images), tuple(base.args), base.symmetry, start, cell, tuple(kinds))


def _one(i: int, kind: str, sim: Simulator, base: dict, cell: dict, rng: np.random.Generator, size: int,
         scale_spread: float, mosaic_spread: float, background_spread: float, orientation_error_deg: float
         ) -> SerialImage:
    """Image ``i`` of :func:`make_serial`, every random number from ``rng`` (its own)."""
    misset = rng.uniform([-180.0, -60.0, -180.0], [180.0, 60.0, 180.0])
    truth = {**base, **cell, **dict(zip(("misset_x", "misset_y", "misset_z"), (float(m) for m in misset)))}
    truth["scale"] = float(np.exp(rng.normal(0.0, scale_spread)))
    truth["mosaic_spread"] = max(0.2, MOSAIC_DEG * (1.0 + rng.normal(0.0, mosaic_spread)))
    shot = SHOT_BACKGROUND * float(np.exp(rng.normal(0.0, background_spread)))
    truth["background"] = shot + PEDESTAL
    if kind == "wrong_crystal":
        truth.update({k: cell[k] * 1.1 for k in ("cell_a", "cell_b", "cell_c")})
    params = {k: truth[k] for k in PARAMETER_NAMES}
    if kind == "garbage":
        crystal = _blobs(size, rng)
    else:
        with torch.no_grad():
            crystal = sim(**{k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}).numpy()
    observed = rng.poisson(truth["scale"] * crystal + shot).astype(np.float64) + PEDESTAL
    turn = 25.0 if kind == "failed_start" else orientation_error_deg
    start = {**{k: truth[k] for k in KNOWN}, **turn_misset(misset, turn, rng), "scale": 1.0}
    return SerialImage(i, kind, observed, {k: float(v) for k, v in truth.items()}, start)
