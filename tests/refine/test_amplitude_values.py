"""The starting amplitudes held once per process (refine.fitting.amplitude_values): every image's values and map of a
joint run read one shared copy, writes stay in the image's own layer, and an evaluation's amplitude vector is made
from tensors kept once (the held amplitudes at their starts), with the same loss and gradient bits as one tensor
per amplitude name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refine.fitting.amplitude_values import AmplitudeValues, layered, shared_layer
from refine.fitting.parameters import ParameterMap, ParameterSpace
from refine.fitting.structure_factors import AMPLITUDE_BLOCK, AmplitudeOptions

pytest.importorskip("gemmi")


def _problem(min_photons: float):
    from experiments.serial_amplitudes import SPACE_GROUP, SYMMETRY, make_amplitude_set
    from refine.many.distributed import Comm
    from refine.many.joint_problem import joint_problem

    torch.set_num_threads(1)
    s = make_amplitude_set(3, np.random.default_rng(1), size=48, truth_domains=1, truth_oversample=1).serial
    return joint_problem(Comm(), s.simulators(), s.observed(), None, s.shared_start, s.image_starts(),
                         shared=("cell",), per_image=("scale", "background", "orientation"), symmetry=SYMMETRY,
                         background="constant", loss="poisson",
                         structure_factors=AmplitudeOptions(SPACE_GROUP, start="one", min_photons=min_photons),
                         local_images=None, priors=None)


def test_layered_values_read_through_and_write_to_their_own_layer():
    shared = AmplitudeValues({"F_1_0_0": 10.0, "F_0_1_0": 20.0})
    v = layered({"cell_a": 5.0, "F_1_0_0": 99.0}, shared)
    assert v["F_1_0_0"] == 10.0 and v["cell_a"] == 5.0 and set(v) == {"cell_a", "F_1_0_0", "F_0_1_0"}
    v["F_0_1_0"] = 3.0
    v.update(cell_a=6.0)
    assert shared == {"F_1_0_0": 10.0, "F_0_1_0": 20.0} and v["F_0_1_0"] == 3.0 and v["cell_a"] == 6.0
    # a layer with an amplitude of its own, a plain dict or a missing name: not the shared layer
    assert shared_layer(v, ("F_1_0_0",)) is None and shared_layer(dict(v), ("F_1_0_0",)) is None
    assert shared_layer(layered({}, shared), ("F_1_0_0", "F_0_1_0")) is shared
    assert shared_layer(layered({}, shared), ("F_1_0_0", "F_2_0_0")) is None
    assert shared.cached("k", lambda: [1]) is shared.cached("k", lambda: [2])


def test_a_map_copies_the_amplitudes_of_plain_values_and_shares_a_layer():
    space = ParameterSpace(amplitudes=("F_1_0_0", "F_0_1_0"))
    from refine.fitting.parameters import BASE_NAMES
    base = {n: 1.0 for n in BASE_NAMES}
    shared = AmplitudeValues({"F_1_0_0": 10.0, "F_0_1_0": 20.0})
    own = ParameterMap(space, {**base, **shared}, ("cell_a",))
    on_layer = ParameterMap(space, layered(base, shared), ("cell_a",))
    assert on_layer._amplitudes is shared and own._amplitudes is not shared and own._amplitudes == shared
    out = on_layer.expand(on_layer.physical(on_layer.raw0()))
    assert out["F_0_1_0"] == 20.0 and float(out["cell_a"]) == 1.0 and shared == {"F_1_0_0": 10.0, "F_0_1_0": 20.0}


def test_every_image_of_a_joint_run_reads_one_copy_of_the_amplitudes():
    prob = _problem(min_photons=10.0)
    layer = prob.amps.start
    assert isinstance(layer, AmplitudeValues) and len(layer) == len(prob.amps.table.names) > 20
    for im in prob.joint.images:
        assert im.pmap._amplitudes is layer and im.prepared.values.maps[-1] is layer
        assert not any(k.startswith("F_") for k in im.pmap.values.maps[0])
    assert all(s.maps[-1] is layer for s in prob.map_starts.values()) and prob.map_start0.maps[-1] is layer


def test_the_block_with_held_amplitudes_gives_the_same_bits_from_tensors_made_once(monkeypatch):
    """Some candidates held (a high photon threshold): the block's vector holds every amplitude, the held ones at
    their starts; its tensors are the same objects for every image and evaluation; loss and gradient equal the
    by-name evaluation's bits."""
    prob = _problem(min_photons=2000.0)
    assert len(prob.amps.held) > 5 and len(prob.amps.free) > 5
    raw = prob.raw0 + 0.01 * torch.sin(torch.arange(prob.raw0.numel(), dtype=torch.float64))
    maps = [im.pmap for im in prob.joint.images]
    r0 = prob.joint.image_raw(raw, 0)
    names, vec = maps[0].physical_block(r0)[AMPLITUDE_BLOCK]
    by_name = maps[0].expand(maps[0].physical(r0))
    assert names == prob.amps.table.names
    assert torch.equal(vec, torch.stack([torch.as_tensor(by_name[n], dtype=torch.float64) for n in names]))
    made = [m._amplitude_block().tensor(w, torch.float64, "cpu") for m in maps for w in ("base", "where")]
    assert all(t is made[0] for t in made[0::2]) and all(t is made[1] for t in made[1::2])
    block_loss, block_grad, _ = prob.joint.loss_and_grad(raw)
    monkeypatch.setattr(ParameterMap, "physical_block", ParameterMap.physical)
    loss, grad, _ = prob.joint.loss_and_grad(raw)
    assert float(block_loss) == float(loss)
    assert torch.equal(block_grad.as_subclass(torch.Tensor), grad.as_subclass(torch.Tensor))


def test_the_physical_vector_is_every_name_in_raw_order():
    """ParameterMap.physical_vector (the amplitudes' run as one operation; what physical_per_raw differentiates)
    equals the per-name values in raw order, and its forward derivative the per-name one."""
    from refine.solver.precondition import physical_per_raw

    prob = _problem(min_photons=500.0)
    pmap = prob.joint.images[1].pmap
    r = prob.joint.image_raw(prob.raw0, 1) + 0.02
    by_name = torch.stack(list(pmap.physical(r).values()))
    assert pmap._amplitude_block() is not None and torch.equal(pmap.physical_vector(r), by_name)
    _, d = torch.func.jvp(lambda x: torch.stack(list(pmap.physical(x).values())), (r,), (torch.ones_like(r),))
    torch.testing.assert_close(physical_per_raw(pmap, r), d, rtol=1e-14, atol=0)


def test_the_maps_share_the_list_of_the_shared_names_transforms():
    """Every image's map after the first reads the first map's transforms of the shared names (one list, not one
    per image) and keeps its own for its own names; replacing a shared one is refused."""
    from refine.fitting.parameters import SharedHead

    prob = _problem(min_photons=10.0)
    first, other = prob.joint.images[0].pmap, prob.joint.images[2].pmap
    assert isinstance(other.transforms, SharedHead) and other.transforms.head is first.transforms
    assert other.transforms.n == prob.joint.S and len(other.transforms) == len(other.names)
    assert list(other.transforms)[:prob.joint.S] == list(first.transforms)[:prob.joint.S]
    assert other.transforms[-1] is other.transforms.own[-1] and other.transforms[-1] is not first.transforms[-1]
    assert other.transforms[1:3] == [first.transforms[1], first.transforms[2]]
    with pytest.raises(IndexError, match="own transforms"):
        other.transforms[0] = first.transforms[0]


def test_the_entry_photons_gather_nothing_per_image(monkeypatch):
    """The candidates' photons are exact sums over the entries some image touches: no per-image list of entries is
    gathered (10^4 stills x 10^4 entries in every process), and the sums are the image-by-image float sums to
    rounding."""
    from refine.many import amplitudes
    from refine.many.distributed import Comm

    def refuse(self, local, n):
        raise AssertionError("per-image objects gathered")

    seen = {}
    exact = amplitudes._summed_entry_photons

    def keep(comm, images, n, grid, lo):
        seen["images"], seen["grid"], seen["lo"] = images, grid, lo
        seen["out"] = exact(comm, images, n, grid, lo)
        return seen["out"]

    monkeypatch.setattr(Comm, "gather_objects", refuse)
    monkeypatch.setattr(amplitudes, "_summed_entry_photons", keep)
    _problem(min_photons=10.0)
    plain = sum(amplitudes.entry_photons(im.sim, im.values, im.valid(), seen["grid"], seen["lo"])
                for im in seen["images"])
    assert float(plain.max()) > 0
    np.testing.assert_allclose(seen["out"], plain.reshape(seen["out"].shape), rtol=1e-12, atol=0)
