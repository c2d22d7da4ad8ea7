"""The options of ``nbtorch-refine`` as typed values: argv becomes a measurement and its settings at the door.

:func:`refine.cli.parser.parse_args` parses the command line (and ``--config``) with argparse and hands the
result to :func:`options_from_namespace`, which returns a :class:`refine.modes.job.Job`: the
:class:`~refine.inputs.measurement.Measurement` (``image``, ``model``, ``dials`` and ``--images``) and the
:class:`~refine.settings.Settings` (the other groups), the very values a Python caller builds; nothing after it
sees an ``argparse.Namespace``.  The groups are the groups of ``--help``, so a reader of either sees which options
go together:

=================  =============================================================================
group              options
=================  =============================================================================
``image``          the measured image, its mask and counts: ``--image --frame --shape --gain ...``
``model``          the starting model: ``--model --f-column --problem --size --config``
``dials``          DIALS files: ``--expt --expt-index --expt-image --refl --panel-groups --expt-out``
``many``           many images: ``--images --out-dir --redo --joint --shared --per-image --screen ...``
``fit``            what to refine: ``--refine --stages --fix --start --symmetry --background ...``
``amplitudes``     structure factors: ``--structure-factors --space-group --f-start ...``
``optimiser``      the step rule and its schedule: ``--optimizer --lr --loss --max-steps ...``
``pixels``         which pixels are fitted and the spot list: ``--roi --dmin --spots --spot-window ...``
``output``         files, logs, checkpoints, esds: ``--out --json --report --logdir --resume ...``
``compute``        device, dtypes and compiling: ``--device --dtype --kernel-dtype --compile``
=================  =============================================================================

Every field keeps its option's name (``--spot-window`` is ``pixels.spot_window``; ``--images`` is the measurement's
``images``); :meth:`~refine.modes.job.Job.get` and :meth:`~refine.modes.job.Job.with_fields` reach a field by that name
alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refine.inputs.dials_pairs import dials_pairs, refuse_with_pairs
from refine.inputs.measurement import DEFAULT_DATASET, Measurement
from refine.modes.dials_sweep import GEOMETRY_PRIORS
from refine.modes.job import GROUPS, PROG, Job
from refine.settings import Settings

__all__ = ["Options", "options_from_namespace", "DEFAULT_DATASET", "PROG", "GROUP_TITLES", "GEOMETRY_PRIORS"]

#: the command's values: a measurement and its settings (:class:`refine.modes.job.Job`)
Options = Job

#: the ``--help`` heading of each group
GROUP_TITLES = {
    "image": "measured image",
    "model": "starting model",
    "dials": "DIALS files (instead of or with --model and --spots)",
    "many": "many images (--images: each on its own, or together with --joint / --rotation-series)",
    "fit": "what to refine",
    "amplitudes": "structure factors (--structure-factors)",
    "optimiser": "optimiser",
    "pixels": "fitted pixels and observed spots",
    "output": "output",
    "compute": "compute",
}

_FIELDS = {f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)} | {"images", "more_pairs"}


def _typed(value: Any) -> Any:
    """Lists from argparse (nargs, comma-separated names) as tuples: the values are frozen."""
    if isinstance(value, list):
        return tuple(_typed(v) for v in value)
    return value


def _dials_values(values: dict) -> dict:
    """``--expt``/``--refl`` as the first pair's paths and ``more_pairs`` (globs expanded:
    :func:`refine.inputs.dials_pairs.dials_pairs`; several pairs refuse the options of one experiment),
    ``--expt-index`` 0 when not given."""
    values = dict(values)
    if "expt" in values or "refl" in values:
        values["expt"], values["refl"], values["more_pairs"] = dials_pairs(values.get("expt"), values.get("refl"))
    if values.get("more_pairs"):
        refuse_with_pairs(values)
    if "expt_index" in values and values["expt_index"] is None:
        values["expt_index"] = 0
    return values


def options_from_namespace(ns: Any, argv: tuple[str, ...] = ()) -> Job:
    """The door: argparse's result as a measurement and its settings (every parser destination has exactly one
    field)."""
    values = _dials_values(vars(ns))
    unknown = sorted(set(values) - _FIELDS)
    if unknown:  # a parser option without a field: a programming error, caught by the tests
        raise TypeError(f"options without a field in refine.cli.options: {', '.join(unknown)}")
    groups = {group: cls(**{f.name: _typed(values[f.name]) for f in dataclasses.fields(cls) if f.name in values})
              for group, cls in GROUPS.items()}
    measurement = Measurement(image=groups.pop("image"), model=groups.pop("model"), dials=groups.pop("dials"),
                              images=_typed(values.get("images")), more_pairs=_typed(values.get("more_pairs") or ()))
    return Job(measurement=measurement, settings=Settings(**groups), argv=tuple(argv))
