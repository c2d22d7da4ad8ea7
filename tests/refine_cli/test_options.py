"""argv becomes typed values at the door (:class:`refine.cli.options.Options`: a measurement and its settings,
:class:`refine.modes.job.Job`): every option has one field, the ``--help`` groups are the groups, and nothing after
the parser sees an argparse Namespace."""

from __future__ import annotations

import dataclasses

import pytest

from nbtorch.errors import InputError
from refine.cli.options import GROUP_TITLES, Options, options_from_namespace
from refine.cli.parser import build_parser, parse_args


def _group_of_each_option() -> dict[str, str]:
    """dest -> the title of the ``--help`` group that shows it."""
    out = {}
    for group in build_parser()._action_groups:
        for action in group._group_actions:
            if action.dest != "help":
                out[action.dest] = group.title
    return out


def test_every_option_has_one_field_in_the_group_its_help_shows():
    titles = _group_of_each_option()
    fields = {f.name: group for group in GROUP_TITLES
              for f in dataclasses.fields(getattr(Options(), group))}
    fields.pop("stage_tables")  # from --config's [[stages]] tables, not an option of its own
    fields["images"] = "many"  # the measurement's images, shown with the options of many images
    assert set(titles) == set(fields)
    wrong = {dest: (titles[dest], GROUP_TITLES[group]) for dest, group in fields.items()
             if titles[dest] != GROUP_TITLES[group]}
    assert not wrong


def test_parse_args_returns_frozen_typed_options():
    o = parse_args(["--problem", "cubic_mosflm", "--refine", "cell,scale", "--roi", "0", "9", "0", "9",
                    "--fix", "distance"])
    assert isinstance(o, Options)
    assert o.fit.refine == ("cell", "scale") and o.fit.fix == ("distance",) and o.pixels.roi == (0, 9, 0, 9)
    assert o.argv[:2] == ("--problem", "cubic_mosflm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.fit.refine = ("cell",)


def test_get_and_with_fields_reach_an_option_by_name():
    o = parse_args(["--problem", "cubic_mosflm", "--spot-window", "4"])
    assert o.get("spot_window") == 4
    p = o.with_fields(spot_window=6, out="x.h5", quiet=True)
    assert (p.pixels.spot_window, p.output.out, p.output.quiet) == (6, "x.h5", True)
    assert o.pixels.spot_window == 4  # the original is unchanged
    with pytest.raises(KeyError):
        o.get("no_such_option")


def test_a_parser_option_without_a_field_is_a_programming_error():
    ns = build_parser().parse_args(["--problem", "cubic_mosflm"])
    ns.stage_tables = None
    ns.new_option = 1
    with pytest.raises(TypeError, match="new_option"):
        options_from_namespace(ns)


def test_mode_options_without_their_mode_are_refused_at_the_door():
    with pytest.raises(InputError, match="--shared: only with --images and --joint"):
        parse_args(["--problem", "cubic_mosflm", "--shared", "cell"])
    assert parse_args(["--images", "a.cbf", "--rotation-series", "--model=-mosflm"]).many.joint is True


def test_a_model_of_one_flag_is_the_models_value():
    """``--model -gauss_aniso_xtal`` (one nanoBragg flag, no space) is --model's value, not an unknown option;
    a ``--option`` after --model stays an option, so a missing value is still reported."""
    o = parse_args(["--problem", "cubic_mosflm", "--model", "-gauss_aniso_xtal"])
    assert o.model.model == "-gauss_aniso_xtal"
    assert parse_args(["--problem", "cubic_mosflm", "--model", "-N 60"]).model.model == "-N 60"
    with pytest.raises(InputError, match="--model: expected one argument"):
        parse_args(["--problem", "cubic_mosflm", "--model", "--quiet"])


def test_the_door_splits_the_options_into_a_measurement_and_its_settings():
    from refine import Measurement, Settings

    o = parse_args(["--images", "a.cbf", "b.cbf", "--expt", "x.expt", "--refl", "x.refl", "--joint", "--gain", "2",
                    "--max-steps", "7", "--out-dir", "out"])
    assert o.measurement == Measurement(image=o.image, dials=o.dials, images=("a.cbf", "b.cbf"))
    assert o.measurement.image.gain == 2 and o.measurement.dials.refl == "x.refl"
    assert o.settings == Settings.of(joint=True, max_steps=7, out_dir="out")
    assert o.with_fields(images=None).images is None and o.images == ("a.cbf", "b.cbf")
    m = Measurement.from_dials("x.expt", "x.refl", images=["a.cbf", "b.cbf"], gain=2)
    assert (m.images, m.image.gain, m.dials.expt, m.dials_files.refl) == (("a.cbf", "b.cbf"), 2, "x.expt", "x.refl")
