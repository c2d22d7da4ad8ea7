"""How a refinement runs, as typed values: :class:`Settings`, one frozen group per concern.

A Python caller builds them (``Settings(fit=FitSettings(refine=("cell", "orientation")))``); the command line
``nbtorch-refine`` turns its options into the very same values at the door (:mod:`refine.cli.options`).  Each field
keeps its option's name (``--spot-window`` is ``pixels.spot_window``), so the command's ``--help`` and
docs/cli-reference.md describe each field.  What is measured (the images, the starting model, the DIALS files) is a
:class:`refine.inputs.measurement.Measurement`.

=================  =============================================================================
group              fields
=================  =============================================================================
``many``           many images: ``out_dir redo skip_missing joint shared per_image rotation_series ...``
``fit``            what to refine: ``refine stages fix start symmetry background bounds prior``
``amplitudes``     structure factors: ``structure_factors space_group f_start ...``
``optimiser``      the step rule and its schedule: ``optimizer lr loss max_steps ...``
``pixels``         which pixels are fitted and the spot list: ``roi dmin spots spot_window ...``
``output``         files, logs, checkpoints, esds: ``out json report logdir resume quiet ...``
``compute``        device, dtypes and compiling: ``device dtype kernel_dtype compile``
=================  =============================================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from refine.fitting.structure_factors import DEFAULT_MIN_PHOTONS

__all__ = ["Settings", "ManySettings", "FitSettings", "AmplitudeSettings", "OptimiserSettings", "PixelSettings",
           "OutputSettings", "ComputeSettings", "SETTINGS_GROUPS"]


@dataclass(frozen=True)
class ManySettings:
    """Many images: each on its own (``out_dir``, ``redo``, ``skip_missing``) or jointly (``joint``,
    ``rotation_series``: ``shared`` and ``per_image`` names, ``screen`` and ``add_to`` for a serial set)."""

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
class FitSettings:
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
class AmplitudeSettings:
    """Structure factors: one refined amplitude per unique reflection (``structure_factors``; None: the run's
    default, on for a rotation series from DIALS files) in ``space_group``."""

    structure_factors: bool | None = None
    space_group: str | None = None
    f_start: str = "auto"
    f_min_photons: float = DEFAULT_MIN_PHOTONS
    f_restraint: float | None = None
    anomalous: bool = False
    anomalous_restraint: float | None = None


@dataclass(frozen=True)
class OptimiserSettings:
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
class PixelSettings:
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
class OutputSettings:
    """Result files, report, TensorBoard logs, checkpoints, esds and printing (``quiet``: nothing printed)."""

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
class ComputeSettings:
    """Where and how the model is computed."""

    device: str = "cpu"
    dtype: str = "float64"
    kernel_dtype: str | None = None
    compile: bool | None = None


#: the groups of :class:`Settings` by name
SETTINGS_GROUPS = {"many": ManySettings, "fit": FitSettings, "amplitudes": AmplitudeSettings,
                   "optimiser": OptimiserSettings, "pixels": PixelSettings, "output": OutputSettings,
                   "compute": ComputeSettings}


@dataclass(frozen=True)
class Settings:
    """Every setting of a refinement, by group (module docstring); the defaults are ``nbtorch-refine``'s."""

    many: ManySettings = field(default_factory=ManySettings)
    fit: FitSettings = field(default_factory=FitSettings)
    amplitudes: AmplitudeSettings = field(default_factory=AmplitudeSettings)
    optimiser: OptimiserSettings = field(default_factory=OptimiserSettings)
    pixels: PixelSettings = field(default_factory=PixelSettings)
    output: OutputSettings = field(default_factory=OutputSettings)
    compute: ComputeSettings = field(default_factory=ComputeSettings)

    @classmethod
    def of(cls, **values: Any) -> "Settings":
        """Settings with the named fields set, whichever group holds each: ``Settings.of(max_steps=50,
        refine=("cell",), out="out/result.h5")``."""
        return cls().with_fields(**values)

    def with_fields(self, **values: Any) -> "Settings":
        """A copy with the named fields replaced (field names, whichever group holds each)."""
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            if name not in _GROUP_OF:
                raise TypeError(f"Settings has no field {name!r}")
            by_group.setdefault(_GROUP_OF[name], {})[name] = value
        return dataclasses.replace(self, **{g: dataclasses.replace(getattr(self, g), **v)
                                            for g, v in by_group.items()})


_GROUP_OF = {f.name: group for group, cls in SETTINGS_GROUPS.items() for f in dataclasses.fields(cls)}
