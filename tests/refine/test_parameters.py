"""Parameters: groups, crystal-system constraints, the raw <-> physical map, orientation composition."""

from __future__ import annotations

import math

import pytest
import torch

from nbtorch.physics.rotation import rotation_matrix_xyz
from nbtorch.parameters import PARAMETER_NAMES
from refine.fitting.parameters import (
    BASE_NAMES, SYMMETRIES, UNITS, ParameterMap, ParameterSpace, canonical_values, constrained_cell,
    misset_after_rotation,
)
from refine.fitting.transforms import Bounded, Identity, Multiplicative, Positive
from nbtorch.errors import InputError

F64 = torch.float64


def state(**kw) -> dict:
    v = {n: 0.0 for n in BASE_NAMES}
    v.update(cell_a=50.0, cell_b=50.0, cell_c=70.0, cell_alpha=90.0, cell_beta=90.0, cell_gamma=90.0,
             mosaic_spread=0.5, N_a=8.0, N_b=8.0, N_c=8.0, distance=100.0, beam_x=51.2, beam_y=51.2,
             wavelength=1.0, fluence=1e29, default_F=100.0, scale=1.0, background=40.0,
             misset_x=10.0, misset_y=20.0, misset_z=30.0)
    v.update(kw)
    return v


def test_every_name_has_a_unit():
    assert set(BASE_NAMES) | {"N"} <= set(UNITS)
    assert UNITS["cell_a"] == "A" and UNITS["distance"] == "mm" and UNITS["orient_x"] == "deg"


@pytest.mark.parametrize("symmetry, free", [
    ("triclinic", ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")),
    ("monoclinic", ("cell_a", "cell_b", "cell_c", "cell_beta")),
    ("orthorhombic", ("cell_a", "cell_b", "cell_c")),
    ("tetragonal", ("cell_a", "cell_c")),
    ("hexagonal", ("cell_a", "cell_c")),
    ("trigonal", ("cell_a", "cell_c")),
    ("rhombohedral", ("cell_a", "cell_alpha")),
    ("cubic", ("cell_a",)),
])
def test_cell_group_holds_the_free_values(symmetry, free):
    assert ParameterSpace(symmetry=symmetry).expand(["cell"]) == free
    assert SYMMETRIES[symmetry] == free


def test_constraints_tie_the_dependent_values():
    v = {"cell_a": 40.0, "cell_b": 41.0, "cell_c": 60.0, "cell_alpha": 80.0, "cell_beta": 100.0, "cell_gamma": 110.0}
    assert constrained_cell("tetragonal", v) == {"cell_a": 40.0, "cell_b": 40.0, "cell_c": 60.0,
                                                 "cell_alpha": 90.0, "cell_beta": 90.0, "cell_gamma": 90.0}
    assert constrained_cell("hexagonal", v)["cell_gamma"] == 120.0
    assert constrained_cell("monoclinic", v)["cell_beta"] == 100.0
    assert constrained_cell("monoclinic", v)["cell_alpha"] == 90.0
    r = constrained_cell("rhombohedral", v)
    assert r["cell_b"] == r["cell_c"] == 40.0 and r["cell_beta"] == r["cell_gamma"] == 80.0
    assert constrained_cell("cubic", v)["cell_c"] == 40.0
    assert constrained_cell("triclinic", v) == v


def test_refined_tetragonal_cell_keeps_a_equal_b():
    space = ParameterSpace(symmetry="tetragonal")
    pmap = ParameterMap(space, state(), space.expand(["cell"]))
    raw = torch.tensor([3.0, -2.0], dtype=F64, requires_grad=True)  # +3 %, -2 % (Multiplicative step 0.01)
    out = pmap.expand(pmap.physical(raw))
    assert out["cell_a"].item() == pytest.approx(50.0 * math.exp(0.03))
    assert out["cell_b"] is out["cell_a"]  # the same tensor: gradients flow to cell_a
    assert out["cell_c"].item() == pytest.approx(70.0 * math.exp(-0.02))
    assert out["cell_alpha"] == 90.0
    (out["cell_a"] + out["cell_b"]).backward()
    assert raw.grad[0].item() == pytest.approx(2 * 0.5 * math.exp(0.03))  # d(2a)/draw = 2 * 50 * 0.01 * e^0.03


def test_a_map_takes_another_maps_transforms_for_shared_names_at_the_same_start():
    """A joint run's image maps share one transform object per shared name (each a module of ~2 kB: thousands of
    amplitudes made per image once held most of a still's memory): where the start agrees; others are their own."""
    space = ParameterSpace(symmetry="tetragonal")
    names = space.expand(["cell", "scale", "distance"])
    first = ParameterMap(space, state(), names)
    other = ParameterMap(space, state(distance=101.0), names, share=(first, {"cell_a", "cell_c", "distance"}))
    mine = dict(zip(names, other.transforms))
    theirs = dict(zip(names, first.transforms))
    assert mine["cell_a"] is theirs["cell_a"] and mine["cell_c"] is theirs["cell_c"]
    assert mine["distance"] is not theirs["distance"]  # another start: its own
    assert mine["scale"] is not theirs["scale"]  # not shared
    raw = torch.tensor([1.0] * len(names), dtype=F64)
    plain = ParameterMap(space, state(distance=101.0), names)
    assert all(torch.equal(a, b) for a, b in zip(other.physical(raw).values(), plain.physical(raw).values()))


def test_start_breaking_the_symmetry_is_an_error():
    with pytest.raises(ValueError, match="cell_b=51 breaks the tetragonal"):
        ParameterSpace(symmetry="tetragonal").check_start(state(cell_b=51.0))
    ParameterSpace(symmetry="tetragonal").check_start(state())
    with pytest.raises(ValueError, match="cell_gamma"):
        ParameterSpace(symmetry="hexagonal").check_start(state())


def test_groups_and_names():
    space = ParameterSpace(symmetry="cubic")
    assert space.expand(["orientation"]) == ("orient_x", "orient_y", "orient_z")
    assert space.expand(["mosaic"]) == ("mosaic_spread", "N")
    assert space.expand(["detector"]) == ("distance", "beam_x", "beam_y", "detector_rotx", "detector_roty",
                                          "detector_rotz", "twotheta")
    assert space.expand(["misset_y"]) == ("orient_x", "orient_y", "orient_z")  # the misset is refined as a rotation
    assert space.expand(["N_b"]) == ("N",)  # isotropic unless N_a/N_b/N_c are named in the run
    assert ParameterSpace(anisotropic_N=True).expand(["mosaic"]) == ("mosaic_spread", "N_a", "N_b", "N_c")
    assert ParameterSpace(background="planar").expand(["background"]) == ("background", "background_x", "background_y")
    fixed = ParameterSpace(symmetry="cubic", fixed=("distance", "orientation"))
    assert fixed.expand(["detector", "orientation", "scale"]) == (
        "beam_x", "beam_y", "detector_rotx", "detector_roty", "detector_rotz", "twotheta", "scale")
    with pytest.raises(ValueError, match="not a free cell value"):
        space.expand(["cell_b"])
    with pytest.raises(ValueError, match="unknown parameter or group 'cel'"):
        space.expand(["cel"])
    with pytest.raises(ValueError, match="symmetry"):
        ParameterSpace(symmetry="orthorombic")


def test_transforms_and_step_sizes():
    space = ParameterSpace(pixel_mm=0.172, bounds={"distance": (90.0, 110.0)})
    assert isinstance(space.transform("cell_a", 50.0), Multiplicative)
    assert space.transform("cell_a", 50.0).scale == pytest.approx(0.5)  # one raw unit = 1 %
    beam = space.transform("beam_x", 30.0)
    assert isinstance(beam, Identity) and beam.scale == 0.172  # one raw unit = one pixel
    assert isinstance(space.transform("distance", 100.0), Bounded)
    assert isinstance(space.transform("background", 40.0), Positive)
    assert isinstance(space.transform("orient_x", 0.0), Identity)
    with pytest.raises(ValueError, match="outside its bounds"):
        space.transform("distance", 120.0)
    with pytest.raises(ValueError, match="mosaic_spread must be > 0"):
        space.transform("mosaic_spread", 0.0)


def test_map_round_trip_and_isotropic_N():
    space = ParameterSpace(symmetry="orthorhombic", bounds={"distance": (90.0, 110.0)})
    names = space.expand(["cell", "mosaic", "distance", "scale", "background", "orientation"])
    pmap = ParameterMap(space, state(N_c=4.0), names)
    raw0 = pmap.raw0()
    assert raw0.shape == (len(names),)
    values = pmap.values_at(raw0)
    for k, v in state(N_c=4.0).items():
        assert values[k] == pytest.approx(v, rel=1e-12, abs=1e-12)
    target = {n: pmap.start_value(n) * 1.01 if n != "orient_y" else 0.2 for n in names}
    raw = pmap.raw_from(target)
    phys = pmap.physical_floats(raw)
    for n in names:
        assert phys[n] == pytest.approx(target[n], rel=1e-12, abs=1e-12)
    values = pmap.values_at(raw)
    # N scales all three by one factor, keeping the anisotropy of the start
    assert values["N_a"] == pytest.approx(8.0 * 1.01) and values["N_c"] == pytest.approx(4.0 * 1.01)


def test_misset_composition_round_trip():
    misset = torch.tensor([10.0, 20.0, 30.0], dtype=F64)
    assert torch.allclose(misset_after_rotation(misset, torch.zeros(3, dtype=F64)), misset, atol=1e-12)
    orient = torch.tensor([0.3, -0.2, 0.1], dtype=F64)
    out = misset_after_rotation(misset, orient)
    deg = math.pi / 180
    R = rotation_matrix_xyz(*(orient * deg)) @ rotation_matrix_xyz(*(misset * deg))
    assert torch.allclose(rotation_matrix_xyz(*(out * deg)), R, atol=1e-13)
    # angles beyond +-90 deg about y come back on the branch nearest the input
    far = torch.tensor([170.0, 100.0, -170.0], dtype=F64)
    back = misset_after_rotation(far, torch.zeros(3, dtype=F64))
    assert torch.allclose(back, far, atol=1e-9)
    v = canonical_values(state(orient_x=0.3, orient_y=-0.2, orient_z=0.1))
    assert [v["misset_x"], v["misset_y"], v["misset_z"]] == pytest.approx(out.tolist(), abs=1e-12)
    assert set(PARAMETER_NAMES) <= set(v) and "orient_x" not in v and v["scale"] == 1.0


def test_anisotropic_mosaic_names_and_groups():
    """``mosaic_aniso`` (and ``mosaic`` on an anisotropic model) refine the three spreads; the isotropic model
    refuses them (it does not use them); the spreads are positive (>= 0 at the start, > 0 to be refined)."""
    from refine.inputs.start_model import with_anisotropic_mosaic
    from nbtorch import config_from_args
    axes = ("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c")
    aniso = ParameterSpace(anisotropic_mosaic=True)
    assert aniso.expand(["mosaic_aniso"]) == axes + ("N",)
    assert aniso.expand(["mosaic"]) == axes + ("N",)
    assert aniso.expand(["mosaic_spread"]) == axes
    assert ParameterSpace(anisotropic_mosaic=True, anisotropic_N=True).expand(["mosaic_aniso"]) == axes + (
        "N_a", "N_b", "N_c")
    iso = ParameterSpace()
    assert iso.expand(["mosaic"]) == ("mosaic_spread", "N")
    for item in ("mosaic_aniso", "mosaic_spread_b"):
        with pytest.raises(InputError, match="mosaic_spread_a: the model's mosaic is isotropic|mosaic_spread_b: the "):
            iso.expand([item])
    assert isinstance(aniso.transform("mosaic_spread_c", 0.3), Multiplicative)
    with pytest.raises(InputError, match="mosaic_spread_a must be > 0 to be refined"):
        aniso.transform("mosaic_spread_a", 0.0)
    cfg = with_anisotropic_mosaic(config_from_args("-cell 50 50 50 90 90 90 -mosaic 0.4".split()), {})
    assert cfg.mosaic_spread_abc_deg == (0.4, 0.4, 0.4)
    cfg = with_anisotropic_mosaic(config_from_args("-cell 50 50 50 90 90 90 -mosaic 0.4".split()),
                                  {"mosaic_spread": 0.25})
    assert cfg.mosaic_spread_abc_deg == (0.25, 0.25, 0.25)
