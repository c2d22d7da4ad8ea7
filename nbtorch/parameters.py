"""The canonical parameters: one table of names, units, groups and typical steps.

Every place that names a simulator parameter reads this table: the
:class:`~nbtorch.simulator.Simulator` (the overrides it accepts), the set-up
(:func:`nbtorch.rules.resolve.resolve` fills ``Setup.params`` in this order), and, in
``refine``, the units of result files (:data:`refine.fitting.parameters.UNITS`), the
refinement steps (:data:`refine.fitting.parameters.STEPS`), the ``detector`` group and
the TensorBoard tags (:mod:`refine.output.callbacks`).  ``nbtorch`` never imports
``refine``: ``refine`` adds its own rows (``N``, ``scale``, ``background`` ...)
with the same :class:`Parameter` record.

Columns:

* ``name``: the shared vocabulary (flags, result files, TensorBoard ``params/<name>``);
* ``unit``: the unit of the value (the simulator's, the refiner's, the result files');
* ``group``: ``cell``, ``orientation``, ``crystal``, ``detector``, ``beam`` or ``structure_factors``
  (``nuisance`` for refine's image-model rows);
* ``step_kind``, ``step``: a typical refinement step, ``relative`` (value x exp(step))
  or ``absolute`` (value + step, in ``unit``); ``None`` for ``beam_x``/``beam_y``, whose
  step is one pixel (known only with the detector);
* ``description``: one line.

``dispersion``, ``divergence_h``, ``divergence_v`` are the beam's widths as nanoBragg's rules resolved
``-dispersion/-dispsteps`` and ``-hdivrange/-vdivrange/-divsteps ...`` (:mod:`nbtorch.sampling.beam_sources`): the
number of sources and their places in units of the width stay as resolved, and each source's wavelength
factor ``1 + offset`` and angles scale with the width (0 where the sources have no spread along that axis;
such a width cannot change).

``beam_x, beam_y`` are the ``-Xbeam/-Ybeam`` values for MOSFLM, DENZO, ADXV and
CUSTOM and ``ORGX*pixel, ORGY*pixel`` for XDS and DIALS (:mod:`nbtorch.geometry.beam_centre`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Parameter", "TABLE", "EXTRA_TABLE", "PARAMETER_NAMES", "ORIENTATION_DELTAS", "SIMULATOR_NAMES",
           "MISSET_NAMES", "MOSAIC_AXIS_NAMES", "CELL_NAMES", "SIZE_DIAGONAL", "SIZE_OFF_DIAGONAL", "UNITS",
           "PARAMETER_GROUPS", "names_in_group", "parameter"]

PARAMETER_GROUPS = ("cell", "orientation", "crystal", "detector", "beam", "structure_factors")
STEP_KINDS = ("relative", "absolute")


@dataclass(frozen=True)
class Parameter:
    """One row of the parameter table (columns in the module docstring)."""

    name: str
    unit: str
    group: str
    step_kind: str
    step: float | None
    description: str

    def __post_init__(self) -> None:
        if self.group not in PARAMETER_GROUPS + ("nuisance",):
            raise ValueError(f"parameter {self.name}: unknown group {self.group!r}")
        if self.step_kind not in STEP_KINDS:
            raise ValueError(f"parameter {self.name}: unknown step kind {self.step_kind!r}")


_P = Parameter
#: the canonical simulator parameters, in ``Setup.params`` order
TABLE: tuple[Parameter, ...] = (
    _P("cell_a", "A", "cell", "relative", 0.01, "unit-cell length a"),
    _P("cell_b", "A", "cell", "relative", 0.01, "unit-cell length b"),
    _P("cell_c", "A", "cell", "relative", 0.01, "unit-cell length c"),
    _P("cell_alpha", "deg", "cell", "absolute", 0.2, "unit-cell angle alpha"),
    _P("cell_beta", "deg", "cell", "absolute", 0.2, "unit-cell angle beta"),
    _P("cell_gamma", "deg", "cell", "absolute", 0.2, "unit-cell angle gamma"),
    _P("misset_x", "deg", "orientation", "absolute", 0.1, "misset rotation about lab x (first)"),
    _P("misset_y", "deg", "orientation", "absolute", 0.1, "misset rotation about lab y (second)"),
    _P("misset_z", "deg", "orientation", "absolute", 0.1, "misset rotation about lab z (third)"),
    _P("phi0", "deg", "orientation", "absolute", 0.1, "spindle angle of the first phi step"),
    _P("mosaic_spread", "deg", "crystal", "relative", 0.1, "mosaic spread (domain angles scale with it)"),
    _P("mosaic_spread_a", "deg", "crystal", "relative", 0.1, "anisotropic mosaic: spread about the crystal's x (a)"),
    _P("mosaic_spread_b", "deg", "crystal", "relative", 0.1, "anisotropic mosaic: spread about the crystal's y"),
    _P("mosaic_spread_c", "deg", "crystal", "relative", 0.1, "anisotropic mosaic: spread about the crystal's z (c*)"),
    _P("N_a", "unit cells", "crystal", "relative", 0.05, "crystal size along a"),
    _P("N_b", "unit cells", "crystal", "relative", 0.05, "crystal size along b"),
    _P("N_c", "unit cells", "crystal", "relative", 0.05, "crystal size along c"),
    _P("N_d", "unit cells", "crystal", "absolute", 0.5, "size matrix a-b term (-gauss_aniso_xtal only)"),
    _P("N_e", "unit cells", "crystal", "absolute", 0.5, "size matrix b-c term (-gauss_aniso_xtal only)"),
    _P("N_f", "unit cells", "crystal", "absolute", 0.5, "size matrix a-c term (-gauss_aniso_xtal only)"),
    _P("distance", "mm", "detector", "relative", 0.01, "sample to detector plane along the beam"),
    _P("beam_x", "mm", "detector", "absolute", None, "beam centre x in the detector convention"),
    _P("beam_y", "mm", "detector", "absolute", None, "beam centre y in the detector convention"),
    _P("detector_rotx", "deg", "detector", "absolute", 0.1, "detector rotation about lab x"),
    _P("detector_roty", "deg", "detector", "absolute", 0.1, "detector rotation about lab y"),
    _P("detector_rotz", "deg", "detector", "absolute", 0.1, "detector rotation about lab z"),
    _P("twotheta", "deg", "detector", "absolute", 0.1, "detector rotation about the two-theta axis"),
    _P("wavelength", "A", "beam", "relative", 0.001, "central wavelength"),
    _P("fluence", "photons/m^2", "beam", "relative", 0.5, "incident photons per area"),
    _P("polarization", "Kahn factor", "beam", "absolute", None, "Kahn polarization factor (-1..1, bounded)"),
    _P("dispersion", "%", "beam", "relative", 0.1, "spectral width, full (-dispersion: lambda x (1 +- dispersion/200))"),
    _P("divergence_h", "mrad", "beam", "relative", 0.1, "full range of the source angles about beam x polarization"),
    _P("divergence_v", "mrad", "beam", "relative", 0.1, "full range of the source angles about the polarization"),
    _P("default_F", "electrons", "structure_factors", "relative", 0.1, "structure factor of unlisted reflections"),
)
#: refinement helpers the simulator also accepts: a small crystal rotation about lab x, y, z
#: applied on top of the misset orientation (0 by default)
EXTRA_TABLE: tuple[Parameter, ...] = (
    _P("orient_x", "deg", "orientation", "absolute", 0.1, "extra crystal rotation about lab x"),
    _P("orient_y", "deg", "orientation", "absolute", 0.1, "extra crystal rotation about lab y"),
    _P("orient_z", "deg", "orientation", "absolute", 0.1, "extra crystal rotation about lab z"),
)
del _P

PARAMETER_NAMES: tuple[str, ...] = tuple(p.name for p in TABLE)
ORIENTATION_DELTAS: tuple[str, ...] = tuple(p.name for p in EXTRA_TABLE)
#: every name ``Simulator(...)(**overrides)`` takes besides ``F_grid``
SIMULATOR_NAMES: tuple[str, ...] = PARAMETER_NAMES + ORIENTATION_DELTAS
MISSET_NAMES: tuple[str, ...] = ("misset_x", "misset_y", "misset_z")
#: the anisotropic mosaic's spreads (``-mosaic_abc``; :mod:`nbtorch.physics.mosaic`), used only by that model
MOSAIC_AXIS_NAMES: tuple[str, ...] = ("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c")
CELL_NAMES: tuple[str, ...] = tuple(p.name for p in TABLE if p.group == "cell")
#: the diagonal (``N_a N_b N_c``) and the off-diagonal terms (``N_d`` a-b, ``N_e`` b-c, ``N_f`` a-c) of the
#: crystal's symmetric size matrix N (unit cells); the off-diagonal ones act only with ``-gauss_aniso_xtal``
SIZE_DIAGONAL: tuple[str, ...] = ("N_a", "N_b", "N_c")
SIZE_OFF_DIAGONAL: tuple[str, ...] = ("N_d", "N_e", "N_f")
#: name -> unit of every simulator name
UNITS: dict[str, str] = {p.name: p.unit for p in TABLE + EXTRA_TABLE}

_BY_NAME = {p.name: p for p in TABLE + EXTRA_TABLE}


def parameter(name: str) -> Parameter:
    """The table row of simulator name ``name`` (KeyError naming the valid names if unknown)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown parameter {name!r}; expected one of {', '.join(SIMULATOR_NAMES)}") from None


def names_in_group(group: str) -> tuple[str, ...]:
    """Canonical names of ``group`` (a :data:`PARAMETER_GROUPS` entry), in table order."""
    if group not in PARAMETER_GROUPS:
        raise KeyError(f"unknown parameter group {group!r}; expected one of {', '.join(PARAMETER_GROUPS)}")
    return tuple(p.name for p in TABLE if p.group == group)
