"""One refinement asked for: a :class:`~refine.inputs.measurement.Measurement` and its
:class:`~refine.settings.Settings` together (:class:`Job`), what the runs of :mod:`refine.modes` take.

The groups keep their names (``job.image``, ``job.dials``, ``job.fit``, ...), and each field its option's name, so
that :meth:`Job.get` and :meth:`Job.with_fields` reach a field by that name alone: independent mode's per-image
values (:func:`refine.modes.independent.per_image_args`), a still's defaults, a joint run's images.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from refine.inputs.measurement import MEASUREMENT_GROUPS, DialsFiles, Measurement
from refine.settings import SETTINGS_GROUPS, Settings

__all__ = ["Job", "GROUPS", "PROG"]

#: the command's name, in the runs' messages (which name its options: ``--expt``, ``--refl``, ...)
PROG = "nbtorch-refine"

#: every group of a job by name, in the order of ``nbtorch-refine --help``
GROUPS = {"image": MEASUREMENT_GROUPS["image"], "model": MEASUREMENT_GROUPS["model"],
          "dials": MEASUREMENT_GROUPS["dials"], **SETTINGS_GROUPS}
_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
#: the measurement's fields outside its groups
_TOP = ("images", "more_pairs")


@dataclass(frozen=True)
class Job:
    """A measurement and its settings; ``argv``: the command line as typed, when a command line asked (written in the
    result file)."""

    measurement: Measurement = field(default_factory=Measurement)
    settings: Settings = field(default_factory=Settings)
    argv: tuple[str, ...] = ()

    # the measurement's groups
    @property
    def image(self):
        return self.measurement.image

    @property
    def model(self):
        return self.measurement.model

    @property
    def dials(self):
        return self.measurement.dials

    @property
    def images(self) -> tuple[str, ...] | None:
        return self.measurement.images

    @property
    def dials_pairs(self) -> tuple[tuple[str, str], ...]:
        """Every ``.expt``/``.refl`` pair of the stills (:attr:`Measurement.dials_pairs`)."""
        return self.measurement.dials_pairs

    # the settings' groups
    @property
    def many(self):
        return self.settings.many

    @property
    def fit(self):
        return self.settings.fit

    @property
    def amplitudes(self):
        return self.settings.amplitudes

    @property
    def optimiser(self):
        return self.settings.optimiser

    @property
    def pixels(self):
        return self.settings.pixels

    @property
    def output(self):
        return self.settings.output

    @property
    def compute(self):
        return self.settings.compute

    @property
    def dials_files(self) -> DialsFiles:
        """The DIALS files of the job's image, typed (:class:`~refine.inputs.measurement.DialsFiles`)."""
        return self.measurement.dials_files

    def get(self, name: str) -> Any:
        """The field ``name`` (e.g. ``"spot_window"``), whichever group holds it."""
        if name in _TOP:
            return getattr(self.measurement, name)
        return getattr(getattr(self, _GROUP_OF[name]), name)

    def with_fields(self, **values: Any) -> "Job":
        """A copy with the named fields replaced (field names, whichever group holds each; ``images`` and
        ``more_pairs`` the measurement's)."""
        by_group: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for name, value in values.items():
            if name in _TOP:
                top[name] = value
            else:
                by_group.setdefault(_GROUP_OF[name], {})[name] = value
        parts = {g: dataclasses.replace(getattr(self, g), **v) for g, v in by_group.items()}
        measurement = dataclasses.replace(self.measurement, **{g: v for g, v in parts.items() if g in MEASUREMENT_GROUPS},
                                          **top)
        settings = dataclasses.replace(self.settings, **{g: v for g, v in parts.items() if g in SETTINGS_GROUPS})
        return dataclasses.replace(self, measurement=measurement, settings=settings)
