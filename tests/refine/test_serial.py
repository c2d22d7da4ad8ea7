"""Serial joint refinement on tiny sets (refine.many.serial, screening, serial_file; experiments.serial_data).

Eight 32 x 32 stills, three of them bad: the rounds drop exactly the bad ones with their reasons, the result file
has one row per image, and three more stills added to the finished run continue from its result file.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from experiments.serial_data import BAD_KINDS, load_serial, make_serial
from nbtorch.errors import InputError
from refine.many.screening import ScreeningRule, screen
from refine.many.serial import refine_serial
from refine.many.serial_file import load_serial_h5, save_serial_h5

SIZE = 32


def test_the_generator_is_seeded_by_the_generator_passed_in(tmp_path):
    a = make_serial(6, np.random.default_rng(5), size=SIZE, bad_fraction=0.5)
    b = make_serial(6, np.random.default_rng(5), size=SIZE, bad_fraction=0.5)
    c = make_serial(6, np.random.default_rng(6), size=SIZE, bad_fraction=0.5)
    assert all(np.array_equal(x.observed, y.observed) for x, y in zip(a.images, b.images))
    assert not np.array_equal(a.images[0].observed, c.images[0].observed)
    assert sorted(a.bad().values()) == sorted(BAD_KINDS)  # 3 bad of 6: one of each kind
    scales = [im.truth["scale"] for im in a.images]
    assert len(set(scales)) == 6 and all(im.start["scale"] == 1.0 for im in a.images)
    back = load_serial(a.write(tmp_path / "set"))
    assert back.bad() == a.bad() and back.shared_start == a.shared_start
    assert all(np.array_equal(x.observed, y.observed) for x, y in zip(a.images, back.images))
    with pytest.raises(InputError, match="bad_fraction"):
        make_serial(3, np.random.default_rng(0), bad_fraction=1.0)
    # one process's share (keep): only the kept images drawn, the same bits as in the whole set
    part = make_serial(6, np.random.default_rng(5), size=SIZE, bad_fraction=0.5, keep=range(2, 4))
    assert [im is None for im in part.images] == [True, True, False, False, True, True]
    assert all(np.array_equal(a.images[i].observed, part.images[i].observed) for i in (2, 3))
    assert [part.images[i].truth for i in (2, 3)] == [a.images[i].truth for i in (2, 3)]
    assert [part.images[i].start for i in (2, 3)] == [a.images[i].start for i in (2, 3)] and part.bad() == a.bad()
    assert part.image_starts()[0] is None and part.observed()[5] is None
    assert [s is not None for s in part.simulators()] == [False, False, True, True, False, False]
    with pytest.raises(InputError, match="write: image 0 was not drawn"):
        part.write(tmp_path / "part")
    with pytest.raises(InputError, match="keep: image 6 is not among the 6 images"):
        make_serial(6, np.random.default_rng(5), size=SIZE, keep=[6])


def test_the_screening_rule():
    rng = np.random.default_rng(0)
    excess = list(0.5 + 0.02 * rng.standard_normal(50))
    scale = list(np.exp(0.3 * rng.standard_normal(50)))
    excess[3], excess[7], scale[11], excess[20] = 9.0, math.nan, 1e-4, 0.7  # 0.7: > 6 MAD above, < 1.5 x
    out = screen(excess, scale)
    assert set(out) == {3, 7, 11}
    assert out[3].startswith("fit far worse") and out[7] == "evaluation failed" and out[11].startswith("no diffr")
    assert set(screen(excess, scale, ScreeningRule(ratio=1.1))) == {3, 7, 11, 20}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    ds = make_serial(11, np.random.default_rng(3), size=SIZE, bad_fraction=0.25)
    first = ds.subset(range(8))
    result = refine_serial(first.simulators(), first.observed(), image_starts=first.image_starts(),
                           start=first.shared_start, symmetry=first.symmetry)
    path = save_serial_h5(result, tmp_path_factory.mktemp("serial") / "serial.h5")
    return ds, first, result, path


def test_bad_images_are_dropped_and_listed(run):
    ds, first, result, _ = run
    bad = first.bad()
    assert set(result.dropped) == set(bad) and len(bad) >= 2
    assert result.used == tuple(i for i in range(8) if i not in bad)
    assert result.joint.n_images == 8 - len(bad) and len(result.rounds) >= 2
    assert all(d["reason"] for d in result.dropped.values())
    assert f"8 images: {8 - len(bad)} used, {len(bad)} dropped" in result.summary()
    truth = first.shared_truth["cell_a"]
    assert abs(result.shared["cell_a"] - truth) < 3 * result.shared_esds["cell_a"]


def test_the_result_file_has_one_row_per_image(run):
    _, first, result, path = run
    doc = load_serial_h5(path)
    rows = doc["rows"]
    assert len(rows["index"]) == 8 and list(rows["used"]) == [int(i not in first.bad()) for i in range(8)]
    for i in first.bad():
        assert rows["reason"][i] == result.dropped[i]["reason"] and math.isnan(rows["esds/scale"][i])
    i = result.used[1]
    assert rows["values/scale"][i] == result.joint.images[1]["scale"]
    assert rows["esds/scale"][i] == result.joint.image_esds[1]["scale"]
    assert doc["summary"] == result.summary() and doc["shared"] == pytest.approx(result.shared)


def test_more_images_continue_from_the_finished_run(run):
    ds, first, result, path = run
    more = refine_serial(ds.simulators(), ds.observed(), image_starts=ds.image_starts(), start=ds.shared_start,
                         symmetry=ds.symmetry, previous=path)
    assert more.n_images == 11 and more.previous == {"n_images": 8}
    for i in first.bad():  # dropped before: still dropped, not refined again
        assert more.dropped[i]["reason"].startswith("dropped before: ")
    assert set(more.dropped) == set(ds.bad())
    # the first round starts from the finished run's values: the old images barely move
    truth = ds.shared_truth["cell_a"]
    assert abs(more.shared["cell_a"] - truth) < 3 * more.shared_esds["cell_a"]
    assert more.shared_esds["cell_a"] < result.shared_esds["cell_a"]
    with pytest.raises(InputError, match="more than the 3 given"):
        refine_serial(ds.simulators()[:3], ds.observed()[:3], image_starts=ds.image_starts()[:3], previous=path,
                      symmetry=ds.symmetry)


def test_bad_arguments_are_refused_in_one_line(run):
    ds = run[0]
    args = (ds.simulators()[:2], ds.observed()[:2])
    with pytest.raises(InputError, match="max_rounds: expected an integer >= 2"):
        refine_serial(*args, max_rounds=1)
    with pytest.raises(InputError, match="screen_steps: expected an integer >= 1"):
        refine_serial(*args, screen_steps=0)
    with pytest.raises(InputError, match="observed_images: expected one image per simulator"):
        refine_serial(ds.simulators()[:2], ds.observed()[:3])
    with pytest.raises(InputError, match="is not a serial result|not a readable HDF5"):
        refine_serial(*args, previous=__file__)
    # the images this process holds: each image in exactly one process (here the only one)
    with pytest.raises(InputError, match="^local_images: image 1 is held by 0 processes"):
        refine_serial(*args, local_images=[0])
    with pytest.raises(InputError, match="^local_images: image 0 is named twice$"):
        refine_serial(*args, local_images=[0, 0, 1])
    with pytest.raises(InputError, match="^local_images: image 2 is not among the 2 images$"):
        refine_serial(*args, local_images=[0, 1, 2])
