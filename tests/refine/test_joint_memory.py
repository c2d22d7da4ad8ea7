"""Bounded memory of a joint refinement (issue #19): each image holds only its fitted pixels
(:mod:`refine.many.pixel_table`), and pixels stored in files (read back at each evaluation) give the same result.

The stills are 96 x 96 pixels fitted on a sparse sample of ~4 % of them, so anything of the detector's size that
an image keeps (the observed image, a mask, a restricted simulator's mask, dense copies of the fitted rectangle)
would dwarf the fitted pixels' tables and fail the bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import refine.many.joint as joint_module
from nbtorch.errors import InputError
from refine.many.joint import DEFAULT_CONVERGENCE, refine_joint
from refine.many.pixel_table import FittedPixels, StoredPixels, load_pixels
from refine.solver.plan import observed_pixels
from refine.inputs.problems import make_stills

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from joint_stills import image_start  # noqa: E402
from memory_walk import held_storages as _held  # noqa: E402

SIZE, N = 96, 2
CELL = ("cell_a", "cell_b", "cell_c")


@pytest.fixture(scope="module")
def stills(tmp_path_factory):
    torch.set_num_threads(1)
    return make_stills("orthorhombic_xds", N, SIZE, seed=3, directory=tmp_path_factory.mktemp("memory_stills"))


def _sample(p, k: int) -> np.ndarray:
    """~4 % of the pixels: the brightest 1 % (the spots) and a random 3 % (background)."""
    obs = np.asarray(p.observed, dtype=np.float64)
    rng = np.random.default_rng(k)
    mask = rng.random(obs.shape) < 0.03
    mask |= obs >= np.quantile(obs, 0.99)
    return mask


def _pixels(stills) -> list[FittedPixels]:
    out = []
    for k, p in enumerate(stills):
        sim = p.simulator()
        obs, valid = observed_pixels(sim, p.observed, torch.as_tensor(_sample(p, k)))
        out.append(FittedPixels.from_image(obs, valid, source=f"still {k}"))
    return out


def _run(stills, observed, masks=None, **kw):
    conv = DEFAULT_CONVERGENCE.replace(max_steps=kw.pop("max_steps", 4))
    return refine_joint([p.simulator() for p in stills], observed, masks, symmetry=stills[0].symmetry,
                        start={k: stills[0].start[k] for k in CELL}, image_starts=[image_start(p) for p in stills],
                        convergence=conv, esds=kw.pop("esds", False), **kw)


class _Stop(Exception):
    pass


def _images_at_loop_start(monkeypatch, stills, observed, masks=None):
    """The joint run's per-image state as the loop starts (the run is stopped there)."""
    seen = {}

    def capture(joint, *args, **kwargs):
        seen["images"] = list(joint.images)
        raise _Stop

    monkeypatch.setattr(joint_module, "_run_loop", capture)
    with pytest.raises(_Stop):
        _run(stills, observed, masks)
    return seen["images"]


def test_each_image_holds_only_its_fitted_pixels(stills, monkeypatch):
    # dense images and masks in: the joint run keeps each image's fitted pixels only
    masks = [torch.as_tensor(_sample(p, k)) for k, p in enumerate(stills)]
    images = _images_at_loop_start(monkeypatch, stills, [p.observed for p in stills], masks)
    # the crystal's structure-factor table: one copy for the images (each simulator read its own)
    assert stills[0].simulator().F_grid is not None
    assert images[0].prepared.sim.F_grid is images[1].prepared.sim.F_grid
    common = set(_held(images[0])) & set(_held(images[1]))
    for im, mask in zip(images, masks):
        objective = im.objective  # made as the loop makes it
        n = objective.n_pixels
        assert 0.03 * SIZE * SIZE < n < 0.06 * SIZE * SIZE and n == int(mask.sum())
        held = {k: v for k, v in _held(im).items() if k not in common}  # the image's own
        largest = max(held.values(), key=lambda v: v[0])
        total = sum(b for b, _ in held.values())
        # positions and photons (int64 + float64) in the pixel table and in the objective's ROI form, plus small
        # things (parameters, per-row offsets); a float64 image of the detector alone would be 73 728 bytes
        assert total <= 4 * 8 * n + 16_000, (total, sorted(held.values(), key=lambda v: -v[0])[:4])
        assert largest[0] <= 8 * n, largest
        assert all(int(np.prod(shape)) < SIZE * SIZE for _, shape in held.values())


def test_stored_pixels_hold_nothing_and_give_the_same_result(stills, tmp_path, monkeypatch):
    pixels = _pixels(stills)
    held = _run(stills, pixels)
    stored = [px.store(tmp_path / f"still_{k}.npz") for k, px in enumerate(pixels)]
    assert all(isinstance(s, StoredPixels) and s.nbytes == 0 for s in stored)
    from_files = _run(stills, stored)
    assert from_files.steps == held.steps == 4
    for name in CELL:
        assert from_files.shared[name] == held.shared[name]
    assert from_files.image_losses == held.image_losses and from_files.loss_final == held.loss_final
    # the dense images with the same masks: the same fit (one pixel set, one digest)
    dense = _run(stills, [p.observed for p in stills], [torch.as_tensor(_sample(p, k)) for k, p in enumerate(stills)])
    assert dense.loss_final == held.loss_final and dense.shared == held.shared
    # stored: the image keeps the file's name, not its pixels
    images = _images_at_loop_start(monkeypatch, stills, stored)
    common = set(_held(images[0])) & set(_held(images[1]))
    for im in images:
        assert sum(b for k, (b, _) in _held(im).items() if k not in common) < 16_000


def test_fitted_pixels_round_trip_and_errors(stills, tmp_path):
    px = _pixels(stills)[0]
    back = load_pixels(px.store(tmp_path / "a.npz").path)
    assert back.shape == px.shape and torch.equal(back.index, px.index) and torch.equal(back.observed, px.observed)
    assert torch.equal(back.digest(), px.digest()) and back.source == "still 0"
    assert torch.equal(px.dense()[px.valid_mask()], px.observed) and int(px.valid_mask().sum()) == px.n
    (tmp_path / "bad.npz").write_bytes(b"not a file")
    with pytest.raises(InputError, match=r"^fitted pixels .*bad.npz: cannot be read"):
        load_pixels(tmp_path / "bad.npz")
    stored = px.store(tmp_path / "b.npz")
    _pixels(stills)[1].store(tmp_path / "b.npz")  # another image's pixels over the file
    with pytest.raises(InputError, match="changed since it was written"):
        stored.load()
    with pytest.raises(InputError, match="no usable pixels"):
        FittedPixels.from_image(torch.ones(4, 4), torch.zeros(4, 4, dtype=torch.bool), "empty")
    with pytest.raises(InputError, match=r"masks\[0\]: give None for fitted pixels"):
        _run(stills, [px, px], [torch.ones(SIZE, SIZE, dtype=torch.bool), None])


def test_render_pixels_at_given_positions(stills):
    sim = stills[0].simulator()
    image, _ = sim.render()
    positions = torch.tensor([0, 5, 17, SIZE * 40 + 33, SIZE * SIZE - 1])
    values, index, _ = sim.render_pixels(pixels=positions)
    assert torch.equal(index, positions) and float(image.max()) > 0
    torch.testing.assert_close(values, image.reshape(-1)[positions], rtol=1e-12, atol=0)
    # in a ROI: positions are the ROI's
    roi = (10, 49, 20, 59)
    sub, _ = sim.render(roi=roi)
    v, _, _ = sim.render_pixels(roi=roi, pixels=torch.tensor([0, 41, 1599]))
    torch.testing.assert_close(v, sub.reshape(-1)[[0, 41, 1599]], rtol=1e-12, atol=0)
    # a position the simulator's pixel mask excludes is exactly 0
    keep = np.ones((SIZE, SIZE), dtype=bool)
    keep[40, 33] = False
    v, _, _ = sim.restricted(keep).render_pixels(pixels=positions)
    assert float(v[3]) == 0.0 and torch.equal(v[[0, 1, 2, 4]], values[[0, 1, 2, 4]])
    with pytest.raises(InputError, match=r"pixels: positions must lie in \[0, 1600\)"):
        sim.render_pixels(roi=roi, pixels=torch.tensor([1600]))
    with pytest.raises(InputError, match="pixels: expected a 1-d integer tensor"):
        sim.render_pixels(pixels=torch.tensor([[1.0]]))
