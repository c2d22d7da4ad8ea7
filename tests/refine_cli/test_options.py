"""argv becomes typed :class:`refine.cli.options.Options` at the door: every option has one field, the
``--help`` groups are the Options groups, and nothing after the parser sees an argparse Namespace."""

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
