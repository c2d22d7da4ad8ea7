"""What a refinement measures, as typed values built at the door: a :class:`Measurement`.

A measurement is the measured images (one, many, or the experiments' own; how to read them: frame, dataset, mask,
gain and ADC offset), the starting model (nanoBragg flags, or a synthetic problem of the bank) and the DIALS files
(experiments' geometry, beam, crystal and scan; the spots of each image).  Its constructors are the ways in:

* :meth:`Measurement.from_dials`: a ``.expt`` and ``.refl`` (one or many experiments; the images those name, or
  given), or several pairs of stills as one set (:mod:`refine.inputs.dials_pairs`);
* :meth:`Measurement.from_images`: images with header geometry and a model's flags;
* :meth:`Measurement.from_problem`: a synthetic problem of the bank (its image simulated, its truth known).

The command line (``nbtorch-refine --image IMAGE --expt FILE --refl FILE ...``) builds the same object from its
options (:mod:`refine.cli.options`).  :class:`DialsFiles` is one image's DIALS files, what every function of
:mod:`refine.inputs.dials`, :mod:`refine.inputs.panels` and :mod:`refine.inputs.still_defaults` takes.  Each file is
parsed once per process for as long as it is unchanged (:func:`nbtorch.io.dials.parsed`), however many steps ask
for its experiment or reflections.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from nbtorch.errors import InputError

__all__ = ["DialsFiles", "ImageSource", "ModelSource", "DialsSource", "Measurement", "DEFAULT_DATASET"]

#: the HDF5 dataset read when none is named
DEFAULT_DATASET = "/entry/data/data"


@dataclass(frozen=True)
class DialsFiles:
    """The DIALS files of one image's refinement.

    Attributes:
        expt: the ``.expt`` file (None: no DIALS experiment; the model comes from nanoBragg flags alone).
        index: which experiment of it (and the ``id`` of its reflections in ``refl``).
        refl: the ``.refl`` file whose observed centroids are the spots (None: no DIALS spots).
        scan_image: a rotation scan's image that ``image`` is, 0 = the scan's first (None: from ``image``'s file
            name and the experiment's template, else 0).
        image: the measured image file (its scan image from its name; a still's new experiment names it).
    """

    expt: str | None = None
    index: int = 0
    refl: str | None = None
    scan_image: int | None = None
    image: str | None = None

    def experiment(self):
        """Experiment :attr:`index` of :attr:`expt` (:func:`nbtorch.io.dials.read_expt`, multi-panel detectors
        read too; errors name ``--expt``)."""
        from nbtorch.io.dials import read_expt

        try:
            return read_expt(self.expt, self.index, multi_panel=True)
        except InputError as exc:
            raise InputError(f"--expt {exc}") from None

    def replace(self, **fields) -> "DialsFiles":
        """A copy with ``fields`` replaced (e.g. another image of the same scan)."""
        return dataclasses.replace(self, **fields)


@dataclass(frozen=True)
class ImageSource:
    """The measured image and how it is read: ``image`` the file (one image's refinement), ``frame`` of a
    multi-frame file, ``dataset`` of an HDF5 file, ``shape`` and ``raw_dtype`` of a headerless file, ``mask`` a
    file of bad pixels, ``saturation`` and ``mask_nan`` more pixels masked, ``parallax`` the sensor's, ``gain`` and
    ``adc_offset`` the detector's counts per photon and offset (None: from the header, else 1 and 0)."""

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
class ModelSource:
    """The starting model: nanoBragg flags (``model``; with DIALS files, applied after the experiment's) or a
    synthetic ``problem`` of the bank at ``size`` pixels a side; ``f_column`` the amplitude column of an MTZ or
    mmCIF ``-hkl`` file; ``config`` the TOML file the options came from (its ``{stem}`` per image)."""

    model: str | None = None
    f_column: str | None = None
    problem: str | None = None
    size: int = 64
    config: str | None = None


@dataclass(frozen=True)
class DialsSource:
    """DIALS files: experiment ``expt_index`` of ``expt`` (a rotation scan's image ``expt_image``, None: from the image's
    file name) as the starting model, ``refl``'s observed centroids as the spots, the refined experiment written to
    ``expt_out``; ``panel_groups`` the level of a multi-panel detector's hierarchy that moves as rigid bodies."""

    expt: str | None = None
    expt_index: int = 0
    expt_image: int | None = None
    refl: str | None = None
    expt_out: str | None = None
    panel_groups: int | None = None


#: the groups of :class:`Measurement` by name
MEASUREMENT_GROUPS = {"image": ImageSource, "model": ModelSource, "dials": DialsSource}


@dataclass(frozen=True)
class Measurement:
    """What is measured (module docstring): one ``image`` and how images are read, the starting ``model``, the
    ``dials`` files, ``images`` when there are many (each refined as ``image`` would be), and ``more_pairs``: the
    ``.expt``/``.refl`` pairs of stills after ``dials.expt``/``dials.refl`` when several make one set."""

    image: ImageSource = field(default_factory=ImageSource)
    model: ModelSource = field(default_factory=ModelSource)
    dials: DialsSource = field(default_factory=DialsSource)
    images: tuple[str, ...] | None = None
    more_pairs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_dials(cls, expt: str | Sequence[str], refl: str | Sequence[str], image: str | None = None,
                   images: Sequence[str] | None = None,
                   index: int = 0, scan_image: int | None = None, model: str | None = None,
                   expt_out: str | None = None, **reading: Any) -> "Measurement":
        """DIALS files: ``expt`` and ``refl``.  One still or one image of a scan: ``image`` (experiment ``index``,
        a scan's image ``scan_image``, default from the file name); many stills of one file: no ``image`` (the images
        its experiments name) or ``images`` (one per experiment, in order); a rotation series: ``images`` of the
        scan; several pairs of stills as one set: ``expt`` and ``refl`` lists or glob patterns, paired in order
        (:func:`refine.inputs.dials_pairs.dials_pairs`).  ``model``: nanoBragg flags after the experiment's (e.g.
        ``"-default_F 100"``); ``reading``: fields of :class:`ImageSource` (``gain``, ``adc_offset``, ``mask``,
        ``frame``, ...)."""
        from refine.inputs.dials_pairs import dials_pairs

        first, first_refl, more = dials_pairs(expt, refl)
        return cls(image=ImageSource(image=None if image is None else str(image), **reading),
                   model=ModelSource(model=model),
                   dials=DialsSource(expt=first, expt_index=index, expt_image=scan_image, refl=first_refl,
                                     expt_out=expt_out),
                   images=None if images is None else tuple(str(i) for i in images), more_pairs=more)

    @classmethod
    def from_images(cls, images: str | Sequence[str], model: str, **reading: Any) -> "Measurement":
        """Images with their headers' geometry: one file (``images`` a path) or many, and the starting model's
        nanoBragg flags (``model``, e.g. ``"-cell 58 58 150 90 90 90 -misset 10 20 30 -N 20 -default_F 100"``);
        ``reading``: fields of :class:`ImageSource`."""
        one = isinstance(images, (str, bytes)) or not isinstance(images, Sequence)
        return cls(image=ImageSource(image=str(images) if one else None, **reading), model=ModelSource(model=model),
                   images=None if one else tuple(str(i) for i in images))

    @classmethod
    def from_problem(cls, name: str, size: int = 64, **reading: Any) -> "Measurement":
        """A synthetic problem of the bank (:data:`refine.PROBLEMS`): its image simulated at ``size`` pixels a side,
        its truth known."""
        return cls(image=ImageSource(**reading), model=ModelSource(problem=name, size=size))

    @property
    def dials_pairs(self) -> tuple[tuple[str, str], ...]:
        """Every ``.expt``/``.refl`` pair of the stills: ``dials``'s, then :attr:`more_pairs`."""
        return ((str(self.dials.expt), str(self.dials.refl)),) + tuple(self.more_pairs)

    @property
    def dials_files(self) -> DialsFiles:
        """The DIALS files of the measured image (:class:`DialsFiles`)."""
        return DialsFiles(expt=self.dials.expt, index=self.dials.expt_index, refl=self.dials.refl,
                          scan_image=self.dials.expt_image, image=self.image.image)
