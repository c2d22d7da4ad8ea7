"""The options of ``nbtorch-refine`` as typed values: argv becomes an :class:`Options` at the door.

:func:`refine.cli.parser.parse_args` parses the command line (and ``--config``) with argparse and hands the
result to :func:`options_from_namespace`; nothing after it sees an ``argparse.Namespace``.  The groups are
the groups of ``--help``, so a reader of either sees which options go together:

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

Every field keeps its option's name (``--spot-window`` is ``pixels.spot_window``); :meth:`Options.get` and
:meth:`Options.with_fields` reach a field by that name alone, for the few places (independent mode's
per-image options) that treat options by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from refine.fitting.structure_factors import DEFAULT_MIN_PHOTONS

__all__ = [
    "Options", "ImageOptions", "ModelOptions", "DialsOptions", "ManyOptions", "FitOptions", "AmplitudeFlags",
    "OptimiserOptions", "PixelOptions", "OutputOptions", "ComputeOptions", "options_from_namespace",
    "DEFAULT_DATASET", "PROG", "GROUP_TITLES", "GEOMETRY_PRIORS",
]

#: the ``--help`` heading of each group of :class:`Options`
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
#: the command's name, in its messages
PROG = "nbtorch-refine"
#: ``--geometry-prior``: DIALS's detector geometry as a prior (``dials``, the default of a rotation series from DIALS
#: files) or not (``none``); :mod:`refine.cli.dials_sweep`
GEOMETRY_PRIORS = ("dials", "none")
#: the HDF5 dataset read when ``--dataset`` is not given
DEFAULT_DATASET = "/entry/data/data"


@dataclass(frozen=True)
class ImageOptions:
    """The measured image: which file, which frame or dataset, how to read a raw file, the mask."""

    image: str | None = None
    frame: int | None = None
    dataset: str = DEFAULT_DATASET
    shape: tuple[int, int] | None = None
    raw_dtype: str = "<f4"
    mask: str | None = None
    saturation: float | None = None
    mask_nan: bool = False
    parallax: bool = True
    gain: float | None = None
    adc_offset: float | None = None


@dataclass(frozen=True)
class ModelOptions:
    """The starting model: nanoBragg flags (``--model``) or a synthetic problem of the bank; the config file."""

    model: str | None = None
    f_column: str | None = None
    problem: str | None = None
    size: int = 64
    config: str | None = None


@dataclass(frozen=True)
class DialsOptions:
    """DIALS files: the experiment as the starting model, its reflections as spots, the refined experiment."""

    expt: str | None = None
    expt_index: int = 0
    expt_image: int = 0
    refl: str | None = None
    expt_out: str | None = None
    panel_groups: int | None = None


@dataclass(frozen=True)
class ManyOptions:
    """Many images: independent mode (``--images``) and joint mode (``--joint``, ``--rotation-series``)."""

    images: tuple[str, ...] | None = None
    out_dir: str | None = None
    redo: bool = False
    skip_missing: bool = False
    joint: bool = False
    shared: str | None = None
    per_image: str | None = None
    rotation_series: bool = False
    pixel_memory: float | None = None
    screen: bool = False
    add_to: str | None = None
    geometry_prior: str | None = None


@dataclass(frozen=True)
class FitOptions:
    """What is refined: names and schedule, what is held, starting values, symmetry, bounds and priors."""

    refine: tuple[str, ...] | None = None
    stages: str | None = None
    stage_tables: tuple[dict, ...] | None = None
    fix: tuple[str, ...] | None = None
    start: tuple[str, ...] | None = None
    symmetry: str | None = None
    background: str = "auto"
    bounds: tuple[str, ...] | None = None
    prior: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AmplitudeFlags:
    """``--structure-factors`` and its options, as given (:func:`refine.cli.single.amplitude_options` checks
    them into a :class:`refine.fitting.structure_factors.AmplitudeOptions`)."""

    structure_factors: bool | None = None  # None: the mode's default (on for a rotation series from DIALS files)
    space_group: str | None = None
    f_start: str = "auto"
    f_min_photons: float = DEFAULT_MIN_PHOTONS
    f_restraint: float | None = None
    anomalous: bool = False
    anomalous_restraint: float | None = None


@dataclass(frozen=True)
class OptimiserOptions:
    """The step rule, the loss and the schedule's limits."""

    optimizer: str = "lbfgs"
    lr: float | None = None
    history_size: int | None = None
    precondition: str | None = None
    loss: str = "poisson"
    max_steps: int | None = None
    bin: int = 1
    coarse: bool = False
    time_budget: float | None = None


@dataclass(frozen=True)
class PixelOptions:
    """Which pixels are fitted (rectangle, resolution, spot windows, subsample) and the observed spots."""

    roi: tuple[int, int, int, int] | None = None
    dmin: float | None = None
    dmax: float | None = None
    subsample: float | None = None
    spots: str | None = None
    too_few_spots: str = "fix"
    spot_columns: str | None = None
    spot_window: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class OutputOptions:
    """Result files, report, TensorBoard logs, checkpoints, esds and printing."""

    out: str = "result.h5"
    json: str | None = None
    hkl_out: str | None = None
    mtz_out: str | None = None
    report: str | None = None
    logdir: str | None = None
    tb_every: int = 10
    checkpoint: str | None = None
    checkpoint_every: int = 10
    resume: bool = False
    no_esds: bool = False
    esd_extra: tuple[str, ...] | None = None
    quiet: bool = False


@dataclass(frozen=True)
class ComputeOptions:
    """Where and how the model is computed."""

    device: str = "cpu"
    dtype: str = "float64"
    kernel_dtype: str | None = None
    compile: bool | None = None


@dataclass(frozen=True)
class Options:
    """Every option of ``nbtorch-refine``, by group; ``argv``: the command line as typed (for the result file)."""

    image: ImageOptions = field(default_factory=ImageOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    dials: DialsOptions = field(default_factory=DialsOptions)
    many: ManyOptions = field(default_factory=ManyOptions)
    fit: FitOptions = field(default_factory=FitOptions)
    amplitudes: AmplitudeFlags = field(default_factory=AmplitudeFlags)
    optimiser: OptimiserOptions = field(default_factory=OptimiserOptions)
    pixels: PixelOptions = field(default_factory=PixelOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    compute: ComputeOptions = field(default_factory=ComputeOptions)
    argv: tuple[str, ...] = ()

    def get(self, name: str) -> Any:
        """The option ``name`` (its field name, e.g. ``"spot_window"``), whichever group holds it."""
        return getattr(getattr(self, _GROUP_OF[name]), name)

    def with_fields(self, **values: Any) -> "Options":
        """A copy with the named options replaced (field names, whichever group holds each)."""
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            by_group.setdefault(_GROUP_OF[name], {})[name] = value
        return dataclasses.replace(self, **{g: dataclasses.replace(getattr(self, g), **v)
                                            for g, v in by_group.items()})


_GROUP_CLASSES = {"image": ImageOptions, "model": ModelOptions, "dials": DialsOptions, "many": ManyOptions,
                  "fit": FitOptions, "amplitudes": AmplitudeFlags, "optimiser": OptimiserOptions,
                  "pixels": PixelOptions, "output": OutputOptions, "compute": ComputeOptions}
_GROUP_OF = {f.name: group for group, cls in _GROUP_CLASSES.items() for f in dataclasses.fields(cls)}


def _typed(value: Any) -> Any:
    """Lists from argparse (nargs, comma-separated names) as tuples: the options are frozen values."""
    if isinstance(value, list):
        return tuple(_typed(v) for v in value)
    return value


def options_from_namespace(ns: Any, argv: tuple[str, ...] = ()) -> Options:
    """The door: argparse's result as :class:`Options` (every parser destination has exactly one field)."""
    values = vars(ns)
    unknown = sorted(set(values) - set(_GROUP_OF))
    if unknown:  # a parser option without a field: a programming error, caught by the tests
        raise TypeError(f"options without a field in refine.cli.options: {', '.join(unknown)}")
    groups = {group: cls(**{f.name: _typed(values[f.name]) for f in dataclasses.fields(cls) if f.name in values})
              for group, cls in _GROUP_CLASSES.items()}
    return Options(**groups, argv=tuple(argv))
